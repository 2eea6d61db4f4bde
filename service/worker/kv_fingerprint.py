"""The KV fingerprint: a digest of everything that changes the bytes of a KV block.

Two engines whose fingerprints are equal compute the same K/V for the same tokens
(up to the kernel-choice noise that already exists between batch shapes in one
run), so they may share disk blocks; any difference keeps them apart (their blocks
live in different folders and are named by different digest chains).

What goes in (`kv_fingerprint_fields`):
- the model file's identity: resolved path, size and modification time (ns) of the
  .gguf file, or of config.json and every *.safetensors file of an HF folder;
- the model's dtype, the KV cache's (only where --kv-cache-dtype makes it differ), block
  size, layers, KV heads, head dim;
- rope: the inverse frequencies' bytes, attention scaling, rope_theta and rope_scaling;
- quantization mode (as served), batch invariance, the device type (cpu or cuda).
The linear kernel plan is left out on purpose: it is chosen per row count within one
run too, so the pool's prefix cache already mixes its outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from service.core.kv_digest import DIGEST_BYTES

__all__ = ["FORMAT_VERSION", "fingerprint_digest", "kv_fingerprint_fields", "model_identity"]

FORMAT_VERSION = 2  # of the block file and this fingerprint: bump to orphan old files
# (2: the checksum is SHA-256, was blake2b-256)


def model_identity(path: str | os.PathLike) -> list[dict[str, Any]]:
    """[{file, size, mtime_ns}] of a .gguf file, or of an HF folder's config.json and
    safetensors files (sorted by name). Raises OSError when `path` cannot be read."""
    p = Path(path).resolve()
    files = [p] if p.is_file() else sorted(
        f for f in p.iterdir() if f.name == "config.json" or f.suffix == ".safetensors")
    out = []
    for f in files:
        st = f.stat()
        out.append({"file": str(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def kv_fingerprint_fields(runner: Any, model_path: str | os.PathLike) -> dict[str, Any]:
    """The fingerprint's fields for a `ModelRunner` (or anything with its attributes:
    dtype, kv_dtype (optional: dtype), block_size, device, quantization, batch_invariant,
    model.num_layers, model.num_kv_heads, model.head_dim, loaded.inv_freq,
    loaded.attention_scaling, loaded.hf_config) serving the model at `model_path`."""
    loaded, model = runner.loaded, runner.model
    cfg = loaded.hf_config
    inv_freq = loaded.inv_freq.detach().to("cpu").contiguous()
    rope = hashlib.blake2b(inv_freq.numpy().tobytes(), digest_size=16).hexdigest()
    fields = {
        "format": FORMAT_VERSION,
        "model": model_identity(model_path),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "block_size": runner.block_size,
        "num_layers": model.num_layers,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "rope_inv_freq": rope,
        "attention_scaling": float(loaded.attention_scaling),
        "rope_theta": getattr(cfg, "rope_theta", None),
        "rope_scaling": repr(getattr(cfg, "rope_scaling", None)),
        "quantization": runner.quantization or "none",
        "batch_invariant": bool(runner.batch_invariant),
        "device": runner.device.type,
    }
    kv_dtype = getattr(runner, "kv_dtype", runner.dtype)
    if kv_dtype != runner.dtype:  # only then: a cache in the model's dtype keeps its digest
        fields["kv_cache_dtype"] = str(kv_dtype).removeprefix("torch.")
    return fields


def fingerprint_digest(fields: dict[str, Any]) -> bytes:
    """The 16-byte digest of the fields (canonical JSON, sorted keys)."""
    text = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.blake2b(text, digest_size=DIGEST_BYTES).digest()
