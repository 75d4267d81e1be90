"""Talking to a running daemon from the command line, knowing only its mount point."""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
from pathlib import Path

from cachefs.errors import UsageError
from cachefs.kernel.mountpoint import FSTYPE, find_mount
from cachefs.mirror.tree import CONTROL_NAME

CONNECT_TIMEOUT_SECONDS = 5.0


def _readlink_with_timeout(path: Path, timeout: float) -> str:
    """readlink through the mount without hanging on a daemon that does not answer."""
    result: list = []

    def run() -> None:
        try:
            result.append(os.readlink(path))
        except OSError as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        raise UsageError(f"the cachefs daemon at {path.parent} does not answer; "
                         f"run 'cachefs unmount --lazy {path.parent}'")
    if isinstance(result[0], OSError):
        exc = result[0]
        if exc.errno == errno.ENOTCONN:
            raise UsageError(f"the cachefs daemon at {path.parent} is gone (stale mount); "
                             f"run 'cachefs unmount --lazy {path.parent}'")
        raise UsageError(f"cannot reach the daemon of {path.parent}: {exc.strerror}")
    return result[0]


def control_path(mountpoint: str | os.PathLike) -> str:
    """Where the control socket of the daemon serving ``mountpoint`` is."""
    mountpoint = Path(os.path.abspath(mountpoint))
    entry = find_mount(mountpoint)
    if entry is None or entry.fstype != FSTYPE:
        what = "not mounted" if entry is None else f"a {entry.fstype} mount"
        raise UsageError(f"{mountpoint} is not a cachefs mount ({what})")
    return _readlink_with_timeout(mountpoint / CONTROL_NAME, CONNECT_TIMEOUT_SECONDS)


def connect(mountpoint: str | os.PathLike, timeout: float = CONNECT_TIMEOUT_SECONDS
            ) -> socket.socket:
    """A connected control socket of the daemon serving ``mountpoint``."""
    mountpoint = Path(os.path.abspath(mountpoint))
    entry = find_mount(mountpoint)
    if entry is None or entry.fstype != FSTYPE:
        what = "not mounted" if entry is None else f"a {entry.fstype} mount"
        raise UsageError(f"{mountpoint} is not a cachefs mount ({what})")
    target = _readlink_with_timeout(mountpoint / CONTROL_NAME, timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(target)
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot connect to the daemon of {mountpoint} at {target}: "
                         f"{exc.strerror}") from None
    return sock


def request(sock: socket.socket, line: str | bytes) -> dict:
    """Send one request line and read its JSON reply."""
    data = line.encode() if isinstance(line, str) else line
    sock.sendall(data.rstrip(b"\n") + b"\n")
    reply = bytearray()
    while not reply.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise UsageError("the daemon closed the connection without answering")
        reply += chunk
    return json.loads(reply)


def status(mountpoint: str | os.PathLike) -> dict:
    with connect(mountpoint) as sock:
        return request(sock, "STATUS")
