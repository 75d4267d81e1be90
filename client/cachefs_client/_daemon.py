"""Finding the cachefs daemon behind a path, and talking to it, from any process.

The daemon is found from the path alone: /proc/self/mountinfo says which
``fuse.cachefs`` mount holds it, and the hidden symlink ``.cachefs.sock`` at
that mount's root leads to the daemon's control socket.

Connections are made lazily in the process that uses them and made again after
a fork (DataLoader workers inherit the parent's objects, not its sockets).
Nothing here may stop training: when the daemon is missing, gone or slow, the
caller gets False, a warning is shown once, and a reconnect is tried now and
then, never more often than every few seconds.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
import warnings

FSTYPE = "fuse.cachefs"
CONTROL_NAME = ".cachefs.sock"
SEND_TIMEOUT_SECONDS = 1.0
RETRY_SECONDS = 5.0
MOUNTINFO_REFRESH_SECONDS = 1.0

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"cachefs: {message}", RuntimeWarning, stacklevel=3)


def _unescape(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        digits = field[i + 1 : i + 4]
        if field[i] == "\\" and len(digits) == 3 and digits.isdigit():
            out.append(chr(int(digits, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def cachefs_mounts() -> list[str]:
    """Mount points of the cachefs mounts this process sees, longest first."""
    found = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, tail = left.split(), right.split()
                if len(fields) >= 5 and tail and tail[0] == FSTYPE:
                    found.append(_unescape(fields[4]))
    except OSError:
        pass
    return sorted(found, key=len, reverse=True)


class MountIndex:
    """Which cachefs mount a path is under.  Thread safety: a lock.

    Answers are cached per directory.  A path on no known mount makes the mount
    table be read again, at most once a second: a mount made after this process
    started is found, and a loop over paths on no mount stays cheap.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mounts: list[str] = []
        self._read_at = -1e9
        self._by_dir: dict[str, str] = {}

    def root_of(self, path: str) -> str | None:
        directory = os.path.dirname(path)
        with self._lock:
            root = self._by_dir.get(directory)
            if root is not None:
                return root
            root = self._find(path)
            now = time.monotonic()
            if root is None and now - self._read_at > MOUNTINFO_REFRESH_SECONDS:
                self._mounts, self._read_at = cachefs_mounts(), now
                root = self._find(path)
            if root is not None:
                if len(self._by_dir) > 100_000:
                    self._by_dir.clear()
                self._by_dir[directory] = root
            return root

    def _find(self, path: str) -> str | None:
        return next((m for m in self._mounts
                     if path == m or path.startswith(m.rstrip("/") + "/")), None)


class DaemonLink:
    """The control connection of this process to the daemon of one mount.

    Thread safety: ``_lock`` serialises use of the socket.
    """

    def __init__(self, mount_root: str) -> None:
        self.mount_root = mount_root
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
            target = os.readlink(os.path.join(self.mount_root, CONTROL_NAME))
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.settimeout(SEND_TIMEOUT_SECONDS)
            sock.connect(target)
        except OSError as exc:
            why = "is gone" if exc.errno == errno.ENOTCONN else f"cannot be reached ({exc})"
            warn_once(f"down:{self.mount_root}",
                      f"the daemon of {self.mount_root} {why}; training goes on without hints")
            return None
        self._sock = sock
        return sock

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
                self._drop_locked()
                warn_once(f"lost:{self.mount_root}",
                          f"lost the daemon of {self.mount_root} ({exc}); training goes on "
                          "without hints")
                return False

    def _drop_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop_locked()


class _ProcessState:
    """What one process holds; replaced wholesale when the pid changes (after fork)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.mounts = MountIndex()
        self.links: dict[str, DaemonLink] = {}
        self.readers: dict = {}  # mount root -> fastpath.DaemonReader
        self.lock = threading.Lock()


_state: _ProcessState | None = None


def process_state() -> _ProcessState:
    global _state
    state = _state
    if state is None or state.pid != os.getpid():
        state = _state = _ProcessState()
    return state


def per_process(registry: str, mount_root: str, make):
    """This process's object for ``mount_root`` in ``registry`` (made by ``make`` once)."""
    state = process_state()
    with state.lock:
        objects = getattr(state, registry)
        found = objects.get(mount_root)
        if found is None:
            found = objects[mount_root] = make(mount_root)
        return found


def link_for(mount_root: str) -> DaemonLink:
    return per_process("links", mount_root, DaemonLink)


def send_hints(paths) -> int:
    """Hint ``paths`` (any path-like) to the daemons of the mounts they are on.

    Returns how many were sent.  Paths on no cachefs mount are skipped with a
    warning shown once.
    """
    state = process_state()
    by_root: dict[str, list[bytes]] = {}
    for path in paths:
        absolute = os.path.abspath(os.fspath(path))
        root = state.mounts.root_of(absolute)
        if root is None:
            warn_once("nomount", f"{absolute} is not on a cachefs mount; no hints are sent "
                      "for such paths")
            continue
        relative = absolute[len(root):].lstrip("/")
        by_root.setdefault(root, []).append(os.fsencode(relative))
    sent = 0
    for root, relatives in by_root.items():
        payload = b"".join(b"HINT " + r + b"\n" for r in relatives if b"\n" not in r)
        if link_for(root).send(payload):
            sent += len(relatives)
    return sent
