"""The FUSE adapter: paths in, errnos out.

A thin layer over :class:`cachefs.tree.CachedTree`; it holds no cache logic.
It turns FUSE's ``/a/b`` paths into paths relative to BACKING, results into
what the binding expects, and every exception into an errno through the one
table in errors.py.  Anything unexpected is logged with a traceback and
answered with EIO: the binding would otherwise say EINVAL or EFAULT, which a
training job cannot make sense of.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from collections.abc import Callable

from cachefs._fuse import FuseOSError, Operations
from cachefs.attrcache import relpath_of
from cachefs.errors import errno_for
from cachefs.pagecache import KernelPages
from cachefs.tree import CachedTree, FdFile

log = logging.getLogger(__name__)


def _errno_boundary(method: Callable) -> Callable:
    @functools.wraps(method)
    def wrapper(self, *args):
        try:
            return method(self, *args)
        except FuseOSError:
            raise
        except Exception as exc:  # the boundary: every failure becomes an errno here
            code = errno_for(exc)
            if code is None:
                log.exception("unexpected error in %s%r; answering EIO", method.__name__, args[:1])
                code = errno.EIO
            raise FuseOSError(code) from None

    return wrapper


class CachefsOperations(Operations):
    """FUSE callbacks of a cachefs mount."""

    use_ns = True

    def __init__(self, tree: CachedTree, *, immutable: bool,
                 on_mounted: Callable[[], None]) -> None:
        self.tree = tree
        # None: files never change (--revalidate never), so the kernel always keeps pages.
        self._kernel_pages = None if immutable else KernelPages()
        self._on_mounted = on_mounted
        self._open_seconds = tree.metrics.open_seconds

    def init(self, path: str) -> None:
        # The kernel has answered FUSE_INIT: from here the mount serves requests.
        self._on_mounted()

    @_errno_boundary
    def getattr(self, path: str, fh=None) -> dict:
        return self.tree.getattr(relpath_of(path)).as_fuse()

    @_errno_boundary
    def readlink(self, path: str) -> str:
        return self.tree.readlink(relpath_of(path))

    @_errno_boundary
    def readdir(self, path: str, fh) -> list:
        entries: list = [".", ".."]
        entries.extend((name, mode, 0) for name, mode in self.tree.listdir(relpath_of(path)))
        return entries

    @_errno_boundary
    def open(self, path: str, fi) -> int:
        if fi.flags & 0o3 != 0:  # O_WRONLY or O_RDWR
            raise FuseOSError(errno.EROFS)
        started = time.perf_counter()
        relpath = relpath_of(path)
        attr = self.tree.attrs.get(relpath)
        if not attr.is_file:
            raise IsADirectoryError(relpath) if attr.is_dir else PermissionError(relpath)
        located = self.tree.locate(relpath, attr)
        fi.fh = self.tree.register(located.handle if located.kind == "chunks"
                                   else FdFile(relpath, attr, located.fd))
        if self._kernel_pages is None:
            fi.keep_cache = True
        else:
            # Pages are kept only while the file's version is the one they were read at,
            # so a reader never sees pages older than the revalidation interval.
            fi.keep_cache = self._kernel_pages.opened(relpath, attr)
        self._open_seconds.observe(time.perf_counter() - started)
        return 0

    @_errno_boundary
    def read(self, path: str, size: int, offset: int, fi) -> bytes:
        return self.tree.read(fi.fh, size, offset)

    @_errno_boundary
    def release(self, path: str, fi) -> int:
        f = self.tree.release(fi.fh)
        if f is not None and self._kernel_pages is not None:
            self._kernel_pages.released(f.relpath)
        return 0

    @_errno_boundary
    def statfs(self, path: str) -> dict:
        return self.tree.statfs()

    # Every mutation: the mirror is read-only (the mount is also made with "ro").
    def _read_only(self, *args) -> int:
        raise FuseOSError(errno.EROFS)

    chmod = chown = create = link = mkdir = mknod = rename = rmdir = _read_only
    setxattr = removexattr = symlink = truncate = unlink = utimens = write = _read_only
