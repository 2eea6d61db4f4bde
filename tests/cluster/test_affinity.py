"""The prefix-affinity policy alone (service.cluster.affinity): no Ray, fake replicas.

The hashes are the engine's own (KVBlockPool.block_hashes), so "shares a prefix" here
means what it means to the engine's prefix cache.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from service.core.block_pool import KVBlockPool
from service.cluster.affinity import (AFFINITY, LEAST_CACHED, POWER_OF_TWO, AffinityConfig,
                                      PendingChoices, PrefixAffinityTable, ReplicaLoad,
                                      RouteDecision, choose)

BS = 16
HASHER = KVBlockPool(1, BS)


def hashes(tokens: list[int]) -> list[int]:
    return HASHER.block_hashes(tokens)


def loads(**ongoing: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(name, n) for name, n in ongoing.items()]


SYSTEM = list(range(1000, 1000 + 256))  # a 256-token shared system prompt: 16 blocks


def request(i: int, shared: bool = True) -> list[int]:
    head = SYSTEM if shared else [5000 + 300 * i + k for k in range(256)]
    return head + [7000 + 40 * i + k for k in range(24)]  # its own question: 1.5 blocks


def route(table: PrefixAffinityTable, cfg: AffinityConfig, rng: random.Random,
          tokens: list[int], replicas: list[ReplicaLoad]) -> tuple[str, str]:
    """One routing as Ray Serve does it: choose, send to the least loaded candidate, record."""
    h = hashes(tokens)
    d = choose(h, replicas, table, cfg, rng)
    by = {r.replica_id: r for r in replicas}
    target = min(d.replicas, key=lambda rid: by[rid].ongoing)
    table.record(h, target)
    return target, d.reason


def test_table_keeps_the_last_owner_and_the_deepest_match():
    t = PrefixAffinityTable(100)
    a = hashes(list(range(48)))          # 3 blocks
    b = hashes(list(range(16)) + [99] * 16)  # shares block 0 with a only
    t.record(a, "A")
    t.record(b, "B")
    assert a[0] == b[0] and a[1] != b[1]
    assert t.longest_match(a + [12345], {"A", "B"}) == ("A", 3)
    assert t.longest_match(b, {"A", "B"}) == ("B", 2)
    assert t.longest_match(a[:1], {"A", "B"}) == ("B", 1)  # block 0 was last sent to B
    assert t.longest_match(a, {"B"}) == ("B", 1)  # A gone: B still holds block 0
    assert t.longest_match(a, {"C"}) == (None, 0)
    assert t.num_blocks("A") == 2 and t.num_blocks("B") == 2 and len(t) == 4


def test_table_is_lru_bounded_and_forgets_dead_replicas():
    t = PrefixAffinityTable(4)
    t.record([1, 2, 3], "A")
    t.record([4, 5], "B")  # 5 entries > 4: hash 1 (least recent) goes
    assert len(t) == 4 and t.longest_match([1], {"A", "B"}) == (None, 0)
    assert t.num_blocks("A") == 2 and t.num_blocks("B") == 2
    t.record([2], "A")  # touched: now most recent
    t.record([6], "B")  # evicts 3, not 2
    assert t.longest_match([2], {"A"}) == ("A", 1) and t.longest_match([3], {"A"}) == (None, 0)
    t.drop_replica("B")
    assert len(t) == 1 and t.num_blocks("B") == 0
    assert t.longest_match([4, 5, 6], {"A", "B"}) == (None, 0)


def test_shared_prefix_requests_stick_to_one_replica():
    t, cfg, rng = PrefixAffinityTable(1 << 16), AffinityConfig(), random.Random(0)
    replicas = loads(A=0, B=0)
    sent = [route(t, cfg, rng, request(i), replicas) for i in range(8)]
    first = sent[0][0]
    assert sent[0][1] == LEAST_CACHED
    assert all(target == first for target, _ in sent)
    assert [reason for _, reason in sent[1:]] == [AFFINITY] * 7


def test_different_prompts_spread_over_the_replicas():
    t, cfg, rng = PrefixAffinityTable(1 << 16), AffinityConfig(), random.Random(1)
    replicas = loads(A=0, B=0)
    got = Counter(route(t, cfg, rng, request(i, shared=False), replicas)[0] for i in range(8))
    assert got == {"A": 4, "B": 4}


def test_a_short_common_header_is_not_affinity():
    """Every chat prompt starts with the template's first block: a 1-of-3-block match is
    below match_rate_threshold (0.5), so it must not pull all traffic to one replica."""
    t, cfg, rng = PrefixAffinityTable(1 << 16), AffinityConfig(), random.Random(2)
    header = list(range(16))
    t.record(hashes(header + list(range(100, 132))), "A")
    d = choose(hashes(header + list(range(200, 232))), loads(A=0, B=0), t, cfg, rng)
    assert d.reason == LEAST_CACHED and d.replicas == ("B",)  # B holds less
    d = choose(hashes(header + list(range(100, 116)) + [1] * 16), loads(A=0, B=0), t, cfg, rng)
    assert d == RouteDecision(("A",), AFFINITY, 2)  # 2 of 3 blocks: affinity


def test_imbalance_beats_affinity_with_power_of_two():
    t, rng = PrefixAffinityTable(1 << 16), random.Random(3)
    cfg = AffinityConfig(imbalanced_threshold=2)
    h = hashes(request(0))
    t.record(h, "A")
    assert choose(h, loads(A=2, B=0), t, cfg, rng).reason == AFFINITY  # spread 2: balanced
    d = choose(h, loads(A=3, B=0), t, cfg, rng)
    assert d.reason == POWER_OF_TWO and d.replicas == ("B", "A")  # less loaded first
    picks = Counter(frozenset(choose(h, loads(A=9, B=0, C=1, D=5), t, cfg, rng).replicas)
                    for _ in range(600))
    assert len(picks) == 6 and all(len(p) == 2 for p in picks)  # every pair, at random
    assert min(picks.values()) > 50


def test_dead_replica_is_never_chosen_and_its_prefixes_move():
    t, cfg, rng = PrefixAffinityTable(1 << 16), AffinityConfig(), random.Random(4)
    h = hashes(request(0))
    t.record(h, "A")
    d = choose(h, loads(B=0, C=0), t, cfg, rng)  # A is gone from the candidates
    assert d.reason == LEAST_CACHED and d.replicas[0] in ("B", "C")
    t.record(h, d.replicas[0])
    assert choose(h, loads(B=0, C=0), t, cfg, rng) == RouteDecision(d.replicas, AFFINITY, len(h))


def test_pending_choices_count_until_confirmed_or_expired():
    p = PendingChoices(ttl_s=10)
    p.add("r1", "A", now=0.0)
    p.add("r2", "A", now=1.0)
    p.add("r3", "B", now=2.0)
    assert p.counts(now=3.0) == {"A": 2, "B": 1}
    p.confirm("r1")
    p.confirm("unknown")
    assert p.counts(now=3.0) == {"A": 1, "B": 1}
    assert p.counts(now=11.5) == {"B": 1}  # r2 never confirmed: expired
    assert p.counts(now=12.5) == {}


def test_a_burst_routed_before_any_send_does_not_herd():
    """Ray Serve routes a burst in one sweep: its queue lengths stay at 0 until the sends.
    Counting the router's own unsent choices spreads new prompts 4/4 and lets a shared
    prefix stay on one replica only while the spread stays within the threshold."""
    t, cfg, rng, pending = PrefixAffinityTable(1 << 16), AffinityConfig(), random.Random(6), \
        PendingChoices()
    for i in range(8):
        counts = pending.counts(now=0.0)
        h = hashes(request(i, shared=False))
        d = choose(h, [ReplicaLoad(r, counts[r]) for r in ("A", "B")], t, cfg, rng)
        pending.add(f"r{i}", d.replicas[0], now=0.0)
        t.record(h, d.replicas[0])
    assert pending.counts(now=0.0) == {"A": 4, "B": 4}
    t, pending = PrefixAffinityTable(1 << 16), PendingChoices()
    sent = []
    for i in range(12):
        counts = pending.counts(now=0.0)
        h = hashes(request(i))
        d = choose(h, [ReplicaLoad(r, counts[r]) for r in ("A", "B")], t, cfg, rng)
        target = min(d.replicas, key=lambda r: counts[r])
        pending.add(f"s{i}", target, now=0.0)
        t.record(h, target)
        sent.append((target, d.reason))
    first = sent[0][0]
    assert [r for r, _ in sent[:5]] == [first] * 5  # affinity up to a spread of 4 ...
    assert sent[5][1] == POWER_OF_TWO and sent[5][0] != first  # ... then balance
    assert max(pending.counts(now=0.0).values()) - min(pending.counts(now=0.0).values()) <= 5


def test_one_replica_and_no_hashes():
    t, cfg, rng = PrefixAffinityTable(8), AffinityConfig(), random.Random(5)
    assert choose([], loads(A=7), t, cfg, rng).replicas == ("A",)
    assert choose([], loads(A=1, B=0), t, cfg, rng).replicas == ("B",)  # least loaded
    with pytest.raises(ValueError, match="no replicas"):
        choose([], [], t, cfg, rng)


@pytest.mark.parametrize("kw", [{"imbalanced_threshold": -1}, {"match_rate_threshold": 0},
                                {"match_rate_threshold": 1.5}, {"max_table_blocks": 0}])
def test_config_errors_name_the_field(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        AffinityConfig(**kw)
