"""cachefs at f = 1 with hints against the local copy, one epoch each in turns.

The share-of-local target compares two loaders' speeds. Taken from the variants' own runs,
which are minutes apart, it moved with the machine rather than with the code: on this 2-core
machine the local copy alone ran anywhere from 6,100 to 9,700 samples/s from one run to the
next, and the same cachefs code showed 43 % to 78 % of it. Here both loaders are started once,
with persistent workers, and then take turns, one unpaced epoch each (the order swapped every
round), so that each pair of epochs is measured within seconds of each other. The share is the
median of the pairs' ratios. The first round only starts the workers and is not counted.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

from bench import counters
from bench.dataset import Dataset
from bench.driver import ChildLoop, LoopConfig, LoopFailed, first_line
from bench.emulator.remote import EmulatedRemote
from bench.filerate import read_pass
from bench.measure import cache_budget, cache_disk, remote_path
from bench.mounts import CachefsMount, MountError
from bench.settings import RunSettings

FILL_THREADS = 16


def _config(root: Path, dataset: Dataset, settings: RunSettings, *, hints: bool) -> LoopConfig:
    return LoopConfig(
        root=str(root), examples=[(e.path, e.offset, e.length) for e in dataset.examples],
        whole_files=True, epochs=0, unpaced_epochs=settings.share_rounds + 1,
        batch_size=settings.batch, num_workers=settings.workers, step_ms=settings.step_ms,
        hints=hints, seed=settings.seed, gated=True)


def measure(dataset: Dataset, remote: EmulatedRemote, settings: RunSettings, run_dir: Path,
            log: Callable[[str], None]) -> dict:
    result: dict = {"rounds": [], "share": None, "error": None}
    with measured_apart(result, run_dir / "alternating", "in turns", log) as work:
        budget = cache_budget(1.0, dataset)
        with cache_disk(work, budget, len(dataset.files)) as disk, \
                CachefsMount(remote_path(remote, dataset), work / "mnt", disk / "cache",
                             cache_size_bytes=budget, fraction=1.0,
                             log_file=settings.out_dir / "logs" / "alternating.log") as mount:
            # One pass fills the cache: from then on every open is a hit.
            read_pass([str(mount.path / name) for name in dataset.files], FILL_THREADS,
                      drop=False, seed=0)

            def ours_snapshot() -> counters.Snapshot:
                return counters.cachefs_snapshot(mount.metrics_text())

            timeout = settings.variant_timeout_s
            with ChildLoop(_config(dataset.root, dataset, settings, hints=False), dict,
                           timeout) as local, \
                    ChildLoop(_config(mount.path, dataset, settings, hints=True),
                              ours_snapshot, timeout) as ours:
                for number, theirs, mine in in_turns(local, ours, settings.share_rounds,
                                                     ChildLoop.run_epoch):
                    result["rounds"].append(_round(theirs, mine))
                    log(f"  round {number}: local {result['rounds'][-1]['local']:.0f}, "
                        f"cachefs f=1 hints {result['rounds'][-1]['cachefs']:.0f} samples/s")
        result["share"] = statistics.median(r["share"] for r in result["rounds"])
    return result


def in_turns(first: ChildLoop, second: ChildLoop, rounds: int,
             run: Callable[[ChildLoop], dict]) -> Iterator[tuple[int, dict, dict]]:
    """``rounds`` rounds of an epoch of each gated loop (``run(loop)``), the order swapped
    every round: (its number, ``first``'s epoch, ``second``'s) of each.  A round before them
    only starts the workers and is not counted."""
    for number in range(rounds + 1):
        turns = (first, second) if number % 2 == 0 else (second, first)
        epochs = {loop: run(loop) for loop in turns}
        if number:
            yield number, epochs[first], epochs[second]


@contextlib.contextmanager
def measured_apart(result: dict, work: Path, what: str,
                   log: Callable[[str], None]) -> Iterator[Path]:
    """A measurement of its own in the empty directory ``work``, removed after; its failure
    is the one line in ``result["error"]``, not the run's end."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        yield work
    except (LoopFailed, MountError, OSError, RuntimeError) as exc:
        result["error"] = first_line(exc)
        log(f"  {what}: FAILED: {result['error']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _round(local: dict, ours: dict) -> dict:
    seen = ours["counters"]
    opens = counters.cachefs_opens(seen)
    return {"local": local["samples_per_second"], "cachefs": ours["samples_per_second"],
            "share": ours["samples_per_second"] / local["samples_per_second"],
            "hit_ratio": seen["cachefs_hit_opens"] / opens if opens else None,
            "remote_bytes": seen["cachefs_remote_bytes"]}
