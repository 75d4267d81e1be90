"""The chunk store: cached bytes on the SSD, their index, checksums and the byte budget.

A cached file is one data file on the SSD (see layout.py), filled and checked in
fixed-size chunks (``CHUNK_BYTES``); a file no larger than one chunk, which is most
training examples, is a single entry.  Every chunk carries an xxh3 checksum.

Two ways to read a cached file:

- chunk by chunk (:meth:`CacheStore.read_chunk`), each chunk verified as it is read;
- whole, as a descriptor handed to the kernel or a client that reads it without us
  (:meth:`CacheStore.local_file`).  Such a file is handed over when its record says its
  bytes were checked against the checksums (hashed as they were written, or verified) while
  it had the inode, mtime and ctime it has now (nothing has written to it since), and the
  store trusts those records: it started after a clean stop, or the scrub (scrub.py) has
  been over the file since.  Otherwise it is verified first: small files on the spot, larger
  ones by a background thread (read chunk by chunk until then).  A file of one chunk is
  found without its record at all, by the check mark it carries (mark.py,
  :meth:`CacheStore.checked_file`): at a million files the record is a read of the index's
  pages from the disk, the mark is in the inode the open reads anyway.

A chunk or file that fails is dropped, counted and refetched by the caller.

A start costs the same whatever the cache holds (reconcile.py): after a clean stop the store
takes the account the stop left; after a crash it serves at once and reconciles the index
with the disk in the background, admission paused until it knows its account again.

The budget counts every byte the store has on disk: chunk data as allocated,
the index files and the directories.  Admission reserves room before writing
and stops when the next chunk would not fit; nothing is ever evicted to make
room (see admission.py for why).

Lock order: ``CacheStore._lock`` before the index's locks; nothing else is taken while it
is held.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import xxhash

from cachefs.attr import Attr, Version
from cachefs.errors import CacheCorrupt, CacheUnavailable
from cachefs.store.admission import FractionAdmission
from cachefs.store.index import CacheIndex, ChunkRecord, FileRecord, chunk_key, data_key, split_key
from cachefs.store.layout import (
    BLOCK_BYTES,
    CacheLayout,
    NewFile,
    allocated_bytes,
    blocks_spanned,
    disk_full,
    unlink_quietly,
)
from cachefs.store.mark import mark_checked, marked_as
from cachefs.store.presence import KeyFilter
from cachefs.store.reconcile import (
    Account,
    CheckReport,
    leave_clean_stop,
    leave_trusted_boot,
    reconcile,
    take_clean_stop,
    take_trusted_boot,
)
from cachefs.store.scrub import Scrubber

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 2**20
# The index grows in bursts: a WAL checkpoint copies up to sqlite_wal_autocheckpoint
# pages into the database at once.  Keep that much free at all times.
INDEX_HEADROOM_BYTES = 768 * 2**10
# A fill may add a directory block (new fan-out directory or a full one).
FILL_HEADROOM_BYTES = 2 * BLOCK_BYTES
# Admission stops when a file does not fit and the room left is below this share of the
# budget; until then only the files that do not fit are left out.
FULL_ROOM_SHARE = 0.01
# After a write error (disk full, read-only, failing), try admitting again after this.
ADMISSION_RETRY_SECONDS = 60.0
# Files up to this size are verified when first handed over; larger ones in the background.
INLINE_VERIFY_BYTES = 16 * 2**20
# How often the index's size on disk is measured (it grows by records between).
INDEX_MEASURE_SECONDS = 0.5
# A fan-out directory's size is measured again after this many files written into it.
FAN_MEASURE_EVERY = 16

_checksum = xxhash.xxh3_64_intdigest
# What a fill thread reads a copy through to hash it (one buffer per thread, reused).
HASH_BUFFER_BYTES = 256 * 2**10
_reading = threading.local()


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


def _describe(exc: OSError) -> str:
    """``No space left on device (ENOSPC)``: the words and the name an operator searches."""
    return f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno or 0, '?')})"


def checksums_of(fd: int, size: int) -> tuple[int, ...]:
    """The checksum of each chunk of the ``size`` bytes the file behind ``fd`` holds (the pages
    just written), read piecewise into a buffer this thread reuses.  (A map of the file would
    copy nothing, but costs three times as much for a 64 KiB file: the map, its page faults
    and the unmap, which must reach every core a thread of the daemon runs on.)"""
    buffer = getattr(_reading, "buffer", None)
    if buffer is None:
        buffer = _reading.buffer = memoryview(bytearray(HASH_BUFFER_BYTES))
    checksums = []
    for number in range(chunk_count(size)):
        offset, length = chunk_span(size, number)
        if length <= HASH_BUFFER_BYTES:
            got = os.preadv(fd, [buffer[:length]], offset)
            if got != length:
                raise CacheCorrupt(f"the copy holds {got} bytes of chunk {number}")
            checksums.append(_checksum(buffer[:length]))
            continue
        hasher = xxhash.xxh3_64()
        end = offset + length
        while offset < end:
            got = os.preadv(fd, [buffer[:min(HASH_BUFFER_BYTES, end - offset)]], offset)
            if got <= 0:
                raise CacheCorrupt(f"the copy ends inside chunk {number}")
            hasher.update(buffer[:got])
            offset += got
        checksums.append(hasher.intdigest())
    return tuple(checksums)


def copy_and_hash(fd: int, version: Version, copy: Callable[[int], None]
                  ) -> tuple[tuple[int, ...], os.stat_result]:
    """Have ``copy(fd)`` write the ``version.size`` bytes of ``version`` into the new file
    ``fd``, then hash it as written (and mark it, a file of one chunk: mark.py): (its chunks'
    checksums, its stat once written).  The one step of a fill, on a thread of the daemon
    (CacheStore.fill) or in a fill process (fillprocess.py); what ``copy`` raises is raised,
    and a copy of another length is CacheCorrupt (the copier's fault, not the disk's)."""
    copy(fd)
    st = os.fstat(fd)
    if st.st_size != version.size:
        raise CacheCorrupt(f"the copy wrote {st.st_size} bytes, not {version.size}")
    checksums = checksums_of(fd, version.size)
    if len(checksums) == 1:
        mark_checked(fd, version, st)  # hashing read it: as it was written
        st = os.fstat(fd)  # its ctime moved
    return checksums, st


def _key_hash(key: bytes) -> int:
    return _checksum(key)


def _allocation_of(record: FileRecord) -> int:
    """The bytes a data file of ``record`` takes on the disk, at least: its stored chunks, in
    blocks (its fill accounted what it measured, these and any the file system added).  Of a
    file not complete, the chunks stored may include the last, shorter one."""
    size, stored = record.attr.size, record.stored_chunks
    count = chunk_count(size)
    if stored >= count:
        return blocks_spanned(0, size)
    if not stored:
        return 0
    last = size - (count - 1) * CHUNK_BYTES
    return (stored - 1) * CHUNK_BYTES + blocks_spanned(0, last)


def refusal(cache_dir: Path, exc: OSError | sqlite3.Error) -> str:
    """One line saying why the cache in ``cache_dir`` could not be opened."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    hint = "; the cache disk is full (space or inodes)" if disk_full(cache_dir) else ""
    return f"cannot open the cache in {cache_dir}: {reason}{hint}"


def _open_index(layout: CacheLayout) -> tuple[CacheIndex, str | None]:
    """The cache's index, and None; or, for a damaged one, a new index and why the old one
    was dropped.  A damaged index (not a database, or its pages malformed: the cache disk's
    fault) goes with the files it accounted for, whose checksums it held, and the cache
    starts empty: it holds copies, and a mount refused for them would stop the node's
    training.  A disk that fails to read or write (OperationalError: I/O error, full,
    locked) is refused as ever."""
    try:
        return CacheIndex(layout.index_dir), None
    except sqlite3.DatabaseError as exc:
        if isinstance(exc, sqlite3.OperationalError):
            raise
        reason = str(exc) or type(exc).__name__
    log.warning("cache %s: its index is damaged (%s): emptied; the cache fills again as "
                "files are read", layout.root, reason)
    layout.empty()
    take_clean_stop(layout)  # its account was the damaged index's
    return CacheIndex(layout.index_dir), reason


def _checked_as(st: os.stat_result) -> tuple[int, int, int]:
    """What changes when anything writes to a file, or puts another file in its place (its
    size too, which the record holds apart)."""
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns


class FillPlace(NamedTuple):
    """Where a fill written by another process goes, and the room held for it."""

    need: int
    tmp: str
    final: str


class StoreClosing(Exception):
    """Raised in a long job of the store's when it closes meanwhile."""


class CacheStore:
    """Cached files on the SSD.

    Thread safety: reading chunks takes no lock (records are immutable values, a file of
    one chunk is replaced atomically, and chunks of a larger file are checked against their
    checksums).  ``_lock`` guards the space account (``_data_bytes``, ``_reserved_bytes``,
    ``_fan_bytes``, ``_fan_total``, ``_index_bytes``), ``_complete_files``, ``_filling``,
    ``_chunk_writes``, ``_closing`` and every read-modify-write of a file record.
    ``_verified`` is a set changed by single operations, ``_trusted`` and ``_marks_alone``
    flags set once;
    ``_fan_writes`` counts without a lock (a lost count only moves when a directory is
    measured next).
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
        # Called (outside the lock) with (key, version) of every file version dropped, so
        # that whoever keeps its data file open lets go of it.
        self.on_dropped: Callable[[bytes, Version], None] = lambda key, version: None
        # Called (outside the lock) when a file is left out for want of room.
        self.on_no_room: Callable[[], None] = lambda: None
        index.on_flush_error = self._pause_admission
        self._lock = threading.Lock()
        self._data_bytes = 0
        self._reserved_bytes = 0
        self._fan_bytes: dict[str, int] = {}
        self._fan_total = 0  # the sum of _fan_bytes
        self._fan_writes: dict[str, int] = {}  # files a fill wrote into each, this process
        self._index_bytes = 0
        self._index_measured_at = 0.0
        self._fixed_bytes = 0
        self._complete_files = 0
        self._full = False
        self._write_error: str | None = None
        self._admission_paused_until = 0.0
        # Whether records' checks are trusted (a clean start, or the scrub went over every
        # file); until then, the keys (their 64-bit hashes) verified in this process.
        self._trusted = False
        self._verified: set[int] = set()
        # Whether a check mark alone makes a copy cached (checked_file): not while the
        # reconciliation after a crash may find marked copies whose records the crash lost
        # (filled between the mark and the index's next commit), which it removes.
        self._marks_alone = True
        self._to_verify: queue.SimpleQueue[tuple[bytes, FileRecord] | None] = \
            queue.SimpleQueue()
        self._verifying: set[bytes] = set()
        self._verifier: threading.Thread | None = None
        self._scrubber: Scrubber | None = None
        self._reconciler: threading.Thread | None = None
        self._reconciling = False  # admission paused until the account is known
        self._closing = False
        # Data files a fill writes in place, by path: whoever takes a path out (the fill, to
        # index or discard it; close, to remove it) sees to its file.  Beside them, the
        # chunk writes under way into each data file (a whole file's one chunk is written
        # under tmp/ and renamed over it): neither kind writes at a name the other holds.
        self._filling: set[str] = set()
        self._chunk_writes: collections.Counter[str] = collections.Counter()
        self.ready = threading.Event()  # set once the account is known (reconciled)
        self.startup_report = CheckReport()
        # Why the index this start found was dropped, the cache emptied with it (_open_index).
        self.dropped_index: str | None = None
        # Removing what an emptying put aside (CacheLayout.remove_trash), while it runs.
        self.trash_removal: threading.Thread | None = None

    @classmethod
    def open(
        cls,
        cache_dir: Path,
        capacity_bytes: int,
        admission: FractionAdmission,
        on_integrity_failure: Callable[[], None] = lambda: None,
        *,
        verify_data: bool = False,
        scrub: bool = True,
        lock_wait_seconds: float = 0.0,
    ) -> CacheStore:
        """Prepare and lock ``cache_dir``, then learn its account: from the record of a clean
        stop (no scan), else by reconciling it with its index, in the background unless the
        index is empty or ``verify_data`` (``cachefs verify``) asks for every checksum, then at
        once.  ``ready`` is set once the account is known; what the reconciliation found is
        then in ``startup_report``.  With ``scrub``, every file is verified in the background
        from then on (scrub.py).  ``lock_wait_seconds``: how long another daemon may still hold
        the cache dir (see CacheLayout.lock)."""
        layout = CacheLayout(cache_dir, CHUNK_BYTES)
        layout.prepare()
        layout.lock(lock_wait_seconds)
        try:
            index, dropped = _open_index(layout)
            store = cls(layout, index, capacity_bytes, admission, on_integrity_failure)
            store.trash_removal = layout.remove_trash()
            if dropped is not None:
                store.dropped_index = dropped
                on_integrity_failure()
            clean = None if verify_data else take_clean_stop(layout)
            # Taken at every start: left again only once this store trusts its records.
            trusted_in_this_boot = take_trusted_boot(layout) and not verify_data
            if clean is not None:
                store._resume(*clean)
                if clean[0].admission != admission.describe() \
                        or store.exceeds_capacity(clean[0].data_bytes):
                    # Files the admission no longer keeps, or more than the budget holds now:
                    # found in the background, the records trusted all the same.
                    store._reconcile_in_background(because="its admission or budget changed")
            elif verify_data or store.index.empty:
                # Nothing to distrust (a new cache), or every checksum read now.
                store._reconcile(verify_data=verify_data)
                store._trust_records()
            else:
                # A crash: of the daemon alone, in this boot, whose records are as good as
                # after a clean stop; or of the machine (reconcile.py).
                store._marks_alone = False
                if trusted_in_this_boot:
                    store._trust_records()
                store._reconcile_in_background()
        except BaseException:
            layout.unlock()
            raise
        if scrub and not verify_data:
            store._start_scrub()
        return store

    def _resume(self, account: Account, present: KeyFilter | None) -> None:
        """After a clean stop: its account, its filter of keys, and records trusted when the
        store that stopped trusted them."""
        self.layout.sweep_tmp()
        self.index.present = present
        with self._lock:
            self._data_bytes = account.data_bytes
            self._complete_files = account.complete_files
            self._measure_directories_locked()
        if account.trusted:
            self._trust_records()
        self.ready.set()
        self.startup_report = CheckReport(files=account.complete_files,
                                          complete_files=account.complete_files,
                                          data_bytes=account.data_bytes)
        log.info("cache %s: %d files, %s of %s used; stopped cleanly, nothing to reconcile%s",
                 self.layout.root, account.complete_files, self.used_bytes,
                 self.capacity_bytes, "" if account.trusted else
                 " (not verified since a crash of the machine yet: cached files are verified "
                 "before they are handed over until the scrub has been over them)")

    def _reconcile_in_background(self, because: str = "") -> None:
        """After a crash (or a change of admission or budget): serve now, reconcile
        meanwhile, admission paused until then."""
        if because:
            log.info("cache %s: reconciling it with its index in the background, as %s; "
                     "nothing new is admitted until then", self.layout.root, because)
        elif self._trusted:
            log.warning("cache %s did not stop cleanly, but in this boot and trusted: its "
                        "cached files are handed over as after a clean stop; reconciling it "
                        "with its index in the background, nothing new admitted until then",
                        self.layout.root)
        else:
            log.warning("cache %s did not stop cleanly: reconciling it with its index in the "
                        "background; cached files are verified before they are handed over, "
                        "and nothing new is admitted, until then", self.layout.root)
        self.ready.clear()
        self._reconciling = True
        self._reconciler = threading.Thread(target=self._reconcile, name="reconcile",
                                             daemon=True)
        self._reconciler.start()

    def _reconcile(self, *, verify_data: bool = False) -> None:
        try:
            report, present, kept = reconcile(self, fix=True, verify_data=verify_data)
            with self._lock:
                self._data_bytes = report.data_bytes
                self._complete_files = report.complete_files
                self._measure_directories_locked()
                self._full = False
            self.index.present = present
            if kept:
                report.over_budget_files = self._trim_to_capacity(kept)
        except StoreClosing:
            return
        except Exception:
            if not self._reconciling:
                raise  # at once (a new cache, cachefs verify): the caller reports it
            log.exception("reconciling cache %s failed: admission stays paused",
                          self.layout.root)
            return
        self.startup_report = report
        self._reconciling = False
        self._marks_alone = True
        self.ready.set()
        log.info("cache %s: %d files (%d complete), %d chunks, %s of %s used",
                 self.layout.root, report.files, report.complete_files, report.chunks,
                 self.used_bytes, self.capacity_bytes)
        if report.problems or report.ineligible_files or report.over_budget_files:
            log.warning("cache %s reconciled: %s", self.layout.root, report)

    def stop_if_closing(self) -> None:
        """For a long job of the store's (reconciling): stop when the store closes."""
        if self._closing:
            raise StoreClosing

    def _start_scrub(self) -> None:
        def scrub_when_ready() -> None:
            self.ready.wait()
            if not self._closing:
                self._scrubber = Scrubber(self, on_done=self._trust_records)

        threading.Thread(target=scrub_when_ready, name="scrub-wait", daemon=True).start()

    def _trust_records(self) -> None:
        """Records' checks are trusted from now on (a clean stop before, a new cache, the
        scrub over every file, a crash of the daemon alone in this boot), and by the next
        start after a crash in this boot."""
        self._trusted = True
        self._verified = set()
        leave_trusted_boot(self.layout)
        fixed = self.layout.fixed_bytes()  # the record is one of its small files
        with self._lock:
            self._fixed_bytes = fixed

    def close(self) -> None:
        with self._lock:
            self._closing = True
            unfinished, self._filling = self._filling, set()
        for path in unfinished:  # fills cut short: no record will name them
            unlink_quietly(path)
        self.ready.set()  # a scrub waiting for it goes
        if self._reconciler is not None:
            self._reconciler.join()  # it stops at its next batch
        if self._scrubber is not None:
            self._scrubber.close()
        if self._verifier is not None:
            self._to_verify.put(None)
            self._verifier.join(5)
        self.index.close()
        # Not after a reconciliation left unfinished, nor after the disk refused a write (the
        # index may miss records): the next start reconciles, as after a crash.
        if not self._reconciling and self._write_error is None and not self.index.failed:
            try:
                with self._lock:
                    account = Account(self._data_bytes, self._complete_files,
                                      self.admission.describe(), self._trusted)
                leave_clean_stop(self.layout, account, self.index.present)
            except OSError as exc:  # the next start reconciles, as after a crash
                log.warning("cache %s: the record of this stop could not be written (%s)",
                            self.layout.root, _describe(exc))
        self.layout.unlock()

    def _measure_directories_locked(self) -> None:
        self._fixed_bytes = self.layout.fixed_bytes()
        self._fan_bytes = self.layout.fan_dir_bytes()
        self._fan_total = sum(self._fan_bytes.values())
        self._measure_index_locked(force=True)

    # -- figures ---------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes on disk now, counted against the capacity."""
        with self._lock:
            return self._used_locked()

    def _used_locked(self) -> int:
        return (self._data_bytes + self._index_bytes + self._fixed_bytes
                + self._fan_total)

    @property
    def complete_files(self) -> int:
        return self._complete_files

    @property
    def admitting(self) -> bool:
        """False once the budget is used or the disk refused a write, and while the cache is
        reconciled with its index (its account is not known)."""
        return not self._full and not self._reconciling \
            and time.monotonic() >= self._admission_paused_until

    @property
    def full(self) -> bool:
        """Admission stopped because the budget is used."""
        return self._full

    @property
    def reconciling(self) -> bool:
        return self._reconciling

    def scrub_figures(self) -> dict:
        """How far the background verification is: files and bytes verified, whether it runs,
        whether every file's record is trusted now."""
        scrubber = self._scrubber
        return {"files": scrubber.files if scrubber else 0,
                "bytes": scrubber.bytes if scrubber else 0,
                "running": bool(scrubber and scrubber.running), "trusted": self._trusted}

    @property
    def write_error(self) -> str | None:
        return self._write_error

    # -- reads -----------------------------------------------------------------------------

    def lookup(self, key: bytes) -> FileRecord | None:
        return self.index.get_file(key)

    @staticmethod
    def is_complete(record: FileRecord) -> bool:
        return record.stored_chunks >= chunk_count(record.attr.size)

    def whole(self, key: bytes, version: Version) -> FileRecord | None:
        """The record of ``key`` when the cache holds this version of it whole."""
        record = self.index.get_file(key)
        if record is not None and record.version == version and self.is_complete(record):
            return record
        return None

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
            return self._load(data_key(key, record.version), number, chunk,
                              whole=chunk_count(record.attr.size) == 1)
        except CacheCorrupt as exc:
            self._corrupt_chunk(key, record, number, str(exc))
            raise

    def local_file(self, key: bytes, record: FileRecord) -> int | None:
        """A read-only descriptor of the whole cached file, its bytes known to match its
        checksums (see the module's docstring); None when the file is not whole, is being
        verified in the background, or failed (then it is dropped and counted, and the caller
        refetches it).  The caller closes the descriptor."""
        if not self.is_complete(record):
            return None
        try:
            fd = self.layout.open_data(data_key(key, record.version))
        except OSError as exc:
            self._corrupt_file(key, record, f"its file cannot be opened ({exc.strerror})")
            return None
        try:
            st = os.fstat(fd)
            if self._trusts(key, record, st):
                return fd
            if record.attr.size > INLINE_VERIFY_BYTES:
                self._verify_later(key, record)
            elif self._verify(key, record, fd, st) is not None:
                return fd
        except OSError as exc:
            self._corrupt_file(key, record, f"reading it failed ({exc.strerror})")
        os.close(fd)
        return None

    def checked_file(self, key: bytes, version: Version
                     ) -> tuple[int, tuple[int, int, int]] | None:
        """(a read-only descriptor, its ``checked_as``) of the whole cached copy of
        ``version`` of a file of one chunk, found by its check mark (mark.py) without asking
        the index, when the store trusts it; None whenever the mark cannot tell (then ask the
        index: :meth:`local_file`).  The caller closes the descriptor."""
        if not 0 < version.size <= CHUNK_BYTES or not self._marks_alone \
                or not (self._trusted or _key_hash(key) in self._verified):
            return None
        present = self.index.present
        if present is not None and key not in present:  # never stored: no open to fail
            return None
        try:
            fd = self.layout.open_data(data_key(key, version))
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if marked_as(fd, st, version):
                return fd, _checked_as(st)
        except OSError:
            pass
        os.close(fd)
        return None

    def still_held(self, key: bytes, attr: Attr, checked_as: tuple[int, int, int]) -> bool:
        """Whether a cached file a caller keeps registered with the kernel across opens may
        still be handed over as it was, without asking the index: version ``attr``'s data
        file is untouched since it was checked (``checked_as``).  Whatever drops
        its record removes that file or tells the holder (``on_dropped``) first."""
        try:
            st = os.stat(self.layout.data_path(data_key(key, attr.version)))
        except OSError:
            return False
        return self._trusts_as(key, attr.size, checked_as, st)

    def _trusts(self, key: bytes, record: FileRecord, st: os.stat_result) -> bool:
        return self._trusts_as(key, record.attr.size, record.checked_as, st)

    def _trusts_as(self, key: bytes, size: int, checked_as: tuple[int, int, int],
                   st: os.stat_result) -> bool:
        """The data file ``st`` is the one checked (``checked_as``), whole, and trusted."""
        return st.st_size == size and _checked_as(st) == checked_as \
            and (self._trusted or _key_hash(key) in self._verified)

    def _verify(self, key: bytes, record: FileRecord, fd: int, st: os.stat_result
                ) -> int | None:
        """Check every chunk of the open data file: the bytes read, once it is marked
        checked; None when it failed (then it is dropped)."""
        if st.st_size != record.attr.size:
            self._corrupt_file(key, record, f"it holds {st.st_size} bytes instead of "
                                            f"{record.attr.size}")
            return None
        for number in range(chunk_count(record.attr.size)):
            chunk = self.chunk_record(key, record, number)
            offset, length = chunk_span(record.attr.size, number)
            data = os.pread(fd, length, offset) if chunk is not None else b""
            if chunk is None or len(data) != chunk.length or _checksum(data) != chunk.checksum:
                self._corrupt_chunk(key, record, number, "its checksum does not match")
                return None
        if chunk_count(record.attr.size) == 1 and not marked_as(fd, st, record.version):
            # A copy an older cachefs wrote: marked now (the scrub goes over every file
            # after each start), so that its next opens need no index query.
            mark_checked(fd, record.version, st)
            st = os.fstat(fd)
        self._mark_checked(key, record, st)
        return record.attr.size

    def _mark_checked(self, key: bytes, record: FileRecord, st: os.stat_result) -> None:
        """Its bytes were found to match: record the data file as it is now, unless the
        record was dropped or replaced meanwhile."""
        checked = _checked_as(st)
        if checked != record.checked_as:
            with self._lock:
                if self.index.get_file(key) != record:
                    return
                self.index.put_file(key, record._replace(checked_as=checked))
        if not self._trusted:
            self._verified.add(_key_hash(key))

    def file_records(self, batch: int = 4096) -> Iterator[tuple[bytes, FileRecord]]:
        """(path, record) of every file the index holds, whole or in part, as committed when
        asked: for passes over every cached file (the scrub, the pruner).  The index is read
        ``batch`` records at a time, so a pass holds neither the index nor its records."""
        self.index.flush()
        for records in self.index.batches(batch):
            for key, raw in records:
                path, number = split_key(key)
                if number is None:  # (a chunk's record goes with its file's)
                    yield path, self.index.file_record(raw)

    def scrub(self, key: bytes, record: FileRecord) -> int | None:
        """Verify one cached file for the scrub (scrub.py): the bytes read (0 when it needs no
        reading, being verified in this process already), None when it is not whole or is
        being verified already."""
        if not self.is_complete(record) or key in self._verifying:
            return None
        if not self._trusted and _key_hash(key) in self._verified:
            return 0
        current = self.lookup(key)
        if current != record:
            return None  # changed or dropped since the scrub read it
        try:
            fd = self.layout.open_data(data_key(key, record.version))
        except OSError as exc:
            self._corrupt_file(key, record, f"its file cannot be opened ({exc.strerror})")
            return 0
        try:
            read = self._verify(key, record, fd, os.fstat(fd)) or 0
            # Read for the scrub alone: its pages need not push anything else out.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return read
        except OSError as exc:
            self._corrupt_file(key, record, f"reading it failed ({exc.strerror})")
            return 0
        finally:
            os.close(fd)

    def _verify_later(self, key: bytes, record: FileRecord) -> None:
        with self._lock:
            if key in self._verifying:
                return
            self._verifying.add(key)
            if self._verifier is None:
                self._verifier = threading.Thread(target=self._verify_loop, name="verify",
                                                  daemon=True)
                self._verifier.start()
        self._to_verify.put((key, record))

    def _verify_loop(self) -> None:
        while (job := self._to_verify.get()) is not None:
            key, record = job
            try:
                fd = self.layout.open_data(data_key(key, record.version))
                try:
                    self._verify(key, record, fd, os.fstat(fd))
                finally:
                    os.close(fd)
            except OSError as exc:
                self._corrupt_file(key, record, f"reading it failed ({exc.strerror})")
            finally:
                with self._lock:
                    self._verifying.discard(key)

    def _corrupt_chunk(self, key: bytes, record: FileRecord, number: int, why: str) -> None:
        log.warning("cached chunk %d of %s dropped: %s; refetching from the remote",
                    number, os.fsdecode(key), why)
        self._on_integrity_failure()
        self._drop_chunk(key, record, number)

    def _corrupt_file(self, key: bytes, record: FileRecord, why: str) -> None:
        log.warning("cached file %s dropped: %s; refetching from the remote",
                    os.fsdecode(key), why)
        self._on_integrity_failure()
        self.drop_version(key, record.version)

    def _load(self, dkey: bytes, number: int, chunk: ChunkRecord, *, whole: bool) -> bytes:
        try:
            fd = self.layout.open_data(dkey)
        except OSError as exc:
            raise CacheCorrupt(f"its file cannot be opened ({exc.strerror})") from None
        try:
            # A file of one chunk: one byte more than recorded tells a file that grew.
            offset = number * CHUNK_BYTES
            data = os.pread(fd, chunk.length + whole, offset)
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
        need = self._reserve(key, attr, len(data))
        if not need:
            return False
        try:
            stored = self._write_chunk(key, attr, number, data)
            self._wrote()
            return stored
        except (OSError, sqlite3.Error) as exc:  # the index lives on the same disk
            self._pause_admission(exc)
            return False
        finally:
            self._unreserve(need)

    def fill(self, key: bytes, attr: Attr, copy: Callable[[int], None]) -> bool:
        """Store the whole file at ``key`` (version ``attr``), its bytes written by
        ``copy(fd)`` into a new file: the kernel's copy of the remote's own file (sendfile),
        no byte of it through Python.  The checksums are then computed from the written
        file, and only then is it indexed, so a fill that fails or is cut short (a crash)
        leaves nothing indexed.  The first fill of a file writes its data file in place
        (:meth:`_new_fill`); any other writes a temporary file renamed into place.

        Returns False, storing nothing, when the file is not eligible, does not fit or the
        disk refuses writes (admission pauses).  What ``copy`` raises otherwise (the remote
        changed, failed or timed out) is raised after the new file is discarded.
        """
        need = self._reserve(key, attr, attr.size)
        if not need:
            return False
        try:
            try:
                new = self._new_fill(key, attr)
            except OSError as exc:
                self._pause_admission(exc)
                return False
            if new is None:  # the store is closing
                return False
            try:  # the remote's errors, and a copy of another length, go to the caller
                checksums, written = copy_and_hash(new.fd, attr.version, copy)
            except CacheUnavailable as exc:  # the copy met the cache disk's refusal
                self._discard(new)
                self._pause_admission(exc.__cause__ or OSError(errno.EIO, str(exc)))
                return False
            except BaseException:
                self._discard(new)
                raise
            finally:
                os.close(new.fd)
            return self._install_fill(key, attr, new, checksums, allocated_bytes(written),
                                      written)
        finally:
            self._unreserve(need)

    def _new_fill(self, key: bytes, attr: Attr) -> NewFile | None:
        """The file a fill writes: the data file itself when nothing of this file is
        indexed and no file has its name (a first fill, nearly every one), claimed in
        ``_filling`` while it is written; otherwise a temporary file.  None when the store
        is closing."""
        dkey = data_key(key, attr.version)
        if self.index.get_file(key) is not None:  # another version, or chunks: replaced
            return self.layout.create_tmp(dkey)
        final = self.layout.data_path(dkey)
        with self._lock:
            if self._closing:
                return None
            claimed = final not in self._filling and not self._chunk_writes[final]
            if claimed:
                self._filling.add(final)
        if not claimed:  # chunks are being written into it (or, never, another fill)
            return self.layout.create_tmp(dkey)
        try:
            new = self.layout.create_in_place(dkey)
        except BaseException:
            self._unclaim(final)
            raise
        if new is None:  # an orphan of a crash, say: replaced by a rename as ever
            self._unclaim(final)
            return self.layout.create_tmp(dkey)
        with self._lock:
            kept = new.final in self._filling
        if not kept:  # close() took the path (finding no file yet): ours goes
            os.close(new.fd)
            unlink_quietly(new.final)
            return None
        return new

    def _unclaim(self, final: str) -> bool:
        """Take a path out of ``_filling``: whether it was still there (the caller sees to
        its file then; close() took it otherwise)."""
        with self._lock:
            if final not in self._filling:
                return False
            self._filling.discard(final)
            return True

    def _discard(self, new: NewFile) -> None:
        """Remove a fill's file that will not be indexed (one written in place only while
        it is still this fill's)."""
        if not new.in_place or self._unclaim(new.final):
            self.layout.discard(new)

    def _install_fill(self, key: bytes, attr: Attr, new: NewFile, checksums: Sequence[int],
                      allocated: int, written: os.stat_result | None = None) -> bool:
        """:meth:`_install_whole`; False, the new file discarded and admission paused, when
        the cache disk or the index refuses it."""
        try:
            return self._install_whole(key, attr, new, checksums, allocated, written)
        except (OSError, sqlite3.Error) as exc:
            self._discard(new)
            self._pause_admission(exc)
            return False

    def _install_whole(self, key: bytes, attr: Attr, new: NewFile, checksums: Sequence[int],
                       allocated: int, written: os.stat_result | None = None) -> bool:
        """Put a filled file in place and index it whole, replacing any other version or
        partial fill of it; True when the file is now cached.  A file written in place is
        indexed as it is (``written``: its stat once written); a temporary file is renamed
        into place, the rename and the stats outside the lock: fills of other files go on
        meanwhile (one fill per file version at a time is the caller's to see to)."""
        if new.in_place:
            return self._index_in_place(key, attr, new, checksums, allocated, written)
        replaced = None
        with self._lock:
            record = self.index.get_file(key)
            if record is not None and record.version == attr.version \
                    and self.is_complete(record):
                self.layout.discard(new)  # another fill was first
                return True
            if record is not None:  # another version, or chunks of this one: replaced whole
                self._drop_locked(key, record)
                if record.version != attr.version:
                    replaced = record
        self.layout.install(new)
        # The bytes were hashed as they lie on the disk: checked for the first hand-over.
        self._index_filled(key, attr, new, checksums, allocated, os.stat(new.final))
        if replaced is not None:
            self.on_dropped(key, replaced.version)
        return True

    def _index_in_place(self, key: bytes, attr: Attr, new: NewFile, checksums: Sequence[int],
                        allocated: int, written: os.stat_result) -> bool:
        """Index a file a fill wrote at its own name, unless the store closed meanwhile
        (close() removed the file) or a record of the file came meanwhile: another version,
        stored by a reader the daemon serves after the remote changed (nothing else writes
        at a name claimed), which is kept."""
        fan_bytes = self._fan_bytes_after_a_write(new.fan)
        with self._lock:
            if new.final not in self._filling:
                return False
            # The claim goes once indexed: what raises before leaves the file to _discard.
            record = self.index.get_file(key)
            if record is None:
                self._index_filled_locked(key, attr, new, checksums, allocated, written,
                                          fan_bytes)
            self._filling.discard(new.final)
        if record is None:
            self._wrote()
            return True
        unlink_quietly(new.final)  # no record names it
        return False

    def _index_filled(self, key: bytes, attr: Attr, new: NewFile, checksums: Sequence[int],
                      allocated: int, st: os.stat_result) -> None:
        fan_bytes = self._fan_bytes_after_a_write(new.fan)
        with self._lock:
            self._index_filled_locked(key, attr, new, checksums, allocated, st, fan_bytes)
        self._wrote()

    def _index_filled_locked(self, key: bytes, attr: Attr, new: NewFile,
                             checksums: Sequence[int], allocated: int, st: os.stat_result,
                             fan_bytes: int | None) -> None:
        """Record a whole file in place (its data file's stat ``st``; its fan-out
        directory's bytes, when measured): hashed as it lies on the disk, it is checked for
        its first hand-over."""
        single = len(checksums) == 1
        if not single:
            for number, checksum in enumerate(checksums):
                self.index.put_chunk(chunk_key(key, number),
                                     ChunkRecord(checksum, chunk_span(attr.size, number)[1]))
        self.index.put_file(key, FileRecord(attr, len(checksums),
                                            checksums[0] if single else 0, _checked_as(st)))
        self._complete_files += 1
        self._data_bytes += allocated
        if not self._trusted:
            self._verified.add(_key_hash(key))
        if fan_bytes is not None:
            self._set_fan_bytes_locked(new.fan, fan_bytes)
        self._measure_index_locked()

    # -- copies made ahead of their fetch (prefetch/readahead.py) -----------------------------

    def install_ahead(self, key: bytes, attr: Attr, checksums: Sequence[int],
                      allocated: int, fd: int) -> bool:
        """Index the whole copy of ``attr``'s version of ``key`` that the fill-ahead wrote,
        hashed and marked, into the unnamed file ``fd`` (O_TMPFILE): linked in at its own
        name, then indexed as a fill written in place is.  False when the file is not
        admitted or does not fit, anything of it is indexed already (the copy would replace
        its data file), or a fill or a chunk write of it is under way (its name is theirs).
        The caller closes ``fd`` either way, and fetches the file as ever after False."""
        final = self.layout.data_path(data_key(key, attr.version))
        need = self._reserve(key, attr, attr.size)
        if not need:
            return False
        try:
            with self._lock:
                claimed = not self._closing and final not in self._filling \
                    and not self._chunk_writes[final] and self.index.get_file(key) is None
                if claimed:
                    self._filling.add(final)
            if not claimed:
                return False
            new = NewFile(-1, final, final)  # once linked, as a fill written in place
            try:
                try:
                    self.layout.link_in(fd, final)
                except FileExistsError:  # a file no record names (a crash's): fetched
                    self._unclaim(final)
                    return False
                return self._index_in_place(key, attr, new, checksums, allocated,
                                            os.fstat(fd))
            except (OSError, sqlite3.Error) as exc:
                self._discard(new)
                self._pause_admission(exc)
                return False
        finally:
            self._unreserve(need)

    # -- fills written by another process (remote/fillprocess.py) ----------------------------

    def place_fill(self, key: bytes, attr: Attr, tag: str) -> FillPlace | None:
        """Room held for a fill of the file at ``key`` (version ``attr``) that another
        process copies and hashes into a file under tmp/; None, holding nothing, when the
        file is not admitted or does not fit.  Then :meth:`install_placed` or
        :meth:`abandon_fill`, once."""
        need = self._reserve(key, attr, attr.size)
        if not need:
            return None
        final = self.layout.data_path(data_key(key, attr.version))
        return FillPlace(need, self.layout.tmp_path(final, tag), final)

    def install_placed(self, key: bytes, attr: Attr, place: FillPlace, checksums: Sequence[int],
                       allocated: int) -> bool:
        """Rename a fill another process wrote and hashed (its checksums) into place and
        index it, as :meth:`fill` does its own; True when the file is now cached."""
        try:
            return self._install_fill(key, attr, NewFile(-1, place.tmp, place.final), checksums,
                                      allocated)
        finally:
            self._unreserve(place.need)

    def abandon_fill(self, place: FillPlace, disk_error: OSError | None = None) -> None:
        """A fill placed that did not get in: its temporary file removed, its room given back,
        and admission paused when the cache disk refused it."""
        self.layout.discard(NewFile(-1, place.tmp, place.final))
        if disk_error is not None:
            self._pause_admission(disk_error)
        self._unreserve(place.need)

    def _set_fan_bytes_locked(self, fan: str, nbytes: int) -> None:
        self._fan_total += nbytes - self._fan_bytes.get(fan, 0)
        self._fan_bytes[fan] = nbytes

    def _fan_bytes_after_a_write(self, fan: str) -> int | None:
        """The fan-out directory's bytes, measured after every FAN_MEASURE_EVERY-th file
        written into it (None between): a directory grows by a block every hundred names or
        so, which FILL_HEADROOM_BYTES covers meanwhile, and a stat per fill is not free."""
        writes = self._fan_writes.get(fan, 0)
        self._fan_writes[fan] = writes + 1
        if writes % FAN_MEASURE_EVERY and fan in self._fan_bytes:
            return None
        return self.layout.fan_bytes(fan)

    def _reserve(self, key: bytes, attr: Attr, size: int) -> int:
        """Hold room for ``size`` more bytes of the file at ``key``: the bytes held (0 when
        the file is not admitted, not indexable, or does not fit; nothing is held then)."""
        if not self.admitting or not self.admission.eligible(os.fsdecode(key)) \
                or not _indexable(attr):
            return 0
        need = -(-size // BLOCK_BYTES) * BLOCK_BYTES + FILL_HEADROOM_BYTES
        with self._lock:
            room = self.capacity_bytes - self._used_locked() - INDEX_HEADROOM_BYTES
            fits = need <= room - self._reserved_bytes
            if fits:
                self._reserved_bytes += need
            # Full once the room left is small.  A file larger than a room that is not (a
            # shard of 100 GiB beside the images) is left out alone, and the files after it
            # still come in.
            elif room < self.capacity_bytes * FULL_ROOM_SHARE and not self._full:
                self._full = True
                log.info("cache is full (%d of %d bytes): admission stopped; "
                         "nothing is evicted", self._used_locked(), self.capacity_bytes)
        if not fits:
            self.on_no_room()
        return need if fits else 0

    def _unreserve(self, need: int) -> None:
        with self._lock:
            self._reserved_bytes -= need

    def _wrote(self) -> None:
        """A write went through: once a pause after a write error has run out, it is over.
        (A write already under way when another failed does not end the pause.)"""
        if self._write_error is not None and time.monotonic() >= self._admission_paused_until:
            self.clear_write_error()

    def _write_chunk(self, key: bytes, attr: Attr, number: int, data: bytes) -> bool:
        checksum = _checksum(data)
        single = chunk_count(attr.size) == 1
        dkey = data_key(key, attr.version)
        # Never beside a fill writing the same file in place, nor it beside this (a whole
        # file's copy is renamed over the name, a larger file's chunks written into it).
        final = self.layout.data_path(dkey)
        with self._lock:
            free = not self._closing and final not in self._filling
            if free:
                self._chunk_writes[final] += 1
        if not free:
            return False
        try:
            if single:
                allocated = self.layout.write_whole(dkey, data, attr.version)
            else:
                allocated = self.layout.write_at(dkey, number * CHUNK_BYTES, data)
        finally:
            with self._lock:
                self._chunk_writes[final] -= 1
                if not self._chunk_writes[final]:
                    del self._chunk_writes[final]
        fan, fan_bytes = self.layout.fan_dir_bytes_of(dkey)
        replaced = None
        with self._lock:
            record = self.index.get_file(key)
            if record is not None and record.attr.version != attr.version:
                self._drop_locked(key, record)
                replaced, record = record, None
            if record is None:
                record = FileRecord(attr, 0, 0)
            already = self.chunk_record(key, record, number) is not None
            if not single:
                self.index.put_chunk(chunk_key(key, number), ChunkRecord(checksum, len(data)))
            if not already:
                record = record._replace(stored_chunks=record.stored_chunks + 1)
                if self.is_complete(record):
                    self._complete_files += 1
            if not already:  # (a chunk written again took the blocks it had)
                self._data_bytes += allocated
            record = record._replace(first_checksum=checksum if single else 0)
            if self.is_complete(record):
                # Every chunk was hashed on its way to the disk, and written before this: the
                # file as it is now is checked, for its first hand-over.
                record = record._replace(
                    checked_as=_checked_as(os.stat(self.layout.data_path(dkey))))
                if not self._trusted:
                    self._verified.add(_key_hash(key))
            self.index.put_file(key, record)
            self._set_fan_bytes_locked(fan, fan_bytes)
            self._measure_index_locked()
        if replaced is not None:
            self.on_dropped(key, replaced.version)
        return True

    def _measure_index_locked(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._index_measured_at >= INDEX_MEASURE_SECONDS:
            self._index_measured_at = now
            self._index_bytes = self.layout.index_bytes()

    def _pause_admission(self, exc: OSError | sqlite3.Error) -> None:
        self.on_write_error()
        if isinstance(exc, OSError):
            message = _describe(exc)
        else:
            # SQLite says only "disk I/O error" when the index's commit is the first write
            # to meet a disk remounted read-only: a write of our own names the cause.
            cause = self.layout.probe_write()
            message = f"index: {exc}" if cause is None else f"{_describe(cause)} (index: {exc})"
        with self._lock:  # concurrent fills fail together: say so once
            first = self._write_error is None
            if first:  # the first refusal is the cause; later ones follow from it
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
        """Forget the file at ``key`` (it changed, or it is bad).

        Never raises for a disk problem: a disk that cannot forget is a disk that
        refuses writes (admission pauses); readers go to the remote regardless.
        """
        record = None
        try:
            with self._lock:
                record = self.index.get_file(key)
                if record is not None:
                    self._drop_locked(key, record)
                    self._measure_index_locked()
        except (OSError, sqlite3.Error) as exc:
            self._pause_admission(exc)
        if record is not None:
            self.on_dropped(key, record.version)

    def drop_version(self, key: bytes, version: Version) -> None:
        """Forget the file at ``key`` if it is still that version."""
        record = self.lookup(key)
        if record is not None and record.version == version:
            self.drop(key)

    def _drop_chunk(self, key: bytes, record: FileRecord, number: int) -> None:
        """Forget one bad chunk; the rest of a large file stays cached.  The chunk's blocks are
        freed (a hole punched), so that fetching it again, which counts the blocks it writes,
        does not count them twice.  Where the file system cannot punch a hole, the whole
        file is dropped instead."""
        if chunk_count(record.attr.size) == 1:
            self.drop_version(key, record.version)
            return
        whole = False
        try:
            with self._lock:
                current = self.index.get_file(key)
                ckey = chunk_key(key, number)
                chunk = self.index.get_chunk(ckey)
                if current is None or current.version != record.version or chunk is None:
                    return  # dropped or replaced meanwhile
                try:
                    # Under the lock: the chunk is not fetched again before its hole is made.
                    freed = self.layout.punch_out(data_key(key, record.version),
                                                  number * CHUNK_BYTES, chunk.length)
                except OSError as exc:
                    log.info("cannot free chunk %d of %s (%s): dropping the file",
                             number, os.fsdecode(key), exc.strerror)
                    whole = True
                else:
                    if self.is_complete(current):
                        self._complete_files -= 1
                    self._verified.discard(_key_hash(key))
                    self.index.delete(ckey)
                    self.index.put_file(key, current._replace(
                        stored_chunks=current.stored_chunks - 1))
                    self._data_bytes -= freed
                    self._full = False
        except (OSError, sqlite3.Error) as exc:
            self._pause_admission(exc)
        if whole:
            self.drop_version(key, record.version)
            return
        # Its data file stays (the other chunks are good): a holder must let it go.
        self.on_dropped(key, record.version)

    def _drop_locked(self, key: bytes, record: FileRecord) -> None:
        if self.is_complete(record):
            self._complete_files -= 1
        self._verified.discard(_key_hash(key))
        count = chunk_count(record.attr.size)
        if count > 1:
            for number in range(count):
                ckey = chunk_key(key, number)
                if self.index.get_chunk(ckey) is not None:
                    self.index.delete(ckey)
        freed = self.layout.remove_data(data_key(key, record.version))
        # At least what its fill put on the account: a data file removed or cut short behind
        # the daemon's back would otherwise stay on it for good.
        accounted = _allocation_of(record)
        self._data_bytes -= accounted if freed is None else max(freed, accounted)
        self.index.delete(key)
        # Removing data may bring the store back under budget for later fills.
        self._full = False

    # -- consistency -----------------------------------------------------------------------

    def check(self, *, fix: bool, verify_data: bool) -> CheckReport:
        """Compare the index with the files on disk (reconcile.py); with ``fix``, repair
        what differs.  For tests and ``cachefs verify``; not safe beside writers."""
        report, present, _kept = reconcile(self, fix=fix, verify_data=verify_data)
        if fix:
            self.index.present = present
            with self._lock:
                self._data_bytes = report.data_bytes
                self._complete_files = report.complete_files
                self._measure_directories_locked()
        return report

    def chunk_intact(self, key: bytes, record: FileRecord, number: int) -> bool:
        chunk = self.chunk_record(key, record, number)
        if chunk is None:
            return False
        try:
            self._load(data_key(key, record.version), number, chunk,
                       whole=chunk_count(record.attr.size) == 1)
        except CacheCorrupt:
            return False
        return True

    def forget_record(self, key: bytes, numbers: list[int], version: Version, *,
                      multi_chunk: bool) -> int:
        """Remove a record found wrong or unwanted by the reconciliation, and its data file;
        the bytes that file took."""
        if multi_chunk:
            for number in numbers:
                self.index.delete(chunk_key(key, number))
        freed = self.layout.remove_data(data_key(key, version))
        self.index.delete(key)
        return freed or 0  # the reconciliation counts what is on the disk

    def exceeds_capacity(self, data_bytes: int) -> bool:
        """Whether data files of ``data_bytes``, with the rest, do not fit the budget (it
        shrank since they were written).  Not counting the room a full cache keeps for its
        index to grow into: the index grew into it, as it may (trimming, when it is over,
        makes that room again)."""
        with self._lock:
            others = self._index_bytes + self._fixed_bytes + self._fan_total
        return data_bytes + others > self.capacity_bytes

    def _trim_to_capacity(self, keys: list[bytes]) -> int:
        """Drop files until the store fits its capacity (it shrank since the last run).

        The files with the highest admission score go first, so the cache keeps the
        files a smaller fraction would have admitted.
        """
        dropped = 0
        for key in sorted(keys, key=lambda k: self.admission.score(os.fsdecode(k)),
                          reverse=True):
            if self.used_bytes + INDEX_HEADROOM_BYTES <= self.capacity_bytes:
                break
            self.drop(key)
            dropped += 1
        self.index.flush()
        return dropped
