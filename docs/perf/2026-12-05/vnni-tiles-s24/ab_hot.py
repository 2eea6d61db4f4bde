"""Session 24 harness (docs/perf/2026-12-05/vnni-tiles-s24/results.txt says how it was run). A/B hot: one layer repeated (weights in cache), two builds alternating. usage: ab_hot.py A.so B.so Ms"""
import sys, time, statistics, ctypes, torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[4]))  # the repository root
from kernels import quant_pack as qp
import kernels.quant_linear_cpu as qlc
torch.manual_seed(0)
libs = []
for path in sys.argv[1:3]:
    lib = ctypes.CDLL(path); qlc._setup(lib); libs.append(lib)
Ms = [int(v) for v in sys.argv[3].split(',')]
for n, k in [(3072, 576), (576, 1536)]:
    p = qp.with_int16_activations(qp.pack_q4_1(torch.randn(n, k) * 0.05))
    for M in Ms:
        x = torch.randn(M, k); reps = max(3, 2000 // M)
        t = [[], []]
        for r in range(9):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                qlc._library = lambda isa, lib=libs[i]: lib
                t0 = time.perf_counter()
                for _ in range(reps): qlc.quant_linear(x, p, 'avx512')
                t[i].append((time.perf_counter() - t0) / reps)
        a, b = (statistics.median(v[1:]) * 1e6 for v in t)
        print(f"[{n}x{k}] M={M:3d} A {a:8.1f} B {b:8.1f} us  A/B {a/b:5.2f}x", flush=True)
