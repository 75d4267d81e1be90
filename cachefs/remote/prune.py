"""Copies of files gone from the remote, dropped when the cache has no room left.

The cache never evicts a file it keeps.  A file deleted or renamed on the remote (a dataset
updated in place, a class removed) is never opened again by its old name, so its copy
would hold its share of the budget for good: after a few updates the cache is full of
files no job can read, and it admits nothing new.  When a file is left out for want of
room, and every PASS_INTERVAL_SECONDS while the cache stays full, a pass over the index
looks each cached file up on the remote, at a bounded rate, and drops the copies of the
files that are gone; admission goes on as soon as one is.  A cache with room left costs
the remote nothing.

A remote that says "no such file" because it is not the dataset any more (its NFS mount
gone, the empty directory under it in its place) must not empty the cache: the pass runs
only while the remote's root is the directory it was when the daemon started (same device
and inode) and lists something, checked again before each copy is dropped.

Thread safety: one thread runs the passes; :meth:`Pruner.no_room` may be called from any
thread (the store calls it, outside its lock, for each file it leaves out).
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable

from cachefs.errors import RemoteUnavailable
from cachefs.remote.remote import Remote
from cachefs.sizes import format_bytes
from cachefs.store.store import CacheStore

log = logging.getLogger(__name__)

# Remote lookups per second a pass makes at most: an NFS GETATTR each, beside the training's
# own; a million cached files are looked over in about half an hour.
LOOKUPS_PER_SECOND = 500
# While the cache stays full, a pass this long after the last one ended: a cache full of
# live files is not looked over again and again.
PASS_INTERVAL_SECONDS = 6 * 3600.0
# A lookup that says the file is not there (the name, or a directory on its path).
_GONE = frozenset({errno.ENOENT, errno.ENOTDIR})


class Pruner:
    """Drops the cached copies of files gone from the remote, a pass at a time."""

    def __init__(self, remote: Remote, store: CacheStore, *,
                 on_pruned: Callable[[int], None] = lambda files: None) -> None:
        self.remote = remote
        self.store = store
        self.on_pruned = on_pruned
        self.passes = 0
        self._root: tuple[int, int] | None = None  # taken by the thread: it may wait
        self._wanted = threading.Event()
        self._closed = False
        self._last_pass_ended: float | None = None
        self._thread = threading.Thread(target=self._run, name="prune", daemon=True)
        self._thread.start()

    def no_room(self) -> None:
        """A file was left out for want of room: look for copies of files gone, unless a
        pass ran lately."""
        if self._last_pass_ended is None \
                or time.monotonic() - self._last_pass_ended >= PASS_INTERVAL_SECONDS:
            self._wanted.set()

    def close(self) -> None:
        self._closed = True
        self._wanted.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        self._root = self._root_identity()
        while not self._closed:
            asked = self._wanted.wait(PASS_INTERVAL_SECONDS)
            if self._closed:
                return
            if not asked and not self.store.full:
                continue
            try:
                self._pass()
            except (OSError, sqlite3.Error) as exc:  # the cache disk: the next pass retries
                log.warning("looking for cached files gone from the remote stopped: %s", exc)
            except Exception:  # a bug: logged, and the daemon serves on
                log.exception("looking for cached files gone from the remote failed")
            self._last_pass_ended = time.monotonic()
            # Files left out while the pass ran were answered by it: no second pass now.
            # (A close meanwhile set _closed first: the loop ends without waiting.)
            self._wanted.clear()

    def _root_identity(self) -> tuple[int, int] | None:
        """(device, inode) of the remote's root when it lists something; None otherwise."""
        try:
            return self.remote.call(_identity_of, self.remote.root)
        except (OSError, RemoteUnavailable):
            return None

    def _remote_is_the_dataset(self) -> bool:
        now = self._root_identity()
        if self._root is None:  # not known at the start (the remote was down): from now on
            self._root = now
        if now is None or now != self._root:
            log.warning("not looking for cached files gone from the remote: its root %s is "
                        "not the directory it was at the start, or lists nothing",
                        self.remote.root)
            return False
        return True

    def _pass(self) -> None:
        if not self._remote_is_the_dataset():
            return
        started = time.monotonic()
        looked = gone = 0
        used_before = self.store.used_bytes
        for path, record in self.store.file_records():
            if self._closed:
                return
            looked += 1
            # Paced: a pass looks at LOOKUPS_PER_SECOND files a second at most.
            ahead = started + looked / LOOKUPS_PER_SECOND - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
            try:
                if self.remote.lstat(os.fsdecode(path)).is_file:
                    continue
                # (A directory or a link by that name now: no file to open there.)
            except RemoteUnavailable:
                log.info("the remote stopped answering: the look for cached files gone "
                         "from it stops after %d files", looked)
                return
            except OSError as exc:
                if exc.errno not in _GONE:
                    continue
            # Gone, or the remote is not the dataset any more (unmounted meanwhile).
            if not self._remote_is_the_dataset():
                return
            self.store.drop_version(path, record.version)
            gone += 1
        freed = max(0, used_before - self.store.used_bytes)
        self.passes += 1
        if gone:
            self.on_pruned(gone)
        log.info("looked up %d cached files on the remote in %.1f s: %d gone from it, their "
                 "copies dropped (%s freed)", looked, time.monotonic() - started, gone,
                 format_bytes(freed))


def _identity_of(root: str) -> tuple[int, int] | None:
    st = os.stat(root)
    with os.scandir(root) as entries:
        if next(entries, None) is None:
            return None
    return st.st_dev, st.st_ino
