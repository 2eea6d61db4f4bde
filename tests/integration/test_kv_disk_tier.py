"""The disk KV tier on the real model: greedy text identical with and without it, a
restart on the same directory serves a long prompt from disk, and damaged or foreign
block files and a full disk are misses (the same text), said in the log."""

from __future__ import annotations

import errno
import logging
import re

from protocol import Delta

PROMPT = ("Here is a list of the things we packed for the trip, one per line, in the "
          "order we packed them: " + ", ".join(f"item {i} (a {c})" for i, c in zip(
              range(90), ["tent", "map", "rope", "lamp", "knife", "stove"] * 15)) +
          ". Now say which item came first.")
PARAMS = {"max_tokens": 24, "temperature": 0}
TIER_LOG = "service.worker.kv_disk_tier"


def prompt_ids(engine) -> list[int]:
    return list(engine.tokenizer(PROMPT)["input_ids"])


async def ask(engine) -> tuple[str, object]:
    text, done = "", None
    async for event in engine.generate(prompt_token_ids=prompt_ids(engine), params=PARAMS):
        if isinstance(event, Delta):
            text += event.text
        else:
            done = event
    return text, done


def metric(text: bytes, name: str) -> float:
    m = re.search(rf"^conveyor:{name}(?:{{[^}}]*}})? (\S+)$", text.decode(), re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


async def test_greedy_text_is_the_same_and_a_restart_serves_the_prompt_from_disk(
        make_engine, tmp_path):
    plain = await make_engine()
    text0, done0 = await ask(plain)
    await plain.close()
    prompt_len = done0.usage.prompt_tokens
    assert prompt_len > 500 and done0.usage.cached_tokens == 0

    first = await make_engine(kv_disk_path=str(tmp_path))
    tier = first.disk_tier  # room for a whole max_model_len prompt's blocks in the queue
    assert tier.queue_bytes >= -(-first.max_model_len // 16) * tier.payload_nbytes
    text1, done1 = await ask(first)
    assert text1 == text0 and done1.usage.cached_tokens == 0
    await first.close()  # flushes the write queue
    files = list(tmp_path.glob("*/*/*.kvb"))
    assert len(files) >= prompt_len // 16

    restarted = await make_engine(kv_disk_path=str(tmp_path))
    text2, done2 = await ask(restarted)
    assert text2 == text0
    full_blocks_tokens = (prompt_len // 16) * 16
    assert done2.usage.cached_tokens >= 0.9 * full_blocks_tokens, done2.usage
    assert done2.usage.disk_cached_tokens == done2.usage.cached_tokens  # all read back
    assert done1.usage.disk_cached_tokens == 0
    m = await restarted.metrics_text()
    assert metric(m, r'prefix_cache_tier_hits_total\{model_name="[^"]+",tier="disk"\}') == \
        done2.usage.cached_tokens
    assert metric(m, "kv_disk_blocks_read_total") == done2.usage.cached_tokens // 16
    assert metric(m, "kv_disk_load_seconds_count") == 1


async def test_damaged_and_foreign_blocks_and_a_full_disk_are_misses(
        make_engine, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=TIER_LOG)
    writer = await make_engine(kv_disk_path=str(tmp_path))
    text0, done0 = await ask(writer)
    await writer.close()
    tier_dir = writer.disk_tier.dir
    # damage the 6th and 11th blocks of the prompt (one byte, and a truncation)
    from service.core.kv_digest import block_digests

    digests = block_digests(writer.disk_tier.root, prompt_ids(writer), 16)
    flipped, cut = writer.disk_tier.path_of(digests[5]), writer.disk_tier.path_of(digests[10])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x40
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:1000])

    damaged = await make_engine(kv_disk_path=str(tmp_path))
    text1, done1 = await ask(damaged)
    assert text1 == text0
    # the truncated file is dropped by the start-up scan; the flipped byte fails the checksum
    assert done1.usage.cached_tokens == 5 * 16, done1.usage
    assert damaged.disk_tier.stats.read_failures == {"checksum": 1}
    assert damaged.disk_tier.stats.bad_files_at_start == 1
    assert "checksum" in caplog.text and "served as a miss" in caplog.text
    await damaged.close()

    other = await make_engine(kv_disk_path=str(tmp_path), block_size=32)
    text2, done2 = await ask(other)
    assert other.disk_tier.dir != tier_dir and done2.usage.cached_tokens == 0
    assert text2 == text0
    await other.close()

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("service.worker.kv_disk_tier.write_block_file", full)
    caplog.clear()
    filling = await make_engine(kv_disk_path=str(tmp_path / "full"))
    text3, _ = await ask(filling)
    await filling.close()
    assert text3 == text0 and not filling.disk_tier.enabled
    assert "kv disk tier off" in caplog.text and "No space left" in caplog.text
    assert metric(await filling.metrics_text(), "kv_disk_enabled") == 0


async def test_two_engines_on_one_directory_share_blocks_written_after_start_up(
        make_engine, tmp_path):
    """As two replicas on one node: B started before A wrote anything, and still hits."""
    a = await make_engine(kv_disk_path=str(tmp_path))
    b = await make_engine(kv_disk_path=str(tmp_path))
    assert len(b.disk_tier.index) == 0
    text_a, done_a = await ask(a)
    await a.close()  # its writes are done
    text_b, done_b = await ask(b)
    assert text_b == text_a and done_a.usage.cached_tokens == 0
    full = (done_b.usage.prompt_tokens // 16) * 16
    assert done_b.usage.cached_tokens >= 0.9 * full, done_b.usage
    assert done_b.usage.disk_cached_tokens == done_b.usage.cached_tokens


def test_the_offline_llm_keeps_its_prefix_on_disk_across_runs(loaded_model, tmp_path):
    from service.engine.llm import LLM

    ids = list(loaded_model.tokenizer(PROMPT)["input_ids"])
    kw = dict(loaded=loaded_model, num_kv_blocks=256, kv_disk_path=str(tmp_path))
    with LLM(**kw) as first:
        [out0] = first.generate_greedy([ids], 12)
        assert first.core.stats().prefix_hits == 0
    with LLM(**kw) as again:  # a new process would see the same files
        [out1] = again.generate_greedy([ids], 12)
        stats = again.core.stats()
    assert out1 == out0
    full = (len(ids) // 16) * 16
    assert stats.prefix_disk_hits == stats.prefix_hits >= 0.9 * full, stats
    assert again.disk_tier.stats.blocks_read == stats.prefix_disk_hits // 16
