# Microbenchmark of kernels/quant_linear_cpu.py (2026-12-06): TREE=<checkout> ONLY=<formats> ISA=<avx512|avx2>
# python mm.py [N K ROWS]; run once per checkout, the checkouts taking turns (results.txt).
import sys, time, torch
sys.path.insert(0, __import__("os").environ.get("TREE", "/work/main"))
from kernels.quant_pack import pack_q4_1, pack_q8_0, with_int16_activations, with_int8_activations
from kernels.quant_linear_cpu import quant_linear, available_isas
torch.manual_seed(0)
N, K = int(sys.argv[1]), int(sys.argv[2])
rows = [int(r) for r in sys.argv[3].split(",")]
w = torch.randn(N, K) * 0.02
isa = __import__("os").environ.get("ISA", "avx512") if "avx512" in available_isas() else "avx2"
print("isas", available_isas(), "using", isa, "threads", torch.get_num_threads())
packs = {"q4_1": pack_q4_1(w), "q8_0": pack_q8_0(w)}
for name in list(packs):
    packs[name + "x16"] = with_int16_activations(packs[name])
    packs[name + "x8"] = with_int8_activations(packs[name])
for m in rows:
    x = torch.randn(m, K)
    for name, p in packs.items():
        quant_linear(x, p, isa)
        best = 1e9
        for _ in range(3):
            t = time.perf_counter(); quant_linear(x, p, isa); best = min(best, time.perf_counter() - t)
        print(f"M={m} {name:8s} {best*1e3:8.2f} ms {2*m*N*K/best/1e9:7.1f} GOP/s")
    t = time.perf_counter(); torch.nn.functional.linear(x, w); best = time.perf_counter() - t
    print(f"M={m} f32 linear {best*1e3:8.2f} ms {2*m*N*K/best/1e9:7.1f} GFLOP/s")
