"""Prefetched files that the cache does not keep, held until read once.

A hint for a file outside the admitted fraction (or arriving when the cache is
full) is still worth fetching ahead: the reader then waits for memory instead
of the remote.  What waits here is a descriptor per file, until a reader opens
the file; that reader takes the descriptor (the kernel reads it, or the fast
path hands it over) and it leaves the area.  The descriptor is an anonymous
memory file (memfd) holding the bytes: copied into it by the kernel from the
remote's own file where the kernel reads the remote, so that the reader's open
asks nothing of the remote (a passthrough open opens its backing file again:
on NFS an OPEN round trip per reader); else written from the bytes the daemon
fetched.  The exception is a file a reader opened moments ago whose pages are
still on their way to it: the remote's own open file, not copied beside that
reader (the prefetcher's RECENT_OPEN_SECONDS).  Either way the area holds at
most ``capacity_bytes`` of files (memory of the daemon's, or pages in the
kernel's cache) and ``max_files`` descriptors.  A file hinted again before it
was read (the end of one epoch and the start of the next can name the same
file) waits for as many readers as hints.  Files nobody takes within
``ttl_seconds`` are dropped and counted as wasted.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from cachefs.attr import Version

# The reads of one epoch and of the next: more hints for a file not read yet are stale.
MAX_READERS = 2


_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def memory_file(name: str, data: bytes) -> int:
    """A descriptor of an anonymous memory file holding ``data``, sealed (:func:`seal`)."""
    fd = new_memory_file(name)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def new_memory_file(name: str) -> int:
    """An empty anonymous memory file, to be written, then sealed."""
    return os.memfd_create(name[-200:] or "staged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


def seal(fd: int) -> None:
    """Seal a written memory file: whoever is handed it (the kernel, a fast-path reader) can
    read it and never change it."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)


# Descriptors held at most: well inside the daemon's own limit.
DEFAULT_MAX_FILES = 4096


@dataclass
class _Staged:
    version: Version
    fd: int
    size: int
    staged_at: float
    readers: int = 1  # reads still expected, one per hint
    kind: str = "memory"  # "memory" (a memfd of its bytes) or "remote" (the remote's file)


class Taken(NamedTuple):
    """A staged file's descriptor, now the taker's, and what it is ("memory", "remote")."""

    fd: int
    kind: str


class StagingArea:
    """Memory-bounded prefetched files by path.

    Thread safety: ``_cond`` (and its lock) guards everything; waiting for room
    happens on the condition, never while holding other locks.  A descriptor taken
    out of the area belongs to the taker.
    """

    def __init__(self, capacity_bytes: int, ttl_seconds: float = 120.0,
                 on_wasted: Callable[[int], None] = lambda files: None,
                 max_files: int = DEFAULT_MAX_FILES) -> None:
        self.capacity_bytes = capacity_bytes
        self.max_files = max_files
        self.ttl_seconds = ttl_seconds
        self._on_wasted = on_wasted
        self._cond = threading.Condition()
        self._entries: dict[str, _Staged] = {}
        self._used = 0  # staged plus reserved bytes
        self._files = 0  # staged plus reserved descriptors

    @property
    def used_bytes(self) -> int:
        return self._used

    def fits(self, size: int) -> bool:
        """Whether a file of ``size`` bytes can ever be staged (a quarter of the budget at most)."""
        return size <= self.capacity_bytes // 4

    def reserve(self, size: int, timeout: float) -> bool:
        """Wait up to ``timeout`` for room for a file of ``size`` bytes and hold it; False if
        none came."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._room_locked(size):
                self._expire_locked()
                if self._room_locked(size):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 1.0))
            self._used += size
            self._files += 1
            return True

    def _room_locked(self, size: int) -> bool:
        return self._used + size <= self.capacity_bytes and self._files < self.max_files

    def release(self, size: int) -> None:
        """Give back room reserved for a fetch that failed."""
        with self._cond:
            self._used -= size
            self._files -= 1
            self._cond.notify_all()

    def put(self, relpath: str, version: Version, fd: int, size: int, reserved: int,
            readers: int = 1, kind: str = "memory") -> None:
        """Stage ``fd`` (a file of ``size`` bytes, owned by the area from now on; ``kind`` as
        in :class:`Taken`) in the room reserved for it, for ``readers`` reads."""
        with self._cond:
            self._used += size - reserved
            old = self._entries.pop(relpath, None)
            if old is not None:
                self._discard_locked(old)
                self._on_wasted(1)
            self._entries[relpath] = _Staged(version, fd, size, time.monotonic(),
                                             min(readers, MAX_READERS), kind)
            self._cond.notify_all()

    def add_reader(self, relpath: str, version: Version) -> bool:
        """One more read of a staged file is coming: keep it for that one too (up to
        MAX_READERS: a hint whose reader came first must not pin it).  False when this
        version of the file is not staged.  The time to live is not extended."""
        with self._cond:
            entry = self._entries.get(relpath)
            if entry is None or entry.version != version:
                return False
            entry.readers = min(entry.readers + 1, MAX_READERS)
            return True

    def take(self, relpath: str, version: Version) -> Taken | None:
        """A descriptor of this version of the staged file, for the caller to keep; it
        leaves the area with the last expected reader.  None if not staged."""
        with self._cond:
            entry = self._entries.get(relpath)
            if entry is None:
                return None
            if entry.readers > 1 and entry.version == version:
                entry.readers -= 1
                return Taken(os.dup(entry.fd), entry.kind)
            del self._entries[relpath]
            self._used -= entry.size
            self._files -= 1
            self._cond.notify_all()
        if entry.version != version:
            os.close(entry.fd)
            self._on_wasted(1)
            return None
        return Taken(entry.fd, entry.kind)

    def __contains__(self, relpath: str) -> bool:
        return relpath in self._entries

    def expire(self) -> None:
        with self._cond:
            self._expire_locked()

    def close(self) -> None:
        with self._cond:
            for entry in self._entries.values():
                self._discard_locked(entry)
            self._entries.clear()

    def _discard_locked(self, entry: _Staged) -> None:
        self._used -= entry.size
        self._files -= 1
        os.close(entry.fd)

    def _expire_locked(self) -> None:
        cutoff = time.monotonic() - self.ttl_seconds
        stale = [path for path, entry in self._entries.items() if entry.staged_at < cutoff]
        for path in stale:
            self._discard_locked(self._entries.pop(path))
        if stale:
            self._on_wasted(len(stale))
            self._cond.notify_all()
