"""Measuring one variant: mount what it needs, run its training loop in a child, unmount.

The emulated remote serves the datasets directory for the whole run; every variant but
``local`` reads through it, so its counters say what crossed the "network" for any of them.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from bench import counters
from bench.dataset import Dataset
from bench.driver import LoopConfig, LoopFailed, first_line, run_in_child
from bench.emulator.remote import EmulatedRemote
from bench.mounts import CachefsMount, MountError, RcloneMount, ScratchDisk
from bench.settings import RunSettings
from bench.variants import CACHEFS, DIRECT, LOCAL, RCLONE, Variant

BLOCK_BYTES = 4096
# The budget is what the kept files occupy, with room for the index, its headroom and the
# fan-out directories (a few MiB for thousands of files), and a little slack.
BUDGET_SLACK = 0.02
BUDGET_OVERHEAD_BYTES = 8 * 2**20
# What the cache disk's ext4 takes for itself (journal, inode tables) beyond the cache's room.
DISK_OVERHEAD_BYTES = 256 * 2**20


def allocated_bytes(sizes: list[int]) -> int:
    """What the files occupy on disk, in whole blocks."""
    return sum(-(-size // BLOCK_BYTES) * BLOCK_BYTES for size in sizes)


def cache_budget(fraction: float, dataset: Dataset) -> int:
    """The --cache-size for a fraction: the files cachefs keeps at it, plus index overhead.

    Which files are kept is decided by cachefs's own rule (a hash of the path, seed 0), so the
    kept share of the bytes is F only on average; sizing by the kept files themselves gives
    the cache exactly what it needs, as an operator sizing a cache for F would.
    """
    from cachefs.store.admission import FractionAdmission

    admission = FractionAdmission(fraction)
    kept = [size for path, size in dataset.file_sizes().items() if admission.eligible(path)]
    return int(allocated_bytes(kept) * (1 + BUDGET_SLACK)) + BUDGET_OVERHEAD_BYTES


def cache_disk(work: Path, budget: int, files: int) -> ScratchDisk:
    """A disk of its own for a cache of ``budget`` bytes holding up to ``files`` files: a
    fresh journaled ext4, as a node's cache disk is (ScratchDisk).  With the caches on this
    machine's root file system (an ext4 without a journal, where each file created scans past
    the inodes deleted in the last minutes, and every variant deleted its cache), a first
    epoch at f = 1 with hints cost 458 - 588 us of daemon CPU per file, by what the runs
    before it had deleted, and ran at 1,555 - 1,871 samples/s; on a disk of its own, 355 -
    372 us and 2,086 - 2,331 (the EFS-like remote, 4,000 files of 64 KiB, 4 rounds in turns)."""
    return ScratchDisk(work, budget + budget // 4 + DISK_OVERHEAD_BYTES,
                       inodes=2 * files + 4096)


def remote_path(remote: EmulatedRemote, dataset: Dataset) -> Path:
    """Where the remote serves ``dataset`` (its root relative to the remote's source)."""
    return remote.path / dataset.root.relative_to(remote.source)


def measure_variant(variant: Variant, dataset: Dataset, remote: EmulatedRemote,
                    settings: RunSettings, run_dir: Path,
                    log: Callable[[str], None]) -> dict:
    """Figures of every epoch of ``variant``, or the error that stopped it."""
    result: dict = {"variant": variant.name, "kind": variant.kind, "fraction": variant.fraction,
                    "hints": variant.hints, "epochs": [], "error": None}
    work = run_dir / variant.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    try:
        with contextlib.ExitStack() as mounts:
            root, reached = _reach(variant, dataset, remote, settings, work, mounts, result)
            # Every variant's epochs also say how busy the machine's CPUs were.
            snapshot = counters.combined(reached, counters.machine_cpu_snapshot)
            config = LoopConfig(
                root=str(root), examples=[(e.path, e.offset, e.length) for e in dataset.examples],
                whole_files=dataset.spec.kind == "images", epochs=settings.epochs,
                unpaced_epochs=settings.unpaced_epochs, batch_size=settings.batch,
                num_workers=settings.workers, step_ms=settings.step_ms, hints=variant.hints,
                seed=settings.seed, pause_before_epoch_s=variant.pause_before_epoch_s)

            def show(epoch: dict) -> None:
                log(f"  {variant.name:<20} epoch {epoch['epoch']}"
                    f"{'' if epoch['paced'] else ' (unpaced)'}: "
                    f"{epoch['samples_per_second']:7.0f} samples/s, stall "
                    f"{epoch['stall_fraction']:6.1%}, wait p99 {epoch['wait_p99_ms']:6.1f} ms")

            result["epochs"] = run_in_child(config, snapshot, show, settings.variant_timeout_s)
    except (LoopFailed, MountError, OSError, RuntimeError) as exc:
        result["error"] = first_line(exc)
        result["error_detail"] = str(exc)
        log(f"  {variant.name}: FAILED: {result['error']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["wall_seconds"] = round(time.monotonic() - started, 1)
    return result


def _reach(variant: Variant, dataset: Dataset, remote: EmulatedRemote, settings: RunSettings,
           work: Path, mounts: contextlib.ExitStack, result: dict):
    """(directory the loop reads, snapshot function), mounting what the variant needs."""
    def emulator() -> counters.Snapshot:
        return counters.emulator_snapshot(remote.stats())

    if variant.kind == LOCAL:
        return dataset.root, dict
    if variant.kind == DIRECT:
        return remote_path(remote, dataset), emulator
    if variant.kind == CACHEFS:
        budget = cache_budget(variant.fraction, dataset)
        result["cache_size_bytes"] = budget
        disk = mounts.enter_context(cache_disk(work, budget, len(dataset.files)))
        mount = mounts.enter_context(CachefsMount(
            remote_path(remote, dataset), work / "mnt", disk / "cache", cache_size_bytes=budget,
            fraction=variant.fraction, log_file=settings.out_dir / "logs" / f"{variant.name}.log",
            extra_args=variant.cachefs_args))
        root = mount.path
        if variant.through_symlink:  # /data -> the local disk that holds the mount
            (work / "data").symlink_to(work)
            root = work / "data" / mount.path.name
        return root, counters.combined(
            emulator, lambda: counters.cachefs_snapshot(mount.metrics_text()),
            lambda: counters.daemon_cpu_snapshot(mount.pid))
    if variant.kind == RCLONE:
        budget = cache_budget(variant.fraction, dataset)
        result["cache_size_bytes"] = budget
        disk = mounts.enter_context(cache_disk(work, budget, len(dataset.files)))
        mount = mounts.enter_context(RcloneMount(
            remote_path(remote, dataset), work / "mnt", disk / "cache", cache_size_bytes=budget,
            log_file=settings.out_dir / "logs" / f"{variant.name}.log"))
        return mount.path, emulator
    raise ValueError(f"unknown variant kind {variant.kind!r}")
