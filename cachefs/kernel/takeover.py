"""Serving a FUSE connection another process set up: what the kernel needs, and what it tells.

The mount lives as long as some process holds its /dev/fuse descriptor: when the process
serving it dies while another holds the descriptor (the supervisor, service/supervisor.py),
readers only wait.  A new server then

- skips INIT, which the kernel sends once per connection: it is handed what the handshake
  settled (:class:`~cachefs.kernel.session.Connection`, as :func:`connection_text` writes it);
- writes FUSE_NOTIFY_RESEND (Linux 6.9+): the kernel queues again every request the dead
  server had read but not answered, each with ``UNIQUE_RESEND`` set in its unique (the reply
  names it as it came, bit and all).  Without it those requests are never answered: their
  callers wait until they are killed or the mount goes away (README, "Restarts and upgrades").

Also here: passing the descriptor between processes over a Unix socket (SCM_RIGHTS).
"""

from __future__ import annotations

import array
import errno
import json
import logging
import os
import socket

from cachefs.kernel import protocol as p
from cachefs.kernel.session import Connection

log = logging.getLogger(__name__)

NOTIFY_RESEND = 7
UNIQUE_RESEND = 1 << 63


def resend(fd: int) -> bool:
    """Ask the kernel to queue again the requests a dead server read; False where it cannot
    (a kernel before 6.9 answers the unknown notification with an error)."""
    try:
        os.write(fd, p.OUT_HEADER.pack(16, NOTIFY_RESEND, 0))
    except OSError as exc:
        if exc.errno in (errno.ENODEV, errno.EBADF):  # unmounted meanwhile: nothing to resend
            return False
        if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            log.warning("this kernel cannot resend the requests the previous server read "
                        "(FUSE_NOTIFY_RESEND needs Linux 6.9): their callers wait until the "
                        "mount goes away")
            return False
        raise
    return True


def connection_text(connection: Connection) -> str:
    return json.dumps({"minor": connection.minor, "passthrough": connection.passthrough,
                       "passthrough_note": connection.passthrough_note})


def connection_from_text(text: str) -> Connection:
    fields = json.loads(text)
    return Connection(int(fields["minor"]), bool(fields["passthrough"]),
                      str(fields.get("passthrough_note", "")))


def send_fd(sock: socket.socket, message: bytes, fd: int) -> None:
    sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def receive(sock: socket.socket, size: int = 65536) -> tuple[bytes, list[int]]:
    """One message and the descriptors that came with it (close-on-exec)."""
    fds = array.array("i")
    message, ancillary, _flags, _address = sock.recvmsg(
        size, socket.CMSG_SPACE(16 * fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return message, list(fds)
