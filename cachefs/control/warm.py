"""`cachefs warm`: fill the cache from a list of paths before training starts.

Sends ``FETCH path`` requests over several control connections at once (the
daemon fetches each from the remote into the cache, if the file is admitted)
and shows a progress bar (on a terminal; plain lines otherwise) and a summary.
Without a list, every file under the mount is warmed.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from cachefs.control.client import connect, request
from cachefs.errors import UsageError
from cachefs.sizes import format_bytes

DEFAULT_CONNECTIONS = 16


def read_list(source: str) -> Iterator[str]:
    """Paths from a file (one per line) or from stdin for ``-``; blank lines skipped."""
    try:
        stream = sys.stdin if source == "-" else open(  # noqa: SIM115 (closed below)
            source, encoding="utf-8", errors="surrogateescape")
    except OSError as exc:
        raise UsageError(f"cannot read list {source}: {exc.strerror}") from None
    with stream:
        for line in stream:
            path = line.rstrip("\n")
            if path.strip():
                yield path


def walk_files(mountpoint: Path) -> Iterator[str]:
    for directory, _dirs, files in os.walk(mountpoint):
        for name in files:
            yield os.path.relpath(os.path.join(directory, name), mountpoint)


class _Progress:
    """Progress on stderr: rich's bar with rate and ETA on a terminal; into a pipe or a
    log, one plain line every ``PLAIN_EVERY_SECONDS`` (none for a warm shorter than that).

    Thread safety: ``update`` is called with the caller's lock held.
    """

    PLAIN_EVERY_SECONDS = 10.0

    def __init__(self, total: int) -> None:
        self.total = total
        self.started = time.monotonic()
        self._last_line = self.started
        self._bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("warming"), BarColumn(), MofNCompleteColumn(),
                TextColumn("files"), _files_per_second_column(),
                TextColumn("[cyan]{task.fields[cached]}"), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(),
                console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task("warm", total=total, cached=format_bytes(0))
            self._bar.start()

    def update(self, done: int, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, cached=f"{format_bytes(nbytes)} new")
            return
        now = time.monotonic()
        if now - self._last_line >= self.PLAIN_EVERY_SECONDS:
            self._last_line = now
            rate = done / max(now - self.started, 1e-9)
            print(f"warm: {done:,}/{self.total:,} files, {format_bytes(nbytes)} new, "
                  f"{rate:,.0f} files/s", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _files_per_second_column():
    from rich.progress import ProgressColumn
    from rich.text import Text

    class FilesPerSecond(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("-" if speed is None else f"{speed:,.0f}/s", style="green")

    return FilesPerSecond()


def warm(mountpoint: str, paths: Iterable[str], connections: int = DEFAULT_CONNECTIONS) -> int:
    """Warm ``paths``; prints a summary, returns the exit status (1 when any failed)."""
    paths = list(paths)
    probe = connect(mountpoint)  # fail early, with one line, when it is not a cachefs mount
    probe.close()
    results: Counter[str] = Counter()
    errors: list[str] = []
    nbytes = 0
    lock = threading.Lock()
    progress = _Progress(len(paths))
    local = threading.local()

    def fetch(path: str) -> None:
        nonlocal nbytes
        sock = getattr(local, "sock", None)
        if sock is None:
            sock = local.sock = connect(mountpoint, timeout=600)
        reply = request(sock, b"FETCH " + os.fsencode(path))
        with lock:
            if reply.get("ok"):
                results[reply["result"]] += 1
                nbytes += reply.get("bytes", 0)
            else:
                results["failed"] += 1
                if len(errors) < 10:
                    errors.append(f"{path}: {reply.get('error', 'failed')}")
            progress.update(sum(results.values()), nbytes)

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max(1, connections)) as pool:
        for future in [pool.submit(fetch, p) for p in paths]:
            try:
                future.result()
            except (OSError, UsageError, ValueError) as exc:
                with lock:
                    results["failed"] += 1
                    if len(errors) < 10:
                        errors.append(str(exc))
    progress.update(sum(results.values()), nbytes)
    progress.finish()
    elapsed = time.monotonic() - started
    print(f"warmed {len(paths):,} files in {elapsed:.1f} s: {results['fetched']:,} fetched "
          f"({format_bytes(nbytes)} now cached), {results['cached']:,} already cached, "
          f"{results['not_admitted']:,} not admitted by the fraction, "
          f"{results['cache_full']:,} left out (cache full), {results['failed']:,} failed")
    for line in errors:
        print(f"  failed: {line}", file=sys.stderr)
    return 1 if results["failed"] else 0
