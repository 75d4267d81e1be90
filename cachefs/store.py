"""The chunk store: cached bytes on the SSD, their index, checksums and the byte budget.

A remote file is cached as fixed-size chunks (``CHUNK_BYTES``); a file no
larger than one chunk, which is most training examples, is a single entry.
Every chunk carries an xxh3 checksum that is verified each time it is read from
the SSD, before any byte is served; a chunk that fails is dropped, counted and
refetched by the caller.

The budget counts every byte the store has on disk: chunk data as allocated,
the index files and the directories.  Admission reserves room before writing
and stops when the next chunk would not fit; nothing is ever evicted to make
room (see admission.py for why).

Lock order: ``CacheStore._lock`` is a leaf; no other lock is taken while it is held.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

from cachefs.admission import FractionAdmission
from cachefs.attr import Attr
from cachefs.errors import CacheCorrupt
from cachefs.index import CacheIndex, ChunkRecord, FileRecord, chunk_key, data_key, split_key
from cachefs.layout import BLOCK_BYTES, CacheLayout, allocated_bytes

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 2**20
# The index grows in bursts: a WAL checkpoint copies up to sqlite_wal_autocheckpoint
# pages into the database at once.  Keep that much free at all times.
INDEX_HEADROOM_BYTES = 768 * 2**10
# A fill may add a directory block (new fan-out directory or a full one).
FILL_HEADROOM_BYTES = 2 * BLOCK_BYTES
# After a write error (disk full, read-only, failing), try admitting again after this.
ADMISSION_RETRY_SECONDS = 60.0

_checksum = xxhash.xxh3_64_intdigest


def _indexable(attr: Attr) -> bool:
    """Whether the index can record ``attr``: times are signed 64-bit nanoseconds, so a file
    dated after 2262 (a broken clock, a bogus archive) is served but not cached."""
    return all(-2**63 <= t < 2**63 for t in (attr.atime_ns, attr.mtime_ns, attr.ctime_ns))


def chunk_count(size: int) -> int:
    return max(1, -(-size // CHUNK_BYTES))


def chunk_span(size: int, number: int) -> tuple[int, int]:
    """(offset, length) of chunk ``number`` of a file of ``size`` bytes."""
    offset = number * CHUNK_BYTES
    return offset, max(0, min(CHUNK_BYTES, size - offset))


@dataclasses.dataclass
class CheckReport:
    """What :meth:`CacheStore.check` found (and fixed, when asked)."""

    files: int = 0
    complete_files: int = 0
    chunks: int = 0
    data_bytes: int = 0
    chunks_verified: int = 0
    corrupt_chunks: int = 0
    missing_chunks: int = 0
    orphan_files: int = 0
    miscounted_files: int = 0
    ineligible_files: int = 0
    over_budget_files: int = 0
    leftover_fills: int = 0

    @property
    def problems(self) -> int:
        return self.corrupt_chunks + self.missing_chunks + self.orphan_files + self.miscounted_files


class CacheStore:
    """Cached chunks of remote files.

    Thread safety: reading chunks takes no lock (records are immutable values and
    chunk files are replaced atomically).  ``_lock`` guards the space account
    (``_data_bytes``, ``_reserved_bytes``, ``_fan_bytes``, ``_index_bytes``),
    ``_complete_files`` and every read-modify-write of a file record.
    """

    def __init__(
        self,
        layout: CacheLayout,
        index: CacheIndex,
        capacity_bytes: int,
        admission: FractionAdmission,
        on_integrity_failure: Callable[[], None] = lambda: None,
    ) -> None:
        self.layout = layout
        self.index = index
        self.capacity_bytes = capacity_bytes
        self.admission = admission
        self._on_integrity_failure = on_integrity_failure
        # Called for every write the cache disk refused (the daemon counts them).
        self.on_write_error: Callable[[], None] = lambda: None
        self._lock = threading.Lock()
        self._data_bytes = 0
        self._reserved_bytes = 0
        self._fan_bytes: dict[str, int] = {}
        self._index_bytes = 0
        self._fixed_bytes = 0
        self._complete_files = 0
        self._full = False
        self._write_error: str | None = None
        self._admission_paused_until = 0.0
        self.startup_report = CheckReport()

    @classmethod
    def open(
        cls,
        cache_dir: Path,
        capacity_bytes: int,
        admission: FractionAdmission,
        on_integrity_failure: Callable[[], None] = lambda: None,
        *,
        verify_data: bool = False,
    ) -> CacheStore:
        """Prepare and lock ``cache_dir``, then reconcile it with its index (see :meth:`check`).

        What the reconciliation found is kept in ``startup_report``.
        """
        layout = CacheLayout(cache_dir, CHUNK_BYTES)
        layout.prepare()
        layout.lock()
        try:
            store = cls(layout, CacheIndex(layout.index_dir), capacity_bytes, admission,
                        on_integrity_failure)
            report = store.startup_report = store.check(fix=True, verify_data=verify_data)
        except BaseException:
            layout.unlock()
            raise
        log.info(
            "cache %s: %d files (%d complete), %d chunks, %s of %s used",
            cache_dir, report.files, report.complete_files, report.chunks,
            store.used_bytes, capacity_bytes,
        )
        if report.problems or report.ineligible_files or report.over_budget_files:
            log.warning("cache %s reconciled at start: %s", cache_dir, report)
        return store

    def close(self) -> None:
        self.index.close()
        self.layout.unlock()

    # -- figures ---------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes on disk now, counted against the capacity."""
        with self._lock:
            return self._used_locked()

    def _used_locked(self) -> int:
        return (self._data_bytes + self._index_bytes + self._fixed_bytes
                + sum(self._fan_bytes.values()))

    @property
    def complete_files(self) -> int:
        return self._complete_files

    @property
    def admitting(self) -> bool:
        """False once the budget is used or the disk refused a write."""
        return not self._full and time.monotonic() >= self._admission_paused_until

    @property
    def write_error(self) -> str | None:
        return self._write_error

    # -- reads -----------------------------------------------------------------------------

    def lookup(self, key: bytes) -> FileRecord | None:
        return self.index.get_file(key)

    @staticmethod
    def is_complete(record: FileRecord) -> bool:
        return record.stored_chunks >= chunk_count(record.attr.size)

    def chunk_record(self, key: bytes, record: FileRecord, number: int) -> ChunkRecord | None:
        if chunk_count(record.attr.size) == 1:
            if not record.stored_chunks:
                return None
            return ChunkRecord(record.first_checksum, record.attr.size)
        return self.index.get_chunk(chunk_key(key, number))

    def read_chunk(self, key: bytes, record: FileRecord, number: int) -> bytes | None:
        """Chunk ``number`` from the SSD, checksum verified; None when it is not stored.

        Raises CacheCorrupt (after dropping that chunk) when the bytes on disk are
        not the ones stored: the caller refetches it from the remote.
        """
        chunk = self.chunk_record(key, record, number)
        if chunk is None:
            return None
        try:
            return self._load(data_key(key, number, record.version), chunk)
        except CacheCorrupt as exc:
            self._corrupt_chunk(key, record, number, str(exc))
            raise

    def open_chunk(self, key: bytes, record: FileRecord, number: int
                   ) -> tuple[int, ChunkRecord] | None:
        """A read-only descriptor of stored chunk ``number`` and what its bytes must be
        (length, checksum), for a reader that verifies both itself; None when it is
        not stored.  A chunk file that is gone is dropped and counted as read_chunk
        would; the caller (not the store) closes the descriptor."""
        chunk = self.chunk_record(key, record, number)
        if chunk is None:
            return None
        try:
            return self._open_data(data_key(key, number, record.version)), chunk
        except CacheCorrupt as exc:
            self._corrupt_chunk(key, record, number, str(exc))
            return None

    def _corrupt_chunk(self, key: bytes, record: FileRecord, number: int, why: str) -> None:
        log.warning("cached chunk %d of %s dropped: %s; refetching from the remote",
                    number, os.fsdecode(key), why)
        self._on_integrity_failure()
        self._drop_chunk(key, record, number)

    def _open_data(self, dkey: bytes) -> int:
        try:
            return self.layout.open_chunk(dkey)
        except OSError as exc:
            raise CacheCorrupt(f"its file cannot be opened ({exc.strerror})") from None

    def _load(self, dkey: bytes, chunk: ChunkRecord) -> bytes:
        fd = self._open_data(dkey)
        try:
            # One byte more than recorded tells a file that grew from an intact one.
            data = os.pread(fd, chunk.length + 1, 0)
        except OSError as exc:
            raise CacheCorrupt(f"reading it failed ({exc.strerror})") from None
        finally:
            os.close(fd)
        if len(data) != chunk.length:
            raise CacheCorrupt(f"it holds {len(data)} bytes instead of {chunk.length}")
        if _checksum(data) != chunk.checksum:
            raise CacheCorrupt("its checksum does not match")
        return data

    # -- writes ----------------------------------------------------------------------------

    def store_chunk(self, key: bytes, attr: Attr, number: int, data: bytes) -> bool:
        """Admit chunk ``number`` of the file at ``key`` (version ``attr``) if it fits.

        Returns False, storing nothing, when the file is not eligible, the budget
        is used or the disk refuses writes.  Never raises for a disk problem: the
        reader is served from the remote regardless.
        """
        if not self.admitting or not self.admission.eligible(os.fsdecode(key)) \
                or not _indexable(attr):
            return False
        need = -(-len(data) // BLOCK_BYTES) * BLOCK_BYTES + FILL_HEADROOM_BYTES
        with self._lock:
            if self._used_locked() + self._reserved_bytes + need + INDEX_HEADROOM_BYTES \
                    > self.capacity_bytes:
                if not self._full:
                    self._full = True
                    log.info("cache is full (%d of %d bytes): admission stopped; "
                             "nothing is evicted", self._used_locked(), self.capacity_bytes)
                return False
            self._reserved_bytes += need
        try:
            stored = self._write_chunk(key, attr, number, data)
            if self._write_error is not None:
                self.clear_write_error()  # the pause is over and the disk took a write
            return stored
        except (OSError, sqlite3.Error) as exc:  # the index lives on the same disk
            self._pause_admission(exc)
            return False
        finally:
            with self._lock:
                self._reserved_bytes -= need

    def _write_chunk(self, key: bytes, attr: Attr, number: int, data: bytes) -> bool:
        checksum = _checksum(data)
        single = chunk_count(attr.size) == 1
        ckey = chunk_key(key, number)
        dkey = data_key(key, number, attr.version)
        allocated, fan_bytes = self.layout.write_chunk(dkey, data)
        fan = self.layout.chunk_name(dkey)[:2]
        with self._lock:
            record = self.index.get_file(key)
            if record is not None and record.attr.version != attr.version:
                self._drop_locked(key, record)
                record = None
            if record is None:
                record = FileRecord(attr, 0, 0)
            already = self.chunk_record(key, record, number) is not None
            if not single:
                self.index.put_chunk(ckey, ChunkRecord(checksum, len(data)))
            if not already:
                record = record._replace(stored_chunks=record.stored_chunks + 1)
                self._data_bytes += allocated
                if self.is_complete(record):
                    self._complete_files += 1
            record = record._replace(first_checksum=checksum if single else 0)
            self.index.put_file(key, record)
            self._fan_bytes[fan] = fan_bytes
            self._index_bytes = self.layout.index_bytes()
        return True

    def _pause_admission(self, exc: OSError | sqlite3.Error) -> None:
        self.on_write_error()
        if isinstance(exc, OSError):
            message = f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, '?')})"
        else:
            message = f"index: {exc}"
        with self._lock:  # concurrent fills fail together: say so once
            first = self._write_error is None
            self._write_error = message
            self._admission_paused_until = time.monotonic() + ADMISSION_RETRY_SECONDS
        if first:
            log.error("cache disk refused a write: %s; admission paused, reads go to the "
                      "remote (retrying in %.0f s)", message, ADMISSION_RETRY_SECONDS)

    def clear_write_error(self) -> None:
        with self._lock:
            was, self._write_error = self._write_error, None
        if was is not None:
            log.info("cache disk accepts writes again: admission resumed")

    def drop(self, key: bytes) -> None:
        """Forget every chunk of the file at ``key`` (it changed, or a chunk is bad).

        Never raises for a disk problem: a disk that cannot forget is a disk that
        refuses writes (admission pauses); readers go to the remote regardless.
        """
        try:
            with self._lock:
                record = self.index.get_file(key)
                if record is not None:
                    self._drop_locked(key, record)
                    self._index_bytes = self.layout.index_bytes()
        except (OSError, sqlite3.Error) as exc:
            self._pause_admission(exc)

    def _drop_chunk(self, key: bytes, record: FileRecord, number: int) -> None:
        """Forget one bad chunk; the rest of a large file stays cached."""
        if chunk_count(record.attr.size) == 1:
            self.drop(key)
            return
        try:
            with self._lock:
                current = self.index.get_file(key)
                ckey = chunk_key(key, number)
                if current is None or current.version != record.version \
                        or self.index.get_chunk(ckey) is None:
                    return  # dropped or replaced meanwhile
                if self.is_complete(current):
                    self._complete_files -= 1
                self._data_bytes -= self._remove_file_locked(data_key(key, number,
                                                                      current.version))
                self.index.delete(ckey)
                self.index.put_file(key, current._replace(
                    stored_chunks=current.stored_chunks - 1))
                self._index_bytes = self.layout.index_bytes()
                self._full = False
        except (OSError, sqlite3.Error) as exc:
            self._pause_admission(exc)

    def _drop_locked(self, key: bytes, record: FileRecord) -> None:
        if self.is_complete(record):
            self._complete_files -= 1
        count = chunk_count(record.attr.size)
        for number in range(count):
            ckey = chunk_key(key, number)
            if count > 1 and self.index.get_chunk(ckey) is None:
                continue
            self._data_bytes -= self._remove_file_locked(data_key(key, number, record.version))
            if count > 1:
                self.index.delete(ckey)
        self.index.delete(key)
        # Removing data may bring the store back under budget for later fills.
        self._full = False

    def _remove_file_locked(self, dkey: bytes) -> int:
        path = self.layout.chunk_path(dkey)
        try:
            allocated = allocated_bytes(os.stat(path))
            os.unlink(path)
        except FileNotFoundError:
            return 0
        return allocated

    # -- consistency -----------------------------------------------------------------------

    def check(self, *, fix: bool, verify_data: bool) -> CheckReport:
        """Compare the index with the files on disk; with ``fix``, repair what differs.

        INVARIANT: every chunk file belongs to a record, and every record's chunks exist.
        INVARIANT: a file record's stored_chunks equals its chunk records (one for a
        single-chunk file).
        INVARIANT: used bytes (data + index + directories) <= capacity.
        INVARIANT (verify_data): every stored chunk matches its checksum.
        Called at every start (fix, no data verification), by ``cachefs verify``
        (fix and verify) and by tests.  Not safe to run beside writers.
        """
        report = CheckReport(leftover_fills=self.layout.sweep_tmp() if fix else 0)
        on_disk = dict(self.layout.iter_chunk_files())
        file_keys: list[bytes] = []
        chunks_by_file: dict[bytes, list[int]] = {}
        for key in self.index.all_keys():
            path, number = split_key(key)
            if number is None:
                file_keys.append(key)
            else:
                chunks_by_file.setdefault(path, []).append(number)

        kept: set[str] = set()
        scores: list[tuple[float, bytes]] = []
        for key in file_keys:
            record = self.index.get_file(key)
            if record is None:
                continue
            count = chunk_count(record.attr.size)
            if count == 1:
                numbers = [0] if record.stored_chunks else []
            else:
                numbers = chunks_by_file.pop(key, [])
            names = [self.layout.chunk_name(data_key(key, n, record.version)) for n in numbers]
            healthy = True
            if len(numbers) != record.stored_chunks or any(n >= count for n in numbers):
                report.miscounted_files += 1
                healthy = False
            for number, name in zip(numbers, names, strict=True):
                if name not in on_disk:
                    report.missing_chunks += 1
                    healthy = False
                elif verify_data:
                    if self._chunk_intact(key, record, number):
                        report.chunks_verified += 1
                    else:
                        report.corrupt_chunks += 1
                        healthy = False
            eligible = self.admission.eligible(os.fsdecode(key))
            report.ineligible_files += not eligible
            if fix and not (healthy and eligible):
                self._forget(key, numbers, record.version, multi_chunk=count > 1)
                kept.update(names)  # accounted for above, not unaccounted orphans
                continue
            report.files += 1
            report.chunks += len(numbers)
            report.complete_files += self.is_complete(record)
            report.data_bytes += sum(on_disk.get(name, 0) for name in names)
            kept.update(names)
            scores.append((self.admission.score(os.fsdecode(key)), key))
        for key, numbers in chunks_by_file.items():  # chunk records of no file record
            report.orphan_files += len(numbers)
            if fix:  # their files, whatever version, are swept as orphans below
                for number in numbers:
                    self.index.delete(chunk_key(key, number))
        for name in on_disk.keys() - kept:
            report.orphan_files += 1
            if fix:
                self.layout.remove_chunk_name(name)

        with self._lock:
            self._data_bytes = report.data_bytes
            self._complete_files = report.complete_files
            self._fixed_bytes = self.layout.fixed_bytes()
            self._fan_bytes = self.layout.fan_dir_bytes()
            self._index_bytes = self.layout.index_bytes()
            self._full = False
        if fix:
            report.over_budget_files = self._trim_to_capacity(scores)
        return report

    def _chunk_intact(self, key: bytes, record: FileRecord, number: int) -> bool:
        chunk = self.chunk_record(key, record, number)
        if chunk is None:
            return False
        try:
            self._load(data_key(key, number, record.version), chunk)
        except CacheCorrupt:
            return False
        return True

    def _forget(self, key: bytes, numbers: list[int], version, *, multi_chunk: bool) -> None:
        for number in numbers:
            self.layout.remove_chunk(data_key(key, number, version))
            if multi_chunk:
                self.index.delete(chunk_key(key, number))
        self.index.delete(key)

    def _trim_to_capacity(self, scores: list[tuple[float, bytes]]) -> int:
        """Drop files until the store fits its capacity (it shrank since the last run).

        The files with the highest admission score go first, so the cache keeps the
        files a smaller fraction would have admitted.
        """
        dropped = 0
        scores.sort(reverse=True)
        for _score, key in scores:
            if self.used_bytes + INDEX_HEADROOM_BYTES <= self.capacity_bytes:
                break
            self.drop(key)
            dropped += 1
        return dropped
