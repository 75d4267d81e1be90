"""Reading and copying a warm's files ahead of its fetches, in a process of its own.

A fetch of a file from a remote whose opens are fast (a local disk, an NFS client that holds
delegations) waits on the remote twice: for the name's inode and for the data.  Each wait,
in the daemon, is its thread sleeping, another taking the interpreter lock, and the first
woken for its turn again.  ``cachefs warm`` reads its list ahead of its FETCHes and tells
each path it will fetch to a reader-ahead, a process of its own, which keeps what the daemon
would fetch (the fraction admits it), opens the remote file and asks the kernel to read it in
(posix_fadvise WILLNEED), asynchronously: its waits are its own.  (A warm of 100,000 files of
4 KiB from a local tree with a cold page cache, 3 runs in turns: 6,141 - 7,006 files/s at
168 - 186 us of CPU per file, the reader-ahead's included, against 4,669 - 4,936 at 192 -
202.  Done in the daemon instead, on a thread of its own, it saved nothing: the waits moved
to that thread.)

The warm's paths never pass through the daemon's interpreter: the warm asks on a connection
of its own (READ-AHEAD), and the daemon hands that connection, with the caller's uid, to the
reader-ahead (SCM_RIGHTS over a socket pair), which reads the paths from it itself.

Nor do most of its fills: a small file (COPY_AHEAD_MAX_BYTES) the reader-ahead also copies
ahead, as a fill process copies, hashes and marks a file (fillprocess.fill_into), into an
unnamed file of the cache's disk (O_TMPFILE), which it hands to the daemon with what it
holds; the file's FETCH then links the copy in at its data file's name and indexes it
(CacheStore.install_ahead) when it is of the version the FETCH resolved, and fetches the
file as ever otherwise.  A fill in the daemon is a remote open, a create, the copy, the
hash, the mark and the record, each a turn at the interpreter lock; the copy's two processes
share the work across cores.  Of what a warm sent since it last looked, the reader-ahead
takes the newest NEWEST_PATHS paths, the furthest ahead of their FETCHes (the older ones are
the FETCHes' to fill), reads them all in at once, then copies them.
100,000 files of 4 KiB of a million, pages dropped, on a busy 2-core host, in turns: 4,351 -
4,561 files/s at 180 - 204 us of the daemon's CPU per file (91 - 96 % of the files copied
ahead), against 3,228 - 3,354 at 286 - 295 with the reader-ahead reading the files in only;
the reader-ahead's own CPU rose from some 110 to 180 us per file.  At most COPIES_AHEAD
copies, of COPIES_AHEAD_BYTES, wait for their FETCH at once (a newer one is dropped); one no
FETCH took within COPY_KEPT_SECONDS is dropped (a warm killed), and so is every one at the
daemon's stop.  A copy has no name until its FETCH links it in: a dropped one, or one a crash
cut short, goes with its last descriptor, and none is left behind to sweep.  While the cache
takes no files (its budget used, its disk refusing writes), the daemon tells the reader-ahead
so, and it makes no copy for DISK_PAUSE_SECONDS.

Advice only, bounded and never waited for: the warm drops paths the reader-ahead is too slow
to take; it reads at most READ_AHEAD_BYTES of a file; a file the cache holds (its check
mark, mark.py) or one the caller may not read is left alone; an open remote file is never
held past the batch it came in.  It reads nothing of a remote whose opens take a round trip
(OpenTimes, remote.py: it times its own): one open at a time would fall behind the warm's
concurrent fetches, which cover that latency themselves, and add an open of each file to
theirs (a warm of 3,000 files from the EFS-like remote: 1,421 - 1,453 files/s read ahead
against 1,496 - 1,509).  It then tries one path every SLOW_PROBE_SECONDS, to see the remote
fast again.  A reader-ahead that dies is started again at the next warm, at most once per
RESTART_SECONDS (the warms it served go on without advice); one stuck on a remote that
stopped answering holds nothing up (the warm drops its paths), and the daemon's stop waits
for it CLOSE_SECONDS, then as long again once killed.

Thread safety (daemon side): ``_lock`` guards the process, its socket, the copies told and
the figures; it is a leaf lock (the store is looked in and written to outside it).  What the
reader-ahead tells is read on a thread of its own, which the daemon's stop waits for before
the store closes.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import resource
import select
import selectors
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

from cachefs import limits
from cachefs.attr import Attr, Version
from cachefs.errors import NotInTree
from cachefs.prefetch.paths import normalize
from cachefs.remote.fillprocess import COPIED, DISK, fill_into
from cachefs.remote.remote import OpenTimes
from cachefs.store.admission import FractionAdmission
from cachefs.store.index import data_key
from cachefs.store.layout import CacheLayout
from cachefs.store.mark import marked_as
from cachefs.store.store import CHUNK_BYTES, CacheStore

log = logging.getLogger(__name__)

# At most this much of a file is read ahead: all of a training example, the start of a
# larger file, whose own copy reads ahead of itself.  A warm reads its list AHEAD_PATHS
# (warm.py) ahead, so this bounds what it puts in the page cache before it is fetched.
READ_AHEAD_BYTES = 256 * 2**10
# Warms read ahead at once, at most (each holds a descriptor in the reader-ahead).
MAX_STREAMS = 64
# While the remote's opens are slow, one path is tried this often.
SLOW_PROBE_SECONDS = 0.25
RESTART_SECONDS = 10.0
CLOSE_SECONDS = 1.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Files of at most this many bytes are copied ahead (one chunk, one checksum), at most
# COPIES_AHEAD of them not taken yet; told to the daemon COPIES_PER_MESSAGE at a time (and
# at the end of what a warm sent at once).
COPY_AHEAD_MAX_BYTES = 1 << 20
# Over a warm's AHEAD_PATHS: a copy waits that many paths for its FETCH.  Past it (or its
# bytes), a new copy is dropped, not an older one: the older are the nearer to their FETCHes.
COPIES_AHEAD = 4096
COPIES_AHEAD_BYTES = 64 << 20
COPIES_PER_MESSAGE = 32
# A copy no FETCH took within this long is removed (a warm killed, a path of another name).
COPY_KEPT_SECONDS = 60.0
# Paths taken at most from what a warm sent since the last look: the newest, the furthest
# ahead of their FETCHes.
NEWEST_PATHS = 256
# After the cache disk refused a copy, or the daemon said the cache takes none (_PAUSE), none
# is made for this long.
DISK_PAUSE_SECONDS = 10.0
# A reader-ahead that takes no new warm within this long is taken for stuck.
SEND_SECONDS = 2.0
# What the reader-ahead tells the daemon, a message each: the copies it made, a line each
# (size, mtime_ns, bytes on the disk, checksum, path); the paths a warm's connection sent
# that it read in or copied, and those it left (not admitted, cached, not readable, not a
# file, the remote slow), once that connection ended.
_COPIES = b"C"
_ENDED = b"E"
# What the daemon tells it besides the warms: the cache takes no copy now (its budget is
# used, its disk refused a write): none is made for DISK_PAUSE_SECONDS.
_PAUSE = b"P"
MESSAGE_BYTES = 1 << 18  # over COPIES_PER_MESSAGE lines of the longest paths


def _parse(message: bytes, fds: list[int]
           ) -> tuple[tuple[int, int] | None, list[tuple[bytes, _Copied]]]:
    """A message of the reader-ahead's: a warm's counts (read, left) as it ended, or the
    copies it made, with their descriptors ``fds``, one a line.  ValueError for anything
    else (the caller closes ``fds``)."""
    kind, _, body = message.partition(b"\n")
    if kind == _ENDED and not fds:
        read, left = body.split()
        return (int(read), int(left)), []
    lines = body.split(b"\n")
    if kind != _COPIES or len(lines) != len(fds):
        raise ValueError(kind)
    now = time.monotonic()
    copies = []
    for line, fd in zip(lines, fds, strict=True):
        size, mtime_ns, allocated, checksum, relpath = line.split(b" ", 4)
        copies.append((relpath, _Copied(Version(int(size), int(mtime_ns)), int(allocated),
                                        int(checksum), now, fd)))
    return None, copies


class _Copied(NamedTuple):
    """A copy the fill-ahead made of a file, not taken yet: an unnamed file of the cache's
    disk (O_TMPFILE), open at ``fd`` (the daemon's to close)."""

    version: Version
    allocated: int
    checksum: int
    at: float
    fd: int


class _Waiting:
    """The copies the reader-ahead made that no FETCH took yet, oldest first, by path, with
    their bytes: bounded in number (``most``) and bytes (COPIES_AHEAD_BYTES).  Each method
    gives back the descriptors of the copies it took out and did not hand over, for the
    caller to close (outside its lock: the last close of an unnamed file frees it).  Not
    thread-safe: ReadAhead's lock guards it."""

    def __init__(self) -> None:
        self._copies: collections.OrderedDict[str, _Copied] = collections.OrderedDict()
        self._bytes = 0
        self.most = COPIES_AHEAD
        self.refused = 0  # new copies turned away past the bounds

    def take(self, relpath: str) -> _Copied | None:
        copied = self._copies.pop(relpath, None)
        if copied is not None:
            self._bytes -= copied.version.size
        return copied

    def add(self, relpath: str, copied: _Copied) -> list[int]:
        """Keep ``copied``; a copy of the same path made before goes (two warms copied it).
        Past the bounds, the new one goes instead: the older copies are the nearer to their
        FETCHes, and this one's FETCH fills the file as ever."""
        gone = []
        old = self.take(relpath)
        if old is not None:
            gone.append(old.fd)
        if len(self._copies) >= self.most or \
                self._bytes + copied.version.size > COPIES_AHEAD_BYTES:
            gone.append(copied.fd)
            self.refused += 1
        else:
            self._copies[relpath] = copied
            self._bytes += copied.version.size
        return gone

    def expired(self, deadline: float) -> list[int]:
        """Take out the copies made before ``deadline`` (a warm killed, a path that resolved
        to another name)."""
        gone = []
        while self._copies:
            relpath, copied = next(iter(self._copies.items()))
            if copied.at > deadline:
                break
            gone.append(self.take(relpath).fd)
        return gone

    def clear(self) -> list[int]:
        gone = [copied.fd for copied in self._copies.values()]
        self._copies.clear()
        self._bytes = 0
        return gone


class ReadAhead:
    """The daemon's end: warms' connections handed to the reader-ahead process (started at
    the first), and the copies it made taken into the cache as their FETCHes come
    (:meth:`install`).  ``admission`` None: no read-ahead (a cluster's admission depends on
    its members, which only the daemon follows)."""

    def __init__(self, remote_root: str, store: CacheStore, mountpoint: str,
                 admission: FractionAdmission | None,
                 count_read: Callable[[int], None] = lambda nbytes: None) -> None:
        self._argv = [remote_root, str(store.layout.root), mountpoint]
        if admission is not None:
            self._argv += [repr(admission.fraction), str(admission.seed)]
        self._store = store
        self._count_read = count_read
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._answering: threading.Thread | None = None  # reads what the process tells
        self._started_at = -RESTART_SECONDS
        self._closed = admission is None
        self._waiting = _Waiting()  # the copies the reader-ahead made, not taken yet
        self.warms = 0  # connections handed to the reader-ahead
        self.open = 0  # of those, not ended yet (as far as it told)
        self.read = 0  # paths it read in (of the warms that ended)
        self.left = 0  # paths it left alone (of the warms that ended)
        self.copied = 0  # copies it made
        self.installed = 0  # of those, taken into the cache
        self.out_of_descriptors = 0  # copies the daemon could not receive

    def take(self, conn: socket.socket, uid: int) -> str | None:
        """Hand the warm's connection ``conn`` (a caller of ``uid``) to the reader-ahead: None
        once it has it, else why not, in a few words.  ``conn`` stays the caller's to
        close."""
        with self._lock:
            if self._closed:
                return "no read-ahead here"
            if self.open >= MAX_STREAMS:
                return f"{MAX_STREAMS} warms read ahead already"
            running = self._running_locked()
            if running is None:
                return "the reader-ahead is not running"
            try:
                socket.send_fds(running, [b"%d" % uid], [conn.fileno()])
            except OSError as exc:  # it died, or is stuck: started again at a later warm
                self._stop_locked()
                return f"the reader-ahead is gone ({exc.strerror or 'stuck'})"
            self.warms += 1
            self.open += 1
            return None

    def install(self, relpath: str, key: bytes, attr: Attr) -> bool:
        """Take the reader-ahead's copy of ``relpath`` into the cache, when it made one of
        the version ``attr`` says: whether the cache holds the file now.  A copy of another
        version is removed; the caller fetches the file as ever."""
        with self._lock:
            copied = self._waiting.take(relpath)
        if copied is None:
            return False
        try:
            if copied.version != attr.version or not self._store.install_ahead(
                    key, attr, (copied.checksum,), copied.allocated, copied.fd):
                if not self._store.admitting:  # the copies would go for nothing a while
                    self._pause_copies()
                return False
        finally:
            os.close(copied.fd)
        self._count_read(attr.size)
        with self._lock:
            self.installed += 1
        return True

    def _pause_copies(self) -> None:
        with self._lock:
            sock = self._socket
            if sock is None:
                return
            try:
                # Only when it has room (a socket with a timeout waits for room even when
                # asked not to): else it hears at the next failed install.
                if select.select([], [sock], [], 0)[1]:
                    sock.send(_PAUSE)
            except OSError:
                pass

    def _answers(self, sock: socket.socket) -> None:
        """What the reader-ahead tells, on a thread of its own: the copies it made, and the
        counts of each warm as it ends.  The store is looked in, and copies closed,
        outside the lock."""
        while True:
            fds: list[int] = []
            try:
                message, fds, flags, _ = socket.recv_fds(sock, MESSAGE_BYTES,
                                                         COPIES_PER_MESSAGE)
                if flags & socket.MSG_CTRUNC:  # out of descriptors: these copies dropped
                    _close_all(fds)
                    with self._lock:
                        self.out_of_descriptors += message.count(b"\n")
                    fds, message = [], None
            except TimeoutError:
                message = None
            except OSError:
                message = b""
            ended, copies = None, []
            try:
                if message:
                    ended, copies = _parse(message, fds)
            except ValueError:  # never from the reader-ahead: not trusted further
                log.warning("the reader-ahead told what cannot be read: ignored")
                _close_all(fds)
            # A copy whose FETCH came first (the reader-ahead fell behind) is of a file held
            # already: dropped at once, else it would hold a place of the bounded table
            # from copies still ahead of their FETCHes until it expired.  (The store closes
            # only once this thread has ended: close.)
            held = {copied.fd for relpath, copied in copies
                    if self._store.whole(relpath, copied.version) is not None}
            gone = list(held)
            with self._lock:
                if self._socket is not sock:
                    gone = [copied.fd for _, copied in copies]
                    copies = []
                elif message == b"":  # it ended: its warms went on without advice
                    self.open = 0
                if ended is not None:
                    self.open = max(0, self.open - 1)
                    self.read += ended[0]
                    self.left += ended[1]
                self.copied += len(copies)
                for relpath, copied in copies:
                    if copied.fd not in held:
                        gone += self._waiting.add(os.fsdecode(relpath), copied)
                gone += self._waiting.expired(time.monotonic() - COPY_KEPT_SECONDS)
                stopped = self._socket is not sock or message == b""
            _close_all(gone)
            if stopped:
                return

    def _running_locked(self) -> socket.socket | None:
        if self._process is not None and self._process.poll() is None:
            return self._socket
        if self._process is not None:
            log.warning("the reader-ahead ended (status %s)", self._process.returncode)
            self._stop_locked()
        now = time.monotonic()
        if self._closed or now - self._started_at < RESTART_SECONDS:
            return None
        self._started_at = now
        # Each copy waiting is a descriptor of the daemon's: a share of its limit, as the
        # held files' (mirrorfs.py) is.
        self._waiting.most = min(COPIES_AHEAD,
                                 resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        # Messages, not a stream: each warm's descriptor comes with its own uid, and each
        # batch of copies whole.
        mine, its = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # A session of its own: a Ctrl-C at the daemon's terminal is the daemon's.
            self._process = subprocess.Popen(
                [sys.executable, "-m", "cachefs.prefetch.readahead", *self._argv],
                stdin=its, stdout=subprocess.DEVNULL, env=env, start_new_session=True)
        except OSError as exc:
            mine.close()
            log.warning("cannot start the reader-ahead (%s): warms read nothing ahead", exc)
            return None
        finally:
            its.close()
        # A reader-ahead that takes no new warm within this long is taken for stuck.
        mine.settimeout(SEND_SECONDS)
        self._socket = mine
        self._answering = threading.Thread(target=self._answers, args=(mine,),
                                           name="reader-ahead", daemon=True)
        self._answering.start()
        try:
            # Its waits are its own, on any CPU: the daemon's threads may keep to one
            # (service/affinity.py), which the process inherited.
            os.sched_setaffinity(self._process.pid, limits.ALLOWED_CPUS)
        except OSError:
            pass
        return mine

    def _stop_locked(self) -> None:
        process, self._process = self._process, None
        sock, self._socket = self._socket, None
        self.open = 0
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the answers' thread in its recv
            except OSError:
                pass
            sock.close()  # it ends at that, its warms' connections with it
        _close_all(self._waiting.clear())
        if process is None:
            return
        try:
            process.wait(CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            try:
                process.wait(CLOSE_SECONDS)
            except subprocess.TimeoutExpired:  # in a wait on the remote no signal ends
                log.warning("the reader-ahead (pid %d) does not end; left to end by itself",
                            process.pid)

    def figures(self) -> dict:
        """For `cachefs status`: its pid while it runs; the warms handed to it and those
        still reading ahead; the copies it made, those taken into the cache and those
        dropped for want of room (past COPIES_AHEAD, COPIES_AHEAD_BYTES or the daemon's
        descriptors), whose FETCHes filled the files themselves; the paths of the ended
        warms it read in and left alone."""
        with self._lock:
            process = self._process
            running = process is not None and process.poll() is None
            return {"pid": process.pid if running else None, "warms": self.warms,
                    "open": self.open, "copied": self.copied, "installed": self.installed,
                    "dropped": self._waiting.refused + self.out_of_descriptors,
                    "read": self.read, "left": self.left}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            answering, self._answering = self._answering, None
            self._stop_locked()
        # The store closes after this: an answer being handled still looks in it.
        if answering is not None:
            answering.join(CLOSE_SECONDS)


# -- the reader-ahead process -------------------------------------------------------------


def read_ahead_one(remote_root: str, layout: CacheLayout, uid: int, relpath: bytes,
                   open_times: OpenTimes | None = None) -> tuple[int, Version] | None:
    """Have the kernel read ``relpath`` of the remote in, for a caller of ``uid``: its open
    descriptor (the caller's to close) and version once asked, else None.  Only a regular
    file the caller may read, not cached whole already.  The open of the remote file is
    timed into ``open_times``."""
    path = os.path.join(os.fsencode(remote_root), relpath)
    try:
        before = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(before.st_mode) or not _readable_by(before, uid):
            return None  # nothing but a regular file is ever opened (a FIFO, a device)
        began = time.monotonic()
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        if open_times is not None:
            open_times.add(time.monotonic() - began)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        version = Version(st.st_size, st.st_mtime_ns)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino) or not st.st_size \
                or _cached(layout, relpath, version):
            os.close(fd)
            return None
        os.posix_fadvise(fd, 0, min(st.st_size, READ_AHEAD_BYTES), os.POSIX_FADV_WILLNEED)
        return fd, version
    except OSError:
        os.close(fd)
        return None


def _readable_by(st: os.stat_result, uid: int) -> bool:
    """Whether a caller of ``uid`` may read the file: the owner or anyone may (a group's
    members are not told apart here: left alone, as advice may be)."""
    return uid == 0 or st.st_mode & stat.S_IROTH != 0 \
        or (st.st_uid == uid and st.st_mode & stat.S_IRUSR != 0)


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
    (O_TMPFILE under tmp/), handed to the daemon with what they hold in batches of
    COPIES_PER_MESSAGE; the daemon links one in as its FETCH takes it and closes the rest,
    so a copy no FETCH takes, or one a crash cut short, goes with its last descriptor, and
    none ever has a name to be swept.  The daemon bounds those waiting (COPIES_AHEAD,
    COPIES_AHEAD_BYTES); a warm's own lookahead (AHEAD_PATHS) keeps them under that."""

    def __init__(self, tmp_dir: str, daemon: socket.socket) -> None:
        self._tmp_dir = tmp_dir
        self._daemon = daemon
        self._told: list[bytes] = []
        self._fds: list[int] = []  # the copies of the lines in _told
        self._paused_until = 0.0

    def copy(self, src: int, relpath: bytes, version: Version) -> bool:
        """Copy the open remote file ``src`` (``version`` of ``relpath``) ahead: whether a
        copy was made."""
        if version.size > COPY_AHEAD_MAX_BYTES or time.monotonic() < self._paused_until:
            return False
        try:
            out = os.open(self._tmp_dir, os.O_RDWR | os.O_TMPFILE | os.O_CLOEXEC, 0o600)
        except OSError:  # the disk refused it, or its file system makes no unnamed files
            self.pause()
            return False
        outcome = fill_into(src, out, version)
        if outcome.kind != COPIED:
            os.close(out)
            if outcome.kind == DISK:
                self.pause()  # the cache disk refused it; else the remote's: read it in
            return False
        self._fds.append(out)
        self._told.append(b"%d %d %d %d %s" % (version.size, version.mtime_ns,
                                               outcome.allocated, outcome.checksums[0],
                                               relpath))
        if len(self._told) >= COPIES_PER_MESSAGE:
            self.tell()
        return True

    def pause(self) -> None:
        self._paused_until = time.monotonic() + DISK_PAUSE_SECONDS

    def tell(self) -> None:
        """Hand the daemon the copies made since it was last told."""
        if self._told:
            told, fds = self._told, self._fds
            self._told, self._fds = [], []
            try:
                socket.send_fds(self._daemon, [_COPIES + b"\n" + b"\n".join(told)], fds)
            except OSError as exc:
                # Too many descriptors on their way to a daemon that is slow to take them:
                # these copies are dropped.  Anything else is the daemon gone.
                if exc.errno != errno.ETOOMANYREFS:
                    raise
            finally:
                _close_all(fds)


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)


class _Warm:
    """One warm's connection, as the reader-ahead reads it."""

    def __init__(self, sock: socket.socket, uid: int) -> None:
        self.sock = sock
        self.uid = uid
        self.pending = b""
        self.read = 0
        self.left = 0


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

    def take(self, warm: _Warm, data: bytes) -> None:
        """Read in each path of ``data`` (the lines ``warm`` sent), all of them first, so
        that the disk reads them at once; then copy ahead what the copier has room for."""
        *lines, warm.pending = (warm.pending + data).split(b"\n")
        if len(warm.pending) > 4 * 4096:  # no path is this long: not a warm's list
            warm.pending = b""
        opened = []
        for line in lines:
            done = self._one(warm.uid, line)
            if done is None:
                warm.left += 1
            else:
                warm.read += 1
                opened.append(done)
        for relpath, fd, version in opened:
            try:
                self.copier.copy(fd, relpath, version)
            finally:
                os.close(fd)
        self.copier.tell()

    def _one(self, uid: int, raw: bytes) -> tuple[bytes, int, Version] | None:
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
        done = read_ahead_one(self.remote_root, self.layout, uid, key, self.open_times)
        return None if done is None else (key, *done)


def _newest(warm: _Warm) -> bytes:
    """What ``warm``'s connection sent since it was last read, but for the paths of it the
    reader-ahead is too late for: of more than NEWEST_PATHS waiting, the older ones are left
    to their FETCHes (counted as left alone), so that what it copies is still ahead of them.
    Empty once the warm has closed its end."""
    pieces = []
    flags = 0
    while True:
        try:
            piece = warm.sock.recv(65536, flags)
        except BlockingIOError:
            break
        except OSError:
            piece = b""
        if not piece:
            if not pieces:
                return b""
            break
        pieces.append(piece)
        flags = socket.MSG_DONTWAIT
    data = b"".join(pieces)
    if data.count(b"\n") > NEWEST_PATHS:
        start = len(data)
        for _ in range(NEWEST_PATHS + 1):
            start = data.rindex(b"\n", 0, start)
        warm.left += data.count(b"\n", 0, start + 1)  # the lines ending at start, too
        warm.pending = b""
        data = data[start + 1:]
    return data


def main(argv: list[str] | None = None) -> int:
    remote_root, cache_dir, mountpoint, fraction, seed = \
        (argv if argv is not None else sys.argv[1:])[:5]
    daemon = socket.socket(fileno=0)  # a socket pair's end: a message per warm, with its uid
    # The daemon's cache, its names only: this process opens nothing of it but data files
    # (read) and its copies under tmp/ (created).
    layout = CacheLayout(Path(cache_dir), CHUNK_BYTES)
    reader = _Reader(remote_root, layout, mountpoint,
                     FractionAdmission(float(fraction), int(seed)),
                     _Copier(str(layout.tmp_dir), daemon))
    selector = selectors.DefaultSelector()
    selector.register(daemon, selectors.EVENT_READ, None)
    while True:
        for key, _ in selector.select():
            warm = key.data
            if warm is None:
                message, fds, _, _ = socket.recv_fds(daemon, 64, 1)
                if not message:  # the daemon closed its end: its stop
                    return 0
                for fd in fds[1:]:
                    os.close(fd)
                if message == _PAUSE and not fds:
                    reader.copier.pause()
                    continue
                if fds:
                    # Left blocking (its file status is the daemon's too until the daemon
                    # has answered on it): read only once the selector says it is readable.
                    sock = socket.socket(fileno=fds[0])
                    selector.register(sock, selectors.EVENT_READ,
                                      _Warm(sock, int(message.strip() or b"0")))
                continue
            data = _newest(warm)
            try:
                if data:
                    reader.take(warm, data)
                    continue
                selector.unregister(warm.sock)
                warm.sock.close()
                daemon.sendall(_ENDED + b"\n%d %d" % (warm.read, warm.left))
            except OSError:  # the daemon is gone
                return 0


if __name__ == "__main__":
    sys.exit(main())
