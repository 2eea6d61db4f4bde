"""What machine a benchmark ran on: the CPU's model name and the x86 extensions that decide
which kernels run (Conveyor's and llama.cpp's), torch's CPU capability, and the commit.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

# summary name -> the /proc/cpuinfo flags that make it (all of them)
FLAG_GROUPS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl"),
    "avx512_vnni": ("avx512_vnni",),
    "avx_vnni": ("avx_vnni",),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_int8", "amx_bf16"),
}


def cpu_summary(cpuinfo: str) -> dict[str, object]:
    """{"model_name", "logical_cpus", "flags": {group: bool}} of a /proc/cpuinfo text
    (the first processor's model name and flags). E.g. a Zen 4 gives avx2, avx512,
    avx512_vnni and avx512_bf16 True, amx False."""
    model, flags, cpus = None, set(), 0
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "processor":
            cpus += 1
        elif key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {"model_name": model, "logical_cpus": cpus,
            "flags": {name: all(f in flags for f in need) for name, need in FLAG_GROUPS.items()}}


def flags_text(summary: dict[str, object]) -> str:
    """The groups present, e.g. "avx2 avx512 avx512_vnni avx512_bf16" ("none" if none)."""
    on = [name for name, ok in summary["flags"].items() if ok]  # type: ignore[union-attr]
    return " ".join(on) or "none"


def machine_info(repo: Path) -> dict[str, object]:
    """The CPU (cpu_summary of this machine), torch's CPU capability and `git rev-parse
    HEAD` of `repo` (None when git fails)."""
    import torch

    try:
        cpu = cpu_summary(Path("/proc/cpuinfo").read_text())
    except OSError:
        cpu = {"model_name": None, "logical_cpus": None, "flags": {}}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"cpu": cpu, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "commit": commit}
