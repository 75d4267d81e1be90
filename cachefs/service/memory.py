"""How much memory the daemon may count on, and the bounds sized from it.

A held file (mirrorfs.HeldFiles: a cache file kept registered with the kernel between opens)
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

import os
from pathlib import Path

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

_CGROUP_ROOT = Path("/sys/fs/cgroup")


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


def memory_limit_bytes() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit_bytes()
    return min(total, limit) if limit else total


def _cgroup_limit_bytes(root: Path = _CGROUP_ROOT,
                        membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """The lowest memory limit on this process's cgroup and its ancestors (cgroup v2), or
    its v1 memory cgroup's; None for none, or where they cannot be read."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    unified = (root / "cgroup.controllers").exists()  # v2 mounted alone, not beside v1
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "" and unified:
            return _v2_limit(root, root / path.lstrip("/"))
        if "memory" in controllers.split(","):
            return _v1_limit(root / "memory", path.lstrip("/"))
    return None


def _v2_limit(root: Path, here: Path) -> int | None:
    """A limit anywhere above ``here`` applies; in a container the walk ends at its own
    cgroup, which is the root it sees."""
    limits = [_read_limit(here / "memory.max")]
    while here != root and root in here.parents:
        here = here.parent
        limits.append(_read_limit(here / "memory.max"))
    found = [limit for limit in limits if limit]
    return min(found) if found else None


def _v1_limit(hierarchy: Path, path: str) -> int | None:
    # In a container the cgroup's own directory is the hierarchy's root.
    for here in (hierarchy / path, hierarchy):
        if (here / "memory.limit_in_bytes").exists():
            return _read_limit(here / "memory.limit_in_bytes")
    return None


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max"
        return None
    limit = int(text)
    # v1 says "no limit" with the largest page-aligned 64-bit number.
    return limit if limit < 1 << 62 else None
