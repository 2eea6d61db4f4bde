"""Sampling defaults from the model's generation config (vLLM's `--generation-config`).

A request leaves `temperature`, `top_p`, `top_k` or `min_p` unset (None in
`SamplingParams`) when its client did not choose one; the engine fills each unset
value here, once, at admission (`SamplingDefaults.apply`, called by
`Engine.add_request`). Where the defaults come from (`ModelConfig.generation_config`):

    auto   the model's `generation_config.json` (the keys its authors set, as vLLM's
           `get_diff_sampling_param` reads them); a model without one, like the GGUF
           file of the embedded SmolLM2-135M-Instruct, gets its model card's
           recommendation from `MODEL_CARD_DEFAULTS` (SmolLM2 Instruct: temperature 0.2,
           top_p 0.9); otherwise the neutral values
    vllm   the neutral values: temperature 1.0, top_p 1.0, top_k 0 (off), min_p 0.0 (off)
    PATH   a folder holding `generation_config.json`, or that file itself

An unset `max_tokens` is the room the context leaves, vLLM's rule: room = max_model_len
(or a smaller whole KV cache) minus the prompt; the generation config's `max_new_tokens`,
where it sets one, caps it. A request's explicit `max_tokens` always wins, above or below
`max_new_tokens` (it is never a cap), and is refused with `context_length_exceeded` when it
does not fit. `repetition_penalty` from the generation config is the default of an unset
`repetition_penalty` (the sampler applies it: `service.worker.logits_processors`).

`top_k: 1` in a generation config makes every request that leaves top_k unset greedy,
whatever its temperature: `SamplingDefaults.warnings` says so, and the engine logs it at
start-up.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

import msgspec
import structlog

from protocol import SamplingParams

__all__ = ["MODEL_CARD_DEFAULTS", "SamplingDefaults", "load_sampling_defaults",
           "log_sampling_defaults"]

log = structlog.get_logger(__name__)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")
"""The defaults `hello.sampling_defaults` reports (PROTOCOL.md)."""
PENALTY_KEYS = ("repetition_penalty",)
"""Further generation-config defaults an unset value takes (not in `hello`)."""
LIMIT_KEY = "max_new_tokens"

MODEL_CARD_DEFAULTS: tuple[tuple[re.Pattern[str], dict[str, float], str], ...] = (
    # huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct: its usage example generates with
    # temperature=0.2, top_p=0.9 (the same for the 360M and 1.7B Instruct models)
    (re.compile(r"^SmolLM2-[0-9.]+[MB]-Instruct$", re.IGNORECASE),
     {"temperature": 0.2, "top_p": 0.9}, "the SmolLM2 Instruct model card"),
)
"""Recommendations from model cards, for models that ship no generation config:
(pattern on the model's display name, values, where they come from)."""


@dataclass(frozen=True)
class SamplingDefaults:
    """The values unset sampling parameters take, and where they came from.

    temperature in [0, 100], top_p in (0, 1], top_k >= 0 (0 = off), min_p in [0, 1]
    (0 = off), repetition_penalty in (0, 2] (1 = off); max_new_tokens in [1, 2**31 - 1] or None (tokens: the default
    `max_tokens`, see the module docstring); `source` says where they were read, e.g.
    "vllm (neutral)" or a path. Raises ValueError naming the field for a value out of range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "vllm (neutral)"
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        try:  # the wire's own ranges (protocol.messages.SamplingParams)
            msgspec.convert({**self.as_dict(), "max_tokens": self.max_new_tokens,
                             "repetition_penalty": self.repetition_penalty},
                            SamplingParams)
        except msgspec.ValidationError as e:
            raise ValueError(f"sampling defaults from {self.source}: "
                             f"{str(e).replace('max_tokens', LIMIT_KEY)}") from None

    def output_limit(self, prompt_tokens: int, room: int, route_cap: int | None = None) -> int:
        """The max_tokens of a request that sets none: what `room` (tokens: the context,
        or the KV cache if smaller) leaves after `prompt_tokens` (at least 1; vLLM's
        rule), capped by max_new_tokens where the generation config sets one, else by the
        route's own default (`route_cap`: PROTOCOL.md's 256 on /v1/stream) where given."""
        left = max(1, room - prompt_tokens)
        cap = self.max_new_tokens if self.max_new_tokens is not None else route_cap
        return left if cap is None else min(cap, left)

    def warnings(self) -> list[str]:
        """What a start-up log should warn of in these defaults (e.g. top_k 1: greedy)."""
        if self.top_k == 1:
            return [f"the generation config ({self.source}) sets top_k 1: every request "
                    "that leaves top_k unset is sampled greedily, whatever its temperature"]
        return []

    def as_dict(self) -> dict[str, float]:
        """{"temperature": ..., "top_p": ..., "top_k": ..., "min_p": ...} (sent in `hello`)."""
        return {k: getattr(self, k) for k in SAMPLING_KEYS}

    def apply(self, params: SamplingParams, prompt_tokens: int = 0,
              room: int = 2**31 - 1) -> SamplingParams:
        """`params` with every unset (None) sampling field replaced by its default, and an
        unset max_tokens by ``output_limit(prompt_tokens, room)``."""
        unset: dict[str, float] = {k: getattr(self, k) for k in SAMPLING_KEYS + PENALTY_KEYS
                                   if getattr(params, k) is None}
        if params.max_tokens is None:
            unset["max_tokens"] = self.output_limit(prompt_tokens, room)
        return msgspec.structs.replace(params, **unset) if unset else params


def _read_json(path: Path) -> dict[str, float]:
    """The sampling keys and max_new_tokens a generation_config.json sets (null values
    count as unset)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable generation config: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a generation config is a JSON object")
    return {k: raw[k] for k in (*SAMPLING_KEYS, *PENALTY_KEYS, LIMIT_KEY)
            if raw.get(k) is not None}


def _from_values(values: dict[str, float], source: str) -> SamplingDefaults:
    known = {f.name for f in fields(SamplingDefaults)}
    return SamplingDefaults(**{k: v for k, v in values.items() if k in known}, source=source)


def load_sampling_defaults(mode: str, model_path: str | None, model_name: str) -> SamplingDefaults:
    """The defaults for `ModelConfig.generation_config` = `mode` ("auto", "vllm" or a PATH).

    model_path: the model's folder or `.gguf` file (None: no file to look in);
    model_name: its display name, matched against `MODEL_CARD_DEFAULTS`.
    Raises FileNotFoundError when PATH has no generation_config.json, ValueError for an
    unreadable file or a value out of range.
    """
    if mode == "vllm":
        return SamplingDefaults()
    if mode != "auto":
        path = Path(mode)
        file = path / "generation_config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"--generation-config {mode}: no generation_config.json there")
        return _from_values(_read_json(file), str(file))
    if model_path is not None and Path(model_path).is_dir():
        file = Path(model_path) / "generation_config.json"
        if file.is_file():
            values = _read_json(file)
            if values:
                return _from_values(values, str(file))
    for pattern, values, source in MODEL_CARD_DEFAULTS:
        if pattern.match(model_name):
            return _from_values(values, source)
    return SamplingDefaults(source="vllm (neutral; the model has no generation config)")


def log_sampling_defaults(defaults: SamplingDefaults) -> None:
    """The start-up log lines of the defaults: the values (the output limit included:
    max_new_tokens, or the room the context leaves when the model sets none) and any
    warning."""
    log.info("sampling_defaults", source=defaults.source, **defaults.as_dict(),
             repetition_penalty=defaults.repetition_penalty,
             default_max_tokens=defaults.max_new_tokens or "the room the context leaves",
             default_max_tokens_from=LIMIT_KEY if defaults.max_new_tokens is not None
             else "vLLM's rule")
    for warning in defaults.warnings():
        log.warning("sampling_defaults_greedy", message=warning)
