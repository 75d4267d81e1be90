"""What of this machine the daemon may use: its CPUs and its memory, as the machine, the CPU
affinity and the cgroups it runs in (a systemd unit's CPUQuota= and MemoryMax=, a pod's
limits) allow.

The daemon sizes by them what would otherwise follow the machine: the threads that copy and
fetch from a fast remote and the threads serving the kernel (cores), the files held registered
with the kernel and the staging area (memory, service/memory.py).  A pod limited to 4 CPUs on
a node of 96 cores that started threads for 96 would have the kernel throttle it for the
whole of each period it overran, readers' opens waiting meanwhile.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_MEMBERSHIP = Path("/proc/self/cgroup")


def usable_cores(root: Path = _CGROUP_ROOT, membership: Path = _MEMBERSHIP) -> int:
    """The CPUs this process may run on at once: those its affinity allows, fewer where its
    cgroups' CPU quota is lower (rounded up: 1.5 CPUs' worth keeps 2 threads busy half the
    time each); at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except OSError:
        cores = os.cpu_count() or 1
    quota = cpu_quota(root, membership)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


@contextmanager
def every_cpu() -> Iterator[None]:
    """Let the calling thread run on every CPU this process could at start (ALLOWED_CPUS)
    for the duration, then keep it to those it kept to before.  For work in the kernel that
    takes no turn at the interpreter lock, such as the copy of a large file, on a thread of
    a serving process that keeps to one CPU (service/affinity.py)."""
    before = os.sched_getaffinity(0)
    try:
        if before != ALLOWED_CPUS:
            os.sched_setaffinity(0, ALLOWED_CPUS)
    except OSError:  # a cpuset narrowed since the start: the thread stays where it was
        before = ALLOWED_CPUS
    try:
        yield
    finally:
        if before != ALLOWED_CPUS:
            os.sched_setaffinity(0, before)


def cpu_quota(root: Path = _CGROUP_ROOT, membership: Path = _MEMBERSHIP) -> float | None:
    """The lowest CPU quota, in CPUs, on this process's cgroup and its ancestors (cgroup v2's
    cpu.max), or its v1 cpu cgroup's (cpu.cfs_quota_us); None for none, or where they cannot
    be read."""
    return _cgroup_limit(root, membership, "cpu", _read_cpu_max, _v1_cpu_quota)


def memory_limit_bytes() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit()
    return min(total, limit) if limit else total


def cgroup_memory_limit(root: Path = _CGROUP_ROOT,
                        membership: Path = _MEMBERSHIP) -> int | None:
    """The lowest memory limit on this process's cgroup and its ancestors (cgroup v2), or
    its v1 memory cgroup's; None for none, or where they cannot be read."""
    return _cgroup_limit(root, membership, "memory",
                         lambda here: _read_bytes(here / "memory.max"), _v1_memory_limit)


def _cgroup_limit(root: Path, membership: Path, controller: str, read_v2, read_v1):
    """The lowest of ``read_v2(directory)`` over this process's v2 cgroup and its ancestors
    when v2 is mounted alone, else ``read_v1(directory)`` of its v1 ``controller`` cgroup."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    unified = (root / "cgroup.controllers").exists()  # v2 mounted alone, not beside v1
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "" and unified:
            return _lowest_above(root, root / path.lstrip("/"), read_v2)
        if controller in controllers.split(","):
            # Mounted under its own name, or under the names it shares ("cpu,cpuacct").
            hierarchy = root / controller
            if not hierarchy.exists():
                hierarchy = root / controllers
            # In a container the cgroup's own directory is the hierarchy's root.
            for here in (hierarchy / path.lstrip("/"), hierarchy):
                if here.is_dir():
                    return read_v1(here)
            return None
    return None


def _lowest_above(root: Path, here: Path, read):
    """A limit anywhere above ``here`` applies; in a container the walk ends at its own
    cgroup, which is the root it sees."""
    limits = [read(here)]
    while here != root and root in here.parents:
        here = here.parent
        limits.append(read(here))
    found = [limit for limit in limits if limit]
    return min(found) if found else None


def _read_cpu_max(here: Path) -> float | None:
    """cpu.max: "QUOTA PERIOD" in microseconds, or "max PERIOD"."""
    try:
        quota, period = (here / "cpu.max").read_text().split()
        return int(quota) / int(period) if int(period) > 0 else None
    except (OSError, ValueError):  # "max", or no such file (the root cgroup has none)
        return None


def _v1_cpu_quota(here: Path) -> float | None:
    try:
        quota = int((here / "cpu.cfs_quota_us").read_text())
        period = int((here / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None  # -1: no quota


def _v1_memory_limit(here: Path) -> int | None:
    return _read_bytes(here / "memory.limit_in_bytes")


def _read_bytes(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max"
        return None
    limit = int(text)
    # v1 says "no limit" with the largest page-aligned 64-bit number.
    return limit if limit < 1 << 62 else None


# Computed once, at import: the daemon sizes its threads by them at start, before its serving
# process keeps to fewer CPUs (service/affinity.py), and gives the processes it starts
# ALLOWED_CPUS again.
ALLOWED_CPUS = frozenset(os.sched_getaffinity(0))
CORES = usable_cores()
