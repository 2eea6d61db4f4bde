"""Which attention the torch backend runs on the CPU: our C++ kernels or SDPA (policy only).

`--cpu-decode-kernel auto|cpp|sdpa` (`ModelConfig.cpu_decode_kernel`); "cpp" is our two C++
kernels, `kernels.decode_attention_cpu` for decode rows and `kernels.prefill_attention_cpu`
for prefill chunks (where it covers the block size: else SDPA), built with g++ on first use.
The default ("auto") is "cpp" wherever they build and cover the model (fp32 activations), so
the default mode's prefill attention is the C++ kernel, with bf16 products where the CPU has
them (`choose_prefill_bf16_dot`).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def _build_problem() -> str | None:
    """Why one of the C++ attention kernels does not build or load here, or None."""
    from kernels import decode_attention_cpu as dac
    from kernels import prefill_attention_cpu as pac

    return dac.build_problem() or pac.build_problem()


def check_decode_kernel_builds() -> None:
    """Raises ValueError when a C++ attention kernel does not build (cpu_decode_kernel cpp);
    called before the model loads, to fail in a second rather than after it."""
    problem = _build_problem()
    if problem is not None:
        raise ValueError(f"cpu_decode_kernel 'cpp' (--cpu-decode-kernel cpp) cannot be "
                         f"used: {problem}")


def choose_decode_kernel(setting: str, backend: str, device: torch.device, dtype: torch.dtype,
                         num_heads: int, num_kv_heads: int, head_dim: int,
                         kv_dtype: torch.dtype | None = None) -> str:
    """The decode attention for this model: "cpp" or "sdpa" on the torch backend, "none" on
    Triton (which runs its own).

    setting: "auto" (cpp when it applies and builds, else sdpa: a failed build is logged as
    a warning), "cpp" or "sdpa". backend: "torch" or "triton" (`kernels.resolve_backend`).
    kv_dtype: the KV cache's dtype (None: dtype).

    Raises:
        ValueError: setting "cpp" where the kernel does not apply (not the CPU torch
            backend, or a dtype / head layout it lacks) or does not build.
    """
    from kernels import decode_attention_cpu as dac

    build_failed = False
    if backend != "torch":
        applies, why = False, f"the {backend} kernels run attention"
    elif device.type != "cpu":
        applies, why = False, f"device {device} is not the CPU"
    elif not dac.supports(dtype, num_heads, num_kv_heads, head_dim, kv_dtype):
        applies, why = False, (f"dtype {dtype} (KV cache {kv_dtype or dtype}) with "
                               f"{num_heads}/{num_kv_heads} heads of {head_dim} is not covered "
                               f"(fp32, a cache in {dac.KV_DTYPES}, D in {dac.HEAD_DIMS})")
    else:
        applies, why = True, ""
        problem = _build_problem() if setting != "sdpa" else None
        if problem is not None:
            applies, why, build_failed = False, problem, True
    if setting == "cpp" and not applies:
        raise ValueError(f"cpu_decode_kernel 'cpp' (--cpu-decode-kernel cpp) cannot be "
                         f"used: {why}")
    if backend != "torch":
        return "none"
    if setting == "auto" and not applies:
        # a failed build deserves a warning; a device or model it does not cover does not
        log.log(logging.WARNING if build_failed else logging.INFO,
                "decode attention: torch SDPA (the C++ kernel is not used: %s)", why)
        return "sdpa"
    return "sdpa" if setting == "sdpa" else "cpp"


def choose_prefill_bf16_dot(decode_kernel: str, quantization: str | None,
                            batch_invariant: bool) -> bool:
    """Whether prefill chunks' attention multiplies in bf16 (``kernels.prefill_attention_cpu``
    with bf16_dot: q, K, V and probabilities rounded to bf16, fp32 sums, about 2x the fp32
    kernel at long contexts on a Zen 4) for chunks whose context reaches
    ``BF16_DOT_MIN_CONTEXT`` tokens (shorter prompts keep the fp32 kernel's bits).

    Only with the C++ kernels (decode_kernel "cpp"), where the CPU multiplies bf16 in hardware
    (``bf16_dot_available``: AVX512-BF16, no ISA cap hiding it; never emulated), and in the
    modes that already trade exactness for speed: never with quantization None
    (``--quantization none``, the fp32 oracle) or under batch invariance (its rows all go
    through the decode kernel).
    """
    if decode_kernel != "cpp" or quantization is None or batch_invariant:
        return False
    from kernels import prefill_attention_cpu as pac

    return pac.bf16_dot_available()
