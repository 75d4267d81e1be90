"""slowfs: a read-only FUSE passthrough that behaves like AWS EFS or GCP Filestore from a node.

The kernel on our machines has no NFS client, so tests and benchmarks of cachefs need a stand-in
for the slow remote share. slowfs serves a plain local directory (SOURCE) at MOUNTPOINT and adds
what makes a network file system different from a local disk:

* latency: every metadata op (getattr, readdir, readlink, access, statfs, opendir) sleeps
  ``meta_ms``, every open ``open_ms``, every read ``read_ms``;
* one shared link: all reads queue on a single link of ``bandwidth_mbps`` (MB = 1e6 bytes), so
  concurrent readers share the bandwidth while their latencies overlap;
* no client-side caching: the mount uses direct_io and zero attr/entry/negative timeouts, so a
  change a test makes in SOURCE is visible through the mount at once;
* NFS semantics for open files: a read on a file that was removed or replaced in SOURCE since it
  was opened fails with ESTALE, as it does for a second NFS client;
* faults injected while mounted, through a control Unix socket (one JSON object per line, one
  JSON reply per line): ``fault`` (``errno`` or ``hang``), ``clear``, ``set``, ``stats``.

Fault filters: ``ops`` is a list of op names from FAULT_OPS (omitted: all of them); ``glob`` is
an fnmatch pattern matched against the path relative to the mount root, without a leading slash
(omitted: every path). The root itself is the empty string, so only ``*`` or an omitted glob
matches it, and ``*`` also matches across ``/`` (fnmatch semantics). An injected error fails the
op at once, without its latency. A hang blocks until ``clear`` (then the op proceeds normally), for
at most HANG_LIMIT_S, after which it fails with ETIMEDOUT.

Where it differs from a real NFS mount (on purpose or by FUSE's nature):

* shared mmap of a file fails with ENODEV (a direct_io limit of libfuse 2); private mmap works;
* a process blocked in a hung op cannot be killed until the hang is cleared or the daemon goes
  (a FUSE request in flight is uninterruptible), so always clear faults: EmulatedRemote.stop()
  does, and SIGTERM does;
* inode numbers are SOURCE's (use_ino), so SOURCE should be a single file system;
* release and releasedir take no latency and no faults (close() does not wait for them);
* no extended attributes (EOPNOTSUPP), as on an NFS share without xattr support.

Usage::

    python -m bench.slowfs SOURCE MOUNTPOINT [--profile efs|filestore|local] [--meta-ms F]
        [--open-ms F] [--read-ms F] [--bandwidth-mbps F] [--control SOCKET] [--foreground]
        [--log-file FILE]
    python -m bench.slowfs ctl SOCKET '{"cmd": "stats"}'

Without --foreground the command returns once the mount serves (exit 0) or has failed (exit 1,
one line on stderr), like mount(8), and the daemon goes on in the background; without --log-file
a background daemon's log is discarded. SIGTERM, SIGINT and SIGHUP unmount cleanly.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import logging
import math
import os
import re
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
from dataclasses import asdict, dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, BinaryIO

from mfusepy import FUSE, FuseOSError, Operations

log = logging.getLogger("slowfs")

# mfusepy decodes kernel paths with this codec; we encode them back with the same one so names
# that are not valid UTF-8 reach SOURCE byte for byte.
FUSE_ENCODING = "utf-8"
FUSE_ERRORS = "surrogateescape"

REPO_ROOT = Path(__file__).resolve().parent.parent
FAULT_OPS = ("getattr", "readdir", "readlink", "access", "statfs", "opendir", "open", "read")
HANG_LIMIT_S = 3600.0
CONTROL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 20.0


@dataclass
class Settings:
    """Latencies in milliseconds and the link's bandwidth in MB/s (None: no cap)."""

    meta_ms: float
    open_ms: float
    read_ms: float
    bandwidth_mbps: float | None

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
    "efs": Settings(meta_ms=0.5, open_ms=2.0, read_ms=2.0, bandwidth_mbps=200.0),
    "filestore": Settings(meta_ms=0.3, open_ms=1.0, read_ms=1.0, bandwidth_mbps=400.0),
    "local": Settings(meta_ms=0.0, open_ms=0.0, read_ms=0.0, bandwidth_mbps=None),
}


class Link:
    """A single network link shared by all readers: transfers are served one after another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0  # time.monotonic() at which the link has sent everything queued

    def reserve(self, ready_at: float, nbytes: int, mbps: float | None) -> float:
        """Queue nbytes that the server can start sending at ready_at; return when they arrive."""
        if not mbps:
            return ready_at
        # Only the bookkeeping is under the lock; callers sleep without holding it.
        with self._lock:
            start = max(ready_at, self._free_at)
            self._free_at = start + nbytes / (mbps * 1e6)
            return self._free_at


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
    """The injected faults; ops consult them, the control socket changes them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._faults: list[Fault] = []
        self._epoch = 0  # bumped by clear(): a hung op waits for it to change
        self._closed = False
        self.errors_injected = 0
        self.hangs_injected = 0
        self.hung_now = 0

    def add(self, fault: Fault) -> None:
        with self._cond:
            self._faults = [*self._faults, fault]

    def clear(self) -> None:
        with self._cond:
            self._faults = []
            self._epoch += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Release every hung op for good: the file system is going away."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def describe(self) -> list[dict[str, Any]]:
        return [asdict(f) for f in self._faults]

    def check(self, op: str, rel: str) -> None:
        """Raise the injected errno, or block while a hang matches op on path rel."""
        if not self._faults:  # the common case, without taking the lock
            return
        with self._cond:
            fault = next((f for f in self._faults if f.matches(op, rel)), None)
            if fault is None:
                return
            if fault.kind == "errno":
                self.errors_injected += 1
                raise FuseOSError(fault.errno)
            self.hangs_injected += 1
            self.hung_now += 1
            epoch = self._epoch
            try:
                released = self._cond.wait_for(
                    lambda: self._epoch != epoch or self._closed, timeout=HANG_LIMIT_S
                )
            finally:
                self.hung_now -= 1
            if self._closed:
                raise FuseOSError(errno.EIO)
            if not released:
                raise FuseOSError(errno.ETIMEDOUT)


class Emulator:
    """What makes SOURCE look remote: settings, the shared link, faults and counters."""

    def __init__(self, source: bytes, settings: Settings) -> None:
        self.source = source
        self.settings = settings
        self.link = Link()
        self.faults = Faults()
        self._lock = threading.Lock()
        self._ops: Counter[str] = Counter()
        self._read_bytes = 0
        self._opens = 0
        # Requests being served now, and the most at once: how parallel the client is.
        self._in_flight = 0
        self._peak_in_flight = 0

    def entered(self) -> None:
        with self._lock:
            self._in_flight += 1
            self._peak_in_flight = max(self._peak_in_flight, self._in_flight)

    def left(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def begin(self, op: str, path: str | None, latency_ms: float = 0.0) -> None:
        """Account for op on path, apply matching faults, then pay its latency."""
        with self._lock:
            self._ops[op] += 1
        self.faults.check(op, (path or "/")[1:])
        if latency_ms > 0:
            time.sleep(latency_ms / 1000)

    def opened(self) -> None:
        with self._lock:
            self._opens += 1

    def deliver(self, started: float, nbytes: int) -> None:
        """Sleep until a read started at `started` has paid read_ms and crossed the link."""
        ready_at = started + self.settings.read_ms / 1000
        done_at = self.link.reserve(ready_at, nbytes, self.settings.bandwidth_mbps)
        delay = done_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        with self._lock:
            self._read_bytes += nbytes

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = {"ops": dict(self._ops), "read_bytes": self._read_bytes,
                        "opens": self._opens, "peak_in_flight": self._peak_in_flight}
        return {
            **counters,
            "errors_injected": self.faults.errors_injected,
            "hangs_injected": self.faults.hangs_injected,
            "hung_now": self.faults.hung_now,
            "faults": self.faults.describe(),
            "settings": asdict(self.settings),
            "pid": os.getpid(),
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


def _errno_guard(method):
    """Keep real errnos; turn anything unexpected into a logged EIO (mfusepy would say EINVAL).
    Also counts the request in flight while it is served."""

    @functools.wraps(method)
    def guarded(self, *args):
        self.emu.entered()
        try:
            return method(self, *args)
        except OSError as e:
            if isinstance(e.errno, int) and e.errno > 0:
                raise
            log.exception("%s%r: OSError without an errno, returning EIO", method.__name__, args)
            raise FuseOSError(errno.EIO) from e
        except Exception as e:
            log.exception("%s%r failed unexpectedly, returning EIO", method.__name__, args)
            raise FuseOSError(errno.EIO) from e
        finally:
            self.emu.left()

    return guarded


@dataclass(frozen=True)
class Handle:
    fd: int
    path: str  # as mfusepy gives it, for fault globs
    src: bytes  # the file in SOURCE
    ident: tuple[int, int]  # (st_dev, st_ino) at open: what an NFS file handle pins down


class SlowFS(Operations):
    """Thin FUSE adapter: each op is the local call on SOURCE, after Emulator.begin()."""

    use_ns = True

    def __init__(self, emu: Emulator) -> None:
        self.emu = emu
        self._handles: dict[int, Handle] = {}

    def _src(self, path: str) -> bytes:
        return self.emu.source + path.encode(FUSE_ENCODING, FUSE_ERRORS)

    def _check_same_file(self, h: Handle) -> None:
        """ESTALE if SOURCE no longer has the file that was opened (removed or replaced)."""
        try:
            st = os.lstat(h.src)
        except (FileNotFoundError, NotADirectoryError):
            raise FuseOSError(errno.ESTALE) from None
        if (st.st_dev, st.st_ino) != h.ident:
            raise FuseOSError(errno.ESTALE)

    def init(self, path: str) -> None:
        log.info("serving")

    def destroy(self, path: str) -> None:
        for fh in list(self._handles):
            os.close(self._handles.pop(fh).fd)

    @_errno_guard
    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        self.emu.begin("getattr", path, self.emu.settings.meta_ms)
        h = self._handles.get(fh) if fh is not None else None
        if h is not None:  # by open file (lseek SEEK_END; fstat comes by path): NFS uses its handle
            self._check_same_file(h)
            st = os.fstat(h.fd)
        else:
            st = os.lstat(self._src(path))
        attrs = {key: getattr(st, key) for key in (
            "st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_rdev")}
        for key in ("st_atime", "st_mtime", "st_ctime"):
            attrs[key] = getattr(st, key + "_ns")
        return attrs

    @_errno_guard
    def readlink(self, path: str) -> str:
        self.emu.begin("readlink", path, self.emu.settings.meta_ms)
        return os.readlink(self._src(path)).decode(FUSE_ENCODING, FUSE_ERRORS)

    @_errno_guard
    def access(self, path: str, amode: int) -> int:
        self.emu.begin("access", path, self.emu.settings.meta_ms)
        if amode & os.W_OK:
            raise FuseOSError(errno.EROFS)
        if not os.access(self._src(path), amode):
            raise FuseOSError(errno.EACCES)
        return 0

    @_errno_guard
    def statfs(self, path: str) -> dict[str, int]:
        self.emu.begin("statfs", path, self.emu.settings.meta_ms)
        sv = os.statvfs(self._src(path))
        return {key: getattr(sv, key) for key in (
            "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
            "f_favail", "f_namemax")}

    @_errno_guard
    def opendir(self, path: str) -> int:
        self.emu.begin("opendir", path, self.emu.settings.meta_ms)
        if not stat.S_ISDIR(os.lstat(self._src(path)).st_mode):
            raise FuseOSError(errno.ENOTDIR)
        return 0

    @_errno_guard
    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        self.emu.begin("readdir", path, self.emu.settings.meta_ms)
        entries = [(".", {"st_mode": stat.S_IFDIR}, 0), ("..", {"st_mode": stat.S_IFDIR}, 0)]
        with os.scandir(self._src(path)) as it:
            for entry in it:
                # Only the file type and inode reach the kernel; d_type spares an lstat per name.
                if entry.is_symlink():
                    mode = stat.S_IFLNK
                elif entry.is_dir(follow_symlinks=False):
                    mode = stat.S_IFDIR
                elif entry.is_file(follow_symlinks=False):
                    mode = stat.S_IFREG
                else:
                    mode = stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode)
                name = entry.name.decode(FUSE_ENCODING, FUSE_ERRORS)
                entries.append((name, {"st_mode": mode, "st_ino": entry.inode()}, 0))
        return entries

    @_errno_guard
    def releasedir(self, path: str, fh: int) -> int:
        self.emu.begin("releasedir", path)
        return 0

    @_errno_guard
    def open(self, path: str, flags: int) -> int:
        self.emu.begin("open", path, self.emu.settings.open_ms)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise FuseOSError(errno.EROFS)
        src = self._src(path)
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(fd)
        self._handles[fd] = Handle(fd, path, src, (st.st_dev, st.st_ino))
        self.emu.opened()
        return fd

    @_errno_guard
    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        h = self._handles[fh]
        self.emu.begin("read", h.path)
        started = time.monotonic()
        self._check_same_file(h)
        data = os.pread(h.fd, size, offset)
        self.emu.deliver(started, len(data))
        return data

    @_errno_guard
    def release(self, path: str, fh: int) -> int:
        self.emu.begin("release", path)
        h = self._handles.pop(fh, None)
        if h is not None:
            os.close(h.fd)
        return 0

    def _read_only(self, *args: Any) -> int:
        raise FuseOSError(errno.EROFS)

    # The mount is also mounted "ro", so the kernel refuses most of these before they get here.
    chmod = chown = create = link = mkdir = mknod = rename = rmdir = _read_only
    setxattr = removexattr = symlink = truncate = unlink = utimens = write = _read_only


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


# --- mounting and process management, shared with bench.remote ---

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
    """argv and environment that run `python -m bench.slowfs ARGS` from any directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return [sys.executable, "-m", "bench.slowfs", *args], env


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
        prog="python -m bench.slowfs",
        description="Serve SOURCE read-only at MOUNTPOINT like a slow NFS share (EFS, Filestore).",
        epilog="Control a running mount with: python -m bench.slowfs ctl SOCKET JSON",
    )
    p.add_argument("source", help="local directory to serve")
    p.add_argument("mountpoint", help="empty directory to mount on")
    p.add_argument("--profile", choices=sorted(PROFILES), default="efs",
                   help="base latencies and bandwidth (default: efs)")
    p.add_argument("--meta-ms", type=float, help="latency of each metadata op, ms")
    p.add_argument("--open-ms", type=float, help="latency of each open, ms")
    p.add_argument("--read-ms", type=float, help="latency of each read, ms")
    p.add_argument("--bandwidth-mbps", type=float, help="shared link bandwidth, MB/s (0: no cap)")
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
    # Signals go to one thread that unmounts: the main thread sits in libfuse's C loop, where a
    # Python handler would never run, and libfuse's own handler only sets a flag that the loop
    # reads after its next request. Blocking them before any thread starts (threads inherit the
    # mask) leaves sigwait() the only taker.
    stop_signals = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    settings = _settings(args)
    emu = Emulator(os.fsencode(source), settings)
    try:
        server = ControlServer(control_path, emu)
    except OSError as e:
        return _fail(f"control socket {control_path!r}: {e}")
    loop_done = threading.Event()

    def on_signal() -> None:
        sig = signal.sigwait(stop_signals)
        log.info("%s: unmounting", signal.Signals(sig).name)
        emu.faults.close()
        if is_mounted(mountpoint):
            fusermount(mountpoint, lazy=True)
        # Once unmounted the FUSE loop ends by itself, unless a client still holds a file open:
        # then exiting closes /dev/fuse, which ends the connection for it.
        if not loop_done.wait(2):
            log.warning("FUSE loop still running after unmount; exiting anyway")
            server.close()
            logging.shutdown()
            os._exit(0)

    threading.Thread(target=on_signal, name="signals", daemon=True).start()
    log.info("mounting %s at %s, settings %s, control %s", source, mountpoint, asdict(settings),
             control_path)
    try:
        FUSE(
            SlowFS(emu), mountpoint, foreground=True, encoding=FUSE_ENCODING, errors=FUSE_ERRORS,
            fsname="slowfs", subtype="slowfs", ro=True,
            # No kernel caching at all: changes to SOURCE must show through at once.
            direct_io=True, attr_timeout=0, entry_timeout=0, negative_timeout=0,
            use_ino=True,  # report SOURCE's inode numbers, which change when a file is replaced
        )
    except RuntimeError as e:
        return _fail(f"libfuse could not mount {mountpoint!r} (status {e})", 1)
    finally:
        loop_done.set()
        server.close()
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
    p = argparse.ArgumentParser(prog="python -m bench.slowfs ctl",
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
