"""Reading a warm's files ahead of its fetches, in a process of its own.

A fetch of a file from a remote whose opens are fast (a local disk, an NFS client that holds
delegations) waits on the remote twice: for the name's inode and for the data.  Each wait,
in the daemon, is its thread sleeping, another taking the interpreter lock, and the first
woken for its turn again: a warm of 100,000 files of 4 KiB from a local tree with a cold
page cache cost the daemon 200 - 210 us of CPU per file, where the same fill from pages
already read costs it some 130.  ``cachefs warm`` reads its list ahead of its FETCHes and
tells the daemon each path it will fetch (AHEAD); the daemon keeps what it would fetch (the
fraction admits it) and hands it on to a reader-ahead, a process of its own, which opens the
remote file and asks the kernel to read it in (posix_fadvise WILLNEED), asynchronously, one
file after the other.  Its waits are its own: each of its lines costs the daemon a few
microseconds, and the fetch finds the inode and the pages read.  That warm, 3 runs in turns:
6,141 - 7,006 files/s at 168 - 186 us of CPU per file, the reader-ahead's (some 30)
included, against 4,669 - 4,936 at 192 - 202; a million files, 2 runs: 5,618 - 5,797 against
4,358 - 4,639.  Done in the daemon instead, on the thread of the AHEAD connection, it saved
nothing (4,781 - 4,915 files/s against 4,516 - 4,918): the waits moved to that thread.

Advice only, bounded and never waited for: a path the reader-ahead has no room for in its pipe
is dropped; it reads at most READ_AHEAD_BYTES of a file; a file the cache holds (its check
mark, mark.py) or one the caller may not read is left alone; an open remote file is never
held.  It reads nothing of a remote whose opens take a round trip: one open at a time would
fall behind the warm's concurrent fetches, which cover that latency themselves.  A reader-ahead
that dies is started again at the next path, at most once per RESTART_SECONDS; one stuck on a
remote that stopped answering holds nothing up (its pipe fills, paths are dropped), and the
daemon's stop waits for it CLOSE_SECONDS, then as long again once killed.  The last paths of
a warm, fewer than BATCH_PATHS that no later path sends on, are not read ahead.

Thread safety (daemon side): ``_lock`` guards the process, its pipe and the batch; it is a
leaf lock, and no write waits under it (the pipe does not block).
"""

from __future__ import annotations

import logging
import os
import select
import stat
import subprocess
import sys
import threading
import time

from cachefs import limits
from cachefs.attr import Version
from cachefs.store.index import data_key
from cachefs.store.layout import data_name
from cachefs.store.mark import marked_as

log = logging.getLogger(__name__)

# At most this much of a file is read ahead: all of a training example, the start of a
# larger file, whose own copy reads ahead of itself.  A warm reads its list AHEAD_PATHS
# (warm.py) ahead, so this bounds what it puts in the page cache before it is fetched.
READ_AHEAD_BYTES = 256 * 2**10
# Paths are written to the reader-ahead this many at a time, or once the first of them has
# waited this long (at the next path).
BATCH_PATHS = 32
BATCH_SECONDS = 0.005
RESTART_SECONDS = 10.0
CLOSE_SECONDS = 1.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ReadAhead:
    """The daemon's end: paths handed on to the reader-ahead process (started at the first)."""

    def __init__(self, remote_root: str, data_dir: str) -> None:
        self._remote_root = remote_root
        self._data_dir = data_dir
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._started_at = -RESTART_SECONDS
        self._batch: list[bytes] = []
        self._batch_since = 0.0
        self._closed = False
        self.sent = 0  # paths handed to the reader-ahead
        self.dropped = 0  # paths it had no room for, or handed to none

    def submit(self, relpath: str, uid: int) -> None:
        """Read ``relpath`` ahead for a caller of ``uid``, soon."""
        line = b"%d %s\n" % (uid, os.fsencode(relpath))
        with self._lock:
            if not self._batch:
                self._batch_since = time.monotonic()
            self._batch.append(line)
            if len(self._batch) >= BATCH_PATHS \
                    or time.monotonic() - self._batch_since >= BATCH_SECONDS:
                self._write_locked()

    def _write_locked(self) -> None:
        lines, self._batch = self._batch, []
        process = self._running_locked()
        # Written PIPE_BUF at most at a time, whole lines: such a write to a pipe goes in
        # whole or not at all, so a line is never cut (a longer one is dropped).
        chunk = b""
        for line in lines:
            if process is None or len(line) > select.PIPE_BUF:
                self.dropped += 1
                continue
            if len(chunk) + len(line) > select.PIPE_BUF:
                process = self._write_chunk_locked(process, chunk)
                chunk = b""
            chunk += line
        if chunk:
            self._write_chunk_locked(process, chunk)

    def _write_chunk_locked(self, process: subprocess.Popen | None,
                            chunk: bytes) -> subprocess.Popen | None:
        """Write ``chunk`` to ``process`` (None: it died); the process to write to next."""
        lines = chunk.count(b"\n")
        if process is None:
            self.dropped += lines
            return None
        try:
            os.write(process.stdin.fileno(), chunk)
            self.sent += lines
            return process
        except BlockingIOError:  # it is behind: this advice would come late anyway
            self.dropped += lines
            return process
        except OSError:  # it died: started again at a later path
            self.dropped += lines
            self._stop_locked()
            return None

    def _running_locked(self) -> subprocess.Popen | None:
        if self._process is not None and self._process.poll() is None:
            return self._process
        if self._process is not None:
            log.warning("the reader-ahead ended (status %s)", self._process.returncode)
            self._stop_locked()
        now = time.monotonic()
        if self._closed or now - self._started_at < RESTART_SECONDS:
            return None
        self._started_at = now
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        try:
            # A session of its own: a Ctrl-C at the daemon's terminal is the daemon's.
            self._process = subprocess.Popen(
                [sys.executable, "-m", "cachefs.remote.readahead", self._remote_root,
                 self._data_dir], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                env=env, start_new_session=True)
        except OSError as exc:
            log.warning("cannot start the reader-ahead (%s): a warm reads nothing ahead", exc)
            return None
        os.set_blocking(self._process.stdin.fileno(), False)
        try:
            # Its waits are its own, on any CPU: the daemon's threads may keep to one
            # (service/affinity.py), which the process inherited.
            os.sched_setaffinity(self._process.pid, limits.ALLOWED_CPUS)
        except OSError:
            pass
        return self._process

    def _stop_locked(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            process.stdin.close()
        except OSError:
            pass
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
        """For `cachefs status`: its pid while it runs, the paths sent to it and dropped."""
        with self._lock:
            process = self._process
            running = process is not None and process.poll() is None
            return {"pid": process.pid if running else None, "sent": self.sent,
                    "dropped": self.dropped}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._batch.clear()
            self._stop_locked()


# -- the reader-ahead process -------------------------------------------------------------


def read_ahead_one(remote_root: str, data_dir: str, uid: int, relpath: bytes) -> bool:
    """Have the kernel read ``relpath`` of the remote in, for a caller of ``uid``: whether
    it did.  Only a regular file the caller may read, not cached whole already."""
    path = os.path.join(os.fsencode(remote_root), relpath)
    try:
        before = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(before.st_mode) or not _readable_by(before, uid):
            return False  # nothing but a regular file is ever opened (a FIFO, a device)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
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


def main(argv: list[str] | None = None) -> int:
    remote_root, data_dir = (argv if argv is not None else sys.argv[1:])[:2]
    for line in sys.stdin.buffer:  # ends when the daemon closes its end
        uid, _, relpath = line.rstrip(b"\n").partition(b" ")
        # The daemon sends normalized paths (paths.normalize): never one that climbs out.
        if uid.isdigit() and relpath and not relpath.startswith((b"/", b"../")):
            read_ahead_one(remote_root, data_dir, int(uid), relpath)
    return 0


if __name__ == "__main__":
    sys.exit(main())
