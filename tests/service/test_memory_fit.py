"""service.worker.memory_fit: the refusal of a model that cannot fit, before allocation."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from types import SimpleNamespace

from service.worker.memory_fit import (GiB, MemoryNeed, ModelDoesNotFit, cgroup_room,
                                       check_fits, dense_bytes, served_need)

ROOT = Path(__file__).resolve().parents[2]


def test_a_need_within_the_available_memory_passes() -> None:
    check_fits(MemoryNeed(GiB, GiB, 0), "m", available=3 * GiB, source="test")


def test_the_refusal_names_the_parts_the_room_and_the_flags() -> None:
    with pytest.raises(ModelDoesNotFit) as e:
        check_fits(MemoryNeed(2 * GiB, 2 * GiB, GiB, GiB // 2), "llama", available=3 * GiB,
                   source="the cgroup's memory limit")
    msg = str(e.value)
    assert "llama does not fit" in msg and "5.50 GiB" in msg and "3.00 GiB is available" in msg
    assert "weights 2.00 GiB" in msg and "KV cache 2.00 GiB" in msg and "swap space 1.00" in msg
    assert "--kv-cache-memory" in msg and "--swap-space" in msg and "0.50 GiB is left" in msg


def test_weights_alone_over_the_memory_say_so() -> None:
    with pytest.raises(ModelDoesNotFit, match="the weights alone do not fit"):
        check_fits(MemoryNeed(8 * GiB, GiB, 0), "big", available=4 * GiB, source="x")


def test_cgroup_room_reads_every_level_of_the_own_cgroup(tmp_path) -> None:
    (tmp_path / "proc").write_text("12:memory:/a/b\n0::/a/b\n")
    v1 = tmp_path / "fs" / "memory"
    (v1 / "a" / "b").mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(1 << 62))  # the root: no limit
    (v1 / "a" / "memory.limit_in_bytes").write_text(str(10 * GiB))
    (v1 / "a" / "memory.usage_in_bytes").write_text(str(4 * GiB))
    (v1 / "a" / "b" / "memory.limit_in_bytes").write_text(str(20 * GiB))
    (v1 / "a" / "b" / "memory.usage_in_bytes").write_text(str(GiB))
    assert cgroup_room(tmp_path / "fs", tmp_path / "proc") == 6 * GiB  # the parent's is smaller
    v2 = tmp_path / "fs" / "a" / "b"
    v2.mkdir(parents=True)
    (v2 / "memory.max").write_text(str(3 * GiB))
    (v2 / "memory.current").write_text(str(GiB))
    assert cgroup_room(tmp_path / "fs", tmp_path / "proc") == 2 * GiB
    (v2 / "memory.max").write_text("max")
    assert cgroup_room(tmp_path / "fs", tmp_path / "proc") == 6 * GiB


def test_dense_bytes_counts_a_llama_shape() -> None:
    class C:
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads = 64, 2, 4, 2
        intermediate_size, vocab_size, tie_word_embeddings = 128, 100, True
    per_layer = 64 * (4 + 4) * 16 + 4 * 16 * 64 + 3 * 64 * 128 + 2 * 64
    assert dense_bytes(C(), 4) == 4 * (2 * per_layer + 100 * 64 + 64)


def _memory_cgroup() -> Path | None:
    root = Path("/sys/fs/cgroup/memory")
    if not root.is_dir() or not os.access(root, os.W_OK):
        return None
    path = root / f"conveyor-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError:
        return None
    return path


def test_a_split_weight_counts_each_part_in_its_own_format() -> None:
    import numpy as np

    from service.worker.gguf_weights import RawBlocks
    from service.worker.memory_fit import BITS_PER_WEIGHT, served_bytes

    def blocks(types, rows):  # only the row counts are read
        return RawBlocks(types, tuple(np.zeros((n, 1), np.uint8) for n in rows), 4096)

    qkv = blocks(("Q4_K", "Q4_K", "Q6_K"), (4096, 1024, 1024))  # Llama-3.1-8B, Q4_K_M
    assert qkv.fmt == "split"
    want = (5120 * 4096 * BITS_PER_WEIGHT["q4_k"] + 1024 * 4096 * BITS_PER_WEIGHT["q6_k"]) / 8
    assert served_bytes(qkv) == want
    assert served_bytes(qkv) < 6144 * 4096 * 9.125 / 8  # the i8_k it replaces
    assert served_bytes(blocks(("Q4_K",), (4096,))) == 4096 * 4096 * 4.625 / 8
    assert served_bytes(blocks(("IQ2_XS",), (4096,))) == 4096 * 4096 * 4  # fp32


def test_served_need_counts_the_cache_and_swap_in_whole_blocks() -> None:
    # SmolLM2-135M's shape: 30 layers, 3 KV heads of 64; 16-token blocks of fp32 K and V
    cfg = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                          tie_word_embeddings=True)
    per_block = 2 * 30 * 3 * 64 * 4 * 16  # 737,280 bytes
    need = served_need(cfg, None, 0, 4, 4, 16, 0, 10 * per_block + 5, 0.001)
    assert need.kv_cache == 10 * per_block
    assert need.swap_space == int(0.001 * GiB) // per_block * per_block == per_block
    assert need.weights == need.transient == dense_bytes(cfg, 4)
    half = served_need(cfg, None, 0, 2, 2, 16, 7, 0, 0)  # bf16 weights and cache, 7 blocks
    assert half.kv_cache == 7 * per_block // 2 and half.swap_space == 0
    assert half.weights == dense_bytes(cfg, 4) // 2
    # a cache smaller than two blocks is two
    assert served_need(cfg, None, 0, 4, 4, 16, 0, 1, 0).kv_cache == 2 * per_block


def test_a_server_under_a_memory_limit_below_the_model_refuses_at_start() -> None:
    """A real cgroup (v1) limit of 1.2 GiB: `conveyor serve` with its default 2 GiB KV cache
    exits with the refusal, before allocating it."""
    cg = _memory_cgroup()
    if cg is None:
        pytest.skip("no writable cgroup v1 memory controller here")
    try:
        (cg / "memory.limit_in_bytes").write_text(str(1200 << 20))
        script = (f"echo $$ > {cg}/cgroup.procs && exec {sys.executable} -m service.cli serve "
                  "--port 0")
        out = subprocess.run(["sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
    finally:
        cg.rmdir()
    assert out.returncode == 2, out.stderr[-2000:]
    assert "does not fit in memory" in out.stderr and "KV cache 2.00 GiB" in out.stderr
    assert "the cgroup's memory limit" in out.stderr
