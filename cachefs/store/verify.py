"""`cachefs verify`: check every stored chunk against its checksum, drop the bad ones.

Runs on a cache dir that no daemon is using (it takes the same lock).  Only
corrupt, missing or unaccounted data is dropped: the fraction and budget of the
mount that made the cache are not known here, so nothing else is touched.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from pathlib import Path

from cachefs.errors import UsageError
from cachefs.sizes import format_bytes
from cachefs.store.admission import FractionAdmission
from cachefs.store.layout import MARKER_NAME, CacheLayout
from cachefs.store.store import CHUNK_BYTES, CacheStore, refusal


def verify(cache_dir: Path, *, as_json: bool = False) -> int:
    """Verify and repair ``cache_dir``; prints a report; 0 when it was clean."""
    if not (cache_dir / MARKER_NAME).is_file():
        raise UsageError(f"{cache_dir} is not a cachefs cache dir (no {MARKER_NAME})")
    started = time.monotonic()
    # Before the store opens (it refuses such a marker); a daemon cannot be using the
    # directory meanwhile, having refused it too.
    marker_rewritten = CacheLayout(cache_dir, CHUNK_BYTES).repair_marker()
    try:
        store = CacheStore.open(cache_dir, capacity_bytes=2**62,
                                admission=FractionAdmission(1.0), verify_data=True)
    except (OSError, sqlite3.Error) as exc:
        raise UsageError(refusal(cache_dir, exc)) from None
    report, dropped_index = store.startup_report, store.dropped_index
    if store.trash_removal is not None:  # what it emptied leaves the disk before it says so
        store.trash_removal.join()
    store.close()
    elapsed = time.monotonic() - started
    if as_json:
        print(json.dumps({**dataclasses.asdict(report), "marker_rewritten": marker_rewritten,
                          "dropped_index": dropped_index, "seconds": round(elapsed, 2)}))
    else:
        if dropped_index is not None:
            print(f"the index was damaged ({dropped_index}): dropped, the cache emptied")
        print(f"verified {report.chunks_verified:,} chunks of {report.files:,} files "
              f"({format_bytes(report.data_bytes)}) in {elapsed:.1f} s")
        for label, value in (("unreadable cachefs-cache.json rewritten", int(marker_rewritten)),
                             ("corrupt chunks dropped", report.corrupt_chunks),
                             ("missing chunks dropped", report.missing_chunks),
                             ("unaccounted files removed", report.orphan_files),
                             ("inconsistent records dropped", report.miscounted_files),
                             ("unfinished fills removed", report.leftover_fills)):
            if value:
                print(f"  {label}: {value:,}")
    mended = marker_rewritten or dropped_index is not None
    if not as_json and not report.problems and not mended:
        print("  no problems found")
    return 1 if report.problems or mended else 0
