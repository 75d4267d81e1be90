"""The FUSE binding, imported here and nowhere else.

mfusepy is the maintained fork of fusepy with the same API; it decodes paths
with surrogateescape, so names that are not UTF-8 survive the round trip.
Swapping bindings is a change to this file only.

With libfuse 2 (Linux), requests are served by cachefs/fuseloop.py on Python
threads instead of by libfuse's own loop: mfusepy mounts through the module's
``fuse_main_real``, which is replaced here by one with the same signature.
"""

import ctypes

import mfusepy
from mfusepy import FuseOSError, Operations, fuse_exit

from cachefs import fuseloop

__all__ = ["FUSE", "FuseOSError", "Operations", "fuse_exit"]

_libfuse = getattr(mfusepy, "_libfuse", None)
if mfusepy.fuse_version_major == 2 and _libfuse is not None \
        and hasattr(mfusepy, "fuse_main_real"):
    mfusepy.fuse_main_real = fuseloop.make_main(_libfuse._name)


# ctypes.memmove and memset give up the GIL for the copy, like any foreign call.  A copy of
# some KiB is over long before another thread could use the GIL, and each release wakes a
# thread waiting for it only to find it taken again: measured, these two held 6 to 12 %
# more cached files/s through the mount.  Functions of a PyDLL keep the GIL.
_libc = ctypes.PyDLL(None)
_memmove = _libc.memmove
_memmove.argtypes, _memmove.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), None
_memset = _libc.memset
_memset.argtypes, _memset.restype = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t), None
_STAT_BYTES = ctypes.sizeof(mfusepy.c_stat)


class FUSE(mfusepy.FUSE):
    """mfusepy's FUSE with the callbacks of every cached read (getattr, read) copying
    without giving up the GIL; otherwise the same."""

    def read(self, path, buf, size: int, offset: int, fip) -> int:
        fh = fip.contents if self.raw_fi else fip.contents.fh
        data = self.operations.read(self._decoded(path), size, offset, fh)
        if not data:
            return 0
        if len(data) > size:
            raise ValueError(f"read returned {len(data)} bytes where {size} were asked")
        _memmove(buf, data, len(data))
        return len(data)

    def fgetattr(self, path, buf, fip) -> int:
        _memset(buf, 0, _STAT_BYTES)
        fh = (fip.contents if self.raw_fi else fip.contents.fh) if fip else None
        attrs = self.operations.getattr(self._decoded(path), fh)
        mfusepy.set_st_attrs(buf.contents, attrs, use_ns=self.use_ns)
        return 0

    def _decoded(self, path: bytes | None) -> str | None:
        return None if path is None else path.decode(self.encoding, self.errors)
