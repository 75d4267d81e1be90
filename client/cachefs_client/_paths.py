"""Which cachefs mount a file path is on, and what the daemon behind it calls the file.

A training job rarely names its files by the mount point's own path: ``/data`` may be a
symlink to a local disk that holds the mount, Kubernetes shows a subdirectory of the mount
(a hostPath of it, or a ``subPath``) as a bind mount elsewhere, a container sees the mount at
its own ``mountPath``, a script changes into the dataset and uses relative paths.  The
daemon knows a file only by its path relative to its own root (the remote's root), so each
path is mapped in two steps:

1. its directory is resolved as the kernel resolves it: made absolute against the working
   directory, symlinks followed (``os.path.realpath``);
2. ``/proc/self/mountinfo`` names the mount that holds the resolved directory (the longest
   mount point; the last one listed when mounts are stacked), and its root field says which
   directory of the file system that mount shows: ``/`` for the mount itself, ``/c03`` for a
   bind mount of ``MNT/c03``.

The daemon's name for the file is that root, then the resolved directory below the mount
point, then the file's name: a bind mount of ``MNT/c03`` at ``P`` makes ``P/x.jpg`` the
daemon's ``c03/x.jpg``.

Both steps cost system calls (an lstat per component, a read of the mount table), so each
directory is mapped once and remembered by the string the caller gave for it; every later
path in it costs a dict lookup and a string concatenation.  A directory on no cachefs mount
is remembered for MOUNT_TABLE_REFRESH_SECONDS only, so that a mount made later is found.
The file's own name is not resolved: a symlink there is followed by the daemon, inside its
tree only; anything the daemon refuses is read through the mount.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

FSTYPE = "fuse.cachefs"
MOUNTINFO = "/proc/self/mountinfo"
# A path on no cachefs mount has its mapping redone (and the mount table read again) at most
# this often: a mount made after this process started is found within that time.
MOUNT_TABLE_REFRESH_SECONDS = 1.0
MAX_REMEMBERED_DIRECTORIES = 100_000


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo: where a mount is, and what it shows."""

    mount_point: str
    root: str  # the directory of the mounted file system that the mount point shows
    fstype: str


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo``."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        digits = field[i + 1 : i + 4]
        if field[i] == "\\" and len(digits) == 3 and digits.isdigit():
            out.append(chr(int(digits, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def read_mount_table(path: str = MOUNTINFO) -> list[MountEntry]:
    """Every mount this process sees, in the kernel's order (OSError if unreadable)."""
    entries = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and tail:
                entries.append(MountEntry(_unescape(fields[4]), _unescape(fields[3]), tail[0]))
    return entries


def _under(path: str, mount_point: str) -> bool:
    return mount_point == "/" or path == mount_point or path.startswith(mount_point + "/")


def mount_of(directory: str, table: list[MountEntry]) -> MountEntry | None:
    """The mount that holds the resolved absolute ``directory``: the longest mount point
    above it, the last listed of those stacked on one point."""
    found = None
    for entry in table:
        if _under(directory, entry.mount_point) and (
                found is None or len(entry.mount_point) >= len(found.mount_point)):
            found = entry
    return found


def daemon_prefix(directory: str, entry: MountEntry) -> str:
    """The daemon's name for the resolved ``directory`` on ``entry``'s mount, as a prefix
    for file names: ``""`` at the daemon's root, else ending in ``/``."""
    below = directory[len(entry.mount_point):] if entry.mount_point != "/" else directory
    parts = [part for part in (entry.root.strip("/"), below.strip("/")) if part]
    return "/".join(parts) + "/" if parts else ""


class PathMap:
    """File path -> (mount point as this process sees it, the daemon's relative path).

    Thread safety: ``_lock`` serialises mapping a directory not seen yet and reading the
    mount table; the remembered directories are read without it (one dict lookup, atomic
    in CPython), and an entry, once stored, is never changed, only replaced or dropped.
    """

    def __init__(self, mountinfo: str = MOUNTINFO) -> None:
        self._mountinfo = mountinfo
        self._lock = threading.Lock()
        self._table: list[MountEntry] = []
        self._table_read_at = -1e9
        self.table_error: OSError | None = None  # why the mount table could not be read
        # directory as given -> (mount point, daemon prefix), or (None, expiry) when the
        # directory is on no cachefs mount.
        self._by_directory: dict[str, tuple] = {}

    def locate(self, path) -> tuple[str, str] | None:
        """Where the file ``path`` (str, bytes or path-like) is for a cachefs daemon:
        ``(mount point, relative path)``, or None when it is on no cachefs mount."""
        path = os.fspath(path)
        if not isinstance(path, str):
            path = os.fsdecode(path)
        if not path.startswith("/"):
            if not path:
                return None
            try:
                path = os.getcwd() + "/" + path
            except OSError:  # the working directory is gone
                return None
        cut = path.rfind("/")
        directory = path[:cut] or "/"
        found = self._by_directory.get(directory)
        if found is None or (found[0] is None and found[1] <= time.monotonic()):
            found = self._map(directory)
        mount_point, prefix = found
        if mount_point is None:
            return None
        return mount_point, prefix + path[cut + 1:]

    def resolve_directory(self, directory: str) -> tuple[str, MountEntry | None]:
        """The resolved ``directory`` and the mount holding it (None: the table is
        unreadable, see ``table_error``); what a warning tells the user."""
        resolved = os.path.realpath(directory)
        with self._lock:
            table = self._table_locked(fresh=False)
        return resolved, mount_of(resolved, table)

    def _map(self, directory: str) -> tuple:
        resolved = os.path.realpath(directory)
        with self._lock:
            entry = mount_of(resolved, self._table_locked(fresh=False))
            if entry is None or entry.fstype != FSTYPE:
                # Perhaps mounted since the table was read.
                entry = mount_of(resolved, self._table_locked(fresh=True))
            if entry is not None and entry.fstype == FSTYPE:
                found = (entry.mount_point, daemon_prefix(resolved, entry))
            else:
                found = (None, time.monotonic() + MOUNT_TABLE_REFRESH_SECONDS)
            if len(self._by_directory) >= MAX_REMEMBERED_DIRECTORIES:
                self._by_directory = {}
            self._by_directory[directory] = found
            return found

    def _table_locked(self, *, fresh: bool) -> list[MountEntry]:
        """The mount table; read again when ``fresh`` and the last read is old enough."""
        now = time.monotonic()
        if self._table_read_at < 0 or (
                fresh and now - self._table_read_at >= MOUNT_TABLE_REFRESH_SECONDS):
            self._table_read_at = now
            try:
                self._table, self.table_error = read_mount_table(self._mountinfo), None
            except OSError as exc:
                self._table, self.table_error = [], exc
        return self._table
