"""Fetching hinted files before the DataLoader workers ask for them.

The training loop's sampler knows the next batches; the client sends their
paths as hints.  Workers here (``--prefetch-concurrency``, tens, as NFS wants
many requests in flight; no more at once than the cores where the remote's opens
take no round trip, see Remote.opens_fast) fetch each hinted file that is not cached yet: into
the cache when it is admitted, otherwise into the bounded staging area, from
which one reader takes it.  Either way the reader waits for no remote round
trip.  Where the kernel reads the remote itself (remote/handover.py), a kept
file is copied into the cache by the kernel and a file not kept is copied by
the kernel into a memory file, which is staged (on the worker's thread, so the
reads in flight stay bounded by the workers): the bytes never pass through the
daemon, and a reader arriving while a file is being copied is handed the
copy's open remote file at once rather than waiting for it.

Hints are advisory and come from any local user, so each is checked
(paths.py), the queue is bounded, a hint is counted exactly once by what became
of it (accepted, cached, invalid, dropped), and a hint the reader has already
passed is dropped rather than fetched late.

A DataLoader worker asking for its whole batch at once (the fast path) does not pass the
hints of its files still queued: it waits for each to be taken, in the order the hints came,
and shares that fetch (``Prefetcher._wait_for_turn``).

Lock order: ``Prefetcher._cond`` before ``StagingArea._cond``; neither is held across I/O.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from cachefs import limits, remotewait
from cachefs.attr import Attr, Version
from cachefs.errors import CachefsError, NotInTree, RemoteChanged
from cachefs.metrics import Metrics
from cachefs.prefetch.paths import Caller, normalize, resolve, searchable_directory_of
from cachefs.prefetch.readahead import ReadAhead
from cachefs.prefetch.staging import (
    MAX_READERS,
    StagingArea,
    memory_file,
    new_memory_file,
    seal,
)
from cachefs.remote.attrcache import AttrCache, relpath_key
from cachefs.remote.fetcher import Fetcher
from cachefs.remote.handover import RemoteFiles
from cachefs.remote.pagecache import uncached_bytes
from cachefs.remote.remote import Remote
from cachefs.store.admission import ClusterAdmission
from cachefs.store.store import CHUNK_BYTES, CacheStore, chunk_count

log = logging.getLogger(__name__)

MAX_QUEUED_HINTS = 65_536
# A hint not started within this time is stale: its reader has moved on.
HINT_TTL_SECONDS = 300.0
# Prefetched into the cache but not opened within this time: wasted.
UNUSED_TTL_SECONDS = 600.0
# (A path and a time each: some 10 MiB at most; older ones are counted wasted.)
MAX_UNUSED_TRACKED = 65_536
STAGING_WAIT_SECONDS = 30.0
# A file a reader opened this lately, some of whose pages are not cached, has them on their
# way and counted by that reader: staged for a hint that comes now (the next epoch's, while
# this one reads the file), it is not copied beside that reader but staged as its remote
# file.  Copied, its pages were counted twice whenever the copy looked before the reader's
# reads had begun (0 - 6 % over the remote's own count per epoch with hints, in
# `bench.run`).  A reader who takes it later counts the pages it lacks by then.  (A file
# whose pages are all cached is copied: that fetches nothing.)  A reader handed a staged copy
# in memory fetches none of the remote file's pages, and is not counted here: staged as its
# remote file, the next epoch's first batches, hinted as this epoch began, were fetched
# again as that epoch began, all 8 workers' at once (first batch waits of 0.4 - 3.5 s at
# f = 0.2 with hints, on a link of 100 MB/s).  (A path and a time each, for the last
# MAX_RECENT_OPENS opens.)
RECENT_OPEN_SECONDS = 2.0
MAX_RECENT_OPENS = 4096
MAINTENANCE_INTERVAL_SECONDS = 5.0
# Errors that mean the hint named nothing the caller may read.
_INVALID_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ELOOP, errno.ENAMETOOLONG}


@dataclass
class _Hint:
    caller: Caller | None
    received_at: float
    # Reads the hints for this file announce: the end of one epoch and the start of the
    # next can name the same file while the first hint still waits (up to MAX_READERS).
    reads: int = 1


class _HintQueue:
    """Hints waiting for a worker, oldest first, and which of them are in each directory
    (a directory just listed settles its files' hints in one pass).  Guarded by the
    prefetcher's ``_cond``."""

    def __init__(self) -> None:
        self._hints: collections.OrderedDict[str, _Hint] = collections.OrderedDict()
        self._by_directory: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._hints)

    def add(self, relpath: str, hint: _Hint) -> None:
        self._hints[relpath] = hint
        self._by_directory.setdefault(relpath.rpartition("/")[0], set()).add(relpath)

    def get(self, relpath: str) -> _Hint | None:
        return self._hints.get(relpath)

    def pop(self, relpath: str) -> _Hint | None:
        hint = self._hints.pop(relpath, None)
        if hint is not None:
            self._unindex(relpath)
        return hint

    def pop_oldest(self) -> tuple[str, _Hint]:
        relpath, hint = self._hints.popitem(last=False)
        self._unindex(relpath)
        return relpath, hint

    def in_directory(self, directory: str) -> list[tuple[str, _Hint]]:
        return [(relpath, self._hints[relpath])
                for relpath in self._by_directory.get(directory, ())]

    def clear(self) -> None:
        self._hints.clear()
        self._by_directory.clear()

    def _unindex(self, relpath: str) -> None:
        directory = relpath.rpartition("/")[0]
        names = self._by_directory[directory]
        names.discard(relpath)
        if not names:
            del self._by_directory[directory]


@dataclass
class _Active:
    """A prefetch under way.  ``done`` is set when it ends, however it ends."""

    done: threading.Event
    opened: bool = False  # a reader opened the file meanwhile
    extra_hints: int = 0  # hinted again meanwhile: more reads are coming
    staged_for: int = 0   # of those, already counted in the staged copy
    staged_version: Version | None = None
    into_cache: bool = False  # this prefetch stored the file (not found cached already)
    reading: int = -1  # the remote file being read in for staging, shared with a reader
    reading_shared: bool = False  # handed to a reader
    # That read-in is done, or not needed (RECENT_OPEN_SECONDS): the pages are cached, or
    # on their way to a reader who counted them.
    read_in: bool = False
    # A reader came before the read-in opened the file: its own open counts the bytes,
    # which the read-in then shares through the remote file's pages.
    reader_counted: bool = False


@dataclass
class Prefetched:
    """What a reader opening a file finds already fetched for it."""

    staged: int | None = None     # a descriptor of the whole file, now the reader's
    staged_kind: str = "memory"   # what it is: a memory file, or the remote's own file
    into_cache: bool = False      # prefetched into the cache and not read since
    # A prefetch is filling it: a reader who shares the fill's open file is served by it.
    underway: bool = False
    fetched: bool = False         # read in whole by the prefetch, its bytes counted


class Prefetcher:
    """Hint intake and the prefetch workers.

    Thread safety: ``_cond`` guards ``_queue``, ``_active``, ``_unused`` and ``_turns``;
    intake and readers only ever hold it briefly.  A reader waits for its hint's turn on an
    event of its own in ``_turns``, set as the hint leaves the queue.  ``_active`` holds a
    path while one worker acts on it (intake joins a path's later hints to it), so its
    length is the workers at work.
    """

    def __init__(self, *, mountpoint: str, store: CacheStore, fetcher: Fetcher, remote: Remote,
                 attrs: AttrCache, staging: StagingArea, metrics: Metrics,
                 concurrency: int, remote_files: RemoteFiles | None = None) -> None:
        self.mountpoint = mountpoint
        self.store = store
        self.fetcher = fetcher
        self.remote_files = remote_files
        self.remote = remote
        self.attrs = attrs
        self._memory = _MemoryOnly(attrs)  # what hint intake may consult (_known_cached)
        self.staging = staging
        self.metrics = metrics
        self._hints = {r: metrics.hints.labels(r) for r in ("accepted", "cached", "invalid",
                                                             "dropped")}
        self._warm_fetched = metrics.warm_files.labels("fetched")
        self._outcome = {r: metrics.prefetch_files.labels(r) for r in ("used", "wasted",
                                                                       "failed")}
        self._cond = threading.Condition()
        # Readers waiting for their file's hint to leave the queue: path -> set as it does.
        self._turns: dict[str, threading.Event] = {}
        self._queue = _HintQueue()
        # Files being prefetched now, from the moment a worker takes the hint.
        self._active: dict[str, _Active] = {}
        # Prefetched into the cache, not yet opened: path -> when.
        self._unused: collections.OrderedDict[str, float] = collections.OrderedDict()
        # The files readers opened lately: path -> when.
        self._opened: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._closed = False
        self._next_maintenance = 0.0
        self._concurrency = concurrency
        # A cluster's admission follows its members, which only the daemon does: no
        # read-ahead there (its remote's opens take a round trip anyway, as a rule).
        self._reader_ahead = ReadAhead(
            remote.root, store, mountpoint,
            None if isinstance(store.admission, ClusterAdmission) else store.admission,
            taken_in=self._taken_in)
        metrics.bind_gauge(metrics.prefetch_queued_files, lambda: len(self._queue))
        metrics.bind_gauge(metrics.prefetch_inflight_files, lambda: len(self._active))
        metrics.bind_gauge(metrics.staging_bytes, lambda: staging.used_bytes)
        self._workers = [
            threading.Thread(target=self._work, name=f"prefetch-{i}", daemon=True)
            for i in range(concurrency)
        ]
        for worker in self._workers:
            worker.start()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
            for turn in self._turns.values():
                turn.set()
        self._reader_ahead.close()

    def _taken_in(self, size: int) -> None:
        """A copy the reader-ahead made of a warm's file, taken in: a file fetched for a warm,
        its bytes read from the remote."""
        self.remote.count_read(size)
        self._warm_fetched.inc()

    def read_ahead_figures(self) -> dict:
        """The reader-ahead of warms (prefetch/readahead.py): see ReadAhead.figures."""
        return self._reader_ahead.figures()

    # -- intake (control connections) ---------------------------------------------------

    def hint(self, raw: bytes, caller: Caller | None) -> None:
        """Queue one hinted path; never blocks, never raises."""
        try:
            relpath = normalize(raw, self.mountpoint)
        except NotInTree:
            self._hints["invalid"].inc()
            return
        if self._known_cached(relpath, caller):
            self._hints["cached"].inc()
            return
        with self._cond:
            active = self._active.get(relpath)
            if active is not None and not self._closed:
                # Being looked at for an earlier hint: staged for this one as well, and
                # counted as that one ends (accepted, cached, invalid or dropped alike).
                active.extra_hints += 1
                return
            queued = self._queue.get(relpath)
            if queued is not None and queued.reads < MAX_READERS and not self._closed:
                queued.reads += 1  # counted with the others as it ends
                return
            if queued is not None or len(self._queue) >= MAX_QUEUED_HINTS or self._closed:
                result = "dropped"
            else:
                self._queue.add(relpath, _Hint(caller, time.monotonic()))
                if len(self._active) < self._allowed_locked():  # else a worker that ends takes it
                    self._cond.notify()
                return
        self._hints[result].inc()

    # -- readers (FUSE open) ------------------------------------------------------------

    def on_open(self, relpath: str, attr: Attr, timeout: float, *,
                in_turn: bool = False) -> Prefetched:
        """Called as a reader opens a file: settle what the prefetcher did for it.

        ``in_turn``: a reader asking for a whole batch at once (the fast path) waits for a
        hint of its file still queued to be taken, in the order the hints came, and shares
        that fetch (see :meth:`_wait_for_turn`)."""
        if in_turn:
            self._wait_for_turn(relpath, timeout)
        with self._cond:
            # A hint still queued: the reader got there first, fetching it now is useless.
            # Another read hinted stays queued, behind the hints that came meanwhile, for a
            # file not kept (one kept is filled as this reader opens it: its next read hits).
            # Unless an earlier hint of the file served this reader: the one queued is for a
            # later read, and stays.
            queued = None if self._served_earlier_locked(relpath) \
                else self._queue.pop(relpath)
            passed = queued is not None
            if passed:
                self._taken_locked(relpath)
            if passed and queued.reads > 1 and not self._keeps(relpath):
                queued.reads -= 1
                self._queue.add(relpath, queued)
            active = self._active.get(relpath)
            if active is not None:
                active.opened = True
            into_cache = self._unused.pop(relpath, None) is not None
            self._opened.pop(relpath, None)
            self._opened[relpath] = time.monotonic()
            if len(self._opened) > MAX_RECENT_OPENS:
                self._opened.popitem(last=False)
        if passed:
            self._hints["dropped"].inc()
        if into_cache:
            self._outcome["used"].inc()
            return Prefetched(into_cache=True)
        if active is not None and self._hands_over(relpath):
            # The kernel is copying it, or staging it: no waiting (a reader never waits
            # for a copy); the reader is handed the prefetch's open remote file, or its own.
            taken = self._take_staged(relpath, attr)
            return taken if taken.staged is not None else self._share_reading(active)
        # A file whose bytes are on the way: wait for them rather than read them a second
        # time.  (A large file is not waited for as a whole: its chunks are shared with
        # the reader one by one through the fetcher.)  If the prefetch fails or is slow,
        # the reader goes to the remote itself.
        if active is not None and attr.size <= CHUNK_BYTES \
                and self._wait_for_prefetch(active, timeout) \
                and self._cached(relpath_key(relpath), attr):
            # A worker that only refreshed a cached file's attributes made it no more local
            # than it was: that open is a hit.
            return Prefetched(into_cache=active.into_cache)
        return self._take_staged(relpath, attr)

    def _wait_for_turn(self, relpath: str, timeout: float) -> None:
        """Wait until the hint of ``relpath``, if queued, is taken by a worker (or dropped).

        The hints come in the order the training loop reads its batches, and the workers
        take them in that order, so that a remote's link, which serves its reads in the
        order they are asked, brings the batch needed next first.  A reader asking for a
        whole batch at once (8 DataLoader workers at the start of an epoch: 8 batches, a
        thousand files) that fetched its queued files itself jumped that order: its fetches
        shared the link with those of the seven other batches and with the workers', who
        moved on to the batches after them, and the first batches came last.  Hinted first
        epoch, 8 DataLoader workers, 3,000 files of 110 KiB, the EFS-like remote at 100 MB/s
        (`bench.run`, whose ceiling is then 883 samples/s): the 6th to 8th batches came 2.3 -
        3.1 s into a 4.8 s epoch, after the 16 batches behind them, 548 - 577 samples/s at
        f = 1 and 534 - 545 at f = 0.2; waiting, the batches came in order, one every 0.14 s
        (the link's time for one), 738 - 781 and 688 - 787.

        Not where the remote's opens are fast (a local disk): there the workers are as
        few as the cores, and a reader that fetches its file itself takes nothing from the
        others.  Not for a hint of a later read (:meth:`_served_earlier_locked`).  A read
        that was never hinted, of a file hinted for later, waits for that hint's turn all
        the same: the daemon cannot tell it from the read the hint announced.  Bounded by
        ``timeout`` (--remote-timeout: a worker stuck on the remote)."""
        if self.remote.opens_fast:
            return
        with self._cond:
            if self._queue.get(relpath) is None or self._served_earlier_locked(relpath):
                return
            turn = self._turns.get(relpath)
            if turn is None:
                turn = self._turns[relpath] = threading.Event()
        try:
            with remotewait.waiting(remote_call=False):
                turn.wait(timeout)
        finally:
            with self._cond:
                if self._turns.get(relpath) is turn:
                    del self._turns[relpath]

    def _served_earlier_locked(self, relpath: str) -> bool:
        """Whether an earlier hint of the file is being acted on, or was and its file is not
        read yet: the reader's hint is that one, and a hint queued is for a later read (the
        next epoch's, sent 0.2 s into a 4 s epoch), which the reader neither waits for nor
        passes.  (Waiting for it held the first batch of a hinted first epoch at f = 0.2 for
        3.3 s, the whole queue's time.)"""
        return relpath in self._active or relpath in self._unused or relpath in self.staging

    def _taken_locked(self, relpath: str) -> None:
        """The hint of ``relpath`` left the queue: tell the readers waiting for it (only
        them: woken all at every hint taken, 8 connections' threads took turns at the
        interpreter lock some 3,000 times an epoch for nothing)."""
        turn = self._turns.pop(relpath, None)
        if turn is not None:
            turn.set()

    @staticmethod
    def _wait_for_prefetch(active: _Active, timeout: float) -> bool:
        with remotewait.waiting(remote_call=False):
            return active.done.wait(timeout)

    def _share_reading(self, active: _Active) -> Prefetched:
        """For a reader that came before the prefetch staged the file or while it fills it:
        the remote file it is reading in (the reader reads the pages as they arrive;
        counted used as the prefetch ends), or what the reader's own open will find."""
        with self._cond:
            if active.reading >= 0:
                active.reading_shared = True
                return Prefetched(staged=os.dup(active.reading), staged_kind="remote")
            if active.read_in:  # about to be staged, for the hints beyond this reader's
                return Prefetched(fetched=True)
            # Not read in yet (resolving the name, waiting for staging room), or a fill.
            active.reader_counted = True
            return Prefetched(underway=True)

    def _take_staged(self, relpath: str, attr: Attr) -> Prefetched:
        if relpath in self.staging:
            taken = self.staging.take(relpath, attr.version)
            if taken is not None:
                self._outcome["used"].inc()
                if taken.kind == "remote":
                    self.remote_files.count_staged_read(taken.fd, attr)
                else:
                    # Read from memory: none of the remote file's pages are on their way
                    # (RECENT_OPEN_SECONDS), and a hint for its next read copies it in.
                    with self._cond:
                        self._opened.pop(relpath, None)
                return Prefetched(staged=taken.fd, staged_kind=taken.kind)
        return Prefetched()

    def _hands_over(self, relpath: str) -> bool:
        """Whether the kernel reads and copies this file from the remote itself (a file an
        other node owns in a cluster comes through that node instead)."""
        return self.remote_files is not None and self.remote_files.enabled \
            and not self.fetcher.origin.from_peer(relpath)

    # -- warm (synchronous) ---------------------------------------------------------------

    def fetch_now(self, raw: bytes, caller: Caller | None) -> dict:
        """Fetch one file into the cache and say how it went (for ``cachefs warm``)."""
        try:
            relpath, attr = resolve(normalize(raw, self.mountpoint), self.attrs, self.remote,
                                    caller)
        except (OSError, CachefsError) as exc:
            # Every failure is this path's answer: one escaping would close the warm's
            # connection, and with it the warm (a name too long, say, or a remote gone).
            if isinstance(exc, NotInTree) or getattr(exc, "errno", None) in _INVALID_ERRNOS:
                return {"ok": False, "error": f"not a readable file in the tree ({exc})"}
            return {"ok": False, "error": str(exc) or type(exc).__name__}
        key = relpath_key(relpath)
        admission = self.store.admission
        eligible = admission.eligible(relpath)
        # A file outside the fraction is cached only where the cache holds others (a
        # cluster's node): elsewhere, most files of a warm at f < 1, no look in the index.
        if (eligible or admission.holds_others) and self._cached(key, attr):
            if self._reader_ahead.took(relpath):  # copied ahead for this FETCH's warm
                return {"ok": True, "result": "fetched", "bytes": attr.size, "counted": True}
            return {"ok": True, "result": "cached", "bytes": attr.size}
        if not eligible:
            return {"ok": True, "result": "not_admitted", "bytes": 0}
        try:
            self._fetch_into_cache(relpath, key, attr)
        except (OSError, CachefsError) as exc:
            return {"ok": False, "error": str(exc) or type(exc).__name__}
        done = self._cached(key, attr)
        return {"ok": True, "result": "fetched" if done else "cache_full",
                "bytes": attr.size if done else 0}

    def take_read_ahead(self, conn: socket.socket, caller: Caller) -> str | None:
        """Hand a warm's READ-AHEAD connection to the reader-ahead: None once it has it, else
        why not (prefetch/readahead.py)."""
        return self._reader_ahead.take(conn, caller)

    @property
    def read_ahead_streams(self) -> int:
        """How many READ-AHEAD connections a warm opens, each with its share of its list."""
        return self._reader_ahead.streams

    # -- workers ------------------------------------------------------------------------

    def _allowed_locked(self) -> int:
        """How many workers may act on hints at once.  Where the remote's opens take no round
        trip, a fetch is CPU (the kernel's copy, the cache disk, the checksums), and a worker
        more than the cores only takes turns at the interpreter lock.  A local tree as the
        remote, 5,000 files of 64 KiB not kept, each hinted by its reader before it reads
        it, 8 readers, 2 cores (``bench.datapath``, "prefetched"): 2,772 - 3,357 files/s at
        338 - 396 us of daemon CPU per file with 2 workers at once, 1,573 - 1,925 at 644 -
        766 with all 32."""
        if self.remote.opens_fast:
            return min(self._concurrency, limits.CORES)
        return self._concurrency

    def _work(self) -> None:
        while True:
            with self._cond:
                while (not self._queue or len(self._active) >= self._allowed_locked()) \
                        and not self._closed:
                    self._cond.wait(MAINTENANCE_INTERVAL_SECONDS)
                    self._maintain_locked()
                if self._closed:
                    return
                relpath, hint = self._queue.pop_oldest()
                self._taken_locked(relpath)
                stale = time.monotonic() - hint.received_at > HINT_TTL_SECONDS
                active = None if stale else _Active(threading.Event(),
                                                    extra_hints=hint.reads - 1)
                if active is not None:
                    self._active[relpath] = active
                self._maintain_locked()
            if active is None:
                self._hints["dropped"].inc(hint.reads)
                continue
            result = "dropped"
            try:
                result = self._prefetch(relpath, hint.caller)
            except Exception:
                log.exception("prefetch of %s failed unexpectedly", relpath)
            finally:
                with self._cond:
                    self._active.pop(relpath, None)
                    late = active.extra_hints - active.staged_for
                    hints = 1 + active.extra_hints
                self._hints[result].inc(hints)
                if active.staged_version is not None:
                    for _ in range(late):  # hinted again between staging and now
                        self.staging.add_reader(relpath, active.staged_version)
                active.done.set()

    def _prefetch(self, hinted: str, caller: Caller | None) -> str:
        """Act on one hint; what it counts as."""
        # Due or unknown attributes: the directory's listing refreshes this name and its
        # neighbours, whose hints then settle without a round trip each: those queued now
        # right here, those still to come at intake.
        if self.attrs.peek(hinted) is None \
                and searchable_directory_of(hinted, self.attrs, caller) \
                and self.attrs.refresh_directory_of(hinted):
            self._settle_queued_in(hinted.rpartition("/")[0])
        try:
            relpath, attr = resolve(hinted, self.attrs, self.remote, caller)
        except NotInTree:
            return "invalid"
        except (OSError, CachefsError) as exc:
            code = getattr(exc, "errno", None)
            return "invalid" if code in _INVALID_ERRNOS else "dropped"
        key = relpath_key(relpath)
        if self._cached(key, attr):
            return "cached"
        admit = self._keeps(relpath)
        if not admit and self.staging.add_reader(relpath, attr.version):
            return "accepted"  # staged for an earlier hint, not read yet
        if not admit and not self.staging.fits(attr.size):
            return "dropped"  # too large to hold in memory: read it directly
        try:
            if admit:
                self._fetch_into_cache(relpath, key, attr)
                with self._cond:
                    self._active[relpath].into_cache = True
            else:
                self._fetch_into_staging(relpath, attr)
        except (OSError, CachefsError) as exc:
            self._outcome["failed"].inc()
            log.debug("prefetch of %s failed: %s", relpath, exc)
            return "accepted"
        with self._cond:
            active = self._active.get(relpath)
            opened_meanwhile = active is not None and active.opened
            if admit and not opened_meanwhile:
                self._unused[relpath] = time.monotonic()
        if admit and opened_meanwhile:
            self._outcome["used"].inc()  # (a staged file counts as used when taken)
        return "accepted"

    def _settle_queued_in(self, directory: str) -> None:
        """The directory was just listed: settle the queued hints of its files that memory
        now shows cached and fresh, in one pass instead of a worker's turn each."""
        with self._cond:
            queued = self._queue.in_directory(directory)
        settled = [relpath for relpath, hint in queued if self._known_cached(relpath, hint.caller)]
        with self._cond:
            taken = [self._queue.pop(relpath) for relpath in settled]
            for relpath in settled:
                self._taken_locked(relpath)
        self._hints["cached"].inc(sum(hint.reads for hint in taken if hint is not None))

    def _known_cached(self, relpath: str, caller: Caller | None) -> bool:
        """Whether memory alone shows the file whole in the cache and readable by the
        caller: such a hint (every hint of a fully cached epoch) is settled here, on the
        connection's thread, without a worker's hand-offs or any remote round trip.
        Anything memory cannot settle goes to the queue, whose workers decide."""
        try:
            relpath, attr = resolve(relpath, self._memory, self._memory, caller)
            return self._cached(relpath_key(relpath), attr)
        except Exception:  # not in the tree, not in memory, or a broken index: the workers
            return False   # decide, and report what needs reporting

    def _keeps(self, relpath: str) -> bool:
        """Whether the cache takes this file in now (else it is staged)."""
        return self.store.admitting and self.store.admission.eligible(relpath)

    def _cached(self, key: bytes, attr: Attr) -> bool:
        return self.store.whole(key, attr.version) is not None

    def _fetch_into_cache(self, relpath: str, key: bytes, attr: Attr) -> None:
        if self._hands_over(relpath):
            self.remote_files.fill_now(relpath, key, attr)
            return
        record = self.store.lookup(key)
        for number in range(chunk_count(attr.size)):
            if record is not None and record.version == attr.version \
                    and self.store.chunk_record(key, record, number) is not None:
                continue
            self.fetcher.fetch(relpath, key, attr, number, admit=True)

    def _fetch_into_staging(self, relpath: str, attr: Attr) -> None:
        if not self.staging.reserve(attr.size, STAGING_WAIT_SECONDS):
            raise CachefsError("no room in the staging area")
        hands_over = self._hands_over(relpath)
        try:
            if hands_over:
                fd, kind = self._read_in(relpath, attr)
            else:
                fd = memory_file(relpath, self.fetcher.origin.read_file(relpath, attr).data)
                kind = "memory"
        except BaseException:
            self.staging.release(attr.size)
            raise
        with self._cond:
            active = self._active[relpath]
            active.staged_for, active.staged_version = active.extra_hints, attr.version
            # A reader that came while the remote file was read in was handed it, or read
            # it itself (on_open: it does not wait): staged for the hints beyond its own
            # only, else held for nobody until its time to live.
            came_first = hands_over and active.opened
            readers = active.staged_for + (0 if came_first else 1)
        if not readers:
            os.close(fd)
            self.staging.release(attr.size)
            self._outcome["used"].inc()
            return
        self.staging.put(relpath, attr.version, fd, attr.size, reserved=attr.size,
                         readers=readers, kind=kind)

    def _read_in(self, relpath: str, attr: Attr) -> tuple[int, str]:
        """The file to stage, and its kind: a memory file the kernel copied the remote's
        file into ("memory"), the remote file shared meanwhile with a reader who comes
        first (``_share_reading``); or, when a reader opened it lately and its pages are on
        their way to that reader, the remote file itself, not read ("remote").

        A memory file, not the remote file read into its page cache: a passthrough open
        opens its backing file again, which on the remote is a round trip (an NFS OPEN) on
        the reader's time.  Opening a staged file took 2.3 ms on the EFS-like remote
        (whose opens take 2 ms) and reading its 64 KiB 0.7 ms; a memory file 0.15 and
        0.02 ms.  The copy costs the memory of the staged bytes (--staging-size) and a
        copy in the kernel."""
        fd = self.remote_files.open_ahead(relpath, attr)
        with self._cond:
            active = self._active[relpath]
            # Opened since this hint was taken: by the reader it announced, who waited for
            # its turn (or came as it was taken) and reads the file beside this copy, which
            # brings its pages as the workers bring the others', in the order of the hints.
            opened = None if active.opened else self._opened.get(relpath)
        if opened is not None and time.monotonic() - opened < RECENT_OPEN_SECONDS \
                and uncached_bytes(fd, attr.size):
            with self._cond:
                active.read_in = True  # staged as it is (see RECENT_OPEN_SECONDS)
            return fd, "remote"
        with self._cond:
            active.reading = fd
        copy = -1
        try:
            copy = new_memory_file(relpath)
            fetched = self.remote_files.copy_in(fd, attr, copy)
            seal(copy)
        except BaseException as exc:
            with self._cond:
                active.reading = -1
                shared = active.reading_shared
            os.close(fd)
            if copy >= 0:
                os.close(copy)
            if shared and not isinstance(exc, RemoteChanged):
                # The reader it was handed to reads the rest from the remote itself: the
                # file's bytes, which the read-in was to count.
                self.remote_files.count_read(attr.size)
            raise
        with self._cond:
            active.reading, active.read_in = -1, True
            counted = active.reader_counted
        os.close(fd)  # a reader it was handed to has a descriptor of its own
        if not counted:
            self.remote_files.count_read(fetched)
        return copy, "memory"

    def _maintain_locked(self) -> None:
        """Now and then: count prefetches nobody read as wasted."""
        now = time.monotonic()
        if now < self._next_maintenance:
            return
        self._next_maintenance = now + MAINTENANCE_INTERVAL_SECONDS
        cutoff = now - UNUSED_TTL_SECONDS
        wasted = 0
        while self._unused and (len(self._unused) > MAX_UNUSED_TRACKED
                                or next(iter(self._unused.values())) < cutoff):
            self._unused.popitem(last=False)
            wasted += 1
        if wasted:
            self._outcome["wasted"].inc(wasted)
        self.staging.expire()

    # -- figures -------------------------------------------------------------------------

    def figures(self) -> dict:
        return {"queued": len(self._queue), "inflight": len(self._active)}


def hint_lines(paths: list[str]) -> bytes:
    """The wire form of hints, for tools written in Python (tests, warm)."""
    return b"".join(b"HINT " + os.fsencode(p) + b"\n" for p in paths)


class _NotInMemory(Exception):
    pass


class _MemoryOnly:
    """The attribute cache seen through memory only: what resolve() may use on a
    connection's thread, where a round trip to the remote would stall the hints."""

    def __init__(self, attrs: AttrCache) -> None:
        self._attrs = attrs

    def get(self, relpath: str) -> Attr:
        attr = self._attrs.peek(relpath)
        if attr is None:
            raise _NotInMemory(relpath)
        return attr

    def readlink(self, relpath: str) -> str:
        raise _NotInMemory(relpath)  # links are rare: the workers follow them
