"""The persistent index: which files and chunks are stored, for which version, with checksums.

Backed by diskcache (SQLite in WAL mode), so it survives restarts and crashes:
a record is written only after its chunk file is complete, and SQLite commits
are atomic.  Records are packed with ``struct`` rather than pickled: they are
read on every open of a file.

Keys are bytes (``os.fsencode`` of the path relative to BACKING) because names
that are not valid UTF-8 cannot be SQLite text.  A file's record sits at its
path; chunk records of files with more than one chunk at ``path NUL n``.
A cached file is one data file on disk whatever its size, named after
:func:`data_key`, which adds the version.

Writes are grouped: a record written or deleted is visible at once (to every
reader of this index) and reaches SQLite with the others of the last
``FLUSH_SECONDS`` in one transaction, not one commit each.  A crash loses at
most those; the data files they describe are then unaccounted for, and the
reconciliation at the next start removes them.  Records are only ever written
after the data they describe, so nothing lost this way makes a wrong byte.
"""

from __future__ import annotations

import os
import sqlite3
import struct
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import diskcache

from cachefs.attr import Attr, Version
from cachefs.store.presence import KeyFilter

_ABSENT = object()

# size, mtime_ns, mode, uid, gid, nlink, atime_ns, ctime_ns, stored chunks, checksum of chunk 0,
# then the data file as its bytes were last checked: inode, mtime_ns, ctime_ns.  Records
# written before the last three were added read as never checked.
_FILE = struct.Struct("<qqIIIQqqIQQqq")
_FILE_UNCHECKED = struct.Struct("<qqIIIQqqIQ")
UNCHECKED = (0, 0, 0)
# checksum, length
_CHUNK = struct.Struct("<QI")
# Records kept in memory: about 250 bytes each, so some 16 MiB at most (a record not kept
# costs a query of about 10 us; a miss costs none, see presence.py).
MEMO_ENTRIES = 2**16
# Writes wait at most this long, or until there are FLUSH_RECORDS of them, before they are
# committed together.
FLUSH_SECONDS = 0.2
FLUSH_RECORDS = 1024

INDEX_SETTINGS = {
    "eviction_policy": "none",  # we never evict to make room; see admission.py
    "size_limit": 2**62,
    "disk_min_file_size": 2**20,  # every record stays inside SQLite
    "sqlite_mmap_size": 0,
    # SQLite's own page cache, per connection (there is one): 8 MiB, not diskcache's 32.  The
    # records most opens need are in the memo above; a query past it reads a page the
    # kernel's page cache most likely holds, a few microseconds.
    "sqlite_cache_size": 2048,
    # Keep the write-ahead log small: its size counts against the byte budget.
    "sqlite_wal_autocheckpoint": 128,
    "sqlite_journal_size_limit": 2**20,
}


def database_path(directory: str | Path) -> str:
    """The SQLite database of the index kept in ``directory``."""
    return os.path.join(directory, diskcache.core.DBNAME)


class FileRecord(NamedTuple):
    """One cached file: its remote attributes and how many of its chunks are stored."""

    attr: Attr
    stored_chunks: int
    # Checksum of the only chunk of a single-chunk file, saving a second lookup per open.
    first_checksum: int
    # The data file when its bytes were last found to match the checksums (hashed as they
    # were written, or verified): (inode, mtime_ns, ctime_ns), as anything that writes to it
    # or puts another file in its place changes them.  UNCHECKED when not known.
    checked_as: tuple[int, int, int] = UNCHECKED

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


def data_key(relpath_bytes: bytes, version: Version) -> bytes:
    """What names a cached file's data on disk: two versions of a file never share a data
    file, so writing the new one cannot clobber the old one still being read or dropped."""
    return b"%s\0%d:%d" % (relpath_bytes, version.size, version.mtime_ns)


def split_key(key: bytes) -> tuple[bytes, int | None]:
    """(path, chunk number) of a chunk key; (path, None) of a file key."""
    path, sep, number = key.rpartition(b"\0")
    return (path, int(number)) if sep else (key, None)


class CacheIndex:
    """Record storage, with the packed records of recently used keys kept in memory.

    Opening a cached file must not cost a database query, nor a fill a commit.  So
    records read or written are remembered (up to MEMO_ENTRIES, oldest forgotten
    first), writes wait in ``_pending`` until the flusher commits them together, and
    the database is asked only for the others.

    Thread safety: one SQLite connection serves every thread, one query at a time
    (``_db_lock``); read-modify-write sequences are the caller's to serialise (the
    store's lock).  ``_memo_lock`` guards ``_memo``, ``_pending`` and the ``_writes``
    counter, which keeps a slow reader from remembering a record that a writer
    replaced while it was in the database.  Lock order: ``_db_lock`` before
    ``_memo_lock``.
    """

    def __init__(self, directory: Path) -> None:
        self._cache = diskcache.Cache(str(directory), **INDEX_SETTINGS)
        self._con = _share_one_connection(self._cache)
        self._db_lock = threading.RLock()
        # Which file keys the index may hold (presence.py); None: unknown, ask the database.
        self.present: KeyFilter | None = None
        # None: not in the index.  First in, first out; an OrderedDict because taking a
        # dict's first key walks past every entry deleted since it last grew.
        self._memo: OrderedDict[bytes, bytes | None] = OrderedDict()
        # Written or deleted (None) and not yet committed: newer than the database.
        self._pending: dict[bytes, bytes | None] = {}
        self._memo_lock = threading.Lock()
        self._writes = 0
        self._flush_wanted = threading.Event()
        # Told when a commit fails (the disk refuses writes): the store pauses admission.
        self.on_flush_error: Callable[[sqlite3.Error], None] = lambda exc: None
        self._closed = False
        self.failed = False  # a commit failed and was not redone: records may be missing
        self._flusher = threading.Thread(target=self._flush_loop, name="index-flush",
                                         daemon=True)
        self._flusher.start()

    def close(self) -> None:
        self._closed = True
        self._flush_wanted.set()
        self._flusher.join()
        with self._db_lock:
            try:
                self.flush()
            except sqlite3.Error as exc:  # the check at the next start forgets the orphans
                self.failed = True
                self.on_flush_error(exc)
            self._cache.close()

    def _get(self, key: bytes, *, file_key: bool = False) -> bytes | None:
        pending = self._pending.get(key, _ABSENT)
        if pending is not _ABSENT:
            return pending
        raw = self._memo.get(key, _ABSENT)
        if raw is not _ABSENT:
            return raw
        present = self.present
        if file_key and present is not None and key not in present:
            return None  # never written: no query
        with self._memo_lock:
            writes = self._writes
        with self._db_lock:
            row = self._con.execute(_SELECT, (key,)).fetchone()
        raw = None if row is None else row[0]
        with self._memo_lock:
            if self._writes == writes:
                # Absent keys too (None): a miss asks for its key several times before
                # the fill writes it.
                self._remember_locked(key, raw)
        return raw

    def _set(self, key: bytes, raw: bytes | None, *, file_key: bool = False) -> None:
        """Write ``raw`` under ``key`` (None deletes it): visible at once, committed by the
        flusher with the writes around it."""
        with self._memo_lock:
            self._writes += 1
            self._pending[key] = raw
            self._memo.pop(key, None)
            if file_key and raw is not None and self.present is not None:
                self.present.add(key)
            full = len(self._pending) >= FLUSH_RECORDS
        if full:
            self._flush_wanted.set()

    def _flush_loop(self) -> None:
        while not self._closed:
            self._flush_wanted.wait(FLUSH_SECONDS)
            self._flush_wanted.clear()
            try:
                self.flush()
            except sqlite3.Error as exc:  # the disk: retried with the next flush
                self.on_flush_error(exc)

    def flush(self) -> None:
        """Commit every pending write in one transaction."""
        with self._db_lock:
            with self._memo_lock:
                batch = dict(self._pending)
            if not batch:
                return
            now = time.time()
            with self._cache.transact(retry=True):
                self._con.executemany(_DELETE, [(key,) for key, raw in batch.items()
                                                if raw is None])
                self._con.executemany(_UPSERT, [(key, now, now, raw)
                                                for key, raw in batch.items()
                                                if raw is not None])
            with self._memo_lock:
                for key, raw in batch.items():
                    if self._pending.get(key, _ABSENT) is raw:  # not written again meanwhile
                        del self._pending[key]
                        if raw is not None:
                            self._remember_locked(key, raw)

    def _remember_locked(self, key: bytes, raw: bytes | None) -> None:
        if len(self._memo) >= MEMO_ENTRIES:
            self._memo.popitem(last=False)
        self._memo[key] = raw

    def get_file(self, key: bytes) -> FileRecord | None:
        raw = self._get(key, file_key=True)
        return None if raw is None else self.file_record(raw)

    def put_file(self, key: bytes, record: FileRecord) -> None:
        a = record.attr
        self._set(
            key,
            _FILE.pack(
                a.size, a.mtime_ns, a.mode, a.uid, a.gid, a.nlink, a.atime_ns, a.ctime_ns,
                record.stored_chunks, record.first_checksum, *record.checked_as,
            ),
            file_key=True,
        )

    def get_chunk(self, key: bytes) -> ChunkRecord | None:
        raw = self._get(key)
        return None if raw is None else ChunkRecord(*_CHUNK.unpack(raw))

    def put_chunk(self, key: bytes, record: ChunkRecord) -> None:
        self._set(key, _CHUNK.pack(record.checksum, record.length))

    def delete(self, key: bytes) -> None:
        self._set(key, None)

    @property
    def empty(self) -> bool:
        """No record committed (a new cache)."""
        with self._db_lock:
            return self._con.execute("SELECT 1 FROM Cache LIMIT 1").fetchone() is None

    def all_keys(self) -> Iterator[bytes]:
        """Every key, file and chunk records alike, committed ones (call flush first for the
        rest), in batches: safe to write and delete meanwhile (a key written meanwhile may or
        may not be seen)."""
        for batch in self.batches():
            for key, _raw in batch:
                yield key

    def batches(self, size: int = 4096) -> Iterator[list[tuple[bytes, bytes]]]:
        """(key, packed record) of every committed record, ``size`` at a time, in the order
        they were first written; the database lock is held for one batch at a time only."""
        after = 0
        while True:
            with self._db_lock:
                rows = self._con.execute(_BATCH, (after, size)).fetchall()
            if not rows:
                return
            after = rows[-1][0]
            yield [(key, raw) for _rowid, key, raw in rows]

    @staticmethod
    def file_record(raw: bytes) -> FileRecord:
        """The file record packed in ``raw`` (a value :meth:`batches` gives)."""
        if len(raw) == _FILE.size:
            f = _FILE.unpack(raw)
            checked = (f[10], f[11], f[12])
        else:
            f, checked = _FILE_UNCHECKED.unpack(raw), UNCHECKED
        return FileRecord(Attr(f[2], f[0], f[3], f[4], f[5], f[6], f[1], f[7]), f[8], f[9],
                          checked)

    def __len__(self) -> int:
        with self._db_lock:
            self.flush()
            return len(self._cache)


# diskcache keeps bytes keys and values up to disk_min_file_size in its Cache table, "raw";
# asked directly, a record costs a third of diskcache's own get.
_SELECT = "SELECT value FROM Cache WHERE key = ? AND raw = 1"
_BATCH = ("SELECT rowid, key, value FROM Cache WHERE rowid > ? AND raw = 1 "
          "ORDER BY rowid LIMIT ?")
# Written the same way: what diskcache's own set and delete leave for a bytes key and a
# small bytes value (inline, "raw", mode 1, size 0), one statement per record for a whole
# batch.  Its set asks for the row, writes it and looks for expired rows to cull, three
# statements and most of the flusher's CPU through a warm.  Its triggers still keep its count.
_UPSERT = ("INSERT INTO Cache(key, raw, store_time, expire_time, access_time, access_count, "
           "tag, size, mode, filename, value) VALUES (?, 1, ?, NULL, ?, 0, NULL, 0, 1, NULL, ?) "
           "ON CONFLICT(key, raw) DO UPDATE SET store_time = excluded.store_time, "
           "access_time = excluded.access_time, value = excluded.value")
_DELETE = "DELETE FROM Cache WHERE key = ? AND raw = 1"


def _share_one_connection(cache: diskcache.Cache) -> sqlite3.Connection:
    """Make every thread use one SQLite connection to the index.

    diskcache keeps a connection per thread.  libfuse's worker threads are not
    Python threads: each callback runs in a thread state made for it and destroyed
    after it, so per-thread connections were opened for a single query and then
    lingered, unclosed, until a garbage collection, thousands of them (each with
    its descriptors and page cache) under load.  One connection, opened here
    across threads and used under CacheIndex's lock, avoids all of that.
    """
    path = database_path(cache.directory)
    shared = types.SimpleNamespace(pid=os.getpid())
    old, cache._local = cache._local, shared
    old_con = getattr(old, "con", None)
    if old_con is not None:
        old_con.close()
    shared.con = sqlite3.connect(path, timeout=cache.timeout, isolation_level=None,
                                 check_same_thread=False)
    # The daemon owns the cache directory (layout.py flock()s it): no other process
    # reads the index while it runs, so SQLite need not take and drop file locks, nor
    # stat the files, on every query.  Set before the first access, so the write-ahead
    # log's index lives in memory, not in a shared -shm file.
    shared.con.execute("PRAGMA locking_mode=EXCLUSIVE")
    # The per-connection settings diskcache applies to each new connection.
    for key, value in shared.con.execute("SELECT key, value FROM Settings").fetchall():
        if key.startswith("sqlite_"):
            cache.reset(key, value, update=False)
    return shared.con
