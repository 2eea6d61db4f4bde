"""Will the model fit? The memory a model needs, checked against what this process may use,
before anything large is allocated (start-up refuses, with what is needed and which flag
lowers it, instead of dying in an allocation or under the kernel's OOM killer).

Available memory: the smaller of the kernel's ``MemAvailable`` (``/proc/meminfo``) and the
room the memory limits of this process's cgroup and its ancestors leave (``cgroup_room``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

GiB = 1 << 30

BITS_PER_WEIGHT = {"q4_1": 5.0, "q8_0": 8.5, "q4_k": 4.625, "i8_k": 10.0, "q6_k": 6.5625,
                   "q5_k": 5.625, "q4_0": 4.5,
                   "f32": 32.0}
"""Bits a weight each packed format takes (scales included), for the estimate; a layer with
no format of ours is served as fp32 (32 bits)."""


BF16_COPY_SHARE = 0.25
"""``--cpu-bf16-compute auto`` holds a bf16 copy of a GGUF file's decoder-layer blocks (16 bits
a weight) only where the copy takes at most this share of the memory available at start-up:
1.9 GiB at Llama-3.2-1B's shape, but 13 GiB at Llama-3.1-8B's, which on a 24 GiB machine
would make the server's memory about 4x the 4.5 GB Q4_K_M file (llama.cpp's is the file plus
its KV cache). ``on`` takes the copy wherever it fits at all."""


class ModelDoesNotFit(ValueError):
    """The model's weights plus the requested KV cache need more memory than is available."""


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a served model needs, by part. transient: held only while loading (e.g. the
    dense copies of one layer of each class while kernels are timed)."""

    weights: int
    kv_cache: int
    swap_space: int
    transient: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.swap_space + self.transient


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def _own_cgroups(proc: Path = Path("/proc/self/cgroup")) -> list[tuple[str, str]]:
    """(version "1" or "2", path) of this process's memory cgroup(s) (/proc/self/cgroup)."""
    out = []
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            out.append(("2", parts[2]))
        elif "memory" in parts[1].split(","):
            out.append(("1", parts[2]))
    return out


def cgroup_room(root: Path = Path("/sys/fs/cgroup"),
                proc: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes the memory limits of this process's cgroup and its ancestors leave (the
    smallest room among them), or None where no level sets a limit. cgroup v2
    (``memory.max`` - ``memory.current``, mounted at `root` or `root`/unified) and v1
    (``memory.limit_in_bytes`` - ``memory.usage_in_bytes`` under `root`/memory)."""
    rooms = []
    for version, path in _own_cgroups(proc):
        bases = [root, root / "unified"] if version == "2" else [root / "memory"]
        for base in bases:
            if not base.is_dir():
                continue
            level = base / path.lstrip("/")
            while True:
                if version == "2":
                    limit = _read_int(level / "memory.max")
                    used = _read_int(level / "memory.current")
                else:
                    limit = _read_int(level / "memory.limit_in_bytes")
                    used = _read_int(level / "memory.usage_in_bytes")
                    if limit is not None and limit >= 1 << 60:  # v1's "no limit"
                        limit = None
                if limit is not None:
                    rooms.append(max(0, limit - (used or 0)))
                if level == base:
                    break
                level = level.parent
    return min(rooms) if rooms else None


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory available without swapping, bytes (None if unknown)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory() -> tuple[int | None, str]:
    """(bytes available to this process, where that figure comes from)."""
    found = [(v, what) for v, what in ((mem_available(), "MemAvailable"),
                                         (cgroup_room(), "the cgroup's memory limit"))
             if v is not None]
    if not found:
        return None, "unknown"
    return min(found)


def check_fits(need: MemoryNeed, model: str, *, available: int | None = None,
               source: str = "") -> None:
    """Raise ModelDoesNotFit, naming the parts, what is available and the flags that lower
    the need, when `need` exceeds the available memory (``available_memory`` by default)."""
    if available is None:
        available, source = available_memory()
        if available is None:
            return
    if need.total <= available:
        return
    parts = [f"weights {need.weights / GiB:.2f} GiB", f"KV cache {need.kv_cache / GiB:.2f} GiB"]
    if need.swap_space:
        parts.append(f"swap space {need.swap_space / GiB:.2f} GiB")
    if need.transient:
        parts.append(f"{need.transient / GiB:.2f} GiB while loading")
    room = available - need.weights - need.transient
    hint = (f"{room / GiB:.2f} GiB is left beside the weights: lower --kv-cache-memory and "
            "--swap-space (0 disables it) to fit in it" if room > 0 else
            "the weights alone do not fit: use a smaller model or a smaller quantization "
            "(a Q4_K_M or Q4_0 GGUF file is served in its own blocks by the default "
            "--quantization auto)")
    raise ModelDoesNotFit(
        f"{model} does not fit in memory: it needs {need.total / GiB:.2f} GiB ("
        + ", ".join(parts) + f"), {available / GiB:.2f} GiB is available ({source}); {hint}")


def dense_bytes(config: object, bytes_per_weight: float) -> int:
    """Bytes of a Llama-family model's parameters at `bytes_per_weight`, from its config."""
    c = config
    h, layers = c.hidden_size, c.num_hidden_layers  # type: ignore[attr-defined]
    heads, kv = c.num_attention_heads, c.num_key_value_heads  # type: ignore[attr-defined]
    d = getattr(c, "head_dim", None) or h // heads
    inter, vocab = c.intermediate_size, c.vocab_size  # type: ignore[attr-defined]
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter + 2 * h
    tied = getattr(c, "tie_word_embeddings", False)
    return math.ceil((layers * per_layer + vocab * h * (1 if tied else 2) + h)
                     * bytes_per_weight)


def served_bytes(blocks: object) -> int:
    """Bytes one GGUF linear weight (``RawBlocks``) takes in the format serving it
    (BITS_PER_WEIGHT; fp32 where it has none; a split weight each part in its own)."""
    fmt, k = blocks.fmt, blocks.in_features  # type: ignore[attr-defined]
    if fmt == "split":
        from kernels.gguf_pack import split_runs

        runs = split_runs(blocks.gguf_types) or []  # type: ignore[attr-defined]
        return sum(math.ceil(sum(blocks.raw[i].shape[0] for i in idx)  # type: ignore[attr-defined]
                             * k * BITS_PER_WEIGHT[f] / 8) for f, idx in runs)
    bits = BITS_PER_WEIGHT.get(fmt, 9.0) if fmt is not None else 32.0
    return math.ceil(blocks.out_features * k * bits / 8)  # type: ignore[attr-defined]


def weights_need(config: object, blocks: object | None, embedding_bytes: int = 0
                 ) -> tuple[int, int]:
    """(resident bytes of the served weights, bytes held only while loading).

    blocks: a GGUF file's linear layers as blocks (``GGUFLinearWeights``): each served in
        its packed format (BITS_PER_WEIGHT; fp32 where it has none), the embedding its
        file bytes (`embedding_bytes`); while loading, one dense fp32 copy of the first
        layer of each class and of the LM head (kernel timing). None: a dense fp32 model,
        which transformers builds beside ours while loading (twice its size at the peak).
    """
    if blocks is None:
        dense = dense_bytes(config, 4)
        return dense, dense
    layers = blocks.layers  # type: ignore[attr-defined]
    resident = embedding_bytes + 4 * 3 * config.hidden_size * config.num_hidden_layers  # type: ignore[attr-defined]
    for b in layers.values():
        resident += served_bytes(b)
    firsts = [b for (i, _), b in layers.items() if i in (0, None)]
    transient = sum(4 * b.out_features * b.in_features for b in firsts)
    return resident, transient


def served_need(hf_config: object, blocks: object | None, embedding_bytes: int,
                dtype_bytes: int, kv_dtype_bytes: int, block_size: int, num_kv_blocks: int,
                kv_cache_memory: int, swap_space_gib: float) -> MemoryNeed:
    """What a runner serving `hf_config` needs: its weights (`weights_need`; dense ones
    scaled from fp32 to `dtype_bytes` a weight), the KV cache (`num_kv_blocks` blocks of
    `block_size` tokens, or as many as `kv_cache_memory` bytes hold, at least 2, at
    `kv_dtype_bytes` an element) and the swap space (`swap_space_gib` GiB, whole blocks)."""
    c = hf_config
    heads = c.num_attention_heads  # type: ignore[attr-defined]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads  # type: ignore[attr-defined]
    per_block = (2 * c.num_hidden_layers * c.num_key_value_heads  # type: ignore[attr-defined]
                 * head_dim * kv_dtype_bytes * block_size)
    kv = per_block * num_kv_blocks if num_kv_blocks else \
        per_block * max(2, kv_cache_memory // per_block)
    dtype_scale = 1 if blocks is not None else dtype_bytes / 4
    weights, transient = weights_need(c, blocks, embedding_bytes)
    return MemoryNeed(int(weights * dtype_scale), kv,
                      int(swap_space_gib * (1 << 30)) // per_block * per_block,
                      int(transient * dtype_scale))


def bf16_copy_fits(need: MemoryNeed, blocks: object, model: str, *, any_share: bool = False,
                   available: int | None = None, source: str = "") -> tuple[bool, str]:
    """(whether a bf16 copy of a GGUF file's decoder-layer `blocks` (16 bits a weight: 1.9 GiB
    at Llama-3.2-1B's shape, 13 GiB at 8B's) fits beside `need` and, unless `any_share`,
    takes at most BF16_COPY_SHARE of the available memory (``available_memory`` by default);
    why not)."""
    layers = blocks.layers.items()  # type: ignore[attr-defined]
    copy = 2 * sum(b.out_features * b.in_features for (i, _), b in layers if i is not None)
    if available is None:
        available, source = available_memory()
    try:
        check_fits(MemoryNeed(need.weights + copy, need.kv_cache, need.swap_space,
                              need.transient), model, available=available, source=source)
    except ModelDoesNotFit as e:
        return False, (f"their bf16 copy ({copy / GiB:.2f} GiB) does not fit beside them "
                       f"({e})")
    if not any_share and available is not None and copy > BF16_COPY_SHARE * available:
        return False, (f"their bf16 copy ({copy / GiB:.2f} GiB) would take more than "
                       f"{round(100 * BF16_COPY_SHARE)}% of the {available / GiB:.2f} GiB "
                       f"available ({source}); --cpu-bf16-compute on takes it wherever it fits")
    return True, ""
