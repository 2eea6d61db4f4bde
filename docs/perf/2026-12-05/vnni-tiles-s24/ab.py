"""Session 24 harness (docs/perf/2026-12-05/vnni-tiles-s24/results.txt says how it was run). A/B: two builds of quant_linear_cpu in one process, alternating per repetition.
usage: ab.py A.so B.so Ms reps"""
import sys, time, statistics, ctypes, torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[4]))  # the repository root
from kernels import quant_pack as qp
import kernels.quant_linear_cpu as qlc
torch.manual_seed(0)
libs = []
for path in sys.argv[1:3]:
    lib = ctypes.CDLL(path); qlc._setup(lib); libs.append(lib)
Ms = [int(v) for v in sys.argv[3].split(',')]
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 9
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
layers = [qp.with_int16_activations(qp.pack_q4_1(torch.randn(n, k) * 0.05)) for _ in range(30) for n, k in shapes]
lm = qp.with_int16_activations(qp.pack_q8_0(torch.randn(49152, 576) * 0.05))
def once(lib, M, xs, which):
    qlc._library = lambda isa: lib
    t0 = time.perf_counter()
    if which == 'layers':
        for p in layers: qlc.quant_linear(xs[p.in_features], p, 'avx512')
    else:
        qlc.quant_linear(xs[576], lm, 'avx512')
    return time.perf_counter() - t0
for M in Ms:
    xs = {k: torch.randn(M, k) for k in (576, 1536)}
    for which in ('layers', 'lm'):
        t = [[], []]
        for r in range(reps):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                t[i].append(once(libs[i], M, xs, which))
        a, b = (statistics.median(v[1:]) * 1e3 for v in t)
        print(f"M={M:3d} {which:6s} A {a:7.2f} B {b:7.2f} ms  A/B {a/b:5.2f}x", flush=True)
