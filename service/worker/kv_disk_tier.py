"""The disk KV tier: full blocks in files under `--kv-disk-path`, written behind and read
ahead in background threads (`service.core.kv_disk.DiskTier` is the contract).

    DIR/<fingerprint hex>/fingerprint.json     what the fingerprint stands for
    DIR/<fingerprint hex>/<d[:2]>/<d>.kvb      one block (service.worker.kv_block_file)

Threads: the step thread calls lookup / save / load / poll / install, each returning at
once; one writer thread writes queued blocks, one loader thread reads and verifies
loads. `save` copies the blocks' K/V out of the pool into a staging tensor right away
(a memcpy, [L, 2, n, block_size, Hkv, D]), so the pool may reuse the blocks at once;
the staging bytes in flight are bounded by `queue_bytes`, beyond which blocks are
dropped and counted, never waited for. A finished load's blocks stay in a staging
tensor ([k, L, 2, block_size, Hkv, D]) until `install` copies them into pool blocks on
the step thread, so no thread but the step thread ever writes the KV cache.

Failures: a missing file (evicted, perhaps by another replica) or one that fails
verification is a miss, counted by reason and logged (a bad file is deleted); any
other OSError (disk full, I/O error, permissions) turns the tier off with one error
line, and serving goes on without it.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from service.core.kv_disk import DiskBlock, LoadResult
from service.core.kv_disk_index import DiskIndex
from service.worker.kv_block_file import (BlockFileError, file_nbytes, read_block_file_into,
                                          write_block_file)
from service.worker.kv_disk_budget import DirectoryLedger, Held
from service.worker.kv_fingerprint import fingerprint_digest, kv_fingerprint_fields

log = logging.getLogger(__name__)

__all__ = ["DiskTier", "DiskTierStats", "open_disk_tier"]

SUFFIX = ".kvb"
STALE_TMP_S = 600.0  # a temporary file this old is a crashed writer's: deleted at start-up
TOO_LONG_MEMORY = 65536  # digests of skipped blocks remembered (a few MB at most)


@dataclass
class DiskTierStats:
    """Counters (blocks, bytes) since start-up; read_failures by reason ("missing", and
    BlockFileError's reasons: "truncated", "checksum", "fingerprint", ...)."""

    blocks_written: int = 0
    bytes_written: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    writes_dropped: int = 0      # the write queue was full
    writes_skipped: int = 0      # blocks whose sequence outgrew the tier (each once)
    writes_dropped_full: int = 0  # blocks not written: other engines' blocks fill the directory
    eviction_saves: int = 0      # queued when the pool evicted them (not saved before)
    blocks_evicted: int = 0
    bad_files_at_start: int = 0  # wrong size, deleted by the start-up scan
    read_failures: dict[str, int] = field(default_factory=dict)


@dataclass
class _WriteJob:
    blocks: list[DiskBlock]
    staging: torch.Tensor  # [L, 2, n, block_size, Hkv, D], CPU
    nbytes: int


class DiskTier:
    """Block files of one KV fingerprint under `path`; the directory's block files of every
    engine and fingerprint are bounded to `capacity_bytes` together (`kv_disk_budget`; least
    recently used sequence ends evicted first: `service.core.kv_disk_index`).

    Args:
        path: the tier's directory (shared by every engine given it; created if missing).
        capacity_bytes: most bytes of block files under `path`, all engines together.
        fields: the KV fingerprint's fields (`service.worker.kv_fingerprint`).
        kv_caches: the pool's KV tensors, one per layer, [2, num_blocks, block_size, Hkv, D].
        queue_bytes: most K/V bytes waiting to be written (beyond it saves are dropped);
            raised to `min_queue_blocks` blocks' worth when that is more.
        min_queue_blocks: blocks the queue always has room for (`open_disk_tier`: one
            request at max_model_len, so a whole long prompt is never dropped).
        max_loads: most loads queued or running.
    Raises OSError when the directory cannot be created or read.
    """

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, fields: dict[str, Any],
                 kv_caches: Sequence[torch.Tensor], *, queue_bytes: int = 256 << 20,
                 min_queue_blocks: int = 0,
                 max_loads: int = 4) -> None:
        self.root = fingerprint_digest(fields)
        self.dir = Path(path) / self.root.hex()
        self.kv_caches = list(kv_caches)
        _, _, bs, hkv, d = self.kv_caches[0].shape
        self.block_size = bs
        self.dtype = self.kv_caches[0].dtype
        self.block_shape = (len(self.kv_caches), 2, bs, hkv, d)
        self.payload_nbytes = len(self.kv_caches) * 2 * bs * hkv * d * self.dtype.itemsize
        self.file_nbytes = file_nbytes(bs, self.payload_nbytes)
        self.index = DiskIndex(capacity_bytes)
        self.stats = DiskTierStats()
        self.enabled = True
        self._closed = False
        self.on_load_seconds: Callable[[float], None] | None = None  # the metrics' histogram
        self.queue_bytes = max(queue_bytes, min_queue_blocks * self.payload_nbytes)
        self.max_loads = max_loads
        self._lock = threading.Lock()
        self._off_lock = threading.Lock()
        self._queued: set[bytes] = set()  # digests waiting in the write queue
        self._inflight_bytes = 0
        self._mtime_ns = 0  # the last file time _touch_chains set (strictly increasing)
        # blocks not written because their sequence outgrew the tier (so the blocks after
        # them are not either), most recent last, at most TOO_LONG_MEMORY
        self._too_long: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._loads_inflight = 0
        self._write_q: queue.SimpleQueue[_WriteJob | None] = queue.SimpleQueue()
        self._load_q: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._done: collections.deque[LoadResult] = collections.deque()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ledger = DirectoryLedger(Path(path))
        (self.dir / "fingerprint.json").write_text(json.dumps(fields, indent=1, default=str))
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="conveyor-kv-disk-writer",
                                        daemon=True)
        self._loader = threading.Thread(target=self._load_loop, name="conveyor-kv-disk-loader",
                                        daemon=True)
        self._writer.start()
        self._loader.start()
        log.info("kv disk tier at %s: %d blocks, %.1f MiB of %.1f MiB", self.dir,
                 len(self.index), self.index.total_bytes / 2**20, capacity_bytes / 2**20)

    # ---- files -------------------------------------------------------------------------
    def path_of(self, digest: bytes) -> Path:
        h = digest.hex()
        return self.dir / h[:2] / (h + SUFFIX)

    def _scan(self) -> None:
        """Rebuild the index from the files (oldest modification first = LRU first)."""
        found: list[tuple[int, bytes, int]] = []
        now = time.time()
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                name = entry.name
                try:
                    st = entry.stat()
                    if name.startswith("."):
                        if name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                            os.unlink(entry.path)
                        continue
                    if not name.endswith(SUFFIX):
                        continue
                    digest = bytes.fromhex(name[:-len(SUFFIX)])
                    if st.st_size != self.file_nbytes:
                        os.unlink(entry.path)
                        self.stats.bad_files_at_start += 1
                        continue
                except (OSError, ValueError):
                    continue  # gone meanwhile (another replica) or not ours
                found.append((st.st_mtime_ns, digest, st.st_size))
        for _, digest, size in sorted(found):
            self.index.add(digest, size)
        if self.stats.bad_files_at_start:
            log.warning("kv disk tier: deleted %d block files of the wrong size",
                        self.stats.bad_files_at_start)
        # the directory's total, recounted; this engine's blocks evicted while it is over
        with self.ledger.locked(recount=True) as held:
            others = max(0, held.total - self.index.total_bytes)
            victims = self.index.make_room(min(others, self.index.capacity_bytes))
            self._evict(victims or [], held)

    def _evict(self, digests: list[bytes], held: Held) -> None:
        """Delete evicted blocks' files; the directory's ledger (its lock held) loses the
        bytes of those this engine deleted (not of those another one deleted first)."""
        for d in digests:
            try:
                os.unlink(self.path_of(d))
                held.add(-self.file_nbytes)
            except FileNotFoundError:
                pass
            self.stats.blocks_evicted += 1

    def _turn_off(self, what: str, error: BaseException) -> None:
        # The log line goes out before `enabled` flips, so that whoever sees the tier off
        # can find the reason already logged; the lock keeps it to one line when the writer
        # and the step thread fail at once.
        with self._off_lock:
            if self.enabled:
                log.error("kv disk tier off after a %s error (serving goes on without it): %s",
                          what, error)
                self.enabled = False

    # ---- the step thread's calls ---------------------------------------------------------
    def lookup(self, digests: Sequence[bytes]) -> int:
        """Leading digests held: the index first, then one stat per block past it (another
        engine on the same directory may have written it since start-up)."""
        if not self.enabled:
            return 0
        n = self.index.leading_hits(digests)
        while n < len(digests):
            try:
                size = os.stat(self.path_of(digests[n])).st_size
            except OSError:
                break
            if size != self.file_nbytes:
                break
            self.index.add(digests[n], size, digests[n - 1] if n else None)
            n += 1
        return n

    def save(self, blocks: Sequence[DiskBlock], evicting: bool = False) -> None:
        """Copy the blocks' K/V out now and queue their write (see the module docstring);
        evicting: the pool is about to reuse them (counted in `eviction_saves`)."""
        if not self.enabled or self._closed:
            return
        todo: list[DiskBlock] = []
        seen: set[bytes] = set()
        # bytes of a block's sequence up to and including it, for the blocks taken here: a
        # block whose sequence would outgrow the tier is skipped before its K/V is copied
        chain: dict[bytes, int] = {}
        with self._lock:
            room = (self.queue_bytes - self._inflight_bytes) // self.payload_nbytes
            for b in blocks:
                d = b.digest
                if d in seen or d in self._queued or d in self.index or d in self._too_long:
                    continue  # held, on its way, or skipped before (counted then)
                seen.add(d)
                if b.parent is not None and b.parent in self._too_long:
                    below: int | None = self.index.capacity_bytes  # after a skipped block
                elif b.parent is None:
                    below = 0
                elif b.parent in chain:
                    below = chain[b.parent]
                elif b.parent in self.index:
                    below = self.index.chain_bytes(b.parent)
                else:
                    below = None  # queued, or only in the pool: the writer decides
                if below is not None:
                    if below + self.file_nbytes > self.index.capacity_bytes:
                        self._skip(d)
                        continue
                    chain[d] = below + self.file_nbytes
                if len(todo) >= room:
                    self.stats.writes_dropped += 1
                    continue
                todo.append(b)
            nbytes = len(todo) * self.payload_nbytes
            self._inflight_bytes += nbytes
            if evicting:
                self.stats.eviction_saves += len(todo)
            self._queued.update(b.digest for b in todo)
        if not todo:
            return
        first = self.kv_caches[0]
        ids = torch.tensor([b.block_id for b in todo], device=first.device)
        # [L, 2, n, block_size, Hkv, D]: one copy of each block, gathered on its device
        staging = torch.empty((len(self.kv_caches), 2, len(todo)) + tuple(first.shape[2:]),
                              dtype=first.dtype, device=first.device)
        for layer, kv in enumerate(self.kv_caches):
            torch.index_select(kv, 1, ids, out=staging[layer])
        self._write_q.put(_WriteJob(todo, staging.to("cpu"), nbytes))

    def load(self, key: str, digests: Sequence[bytes],
             token_ids: Sequence[tuple[int, ...]]) -> bool:
        if not self.enabled or self._closed or not digests:
            return False
        with self._lock:
            if self._loads_inflight >= self.max_loads:
                return False
            self._loads_inflight += 1
        self._load_q.put((key, list(digests), list(token_ids), time.perf_counter()))
        return True

    def poll(self) -> list[LoadResult]:
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def install(self, result: LoadResult, block_ids: Sequence[int]) -> None:
        """Copy the load's first len(block_ids) blocks into those pool blocks, every layer."""
        staging: torch.Tensor = result.payload  # [k, L, 2, block_size, Hkv, D]
        n = len(block_ids)
        assert staging is not None and n <= staging.shape[0], "installing more than was read"
        dev = self.kv_caches[0].device
        ids = torch.tensor(list(block_ids), device=dev)
        for layer, kv in enumerate(self.kv_caches):
            # [n, 2, bs, Hkv, D] -> [2, n, bs, Hkv, D], the cache's block axis second
            kv[:, ids] = staging[:n, layer].transpose(0, 1).to(dev)

    def discard(self, result: LoadResult) -> None:
        """Nothing to free but the staging tensor, which the result holds."""

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the queued writes (at most `timeout_s`), stop both threads and let go of
        the KV cache (saves and loads are no-ops afterwards). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._write_q.put(None)
        self._load_q.put(None)
        self._writer.join(timeout_s)
        self._loader.join(5.0)
        if self._writer.is_alive():
            log.warning("kv disk tier: writes still queued after %.0f s at close", timeout_s)
        self.kv_caches = []  # the runner's release() may free them now

    # ---- the writer thread --------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            job = self._write_q.get()
            if job is None:
                return
            try:
                if self.enabled:
                    self._write(job)
            except OSError as e:
                self._turn_off("write", e)
            except Exception:  # noqa: BLE001 -- a bug here must not kill the thread silently
                log.exception("kv disk tier: write failed")
            finally:
                with self._lock:
                    self._queued.difference_update(b.digest for b in job.blocks)
                    self._inflight_bytes -= job.nbytes

    def _write(self, job: _WriteJob) -> None:
        """Write the job's blocks in order; room comes from other chains' ends
        (`DiskIndex.make_room`): a block that fits only by evicting its own chain's head is
        skipped, and so are the blocks after it. Then each chain written is marked used from
        its end to its head (`_touch_chains`)."""
        written: list[DiskBlock] = []
        try:
            for i, block in enumerate(job.blocks):
                if not self.enabled:
                    return
                with self._lock:
                    after_skipped = block.parent is not None and block.parent in self._too_long
                keep = () if block.parent is None else (block.parent,)
                own = self.index.chain_bytes(block.parent) if keep and \
                    block.parent in self.index else 0
                if after_skipped or own + self.file_nbytes > self.index.capacity_bytes:
                    with self._lock:  # too long for the tier even alone: never again
                        self._skip(block.digest)
                    continue
                path = self.path_of(block.digest)
                with self.ledger.locked() as held:  # the directory's one budget
                    # bytes other engines hold in the directory: room for them too
                    others = max(0, held.total - self.index.total_bytes)
                    victims = self.index.make_room(self.file_nbytes + others, keep)
                    if victims is None:  # the others' blocks fill it: not written now
                        self.stats.writes_dropped_full += 1
                        continue
                    self._evict(victims, held)
                    if path.exists():  # another engine wrote it meanwhile
                        self.index.add(block.digest, self.file_nbytes, block.parent)
                        continue
                    payload = job.staging[:, :, i].contiguous()  # [L, 2, block_size, Hkv, D]
                    path.parent.mkdir(exist_ok=True)
                    size = write_block_file(path, self.root, block.digest, block.token_ids,
                                            payload.view(torch.uint8).numpy().data)
                    held.add(size)
                self.index.add(block.digest, size, block.parent)
                written.append(block)
                self.stats.blocks_written += 1
                self.stats.bytes_written += size
        finally:
            parents = {b.parent for b in written}
            self._touch_chains([b.digest for b in written if b.digest not in parents])

    def _skip(self, digest: bytes) -> None:
        """Count a block not written because its sequence outgrew the tier, and remember it,
        so that it is not offered again and the blocks after it are skipped too (caller
        holds `_lock`)."""
        if digest not in self._too_long:
            self.stats.writes_skipped += 1
        self._too_long[digest] = None
        self._too_long.move_to_end(digest)
        if len(self._too_long) > TOO_LONG_MEMORY:
            self._too_long.popitem(last=False)

    def _touch_chains(self, ends: Sequence[bytes]) -> None:
        """Mark each chain ending at one of `ends` used now, from its end to its head
        (`DiskIndex.touch_chain`), and set its files' modification times in the same
        strictly increasing order, so that the start-up scan of a restart, which knows no
        chains, rebuilds that order (the file system's clock is too coarse for it)."""
        for end in ends:
            for d in self.index.touch_chain(end):
                with self._off_lock:  # the writer and the loader both come here
                    self._mtime_ns = t = max(time.time_ns(), self._mtime_ns + 1)
                try:
                    os.utime(self.path_of(d), ns=(t, t))
                except OSError:
                    pass  # gone meanwhile (another replica evicted it): a later miss

    # ---- the loader thread --------------------------------------------------------------
    def _load_loop(self) -> None:
        while True:
            job = self._load_q.get()
            if job is None:
                return
            key, digests, token_ids, t0 = job
            staging = None
            try:
                staging = self._read(digests, token_ids)
            except Exception:  # noqa: BLE001 -- a bug here must not kill the thread silently
                log.exception("kv disk tier: load failed")
            seconds = time.perf_counter() - t0
            with self._lock:
                self._loads_inflight -= 1
            n = 0 if staging is None else staging.shape[0]
            self._done.append(LoadResult(key, n, seconds, staging))
            if self.on_load_seconds is not None:
                self.on_load_seconds(seconds)

    def _read(self, digests: list[bytes], token_ids: list[tuple[int, ...]]
              ) -> torch.Tensor | None:
        """Read and verify blocks in order straight into one staging tensor
        [k, L, 2, block_size, Hkv, D], stopping at the first miss; None when the first
        block fails (the tensor is cut to the blocks that passed)."""
        staging = torch.empty((len(digests),) + self.block_shape, dtype=self.dtype)
        raw = staging.view(torch.uint8).view(len(digests), -1).numpy()  # [k, bytes]
        n = 0
        for digest, tokens in zip(digests, token_ids):
            if not self.enabled:
                break
            path = self.path_of(digest)
            try:
                read_block_file_into(path, self.root, digest, tokens, memoryview(raw[n]))
            except FileNotFoundError:
                self._miss(digest, "missing", f"{path}: no such block file")
                break
            except BlockFileError as e:
                self._miss(digest, e.reason, str(e))
                try:
                    with self.ledger.locked() as held:
                        size = os.stat(path).st_size
                        os.unlink(path)
                        held.add(-size)
                except OSError:
                    pass
                break
            except OSError as e:
                self._turn_off("read", e)
                break
            if n:  # consecutive blocks of one chain (a restart forgets the links)
                self.index.link(digest, digests[n - 1])
            n += 1
            self.stats.blocks_read += 1
            self.stats.bytes_read += self.file_nbytes
        if n:  # recency, the chain's head last; it survives a restart (files' times)
            self._touch_chains([digests[n - 1]])
        return staging[:n] if n else None

    def _miss(self, digest: bytes, reason: str, message: str) -> None:
        self.index.discard(digest)
        with self._lock:
            self.stats.read_failures[reason] = self.stats.read_failures.get(reason, 0) + 1
        if reason == "missing":
            log.info("kv disk tier miss: %s", message)
        else:
            log.warning("kv disk tier: %s; served as a miss (recomputed)", message)


def open_disk_tier(config: Any, runner: Any) -> DiskTier:
    """The tier `config.cache.kv_disk_path` / `kv_disk_size` ask for, over a ModelRunner's
    KV cache. Raises OSError when the directory cannot be used."""
    from service.worker.loader import default_model_path

    model_path = runner.loaded.gguf_path or config.model.model or default_model_path()
    fields = kv_fingerprint_fields(runner, model_path)
    bs = config.cache.block_size
    return DiskTier(config.cache.kv_disk_path, config.cache.kv_disk_size, fields,
                    runner.kv_caches, min_queue_blocks=-(-runner.max_model_len // bs))
