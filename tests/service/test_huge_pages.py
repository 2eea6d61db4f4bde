"""The KV cache's memory advice: zeroed like torch.zeros, and huge pages asked for (and
given) where Linux offers them."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from service.worker import huge_pages


def _thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    text = path.read_text()
    return text[text.index("[") + 1:text.index("]")]


def test_zeroed_like_torch_zeros() -> None:
    t = huge_pages.zeros_on_huge_pages((3, 1 << 20), torch.float32)  # 12 MiB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and not t.any()
    small = huge_pages.zeros_on_huge_pages((4, 4), torch.float16)
    assert small.dtype == torch.float16 and not small.any()


def test_a_tensor_without_a_whole_huge_page_is_not_advised() -> None:
    assert huge_pages.advise_huge_pages(torch.empty(16)) is False  # no whole huge page inside


@pytest.mark.skipif(sys.platform != "linux" or _thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off or absent here")
def test_the_advice_is_taken_and_the_pages_come_huge() -> None:
    # a fresh anonymous mapping: never touched (torch.empty may hand back memory the process
    # touched before, on small pages already, as it did in the full suite)
    # 16 MiB, private (a shared mapping is shmem, whose huge pages are set apart): 7 whole
    # huge pages or more
    region = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(region, dtype=torch.uint8)  # unmapped when both are collected
    before = _anon_huge_kb()
    assert huge_pages.advise_huge_pages(t)
    t.fill_(1)  # faulted in now, as huge pages where the kernel could find them
    assert _anon_huge_kb() - before >= 2048


def _anon_huge_kb() -> int:
    """This process's anonymous memory on transparent huge pages, in KiB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no AnonHugePages line in /proc/self/smaps_rollup")


def test_copies_share_one_arena_and_keep_their_values() -> None:
    originals = [torch.arange(5, dtype=torch.float16), torch.randn(3, 7),
                 torch.randint(0, 255, (2, 3, 64), dtype=torch.uint8), torch.randn(4, 4)[:, 1]]
    copies = huge_pages.copies_on_huge_pages(originals)
    storage = copies[0].untyped_storage().data_ptr()
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0  # the arena starts on a huge page
    for o, c in zip(originals, copies):
        assert c.dtype == o.dtype and c.shape == o.shape and c.is_contiguous()
        assert torch.equal(c, o) and c.data_ptr() != o.data_ptr()
        assert c.untyped_storage().data_ptr() == storage and c.data_ptr() % 64 == 0
    copies[1].zero_()
    assert originals[1].abs().sum() > 0  # copies, not views of the originals


@pytest.mark.skipif(sys.platform != "linux" or _thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off or absent here")
def test_an_arena_is_known_while_it_lives() -> None:
    specs = [((3, 1 << 20), torch.uint8), ((5,), torch.float16), ((2, 4, 64), torch.int8)]
    slots = huge_pages.empty_on_huge_pages(specs)
    assert [(tuple(t.shape), t.dtype) for t in slots] == [(s, d) for s, d in specs]
    assert all(huge_pages.on_huge_pages(t) and t.is_contiguous() and t.data_ptr() % 64 == 0
               for t in slots)
    assert not huge_pages.on_huge_pages(torch.empty(1 << 22, dtype=torch.uint8))


@pytest.mark.skipif(sys.platform != "linux" or _thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off or absent here")
def test_an_arena_leaves_the_table_with_its_last_tensor() -> None:
    def expired() -> int:
        return sum(ref.expired() for _, ref in huge_pages._ARENAS.values())

    slots = huge_pages.empty_on_huge_pages([((3, 1 << 20), torch.uint8), ((5,), torch.int8)])
    address = slots[0].untyped_storage().data_ptr()
    _, ref = huge_pages._ARENAS[address]
    kept = slots[1].view(torch.uint8)[1:]  # a view of a view holds the arena too
    del slots
    assert huge_pages.on_huge_pages(kept) and not ref.expired()
    del kept  # the last tensor: torch frees the arena's memory
    assert ref.expired() and expired() >= 1
    others = huge_pages.empty_on_huge_pages([((3 << 20,), torch.uint8)])  # prunes the freed
    assert expired() == 0 and huge_pages._ARENAS.get(address, (0, None))[1] is not ref
    assert all(huge_pages.on_huge_pages(t) for t in others)
    del others
    assert expired() == 1
    # a lookup at a freed arena's address drops its entry
    freed = next(a for a, (_, r) in huge_pages._ARENAS.items() if r.expired())
    probe = torch.empty(8)
    huge_pages._ARENAS[probe.untyped_storage().data_ptr()] = huge_pages._ARENAS.pop(freed)
    assert not huge_pages.on_huge_pages(probe) and expired() == 0



def test_packed_blocks_are_written_on_huge_pages() -> None:
    from kernels.gguf_pack_cpu import build_problem
    from service.worker.gguf_weights import RawBlocks
    from tests.kernels.test_gguf_pack import random_raw

    if build_problem() is not None or _thp_mode() not in ("always", "madvise"):
        pytest.skip("no C++ packer or no transparent huge pages here")
    blocks = RawBlocks(("Q4_K",), (random_raw("Q4_K", 1024, 4096).numpy(),), 4096)
    packed = blocks.pack(torch.randn(1024))
    for t in (packed.data, packed.scale, packed.minv, packed.super_scale, packed.super_min,
              packed.bias):
        assert huge_pages.on_huge_pages(t)


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE


@pytest.mark.skipif(sys.platform != "linux", reason="the lazy mapping is Linux's")
def test_a_large_cache_is_zero_writable_and_resident_only_where_touched() -> None:
    n = huge_pages.LAZY_ZEROS_BYTES // 4 * 2  # 128 MiB of float32: the mapped path
    before = _rss_bytes()
    t = huge_pages.zeros_on_huge_pages((2, n // 2), torch.float32)
    assert t.shape == (2, n // 2) and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert _rss_bytes() - before < 32 << 20  # nothing written: (almost) nothing resident
    t[1, :1024] = 2.5
    assert float(t.sum()) == 2.5 * 1024 and not t[0].any()
    view = t[1, :4]
    del t  # a view keeps the mapping alive
    assert view.tolist() == [2.5] * 4
