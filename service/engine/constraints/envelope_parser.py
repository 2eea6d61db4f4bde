"""EnvelopeParser: the generic tool style's completion, as it streams -> answer text or
tool-call pieces.

With a template that ignores tools, the completion of a request with tools is one JSON
object (`tools.ToolPlan.grammar`, llama.cpp's server's generic form):

    {"response":"<the answer, a JSON string>"}
    {"tool_call":{"name":"f","arguments":{...}}}
    {"tool_calls":[{"name":"f","arguments":{...}},...]}      (parallel_tool_calls)

The answer's string may also end unclosed, at EOS (the grammar allows it).
The answer streams as plain text, its JSON escapes decoded as they complete (a `\\u`
escape is held until its four digits, a surrogate pair until both halves, have come);
calls stream as `ToolCallParser` streams them. The grammar writes the envelope without
free whitespace, so its keys decide the kind at once.

Nothing generated is dropped: text that is not an envelope is passed on as it is; a
completion cut before its kind was known, or inside a call before its name, comes back as
its own text; an answer cut inside an escape ends with the escape's raw text.
"""

from __future__ import annotations

from protocol.structured import ToolCall, ToolCallDelta
from service.engine.constraints.tool_parser import ToolCallParser
from service.engine.constraints.tools import ANSWER_OPEN, MANY_OPEN, ONE_OPEN, ToolFormat

__all__ = ["EnvelopeParser", "tool_parser"]

_CALL_OPENS = (MANY_OPEN, ONE_OPEN)
_ENDS = set("]} \t\n")
_HEX = set("0123456789abcdefABCDEF")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}


class EnvelopeParser:
    """Splits one generic-style completion into answer text and tool calls; the same
    interface as `ToolCallParser` (`feed`, `finish`, `calls`, `partial`, `is_calls`).

    Args:
        fmt: the generic style's format (`tools.FORMATS["generic"]`: the arguments' key).
    """

    def __init__(self, fmt: ToolFormat) -> None:
        self._inner = ToolCallParser(ToolFormat("", "", fmt.args_key, True),
                                     between=r"[\s,]*")
        self._mode = "undecided"  # -> "answer" | "calls" | "text" (not an envelope)
        self._buf = ""  # undecided: the text so far; answer: raw text not yet decoded
        self._opened = ""  # the envelope's opening text (calls)
        self._answer_done = False

    @property
    def calls(self) -> list[ToolCall]:
        """The complete calls so far (and, after `finish`, a cut one: see `partial`)."""
        return self._inner.calls

    @property
    def partial(self) -> bool:
        """`finish` reported a call cut inside its arguments."""
        return self._inner.partial

    @property
    def is_calls(self) -> bool:
        """The completion is calls (not an answer)."""
        return self._mode == "calls"

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(answer text to pass on, call pieces) for the next piece of the completion."""
        if self._mode == "undecided":
            self._buf += text
            text = self._decide()
            if self._mode == "undecided":
                return "", []
        if self._mode == "answer":
            return self._decode(text), []
        if self._mode == "calls":
            return self._inner.feed(text)
        return text, []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """(text held back, last pieces) at the end of the completion."""
        if self._mode == "undecided":  # cut before its kind was known: its own text
            out, self._buf, self._mode = self._buf, "", "text"
            return out, []
        if self._mode == "answer":
            out, self._buf = ("" if self._answer_done else self._buf), ""
            return out, []
        if self._mode == "calls":
            rest, pieces = self._inner.finish()
            if not rest or set(rest) <= _ENDS:  # the envelope's closing brackets
                return "", pieces
            return (rest if self._inner.calls else self._opened + rest), pieces
        return "", []

    def _decide(self) -> str:
        """Sets the mode once the buffer shows it; returns the text after the opening."""
        lead = self._buf.lstrip()
        for opening, mode in ((ANSWER_OPEN, "answer"), *((o, "calls") for o in _CALL_OPENS)):
            if lead.startswith(opening):
                self._mode, self._buf = mode, ""
                if mode == "calls":
                    self._opened = opening
                return lead[len(opening):]
        if not any(o.startswith(lead) for o in (ANSWER_OPEN, *_CALL_OPENS)):
            self._mode = "text"  # not an envelope (e.g. blanks, or no constraint)
            out, self._buf = self._buf, ""
            return out
        return ""

    def _decode(self, text: str) -> str:
        """The answer's JSON string text -> its characters, up to the closing quote."""
        if self._answer_done:
            return ""
        raw = self._buf + text
        out: list[str] = []
        i, n = 0, len(raw)
        while i < n:
            c = raw[i]
            if c == '"':
                self._answer_done = True
                self._buf = ""
                return "".join(out)
            if c != "\\":
                out.append(c)
                i += 1
                continue
            if i + 1 >= n:
                break  # the escape's letter is still to come
            letter = raw[i + 1]
            if letter != "u":
                out.append(_ESCAPES.get(letter, letter))
                i += 2
                continue
            if i + 6 > n:
                break
            code = _hex(raw[i + 2:i + 6])
            if code is None:
                out.append(raw[i:i + 6])
                i += 6
                continue
            if 0xD800 <= code < 0xDC00:  # a high surrogate: its low half follows
                after = raw[i + 6:i + 12]
                if len(after) < 6 and "\\u".startswith(after[:2]) \
                        and all(d in _HEX for d in after[2:]):
                    break  # may still be the low half's escape
                low = _hex(raw[i + 8:i + 12]) if raw[i + 6:i + 8] == "\\u" else None
                if low is not None and 0xDC00 <= low < 0xE000:
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    i += 12
                    continue
                out.append("\ufffd")
                i += 6
                continue
            out.append("\ufffd" if 0xDC00 <= code < 0xE000 else chr(code))
            i += 6
        self._buf = raw[i:]
        return "".join(out)


def tool_parser(fmt: ToolFormat) -> ToolCallParser | EnvelopeParser:
    """The parser of a completion written in `fmt`: the generic style's envelope, or calls
    in the style's own form."""
    return EnvelopeParser(fmt) if fmt.envelope else ToolCallParser(fmt)


def _hex(digits: str) -> int | None:
    if len(digits) != 4:
        return None
    try:
        return int(digits, 16)
    except ValueError:
        return None
