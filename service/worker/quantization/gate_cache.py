"""The quality gate's verdicts kept on disk, so that a server restarted on the same model and
machine does not score the gate's text again.

The gate (``quality_gate.run_gate``) feeds a text of about 1,000 tokens through the model
once with the exact plan and once per bucket that chose bf16. At the 8B shape on 2 Zen 4
cores that took 194 s of a 304 s start-up (2026-12-06, llama-3.1-8b-random-Q4_K_M.gguf,
every bucket timed afresh); the verdict is the same at every start-up as long as nothing it
depends on changed.

Kept in ``$CONVEYOR_CACHE_DIR/kernels/quality-gate-<key>.json`` (the kernel timings'
folder, ``kernels.cpu_build.cache_dir``). The key hashes everything the verdict depends on:

- the model's files: real path, size and modification time (``kv_fingerprint.model_identity``:
  a GGUF file, or a folder's config.json and safetensors);
- what the linear timings' key covers (``choice.cache_key``: the C++ kernel source, the CPU
  flags, torch's version, the thread count, the instruction-set caps);
- the source of the model's forward and of the gate (its text, its scoring, the bf16 path);
- the plan's paths, bucket by bucket, of every layer that runs bf16 somewhere;
- the text's length (capped by the KV cache) and the gate's thresholds.

A cache that cannot be read or written is skipped (the gate then runs, as without one).

Beside the verdicts, a refusal is remembered per model and machine alone (``refused_before``:
the key without the plan and the text's length): a model whose gate refused 16-bit compute
for some bucket on a text long enough to judge is not offered bf16 again there, so that the
next start-up neither dequantizes its blocks to a bf16 copy nor times that path. At the
Llama-3.2-1B shape (Q4_K_M) the copy cost 7.5 s of a 17.8 s start-up and 1.9 GB of peak
memory, only to be dropped by the stored verdict (2026-12-06, Zen 4).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kernels.cpu_build import cache_dir
from service.worker.kv_fingerprint import model_identity
from service.worker.quantization import choice, gate_text, paths, quality_gate
from service.worker.quantization.plan import DispatchLinear
from service.worker.quantization.quality_gate import GateResult, QualityGate

log = logging.getLogger(__name__)

GATE_CACHE_VERSION = 2
"""Bumped when the stored form or the meaning of a verdict changes."""

def _source_digest() -> bytes:
    from service.worker import model as model_module  # the forward every score runs

    h = hashlib.sha256()
    for module in (model_module, quality_gate, gate_text, paths):
        h.update(Path(module.__file__ or "").read_bytes())
    return h.digest()


def _key(model: str, gate: QualityGate, *parts: str) -> str | None:
    """16 hex digits of the model's files (``kv_fingerprint.model_identity``), the machine's
    timing key, the source, the thresholds and `parts`; None where the files cannot be read
    (then nothing is cached)."""
    try:
        identity = json.dumps(model_identity(model))
    except OSError:
        return None
    text = "\0".join([str(GATE_CACHE_VERSION), identity, choice.cache_key(),
                      _source_digest().hex(), json.dumps(dataclasses.asdict(gate)), *parts])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def gate_model_for(model: str | None, default: str, loaded_from: str | None,
                   given: bool) -> str | None:
    """The model path whose file keys the gate's verdict on disk, or None (nothing cached):
    the served model (`model`, else `default`) when the runner loads it itself (`given`
    False); when a caller hands it a loaded model (tests, benchmarks), only where `model` was
    named and that model was loaded from the same file (`loaded_from`, its GGUF path):
    a benchmark's runners over one file then score the gate once a machine, while a test's
    checkpoint, built or changed in memory, is always scored."""
    if not given:
        return model or default
    if model is None or loaded_from is None:
        return None
    try:
        return model if os.path.samefile(model, loaded_from) else None
    except OSError:
        return None


def gate_cache_key(model: str, linears: Sequence[object], tokens: int,
                   gate: QualityGate = QualityGate()) -> str | None:
    """The verdict's key: `_key` with the plan's bf16 layout and the text's length."""
    layout = [lin.names for lin in linears if isinstance(lin, DispatchLinear)
              and any(paths.PATHS[n].rounds_weights for n in lin.names)]
    return _key(model, gate, json.dumps(layout), str(tokens))


def _path(key: str) -> Path:
    return cache_dir() / f"quality-gate-{key}.json"


def refused_before(model: str, gate: QualityGate = QualityGate()) -> str | None:
    """The stored description of the gate's refusal for `model` on this machine (e.g.
    "rows 181+: top-1 99.4% of 1053, ..."), or None: never refused here, or unknown."""
    key = _key(model, gate, "refused")
    if key is None:
        return None
    try:
        text = json.loads(_path(key).read_text())["refused"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return text if isinstance(text, str) and text else None


def remember_refusal(model: str, results: Sequence[GateResult],
                     gate: QualityGate = QualityGate()) -> None:
    """Store the refusals among `results` that judged quality (enough positions: a refusal
    for a text too short, from a small KV cache, says nothing of the model); nothing when
    every bucket passed."""
    refused = [r for r in results if not r.passes(gate) and r.positions >= gate.min_positions]
    key = _key(model, gate, "refused")
    if refused and key is not None:
        _write(_path(key), {"version": GATE_CACHE_VERSION,
                            "refused": "; ".join(r.describe() for r in refused)})


def load_verdict(key: str) -> tuple[list[GateResult], list[int]] | None:
    """(each scored bucket's result, the buckets the text could not reach) stored under
    `key`, or None when there is none or it cannot be read."""
    try:
        data = json.loads(_path(key).read_text())
        results = [GateResult(**r) for r in data["results"]]
        unreachable = [int(b) for b in data["unreachable"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return results, unreachable


def store_verdict(key: str, results: Sequence[GateResult], unreachable: Sequence[int]) -> None:
    """Write the verdict; a failure is logged, never raised."""
    _write(_path(key), {"version": GATE_CACHE_VERSION,
                        "results": [dataclasses.asdict(r) for r in results],
                        "unreachable": list(unreachable)})


def _write(where: Path, data: dict) -> None:
    """Write `data` as JSON atomically (a temporary file renamed); a failure is logged."""
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where.parent, prefix=".quality-gate-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, where)
    except OSError as e:
        log.warning("quality gate verdict not cached (%s): the next start-up scores again", e)
