"""Prefetched files that the cache does not keep, held in memory until read once.

A hint for a file outside the admitted fraction (or arriving when the cache is
full) is still worth fetching ahead: the reader then waits for memory instead
of the remote.  The bytes wait here, within a fixed memory budget, until a
reader opens the file; that reader takes them and they leave the area.  A file
hinted again before it was read (the end of one epoch and the start of the
next can name the same file) waits for as many readers as hints.  Bytes nobody
takes within ``ttl_seconds`` are dropped and counted as wasted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cachefs.attr import Version

# The reads of one epoch and of the next: more hints for a file not read yet are stale.
MAX_READERS = 2


@dataclass
class _Staged:
    version: Version
    data: bytes
    staged_at: float
    readers: int = 1  # reads still expected, one per hint


class StagingArea:
    """Memory-bounded prefetched bytes by path.

    Thread safety: ``_cond`` (and its lock) guards everything; waiting for room
    happens on the condition, never while holding other locks.
    """

    def __init__(self, capacity_bytes: int, ttl_seconds: float = 120.0,
                 on_wasted: Callable[[int], None] = lambda files: None) -> None:
        self.capacity_bytes = capacity_bytes
        self.ttl_seconds = ttl_seconds
        self._on_wasted = on_wasted
        self._cond = threading.Condition()
        self._entries: dict[str, _Staged] = {}
        self._used = 0  # staged plus reserved bytes

    @property
    def used_bytes(self) -> int:
        return self._used

    def fits(self, size: int) -> bool:
        """Whether a file of ``size`` bytes can ever be staged (a quarter of the budget at most)."""
        return size <= self.capacity_bytes // 4

    def reserve(self, size: int, timeout: float) -> bool:
        """Wait up to ``timeout`` for room for ``size`` bytes and hold it; False if none came."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._used + size > self.capacity_bytes:
                self._expire_locked()
                if self._used + size <= self.capacity_bytes:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 1.0))
            self._used += size
            return True

    def release(self, size: int) -> None:
        """Give back room reserved for a fetch that failed."""
        with self._cond:
            self._used -= size
            self._cond.notify_all()

    def put(self, relpath: str, version: Version, data: bytes, reserved: int,
            readers: int = 1) -> None:
        """Stage ``data`` in the room reserved for it, for ``readers`` reads."""
        with self._cond:
            self._used += len(data) - reserved
            old = self._entries.pop(relpath, None)
            if old is not None:
                self._used -= len(old.data)
                self._on_wasted(1)
            self._entries[relpath] = _Staged(version, data, time.monotonic(),
                                             min(readers, MAX_READERS))
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

    def take(self, relpath: str, version: Version) -> bytes | None:
        """The staged bytes of this version of the file; they leave the area with the
        last expected reader.  None if not staged."""
        with self._cond:
            entry = self._entries.get(relpath)
            if entry is None:
                return None
            if entry.readers > 1 and entry.version == version:
                entry.readers -= 1
                return entry.data
            del self._entries[relpath]
            self._used -= len(entry.data)
            self._cond.notify_all()
        if entry.version != version:
            self._on_wasted(1)
            return None
        return entry.data

    def __contains__(self, relpath: str) -> bool:
        return relpath in self._entries

    def expire(self) -> None:
        with self._cond:
            self._expire_locked()

    def _expire_locked(self) -> None:
        cutoff = time.monotonic() - self.ttl_seconds
        stale = [path for path, entry in self._entries.items() if entry.staged_at < cutoff]
        for path in stale:
            self._used -= len(self._entries.pop(path).data)
        if stale:
            self._on_wasted(len(stale))
            self._cond.notify_all()
