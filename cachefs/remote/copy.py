"""The kernel's copy of a remote file into a cache file or a memory file, checked to be one
version whole.

Used by a fill thread of the daemon (handover.py), by a fill process (fillprocess.py) and by
a prefetch that stages a remote file (handover.py ``copy_in``).
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
# A copy's waits on the remote are bounded piece by piece (see send_checked): a remote that
# moves less than a piece within --remote-timeout (1 MiB in 30 s by default) is not
# answering.  Each piece costs a bounded call, some microseconds against the 0.3 ms or more
# its copy takes.
COPY_PIECE_BYTES = 1 << 20
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


def _direct(fn: Callable[..., int], *args) -> int:
    """A piece copied with no bound of its own (a fill process: the daemon bounds it)."""
    return fn(*args)


def send_checked(src: int, out: int, version: Version,
                 call: Callable[..., int] = _direct) -> None:
    """Copy the whole remote file ``src`` into ``out`` in the kernel; RemoteChanged unless it
    is version ``version`` after the copy.  ``src`` was that version when it was opened
    (Remote.open_file checks it), and a write since, before the copy or during it, changes
    the size or mtime read after it: so no mix of two versions is ever stored, with one
    check, not one on each side (each a turn at the interpreter lock).

    ``call(fn, *args)`` runs each piece of COPY_PIECE_BYTES (Remote.call on a daemon's
    thread): the timeout then bounds a piece, not the whole copy, so a large file copied at
    any usable speed is not taken for a remote that does not answer."""
    offset = 0
    while True:
        offset = call(_copy_piece, src, out, version, offset)
        if offset >= version.size:
            return


def _copy_piece(src: int, out: int, version: Version, offset: int) -> int:
    """Copy up to COPY_PIECE_BYTES of ``src`` from ``offset``, and check the version once
    the whole file is copied: the offset reached."""
    end = min(version.size, offset + COPY_PIECE_BYTES)
    while offset < end:
        try:
            sent = os.sendfile(out, src, offset, end - offset)
        except OSError as exc:
            if exc.errno in DISK_ERRNOS:  # the cache disk's: not counted against the remote
                raise CacheUnavailable(f"writing the copy: {exc.strerror}") from exc
            raise
        if sent == 0:
            raise RemoteChanged("the file is shorter than its attributes say")
        offset += sent
    if offset >= version.size:
        st = os.fstat(src)
        if (st.st_size, st.st_mtime_ns) != version:
            raise RemoteChanged("the file changed on the remote while being copied")
    return offset
