"""sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET.

systemd's Type=notify waits for READY=1 before it considers the unit started;
STATUS= shows in `systemctl status`; MAINPID= names the unit's main process; FDSTORE=1 with
descriptors attached (SCM_RIGHTS) gives them to systemd's file descriptor store
(service/fdstore.py).  Outside systemd this does nothing.
"""

from __future__ import annotations

import array
import os
import socket
import threading
import time
from collections.abc import Callable

# How often STATUS= is refreshed: `systemctl status` shows the last one sent, and the
# hit ratio it carries is only worth reading if it is recent.
STATUS_INTERVAL_SECONDS = 10.0


def notify(message: str, fds: tuple[int, ...] = ()) -> bool:
    """Send ``message`` (newline-separated KEY=VALUE pairs), with ``fds`` attached; False when
    there is no listener."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendmsg([message.encode()], ancillary)
    except OSError:
        return False
    return True


def keep_status_current(status_line: Callable[[], str],
                        interval: float = STATUS_INTERVAL_SECONDS) -> None:
    """Send ``STATUS=<status_line()>`` every ``interval`` seconds from a daemon thread.

    Does nothing outside systemd.  Stops when ``status_line`` fails, which happens
    only while the daemon is shutting down.
    """
    if not os.environ.get("NOTIFY_SOCKET"):
        return

    def run() -> None:
        while True:
            time.sleep(interval)
            try:
                line = status_line()
            except Exception:
                return
            notify(f"STATUS={line}")

    threading.Thread(target=run, name="sd-status", daemon=True).start()
