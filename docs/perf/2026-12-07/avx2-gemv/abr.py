"""Two and three rows of q6_k x16 calls (the Q6_K ffn_down of a 1B Q4_K_M file's
use_more_bits layers and its LM head, random integers and scales), this checkout's avx2 build
against BASE's, in one process, taking turns; every output checked equal first. Figures:
results.txt here.

usage: BASE=/path/to/older/checkout python abr.py [ROUNDS]   (from this checkout's root)"""
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from abx import qlc, weight  # noqa: E402  (abx registers BASE's build as the isa "base")


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    torch.manual_seed(0)
    ws = [(weight("q6_kx16", 2048, 8192), 8192) for _ in range(8)]
    ws.append((weight("q6_kx16", 49152, 2048), 2048))
    mb = sum(p.data.numel() for p, _ in ws) / 1e6
    for rows in (2, 3):
        xs = {8192: torch.randn(rows, 8192), 2048: torch.randn(rows, 2048)}
        for p, k in ws:
            assert torch.equal(qlc.quant_linear(xs[k], p, "avx2"),
                               qlc.quant_linear(xs[k], p, "base"))
        res: dict[str, list[float]] = {"avx2": [], "base": []}
        for r in range(rounds):
            for isa in (("base", "avx2") if r % 2 else ("avx2", "base")):
                t = time.perf_counter()
                for p, k in ws:
                    qlc.quant_linear(xs[k], p, isa)
                res[isa].append((time.perf_counter() - t) * 1e3)
        print(f"{rows} rows, q6_k x16, {mb:.0f} MB (8 ffn_down [2048 x 8192] + LM head "
              f"[49152 x 2048]): base median {statistics.median(res['base']):.2f} ms, this "
              f"{statistics.median(res['avx2']):.2f} ms; ratios "
              + " ".join(f"{a / b:.2f}" for a, b in zip(res["avx2"], res["base"])))


if __name__ == "__main__":
    main()
