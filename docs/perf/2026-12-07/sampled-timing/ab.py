"""The kernel choice's sampled timing against the whole layer, in one process.

For each path of a GGUF layer's format (fp32 activations, dequant-mm, int16 activations), the
whole layer's call and the estimate from samples (``choice.scaled_ms`` over the sample the
choice uses and, but for dequant-mm, the one-block sample) are timed by ``choice.measure_ms``,
the calls taking turns; the ratio estimate / whole is printed, twice per bucket.

    PYTHONPATH=. python docs/perf/2026-12-07/sampled-timing/ab.py FILE LAYERS HEADS KV_HEADS \
        ROWS[,ROWS] CLASS[,CLASS]
    e.g. ... /work/models/llama-3.2-1b-random-Q4_K_M.gguf 16 32 8 512,64 qkv,o,down,gate_up
"""
import sys

import torch

from service.worker.gguf_weights import read_linear_weights
from service.worker.quantization import choice
from service.worker.quantization.paths import PATHS, SAMPLE_BLOCK, LayerWeights


def sample(lw: LayerWeights, path, channels: int = choice.SAMPLE_CHANNELS):
    """The sample `choose_plan` times `path` on (its ``sample_of``)."""
    if path.writes_weight:
        channels = max(channels, -(-2 * choice._llc_bytes() // (4 * lw.shape[1])))
    return lw.timing_sample(channels)


def main() -> None:
    file, layers, heads, kv = sys.argv[1], *map(int, sys.argv[2:5])
    rows_list = [int(r) for r in sys.argv[5].split(",")]
    weights = read_linear_weights(file, layers, heads, kv)
    for cls in sys.argv[6].split(","):
        raw = weights.layers[(None if cls == "lm_head" else 0, cls)]
        lw = LayerWeights(None, None, native=raw)
        names = [f"cpp-{raw.fmt}-avx2", f"{raw.fmt}-dequant-mm", f"cpp-{raw.fmt}x16-avx2"]
        for rows in rows_list:
            x = torch.randn(rows, lw.shape[1])
            calls, scales, small_scales = {}, {}, {}
            for n in names:
                p = PATHS[n]
                whole = choice.bound_copies(p, lw, target_bytes=1)
                s, scales[n] = sample(lw, p)
                calls[n + "|whole"] = [lambda f=f: f(x) for f in whole]
                calls[n + "|sample"] = [lambda f=f: f(x) for f in
                                        choice.bound_copies(p, s, target_bytes=1)]
                if not p.writes_weight:
                    s2, small_scales[n] = sample(lw, p, SAMPLE_BLOCK)
                    calls[n + "|small"] = [lambda f=f: f(x) for f in
                                           choice.bound_copies(p, s2, target_bytes=1)]
            for rep in range(2):
                got = choice.measure_ms(calls)
                out = []
                for n in names:
                    whole = got[n + "|whole"]
                    est = choice.scaled_ms(got[n + "|sample"], scales[n], got.get(n + "|small"),
                                           small_scales.get(n, float("inf")))
                    out.append(f"{n}: whole {whole:.1f} estimate (x{scales[n]:.1f}) {est:.1f} "
                               f"({est / whole:.2f})")
                print(cls, tuple(lw.shape), rows, "rep", rep, "; ".join(out), flush=True)


if __name__ == "__main__":
    main()
