"""Compile the CPU kernels a server loads, all at once, while it starts.

Each C++ kernel is built on its first use (``kernels.cpu_build``): one ``g++`` at a time,
single-threaded, so a start on a machine without those builds cached (a first start, or
the first after the sources changed) compiled them one after another while the other cores
waited. ``start_builds`` hands every build to a pool of background threads (each waits on
its compiler process, so the builds run on as many cores as there are) before the model
loads; a later ``load()`` of a library waits for its build (``KernelLibrary``'s lock) and
a build already cached costs a hash and a ``g++ --version``.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

from kernels.cpu_build import KernelLibrary

__all__ = ["cpu_serving_libraries", "start_builds"]


def cpu_serving_libraries() -> list[KernelLibrary]:
    """The libraries a CPU server may load: the linear kernel's serving builds (the biggest
    first), the decode forward, both attention kernels, the GGUF packer and the row argmax.
    Builds this CPU cannot run are left out (their ``load`` fails at once)."""
    from kernels import decode_attention_cpu, decode_forward_cpu, gguf_pack_cpu
    from kernels import prefill_attention_cpu, row_argmax_cpu
    from kernels import quant_linear_cpu as qlc

    linear = [qlc.library(isa) for isa in (*qlc.ACT16_VARIANTS, *qlc.VARIANTS)]
    libs = [*linear, decode_forward_cpu.LIBRARY, prefill_attention_cpu.LIBRARY,
            decode_attention_cpu.LIBRARY, gguf_pack_cpu.LIBRARY, row_argmax_cpu.LIBRARY]
    return [lib for lib in libs if lib.kernel.runs_here()]


MAX_BUILDS = 4
"""Compilers run at once at most: the linear kernel's build peaks at about 370 MB of
memory (g++ 12), and the model loads beside them."""

_POOL: ThreadPoolExecutor | None = None


def start_builds(libraries: list[KernelLibrary] | None = None) -> list[Future]:
    """Build and load `libraries` (default ``cpu_serving_libraries()``) in background threads,
    as many at a time as this process may use cores (at most MAX_BUILDS). Returns the futures
    of their ``problem()`` (None, or why the build failed: the caller's own ``load`` raises it
    again). Never raises."""
    global _POOL
    if libraries is None:
        libraries = cpu_serving_libraries()
    if _POOL is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            os.cpu_count() or 1
        _POOL = ThreadPoolExecutor(max(1, min(cores, MAX_BUILDS)),
                                   thread_name_prefix="conveyor-kernel-build")
    return [_POOL.submit(lib.problem) for lib in libraries]
