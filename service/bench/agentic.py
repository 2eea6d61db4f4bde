"""Multi-turn agentic workload for the disk KV tier (issue 25, item 8), in process.

    python -m service.bench.agentic                          # 4 sessions x 4 turns, 96 KV blocks
    python -m service.bench.agentic --sessions 8 --turns 6 --json docs/perf/agentic.json
    # issue 25's figure: 6k-token contexts, a pool of 512 blocks (one session's worth)
    python -m service.bench.agentic --context 6144 --append 192 --num-kv-blocks 512

N sessions of T turns. A session starts from a context of `--context` tokens (real
prose, each session its own); each turn appends `--append` tokens (the "tool output")
and the model's previous answer, and asks for `--max-tokens` greedy tokens. Turns go
round robin (every session's turn t, then turn t+1), one request at a time, so a
returning turn finds its session's blocks evicted from a pool (`--num-kv-blocks`)
smaller than the working set, unless the disk tier kept them.

Two engines on one loaded checkpoint, served the same requests alternately (so they
see the same machine load):
- off:     no disk tier;
- on:      a disk tier on a fresh directory;
then, for the first turns after a restart, one more turn of every session on a new
engine over the same directory ("restart"), alternating with a new engine without
the tier ("restart_off").
Reported per run: prefix-cache hit rate (cached prompt tokens / prompt tokens), over all
turns and over returning turns only (`hit_rate_returning`: a session's first turn has
nothing to hit), prompt tokens from disk (usage.disk_cached_tokens), prompt tokens
computed, TTFT p50 / p99 of first and returning turns, disk hits; and whether every
greedy answer of "on" equals that of "off".
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

from protocol import Delta
from service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from service.engine import Engine
from service.worker.loader import LoadedModel, load_model


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), nearest rank; None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def session_contexts(loaded: LoadedModel, n: int, context: int, append: int,
                     turns: int) -> list[tuple[list[int], list[list[int]]]]:
    """(initial context, [tool output of each turn]) token ids per session, cut from the
    bench's prose at session-specific offsets (so no two sessions share a first block)."""
    from service.bench.engine_runs import text_tokens

    per = context + append * (turns + 1)
    ids = text_tokens(loaded, per * n + 7 * n)
    out = []
    for s in range(n):
        start = s * (per + 7)
        tools = [ids[start + context + t * append:start + context + (t + 1) * append]
                 for t in range(turns + 1)]
        out.append((ids[start:start + context], tools))
    return out


async def ask(engine: Engine, prompt: list[int], max_tokens: int) -> dict:
    answer: list[int] = []
    done = None
    t0 = time.perf_counter()
    async for event in engine.generate(prompt_token_ids=prompt, params={
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}):
        if isinstance(event, Delta):
            answer += event.token_ids
        else:
            done = event
    disk = done.usage.disk_cached_tokens
    return {"prompt_tokens": done.usage.prompt_tokens, "cached_tokens": done.usage.cached_tokens,
            "disk_cached_tokens": disk if isinstance(disk, int) else 0,
            "ttft_ms": done.timings.ttft_ms, "answer": answer,
            "wall_s": time.perf_counter() - t0}


def engine_extra(engine: Engine) -> dict:
    stats = engine.stats()
    extra = {"prefix_hits": stats.prefix_hits, "prefix_disk_hits": stats.prefix_disk_hits}
    tier = engine.disk_tier
    if tier is not None:
        st = tier.stats
        extra.update(blocks_written=st.blocks_written, blocks_read=st.blocks_read,
                     writes_dropped=st.writes_dropped, writes_skipped=st.writes_skipped,
                     eviction_saves=st.eviction_saves,
                     read_failures=dict(st.read_failures),
                     disk_bytes=tier.index.total_bytes)
    return extra


async def run(engines: dict[str, Engine], sessions, turns: range,
              histories: dict[str, list[list[int]]], max_tokens: int) -> dict[str, list[dict]]:
    """Run `turns` of every session, round robin, on every engine in turn (the same
    request on each before the next one, so they share the machine's load); each
    engine's histories are extended in place with its own answers."""
    records: dict[str, list[dict]] = {name: [] for name in engines}
    for t in turns:
        for s, (_, tools) in enumerate(sessions):
            for name, engine in engines.items():
                hist = histories[name][s]
                hist += tools[t]
                r = await ask(engine, list(hist), max_tokens)
                hist += r["answer"]
                records[name].append({"session": s, "turn": t, **r})
    return records


def summarize(records: list[dict], extra: dict, first_turn: int) -> dict:
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    first = [r["ttft_ms"] for r in records if r["turn"] == first_turn]
    back = [r["ttft_ms"] for r in records if r["turn"] > first_turn]
    back_prompt = sum(r["prompt_tokens"] for r in records if r["turn"] > first_turn)
    back_cached = sum(r["cached_tokens"] for r in records if r["turn"] > first_turn)
    return {"requests": len(records), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": round(cached / prompt, 4) if prompt else None,
            "hit_rate_returning": round(back_cached / back_prompt, 4) if back_prompt else None,
            "disk_cached_tokens": sum(r["disk_cached_tokens"] for r in records),
            "prompt_tokens_computed": prompt - cached,
            "ttft_ms_first_turns_p50": percentile(first, 50),
            "ttft_ms_returning_p50": percentile(back, 50),
            "ttft_ms_returning_p99": percentile(back, 99), **extra}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context", type=int, default=768, help="tokens of a session's start")
    ap.add_argument("--append", type=int, default=128, help="tokens each turn appends")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--kv-disk-path", default=None,
                    help="default: a fresh temporary folder, deleted at the end")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    loaded = load_model(None, torch.float32)
    sessions = session_contexts(loaded, args.sessions, args.context, args.append, args.turns)
    base = EngineConfig(
        model=ModelConfig(quantization=None if args.quantization == "none" else args.quantization),
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=4))
    path = args.kv_disk_path or tempfile.mkdtemp(prefix="conveyor-kv-disk-")
    shutil.rmtree(path, ignore_errors=True)
    tiered = dataclasses.replace(base, cache=dataclasses.replace(base.cache, kv_disk_path=path))

    async def go() -> dict:
        report: dict = {"args": vars(args), "kv_disk_path": path}
        histories = {name: [list(ctx) for ctx, _ in sessions] for name in ("off", "on")}
        async with Engine(base, loaded=loaded) as off, Engine(tiered, loaded=loaded) as on:
            engines = {"off": off, "on": on}
            records = await run(engines, sessions, range(args.turns), histories,
                                args.max_tokens)
            for name, engine in engines.items():
                report[name] = summarize(records[name], engine_extra(engine), 0)
                print(name, json.dumps(report[name]), file=sys.stderr)
        report["greedy_identical"] = all(
            a["answer"] == b["answer"] for a, b in zip(records["off"], records["on"]))
        # the first turns after a restart: a new engine on the tier's directory, paired
        # with the (still cold for these contexts) engine without the tier
        hist = {"off": histories["off"], "restart": histories["on"]}
        async with Engine(base, loaded=loaded) as off, Engine(tiered, loaded=loaded) as again:
            engines = {"off": off, "restart": again}
            records = await run(engines, sessions, range(args.turns, args.turns + 1), hist,
                                args.max_tokens)
            report["restart"] = summarize(records["restart"], engine_extra(again), args.turns)
            report["restart_off"] = summarize(records["off"], engine_extra(off), args.turns)
        off, on = report["off"], report["on"]
        if on["ttft_ms_returning_p50"]:
            report["returning_ttft_p50_off_over_on"] = round(
                off["ttft_ms_returning_p50"] / on["ttft_ms_returning_p50"], 2)
        if report["restart"]["ttft_ms_first_turns_p50"]:
            report["restart_ttft_p50_off_over_on"] = round(
                report["restart_off"]["ttft_ms_first_turns_p50"]
                / report["restart"]["ttft_ms_first_turns_p50"], 2)
        return report

    try:
        report = asyncio.run(go())
    finally:
        if args.kv_disk_path is None:  # our temporary folder: hundreds of MB of blocks
            shutil.rmtree(path, ignore_errors=True)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
