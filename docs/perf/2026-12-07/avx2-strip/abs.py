"""AVX2 calls of a few rows (decode of several sequences) through this checkout's avx2 build
and BASE's, in one process, taking turns, every output checked equal first: a Llama-3.2-1B
K-quant step's weights (q4_k or q5_k layers, the Q6_K ffn_down / attn_v of the
`use_more_bits` layers and the Q6_K LM head; random integers and scales). Figures:
results.txt here.

usage: BASE=/path/to/older/checkout python abs.py FORMAT ROWS [ROUNDS]
FORMAT: q4_kx16 (a Q4_K_M file's mix) or q5_kx16 (Q5_K_M's); ROUNDS default 10.
(run from this checkout's root with its venv)"""
import os
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs/perf/2026-12-06/kquant-tiles"))
import kernels.quant_linear_cpu as qlc  # noqa: E402
from ab import weight  # noqa: E402
from kernels.cpu_build import CppKernel, KernelLibrary  # noqa: E402

base_src = pathlib.Path(os.environ["BASE"]) / "kernels/csrc/quant_linear_cpu.cpp"
avx2 = qlc.VARIANTS["avx2"]
qlc.VARIANTS["base"] = CppKernel("quant_linear_cpu-avx2base", base_src, avx2.cxx_flags,
                                 avx2.requires)
qlc._LIBRARIES["base"] = KernelLibrary(qlc.VARIANTS["base"], qlc._setup)

H, F, KV, V, LAYERS = 2048, 8192, 512, 49152, 16
MORE_BITS = {0, 1, 4, 7, 10, 13, 14, 15}  # llama.cpp's use_more_bits layers of 16


def step_weights(lo: str) -> list:
    torch.manual_seed(0)
    ws = []
    for layer in range(LAYERS):
        hi = "q6_kx16" if layer in MORE_BITS else lo
        ws += [(weight(lo, H, H), H), (weight(lo, KV, H), H), (weight(hi, KV, H), H),
               (weight(lo, H, H), H), (weight(lo, F, H), H), (weight(lo, F, H), H),
               (weight(hi, H, F), F)]
    return ws + [(weight("q6_kx16", V, H), H)]


def main() -> None:
    fmt, rows = sys.argv[1], int(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    ws = step_weights(fmt)
    xs = {H: torch.randn(rows, H), F: torch.randn(rows, F)}
    for p, k in ws:
        assert torch.equal(qlc.quant_linear(xs[k], p, "avx2"), qlc.quant_linear(xs[k], p, "base"))

    def step(isa: str) -> float:
        t = time.perf_counter()
        for p, k in ws:
            qlc.quant_linear(xs[k], p, isa)
        return (time.perf_counter() - t) * 1e3

    res: dict[str, list[float]] = {"avx2": [], "base": []}
    for r in range(rounds):
        for isa in (("base", "avx2") if r % 2 else ("avx2", "base")):
            res[isa].append(step(isa))
    print(f"{fmt} mix, {rows} rows, {len(ws)} calls")
    for isa, name in (("base", "base"), ("avx2", "this checkout")):
        v = res[isa]
        print(f"{name}: best {min(v):.1f} ms, median {statistics.median(v):.1f} ms")
    print("this / base, round by round:",
          " ".join(f"{a / b:.2f}" for a, b in zip(res["avx2"], res["base"])))


if __name__ == "__main__":
    main()
