"""The kernel's node ids and what each stands for, in memory a successor can read.

The kernel names a file by the node id a LOOKUP gave it, until it FORGETs it: after a pass over
a million files it may hold a million.  Each is a fixed 96-byte slot here, not a Python object
(about 800 bytes each, with its dictionaries), and the slots live in a file under the runtime
directory (tmpfs), mapped in: a daemon that takes the mount over after a crash or for an
upgrade maps the same file and knows every node id the kernel still holds, with nothing to
replay (issue of restarts: takeover.py).

Three files, ``BASE.nodes``, ``BASE.index`` and ``BASE.names``:

- ``.nodes``: a header, then the slots; node id N is slot N - 1 (the root, 1, is slot 0).  A
  slot: the parent's node id, the attributes the node was looked up with (mode, size, mtime:
  its version; ctime, atime, uid, gid, nlink), the kernel's lookup count, and the name: up to
  32 bytes in the slot, longer in ``.names``.  A slot is freed when the kernel has forgotten
  every lookup of it, and reused.
- ``.index``: (parent, name) to node id, open addressing with linear probing, 8-byte buckets
  (the 32-bit hash, the node id), at most half full, doubled when it would be fuller.
- ``.names``: names longer than 32 bytes, in blocks of 64, 128 or 256 bytes, each size with a
  list of the freed ones.

A regular file has one node per path and version: a lookup that finds its name with another
version (or kind) makes a new node, and the name's index entry moves to it; the old node lives
on, unindexed, until the kernel forgets it (it never mixes two versions' pages or backing
files).

A process may be killed anywhere in a change (kill -9, the OOM killer).  The header takes a
slot, or a block of names, before anything is written into it, so a successor never hands one
out twice; a change cut short otherwise leaves at worst a slot or block nobody uses, or a name
unindexed (its next lookup makes a new node, as for a new version).

Thread safety: ``_lock`` guards every change and every read of more than one field; it is a
leaf lock.  One process uses the files at a time: the daemon serving the mount, then its
successor (the old one is gone, or stopped serving before it hands them over).
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import xxhash

from cachefs.attr import Attr

ROOT_ID = 1
_MAGIC = b"cfsnodes"
_FORMAT = 1
# magic, format, slot bytes, slots in the file, the next never-used slot, head of the freed
# slots (node id, 0: none), live nodes, buckets of the index, entries in it, bytes of the
# names file used, heads of its freed blocks of 64, 128 and 256 bytes (offset + 1, 0: none)
_HEADER = struct.Struct("<8sIIQQQQQQQQQQ")
_HEADER_BYTES = 4096
# parent, mode, lookups, size, mtime_ns, ctime_ns, atime_ns, uid, gid, nlink, name length,
# flags, then the name (or, for a longer one, its offset in the names file)
_SLOT = struct.Struct("<IIQQqqqIIIHH32s")
SLOT_BYTES = _SLOT.size
_INLINE_NAME = 32
_HEAP_REF = struct.Struct("<Q")
_BLOCK_SIZES = (64, 128, 256)
_LIVE, _NAME_IN_HEAP, _TIMES_ASIDE = 1, 2, 4
_FLAGS_AT = 62  # the flags' offset in a slot
_TIME_MIN, _TIME_MAX = -(1 << 63), (1 << 63) - 1
MIN_SLOTS = 1024
MIN_BUCKETS = 2048
_GROWTH = 2


class NodeInfo(NamedTuple):
    """A node as the table holds it."""

    parent: int
    name: bytes
    attr: Attr
    lookups: int


class TableFull(Exception):
    """No node can be added (the node file cannot grow)."""


def _hash(parent: int, name: bytes) -> int:
    return xxhash.xxh3_64_intdigest(name, seed=parent) & 0xFFFF_FFFF


class NodeTable:
    """Node ids to (parent, name, attributes, lookups), and (parent, name) to node ids."""

    def __init__(self, base: Path | None, root_attr: Attr, *, take_over: bool = False) -> None:
        """Make the table's files at ``base`` (``BASE.nodes`` ...), or with ``take_over`` map
        the ones another daemon left there (ValueError when they are not such files).  Without
        a ``base``, files nobody else can find (a table of this process alone)."""
        private = base is None
        if private:
            base = Path(tempfile.mkdtemp(prefix="cachefs-nodes-")) / "nodes"
        self.base = base
        self._lock = threading.Lock()
        self._files = {}
        # Times a slot cannot hold (nanoseconds beyond 2**63: after 2262): this process's
        # own, rare; a successor sees them clamped, so such a file's version looks changed
        # to it and its name is looked up anew (never the wrong version).
        self._times_aside: dict[int, tuple[int, int, int]] = {}
        self._maps: dict[str, mmap.mmap] = {}
        if take_over:
            for part in ("nodes", "index", "names"):
                self._open(part, create=False)
            header = _HEADER.unpack_from(self._maps["nodes"])
            if header[0] != _MAGIC or header[1] != _FORMAT or header[2] != SLOT_BYTES:
                raise ValueError(f"{base}.nodes is not a node table of this format")
            self._read_header(header)
        else:
            for part, size in (("nodes", _HEADER_BYTES + MIN_SLOTS * SLOT_BYTES),
                               ("index", MIN_BUCKETS * 8), ("names", 0)):
                self._open(part, create=True, size=size)
            self._slots, self._next, self._free, self.live = MIN_SLOTS, ROOT_ID + 1, 0, 1
            self._buckets, self._entries, self._heap_used = MIN_BUCKETS, 0, 0
            self._heap_free = [0, 0, 0]
            self._write_slot(ROOT_ID, 0, b"", root_attr, 1)
            self._write_header()
        self._index = memoryview(self._maps["index"]).cast("Q")
        if private:
            for part in self._maps:
                os.unlink(f"{base}.{part}")
            os.rmdir(base.parent)

    # -- files ----------------------------------------------------------------------------------

    def _open(self, part: str, *, create: bool, size: int = 0) -> None:
        path = f"{self.base}.{part}"
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(fd, max(size, mmap.PAGESIZE))
        self._files[part] = fd
        self._maps[part] = mmap.mmap(fd, os.fstat(fd).st_size)

    def _grow(self, part: str, size: int) -> None:
        """Make a file (and its map) at least ``size`` bytes."""
        mapped = self._maps[part]
        if len(mapped) >= size:
            return
        size = max(size, len(mapped) * _GROWTH)
        try:
            os.ftruncate(self._files[part], size)
        except OSError as exc:
            raise TableFull(f"{self.base}.{part}: {exc.strerror}") from None
        if part == "index":
            self._index.release()
        mapped.resize(size)
        if part == "index":
            self._index = memoryview(mapped).cast("Q")

    def close(self, *, remove: bool = False) -> None:
        """Unmap the files; ``remove`` them too (the mount is gone: no successor needs them)."""
        with self._lock:
            self._index.release()
            for part, mapped in self._maps.items():
                mapped.close()
                os.close(self._files[part])
                if remove:
                    try:
                        os.unlink(f"{self.base}.{part}")
                    except FileNotFoundError:
                        pass
            self._maps.clear()

    def _read_header(self, header: tuple) -> None:
        (_magic, _format, _slot, self._slots, self._next, self._free, self.live,
         self._buckets, self._entries, self._heap_used, *heap_free) = header
        self._heap_free = list(heap_free)

    def _write_header(self) -> None:
        _HEADER.pack_into(self._maps["nodes"], 0, _MAGIC, _FORMAT, SLOT_BYTES, self._slots,
                          self._next, self._free, self.live, self._buckets, self._entries,
                          self._heap_used, *self._heap_free)

    # -- slots ----------------------------------------------------------------------------------

    @staticmethod
    def _offset(nodeid: int) -> int:
        return _HEADER_BYTES + (nodeid - 1) * SLOT_BYTES

    def _write_slot(self, nodeid: int, parent: int, name: bytes, a: Attr, lookups: int) -> None:
        flags = _LIVE | self._set_times_aside(nodeid, a)
        if len(name) > _INLINE_NAME:
            flags |= _NAME_IN_HEAP
            stored = _HEAP_REF.pack(self._heap_put(name))
        else:
            stored = name
        times = (a.mtime_ns, a.ctime_ns, a.atime_ns) if not flags & _TIMES_ASIDE else (
            _clamp(a.mtime_ns), _clamp(a.ctime_ns), _clamp(a.atime_ns))
        _SLOT.pack_into(self._maps["nodes"], _HEADER_BYTES + (nodeid - 1) * SLOT_BYTES, parent,
                        a.mode, lookups, a.size, *times, a.uid, a.gid, a.nlink, len(name),
                        flags, stored)

    def _set_times_aside(self, nodeid: int, a: Attr) -> int:
        """Keep aside the times a slot cannot hold: the flag to set (0: none)."""
        if _times_fit(a):
            if self._times_aside:
                self._times_aside.pop(nodeid, None)
            return 0
        self._times_aside[nodeid] = (a.mtime_ns, a.ctime_ns, a.atime_ns)
        return _TIMES_ASIDE

    def _read_slot(self, nodeid: int) -> tuple | None:
        if not 1 <= nodeid < self._next:
            return None
        fields = _SLOT.unpack_from(self._maps["nodes"], self._offset(nodeid))
        return fields if fields[11] & _LIVE else None

    def _name_of(self, fields: tuple) -> bytes:
        length, flags, stored = fields[10], fields[11], fields[12]
        if flags & _NAME_IN_HEAP:
            (offset,) = _HEAP_REF.unpack_from(stored)
            return self._maps["names"][offset:offset + length]
        return stored[:length]

    def _attr_of(self, nodeid: int, fields: tuple) -> Attr:
        (_parent, mode, _lookups, size, mtime, ctime, atime, uid, gid, nlink, _length,
         flags, _name) = fields
        if flags & _TIMES_ASIDE and nodeid in self._times_aside:
            mtime, ctime, atime = self._times_aside[nodeid]
        return Attr(mode, size, uid, gid, nlink, atime, mtime, ctime)

    def _allocate(self) -> int:
        """A slot for a new node, taken in the header at once: a process killed before it
        wrote the header would leave a successor handing out the same slot again, for
        another name, while the kernel holds it (once the LOOKUP is resent) for this one."""
        if self._free:
            nodeid = self._free
            self._free = _SLOT.unpack_from(self._maps["nodes"], self._offset(nodeid))[0]
        else:
            nodeid = self._next
            if nodeid > self._slots:
                self._grow("nodes", _HEADER_BYTES + self._slots * _GROWTH * SLOT_BYTES)
                self._slots = (len(self._maps["nodes"]) - _HEADER_BYTES) // SLOT_BYTES
            self._next += 1
        self._write_header()
        return nodeid

    def _release(self, nodeid: int, fields: tuple) -> None:
        if fields[11] & _NAME_IN_HEAP:
            self._heap_free_block(_HEAP_REF.unpack_from(fields[12])[0], fields[10])
        self._times_aside.pop(nodeid, None)
        # A freed slot: not live, its first field the next freed one.
        _SLOT.pack_into(self._maps["nodes"], self._offset(nodeid), self._free, 0, 0, 0, 0, 0,
                        0, 0, 0, 0, 0, 0, b"")
        self._free = nodeid

    # -- long names -----------------------------------------------------------------------------

    @staticmethod
    def _block_class(length: int) -> int:
        return next(i for i, size in enumerate(_BLOCK_SIZES) if length <= size)

    def _heap_put(self, name: bytes) -> int:
        which = self._block_class(len(name))
        offset = self._heap_free[which] - 1
        if offset >= 0:
            (following,) = _HEAP_REF.unpack_from(self._maps["names"], offset)
            self._heap_free[which] = following
        else:
            offset = self._heap_used
            self._heap_used += _BLOCK_SIZES[which]
            self._grow("names", self._heap_used)
        self._write_header()  # taken before it is written in, as a slot is (_allocate)
        self._maps["names"][offset:offset + len(name)] = name
        return offset

    def _heap_free_block(self, offset: int, length: int) -> None:
        which = self._block_class(length)
        _HEAP_REF.pack_into(self._maps["names"], offset, self._heap_free[which])
        self._heap_free[which] = offset + 1

    # -- the index ------------------------------------------------------------------------------

    def _find_locked(self, parent: int, name: bytes) -> tuple[int, int, tuple | None]:
        """(bucket, node id, its slot's fields) of (parent, name); node id 0, no fields and
        the empty bucket where it would go when it is not indexed."""
        h = _hash(parent, name)
        mask = self._buckets - 1
        index = self._index
        bucket = h & mask
        while True:
            entry = index[bucket]
            if not entry:
                return bucket, 0, None
            if entry >> 32 == h:
                nodeid = entry & 0xFFFF_FFFF
                fields = self._read_slot(nodeid)
                if fields is not None and fields[0] == parent and self._name_of(fields) == name:
                    return bucket, nodeid, fields
            bucket = (bucket + 1) & mask

    def _bucket_of_locked(self, h: int, nodeid: int) -> int | None:
        """The bucket of node ``nodeid`` whose name hashes to ``h``; None when its name is not
        indexed to it (a newer version's node has the entry).  A live node has at most one
        entry, so one holding both its id and its name's hash is its own: no slot read, no
        name compared (a FORGET's path, a million of them after a pass)."""
        wanted = h << 32 | nodeid
        mask = self._buckets - 1
        index = self._index
        bucket = h & mask
        while (entry := index[bucket]):
            if entry == wanted:
                return bucket
            bucket = (bucket + 1) & mask
        return None

    def _index_put_locked(self, bucket: int, parent: int, name: bytes, nodeid: int) -> None:
        self._index[bucket] = _hash(parent, name) << 32 | nodeid
        self._entries += 1
        if self._entries * 2 > self._buckets:
            self._rehash(self._buckets * _GROWTH)

    def _index_remove_locked(self, bucket: int) -> None:
        """Empty a bucket, moving the entries after it back (linear probing: no tombstones)."""
        index, mask = self._index, self._buckets - 1
        index[bucket] = 0
        self._entries -= 1
        hole, probe = bucket, (bucket + 1) & mask
        while (entry := index[probe]):
            home = (entry >> 32) & mask
            # Move it into the hole unless its home lies in (hole, probe].
            if (probe - home) & mask >= (probe - hole) & mask:
                index[hole], index[probe] = entry, 0
                hole = probe
            probe = (probe + 1) & mask

    def _rehash(self, buckets: int) -> None:
        old = bytes(self._maps["index"][:self._buckets * 8])
        self._grow("index", buckets * 8)
        self._maps["index"][:buckets * 8] = bytes(buckets * 8)
        self._buckets = buckets
        index, mask = self._index, buckets - 1
        for entry in memoryview(old).cast("Q"):
            if entry:
                bucket = (entry >> 32) & mask
                while index[bucket]:
                    bucket = (bucket + 1) & mask
                index[bucket] = entry

    # -- what the mount asks ---------------------------------------------------------------------

    def lookup(self, parent: int, name: bytes, attr: Attr) -> int:
        """The node of ``name`` in directory ``parent`` at ``attr``, counted as one more lookup
        by the kernel: the one it has, or a new one when there is none, or when the name is now
        of another kind or (a regular file) another version."""
        with self._lock:
            bucket, nodeid, fields = self._find_locked(parent, name)
            if nodeid:
                if self._same_node(nodeid, fields, attr):
                    self._write_slot_attr(nodeid, attr, fields[2] + 1, fields[11])
                    return nodeid
                self._index_remove_locked(bucket)  # the name's entry moves to its new node
                bucket, _none, _fields = self._find_locked(parent, name)
            nodeid = self._allocate()
            self._write_slot(nodeid, parent, name, attr, 1)
            self.live += 1
            self._index_put_locked(bucket, parent, name, nodeid)
            self._write_header()
            return nodeid

    def _same_node(self, nodeid: int, fields: tuple, attr: Attr) -> bool:
        """Whether ``attr`` is of the kind, and for a regular file the version, the node was
        looked up with (the slot's fields, read without building its Attr: a lookup's path)."""
        mode = attr.mode
        if stat.S_IFMT(fields[1]) != stat.S_IFMT(mode):
            return False
        if not stat.S_ISREG(mode):
            return True
        mtime = fields[4]
        if fields[11] & _TIMES_ASIDE and nodeid in self._times_aside:
            mtime = self._times_aside[nodeid][0]
        return fields[3] == attr.size and mtime == attr.mtime_ns

    def _write_slot_attr(self, nodeid: int, a: Attr, lookups: int, flags: int) -> None:
        """New attributes and lookup count into a live slot whose flags are ``flags``."""
        mapped, offset = self._maps["nodes"], self._offset(nodeid)
        if _times_fit(a) and not flags & _TIMES_ASIDE:  # the common case: the flags stay
            _ATTR_PART.pack_into(mapped, offset + 4, a.mode, lookups, a.size, a.mtime_ns,
                                 a.ctime_ns, a.atime_ns, a.uid, a.gid, a.nlink)
            return
        _ATTR_PART.pack_into(mapped, offset + 4, a.mode, lookups, a.size, _clamp(a.mtime_ns),
                             _clamp(a.ctime_ns), _clamp(a.atime_ns), a.uid, a.gid, a.nlink)
        flags = flags & ~_TIMES_ASIDE | self._set_times_aside(nodeid, a)
        _FLAGS.pack_into(mapped, offset + _FLAGS_AT, flags)

    def refresh(self, nodeid: int, attr: Attr) -> None:
        """New attributes of the same version (a revalidation) for a live node."""
        with self._lock:
            fields = self._read_slot(nodeid)
            if fields is not None:
                self._write_slot_attr(nodeid, attr, fields[2], fields[11])

    def forget(self, nodeid: int, nlookup: int) -> bool:
        """The kernel forgot ``nlookup`` lookups of a node; the node goes with the last (then
        True: its id may name another node from now on)."""
        if nodeid == ROOT_ID:
            return False
        with self._lock:
            fields = self._read_slot(nodeid)
            if fields is None:
                return False
            lookups = fields[2] - nlookup
            if lookups > 0:
                _LOOKUPS.pack_into(self._maps["nodes"], self._offset(nodeid) + 8, lookups)
                return False
            bucket = self._bucket_of_locked(_hash(fields[0], self._name_of(fields)), nodeid)
            if bucket is not None:
                self._index_remove_locked(bucket)
            self._release(nodeid, fields)
            self.live -= 1
            self._write_header()
            return True

    def get(self, nodeid: int) -> NodeInfo | None:
        with self._lock:
            fields = self._read_slot(nodeid)
            if fields is None:
                return None
            return NodeInfo(fields[0], self._name_of(fields), self._attr_of(nodeid, fields),
                            fields[2])

    def __len__(self) -> int:
        return self.live

    @property
    def memory_bytes(self) -> int:
        """What the table's files take (their pages in use)."""
        return (_HEADER_BYTES + (self._next - 1) * SLOT_BYTES + self._buckets * 8
                + self._heap_used)


# mode, lookups, size, mtime, ctime, atime, uid, gid, nlink: a slot from its fifth byte
_ATTR_PART = struct.Struct("<IQQqqqIII")
_LOOKUPS = struct.Struct("<Q")
_FLAGS = struct.Struct("<H")
assert _SLOT.size - _INLINE_NAME - _FLAGS.size == _FLAGS_AT


def _clamp(ns: int) -> int:
    return min(max(ns, _TIME_MIN), _TIME_MAX)


def _times_fit(a: Attr) -> bool:
    """Whether a slot holds the times as they are (nanoseconds before 2262 and after 1677)."""
    return (_TIME_MIN <= a.mtime_ns <= _TIME_MAX and _TIME_MIN <= a.ctime_ns <= _TIME_MAX
            and _TIME_MIN <= a.atime_ns <= _TIME_MAX)
