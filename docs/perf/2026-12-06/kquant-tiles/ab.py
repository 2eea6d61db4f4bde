"""Kernel microbenchmarks of 2026-12-06 (results.txt here has the figures): one checkout's
kernels/quant_linear_cpu.py a process; run it once per checkout, the checkouts taking turns.

usage: TREE=CHECKOUT ab.py rows N K ROWS [FORMATS]   calls of ROWS (comma-separated) rows on
                                                     one [N x K] weight in cache, best of 3
       TREE=CHECKOUT ab.py stream [FORMATS]          one-row calls over twelve [4096 x 4096]
                                                     weights, streamed from memory, best of 5
FORMATS: comma-separated among q4_1, q8_0 (with x8 / x16: int8 / int16 activations), q4_k,
q5_k, q6_k, i8_k (with x16), e.g. q4_kx16,q5_kx16; default all. ISA=avx2 takes the AVX2 build
(default avx512). TREE defaults to the checkout holding this file."""
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, os.environ.get("TREE") or str(pathlib.Path(__file__).resolve().parents[4]))
from kernels.quant_linear_cpu import quant_linear  # noqa: E402
from kernels.quant_pack import (pack_k_blocks, pack_q4_1, pack_q6_k_blocks, pack_q8_0,  # noqa: E402
                                with_int8_activations, with_int16_activations)

ISA = os.environ.get("ISA", "avx512")
ALL = ("q4_1", "q4_1x8", "q4_1x16", "q8_0", "q8_0x8", "q8_0x16", "q4_k", "q4_kx16", "q5_k",
       "q5_kx16", "q6_k", "q6_kx16", "i8_k", "i8_kx16")


def weight(fmt: str, n: int, k: int):
    """A random [n x k] weight in `fmt` (its integers and scales drawn in range)."""
    base, act = (fmt[:-3], with_int16_activations) if fmt.endswith("x16") else \
        (fmt[:-2], with_int8_activations) if fmt.endswith("x8") else (fmt, None)
    d = (torch.rand(n, k // 256) * 1e-3).half()
    if base in ("q4_1", "q8_0"):
        w = torch.randn(n, k) * 0.02
        p = pack_q4_1(w) if base == "q4_1" else pack_q8_0(w)
    elif base == "q6_k":
        p = pack_q6_k_blocks(torch.randint(0, 64, (n, k), dtype=torch.uint8),
                             torch.randint(-60, 60, (n, k // 16), dtype=torch.int8), d)
    elif base == "i8_k":
        sc = torch.randint(-60, 60, (n, k // 16), dtype=torch.int8)
        p = pack_k_blocks("i8_k", torch.randint(-128, 128, (n, k), dtype=torch.int8), sc,
                          torch.zeros_like(sc), d, d.clone())
    else:  # q4_k, q5_k
        top = 15 if base == "q4_k" else 31
        p = pack_k_blocks(base, torch.randint(0, top + 1, (n, k), dtype=torch.uint8),
                          torch.randint(0, 64, (n, k // 32), dtype=torch.uint8),
                          torch.randint(0, 64, (n, k // 32), dtype=torch.uint8), d,
                          (torch.rand(n, k // 256) * 1e-3).half())
    return act(p) if act else p


def rows(n: int, k: int, counts: list[int], formats: list[str]) -> None:
    torch.manual_seed(0)
    packs = {f: weight(f, n, k) for f in formats}
    for m in counts:
        x = torch.randn(m, k)
        for f, p in packs.items():
            quant_linear(x, p, ISA)
            best = 1e9
            for _ in range(3):
                t = time.perf_counter()
                quant_linear(x, p, ISA)
                best = min(best, time.perf_counter() - t)
            print(f"M={m} {f:8s} {best * 1e3:8.2f} ms {2 * m * n * k / best / 1e9:7.1f} GOP/s",
                  flush=True)


def stream(formats: list[str], n: int = 4096, k: int = 4096, copies: int = 12) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, k)
    for f in formats:
        ps = [weight(f, n, k) for _ in range(copies)]
        mb = sum(p.data.numel() * p.data.element_size() for p in ps) / 1e6
        for p in ps:
            quant_linear(x, p, ISA)
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for p in ps:
                quant_linear(x, p, ISA)
            best = min(best, time.perf_counter() - t)
        print(f"{f} one row, {copies} weights [{n}x{k}] streamed ({mb:.0f} MB): "
              f"{best * 1e3:.2f} ms, {mb / 1e3 / best:.1f} GB/s", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    if a[:1] == ["rows"] and len(a) in (4, 5):
        rows(int(a[1]), int(a[2]), [int(r) for r in a[3].split(",")],
             a[4].split(",") if len(a) == 5 else list(ALL))
    elif a[:1] == ["stream"] and len(a) in (1, 2):
        stream(a[1].split(",") if len(a) == 2 else ["q4_kx16", "q5_kx16", "q6_kx16", "q6_k"])
    else:
        sys.exit(__doc__)
