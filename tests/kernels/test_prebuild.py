"""kernels.prebuild: a server's C++ kernels are built side by side, before the model loads."""

from __future__ import annotations

import os
import threading

import pytest

from kernels import prebuild
from kernels import quant_linear_cpu as qlc


class _Meeting:
    """A fake library whose build waits until `parties` builds run at the same time."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def problem(self) -> str | None:
        self.barrier.wait()  # raises BrokenBarrierError after its timeout when run alone
        return None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores to build side by side")
def test_builds_run_side_by_side() -> None:
    barrier = threading.Barrier(2, timeout=10)
    fakes = [_Meeting(barrier), _Meeting(barrier)]
    futures = prebuild.start_builds(fakes)  # type: ignore[arg-type]
    assert [f.result(timeout=20) for f in futures] == [None, None]


def test_the_serving_libraries_are_the_ones_this_cpu_runs() -> None:
    libs = prebuild.cpu_serving_libraries()
    names = {lib.kernel.name for lib in libs}
    assert all(lib.kernel.runs_here() for lib in libs)
    assert {"decode_forward_cpu", "prefill_attention_cpu", "decode_attention_cpu",
            "gguf_pack_cpu", "row_argmax_cpu"} <= names
    assert ("quant_linear_cpu-avx2" in names) == qlc.VARIANTS["avx2"].runs_here()
    assert not any(name.endswith("amxemu") for name in names)  # never a test build
    for f in prebuild.start_builds(libs):  # then every one loads (or says why not)
        problem = f.result(timeout=600)
        assert problem is None or isinstance(problem, str)
