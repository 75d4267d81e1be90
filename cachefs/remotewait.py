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

import itertools
import threading
import time
from collections.abc import Callable


class _Hooks(threading.local):
    """The calling thread's hooks; None on a thread that set none (a fill, a prefetch): the
    class's defaults, so that asking costs no failed lookup (an AttributeError caught
    inside getattr, three per call on the remote)."""

    begin: Callable[[], None] | None = None
    end: Callable[[], None] | None = None
    expire: Callable[[object], None] | None = None
    token: object = None


_hooks = _Hooks()
# How often the watchdog looks for waits past their deadline: a wait is answered at most
# this much after its timeout.
POLL_SECONDS = 0.25
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


class waiting:  # noqa: N801 - used as a function: ``with waiting():``
    """Around a wait on the remote.  ``remote_call`` False: a wait for another thread's
    call (a fetch in flight), which is bounded like a call but not counted as one.

    A class rather than a generator: it runs around every call on the remote, and a
    generator-based context manager costs several times as much."""

    __slots__ = ("_remote_call", "_begin", "_watchdog", "_watch")

    def __init__(self, *, remote_call: bool = True) -> None:
        self._remote_call = remote_call

    def __enter__(self) -> None:
        hooks = _hooks
        begin = self._begin = hooks.begin
        watchdog = self._watchdog = _watchdog
        self._watch = None
        if watchdog is not None:
            self._watch = watchdog.watch(hooks.expire, hooks.token, counted=self._remote_call)
        if begin is not None:
            begin()

    def __exit__(self, *exc_info: object) -> None:
        if self._begin is not None:
            _hooks.end()
        if self._watch is not None:
            self._watchdog.unwatch(self._watch)


class Watchdog:
    """Calls ``on_expired()`` for every watched call still running ``timeout`` seconds after
    it began (the remote counts a timeout), and ``expire(token)`` for every such wait that
    came with one (the caller's request is answered).

    Every wait has the same timeout, so the oldest watch is always the first to expire:
    the watches are kept in order of age, and ending one is a dictionary deletion.

    Thread safety: ``_cond`` guards ``_watches`` but for ``unwatch``, a single dictionary
    deletion (atomic under the interpreter lock); callbacks run on the watchdog's own
    thread, outside the lock.
    """

    def __init__(self, timeout_seconds: float, on_expired: Callable[[], None]) -> None:
        self.timeout_seconds = timeout_seconds
        self._on_expired = on_expired
        self._cond = threading.Condition(threading.Lock())
        # ident -> (deadline, expire, token, counted), oldest first (insertion order).
        self._watches: dict[int, tuple[float, Callable[[object], None] | None, object,
                                       bool]] = {}
        self._ids = itertools.count()
        self._closed = False
        self._idle = False  # asleep until the next watch
        self._thread = threading.Thread(target=self._run, name="remote-watchdog", daemon=True)
        self._thread.start()

    def watch(self, expire: Callable[[object], None] | None, token: object, *,
              counted: bool = True) -> int:
        ident = next(self._ids)
        with self._cond:
            self._watches[ident] = (time.monotonic() + self.timeout_seconds, expire, token,
                                    counted)
            # While busy the watchdog looks every POLL_SECONDS (a timeout of seconds can
            # afford it), so a call need not wake it: at most one wake per poll.
            if self._idle:
                self._idle = False
                self._cond.notify()
        return ident

    def unwatch(self, ident: int) -> None:
        # One dictionary operation, atomic without the lock: every call on the remote
        # ends here.
        self._watches.pop(ident, None)

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
                    # (An unwatch may take any entry meanwhile: nothing here assumes one
                    # seen a moment ago is still there.)
                    while (oldest := next(iter(self._watches.items()), None)) is not None:
                        ident, (deadline, expire, token, counted) = oldest
                        if deadline > now:
                            break
                        if self._watches.pop(ident, None) is not None:
                            due.append((expire, token, counted))
                    if due:
                        break
                    if oldest is not None:
                        self._cond.wait(min(oldest[1][0] - now, POLL_SECONDS))
                    else:
                        self._idle = True
                        self._cond.wait()
                if self._closed:
                    return
            for expire, token, counted in due:
                if counted:
                    self._on_expired()
                if expire is not None:
                    try:
                        expire(token)
                    except Exception:  # a caller already gone; nothing to answer
                        pass
