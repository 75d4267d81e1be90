"""A FUSE session over /dev/fuse: requests in, replies out, served on a few Python threads.

This is the low-level (inode-based) protocol spoken directly, without libfuse: Debian's
libfuse predates passthrough, and no maintained Python binding offers it.  The session owns
the descriptor, the handshake (FUSE_INIT), the threads and the encoding of errors; what a
request means is the file system's business (:class:`Filesystem`), which answers with the
reply bodies ``protocol`` packs.

Passthrough: when the kernel offers it and the caller asks, the INIT reply switches it on
and a probe registers a backing file.  From then on the file system may answer an OPEN with
``FOPEN_PASSTHROUGH`` and a backing id (:meth:`Session.backing_open`), and the kernel reads
that file itself: no READ reaches Python.  Where the probe fails (no CAP_SYS_ADMIN, a kernel
built without it) ``passthrough`` is False and the file system serves reads itself.

Threads.  A serving thread reads a request (the GIL released while it waits), handles it
holding the GIL, writes the reply, and reads the next.  The kernel wakes one reader per
request, and every thread more that is busy takes turns at the GIL (each turn a futex wake
and a context switch), so there are few (``base_threads``), and more are added only where
waiting, not Python, is what a request costs:

- when a request has waited on the remote (cachefs/remotewait.py) for ``GRACE_SECONDS``
  while no other thread was free of the remote, one more is added, so that misses wait side
  by side and never hold up the opens of cached files.  Not at once: a remote that answers
  within the grace (a fast NFS server, the attributes in its client's cache) would have a
  thread woken, and parked again, for every miss: measured on a local tree as the remote,
  that cost 90 us of daemon CPU per file, a third of all of it;
- when every thread has been busy and none has finished a request for ``STUCK_SECONDS``
  (a wait nobody marked, a hung cache disk), the threads double.

Threads no longer needed (more than the base and ``SPARE_THREADS`` free of the remote, and
another one idle) park, to be woken by the next wait instead of starting a thread, and end
after ``PARKED_SECONDS``.

Thread safety: ``_lock`` guards the thread accounting (``_threads``, ``_busy``,
``_waiting``, ``_parked``, ``_short_since``); it is a leaf lock, held for a few counter
updates.  Replies may
be written from any thread (a write to /dev/fuse is atomic per message).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from cachefs import limits, remotewait
from cachefs.kernel import mount as kmount
from cachefs.kernel import protocol as p

log = logging.getLogger(__name__)

STUCK_SECONDS = 0.1
# How long a request waits on the remote, with no other thread free, before a thread is added.
GRACE_SECONDS = 0.0005
# After this many waits in a row that ended within the grace (a remote as fast as a local
# disk, or attributes and pages in its client's cache), a wait no longer wakes the watching
# loop at once: it finds a long one at its next round (STUCK_SECONDS / 2) instead.  Waking it
# for every miss cost 30-40 us of daemon CPU per file against a local tree (a futex wake, a
# context switch and a turn at the interpreter lock; 5,000 files of 64 KiB, 8 readers, none
# kept).  The first wait found long switches back to waking at once.
FAST_WAITS_BEFORE_LAZY = 32
PARKED_SECONDS = 60.0
MAX_THREADS = 128
# One serving thread per two cores, at least one, at most four.  Two threads on two cores
# cost 15-35 us more per file (64 KiB files, 8 readers: cached 80-95 us against 65-85,
# page cache kept 60-80 against 35-45; `python3 -m bench.datapath`) in GIL hand-offs between
# them, some 15 futex calls per file (strace -c); on more cores the kernel's side of the
# requests, outside the GIL, overlaps.
BASE_THREADS = max(1, min(4, limits.CORES // 2))
# Threads kept beyond the base once a burst of misses made them: an idle thread waits in
# the kernel at no cost, a parked one costs a wake-up when the next miss comes.
SPARE_THREADS = 4
# Requests never carry data here (no writes), so a small buffer holds any of them: the
# kernel wants room for a WRITE of max_write plus headers, and at least 8 KiB.
MAX_WRITE = 4096
READ_BUFFER_BYTES = p.MIN_READ_BUFFER + 4096
MAX_PAGES = 256  # reads of up to 1 MiB in one request
# Returned by a handler that will answer later (Session.reply from any thread).
DEFERRED = object()


class Request(NamedTuple):
    """Who asks, and the request's identity for a deferred reply."""

    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int


@dataclass(frozen=True)
class Connection:
    """What the handshake settled."""

    minor: int
    passthrough: bool
    # Why passthrough is off, when it is (one line for the log and status).
    passthrough_note: str = ""


class Filesystem:
    """What a session calls.  Each method returns the reply body (bytes, from
    ``protocol``'s packers), ``DEFERRED``, or raises: an OSError's errno is sent as it is;
    anything else goes through :meth:`errno_for`.  The defaults answer ENOSYS (or EROFS
    for writes), so a file system implements what it serves."""

    def init(self, session: Session, connection: Connection) -> None:
        """The kernel has answered the handshake: the mount serves from now on."""

    def errno_for(self, exc: BaseException) -> int | None:
        """The errno for an exception that is not an OSError; None: log it, answer EIO."""
        return None

    def lookup(self, req: Request, parent: int, name: bytes) -> bytes:
        raise OSError(errno.ENOSYS, "lookup")

    def forget(self, nodeid: int, nlookup: int) -> None:
        pass

    def getattr(self, req: Request, nodeid: int, fh: int | None) -> bytes:
        raise OSError(errno.ENOSYS, "getattr")

    def readlink(self, req: Request, nodeid: int) -> bytes:
        raise OSError(errno.ENOSYS, "readlink")

    def open(self, req: Request, nodeid: int, flags: int) -> bytes:
        raise OSError(errno.ENOSYS, "open")

    def read(self, req: Request, nodeid: int, fh: int, offset: int, size: int):
        raise OSError(errno.ENOSYS, "read")

    def release(self, req: Request, nodeid: int, fh: int) -> None:
        pass

    def opendir(self, req: Request, nodeid: int, flags: int) -> bytes:
        raise OSError(errno.ENOSYS, "opendir")

    def readdir(self, req: Request, nodeid: int, fh: int, offset: int, size: int,
                plus: bool) -> bytes:
        raise OSError(errno.ENOSYS, "readdir")

    def releasedir(self, req: Request, nodeid: int, fh: int) -> None:
        pass

    def statfs(self, req: Request, nodeid: int) -> bytes:
        raise OSError(errno.ENOSYS, "statfs")

    def access(self, req: Request, nodeid: int, mask: int) -> None:
        raise OSError(errno.ENOSYS, "access")


class Session:
    """One mount's /dev/fuse conversation."""

    def __init__(self, fs: Filesystem, *, want_passthrough: bool = True,
                 readdirplus: bool = False, base_threads: int = BASE_THREADS,
                 on_unexpected: Callable[[], None] | None = None,
                 on_resent: Callable[[], None] | None = None) -> None:
        self.fs = fs
        self.fd = -1
        self.mountpoint = ""
        self.connection: Connection | None = None
        self._want_passthrough = want_passthrough
        self._readdirplus = readdirplus
        self._base = base_threads
        self._on_unexpected = on_unexpected
        self._on_resent = on_resent
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._local = threading.local()  # per serving thread: "waiting", see _serve
        self._busy = 0      # threads handling a request
        self._waiting = 0   # of those, waiting on the remote
        self._parked = 0
        self._unpark = threading.Semaphore(0)
        self._last_done = time.monotonic()
        self._ended = threading.Event()
        # Wakes the watching loop of serve(): the session ended, or a wait left no thread free.
        self._wake = threading.Event()
        self._short_since: float | None = None  # since when no thread is free of the remote
        self._fast_waits = 0  # waits in a row that ended within GRACE_SECONDS
        self._no_flush = False
        # Requests the kernel sent again after a takeover (their unique has UNIQUE_RESEND).
        self.resent_requests = 0
        self.resend_supported: bool | None = None  # None: no takeover
        self._handlers = {
            p.LOOKUP: self._lookup, p.FORGET: self._forget, p.BATCH_FORGET: self._batch_forget,
            p.GETATTR: self._getattr, p.READLINK: self._readlink, p.OPEN: self._open,
            p.READ: self._read, p.RELEASE: self._release, p.FLUSH: self._flush,
            p.OPENDIR: self._opendir, p.READDIR: self._readdir,
            p.READDIRPLUS: self._readdirplus_request, p.RELEASEDIR: self._releasedir,
            p.STATFS: self._statfs, p.ACCESS: self._access, p.INIT: self._init,
            p.DESTROY: self._destroy, p.GETXATTR: self._no_xattr, p.LISTXATTR: self._no_xattr,
        }

    # -- mounting --------------------------------------------------------------------------

    def mount(self, mountpoint: str, options: kmount.MountOptions) -> None:
        self.fd = kmount.mount(mountpoint, options)
        self.mountpoint = mountpoint

    def take_over(self, fd: int, connection: Connection | None) -> None:
        """Serve the connection another process set up (kernel/takeover.py): ``connection``
        is what its handshake settled (None: the handshake had not completed; the kernel sends
        INIT again with the requests resent).  The file system learns it as after INIT, then
        the kernel is asked to resend the requests the previous server read and never
        answered; :meth:`serve` then serves them."""
        from cachefs.kernel import takeover

        self.fd = fd
        if connection is not None:
            self.connection = connection
            self.fs.init(self, connection)
        self.resend_supported = takeover.resend(fd)

    def unmount(self) -> None:
        """Detach the mount; the serving threads then see the end of the session."""
        if self.mountpoint:
            kmount.unmount(self.mountpoint)

    def serve(self) -> None:
        """Serve until the mount goes away (unmounted, or the connection aborted)."""
        for _ in range(self._base):
            self._add_thread()
        while not self._ended.is_set():
            # Every STUCK_SECONDS / 2; every GRACE_SECONDS / 2 while no thread is free.
            short = self._short_since is not None
            self._wake.wait(GRACE_SECONDS / 2 if short else STUCK_SECONDS / 2)
            self._wake.clear()
            self._add_if_short()
            self._add_if_stuck()
        self._wake_parked()
        os.close(self.fd)
        self.fd = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- replies (from any thread) ---------------------------------------------------------

    def reply(self, unique: int, body: bytes = b"") -> bool:
        """Send a reply; False when the kernel no longer waits for it (interrupted)."""
        return self._write(p.OUT_HEADER.pack(16 + len(body), 0, unique) + body)

    def reply_data(self, unique: int, data) -> bool:
        """A READ reply: the bytes follow the header without being copied together."""
        return self._writev([p.OUT_HEADER.pack(16 + len(data), 0, unique), data])

    def reply_error(self, unique: int, code: int) -> bool:
        return self._write(p.OUT_HEADER.pack(16, -code, unique))

    def _write(self, message: bytes) -> bool:
        try:
            os.write(self.fd, message)
            return True
        except OSError as exc:
            return self._write_failed(exc)

    def _writev(self, pieces: list) -> bool:
        try:
            os.writev(self.fd, pieces)
            return True
        except OSError as exc:
            return self._write_failed(exc)

    @staticmethod
    def _write_failed(exc: OSError) -> bool:
        # ENOENT: the request was interrupted or answered already (a watchdog's EIO);
        # ENODEV: unmounted; EBADF: the session closed under a late reply.
        if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
            log.error("the kernel refused a reply: %s", exc)
        return False

    # -- notifications and passthrough -------------------------------------------------------

    def notify_inval_inode(self, nodeid: int) -> bool:
        """Drop the kernel's cached pages and attributes of ``nodeid`` before returning."""
        body = p.NOTIFY_INVAL_INODE_OUT.pack(nodeid, 0, 0)  # from offset 0, length 0: all
        return self._write(p.OUT_HEADER.pack(16 + len(body), p.NOTIFY_INVAL_INODE, 0) + body)

    def notify_inval_entry(self, parent: int, name: bytes) -> bool:
        body = p.NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0) + name + b"\0"
        return self._write(p.OUT_HEADER.pack(16 + len(body), p.NOTIFY_INVAL_ENTRY, 0) + body)

    def backing_open(self, fd: int) -> int:
        """Register ``fd`` as a backing file; the id an OPEN reply names it by."""
        arg = bytearray(p.BACKING_MAP.pack(fd, 0, 0))
        return fcntl.ioctl(self.fd, p.DEV_IOC_BACKING_OPEN, arg, True)

    def backing_close(self, backing_id: int) -> None:
        """Forget a backing id; files the kernel opened with it keep their backing file."""
        arg = bytearray(backing_id.to_bytes(4, "little"))
        try:
            fcntl.ioctl(self.fd, p.DEV_IOC_BACKING_CLOSE, arg, True)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                log.warning("closing backing id %d: %s", backing_id, exc)

    # -- the serving threads -------------------------------------------------------------------

    def _add_thread(self) -> None:
        """One more serving thread: a parked one if there is one, else a new one."""
        with self._lock:
            if self._parked:
                self._parked -= 1
                self._unpark.release()
                return
            if len(self._threads) >= MAX_THREADS or self._ended.is_set():
                return
            thread = threading.Thread(target=self._serve, name="fuse", daemon=True)
            self._threads.add(thread)
        thread.start()

    def _serving_locked(self) -> int:
        return len(self._threads) - self._parked

    def _add_if_stuck(self) -> None:
        with self._lock:
            serving = self._serving_locked()
            stuck = self._busy >= serving and time.monotonic() - self._last_done > STUCK_SECONDS
        if stuck:
            # Double: the kernel hands out requests in order, so an open of a cached file may
            # queue behind many that would be stuck too.
            for _ in range(max(1, serving)):
                self._add_thread()

    def _begin_remote_wait(self) -> None:
        # Counted once per request, however many remote calls it makes (a miss makes
        # several): the thread's request is "waiting" until it is answered (see _serve).
        local = self._local
        if local.waiting:
            return
        local.waiting = True
        now = local.wait_began = time.monotonic()
        with self._lock:
            self._waiting += 1
            short = self._short_since is None and self._serving_locked() - self._waiting < 1
            if short:
                self._short_since = now
            wake = short and self._fast_waits < FAST_WAITS_BEFORE_LAZY
        if wake:  # once per spell without a free thread, not per miss
            self._wake.set()

    def _add_if_short(self) -> None:
        """Add a thread when no thread has been free of the remote for GRACE_SECONDS."""
        with self._lock:
            since = self._short_since
            if since is None:
                return
            if self._serving_locked() - self._waiting >= 1:
                self._short_since = None  # a wait ended meanwhile
                return
            if time.monotonic() - since < GRACE_SECONDS:
                return
            self._short_since = None
            self._fast_waits = 0  # a slow remote: wake the watching loop at once again
        self._add_thread()

    def _end_remote_wait(self) -> None:
        pass  # the request's end ends its wait: see _serve

    def _expire(self, unique) -> None:
        """A request has waited on the remote past the timeout: answer it without its thread."""
        self.reply_error(unique, errno.EIO)

    def _serve(self) -> None:
        remotewait.set_hooks(self._begin_remote_wait, self._end_remote_wait, self._expire)
        local = self._local
        local.waiting = False
        buffer = bytearray(READ_BUFFER_BYTES)
        view = memoryview(buffer)
        fd = self.fd
        unpack = p.IN_HEADER.unpack_from
        handlers = self._handlers
        try:
            while True:
                try:
                    length = os.readv(fd, [buffer])
                except OSError as exc:
                    if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                        continue  # ENOENT: the request was interrupted before we read it
                    if exc.errno not in (errno.ENODEV, errno.EBADF):
                        log.error("reading /dev/fuse failed: %s", exc)
                    self._end()
                    return
                _len, opcode, unique, nodeid, uid, gid, pid, _ext, _pad = unpack(buffer)
                if unique >> 63:  # takeover.UNIQUE_RESEND: read by a server that died
                    self.resent_requests += 1
                    if self._on_resent is not None:
                        self._on_resent()
                with self._lock:
                    self._busy += 1
                remotewait.set_token(unique)
                handler = handlers.get(opcode)
                if handler is None:
                    self._unhandled(opcode, unique)
                else:
                    try:
                        handler(Request(unique, nodeid, uid, gid, pid), view[40:length])
                    except Exception:
                        log.exception("handling FUSE opcode %d failed", opcode)
                        self.reply_error(unique, errno.EIO)
                waited, local.waiting = local.waiting, False
                done = time.monotonic()
                with self._lock:
                    self._busy -= 1
                    if waited:
                        self._waiting -= 1
                        self._fast_waits = self._fast_waits + 1 \
                            if done - local.wait_began < GRACE_SECONDS else 0
                        if self._serving_locked() - self._waiting >= 1:
                            self._short_since = None  # the spell ended: a thread is free
                    self._last_done = done
                    serving = self._serving_locked()
                    # Not needed: more threads free of the remote than the base and the
                    # spares (kept so that a burst of misses wakes no thread), and
                    # another one idle to take the next request.
                    extra = serving - self._waiting > self._base + SPARE_THREADS \
                        and self._busy < serving - 1
                    if extra:
                        self._parked += 1
                if extra and not self._park():
                    return
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _park(self) -> bool:
        """Wait to be asked to serve again: True when asked, False after PARKED_SECONDS or at
        the end of the session (the thread then ends)."""
        if self._unpark.acquire(timeout=PARKED_SECONDS) and not self._ended.is_set():
            return True
        with self._lock:
            if self._ended.is_set():
                return False
            # Asked just as the wait ran out: the one who asked counted on this thread.
            if self._unpark.acquire(blocking=False):
                return True
            self._parked -= 1
            return False

    def _wake_parked(self) -> None:
        with self._lock:
            for _ in range(self._parked):
                self._unpark.release()
            self._parked = 0

    # -- dispatch ------------------------------------------------------------------------------

    def _unhandled(self, opcode: int, unique: int) -> None:
        if opcode in (p.FORGET, p.BATCH_FORGET, p.INTERRUPT):
            if opcode == p.INTERRUPT:
                self.reply_error(unique, errno.ENOSYS)  # the kernel stops sending them
            return
        self.reply_error(unique, errno.EROFS if opcode in p.MUTATIONS else errno.ENOSYS)

    def _call(self, req: Request, method, *args) -> bytes | None:
        """Run a file system method and send what it returns (or the errno it raised).
        Returns the body the kernel did not take (its caller was interrupted, or a watchdog
        answered first), for the caller to undo what it stood for; None otherwise."""
        try:
            body = method(req, *args)
        except OSError as exc:
            code = exc.errno if isinstance(exc.errno, int) and exc.errno > 0 else None
            if code is None:
                code = self._unexpected(exc, method)
            self.reply_error(req.unique, code)
            return None
        except Exception as exc:
            code = self.fs.errno_for(exc)
            if code is None:
                code = self._unexpected(exc, method)
            self.reply_error(req.unique, code)
            return None
        if body is DEFERRED or self.reply(req.unique, body or b""):
            return None
        return body

    def _unexpected(self, exc: BaseException, method) -> int:
        log.error("unexpected error in %s; answering EIO", getattr(method, "__name__", method),
                  exc_info=exc)
        if self._on_unexpected is not None:
            self._on_unexpected()
        return errno.EIO

    def _init(self, req: Request, body: memoryview) -> None:
        major, minor, max_readahead, flags, flags2 = p.INIT_IN.unpack_from(body)
        if major != p.KERNEL_MAJOR:
            if major > p.KERNEL_MAJOR:  # the kernel asks again with our major version
                self.reply(req.unique, p.INIT_OUT.pack(p.KERNEL_MAJOR, p.KERNEL_MINOR,
                                                       *(0,) * 11))
                return
            log.error("the kernel speaks FUSE %d.%d; cachefs needs 7.x", major, minor)
            self.reply_error(req.unique, errno.EPROTO)
            return
        offered = flags | (flags2 << 32)
        want = p.ASYNC_READ | p.PARALLEL_DIROPS | p.MAX_PAGES | p.NO_OPENDIR_SUPPORT
        if self._readdirplus:
            # The kernel asks for entries with attributes where its lookups show they are
            # wanted (a first page, or after stats of a directory's names), not for `find`.
            want |= p.DO_READDIRPLUS | p.READDIRPLUS_AUTO
        passthrough = self._want_passthrough and bool(offered & p.PASSTHROUGH)
        if passthrough:
            want |= p.PASSTHROUGH
        if want >> 32:
            want |= p.INIT_EXT
        granted = offered & want
        self.reply(req.unique, p.INIT_OUT.pack(
            p.KERNEL_MAJOR, min(minor, p.KERNEL_MINOR), max_readahead,
            granted & 0xFFFF_FFFF, 64, 48, MAX_WRITE, 1, MAX_PAGES, 0, granted >> 32,
            1 if passthrough else 0, 0))
        note = ""
        if not self._want_passthrough:
            note = "switched off (--passthrough off)"
        elif not offered & p.PASSTHROUGH:
            note = "the kernel does not offer it (Linux 6.9 or newer, CONFIG_FUSE_PASSTHROUGH)"
        else:
            note = self._probe_passthrough()
        self.connection = Connection(min(minor, p.KERNEL_MINOR), passthrough and not note, note)
        self.fs.init(self, self.connection)

    def _probe_passthrough(self) -> str:
        """Register and drop one backing file: "" when that works, else why it does not."""
        probe = os.memfd_create("cachefs-probe", os.MFD_CLOEXEC)
        try:
            self.backing_close(self.backing_open(probe))
        except OSError as exc:
            if exc.errno == errno.EPERM:
                return "the daemon lacks CAP_SYS_ADMIN, which backing files need"
            return f"the kernel refused a backing file ({os.strerror(exc.errno or 0)})"
        finally:
            os.close(probe)
        return ""

    def _destroy(self, req: Request, body: memoryview) -> None:
        self.reply(req.unique)
        self._end()

    def _end(self) -> None:
        self._ended.set()
        self._wake.set()

    def _lookup(self, req: Request, body: memoryview) -> None:
        name = bytes(body[: len(body) - 1])  # NUL-terminated
        lost = self._call(req, self.fs.lookup, req.nodeid, name)
        if lost:  # the kernel never counted this lookup
            self.fs.forget(int.from_bytes(lost[:8], "little"), 1)

    def _forget(self, req: Request, body: memoryview) -> None:
        (nlookup,) = p.FORGET_IN.unpack_from(body)
        self.fs.forget(req.nodeid, nlookup)

    def _batch_forget(self, req: Request, body: memoryview) -> None:
        count, _ = p.BATCH_FORGET_IN.unpack_from(body)
        forget = self.fs.forget
        for offset in range(8, 8 + 16 * count, 16):
            forget(*p.FORGET_ONE.unpack_from(body, offset))

    def _getattr(self, req: Request, body: memoryview) -> None:
        flags, _, fh = p.GETATTR_IN.unpack_from(body)
        self._call(req, self.fs.getattr, req.nodeid, fh if flags & 1 else None)

    def _readlink(self, req: Request, body: memoryview) -> None:
        self._call(req, self.fs.readlink, req.nodeid)

    def _open(self, req: Request, body: memoryview) -> None:
        flags, _ = p.OPEN_IN.unpack_from(body)
        lost = self._call(req, self.fs.open, req.nodeid, flags)
        if lost:  # no RELEASE will come for this open
            self.fs.release(req, req.nodeid, p.OPEN_OUT.unpack_from(lost)[0])

    def _read(self, req: Request, body: memoryview) -> None:
        fh, offset, size, _ = p.READ_IN.unpack_from(body)
        try:
            data = self.fs.read(req, req.nodeid, fh, offset, size)
        except Exception as exc:
            code = exc.errno if isinstance(exc, OSError) and isinstance(exc.errno, int) \
                and exc.errno > 0 else self.fs.errno_for(exc)
            self.reply_error(req.unique, code or self._unexpected(exc, self.fs.read))
            return
        if data is not DEFERRED:
            self.reply_data(req.unique, data)

    def _release(self, req: Request, body: memoryview) -> None:
        fh, _flags, _release_flags = p.RELEASE_IN.unpack_from(body)
        # Answered before the handle goes: a RELEASE this process handled and then died
        # before answering is resent to its successor, by which time the handle's number may
        # name another open (given out meanwhile), which that RELEASE would close; the READs
        # of that open would then be served from whatever file takes the number next.  Dying
        # between the two costs at most a handle the successor keeps for good.
        self.reply(req.unique)
        try:
            self.fs.release(req, req.nodeid, fh)
        except Exception:
            log.exception("release failed")

    def _flush(self, req: Request, body: memoryview) -> None:
        # Nothing to flush on a read-only mount: ENOSYS once, and the kernel stops asking.
        self.reply_error(req.unique, errno.ENOSYS)

    def _opendir(self, req: Request, body: memoryview) -> None:
        # Zero-message opendir where the kernel supports it (NO_OPENDIR_SUPPORT): ENOSYS once.
        flags, _ = p.OPEN_IN.unpack_from(body)
        self._call(req, self.fs.opendir, req.nodeid, flags)

    def _readdir(self, req: Request, body: memoryview) -> None:
        fh, offset, size, _ = p.READ_IN.unpack_from(body)
        self._call(req, self.fs.readdir, req.nodeid, fh, offset, size, False)

    def _readdirplus_request(self, req: Request, body: memoryview) -> None:
        fh, offset, size, _ = p.READ_IN.unpack_from(body)
        self._call(req, self.fs.readdir, req.nodeid, fh, offset, size, True)

    def _releasedir(self, req: Request, body: memoryview) -> None:
        fh, _flags, _release_flags = p.RELEASE_IN.unpack_from(body)
        try:
            self.fs.releasedir(req, req.nodeid, fh)
        except Exception:
            log.exception("releasedir failed")
        self.reply(req.unique)

    def _statfs(self, req: Request, body: memoryview) -> None:
        self._call(req, self.fs.statfs, req.nodeid)

    def _access(self, req: Request, body: memoryview) -> None:
        mask, _ = p.ACCESS_IN.unpack_from(body)
        self._call(req, self.fs.access, req.nodeid, mask)

    def _no_xattr(self, req: Request, body: memoryview) -> None:
        # No extended attributes, as on an NFS share without them.
        self.reply_error(req.unique, errno.EOPNOTSUPP)
