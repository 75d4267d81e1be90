"""The FUSE binding, imported here and nowhere else.

mfusepy is the maintained fork of fusepy with the same API; it decodes paths
with surrogateescape, so names that are not UTF-8 survive the round trip.
Swapping bindings is a change to this file only.
"""

from mfusepy import FUSE, FuseOSError, Operations, fuse_exit

__all__ = ["FUSE", "FuseOSError", "Operations", "fuse_exit"]
