"""The disk tier's pure parts: stable block digests, the LRU index, the block file format."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.core.kv_digest import block_digests, digest_block
from service.core.kv_disk_index import DiskIndex
from service.worker.kv_block_file import BlockFileError, file_nbytes, read_block_file, write_block_file

ROOT = Path(__file__).resolve().parents[2]
FP = bytes(range(16))
TOKENS = list(range(100, 110))


def test_digests_chain_and_are_stable_across_processes():
    d = block_digests(FP, TOKENS, 4)
    assert len(d) == 2 and all(len(x) == 16 for x in d)
    assert d[0] == digest_block(FP, TOKENS[:4]) and d[1] == digest_block(d[0], TOKENS[4:8])
    # extending from the middle gives the same chain
    assert block_digests(FP, TOKENS, 4, start=1, parent=d[0]) == d[1:]
    # another fingerprint, or another earlier token, changes every later digest
    assert block_digests(bytes(16), TOKENS, 4)[1] != d[1]
    assert block_digests(FP, [99] + TOKENS[1:], 4)[1] != d[1]
    code = ("from service.core.kv_digest import block_digests;"
            f"print(block_digests(bytes(range(16)), {TOKENS}, 4)[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={"PYTHONHASHSEED": "123"}).stdout.strip()
    assert out == d[1].hex()
    with pytest.raises(ValueError):
        block_digests(FP, TOKENS, 4, start=1)


def test_index_lru_by_bytes():
    ix = DiskIndex(300)
    for name in (b"a", b"b", b"c"):
        ix.add(name, 100)
    assert ix.total_bytes == 300 and ix.leading_hits([b"a", b"b", b"x", b"c"]) == 2
    assert ix.touch_chain(b"a") == [b"a"]  # a, alone, becomes the most recent: b goes first
    assert ix.lru_order() == [b"b", b"c", b"a"]
    assert ix.make_room(150) == [b"b", b"c"]
    assert ix.total_bytes == 100 and ix.make_room(400) is None and len(ix) == 1
    assert ix.discard(b"a") and not ix.discard(b"a") and ix.total_bytes == 0
    with pytest.raises(ValueError):
        DiskIndex(0)


def test_index_evicts_chain_ends_first():
    # a -> b -> c (one sequence's blocks), x alone; LRU order a, b, c, x
    ix = DiskIndex(400)
    ix.add(b"a", 100)
    ix.add(b"b", 100, parent=b"a")
    ix.add(b"c", 100, parent=b"b")
    ix.add(b"x", 100)
    assert ix.make_room(100) == [b"c"]  # a and b are older, but c depends on them
    assert ix.make_room(200) == [b"b"]  # b is a leaf now and older than x
    assert ix.lru_order() == [b"a", b"x"] and ix.leading_hits([b"a", b"b"]) == 1


def test_index_keep_protects_a_chain_and_refuses_rather_than_cut_it():
    ix = DiskIndex(300)
    ix.add(b"a", 100)
    ix.add(b"b", 100, parent=b"a")
    ix.add(b"x", 100)
    # room for b's child: x goes, never a or b (kept with their descendants)
    assert ix.make_room(100, keep=[b"b"]) == [b"x"]
    ix.add(b"c", 100, parent=b"b")
    # the chain fills the tier: its next block cannot come without cutting it
    assert ix.make_room(100, keep=[b"c"]) is None and len(ix) == 3
    assert ix.make_room(100) == [b"c"]  # without the keep, its end goes


def test_index_touch_chain_marks_the_head_most_recent():
    ix = DiskIndex(1000)
    ix.add(b"a", 1)
    ix.add(b"b", 1, parent=b"a")
    ix.add(b"c", 1, parent=b"b")
    ix.add(b"x", 1)
    assert ix.touch_chain(b"c") == [b"c", b"b", b"a"]
    assert ix.lru_order() == [b"x", b"c", b"b", b"a"]
    assert ix.touch_chain(b"zz") == []
    ix.add(b"y", 1)
    ix.link(b"y", b"x")  # learnt later (a load of blocks found at start-up)
    # x, the oldest, is y's parent now: the oldest leaf, c, goes instead
    assert ix.make_room(1000 - 5 + 1) == [b"c"]
    ix.link(b"nope", b"x")  # unknown digest: ignored
    assert len(ix) == 4


def _write(tmp_path: Path, payload: bytes = bytes(range(256)) * 4) -> Path:
    path = tmp_path / "blk.kvb"
    n = write_block_file(path, FP, b"D" * 16, TOKENS, payload)
    assert n == path.stat().st_size == file_nbytes(len(TOKENS), len(payload))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    return path


def test_block_file_round_trip(tmp_path):
    payload = bytes(range(256)) * 4
    path = _write(tmp_path, payload)
    assert bytes(read_block_file(path, FP, b"D" * 16, TOKENS, len(payload))) == payload


@pytest.mark.parametrize("damage, reason", [
    (lambda b: b[:-1], "truncated"),
    (lambda b: b[:len(b) // 2], "truncated"),
    (lambda b: b + b"x", "size"),
    (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], "checksum"),
    (lambda b: b"X" + b[1:], "magic"),
])
def test_block_file_damage_is_detected(tmp_path, damage, reason):
    path = _write(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(BlockFileError) as e:
        read_block_file(path, FP, b"D" * 16, TOKENS, 1024)
    assert e.value.reason == reason


@pytest.mark.parametrize("kw, reason", [
    ({"fingerprint": bytes(16)}, "fingerprint"),
    ({"digest": b"E" * 16}, "digest"),
    ({"token_ids": TOKENS[:-1] + [7]}, "tokens"),
    ({"payload_nbytes": 1020, "token_ids": TOKENS + [1]}, "size"),
])
def test_block_file_of_another_block_or_setting_is_refused(tmp_path, kw, reason):
    path = _write(tmp_path)
    args = {"fingerprint": FP, "digest": b"D" * 16, "token_ids": TOKENS, "payload_nbytes": 1024}
    args.update(kw)
    with pytest.raises(BlockFileError) as e:
        read_block_file(path, args["fingerprint"], args["digest"], args["token_ids"],
                        args["payload_nbytes"])
    assert e.value.reason == reason


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    def bad_replace(*_):
        raise OSError(28, "No space left on device")

    path = tmp_path / "blk.kvb"
    monkeypatch.setattr("service.worker.kv_block_file.os.replace", bad_replace)
    with pytest.raises(OSError):
        write_block_file(path, FP, b"D" * 16, TOKENS, b"\0" * 64)
    assert list(tmp_path.iterdir()) == []
