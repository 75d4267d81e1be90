"""Whether a daemon process is still there, as the unmount command and the tests wait for it."""

from __future__ import annotations

import os
import time


def alive(pid: int) -> bool:
    """True while ``pid`` runs.  A zombie counts as gone: a daemon detached from its parent
    is reaped by init, which in a container may take a second or more, and its work (the
    cache's lock, the mount) ended when it exited."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # The state follows the command name, which is in parentheses and may hold any.
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass  # no /proc: ask the kernel
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_gone(pid: int, timeout: float, interval: float = 0.02) -> bool:
    """Wait up to ``timeout`` seconds for ``pid`` to exit; True when it did."""
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True
