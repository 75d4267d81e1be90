"""Finding the cachefs daemon behind a path, and talking to it, from any process.

The daemon is found from the path alone: _paths.py maps a path to the cachefs mount that
holds it (through symlinks, bind mounts of a subdirectory, other mount namespaces) and to
the daemon's name for the file; _control.py finds the daemon's control socket from that
mount.

Connections are made lazily in the process that uses them and made again after
a fork (DataLoader workers inherit the parent's objects, not its sockets).
Nothing here may stop training: when the daemon is missing, gone or slow, the
caller gets False, a warning is shown once, and a reconnect is tried now and
then, never more often than every few seconds.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable

from cachefs_client._control import Unreachable, connect
from cachefs_client._paths import MOUNTINFO, PathMap

SEND_TIMEOUT_SECONDS = 1.0
RETRY_SECONDS = 5.0

_warned: set[str] = set()


def warn_once(key: str, message: str | Callable[[], str]) -> None:
    """Warn once per process for ``key``; ``message`` may be a function, called only then."""
    if key not in _warned:
        _warned.add(key)
        text = message() if callable(message) else message
        warnings.warn(f"cachefs: {text}", RuntimeWarning, stacklevel=3)


def warn_unreachable(mount_point: str, exc: Unreachable) -> None:
    """One warning per mount for a daemon that cannot be reached, whoever tried (hints or
    the fast path)."""
    warn_once(f"unreachable:{mount_point}",
              f"{exc}; training goes on without hints, reading through the mount")


def warn_not_on_mount(paths: PathMap, path) -> None:
    """One warning per process for paths on no cachefs mount, saying why."""
    warn_once("nomount", lambda: not_on_mount_message(paths, path))


def not_on_mount_message(paths: PathMap, path) -> str:
    text = os.fsdecode(os.fspath(path))
    directory = os.path.dirname(os.path.abspath(text))
    resolved, entry = paths.resolve_directory(directory)
    if paths.table_error is not None:
        return (f"cannot read {MOUNTINFO} ({paths.table_error.strerror}), so no path is "
                "known to be on a cachefs mount and no hints are sent; make /proc readable "
                "in this container")
    shown = text if resolved == directory else f"{text} (in {resolved})"
    where = "no mount" if entry is None else f"the {entry.fstype} mount at {entry.mount_point}"
    return (f"{shown} is not on a cachefs mount but on {where}; no hints are sent for such "
            "paths")


class Connection:
    """A connection of this process to a daemon, closed by ``_close_locked`` under
    ``_lock``; how it is let go after a fork and at exit."""

    _lock: threading.Lock

    def _close_locked(self) -> None:
        raise NotImplementedError

    def abandon(self) -> None:
        """In a child forked with this connection: close the child's copy, the parent's own
        untouched.  Without the lock, which a thread of the parent may have held as it
        forked (only this thread runs here)."""
        self._close_locked()

    def close_if_idle(self) -> None:
        """At exit: close the connection unless a thread is using it this moment."""
        if self._lock.acquire(blocking=False):
            try:
                self._close_locked()
            finally:
                self._lock.release()


class DaemonLink(Connection):
    """The control connection of this process to the daemon of one mount.

    Thread safety: ``_lock`` serialises use of the socket.
    """

    def __init__(self, mount_point: str) -> None:
        self.mount_point = mount_point
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._retry_at = 0.0

    def _connect_locked(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        now = time.monotonic()
        if now < self._retry_at:
            return None
        self._retry_at = now + RETRY_SECONDS
        try:
            self._sock = connect(self.mount_point, SEND_TIMEOUT_SECONDS)
        except Unreachable as exc:
            warn_unreachable(self.mount_point, exc)
        return self._sock

    def reachable(self) -> bool:
        """Connect now if not connected (a warning once if that fails)."""
        with self._lock:
            return self._connect_locked() is not None

    def send(self, payload: bytes) -> bool:
        """Send request lines that need no answer; False (and a warning once) on failure."""
        with self._lock:
            sock = self._connect_locked()
            if sock is None:
                return False
            try:
                sock.sendall(payload)
                return True
            except OSError as exc:
                self._close_locked()
                warn_once(f"lost:{self.mount_point}",
                          f"lost the daemon of {self.mount_point} ({exc}); training goes on "
                          "without hints")
                return False

    def _close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()


class _ProcessState:
    """What one process holds; replaced wholesale when the pid changes (after fork)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.paths = PathMap()
        self.links: dict[str, DaemonLink] = {}
        self.readers: dict = {}  # mount point -> fastpath.DaemonReader
        self.lock = threading.Lock()

    def holders(self) -> list:
        return [*self.links.values(), *self.readers.values()]


_state: _ProcessState | None = None


def process_state() -> _ProcessState:
    global _state
    state = _state
    if state is None or state.pid != os.getpid():
        if state is not None:
            # Forked: this process's copies of the parent's connections are closed here
            # (else each is left to the garbage collector, a ResourceWarning each in every
            # DataLoader worker); the parent's stay open.
            for holder in state.holders():
                holder.abandon()
        state = _state = _ProcessState()
    return state


@atexit.register
def _close_at_exit() -> None:
    state = _state
    if state is not None and state.pid == os.getpid():
        for holder in state.holders():
            holder.close_if_idle()


def per_process(registry: str, mount_point: str, make):
    """This process's object for ``mount_point`` in ``registry`` (made by ``make`` once)."""
    state = process_state()
    with state.lock:
        objects = getattr(state, registry)
        found = objects.get(mount_point)
        if found is None:
            found = objects[mount_point] = make(mount_point)
        return found


def link_for(mount_point: str) -> DaemonLink:
    return per_process("links", mount_point, DaemonLink)


def send_hints(paths) -> int:
    """Hint ``paths`` (any path-like) to the daemons of the mounts they are on.

    Returns how many were sent.  Paths on no cachefs mount are skipped with a
    warning shown once.
    """
    state = process_state()
    by_mount: dict[str, list[bytes]] = {}
    for path in paths:
        found = _locate(state.paths, path)
        if found is None:
            continue
        mount_point, relative = found
        if relative and "\n" not in relative:
            by_mount.setdefault(mount_point, []).append(os.fsencode(relative))
    sent = 0
    for mount_point, relatives in by_mount.items():
        payload = b"".join(b"HINT " + r + b"\n" for r in relatives)
        if link_for(mount_point).send(payload):
            sent += len(relatives)
    return sent


def check_daemon(path) -> bool:
    """Whether the daemon behind ``path`` can be reached now, warning once if not.  Called
    before DataLoader workers start, so that workers forked after it inherit the warning
    instead of each repeating it."""
    state = process_state()
    found = _locate(state.paths, path)
    return found is not None and link_for(found[0]).reachable()


def _locate(paths, path):
    """``paths.locate(path)``: (mount point, path inside it), or None with a warning once
    for a path on no cachefs mount, or for what is no path at all (a path_of that returns
    an index or None).  Training goes on either way, without hints for such paths."""
    try:
        found = paths.locate(path)
    except (TypeError, ValueError) as exc:  # not path-like, or a NUL in it
        warn_once("not a path", f"{path!r} is not a path ({exc}); no hints are sent for "
                  "such paths")
        return None
    if found is None:
        warn_not_on_mount(paths, path)
    return found
