"""Flags generated from the config dataclasses: every option field is a flag with the field's
default, and parsed flags build the same frozen configs back."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from service.config import (CacheConfig, EngineConfig, ModelConfig, PolicyOptions,
                            SchedulerConfig, ServerConfig)
from service.engine_args import add_engine_args, add_server_args, engine_config, server_config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_server_args(p)
    add_engine_args(p)
    return p


def test_every_option_field_is_a_flag_and_defaults_round_trip():
    p = parser()
    flags = {o for a in p._actions for o in a.option_strings}
    for cls in (ModelConfig, CacheConfig, SchedulerConfig, PolicyOptions, EngineConfig,
                ServerConfig):
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                assert "--" + f.name.replace("_", "-") in flags, (cls.__name__, f.name)
    ns = p.parse_args([])
    assert engine_config(ns) == EngineConfig()
    assert server_config(ns) == ServerConfig()


def test_flags_reach_nested_configs_and_parse_their_units():
    ns = parser().parse_args([
        "--max-num-seqs", "8", "--no-enable-prefix-caching", "--kv-cache-memory", "512MiB",
        "--mlfq-slices", "4,8", "--quantization", "int8", "--step-timeout-s", "30",
        "--allowed-origins", "http://a:1, https://b", "--max-message-bytes", "16MiB"])
    c = engine_config(ns)
    assert c.scheduler.max_num_seqs == 8 and not c.cache.enable_prefix_caching
    assert c.cache.kv_cache_memory == 512 << 20 and c.scheduler.policy.mlfq_slices == (4, 8)
    assert c.model.quantization == "int8" and c.step_timeout_s == 30
    s = server_config(ns)
    assert s.allowed_origins == ("http://a:1", "https://b") and s.max_message_bytes == 16 << 20
    assert engine_config(parser().parse_args(["--quantization", "none"])).model.quantization \
        is None


def test_bad_values_are_refused_by_the_configs_own_checks():
    with pytest.raises(ValueError, match="^--max-num-seqs must be >= 1, got 0"):
        engine_config(parser().parse_args(["--max-num-seqs", "0"]))
    # the error names the flags a user typed, not the config's field names
    with pytest.raises(ValueError, match='--batch-invariant must be .*--cpu-decode-kernel not "sdpa"'):
        engine_config(parser().parse_args(["--batch-invariant", "--cpu-decode-kernel", "sdpa"]))
    with pytest.raises(SystemExit):
        parser().parse_args(["--batching", "sometimes"])


def test_api_key_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("CONVEYOR_API_KEY", "from-env")
    assert server_config(parser().parse_args([])).api_key == "from-env"
    assert server_config(parser().parse_args(["--api-key", "k"])).api_key == "k"
