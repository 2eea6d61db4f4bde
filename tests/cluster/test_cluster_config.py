"""ClusterConfig (pure) and the deployment options the Serve application derives from it."""

from __future__ import annotations

import pytest

from service.cluster.config import ClusterConfig
from service.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from tests.cluster.conftest import HAVE_RAY


@pytest.mark.parametrize("kw, field", [
    ({"num_replicas": 0}, "num_replicas"),
    ({"min_replicas": 1}, "min_replicas/max_replicas"),
    ({"min_replicas": 3, "max_replicas": 4, "num_replicas": 2}, "replica counts"),
    ({"num_cpus_per_replica": 0}, "num_cpus_per_replica"),
    ({"num_gpus_per_replica": -1}, "num_gpus_per_replica"),
    ({"max_ongoing_requests": 0}, "max_ongoing_requests"),
    ({"routing": "round-robin"}, "routing"),
    ({"imbalanced_threshold": -1}, "imbalanced_threshold"),
    ({"match_rate_threshold": 1.01}, "match_rate_threshold"),
    ({"target_ongoing_requests": 0}, "target_ongoing_requests"),
    ({"route_prefix": "v1"}, "route_prefix"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field.replace("/", ".")):
        ClusterConfig(**kw)


def test_torch_threads_follow_the_cpu_reservation():
    assert ClusterConfig(num_cpus_per_replica=0.5).torch_threads == 1
    assert ClusterConfig(num_cpus_per_replica=1).torch_threads == 1
    assert ClusterConfig(num_cpus_per_replica=4).torch_threads == 4
    assert not ClusterConfig().autoscaling
    assert ClusterConfig(num_replicas=2, min_replicas=1, max_replicas=8).autoscaling


@pytest.mark.skipif(not HAVE_RAY, reason="the cluster extra is not installed")
def test_deployment_options():
    from service.cluster.app import engine_deployment_options, replica_engine_config
    from service.cluster.router import PrefixCacheAffinityRouter

    engine = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_waiting_requests=100))
    fixed = engine_deployment_options(engine, ServerConfig(shutdown_timeout=7),
                                      ClusterConfig(num_replicas=3, num_cpus_per_replica=0.5,
                                                    routing="power-of-two"))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert fixed["max_ongoing_requests"] == 8 + 100 + 16
    assert fixed["graceful_shutdown_timeout_s"] == 7
    router = fixed["request_router_config"]
    assert router.request_router_kwargs["affinity"] is False
    assert router.request_router_class.endswith(PrefixCacheAffinityRouter.__name__)
    auto = engine_deployment_options(engine, ServerConfig(), ClusterConfig(
        num_replicas=2, min_replicas=1, max_replicas=6, target_ongoing_requests=12,
        max_ongoing_requests=40))
    assert "num_replicas" not in auto and auto["max_ongoing_requests"] == 40
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 6,
                                          "initial_replicas": 2, "target_ongoing_requests": 12}
    # torch threads from the reservation, unless --num-threads said otherwise
    assert replica_engine_config(engine, ClusterConfig(num_cpus_per_replica=2)) \
        .model.num_threads == 2
    pinned = EngineConfig(model=ModelConfig(num_threads=3))
    assert replica_engine_config(pinned, ClusterConfig()).model.num_threads == 3


@pytest.mark.skipif(not HAVE_RAY, reason="the cluster extra is not installed")
def test_the_disk_tier_flags_reach_every_replica(tmp_path):
    """`--kv-disk-path DIR --kv-disk-size BYTES` (flags, or a Serve YAML's args.flags) end
    up in the EngineConfig each replica is bound with: replicas on one node share DIR."""
    from service.cluster.app import configs_from_argv, replica_engine_config

    engine, _, cluster = configs_from_argv(["--replicas", "2", "--kv-disk-path",
                                            str(tmp_path), "--kv-disk-size", "123456789"])
    replica = replica_engine_config(engine, cluster)
    assert cluster.num_replicas == 2
    assert replica.cache.kv_disk_path == str(tmp_path)
    assert replica.cache.kv_disk_size == 123456789
