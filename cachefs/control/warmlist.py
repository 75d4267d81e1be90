"""The paths a warm goes through, in order, one at a time: a list file, stdin, or every file
under the mount.

A list may hold millions of paths, so none is ever held as a whole: each is read, sent and
forgotten.  Paths stay bytes from the list to the socket (a name need not be UTF-8).  A list
file is counted first, in a pass of its own, for the progress bar's total; stdin and a walk
of the mount have none.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from cachefs.errors import UsageError

READ_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class PathList:
    """Where the paths come from.  ``identity`` names the list for its checkpoint (the list
    file's real path, ``-`` for stdin, empty for every file); ``total`` is how many paths
    it holds, when that can be known before reading it."""

    source: str | None  # a file, "-", or None for every file under the mount
    mountpoint: Path
    identity: str
    total: int | None

    def paths(self) -> Iterator[bytes]:
        if self.source is None:
            return walk_files(self.mountpoint)
        if self.source == "-":
            return _lines(sys.stdin.buffer)
        return _file_lines(self.source)


def open_list(source: str | None, mountpoint: Path) -> PathList:
    """The list named on the command line; one line (UsageError) when it cannot be read."""
    if source is None:
        return PathList(None, mountpoint, "", None)
    if source == "-":
        return PathList("-", mountpoint, "-", None)
    try:
        with open(source, "rb") as f:
            total = count_paths(f)
    except OSError as exc:
        raise UsageError(f"cannot read list {source}: {exc.strerror}") from None
    return PathList(source, mountpoint, os.path.realpath(source), total)


def count_paths(stream: BinaryIO) -> int:
    """How many paths (lines that are not blank) ``stream`` holds, read in one pass."""
    return sum(1 for _ in _lines(stream))


def _file_lines(source: str) -> Iterator[bytes]:
    try:
        stream = open(source, "rb", buffering=READ_BUFFER_BYTES)  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise UsageError(f"cannot read list {source}: {exc.strerror}") from None
    with stream:
        yield from _lines(stream)


def _lines(stream: BinaryIO) -> Iterator[bytes]:
    """Each line without its end (``\\n`` or ``\\r\\n``); blank lines skipped."""
    for line in stream:
        path = line.rstrip(b"\n")
        if path.endswith(b"\r"):
            path = path[:-1]
        if path.strip():
            yield path


def walk_files(mountpoint: Path) -> Iterator[bytes]:
    """Every regular file under the mount, relative to it, in an order that does not depend
    on the order the directories list their names in (so that a checkpoint of a walk holds).
    Symlinks, pipes and device nodes are no data to warm: passed over, not failed (a link's
    target inside the tree is warmed by its own name)."""
    root = os.fsencode(mountpoint)
    pending = [b""]  # directories to list, relative to root; the next one last
    while pending:
        relative = pending.pop()
        files, dirs = _regular_files_and_dirs(os.path.join(root, relative) if relative else root)
        prefix = relative + b"/" if relative else b""
        for name in files:
            yield prefix + name
        pending.extend(prefix + name for name in reversed(dirs))


def _regular_files_and_dirs(directory: bytes) -> tuple[list[bytes], list[bytes]]:
    """The names of ``directory``'s regular files and of its subdirectories (symlinks to
    either not followed), each sorted; none when it cannot be listed (as os.walk does)."""
    files, dirs = [], []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        dirs.append(entry.name)
                    elif entry.is_file(follow_symlinks=False):
                        files.append(entry.name)
                except OSError:  # gone, or cannot be looked up: as a walk that missed it
                    continue
    except OSError:
        pass
    return sorted(files), sorted(dirs)
