"""`cachefs mount --dry-run`: what a mount would do, without mounting.

Resolves the settings as a mount does (flags over the config file over the defaults)
and shows each with where it came from; runs the checks a mount runs before it touches
anything, with the same one-line errors; counts the share of the remote's files the
admission hash keeps at this fraction and seed (walking the remote tree, bounded in
files and time, and saying so when it stopped early); and says which data path the
mount would take, or what that depends on when only the mount itself can tell.

Nothing is created, mounted or cleaned up: a stale mount at MOUNTPOINT is reported,
not removed, and the metrics port is bound for an instant only to see that it is free.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import platform
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

from cachefs.errors import UsageError
from cachefs.service.affinity import describe_setting
from cachefs.service.config import FIELD_FOR_KEY, Settings
from cachefs.sizes import format_bytes
from cachefs.store.admission import FractionAdmission
from cachefs.store.layout import MARKER_NAME

# The walk stops at whichever comes first; the hash does not depend on the order, so the
# files seen are a fair sample of the tree for the share they show.
WALK_MAX_FILES = 200_000
WALK_MAX_SECONDS = 10.0
# Bit of CAP_SYS_ADMIN in /proc/self/status CapEff (linux/capability.h).
CAP_SYS_ADMIN = 21


@dataclasses.dataclass
class AdmissionCount:
    files: int = 0
    bytes: int = 0
    kept_files: int = 0
    kept_bytes: int = 0
    complete: bool = True  # False: the walk stopped at a limit
    unreadable: int = 0  # directories that could not be listed
    seconds: float = 0.0


def count_admitted(backing: Path, fraction: float, seed: int, *,
                   max_files: int = WALK_MAX_FILES,
                   max_seconds: float = WALK_MAX_SECONDS) -> AdmissionCount:
    """The files under ``backing`` and those the admission hash keeps, breadth first."""
    admission = FractionAdmission(fraction, seed)
    count = AdmissionCount()
    started = time.monotonic()
    pending: deque[str] = deque([""])
    deadline = started + max_seconds
    while pending:
        relative = pending.popleft()
        try:
            with os.scandir(os.path.join(backing, relative)) as entries:
                for entry in entries:
                    if count.files >= max_files or time.monotonic() > deadline:
                        count.complete = False
                        break
                    relpath = f"{relative}/{entry.name}" if relative else entry.name
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            pending.append(relpath)
                            continue
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        size = entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
                    count.files += 1
                    count.bytes += size
                    if admission.eligible(relpath):
                        count.kept_files += 1
                        count.kept_bytes += size
        except OSError:
            count.unreadable += 1
        if not count.complete:
            break
    count.seconds = time.monotonic() - started
    return count


def _has_cap_sys_admin() -> bool | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def data_path(settings: Settings) -> str:
    """The data path a mount would take, as far as it can be known before mounting."""
    if settings.passthrough == "off":
        return "served by the daemon: passthrough switched off (--passthrough off)"
    cap = _has_cap_sys_admin()
    has_cap = {True: "it has", False: "it lacks", None: "unknown whether it has"}[cap]
    release = platform.release()
    if cap is False:
        return (f"served by the daemon: passthrough needs CAP_SYS_ADMIN, which this user lacks "
                f"(run as root for it); kernel {release}")
    files = ("local files and, for a miss, the remote's own file" if settings.passthrough
             == "auto" else "local files (the daemon reads the remote: --passthrough local)")
    return (f"kernel passthrough of {files} if the kernel offers it when the mount starts "
            f"(Linux 6.9 or newer built with CONFIG_FUSE_PASSTHROUGH; this is {release}) and "
            f"the daemon may register backing files (CAP_SYS_ADMIN: {has_cap}); else served "
            "by the daemon. The log and 'cachefs status' say which after mounting")


def _value_text(key: str, settings: Settings) -> str:
    value = getattr(settings, FIELD_FOR_KEY.get(key, key))
    if key == "log_file" and value is None:
        from cachefs.service.daemon import default_log_file

        return str(default_log_file(settings.mountpoint))
    if key == "runtime_dir" and value is None:
        from cachefs.service.daemon import socket_path

        return str(socket_path(settings).parent)
    if key == "staging_size" and value is None:
        from cachefs.service.memory import default_staging_bytes

        value = default_staging_bytes()
        return f"{format_bytes(value)} ({value:,} bytes; sized from the memory it may use)"
    if key == "cpus":
        return describe_setting(value, str(settings.mountpoint))
    if value is None:
        return {"revalidate": "never", "metrics_addr": "off"}.get(key, "-")
    if key in ("cache_size", "staging_size"):
        return f"{format_bytes(value)} ({value:,} bytes)"
    if key in ("revalidate", "remote_timeout", "peer_timeout"):
        return f"{value:g} s"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def check(settings: Settings) -> list[str]:
    """The checks a mount makes before it changes anything; notes for what only a mount does.

    Raises the UsageError a mount would raise.
    """
    from cachefs.kernel.mountpoint import find_mount, probe
    from cachefs.metrics import Metrics
    from cachefs.service import preflight

    notes = []
    preflight.check_backing(settings.backing)
    preflight.check_paths(settings)
    if find_mount(settings.mountpoint) is not None \
            and probe(settings.mountpoint, timeout=5.0) == errno.ENOTCONN:
        notes.append(f"MOUNTPOINT {settings.mountpoint} holds a stale mount of a daemon that "
                     "died; a mount would clear it first")
    else:
        # Without a mount on it, this only looks.
        preflight.prepare_mountpoint(settings.mountpoint)
    notes.append(_cache_dir_state(settings.cache_dir))
    if beyond := preflight.budget_beyond_disk(settings.cache_dir, settings.cache_size_bytes):
        notes.append(beyond)
    if settings.metrics_addr is not None and settings.metrics_addr.port != 0:
        metrics = Metrics()
        try:
            metrics.serve(settings.metrics_addr)
        finally:
            metrics.close()
    return notes


def _cache_dir_state(cache_dir: Path) -> str:
    try:
        entries = set(os.listdir(cache_dir))
    except FileNotFoundError:
        return f"cache dir {cache_dir} does not exist yet; a mount creates it (mode 0700)"
    except NotADirectoryError:
        raise UsageError(f"--cache-dir {cache_dir} is not a directory; choose a directory "
                         "on the local SSD") from None
    except PermissionError:
        raise UsageError(f"--cache-dir {cache_dir} is not accessible by this user") from None
    if MARKER_NAME in entries:
        return f"cache dir {cache_dir} holds a cachefs cache; a mount reuses it"
    if entries - {"lost+found"}:
        raise UsageError(f"cache dir {cache_dir} is not empty and is not a cachefs cache; "
                         "choose an empty or new directory")
    return f"cache dir {cache_dir} is empty; a mount starts a cache there"


def _admission_lines(settings: Settings, count: AdmissionCount) -> Iterable[str]:
    f = settings.fraction
    if not count.files:
        yield f"  the remote has no files yet; fraction {f:g} keeps that share of those to come"
        return
    share = count.kept_files / count.files
    kept = (f"  fraction {f:g}, seed {settings.seed} keeps {share:.1%} of the files: "
            f"{count.kept_files:,} of {count.files:,}, {format_bytes(count.kept_bytes)} of "
            f"{format_bytes(count.bytes)}")
    if count.complete:
        yield kept + f" (the whole tree, walked in {count.seconds:.1f} s)"
    else:
        yield kept + (f" (sampled: the walk stopped after {count.files:,} files and "
                      f"{count.seconds:.1f} s; the tree holds more)")
    if count.unreadable:
        yield f"  {count.unreadable:,} directories could not be listed and were left out"
    budget = settings.cache_size_bytes
    if not count.complete:
        yield (f"  the whole tree's kept bytes are not known; --cache-size is "
               f"{format_bytes(budget)}")
    elif count.kept_bytes <= budget:
        yield (f"  the cache ({format_bytes(budget)}) holds all of them, "
               f"{count.kept_bytes / budget:.0%} of its budget, index aside")
    else:
        yield (f"  the cache ({format_bytes(budget)}) fills before it holds them all: about "
               f"{budget / count.kept_bytes:.0%} of the kept files; the hit ratio stays below "
               "the fraction. Raise --cache-size or lower --fraction")


def report(settings: Settings, sources: dict[str, str], *,
           max_files: int = WALK_MAX_FILES, max_seconds: float = WALK_MAX_SECONDS) -> str:
    """The whole dry-run report; raises the UsageError a mount would raise."""
    notes = check(settings)
    values = {key: _value_text(key, settings) for key in sources}
    width = max(map(len, sources))
    value_width = max(map(len, values.values()))
    lines = [f"cachefs mount --dry-run: {settings.backing} at {settings.mountpoint}; "
             "nothing mounted", "settings (from: flag, config file or default):"]
    for key, source in sources.items():
        lines.append(f"  {key:<{width}}  {values[key]:<{value_width}}  {source}")
    lines.append("admission:")
    count = count_admitted(settings.backing, settings.fraction, settings.seed,
                           max_files=max_files, max_seconds=max_seconds)
    lines.extend(_admission_lines(settings, count))
    lines.append("data path:")
    lines.append(f"  {data_path(settings)}")
    lines.append("checks:")
    lines.append("  BACKING readable, MOUNTPOINT an empty directory, the paths apart, "
                 "the metrics address free")
    lines.extend(f"  {note}" for note in notes)
    return "\n".join(lines)
