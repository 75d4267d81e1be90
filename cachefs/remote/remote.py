"""The remote tree (BACKING: an NFS mount in production), with every wait bounded in time.

An NFS server that stops answering makes system calls block, possibly for ever, and a
blocked thread cannot be interrupted.  Remote calls run on the caller's own thread (no
hand-off to a pool: a miss costs the remote's latency, not our CPU), inside
``remotewait.waiting()``: the FUSE session then starts another serving thread, and the
watchdog answers the caller's request with EIO once ``--remote-timeout`` has passed,
while the stuck thread stays parked in its system call until the server answers.

A timeout marks the remote unavailable.  From then on calls fail at once with
:class:`RemoteUnavailable` (EIO for a reader) instead of parking one more thread each,
and attributes come from memory, so cached files are served without waiting on the
remote; a probe stats the root every second and marks it available again when it answers.

Paths are relative to BACKING ("" is its root) and never follow a symlink in
their last component.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from cachefs import remotewait
from cachefs.attr import Attr, Version
from cachefs.errors import RemoteChanged, RemoteUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

PROBE_INTERVAL_SECONDS = 1.0
# A listing brings the attributes of this many names at most: enough for a flat directory of
# a dataset (COCO's 118,000 images), and a bound on what `ls` of a huge directory costs
# where the server answers no READDIRPLUS (then each lstat is a round trip of its own).
LISTED_ATTRS_MAX = 131_072
# The remote's opens are fast (no round trip: a local disk, an NFS client holding
# delegations) when the median of the last OPEN_TIMES_WINDOW took under FAST_OPEN_SECONDS.
# The threads that open remote files then do so themselves instead of handing it to threads
# that wait on round trips (handover.py), and prefetch workers run no more at once than the
# cores (prefetcher.py): a hand-over, or a thread more, costs wake-ups and turns at the
# interpreter lock, an open here microseconds (a local tree as the remote, 6,000 files of
# 64 KiB, 8 readers: with the fills' opens on threads of their own, over 30 waited for them
# and all 16 ran, a fill at 720 - 800 us of daemon CPU; opened by the fill threads, 480 us).
# An open's time counts its thread's wait for the interpreter lock, which comes in bursts:
# the median, not the mean, tells (a local tree as the remote, fills opening their files on
# 2 cores: half the opens under 20 - 60 us, the slowest over 2 ms).  Until more than half of
# OPEN_TIMES_WINDOW opens were timed fast, the remote counts as slow.  The threads that may
# copy or fetch from such a remote at once are limits.CORES at most.
FAST_OPEN_SECONDS = 0.0003
OPEN_TIMES_WINDOW = 32


class Remote:
    """Bounded-time access to BACKING.

    Thread safety: all methods may be called from any thread.  ``_state_lock``
    guards the availability flag and the probe; it is a leaf lock.
    """

    def __init__(
        self,
        root: str,
        timeout_seconds: float,
        *,
        on_read_bytes: Callable[[int], None] = lambda n: None,
        on_error: Callable[[str], None] = lambda kind: None,
        on_availability: Callable[[bool], None] = lambda up: None,
    ) -> None:
        self.root = root
        self._prefix = root if root.endswith("/") else root + "/"
        self.timeout_seconds = timeout_seconds
        self._on_read_bytes = on_read_bytes
        self._on_error = on_error
        self._on_availability = on_availability
        self._state_lock = threading.Lock()
        self._available = True
        self._probing = False
        self._closed = False
        self.watchdog = remotewait.Watchdog(timeout_seconds, self.timed_out)
        remotewait.install(self.watchdog)
        self._open_times = OpenTimes()

    def close(self) -> None:
        self._closed = True
        self.watchdog.close()
        remotewait.install(None)

    def path(self, relpath: str) -> str:
        # Joined by hand, not os.path.join (a call on every remote call): a relative path
        # never names anything outside the root, even one that begins with a slash.
        return self._prefix + relpath if relpath else self.root

    @property
    def available(self) -> bool:
        return self._available

    @property
    def opens_fast(self) -> bool:
        """Whether opening a remote file takes no round trip (see FAST_OPEN_SECONDS)."""
        return self._open_times.fast

    # -- the one way to call the remote ----------------------------------------------------

    def call(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on this thread, as a wait on the remote the watchdog bounds.

        OSErrors keep their errno; RemoteUnavailable while the remote is known not to
        answer.
        """
        if not self._available or self._closed:
            raise RemoteUnavailable("the remote is not answering" if not self._closed
                                    else "the daemon is shutting down")
        try:
            with remotewait.waiting():
                return fn(*args)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # a missing name is an answer, not a fault
                self._on_error(_error_kind(exc))
            raise

    def timed_out(self) -> None:
        """A wait on the remote outlasted the timeout: the watchdog's word for a call, a fill
        process's for its copy."""
        self._on_error("timeout")
        self._mark_unavailable(f"no answer within {self.timeout_seconds:g} s")

    def _mark_unavailable(self, why: str) -> None:
        with self._state_lock:
            if self._available:
                self._available = False
                log.error("remote %s is not answering (%s): serving cached files only",
                          self.root, why)
                self._on_availability(False)
            if self._probing or self._closed:
                return
            self._probing = True
        threading.Thread(target=self._probe, name="remote-probe", daemon=True).start()

    def _probe(self) -> None:
        """Stat the root until it answers, then mark the remote available."""
        while not self._closed:
            time.sleep(PROBE_INTERVAL_SECONDS)
            try:
                os.lstat(self.root)  # on this thread only: it may park here for a while
            except OSError:
                continue
            with self._state_lock:
                self._available = True
                self._probing = False
                log.warning("remote %s answers again", self.root)
                self._on_availability(True)
            return

    # -- operations ------------------------------------------------------------------------

    def lstat(self, relpath: str) -> Attr:
        return Attr.from_stat(self.call(os.lstat, self.path(relpath)))

    def listdir(self, relpath: str) -> list[tuple[str, int, Attr | None]]:
        """(name, file type bits, attributes) of each entry, in one wait.

        The attributes come with the listing on NFS (READDIRPLUS: the client keeps them
        for its ``actimeo``, so the lstat of each name costs no round trip); they are None
        for a name gone since it was listed, and past the first LISTED_ATTRS_MAX names.
        """
        return self.call(_scan, self.path(relpath))

    def listnames(self, relpath: str) -> list[tuple[str, int]]:
        """(name, file type bits) of each entry, from the directory alone (no attributes:
        an NFS READDIR, no per-name GETATTR), for a walk that needs only the names."""
        return self.call(_scan_names, self.path(relpath))

    def statvfs(self) -> os.statvfs_result:
        return self.call(os.statvfs, self.root)

    def readlink(self, relpath: str) -> str:
        return self.call(os.readlink, self.path(relpath))

    def read(self, relpath: str, offset: int, length: int, expected: Version) -> bytes:
        """``length`` bytes at ``offset`` of the file, which must still be version ``expected``.

        Opens, checks, reads and closes in one wait.  RemoteChanged when the file is
        another version.
        """
        data = self.call(_read_range, self.path(relpath), offset, length, expected)
        self._on_read_bytes(len(data))
        return data

    def open(self, relpath: str, expected: Version) -> RemoteFile:
        """An open remote file for a reader that reads it piecemeal."""
        return RemoteFile(self, self.open_file(relpath, expected), expected)

    def open_file(self, relpath: str, expected: Version) -> int:
        """A descriptor of the remote file, checked to be version ``expected`` (RemoteChanged
        otherwise); the caller closes it."""
        began = time.monotonic()
        fd = self.call(_open_checked, self.path(relpath), expected)
        self._open_times.add(time.monotonic() - began)
        return fd

    def locate_file(self, relpath: str, expected: Version) -> int:
        """An O_PATH descriptor of the remote file (a path walk, no NFS OPEN: nothing to
        read with, but enough for the kernel to open the very file, as passthrough does),
        checked to be version ``expected``; the caller closes it."""
        return self.call(_open_checked, self.path(relpath), expected, os.O_PATH)

    def count_read(self, nbytes: int) -> None:
        """Bytes the kernel reads from the remote on our behalf: a file handed to it, or
        copied by it into the cache (see handover.py)."""
        self._on_read_bytes(nbytes)


class OpenTimes:
    """The times of the last OPEN_TIMES_WINDOW opens of remote files: whether they are fast.

    Thread safety: added to by any thread without a lock (a slot's store is atomic under the
    interpreter lock; two threads storing into one slot lose a time, which only delays the
    answer)."""

    def __init__(self, untimed: float = float("inf")) -> None:
        # Slots not yet timed count as taking ``untimed``: by default slow, so that the
        # remote is fast once more than half of a window of opens were.
        self._times = [untimed] * OPEN_TIMES_WINDOW
        self._next = 0
        self.fast = untimed < FAST_OPEN_SECONDS

    def add(self, seconds: float) -> None:
        slot = self._next
        self._next = (slot + 1) % OPEN_TIMES_WINDOW
        self._times[slot] = seconds
        self.fast = sorted(self._times)[OPEN_TIMES_WINDOW // 2] < FAST_OPEN_SECONDS


class RemoteFile:
    """A descriptor of a remote file, for reads that do not go through the cache.

    Thread safety: pread on a shared descriptor is safe; close once.
    """

    def __init__(self, remote: Remote, fd: int, version: Version) -> None:
        self._remote = remote
        self.fd = fd
        self.version = version

    def pread(self, offset: int, length: int) -> bytes:
        """Bytes of version ``self.version`` only: RemoteChanged when the file was rewritten
        in place since it was opened (a read of it could mix old and new bytes)."""
        data = self._remote.call(_pread_checked, self.fd, length, offset, self.version)
        self._remote._on_read_bytes(len(data))
        return data

    def close(self) -> None:
        # A close may talk to the server (NFSv4 CLOSE): a wait like any other.
        with remotewait.waiting():
            os.close(self.fd)


def _scan(path: str) -> list[tuple[str, int, Attr | None]]:
    listed: list[tuple[str, int, Attr | None]] = []
    with os.scandir(path) as it:
        # Each name's lstat as it is listed, as `ls -l` does: the NFS client sees the
        # attributes wanted and keeps asking for them with the names (READDIRPLUS).
        for entry in it:
            attr = None
            if len(listed) < LISTED_ATTRS_MAX:
                try:
                    attr = Attr.from_stat(entry.stat(follow_symlinks=False))
                except FileNotFoundError:
                    pass  # gone since the listing
            kind = _dirent_type(entry) if attr is None else stat.S_IFMT(attr.mode)
            listed.append((entry.name, kind, attr))
    return listed


def _scan_names(path: str) -> list[tuple[str, int]]:
    with os.scandir(path) as it:
        return [(entry.name, _dirent_type(entry)) for entry in it]


def _dirent_type(entry: os.DirEntry) -> int:
    """The file type bits of a listed entry, as its lookup will show them: a pipe or a
    device node listed as a regular file would be taken for data by a walk that trusts the
    listing (``find -type f``, ``os.scandir``), and its open would wait for a writer.  0
    (the type unknown: the reader looks it up) when it went away meanwhile."""
    if entry.is_symlink():
        return stat.S_IFLNK
    if entry.is_dir(follow_symlinks=False):
        return stat.S_IFDIR
    if entry.is_file(follow_symlinks=False):
        return stat.S_IFREG
    try:  # something else (rare): its type from its own lstat
        return stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode)
    except OSError:
        return 0


def _open_checked(path: str, expected: Version, mode: int = os.O_RDONLY) -> int:
    fd = os.open(path, mode | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if Version(st.st_size, st.st_mtime_ns) != expected:
            raise RemoteChanged(f"{path} changed on the remote")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_range(path: str, offset: int, length: int, expected: Version) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        # One version check, after the read: it catches a file replaced before the open
        # as well as one rewritten in place during the read (a round trip less than a
        # check before and after, on a remote where each is one).
        return _pread_checked(fd, length, offset, expected)
    finally:
        os.close(fd)


def _pread_checked(fd: int, length: int, offset: int, expected: Version) -> bytes:
    data = _pread_full(fd, length, offset)
    st = os.fstat(fd)
    if Version(st.st_size, st.st_mtime_ns) != expected:
        raise RemoteChanged("the file changed on the remote while being read")
    return data


def _pread_full(fd: int, length: int, offset: int) -> bytes:
    """pread until ``length`` bytes or end of file (NFS may return short reads)."""
    data = os.pread(fd, length, offset)
    if len(data) == length or not data:
        return data
    parts = [data]
    got = len(data)
    while got < length:
        more = os.pread(fd, length - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _error_kind(exc: OSError) -> str:
    return {errno.ESTALE: "estale", errno.EACCES: "eacces",
            errno.EIO: "eio"}.get(exc.errno or 0, "other")
