"""``cachefs upgrade MOUNTPOINT``: hand a mount from the daemon serving it to a new one, which
may run another version of cachefs (the one ``cachefs upgrade`` itself runs from).

1. ``cachefs upgrade`` asks the running daemon for its mount command (STATUS, ``command``) and
   starts that command again, detached, as ``cachefs mount`` does, with
   ``CACHEFS_TAKE_OVER_FROM`` naming the old daemon's control socket.
2. The new supervisor, before it forks anything, asks the old serving process for the mount
   (``HANDOVER``: the /dev/fuse descriptor over SCM_RIGHTS, what INIT settled, the restarts
   so far), then tells it to go (``RELINQUISH``): it exits at once, as a killed one would,
   and its supervisor with it, without unmounting.  The requests it had read and not answered
   are resent to the successor (kernel/takeover.py); its node and handle tables stay in the
   runtime directory for the successor, as after a crash.  RELINQUISH brings back the token
   of HANDOVER's reply, so that no client sending commands blindly ends the daemon.
3. The new supervisor forks its serving child on the descriptor, which takes the mount over
   once the old one is gone (the cache dir's lock is free), and reports ready; ``cachefs
   upgrade`` prints the pause and returns.

Only the daemon's own user (or root) may ask for the descriptor.  A daemon too old to know
HANDOVER answers "unknown command": nothing is changed, and the upgrade fails in one line.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from dataclasses import dataclass

from cachefs.control import client
from cachefs.errors import UsageError
from cachefs.kernel import takeover
from cachefs.kernel.mountpoint import FSTYPE, find_mount
from cachefs.kernel.session import Connection
from cachefs.service.process import wait_gone

TAKE_OVER_ENV = "CACHEFS_TAKE_OVER_FROM"
HANDOVER_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class Handover:
    """A mount received from the daemon that served it."""

    fd: int
    connection: Connection | None
    restarts: int
    mounted_at: float
    old_pid: int
    gone_at: float | None  # when the old serving process was gone (time.time()); None: unknown
    source: str = "daemon"  # from the serving daemon; "fdstore": from systemd (fdstore.py)


def running_command(mountpoint: str) -> tuple[list[str], dict]:
    """The arguments the daemon serving ``mountpoint`` was started with, and its status."""
    status = client.status(mountpoint)
    command = status.get("command")
    if not command:
        raise UsageError(f"the daemon of {mountpoint} (cachefs {status.get('version', '?')}) "
                         "cannot hand its mount over; unmount and mount again instead")
    return list(command), status


def serving_daemon(mountpoint: str | os.PathLike, control_path: str) -> str | None:
    """``control_path`` when a daemon serving ``mountpoint`` answers there (``cachefs mount
    --take-over``: a new pod takes the mount of the old one); None when there is nothing to
    take over: no cachefs mount, or a dead daemon's (its stale mount is cleared as usual).
    The socket is asked, not the mount: a dead daemon's mount would hang the asking."""
    entry = find_mount(mountpoint)
    if entry is None or entry.fstype != FSTYPE:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(HANDOVER_TIMEOUT_SECONDS)
            sock.connect(control_path)
            sock.sendall(b"PING\n")
            answer = json.loads(sock.makefile("rb").readline() or b"{}")
    except (OSError, ValueError):
        return None
    return control_path if answer.get("ok") else None


def receive_mount(control_path: str) -> Handover:
    """Take the mount from the serving process at ``control_path``; it is gone on return."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HANDOVER_TIMEOUT_SECONDS)
    try:
        try:
            sock.connect(control_path)
            visible_pid = _peer_pid(sock)
            sock.sendall(b"HANDOVER\n")
            line, fds = _reply(sock)
        except OSError as exc:
            raise UsageError(f"cannot reach the daemon at {control_path}: "
                             f"{exc.strerror or exc}") from None
        reply = json.loads(line)
        if not reply.get("ok") or not fds:
            for fd in fds:
                os.close(fd)
            raise UsageError(f"the running daemon refused to hand its mount over: "
                             f"{reply.get('error', 'no descriptor')}")
        fd = fds[0]
        connection = reply.get("connection")
        refusal = b""
        try:
            sock.sendall(b"RELINQUISH %s\n" % str(reply.get("token", "")).encode())
            # It exits without answering (end of file); a refusal is one line.
            while not refusal.endswith(b"\n") and (chunk := sock.recv(4096)):
                refusal += chunk
        except OSError:
            pass
        if refusal:
            os.close(fd)
            try:
                error = json.loads(refusal).get("error", "no reason given")
            except (ValueError, AttributeError):
                error = refusal.decode(errors="replace").strip()
            raise UsageError(f"the running daemon refused to hand its mount over: {error}")
    finally:
        sock.close()
    old_pid = int(reply["pid"])  # as its own PID namespace numbers it
    # Waited for by the pid this namespace sees: in another container's namespace (a pod of a
    # rolling update) its own pid names some other process here, or none, and the kernel says
    # 0; the end of file above, at its exit, is then all there is to wait for.
    if visible_pid and not wait_gone(visible_pid, HANDOVER_TIMEOUT_SECONDS):
        raise UsageError(f"the old serving process {old_pid} did not exit")
    return Handover(fd, takeover.connection_from_text(connection) if connection else None,
                    int(reply.get("restarts", 0)), float(reply.get("mounted_at", time.time())),
                    old_pid, time.time())


def _peer_pid(sock: socket.socket) -> int:
    """The pid of the process that listens at the other end of ``sock``, as this process's PID
    namespace numbers it; 0 where it cannot see that process."""
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", credentials)[0]


def _reply(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The first reply line and the descriptors that came with it."""
    data = bytearray()
    fds: list[int] = []
    while not data.endswith(b"\n"):
        chunk, more = takeover.receive(sock, 65536)
        if not chunk:
            raise OSError(0, "the daemon closed the connection")
        data += chunk
        fds += more
    return bytes(data), fds
