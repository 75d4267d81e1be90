"""The benchmarks' reader processes: forked once, each reading its share of a pass.

A process pool of concurrent.futures, not multiprocessing.Pool.  When every process of a
benchmark gets SIGTERM at once (its process group stopped), a Pool forks new workers in
place of the killed ones, from a thread of its own: one forked while the main thread starts
`cachefs unmount` on its way out holds that child's exec-status pipe open, and the benchmark
waits for the unmount to start for ever, its mounts left behind; and a worker killed while
it took from the task queue holds the queue's lock, which the Pool's terminate then waits
for.  This pool forks only when work is submitted, on the caller's thread, and a worker that
dies breaks it: the pass raises, and the benchmark unwinds and unmounts.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

from cachefs.service.process import die_with_parent

# A reader that SIGTERM has not ended after this long is killed.
CLOSE_SECONDS = 5.0

Share = TypeVar("Share")
Result = TypeVar("Result")


def start_reader(benchmark: int) -> None:
    """A reader process's start: it ends with the benchmark (pid ``benchmark``), however that
    ends (killed on a timeout, say), and leaves Ctrl-C to it, which ends the readers itself.
    SIGTERM ends a reader (how the pool ends one that is stuck): bench.run turns SIGTERM into
    KeyboardInterrupt for itself, and a reader that inherited that outlived the pool's own
    SIGTERM now and then."""
    die_with_parent(benchmark)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class ReaderPool:
    """``count`` reader processes forked from this one (so each has what it had: the names
    of a tree, an imported client)."""

    def __init__(self, count: int) -> None:
        self._executor = ProcessPoolExecutor(
            count, mp_context=multiprocessing.get_context("fork"), initializer=start_reader,
            initargs=(os.getpid(),))

    def map(self, read: Callable[[Share], Result], shares: Iterable[Share]) -> list[Result]:
        """``read`` of each share, each in a reader; what a reader raised is raised (and
        BrokenProcessPool where a reader died)."""
        return list(self._executor.map(read, shares))

    def close(self) -> None:
        """End the readers, one stuck in a read too (on a mount that stopped answering: the
        benchmark unmounts it after)."""
        # The executor's own list: shutdown() alone would wait for a stuck reader's task.
        readers = list((getattr(self._executor, "_processes", None) or {}).values())
        self._executor.shutdown(wait=False, cancel_futures=True)
        for reader in readers:
            reader.terminate()
        for reader in readers:
            reader.join(CLOSE_SECONDS)
            if reader.is_alive():
                reader.kill()
                reader.join(CLOSE_SECONDS)
