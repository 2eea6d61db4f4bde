"""A Llama-family model read from a GGUF file as the file's own blocks: no dense copy.

transformers' GGUF loader dequantizes every tensor to fp32 (4 bytes a weight: a 4.9 GB
Q4_K_M file of Llama-3.1-8B's shape becomes about 30 GB). Here the linear layers stay
``RawBlocks`` (views of the mapped file until packed for our kernels), the token embedding
a ``BlockEmbedding`` (rows dequantized when looked up), and only the norms and biases are
read as float32 tensors, under transformers' parameter names. transformers still gives the
config, tokenizer and chat template (``service.worker.loader``), and stays the oracle.
"""

from __future__ import annotations

import torch

from service.worker.block_embedding import BlockEmbedding
from service.worker.gguf_file import GGUFFile
from service.worker.gguf_weights import GGUFLinearWeights, read_linear_weights

_BIASES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
"""GGUF tensor stems of a decoder layer -> transformers' module names (for their biases)."""


def read_gguf_model(path: str, config: object) -> tuple[dict[str, torch.Tensor],
                                                         GGUFLinearWeights, BlockEmbedding]:
    """(norms and biases by transformers' names as float32, every linear layer as blocks,
    the token embedding as blocks) of the GGUF file at `path`, whose transformers config is
    `config`.

    Raises ValueError when a tensor the config implies is missing or of another shape.
    """
    cfg = config
    f = GGUFFile(path)
    layers, heads, kv_heads = (cfg.num_hidden_layers, cfg.num_attention_heads,  # type: ignore[attr-defined]
                               cfg.num_key_value_heads)  # type: ignore[attr-defined]
    linear = read_linear_weights(path, layers, heads, kv_heads, file=f)
    heads_of = {"attn_q": heads, "attn_k": kv_heads}
    weights: dict[str, torch.Tensor] = {"model.norm.weight": f.vector("output_norm.weight")}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = f.vector(f"blk.{i}.attn_norm.weight")
        weights[p + "post_attention_layernorm.weight"] = f.vector(f"blk.{i}.ffn_norm.weight")
        for stem, module in _BIASES.items():
            name = f"blk.{i}.{stem}.bias"
            if f.has(name):
                weights[p + module + ".bias"] = f.vector(name, heads_of.get(stem))
    kind, rows, hidden = f.raw("token_embd.weight")
    if hidden != cfg.hidden_size:  # type: ignore[attr-defined]
        raise ValueError(f"{path}: token_embd has {hidden} values a row, the config's hidden "
                         f"size is {cfg.hidden_size}")  # type: ignore[attr-defined]
    embedding = BlockEmbedding(kind, rows, hidden)
    return weights, linear, embedding
