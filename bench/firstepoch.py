"""The plain first epoch at the peer fraction against the remote read directly, in turns.

A first epoch without hints reads every file from the remote either way: directly, or through
cachefs, which hands the remote's own file to the kernel and fills the kept fifth beside the
reader.  The two run at nearly the same speed, so the verdict on "at least the remote's own
speed" hangs on a few per cent, less than what the machine moves from one minute to the next:
taken from the variants' own runs (one first epoch of cachefs against the direct variant's
epochs minutes before) the same code showed 0.93x and 0.99x.  Here both loaders are started
once, with persistent workers, and take turns, one paced epoch each (the order swapped every
round), cachefs each time on a fresh, empty cache mounted again at the same place.  The ratio
is the median of the rounds'.  The first round only starts the workers and is not counted.
"""

from __future__ import annotations

import shutil
import statistics
from collections.abc import Callable
from pathlib import Path

from bench.dataset import Dataset
from bench.driver import ChildLoop, LoopConfig, LoopFailed
from bench.emulator.remote import EmulatedRemote
from bench.measure import cache_budget, cache_disk, remote_path
from bench.mounts import CachefsMount, MountError
from bench.settings import RunSettings
from bench.variants import PEER_FRACTION


def _config(root: Path, dataset: Dataset, settings: RunSettings) -> LoopConfig:
    return LoopConfig(
        root=str(root), examples=[(e.path, e.offset, e.length) for e in dataset.examples],
        whole_files=True, epochs=settings.first_rounds + 1, batch_size=settings.batch,
        num_workers=settings.workers, step_ms=settings.step_ms, seed=settings.seed,
        gated=True)


def measure(dataset: Dataset, remote: EmulatedRemote, settings: RunSettings, run_dir: Path,
            log: Callable[[str], None]) -> dict:
    result: dict = {"fraction": PEER_FRACTION, "rounds": [], "ratio": None, "error": None}
    work = run_dir / "first-epochs"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    source = remote_path(remote, dataset)
    budget = cache_budget(PEER_FRACTION, dataset)
    log_file = settings.out_dir / "logs" / "first-epochs.log"

    def through_cachefs(loop: ChildLoop) -> dict:
        """One epoch of ``loop`` through a mount of a fresh cache, unmounted after."""
        with cache_disk(work, budget, len(dataset.files)) as disk, \
                CachefsMount(source, work / "mnt", disk / "cache", cache_size_bytes=budget,
                             fraction=PEER_FRACTION, log_file=log_file):
            return loop.run_epoch()

    try:
        (work / "mnt").mkdir()
        timeout = settings.variant_timeout_s
        with ChildLoop(_config(source, dataset, settings), dict, timeout) as direct, \
                ChildLoop(_config(work / "mnt", dataset, settings), dict, timeout) as ours:
            for number in range(settings.first_rounds + 1):
                turns = ((direct, ours) if number % 2 == 0 else (ours, direct))
                epochs = {loop: through_cachefs(loop) if loop is ours else loop.run_epoch()
                          for loop in turns}
                if epochs[ours]["bytes_read"] != epochs[direct]["bytes_read"]:
                    raise RuntimeError(f"an epoch through cachefs read "
                                       f"{epochs[ours]['bytes_read']} bytes, directly "
                                       f"{epochs[direct]['bytes_read']}")
                if number == 0:
                    continue  # the workers started during this round
                rates = {"direct": epochs[direct]["samples_per_second"],
                         "cachefs": epochs[ours]["samples_per_second"]}
                rates["ratio"] = rates["cachefs"] / rates["direct"]
                result["rounds"].append(rates)
                log(f"  round {number}: the remote directly {rates['direct']:.0f}, cachefs "
                    f"f={PEER_FRACTION:g} {rates['cachefs']:.0f} samples/s "
                    f"({rates['ratio']:.2f}x)")
        result["ratio"] = statistics.median(r["ratio"] for r in result["rounds"])
    except (LoopFailed, MountError, OSError, RuntimeError) as exc:
        result["error"] = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        log(f"  first epochs in turns: FAILED: {result['error']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result
