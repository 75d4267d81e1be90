"""How much memory the daemon may count on, and the bounds sized from it.

A held file (mirror/held.py: a cache file kept registered with the kernel between opens)
saves each open of it a registration, an index query and an open of the cache file: at
100,000 cached files read each pass, 178 - 245 us of daemon CPU per file with all of them
held against 472 - 518 us with 65,536 held.  What it costs is memory, most of it the kernel's (an
open file, the cache file's dentry and inode kept from reclaim) and some of the daemon's.  So
the bound is a share of the memory the daemon may use: the machine's, or less where its
cgroup (a systemd unit's MemoryMax, a pod's limit) says less, since the kernel charges the
cgroup for those dentries and inodes too.  A GPU node of 1 TiB holds every file of a dataset
of millions; a container limited to 2 GiB keeps the fixed floor it had before.

The staging area (prefetch/staging.py) is sized from the same limit, from above rather than
from below: its files are memory files of the daemon's, which the kernel can neither write
back nor drop, charged to its cgroup until a reader takes them.  Its default stays 512 MiB
wherever that is at most a 16th of the memory the daemon may use, and shrinks with a smaller
limit: a unit with MemoryMax=2G stages at most 128 MiB, which its readers' hints may fill
without the unit being killed for it.
"""

from __future__ import annotations

from cachefs.limits import memory_limit_bytes
from cachefs.mirror.mirrorfs import DEFAULT_MAX_HELD
from cachefs.service.config import DEFAULT_STAGING_BYTES, MAX_HELD_FILES

# What one held file costs, the kernel's part and ours together (measured, see the README's
# Scale section), and the share of the memory they may take.
HELD_FILE_BYTES = 2048
HELD_SHARE = 1 / 64
MIN_HELD_FILES = DEFAULT_MAX_HELD
STAGING_SHARE = 1 / 16
# A few batches of files of some hundred KiB: below it staging would turn most hints away.
MIN_STAGING_BYTES = 32 * 2**20


def default_held_files(limit_bytes: int | None = None) -> int:
    """The ``--held-files`` bound when none is given: a 64th of ``limit_bytes`` (the memory
    this process may use, by default), within the floor and the ceiling."""
    limit = memory_limit_bytes() if limit_bytes is None else limit_bytes
    held = int(limit * HELD_SHARE) // HELD_FILE_BYTES
    return max(MIN_HELD_FILES, min(MAX_HELD_FILES, held))


def default_staging_bytes(limit_bytes: int | None = None) -> int:
    """The ``--staging-size`` when none is given: a 16th of ``limit_bytes`` (the memory this
    process may use, by default), at most DEFAULT_STAGING_BYTES, MIN_STAGING_BYTES at least."""
    limit = memory_limit_bytes() if limit_bytes is None else limit_bytes
    return max(MIN_STAGING_BYTES, min(DEFAULT_STAGING_BYTES, int(limit * STAGING_SHARE)))
