"""Workload generators: deterministic under a seed, lengths right in model tokens, real text."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from service.bench.prompts import PromptSource, chat_token_ids
from service.bench.workloads import build_workload, load_jsonl, log_uniform, scaled


def _is_ring_slice(source: PromptSource, ids: tuple[int, ...]) -> bool:
    """ids are consecutive tokens of the prose ring, starting at a word start."""
    ring = source.ids * (len(ids) // len(source.ids) + 2)
    return any(ring[s:s + len(ids)] == list(ids) for s in source.word_starts)


def test_uniform_lengths_and_real_text(bench_tokenizer):
    specs = build_workload("uniform", bench_tokenizer, seed=0)
    assert len(specs) == 32
    assert [s.index for s in specs] == list(range(32))
    assert all(s.input_len == 128 and s.max_tokens == 128 for s in specs)
    source = PromptSource(bench_tokenizer)
    assert all(_is_ring_slice(source, s.prompt_token_ids) for s in specs)
    # sent as token ids; decoding gives prose (letters and spaces), not random ids
    assert specs[0].wire() == {"prompt_token_ids": list(specs[0].prompt_token_ids)}
    text = bench_tokenizer.decode(specs[0].prompt_token_ids)
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.9 * len(text)
    # no two prompts share a first KV block: no accidental prefix-cache hits
    assert len({s.prompt_token_ids[:16] for s in specs}) == 32


def test_same_seed_same_requests_other_seed_others(bench_tokenizer):
    for name in ("uniform", "medium", "extreme", "shared-prefix", "seed-exercise", "one-user"):
        a = build_workload(name, bench_tokenizer, seed=7, num_requests=10)
        b = build_workload(name, bench_tokenizer, seed=7, num_requests=10)
        assert a == b, name
    assert (build_workload("medium", bench_tokenizer, seed=1, num_requests=10)
            != build_workload("medium", bench_tokenizer, seed=2, num_requests=10))


def test_one_user_is_six_medium_requests_one_at_a_time(bench_tokenizer):
    from service.bench.workloads import default_max_concurrency

    specs = build_workload("one-user", bench_tokenizer, seed=0)
    assert len(specs) == 6
    assert all(100 <= s.input_len <= 500 and 50 <= s.max_tokens <= 200 for s in specs)
    medium = build_workload("medium", bench_tokenizer, seed=0, num_requests=6)
    assert [(s.input_len, s.max_tokens) for s in specs] == [
        (s.input_len, s.max_tokens) for s in medium]  # medium's lengths
    assert default_max_concurrency("one-user") == 1
    assert default_max_concurrency("medium") is None
    assert default_max_concurrency("x.jsonl") is None


def test_medium_ranges(bench_tokenizer):
    specs = build_workload("medium", bench_tokenizer, seed=3, num_requests=50)
    assert len(specs) == 50
    assert all(100 <= s.input_len <= 500 and 50 <= s.max_tokens <= 200 for s in specs)
    assert len({s.input_len for s in specs}) > 10


def test_extreme_ranges_and_long_tail(bench_tokenizer):
    specs = build_workload("extreme", bench_tokenizer, seed=0, num_requests=120)
    ins = [s.input_len for s in specs]
    outs = [s.max_tokens for s in specs]
    assert min(ins) >= 10 and max(ins) <= 2000 and min(outs) >= 10 and max(outs) <= 1000
    assert statistics.median(ins) < statistics.mean(ins)      # skewed: a long right tail
    assert max(ins) > 1000 and min(ins) < 40
    source = PromptSource(bench_tokenizer)
    assert all(_is_ring_slice(source, s.prompt_token_ids) for s in specs[:20])


def test_log_uniform_bounds():
    rng = random.Random(0)
    xs = [log_uniform(rng, 10, 1000) for _ in range(2000)]
    assert min(xs) >= 10 and max(xs) <= 1000
    below_100 = sum(x < 100 for x in xs) / len(xs)
    assert 0.4 < below_100 < 0.6  # as many per decade: half below the geometric mean


def test_shared_prefix(bench_tokenizer):
    specs = build_workload("shared-prefix", bench_tokenizer, num_requests=20)
    assert len({s.prompt_token_ids for s in specs}) == 20 and all(s.max_tokens == 128 for s in specs)
    first = specs[0].prompt_token_ids
    common = min(next((k for k, (a, b) in enumerate(zip(first, s.prompt_token_ids)) if a != b),
                      len(first)) for s in specs[1:])
    assert 400 <= common <= 420, common  # ~400 tokens of system prompt plus the template's
    source = PromptSource(bench_tokenizer)
    system = source.system_prompt(400)
    assert abs(len(bench_tokenizer.encode(system, add_special_tokens=False)) - 400) <= 2
    assert specs[3].prompt_token_ids == tuple(source.chat_ids(system, source.question(3)))


def test_seed_exercise(bench_tokenizer):
    specs = build_workload("seed-exercise", bench_tokenizer, seed=5)
    assert len(specs) == 10
    assert sorted(s.max_tokens for s in specs) == [100] * 8 + [1000] * 2
    assert all(s.input_len == 128 for s in specs)
    orders = {tuple(s.max_tokens for s in build_workload("seed-exercise", bench_tokenizer, seed=k))
              for k in range(6)}
    assert len(orders) > 1  # the seed shuffles where the long ones are


def test_scale(bench_tokenizer):
    specs = build_workload("uniform", bench_tokenizer, num_requests=4, scale=0.125)
    assert all(s.input_len == 16 and s.max_tokens == 16 for s in specs)
    tiny = build_workload("medium", bench_tokenizer, num_requests=4, scale=0.001)
    assert all(s.input_len == 1 and s.max_tokens == 1 for s in tiny)
    assert scaled(128, 0.5) == 64 and scaled(3, 0.1) == 1
    shared = build_workload("shared-prefix", bench_tokenizer, num_requests=2, scale=0.1)
    assert all(s.max_tokens == 13 for s in shared)


def test_bad_arguments(bench_tokenizer):
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope", bench_tokenizer)
    with pytest.raises(ValueError, match="scale"):
        build_workload("uniform", bench_tokenizer, scale=0)
    with pytest.raises(ValueError, match="num_requests"):
        build_workload("uniform", bench_tokenizer, num_requests=0)
    with pytest.raises(FileNotFoundError):
        build_workload("/nonexistent/requests.jsonl", bench_tokenizer)


def test_jsonl(bench_tokenizer, tmp_path):
    path = tmp_path / "reqs.jsonl"
    turns = [{"role": "user", "content": "Name three rivers in Europe."}]
    path.write_text(json.dumps({"messages": turns, "max_tokens": 20}) + "\n\n"
                    + json.dumps({"prompt": "The lighthouse keeper", "max_tokens": 8}) + "\n")
    specs = load_jsonl(str(path), bench_tokenizer)
    assert [s.max_tokens for s in specs] == [20, 8]
    assert specs[0].wire() == {"messages": turns}
    assert specs[0].prompt_token_ids == tuple(chat_token_ids(bench_tokenizer, turns))
    assert specs[1].wire() == {"prompt": "The lighthouse keeper"}
    assert specs[1].prompt_token_ids == tuple(
        bench_tokenizer.encode("The lighthouse keeper", add_special_tokens=False))
    assert build_workload(str(path), bench_tokenizer, num_requests=1, scale=0.5)[0].max_tokens == 10


@pytest.mark.parametrize("line, error", [
    ("not json", "not JSON"),
    ('{"prompt": "x"}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "x", "messages": [], "max_tokens": 3}', "exactly one"),
    ('{"messages": [{"role": "user"}], "max_tokens": 3}', "messages"),
    ("[1, 2]", "object"),
])
def test_jsonl_errors_name_the_line(bench_tokenizer, tmp_path, line, error):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "max_tokens": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=error) as info:
        load_jsonl(str(path), bench_tokenizer)
    assert "bad.jsonl:2" in str(info.value)
