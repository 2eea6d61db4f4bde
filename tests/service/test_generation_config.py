"""Sampling defaults from the model's generation config (`--generation-config auto|vllm|PATH`)."""

from __future__ import annotations

import json

import pytest

from protocol import SamplingParams, decode_client_frame
from service.config import ModelConfig
from service.engine.sampling_defaults import SamplingDefaults, load_sampling_defaults

SMOL = "SmolLM2-135M-Instruct"


def test_unset_is_not_the_same_as_the_old_default_on_the_wire() -> None:
    unset = decode_client_frame('{"type": "generate", "id": "a", "prompt": "x"}').params
    one = decode_client_frame('{"type": "generate", "id": "a", "prompt": "x", '
                              '"params": {"temperature": 1.0, "top_p": 1.0}}').params
    assert unset.temperature is None and unset.top_p is None
    card = load_sampling_defaults("auto", None, SMOL)
    assert card.apply(unset).temperature == 0.2 and card.apply(unset).top_p == 0.9
    assert card.apply(one).temperature == 1.0 and card.apply(one).top_p == 1.0  # chosen: kept
    assert card.apply(card.apply(unset)) == card.apply(unset)


def test_the_embedded_gguf_gets_its_model_card_recommendation() -> None:
    d = load_sampling_defaults("auto", "/some/where/SmolLM2-135M-Instruct.Q4_1.gguf", SMOL)
    assert d.as_dict() == {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.0}
    assert "model card" in d.source
    assert load_sampling_defaults("auto", None, "SmolLM2-1.7B-Instruct").temperature == 0.2


def test_vllm_mode_and_unknown_models_are_neutral() -> None:
    assert load_sampling_defaults("vllm", None, SMOL) == SamplingDefaults()
    other = load_sampling_defaults("auto", None, "MyLlama")
    assert other.as_dict() == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def test_a_folders_generation_config_json_wins_in_auto(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "min_p": None}))
    d = load_sampling_defaults("auto", str(tmp_path), SMOL)
    assert (d.temperature, d.top_p, d.top_k, d.min_p) == (0.6, 0.95, 20, 0.0)
    params = d.apply(SamplingParams(top_k=5))
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 5)


def test_a_path_names_the_folder_or_the_file(tmp_path) -> None:
    f = tmp_path / "generation_config.json"
    f.write_text('{"temperature": 0.7}')
    assert load_sampling_defaults(str(tmp_path), None, SMOL).temperature == 0.7
    assert load_sampling_defaults(str(f), None, SMOL).top_p == 1.0
    with pytest.raises(FileNotFoundError):
        load_sampling_defaults(str(tmp_path / "nope"), None, SMOL)
    f.write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="temperature"):
        load_sampling_defaults(str(f), None, SMOL)
    f.write_text("[1")
    with pytest.raises(ValueError, match="generation config"):
        load_sampling_defaults(str(f), None, SMOL)


def test_config_and_cli_carry_the_option() -> None:
    assert ModelConfig().generation_config == "auto"
    with pytest.raises(ValueError, match="generation_config"):
        ModelConfig(generation_config="")
    from service.engine_args import build_parser, engine_config

    a = build_parser().parse_args(["serve", "--generation-config", "vllm"])
    assert engine_config(a).model.generation_config == "vllm"


def test_sampler_reads_unset_values_as_neutral() -> None:
    from service.worker.sampler import build_sampling_tensors

    t = build_sampling_tensors([SamplingParams(), SamplingParams(temperature=0.0, top_k=3)])
    assert t.temperature.tolist() == [1.0, 0.0] and t.top_k.tolist() == [0, 3]
    assert t.top_p.tolist() == [1.0, 1.0] and t.min_p.tolist() == [0.0, 0.0]


def test_max_new_tokens_is_the_default_limit_never_a_cap(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 40, "top_k": 5}')
    d = load_sampling_defaults("auto", str(tmp_path), SMOL)
    assert d.max_new_tokens == 40 and d.top_k == 5
    assert d.apply(SamplingParams(), 10, 8192).max_tokens == 40
    assert d.apply(SamplingParams(), 8180, 8192).max_tokens == 12  # the context caps it
    assert d.apply(SamplingParams(), 9000, 8192).max_tokens == 1  # admission then refuses
    assert d.apply(SamplingParams(max_tokens=500), 10, 8192).max_tokens == 500  # explicit wins
    assert d.apply(SamplingParams(max_tokens=3), 10, 8192).max_tokens == 3
    neutral = SamplingDefaults()
    # without max_new_tokens: the room the context leaves (vLLM's rule)
    assert neutral.apply(SamplingParams(), 8180, 8192).max_tokens == 12
    assert neutral.apply(SamplingParams(), 10, 8192).max_tokens == 8182
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingDefaults(max_new_tokens=0)


def test_repetition_penalty_default_comes_from_the_generation_config(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text('{"repetition_penalty": 1.3}')
    d = load_sampling_defaults("auto", str(tmp_path), SMOL)
    assert d.repetition_penalty == 1.3
    assert d.apply(SamplingParams()).repetition_penalty == 1.3
    assert d.apply(SamplingParams(repetition_penalty=1.0)).repetition_penalty == 1.0  # set wins
    assert "repetition_penalty" not in d.as_dict()  # hello's sampling_defaults: PROTOCOL.md's four
    assert SamplingDefaults().apply(SamplingParams()).repetition_penalty == 1.0
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingDefaults(repetition_penalty=0.0)


def test_top_k_1_is_warned_of() -> None:
    assert SamplingDefaults(top_k=1).warnings() and "greedily" in SamplingDefaults(
        top_k=1).warnings()[0]
    assert not SamplingDefaults(top_k=2).warnings() and not SamplingDefaults().warnings()
