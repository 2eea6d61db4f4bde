"""Benchmark workloads: lists of RequestSpec, deterministic under a seed.

Lengths are in model tokens, before `scale` (each length becomes max(1, round(length * scale))):

    uniform        every input 128, every output 128
    medium         inputs uniform in [100, 500], outputs uniform in [50, 200]
    extreme        inputs in [10, 2000], outputs in [10, 1000], both log-uniform (density
                   ~ 1/x: median ~ the geometric mean, 141 and 100; a long tail of big ones)
    shared-prefix  one ~400-token system prompt shared by all, a distinct short question
                   each (chat template applied), outputs 128
    seed-exercise  inputs 128; outputs 100, except every fifth request 1000 (8 + 2 for the
                   default 10 requests), in a seeded random order
    one-user       medium's lengths, 6 requests by default, sent one at a time: the bench
                   runs it at --max-concurrency 1 unless told otherwise
                   (DEFAULT_MAX_CONCURRENCY), the chat front end with a single user
    PATH.jsonl     one request per line: {"messages": [{"role", "content"}, ...] | "prompt":
                   str, "max_tokens": int}; lines in file order (the seed plays no part)

Prompts are real prose (`texts.py`) cut to length in tokens (`prompts.PromptSource`) and
sent as `prompt_token_ids`; JSONL requests are sent as given (messages or prompt) and
tokenized here the way the server tokenizes them, for their input length and for the peers.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path

from service.bench.prompts import PromptSource, chat_token_ids
from service.bench.request_spec import RequestSpec

WORKLOADS = ("uniform", "medium", "extreme", "shared-prefix", "seed-exercise", "one-user")
DEFAULT_NUM_REQUESTS = {"uniform": 32, "medium": 32, "extreme": 32, "shared-prefix": 32,
                        "seed-exercise": 10, "one-user": 6}
# the concurrency a workload is about, when --max-concurrency is not given (None: no limit)
DEFAULT_MAX_CONCURRENCY = {"one-user": 1}
SHARED_PREFIX_TOKENS = 400


def default_max_concurrency(name: str) -> int | None:
    """Requests in flight at once that workload `name` is meant for, e.g. "one-user" -> 1;
    None (no limit) for the others and for JSONL files."""
    return DEFAULT_MAX_CONCURRENCY.get(name)


def scaled(length: int, scale: float) -> int:
    """A length after `--scale`: max(1, round(length * scale))."""
    return max(1, round(length * scale))


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer in [low, high] whose log is uniform: as many in [10, 100] as in [100, 1000]."""
    return min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high))))))


def build_workload(name: str, tokenizer, *, num_requests: int | None = None, seed: int = 0,
                   scale: float = 1.0) -> list[RequestSpec]:
    """The requests of workload `name` (one of WORKLOADS, or a path to a .jsonl file).

    num_requests: how many (default DEFAULT_NUM_REQUESTS[name]; for a file, all its lines;
        fewer takes the first ones). seed: the same seed gives the same requests.
    scale: multiplies every length (> 0), e.g. 0.125 for a quick run.

    Raises ValueError for an unknown workload, num_requests < 1, scale <= 0 or a bad
    JSONL line (its line number named); FileNotFoundError for a missing file.
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if name not in WORKLOADS:
        if name.endswith(".jsonl") or Path(name).is_file():
            return load_jsonl(name, tokenizer, num_requests=num_requests, scale=scale)
        raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)} "
                         "or a path to a .jsonl file")
    n = num_requests or DEFAULT_NUM_REQUESTS[name]
    rng = random.Random(seed)
    source = PromptSource(tokenizer)
    if name == "shared-prefix":
        return _shared_prefix(source, n, scale)
    lengths = _LENGTHS[name](rng, n)
    used: set[int] = set()
    return [RequestSpec(i, tuple(source.take(scaled(lin, scale), rng, used)), scaled(lout, scale))
            for i, (lin, lout) in enumerate(lengths)]


def _uniform(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(128, 128)] * n


def _medium(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(rng.randint(100, 500), rng.randint(50, 200)) for _ in range(n)]


def _extreme(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(log_uniform(rng, 10, 2000), log_uniform(rng, 10, 1000)) for _ in range(n)]


def _seed_exercise(rng: random.Random, n: int) -> list[tuple[int, int]]:
    outputs = [1000 if i % 5 == 4 else 100 for i in range(n)]
    rng.shuffle(outputs)
    return [(128, out) for out in outputs]


_LENGTHS: dict[str, Callable[[random.Random, int], list[tuple[int, int]]]] = {
    "uniform": _uniform, "medium": _medium, "extreme": _extreme, "seed-exercise": _seed_exercise,
    "one-user": _medium,
}


def _shared_prefix(source: PromptSource, n: int, scale: float) -> list[RequestSpec]:
    system = source.system_prompt(scaled(SHARED_PREFIX_TOKENS, scale))
    return [RequestSpec(i, tuple(source.chat_ids(system, source.question(i))), scaled(128, scale))
            for i in range(n)]


def load_jsonl(path: str, tokenizer, *, num_requests: int | None = None,
               scale: float = 1.0) -> list[RequestSpec]:
    """Requests from a JSONL file: {"messages": [...] | "prompt": str, "max_tokens": int >= 1}.

    `scale` multiplies max_tokens. Raises FileNotFoundError, or ValueError naming the line.
    """
    specs: list[RequestSpec] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if num_requests is not None and len(specs) == num_requests:
                break
            specs.append(_jsonl_request(len(specs), line, lineno, path, tokenizer, scale))
    if not specs:
        raise ValueError(f"{path}: no requests")
    return specs


def _jsonl_request(index: int, line: str, lineno: int, path: str, tokenizer,
                   scale: float) -> RequestSpec:
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON: {e}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
    max_tokens = row.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be an int >= 1, got {max_tokens!r}")
    if ("messages" in row) == ("prompt" in row):
        raise ValueError(f"{where}: give exactly one of messages, prompt")
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError(f"{where}: prompt must be a non-empty string")
        ids = tokenizer.encode(row["prompt"], add_special_tokens=False)
        return RequestSpec(index, tuple(ids), scaled(max_tokens, scale), prompt=row["prompt"])
    turns = row["messages"]
    if (not isinstance(turns, list) or not turns or not all(
            isinstance(t, dict) and isinstance(t.get("role"), str)
            and isinstance(t.get("content"), str) for t in turns)):
        raise ValueError(f"{where}: messages must be a non-empty list of "
                         '{"role": str, "content": str}')
    ids = chat_token_ids(tokenizer, [{"role": t["role"], "content": t["content"]} for t in turns])
    return RequestSpec(index, tuple(ids), scaled(max_tokens, scale),
                       messages=tuple((t["role"], t["content"]) for t in turns))
