"""Files per second through the FUSE path when every file is already in the cache.

A training loop's hits never touch the remote, so what bounds them is the cost of FUSE and of
the daemon per file. Measured with a plain multi-threaded read loop (no DataLoader), no hints,
cachefs at F = 1.0 after one pass has filled the cache, against the same loop on the local
copy. Each measured pass starts with the page cache dropped, so both read the disk; one more
pass with the page cache kept shows a warm node: the kernel keeps the pages of unchanged
files across opens, so they reach the daemon only for the open. Between the two, for cachefs, a
pass with the cache disk's pages kept but the mount's dropped: every read goes through FUSE
and the daemon, as in a Python passthrough reading warm files (the 4,600 files/s of
../shared/NOTES.md), and nothing waits on the disk. cachefs is measured twice: with the default
revalidation, and with ``--revalidate never``, where the kernel also keeps attributes and
entries.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import counters
from bench.dataset import Dataset
from bench.driver import drop_page_cache
from bench.emulator.remote import EmulatedRemote
from bench.measure import cache_budget, cache_disk, remote_path
from bench.mounts import CachefsMount, MountError
from bench.settings import RunSettings

COLD_PASSES = 2
DAEMON_PASSES = 3  # short passes (about a second each): the best is the least disturbed
# The default, and the setting for a dataset that never changes: the kernel then also keeps
# attributes and entries for a day, so an open needs fewer round trips to the daemon.
CACHEFS_SETTINGS = {"cachefs": (), "cachefs-immutable": ("--revalidate", "never")}


def _read_whole(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def read_pass(paths: list[str], threads: int, *, drop: bool, seed: int) -> float:
    """Read every file once in a shuffled order; files/s."""
    order = list(paths)
    random.Random(seed).shuffle(order)
    if drop:
        drop_page_cache()
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(_read_whole, order, chunksize=16):
            pass
    return len(order) / (time.perf_counter() - started)


def _drop_pages_of(paths: list[str]) -> None:
    """Drop the pages of these files only: on a FUSE mount, the mount's copy of them, not
    the pages of the files behind it."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _passes(root: Path, files: list[str], threads: int, *, mount: bool = False) -> dict:
    paths = [str(root / name) for name in files]
    found: dict = {}
    cold = [read_pass(paths, threads, drop=True, seed=i) for i in range(COLD_PASSES)]
    found.update(cold_passes=[round(x) for x in cold], cold=round(max(cold)))
    if mount:
        read_pass(paths, threads, drop=False, seed=COLD_PASSES)  # the cache disk's pages in
        through_daemon = []
        for i in range(DAEMON_PASSES):
            _drop_pages_of(paths)
            through_daemon.append(read_pass(paths, threads, drop=False, seed=COLD_PASSES + i))
        found.update(daemon_passes=[round(x) for x in through_daemon],
                     daemon=round(max(through_daemon)))
    found["page_cache"] = round(read_pass(paths, threads, drop=False, seed=COLD_PASSES))
    return found


def _cachefs_passes(data: Dataset, remote: EmulatedRemote, settings: RunSettings,
                    run_dir: Path, extra_args: tuple[str, ...]) -> dict:
    work = run_dir / "filerate"
    shutil.rmtree(work, ignore_errors=True)
    budget = cache_budget(1.0, data)
    with cache_disk(work, budget, len(data.files)) as disk, \
            CachefsMount(remote_path(remote, data), work / "mnt", disk / "cache",
                         cache_size_bytes=budget, fraction=1.0,
                         log_file=settings.out_dir / "logs" / "filerate.log",
                         extra_args=extra_args) as mount:
        mnt = [str(mount.path / name) for name in data.files]
        read_pass(mnt, settings.fps_threads, drop=False, seed=0)  # fills the cache
        before = counters.cachefs_snapshot(mount.metrics_text())
        found = _passes(mount.path, data.files, settings.fps_threads, mount=True)
        seen = counters.delta(before, counters.cachefs_snapshot(mount.metrics_text()))
    opens = counters.cachefs_opens(seen)
    found["hit_ratio"] = seen["cachefs_hit_opens"] / opens if opens else None
    found["remote_bytes"] = seen["cachefs_remote_bytes"]
    return found


def measure(data: Dataset, remote: EmulatedRemote, settings: RunSettings, run_dir: Path,
            log: Callable[[str], None]) -> dict:
    files = data.files
    result: dict = {"files": len(files), "file_bytes": data.examples[0].length,
                    "threads": settings.fps_threads, "error": None}
    try:
        result["local"] = _passes(data.root, files, settings.fps_threads)
        log(f"  local copy: {result['local']['cold']} files/s (page cache dropped), "
            f"{result['local']['page_cache']} (kept)")
        for name, extra_args in CACHEFS_SETTINGS.items():
            result[name] = _cachefs_passes(data, remote, settings, run_dir, extra_args)
            log(f"  {name} f=1 warm: {result[name]['cold']} files/s (page cache dropped), "
                f"{result[name]['daemon']} (through the daemon), "
                f"{result[name]['page_cache']} (kept), hit ratio {result[name]['hit_ratio']}")
    except (MountError, OSError, RuntimeError) as exc:
        result["error"] = str(exc).splitlines()[0]
        log(f"  files/s: FAILED: {result['error']}")
    finally:
        shutil.rmtree(run_dir / "filerate", ignore_errors=True)
    return result
