"""Kernel choice by measurement: for each linear shape class of the model and each row
bucket, time every path of the mode that is available and correct here, keep the fastest.

Why measure: the fastest int8 path differs by CPU by a factor of 50 (``torch._int_mm`` is
fast with VNNI and 20-50x slower than fp32 without it; fbgemm needs 7-bit activations
without VNNI; our C++ kernels win where weights stream from memory), and by row count
(decode streams weights, a 512-token prefill chunk is compute-bound).

- Row buckets: BUCKETS = 1, 16, 64, 512 rows; a call of M rows uses the nearest bucket on a
  log scale (``bucket_index``). The LM head sees only sampling rows (at most
  max_num_seqs), so its 512 bucket reuses the 64 choice instead of a 30-GFLOP timing.
- Correct: a path's relative error against fp32 on 8 random rows (one an outlier token)
  through the layer's own weight, called as the bucket calls it, is within
  ``ERROR_BOUNDS[mode]`` (``relative_errors``; checked every start-up: it also catches a
  broken build).
- Saturation: every int8 path is also run on worst-case inputs (``saturation``: int8
  weights of +127 in adjacent input pairs, activations at the top of their range) at each
  bucket's row count; where its error there exceeds the bound it is not chosen for that
  bucket (the random check cannot see int16 pair sums that saturate without VNNI).
- Timing: decode-sized calls are bound by streaming weights from DRAM, so each path is
  timed over copies of the weight that together exceed the last-level cache (as a step
  streams every layer), each path's fastest call, the paths taking turns (``measure_ms``).
  Buckets from 64 rows are compute-bound: timed on a sample of about 512 output channels
  and one of a block a part, scaled to the layer (``SAMPLE_CHANNELS``, ``scaled_ms``). On
  busy cores, or when the timings contradict themselves (``contradictions``), on one
  thread: a two-thread call waits at its barrier for a descheduled thread.
- Cache: timings are kept in ``$CONVEYOR_CACHE_DIR/kernels/linear-timings-<key>.json``,
  key = hash of the C++ kernel source, the CPU flags, the torch version and the thread
  count; a later start-up on the same machine reuses them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernels import quant_linear_cpu as qlc
from kernels.cpu_build import cache_dir, cpu_flags
from service.worker.quantization.isa import CAP_VARS
from service.worker.quantization.paths import (BF16_BLOCKS_MIN_ROWS, ERROR_BOUNDS,
                                               SAMPLE_BLOCK, LayerWeights, LinearPath)

if TYPE_CHECKING:
    from service.worker.gguf_weights import BlockWeight
from service.worker.quantization.plan import BUCKETS, LinearPlan
from service.worker.quantization.saturation import (PROBE_N, needs_probe, probe_inputs,
                                                    saturation_errors)

log = logging.getLogger(__name__)

TIMING_VERSION = 3
"""Bump when the timing method changes: old cached timings are then not reused."""
LM_HEAD = "lm_head"
SAMPLE_FROM_ROWS = 64
SAMPLE_CHANNELS = 512
"""Buckets of SAMPLE_FROM_ROWS rows and more are compute-bound (a weight read once serves
every row), so their cost is the same per output channel: they are timed on a sample of
about SAMPLE_CHANNELS of the layer's output channels (``LayerWeights.timing_sample``, each
part in its share) and the time is scaled to the layer's N: a fixed part a call, read off a
second sample of one block a part (``scaled_ms``), plus a part a channel. A path that writes the
whole weight dequantized every call (``LinearPath.writes_weight``) is timed on enough channels
that their fp32 copy exceeds twice the last-level cache: on a smaller sample that traffic
stays in cache (measured on AMD Zen 3 at the 8B shape: 0.5x its whole layer's time at 64 rows,
0.6-0.9x at 512, where our C++ kernels' samples read 0.9-1.1x). At the 8B shape the 64- and
512-row timings of the whole layers took 106 of a first start's 130 s of timing (Zen 3).
Smaller buckets stream the weight from memory and are timed whole."""
CHECK_ROWS = 8
CHECK_OUT_ROWS = 256
"""A layer held only as a file's blocks is checked on the first this many output rows of
each part (``LayerWeights.check_sample``): the same kernels and block types, without
dequantizing the whole first layer and LM head (1.7 GB of fp32 at the 8B shape)."""
OUTLIER = 30.0

Timer = Callable[[str, int, Mapping[str, Callable[[], Sequence[Callable[[], object]]]]],
                 dict[str, float]]
"""(class name, rows, {path name: make_calls}) -> {path name: ms per call}. make_calls
builds the calls to time (one per weight copy); a fake timer for tests need not call it."""


def relative_errors(path: LinearPath, lw: LayerWeights, seed: int = 0) -> tuple[float, float]:
    """(error in one-row calls, error in one call of CHECK_ROWS rows) of `path`: the
    relative error |y - y_fp32| / |y_fp32| (Frobenius, y_fp32 in float64) over the ordinary
    rows of CHECK_ROWS Gaussian rows of which the first is an outlier token (x OUTLIER).

    Real activations carry such tokens (Sun et al., "Massive Activations in Large Language
    Models", 2024): a path that quantizes a whole call's activations with one range (fbgemm's
    per-tensor uint8) loses the other rows' precision whenever one shares the call, which a
    check on Gaussian rows alone would not see (on SmolLM2-135M, fbgemm for every layer
    raised perplexity by 7% where weight-only int8 changed it by -0.2%). One-row calls are
    what the 1-row bucket runs. inf when the output is not finite."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(CHECK_ROWS, lw.weight.shape[1], generator=g)
    x[0] *= OUTLIER
    ref = x[1:].double() @ lw.weight.double().t()
    if lw.bias is not None:
        ref += lw.bias.double()
    fn = path.bind(lw)
    errors = []
    for y in (torch.cat([fn(x[i:i + 1]) for i in range(CHECK_ROWS)]), fn(x)):
        y = y[1:].double()
        errors.append(float((y - ref).norm() / ref.norm().clamp(min=1e-30))
                      if bool(torch.isfinite(y).all()) else math.inf)
    return errors[0], errors[1]


def _llc_bytes() -> int:
    """The last-level cache's size (Linux sysfs), 32 MiB when unknown."""
    best = 0
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in root.glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            best = max(best, int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]
                       if text[-1] in "KM" else int(text))
        except (OSError, ValueError, KeyError):
            continue
    return best or 32 << 20


def weight_bytes(fn: object) -> int:
    """Bytes of weight a bound path (or a dense layer with `.weight`) reads per call."""
    packed = getattr(fn, "packed", None)
    if packed is not None:
        return int(packed.nbytes)
    qweight = getattr(fn, "qweight", None)
    if qweight is not None:
        return qweight.numel()
    weight = getattr(fn, "weight")
    return weight.numel() * weight.element_size()


def bound_copies(path: LinearPath, lw: LayerWeights,
                 target_bytes: int | None = None) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """`path` bound to copies of the weight on distinct memory (each bound layer's
    ``clone()``), together about `target_bytes` (default: twice the last-level cache, at
    least 64 MiB), 2 to 64 copies."""
    target = target_bytes or max(64 << 20, 2 * _llc_bytes())
    first = path.bind(lw)
    n = max(2, min(64, -(-target // max(weight_bytes(first), 1))))
    return [first] + [first.clone() for _ in range(n - 1)]  # type: ignore[attr-defined]


_clock = time.perf_counter
"""measure_ms's clock (tests replace it with a fake one)."""


FAR_BEHIND = 4.0
"""``measure_ms``: after round 1, a path more than this factor slower than the fastest is
not timed again; after round 0 (each path's first calls, warm-up included) one more than
twice this factor (a dequantize-then-matmul path, 10-70x behind at the 8B shape:
its calls of 50-380 ms, two a bucket, were a fifth of a first start's timing there)."""
BEHIND = 1.5
"""``measure_ms``: after round 2, a path more than this factor slower than the fastest is
not timed again. A path that far behind on the best of several cold calls each,
the paths taking turns, does not come first (nor within ``FUSION_SLACK``); at the 8B shape
the AVX2 twins and the fp32-activation C++ paths of the 512-row bucket are 1.3-2.4x behind,
and their later rounds were a third of a first start's timing (Zen 4, 2026-12-07)."""
BUDGET_S = 0.25
"""``measure_ms`` starts no round after round 2 once a measurement has taken this long
(seconds): a path whose call takes 30-90 ms (512 rows, or the LM head at 16) then has the
best of about three calls, where six rounds cost 1.3-2.7 s a bucket at the 8B shape."""


def measure_ms(calls: Mapping[str, Sequence[Callable[[], object]]], *, rounds: int = 5,
               round_s: float = 0.005, budget_s: float = BUDGET_S) -> dict[str, float]:
    """Each path's fastest call in ms. The paths take turns, round by round, so that a
    spell of contention on a shared machine hits them alike; a path's round runs through
    its calls (continuing where its last round stopped) until all ran once or `round_s`
    passed. The minimum, not the mean: a call whose OpenMP threads were descheduled takes a
    scheduler quantum (milliseconds) longer, which says nothing about the kernel; every
    copy is cold when its turn comes, so the minimum is not a cache hit. Paths over
    2 x FAR_BEHIND slower than the best stop being timed after round 0, over FAR_BEHIND x
    after round 1, over BEHIND x after round 2; from round 3 on, none starts once the
    measurement has taken `budget_s` seconds. A path no longer timed keeps its best so
    far.

    calls: path name -> calls on distinct copies of the weight.
    """
    best = {n: math.inf for n in calls}
    turn = {n: 0 for n in calls}
    alive = list(calls)
    began = _clock()
    for r in range(rounds + 1):  # round 0: each path's first calls (warm-up included)
        if r > 2 and _clock() - began >= budget_s:
            break
        for n in alive:
            cs = calls[n]
            start = _clock()
            for _ in range(len(cs) if r else min(2, len(cs))):
                t = _clock()
                cs[turn[n] % len(cs)]()
                turn[n] += 1
                best[n] = min(best[n], _clock() - t)
                if _clock() - start >= round_s:
                    break
        if r <= 2:
            lead = min(best[n] for n in alive)
            alive = [n for n in alive if best[n] <= (2 * FAR_BEHIND, FAR_BEHIND, BEHIND)[r] * lead]
    return {n: v * 1e3 for n, v in best.items()}


FIXED_SHARE_MAX = 0.25
"""``scaled_ms`` takes at most this share of a sample's time as the fixed cost of a call
(measured at the 1B shape on Zen 3: about 17% for a fused qkv's three part calls at 512 rows);
a noisy smaller sample can suggest more, which would scale too little."""
LINE_MIN_MS = 1.0
"""``scaled_ms`` reads the fixed part off a smaller sample only where that takes at least
this long a call: below it, a thread's wake-up (tens of microseconds, varying) is a large
share of the call and the line tilts (at 64 rows on Zen 3: 0.6-0.8x the layer's time)."""


def scaled_ms(ms: float, scale: float, small_ms: float | None = None,
              small_scale: float = math.inf) -> float:
    """A layer's time a call from its time on a sample of its output channels (`ms`; the
    layer has `scale` times the sample's channels): a fixed part a call (rounding x, starting
    threads) plus a part a channel, a + (ms - a) x scale. a is read off the line through a
    second, smaller sample (`small_ms`; the layer has `small_scale` times its channels),
    kept between 0 and FIXED_SHARE_MAX x ms; without one, with one under LINE_MIN_MS, or
    with one not faster than the sample (noise), a = 0 (proportional)."""
    fixed = 0.0
    if small_ms is not None and small_scale > scale and LINE_MIN_MS <= small_ms < ms:
        per_channel = (ms - small_ms) / (1 / scale - 1 / small_scale)  # a whole layer's
        fixed = min(FIXED_SHARE_MAX * ms, max(0.0, ms - per_channel / scale))
    return fixed + (ms - fixed) * scale


def default_timer(cls: str, rows: int,
                  makers: Mapping[str, Callable[[], Sequence[Callable[[], object]]]]
                  ) -> dict[str, float]:
    """``measure_ms`` of each path's calls (the class and rows only label them)."""
    return measure_ms({name: make() for name, make in makers.items()})


def cache_key() -> str:
    """Hash of what the timings depend on: kernel source, CPU flags, torch, threads, and
    the instruction-set caps in the environment (``isa.CAP_VARS``)."""
    caps = ",".join(f"{k}={os.environ.get(k, '')}" for k in CAP_VARS)
    parts = [qlc.SOURCE.read_bytes(), " ".join(sorted(cpu_flags())).encode(),
             torch.__version__.encode(), str(torch.get_num_threads()).encode(),
             str(TIMING_VERSION).encode(), caps.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cache_path() -> Path:
    return cache_dir() / f"linear-timings-{cache_key()}.json"


_PROCESS_TIMINGS: dict[str, dict[str, float]] = {}
"""cache key -> timings measured in this process, also those a busy machine kept off the
disk: a process that builds several runners (tests, benchmarks) times each shape once."""


MONOTONE_SLACK = 4.0
"""A path's call on fewer rows may take at most this factor longer than on more rows of the
same layer. Measured on an idle AVX2 machine, the worst genuine case is 3.1x (the
dequantize-then-matmul path, whose one-row product takes another BLAS route); timings
taken while other processes held the cores ran 30x slower at 1 row than at 16
(cpp-q4_1x8: 7.4 against 0.22 ms), and such a cache made an idle server choose fp32
kernels (docs/perf/HISTORY.md, 2026-12-01 later)."""


def contradictions(timings: Mapping[str, float]) -> set[str]:
    """The timing keys of every (path, layer) whose timings contradict themselves: a call
    on fewer rows over MONOTONE_SLACK times slower than one on more rows, or one of our
    C++ paths ("cpp-*") over MONOTONE_SLACK times slower at one row than ``fp32`` on the
    same layer (a one-row call streams the weight, and ours read at most fp32's bytes: on
    an AVX2 machine with a test suite beside it, load 2-3 on 2 CPUs, their OpenMP barriers
    waited for descheduled threads and cpp-q4_1 took 7.7 ms at one row where fp32 took
    0.74 and an idle one 0.05; that cache made an idle server decode on fp32). Keys are
    "path|NxK|bias|group|rows"; a (path, layer) is all its keys but the rows."""
    groups: dict[str, dict[int, str]] = {}
    for key in timings:
        head, _, rows = key.rpartition("|")
        if rows.isdigit():
            groups.setdefault(head, {})[int(rows)] = key
    bad: set[str] = set()
    for head, by_rows in groups.items():
        ms = [timings[by_rows[r]] for r in sorted(by_rows)]
        if any(ms[i] > MONOTONE_SLACK * ms[j] for i in range(len(ms))
               for j in range(i + 1, len(ms))):
            bad.update(by_rows.values())
        path, _, layer = head.partition("|")
        dense = groups.get(f"fp32|{layer}", {}).get(1)
        if (path.startswith("cpp-") and 1 in by_rows and dense is not None
                and timings[by_rows[1]] > MONOTONE_SLACK * timings[dense]):
            bad.update(by_rows.values())
    return bad


def _load_cache() -> dict[str, float]:
    """Timings from the disk cache and this process; a (path, layer) whose cached timings
    contradict themselves (`contradictions`) is dropped, so that it is timed again."""
    mine = _PROCESS_TIMINGS.get(cache_key(), {})
    try:
        data = json.loads(_cache_path().read_text())
        disk = {str(k): float(v) for k, v in data.get("timings_ms", {}).items()}
    except (OSError, ValueError, AttributeError):
        return dict(mine)
    bad = contradictions(disk)
    if bad:
        log.warning("linear kernel timing cache %s: %d timings dropped, they contradict "
                    "themselves (a path far slower on fewer rows; taken while the cores were "
                    "shared): %s", _cache_path(), len(bad), ", ".join(sorted(bad)[:4]))
    return {**{k: v for k, v in disk.items() if k not in bad}, **mine}


def _remember(timings: Mapping[str, float]) -> None:
    _PROCESS_TIMINGS.setdefault(cache_key(), {}).update(timings)


def _save_cache(timings: Mapping[str, float]) -> None:
    _remember(timings)
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       "timings_ms": dict(sorted(timings.items()))}, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("linear kernel timings not cached (%s): %s", path, e)


FUSION_SLACK = 1.25
"""A C++ path within this factor of the fastest serves a bucket the fused forward can take
(``choose_plan``'s fused_rows): one-sequence decode steps measured faster fused by more than
the linears could lose (README, "How a step works")."""


def pick(timings_ms: Mapping[str, float], errors: Mapping[str, float],
         bound: float) -> str | None:
    """The fastest path whose error (errors: path -> its error at this bucket) is within
    bound; ties go to the earlier path. None when no path is both timed and correct."""
    ok = [(ms, i, name) for i, (name, ms) in enumerate(timings_ms.items())
          if errors.get(name, math.inf) <= bound and math.isfinite(ms)]
    return min(ok)[2] if ok else None


def class_paths(paths: Sequence[LinearPath], lw: LayerWeights,
                batch_invariant: bool, native_only: bool = False,
                round_blocks: bool = False) -> list[LinearPath]:
    """The paths among `paths` that can serve the layer `lw` (a native q4_1 / q8_0 path
    needs its blocks); batch-invariant: only those with the first one's numerics (the
    candidates list the layer's native format before f32), so that every bucket computes
    the same bits. native_only: a layer with native blocks takes only paths over them (no
    dense fp32 copy of its weight is ever made). round_blocks: a layer with native blocks
    is also offered the paths that round its weights (``LinearPath.rounds_weights``: bf16
    over the blocks dequantized once to bf16); without it, never."""
    ok = [p for p in paths if p.accepts(lw)]
    if lw.native is not None:
        ok = [p for p in ok if (round_blocks if p.rounds_weights
                                else not native_only or p.native is not None)]
    return [p for p in ok if p.numerics == ok[0].numerics] if batch_invariant and ok else ok


def choose_plan(layers: Mapping[str, tuple[torch.Tensor | None, torch.Tensor | None]],
                paths: Sequence[LinearPath], mode: str, batch_invariant: bool, *,
                timer: Timer | None = None, use_cache: bool = True,
                int4_group: int | None = None,
                natives: Mapping[str, BlockWeight] | None = None,
                fused_rows: int = 0, native_only: bool = False,
                round_blocks: frozenset[str] = frozenset()) -> LinearPlan:
    """Measure and choose a path per (shape class, row bucket).

    Args:
        layers: class name ("qkv", "o", "gate_up", "down", "lm_head") -> (weight [N, K]
            float32, bias [N] or None) of one layer of that class; weight None where the
            class has native blocks and no dense copy (it is then checked on a sample of
            its rows, ``CHECK_OUT_ROWS``).
        paths: the candidates (``paths.candidates(mode, batch_invariant)``); each class
            takes those that accept its layer (``class_paths``). A path is correct within
            its own bound (``LinearPath.bound``) and timed from ``min_rows`` rows on.
        natives: class -> the checkpoint's own blocks of that layer (auto on a GGUF file),
            whose dequantization is the layer's weight.
        timer: measures a path (default: ``default_timer``); tests pass a fake.
        use_cache: reuse and store timings in the per-machine cache.
        fused_rows: buckets of at most this many rows prefer our C++ kernels (``cpp-*``)
            within ``FUSION_SLACK`` of the fastest path: the fused forward
            (``service.worker.fused_forward``) serves a bucket only where every class is a
            C++ kernel, and saves more than that per step. 0: plain fastest.
        native_only: a class with native blocks is offered only the paths over them
            (``class_paths``): the model holds no dense copy of such layers.
        round_blocks: the classes whose native blocks may also be served by a path that
            rounds them (bf16 over a bf16 copy made once; ``class_paths``).

    Raises:
        ValueError: no candidate can run here, or none is correct for some class.
    """
    problems = {p.name: p.problem() for p in paths}
    usable = [p for p in paths if problems[p.name] is None]
    if not usable:
        raise ValueError(f"no linear kernel for quantization {mode!r}"
                         f"{' (batch-invariant)' if batch_invariant else ''} runs here: "
                         + "; ".join(f"{k}: {v}" for k, v in problems.items()))
    cached = _load_cache() if use_cache else {}
    load, cpus = os.getloadavg()[0], len(os.sched_getaffinity(0))
    busy = load > cpus + max(1.0, cpus / 2)  # our own model load counts too
    bound = ERROR_BOUNDS[mode]
    bounds = {p.name: p.bound(mode) for p in usable}
    errors: dict[str, dict[str, tuple[float, float]]] = {}
    saturation: dict[str, dict[str, tuple[float, ...]]] = {}
    correct: dict[str, list[LinearPath]] = {}
    lws: dict[str, LayerWeights] = {}
    for cls, (weight, bias) in layers.items():
        kw = {} if int4_group is None else {"int4_group": int4_group}
        lw = lws[cls] = LayerWeights(weight, bias, native=(natives or {}).get(cls), **kw)
        mine = class_paths(usable, lw, batch_invariant, native_only, cls in round_blocks)
        check = lw.check_sample(CHECK_OUT_ROWS)
        errors[cls] = {p.name: relative_errors(p, check) for p in mine}
        saturation[cls] = _probe(cls, lw.shape, [p for p in mine if needs_probe(p)], bound)
        sat = saturation[cls]
        correct[cls] = [p for p in mine if min(errors[cls][p.name]) <= bounds[p.name]
                        and min(sat.get(p.name, (0.0,))) <= bound]
        if not correct[cls]:
            raise ValueError(f"no {mode} linear path is within the error bound {bound} for "
                             f"{cls} {tuple(lw.shape)}: {errors[cls]}; worst-case "
                             f"inputs: {sat}")

    samples: dict[int, tuple[LayerWeights, float]] = {}

    def sample_of(lw: LayerWeights, p: LinearPath,
                  channels: int = SAMPLE_CHANNELS) -> tuple[LayerWeights, float]:
        """(the layer `p` is timed on in a compute-bound bucket, N over its N)."""
        if p.writes_weight:  # its fp32 copy of the sample must exceed the LLC, as the layer's
            channels = max(channels, -(-2 * _llc_bytes() // (4 * lw.shape[1])))
        if channels not in samples:
            samples[channels] = lw.timing_sample(channels)
        return samples[channels]

    def decide(threads: int) -> tuple[dict[str, float], dict[str, list[dict[str, float]]],
                                      dict[str, tuple[str, ...]], list[str]]:
        """(timings, table, choices, retimed) with what is not cached timed at `threads`."""
        timings = dict(cached)
        table: dict[str, list[dict[str, float]]] = {}
        choices: dict[str, tuple[str, ...]] = {}
        retimed: list[str] = []  # "class NxK at R rows", for the start-up log
        for cls, lw in lws.items():
            (n, k), bias, sat = lw.shape, lw.bias, saturation[cls]
            table[cls], picked = [], []
            copies: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
            samples.clear()
            for b, rows in enumerate(BUCKETS):
                if cls == LM_HEAD and b == len(BUCKETS) - 1:  # one row per sampling sequence
                    table[cls].append({})  # not timed: served as the bucket below
                    picked.append(picked[-1])
                    continue
                err = {n: max(e[0 if rows == 1 else 1], sat[n][b] if n in sat else 0.0)
                       for n, e in errors[cls].items()}
                within = [p for p in correct[cls] if err[p.name] <= bounds[p.name]]
                # a path is offered from its min_rows on, unless no other path is left here
                offered = [p for p in within if rows >= (
                    BF16_BLOCKS_MIN_ROWS if p.rounds_weights and lw.native is not None
                    else p.min_rows)] or within
                keys = {p.name: (f"{p.name}|{n}x{k}|"
                                 f"{'bias' if bias is not None else 'nobias'}|{lw.int4_group}|"
                                 f"{rows}")
                        for p in offered}
                missing = [p for p in correct[cls] if p.name in keys
                           and keys[p.name] not in timings]
                if missing:
                    x = torch.randn(rows, k)
                    sampled = rows >= SAMPLE_FROM_ROWS

                    def make(p: LinearPath, x: torch.Tensor = x, lw: LayerWeights = lw,
                             channels: int = SAMPLE_CHANNELS) -> list[Callable[[], object]]:
                        if sampled:  # compute-bound: two copies of the sample are enough
                            fns = bound_copies(p, sample_of(lw, p, channels)[0],
                                               target_bytes=1)
                        else:
                            if p.name not in copies:
                                copies[p.name] = bound_copies(p, lw)
                            # compute-bound above 16 rows: two copies are enough
                            fns = copies[p.name] if x.shape[0] <= 16 else copies[p.name][:2]
                        return [lambda f=f: f(x) for f in fns]

                    scales = {p.name: sample_of(lw, p)[1] if sampled else 1.0 for p in missing}
                    if not retimed:
                        log.info("timing the linear kernels on this model's shapes (not in "
                                 "the timing cache: a first start on these shapes here; kept "
                                 "for the next)")
                    retimed.append(f"{cls} {n}x{k} at {rows} rows"
                                   + (" (on a sample of its output channels)"
                                      if any(v != 1.0 for v in scales.values()) else ""))
                    # a fixed cost a call (rounding x, starting threads) is read off a
                    # second, smaller sample (one block a part; not for a path that writes
                    # its weight: its sample is large)
                    smaller = {p.name: sample_of(lw, p, SAMPLE_BLOCK)[1] for p in missing
                               if scales[p.name] != 1.0 and not p.writes_weight}
                    with _num_threads(threads):
                        got = (timer or default_timer)(
                            cls, rows, {p.name: functools.partial(make, p) for p in missing})
                        small = (timer or default_timer)(
                            cls, rows, {p.name: functools.partial(make, p, channels=SAMPLE_BLOCK)
                                        for p in missing if p.name in smaller}) if smaller else {}
                    timings.update({keys[p.name]: scaled_ms(
                        got[p.name], scales[p.name], small.get(p.name),
                        smaller.get(p.name, math.inf)) for p in missing})
                row = {n: timings[k] for n, k in keys.items()}
                table[cls].append(row)
                margins = {n: e - bounds[n] for n, e in err.items()}
                choice = pick(row, margins, 0.0)
                assert choice is not None, f"{cls}: a correct path went untimed"
                if rows <= fused_rows and not choice.startswith("cpp-"):
                    cpp = pick({n: ms for n, ms in row.items() if n.startswith("cpp-")},
                               margins, 0.0)
                    if cpp is not None and row[cpp] <= FUSION_SLACK * row[choice]:
                        choice = cpp
                picked.append(choice)
            copies.clear()
            choices[cls] = tuple(picked)
        return timings, table, choices, retimed

    threads = torch.get_num_threads()
    # Busy cores: time on one thread (a call's OpenMP barrier waits for a descheduled
    # thread, a scheduler quantum, and the multi-threaded C++ kernels lose to fp32 calls
    # that ATen runs on one thread: `contradictions`). The same when the timings of all
    # threads contradict themselves. One-thread timings rank the paths as an idle machine's
    # do (README, Quantized linear layers) and never go to the disk cache.
    one_thread = threads > 1 and busy
    timings, table, choices, retimed = decide(1 if one_thread else threads)
    bad = contradictions(timings)
    if bad - cached.keys() and threads > 1 and not one_thread:  # a new timing is in it
        log.warning("linear kernel timings contradict themselves (%s: a path far slower "
                    "on fewer rows, or a C++ path far slower than fp32 at one row; other "
                    "processes shared the cores): timing again on one thread",
                    ", ".join(sorted(bad)[:4]))
        one_thread = True
        timings, table, choices, retimed = decide(1)
        bad = contradictions(timings)
    lws.clear()  # the packed forms the checks and timings built
    _log_cache_use(use_cache, cached, retimed)
    if use_cache and timings != cached:
        if busy or one_thread:
            log.warning("the machine was busy while linear kernels were timed (load average "
                        "%.1f on %d CPUs)%s: the choice may be off, and is not cached on disk "
                        "(this process reuses it)", load, cpus,
                        ", so they were timed on one thread" if one_thread else "")
            _remember(timings)
        elif bad:
            log.warning("linear kernel timings contradict themselves (%s: a path far slower "
                        "on fewer rows; other processes shared the cores): the choice may be "
                        "off; those are not cached on disk (this process reuses them)",
                        ", ".join(sorted(bad)[:4]))
            _remember(timings)
            _save_cache({k: v for k, v in timings.items() if k not in bad})
        else:
            _save_cache(timings)
    return LinearPlan(mode, batch_invariant, choices, table, errors,
                      {k: v for k, v in problems.items() if v is not None},
                      int4_group=int4_group, saturation=saturation, fused_rows=fused_rows)


@contextlib.contextmanager
def _num_threads(n: int) -> Iterator[None]:
    """torch's (and so our C++ kernels') intra-op thread count set to `n` for the block."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _log_cache_use(use_cache: bool, cached: Mapping[str, float], retimed: list[str]) -> None:
    """The start-up log line on the timing cache: used or not, and what was re-timed."""
    if not use_cache:
        where = "not used (use_cache=False)"
    elif cached:
        where = f"{_cache_path()} ({len(cached)} timings found)"
    else:
        where = f"{_cache_path()} (none found: everything is timed)"
    log.info("linear kernel timing cache: %s; re-timed: %s", where,
             ", ".join(retimed) if retimed else "nothing (every timing came from the cache)")


def _probe(cls: str, shape: torch.Size, paths: Sequence[LinearPath],
           bound: float) -> dict[str, tuple[float, ...]]:
    """path -> its error on the worst-case inputs per bucket (``saturation_errors``), and a
    warning for each path that saturates at some bucket (it is not chosen there)."""
    n, k = shape
    inputs = probe_inputs(min(n, PROBE_N), k, max(BUCKETS))
    out = {p.name: saturation_errors(p, k, n, inputs=inputs) for p in paths}
    for name, errs in out.items():
        bad = [rows for rows, e in zip(BUCKETS, errs) if not e <= bound]
        if bad and not (cls == LM_HEAD and bad == [BUCKETS[-1]]):
            log.warning("int8 path %s saturates on worst-case inputs for %s %s at rows %s "
                        "(error up to %.3f > %s): not used there", name, cls, tuple(shape),
                        bad, max(errs), bound)
    return out
