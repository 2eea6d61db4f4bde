"""CPU cost of the network front per streamed token, one process, model-free.

    python -m service.bench.front_cost [--requests 16] [--max-tokens 256] [--rounds 3]

Serves an Engine over a NullRunner (no forward: every step "samples" at once, with the
real SmolLM2 tokenizer detokenizing) in a child process, streams `--requests` concurrent
requests of `--max-tokens` tokens through each front, and reads the CPU time (user +
system, from the OS) the server process spent meanwhile. The engine's own work is the
same for both routes, so the differences between rows are the routes' costs:

    asgi-ws      the front app on uvicorn, /v1/stream (one socket, many requests)
    asgi-sse     the front app on uvicorn, POST /v1/chat/completions stream=true
                 (one HTTP connection per request)

Prints CPU ms per 1,000 streamed tokens (median of --rounds). CPU time, unlike wall
time, stays meaningful on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

FRONTS = ("asgi-ws", "asgi-sse")


async def _serve() -> None:
    from service.bench.tokenizer import load_tokenizer
    from service.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
    from service.core.null_runner import NullRunner
    from service.engine import Engine

    tok = load_tokenizer()
    words = tok(" the cat sat on a mat and", add_special_tokens=False)["input_ids"]
    runner = NullRunner(4096, max_model_len=8192,
                        token_fn=lambda rid, pos: words[pos % len(words)])
    runner.tokenizer, runner.vocab_size = tok, len(tok)
    runner.eos_token_ids, runner.model_name = frozenset(), "null"
    cfg = EngineConfig(cache=CacheConfig(num_kv_blocks=4096, swap_space=0.0),
                       scheduler=SchedulerConfig(max_num_seqs=64))
    async with Engine(cfg, runner=runner) as engine:
        from service.front.server import FrontServer

        server = await FrontServer(engine, ServerConfig(port=0)).start()
        print(server.port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await server.close()


async def _ws(port: int, requests: int, max_tokens: int) -> int:
    from protocol import connect

    async def one(i: int, client) -> int:
        n = 0
        async for ev in client.generate(prompt=f"Story {i}:", max_tokens=max_tokens,
                                        ignore_eos=True, temperature=0):
            n += len(getattr(ev, "token_ids", ()))
        return n

    async with await connect(f"ws://127.0.0.1:{port}/v1/stream") as client:
        return sum(await asyncio.gather(*(one(i, client) for i in range(requests))))


async def _sse(port: int, requests: int, max_tokens: int) -> int:
    import httpx

    async def one(i: int, c: httpx.AsyncClient) -> int:
        body = {"messages": [{"role": "user", "content": f"Story {i}"}], "stream": True,
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage":{' in line:
                    return json.loads(line[6:])["usage"]["completion_tokens"]
        return 0

    limits = httpx.Limits(max_connections=requests)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300,
                                 limits=limits) as c:
        return sum(await asyncio.gather(*(one(i, c) for i in range(requests))))


def measure(front: str, requests: int, max_tokens: int, rounds: int) -> float:
    """Median server CPU ms per 1,000 tokens through `front`."""
    import psutil

    child = subprocess.Popen([sys.executable, "-m", "service.bench.front_cost", "--serve"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        proc = psutil.Process(child.pid)
        stream = _sse if front == "asgi-sse" else _ws
        asyncio.run(stream(port, 2, 8))  # warm-up
        costs = []
        for _ in range(rounds):
            t = proc.cpu_times()
            before = t.user + t.system
            tokens = asyncio.run(stream(port, requests, max_tokens))
            t = proc.cpu_times()
            costs.append((t.user + t.system - before) * 1e6 / tokens)
        return statistics.median(costs)
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.bench.front_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16, help="concurrent requests")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fronts", default=",".join(FRONTS))
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        from service.logs import configure_logging

        configure_logging("warning")
        asyncio.run(_serve())
        return 0
    t0 = time.monotonic()
    for front in a.fronts.split(","):
        ms = measure(front, a.requests, a.max_tokens, a.rounds)
        print(f"  {front:<11} {ms:8.1f} server CPU ms per 1,000 tokens", flush=True)
    print(f"({a.requests} concurrent requests x {a.max_tokens} tokens, median of "
          f"{a.rounds}; {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
