"""Whether the kernel may keep a file's pages from one open to the next.

FUSE drops a file's page cache at every open unless the daemon answers the open with
keep_cache.  Dropping always is safe but makes every epoch of a dataset that fits in memory
go through the daemon again.  Keeping is safe when the pages the kernel may hold can only be
of the version this open reads: every open since they were last dropped saw that same
version (size and mtime, as revalidated by the daemon), and no handle opened at another
version was still open to fill pages after the drop.

With ``--revalidate never`` versions never change, so the mount keeps pages without asking
here.
"""

from __future__ import annotations

import threading

from cachefs.attr import Attr

DEFAULT_MAX_ENTRIES = 1_000_000


class KernelPages:
    """The version each file was last opened at, and which files are open.

    Thread safety: ``_lock`` guards every field (a leaf lock, held for dict operations only).
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._max_entries = max_entries
        self._lock = threading.Lock()
        # The attributes of each file's last open: the object the attribute cache holds too,
        # so remembering it costs a dictionary entry.  Insertion order is age order.
        self._last_opened: dict[str, Attr] = {}
        self._open_handles: dict[str, int] = {}
        # Files whose pages may be of an older version than their last open's: a handle of
        # that version was still open, and may have read after the drop.
        self._mixed: set[str] = set()

    def opened(self, relpath: str, attr: Attr) -> bool:
        """Record an open of ``relpath`` at ``attr``'s version; whether the kernel may keep
        its pages."""
        with self._lock:
            last = self._last_opened.pop(relpath, None)
            self._last_opened[relpath] = attr
            still_open = self._open_handles.get(relpath, 0)
            self._open_handles[relpath] = still_open + 1
            changed = last is not None and last.version != attr.version
            keep = last is not None and not changed and relpath not in self._mixed
            if changed and still_open:
                self._mixed.add(relpath)
            elif not still_open:
                # This open drops the pages (or keeps ones no other version can have filled).
                self._mixed.discard(relpath)
            if len(self._last_opened) > self._max_entries:
                # Forget the oldest tenth: their next open just drops pages it could have kept.
                # One still open may yet fill pages of the version forgotten here.
                for old in list(self._last_opened)[: self._max_entries // 10]:
                    del self._last_opened[old]
                    if old in self._open_handles:
                        self._mixed.add(old)
            return keep

    def released(self, relpath: str) -> None:
        with self._lock:
            left = self._open_handles.pop(relpath, 1) - 1
            if left:
                self._open_handles[relpath] = left
