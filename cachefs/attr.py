"""A remote file's attributes, as the mirror shows them and as the cache validates by."""

from __future__ import annotations

import os
import stat
from typing import NamedTuple

_new_tuple = tuple.__new__


class Version(NamedTuple):
    """What a cached copy is valid for: the remote file's size and mtime."""

    size: int
    mtime_ns: int


class Attr(NamedTuple):
    """The fields of ``lstat`` that a read-only mirror shows.  Immutable, cheap to share."""

    mode: int
    size: int
    uid: int
    gid: int
    nlink: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def from_stat(cls, st: os.stat_result) -> Attr:
        # The tuple made directly: a NamedTuple's own __new__ is a Python function, and this
        # runs for every name a listing or a lookup brings.
        return _new_tuple(cls, (st.st_mode, st.st_size, st.st_uid, st.st_gid, st.st_nlink,
                                st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns))

    @property
    def version(self) -> Version:
        # tuple.__new__ directly: a NamedTuple's own constructor is a Python function, and
        # this runs several times for every open.
        return _new_tuple(Version, (self.size, self.mtime_ns))

    def same_version(self, other: Attr) -> bool:
        return self.size == other.size and self.mtime_ns == other.mtime_ns

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)

