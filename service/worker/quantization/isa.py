"""The instruction set the int8 kernels actually run, and so whether they can saturate.

Without VNNI, x86 int8 GEMMs multiply u8 x s8 with ``vpmaddubsw``, which adds the products
of two adjacent inputs in a saturating int16: 255 * 127 * 2 = 64,770 > 32,767. With VNNI
(``vpdpbusd``) the products go straight into int32. Whether VNNI is used is not only the
CPU's flag: each library can be held to an older instruction set by the environment,

    FBGEMM_ENABLE_INSTRUCTIONS   fbgemm (torch's quantized linear_dynamic): AVX2, AVX512,
                                 AVX512_256 have no VNNI; AVX512_E1, AVX512_E1_256 do;
                                 any other value is ignored by fbgemm
    ONEDNN_MAX_CPU_ISA           oneDNN (``torch._int_mm`` on the CPU), also spelled
    (DNNL_MAX_CPU_ISA)           DNNL_MAX_CPU_ISA: SSE41, AVX, AVX2, AVX512_CORE have none
    ATEN_CPU_CAPABILITY          ATen's own vector kernels: default, avx, avx2 are below
                                 AVX-512; taken as "emulate that CPU" for every library

so the decision (fbgemm's ``reduce_range``: 7-bit activations) is made from all three
(``int8_isa``). It is conservative: a cap that may or may not reach a library counts.
fbgemm's int8 GEMM has only an AVX-512 VNNI kernel (``avx512_vnni``); AVX-VNNI
(``avx_vnni``, 256-bit) serves oneDNN only. Whatever this says, every int8 path is also
probed with worst-case inputs at start-up (``saturation``), so a wrong guess here costs
accuracy or speed, never wrong answers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kernels.cpu_build import cpu_flags

__all__ = ["CAP_VARS", "Int8Isa", "int8_isa"]

CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
            "FBGEMM_ENABLE_INSTRUCTIONS", "MKL_ENABLE_INSTRUCTIONS")
"""The environment variables that cap an instruction set (also part of the timing cache's
key: capped kernels time differently)."""

_FBGEMM_NO_VNNI = frozenset({"AVX2", "AVX512", "AVX512_256"})
_ONEDNN_NO_VNNI = frozenset({"SSE41", "AVX", "AVX2", "AVX512_CORE"})
_ATEN_BELOW_AVX512 = frozenset({"default", "avx", "avx2"})


@dataclass(frozen=True)
class Int8Isa:
    """What the int8 kernels run here.

    fbgemm_vnni: fbgemm multiplies with VNNI (8-bit activations cannot saturate).
    onednn_vnni: oneDNN (``torch._int_mm``) may use VNNI.
    caps: the capping variables that are set, (name, value) pairs in CAP_VARS order.
    """

    fbgemm_vnni: bool
    onednn_vnni: bool
    caps: tuple[tuple[str, str], ...] = ()

    @property
    def reduce_range(self) -> bool:
        """Whether fbgemm's activations must take 7 bits (no VNNI in force)."""
        return not self.fbgemm_vnni

    def note(self) -> str:
        """One line, e.g. "fbgemm VNNI no (7-bit activations), oneDNN VNNI no; caps:
        FBGEMM_ENABLE_INSTRUCTIONS=AVX2"."""
        caps = ", ".join(f"{k}={v}" for k, v in self.caps) or "none"
        return (f"fbgemm VNNI {'yes' if self.fbgemm_vnni else 'no (7-bit activations)'}, "
                f"oneDNN VNNI {'yes' if self.onednn_vnni else 'no'}; ISA caps: {caps}")


def int8_isa(flags: frozenset[str] | None = None,
             env: Mapping[str, str] | None = None) -> Int8Isa:
    """The instruction set in force for int8 GEMMs.

    flags: the CPU's flags (default: /proc/cpuinfo via ``kernels.cpu_build.cpu_flags``);
    env: the environment (default: ``os.environ``). Values are compared case-blind.
    """
    flags = cpu_flags() if flags is None else flags
    env = os.environ if env is None else env
    caps = tuple((k, env[k]) for k in CAP_VARS if env.get(k))
    aten_capped = env.get("ATEN_CPU_CAPABILITY", "").strip().lower() in _ATEN_BELOW_AVX512
    fbgemm = env.get("FBGEMM_ENABLE_INSTRUCTIONS", "").strip().upper()
    onednn = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return Int8Isa(
        fbgemm_vnni="avx512_vnni" in flags and fbgemm not in _FBGEMM_NO_VNNI
        and not aten_capped,
        onednn_vnni=bool({"avx512_vnni", "avx_vnni"} & flags) and onednn not in _ONEDNN_NO_VNNI
        and not aten_capped,
        caps=caps)
