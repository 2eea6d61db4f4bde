"""Two engine replicas on one node share the disk KV tier (issue 25), through Ray Serve.

Both EngineReplica replicas get the same `kv_disk_path` (a tmp dir). Routing is power
of two choices (no prefix affinity): with both replicas idle, each call goes to either
one at random. A first request is served by some replica A (the ingress's per-replica
routed counters say which), and A writes the prompt's full blocks behind to the
directory; once the files are there, the same prompt is sent again until a copy lands
on the other replica B (each copy that lands on A is a cheap pool hit, so the tries are
bounded and cheap: P(all 16 land on A) = 2**-16 with idle replicas). B never saw the
prompt, so every cached token it reports was read back from A's files.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from protocol import Done, connect
from service.cluster.config import ClusterConfig
from tests.cluster.conftest import (HAVE_RAY, RunningCluster, cluster_marks,
                                    small_engine_config, start_cluster, stop_cluster)
from tests.integration.stream_checks import collect

pytestmark = cluster_marks

BLOCK_SIZE = 16  # tokens per KV block (the engine's default)
# ~350 tokens: 21 full blocks; unique to this module, so no replica has it cached
PROMPT = ("Here is the list of the crates loaded on the night ferry, one per line, in the "
          "order they came aboard: " + ", ".join(f"crate {i} (of {c})" for i, c in zip(
              range(36), ["apples", "bolts", "cloth", "dates", "eggs", "flour"] * 6)) +
          ". Which crate came aboard first?")
MAX_TOKENS = 8
MAX_TRIES = 16  # copies of the follow-up before giving up on reaching the other replica
FILES_TIMEOUT_S = 60.0  # for the write-behind of the first request's blocks


@dataclasses.dataclass
class DiskCluster:
    running: RunningCluster
    kv_dir: Path


@pytest.fixture(scope="module")
def disk_cluster(tmp_path_factory):
    """2 replicas (0.5 CPU, 1 torch thread each), power-of-two routing, one disk tier dir."""
    if not HAVE_RAY:
        pytest.skip("the cluster extra is not installed: pip install -e '.[cluster]'")
    kv_dir = tmp_path_factory.mktemp("kv_disk")
    engine = small_engine_config()
    engine = dataclasses.replace(
        engine, cache=dataclasses.replace(engine.cache, kv_disk_path=str(kv_dir)))
    try:
        yield DiskCluster(start_cluster(ClusterConfig(num_replicas=2, num_cpus_per_replica=0.5,
                                                      routing="power-of-two"), engine),
                          kv_dir)
    finally:
        stop_cluster()


async def ask(url: str) -> tuple[str, Done]:
    """PROMPT, greedy, MAX_TOKENS tokens: (text, done)."""
    async with await connect(url) as client:
        deltas, done = await collect(client.generate(prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                     temperature=0, ignore_eos=True))
    assert done.finish_reason == "length", done
    return "".join(d.text for d in deltas), done


async def ask_on_one_replica(cluster: RunningCluster) -> tuple[str, str, Done]:
    """ask(), and the replica that served it (the routed counters' difference)."""
    before = await cluster.routed()
    text, done = await ask(cluster.url)
    got = await cluster.routed() - before
    assert sum(got.values()) == 1 and len(got) == 1, got
    return next(iter(got)), text, done


async def wait_for_block_files(kv_dir: Path, n: int) -> int:
    """Poll (every 0.1 s, at most FILES_TIMEOUT_S) until `n` block files exist."""
    deadline = time.monotonic() + FILES_TIMEOUT_S
    while True:
        count = len(list(kv_dir.glob("*/*/*.kvb")))
        if count >= n:
            return count
        assert time.monotonic() < deadline, f"{count} of {n} block files after {FILES_TIMEOUT_S} s"
        await asyncio.sleep(0.1)


async def test_a_prompt_moved_to_the_other_replica_is_read_back_from_disk(disk_cluster):
    cluster = disk_cluster.running
    first, text_a, done_a = await ask_on_one_replica(cluster)
    prompt_tokens = done_a.usage.prompt_tokens
    assert prompt_tokens >= 300, done_a.usage
    assert done_a.usage.cached_tokens == 0 and done_a.usage.disk_cached_tokens == 0
    full_blocks = prompt_tokens // BLOCK_SIZE
    await wait_for_block_files(disk_cluster.kv_dir, full_blocks)

    on_first: list[tuple[str, Done]] = []
    for _ in range(MAX_TRIES):
        replica, text_b, done_b = await ask_on_one_replica(cluster)
        if replica != first:
            break
        on_first.append((text_b, done_b))
    else:
        raise AssertionError(f"{MAX_TRIES} copies of the prompt all went to {first}")

    print(f"first on {first}; other replica reached on copy {len(on_first) + 1}; "
          f"{done_a.usage} then {done_b.usage}")
    assert text_b == text_a
    usage = done_b.usage
    assert usage.prompt_tokens == prompt_tokens
    assert usage.disk_cached_tokens >= 0.9 * full_blocks * BLOCK_SIZE, usage
    assert usage.disk_cached_tokens == usage.cached_tokens, usage  # B's pool never had it
    # copies that stayed on A hit its pool, not the disk
    for text, d in on_first:
        assert text == text_a
        assert d.usage.cached_tokens >= 0.9 * full_blocks * BLOCK_SIZE, d.usage
        assert d.usage.disk_cached_tokens == 0, d.usage
