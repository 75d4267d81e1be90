"""Checks made before anything is mounted or written, each failing with one clear line.

BACKING must be a readable directory; MOUNTPOINT an empty directory that is not
mounted (a stale mount left by a crashed daemon is cleaned up and reported);
the three paths must not contain one another, since a cache inside BACKING
would be read back as data and a mount inside BACKING would list itself; a
--runtime-dir given must be a directory, or one that can be made.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from cachefs.errors import UsageError
from cachefs.kernel.mountpoint import find_mount, is_empty_dir, probe, unmount
from cachefs.service.config import Settings
from cachefs.sizes import format_bytes

log = logging.getLogger(__name__)


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def check_backing(backing: Path) -> None:
    try:
        if not backing.is_dir():
            what = "does not exist" if not backing.exists() else "is not a directory"
            raise UsageError(f"BACKING {backing} {what}; give the remote dataset directory")
        os.listdir(backing)
    except PermissionError:
        raise UsageError(f"BACKING {backing} is not readable by this user") from None
    except OSError as exc:
        raise UsageError(f"BACKING {backing} cannot be listed: {exc.strerror}; "
                         "is the remote (NFS) mount healthy?") from None


def check_paths(settings: Settings) -> None:
    backing = Path(os.path.realpath(settings.backing))
    mountpoint = Path(os.path.realpath(settings.mountpoint))
    cache_dir = Path(os.path.realpath(settings.cache_dir))
    if _inside(mountpoint, backing) or _inside(backing, mountpoint):
        raise UsageError(f"MOUNTPOINT {settings.mountpoint} and BACKING {settings.backing} "
                         "must not contain each other; mount somewhere else")
    if _inside(cache_dir, backing):
        raise UsageError(f"--cache-dir {settings.cache_dir} is inside BACKING; put the cache on "
                         "the local SSD, outside the dataset")
    if _inside(cache_dir, mountpoint) or _inside(mountpoint, cache_dir):
        raise UsageError(f"--cache-dir {settings.cache_dir} and MOUNTPOINT must not contain each "
                         "other; choose a cache dir elsewhere")
    if settings.runtime_dir is not None:
        check_runtime_dir(settings.runtime_dir)


def _nearest_existing(path: Path) -> Path:
    """``path``, or its nearest parent that exists: where a directory to be made would be."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_runtime_dir(runtime_dir: Path) -> None:
    """--runtime-dir (the control socket, the node and handle tables) must be a directory
    this user may write, or one that can be made under one."""
    existing = _nearest_existing(runtime_dir)
    if not existing.is_dir():
        raise UsageError(f"--runtime-dir {runtime_dir}: {existing} is not a directory; "
                         "choose a directory on a tmpfs such as /run")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--runtime-dir {runtime_dir}: {existing} is not writable by this "
                         "user")


def budget_beyond_disk(cache_dir: Path, cache_size: int) -> str | None:
    """What to tell the operator when --cache-size is more than the whole cache disk (that of
    ``cache_dir``, or of its nearest existing parent): no error, since the disk then fills
    first and admission pauses, but better heard at the mount than at the first failed
    write."""
    try:
        st = os.statvfs(_nearest_existing(cache_dir))
    except OSError:
        return None
    disk = st.f_blocks * st.f_frsize
    if cache_size <= disk:
        return None
    return (f"--cache-size {format_bytes(cache_size)} is more than the cache disk holds "
            f"({format_bytes(disk)}): the disk fills first, and admission pauses then")


def prepare_mountpoint(mountpoint: Path) -> str | None:
    """Make sure ``mountpoint`` can be mounted on; returns a note when a stale mount was cleared."""
    note = None
    entry = find_mount(mountpoint)
    if entry is not None:
        state = probe(mountpoint, timeout=5.0)
        if state == errno.ENOTCONN:
            result = unmount(mountpoint, lazy=True)
            if find_mount(mountpoint) is not None:
                raise UsageError(f"MOUNTPOINT {mountpoint} holds a stale mount that could not be "
                                 f"removed ({result.stderr.strip()}); run fusermount -uz on it")
            note = f"cleaned up a stale mount at {mountpoint} left by a daemon that died"
            log.warning(note)
        else:
            raise UsageError(f"MOUNTPOINT {mountpoint} is already mounted ({entry.fstype} from "
                             f"{entry.source}); unmount it first")
    try:
        if not mountpoint.is_dir():
            what = "does not exist" if not mountpoint.exists() else "is not a directory"
            raise UsageError(f"MOUNTPOINT {mountpoint} {what}; create an empty directory first")
        if not is_empty_dir(mountpoint):
            raise UsageError(f"MOUNTPOINT {mountpoint} is not empty; mount on an empty directory")
    except PermissionError:
        raise UsageError(f"MOUNTPOINT {mountpoint} is not accessible by this user") from None
    return note


def preflight(settings: Settings, *, taking_over: bool = False) -> str | None:
    """Every check, in the order a person would fix them; returns a note to show, if any.
    ``taking_over`` a mount from a running daemon (`cachefs upgrade`): it is mounted."""
    check_backing(settings.backing)
    check_paths(settings)
    if taking_over:
        return None
    return prepare_mountpoint(settings.mountpoint)
