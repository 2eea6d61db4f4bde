# Microbenchmark of kernels/quant_linear_cpu.py (2026-12-06): TREE=<checkout> ONLY=<formats> ISA=<avx512|avx2>
# python mmk.py [N K ROWS]; run once per checkout, the checkouts taking turns (results.txt).
import sys, time, torch
sys.path.insert(0, __import__("os").environ.get("TREE", "/work/main"))
from kernels.quant_pack import pack_k_blocks, pack_q6_k_blocks, with_int16_activations
from kernels.quant_linear_cpu import quant_linear
import inspect
torch.manual_seed(0)
N, K = int(sys.argv[1]), int(sys.argv[2])
rows = [int(r) for r in sys.argv[3].split(",")]
isa = __import__("os").environ.get("ISA", "avx512")
def kp(fmt, top):
    if fmt == "i8_k":
        q = torch.randint(-128, 128, (N, K), dtype=torch.int8); sc = torch.randint(-60, 60, (N, K // 16), dtype=torch.int8); m = torch.zeros_like(sc)
    else:
        q = torch.randint(0, top + 1, (N, K), dtype=torch.uint8); sc = torch.randint(0, 64, (N, K // 32), dtype=torch.uint8); m = torch.randint(0, 64, (N, K // 32), dtype=torch.uint8)
    d = (torch.rand(N, K // 256) * 1e-3).half(); dm = (torch.rand(N, K // 256) * 1e-3).half()
    return pack_k_blocks(fmt, q, sc, m, d, dm)
packs = {"q4_k": kp("q4_k", 15), "q5_k": kp("q5_k", 31), "i8_k": kp("i8_k", 0),
 "q6_k": pack_q6_k_blocks(torch.randint(0, 64, (N, K), dtype=torch.uint8), torch.randint(-60, 60, (N, K // 16), dtype=torch.int8), (torch.rand(N, K // 256) * 1e-3).half())}
import os
only = os.environ.get("ONLY")
if only: packs = {k: v for k, v in packs.items() if k in only.split(",")}
for name in list(packs):
    packs[name + "x16"] = with_int16_activations(packs[name])
for m in rows:
    x = torch.randn(m, K)
    for name, p in packs.items():
        quant_linear(x, p, isa)
        best = 1e9
        for _ in range(3):
            t = time.perf_counter(); quant_linear(x, p, isa); best = min(best, time.perf_counter() - t)
        print(f"M={m} {name:8s} {best*1e3:8.2f} ms {2*m*N*K/best/1e9:7.1f} GOP/s", flush=True)
