"""The harness of 2026-12-05 (commit 521596e): one q4_1 x int16 linear call again and again, from one build.

usage: loop.py LIB.so N K M SECONDS [THREADS]   prints us a call and G multiply-adds/s"""
import ctypes
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[4]))  # the repository root
from kernels import quant_pack as qp
import kernels.quant_linear_cpu as qlc
lib = ctypes.CDLL(sys.argv[1]); qlc._setup(lib); qlc._library = lambda isa: lib
n, k, m, secs = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
torch.set_num_threads(int(sys.argv[6]) if len(sys.argv) > 6 else 2)
p = qp.with_int16_activations(qp.pack_q4_1(torch.randn(n, k) * 0.05))
x = torch.randn(m, k)
t0 = time.perf_counter(); c = 0
while time.perf_counter() - t0 < secs:
    qlc.quant_linear(x, p, "avx512"); c += 1
dt = (time.perf_counter() - t0) / c
print(f"{dt*1e6:.1f} us/call, {n*k*m/dt/1e9:.1f} GMAC/s")
