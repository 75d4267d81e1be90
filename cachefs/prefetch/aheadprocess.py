"""A reader-ahead: a process of its own that reads and copies a warm's files ahead of its
fetches, started and ended by the daemon, which runs one for each core it may use
(readahead.py, which says why and how).

It reads the paths of the warms' connections the daemon handed it, in batches, oldest first;
has the kernel read in the files the daemon would fetch; copies the small ones into unnamed
files of the cache's disk, handed to the daemon in numbered batches; and tells each warm
which of its paths the daemon took in, and how many it is done with, once the daemon has
answered.  One thread: its waits are its own, not the daemon's.
"""

from __future__ import annotations

import collections
import errno
import os
import selectors
import socket
import stat
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from cachefs.attr import Attr, Version
from cachefs.errors import NotInTree
from cachefs.prefetch.paths import Caller, may, normalize
from cachefs.prefetch.readahead import (
    BATCH_PATHS,
    BATCHES_ASKED,
    BUFFERED_BYTES,
    CALLER_BYTES,
    COPIES,
    COPIES_PER_MESSAGE,
    COPY_AHEAD_MAX_BYTES,
    DELIVERED,
    DISK_PAUSE_SECONDS,
    ENDED,
    ENDED_LOOK_SECONDS,
    PAUSE,
    READ_AHEAD_BYTES,
    SEND_SECONDS,
    SLOW_PROBE_SECONDS,
    TAKEN,
    TOLD_BYTES,
    close_all,
)
from cachefs.remote.fillprocess import COPIED, DISK, fill_into
from cachefs.remote.remote import OpenTimes
from cachefs.store.admission import FractionAdmission
from cachefs.store.index import data_key
from cachefs.store.layout import CacheLayout
from cachefs.store.mark import marked_as
from cachefs.store.store import CHUNK_BYTES


def read_ahead_one(remote_root: str, layout: CacheLayout, caller: Caller, relpath: bytes,
                   open_times: OpenTimes | None = None) -> tuple[int, Attr] | None:
    """Have the kernel read ``relpath`` of the remote in, for ``caller``: its open
    descriptor (the caller's to close) and attributes once asked, else None.  Only a regular
    file the caller may read, not cached whole already.  The open of the remote file is
    timed into ``open_times``."""
    path = os.path.join(os.fsencode(remote_root), relpath)
    try:
        before = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(before.st_mode) \
                or not may(caller, 4, before.st_mode, before.st_uid, before.st_gid):
            return None  # nothing but a regular file is ever opened (a FIFO, a device)
        began = time.monotonic()
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        if open_times is not None:
            open_times.add(time.monotonic() - began)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        attr = Attr.from_stat(st)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino) or not st.st_size \
                or _cached(layout, relpath, attr.version):
            os.close(fd)
            return None
        os.posix_fadvise(fd, 0, min(st.st_size, READ_AHEAD_BYTES), os.POSIX_FADV_WILLNEED)
        return fd, attr
    except OSError:
        os.close(fd)
        return None


def _way_open(remote_root: bytes, relpath: bytes, caller: Caller, ways: dict[bytes, bool]
              ) -> bool:
    """Whether every directory on the way to ``relpath`` is one, not a symlink (which the
    kernel would follow out of the tree, or to a name the daemon's resolution, paths.resolve,
    gives another file), and ``caller`` may search it, as that resolution checks:
    the copy goes into the cache with no FETCH of its own.  ``ways`` holds the answers for
    directories looked at already (a batch's: a directory replaced meanwhile is seen at the
    next).  A symlink within the tree is left to the FETCH, which follows it."""
    way = b""
    for part in (b"", *relpath.split(b"/")[:-1]):
        way = part if not way else way + b"/" + part
        ok = ways.get(way)
        if ok is None:
            try:
                if way:
                    st = os.stat(os.path.join(remote_root, way), follow_symlinks=False)
                else:  # the remote's root, as configured (a symlink to it is its name)
                    st = os.stat(remote_root)
                ok = stat.S_ISDIR(st.st_mode) \
                    and may(caller, 1, st.st_mode, st.st_uid, st.st_gid)
            except OSError:
                ok = False
            ways[way] = ok
        if not ok:
            return False
    return True


def _cached(layout: CacheLayout, relpath: bytes, version: Version) -> bool:
    """Whether the cache holds this version of the file whole, as its check mark says."""
    try:
        fd = os.open(layout.data_path(data_key(relpath, version)),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return marked_as(fd, os.fstat(fd), version)
    finally:
        os.close(fd)


class _Copier:
    """Copies of small files made ahead of their fetch: unnamed files of the cache's disk
    (O_TMPFILE under tmp/), handed to the daemon with what they hold in numbered batches of
    COPIES_PER_MESSAGE.  The daemon links each in and indexes it as it comes, closes the
    rest, and answers which it took in; each warm is told its copies taken in, with their
    sizes, and sends no FETCH for them.  A copy the daemon does not take, or one a crash cut
    short, goes with its last descriptor, and none ever has a name to be swept."""

    def __init__(self, tmp_dir: str, daemon: socket.socket) -> None:
        self._tmp_dir = tmp_dir
        self._daemon = daemon
        self._told: list[bytes] = []
        self._fds: list[int] = []  # the copies of the lines in _told
        self._owners: list[tuple[_Warm, bytes, int]] = []  # their warms, lines and sizes
        # The batches told whose answer has not come, oldest first: number -> their owners.
        self._asked: collections.OrderedDict[int, list[tuple[_Warm, bytes, int]]] = \
            collections.OrderedDict()
        self._batches = 0
        # What the warms are to be told they are done with once the batches up to theirs
        # are answered, in order: (batch, warm, lines done).
        self._marks: collections.deque[tuple[int, _Warm, int]] = collections.deque()
        self._paused_until = 0.0

    def copy(self, src: int, relpath: bytes, attr: Attr, warm: _Warm, line: bytes) -> bool:
        """Copy the open remote file ``src`` (``relpath``, of ``attr``; ``line`` of
        ``warm``'s list) ahead: whether a copy was made."""
        if attr.size > COPY_AHEAD_MAX_BYTES or time.monotonic() < self._paused_until:
            return False
        try:
            out = os.open(self._tmp_dir, os.O_RDWR | os.O_TMPFILE | os.O_CLOEXEC, 0o600)
        except OSError:  # the disk refused it, or its file system makes no unnamed files
            self.pause()
            return False
        outcome = fill_into(src, out, attr.version)
        if outcome.kind != COPIED:
            os.close(out)
            if outcome.kind == DISK:
                self.pause()  # the cache disk refused it; else the remote's: read it in
            return False
        self._fds.append(out)
        self._told.append(b"%d %d %d %d %d %d %d %d %d %d %s" % (
            *attr, outcome.allocated, outcome.checksums[0], relpath))
        self._owners.append((warm, line, attr.size))
        if len(self._told) >= COPIES_PER_MESSAGE:
            self.tell()
        return True

    def pause(self) -> None:
        self._paused_until = time.monotonic() + DISK_PAUSE_SECONDS

    def tell(self) -> None:
        """Hand the daemon the copies made since it was last told."""
        if self._told:
            told, fds, owners = self._told, self._fds, self._owners
            self._told, self._fds, self._owners = [], [], []
            self._batches += 1
            head = COPIES + b" %d\n" % self._batches
            try:
                socket.send_fds(self._daemon, [head + b"\n".join(told)], fds)
            except OSError as exc:
                # Too many descriptors on their way to a daemon that is slow to take them:
                # these copies are dropped.  Anything else is the daemon gone.
                if exc.errno != errno.ETOOMANYREFS:
                    raise
                return
            finally:
                close_all(fds)
            self._asked[self._batches] = owners
            if len(self._asked) > BATCHES_ASKED:  # its answer was not sent: given up on
                self._asked.popitem(last=False)
                self._release()

    def mark(self, warm: _Warm, done: int) -> None:
        """Tell ``warm`` it is done with its first ``done`` lines, once the daemon answered
        for every copy of them."""
        self._marks.append((self._batches, warm, done))
        warm.awaiting += 1
        self._tell_warms(self._release())

    def answered(self, message: bytes) -> None:
        """The daemon's answer to a batch: each warm is told its copies taken in, and the
        lines done with once their batches are all answered."""
        head, _, flags = message.partition(b"\n")
        batch = int(head.split()[1])
        owners = self._asked.pop(batch, [])
        warms = set()
        for (warm, line, size), flag in zip(owners, flags, strict=False):
            if flag == 0x31 and warm.sock is not None:
                warm.taken_in(batch, size, line)
                warms.add(warm)
        warms.update(self._release())
        self._tell_warms(warms)

    def _tell_warms(self, warms: Iterable[_Warm]) -> None:
        delivered = []
        for warm in warms:
            delivered += warm.tell()
        if delivered:  # the daemon forgets them: no FETCH of theirs comes
            self._daemon.sendall(DELIVERED + b"\n" + b" ".join(b"%d" % n for n in delivered))

    def _release(self) -> set[_Warm]:
        """The marks whose batches are all answered (or given up on), each told to its
        warm: the warms told."""
        oldest = next(iter(self._asked), self._batches + 1)
        warms = set()
        while self._marks and self._marks[0][0] < oldest:
            _, warm, done = self._marks.popleft()
            warm.awaiting -= 1
            if warm.sock is not None:
                warm.done(done)
                warms.add(warm)
        return warms


class _Warm:
    """One warm's connection, as the reader-ahead reads it, and what it tells the warm: the
    lines of its list whose copies were taken in, a line each (size, the line)."""

    def __init__(self, sock: socket.socket, caller: Caller) -> None:
        self.sock: socket.socket | None = sock
        self.caller = caller
        self.ended = False  # it closed its end: once its lines are taken, it is done
        self.ended_at: float | None = None  # when that was seen
        self.awaiting = 0  # marks waiting for the daemon's answers (_Copier.mark)
        self.lines = 0  # the lines taken (or left), whole, so far
        self.read = 0
        self.left = 0
        self._sent = bytearray()  # what it sent, not taken yet
        self._told = bytearray()  # what it is to be told, not sent yet
        self._batches: list[int] = []  # of the copies in _told
        self._lost: set[int] = set()  # of those, batches with lines not told

    def receive(self) -> None:
        """Take in what the warm sent since it was last asked."""
        flags = 0
        while len(self._sent) <= BUFFERED_BYTES:
            try:
                piece = self.sock.recv(65536, flags)
            except BlockingIOError:
                break
            except OSError:
                piece = b""
            if not piece:
                self.ended = True
                break
            self._sent += piece
            flags = socket.MSG_DONTWAIT
        if len(self._sent) > BUFFERED_BYTES:  # not a warm's list: its FETCHes will do
            # The older lines go, or all of it when they make one line (no path is that long).
            cut = self._sent.rfind(b"\n", 0, len(self._sent) - BUFFERED_BYTES // 2) + 1 \
                or len(self._sent)
            skipped = self._sent.count(b"\n", 0, cut)
            self.left += skipped
            self.lines += skipped
            del self._sent[:cut]

    def has_lines(self) -> bool:
        return b"\n" in self._sent

    def next_lines(self) -> list[bytes]:
        """The oldest BATCH_PATHS lines it sent, whole, not taken yet."""
        end = -1
        for _ in range(BATCH_PATHS):
            found = self._sent.find(b"\n", end + 1)
            if found < 0:
                break
            end = found
        lines = bytes(self._sent[:end + 1]).split(b"\n")[:-1]
        del self._sent[:end + 1]
        self.lines += len(lines)
        return lines

    def taken_in(self, batch: int, size: int, line: bytes) -> None:
        """Tell the warm ``line`` of batch ``batch`` was copied and taken in (``size``
        bytes)."""
        if len(self._told) < TOLD_BYTES:
            self._told += b"%d %s\n" % (size, line)
            if not self._batches or self._batches[-1] != batch:
                self._batches.append(batch)
        else:  # its FETCH says so instead: the daemon keeps the batch until it does
            self._lost.add(batch)

    def done(self, lines: int) -> None:
        self._told += b"@%d\n" % lines

    def tell(self) -> list[int]:
        """Send what the warm takes now: it reads at its own pace, never waited for.  The
        batches whose lines it was told whole, once all it was told went."""
        if self.sock is None:
            return []
        try:
            sent = self.sock.send(self._told, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []
        except OSError:  # the warm is gone: its FETCHes too
            sent = len(self._told)
        del self._told[:sent]
        if self._told:
            return []
        delivered = [batch for batch in self._batches if batch not in self._lost]
        self._batches.clear()
        self._lost.clear()
        return delivered

    def close(self) -> None:
        self.sock.close()
        self.sock = None


class _Reader:
    """The paths of every warm handed over, read ahead one after the other.  The remote's
    opens are timed here, by the only thread that makes them: untimed slots count as fast,
    so that a warm is read ahead from its first path."""

    def __init__(self, remote_root: str, layout: CacheLayout, mountpoint: str,
                 admission: FractionAdmission, copier: _Copier) -> None:
        self.remote_root = remote_root
        self.layout = layout
        self.mountpoint = mountpoint
        self.admission = admission
        self.copier = copier
        self.open_times = OpenTimes(untimed=0.0)
        self._next_probe = 0.0

    def take(self, warm: _Warm) -> None:
        """Read in each path of the next lines ``warm`` sent, all of them first, so that the
        disk reads them at once; then copy ahead what is small enough, and tell the warm
        when the daemon has answered for them."""
        lines = warm.next_lines()
        opened = []
        ways: dict[bytes, bool] = {}  # the directories looked at, for this batch
        for line in lines:
            done = self._one(warm.caller, line, ways)
            if done is None:
                warm.left += 1
            else:
                warm.read += 1
                opened.append((line, *done))
        for line, relpath, fd, attr in opened:
            try:
                self.copier.copy(fd, relpath, attr, warm, line)
            finally:
                os.close(fd)
        self.copier.tell()
        self.copier.mark(warm, warm.lines)

    def _one(self, caller: Caller, raw: bytes, ways: dict[bytes, bool]
             ) -> tuple[bytes, int, Attr] | None:
        try:
            relpath = normalize(raw, self.mountpoint)
        except NotInTree:
            return None
        if not self.admission.eligible(relpath):
            return None
        if not self.open_times.fast:
            now = time.monotonic()
            if now < self._next_probe:
                return None
            self._next_probe = now + SLOW_PROBE_SECONDS
        key = os.fsencode(relpath)
        if not _way_open(os.fsencode(self.remote_root), key, caller, ways):
            return None
        done = read_ahead_one(self.remote_root, self.layout, caller, key, self.open_times)
        return None if done is None else (key, *done)


def main(argv: list[str] | None = None) -> int:
    remote_root, cache_dir, mountpoint, fraction, seed = \
        (argv if argv is not None else sys.argv[1:])[:5]
    daemon = socket.socket(fileno=0)  # a socket pair's end: a message per warm, with its caller
    # The daemon's cache, its names only: this process opens nothing of it but data files
    # (read) and its copies under tmp/ (created).
    layout = CacheLayout(Path(cache_dir), CHUNK_BYTES)
    reader = _Reader(remote_root, layout, mountpoint,
                     FractionAdmission(float(fraction), int(seed)),
                     _Copier(str(layout.tmp_dir), daemon))
    selector = selectors.DefaultSelector()
    selector.register(daemon, selectors.EVENT_READ, None)
    warms: list[_Warm] = []
    while True:
        # A warm with lines not taken yet is taken in turn with the others at once; one that
        # ended is looked at again until the daemon answered for its last copies.
        timeout = 0 if any(warm.has_lines() for warm in warms) else \
            ENDED_LOOK_SECONDS if any(warm.ended for warm in warms) else None
        for key, _ in selector.select(timeout):
            warm = key.data
            if warm is None:
                message, fds, _, _ = socket.recv_fds(daemon, CALLER_BYTES, 1)
                if not message:  # the daemon closed its end: its stop
                    return 0
                for fd in fds[1:]:
                    os.close(fd)
                if message.startswith(TAKEN) and not fds:
                    reader.copier.answered(message)
                    continue
                if message == PAUSE and not fds:
                    reader.copier.pause()
                    continue
                if fds:
                    # Left blocking (its file status is the daemon's too until the daemon
                    # has answered on it): read only once the selector says it is readable.
                    sock = socket.socket(fileno=fds[0])
                    try:
                        caller = Caller.decoded(message)
                    except ValueError:  # never from the daemon: nothing read for it
                        sock.close()
                        continue
                    warm = _Warm(sock, caller)
                    selector.register(sock, selectors.EVENT_READ, warm)
                    warms.append(warm)
                continue
            warm.receive()
        try:
            now = time.monotonic()
            for warm in list(warms):
                if warm.has_lines():
                    reader.take(warm)
                elif warm.ended:
                    if warm.ended_at is None:  # its end of the connection is closed
                        selector.unregister(warm.sock)
                        warm.ended_at = now
                    # Told of its last copies once the daemon answered for them (at most
                    # SEND_SECONDS: an answer it could not send never comes).
                    if warm.awaiting and now - warm.ended_at < SEND_SECONDS:
                        continue
                    warm.close()
                    warms.remove(warm)
                    daemon.sendall(ENDED + b"\n%d %d" % (warm.read, warm.left))
        except OSError:  # the daemon is gone
            return 0


if __name__ == "__main__":
    sys.exit(main())
