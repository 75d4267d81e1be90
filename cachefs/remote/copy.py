"""The kernel's copy of a remote file into a cache file, checked to be one version whole.

Used by a fill thread of the daemon (handover.py) and by a fill process (fillprocess.py).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import TypeVar

from cachefs.attr import Version
from cachefs.errors import CacheUnavailable, RemoteChanged

# A copy that spent longer than this off the CPU waited on the remote: a round trip to an
# NFS server is 0.5-5 ms; 64 KiB from a local disk, or from pages the remote's client
# cached, 20-200 us.  The time off the CPU also counts turns at the interpreter lock and on
# a busy run queue, which come in bursts: the share is averaged over WAITING_COPIES_WINDOW
# copies.
WAITING_COPY_SECONDS = 0.001
WAITING_COPIES_WINDOW = 32
# Errors of a copy that are the cache disk's, not the remote's.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})

T = TypeVar("T")


class CopyWaits:
    """Whether recent copies waited on the remote: the share of the last
    WAITING_COPIES_WINDOW or so that spent over WAITING_COPY_SECONDS off the CPU.  It decides
    whether copying several files at once helps (the daemon's fill threads, handover.py; a
    fill process's turns, fillprocess.py).

    Thread safety: updated by any copying thread without a lock; a lost update only delays
    the hint by a copy."""

    def __init__(self) -> None:
        self.share = 0.0

    @property
    def mostly_waiting(self) -> bool:
        return self.share > 0.5

    def measure(self, copy: Callable[..., T], *args) -> T:
        """``copy(*args)``, its time off the CPU counted whether it returns or raises."""
        began, began_cpu = time.monotonic(), time.thread_time()
        try:
            return copy(*args)
        finally:
            waited = (time.monotonic() - began) - (time.thread_time() - began_cpu)
            self.share += (float(waited > WAITING_COPY_SECONDS) - self.share) \
                / WAITING_COPIES_WINDOW


def send_checked(src: int, out: int, version: Version) -> None:
    """Copy the whole remote file ``src`` into ``out`` in the kernel; RemoteChanged unless it
    is version ``version`` after the copy.  ``src`` was that version when it was opened
    (Remote.open_file checks it), and a write since, before the copy or during it, changes
    the size or mtime read after it: so no mix of two versions is ever stored, with one
    check, not one on each side (each a turn at the interpreter lock)."""
    offset = 0
    while offset < version.size:
        try:
            sent = os.sendfile(out, src, offset, version.size - offset)
        except OSError as exc:
            if exc.errno in DISK_ERRNOS:
                raise CacheUnavailable(f"writing the copy: {exc.strerror}") from exc
            raise
        if sent == 0:
            raise RemoteChanged("the file is shorter than its attributes say")
        offset += sent
    st = os.fstat(src)
    if (st.st_size, st.st_mtime_ns) != version:
        raise RemoteChanged("the file changed on the remote while being copied")
