"""In-process peers on the same model and workload: transformers' `generate` (static
batches) and its continuous batching manager. They are not servers: each runs in a
worker thread of the benchmark process, fp32 on CPU, with torch using every core.
"""

from __future__ import annotations

import os
from pathlib import Path

from service.bench.hf_continuous import run_hf_continuous
from service.bench.hf_static import run_hf_static
from service.bench.plan import LoadPlan
from service.bench.record import RequestRecord
from service.worker.loader import default_model_path

PEERS = ("hf-static", "hf-continuous")

PEER_NOTES = {
    "hf-static": "transformers generate() on left-padded batches of max_num_seqs formed from "
                 "the requests waiting when the model is idle; TTFT/ITL from a streamer hook "
                 "(time each token was computed); E2E when the request's whole batch finished",
    "hf-continuous": "transformers continuous batching manager (init_continuous_batching, "
                     "requests added at their arrival times); TTFT/ITL from the manager's "
                     "per-token timestamps (time each token was computed); E2E when the "
                     "finished output reached the benchmark thread",
}


def load_hf_model(model: str | None = None):
    """The transformers model (fp32, CPU, eval mode) of a .gguf file or HF folder (None =
    the default SmolLM2 GGUF). Sets torch's intra-op threads to the machine's core count.

    Raises FileNotFoundError for a path that is neither.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    path = Path(model or default_model_path())
    if path.is_file() and path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32)
    elif path.is_dir() and (path / "config.json").is_file():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        raise FileNotFoundError(f"{path}: neither a .gguf file nor a folder with config.json")
    return hf.eval()


def run_peer(name: str, model, plan: LoadPlan, *, max_num_seqs: int, max_num_batched_tokens: int,
             pad_token_id: int, progress: bool = True) -> list[RequestRecord]:
    """Run `plan` on peer `name` (one of PEERS) in the calling thread.

    Raises ValueError for an unknown peer.
    """
    if name == "hf-static":
        return run_hf_static(model, plan, max_num_seqs=max_num_seqs, pad_token_id=pad_token_id,
                             progress=progress)
    if name == "hf-continuous":
        return run_hf_continuous(model, plan, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, progress=progress)
    raise ValueError(f"unknown peer {name!r}: one of {', '.join(PEERS)}")
