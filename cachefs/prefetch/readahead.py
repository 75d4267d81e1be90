"""Reading and copying a warm's files ahead of its fetches, in a process of its own
(aheadprocess.py): the daemon's end, the design, and what the two tell each other.

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
of its own (READ-AHEAD), and the daemon hands that connection, with the caller, to the
reader-ahead (SCM_RIGHTS over a socket pair), which reads the paths from it itself.

A reader-ahead is one core's work at most: over a million files of 4 KiB it was busy 89 % of
its time, and set the warm's pace with the host 17 % idle.  The daemon runs PROCESSES of
them (one for each core it may use, 4 at most), and a warm opens a READ-AHEAD connection
to each (the daemon's answer says how many; each goes to the process reading the fewest),
dealing its list among them a batch of BATCH_PATHS at a time: each reads and copies its
share and tells the warm of it on its own connection, at its own pace.

Nor do most of its fills, nor their FETCHes: a small file (COPY_AHEAD_MAX_BYTES) the
reader-ahead also copies ahead, as a fill process copies, hashes and marks a file
(fillprocess.fill_into), into an unnamed file of the cache's disk (O_TMPFILE), which it hands
to the daemon with the remote file's attributes, COPIES_PER_MESSAGE copies to a numbered
batch.  The daemon links each copy in at its data file's name and indexes it, as a fill is
(CacheStore.install_ahead), and answers which it took in: not a file it holds or fills
already (its FETCH came first), nor one that does not fit.  The reader-ahead tells the warm,
on its connection, the lines whose copies were taken in (their size and the line), which
need no FETCH, and then how many of its lines it is done with; the warm fetches a line only
once the reader-ahead is done with it (or has said nothing for a while: warm.py), so that
the two do not fill the same file.  A FETCH costs the daemon the request, the name's
resolution, two looks in the index and the answer (some 70 us of its CPU per file): a
warm's files need none but the few the reader-ahead left.
100,000 files of 4 KiB of a million, pages dropped, on a busy 2-core host, 3 runs in turns:
4,750 - 5,262 files/s at 126 - 147 us of the daemon's CPU per file and 14 - 16 us of the
warm's, every file copied ahead, against 4,065 - 4,751 at 174 - 223 and 25 - 31 with a
FETCH of each (which took its copy in); the reader-ahead's own CPU stayed 170 - 190 us per
file.  (Taking the copies in as they came, the FETCHes still sent, was slower: 3,396 -
3,551 files/s, one thread taking in what four had.)

A FETCH that finds its file taken in before the warm was told of it says "fetched", as the
copy was its warm's; the daemon forgets the paths of a batch once the reader-ahead has told
them to their warm (TAKEN_IN_KEPT at most, TAKEN_IN_SECONDS at most).  A copy has a name
only once linked in: one the daemon did not take, or one a crash cut short, goes with its
last descriptor, and none is left behind to sweep.  While the cache takes no files (its
budget used, its disk refusing writes), the daemon tells the reader-ahead so, and it makes
no copy for DISK_PAUSE_SECONDS.  The reader-ahead takes a warm's lines in batches of
BATCH_PATHS, oldest first, opens them all (the disk reads them at once), then copies them.

Advice only, bounded and never waited long: the warm tells no more paths than it has room
for (AHEAD_PENDING_BYTES), nor waits for one longer than its pace allows
(AHEAD_STALL_FACTOR); the reader-ahead reads at most READ_AHEAD_BYTES of a file; a file the
cache holds (its check mark, mark.py) or one the caller may not read is left alone; an open
remote file is never held past the batch it came in.  It reads nothing of a remote whose
opens take a round trip (OpenTimes, remote.py: it times its own): one open at a time would
fall behind the warm's concurrent fetches, which cover that latency themselves, and add an
open of each file to theirs (a warm of 3,000 files from the EFS-like remote: 1,421 - 1,453
files/s read ahead against 1,496 - 1,509).  It then tries one path every SLOW_PROBE_SECONDS,
to see the remote fast again.  A reader-ahead that dies is started again at the next warm,
at most once per RESTART_SECONDS (the warms it served go on without advice); one stuck on a
remote that stopped answering holds a warm up once, for AHEAD_STALL_SECONDS or more, and the
daemon's stop waits for it CLOSE_SECONDS, then as long again once killed.  The daemon never
waits to answer it (its answers have room in the socket's buffer, SEND_BUFFER_BYTES), nor
does it to tell a warm (TOLD_BYTES at most waiting: past it, the warm's FETCHes find out).

Thread safety (daemon side): ``_lock`` guards the processes, their sockets, the paths taken
in and the figures; it is a leaf lock (the store is written to outside it).  What each
reader-ahead tells is read, and its copies taken in, on a thread of its own, which the
daemon's stop waits for before the store closes.  A reader-ahead is one thread.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from cachefs import limits
from cachefs.attr import Attr
from cachefs.prefetch.paths import Caller
from cachefs.store.admission import FractionAdmission
from cachefs.store.store import CacheStore

log = logging.getLogger(__name__)

# At most this much of a file is read ahead: all of a training example, the start of a
# larger file, whose own copy reads ahead of itself.  A warm reads its list AHEAD_PATHS
# (warm.py) ahead, so this bounds what it puts in the page cache before it is fetched.
READ_AHEAD_BYTES = 256 * 2**10
# Warms' connections read ahead at once, at most (each holds a descriptor in a reader-ahead).
MAX_STREAMS = 64
# Reader-ahead processes, each busy on a core of its own at a warm's full pace (one reads
# and copies some 5,000 files of 4 KiB a second): a warm's list is dealt among them, a batch
# to each in turn, over a connection to each.  No more than the cores the daemon may use
# (its affinity and its cgroups' CPU quota: more would only be throttled).
PROCESSES = max(1, min(4, limits.CORES))
# While the remote's opens are slow, one path is tried this often.
SLOW_PROBE_SECONDS = 0.25
RESTART_SECONDS = 10.0
CLOSE_SECONDS = 1.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Files of at most this many bytes are copied ahead (one chunk, one checksum), told to the
# daemon COPIES_PER_MESSAGE at a time (and at the end of what a warm sent at once).
COPY_AHEAD_MAX_BYTES = 1 << 20
COPIES_PER_MESSAGE = 32
# Batches of copies told to the daemon whose answer the reader-ahead still waits for, at
# most: the daemon never waits to send one, and one it could not send is given up on.
BATCHES_ASKED = 64
# The paths of the copies taken in, the newest TAKEN_IN_KEPT within TAKEN_IN_SECONDS: a FETCH
# of one (its warm had not heard yet) says "fetched", not "cached".
TAKEN_IN_KEPT = 4096
TAKEN_IN_SECONDS = 60.0
# What a warm is told at most, not read yet: past it, what it would be told is dropped (its
# FETCHes then find those files cached).
TOLD_BYTES = 1 << 20
# Paths of a warm taken at once, oldest first: read in all together, then copied.
BATCH_PATHS = 256
# What a warm sent that is not taken yet, at most (its own bound, AHEAD_PENDING_BYTES in
# warm.py, keeps under it): past it, the oldest lines are left to their FETCHes.
BUFFERED_BYTES = 2 << 20
# After the cache disk refused a copy, or the daemon said the cache takes none (PAUSE), none
# is made for this long.
DISK_PAUSE_SECONDS = 10.0
# A reader-ahead that takes no new warm within this long is taken for stuck.
SEND_SECONDS = 2.0
# While a warm that ended waits for the daemon's last answers, it is looked at this often.
ENDED_LOOK_SECONDS = 0.05
# What the reader-ahead tells the daemon, a message each: a batch of copies it made ("C"
# and the batch's number), a line each (the remote file's attributes, as Attr, its bytes on
# the disk, checksum, path); the paths a warm's connection sent that it read in or copied,
# and those it left (not admitted, cached, not readable, not a file, the remote slow), once
# that connection ended.
COPIES = b"C"
ENDED = b"E"
# ...and the batches whose copies taken in were told to their warms (which then send no
# FETCH for them), once every line of them went into the warms' sockets.
DELIVERED = b"D"
# What the daemon tells it besides the warms: which copies of a batch it took in ("T", the
# batch's number, then 1 or 0 for each line); the cache takes no copy now (its budget is
# used, its disk refused a write): none is made for DISK_PAUSE_SECONDS.
TAKEN = b"T"
PAUSE = b"P"
MESSAGE_BYTES = 1 << 18  # over COPIES_PER_MESSAGE lines of the longest paths
# A warm's caller as told with its connection (uid, gid, groups), at most: some 600 groups.
CALLER_BYTES = 4096


class _Said(NamedTuple):
    """A message of the reader-ahead's, read: one of a warm's counts as it ended (paths read
    in, left alone), a batch of copies (its number, each copy with its relpath), or the
    batches whose copies taken in every warm was told of."""

    ended: tuple[int, int] | None = None
    batch: int | None = None
    copies: tuple[tuple[bytes, _Copied], ...] = ()
    delivered: tuple[int, ...] = ()


def _parse(message: bytes, fds: list[int]) -> _Said:
    """A message of the reader-ahead's, with its descriptors ``fds`` (a copy's each, one a
    line).  ValueError for anything else (the caller closes ``fds``)."""
    head, _, body = message.partition(b"\n")
    if fds and not head.startswith(COPIES + b" "):
        raise ValueError(head)
    if head == ENDED:
        read, left = body.split()
        return _Said(ended=(int(read), int(left)))
    if head == DELIVERED:
        return _Said(delivered=tuple(map(int, body.split())))
    kind, batch = head.split()
    lines = body.split(b"\n")
    if kind != COPIES or len(lines) != len(fds):
        raise ValueError(kind)
    copies = []
    for line, fd in zip(lines, fds, strict=True):
        *fields, allocated, checksum, relpath = line.split(b" ", 10)
        copies.append((relpath, _Copied(Attr(*map(int, fields)), int(allocated),
                                        int(checksum), fd)))
    return _Said(batch=int(batch), copies=tuple(copies))


class _Copied(NamedTuple):
    """A copy the fill-ahead made of a file (of the remote's ``attr``): an unnamed file of
    the cache's disk (O_TMPFILE), open at ``fd`` (the daemon's to close)."""

    attr: Attr
    allocated: int
    checksum: int
    fd: int


class _Process:
    """One reader-ahead process as the daemon runs it: its end of their socket pair, the
    thread reading what it tells, and the warms' connections it reads now."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.popen: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.answering: threading.Thread | None = None
        self.started_at = -RESTART_SECONDS
        self.open = 0  # warms' connections handed to it, not ended yet (as far as it told)

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class ReadAhead:
    """The daemon's end: warms' connections handed to the reader-ahead processes (started
    as the first warms come), and the copies they made taken into the cache as they come.
    ``admission`` None: no read-ahead (a cluster's admission depends on its members, which
    only the daemon follows)."""

    def __init__(self, remote_root: str, store: CacheStore, mountpoint: str,
                 admission: FractionAdmission | None,
                 taken_in: Callable[[int], None] = lambda size: None,
                 processes: int = PROCESSES) -> None:
        self._argv = [remote_root, str(store.layout.root), mountpoint]
        if admission is not None:
            self._argv += [repr(admission.fraction), str(admission.seed)]
        self._store = store
        self._count_taken_in = taken_in  # with the size of each copy taken in
        self._lock = threading.Lock()
        self._processes = [_Process(number) for number in range(max(1, processes))]
        self._closed = admission is None
        # The copies taken in that their warms may FETCH still (not told of them yet), oldest
        # first: relpath -> when; and the paths taken in of each batch (by process and
        # batch number), until its warm was told of them.
        self._taken_in: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._undelivered: collections.OrderedDict[tuple[int, int], list[str]] = \
            collections.OrderedDict()
        self.warms = 0  # connections handed to the reader-ahead
        self.read = 0  # paths it read in (of the warms that ended)
        self.left = 0  # paths it left alone (of the warms that ended)
        self.copied = 0  # copies it made
        self.installed = 0  # of those, taken into the cache
        self.dropped = 0  # of those, not received (the daemon out of descriptors)

    @property
    def streams(self) -> int:
        """How many connections a warm reads ahead on: one per process, each with its share
        of the list."""
        return 0 if self._closed else len(self._processes)

    def take(self, conn: socket.socket, caller: Caller) -> str | None:
        """Hand the warm's connection ``conn`` (of ``caller``, whose rights the reader-ahead
        checks as a FETCH's resolution would) to the process reading the fewest: None once
        it has it, else why not, in a few words.  ``conn`` stays the caller's to close."""
        told = caller.encoded()
        if len(told) > CALLER_BYTES:
            return "the caller is in too many groups to read ahead for"
        with self._lock:
            if self._closed:
                return "no read-ahead here"
            if sum(process.open for process in self._processes) >= MAX_STREAMS:
                return f"{MAX_STREAMS} warms' connections read ahead already"
            for process in sorted(self._processes, key=lambda process: process.open):
                running = self._running_locked(process)
                if running is not None:
                    break
            else:
                return "the reader-ahead is not running"
            try:
                socket.send_fds(running, [told], [conn.fileno()])
            except OSError as exc:  # it died, or is stuck: started again at a later warm
                self._stop_locked(process)
                return f"the reader-ahead is gone ({exc.strerror or 'stuck'})"
            self.warms += 1
            process.open += 1
            return None

    def took(self, relpath: str) -> bool:
        """Whether the cache holds ``relpath`` by a copy made ahead whose warm was not told
        so (its FETCH of a cached file, the caller's, came first): that FETCH fetched it, as
        far as the warm is told.  Asked once."""
        with self._lock:
            return self._taken_in.pop(relpath, None) is not None

    def _take_in(self, relpath: bytes, copied: _Copied) -> bool:
        """Link ``copied`` in at its data file's name and index it, as a fill of the file
        would be (CacheStore.install_ahead); its descriptor is closed either way.  Not taken
        in: a file the cache holds or fills already (its FETCH came first), one outside the
        fraction, one that does not fit."""
        path = os.fsdecode(relpath)
        now = time.monotonic()
        with self._lock:
            # Kept before it is indexed: a FETCH that finds the file cached finds this too.
            taken_in = self._taken_in
            taken_in[path] = now
            while len(taken_in) > TAKEN_IN_KEPT or \
                    next(iter(taken_in.values())) < now - TAKEN_IN_SECONDS:
                taken_in.popitem(last=False)  # a warm that stopped listening, or killed
        try:
            installed = self._store.install_ahead(relpath, copied.attr, (copied.checksum,),
                                                  copied.allocated, copied.fd)
        finally:
            os.close(copied.fd)
        if installed:
            self._count_taken_in(copied.attr.size)
        with self._lock:
            if installed:
                self.installed += 1
            else:
                taken_in.pop(path, None)
        if not installed and not self._store.admitting:  # copies would go for nothing
            for process in self._processes:
                self._tell(process, PAUSE)
        return installed

    def _tell(self, process: _Process, message: bytes) -> None:
        """Tell ``process`` ``message`` when its socket has room now: the daemon never waits
        for it (the reader-ahead may itself be waiting to tell the daemon)."""
        with self._lock:
            sock = process.sock
            if sock is None:
                return
            try:
                # A socket with a timeout waits for room even when asked not to.
                if select.select([], [sock], [], 0)[1]:
                    sock.send(message)
            except OSError:
                pass

    def _answers(self, process: _Process, sock: socket.socket) -> None:
        """What ``process`` tells on ``sock``, on a thread of its own: the copies it made,
        taken into the cache as they come (and which were, told back), and the counts of
        each warm as it ends.  (The store closes only once this thread has ended: close.)"""
        while True:
            fds: list[int] = []
            try:
                message, fds, flags, _ = socket.recv_fds(sock, MESSAGE_BYTES,
                                                         COPIES_PER_MESSAGE)
                if flags & socket.MSG_CTRUNC:  # out of descriptors: these copies dropped
                    close_all(fds)
                    with self._lock:
                        self.dropped += message.count(b"\n")
                    fds, message = [], None
            except TimeoutError:
                message = None
            except OSError:
                message = b""
            said = _Said()
            try:
                if message:
                    said = _parse(message, fds)
            except ValueError:  # never from the reader-ahead: not trusted further
                log.warning("the reader-ahead told what cannot be read: ignored")
                close_all(fds)
            if said.batch is not None:
                self._take_in_batch(process, said.batch, said.copies)
            with self._lock:
                for batch in said.delivered:  # their FETCHes will not come: forgotten
                    for path in self._undelivered.pop((process.number, batch), ()):
                        self._taken_in.pop(path, None)
                current = process.sock is sock
                if current and message == b"":  # it ended: its warms went on without advice
                    process.open = 0
                if said.ended is not None:
                    process.open = max(0, process.open - 1)
                    self.read += said.ended[0]
                    self.left += said.ended[1]
                if not current or message == b"":
                    return

    def _take_in_batch(self, process: _Process, batch: int,
                       copies: Iterable[tuple[bytes, _Copied]]) -> None:
        """Take in a batch of copies, and tell ``process`` which were taken in."""
        taken = []
        for relpath, copied in copies:
            taken.append(os.fsdecode(relpath) if self._take_in(relpath, copied) else None)
        with self._lock:
            self.copied += len(taken)
            self._undelivered[process.number, batch] = [path for path in taken
                                                        if path is not None]
            # (one its process gave up on, BATCHES_ASKED behind, or of a process ended)
            if len(self._undelivered) > BATCHES_ASKED * len(self._processes):
                self._undelivered.popitem(last=False)
        self._tell(process, TAKEN + b" %d\n" % batch
                   + bytes(0x30 if path is None else 0x31 for path in taken))

    def _running_locked(self, process: _Process) -> socket.socket | None:
        if process.running():
            return process.sock
        if process.popen is not None:
            log.warning("the reader-ahead ended (status %s)", process.popen.returncode)
            self._stop_locked(process)
        now = time.monotonic()
        if self._closed or now - process.started_at < RESTART_SECONDS:
            return None
        process.started_at = now
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        # Messages, not a stream: each warm's descriptor comes with its own caller, and each
        # batch of copies whole.
        mine, its = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # A session of its own: a Ctrl-C at the daemon's terminal is the daemon's.
            process.popen = subprocess.Popen(
                [sys.executable, "-m", "cachefs.prefetch.aheadprocess", *self._argv],
                stdin=its, stdout=subprocess.DEVNULL, env=env, start_new_session=True)
        except OSError as exc:
            mine.close()
            log.warning("cannot start the reader-ahead (%s): warms read nothing ahead", exc)
            return None
        finally:
            its.close()
        # A reader-ahead that takes no new warm within this long is taken for stuck.
        mine.settimeout(SEND_SECONDS)
        process.sock = mine
        process.answering = threading.Thread(target=self._answers, args=(process, mine),
                                             name=f"reader-ahead-{process.number}",
                                             daemon=True)
        process.answering.start()
        try:
            # Its waits are its own, on any CPU: the daemon's threads may keep to one
            # (service/affinity.py), which the process inherited.
            os.sched_setaffinity(process.popen.pid, limits.ALLOWED_CPUS)
        except OSError:
            pass
        return mine

    def _stop_locked(self, process: _Process) -> None:
        popen, process.popen = process.popen, None
        sock, process.sock = process.sock, None
        process.open = 0
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the answers' thread in its recv
            except OSError:
                pass
            sock.close()  # it ends at that, its warms' connections with it
        if popen is None:
            return
        try:
            popen.wait(CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            popen.kill()
            try:
                popen.wait(CLOSE_SECONDS)
            except subprocess.TimeoutExpired:  # in a wait on the remote no signal ends
                log.warning("the reader-ahead (pid %d) does not end; left to end by itself",
                            popen.pid)

    def figures(self) -> dict:
        """For `cachefs status`: the pids of its processes that run; the warms' connections
        handed to them and those still reading ahead; the copies they made, those taken into
        the cache and those the daemon had no descriptors to receive; the paths of the ended
        warms read in and left alone."""
        with self._lock:
            return {"pids": [process.popen.pid for process in self._processes
                             if process.running()],
                    "warms": self.warms,
                    "open": sum(process.open for process in self._processes),
                    "copied": self.copied, "installed": self.installed,
                    "dropped": self.dropped, "read": self.read, "left": self.left}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            answering = [process.answering for process in self._processes]
            for process in self._processes:
                process.answering = None
                self._stop_locked(process)
        # The store closes after this: an answer being handled still looks in it.
        for thread in answering:
            if thread is not None:
                thread.join(CLOSE_SECONDS)


def close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        os.close(fd)
