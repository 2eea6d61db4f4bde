"""Prefix-cache affinity: which engine replica should take a request (pure, no Ray).

A replica's prefix cache only pays off if requests that share a prompt prefix reach
the replica that already holds that prefix's KV blocks. The router keeps a table from
block hash to the replica that block was last sent to. The hashes are the engine's
own chained block hashes (`KVBlockPool.block_hashes`) over the prompt's token ids, so
hash j stands for the whole prefix of blocks 0..j, as it does in the engine's cache.

For each request, with `loads` the requests in flight at each live replica:

1. Balanced (max - min load <= `imbalanced_threshold`) and the table knows a prefix:
   the deepest block j whose hash is in the table (on a live replica) gives the match
   length j + 1. If it covers at least `match_rate_threshold` of the request's full
   blocks, route there ("affinity").
2. Balanced, no good match: a new prefix. Route to the least loaded replica whose table
   share is smallest ("least_cached"), so new prefixes spread over the replicas instead
   of piling onto the first one (SGLang's and Ray Serve LLM's "smallest tree/tenant").
3. Imbalanced: power of two choices: two random replicas, the less loaded one first
   ("power_of_two"; Mitzenmacher, "The Power of Two Choices in Randomized Load
   Balancing", IEEE TPDS 2001). Affinity never overrides a real imbalance.

Every block hash of the request is recorded for the chosen replica (LRU, at most
`max_table_blocks` hashes in all) as soon as the choice is made, and the choice counts
as load on that replica until Ray Serve has sent the request (`PendingChoices`): a burst
of requests is routed in one sweep, before any send updates the queue lengths, and a
deterministic rule must not send the whole burst to one replica ("herding", the reason
power of two choices randomizes).

Sources: Ray Serve LLM's `PrefixCacheAffinityRouter` (`ray.serve.llm.request_router`:
balanced-load check, prefix match rate threshold, smallest-tenant fallback, power of
two otherwise; it matches characters in a prefix tree, we match the engine's block
hashes) and SGLang's cache-aware router (sgl-router `cache_aware` policy: approximate
radix tree per worker, `cache_threshold`, `balance_abs_threshold`, shortest queue when
imbalanced). Matching on block hashes, as llm-d's and NVIDIA Dynamo's KV-aware routers
do, makes a "match" mean exactly what the engine can reuse: whole blocks.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass

AFFINITY, LEAST_CACHED, POWER_OF_TWO = "affinity", "least_cached", "power_of_two"


@dataclass(frozen=True)
class AffinityConfig:
    """Knobs of the prefix-affinity router.

    imbalanced_threshold: requests in flight; when the most loaded replica has more than
        this many above the least loaded, load decides (power of two), not the cache.
    match_rate_threshold: fraction (0..1] of a request's full blocks that must be found
        on one replica for the match to count (SGLang's cache_threshold, Ray's
        match_rate_threshold).
    max_table_blocks: block hashes remembered across all replicas (LRU beyond).
    """

    imbalanced_threshold: int = 4
    match_rate_threshold: float = 0.5
    max_table_blocks: int = 1 << 18

    def __post_init__(self) -> None:
        if self.imbalanced_threshold < 0:
            raise ValueError(f"imbalanced_threshold must be >= 0 requests, got "
                             f"{self.imbalanced_threshold!r}")
        if not 0 < self.match_rate_threshold <= 1:
            raise ValueError(f"match_rate_threshold must be in (0, 1], got "
                             f"{self.match_rate_threshold!r}")
        if self.max_table_blocks < 1:
            raise ValueError(f"max_table_blocks must be >= 1, got {self.max_table_blocks!r}")


@dataclass(frozen=True)
class ReplicaLoad:
    """One candidate replica as the router sees it.

    ongoing: requests in flight there (Ray Serve's queue length); kv_usage: fraction of
    its KV blocks held (0..1, from its routing stats; a tie-breaker only).
    """

    replica_id: str
    ongoing: int
    kv_usage: float = 0.0


@dataclass(frozen=True)
class RouteDecision:
    """replicas: ranked candidates (Ray Serve sends to the least loaded one of them that
    has room); reason: AFFINITY, LEAST_CACHED or POWER_OF_TWO; matched_blocks: leading
    blocks of the request found on replicas[0] (0 unless AFFINITY)."""

    replicas: tuple[str, ...]
    reason: str
    matched_blocks: int = 0


class PrefixAffinityTable:
    """Block hash -> the replica it was last sent to; LRU-bounded.

    E.g. after record([h0, h1, h2], "A") and record([h0, h3], "B"): h0 -> B (last sent),
    h1, h2 -> A, h3 -> B; longest_match([h0, h1, h2, h9], {"A", "B"}) == ("A", 3).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()
        self._count: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._owner)

    def num_blocks(self, replica_id: str) -> int:
        """Hashes currently recorded for `replica_id`."""
        return self._count[replica_id]

    def longest_match(self, hashes: Sequence[int],
                      allowed: Container[str]) -> tuple[str | None, int]:
        """(replica, number of leading blocks) of the deepest hash owned by an allowed
        replica; (None, 0) when none is. A chained hash implies its whole prefix."""
        for j in range(len(hashes) - 1, -1, -1):
            owner = self._owner.get(hashes[j])
            if owner is not None and owner in allowed:
                return owner, j + 1
        return None, 0

    def record(self, hashes: Sequence[int], replica_id: str) -> None:
        """`hashes` were sent to `replica_id`: they now point there and become most recent."""
        owner, count = self._owner, self._count
        for h in hashes:
            old = owner.get(h)
            if old is not None:
                count[old] -= 1
                owner.move_to_end(h)
            owner[h] = replica_id
            count[replica_id] += 1
        while len(owner) > self.capacity:
            _, evicted = owner.popitem(last=False)
            count[evicted] -= 1

    def drop_replica(self, replica_id: str) -> None:
        """Forget every hash recorded for a replica that is gone (its cache went with it)."""
        if not self._count.get(replica_id):
            return
        for h in [h for h, r in self._owner.items() if r == replica_id]:
            del self._owner[h]
        del self._count[replica_id]


class PendingChoices:
    """Choices made but not yet seen sent, by request: they count as load meanwhile.

    E.g. add("r1", "A", now=0.0); add("r2", "A", now=0.1) -> counts(0.2) == {"A": 2};
    confirm("r1") -> {"A": 1}; a choice never confirmed (its request was cancelled
    while routing) stops counting after `ttl_s` seconds.
    """

    def __init__(self, ttl_s: float = 10.0) -> None:
        self.ttl_s = ttl_s
        self._choices: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def add(self, request_id: str, replica_id: str, now: float) -> None:
        self._choices.pop(request_id, None)
        self._choices[request_id] = (replica_id, now)

    def confirm(self, request_id: str) -> None:
        """The request was sent (Ray Serve's queue lengths now include it)."""
        self._choices.pop(request_id, None)

    def counts(self, now: float) -> Counter[str]:
        """Unconfirmed choices per replica, dropping those older than ttl_s."""
        while self._choices:
            rid, (_, when) = next(iter(self._choices.items()))
            if now - when <= self.ttl_s:
                break
            del self._choices[rid]
        return Counter(replica for replica, _ in self._choices.values())


def choose(hashes: Sequence[int], loads: Sequence[ReplicaLoad], table: PrefixAffinityTable,
           config: AffinityConfig, rng: random.Random) -> RouteDecision:
    """Rank the replicas for one request (see the module docstring for the algorithm).

    hashes: [B] the request's full-block hashes (may be empty); loads: the live replicas
    (at least one). Does not record anything: call `table.record` once the request was
    really sent. Raises ValueError without replicas.
    """
    if not loads:
        raise ValueError("no replicas to choose from")
    low = min(r.ongoing for r in loads)
    high = max(r.ongoing for r in loads)
    if high - low <= config.imbalanced_threshold:
        if hashes:
            replica, matched = table.longest_match(hashes, {r.replica_id for r in loads})
            if replica is not None and matched >= config.match_rate_threshold * len(hashes):
                return RouteDecision((replica,), AFFINITY, matched)
        best = min(loads, key=lambda r: (r.ongoing, table.num_blocks(r.replica_id),
                                         r.kv_usage, rng.random()))
        return RouteDecision((best.replica_id,), LEAST_CACHED)
    pair = rng.sample(list(loads), 2)
    pair.sort(key=lambda r: (r.ongoing, r.kv_usage))
    return RouteDecision(tuple(r.replica_id for r in pair), POWER_OF_TWO)
