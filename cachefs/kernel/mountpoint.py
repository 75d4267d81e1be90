"""The state of a mount point, read from /proc without touching the mount itself.

A hung or crashed FUSE daemon makes any access to its mount block or fail
("Transport endpoint is not connected"), so these helpers read
/proc/self/mountinfo instead of stat-ing the mount wherever they can.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

FSTYPE = "fuse.cachefs"


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    device: str = ""  # "major:minor", as /sys/class/bdi names a mount's readahead setting


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field):
        digits = field[i + 1 : i + 4]
        if field[i] == "\\" and len(digits) == 3 and digits.isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts() -> list[MountEntry]:
    entries = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 2:
                entries.append(MountEntry(_unescape(fields[4]), tail[0], _unescape(tail[1]),
                                          fields[2]))
    return entries


def find_mount(path: str | os.PathLike) -> MountEntry | None:
    """The mount whose mount point is exactly ``path`` (the last one when stacked)."""
    target = os.path.abspath(path)
    found = None
    for entry in mounts():
        if entry.mountpoint == target:
            found = entry
    return found


def probe(path: str | os.PathLike, timeout: float = 5.0) -> int | None:
    """statvfs ``path`` from a helper thread; the errno it failed with, 0 if fine, None if hung.

    statvfs, not stat: after the daemon died the kernel still answers stat from its
    attribute cache (for a day with --revalidate never), while statfs always asks the
    daemon, so a dead mount fails at once with ENOTCONN.
    """
    result: list[int] = []

    def run() -> None:
        try:
            os.statvfs(path)
            result.append(0)
        except OSError as exc:
            result.append(exc.errno or errno.EIO)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else None


def unmount(path: str | os.PathLike, *, lazy: bool = False) -> subprocess.CompletedProcess:
    """fusermount -u (or -uz); falls back to umount(8) where fusermount is missing."""
    if shutil.which("fusermount"):
        command = ["fusermount", "-uz" if lazy else "-u", str(path)]
    elif shutil.which("fusermount3"):
        command = ["fusermount3", "-uz" if lazy else "-u", str(path)]
    else:
        command = ["umount", "-l", str(path)] if lazy else ["umount", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def is_empty_dir(path: Path) -> bool:
    with os.scandir(path) as it:
        return next(it, None) is None
