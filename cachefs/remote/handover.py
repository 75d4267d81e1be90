"""The remote's own file handed to the kernel for a reader, and copied into the cache by the
kernel: a miss costs the daemon an open, not its bytes.

With FUSE passthrough the kernel takes any file as the backing of an open, the remote's own
(an NFS file) included.  So a miss is answered with a descriptor of the remote file, opened
here and checked to be the version the kernel looked up (bounded by --remote-timeout, like
every call the daemon makes on the remote), and the reader's reads go from the kernel to the
NFS client.  A file the cache keeps is copied into the cache beside the reader, by the
kernel too: ``sendfile`` from the remote file, opened by the fill, so that a page the reader
pulled and a page the copy pulled are fetched from the server once and shared through the
remote file's page cache (one inode, whoever opened it).  The store then computes the
checksums of the copy, checks the version again and indexes it (store.py ``fill``).

Fills run on threads of their own, never on a reader's: a reader never waits for a copy.
With ``--fill-processes`` a reader's fill is copied and hashed by a process of its own
instead (fillprocess.py: the daemon's interpreter lock is then not shared with the copies),
and only renamed into place and indexed here; a prefetch's or a warm's stays on its thread.
There is one fill per file version at a time, and a reader arriving while a file is being
filled is handed the fill's own open file once it is open (one fetch of its pages).
A fill that cannot be queued (too many waiting) is skipped: the file is filled at a later
open.

Thread safety: ``_lock`` guards ``_fills``, each fill's ``fd``, ``_queued``, ``_opening``
and the thread lists (a leaf lock, never held across a call on the remote); ``_done``, a
condition on it, tells waiters that a fill ended.  ``_copy_waits`` is a hint any fill thread
updates without it.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import NamedTuple

from cachefs import limits, remotewait
from cachefs.attr import Attr, Version
from cachefs.errors import CachefsError, RemoteChanged
from cachefs.remote.copy import COPY_PIECE_BYTES, CopyWaits, send_checked
from cachefs.remote.fillprocess import CHANGED, COPIED, DISK, FillProcesses, Outcome
from cachefs.remote.pagecache import uncached_bytes
from cachefs.remote.remote import Remote
from cachefs.store.store import CacheStore, FillPlace

log = logging.getLogger(__name__)

# Fills under way at once, at most.  A fill that waits on the remote (its pages not fetched
# yet) waits outside the interpreter lock: enough to keep a remote's latency covered.
FILL_THREADS = 8
# Threads are added where they help, not as fills come: once more than
# FILL_BACKLOG_PER_THREAD fills per thread are queued while most copies wait on the remote
# (spend longer than WAITING_COPY_SECONDS off the CPU: a copy that waits does so outside
# the interpreter lock, where another thread's copy can wait beside it).  A copy of pages the
# remote's client has cached, or from a disk as fast as a local one, waits on nothing, and
# every thread more only takes turns at the interpreter lock (a futex wake and a context
# switch each).  Against a fast remote (a local tree, 5,000 files of 64 KiB, 8 readers,
# 2 cores): with one thread per fill as they came (eight), the copies waited 350-460 us
# beyond their CPU time (median) for each other, with one 0 us (65 us at the 90th
# percentile).  Whether a copy waits was first told by whether the remote file's last page
# was in the page cache (RWF_NOWAIT), which is not the question: on a fast remote the copy
# starts before the reader has pulled the pages, so nearly every copy counted as waiting
# and eight threads ran, where the copies' own times (a median of 190 us, 12 % over 1 ms,
# with the readers beside them) keep two.  Copies that wait on nothing get threads too once
# the queue fills up (a thread per MAX_QUEUED_FILLS / FILL_THREADS queued): fills that
# cannot keep up with the readers are late rather than skipped.  A queued fill costs a
# descriptor, and its remote file's pages stay cached a little longer.
FILL_BACKLOG_PER_THREAD = 4
# Fills waiting for a thread; past this a file is filled at a later open instead.
MAX_QUEUED_FILLS = 4096
# ... unless the fill holds no descriptor yet (a file handed to the kernel by path, whose fill
# opens it): such a fill waiting costs some 500 bytes, and readers faster than the fills
# (the copies are CPU, and on few cores the readers come first) leave it late rather than
# skipped: a skipped file is a miss again in the next epoch.  With the fill threads no more
# than the cores, 8,000 files of 64 KiB read by 8 readers from a local tree as the remote
# queued over 4,096 fills, and 629 - 1,431 of them were skipped.
MAX_QUEUED_UNOPENED_FILLS = 16384
# A kept miss is handed to the kernel by path, and its fill opens the remote file.  Those
# opens are made by threads of their own, more of them once more than OPENS_PER_OPEN_THREAD
# per thread wait to be made: an open waits a round trip (2 ms on the EFS-like remote) and
# costs next to no CPU, where a copy costs CPU and every fill thread more takes turns at the
# interpreter lock.  With the opens on the fill threads, counted among the copies' waits
# (eight threads, each one fill at a time): a fill 899 - 1,232 files/s at 660 - 975 us of
# daemon CPU per file (EFS-like remote, 2,000 files of 64 KiB, 8 readers); not counted (one
# or two threads), fills fell behind the readers by hundreds of files.
OPEN_THREADS = 16
OPENS_PER_OPEN_THREAD = 2
# A backlog of fills whose copies wait on nothing is worked by as many threads as there are
# cores, at most: each copy is CPU (the kernel's copy, the cache disk's file system, the
# checksums), and a thread more than the cores only takes turns.  On 2 cores and a local tree
# as the remote, eight threads cost 740 - 800 us of daemon CPU per fill and two 560 - 590,
# at 1,500 against 2,300 files/s (8 readers, 6,000 files of 64 KiB).
CPU_BOUND_FILL_THREADS = min(FILL_THREADS, limits.CORES)


class Handed(NamedTuple):
    """A remote file for a reader: the descriptor (the caller's), whether it is a fill's
    under way (its pages being fetched already), whether it can be read (not O_PATH)."""

    fd: int
    shared: bool = False
    readable: bool = True


@dataclass(eq=False, slots=True)
class _Fill:
    """One file version being filled.  ``fd`` is its open remote file (-1 until opened, and
    once done), shared with the readers who arrive meanwhile."""

    relpath: str
    key: bytes
    attr: Attr
    fd: int = -1
    # Its bytes are counted as read from the remote: by the copy, or by a reader with an
    # open file of its own whose pages the copy shares, whichever claimed them first.
    counted: bool = False
    shared: bool = False  # ``fd`` was handed to a reader
    # Where a fill process writes it, and the room held for it.
    place: FillPlace | None = None


class RemoteFiles:
    """Remote files opened for the kernel, and their fills.  ``enabled`` is set once the
    mount knows the kernel accepts backing files and the settings let it read the remote."""

    def __init__(self, remote: Remote, store: CacheStore, *,
                 on_fill=lambda result: None, fill_processes: int = 0) -> None:
        self.enabled = False
        self._remote = remote
        self._store = store
        self._on_fill = on_fill
        # Fills of readers' files go to processes of their own when asked (fillprocess.py).
        self._processes = FillProcesses(fill_processes, self._filled_elsewhere,
                                        remote.timeout_seconds, remote.timed_out) \
            if fill_processes else None
        self._placed = itertools.count(1)
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)  # notified as each fill ends
        self._fills: dict[tuple[bytes, Version], _Fill] = {}
        self._queue: queue.SimpleQueue[_Fill | None] = queue.SimpleQueue()
        self._queued = 0
        self._threads: list[threading.Thread] = []
        # Fills whose remote file is yet to be opened (see OPEN_THREADS).
        self._to_open: queue.SimpleQueue[_Fill | None] = queue.SimpleQueue()
        self._opening = 0
        self._openers: list[threading.Thread] = []
        self._copy_waits = CopyWaits()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            threads, openers = list(self._threads), list(self._openers)
        for _ in threads:
            self._queue.put(None)
        for _ in openers:
            self._to_open.put(None)
        if self._processes is not None:
            self._processes.close()

    # -- for a reader ------------------------------------------------------------------------

    def open_for_reader(self, relpath: str, key: bytes, attr: Attr, *, keep: bool,
                        for_kernel: bool = True, counted: bool = False) -> Handed | None:
        """A descriptor of the remote's file, version ``attr``, for a reader (the caller's to
        close): the kernel (``for_kernel``) or a process handed it over the control socket.
        With ``keep`` the file is also filled into the cache, in the background.  Its bytes
        are counted as read from the remote here, unless ``counted`` (a prefetch read them
        in and counted them) or the reader shares a fill's open file (the fill counts them).

        The kernel opens the file anew for each reader it is handed to (passthrough opens
        a backing file of its own from the one registered).  So for it a file is named by an
        O_PATH descriptor, a path walk and no NFS OPEN of ours: one OPEN on the reader's
        time, the kernel's.  A kept one is then opened for reading for its fill, on a
        thread of its own (see OPEN_THREADS), or on the fill's where the remote's opens are
        fast (Remote.opens_fast): an OPEN of ours here, in series with the
        kernel's, made a kept miss wait for two (on the EFS-like remote a plain first epoch
        at f = 1 ran at 0.62 - 0.65x the remote read directly; with the fill's open off the
        reader's time, 0.82 - 0.86x).  A fill process (--fill-processes) is sent an open
        file: for it the file is opened here, as before.

        None when a fill stored this version since the caller looked in the cache: the
        caller serves the cache's copy."""
        ident = (key, attr.version)
        with self._lock:
            fill = self._fills.get(ident)
            if fill is not None and fill.fd >= 0:
                fill.shared = True
                return Handed(os.dup(fill.fd), shared=True)
        # A fill is stored before it leaves ``_fills``: one not found there has not begun,
        # or has stored the file already (a reader that came as a prefetch's fill ended:
        # a second copy, and its bytes counted twice, 1 - 2 % of a first epoch's files).
        if keep and fill is None and self._store.whole(key, attr.version):
            return None
        if for_kernel and not (keep and self._fills_in_processes(attr.size)):
            fd = self._remote.locate_file(relpath, attr.version)
            if (not keep or self._queue_fill(relpath, key, attr, -1)) and not counted:
                self._remote.count_read(attr.size)
            return Handed(fd, readable=False)
        fd = self._remote.open_file(relpath, attr.version)
        # With a fill (this reader's, or a prefetch's not yet open), the reader's reads and
        # the copy share the pages: whichever of the two claims the bytes first counts them.
        if (not keep or self._queue_fill(relpath, key, attr, fd)) and not counted:
            self._remote.count_read(attr.size)
        return Handed(fd)

    def open_ahead(self, relpath: str, attr: Attr) -> int:
        """A descriptor of the remote's file for a reader to come (the caller's to close),
        to be copied into memory (:meth:`copy_in`) before it is staged."""
        return self._remote.open_file(relpath, attr.version)

    def copy_in(self, fd: int, attr: Attr, into: int) -> int:
        """Copy the remote file ``fd`` (version ``attr``) into the new file ``into`` (a
        memory file, to be staged), in the kernel, on this thread: RemoteChanged if it
        changed meanwhile.  Returns the bytes that were not cached (what the copy fetched).

        Copied here, not left to posix_fadvise(WILLNEED): that readahead is asynchronous,
        so a burst of hints queued the reads of every staged file at once (up to
        --staging-size) ahead of those a reader waited for, which a remote serves in order
        (one link, one NFS connection); and it is advice, which a client whose requests
        queue up drops in part.  Copied, the reads in flight are bounded by the prefetch's
        concurrency.  First epoch at f = 0.2 with hints (the EFS-like remote, 3,000 files,
        2 rounds in turns): 881 - 891 samples/s against 766 - 781 with WILLNEED, the worst
        batch's wait 550 - 570 ms against 550 - 918.

        The bytes are the caller's to count (:meth:`count_read`): a reader may have counted
        them already."""
        fetched = uncached_bytes(fd, attr.size)
        with _cpus_for_copy(attr.size):
            send_checked(fd, into, attr.version, self._remote.call)
        return fetched

    def count_read(self, nbytes: int) -> None:
        """Count bytes read from the remote for the cache or a reader."""
        self._remote.count_read(nbytes)

    def count_staged_read(self, fd: int, attr: Attr) -> None:
        """Count what a reader handed a staged remote file (``fd``) will fetch: the pages
        of it not in the page cache by now."""
        self._remote.count_read(uncached_bytes(fd, attr.size))

    # -- fills -------------------------------------------------------------------------------

    def fill_now(self, relpath: str, key: bytes, attr: Attr) -> None:
        """Fill on this thread (a prefetch, a warm): open the remote file, copy it in.  When
        the file is being filled already, wait for that fill.  Raises what the remote raises;
        whether the file got in, the store says."""
        ident = (key, attr.version)
        with self._lock:
            fill = self._fills.get(ident)
            mine = fill is None
            if mine:
                fill = self._fills[ident] = _Fill(relpath, key, attr)
        if not mine:
            self._wait(fill)
            return
        try:
            # A reader's fill that ended since the caller looked has stored it (see
            # open_for_reader): not copied, nor counted, twice.
            if self._store.whole(key, attr.version):
                return
            fd = self._remote.open_file(relpath, attr.version)
            with self._lock:
                fill.fd = fd
            self._fill(fill)
        finally:
            self._finish(fill)

    def _wait(self, fill: _Fill) -> None:
        ident = (fill.key, fill.attr.version)
        with remotewait.waiting(remote_call=False), self._done:
            self._done.wait_for(lambda: self._fills.get(ident) is not fill,
                                self._remote.timeout_seconds + 1.0)

    def _queue_fill(self, relpath: str, key: bytes, attr: Attr, reader_fd: int) -> bool:
        """A fill of the file a reader opened (``reader_fd``; -1: the reader was handed it
        by path, and the fill opens it), unless one is under way; whether the reader counts
        the bytes (see :meth:`_claim_count_locked`)."""
        ident = (key, attr.version)
        # Stored already: a prefetch's fill ended while the reader opened the file (a fill is
        # stored before it leaves ``_fills``), having counted the bytes the reader now finds
        # in the remote file's pages.
        if self._store.whole(key, attr.version):
            return False
        thread = None
        with self._lock:
            fill = self._fills.get(ident)
            if fill is not None:  # under way
                return self._claim_count_locked(fill)
            if self._closed:
                return True
            # Opened by a thread of its own, unless the remote's opens are fast: then by the
            # fill thread (see FAST_OPEN_SECONDS in remote.py).
            to_open = reader_fd < 0 and not self._remote.opens_fast
            elsewhere = reader_fd >= 0 and self._fills_in_processes(attr.size)
            backlog = len(self._fills) if elsewhere else self._queued + self._opening
            skipped = backlog >= (MAX_QUEUED_FILLS if reader_fd >= 0
                                  else MAX_QUEUED_UNOPENED_FILLS)
            if not skipped:
                fill = self._fills[ident] = _Fill(
                    relpath, key, attr, -1 if reader_fd < 0 else os.dup(reader_fd),
                    counted=True)
                if to_open:
                    self._opening += 1
                    thread = self._opener_wanted_locked()
                elif not elsewhere:
                    self._queued += 1
                    thread = self._thread_wanted_locked()
        if skipped:
            self._on_fill("skipped")
            return True
        if elsewhere:
            self._send_to_process(fill)
            return True
        (self._to_open if to_open else self._queue).put(fill)
        if thread is not None:
            thread.start()
        return True

    def _fills_in_processes(self, size: int) -> bool:
        return self._processes is not None and self._processes.takes(size)

    @staticmethod
    def _claim_count_locked(fill: _Fill) -> bool:
        """Whether the caller counts the fill's bytes: the first to ask, of the copy and a
        reader with its own open file, does."""
        claimed, fill.counted = not fill.counted, True
        return claimed

    def _thread_wanted_locked(self) -> threading.Thread | None:
        """A new fill thread (to be started), where the queue says one helps."""
        threads = len(self._threads)
        if self._copy_waits.mostly_waiting:
            wanted = threads < FILL_THREADS and self._queued > threads * FILL_BACKLOG_PER_THREAD
        else:
            wanted = threads < CPU_BOUND_FILL_THREADS \
                and self._queued > threads * (MAX_QUEUED_FILLS // FILL_THREADS)
        if not threads or wanted:
            thread = threading.Thread(target=self._work, name="fill", daemon=True)
            self._threads.append(thread)
            return thread
        return None

    def _opener_wanted_locked(self) -> threading.Thread | None:
        """A new thread to open fills' remote files (to be started), where the waiting
        opens say one helps."""
        openers = len(self._openers)
        if not openers or openers < OPEN_THREADS \
                and self._opening > openers * OPENS_PER_OPEN_THREAD:
            thread = threading.Thread(target=self._open_for_fills, name="fill-open",
                                      daemon=True)
            self._openers.append(thread)
            return thread
        return None

    def _open_for_fills(self) -> None:
        """Open the remote files of queued fills, then queue their copies."""
        while (fill := self._to_open.get()) is not None:
            with self._lock:
                self._opening -= 1
            try:
                fd = self._remote.open_file(fill.relpath, fill.attr.version)
            except Exception as exc:
                self._on_fill(_failure(exc))
                _log_failure(fill, exc)
                self._finish(fill)
                continue
            with self._lock:
                fill.fd = fd
                closed = self._closed  # the fill threads are ending: the fill is let go
                if not closed:
                    self._queued += 1
                    thread = self._thread_wanted_locked()
            if closed:
                self._finish(fill)
                continue
            self._queue.put(fill)
            if thread is not None:
                thread.start()

    def _send_to_process(self, fill: _Fill) -> None:
        place = self._store.place_fill(fill.key, fill.attr, f"p{next(self._placed)}")
        if place is None:
            self._on_fill("not_stored")
            self._finish(fill)
            return
        fill.place = place
        if not self._processes.submit(fill.fd, place.tmp, fill.attr.version, fill):
            self._store.abandon_fill(place)
            self._on_fill("skipped")
            self._finish(fill)

    def _filled_elsewhere(self, fill: _Fill, outcome: Outcome) -> None:
        """A fill process's answer (on its answers thread): the copy put in place and
        indexed, or let go."""
        place = fill.place
        try:
            if outcome.kind == COPIED:
                stored = self._store.install_placed(fill.key, fill.attr, place,
                                                    outcome.checksums, outcome.allocated)
                self._on_fill("stored" if stored else "not_stored")
            else:
                disk = OSError(outcome.errno, outcome.message) if outcome.kind == DISK else None
                self._store.abandon_fill(place, disk)
                self._on_fill({CHANGED: "changed", DISK: "not_stored"}.get(outcome.kind,
                                                                          "failed"))
                log.debug("fill of %s failed: %s", fill.relpath, outcome.message)
        finally:
            self._finish(fill)

    def _work(self) -> None:
        while (fill := self._queue.get()) is not None:
            with self._lock:
                self._queued -= 1
            try:
                self._fill(fill)
            except Exception as exc:
                _log_failure(fill, exc)
            finally:
                self._finish(fill)

    def _fill(self, fill: _Fill) -> None:
        try:
            if fill.fd < 0:  # queued unopened: the remote's opens are fast
                fd = self._remote.open_file(fill.relpath, fill.attr.version)
                with self._lock:
                    fill.fd = fd
            with _cpus_for_copy(fill.attr.size):
                stored = self._store.fill(fill.key, fill.attr,
                                          lambda out: self._copy(fill, out))
        except BaseException as exc:
            self._on_fill(_failure(exc))
            raise
        self._on_fill("stored" if stored else "not_stored")

    def _copy(self, fill: _Fill, out: int) -> None:
        with self._lock:
            claimed = self._claim_count_locked(fill)
        if claimed:
            self._remote.count_read(fill.attr.size)
        self._copy_waits.measure(send_checked, fill.fd, out, fill.attr.version,
                                 self._remote.call)

    def _finish(self, fill: _Fill) -> None:
        with self._lock:
            if self._fills.get((fill.key, fill.attr.version)) is fill:
                del self._fills[(fill.key, fill.attr.version)]
            fd, fill.fd = fill.fd, -1
            # Readers were handed its file but no copy counted the bytes (the cache had no
            # room for it, say): they read them from the remote.
            unclaimed = fill.shared and self._claim_count_locked(fill)
            self._done.notify_all()
        if unclaimed:
            self._remote.count_read(fill.attr.size)
        if fd >= 0:
            os.close(fd)

    @property
    def fills_under_way(self) -> int:
        return len(self._fills)

    @property
    def fill_processes(self) -> list[int]:
        """The pids of the fill processes running (--fill-processes)."""
        return self._processes.pids if self._processes is not None else []


def _cpus_for_copy(size: int) -> AbstractContextManager:
    """Where a copy of ``size`` bytes runs: one of more than a piece is mostly the kernel's
    work, on whatever CPU is free (the serving threads may keep to one, service/affinity.py);
    a smaller one takes turns at the interpreter lock more than it copies."""
    return limits.every_cpu() if size > COPY_PIECE_BYTES else nullcontext()


def _failure(exc: BaseException) -> str:
    """The outcome a fill that raised ``exc`` is counted as."""
    return "changed" if isinstance(exc, RemoteChanged) else "failed"


def _log_failure(fill: _Fill, exc: Exception) -> None:
    if isinstance(exc, (OSError, CachefsError)):  # the remote's or the disk's: expected
        log.debug("fill of %s failed: %s", fill.relpath, exc)
    else:
        log.error("fill of %s failed unexpectedly", fill.relpath, exc_info=exc)
