"""What reading an open remote file would fetch from the remote now: the bytes of its pages
that the kernel's cache of the file (the NFS client's) does not hold, as cachestat(2) tells
(Linux 6.5).

A file read in for a reader to come may already be cached (a reader read it a moment ago:
a hint for the next epoch arrives while this one still reads it), and one read in long
before its reader comes may no longer be (memory reclaim dropped its pages): counting its
size at either moment made ``cachefs_remote_read_bytes_total`` count what the remote never
sent, or miss what it sent again (per epoch with hints in `bench.run`, 43 % under to 24 %
over the remote's own count).
"""

from __future__ import annotations

import ctypes
import errno
import os

_CACHESTAT = 451  # the same number on every architecture (new system calls are unified)
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# Set once the kernel says it has no cachestat: every file then counts whole.
_unsupported = False


def uncached_bytes(fd: int, size: int) -> int:
    """Bytes among the first ``size`` of the open file ``fd`` whose pages are not in the
    page cache: what reading them now fetches.  ``size`` where the kernel cannot tell (no
    cachestat, a file system without a page cache of its own)."""
    global _unsupported
    if size <= 0:
        return 0
    if _unsupported:
        return size
    span = (ctypes.c_uint64 * 2)(0, size)
    # struct cachestat: nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted
    found = (ctypes.c_uint64 * 5)()
    if _libc.syscall(ctypes.c_long(_CACHESTAT), ctypes.c_int(fd), span, found,
                     ctypes.c_uint(0)) < 0:
        if ctypes.get_errno() == errno.ENOSYS:
            _unsupported = True
        return size
    pages = -(-size // PAGE_BYTES)
    return min(size, max(0, pages - found[0]) * PAGE_BYTES)
