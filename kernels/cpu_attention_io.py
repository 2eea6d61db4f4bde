"""What the two CPU attention kernels (``decode_attention_cpu``, ``prefill_attention_cpu``)
take: the cache element types, their C entry points, and the dtype / device checks both
wrappers run before a call.

q and out are fp32; the caches are fp32, or 16-bit under fp32 activations
(``--kv-cache-dtype float16`` / ``bfloat16``): widened to fp32 as the kernels read them
(``kernels/csrc/half.h``), every sum fp32.
"""

from __future__ import annotations

import torch

__all__ = ["KV_DTYPES", "check_dtypes", "entry_name", "entry_names"]

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Cache dtypes the kernels read."""
_SUFFIX = {torch.float32: "f32", torch.float16: "f16kv", torch.bfloat16: "bf16kv"}


def entry_name(prefix: str, kv_dtype: torch.dtype) -> str:
    """The C function of kernel `prefix` for caches of kv_dtype, e.g.
    ``conveyor_decode_attention_bf16kv``. Raises ValueError for a dtype outside KV_DTYPES."""
    if kv_dtype not in _SUFFIX:
        raise ValueError(f"no {prefix} kernel for a {kv_dtype} cache; have {KV_DTYPES}")
    return f"{prefix}_{_SUFFIX[kv_dtype]}"


def entry_names(prefix: str) -> tuple[str, ...]:
    """Every cache dtype's C function of kernel `prefix` (for ctypes set-up)."""
    return tuple(entry_name(prefix, dtype) for dtype in KV_DTYPES)


def check_dtypes(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> None:
    """Raises ValueError unless q and out are fp32 on the CPU and both caches one dtype of
    KV_DTYPES on the CPU."""
    for name, t in (("q", q), ("out", out)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be float32 on the CPU, got {t.dtype} on {t.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != k_cache.dtype or t.dtype not in KV_DTYPES or t.device.type != "cpu":
            raise ValueError(f"{name} must be one of {KV_DTYPES} on the CPU (both caches "
                             f"alike), got {t.dtype} on {t.device}")
