"""The AVX2 one-row kernels of 2026-12-07, against an older checkout's, in one process: the
same packed weights (the shapes of a Llama-3.2-1B Q4_K_M decode step: q4_k layers, the Q6_K
ffn_down / attn_v of the `use_more_bits` layers and the Q6_K LM head, random integers and
scales) through this checkout's avx2 build and BASE's, taking turns, every output checked
equal first. Figures: results.txt here.

usage: BASE=/path/to/older/checkout python abx.py [ROUNDS]
(run from this checkout's root with its venv; ROUNDS default 20)"""
import os
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs/perf/2026-12-06/kquant-tiles"))
os.environ.setdefault("TREE", str(ROOT))
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


def step_weights(lo: str = "q4_kx16") -> list:
    """(weight, K) of each call of a 1B step: `lo` layers (a Q4_K_M file's q4_k, or q5_k for
    Q5_K_M), Q6_K in the use_more_bits layers' attn_v / ffn_down and the LM head."""
    torch.manual_seed(0)
    ws = []
    for layer in range(LAYERS):
        hi = "q6_kx16" if layer in MORE_BITS else lo
        ws += [(weight(lo, H, H), H), (weight(lo, KV, H), H), (weight(hi, KV, H), H),
               (weight(lo, H, H), H), (weight(lo, F, H), H), (weight(lo, F, H), H),
               (weight(hi, H, F), F)]
    return ws + [(weight("q6_kx16", V, H), H)]


def compare(ws: list, rows: int, rounds: int) -> None:
    """The calls of `ws` on `rows` rows through both builds (outputs checked equal first),
    taking turns for `rounds` rounds; prints best, median and the round-by-round ratios."""
    xs = {H: torch.randn(rows, H), F: torch.randn(rows, F)}

    def step(isa: str) -> float:
        t = time.perf_counter()
        for p, k in ws:
            qlc.quant_linear(xs[k], p, isa)
        return (time.perf_counter() - t) * 1e3

    for p, k in ws:
        assert torch.equal(qlc.quant_linear(xs[k], p, "avx2"), qlc.quant_linear(xs[k], p, "base"))
    res: dict[str, list[float]] = {"avx2": [], "base": []}
    for r in range(rounds):
        for isa in (("base", "avx2") if r % 2 else ("avx2", "base")):
            res[isa].append(step(isa))
    for isa, name in (("base", "base"), ("avx2", "this checkout")):
        v = res[isa]
        print(f"{name}: best {min(v):.2f} ms, median {statistics.median(v):.2f} ms")
    print("this / base, round by round:",
          " ".join(f"{a / b:.2f}" for a, b in zip(res["avx2"], res["base"])))


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    ws = step_weights()
    mb = sum(p.data.numel() * p.data.element_size() for p, _ in ws) / 1e6
    print(f"{len(ws)} one-row calls, {mb:.0f} MB of weight integers a step")
    compare(ws, 1, rounds)


if __name__ == "__main__":
    main()
