"""Fills copied and hashed by processes of their own (--fill-processes).

A fill on a thread of the daemon takes turns at the daemon's interpreter lock with the thread
serving the kernel's requests, and every system call either makes while the other wants the
lock is a futex wake and a context switch each way.  Against a fast remote (a local tree,
5,000 files of 64 KiB, 8 readers, 2 cores) a fill thread cost 340-350 us of CPU per file, 240
of it in the kernel, and perf put 43 % of the daemon's CPU in waking and switching threads
(24-32 voluntary context switches per file), where the same copy on an uncontended thread
(`cachefs warm`) costs about 100 us.  A fill process has an interpreter of its own: the
daemon sends it the remote file's descriptor (SCM_RIGHTS) and the temporary file the copy
goes to, and it copies (sendfile), hashes and answers with the checksums; the daemon renames
the copy into place and indexes it (CacheStore.install_placed), on one thread per process
that sleeps between answers.  The process never touches a name outside tmp/: a daemon that
dies leaves only temporary files, which every start sweeps.

The daemon sends a file to the process with the fewest under way, starting processes as
they are needed up to the number asked for, and a new one in place of one that died (its
fills fail: nothing was indexed, readers read the remote).  One that cannot start, or ends
before its first answer, tells that processes cannot work here (cachefs not importable by
the interpreter, say): the daemon logs it and its threads fill from then on.  A process copies up to
THREADS_PER_PROCESS files at once, for a remote whose copies wait.
A process ends when the daemon's end of its socket closes, and takes no new file once the
daemon is gone.

Thread safety (daemon side): ``_lock`` guards ``_workers`` and each worker's ``pending``,
``copies``, ``progress`` and ``copied``; it is a leaf lock.  Answers are handled, and a stuck
process found, on the worker's own ``fill-answers`` thread.
"""

from __future__ import annotations

import array
import errno
import itertools
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from cachefs import limits
from cachefs.attr import Version
from cachefs.errors import CacheCorrupt, CacheUnavailable, RemoteChanged
from cachefs.remote.copy import CopyWaits, send_checked
from cachefs.store.layout import allocated_bytes
from cachefs.store.store import copy_and_hash

log = logging.getLogger(__name__)

# A job: its number, the file's size and mtime, then the path of the copy; the remote
# file's descriptor rides along.
_JOB = struct.Struct("<Qqq")
# An answer: the job's number, the outcome, an errno; then for a file copied whole the bytes
# its copy takes on the disk and the checksums of its chunks; else a message.
_ANSWER = struct.Struct("<QBi")
_COPIED = struct.Struct("<q")
MESSAGE_BYTES = 1 << 16
COPIED, CHANGED, DISK, FAILED = range(4)
# Copies one process makes at once, at most (one per thread): a copy that waits on the remote
# waits outside the interpreter lock, so several cover a remote's latency (see _Turns).
THREADS_PER_PROCESS = 4
# How long a closing daemon waits for its fill processes to end before it kills them.
CLOSE_SECONDS = 1.0
# A process that ends this soon after its start without answering once cannot work here (it
# cannot import cachefs, say): fills go back to the daemon's threads rather than start
# process after process.
EARLY_END_SECONDS = 5.0
# Larger files are filled by the daemon's threads: an answer carries a checksum per chunk in
# one message of at most MESSAGE_BYTES.
MAX_FILE_BYTES = 16 * 2**30
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Outcome(NamedTuple):
    """How a fill sent to a process went."""

    kind: int
    errno: int = 0
    message: str = ""
    checksums: tuple[int, ...] = ()
    allocated: int = 0


# -- the fill process -----------------------------------------------------------------------

def fill_one(src: int, tmp: str, version: Version) -> Outcome:
    """Copy ``src`` into ``tmp`` and hash it: the outcome.  ``tmp`` is left for the daemon
    to rename into place when the copy is whole, removed otherwise."""
    try:
        out = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600)
    except OSError as exc:
        return Outcome(DISK, exc.errno or errno.EIO, f"creating the copy: {exc.strerror}")
    outcome = Outcome(FAILED)
    try:
        outcome = fill_into(src, out, version)
        return outcome
    finally:
        os.close(out)
        if outcome.kind != COPIED:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def fill_into(src: int, out: int, version: Version) -> Outcome:
    """Copy ``src`` into the new file ``out`` and hash it (and mark it, a file of one
    chunk): the outcome.  Also the copies a warm's reader-ahead makes
    (prefetch/aheadprocess.py)."""
    try:
        checksums, written = copy_and_hash(
            out, version, lambda fd: send_checked(src, fd, version))
        return Outcome(COPIED, checksums=checksums, allocated=allocated_bytes(written))
    except RemoteChanged as exc:
        return Outcome(CHANGED, message=str(exc))
    except CacheUnavailable as exc:
        cause = exc.__cause__
        return Outcome(DISK, getattr(cause, "errno", None) or errno.EIO, str(exc))
    except CacheCorrupt as exc:
        return Outcome(FAILED, errno.EIO, str(exc))
    except OSError as exc:
        return Outcome(FAILED, exc.errno or errno.EIO, exc.strerror or str(exc))


def _encode_answer(job: int, outcome: Outcome) -> bytes:
    head = _ANSWER.pack(job, outcome.kind, outcome.errno)
    if outcome.kind != COPIED:
        return head + outcome.message.encode(errors="replace")[:MESSAGE_BYTES // 2]
    return head + _COPIED.pack(outcome.allocated) + array.array("Q", outcome.checksums).tobytes()


def _decode_answer(data: bytes) -> tuple[int, Outcome]:
    job, kind, code = _ANSWER.unpack_from(data)
    rest = data[_ANSWER.size:]
    if kind != COPIED:
        return job, Outcome(kind, code, rest.decode(errors="replace"))
    (allocated,) = _COPIED.unpack_from(rest)
    checksums = tuple(array.array("Q", rest[_COPIED.size:]))
    return job, Outcome(kind, checksums=checksums, allocated=allocated)


class _Turns:
    """How many of a process's threads copy at once: one while copies wait on nothing (more
    would only take turns at the interpreter lock), THREADS_PER_PROCESS once most recent
    copies waited on the remote (``waits``), as the daemon's fill threads are added
    (handover.py).

    Thread safety: ``_cond`` guards ``_copying``."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._copying = 0
        self.waits = CopyWaits()

    def _allowed_locked(self) -> int:
        return THREADS_PER_PROCESS if self.waits.mostly_waiting else 1

    def take(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._copying < self._allowed_locked())
            self._copying += 1

    def give_back(self) -> None:
        with self._cond:
            self._copying -= 1
            self._cond.notify()


def serve(sock: socket.socket, turns: _Turns) -> None:
    """Fill what the daemon sends, until it closes its end or ends: this thread's turn first
    (taken before the job is read, so that a job waits in the socket, not on a thread)."""
    daemon = os.getppid()
    while True:
        turns.take()
        try:
            if not _serve_one(sock, daemon, turns.waits):
                return
        finally:
            turns.give_back()


def _serve_one(sock: socket.socket, daemon: int, waits: CopyWaits) -> bool:
    """Read one job, fill it (its copy counted in ``waits``), answer: False once there will
    be no more."""
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MESSAGE_BYTES, 1)
            break
        except InterruptedError:
            continue
        except OSError:
            return False
    for extra in fds[1:]:
        os.close(extra)
    if not data or os.getppid() != daemon:  # the daemon died with jobs queued: nobody
        for fd in fds[:1]:                  # would index them
            os.close(fd)
        return False
    job, size, mtime = _JOB.unpack_from(data)
    tmp = os.fsdecode(data[_JOB.size:])
    if not fds:
        outcome = Outcome(FAILED, errno.EBADF, "no remote file came with the job")
    else:
        try:
            outcome = waits.measure(fill_one, fds[0], tmp, Version(size, mtime))
        finally:
            os.close(fds[0])
    try:
        sock.send(_encode_answer(job, outcome))
    except OSError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python3 -m cachefs.remote.fillprocess SOCKET_FD (started by the daemon)",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon ends this process
    sock = socket.socket(fileno=int(args[0]))
    # Each thread takes the next job the socket holds: one copy at a time while the copies
    # are quick, several while they wait on the remote.
    turns = _Turns()
    threads = [threading.Thread(target=serve, args=(sock, turns), name=f"fill-{i}",
                                daemon=True)
               for i in range(THREADS_PER_PROCESS)]
    for thread in threads:
        thread.start()
    threads[0].join()  # the first to find the socket closed: the others may wait their turn
    return 0


# -- the daemon's side ----------------------------------------------------------------------

@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    sock: socket.socket
    started: float
    pending: dict[int, object] = field(default_factory=dict)
    copies: dict[int, str] = field(default_factory=dict)  # job -> its copy under tmp/
    answered: int = 0
    alive: bool = True
    # When its copies last grew, or it last answered, or took a job with none under way;
    # and how many bytes its copies under way held then.
    progress: float = 0.0
    copied: int = 0


class FillProcesses:
    """Up to ``count`` fill processes; ``on_done(context, outcome)`` is called once for every
    job :meth:`submit` took, on a thread of this class.  ``broken`` says why processes cannot
    be used here (one could not start, or ended at once), once that is known.

    A process with fills under way whose copies do not grow, and which answers none, for
    ``timeout_seconds`` waits on a remote that does not answer: it is killed, its fills fail
    (their room and temporary files given back at once, not when the remote answers) and
    ``on_stuck()`` says so.  SIGKILL ends it at the latest when its copy returns: it runs no
    code of its own after that, so it takes no further job.  (A copy that grows is not
    stuck, however long a large file takes.)"""

    def __init__(self, count: int, on_done: Callable[[object, Outcome], None],
                 timeout_seconds: float | None = None,
                 on_stuck: Callable[[], None] = lambda: None) -> None:
        self.count = max(1, count)
        self.broken: str | None = None
        self._on_done = on_done
        self._timeout = timeout_seconds
        self._on_stuck = on_stuck
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._jobs = itertools.count(1)
        self._closed = False

    def takes(self, size: int) -> bool:
        """Whether a file of ``size`` bytes goes to a process (else to a thread)."""
        return self.broken is None and size <= MAX_FILE_BYTES

    def submit(self, src: int, tmp: str, version: Version, context: object) -> bool:
        """Send a fill to a process: copy ``src`` (duplicated into it; the caller keeps its
        own) into ``tmp``.  False when none can take it now (it could not be started, or its
        socket is full): the file is filled at a later open."""
        job = next(self._jobs)
        message = _JOB.pack(job, version.size, version.mtime_ns) + os.fsencode(tmp)
        with self._lock:
            if self._closed or self.broken is not None:
                return False
            worker = self._pick_locked()
            if worker is None:
                return False
            if not worker.pending:
                worker.progress, worker.copied = time.monotonic(), 0
            worker.pending[job] = context
            worker.copies[job] = tmp
        try:
            socket.send_fds(worker.sock, [message], [src], socket.MSG_DONTWAIT)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                log.warning("a fill process did not take a file: %s", exc)
            with self._lock:
                worker.pending.pop(job, None)
                worker.copies.pop(job, None)
            return False

    def _pick_locked(self) -> _Worker | None:
        live = [w for w in self._workers if w.alive]
        self._workers = live
        idle = min(live, key=lambda w: len(w.pending), default=None)
        if idle is not None and (not idle.pending or len(live) >= self.count):
            return idle
        try:
            worker = self._start()
        except OSError as exc:
            self._break(f"a fill process could not start: {exc}")
            return None
        self._workers.append(worker)
        return worker

    def _start(self) -> _Worker:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The same cachefs as the daemon's, wherever the daemon's own working directory is.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT,
                                                          env.get("PYTHONPATH")]))
        try:
            # A session of its own: a Ctrl-C at the daemon's terminal is the daemon's to
            # handle (it ends its processes as it stops).
            process = subprocess.Popen(
                [sys.executable, "-m", "cachefs.remote.fillprocess", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        # Copies on CPUs of its own: the daemon's serving threads may keep to one
        # (service/affinity.py), which the process inherited.
        try:
            os.sched_setaffinity(process.pid, limits.ALLOWED_CPUS)
        except OSError:
            pass  # it ended already: found as any process that dies
        worker = _Worker(process, ours, time.monotonic())
        threading.Thread(target=self._answers, args=(worker,), name="fill-answers",
                         daemon=True).start()
        return worker

    def _answers(self, worker: _Worker) -> None:
        # Polled rather than a timeout on the socket, which would make submit's sends wait.
        poll = None if self._timeout is None else min(1.0, self._timeout / 4)
        stuck = False
        while True:
            try:
                if not select.select([worker.sock], [], [], poll)[0]:
                    if self._stuck(worker):
                        stuck = True
                        break
                    continue
                data = worker.sock.recv(MESSAGE_BYTES)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                break
            job, outcome = _decode_answer(data)
            with self._lock:
                worker.answered += 1
                worker.progress = time.monotonic()
                context = worker.pending.pop(job, None)
                worker.copies.pop(job, None)
            if context is not None:
                self._done(context, outcome)
        if stuck:
            worker.process.kill()
            log.error("a fill process copied nothing for %g s (the remote does not answer): "
                      "killed; its fills are read from the remote, filled at a later open",
                      self._timeout)
            self._on_stuck()
        # The process ended, is being closed or was killed: what it had is lost.
        with self._lock:
            worker.alive = False
            lost, worker.pending, worker.copies = list(worker.pending.values()), {}, {}
        worker.sock.close()
        for context in lost:  # given back before the wait: a killed copy may end late
            self._done(context, Outcome(FAILED, errno.ETIMEDOUT if stuck else errno.EPIPE,
                                        "the fill process ended"))
        code = worker.process.wait()
        if not self._closed and not stuck:
            if not worker.answered and time.monotonic() - worker.started < EARLY_END_SECONDS:
                self._break(f"a fill process ended with {code} before its first file")
            else:
                log.warning("a fill process ended with %s; %d fills lost (read from the "
                            "remote, filled at a later open)", code, len(lost))

    def _stuck(self, worker: _Worker) -> bool:
        """Whether ``worker``'s copies have made no progress for the timeout (on its answers
        thread: a stat of each copy under way, once a poll)."""
        with self._lock:
            if not worker.pending or self._closed:
                return False
            copies = list(worker.copies.values())
        copied = 0
        for tmp in copies:
            try:
                copied += os.stat(tmp).st_size
            except OSError:
                pass  # not begun yet, or just renamed into place
        now = time.monotonic()
        with self._lock:
            if copied != worker.copied:
                worker.progress, worker.copied = now, copied
            return now - worker.progress > self._timeout

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            log.error("%s: the daemon's threads fill from now on", why)

    def _done(self, context: object, outcome: Outcome) -> None:
        try:
            self._on_done(context, outcome)
        except Exception:
            log.exception("handling a fill's outcome failed")

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [w.process.pid for w in self._workers if w.alive]

    def close(self) -> None:
        """End every process: each sees its socket closed once its copy is done, and one
        still copying after CLOSE_SECONDS (a remote that does not answer) is killed; what
        either leaves under tmp/ the next start sweeps."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        for worker in workers:
            try:
                worker.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_SECONDS
        for worker in workers:
            try:
                worker.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()


if __name__ == "__main__":
    raise SystemExit(main())
