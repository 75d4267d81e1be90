"""Domain exceptions and the one table that turns them into errnos.

Everything below the FUSE adapter raises either a real ``OSError`` from the
remote (which keeps its errno: ESTALE, EACCES, ENOENT, EIO from NFS mean
something to a training job) or one of the exceptions defined here.  The
adapter calls :func:`errno_for` at the boundary and nowhere else; anything it
does not know becomes EIO and is logged with a traceback (a bug, never a fault of
the reader's making).
"""

from __future__ import annotations

import errno


class CachefsError(Exception):
    """Base class of the errors cachefs raises on purpose."""

    errno = errno.EIO


class UsageError(CachefsError):
    """Bad input from a person: flags, config files, paths.  Shown as one line."""


class RemoteUnavailable(CachefsError):
    """The remote did not answer within --remote-timeout, or is known to be down."""

    errno = errno.EIO


class RemoteChanged(CachefsError):
    """The remote file changed while a reader had it open.

    ESTALE, as NFS says for a handle whose file went away: reopening the file
    gives the new version.  Never a mix of old and new bytes.
    """

    errno = errno.ESTALE


class CacheCorrupt(CachefsError):
    """A stored chunk failed its checksum or vanished; it is refetched, never served."""


class CacheUnavailable(CachefsError):
    """The cache disk cannot take writes (full, read-only, I/O error)."""


class NotInTree(CachefsError):
    """A path from a hint or a control request does not name a file inside BACKING."""

    errno = errno.ENOENT


def errno_for(exc: BaseException) -> int | None:
    """The errno a reader should see for ``exc``, or None when it is unexpected.

    None tells the caller to log a traceback and answer EIO.
    """
    if isinstance(exc, CachefsError):
        return exc.errno
    if isinstance(exc, OSError) and isinstance(exc.errno, int) and exc.errno > 0:
        return exc.errno
    return None
