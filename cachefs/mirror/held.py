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

The table is what a held file costs the daemon, so it holds no Python object per file: an
open-addressed hash table of fixed-size slots in three arrays (the key; the second a file
was last opened, 0 for an empty slot; the packed entry, 36 bytes): 48 bytes a slot, 60 - 120
bytes per held file by how full the table is (61 at a full million, tracemalloc), where an
OrderedDict of ints took 159.  An idle file is found by a hand
sweeping the slots (CLOCK), a few slots per open, and not looked for again until the least
recently opened file it passed can be idle.

Thread safety: none of its own; the caller holds ``MirrorFS._lock``.
"""

from __future__ import annotations

import array
import math
import time
from collections.abc import Callable

# A held file not opened for this long makes room for one opened now.  Longer than an epoch,
# so that a file read once an epoch keeps its place (an epoch of a million files takes
# minutes here; of ImageNet on a node of 8 GPUs, 10 - 20 minutes).
HELD_IDLE_SECONDS = 1800
# The packed entry (mirrorfs.HeldFile.packed): record, descriptor and backing id, 32 bits
# each, and the cache file's inode, mtime and ctime, 64 bits each.
ENTRY_BYTES = 36
# Slots looked at for an idle file per open that finds the table full: a bounded cost per
# open; a sweep of every slot that finds none idle stops the search until one can be.
SWEEP_SLOTS = 64
# The table grows past this share of its slots used (linear probing stays short below it),
# by doubling, up to the slots the bound needs: a full table is at this load.
MAX_LOAD = 0.8
_FIRST_SLOTS = 1024
# A key's home slot is its low 30 bits modulo the slots: keys are hashes already, and an
# int of 30 bits is one digit to the interpreter, its arithmetic the cheapest.
_HOME_BITS = (1 << 30) - 1


class HeldFiles:
    """Held files, by key (mirrorfs.held_key), each as an int (mirrorfs.HeldFile.packed())."""

    def __init__(self, max_files: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_files = max_files
        self._clock = clock
        self._started = clock()
        self._count = 0
        self._hand = 0
        # No slot was idle at the last full sweep: none can be before this second.
        self._none_idle_until = 0
        self._swept = 0  # slots swept since the last file found idle
        self._oldest_swept = 0
        # Grown as files come, from no more slots than a small bound needs: the hand's
        # sweep looks at slots, not files.
        self._allocate(min(_FIRST_SLOTS, _slots_for(max_files)))

    def _allocate(self, slots: int) -> None:
        self._slots = slots
        self._keys = array.array("Q", bytes(8 * slots))
        self._opened = array.array("I", bytes(4 * slots))  # seconds since start, plus 1
        self._entries = bytearray(ENTRY_BYTES * slots)

    # -- the policy ------------------------------------------------------------------------

    def get_locked(self, key: int) -> int | None:
        # _find and _entry inline: this runs at every open of a cached file.
        keys, opened, slots = self._keys, self._opened, self._slots
        slot = (key & _HOME_BITS) % slots
        while opened[slot]:
            if keys[slot] == key:
                opened[slot] = int(self._clock() - self._started) + 1
                at = slot * ENTRY_BYTES
                return int.from_bytes(self._entries[at:at + ENTRY_BYTES], "little")
            slot = (slot + 1) % slots
        return None

    def holds_locked(self, key: int, packed: int) -> bool:
        slot = self._find(key)
        return slot >= 0 and self._entry(slot) == packed

    def room_locked(self, key: int) -> list[tuple[int, int]] | None:
        """Room to hold ``key``: the (key, entry) pair pushed out for it, if any, the
        caller's to close; None when there is none (every held file opened within
        HELD_IDLE_SECONDS), and the caller's open then uses its file alone."""
        if self._count < self.max_files or self._find(key) >= 0:
            return []
        slot = self._idle_slot(self._now())
        if slot < 0:
            return None
        out = [(self._keys[slot], self._entry(slot))]
        self._remove(slot)
        return out

    def put_locked(self, key: int, packed: int) -> list[tuple[int, int]]:
        """Hold ``packed`` (after :meth:`room_locked`); the (key, entry) pairs it replaces
        or a lowered bound pushes out, the caller's to close."""
        out = []
        slot = self._find(key)
        if slot >= 0:
            out.append((key, self._entry(slot)))
        else:
            if self._count + 1 > MAX_LOAD * self._slots:
                self._grow()
            slot = self._probe(key)  # an empty slot: the key is not held
            self._keys[slot] = key
            self._count += 1
        self._opened[slot] = self._now()
        self._entries[slot * ENTRY_BYTES:(slot + 1) * ENTRY_BYTES] = \
            packed.to_bytes(ENTRY_BYTES, "little")
        excess = self._count - self.max_files
        if excess > 0:  # the bound was lowered: the least recently opened go
            held = sorted((s for s in range(self._slots) if self._opened[s] and s != slot),
                          key=self._opened.__getitem__)
            gone = [(self._keys[s], self._entry(s)) for s in held[:excess]]
            for gone_key, _ in gone:
                self._remove(self._find(gone_key))  # found again: removals shift slots
            out += gone
        return out

    def drop_locked(self, key: int) -> int | None:
        slot = self._find(key)
        if slot < 0:
            return None
        packed = self._entry(slot)
        self._remove(slot)
        return packed

    def __len__(self) -> int:
        return self._count

    def _now(self) -> int:
        return int(self._clock() - self._started) + 1

    def _idle_slot(self, now: int) -> int:
        """A held file unopened for HELD_IDLE_SECONDS, from the hand on; -1 after
        SWEEP_SLOTS slots without one."""
        if now < self._none_idle_until:
            return -1
        opened, slots = self._opened, self._slots
        for _ in range(min(SWEEP_SLOTS, slots)):
            slot = self._hand
            self._hand = (slot + 1) % slots
            at = opened[slot]
            if at and now - at >= HELD_IDLE_SECONDS:
                self._swept = 0
                return slot
            if at and (self._oldest_swept == 0 or at < self._oldest_swept):
                self._oldest_swept = at
        self._swept += SWEEP_SLOTS
        # A round without an idle file.  An entry shifted back behind the hand by a removal
        # during the round goes unseen until the next: its file makes room at most one idle
        # time late, a matter of policy, never of what is held.
        if self._swept >= slots:
            self._none_idle_until = self._oldest_swept + HELD_IDLE_SECONDS
            self._swept = self._oldest_swept = 0
        return -1

    # -- the table: linear probing, deletion by shifting back ------------------------------

    def _entry(self, slot: int) -> int:
        return int.from_bytes(self._entries[slot * ENTRY_BYTES:(slot + 1) * ENTRY_BYTES],
                              "little")

    def _find(self, key: int) -> int:
        """The slot holding ``key``; -1 when it is not held."""
        slot = self._probe(key)
        return slot if self._opened[slot] else -1

    def _probe(self, key: int) -> int:
        """The slot holding ``key``, else the empty slot its probe ends at."""
        keys, opened, slots = self._keys, self._opened, self._slots
        slot = (key & _HOME_BITS) % slots
        while opened[slot] and keys[slot] != key:
            slot = (slot + 1) % slots
        return slot

    def _remove(self, slot: int) -> None:
        keys, opened, entries, slots = self._keys, self._opened, self._entries, self._slots
        self._count -= 1
        hole, slot = slot, (slot + 1) % slots
        # Entries after the hole whose home is not between the hole and them move into it,
        # so that every probe from an entry's home still reaches it without a gap.
        while opened[slot]:
            home = (keys[slot] & _HOME_BITS) % slots
            if (slot - home) % slots >= (slot - hole) % slots:
                keys[hole], opened[hole] = keys[slot], opened[slot]
                _copy_entry(entries, hole, entries, slot)
                hole = slot
            slot = (slot + 1) % slots
        keys[hole] = opened[hole] = 0

    def _grow(self) -> None:
        keys, opened, entries = self._keys, self._opened, self._entries
        bound = _slots_for(self.max_files)
        # Doubled, to no more slots than the bound needs; past them only when the table has
        # them already: a lowered bound's excess, held for the moment before put_locked
        # pushes it out.
        self._allocate(min(2 * self._slots, bound) if bound > self._slots else 2 * self._slots)
        for old, at in enumerate(opened):
            if at:
                slot = self._probe(keys[old])  # an empty slot: the keys are distinct
                self._keys[slot], self._opened[slot] = keys[old], at
                _copy_entry(self._entries, slot, entries, old)
        # The slots moved: the hand's round begins again.
        self._hand = self._swept = self._oldest_swept = 0


def _copy_entry(into: bytearray, slot: int, source: bytearray, source_slot: int) -> None:
    into[slot * ENTRY_BYTES:(slot + 1) * ENTRY_BYTES] = \
        source[source_slot * ENTRY_BYTES:(source_slot + 1) * ENTRY_BYTES]


def _slots_for(files: int) -> int:
    """The fewest slots that hold ``files`` within MAX_LOAD."""
    return max(4, math.ceil((files + 1) / MAX_LOAD))
