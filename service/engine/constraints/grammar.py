"""A request's output constraint -> the grammar text llguidance compiles (pure, cheap).

Sources, at most one per request (Admission refuses two):
    response_format {"type": "json_object"}     any JSON object
    response_format {"type": "json_schema"}     JSON valid against `json_schema.schema`
    structured {"regex": ...}                   the regex, matched whole
    structured {"choice": [...]}                exactly one of the strings
    structured {"grammar": ...}                 Lark (llguidance's dialect) or GBNF
    a tool plan (`tools.ToolPlan.lark`)         a call, or a call or a plain answer

The result is llguidance's grammar JSON (`LLMatcher.grammar_from_*`), which also serves as
the compile cache's key: the same schema always gives the same text.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any, NamedTuple

from protocol import InvalidRequest, SamplingParams

__all__ = ["FRACTION_DIGITS", "GrammarSource", "INTEGER_BOUND", "MAX_GRAMMAR_CHARS",
           "close_objects", "grammar_of_params", "lark_string"]

MAX_GRAMMAR_CHARS = 512 * 1024
"""Longest grammar text (a schema, regex, grammar or a tool list's, once serialized) a
request may bring: compiling is linear in it and cached, but the cache holds its copies.
Open WebUI's 36 tools make about 26 KB."""


class GrammarSource(NamedTuple):
    """grammar: llguidance's grammar JSON text; param: the JSON path of the field it came
    from (blamed when it does not compile)."""

    grammar: str
    param: str


INTEGER_BOUND = 10 ** 15 - 1
"""An integer or number schema without bounds gets [-INTEGER_BOUND, INTEGER_BOUND]: at most 15
digits (llama.cpp's JSON-schema grammars allow 16 for the same reason). Without it a small
model may write digits until max_tokens (SmolLM2-135M at temperature 0.7 answered a
`"limit": {"type": "integer"}` with a 1 and 90 zeros)."""

FRACTION_DIGITS = 10
"""A number schema without `multipleOf` gets `multipleOf` 10**-FRACTION_DIGITS: at most 10
digits after the point (and, without bounds, the integers' 15 before it). Without it
SmolLM2-135M at temperature 0.2 answered a `"rating": {"type": "number", "minimum": 0,
"maximum": 10}` with 7.111... until max_tokens (CI, commit c6b48aa). llama.cpp's JSON-schema
grammars allow 16 digits after the point; llguidance reads `multipleOf` as an f64 and
refuses 1e-11 and finer, hence 10."""


def close_objects(schema: Any, depth: int = 0) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that lists
    `properties` and says nothing of others (OpenAI's strict mode asks clients to write
    it; a small model otherwise invents properties, e.g. copies the schema's own keys),
    and `minimum` / `maximum` of +-INTEGER_BOUND on integer and number schemas that leave
    them out, and `multipleOf` 10**-FRACTION_DIGITS on number schemas without one (unless a
    bound of theirs has more digits after the point).
    Every output valid under the result is valid under `schema`: only what the schema left
    open is closed. A copy; `schema` is not changed."""
    if depth > 64:
        return schema
    if isinstance(schema, list):
        return [close_objects(x, depth + 1) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: close_objects(v, depth + 1) if k not in ("const", "enum", "default", "examples")
           else v for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema:
        out["additionalProperties"] = False
    kind = schema.get("type")
    if kind in ("integer", "number") and "enum" not in schema and "const" not in schema:
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = -INTEGER_BOUND
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = INTEGER_BOUND
        if kind == "number" and "multipleOf" not in schema and all(
                _fraction_digits(schema.get(k)) <= FRACTION_DIGITS
                for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            out["multipleOf"] = 10.0 ** -FRACTION_DIGITS
    return out


def _fraction_digits(bound: Any) -> int:
    """Digits after the point of a schema's numeric bound as JSON writes it (0 for absent
    or not a number)."""
    if isinstance(bound, bool) or not isinstance(bound, (int, float)):
        return 0
    exponent = Decimal(repr(bound)).as_tuple().exponent
    return -exponent if isinstance(exponent, int) and exponent < 0 else 0


def lark_string(text: str) -> str:
    """A Lark string literal matching `text` exactly (JSON's escapes, which Lark reads)."""
    return json.dumps(text)


def grammar_of_params(params: SamplingParams, request_id: str | None = None,
                      prefix: str = "$.params") -> GrammarSource | None:
    """The grammar of `params.response_format` / `params.structured`, or None (no
    constraint: absent, or response_format text).

    Raises InvalidRequest (param e.g. "$.params.response_format.json_schema.schema") for a
    schema llguidance cannot read or a grammar text longer than MAX_GRAMMAR_CHARS.
    """
    import llguidance

    fmt, st = params.response_format, params.structured
    if fmt is not None and fmt.type != "text":
        param = f"{prefix}.response_format"
        schema: object = {"type": "object"}
        if fmt.type == "json_schema":
            assert fmt.json_schema is not None
            param += ".json_schema.schema"
            if fmt.json_schema.schema is not None:
                schema = fmt.json_schema.schema
                if fmt.json_schema.strict is not False:
                    schema = close_objects(schema)
        _check_size(json.dumps(schema), param, request_id)
        try:
            # one way to write it: no free whitespace (a small model given room for blanks
            # may spend max_tokens on them, and the output then never closes)
            return GrammarSource(llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides={"whitespace_flexible": False}), param)
        except Exception as e:  # llguidance raises ValueError / RuntimeError for bad schemas
            raise InvalidRequest(f"{param}: the schema cannot be served: {e}", param=param,
                                 request_id=request_id) from None
    if st is None:
        return None
    if st.regex is not None:
        param = f"{prefix}.structured.regex"
        _check_size(st.regex, param, request_id)
        return GrammarSource(llguidance.LLMatcher.grammar_from_regex(st.regex), param)
    if st.choice is not None:
        param = f"{prefix}.structured.choice"
        lark = "start: " + " | ".join(lark_string(c) for c in st.choice)
        _check_size(lark, param, request_id)
        return GrammarSource(llguidance.LLMatcher.grammar_from_lark(lark), param)
    assert st.grammar is not None
    param = f"{prefix}.structured.grammar"
    _check_size(st.grammar, param, request_id)
    return GrammarSource(llguidance.LLMatcher.grammar_from_lark(_as_lark(st.grammar, param,
                                                                         request_id)), param)


def lark_grammar(lark: str, param: str, request_id: str | None = None) -> GrammarSource:
    """A Lark grammar text as a GrammarSource (tool plans). Raises InvalidRequest when too long."""
    import llguidance

    _check_size(lark, param, request_id)
    return GrammarSource(llguidance.LLMatcher.grammar_from_lark(lark), param)


def _as_lark(text: str, param: str, request_id: str | None) -> str:
    """GBNF (llama.cpp's `root ::= ...`) converted to Lark; Lark as it is."""
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except Exception as e:  # the converter raises on syntax it cannot read
        raise InvalidRequest(f"{param}: the GBNF grammar cannot be read: {e}", param=param,
                             request_id=request_id) from None


def _check_size(text: str, param: str, request_id: str | None) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"{param}: {len(text)} characters; at most {MAX_GRAMMAR_CHARS} "
                             "are served", param=param, request_id=request_id)
