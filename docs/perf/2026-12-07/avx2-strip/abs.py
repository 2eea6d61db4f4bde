"""AVX2 calls of a few rows (decode of several sequences) through this checkout's avx2 build
and BASE's, in one process, taking turns, every output checked equal first: a Llama-3.2-1B
K-quant step's weights (`avx2-gemv/abx.py`'s: q4_k or q5_k layers, the Q6_K ffn_down /
attn_v of the `use_more_bits` layers and the Q6_K LM head; random integers and scales).
Figures: results.txt here.

usage: BASE=/path/to/older/checkout python abs.py FORMAT ROWS [ROUNDS]
FORMAT: q4_kx16 (a Q4_K_M file's mix) or q5_kx16 (Q5_K_M's); ROUNDS default 10.
(run from this checkout's root with its venv)"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "avx2-gemv"))
from abx import compare, step_weights  # noqa: E402  (abx registers BASE's build as "base")


def main() -> None:
    fmt, rows = sys.argv[1], int(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    ws = step_weights(fmt)
    print(f"{fmt} mix, {rows} rows, {len(ws)} calls")
    compare(ws, rows, rounds)


if __name__ == "__main__":
    main()
