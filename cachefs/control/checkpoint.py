"""Where a warm of one list on one mount got to, so that a warm run again after it was
interrupted (Ctrl-C, killed, the connection lost) goes on from there.

The list is cut into blocks of BLOCK_PATHS paths.  The checkpoint holds how many blocks
from the start were answered whole, a digest of each of them, and what the answers were
(the counts of the summary).  It is a small JSON file in the state directory, named by the
mount and the list (``warm/<digest>.json``), rewritten (a new file renamed over the old)
at most every COMMIT_SECONDS as blocks complete, and when the warm stops; a warm that
reaches the end of its list removes it, so the next warm of that list starts over.

A warm run again reads its list from the start but sends nothing for the blocks the
checkpoint holds: each is compared with its digest, so a list that changed meanwhile is
warmed from its first block that differs (from the start if the first does), whichever
way it changed.  One block is held in memory while it is compared, to be sent after all
if it differs.  At most a block and the requests then in flight are asked again; the
daemon answers those "already cached".  A checkpoint that cannot be read is ignored: the
warm starts over, and says so in one line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import xxhash

from cachefs.errors import UsageError

BLOCK_PATHS = 4096
COMMIT_SECONDS = 1.0
FORMAT = 1
STATE_DIR_ENV = "CACHEFS_STATE_DIR"
# What a reply of the daemon can say of a file, in the order of the summary.
RESULTS = ("fetched", "cached", "not_admitted", "cache_full", "failed")


def default_state_dir() -> Path:
    """Where cachefs keeps what must outlast a command: CACHEFS_STATE_DIR when set, else
    /var/lib/cachefs for root and $XDG_STATE_HOME/cachefs (~/.local/state) for others."""
    chosen = os.environ.get(STATE_DIR_ENV)
    if chosen:
        return Path(chosen)
    if os.geteuid() == 0:
        return Path("/var/lib/cachefs")
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "cachefs"


def block_hasher() -> xxhash.xxh3_64:
    """What digests a block: each of its paths, followed by a newline."""
    return xxhash.xxh3_64()


def block_digest(paths: list[bytes]) -> int:
    hasher = block_hasher()
    for path in paths:
        hasher.update(path + b"\n")
    return hasher.intdigest()


class Block(NamedTuple):
    """One block of the list, answered whole: its digest, and what the answers said."""

    digest: int
    counts: tuple[int, ...]  # by RESULTS
    new_bytes: int


@dataclass
class Progress:
    """The blocks from the start of the list answered whole."""

    blocks: list[Block] = field(default_factory=list)

    @property
    def paths(self) -> int:
        return len(self.blocks) * BLOCK_PATHS

    def counts(self) -> Counter[str]:
        return Counter({r: sum(b.counts[i] for b in self.blocks)
                        for i, r in enumerate(RESULTS)})

    def new_bytes(self) -> int:
        return sum(b.new_bytes for b in self.blocks)


class Checkpoint:
    """The checkpoint file of one list on one mount, held (flock) for as long as this warm
    runs, so that two warms of the same list cannot write over each other's.  It records the
    cache it was taken against (``cache``, as the daemon names it): what it says was warmed
    is in that cache only, and a warm into another cache mounted there (a new disk, a cache
    emptied) starts over.

    Thread safety: used by one thread.
    """

    def __init__(self, mountpoint: Path, identity: str, state_dir: Path | None = None,
                 cache: str | None = None) -> None:
        self.mountpoint = str(mountpoint)
        self.identity = identity
        self.cache = cache
        directory = (state_dir or default_state_dir()) / "warm"
        name = xxhash.xxh64_hexdigest(f"{self.mountpoint}\0{identity}".encode(
            errors="surrogateescape"))
        self.path = directory / f"{name}.json"
        self._lock_path = directory / f"{name}.lock"
        self._lock_fd = -1
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._lock_fd = os.open(self._lock_path,
                                    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self.close()
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UsageError(f"another cachefs warm of this list on {mountpoint} is "
                                 "running; wait for it, or stop it first") from None
            raise

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def load(self) -> tuple[Progress, str | None]:
        """The progress recorded, and a line to say when one was there but cannot be used
        (an empty progress then: the warm starts over)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return Progress(), None
        except OSError as exc:
            return Progress(), (f"cannot read the checkpoint {self.path} ({exc.strerror}): "
                                "starting over")
        try:
            state = json.loads(text)
            if state.get("format") != FORMAT or state["block_paths"] != BLOCK_PATHS \
                    or state["mountpoint"] != self.mountpoint \
                    or state["list"] != self.identity:
                raise ValueError("made by another version, or for another list")
            if state["results"] != list(RESULTS):
                raise ValueError("made by another version")
            if state.get("cache") != self.cache:
                return Progress(), (f"the checkpoint {self.path} was taken against another "
                                    "cache than the one mounted now: starting over")
            blocks = [_block(row) for row in state["blocks"]]
            return Progress(blocks), None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return Progress(), f"the checkpoint {self.path} is damaged ({exc}): starting over"

    def save(self, progress: Progress) -> None:
        """Replace the checkpoint by ``progress`` (a new file renamed over the old: a crash
        leaves one or the other)."""
        state = {
            "format": FORMAT, "mountpoint": self.mountpoint, "list": self.identity,
            "cache": self.cache, "block_paths": BLOCK_PATHS, "results": RESULTS,
            # Per block: its digest, then its counts by RESULTS, then its new bytes.
            "blocks": [[format(b.digest, "016x"), *b.counts, b.new_bytes]
                       for b in progress.blocks],
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(state, separators=(",", ":")))
        os.replace(tmp, self.path)

    def remove(self) -> None:
        """The list was answered to its end: nothing to go on from, nothing left behind."""
        self.path.unlink(missing_ok=True)
        self._lock_path.unlink(missing_ok=True)


def skip_done(paths: Iterator[bytes], recorded: Progress) -> tuple[Progress, Iterator[bytes],
                                                                   str | None]:
    """Read past the blocks ``recorded`` as answered, checking each against its digest.

    Returns the progress that still holds (the blocks before the first that differs), the
    paths from there on (that block's, held while it was compared, first), and a line to
    say when the list is not the one the checkpoint was made for."""
    for number, recorded_block in enumerate(recorded.blocks):
        block = [path for _, path in zip(range(BLOCK_PATHS), paths, strict=False)]
        if len(block) == BLOCK_PATHS and block_digest(block) == recorded_block.digest:
            continue
        if number:
            note = (f"the list differs from the checkpoint's after path "
                    f"{number * BLOCK_PATHS:,}: warming from there")
        else:
            note = "the list is not the one of the checkpoint: starting over"
        return Progress(recorded.blocks[:number]), _chain(block, paths), note
    return recorded, paths, None


def _block(row: list) -> Block:
    digest, *numbers = row
    if len(numbers) != len(RESULTS) + 1 or not all(isinstance(n, int) and n >= 0
                                                    for n in numbers):
        raise ValueError("a block's counts are not counts")
    *counts, new_bytes = numbers
    if sum(counts) != BLOCK_PATHS:
        raise ValueError("a block's counts do not add up")
    return Block(int(digest, 16), tuple(counts), new_bytes)


def _chain(first: list[bytes], rest: Iterator[bytes]) -> Iterator[bytes]:
    yield from first
    yield from rest
