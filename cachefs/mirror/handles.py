"""The mount's open files and registered backing files, in a mapped file a successor reads.

A file handle the kernel holds (the ``fh`` of an OPEN reply) is the number of a slot here, and
the slot says what a process taking the mount over needs to serve it on (kernel/takeover.py):

- the node (its path and version are in the node table, nodes.py);
- how the open is read: by the kernel through a backing file (passthrough; the backing id is
  in the slot, so that the RELEASE of the last open of it, reaching the successor, closes it,
  and so that a new open of the same node names the same backing file, as the kernel
  insists), or here (pread or chunk by chunk: the successor opens the file again at the first
  READ it gets for the handle).

Cache files kept registered across opens (mirrorfs.HeldFiles) have a slot each too, with no
node: a successor closes those no open uses, so that three restarts leave no backing id behind
in the kernel.

The file is ``BASE.handles`` beside the node table, in the runtime directory (tmpfs): a header,
then 16-byte slots (node id, backing id, kind).  Slot N is at ``HEADER + (N - 1) * 16``.

Thread safety: none of its own; every method ends in ``_locked`` and is called with
``MirrorFS._lock`` held (the lock that guards the handles these slots describe).  One process
uses the file at a time, as with the node table.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
from pathlib import Path
from typing import NamedTuple

FREE, PASSTHROUGH, SERVED, HELD = 0, 1, 2, 3
_MAGIC = b"cfshndls"
_FORMAT = 1
_HEADER = struct.Struct("<8sIIQ")  # magic, format, slot bytes, slots used so far (high mark)
_HEADER_BYTES = 64
_SLOT = struct.Struct("<QII")  # node id, backing id, kind
MIN_SLOTS = 1024


class Record(NamedTuple):
    """One slot in use."""

    slot: int
    nodeid: int
    backing_id: int
    kind: int


class HandleTable:
    """File handles and held backing ids, in slots of a mapped file."""

    def __init__(self, base: Path | None, *, take_over: bool = False) -> None:
        """Make ``BASE.handles``, or with ``take_over`` map the one another daemon left
        (ValueError when it is not such a file).  Without a ``base``, a file of this process
        alone."""
        self.inherited = take_over
        if base is None:
            directory = tempfile.mkdtemp(prefix="cachefs-handles-")
            path = os.path.join(directory, "handles")
        else:
            path = f"{base}.handles"
        self.path = path
        flags = os.O_RDWR | os.O_CLOEXEC | (0 if take_over else os.O_CREAT | os.O_TRUNC)
        self._fd = os.open(path, flags, 0o600)
        if not take_over:
            os.ftruncate(self._fd, _HEADER_BYTES + MIN_SLOTS * _SLOT.size)
        self._map = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        if take_over:
            magic, version, slot_bytes, self._high = _HEADER.unpack_from(self._map)
            if (magic, version, slot_bytes) != (_MAGIC, _FORMAT, _SLOT.size):
                self.close()
                raise ValueError(f"{path} is not a handle table of this format")
        else:
            self._high = 0
            self._write_header()
        self._free = [record.slot for record in self._scan(FREE)]
        self._free.reverse()  # the lowest first out
        if base is None:
            os.unlink(path)
            os.rmdir(directory)

    def _write_header(self) -> None:
        _HEADER.pack_into(self._map, 0, _MAGIC, _FORMAT, _SLOT.size, self._high)

    def _scan(self, kind: int | None = None) -> list[Record]:
        out = []
        for slot in range(1, self._high + 1):
            nodeid, backing_id, found = _SLOT.unpack_from(self._map, _offset(slot))
            if kind is None and found != FREE or found == kind:
                out.append(Record(slot, nodeid, backing_id, found))
        return out

    def records_locked(self) -> list[Record]:
        """Every slot in use (what a predecessor left, at a takeover)."""
        return self._scan()

    def add_locked(self, nodeid: int, backing_id: int, kind: int) -> int:
        """A slot for a new handle (or held file); its number, never 0."""
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._high + 1
            end = _offset(slot) + _SLOT.size
            if end > len(self._map):
                size = max(end, 2 * len(self._map))
                os.ftruncate(self._fd, size)
                self._map.resize(size)
            self._high = slot
            self._write_header()
        _SLOT.pack_into(self._map, _offset(slot), nodeid, backing_id, kind)
        return slot

    def remove_locked(self, slot: int) -> None:
        if not 1 <= slot <= self._high:
            return
        _SLOT.pack_into(self._map, _offset(slot), 0, 0, FREE)
        self._free.append(slot)

    def __len__(self) -> int:
        return self._high - len(self._free)

    def close(self, *, remove: bool = False) -> None:
        """Unmap the file; ``remove`` it too (the mount is gone: no successor needs it)."""
        if self._map is None:
            return
        self._map.close()
        os.close(self._fd)
        self._map = None
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _offset(slot: int) -> int:
    return _HEADER_BYTES + (slot - 1) * _SLOT.size
