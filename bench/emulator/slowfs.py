"""slowfs: a read-only FUSE file system that behaves like AWS EFS or GCP Filestore from a node.

The kernel on our machines has no NFS client, so tests and benchmarks of cachefs need a stand-in
for the slow remote share. slowfs serves a plain local directory (SOURCE) at MOUNTPOINT and adds
what makes a network file system different from a local disk:

* latency: every metadata op (getattr, which includes the kernel's lookups of names, readdir,
  readlink, access, statfs, opendir) takes ``meta_ms``, every open ``open_ms``, every read
  ``read_ms``; errors from SOURCE (ENOENT...) come after the same latency;
* one shared link: all reads queue on a single link of ``bandwidth_mbps`` (MB = 1e6 bytes), so
  concurrent readers share the bandwidth while their latencies overlap;
* the client's attribute cache (NFS ``actimeo``): the kernel keeps entries and attributes for
  ``actimeo_s`` seconds (3 s, NFS's ``acregmin``, in the efs and filestore profiles; 0 in
  ``local``, so a change a test makes in SOURCE is visible through the mount at once), and a
  listing brings every entry's attributes with it (NFS READDIRPLUS, as FUSE's), so an lstat of
  each name just listed costs no round trip;
* the client's page cache, kept as NFS keeps it (close-to-open): an open asks the server for
  the file's attributes, and the pages the kernel holds of the file stay valid while the file
  is the same one, unchanged (inode, size, mtime and ctime as at the node's previous open);
  otherwise they are dropped before that open is answered, and any open answered meanwhile
  drops them itself, as an NFS client marks the inode's pages invalid for every reader.  Reads
  of cached pages never reach the emulator, so they pay no latency and no bandwidth, and a
  page that two readers (say, a reader handed the file and a copy of it into a cache) want is
  fetched once.  The kernel reads ahead ``READ_AHEAD_KB`` at a time, in requests of up to
  1 MiB, as an NFS client with ``rsize=1048576`` does;
* NFS semantics for open files: a read (or an lseek to the end) on a file that was removed or
  replaced in SOURCE since it was opened fails with ESTALE, as it does for a second NFS client;
* faults injected while mounted, through a control Unix socket (one JSON object per line, one
  JSON reply per line): ``fault`` (``errno`` or ``hang``), ``clear``, ``set``, ``stats``.

Fault filters: ``ops`` is a list of op names from FAULT_OPS (omitted: all of them); ``glob`` is
an fnmatch pattern matched against the path relative to the mount root, without a leading slash
(omitted: every path). The root itself is the empty string, so only ``*`` or an omitted glob
matches it, and ``*`` also matches across ``/`` (fnmatch semantics). A lookup of a name is the
``getattr`` of its path. An injected error fails the op at once, without its latency. A hang
holds the op until ``clear`` (then the op proceeds normally), for at most HANG_LIMIT_S, after
which it fails with ETIMEDOUT.

How it waits: slowfs speaks the kernel's low-level protocol through cachefs's own FUSE session
(cachefs/kernel/session.py). A request does its local work (lstat, open, pread) at once on a
serving thread and its answer is queued on one timer thread for the moment its latency has
passed; a hung request is parked until released. So a waiting request holds no thread, and the
emulator's own CPU per file is a small fraction of the latency it injects, which matters because
it shares the machine's cores with the daemon under test. ``python -m bench.emulator.remote_cost``
measures it (on a 2-core VM, efs profile, 8 readers of 64 KiB files: 0.39 ms per file, 5 % of
the 7.8 ms injected; the mfusepy version took 0.53 ms); ``stats`` reports ``cpu_seconds``.

Where it differs from a real NFS mount (on purpose or by FUSE's nature):

* a read of a page the kernel holds is served from memory even when the file was removed or
  rewritten in place since (an NFS client does the same until it revalidates at the next
  open); only reads that reach the emulator see ESTALE;
* a process blocked in a hung op cannot be killed until the hang is cleared or the daemon goes
  (a FUSE request in flight is uninterruptible), so always clear faults: EmulatedRemote.stop()
  does, and SIGTERM does;
* inode numbers are SOURCE's, so SOURCE should be a single file system; the kernel's node ids
  are one per path, so a file replaced under an open descriptor keeps its kernel inode (reads
  on it fail with ESTALE) while a new open gets the new file;
* release and releasedir take no latency and no faults (close() does not wait for them), nor
  do readdir's later pages of a listing (the listing is taken, and paid for, at its start);
* no extended attributes (EOPNOTSUPP), as on an NFS share without xattr support;
* permissions are the daemon's, as before: the kernel checks no mode bits (no
  default_permissions), access(2) is the daemon's own access(2) on SOURCE, and only the user
  who mounted may use the mount (no allow_other).

Usage::

    python -m bench.emulator.slowfs SOURCE MOUNTPOINT [--profile efs|filestore|local] [--meta-ms F]
        [--open-ms F] [--read-ms F] [--bandwidth-mbps F] [--actimeo-s F]
        [--control SOCKET] [--foreground] [--log-file FILE]
    python -m bench.emulator.slowfs ctl SOCKET '{"cmd": "stats"}'

Without --foreground the command returns once the mount serves (exit 0) or has failed (exit 1,
one line on stderr), like mount(8), and the daemon goes on in the background; without --log-file
a background daemon's log is discarded. SIGTERM, SIGINT and SIGHUP unmount cleanly.

Lock order: every lock here is a leaf (``Link._lock``, ``Faults._lock``, ``Timer._lock``,
``Emulator._lock``, ``SlowFS._lock``): none is held across a call that takes another, and
callbacks (a parked request's resume or fail, the timer's) run with no lock held.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import functools
import heapq
import itertools
import json
import logging
import math
import os
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from cachefs import remotewait
from cachefs.kernel import protocol as p
from cachefs.kernel.mount import MountOptions
from cachefs.kernel.mountpoint import find_mount
from cachefs.kernel.session import DEFERRED, Connection, Filesystem, Request, Session

log = logging.getLogger("slowfs")

# Names reach us as bytes; fault globs are matched against them decoded with this codec, which
# keeps names that are not valid UTF-8 (as mfusepy, the binding we used before, did).
FUSE_ENCODING = "utf-8"
FUSE_ERRORS = "surrogateescape"

REPO_ROOT = Path(__file__).resolve().parents[2]
FAULT_OPS = ("getattr", "readdir", "readlink", "access", "statfs", "opendir", "open", "read")
# The setting whose latency each op pays (release and releasedir pay none).
LATENCY_OF = {"getattr": "meta_ms", "readdir": "meta_ms", "readlink": "meta_ms",
              "access": "meta_ms", "statfs": "meta_ms", "opendir": "meta_ms",
              "open": "open_ms", "read": "read_ms"}
HANG_LIMIT_S = 3600.0
CONTROL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 20.0
# How far the kernel reads ahead of a sequential reader: what amazon-efs-utils sets for an
# EFS mount (Linux 5.4 lowered NFS's default to 128 KiB).
READ_AHEAD_KB = 15360


@dataclass
class Settings:
    """Latencies in milliseconds and the link's bandwidth in MB/s (None: no cap)."""

    meta_ms: float
    open_ms: float
    read_ms: float
    bandwidth_mbps: float | None
    actimeo_s: float = 0.0  # how long the kernel keeps entries and attributes

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a subset of settings after validating all of them (all or nothing)."""
        clean: dict[str, float | None] = {}
        for key, value in changes.items():
            if key not in Settings.__dataclass_fields__:
                raise ValueError(f"unknown setting {key!r}")
            if key == "bandwidth_mbps" and value in (None, 0):
                clean[key] = None
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{key} must be a number, not {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{key} must be a finite number >= 0, not {value!r}")
            clean[key] = float(value)
        for key, value in clean.items():
            setattr(self, key, value)


PROFILES: dict[str, Settings] = {
    # The EFS numbers are what we measured from one node (see shared/NOTES.md).
    "efs": Settings(meta_ms=0.5, open_ms=2.0, read_ms=2.0, bandwidth_mbps=200.0, actimeo_s=3.0),
    "filestore": Settings(meta_ms=0.3, open_ms=1.0, read_ms=1.0, bandwidth_mbps=400.0,
                          actimeo_s=3.0),
    "local": Settings(meta_ms=0.0, open_ms=0.0, read_ms=0.0, bandwidth_mbps=None),
}


class Link:
    """A single network link shared by all readers: transfers are served one after another.

    Thread safety: ``_lock`` guards ``_free_at``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0  # time.monotonic() at which the link has sent everything queued

    def reserve(self, ready_at: float, nbytes: int, mbps: float | None) -> float:
        """Queue nbytes that the server can start sending at ready_at; return when they arrive."""
        if not mbps:
            return ready_at
        with self._lock:
            start = max(ready_at, self._free_at)
            self._free_at = start + nbytes / (mbps * 1e6)
            return self._free_at


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.timerfd_create.argtypes = (ctypes.c_int, ctypes.c_int)
_libc.timerfd_settime.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec),
                                  ctypes.c_void_p)
CLOCK_MONOTONIC = 1  # the clock of time.monotonic()
TFD_CLOEXEC = os.O_CLOEXEC
TFD_TIMER_ABSTIME = 1


class Timer:
    """One thread that runs callbacks when they fall due: how a request waits without a thread
    of its own.

    The thread blocks in a read of a timerfd armed for the earliest callback. ``at`` re-arms it
    when the new callback is due first, which moves the kernel's timer without waking the
    thread: a request costs the timer one wake, when its answer is due. (A condition variable
    would wake the thread to re-arm its own timeout each time, a third of the wakes of an
    emulator serving one reader. os.timerfd_* comes with Python 3.13; until then, libc.)
    The timer fires SLACK_S after the earliest due time and runs everything due by then, as
    the kernel's timer slack does for a sleeping thread: answers due close together leave on
    one wake.

    Thread safety: ``_lock`` guards ``_heap``, ``_armed_at`` and the timerfd's setting;
    callbacks run on the timer's thread without it, one after another, so a callback must not
    block.
    """

    # The default timer slack of a Linux thread (prctl PR_SET_TIMERSLACK): how late a sleep
    # may end, and how late the mfusepy version's sleeping threads answered.
    SLACK_S = 50e-6

    def __init__(self) -> None:
        self._fd = _libc.timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC)
        if self._fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"timerfd_create: {os.strerror(code)}")
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._armed_at = math.inf  # when the timerfd fires next
        self._spec = _Itimerspec()
        self._spec_ref = ctypes.byref(self._spec)
        self._serial = itertools.count()  # orders callbacks due at the same time, first in first
        threading.Thread(target=self._run, name="timer", daemon=True).start()

    def at(self, due: float, callback: Callable[..., Any], *args: Any) -> None:
        """Run callback(*args) at time.monotonic() ``due`` (at once if that has passed)."""
        with self._lock:
            heapq.heappush(self._heap, (due, next(self._serial), callback, args))
            if due + self.SLACK_S < self._armed_at:
                self._arm_locked(due + self.SLACK_S)

    def _arm_locked(self, due: float) -> None:
        """Make the timerfd fire at ``due`` (a time past fires it at once)."""
        self._armed_at = due
        seconds = int(due)
        value = self._spec.it_value
        # A zero it_value would disarm the timer: the earliest time that is not zero.
        value.tv_sec, value.tv_nsec = seconds, max(int((due - seconds) * 1e9), 0 if seconds else 1)
        if _libc.timerfd_settime(self._fd, TFD_TIMER_ABSTIME, self._spec_ref, None):
            code = ctypes.get_errno()
            raise OSError(code, f"timerfd_settime: {os.strerror(code)}")

    def _run(self) -> None:
        heap = self._heap
        pop = heapq.heappop
        while True:
            os.read(self._fd, 8)  # the number of expiries: one wake is enough for them all
            with self._lock:
                now = time.monotonic()
                batch = []
                while heap and heap[0][0] <= now:
                    batch.append(pop(heap))
                # A one-shot timerfd that fired is disarmed: arm it for what is left.
                self._armed_at = math.inf
                if heap:
                    self._arm_locked(heap[0][0] + self.SLACK_S)
            for _due, _serial, callback, args in batch:
                try:
                    callback(*args)
                except Exception:
                    log.exception("timer callback %r failed", callback)


@dataclass(frozen=True)
class Fault:
    kind: str  # "errno" or "hang"
    errno: int | None = None
    ops: tuple[str, ...] | None = None
    glob: str | None = None

    @classmethod
    def from_request(cls, req: dict[str, Any]) -> Fault:
        kind, code, ops, glob = req.get("kind"), req.get("errno"), req.get("ops"), req.get("glob")
        if kind not in ("errno", "hang"):
            raise ValueError('fault "kind" must be "errno" or "hang"')
        if kind == "errno" and (isinstance(code, bool) or not isinstance(code, int) or code <= 0):
            raise ValueError('an errno fault needs "errno": a positive integer')
        if ops is not None:
            if not isinstance(ops, list) or not all(op in FAULT_OPS for op in ops):
                raise ValueError(f'"ops" must be a list of names from {list(FAULT_OPS)}')
            ops = tuple(ops)
        if glob is not None and not isinstance(glob, str):
            raise ValueError('"glob" must be a string')
        return cls(kind, code if kind == "errno" else None, ops, glob)

    def matches(self, op: str, rel: str) -> bool:
        return op in (self.ops or FAULT_OPS) and (self.glob is None or fnmatchcase(rel, self.glob))


class Faults:
    """The injected faults; requests consult them, the control socket changes them.

    A request that meets a hang is parked here without a thread: ``clear`` resumes it (on the
    timer's thread), HANG_LIMIT_S fails it with ETIMEDOUT and ``close`` with EIO.

    Thread safety: ``_lock`` guards ``_faults``, ``_parked``, ``_closed`` and the counters;
    ``_faults`` is replaced, never changed in place, so ``match`` may test it without the lock.
    """

    def __init__(self, timer: Timer) -> None:
        self._timer = timer
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        # Parked requests by serial number: (resume(), fail(errno)).
        self._parked: dict[int, tuple[Callable[[], None], Callable[[int], None]]] = {}
        self._serial = itertools.count()
        self._closed = False
        self.errors_injected = 0
        self.hangs_injected = 0

    @property
    def hung_now(self) -> int:
        return len(self._parked)

    def add(self, fault: Fault) -> None:
        with self._lock:
            self._faults = [*self._faults, fault]

    def clear(self) -> None:
        """Remove every fault and let the parked requests proceed."""
        with self._lock:
            self._faults = []
            parked, self._parked = list(self._parked.values()), {}
        for resume, _fail in parked:
            self._timer.at(0.0, resume)

    def close(self) -> None:
        """Fail every parked request, and any hang from now on: the file system is going away."""
        with self._lock:
            self._closed = True
            parked, self._parked = list(self._parked.values()), {}
        for _resume, fail in parked:
            fail(errno.EIO)

    def describe(self) -> list[dict[str, Any]]:
        return [asdict(f) for f in self._faults]

    def match(self, op: str, rel: bytes) -> Fault | None:
        """The first fault that matches op on path rel (relative, bytes), or None."""
        if not self._faults:  # the common case, without decoding or locking
            return None
        text = rel.decode(FUSE_ENCODING, FUSE_ERRORS)
        with self._lock:
            fault = next((f for f in self._faults if f.matches(op, text)), None)
            if fault is not None and fault.kind == "errno":
                self.errors_injected += 1
            return fault

    def park(self, fault: Fault, resume: Callable[[], None], fail: Callable[[int], None]) -> None:
        """Hold a request that met the hang ``fault`` until clear() (then resume()) or a
        failure (fail(errno)). If the fault went meanwhile, resume at once."""
        with self._lock:
            closed = self._closed
            present = any(f is fault for f in self._faults)
            if present and not closed:
                key = next(self._serial)
                self._parked[key] = (resume, fail)
                self.hangs_injected += 1
        if closed:
            fail(errno.EIO)
        elif not present:
            resume()
        else:
            self._timer.at(time.monotonic() + HANG_LIMIT_S, self._expire, key)

    def _expire(self, key: int) -> None:
        with self._lock:
            parked = self._parked.pop(key, None)
        if parked is not None:
            parked[1](errno.ETIMEDOUT)


class Emulator:
    """What makes SOURCE look remote: settings, the shared link, the timer, faults and counters.

    Thread safety: ``_lock`` guards the counters; settings change by whole attributes.
    """

    def __init__(self, source: bytes, settings: Settings) -> None:
        self.source = source
        self.settings = settings
        self.link = Link()
        self.timer = Timer()
        self.faults = Faults(self.timer)
        self._lock = threading.Lock()
        self._ops: Counter[str] = Counter()
        self._read_bytes = 0
        self._opens = 0
        # Requests from their arrival to their answer, and the most at once: how parallel the
        # client is (a waiting request is in flight without a thread).
        self._in_flight = 0
        self._peak_in_flight = 0

    def entered(self, op: str) -> None:
        with self._lock:
            self._ops[op] += 1
            self._in_flight += 1
            self._peak_in_flight = max(self._peak_in_flight, self._in_flight)

    def left(self, read_bytes: int = 0) -> None:
        with self._lock:
            self._in_flight -= 1
            self._read_bytes += read_bytes

    def counted(self, op: str) -> None:
        """An op that is answered at once, without latency or faults."""
        with self._lock:
            self._ops[op] += 1

    def opened(self) -> None:
        with self._lock:
            self._opens += 1

    def due(self, op: str, started: float, nbytes: int = 0) -> float:
        """When the answer to op, begun at started, may go: its latency, and for a read the
        transfer of nbytes on the shared link."""
        settings = self.settings
        ready_at = started + getattr(settings, LATENCY_OF[op]) / 1000
        if op != "read":
            return ready_at
        return self.link.reserve(ready_at, nbytes, settings.bandwidth_mbps)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = {"ops": dict(self._ops), "read_bytes": self._read_bytes,
                        "opens": self._opens, "in_flight": self._in_flight,
                        "peak_in_flight": self._peak_in_flight}
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            **counters,
            "errors_injected": self.faults.errors_injected,
            "hangs_injected": self.faults.hangs_injected,
            "hung_now": self.faults.hung_now,
            "faults": self.faults.describe(),
            "settings": asdict(self.settings),
            "pid": os.getpid(),
            # The daemon's own CPU (all threads, user + system) since it started.
            "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 6),
            "cpu_user_seconds": round(usage.ru_utime, 6),
            "cpu_system_seconds": round(usage.ru_stime, 6),
            "threads": threading.active_count(),
        }

    def command(self, req: Any) -> dict[str, Any]:
        """Carry out one control request; invalid ones raise ValueError or TypeError."""
        if not isinstance(req, dict):
            raise TypeError("a request must be a JSON object")
        cmd = req.get("cmd")
        if cmd == "fault":
            self.faults.add(Fault.from_request(req))
            log.info("fault added: %s", req)
        elif cmd == "clear":
            self.faults.clear()
            log.info("faults cleared")
        elif cmd == "set":
            self.settings.update({k: v for k, v in req.items() if k != "cmd"})
            log.info("settings now %s", asdict(self.settings))
            return {"ok": True, "settings": asdict(self.settings)}
        elif cmd == "stats":
            return {"ok": True, **self.stats()}
        else:
            raise ValueError(f"unknown cmd {cmd!r}: use fault, clear, set or stats")
        return {"ok": True}


def _attr(st: os.stat_result) -> bytes:
    """SOURCE's attributes as a ``struct fuse_attr``: its inode numbers, its blocks."""
    a_s, a_n = divmod(st.st_atime_ns, 10**9)
    m_s, m_n = divmod(st.st_mtime_ns, 10**9)
    c_s, c_n = divmod(st.st_ctime_ns, 10**9)
    wide = 0xFFFF_FFFF_FFFF_FFFF  # times before 1970 as the kernel's signed seconds
    return p.ATTR.pack(st.st_ino, st.st_size, st.st_blocks, a_s & wide, m_s & wide, c_s & wide,
                       a_n, m_n, c_n, st.st_mode, st.st_nlink, st.st_uid, st.st_gid,
                       st.st_rdev & 0xFFFF_FFFF, st.st_blksize, 0)


def _set_read_ahead(mountpoint: str, kib: int) -> None:
    """Set the mount's readahead (its backing device's ``read_ahead_kb``).  Called once the
    kernel has taken the INIT reply, which would otherwise lower it again."""
    entry = find_mount(mountpoint)
    try:
        if entry is None or not entry.device:
            raise OSError(errno.ENOENT, "not in /proc/self/mountinfo")
        Path(f"/sys/class/bdi/{entry.device}/read_ahead_kb").write_text(f"{kib}\n")
    except OSError as exc:  # not root, no sysfs: the kernel's default readahead
        log.warning("cannot set the readahead of %s to %d KiB: %s", mountpoint, kib, exc)


def _dirent_mode(entry: os.DirEntry) -> int:
    # Only the file type and inode reach the kernel; d_type spares an lstat per name.
    if entry.is_symlink():
        return stat.S_IFLNK
    if entry.is_dir(follow_symlinks=False):
        return stat.S_IFDIR
    if entry.is_file(follow_symlinks=False):
        return stat.S_IFREG
    return stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode)


class Listed(NamedTuple):
    """One entry of a directory listing."""

    name: bytes
    ino: int
    mode: int
    st: os.stat_result | None  # its attributes, when the listing carries them


def _entry_lstat(entry: os.DirEntry) -> os.stat_result | None:
    try:
        return entry.stat(follow_symlinks=False)
    except OSError:
        return None  # gone since the listing: the name goes without attributes


class Node:
    """A path the kernel knows by a node id, how many lookups of it it counts, and which file
    its pages are of (what its last open found: close-to-open)."""

    __slots__ = ("rel", "lookups", "opened", "dropping")

    def __init__(self, rel: bytes, lookups: int = 0) -> None:
        self.rel = rel  # relative to SOURCE, without a leading slash; b"" for the root
        self.lookups = lookups
        self.opened: tuple[int, ...] | None = None
        self.dropping = 0  # opens dropping the kernel's pages of an older version now


def _same_file(st: os.stat_result) -> tuple[int, ...]:
    """What an NFS client compares at open to keep a file's cached pages: the file handle
    (device and inode here) and its change attributes."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@dataclass(frozen=True)
class Handle:
    fd: int
    src: bytes  # the file in SOURCE
    ident: tuple[int, int]  # (st_dev, st_ino) at open: what an NFS file handle pins down


class SlowFS(Filesystem):
    """Thin adapter from the kernel's requests to SOURCE: node ids to paths, the local call's
    result or errno to a reply, answered when the Emulator says it is due.

    Every answered request goes through ``_request``: counted, checked against the faults,
    its work done at once, its answer sent now or queued on the timer. The handlers return
    DEFERRED: the answer is always sent here (from the serving thread or the timer's), and
    a reply the kernel no longer waits for undoes what it stood for (a lookup, an open).

    Thread safety: ``_lock`` guards the node table (``_nodes``, ``_ids`` and each Node's
    ``lookups``). ``_handles`` and ``_dirs`` change by single dictionary operations, each on a
    key that only one request at a time uses (the kernel sends nothing for a handle before
    its open is answered nor after its release).
    """

    def __init__(self, emu: Emulator) -> None:
        self.emu = emu
        self.session: Session | None = None
        self._lock = threading.Lock()
        self._nodes: dict[int, Node] = {p.ROOT_ID: Node(b"", 1)}
        self._ids: dict[bytes, int] = {b"": p.ROOT_ID}
        self._next_id = itertools.count(p.ROOT_ID + 1)
        self._handles: dict[int, Handle] = {}
        # A listing, once taken: (name, inode, file type, lstat or None) per entry.
        self._dirs: dict[int, list[Listed] | None] = {}
        self._next_dir = itertools.count(1)

    # -- the session's calls ---------------------------------------------------------------

    def init(self, session: Session, connection: Connection) -> None:
        self.session = session
        log.info("serving (FUSE 7.%d)", connection.minor)
        if getattr(session, "mountpoint", ""):
            _set_read_ahead(session.mountpoint, READ_AHEAD_KB)

    def close(self) -> None:
        """Close what SOURCE files are still open (the mount is gone)."""
        for fh in list(self._handles):
            self._close(fh)

    def lookup(self, req: Request, parent: int, name: bytes) -> object:
        parent_rel = self._node(parent).rel
        rel = parent_rel + b"/" + name if parent_rel else name
        return self._request(req, "getattr", rel, self._lookup, (rel,), on_lost=self._unlook)

    def forget(self, nodeid: int, nlookup: int) -> None:
        with self._lock:
            node = self._nodes.get(nodeid)
            if node is None or nodeid == p.ROOT_ID:
                return
            node.lookups -= nlookup
            if node.lookups <= 0:
                del self._nodes[nodeid]
                if self._ids.get(node.rel) == nodeid:
                    del self._ids[node.rel]

    def getattr(self, req: Request, nodeid: int, fh: int | None) -> object:
        rel = self._node(nodeid).rel
        return self._request(req, "getattr", rel, self._getattr, (rel, fh))

    def readlink(self, req: Request, nodeid: int) -> object:
        rel = self._node(nodeid).rel
        return self._request(req, "readlink", rel, self._readlink, (rel,))

    def access(self, req: Request, nodeid: int, mask: int) -> object:
        rel = self._node(nodeid).rel
        return self._request(req, "access", rel, self._access, (rel, mask))

    def statfs(self, req: Request, nodeid: int) -> object:
        rel = self._node(nodeid).rel
        return self._request(req, "statfs", rel, self._statfs, (rel,))

    def opendir(self, req: Request, nodeid: int, flags: int) -> object:
        rel = self._node(nodeid).rel
        return self._request(req, "opendir", rel, self._opendir, (rel,), on_lost=self._unopendir)

    def readdir(self, req: Request, nodeid: int, fh: int, offset: int, size: int,
                plus: bool) -> object:
        if offset:  # a later page of a listing taken (and paid for) at offset 0
            entries = self._dirs.get(fh)
            if entries is None:
                raise OSError(errno.EBADF, "directory not listed")
            return self._page(self._node(nodeid).rel, entries, offset, size, plus)
        rel = self._node(nodeid).rel
        return self._request(req, "readdir", rel, self._readdir, (rel, fh, size, plus))

    def releasedir(self, req: Request, nodeid: int, fh: int) -> None:
        self.emu.counted("releasedir")
        self._dirs.pop(fh, None)

    def open(self, req: Request, nodeid: int, flags: int) -> object:
        node = self._node(nodeid)
        return self._request(req, "open", node.rel, self._open, (nodeid, node, flags),
                             on_lost=self._unopen)

    def read(self, req: Request, nodeid: int, fh: int, offset: int, size: int) -> object:
        rel = self._node(nodeid).rel
        return self._request(req, "read", rel, self._read, (fh, offset, size))

    def release(self, req: Request, nodeid: int, fh: int) -> None:
        self.emu.counted("release")
        self._close(fh)

    # -- answering ---------------------------------------------------------------------------

    def _request(self, req: Request, op: str, rel: bytes, work: Callable[..., bytes],
                 args: tuple, on_lost: Callable[[bytes], None] | None = None) -> object:
        """Count op, apply the faults on rel, then do work(*args) and answer when due."""
        emu = self.emu
        emu.entered(op)
        fault = emu.faults.match(op, rel)
        if fault is None:
            self._proceed(req.unique, op, work, args, on_lost)
        elif fault.kind == "errno":
            self._send(req.unique, fault.errno, op, None)
        else:
            emu.faults.park(fault,
                            functools.partial(self._proceed, req.unique, op, work, args, on_lost),
                            functools.partial(self._fail, req.unique, op))
        return DEFERRED

    def _proceed(self, unique: int, op: str, work: Callable[..., bytes], args: tuple,
                 on_lost: Callable[[bytes], None] | None) -> None:
        started = time.monotonic()
        try:
            outcome: bytes | int = work(*args)
        except OSError as exc:
            outcome = exc.errno if isinstance(exc.errno, int) and exc.errno > 0 else \
                self._unexpected(exc, op)
        except Exception as exc:
            outcome = self._unexpected(exc, op)
        due = self.emu.due(op, started, len(outcome) if isinstance(outcome, bytes) else 0)
        if due > time.monotonic():
            self.emu.timer.at(due, self._send, unique, outcome, op, on_lost)
        else:
            self._send(unique, outcome, op, on_lost)

    def _send(self, unique: int, outcome: bytes | int, op: str,
              on_lost: Callable[[bytes], None] | None) -> None:
        """Answer a request: a reply body, a read's data, or an errno."""
        session = self.session
        read_bytes = 0
        try:
            if isinstance(outcome, int):
                session.reply_error(unique, outcome)
            elif op == "read":
                session.reply_data(unique, outcome)
                read_bytes = len(outcome)
            elif not session.reply(unique, outcome) and on_lost is not None:
                on_lost(outcome)  # the kernel never counted it (its caller was interrupted)
        finally:
            self.emu.left(read_bytes)

    def _fail(self, unique: int, op: str, code: int) -> None:
        self._send(unique, code, op, None)

    @staticmethod
    def _unexpected(exc: BaseException, op: str) -> int:
        log.error("%s failed unexpectedly, answering EIO", op, exc_info=exc)
        return errno.EIO

    # -- the work, on SOURCE ----------------------------------------------------------------

    def _node(self, nodeid: int) -> Node:
        node = self._nodes.get(nodeid)
        if node is None:  # forgotten: the kernel does not ask about those
            raise OSError(errno.ESTALE, "unknown node")
        return node

    def _src(self, rel: bytes) -> bytes:
        return self.emu.source + b"/" + rel if rel else self.emu.source

    def _lookup(self, rel: bytes) -> bytes:
        attr = _attr(os.lstat(self._src(rel)))
        nodeid = self._lookup_listed(rel)
        cached = self.emu.settings.actimeo_s
        return p.entry_out(nodeid, 0, cached, cached, attr)

    def _unlook(self, body: bytes) -> None:
        self.forget(int.from_bytes(body[:8], "little"), 1)

    def _check_same_file(self, handle: Handle) -> None:
        """ESTALE if SOURCE no longer has the file that was opened (removed or replaced)."""
        try:
            st = os.lstat(handle.src)
        except (FileNotFoundError, NotADirectoryError):
            raise OSError(errno.ESTALE, "removed") from None
        if (st.st_dev, st.st_ino) != handle.ident:
            raise OSError(errno.ESTALE, "replaced")

    def _getattr(self, rel: bytes, fh: int | None) -> bytes:
        handle = self._handles.get(fh) if fh is not None else None
        if handle is not None:  # by open file (lseek SEEK_END): NFS uses its file handle
            self._check_same_file(handle)
            st = os.fstat(handle.fd)
        else:
            st = os.lstat(self._src(rel))
        return p.attr_out(self.emu.settings.actimeo_s, _attr(st))

    def _readlink(self, rel: bytes) -> bytes:
        return os.readlink(self._src(rel))

    def _access(self, rel: bytes, mask: int) -> bytes:
        if mask & os.W_OK:
            raise OSError(errno.EROFS, "read-only")
        if not os.access(self._src(rel), mask):
            raise OSError(errno.EACCES, "no access")
        return b""

    def _statfs(self, rel: bytes) -> bytes:
        return p.statfs_out(os.statvfs(self._src(rel)))

    def _opendir(self, rel: bytes) -> bytes:
        if not stat.S_ISDIR(os.lstat(self._src(rel)).st_mode):
            raise OSError(errno.ENOTDIR, "not a directory")
        fh = next(self._next_dir)
        self._dirs[fh] = None
        return p.open_out(fh, 0)

    def _unopendir(self, body: bytes) -> None:
        self._dirs.pop(p.OPEN_OUT.unpack_from(body)[0], None)

    def _readdir(self, rel: bytes, fh: int, size: int, plus: bool) -> bytes:
        if fh not in self._dirs:
            raise OSError(errno.EBADF, "directory not open")
        src = self._src(rel)
        here, parent = os.lstat(src).st_ino, os.lstat(src + b"/..").st_ino
        entries = [Listed(b".", here, stat.S_IFDIR, None),
                   Listed(b"..", parent, stat.S_IFDIR, None)]
        # With an attribute cache, READDIRPLUS brings each entry's attributes (NFS's does).
        with_attrs = plus and self.emu.settings.actimeo_s > 0
        with os.scandir(src) as it:
            entries += [Listed(entry.name, entry.inode(), _dirent_mode(entry),
                               _entry_lstat(entry) if with_attrs else None) for entry in it]
        self._dirs[fh] = entries
        return self._page(rel, entries, 0, size, plus)

    def _page(self, rel: bytes, entries: list[Listed], offset: int, size: int,
              plus: bool) -> bytes:
        """The records from offset on that fit in size bytes; a READDIRPLUS record with
        attributes counts as a lookup of its name, as the kernel counts it."""
        out: list[bytes] = []
        used = 0
        cached = self.emu.settings.actimeo_s
        for index, (name, ino, mode, st) in enumerate(itertools.islice(entries, offset, None),
                                                      start=offset + 1):
            if not plus:
                record = p.dirent(ino, index, mode, name)
            else:  # a direntplus is as long with or without attributes
                record = p.direntplus(bytes(p.ENTRY_OUT_BYTES), ino, index, mode, name)
            used += len(record)
            if used > size:
                break
            if plus and st is not None:
                nodeid = self._lookup_listed(rel + b"/" + name if rel else name)
                record = p.direntplus(p.entry_out(nodeid, 0, cached, cached, _attr(st)),
                                      ino, index, mode, name)
            # else nodeid 0: the name without attributes (".", "..", no attribute cache)
            out.append(record)
        return b"".join(out)

    def _lookup_listed(self, rel: bytes) -> int:
        """The node id of a name a READDIRPLUS answer carries, counted as one lookup."""
        with self._lock:
            nodeid = self._ids.get(rel)
            if nodeid is None:
                nodeid = next(self._next_id)
                self._ids[rel] = nodeid
                self._nodes[nodeid] = Node(rel)
            self._nodes[nodeid].lookups += 1
        return nodeid

    def _open(self, nodeid: int, node: Node, flags: int) -> bytes:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise OSError(errno.EROFS, "read-only")
        src = self._src(node.rel)
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        self._handles[fd] = Handle(fd, src, (st.st_dev, st.st_ino))
        self.emu.opened()
        # Close-to-open: the pages the kernel holds stay while the file is the one they were
        # read from.  The open that finds it changed drops them before it is answered.  Left
        # to that open's own reply (no FOPEN_KEEP_CACHE), the kernel would drop them only as
        # its opener wakes, and an open answered meanwhile (found the file as the node's
        # last open did) would read the old version's pages: a reader beside a fill on two
        # busy cores did.  An open answered while the pages are being dropped drops them as
        # it wakes, before its own reads.  A node's first open keeps them: it has none.
        found = _same_file(st)
        with self._lock:
            changed = node.opened is not None and node.opened != found
            node.opened = found
            node.dropping += changed
            keep = not node.dropping
        if changed:
            try:
                keep = self._drop_pages(nodeid)
            finally:
                with self._lock:
                    node.dropping -= 1
        return p.open_out(fd, p.FOPEN_KEEP_CACHE if keep else 0)

    def _drop_pages(self, nodeid: int) -> bool:
        """Drop the kernel's pages of ``nodeid`` now: whether it did.  The kernel waits for
        reads in flight of those pages, answered by another thread (started meanwhile)."""
        with remotewait.waiting(remote_call=False):
            return self.session.notify_inval_inode(nodeid)

    def _unopen(self, body: bytes) -> None:
        self._close(p.OPEN_OUT.unpack_from(body)[0])

    def _close(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is not None:
            os.close(handle.fd)

    def _read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self._handles[fh]  # a KeyError (a handle never given out) is a bug: EIO
        self._check_same_file(handle)
        return os.pread(handle.fd, size, offset)


class ControlServer:
    """The control Unix socket: one JSON request per line in, one JSON reply per line out.

    Each connection has its own thread, so the socket keeps answering while ops hang.
    """

    MAX_LINE = 1 << 16

    def __init__(self, path: str, emu: Emulator) -> None:
        self.path = path
        self.emu = emu
        if os.path.exists(path) and stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)  # left by a daemon that did not exit cleanly
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)  # controlling faults is for the user who mounted
        self._sock.listen(16)
        threading.Thread(target=self._accept_loop, name="control", daemon=True).start()

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._sock.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            try:
                while line := lines.readline(self.MAX_LINE):
                    if line.strip():
                        reply = self.handle(line)
                        conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass  # the client went away

    def handle(self, line: bytes) -> dict[str, Any]:
        try:
            return self.emu.command(json.loads(line))
        except (ValueError, TypeError) as e:  # ValueError includes bad JSON
            return {"ok": False, "error": str(e)}
        except Exception as e:
            log.exception("control request %r failed", line)
            return {"ok": False, "error": f"internal error: {e!r}"}


def control_raw(socket_path: str | os.PathLike, line: str,
                timeout: float = CONTROL_TIMEOUT_S) -> str:
    """Send one request line to a slowfs control socket and return the reply line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(os.fspath(socket_path))
        sock.sendall(line.strip().encode() + b"\n")
        with sock.makefile("rb") as f:
            reply = f.readline()
    if not reply:
        raise ConnectionError(f"{os.fspath(socket_path)}: closed without a reply")
    return reply.decode()


def control(socket_path: str | os.PathLike, request: dict[str, Any],
            timeout: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
    """Send one request to a slowfs control socket and return the decoded reply."""
    return json.loads(control_raw(socket_path, json.dumps(request), timeout))


# --- mounting and process management, shared with bench.emulator.remote ---

def is_mounted(path: str | os.PathLike) -> bool:
    """Whether something is mounted at path, even a FUSE mount whose daemon died.

    os.path.ismount() says False for those (stat fails with ENOTCONN), so read mountinfo.
    """
    target = os.fsencode(os.path.abspath(path))
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            field = line.split(b" ")[4]  # the mount point, with octal escapes for " \t\n\\"
            if re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), field) == target:
                return True
    return False


def fusermount(mountpoint: str | os.PathLike, lazy: bool = False) -> bool:
    """Unmount a FUSE mount; True on success. Lazy detaches it even while files are open."""
    tool = shutil.which("fusermount") or shutil.which("fusermount3") or "fusermount"
    args = [tool, "-u", "-q"] + (["-z"] if lazy else []) + [os.fspath(mountpoint)]
    try:
        return subprocess.run(args, check=False, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def child_command(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run `python -m bench.emulator.slowfs ARGS` from any directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return [sys.executable, "-m", "bench.emulator.slowfs", *args], env


def wait_until_serving(mountpoint: str | os.PathLike, proc: subprocess.Popen,
                       timeout: float = START_TIMEOUT_S) -> str | None:
    """Wait until proc's mount at mountpoint answers; None when it does, else why not.

    The caller has checked that nothing was mounted there before proc started.
    """
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            return f"slowfs exited with status {proc.returncode}"
        if is_mounted(mountpoint):
            try:
                os.listdir(mountpoint)
                return None
            except OSError:
                pass  # mounted, but not answering yet
        if time.monotonic() > deadline:
            return f"not serving after {timeout:g} s"
        time.sleep(0.02)


def failure_reason(output: str, fallback: str) -> str:
    """The most telling line of a failed daemon's output."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for prefixes in (("slowfs: error:",), ("fuse:", "fusermount:")):
        for line in lines:
            if line.startswith(prefixes):
                return line
    return lines[-1] if lines else fallback


# --- command line ---

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.emulator.slowfs",
        description="Serve SOURCE read-only at MOUNTPOINT like a slow NFS share (EFS, Filestore).",
        epilog="Control a running mount with: python -m bench.emulator.slowfs ctl SOCKET JSON",
    )
    p.add_argument("source", help="local directory to serve")
    p.add_argument("mountpoint", help="empty directory to mount on")
    p.add_argument("--profile", choices=sorted(PROFILES), default="efs",
                   help="base latencies and bandwidth (default: efs)")
    p.add_argument("--meta-ms", type=float, help="latency of each metadata op, ms")
    p.add_argument("--open-ms", type=float, help="latency of each open, ms")
    p.add_argument("--read-ms", type=float, help="latency of each read, ms")
    p.add_argument("--bandwidth-mbps", type=float, help="shared link bandwidth, MB/s (0: no cap)")
    p.add_argument("--actimeo-s", type=float,
                   help="how long the kernel keeps entries and attributes, s (NFS actimeo)")
    p.add_argument("--control", help="control socket (default: .NAME.slowfs.sock beside the "
                                     "mount point)")
    p.add_argument("--foreground", action="store_true", help="stay attached")
    p.add_argument("--log-file", help="log here instead of stderr")
    return p


def _settings(args: argparse.Namespace) -> Settings:
    base = PROFILES[args.profile]
    settings = Settings(**asdict(base))
    overrides = {key: getattr(args, key) for key in asdict(base) if getattr(args, key) is not None}
    settings.update(overrides)
    return settings


def _fail(message: str, status: int = 2) -> int:
    print(f"slowfs: error: {message}", file=sys.stderr, flush=True)
    return status


def _check_paths(source: str, mountpoint: str) -> str | None:
    """Why SOURCE and MOUNTPOINT cannot be used, or None."""
    if not os.path.isdir(source):
        return f"source {source!r} is not a directory"
    if is_mounted(mountpoint):
        return f"{mountpoint!r} is already a mount point"
    if not os.path.isdir(mountpoint):
        return f"mount point {mountpoint!r} is not a directory"
    if os.listdir(mountpoint):
        return f"mount point {mountpoint!r} is not empty"
    return None


def _serve(args: argparse.Namespace, source: str, mountpoint: str, control_path: str) -> int:
    """Mount and serve in this process until unmounted or signalled."""
    problem = _check_paths(source, mountpoint)
    if problem:
        return _fail(problem)
    # Signals go to one thread that unmounts. Blocking them before any thread starts (threads
    # inherit the mask) leaves sigwait() the only taker, so no serving thread is interrupted.
    stop_signals = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    settings = _settings(args)
    emu = Emulator(os.fsencode(source), settings)
    try:
        server = ControlServer(control_path, emu)
    except OSError as e:
        return _fail(f"control socket {control_path!r}: {e}")
    fs = SlowFS(emu)
    # No passthrough: every read must come here to pay its latency.
    session = Session(fs, want_passthrough=False, readdirplus=True)
    log.info("mounting %s at %s, settings %s, control %s", source, mountpoint, asdict(settings),
             control_path)
    try:
        # Without default_permissions, as a plain NFS mount: access(2) comes to us.
        session.mount(mountpoint, MountOptions(fsname="slowfs", subtype="slowfs",
                                               default_permissions=False))
    except OSError as e:
        server.close()
        return _fail(f"cannot mount {mountpoint!r}: {e}", 1)
    loop_done = threading.Event()

    def on_signal() -> None:
        sig = signal.sigwait(stop_signals)
        log.info("%s: unmounting", signal.Signals(sig).name)
        emu.faults.close()
        try:
            session.unmount()
        except OSError as e:
            log.warning("%s", e)
        # Once unmounted the session ends by itself, unless a client still holds a file open:
        # then exiting closes /dev/fuse, which ends the connection for it.
        if not loop_done.wait(2):
            log.warning("FUSE session still running after unmount; exiting anyway")
            server.close()
            logging.shutdown()
            os._exit(0)

    threading.Thread(target=on_signal, name="signals", daemon=True).start()
    try:
        session.serve()
    finally:
        loop_done.set()
        server.close()
        fs.close()
    log.info("unmounted")
    return 0


def _child_args(args: argparse.Namespace, source: str, mountpoint: str, control: str) -> list[str]:
    """The foreground command line for a background daemon, with absolute paths (cwd is /)."""
    out = [source, mountpoint, "--profile", args.profile, "--control", control, "--foreground"]
    for key in ("meta_ms", "open_ms", "read_ms", "bandwidth_mbps"):
        if getattr(args, key) is not None:
            out += ["--" + key.replace("_", "-"), repr(getattr(args, key))]
    return out


def _daemonize(args: argparse.Namespace, source: str, mountpoint: str, control: str) -> int:
    """Start the daemon in the background and return once its mount serves, like mount(8)."""
    problem = _check_paths(source, mountpoint)
    if problem:
        return _fail(problem)
    # The child logs to its stderr: the log file, or a nameless file read only if startup fails.
    if args.log_file:
        log_out: BinaryIO = open(args.log_file, "ab")  # noqa: SIM115 - closed below
    else:
        log_out = tempfile.TemporaryFile()  # noqa: SIM115 - closed below
    with log_out:
        start = log_out.tell()
        cmd, env = child_command(_child_args(args, source, mountpoint, control))
        proc = subprocess.Popen(cmd, env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=log_out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        problem = wait_until_serving(mountpoint, proc)
        if problem is None:
            return 0
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        if is_mounted(mountpoint):
            fusermount(mountpoint, lazy=True)
        with open(log_out.fileno(), "rb", closefd=False) as f:
            f.seek(start)
            output = f.read().decode(errors="replace")
    reason = failure_reason(output, problem).removeprefix("slowfs: error: ")
    return _fail(f"cannot serve {args.source} at {args.mountpoint}: {reason}", 1)


def _ctl(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.emulator.slowfs ctl",
                                description="Send one JSON request to a slowfs control socket.")
    p.add_argument("socket")
    p.add_argument("request", help='e.g. \'{"cmd": "stats"}\'')
    args = p.parse_args(argv)
    try:
        reply = control_raw(args.socket, args.request)
    except (OSError, ValueError) as e:
        return _fail(f"{args.socket}: {e}", 1)
    print(reply.strip())
    return 0 if json.loads(reply).get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ctl"]:
        return _ctl(argv[1:])
    args = _parser().parse_args(argv)
    try:
        _settings(args)
    except (ValueError, TypeError) as e:
        return _fail(str(e))
    source = os.path.realpath(args.source)
    mountpoint = os.path.realpath(args.mountpoint)
    control = os.path.abspath(args.control or os.path.join(
        os.path.dirname(mountpoint), f".{os.path.basename(mountpoint)}.slowfs.sock"))
    if not args.foreground:
        return _daemonize(args, source, mountpoint, control)
    logging.basicConfig(
        filename=args.log_file, level=logging.INFO,
        format="%(asctime)s slowfs[%(process)d] %(levelname)s %(message)s")
    return _serve(args, source, mountpoint, control)

if __name__ == "__main__":
    sys.exit(main())
