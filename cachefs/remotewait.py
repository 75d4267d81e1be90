"""Marking the waits on the remote, so that a thread serving FUSE is replaced meanwhile.

The FUSE loop (cachefs/fuseloop.py) keeps few threads: the daemon's Python runs on one core
at a time, and every thread more takes turns at the GIL for nothing.  But a thread waiting
for the remote (milliseconds, or seconds when it hangs) is not using the GIL, and the reads
of cached files must not queue behind it.  Code that waits on the remote says so with
``waiting()``; on a loop thread that tells the loop to start another thread at once.
Elsewhere (prefetch workers, the control socket) it does nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

_hooks = threading.local()


def set_hooks(begin: Callable[[], None], end: Callable[[], None]) -> None:
    """Call ``begin`` and ``end`` around each wait on the remote by the calling thread."""
    _hooks.begin, _hooks.end = begin, end


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    begin = getattr(_hooks, "begin", None)
    if begin is None:
        yield
        return
    begin()
    try:
        yield
    finally:
        _hooks.end()
