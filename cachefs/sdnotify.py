"""sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET.

systemd's Type=notify waits for READY=1 before it considers the unit started;
STATUS= shows in `systemctl status`.  Outside systemd this does nothing.
"""

from __future__ import annotations

import os
import socket


def notify(message: str) -> bool:
    """Send ``message`` (newline-separated KEY=VALUE pairs); False when there is no listener."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError:
        return False
    return True
