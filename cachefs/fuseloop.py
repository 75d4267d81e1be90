"""libfuse's request loop, run on Python threads.

libfuse's own multi-threaded loop runs every callback on a thread Python has never seen, so
each callback builds and destroys a Python thread state (with an mmap and munmap of its frame
stack), and it starts another thread whenever all are busy, which in a daemon bound by the GIL
means many threads handing the GIL to one another.  Here a few Python threads take requests
from the kernel themselves and process each one holding the GIL, with the thread state they
already have; the GIL is given up while a thread waits for the kernel and wherever a callback
gives it up (remote and disk I/O).  Measured with 8 readers of 64 KiB files from a warm
cache: 1.5 to 2 times the files/s of libfuse's loop.

Few threads, because each one more wakes up to find the GIL taken: with 8 readers of cached
files on 2 cores, 2 threads used a fifth (page cache warm) to a third (cold) less CPU per
file than 8.
Threads are added where waiting, not Python, is what a request costs:

- a thread that waits on the remote (cachefs/remotewait.py) is replaced at once, so that
  misses are fetched in parallel and never hold up the reads of cached files;
- when every thread has been busy with one request for STUCK_SECONDS (a wait nobody
  marked, a hung cache disk), the threads double.

Threads no longer needed (another one is idle) park, to be woken by the next wait on the
remote instead of starting a thread, and end after PARKED_SECONDS parked.  Used with libfuse 2
only (cachefs/_fuse.py decides).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import threading
import time

from cachefs import remotewait
from cachefs.mountpoint import unmount

log = logging.getLogger(__name__)

BASE_THREADS = 2
MAX_THREADS = 128
STUCK_SECONDS = 0.1
# A thread no longer needed waits this long to be needed again before it ends.
PARKED_SECONDS = 60.0
# How long unmounting waits for requests still being served (a callback waiting on the
# remote ends within its timeout); after that the process exits with them.
DRAIN_SECONDS = 10.0
_c_void_p, _c_int, _c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t


class _FuseBuf(ctypes.Structure):
    """struct fuse_buf (fuse_common.h)."""

    _fields_ = [("size", _c_size_t), ("flags", _c_int), ("mem", _c_void_p), ("fd", _c_int),
                ("pos", ctypes.c_longlong)]


class _Libfuse:
    """The functions of libfuse 2 the loop calls.  ``held`` ones keep the GIL: they never
    block, or (process_buf) they call back into Python on this same thread."""

    def __init__(self, path: str) -> None:
        free, held = ctypes.CDLL(path), ctypes.PyDLL(path)
        self.setup = _fn(free, "fuse_setup", _c_void_p, _c_int, ctypes.POINTER(ctypes.c_char_p),
                         _c_void_p, _c_size_t, ctypes.POINTER(ctypes.c_char_p),
                         ctypes.POINTER(_c_int), _c_void_p)
        self.teardown = _fn(free, "fuse_teardown", None, _c_void_p, ctypes.c_char_p)
        self.get_session = _fn(held, "fuse_get_session", _c_void_p, _c_void_p)
        self.next_chan = _fn(held, "fuse_session_next_chan", _c_void_p, _c_void_p, _c_void_p)
        self.chan_bufsize = _fn(held, "fuse_chan_bufsize", _c_size_t, _c_void_p)
        self.receive = _fn(free, "fuse_session_receive_buf", _c_int, _c_void_p,
                           ctypes.POINTER(_FuseBuf), ctypes.POINTER(_c_void_p))
        self.process = _fn(held, "fuse_session_process_buf", None, _c_void_p,
                           ctypes.POINTER(_FuseBuf), _c_void_p)
        self.exited = _fn(held, "fuse_session_exited", _c_int, _c_void_p)
        self.exit = _fn(held, "fuse_session_exit", None, _c_void_p)


def _fn(library, name: str, restype, *argtypes):
    function = getattr(library, name)
    function.restype, function.argtypes = restype, argtypes
    return function


class _Loop:
    """The threads serving one session.

    A thread is serving (taking requests from the kernel) or parked (waiting to be asked to
    serve again): threads that are no longer needed park rather than end, so that the next
    wait on the remote costs a wake-up, not a new thread.

    Thread safety: ``_lock`` guards ``_threads``, ``_busy_since``, ``_waiting`` and
    ``_parked``.
    """

    def __init__(self, fuse: _Libfuse, session: int, threads: int) -> None:
        self._fuse = fuse
        self._session = session
        self._chan = fuse.next_chan(session, None)
        self._bufsize = fuse.chan_bufsize(self._chan)
        self._base = threads
        self._lock = threading.Lock()
        self._threads: dict[int, threading.Thread] = {}  # every thread, parked ones too
        self._busy_since: dict[int, float] = {}  # thread ident -> when its request came
        self._waiting = 0  # serving threads waiting on the remote
        self._parked = 0
        self._unpark = threading.Semaphore(0)

    def run(self) -> None:
        for _ in range(self._base):
            self._add_thread()
        while not self._fuse.exited(self._session):
            time.sleep(STUCK_SECONDS / 2)
            self._add_if_stuck()
        self._drain()

    def _add_thread(self) -> None:
        """One more serving thread: a parked one if there is one, else a new one."""
        with self._lock:
            if self._parked:
                self._parked -= 1
                self._unpark.release()
                return
            if len(self._threads) >= MAX_THREADS:
                return
            thread = threading.Thread(target=self._serve, name="fuse", daemon=True)
            thread.start()
            self._threads[thread.ident] = thread

    def _serving_locked(self) -> int:
        return len(self._threads) - self._parked

    def _add_if_stuck(self) -> None:
        now = time.monotonic()
        with self._lock:
            serving = self._serving_locked()
            stuck = (len(self._busy_since) == serving and all(
                now - since >= STUCK_SECONDS for since in self._busy_since.values()))
        if stuck:
            # Double: the kernel hands out requests in order, so a read of a cached file may
            # queue behind many that would be stuck too.
            for _ in range(serving):
                self._add_thread()

    def _begin_remote_wait(self) -> None:
        with self._lock:
            self._waiting += 1
            short = self._serving_locked() - self._waiting < self._base
        if short:
            self._add_thread()

    def _end_remote_wait(self) -> None:
        with self._lock:
            self._waiting -= 1

    def _serve(self) -> None:
        fuse, session = self._fuse, self._session
        me = threading.get_ident()
        remotewait.set_hooks(self._begin_remote_wait, self._end_remote_wait)
        memory = ctypes.create_string_buffer(self._bufsize)
        buf, chan = _FuseBuf(), _c_void_p()
        try:
            while not fuse.exited(session):
                buf.size, buf.flags, buf.mem, buf.fd, buf.pos = (
                    self._bufsize, 0, ctypes.addressof(memory), -1, 0)
                chan.value = self._chan
                received = fuse.receive(session, ctypes.byref(buf), ctypes.byref(chan))
                if received == -errno.EINTR:
                    continue
                if received <= 0:  # 0: unmounted
                    if received < 0:
                        fuse.exit(session)
                    return
                with self._lock:
                    self._busy_since[me] = time.monotonic()
                fuse.process(session, ctypes.byref(buf), chan)
                with self._lock:
                    del self._busy_since[me]
                    serving = self._serving_locked()
                    # Not needed: more threads free of the remote than the base, and another
                    # one idle to take the next request.
                    extra = serving - self._waiting > self._base \
                        and len(self._busy_since) < serving - 1
                    if extra:
                        self._parked += 1
                if extra and not self._park():
                    return
        finally:
            with self._lock:
                self._busy_since.pop(me, None)
                self._threads.pop(me, None)

    def _park(self) -> bool:
        """Wait to be asked to serve again: True when asked, False after PARKED_SECONDS
        (the thread then ends: a burst of waits on the remote long past)."""
        if self._unpark.acquire(timeout=PARKED_SECONDS):
            return True
        with self._lock:
            # Asked just as the wait ran out: the one who asked counted on this thread.
            if self._unpark.acquire(blocking=False):
                return True
            self._parked -= 1
            return False

    def _drain(self) -> None:
        """Stop every thread before the session is freed: wake the parked ones and those
        waiting for the kernel (libfuse's own SIGHUP handler only marks the session exited),
        let the busy ones finish their request."""
        deadline = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < deadline:
            with self._lock:
                threads = [t for t in self._threads.values() if t.is_alive()]
                for _ in range(self._parked):  # they see the session exited, and end
                    self._unpark.release()
                self._parked = 0
            if not threads:
                return
            for thread in threads:
                if thread.ident not in self._busy_since:
                    try:
                        signal.pthread_kill(thread.ident, signal.SIGHUP)
                    except (ProcessLookupError, ValueError):
                        pass
            threads[0].join(0.05)
        raise TimeoutError(f"FUSE requests still running after {DRAIN_SECONDS:g} s")


def make_main(libfuse_path: str, threads: int = BASE_THREADS):
    """A replacement for libfuse's fuse_main_real(argc, argv, ops, size, user_data) that
    serves the mount with :class:`_Loop`."""
    fuse = _Libfuse(libfuse_path)

    def fuse_main_real(argc, argv, operations, operations_size, user_data) -> int:
        mountpoint, multithreaded = ctypes.c_char_p(), _c_int()
        # Mounts, parses the options, and sets libfuse's SIGHUP/SIGINT/SIGTERM handlers.
        handle = fuse.setup(argc, argv, operations, operations_size, ctypes.byref(mountpoint),
                            ctypes.byref(multithreaded), user_data)
        if not handle:
            return 1
        try:
            _Loop(fuse, fuse.get_session(handle), threads if multithreaded.value else 1).run()
        except TimeoutError as exc:
            # The session cannot be freed under a running request: detach the mount and
            # let the process exit with it.
            log.error("%s; detaching the mount without waiting for them", exc)
            unmount(os.fsdecode(mountpoint.value), lazy=True)
            return 1
        fuse.teardown(handle, mountpoint)
        return 0

    return fuse_main_real
