"""tandem/cpu_quota.py: a container's CPU quota (cgroup v2 and v1, on the process's cgroup or an ancestor)
cuts the cores a service sizes its busy threads by; no quota, or nothing readable, leaves the affinity."""

from __future__ import annotations

from pathlib import Path

from tandem import cpu_quota


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_cgroup_v2_quota_counts_and_the_smallest_limit_up_the_tree_wins(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "0::/kubepods/pod1/ctr\n")
    root = tmp_path / "fs"
    write(root / "kubepods/pod1/ctr/cpu.max", "max 100000\n")  # the container's own: no limit
    write(root / "kubepods/pod1/cpu.max", "250000 100000\n")  # the pod's: 2.5 CPUs
    write(root / "kubepods/cpu.max", "800000 100000\n")
    assert cpu_quota.quota_cores(root, proc) == 2.5
    assert cpu_quota.usable_cores(root, proc) == min(cpu_quota.affinity_cores(), 2)


def test_a_cgroup_v1_quota_counts_and_minus_one_means_none(tmp_path):
    proc = tmp_path / "cgroup"
    write(proc, "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n")
    root = tmp_path / "fs"
    write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")
    write(root / "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cpu_quota.quota_cores(root, proc) == 1.5
    assert cpu_quota.usable_cores(root, proc) == 1  # rounded down, and never none
    write(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert cpu_quota.quota_cores(root, proc) is None
    assert cpu_quota.usable_cores(root, proc) == cpu_quota.affinity_cores()


def test_nothing_readable_means_no_quota(tmp_path):
    assert cpu_quota.quota_cores(tmp_path / "none", tmp_path / "no-cgroup-file") is None
    proc = tmp_path / "cgroup"
    write(proc, "0::/\n")
    write(tmp_path / "fs/cpu.max", "garbage\n")
    assert cpu_quota.quota_cores(tmp_path / "fs", proc) is None
    assert cpu_quota.usable_cores(tmp_path / "none", tmp_path / "no-cgroup-file") == cpu_quota.affinity_cores()
