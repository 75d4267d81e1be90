"""Paths that arrive from outside (hints, warm lists, fast-path opens), made safe.

Such a path is advisory input from any local user.  It may only ever name a
regular file inside BACKING that the caller may read:

- :func:`normalize` turns the raw bytes into a path relative to BACKING and
  refuses NUL, ``..`` that climbs out, absolute paths outside the mount and
  anything too long;
- :func:`resolve` walks it component by component through the attribute cache,
  follows symlinks only while they stay inside the tree (never absolute ones),
  and checks, as the kernel would, that the caller may search every directory
  and read the file;
- :func:`searchable_directory_of` says whether the caller may search the directory
  of a hinted file, which the daemon then lists to refresh its attributes in one pass.
"""

from __future__ import annotations

import os
import posixpath
import stat
from dataclasses import dataclass

from cachefs.attr import Attr
from cachefs.errors import CachefsError, NotInTree
from cachefs.remote.attrcache import AttrCache
from cachefs.remote.remote import Remote

MAX_PATH_BYTES = 4096
MAX_SYMLINK_HOPS = 8


@dataclass(frozen=True)
class Caller:
    """Who asks: from SO_PEERCRED, with supplementary groups from /proc."""

    uid: int
    gid: int
    groups: frozenset[int] = frozenset()

    @classmethod
    def of_process(cls, pid: int, uid: int, gid: int) -> Caller:
        groups: set[int] = {gid}
        try:
            with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Groups:"):
                        groups.update(int(g) for g in line.split()[1:])
                        break
        except (OSError, ValueError):
            pass  # the process is gone or hidden: primary group only
        return cls(uid, gid, frozenset(groups))

    def encoded(self) -> bytes:
        """As one line of numbers (uid, gid, then the groups), for another process."""
        return b" ".join(b"%d" % n for n in (self.uid, self.gid, *sorted(self.groups)))

    @classmethod
    def decoded(cls, line: bytes) -> Caller:
        """The caller ``encoded`` gave; ValueError for anything else."""
        uid, gid, *groups = (int(n) for n in line.split())
        return cls(uid, gid, frozenset(groups))


def normalize(raw: bytes, mountpoint: str) -> str:
    """The path relative to BACKING named by ``raw`` (relative to the mount, or absolute
    inside it).  NotInTree for anything else."""
    if not raw or len(raw) > MAX_PATH_BYTES or b"\0" in raw or b"\n" in raw:
        raise NotInTree("empty, too long, or holds NUL or newline")
    path = os.fsdecode(raw)
    if path.startswith("/"):
        root = mountpoint.rstrip("/") + "/"
        if not path.startswith(root):
            raise NotInTree("absolute path outside the mount")
        path = path[len(root):]
    if path.startswith("/"):
        raise NotInTree("absolute path outside the mount")
    normal = posixpath.normpath(path)
    if normal in (".", "") or normal == ".." or normal.startswith("../"):
        raise NotInTree("climbs out of the tree")
    return normal


def may(caller: Caller, want: int, mode: int, owner: int, group: int) -> bool:
    """Whether ``caller`` has the ``want`` bits (4 read, 1 search) on a file of ``mode``,
    ``owner`` and ``group``: the kernel's rule (the owner's bits for the owner, else the
    group's for its members, else the others'), root passing every check."""
    if caller.uid == 0:
        return True
    if caller.uid == owner:
        bits = (mode >> 6) & 7
    elif group in caller.groups:
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & want == want


def _may(attr: Attr, caller: Caller, want: int) -> bool:
    return may(caller, want, attr.mode, attr.uid, attr.gid)


def searchable_directory_of(relpath: str, attrs: AttrCache, caller: Caller | None) -> bool:
    """Whether the caller may search every directory on the way to ``relpath`` (a normalized
    path), its own included: what must hold before the daemon lists that directory for the
    caller's hint.  (That the way holds no symlink, the listing checks itself.)"""
    if caller is None or caller.uid == 0:
        return True
    done = ""
    try:
        if not _may(attrs.get(done), caller, 1):
            return False
        for part in relpath.split("/")[:-1]:
            done = f"{done}/{part}" if done else part
            if not _may(attrs.get(done), caller, 1):
                return False
    except (OSError, CachefsError):
        return False
    return True


def resolve(relpath: str, attrs: AttrCache, remote: Remote, caller: Caller | None
            ) -> tuple[str, Attr]:
    """The regular file ``relpath`` leads to, and its attributes.

    NotInTree when it leaves the tree, is not a regular file, or the caller may
    not read it; OSError (ENOENT...) as the remote answers.
    """
    # Root may search every directory: its opens (most training jobs') skip those lookups.
    searching = caller is not None and caller.uid != 0
    parts = relpath.split("/")
    done: list[str] = []
    hops = 0
    last: Attr | None = None  # attributes of the path in ``done``, when known
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not done:
                raise NotInTree("climbs out of the tree")
            done.pop()
            last = None
            continue
        if searching and not _may(attrs.get("/".join(done)), caller, 1):
            raise NotInTree("a directory on the way is not searchable by the caller")
        current = "/".join([*done, part])
        attr = attrs.get(current)
        if stat.S_ISLNK(attr.mode):
            hops += 1
            target = remote.readlink(current)
            if hops > MAX_SYMLINK_HOPS or target.startswith("/"):
                raise NotInTree("symlink leads out of the tree")
            parts = target.split("/") + parts
            continue
        done.append(part)
        last = attr
        if parts and not attr.is_dir:
            raise NotInTree("a component is not a directory")
    final = "/".join(done)
    attr = last if last is not None else attrs.get(final)
    if not attr.is_file:
        raise NotInTree("not a regular file")
    if caller is not None and not _may(attr, caller, 4):
        raise NotInTree("not readable by the caller")
    return final, attr
