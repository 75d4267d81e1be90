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

import statistics
from collections.abc import Callable
from pathlib import Path

from bench.alternating import in_turns, measured_apart
from bench.dataset import Dataset
from bench.driver import ChildLoop, LoopConfig
from bench.emulator.remote import EmulatedRemote
from bench.measure import cache_budget, cache_disk, remote_path
from bench.mounts import CachefsMount
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
    with measured_apart(result, run_dir / "first-epochs", "first epochs in turns", log) as work:
        source = remote_path(remote, dataset)
        budget = cache_budget(PEER_FRACTION, dataset)
        log_file = settings.out_dir / "logs" / "first-epochs.log"
        (work / "mnt").mkdir()
        timeout = settings.variant_timeout_s
        with ChildLoop(_config(source, dataset, settings), dict, timeout) as direct, \
                ChildLoop(_config(work / "mnt", dataset, settings), dict, timeout) as ours:

            def epoch(loop: ChildLoop) -> dict:
                """An epoch of ``loop``: through cachefs, a mount of a fresh cache, unmounted
                after."""
                if loop is not ours:
                    return loop.run_epoch()
                with cache_disk(work, budget, len(dataset.files)) as disk, \
                        CachefsMount(source, work / "mnt", disk / "cache",
                                     cache_size_bytes=budget, fraction=PEER_FRACTION,
                                     log_file=log_file):
                    return loop.run_epoch()

            for number, theirs, mine in in_turns(direct, ours, settings.first_rounds, epoch):
                if mine["bytes_read"] != theirs["bytes_read"]:
                    raise RuntimeError(f"an epoch through cachefs read {mine['bytes_read']} "
                                       f"bytes, directly {theirs['bytes_read']}")
                rates = {"direct": theirs["samples_per_second"],
                         "cachefs": mine["samples_per_second"]}
                rates["ratio"] = rates["cachefs"] / rates["direct"]
                result["rounds"].append(rates)
                log(f"  round {number}: the remote directly {rates['direct']:.0f}, cachefs "
                    f"f={PEER_FRACTION:g} {rates['cachefs']:.0f} samples/s "
                    f"({rates['ratio']:.2f}x)")
        result["ratio"] = statistics.median(r["ratio"] for r in result["rounds"])
    return result
