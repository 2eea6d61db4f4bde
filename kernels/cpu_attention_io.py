"""What the two CPU attention kernels (``decode_attention_cpu``, ``prefill_attention_cpu``)
take: the cache element types and the code each kernel's one C entry point takes for them,
and the dtype / device checks both wrappers run before a call.

q and out are fp32; the caches are fp32, or 16-bit under fp32 activations
(``--kv-cache-dtype float16`` / ``bfloat16``): widened to fp32 as the kernels read them
(``kernels/csrc/half.h``), every sum fp32.
"""

from __future__ import annotations

import torch

__all__ = ["KV_DTYPES", "KV_DTYPE_CODES", "check_dtypes", "kv_dtype_code"]

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Cache dtypes the kernels read."""
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""The kernels' first argument for each cache dtype (``kernels/csrc/half.h``: ``KvDtype``;
the fused forward's ``kv_kind`` uses the same codes)."""


def kv_dtype_code(kv_dtype: torch.dtype) -> int:
    """The C kernels' code for caches of kv_dtype (``KV_DTYPE_CODES``). Raises ValueError for
    a dtype outside KV_DTYPES."""
    if kv_dtype not in KV_DTYPE_CODES:
        raise ValueError(f"no CPU attention kernel for a {kv_dtype} cache; have {KV_DTYPES}")
    return KV_DTYPE_CODES[kv_dtype]


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
