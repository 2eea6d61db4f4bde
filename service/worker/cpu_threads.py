"""How many CPU threads this process should compute with: its affinity mask and its CPU quota.

A container limited to 1.5 CPUs by its cgroup still sees every core of the host in
`os.sched_getaffinity()`; sizing torch's thread pool to the host would put more threads
than CPU time in the pool, and threads that wait on a descheduled sibling at every
barrier lose far more than the missing share. The quota comes from:

- cgroup v2: `cpu.max` = "QUOTA PERIOD" (microseconds) or "max PERIOD" (no limit);
- cgroup v1: `cpu.cfs_quota_us` (-1 = no limit) over `cpu.cfs_period_us`;

read in the process's own cgroup (`/proc/self/cgroup`) under each cgroup mount that
carries the cpu controller (`/proc/self/mountinfo`) and in every ancestor up to the
mount point: the tightest limit on the way up binds. Cores = ceil(quota / period), as
the Go runtime (1.25, GOMAXPROCS) and the JVM (active processor count) round it.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CgroupMount:
    """A cgroup file system mount: version 1 or 2, where it is, the cgroup path at its root."""

    version: int
    mount_point: Path
    root: str


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as \\ooo (octal)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def cpu_mounts(mountinfo: str) -> list[CgroupMount]:
    """The cgroup2 mounts and the cgroup v1 mounts of the cpu controller in a
    /proc/self/mountinfo text. E.g. the line
    `32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu`
    -> CgroupMount(1, Path("/sys/fs/cgroup/cpu"), "/")."""
    mounts = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup2":
            mounts.append(CgroupMount(2, Path(_unescape(fields[4])), _unescape(fields[3])))
        elif fstype == "cgroup" and "cpu" in options:
            mounts.append(CgroupMount(1, Path(_unescape(fields[4])), _unescape(fields[3])))
    return mounts


def own_cgroups(proc_cgroup: str) -> dict[int, str]:
    """{1: path of the v1 cpu hierarchy, 2: path in the unified hierarchy} from a
    /proc/self/cgroup text ("ID:controllers:path" lines; v2 is "0::path")."""
    paths: dict[int, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            paths[2] = path
        elif "cpu" in controllers.split(","):
            paths[1] = path
    return paths


def _limit_v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    q, p = float(quota), float(period)
    return q / p if q > 0 and p > 0 else None


def _limit_v1(folder: Path) -> float | None:
    try:
        q = float((folder / "cpu.cfs_quota_us").read_text())
        p = float((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def _folders(mount: CgroupMount, path: str) -> list[Path]:
    """The process's cgroup folder under `mount` and its ancestors up to the mount point.
    A path outside the mount's root (a cgroup namespace shows "/") maps to the mount point."""
    rel = path
    if mount.root != "/" and (path == mount.root or path.startswith(mount.root.rstrip("/") + "/")):
        rel = path[len(mount.root):]
    elif mount.root != "/":
        rel = "/"
    folder = mount.mount_point / rel.lstrip("/")
    out = [folder]
    while folder != mount.mount_point and mount.mount_point in folder.parents:
        folder = folder.parent
        out.append(folder)
    return out


def cpu_quota(mountinfo_path: str | Path = "/proc/self/mountinfo",
              cgroup_path: str | Path = "/proc/self/cgroup") -> float | None:
    """The CPU quota of this process in cores (e.g. 1.5), the tightest over cgroup v1 and
    v2 and over the cgroup's ancestors; None when no limit is set or nothing is readable.
    Never raises (a missing /proc or cgroup file means "no limit known")."""
    try:
        mounts = cpu_mounts(Path(mountinfo_path).read_text())
        own = own_cgroups(Path(cgroup_path).read_text())
    except OSError:
        return None
    limits = []
    for mount in mounts:
        if mount.version not in own:
            continue
        read = _limit_v2 if mount.version == 2 else _limit_v1
        limits += [q for q in map(read, _folders(mount, own[mount.version])) if q is not None]
    return min(limits) if limits else None


_READ = object()


def default_num_threads(affinity: int | None = None, quota: object = _READ) -> int:
    """Threads to compute with: the CPUs of the affinity mask, capped by ceil(CPU quota).

    affinity: CPUs allowed (None: len(os.sched_getaffinity(0)), or os.cpu_count()).
    quota: cores as a float, None for no limit; by default read with `cpu_quota()`.
    Always >= 1. E.g. 8 CPUs in the mask, cpu.max "150000 100000" -> min(8, ceil(1.5)) = 2.
    """
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            affinity = os.cpu_count() or 1
    if quota is _READ:
        quota = cpu_quota()
    n = affinity if quota is None else min(affinity, math.ceil(float(quota) - 1e-9))
    return max(1, n)
