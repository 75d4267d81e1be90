"""Python's cyclic garbage collector, kept from taking the serving thread's time as the dataset
grows.

Reference counting frees what the daemon drops; the collector is there only for objects in
reference cycles, which the daemon hardly makes (a read pass over 300,000 cached files left
fewer than 1,000 for it).  But each collection visits every container object of the
generations it collects, and the oldest holds one or more per file the daemon keeps track of:
a queued fill, and a held cache file until those became ints (mirror/mirrorfs.py
``HeldFile``).  With CPython's thresholds (700, 10, 10) a full collection comes every few ten
thousand requests once such objects come and go: over a fill pass and two read passes of
300,000 cached files with 192,844 held (an object each then), 63 full collections of 100 to
290 ms each and 700 of the middle generation of 2 to 4 ms, 13 s of the serving thread, 12 to
19 us per file, every request waiting meanwhile.  At 10,000 files: 25 ms in all.

So collections are rarer: the youngest generation every 50,000 allocations net of frees
(about 200 requests' worth; most of what a request allocates is freed before), the middle
one every 20 of those, the oldest every 100 of the middle (and, as CPython adds, only once
the objects promoted since the last full collection are a quarter of those there).  The
same run then spent 0.7 s in 59 collections of the youngest generation and none of the
others.  (10,000 for the youngest: 3.6 s, more young objects promoted and visited again.)
And what starting made (modules, functions, the tables: some 27,000 objects, none garbage)
is frozen out of every later collection.
"""

from __future__ import annotations

import gc
import time

THRESHOLDS = (50_000, 20, 100)


class CollectionTimes:
    """Collections made and the seconds they took, by generation, since this process started
    timing them: what requests waited for (the metrics read them at scrape time).  Written by
    the collector's callback, which runs holding the interpreter lock, so it takes no lock:
    a collection may start inside any allocation, a lock's holder's included."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._began = 0.0

    def on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            generation = info["generation"]
            self.collections[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._began


def collect_rarely() -> CollectionTimes:
    """Raise the collector's thresholds and time its collections from now on (at start,
    before the tables that grow)."""
    gc.set_threshold(*THRESHOLDS)
    times = CollectionTimes()
    gc.callbacks.append(times.on_collection)
    return times


def freeze_what_starting_made() -> None:
    """Leave everything allocated so far out of later collections (just before serving)."""
    gc.collect()  # what starting left in cycles goes now, not frozen for the process's life
    gc.freeze()
