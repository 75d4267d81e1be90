"""Which cache files stay registered with the kernel across opens: a stable set, not the
most recent.

A held file costs an open of it nothing but a stat (mirrorfs.py); one not held costs opening
the cache file, reading its check mark and registering it with the kernel, then closing it
at the release: some 30 us of daemon CPU more per open (10,000 cached files revalidated
every pass, 8 readers: 116 - 124 us per file with all of them held, 147 - 151 with 2,000).
``--held-files`` bounds them by what they cost the kernel, and at a million files of a
machine of 24 GiB the bound is a fifth of them.

Which fifth matters.  A dataset is read in a new random order each epoch, so a file is
opened again about an epoch later, after every other file.  Holding the most recently opened
files then holds almost none of those opened next: a file comes back while still held only
when it was opened late in one epoch and early in the next, 2 % of the opens with a fifth of
the files held (the thrashing of an LRU cache under shuffling that the cache itself avoids
with a stable fraction).  So the files held are the first to come while there is room, and
one is pushed out only for a file opened now when it has not been opened for
HELD_IDLE_SECONDS: a fifth of the opens of every epoch find their file held, and a new
workload still takes the room of an old one.

How long a file has been idle is told without a time per file: every TICK_SECONDS a marker
goes in at the recent end of the same order of use.  A file before the oldest marker was
last opened before that marker's time.

Thread safety: none of its own; the caller holds ``MirrorFS._lock``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

# A held file not opened for this long makes room for one opened now.  Longer than an epoch,
# so that a file read once an epoch keeps its place (an epoch of a million files takes
# minutes here; of ImageNet on a node of 8 GPUs, 10 - 20 minutes).
HELD_IDLE_SECONDS = 1800.0
TICK_SECONDS = HELD_IDLE_SECONDS / 8
# Markers kept at most: the oldest goes first, which only makes idle files look more recent.
MAX_TICKS = 16


class _Tick:
    """A marker in the order of use, made at ``at``; equal to nothing but itself, so never
    to the key of a held file."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at


class HeldFiles:
    """Held files, by key (mirrorfs.held_key), each as an int (mirrorfs.HeldFile.packed())."""

    def __init__(self, max_files: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_files = max_files
        self._clock = clock
        # Held files and markers, in order of use, the least recent first.  An OrderedDict,
        # not a dict: taking a dict's first key walks past every entry deleted since it last
        # grew, tens of microseconds per open once tens of thousands have gone.
        self._order: OrderedDict[int | _Tick, int] = OrderedDict()
        self._ticks: deque[_Tick] = deque()  # the markers in _order, the oldest first
        self._next_tick = float("-inf")
        self._count = 0

    def get_locked(self, key: int) -> int | None:
        packed = self._order.get(key)
        if packed is not None:
            self._order.move_to_end(key)
            self._tick(self._clock())
        return packed

    def holds_locked(self, key: int, packed: int) -> bool:
        return self._order.get(key) == packed

    def room_locked(self, key: int) -> list[tuple[int, int]] | None:
        """Room to hold ``key``: the (key, entry) pair pushed out for it, if any, the
        caller's to close; None when there is none (every held file opened within
        HELD_IDLE_SECONDS), and the caller's open then uses its file alone."""
        now = self._clock()
        self._tick(now)
        if self._count < self.max_files or key in self._order:
            return []
        oldest = self._oldest_file()
        # Opened last before the oldest marker: idle when that marker is old enough.
        if oldest is None or not self._ticks or self._ticks[0].at > now - HELD_IDLE_SECONDS:
            return None
        self._count -= 1
        return [(oldest, self._order.pop(oldest))]

    def put_locked(self, key: int, packed: int) -> list[tuple[int, int]]:
        """Hold ``packed`` (after :meth:`room_locked`); the (key, entry) pairs it replaces
        or a lowered bound pushes out, the caller's to close."""
        old = self._order.pop(key, None)
        self._order[key] = packed
        out = [(key, old)] if old is not None else []
        if old is None:
            self._count += 1
        while self._count > self.max_files:  # the bound was lowered
            oldest = self._oldest_file()
            out.append((oldest, self._order.pop(oldest)))
            self._count -= 1
        return out

    def drop_locked(self, key: int) -> int | None:
        packed = self._order.pop(key, None)
        if packed is not None:
            self._count -= 1
        return packed

    def __len__(self) -> int:
        return self._count

    def _oldest_file(self) -> int | None:
        """The least recently opened held file, past the markers older than it."""
        order = self._order
        while order:
            first = next(iter(order))
            if type(first) is not _Tick:
                return first
            del order[first]
            self._ticks.popleft()
        return None

    def _tick(self, now: float) -> None:
        if now < self._next_tick:
            return
        self._next_tick = now + TICK_SECONDS
        tick = _Tick(now)
        self._order[tick] = 0
        self._ticks.append(tick)
        if len(self._ticks) > MAX_TICKS:
            del self._order[self._ticks.popleft()]
