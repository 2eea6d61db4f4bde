"""Which GGML type each tensor of a GGUF file gets, per file type, as llama.cpp's
``llama-quantize`` chooses (``src/llama-quant.cpp``: ``llama_tensor_get_type_impl`` and
``tensor_type_fallback``), for dense Llama / Qwen2 / Mistral decoders: no experts, no
importance matrix, not the 70B special case. Rewritten from reading it, not copied.

The rules that apply to the file types written here:

- 1-D tensors (norms, biases, rope_freqs) stay F32; so does everything in an F32 file.
- F16: every 2-D tensor F16 (the converter's ``--outtype f16``).
- The LM head (``output.weight``; ``token_embd.weight`` when the embeddings are tied, as
  llama.cpp quantizes a shared tensor as the output): Q8_0 in a Q8_0 file, else Q6_K
  (Q8_0 where its row length is not a multiple of the file type's block).
- Q4_K_M and Q5_K_M: ``attn_v`` and ``ffn_down`` of the layers where ``use_more_bits``
  holds are Q6_K; every other weight the file type's base (Q4_K, Q5_K).
- An untied ``token_embd.weight`` gets the base type.
- A row length that the chosen type's block does not divide falls back: Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, and to F16 where that block does not divide it either.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, LlamaFileType as F

from service.bench.model_shapes import TensorSpec

FILE_TYPES: dict[str, F] = {
    "F16": F.MOSTLY_F16, "Q8_0": F.MOSTLY_Q8_0, "Q4_0": F.MOSTLY_Q4_0,
    "Q4_K_M": F.MOSTLY_Q4_K_M, "Q5_K_M": F.MOSTLY_Q5_K_M, "Q6_K": F.MOSTLY_Q6_K,
}
"""The file types `scripts/make_models --type` writes (GGUF; ``bf16`` is the HF folder)."""

BASE_TYPE: dict[F, T] = {
    F.MOSTLY_F16: T.F16, F.MOSTLY_Q8_0: T.Q8_0, F.MOSTLY_Q4_0: T.Q4_0,
    F.MOSTLY_Q4_K_M: T.Q4_K, F.MOSTLY_Q5_K_M: T.Q5_K, F.MOSTLY_Q6_K: T.Q6_K,
}

_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that keep more bits in the _M mixes: the first
    eighth, the last eighth, and every third layer between.
    E.g. 16 layers: 0, 1, 4, 7, 10, 13, 14, 15."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or \
        (i_layer - n_layers // 8) % 3 == 2


def _block(t: T) -> int:
    return GGML_QUANT_SIZES[t][0]


def _fallback(t: T, ncols: int) -> T:
    if ncols % _block(t) == 0:
        return t
    t = _FALLBACK.get(t, T.F16)
    return t if ncols % _block(t) == 0 else T.F16


def tensor_type(spec: TensorSpec, ftype: F, n_layers: int, tied: bool) -> T:
    """The GGML type llama.cpp gives `spec` in a file of type `ftype`."""
    if len(spec.shape) < 2:
        return T.F32
    base = BASE_TYPE[ftype]
    if base == T.F16:
        return T.F16
    ncols = spec.shape[-1]
    name = spec.gguf_name
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if ncols % _block(base) != 0 or base == T.Q8_0:
            return T.Q8_0
        return _fallback(T.Q6_K, ncols)
    t = base
    if ftype in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and spec.layer is not None and \
            (name.endswith("attn_v.weight") or name.endswith("ffn_down.weight")) and \
            use_more_bits(spec.layer, n_layers):
        t = T.Q6_K
    return _fallback(t, ncols)
