"""Whether a daemon process is still there, as the unmount command and the tests wait for it;
and a child process that ends with its parent."""

from __future__ import annotations

import ctypes
import os
import signal
import time

_PR_SET_PDEATHSIG = 1


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


def die_with_parent(parent: int) -> None:
    """SIGKILL this process (a child of ``parent``, just started) when its parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the call
        os._exit(1)
