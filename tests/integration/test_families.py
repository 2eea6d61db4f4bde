"""Every model family the README claims, against transformers' fp32 greedy generate.

For each small random checkpoint of ``tests.support.family_models`` (HF folders and GGUF
files), Conveyor's greedy completions (the offline ``LLM``) must equal transformers'
``generate(do_sample=False)``: each prompt alone and all in one batch, with
``quantization`` auto (the default) and none (dense fp32). The checkpoints decide every
greedy step by a margin (``MIN_MARGIN``, checked along transformers' own paths) far above
fp32 rounding, so a difference is a bug, never a coin toss.

Sliding windows shorter than the context (``WINDOWS``): prompts of 40 tokens and more, so
that prompt and completion outrun the window; the window is checked to change transformers'
own output. Two behaviours are accepted: the window honoured in attention (the long
prompts match), or the context capped to the window (the runner's ``max_model_len`` at most
the window: then a request beyond it is refused, and one within it matches).
"""

from __future__ import annotations

import pytest
import torch

from protocol import ContextLengthExceeded
from tests.support.family_models import (FAMILIES, GGUF_FAMILIES, WINDOWS, config_of,
                                         greedy_margin, write_family, write_family_gguf)

N_NEW = 24
MIN_MARGIN = 1e-3
"""The smallest gap between transformers' best and second-best logit at any greedy step
(logits of std ~12; fp32 summation order moves them by ~1e-5)."""

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "In 1492, Columbus",
    "def fib(n):",
    "Once upon a time there",
    "Paged attention splits the KV cache into fixed-size blocks.",
]
LONG_PROMPTS = [
    "Paged attention splits the KV cache into fixed-size blocks so that memory is not "
    "wasted on fragmentation, and continuous batching rebuilds the batch before every step "
    "of the model, so finished sequences leave at once.",
    "The history of the printing press begins in the fifteenth century, when movable type "
    "made books cheaper than ever before; within fifty years presses worked in more than two "
    "hundred cities across Europe.",
    "A sliding window lets each token attend only to the most recent tokens before it, which "
    "bounds the memory of the cache and the cost of attention, while the stacked layers still "
    "carry information from further back.",
]
CASES = list(FAMILIES) + list(GGUF_FAMILIES)
MODES = ["auto", None]   # None: dense fp32 ("none")

_state: dict[str, dict] = {}


def _oracle_model(path):
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def _generate(model, ids: list[int], n: int) -> tuple[list[int], float]:
    """transformers' greedy completion of `ids` (a final EOS dropped: a stop token is not
    part of our completion) and its smallest top-1 margin."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                         max_new_tokens=n, do_sample=False, pad_token_id=2,
                         output_logits=True, return_dict_in_generate=True)
    toks = out.sequences[0, len(ids):].tolist()
    if toks and toks[-1] == 2:
        toks.pop()
    return toks, greedy_margin(torch.cat(out.logits))


def _case(name: str, tmp_path_factory) -> dict:
    """The checkpoint, Conveyor's loaded model and transformers' completions of `name`,
    made once per module."""
    if name in _state:
        return _state[name]
    from service.worker.gguf_parse import shared_gguf_parse
    from service.worker.loader import load_model

    folder = tmp_path_factory.mktemp(name)
    if name in GGUF_FAMILIES:
        path = write_family_gguf(name, folder / f"{name}.gguf")
    else:
        path = write_family(name, folder / name)
    with shared_gguf_parse():   # a GGUF file parsed once for the loads
        loaded = load_model(str(path), torch.float32)
        # the auto modes serve a GGUF file's own blocks, as `conveyor serve` loads it
        blocks = load_model(str(path), torch.float32, blocks=True) \
            if path.suffix == ".gguf" else loaded
        model = _oracle_model(path)
    tok = loaded.tokenizer
    window = WINDOWS.get(name)
    prompts = [tok.encode(p) for p in (LONG_PROMPTS if window else PROMPTS)]
    want, margins = zip(*(_generate(model, ids, N_NEW) for ids in prompts))
    st = {"path": path, "loaded": loaded, "blocks": blocks, "prompts": prompts,
          "want": list(want),
          "margin": min(margins), "window": window}
    if window:
        assert all(len(ids) >= 2 * window for ids in prompts)
        # within the window: a short prompt and a completion that ends inside it
        short = [tok.encode(p)[:5] for p in PROMPTS]
        st["short"] = short
        short_want, short_margins = zip(*(_generate(model, ids, window - len(ids))
                                          for ids in short))
        st["short_want"] = list(short_want)
        st["margin"] = min(st["margin"], *short_margins)
        # the window matters: the same weights without it answer otherwise
        from transformers import AutoModelForCausalLM

        cfg = config_of(name)
        cfg.sliding_window = None
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
        full = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        full.load_state_dict(model.state_dict())
        st["full_want"] = [_generate(full, ids, N_NEW)[0] for ids in prompts]
    _state[name] = st
    return st


def _first_diff(got: list[int], want: list[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"first difference at completion position {i}: got {a}, transformers {b}"
    return f"lengths differ: got {len(got)} tokens, transformers {len(want)}"


def _llm(st: dict, mode: str | None):
    from service.engine.llm import LLM

    return LLM(loaded=st["blocks"] if mode in ("auto", "auto-a8") else st["loaded"],
               quantization=mode, num_kv_blocks=256, max_num_seqs=8,
               max_num_batched_tokens=512)


def _check(llm, prompts, want, max_tokens: list[int], label: str) -> None:
    """Each prompt alone, then all in one batch: the completions must be `want`."""
    problems = []
    for k, ids in enumerate(prompts):
        got = llm.generate_greedy([ids], max_tokens[k])[0]
        if got != want[k]:
            problems.append(f"prompt {k} alone: {_first_diff(got, want[k])}")
    outs = llm.generate(prompts, [{"temperature": 0.0, "max_tokens": m} for m in max_tokens])
    for k, got in enumerate(outs):
        if got != want[k]:
            problems.append(f"prompt {k} batched: {_first_diff(got, want[k])}")
    assert not problems, f"{label}: " + "; ".join(problems)


@pytest.mark.parametrize("mode", MODES, ids=["auto", "none"])
@pytest.mark.parametrize("name", CASES)
def test_greedy_matches_transformers(name, mode, tmp_path_factory):
    st = _case(name, tmp_path_factory)
    assert st["margin"] >= MIN_MARGIN, \
        f"{name}: the checkpoint decides a greedy step by {st['margin']:.2e} only"
    llm = _llm(st, mode)
    label = f"{name} ({mode or 'none'})"
    window = st["window"]
    if window is None:
        _check(llm, st["prompts"], st["want"], [N_NEW] * len(st["prompts"]), label)
        return
    assert st["full_want"] != st["want"], f"{name}: the window changes nothing here"
    if llm.runner.max_model_len <= window:   # the context capped to the window
        for ids in st["prompts"]:
            with pytest.raises(ContextLengthExceeded):
                llm.generate_greedy([ids], N_NEW)
        short = st["short"]
        _check(llm, short, st["short_want"], [window - len(ids) for ids in short], label)
    else:                                    # the window honoured in attention
        _check(llm, st["prompts"], st["want"], [N_NEW] * len(st["prompts"]), label)
