"""Ray Serve request router for engine replicas: prefix-cache affinity (service.cluster.affinity).

Ray Serve builds one router per DeploymentHandle, in the process that holds the
handle (our ingress), and asks it `choose_replicas` for every call: it returns ranks
of candidate replicas and Serve sends the call to the least loaded candidate of the
first rank that has room (queue length below `max_ongoing_requests`).

    ReplicaRequest (first argument)  -> affinity.choose(block_hashes, loads, table)
    ReplicaPin (any argument)        -> that replica (aborts, per-replica metrics);
                                        any replica when it is gone
    anything else                    -> power of two choices

Loads are Ray Serve's queue lengths (requests in flight at each replica, from its
cache, probed when stale: as Ray Serve LLM's PrefixCacheAffinityRouter does) plus this
router's choices not yet sent (Serve routes a burst in one synchronous sweep, before
the sends update its cache); the replicas' routing stats
(`EngineReplica.record_routing_stats`: KV usage, running, waiting) break ties. The
affinity table lives in this router only: nothing is shared between ingress processes
(each learns from what it routes itself). Ray Serve ships
this module to the handle's process pickled by value, so anything the ingress must
find goes through service.cluster.registry.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import structlog
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from service.cluster import registry
from service.cluster.affinity import (POWER_OF_TWO, AffinityConfig, PendingChoices,
                                      PrefixAffinityTable, ReplicaLoad, choose)
from service.cluster.messages import ReplicaPin, ReplicaRequest

PINNED = "pinned"


def _find(pending: PendingRequest | None, kind: type) -> Any:
    if pending is None:
        return None
    for arg in (*pending.args, *pending.kwargs.values()):
        if isinstance(arg, kind):
            return arg
    return None


class PrefixCacheAffinityRouter(RequestRouter):
    """Prefix-cache-affinity routing with power-of-two-choices balancing (see
    service.cluster.affinity for the algorithm and its sources: Ray Serve LLM's
    PrefixCacheAffinityRouter, SGLang's cache-aware router).

    `request_router_kwargs` (RequestRouterConfig) reach `initialize_state`:
    imbalanced_threshold (requests), match_rate_threshold (0..1], max_table_blocks, seed,
    and affinity: False routes every unpinned call by power of two choices alone (the
    baseline the README's measurement compares against; pins still work, so aborts
    still reach their replica).
    """

    def initialize_state(self, imbalanced_threshold: int = 4, match_rate_threshold: float = 0.5,
                         max_table_blocks: int = 1 << 18, seed: int | None = None,
                         affinity: bool = True) -> None:
        self.affinity = affinity
        self.config = AffinityConfig(imbalanced_threshold=imbalanced_threshold,
                                     match_rate_threshold=match_rate_threshold,
                                     max_table_blocks=max_table_blocks)
        self.table = PrefixAffinityTable(self.config.max_table_blocks)
        self.pending = PendingChoices()
        self._rng = random.Random(seed)
        self.decisions: Counter[str] = Counter()  # routing attempts by reason
        registry.register(self)  # for the ingress's /health and /metrics
        structlog.get_logger(__name__).info(
            "router_ready", routing="prefix-affinity" if affinity else "power-of-two",
            imbalanced_threshold_requests=imbalanced_threshold,
            match_rate_threshold=match_rate_threshold, max_table_blocks=max_table_blocks)

    @property
    def deployment_name(self) -> str:
        return self._deployment_id.name

    def replica_ids(self) -> list[str]:
        """Full ids of the replicas this router may send to now."""
        return [rid.to_full_id_str() for rid in self.curr_replicas]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        pin = _find(pending_request, ReplicaPin)
        if pin is not None:
            self.decisions[PINNED] += 1
            target = by_id.get(pin.replica_id)
            return [[target]] if target is not None else [candidate_replicas]
        if not self.affinity or len(candidate_replicas) == 1:
            self.decisions[POWER_OF_TWO] += 1
            return [self._rng.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        request = _find(pending_request, ReplicaRequest)
        hashes = request.block_hashes if request is not None else ()
        loads = await self._loads(candidate_replicas)
        if not loads:
            return []  # no queue length known: Serve backs off and asks again
        decision = choose(hashes, loads, self.table, self.config, self._rng)
        self.decisions[decision.reason] += 1
        if len(decision.replicas) == 1 and pending_request is not None:
            # the choice is made: it counts now, for the next request of a burst
            target = decision.replicas[0]
            self.pending.add(pending_request.metadata.internal_request_id, target,
                             time.monotonic())
            if hashes:
                self.table.record(hashes, target)
        return [[by_id[rid] for rid in decision.replicas]]

    async def _loads(self, candidates: list[RunningReplica]) -> list[ReplicaLoad]:
        """Requests in flight at each candidate: the queue-length cache, probing the
        replicas it has no fresh entry for (a replica that does not answer is left out)."""
        lens: dict[ReplicaID, int] = {}
        stale: list[RunningReplica] = []
        for r in candidates:
            n = self.replica_queue_len_cache.get(r.replica_id) \
                if self._use_replica_queue_len_cache else None
            if n is None:
                stale.append(r)
            else:
                lens[r.replica_id] = n
        if stale:
            for r, n in await self._probe_queue_lens(stale, 0):
                if n is not None:
                    lens[r.replica_id] = n
        unsent = self.pending.counts(time.monotonic())
        loads = []
        for r in candidates:
            if r.replica_id in lens:
                rid = r.replica_id.to_full_id_str()
                stats = r.routing_stats or {}
                loads.append(ReplicaLoad(rid, lens[r.replica_id] + unsent[rid],
                                         float(stats.get("kv_usage", 0.0))))
        return loads

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        self.pending.confirm(pending_request.metadata.internal_request_id)
        request = _find(pending_request, ReplicaRequest)
        if self.affinity and request is not None and request.block_hashes:
            self.table.record(request.block_hashes, replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.drop_replica(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self.curr_replicas)
        super().update_replicas(replicas)
        for gone in before - set(self.curr_replicas):
            self.table.drop_replica(gone.to_full_id_str())
