"""The CPUs the serving process's threads run on (--cpus).

The daemon's Python runs under one interpreter lock: its threads take turns, never run
Python at once.  Spread over the machine's CPUs, a turn handed to a thread on another CPU
wakes that CPU (a futex wake; on a virtual machine a halted CPU is woken through the
hypervisor) and switches context on both; on one CPU the thread giving the lock up runs on
into its system call and the next takes the lock without waking anything.  The local tree
as the remote, 4,000 files of 64 KiB, 8 readers free on 2 cores (`bench.datapath`, 2 rounds
in turns): with the serving process on one CPU, a fill 4,538 - 4,753 files/s at 300 us of
daemon CPU per file, against 3,220 - 3,491 at 530 spread over both; a miss not kept 7,424 -
7,600 at 115 - 118 us against 5,475 - 6,171 at 150 - 172; voluntary context switches per
fill 0.7 - 0.8 against 13 - 18.

So by default (``auto``) the serving process keeps its threads on one CPU of those it may
run on, chosen from the mount point, so that the daemons of several mounts take different
CPUs where there are enough.  Work that can use more CPUs goes to processes of its own,
which keep every CPU (fill processes, --fill-processes).  ``all`` leaves the threads to the
kernel's scheduler, and a list (``3``, ``0,2``, ``4-7``) names the CPUs.
"""

from __future__ import annotations

import logging
import os
import zlib

from cachefs.limits import ALLOWED_CPUS

log = logging.getLogger(__name__)

AUTO, ALL = "auto", "all"


def parse_cpus(value: object, allowed: frozenset[int] = ALLOWED_CPUS) -> str | frozenset[int]:
    """``auto``, ``all`` or a list of CPU numbers and ranges (``0,2``, ``4-7``) among those
    ``allowed`` (this process's affinity and cpuset); ValueError for anything else."""
    text = "" if isinstance(value, bool) else str(value).strip().lower()
    if text in (AUTO, ALL):
        return text
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, dash, last = part.strip().partition("-")
            low, high = int(first), int(last) if dash else int(first)
            if low < 0 or high < low:
                raise ValueError
            cpus.update(range(low, high + 1))
    except ValueError:
        raise ValueError(f"{value!r} is not 'auto', 'all' or a list of CPUs such as "
                         "0,2-3") from None
    outside = sorted(cpus - allowed)
    if outside:
        raise ValueError(f"CPU {outside[0]} is not one this process may run on "
                         f"({_spans(allowed)})")
    return frozenset(cpus)


def serving_cpus(setting: str | frozenset[int], mountpoint: str,
                 allowed: frozenset[int] = ALLOWED_CPUS) -> frozenset[int] | None:
    """The CPUs the serving process keeps to (``setting`` as parse_cpus gave it), None for
    all it may run on."""
    if setting == ALL:
        return None
    if setting == AUTO:
        ordered = sorted(allowed)
        setting = frozenset({ordered[zlib.crc32(mountpoint.encode()) % len(ordered)]})
    return setting if setting != allowed else None


def keep_to(cpus: frozenset[int] | None) -> None:
    """Keep every thread of this process, and those it starts from now on, to ``cpus``."""
    if cpus is None:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile
        except OSError as exc:  # a cpuset narrowed since the start: served as it was
            log.warning("cannot keep to CPU %s (%s); serving on every CPU it may run on",
                        _spans(cpus), exc.strerror)
            return
    log.info("serving on CPU %s", _spans(cpus))


def _spans(cpus: frozenset[int]) -> str:
    """0,2-5 for {0, 2, 3, 4, 5}."""
    spans: list[str] = []
    for cpu in sorted(cpus):
        if spans and spans[-1].rpartition("-")[2] == str(cpu - 1):
            spans[-1] = f"{spans[-1].partition('-')[0]}-{cpu}"
        else:
            spans.append(str(cpu))
    return ",".join(spans)


def describe(cpus: frozenset[int] | None) -> str:
    return "all it may run on" if cpus is None else _spans(cpus)


def describe_setting(setting: str | frozenset[int], mountpoint: str) -> str:
    """What ``setting`` comes to for the mount at ``mountpoint``: "auto: CPU 3 of 0-7"."""
    cpus = serving_cpus(setting, mountpoint)
    named = setting if isinstance(setting, str) else _spans(setting)
    return f"{named}: CPU {describe(cpus)} of {_spans(ALLOWED_CPUS)}" if cpus is not None \
        else f"{named}: every CPU it may run on ({_spans(ALLOWED_CPUS)})"
