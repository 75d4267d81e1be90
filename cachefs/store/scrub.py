"""Every cached file's checksums verified in the background, from each start on, at a bounded
rate.

After a clean stop the store trusts a data file whose identity (inode, mtime, ctime) is the
one its record says it had when its bytes were last checked: nothing but a fault of the disk
can have changed them since.  The scrub looks for those faults, a whole pass over the cache
after every start, reading at most ``bytes_per_second`` and ``files_per_second`` so that it
takes little of the disk and of the daemon's CPU; a file that fails is dropped, counted in
cachefs_integrity_failures_total, and fetched again when next read.  After a crash the store
trusts nothing until it has been over a file: a file opened before the scrub reached it is
verified at its open, as the scrub would, and the scrub skips it.

The scrub reads each file once, then tells the kernel it needs its pages no more
(POSIX_FADV_DONTNEED): a pass over a cache larger than memory must not push the training
data out of the page cache.

Thread safety: one thread; the store's methods it calls are thread safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachefs.store.store import CacheStore

log = logging.getLogger(__name__)

BYTES_PER_SECOND = 64 * 2**20
FILES_PER_SECOND = 2000


class Scrubber:
    """One pass over the store's files, on a thread of its own; ``on_done`` when it is over."""

    def __init__(self, store: CacheStore, *, on_done: Callable[[], None],
                 bytes_per_second: float = BYTES_PER_SECOND,
                 files_per_second: float = FILES_PER_SECOND) -> None:
        self._store = store
        self._on_done = on_done
        self._bytes_per_second = bytes_per_second
        self._files_per_second = files_per_second
        self._stop = threading.Event()
        self.files = 0
        self.bytes = 0
        self._thread = threading.Thread(target=self._run, name="scrub", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            for key, record in self._store.file_records(512):
                if self._stop.is_set():
                    return
                read = self._store.scrub(key, record)
                if read is None:
                    continue  # not whole, or verified by a reader meanwhile
                self.files += 1
                self.bytes += read
                self._pace(started)
        except Exception:  # the disk, the index: what is not scrubbed is checked at open
            log.exception("verifying the cache in the background stopped")
            return
        log.info("cache verified in the background: %d files, %d bytes, in %.0f s",
                 self.files, self.bytes, time.monotonic() - started)
        self._on_done()

    def _pace(self, started: float) -> None:
        due = max(self.bytes / self._bytes_per_second, self.files / self._files_per_second)
        ahead = started + due - time.monotonic()
        if ahead > 0:
            self._stop.wait(ahead)
