import ctypes, time, statistics, torch
torch.set_num_threads(2)
lib = ctypes.CDLL('rd2.so')
P = ctypes.POINTER(ctypes.c_void_p); I = ctypes.POINTER(ctypes.c_int64)
lib.rd_call.argtypes = [P, I]; lib.rd_region.argtypes = [P, I, ctypes.c_int]
lib.rd_calls_cpp.argtypes = [P, I, ctypes.c_int]
lib.rd_call.restype = lib.rd_region.restype = lib.rd_calls_cpp.restype = ctypes.c_int64
sizes = []
for _ in range(30):
    for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
        sizes.append((n // 64, k // 2 * 64))
sizes.append((49152 // 64, 576 * 64))
def split(nb):  # blocks per thread, as the kernel splits (ceil for thread 0)
    a = (nb + 1) // 2; return a, nb - a
tot = sum(nb * bs for nb, bs in sizes)
arena = torch.empty(tot + (4 << 20), dtype=torch.uint8).fill_(1)
base = (arena.data_ptr() + (2 << 20) - 1) & ~((2 << 20) - 1)
# model order: tensor after tensor
mo_p, mo_n, off = [], [], 0
for nb, bs in sizes:
    a, b = split(nb); mo_p += [base + off, base + off + a * bs]; mo_n += [a * bs, b * bs]; off += nb * bs
# thread-major: region 0 holds thread 0's parts in order, region 1 thread 1's
t0 = sum(split(nb)[0] * bs for nb, bs in sizes)
tm_p, tm_n, o0, o1 = [], [], 0, 0
for nb, bs in sizes:
    a, b = split(nb); tm_p += [base + o0, base + t0 + o1]; tm_n += [a * bs, b * bs]; o0 += a * bs; o1 += b * bs
# balanced bytes (split by bytes, not blocks), model order
bb_p, bb_n, off = [], [], 0
for nb, bs in sizes:
    h = (nb * bs // 2) & ~255; bb_p += [base + off, base + off + h]; bb_n += [h, nb * bs - h]; off += nb * bs
def arr(p, n): return (ctypes.c_void_p * len(p))(*p), (ctypes.c_int64 * len(n))(*n)
L = {k: arr(*v) for k, v in {"model": (mo_p, mo_n), "thread-major": (tm_p, tm_n), "balanced": (bb_p, bb_n)}.items()}
big = torch.ones(16 << 20)
res = {}
C = len(sizes)
for r in range(15):
    for name, (p, n) in L.items():
        for mode in ("calls", "region"):
            big.sum(); t = time.perf_counter()
            if mode == "calls":
                lib.rd_calls_cpp(p, n, C)
            else:
                lib.rd_region(p, n, C)
            res.setdefault(f"{name}/{mode}", []).append(time.perf_counter() - t)
    big.sum(); t = time.perf_counter(); arena.view(torch.int64).sum(); res.setdefault("torch sum arena", []).append(time.perf_counter() - t)
print(f"{tot/1e6:.1f} MB")
for k, v in res.items(): print(f"  {k:28s} median {statistics.median(v)*1e3:.2f} ms {tot/statistics.median(v)/1e9:.1f} GB/s  best {tot/min(v)/1e9:.1f}")
x = torch.ones(64 << 20); x.sum(); ts = []
for _ in range(10):
    t = time.perf_counter(); x.sum(); ts.append(time.perf_counter() - t)
print(f"x.sum 256 MiB: best {x.numel()*4/min(ts)/1e9:.1f} median {x.numel()*4/statistics.median(ts)/1e9:.1f} GB/s")
