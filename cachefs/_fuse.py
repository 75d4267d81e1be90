"""The FUSE binding, imported here and nowhere else.

mfusepy is the maintained fork of fusepy with the same API; it decodes paths
with surrogateescape, so names that are not UTF-8 survive the round trip.
Swapping bindings is a change to this file only.

With libfuse 2 (Linux), requests are served by cachefs/fuseloop.py on Python
threads instead of by libfuse's own loop: mfusepy mounts through the module's
``fuse_main_real``, which is replaced here by one with the same signature.
"""

import mfusepy
from mfusepy import FUSE, FuseOSError, Operations, fuse_exit

from cachefs import fuseloop

__all__ = ["FUSE", "FuseOSError", "Operations", "fuse_exit"]

_libfuse = getattr(mfusepy, "_libfuse", None)
if mfusepy.fuse_version_major == 2 and _libfuse is not None \
        and hasattr(mfusepy, "fuse_main_real"):
    mfusepy.fuse_main_real = fuseloop.make_main(_libfuse._name)
