"""The persistent index: which files and chunks are stored, for which version, with checksums.

Backed by diskcache (SQLite in WAL mode), so it survives restarts and crashes:
a record is written only after its chunk file is complete, and SQLite commits
are atomic.  Records are packed with ``struct`` rather than pickled: they are
read on every open of a file.

Keys are bytes (``os.fsencode`` of the path relative to BACKING) because names
that are not valid UTF-8 cannot be SQLite text.  A file's record sits at its
path; chunk records of files with more than one chunk at ``path NUL n``.
Chunk files on disk are named after :func:`data_key`, which adds the version.
"""

from __future__ import annotations

import os
import sqlite3
import struct
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import diskcache

from cachefs.attr import Attr, Version

# size, mtime_ns, mode, uid, gid, nlink, atime_ns, ctime_ns, stored chunks, checksum of chunk 0
_FILE = struct.Struct("<qqIIIQqqIQ")
# checksum, length
_CHUNK = struct.Struct("<QI")
# Records kept in memory: about 200 bytes each, so some 50 MiB at most.
MEMO_ENTRIES = 2**18

INDEX_SETTINGS = {
    "eviction_policy": "none",  # we never evict to make room; see admission.py
    "size_limit": 2**62,
    "disk_min_file_size": 2**20,  # every record stays inside SQLite
    "sqlite_mmap_size": 0,
    # Keep the write-ahead log small: its size counts against the byte budget.
    "sqlite_wal_autocheckpoint": 128,
    "sqlite_journal_size_limit": 2**20,
}


class FileRecord(NamedTuple):
    """One cached file: its remote attributes and how many of its chunks are stored."""

    attr: Attr
    stored_chunks: int
    # Checksum of the only chunk of a single-chunk file, saving a second lookup per open.
    first_checksum: int

    @property
    def version(self) -> Version:
        return self.attr.version


class ChunkRecord(NamedTuple):
    checksum: int
    length: int


def file_key(relpath_bytes: bytes) -> bytes:
    return relpath_bytes


def chunk_key(relpath_bytes: bytes, index: int) -> bytes:
    return b"%s\0%d" % (relpath_bytes, index)


def data_key(relpath_bytes: bytes, index: int, version: Version) -> bytes:
    """What names a chunk's file on disk: two versions of a file never share a chunk file,
    so writing the new one cannot clobber the old one still being read or dropped."""
    return b"%s\0%d\0%d:%d" % (relpath_bytes, index, version.size, version.mtime_ns)


def split_key(key: bytes) -> tuple[bytes, int | None]:
    """(path, chunk number) of a chunk key; (path, None) of a file key."""
    path, sep, number = key.rpartition(b"\0")
    return (path, int(number)) if sep else (key, None)


class CacheIndex:
    """Record storage, with the packed records of recently used keys kept in memory.

    Opening a cached file must not cost a database query: libfuse's worker threads
    come and go, and each new thread would open its own SQLite connection first.  So
    records read or written are remembered (up to MEMO_ENTRIES, oldest forgotten
    first) and the database is asked only for the others.

    Thread safety: one SQLite connection serves every thread, one query at a time
    (``_db_lock``); read-modify-write sequences are the caller's to serialise (the
    store's lock).  ``_memo_lock`` and the ``_writes`` counter keep a slow reader
    from remembering a record that a writer replaced while it was in the database.
    """

    def __init__(self, directory: Path) -> None:
        self._cache = diskcache.Cache(str(directory), **INDEX_SETTINGS)
        _share_one_connection(self._cache)
        self._db_lock = threading.RLock()
        self._memo: dict[bytes, bytes] = {}
        self._memo_lock = threading.Lock()
        self._writes = 0

    def close(self) -> None:
        with self._db_lock:
            self._cache.close()

    def _get(self, key: bytes) -> bytes | None:
        raw = self._memo.get(key)
        if raw is not None:
            return raw
        with self._memo_lock:
            writes = self._writes
        with self._db_lock:
            raw = self._cache.get(key)
        if raw is not None:
            with self._memo_lock:
                if self._writes == writes:
                    self._remember_locked(key, raw)
        return raw

    def _set(self, key: bytes, raw: bytes | None) -> None:
        """Write ``raw`` under ``key`` (None deletes it), keeping the memo in step: a reader
        that went to the database before the write does not remember what it found."""
        with self._memo_lock:
            self._writes += 1
            self._memo.pop(key, None)
        with self._db_lock:
            if raw is None:
                self._cache.delete(key)
            else:
                self._cache.set(key, raw)
        with self._memo_lock:
            # Again after the write: a reader may have remembered the old record meanwhile.
            if raw is None:
                self._memo.pop(key, None)
            else:
                self._remember_locked(key, raw)
            self._writes += 1

    def _remember_locked(self, key: bytes, raw: bytes) -> None:
        if len(self._memo) >= MEMO_ENTRIES:
            del self._memo[next(iter(self._memo))]
        self._memo[key] = raw

    def get_file(self, key: bytes) -> FileRecord | None:
        raw = self._get(key)
        if raw is None:
            return None
        f = _FILE.unpack(raw)
        return FileRecord(Attr(f[2], f[0], f[3], f[4], f[5], f[6], f[1], f[7]), f[8], f[9])

    def put_file(self, key: bytes, record: FileRecord) -> None:
        a = record.attr
        self._set(
            key,
            _FILE.pack(
                a.size, a.mtime_ns, a.mode, a.uid, a.gid, a.nlink, a.atime_ns, a.ctime_ns,
                record.stored_chunks, record.first_checksum,
            ),
        )

    def get_chunk(self, key: bytes) -> ChunkRecord | None:
        raw = self._get(key)
        return None if raw is None else ChunkRecord(*_CHUNK.unpack(raw))

    def put_chunk(self, key: bytes, record: ChunkRecord) -> None:
        self._set(key, _CHUNK.pack(record.checksum, record.length))

    def delete(self, key: bytes) -> None:
        self._set(key, None)

    def all_keys(self) -> Iterator[bytes]:
        """Every key, file and chunk records alike (a snapshot; safe to delete while iterating)."""
        with self._db_lock:
            return iter(list(self._cache.iterkeys()))

    def __len__(self) -> int:
        with self._db_lock:
            return len(self._cache)


def _share_one_connection(cache: diskcache.Cache) -> None:
    """Make every thread use one SQLite connection to the index.

    diskcache keeps a connection per thread.  libfuse's worker threads are not
    Python threads: each callback runs in a thread state made for it and destroyed
    after it, so per-thread connections were opened for a single query and then
    lingered, unclosed, until a garbage collection, thousands of them (each with
    its descriptors and page cache) under load.  One connection, opened here
    across threads and used under CacheIndex's lock, avoids all of that.
    """
    path = os.path.join(cache.directory, diskcache.core.DBNAME)
    shared = types.SimpleNamespace(pid=os.getpid())
    shared.con = sqlite3.connect(path, timeout=cache.timeout, isolation_level=None,
                                 check_same_thread=False)
    old, cache._local = cache._local, shared
    old_con = getattr(old, "con", None)
    if old_con is not None:
        old_con.close()
    # The per-connection settings diskcache applies to each new connection.
    for key, value in shared.con.execute("SELECT key, value FROM Settings").fetchall():
        if key.startswith("sqlite_"):
            cache.reset(key, value, update=False)
