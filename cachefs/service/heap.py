"""Large heap blocks given back to the kernel when freed, so that the daemon's memory follows
what it holds, not what it once held.

glibc serves a block above its mmap threshold (128 KiB at first) with a mapping of its own,
unmapped when freed, but raises the threshold to the size of each such block freed (up to 32
MiB): after a while the tables of the large dictionaries (the attribute cache's is some 10 MiB
at 200,000 names, reallocated as its entries cycle) come from the per-thread arenas instead.
An arena gives memory back only from its top, so those tables, freed as other blocks land
above them, stay resident, up to one or two per arena: after a read pass over 1,000,000 files
malloc held 312 MiB, 70 of them in use.

Fixing the threshold stops it moving.  At 2 MiB, not glibc's 128 KiB: a read served here
(up to 1 MiB) stays a block of an arena, reused by the next one; as a mapping of its own it
would cost a map, page faults and an unmap each, 0.5 ms instead of 45 us per MiB.  The trim
threshold (how much free memory an arena's top may keep), which glibc also stops moving then,
is set to 8 MiB for the same reason.

Not glibc (musl, say): nothing to do; its large blocks are mappings already.
"""

from __future__ import annotations

import ctypes

# mallopt's parameter numbers, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 2 << 20
TRIM_THRESHOLD_BYTES = 8 << 20


def map_large_blocks() -> bool:
    """Fix malloc's mmap and trim thresholds; True when the C library took them."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) \
        and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
