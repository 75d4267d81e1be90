"""Waits on the remote: marked, so that a serving thread is replaced meanwhile, and bounded,
so that nobody waits longer than ``--remote-timeout``.

The FUSE session (cachefs/kernel/session.py) keeps few threads: the daemon's Python runs on
one core at a time, and every thread more takes turns at the GIL for nothing.  But a thread
waiting for the remote (milliseconds, or for ever when an NFS server hangs) is not using the
GIL, and the opens of cached files must not queue behind it.  Code that waits on the remote
says so with ``waiting()``:

- on a thread that installed hooks (a FUSE serving thread, a control connection), ``begin``
  and ``end`` run around the wait (the session starts another thread at once);
- when a :class:`Watchdog` is installed, a wait that outlasts the timeout is answered
  without its thread: ``expire(token)`` fails the request the thread was serving (EIO to
  the kernel, a closed connection to a control client), while the thread itself stays
  parked in its system call until the server answers.  Nothing can interrupt a system
  call stuck on a hard NFS mount; this is how every caller still gets an answer in time.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator

_hooks = threading.local()
_watchdog: Watchdog | None = None


def set_hooks(begin: Callable[[], None], end: Callable[[], None],
              expire: Callable[[object], None] | None = None) -> None:
    """For the calling thread: ``begin`` and ``end`` around each of its waits on the remote,
    and ``expire(token)`` when one outlasts the timeout (``token`` is what
    :func:`set_token` last set on this thread: the request being served)."""
    _hooks.begin, _hooks.end, _hooks.expire = begin, end, expire


def set_token(token: object) -> None:
    """What the calling thread serves now (cheap: called for every request)."""
    _hooks.token = token


def install(watchdog: Watchdog | None) -> None:
    global _watchdog
    _watchdog = watchdog


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    begin = getattr(_hooks, "begin", None)
    expire = getattr(_hooks, "expire", None)
    watch = None
    if expire is not None and _watchdog is not None:
        watch = _watchdog.watch(expire, _hooks.token)
    if begin is not None:
        begin()
    try:
        yield
    finally:
        if begin is not None:
            _hooks.end()
        if watch is not None:
            _watchdog.unwatch(watch)


class Watchdog:
    """Calls ``expire(token)`` for every watched wait still running ``timeout`` seconds after
    it began, and ``on_expired()`` once per such wait (the remote counts a timeout).

    Thread safety: ``_cond`` guards the heap and the set of live watches; callbacks run on
    the watchdog's own thread, outside the lock.
    """

    def __init__(self, timeout_seconds: float, on_expired: Callable[[], None]) -> None:
        self.timeout_seconds = timeout_seconds
        self._on_expired = on_expired
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[object], None], object]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="remote-watchdog", daemon=True)
        self._thread.start()

    def watch(self, expire: Callable[[object], None], token: object) -> int:
        ident = next(self._ids)
        with self._cond:
            first = not self._heap or time.monotonic() + self.timeout_seconds < self._heap[0][0]
            heapq.heappush(self._heap, (time.monotonic() + self.timeout_seconds, ident,
                                        expire, token))
            self._live.add(ident)
            if first:
                self._cond.notify()
        return ident

    def unwatch(self, ident: int) -> None:
        with self._cond:
            self._live.discard(ident)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            due = []
            with self._cond:
                while not self._closed:
                    now = time.monotonic()
                    while self._heap and (self._heap[0][1] not in self._live
                                          or self._heap[0][0] <= now):
                        _deadline, ident, expire, token = heapq.heappop(self._heap)
                        if ident in self._live:
                            self._live.discard(ident)
                            due.append((expire, token))
                    if due:
                        break
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
                if self._closed:
                    return
            for expire, token in due:
                self._on_expired()
                try:
                    expire(token)
                except Exception:  # a caller already gone; nothing to answer
                    pass
