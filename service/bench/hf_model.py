"""Write a random-weight Hugging Face folder of a model shape: config.json,
generation_config.json, bf16 safetensors (sharded beyond ``SHARD_BYTES``, with
``model.safetensors.index.json``) and SmolLM2-135M-Instruct's tokenizer files.

The safetensors files are written by hand, tensor by tensor in chunks (the format: an
8-byte little-endian header length, a JSON header of names, dtypes, shapes and byte
offsets, then the raw data), so the peak memory is a chunk, not a shard.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from service.bench.gguf_writer import default_std
from service.bench.model_shapes import ModelShape, TensorSpec, hf_config, tensors

SHARD_BYTES = 5 * 10**9     # transformers' save_pretrained default
CHUNK_VALUES = 16 << 20


def _bf16_chunks(spec: TensorSpec, rng: np.random.Generator, std: float):
    """The tensor's bf16 bytes, rows at a time."""
    if spec.kind == "norm":
        yield torch.ones(spec.shape, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
        return
    rows, ncols = math.prod(spec.shape[:-1]), spec.shape[-1]
    step = max(1, CHUNK_VALUES // ncols)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        x = torch.from_numpy(rng.standard_normal((n, ncols), dtype=np.float32) * np.float32(std))
        yield x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def _shards(specs: list[TensorSpec]) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        n = spec.numel * 2
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def _write_safetensors(path: Path, specs: list[TensorSpec], seed: int, index: dict[str, int],
                       std_of: Callable[[TensorSpec], float]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        n = spec.numel * 2
        header[spec.hf_name] = {"dtype": "BF16", "shape": list(spec.shape),
                                "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)               # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            rng = np.random.default_rng([seed, index[spec.gguf_name]])
            for chunk in _bf16_chunks(spec, rng, std_of(spec)):
                f.write(chunk)


def save_tokenizer(folder: Path, tokenizer_gguf: str | Path) -> None:
    """SmolLM2's tokenizer, read through transformers from its GGUF file, saved as HF
    tokenizer files in `folder`."""
    from transformers import AutoTokenizer

    src = Path(tokenizer_gguf)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name, local_files_only=True)
    tok.save_pretrained(folder)


def write_hf_folder(folder: str | Path, s: ModelShape, *, seed: int = 0,
                    tokenizer_gguf: str | Path,
                    std_of: Callable[[TensorSpec], float] = default_std) -> list[Path]:
    """Write the HF folder of shape `s` (bf16 weights drawn from `seed`, each tensor from
    the same stream index as in the GGUF writer); returns the safetensors files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    all_specs = tensors(s)
    index = {spec.gguf_name: i for i, spec in enumerate(all_specs)}
    specs = [spec for spec in all_specs if spec.hf_name is not None]
    shards = _shards(specs)
    files = []
    weight_map = {}
    for k, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else \
            f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(folder / name, shard, seed, index, std_of)
        files.append(folder / name)
        weight_map.update({spec.hf_name: name for spec in shard})
    if len(shards) > 1:
        total = sum(spec.numel * 2 for spec in specs)
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(hf_config(s), indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}, indent=2) + "\n")
    save_tokenizer(folder, tokenizer_gguf)
    return files
