"""Sliding-window attention in a checkpoint's config, and the context that keeps it exact.

Mistral's ``sliding_window`` and Qwen2's (with ``use_sliding_window``; ``layer_types`` names
the layers it applies to) let a token attend to the previous `window` positions only: in
transformers' mask, key position k is seen from query position q when q - k < window. Our
attention kernels attend to the whole context, so a model with a window shorter than its
context is served with its context capped to the window (every sequence then fits in the
window, where both attentions are the same: vLLM's ``--disable-sliding-window`` does this).
"""

from __future__ import annotations


def sliding_window(config: object) -> int | None:
    """The window some layer of the model attends within, in tokens, or None (full
    attention everywhere)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "use_sliding_window", True) is False:  # Qwen2 keeps the field, off
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def context_limit(config: object, model_len: int) -> tuple[int, str | None]:
    """(the longest context served exactly, why it is below `model_len` or None)."""
    window = sliding_window(config)
    if window is None or window >= model_len:
        return model_len, None
    return window, (f"the model attends within a sliding window of {window} tokens, which "
                    f"our attention does not implement: the context is capped to {window} "
                    f"tokens (of {model_len}) so that every answer is exact")
