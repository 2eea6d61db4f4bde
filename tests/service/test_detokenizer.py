"""IncrementalDetokenizer against the real SmolLM2 tokenizer's own full decode."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models

from service.engine.detokenizer import DetokenizerStep, IncrementalDetokenizer

EOS_ID = 2  # <|im_end|> in SmolLM2-Instruct
REPLACEMENT = "\ufffd"

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 42, isn't it?",
    "emoji": "Party 🎉🎉 time 😀👍🏽 ok 🇫🇷!",
    "cjk": "日本語のテキスト。中文文本，한국어 텍스트.",
    "mixed": "Café ça va? naïve résumé — “quotes” 😀 日本 x² ∑ e\u0301 tab\tnew\nline",
}


@pytest.fixture(scope="session")
def smol_tokenizer() -> Any:
    """The SmolLM2-135M-Instruct tokenizer alone (no weights), from the installed GGUF file."""
    from transformers import AutoTokenizer

    from service.worker.loader import default_model_path

    path = Path(default_model_path())
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def chat_prompt(smol_tokenizer: Any) -> list[int]:
    """Prompt ids of a one-turn chat, ending with the assistant generation prompt."""
    ids = smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say something."}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed ids `chunk` at a time until the end or a stop string; (step texts, stop_hit)."""
    texts: list[str] = []
    for i in range(0, len(ids), chunk):
        out = det.step(ids[i : i + chunk])
        texts.append(out.text)
        if out.stop_hit is not None:
            return texts, out.stop_hit
    return texts, None


def reference_cut(tok: Any, ids: list[int], stop: list[str]) -> tuple[str, str | None]:
    """What the output must be: generation stops at the first token after which the decode
    contains a stop string; the text is cut before the earliest occurrence (ties: shorter)."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        hits = [(text.find(s), len(s), s) for s in stop if s in text]
        if hits:
            start, _, s = min(hits)
            return text[:start], s
    return tok.decode(ids, skip_special_tokens=True), None


# -- round trips ---------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_round_trip_matches_full_decode(
    smol_tokenizer: Any, chat_prompt: list[int], name: str, chunk: int
) -> None:
    ids = encode(smol_tokenizer, TEXTS[name]) + [EOS_ID]
    det = IncrementalDetokenizer(smol_tokenizer, chat_prompt)
    texts, stop_hit = stream(det, ids, chunk)
    texts.append(det.flush())
    assert stop_hit is None
    assert "".join(texts) == smol_tokenizer.decode(ids, skip_special_tokens=True) == TEXTS[name]
    assert det.output_text == TEXTS[name]
    for piece in texts:
        assert REPLACEMENT not in piece
        piece.encode("utf-8")  # raises on a lone surrogate


@pytest.mark.model
@pytest.mark.parametrize("name", ["emoji", "cjk"])
def test_partial_characters_are_held_back(smol_tokenizer: Any, name: str) -> None:
    ids = encode(smol_tokenizer, TEXTS[name])
    # The test only means something if some token really ends inside a character.
    partial = [k for k in range(1, len(ids)) if smol_tokenizer.decode(ids[:k]).endswith(REPLACEMENT)]
    assert partial, "expected byte-level tokens that split a character"
    det = IncrementalDetokenizer(smol_tokenizer, [])
    for k, token in enumerate(ids, start=1):
        det.step([token])
        # Everything emitted so far is a prefix of the text made of complete characters.
        assert smol_tokenizer.decode(ids[:k]).startswith(det.output_text)
        if k in partial:
            assert not det.output_text.endswith(REPLACEMENT)
            assert len(det.output_text) < len(smol_tokenizer.decode(ids[:k]))


@pytest.mark.model
def test_flush_releases_an_unfinished_character(smol_tokenizer: Any) -> None:
    ids = encode(smol_tokenizer, "Hi 😀")
    cut = next(k for k in range(1, len(ids)) if smol_tokenizer.decode(ids[:k]).endswith(REPLACEMENT))
    det = IncrementalDetokenizer(smol_tokenizer, [])
    texts, _ = stream(det, ids[:cut])
    assert "".join(texts) == "Hi"
    # Length limit hit mid-character: flush gives what the full decode gives.
    tail = det.flush()
    assert "Hi" + tail == smol_tokenizer.decode(ids[:cut])
    assert tail.endswith(REPLACEMENT)
    assert det.flush() == ""
    with pytest.raises(RuntimeError):
        det.step([EOS_ID])


@pytest.mark.model
def test_prompt_ending_inside_a_character(smol_tokenizer: Any) -> None:
    ids = encode(smol_tokenizer, "Hi 😀 there")
    cut = next(k for k in range(1, len(ids)) if smol_tokenizer.decode(ids[:k]).endswith(REPLACEMENT))
    det = IncrementalDetokenizer(smol_tokenizer, ids[:cut])
    texts, _ = stream(det, ids[cut:])
    texts.append(det.flush())
    # No prompt text leaks into the output: it decodes as the output ids alone.
    assert "".join(texts) == smol_tokenizer.decode(ids[cut:])
    assert "Hi" not in "".join(texts)


@pytest.mark.model
def test_first_token_decodes_after_the_prompt(smol_tokenizer: Any, chat_prompt: list[int]) -> None:
    ids = encode(smol_tokenizer, " world")
    det = IncrementalDetokenizer(smol_tokenizer, chat_prompt)
    assert det.step(ids) == DetokenizerStep(" world", None)


def test_leading_space_kept_with_a_sentencepiece_style_decoder() -> None:
    # Metaspace decoding drops the leading space of the first token of any decode.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    bos = tok.token_to_id("<s>")
    assert tok.decode([2, 3]) == "world!"
    det = IncrementalDetokenizer(tok, [bos, 1])
    assert det.step([2]).text == " world"
    assert det.step([3]).text == "!"
    # Without a prompt there is no left context: same as the plain decode.
    det = IncrementalDetokenizer(tok, [])
    assert "".join(det.step([t]).text for t in [2, 3]) == "world!"


# -- special tokens ---------------------------------------------------------------


@pytest.mark.model
def test_special_tokens_are_skipped(smol_tokenizer: Any, chat_prompt: list[int]) -> None:
    special = sorted(smol_tokenizer.backend_tokenizer.get_added_tokens_decoder())
    assert EOS_ID in special and smol_tokenizer.convert_ids_to_tokens(EOS_ID) == "<|im_end|>"
    ids = encode(smol_tokenizer, "Hi") + special + encode(smol_tokenizer, " there 😀") + [EOS_ID, EOS_ID]
    det = IncrementalDetokenizer(smol_tokenizer, chat_prompt)
    texts, _ = stream(det, ids)
    texts.append(det.flush())
    assert "".join(texts) == smol_tokenizer.decode(ids, skip_special_tokens=True) == "Hi there 😀"


@pytest.mark.model
def test_special_tokens_kept_when_asked(smol_tokenizer: Any) -> None:
    ids = encode(smol_tokenizer, "Hi") + [EOS_ID] + encode(smol_tokenizer, " there")
    det = IncrementalDetokenizer(smol_tokenizer, [], skip_special_tokens=False)
    texts, _ = stream(det, ids)
    texts.append(det.flush())
    assert "".join(texts) == smol_tokenizer.decode(ids, skip_special_tokens=False) == "Hi<|im_end|> there"


# -- stop strings -----------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("stop", ["END OF", "swer i", " is 4", "😀 日"])
def test_stop_string_across_tokens(smol_tokenizer: Any, chat_prompt: list[int], stop: str) -> None:
    text = "Hello world, the answer is 42. 😀 日本 END OF TEXT and more after it."
    ids = encode(smol_tokenizer, text)
    assert not any(smol_tokenizer.decode([t]).find(stop) >= 0 for t in ids), "stop must span tokens"
    det = IncrementalDetokenizer(smol_tokenizer, chat_prompt, stop=[stop])
    texts, stop_hit = stream(det, ids)
    assert stop_hit == stop == det.stop_hit
    assert "".join(texts) == det.output_text == text[: text.index(stop)]
    assert stop not in det.output_text
    assert det.finished and det.flush() == ""
    with pytest.raises(RuntimeError):
        det.step(ids[:1])


@pytest.mark.model
def test_stop_ignores_tokens_after_it_in_the_same_step(smol_tokenizer: Any) -> None:
    ids = encode(smol_tokenizer, "one two three four")
    det = IncrementalDetokenizer(smol_tokenizer, [], stop=["two"])
    assert det.step(ids) == DetokenizerStep("one ", "two")


@pytest.mark.model
def test_partial_stop_string_is_held_then_flushed(smol_tokenizer: Any) -> None:
    ids = encode(smol_tokenizer, "Hello END OF")
    det = IncrementalDetokenizer(smol_tokenizer, [], stop=["END OF THE WORLD"])
    texts, stop_hit = stream(det, ids)
    assert stop_hit is None
    assert "".join(texts) == det.output_text == "Hello "
    assert det.flush() == "END OF"
    assert det.output_text == "Hello END OF" and det.stop_hit is None


@pytest.mark.model
def test_held_text_released_once_it_cannot_be_a_stop(smol_tokenizer: Any) -> None:
    ids = encode(smol_tokenizer, "Hello END OF story")
    det = IncrementalDetokenizer(smol_tokenizer, [], stop=["END OF THE WORLD"])
    texts, stop_hit = stream(det, ids)
    assert stop_hit is None
    assert "".join(texts) == "Hello END OF story"
    assert det.flush() == ""


@pytest.mark.model
@pytest.mark.parametrize(
    ("stops", "expected_text", "expected_stop"),
    [
        (["brown", "quick"], "The ", "quick"),  # earliest occurrence, whatever the list order
        (["ick", "qui"], "The ", "qui"),  # both complete in one token: earliest start wins
        (["quick", "qu"], "The ", "qu"),  # same start: the shorter
        (["zebra", "lazy", "fox j"], "The quick brown ", "fox j"),
    ],
)
def test_several_stop_strings_earliest_wins(
    smol_tokenizer: Any, stops: list[str], expected_text: str, expected_stop: str
) -> None:
    ids = encode(smol_tokenizer, "The quick brown fox jumps over the lazy dog")
    for order in (stops, stops[::-1]):
        det = IncrementalDetokenizer(smol_tokenizer, [], stop=order)
        texts, stop_hit = stream(det, ids)
        assert ("".join(texts), stop_hit) == (expected_text, expected_stop)


@pytest.mark.model
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet="ab .,\n日本語😀🎉éü—", min_size=1, max_size=40),
    stop_spans=st.lists(st.tuples(st.integers(0, 39), st.integers(1, 6)), max_size=3),
    extra_stop=st.sampled_from(["", "ab a", "😀 ", "zz"]),
    chunk=st.integers(1, 4),
)
def test_matches_reference_on_random_text(
    smol_tokenizer: Any,
    chat_prompt: list[int],
    text: str,
    stop_spans: list[tuple[int, int]],
    extra_stop: str,
    chunk: int,
) -> None:
    stop = [text[i : i + n] for i, n in stop_spans if text[i : i + n]] + ([extra_stop] if extra_stop else [])
    ids = encode(smol_tokenizer, text)
    expected_text, expected_stop = reference_cut(smol_tokenizer, ids, stop)
    det = IncrementalDetokenizer(smol_tokenizer, chat_prompt, stop=stop)
    texts, stop_hit = stream(det, ids, chunk)
    texts.append(det.flush())
    assert ("".join(texts), stop_hit) == (expected_text, expected_stop)
    assert all(REPLACEMENT not in piece for piece in texts)


# -- bad input --------------------------------------------------------------------


@pytest.mark.model
def test_bad_input(smol_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(smol_tokenizer, [], stop=[""])
    with pytest.raises(ValueError, match="single string"):
        IncrementalDetokenizer(smol_tokenizer, [], stop="abc")
    with pytest.raises(ValueError, match=">= 0"):
        IncrementalDetokenizer(smol_tokenizer, [-3])
    with pytest.raises(ValueError, match=">= 0"):
        IncrementalDetokenizer(smol_tokenizer, []).step([5, -1])
    with pytest.raises(TypeError, match="backend_tokenizer"):
        IncrementalDetokenizer(object(), [])


# -- cost ---------------------------------------------------------------------------


@pytest.mark.model
def test_per_token_cost_report(smol_tokenizer: Any, chat_prompt: list[int]) -> None:
    """Benchmark-style print (run with -s); checks the output, never the time."""
    text = " ".join(TEXTS.values()) * 20
    ids = encode(smol_tokenizer, text)
    for stop in ((), ("</s>", "User:", "\n\n\n")):
        best = float("inf")
        for _ in range(3):
            det = IncrementalDetokenizer(smol_tokenizer, chat_prompt, stop=stop)
            t0 = time.perf_counter()
            for token in ids:
                det.step([token])
            det.flush()
            best = min(best, time.perf_counter() - t0)
            assert det.output_text == text
        per_token_us = best / len(ids) * 1e6
        print(f"\nIncrementalDetokenizer: {per_token_us:.2f} us/token, {len(ids)} tokens, {len(stop)} stop strings")
