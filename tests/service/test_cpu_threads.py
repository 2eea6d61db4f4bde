"""CPU quota parsing from fake cgroup v1 / v2 trees, and the default thread count."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import ModelConfig
from service.worker.cpu_threads import (CgroupMount, cpu_mounts, cpu_quota, default_num_threads,
                                 own_cgroups)


def _tree(tmp_path: Path, mountinfo: str, cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    """Write fake /proc/self/{mountinfo,cgroup} and cgroup files; MNT in texts = tmp_path."""
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    mi, cg = tmp_path / "mountinfo", tmp_path / "cgroup"
    mi.write_text(mountinfo.replace("MNT", str(tmp_path)))
    cg.write_text(cgroup)
    return mi, cg


V2_MOUNT = "30 23 0:26 / MNT/v2 rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNT = "32 31 0:29 / MNT/v1cpu rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"


def test_v2_quota_in_own_cgroup(tmp_path) -> None:
    mi, cg = _tree(tmp_path, V2_MOUNT, "0::/app\n", {"v2/app/cpu.max": "150000 100000\n"})
    assert cpu_quota(mi, cg) == pytest.approx(1.5)


def test_v2_max_means_no_limit_and_an_ancestor_binds(tmp_path) -> None:
    mi, cg = _tree(tmp_path, V2_MOUNT, "0::/kube/pod/app\n",
                   {"v2/kube/pod/app/cpu.max": "max 100000\n",
                    "v2/kube/pod/cpu.max": "50000 100000\n",
                    "v2/kube/cpu.max": "400000 100000\n"})
    assert cpu_quota(mi, cg) == pytest.approx(0.5)


def test_v2_unlimited_everywhere(tmp_path) -> None:
    mi, cg = _tree(tmp_path, V2_MOUNT, "0::/app\n", {"v2/app/cpu.max": "max 100000\n",
                                                    "v2/cpu.max": "max 100000\n"})
    assert cpu_quota(mi, cg) is None


def test_v1_cfs_quota(tmp_path) -> None:
    mi, cg = _tree(tmp_path, V1_MOUNT, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n",
                   {"v1cpu/docker/abc/cpu.cfs_quota_us": "250000\n",
                    "v1cpu/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(mi, cg) == pytest.approx(2.5)


def test_v1_minus_one_is_no_limit(tmp_path) -> None:
    mi, cg = _tree(tmp_path, V1_MOUNT, "3:cpu,cpuacct:/\n",
                   {"v1cpu/cpu.cfs_quota_us": "-1\n", "v1cpu/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(mi, cg) is None


def test_hybrid_takes_the_tightest_of_v1_and_v2(tmp_path) -> None:
    mi, cg = _tree(tmp_path, V2_MOUNT + V1_MOUNT, "3:cpu,cpuacct:/a\n0::/a\n",
                   {"v2/a/cpu.max": "300000 100000\n",
                    "v1cpu/a/cpu.cfs_quota_us": "120000\n",
                    "v1cpu/a/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(mi, cg) == pytest.approx(1.2)


def test_cgroup_namespace_maps_to_the_mount_point(tmp_path) -> None:
    # inside a container the mount's root is the container's cgroup and /proc shows "/"
    mount = "30 23 0:26 /docker/abc MNT/v2 rw - cgroup2 cgroup2 rw\n"
    mi, cg = _tree(tmp_path, mount, "0::/\n", {"v2/cpu.max": "200000 100000\n"})
    assert cpu_quota(mi, cg) == pytest.approx(2.0)
    # a path below the mount's root is found relative to it
    mi, cg = _tree(tmp_path, mount, "0::/docker/abc/worker\n",
                   {"v2/worker/cpu.max": "100000 100000\n"})
    assert cpu_quota(mi, cg) == pytest.approx(1.0)


def test_missing_or_garbled_files_mean_no_limit(tmp_path) -> None:
    assert cpu_quota(tmp_path / "none", tmp_path / "none") is None
    mi, cg = _tree(tmp_path, V2_MOUNT, "0::/app\n", {"v2/app/cpu.max": "garbage\n"})
    assert cpu_quota(mi, cg) is None


def test_parsers() -> None:
    text = (V2_MOUNT + V1_MOUNT + "33 31 0:30 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
            "40 23 0:40 / /mnt/with\\040space rw - cgroup2 cgroup2 rw\n")
    mounts = cpu_mounts(text)
    assert mounts[0] == CgroupMount(2, Path("MNT/v2"), "/")
    assert mounts[1] == CgroupMount(1, Path("MNT/v1cpu"), "/")
    assert mounts[2].mount_point == Path("/mnt/with space") and len(mounts) == 3
    assert own_cgroups("12:cpuset:/\n3:cpu,cpuacct:/a\n0::/b\n") == {1: "/a", 2: "/b"}


@pytest.mark.parametrize("affinity, quota, expected", [
    (8, None, 8), (8, 1.5, 2), (8, 2.0, 2), (2, 4.0, 2), (4, 0.2, 1), (1, None, 1)])
def test_default_num_threads(affinity, quota, expected) -> None:
    assert default_num_threads(affinity, quota) == expected


def test_default_num_threads_reads_this_machine() -> None:
    import os

    assert 1 <= default_num_threads() <= len(os.sched_getaffinity(0))


def test_num_threads_config() -> None:
    assert ModelConfig(num_threads=3).num_threads == 3
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_threads"):
            ModelConfig(num_threads=bad)


def test_num_threads_flag_reaches_the_config() -> None:
    from service.engine_args import build_parser, engine_config

    a = build_parser().parse_args(["serve", "--num-threads", "3"])
    assert engine_config(a).model.num_threads == 3
    assert engine_config(build_parser().parse_args(["serve"])).model.num_threads is None
