"""Does structured output slow the streams beside it? (issue 48's benchmark)

    python -m service.bench.structured_itl [--model M] [--streams 16] [--constrained 8]
        [--max-tokens 96] [--rounds 3] [--json out.json]

One `conveyor serve` (its own process), and per round, taking turns, the same `--streams`
chat requests at once over the WebSocket protocol:

- `mixed`: `--constrained` of them with a JSON-schema `response_format` (a list of short
  records: long enough that the grammar stays open for most of `--max-tokens`), the others
  free (greedy, `ignore_eos`, exactly `--max-tokens` tokens);
- `free`: all of them free, the same prompts and lengths.

The figure is the free streams' ITL p50 (the gaps between a stream's token deltas, over
every free stream of every round of the variant) in `mixed` against `free`: structured output
is applied inside the shared batch (the constrained rows' token masks filled beside the
forward, applied in one batched masked fill), so the free streams should hardly see it
(issue 48: within 10%). Both variants run the same batch size, so the ratio is the
constraints' cost, not a smaller batch's gain. The constrained answers are parsed and
validated where the grammar closed them (finish "stop"; one cut at `--max-tokens` is
counted apart); a failure is reported and the exit status is 1. A benchmark, never a timed test: run it on a quiet
machine; the JSON names the CPU, the commit and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from protocol import Delta, Done, connect
from service.bench.llama_server import ROOT
from service.bench.machine import flags_text, machine_info
from service.bench.real_sizes import read_loadavg
from service.bench.report import write_json
from service.bench.server_process import ServerProcess
from service.bench.stats import percentile

SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array", "minItems": 1, "maxItems": 40,
            "items": {"type": "object",
                      "properties": {"name": {"type": "string", "maxLength": 24},
                                     "country": {"type": "string", "maxLength": 24},
                                     "population": {"type": "integer"}},
                      "required": ["name", "country", "population"],
                      "additionalProperties": False}}},
    "required": ["cities"],
    "additionalProperties": False,
}
"""The constrained streams' schema: an array of records, open for many tokens."""

TOPICS = ("rivers of Europe", "how bread rises", "the history of paper", "tides and the moon",
          "bees and flowers", "why the sky is blue", "how a bicycle stays up", "volcanoes",
          "the first telescopes", "salt in the sea", "clouds and rain", "how maps are drawn",
          "deserts at night", "the printing press", "coral reefs", "glaciers")


def _messages(i: int, constrained: bool) -> list[dict[str, str]]:
    topic = TOPICS[i % len(TOPICS)]
    if constrained:
        return [{"role": "user", "content": f"List as many large cities as you can, near "
                                            f"{topic}, as JSON with name, country, population."}]
    return [{"role": "user", "content": f"Tell me at length about {topic}."}]


async def _stream(client, i: int, constrained: bool, max_tokens: int) -> dict:
    params: dict[str, object] = {"max_tokens": max_tokens, "temperature": 0.0}
    if constrained:
        params["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "cities", "schema": SCHEMA,
                                                     "strict": True}}
    else:
        params["ignore_eos"] = True
    times: list[float] = []
    text: list[str] = []
    finish = None
    stream = client.generate(id=f"s{i}", messages=_messages(i, constrained), **params)
    async for event in stream:
        if isinstance(event, Delta):
            times.append(time.perf_counter())
            text.append(event.text)
        elif isinstance(event, Done):
            finish = event.finish_reason
    gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    out = {"constrained": constrained, "tokens": len(times), "itl_ms": gaps, "finish": finish,
           "error": None if stream.error is None else f"{stream.error.code}: "
                                                        f"{stream.error.message}"}
    # an answer the grammar closed must parse; one cut at max_tokens ("length") cannot
    if constrained and out["error"] is None and finish == "stop":
        try:
            doc = json.loads("".join(text))
            ok = isinstance(doc, dict) and isinstance(doc.get("cities"), list)
            out["valid"] = ok
        except ValueError:
            out["valid"] = False
    return out


async def _round(url: str, streams: int, constrained: int, max_tokens: int) -> list[dict]:
    clients = [await connect(url) for _ in range(streams)]
    try:
        return await asyncio.gather(*(_stream(c, i, i < constrained, max_tokens)
                                      for i, c in enumerate(clients)))
    finally:
        for c in clients:
            await c.close()


def _p50(values: list[float]) -> float | None:
    return percentile(values, 50) if values else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.bench.structured_itl",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model (default: the default model)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--constrained", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-args", default="", help="more `conveyor serve` flags")
    p.add_argument("--json", default=None, metavar="PATH")
    a = p.parse_args(argv)
    if not 0 < a.constrained < a.streams or a.rounds < 1 or a.max_tokens < 2:
        p.error("need 0 < --constrained < --streams, --rounds >= 1, --max-tokens >= 2")
    machine = machine_info(ROOT)
    cpu = machine["cpu"]
    print(f"CPU {cpu['model_name']} ({flags_text(cpu)}; torch {machine['torch_cpu_capability']}),"
          f" commit {machine['commit']}", file=sys.stderr)
    serve = ["--max-num-seqs", str(a.streams), *(["--model", a.model] if a.model else []),
             *a.server_args.split()]
    runs: dict[str, list[list[dict]]] = {"mixed": [], "free": []}
    load = {"start": read_loadavg()}
    with ServerProcess(serve) as server:
        asyncio.run(_round(server.url, 2, 1, 8))  # warm-up: the grammar compiler, the buckets
        for r in range(a.rounds):
            for variant in ("mixed", "free") if r % 2 == 0 else ("free", "mixed"):
                n = a.constrained if variant == "mixed" else 0
                runs[variant].append(asyncio.run(_round(server.url, a.streams, n,
                                                        a.max_tokens)))
    load["end"] = read_loadavg()
    free_gaps = {v: [g for rnd in runs[v] for s in rnd if not s["constrained"]
                     for g in s["itl_ms"]] for v in runs}
    constrained = [s for rnd in runs["mixed"] for s in rnd if s["constrained"]]
    errors = [s["error"] for rnd in runs["mixed"] + runs["free"] for s in rnd if s["error"]]
    result = {
        "free_streams_itl_p50_ms": {v: _p50(g) for v, g in free_gaps.items()},
        "ratio_mixed_over_free": None,
        "constrained_streams": len(constrained),
        "constrained_closed": sum(s["finish"] == "stop" for s in constrained),
        "constrained_valid": sum(bool(s.get("valid")) for s in constrained),
        "constrained_tokens_mean": statistics.fmean(s["tokens"] for s in constrained)
        if constrained else None,
        "constrained_itl_p50_ms": _p50([g for s in constrained for g in s["itl_ms"]]),
        "errors": errors,
    }
    m, f = result["free_streams_itl_p50_ms"]["mixed"], result["free_streams_itl_p50_ms"]["free"]
    if m and f:
        result["ratio_mixed_over_free"] = m / f
    print(json.dumps(result, indent=1))
    if a.json:
        write_json(a.json, {"schema": "conveyor-bench-structured-itl/1", "machine": machine,
                            "argv": sys.argv[1:] if argv is None else argv,
                            "config": vars(a), "loadavg": load, "result": result,
                            "runs": runs})
    return 1 if errors or result["constrained_valid"] < result["constrained_closed"] else 0


if __name__ == "__main__":
    sys.exit(main())
