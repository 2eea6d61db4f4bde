"""Device check: what can only be verified on a GPU, in one run, as JSON.

Sections (each recorded even when it fails; the JSON is rewritten after each,
so a run killed by a time limit still leaves the sections it finished):

- ``environment``: torch/triton versions, the GPU.
- ``kernel_tests``: ``pytest tests/kernels`` in a subprocess, natively on CUDA
  (TRITON_INTERPRET removed from its environment).
- ``e2e_greedy``: greedy generation with ``service.engine.llm.LLM`` on CPU (torch
  backend), on CUDA with the torch backend and on CUDA with the Triton
  backend; per prompt, the first index where the token streams differ.
- ``copy_bandwidth`` and ``decode_attention``: device-to-device copy of a
  1 GiB tensor (CUDA events), then paged decode attention (Triton and the
  torch reference) with achieved K/V bandwidth as a fraction of the copy's.

``--dry-run`` runs the same code on CPU with tiny shapes (Triton under the
interpreter) to test this script without a GPU. Needs no network.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOTAL_BUDGET_S = 450.0  # the whole run stays under 8 minutes
GIB = 1 << 30


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the real GPU check or the CPU dry run."""

    device: str
    test_filter: str | None  # pytest -k expression; None runs every kernel test
    tests_timeout_s: float
    e2e_backends: tuple[tuple[str, str], ...]  # (device, attention_backend); the first is the baseline
    e2e_prompts: tuple[tuple[int, ...], ...]
    e2e_max_tokens: int
    copy_bytes: int
    bench_batch: int
    bench_context: int
    bench_dtype: str
    bench_iters: int


def _prompts(count: int, lengths: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    # Fixed token ids (no tokenizer needed): a deterministic walk through the
    # low part of the vocabulary, where every Llama-family tokenizer has ids.
    out = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        out.append(tuple(100 + (i * 7919 + j * 104729) % 9000 for j in range(n)))
    return tuple(out)


def make_plan(dry_run: bool) -> Plan:
    if dry_run:
        return Plan(
            device="cpu",
            test_filter="dispatch or activation",
            tests_timeout_s=240.0,
            e2e_backends=(("cpu", "torch"), ("cpu", "triton")),
            e2e_prompts=_prompts(1, (6,)),
            e2e_max_tokens=2,
            copy_bytes=16 << 20,
            bench_batch=2,
            bench_context=40,
            bench_dtype="float32",
            bench_iters=2,
        )
    return Plan(
        device="cuda",
        test_filter=None,
        tests_timeout_s=240.0,
        e2e_backends=(("cpu", "torch"), ("cuda", "torch"), ("cuda", "triton")),
        e2e_prompts=_prompts(4, (5, 37, 120, 300)),
        e2e_max_tokens=32,
        copy_bytes=GIB,
        bench_batch=64,
        bench_context=2048,
        bench_dtype="float16",
        bench_iters=50,
    )


class Report:
    """The JSON result, rewritten atomically after every section."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}
        self.start = time.monotonic()

    def remaining_s(self) -> float:
        return TOTAL_BUDGET_S - (time.monotonic() - self.start)

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        began = time.monotonic()
        try:
            entry = {"status": "ok", **fn()}
        except Exception as exc:  # a failed section is a result, not a crash
            entry = {"status": "error", "error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
        entry["elapsed_s"] = round(time.monotonic() - began, 3)
        self.data["sections"][name] = entry
        self.write()

    def skip(self, name: str, why: str) -> None:
        self.data["sections"][name] = {"status": "skipped", "reason": why}
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.start, 3)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


# ---------------------------------------------------------------- environment


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = f"not importable: {exc!r}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / GIB, 1)
        info["capability"] = list(torch.cuda.get_device_capability(0))
    return info


# --------------------------------------------------------------- kernel tests


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and the failed test ids of a pytest ``--junitxml`` file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed[:50]}


def kernel_tests(plan: Plan, workdir: Path, timeout_s: float) -> dict[str, Any]:
    junit = workdir / "kernel_tests.xml"
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "tests/kernels", "--ignore=tests/kernels/test_device_check.py", f"--junitxml={junit}",
    ]
    if plan.test_filter:
        cmd += ["-k", plan.test_filter]
    env = dict(os.environ)
    if plan.device == "cuda":
        env.pop("TRITON_INTERPRET", None)  # native kernels on the GPU
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-3000:] if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-3000:]
        return {"passed_all": False, "timed_out": True, "timeout_s": timeout_s, "output_tail": str(tail)}
    result: dict[str, Any] = {"returncode": proc.returncode, "output_tail": (proc.stdout + proc.stderr)[-3000:]}
    if junit.exists():
        result.update(parse_junit(junit))
    result["passed_all"] = proc.returncode == 0
    return result


# ----------------------------------------------------------------- end to end


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (length mismatch counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def e2e_greedy(plan: Plan, llm_factory: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Greedy token streams per (device, backend), compared with the first one.

    llm_factory(device=..., attention_backend=...) must return an object with
    ``generate_greedy(prompt_token_ids_list, max_tokens) -> list[list[int]]``;
    by default ``service.engine.llm.LLM``. An import failure is recorded, not raised.
    """
    if llm_factory is None:
        try:
            from service.engine.llm import LLM
        except Exception as exc:
            return {"compared": False, "import_error": repr(exc)}
        llm_factory = LLM
    prompts = [list(p) for p in plan.e2e_prompts]
    runs: dict[str, Any] = {}
    baseline_key: str | None = None
    baseline: list[list[int]] | None = None
    for device, backend in plan.e2e_backends:
        key = f"{device}/{backend}"
        began = time.monotonic()
        try:
            llm = llm_factory(device=device, attention_backend=backend)
            tokens = [list(map(int, t)) for t in llm.generate_greedy(prompts, plan.e2e_max_tokens)]
            del llm
        except Exception as exc:
            runs[key] = {"error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
            continue
        entry: dict[str, Any] = {"tokens": tokens, "seconds": round(time.monotonic() - began, 3)}
        if baseline is None:
            baseline_key, baseline = key, tokens
        else:
            div = [first_divergence(a, b) for a, b in zip(baseline, tokens)]
            entry["vs"] = baseline_key
            entry["first_divergence"] = div
            entry["identical"] = len(tokens) == len(baseline) and all(d is None for d in div)
        runs[key] = entry
    compared = [r for r in runs.values() if "identical" in r]
    return {
        "compared": bool(compared),
        "all_identical": bool(compared) and all(r["identical"] for r in compared) and len(compared) == len(runs) - 1,
        "max_tokens": plan.e2e_max_tokens,
        "prompt_lengths": [len(p) for p in prompts],
        "runs": runs,
    }


# ------------------------------------------------------------------ bandwidth


class Timer:
    """Seconds per call of fn: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: str) -> None:
        self.device = device

    def seconds(self, fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
        import torch

        for _ in range(warmup):
            fn()
        if self.device == "cuda":
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3 / iters
        began = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - began) / iters


def copy_bandwidth(plan: Plan) -> dict[str, Any]:
    """Device-to-device copy: bytes read + bytes written per second."""
    import torch

    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    src.fill_(1)
    dst = torch.empty_like(src)
    secs = Timer(plan.device).seconds(lambda: dst.copy_(src), iters=10 if plan.device == "cuda" else 3)
    moved = 2 * plan.copy_bytes
    return {"bytes_copied": plan.copy_bytes, "seconds": secs, "GBps_read_plus_write": moved / secs / 1e9}


def decode_attention(plan: Plan, copy_gbps: float | None) -> dict[str, Any]:
    """Paged decode attention, batch x context, 9 q / 3 kv heads, D 64, block 16.

    K/V bandwidth = bytes of K and V read (every context token of every
    sequence, all kv heads) per second; compared with the copy figure.
    """
    import torch

    from kernels import paged_attention, paged_attention_ref, plan_attention_work

    dtype = getattr(torch, plan.bench_dtype)
    batch, ctx, block_size, hq, hkv, dim = plan.bench_batch, plan.bench_context, 16, 9, 3, 64
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    kv = torch.randn((2, num_blocks, block_size, hkv, dim), generator=gen).to(plan.device, dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(plan.device, torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=plan.device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=plan.device)
    q = torch.randn((batch, hq, dim), generator=gen).to(plan.device, dtype)
    args = (q, kv[0], kv[1], tables, seq_lens, cu, dim**-0.5)

    ref = paged_attention_ref(*args)
    out = paged_attention(*args)
    max_abs_diff = (out.float() - ref.float()).abs().max().item()
    kv_bytes = 2 * batch * ctx * hkv * dim * kv.element_size()
    timer = Timer(plan.device)
    result: dict[str, Any] = {
        "shape": {"batch": batch, "context": ctx, "q_heads": hq, "kv_heads": hkv, "head_dim": dim,
                  "block_size": block_size, "dtype": plan.bench_dtype},
        "kv_bytes_read": kv_bytes,
        "triton_vs_ref_max_abs_diff": max_abs_diff,
        "within_tolerance": max_abs_diff <= (1e-4 if dtype == torch.float32 else 2e-2),
    }
    work = plan_attention_work(cu.cpu(), hq, hkv, plan.device)
    calls: dict[str, Callable[[], Any]] = {
        # The model runner plans the grid once per step: no host sync per layer.
        "triton_planned": lambda: paged_attention(*args, work=work),
        # Planning inside the call: one host sync, as without a plan.
        "triton_unplanned": lambda: paged_attention(*args),
        "torch_ref": lambda: paged_attention_ref(*args),
    }
    for name, call in calls.items():
        secs = timer.seconds(call, iters=plan.bench_iters)
        gbps = kv_bytes / secs / 1e9
        result[name] = {
            "ms": secs * 1e3,
            "kv_GBps": gbps,
            "fraction_of_copy_bandwidth": gbps / copy_gbps if copy_gbps else None,
        }
    return result


# ----------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreted")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/device_check.json)")
    args = parser.parse_args(argv)

    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path.cwd()
    path = args.out or out_dir / "device_check.json"
    report = Report(path)

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        report.data["mode"] = "gpu"
        report.data["fatal"] = "no CUDA device (torch.cuda.is_available() is False); use --dry-run on CPU"
        report.write()
        print(report.data["fatal"], file=sys.stderr)
        return 2
    # Decided before any kernel is decorated (kernels decorate on first launch).
    if args.dry_run and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not args.dry_run:
        os.environ.pop("TRITON_INTERPRET", None)  # native kernels on the GPU
    plan = make_plan(args.dry_run)
    report.data["mode"] = "dry-run" if args.dry_run else "gpu"
    report.data["plan"] = {k: v for k, v in plan.__dict__.items() if k != "e2e_prompts"}
    report.run("environment", environment)

    if args.skip_tests:
        report.skip("kernel_tests", "--skip-tests")
    else:
        timeout = max(30.0, min(plan.tests_timeout_s, report.remaining_s() - 150.0))
        report.run("kernel_tests", lambda: kernel_tests(plan, path.parent, timeout))

    if args.skip_bench:
        report.skip("copy_bandwidth", "--skip-bench")
        report.skip("decode_attention", "--skip-bench")
    else:
        report.run("copy_bandwidth", lambda: copy_bandwidth(plan))
        copy = report.data["sections"]["copy_bandwidth"].get("GBps_read_plus_write")
        report.run("decode_attention", lambda: decode_attention(plan, copy))

    if args.skip_e2e:
        report.skip("e2e_greedy", "--skip-e2e")
    elif report.remaining_s() < 60:
        report.skip("e2e_greedy", f"time budget spent ({report.remaining_s():.0f} s left)")
    else:
        report.run("e2e_greedy", lambda: e2e_greedy(plan))

    sections = report.data["sections"]
    report.data["ok"] = (
        all(s["status"] in ("ok", "skipped") for s in sections.values())
        and sections.get("kernel_tests", {}).get("passed_all", True)
        and sections.get("decode_attention", {}).get("within_tolerance", True)
        and sections.get("e2e_greedy", {}).get("compared", True) is not False
    )
    report.write()
    print(json.dumps({name: s["status"] for name, s in sections.items()} | {"ok": report.data["ok"], "json": str(path)}))
    return 0 if report.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
