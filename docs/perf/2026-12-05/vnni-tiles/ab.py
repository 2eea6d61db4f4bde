"""The harness of 2026-12-05 (commit 8798a95; results.txt here says how it was run): two builds of
kernels/csrc/quant_linear_cpu.cpp in one process, alternating each repetition, medians.

usage: ab.py A.so B.so ROWS [REPS]         a step's 120 q4_1x16 layers streamed, then the
                                            [49152 x 576] q8_0x16 LM head
       ab.py --hot A.so B.so ROWS          one [3072 x 576] and one [576 x 1536] layer again
                                            and again (weights in cache)
ROWS: comma-separated row counts."""
import ctypes
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))  # the repository root
from kernels import quant_pack as qp  # noqa: E402
import kernels.quant_linear_cpu as qlc  # noqa: E402

hot = sys.argv[1] == "--hot"
args = sys.argv[2:] if hot else sys.argv[1:]
libs = []
for path in args[:2]:
    lib = ctypes.CDLL(path)
    qlc._setup(lib)
    libs.append(lib)
rows = [int(v) for v in args[2].split(",")]
reps = int(args[3]) if len(args) > 3 else 9
torch.manual_seed(0)


def alternate(calls, reps):
    """Medians (s) of calls[0] and calls[1], run in turns (ABBA...)."""
    t = [[], []]
    for r in range(reps):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            qlc._library = lambda isa, lib=libs[i]: lib
            t0 = time.perf_counter()
            calls()
            t[i].append(time.perf_counter() - t0)
    return [statistics.median(v[1:]) for v in t]


def q4(n, k):
    return qp.with_int16_activations(qp.pack_q4_1(torch.randn(n, k) * 0.05))


if hot:
    for n, k in [(3072, 576), (576, 1536)]:
        p = q4(n, k)
        for m in rows:
            x = torch.randn(m, k)
            n_calls = max(3, 2000 // m)
            a, b = (v / n_calls * 1e6 for v in alternate(
                lambda: [qlc.quant_linear(x, p, "avx512") for _ in range(n_calls)], 9))
            print(f"[{n}x{k}] M={m:3d} A {a:8.1f} B {b:8.1f} us  A/B {a / b:5.2f}x", flush=True)
else:
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    layers = [q4(n, k) for _ in range(30) for n, k in shapes]
    lm = qp.with_int16_activations(qp.pack_q8_0(torch.randn(49152, 576) * 0.05))
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        for name, call in (
                ("layers", lambda: [qlc.quant_linear(xs[p.in_features], p, "avx512") for p in layers]),
                ("lm", lambda: qlc.quant_linear(xs[576], lm, "avx512"))):
            a, b = (v * 1e3 for v in alternate(call, reps))
            print(f"M={m:3d} {name:6s} A {a:7.2f} B {b:7.2f} ms  A/B {a / b:5.2f}x", flush=True)
