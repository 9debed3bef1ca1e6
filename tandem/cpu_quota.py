"""How many cores this process may use: its CPU affinity, and its cgroup's CPU quota.

A container limited to N CPUs (Kubernetes `resources.limits.cpu`, `docker run --cpus`) usually still sees
every core of the host in its affinity mask and in os.cpu_count(); the limit is a quota of CPU time per
period in its cgroup, and a process that keeps more threads busy than the quota allows is throttled as a
whole, every thread stopped until the next period. Sizing busy threads by the affinity alone would spin a
quota'd service into throttling (`tandem serve`'s spinning lane reads) or start more OpenMP threads than
it may run (a CPU serve's torch).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _up(base: Path, relative: str) -> list[Path]:
    """base/relative and each of its parents up to base: a limit may be set on an ancestor."""
    parts = [part for part in relative.split("/") if part]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(directory: Path) -> float | None:
    text = _read(directory / "cpu.max")  # "QUOTA PERIOD" in microseconds, or "max PERIOD"
    if text is None:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(directory: Path) -> float | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    try:
        quota_us, period_us = int(quota or ""), int(period or "")
    except ValueError:
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None  # -1: no limit


def quota_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPUs' worth of time the process's cgroup (or an ancestor) may use per period, the smallest limit
    found; None where none is set or none can be read (not Linux, no cgroup file system)."""
    lines = (_read(proc_cgroup) or "").splitlines()
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2: one unified hierarchy
            limits += [_v2_quota(directory) for directory in _up(root, path)]
        elif "cpu" in controllers.split(","):
            for name in V1_CPU_DIRS:
                if (root / name).is_dir():
                    limits += [_v1_quota(directory) for directory in _up(root / name, path)]
                    break
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def affinity_cores() -> int:
    """The cores this process may run on (all the machine's where that is not known)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def usable_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """Cores this process may keep busy: its affinity, cut to its cgroup's quota, rounded down (a quota of
    2.5 CPUs keeps two threads busy without throttling), at least one."""
    cores = affinity_cores()
    quota = quota_cores(root, proc_cgroup)
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, cores)
