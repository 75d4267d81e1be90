"""Reading a warm's files ahead of its fetches, in a process of its own.

A fetch of a file from a remote whose opens are fast (a local disk, an NFS client that holds
delegations) waits on the remote twice: for the name's inode and for the data.  Each wait,
in the daemon, is its thread sleeping, another taking the interpreter lock, and the first
woken for its turn again: a warm of 100,000 files of 4 KiB from a local tree with a cold
page cache cost the daemon 200 - 210 us of CPU per file, where the same fill from pages
already read costs it some 130.  ``cachefs warm`` reads its list ahead of its FETCHes and
tells each path it will fetch to a reader-ahead, a process of its own, which keeps what the
daemon would fetch (the fraction admits it), opens the remote file and asks the kernel to
read it in (posix_fadvise WILLNEED), asynchronously, one file after the other.  Its waits
are its own, and the fetch finds the inode and the pages read.  That warm, 3 runs in turns:
6,141 - 7,006 files/s at 168 - 186 us of CPU per file, the reader-ahead's (some 30)
included, against 4,669 - 4,936 at 192 - 202; a million files, 2 runs: 5,618 - 5,797 against
4,358 - 4,639.  Done in the daemon instead, on a thread of its own, it saved
nothing (4,781 - 4,915 files/s against 4,516 - 4,918): the waits moved to that thread.

The warm's paths never pass through the daemon's interpreter: the warm asks on a connection
of its own (READ-AHEAD), and the daemon hands that connection, with the caller's uid, to the
reader-ahead (SCM_RIGHTS over a socket pair), which reads the paths from it itself: a line
of the warm's that the daemon took cost its interpreter time, the lock the fetches take turns
at.  100,000 files of a million, pages dropped, on a busy host, in turns: 3,336 - 3,656
files/s at 172 - 188 us of the daemon's user CPU per file with the reader-ahead reading the
warm's connection, against 3,394 - 3,511 at 177 - 191 with the daemon taking each path (the
reader-ahead's own CPU rose from some 87 to 107 us per file, its normalizing and keeping of
the paths now its own, on the other core).

Advice only, bounded and never waited for: the warm drops paths the reader-ahead is too slow
to take; it reads at most READ_AHEAD_BYTES of a file; a file the cache holds (its check
mark, mark.py) or one the caller may not read is left alone; an open remote file is never
held.  It reads nothing of a remote whose opens take a round trip (OpenTimes, remote.py: it
times its own): one open at a time would fall behind the warm's concurrent fetches, which
cover that latency themselves, and add an open of each file to theirs (a warm of 3,000
files from the EFS-like remote: 1,421 - 1,453 files/s read ahead against 1,496 - 1,509).
It then tries one path every SLOW_PROBE_SECONDS, to see the remote fast again.  A
reader-ahead that dies is started again at the next warm, at most once per RESTART_SECONDS
(the warms it served go on without advice); one stuck on a remote that stopped answering
holds nothing up (the warm drops its paths), and the daemon's stop waits for it
CLOSE_SECONDS, then as long again once killed.

Thread safety (daemon side): ``_lock`` guards the process, its socket and the figures; it
is a leaf lock.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import stat
import subprocess
import sys
import threading
import time

from cachefs import limits
from cachefs.attr import Version
from cachefs.errors import NotInTree
from cachefs.prefetch.paths import normalize
from cachefs.remote.remote import OpenTimes
from cachefs.store.admission import FractionAdmission
from cachefs.store.index import data_key
from cachefs.store.layout import data_name
from cachefs.store.mark import marked_as

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
# What the reader-ahead tells the daemon as each warm's connection ends: the paths it read
# in, and those it left (not admitted, cached, not readable, not a file, the remote slow).
_DONE = b"%d %d\n"


class ReadAhead:
    """The daemon's end: warms' connections handed to the reader-ahead process (started at
    the first).  ``admission`` None: no read-ahead (a cluster's admission depends on its
    members, which only the daemon follows)."""

    def __init__(self, remote_root: str, data_dir: str, mountpoint: str,
                 admission: FractionAdmission | None) -> None:
        self._argv = [remote_root, data_dir, mountpoint]
        if admission is not None:
            self._argv += [repr(admission.fraction), str(admission.seed)]
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._socket: socket.socket | None = None
        self._started_at = -RESTART_SECONDS
        self._pending = b""  # a part of the reader-ahead's last line
        self._closed = admission is None
        self.warms = 0  # connections handed to the reader-ahead
        self.open = 0  # of those, not ended yet (as far as it told)
        self.read = 0  # paths it read in
        self.left = 0  # paths it left alone

    def take(self, conn: socket.socket, uid: int) -> str | None:
        """Hand the warm's connection ``conn`` (a caller of ``uid``) to the reader-ahead: None
        once it has it, else why not, in a few words.  ``conn`` stays the caller's to
        close."""
        with self._lock:
            if self._closed:
                return "no read-ahead here"
            self._collect_locked()
            if self.open >= MAX_STREAMS:
                return f"{MAX_STREAMS} warms read ahead already"
            running = self._running_locked()
            if running is None:
                return "the reader-ahead is not running"
            try:
                socket.send_fds(running, [b"%d\n" % uid], [conn.fileno()])
            except OSError as exc:  # it died: started again at a later warm
                self._stop_locked()
                return f"the reader-ahead is gone ({exc.strerror})"
            self.warms += 1
            self.open += 1
            return None

    def _collect_locked(self) -> None:
        """Take in what the reader-ahead told of the warms that ended."""
        if self._socket is None:
            return
        while True:
            try:
                data = self._socket.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # it ended: its warms went on without advice
                self.open = 0
                self._stop_locked()
                return
            *lines, self._pending = (self._pending + data).split(b"\n")
            for line in lines:
                read, _, left = line.partition(b" ")
                if read.isdigit() and left.isdigit():
                    self.open = max(0, self.open - 1)
                    self.read += int(read)
                    self.left += int(left)

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
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        # Messages, not a stream: each warm's descriptor comes with its own uid, never glued
        # to the next one's.
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
        mine.setblocking(False)
        self._socket = mine
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
        self._pending = b""
        self.open = 0
        if sock is not None:
            sock.close()  # it ends at that, its warms' connections with it
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
        """For `cachefs status`: its pid while it runs; the warms handed to it, those still
        reading ahead, and the paths of the ended ones it read in and left alone."""
        with self._lock:
            self._collect_locked()
            process = self._process
            running = process is not None and process.poll() is None
            return {"pid": process.pid if running else None, "warms": self.warms,
                    "open": self.open, "read": self.read, "left": self.left}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop_locked()


# -- the reader-ahead process -------------------------------------------------------------


def read_ahead_one(remote_root: str, data_dir: str, uid: int, relpath: bytes,
                   open_times: OpenTimes | None = None) -> bool:
    """Have the kernel read ``relpath`` of the remote in, for a caller of ``uid``: whether
    it did.  Only a regular file the caller may read, not cached whole already.  The open
    of the remote file is timed into ``open_times``."""
    path = os.path.join(os.fsencode(remote_root), relpath)
    try:
        before = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(before.st_mode) or not _readable_by(before, uid):
            return False  # nothing but a regular file is ever opened (a FIFO, a device)
        began = time.monotonic()
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        if open_times is not None:
            open_times.add(time.monotonic() - began)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino) or not st.st_size \
                or _cached(data_dir, relpath, Version(st.st_size, st.st_mtime_ns)):
            return False
        os.posix_fadvise(fd, 0, min(st.st_size, READ_AHEAD_BYTES), os.POSIX_FADV_WILLNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _readable_by(st: os.stat_result, uid: int) -> bool:
    """Whether a caller of ``uid`` may read the file: the owner or anyone may (a group's
    members are not told apart here: left alone, as advice may be)."""
    return uid == 0 or st.st_mode & stat.S_IROTH != 0 \
        or (st.st_uid == uid and st.st_mode & stat.S_IRUSR != 0)


def _cached(data_dir: str, relpath: bytes, version: Version) -> bool:
    """Whether the cache holds this version of the file whole, as its check mark says."""
    try:
        fd = os.open(f"{data_dir}/{data_name(data_key(relpath, version))}",
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return marked_as(fd, os.fstat(fd), version)
    finally:
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

    def __init__(self, remote_root: str, data_dir: str, mountpoint: str,
                 admission: FractionAdmission) -> None:
        self.remote_root = remote_root
        self.data_dir = data_dir
        self.mountpoint = mountpoint
        self.admission = admission
        self.open_times = OpenTimes(untimed=0.0)
        self._next_probe = 0.0

    def take(self, warm: _Warm, data: bytes) -> None:
        *lines, warm.pending = (warm.pending + data).split(b"\n")
        if len(warm.pending) > 4 * 4096:  # no path is this long: not a warm's list
            warm.pending = b""
        for line in lines:
            if self._one(warm.uid, line):
                warm.read += 1
            else:
                warm.left += 1

    def _one(self, uid: int, raw: bytes) -> bool:
        try:
            relpath = normalize(raw, self.mountpoint)
        except NotInTree:
            return False
        if not self.admission.eligible(relpath):
            return False
        if not self.open_times.fast:
            now = time.monotonic()
            if now < self._next_probe:
                return False
            self._next_probe = now + SLOW_PROBE_SECONDS
        return read_ahead_one(self.remote_root, self.data_dir, uid, os.fsencode(relpath),
                              self.open_times)


def main(argv: list[str] | None = None) -> int:
    remote_root, data_dir, mountpoint, fraction, seed = \
        (argv if argv is not None else sys.argv[1:])[:5]
    reader = _Reader(remote_root, data_dir, mountpoint,
                     FractionAdmission(float(fraction), int(seed)))
    daemon = socket.socket(fileno=0)  # a socket pair's end: a message per warm, with its uid
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
                if fds:
                    # Left blocking (its file status is the daemon's too until the daemon
                    # has answered on it): read only once the selector says it is readable.
                    sock = socket.socket(fileno=fds[0])
                    selector.register(sock, selectors.EVENT_READ,
                                      _Warm(sock, int(message.strip() or b"0")))
                continue
            try:
                data = warm.sock.recv(65536)
            except OSError:
                data = b""
            if data:
                reader.take(warm, data)
                continue
            selector.unregister(warm.sock)
            warm.sock.close()
            try:
                daemon.sendall(_DONE % (warm.read, warm.left))
            except OSError:
                return 0


if __name__ == "__main__":
    sys.exit(main())
