"""The check mark: what lets an open find a cached file without asking the index.

A whole data file of one chunk (nearly every training example) is marked once its bytes
were hashed as written: an extended attribute holding the version it is a copy of and the
file as it was then (its inode and mtime).  The mark is set before the stat the index
records (setting it changes the file's ctime), and only after the checksums are known, so a
file half written, torn by a crash or never hashed carries none.

An open of a file the store trusts (CacheStore.checked_file) then costs the descriptor it
hands over, its fstat and one getxattr on it, the inode already read by the open: no query
of the index, which at a million files is a read of its pages from the disk.  What it cannot
tell (no mark, another version, a file written since, a store not trusted yet) it leaves to
the index: a cache on a file system without user extended attributes is served as before,
only slower, and the copies an older cachefs wrote are marked as they are verified (the
scrub goes over every file after each start: CacheStore._verify).

Whatever drops a record removes its data file (CacheStore._drop_locked, forget_record), and
a file of a larger size is never marked (its chunks are dropped one by one), so a mark
never outlives its record by more than what a crash loses of the index's last writes: after
a crash no mark is taken alone until the reconciliation has removed such orphans (and after
a crash of the machine nothing is trusted until verified: reconcile.py).

The mark holds no checksum: it says the file is the whole copy that was hashed, not what its
bytes are; a disk that flips a bit under it is the scrub's to find, as for the index.  Nor
the ctime the index's record holds (setting the mark moves it): a write moves the mtime, and
only a writer that puts the mtime back escapes it, one with the daemon's rights over its
0700 cache dir, who could as well rewrite the index and its checksums.
"""

from __future__ import annotations

import errno
import logging
import os
import struct

from cachefs.attr import Version

log = logging.getLogger(__name__)

MARK_NAME = "user.cachefs.checked"
# The version's size and mtime_ns, then the data file's inode and mtime_ns when hashed: 32
# bytes, which ext4 (256-byte inodes) and XFS keep inside the inode.
_MARK = struct.Struct("<qqQq")
_UNSUPPORTED = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM})


class _Support:
    """Whether this process's cache file system takes user extended attributes: tried at the
    first mark, not again once refused (then every file is found through the index)."""

    marks = True


def mark_checked(fd: int, version: Version, st: os.stat_result | None = None) -> None:
    """Mark the data file ``fd`` (its fstat ``st``, taken once written), whole and hashed as
    it is now, as a copy of ``version``.  A mark refused (no room for it, no support) leaves
    the file unmarked: found through the index."""
    if not _Support.marks:
        return
    if st is None:
        st = os.fstat(fd)
    try:
        os.setxattr(fd, MARK_NAME, _MARK.pack(version.size, version.mtime_ns, st.st_ino,
                                              st.st_mtime_ns))
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            _Support.marks = False
            log.info("the cache's file system keeps no extended attributes (%s): cached "
                     "files are found through the index", exc.strerror)


def marked_as(fd: int, st: os.stat_result, version: Version) -> bool:
    """Whether the open data file ``fd`` (its fstat ``st``) is the whole copy of ``version``
    that was hashed: marked so, and neither replaced nor written since."""
    if not _Support.marks:
        return False
    try:
        mark = os.getxattr(fd, MARK_NAME)
    except OSError:  # ENODATA: not marked
        return False
    return mark == _MARK.pack(version.size, version.mtime_ns, st.st_ino, st.st_mtime_ns) \
        and st.st_size == version.size
