# Microbenchmark of kernels/quant_linear_cpu.py (2026-12-06): TREE=<checkout> ONLY=<formats> ISA=<avx512|avx2>
# python mmstream6.py [N K ROWS]; run once per checkout, the checkouts taking turns (results.txt).
import sys, os, time, torch
sys.path.insert(0, os.environ.get("TREE", "/work/main"))
from kernels.quant_pack import pack_k_blocks, pack_q6_k_blocks, with_int16_activations
from kernels.quant_linear_cpu import quant_linear
torch.manual_seed(0)
N, K, copies = 4096, 4096, 12
def kp(fmt, top):
    q = torch.randint(0, top + 1, (N, K), dtype=torch.uint8); sc = torch.randint(0, 64, (N, K // 32), dtype=torch.uint8); m = torch.randint(0, 64, (N, K // 32), dtype=torch.uint8)
    d = (torch.rand(N, K // 256) * 1e-3).half(); dm = (torch.rand(N, K // 256) * 1e-3).half()
    return with_int16_activations(pack_k_blocks(fmt, q, sc, m, d, dm))
x = torch.randn(1, K)
def q6(x16):
    p = pack_q6_k_blocks(torch.randint(0, 64, (N, K), dtype=torch.uint8), torch.randint(-60, 60, (N, K // 16), dtype=torch.int8), (torch.rand(N, K // 256) * 1e-3).half())
    return with_int16_activations(p) if x16 else p
for fmt, top in (("q4_k", 15), ("q6_k", 1), ("q6_k", 0)):
    ps = [kp(fmt, top) for _ in range(copies)] if fmt != "q6_k" else [q6(top) for _ in range(copies)]
    mb = sum(p.data.numel() * p.data.element_size() for p in ps) / 1e6
    for p in ps: quant_linear(x, p, "avx512")
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for p in ps: quant_linear(x, p, "avx512")
        best = min(best, time.perf_counter() - t)
    bw = torch.empty(int(2e8), dtype=torch.uint8); t = time.perf_counter(); bw.sum(); tb = time.perf_counter() - t
    print(f"{fmt} x16={top} one row, {copies} weights [{N}x{K}] streamed ({mb:.0f} MB): {best*1e3:.2f} ms, {mb/1e3/best:.1f} GB/s (plain read {0.2/tb:.1f} GB/s)", flush=True)
