"""The training loop: a real torch DataLoader over a dataset path, a simulated GPU step.

Per batch the loop measures how long it was blocked in ``next(loader)`` (the data stall), then
sleeps ``step_ms`` as a GPU step would. Before every epoch it drops the page cache, so that
"local" reads are disk reads and nothing the previous epoch read is free.

Each variant's loop runs in a process of its own (:func:`run_in_child`), so DataLoader workers,
torch state and client connections never leak from one variant into the next. The child asks the
parent for a counter snapshot at each epoch boundary, over a pipe: the parent owns the mounts
and knows where their counters are.

Standalone, on any directory of files (a cachefs mount, a remote, a local copy)::

    python3 -m bench.driver PATH [--epochs 3] [--workers 8] [--batch 128] [--step-ms 87] [--hints]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import xxhash

from bench.counters import Snapshot, delta

DROP_CACHES = "/proc/sys/vm/drop_caches"
SNAPSHOT = "snapshot"
READY = "ready"


@dataclass
class LoopConfig:
    """What one variant's loop does. ``examples``: (path relative to root, offset, length)."""

    root: str
    examples: list[tuple[str, int, int]]
    whole_files: bool
    epochs: int
    batch_size: int
    num_workers: int
    step_ms: float
    unpaced_epochs: int = 0
    hints: bool = False
    seed: int = 0
    drop_caches: bool = True
    persistent_workers: bool = True
    # Wait for the parent's word before each epoch, so that two loops can take turns.
    gated: bool = False
    # Ask the parent for a counter snapshot at each epoch's start and end; off when the parent
    # takes them itself around several loops that run at once (a cluster's nodes).
    child_snapshots: bool = True
    # This loop's shard of the examples, as one rank of a data-parallel job reads it: a
    # DistributedSampler over ``world`` ranks, reshuffled every epoch; 1: every example.
    rank: int = 0
    world: int = 1
    # xxh3_64 of each example's bytes: when given, every read is compared with it, not only
    # its length, so a wrong byte fails the loop.
    digests: list[int] | None = None
    # Idle this long before each epoch (so that cached attributes fall due, say).
    pause_before_epoch_s: float = 0.0
    # How DataLoader workers start. A child made with "spawn" inherits "spawn" as its default,
    # and spawned workers each import torch again (seconds per worker on a small machine):
    # the parent passes the platform's own default, which a training script would get.
    worker_start_method: str = field(default_factory=multiprocessing.get_start_method)


@dataclass
class EpochResult:
    epoch: int
    paced: bool
    samples: int
    bytes_read: int
    seconds: float
    wait_seconds: float
    samples_per_second: float
    stall_fraction: float
    wait_p50_ms: float
    wait_p99_ms: float
    wait_max_ms: float
    late_batches: int  # batches that waited longer than one step
    step_seconds: float  # time in the simulated GPU step (more than asked on a busy machine)
    waits_ms: list[float] = field(default_factory=list)  # every batch's wait, in order
    counters: Snapshot = field(default_factory=dict)


class ExampleDataset:
    """Examples as (path, offset, length); an item is the number of bytes read.

    Whole files are read with open().read(), as ImageFolder does, or, with ``fast_path``, with
    cachefs_client.read_files, a batch at a time, as a hinted training script does; records of
    shard files with os.pread at their offset. Returning the length rather than the bytes keeps
    worker-to-loop traffic out of the measurement (a real pipeline returns a decoded tensor of
    its own size).
    """

    def __init__(self, root: str, examples: list[tuple[str, int, int]], whole_files: bool,
                 fast_path: bool = False, digests: list[int] | None = None):
        self.paths = [os.path.join(root, path) for path, _, _ in examples]
        self.offsets = [offset for _, offset, _ in examples]
        self.lengths = [length for _, _, length in examples]
        self.whole_files = whole_files
        self.fast_path = fast_path
        self.digests = digests

    def __len__(self) -> int:
        return len(self.paths)

    def path_of(self, index: int) -> str:
        return self.paths[index]

    def __getitems__(self, indices: list[int]) -> list[int]:
        if not (self.whole_files and self.fast_path):
            return [self[index] for index in indices]
        from cachefs_client import read_files

        found = read_files([self.paths[index] for index in indices])
        return [self._checked(index, data) for index, data in zip(indices, found, strict=True)]

    def __getitem__(self, index: int) -> int:
        if self.whole_files and self.fast_path:
            from cachefs_client import read_file

            data = read_file(self.paths[index])
        elif self.whole_files:
            with open(self.paths[index], "rb") as f:
                data = f.read()
        else:
            fd = os.open(self.paths[index], os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.pread(fd, self.lengths[index], self.offsets[index])
            finally:
                os.close(fd)
        return self._checked(index, data)

    def _checked(self, index: int, data: bytes) -> int:
        if len(data) != self.lengths[index]:
            raise OSError(f"{self.paths[index]}: read {len(data)} bytes, expected "
                          f"{self.lengths[index]}")
        if self.digests is not None and xxhash.xxh3_64_intdigest(data) != self.digests[index]:
            raise OSError(f"{self.paths[index]}: the bytes read differ from the dataset's")
        return len(data)


def drop_page_cache(*, names_too: bool = True) -> None:
    """Write back, then drop clean pages and, with ``names_too``, dentries and inodes (needs
    root)."""
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n" if names_too else "1\n")


def percentile(values: list[float], share: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _loader(config: LoopConfig):
    import torch
    import torch.utils.data

    # The workers fork from this process and inherit what it imported.  torch's worker loop
    # seeds numpy's generator, importing numpy.random where the script had not: some 150 ms
    # of CPU in each worker as the first epoch starts, 8 at once, which on 2 cores shared
    # with a daemon filling its cache delayed the first batch by up to 1.5 s (the workers'
    # first reads came 0.6 - 1.8 s into the epoch, against 0.3 s with it imported here).
    # A training script that uses numpy has it imported already.
    with contextlib.suppress(ImportError):
        import numpy.random  # noqa: F401

    # More workers than cores is deliberate: they wait on I/O, not on the CPU.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    # The hinted variants use the client whole: hints and its read past FUSE.
    dataset = ExampleDataset(config.root, config.examples, config.whole_files,
                             fast_path=config.hints, digests=config.digests)
    generator = torch.Generator().manual_seed(config.seed)
    # The same arguments with and without hints, so both variants see the same batches.
    # Persistent workers, as a tuned training script has them: otherwise every epoch of a
    # small dataset starts with seconds of forking workers, which is no data loading.
    kwargs = dict(batch_size=config.batch_size, shuffle=True, num_workers=config.num_workers,
                  generator=generator, drop_last=False,
                  persistent_workers=config.persistent_workers and config.num_workers > 0)
    if config.world > 1:
        # Without a process group: the rank and the world say all the sampler needs.
        kwargs["shuffle"] = False
        kwargs["sampler"] = torch.utils.data.DistributedSampler(
            dataset, num_replicas=config.world, rank=config.rank, shuffle=True,
            seed=config.seed, drop_last=False)
    if config.num_workers > 0:
        kwargs["multiprocessing_context"] = config.worker_start_method
    if config.hints:
        from cachefs_client import DataLoader

        return DataLoader(dataset, path_of=dataset.path_of, **kwargs)
    return torch.utils.data.DataLoader(dataset, **kwargs)


def run_loop(config: LoopConfig, snapshot: Callable[[], Snapshot],
             report: Callable[[EpochResult], None],
             gate: Callable[[], None] = lambda: None) -> None:
    """Run the epochs; ``report`` gets each epoch's figures as soon as it ends, ``gate`` is
    called before each one starts."""
    loader = _loader(config)
    step = config.step_ms / 1000.0
    for epoch in range(1, config.epochs + config.unpaced_epochs + 1):
        paced = epoch <= config.epochs
        time.sleep(config.pause_before_epoch_s)
        gate()
        if config.world > 1:  # as a data-parallel training script does every epoch
            loader.sampler.set_epoch(epoch)
        if config.drop_caches:
            drop_page_cache()
        before = snapshot()
        waits: list[float] = []
        samples = bytes_read = 0
        stepping = 0.0
        started = time.perf_counter()
        # What a training loop's `for batch in loader` blocks in: iter() (starting the
        # workers) counts into the first batch's wait; the final next() that ends the epoch
        # (and stops the workers) counts into the stall, but is no batch.
        batches = iter(loader)
        asked = started
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            waits.append(time.perf_counter() - asked)
            samples += len(batch)
            bytes_read += int(batch.sum())
            if paced and step > 0:
                slept = time.perf_counter()
                time.sleep(step)
                stepping += time.perf_counter() - slept
            asked = time.perf_counter()
        ended = time.perf_counter()
        seconds = ended - started
        after = snapshot()
        wait = sum(waits) + (ended - asked)
        report(EpochResult(
            epoch=epoch, paced=paced, samples=samples, bytes_read=bytes_read, seconds=seconds,
            wait_seconds=wait, samples_per_second=samples / seconds if seconds else 0.0,
            stall_fraction=wait / seconds if seconds else 0.0,
            wait_p50_ms=1000 * (statistics.median(waits) if waits else 0.0),
            wait_p99_ms=1000 * percentile(waits, 0.99),
            wait_max_ms=1000 * max(waits, default=0.0),
            late_batches=sum(w > step for w in waits) if paced else 0,
            step_seconds=stepping,
            waits_ms=[round(1000 * w, 3) for w in waits],
            counters=delta(before, after)))


# -- one variant in a child process ------------------------------------------------------------

def _child(config: LoopConfig, conn) -> None:
    def snapshot() -> Snapshot:
        conn.send((SNAPSHOT,))
        return conn.recv()

    def gate() -> None:
        conn.send((READY,))
        conn.recv()  # the parent's go

    try:
        run_loop(config, snapshot if config.child_snapshots else dict,
                 lambda result: conn.send(("epoch", asdict(result))),
                 gate if config.gated else lambda: None)
        conn.send(("done",))
    except (KeyboardInterrupt, BrokenPipeError, EOFError):
        pass  # the parent is stopping the run (Ctrl-C, SIGTERM) and cleans up
    except BaseException as exc:  # reported to the parent, which decides what to do
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except OSError:
            pass
    finally:
        conn.close()


class LoopFailed(RuntimeError):
    """The training loop of a variant failed or hung; the message has the child's traceback."""


def first_line(exc: BaseException) -> str:
    """What a measurement that failed with ``exc`` reports: its message's first line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


class ChildLoop:
    """:func:`run_loop` in a fresh process, answering its snapshot requests; a context manager
    that stops the process however the block ends."""

    def __init__(self, config: LoopConfig, snapshot: Callable[[], Snapshot],
                 timeout_s: float) -> None:
        self._snapshot = snapshot
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        # spawn: a clean interpreter, nothing inherited from the parent's threads or mounts.
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(target=_child, args=(config, child_end), daemon=False)
        self._process.start()
        child_end.close()

    def __enter__(self) -> ChildLoop:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def next_message(self) -> tuple:
        """The loop's next epoch, "ready" or "done" message; LoopFailed if it fails or hangs."""
        while True:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise LoopFailed(f"the training loop did not finish within "
                                 f"{self._timeout_s:.0f} s")
            if not self._conn.poll(min(remaining, 1.0)):
                if not self._process.is_alive() and not self._conn.poll(0):
                    raise LoopFailed(f"the training loop died (exit code "
                                     f"{self._process.exitcode})")
                continue
            try:
                message = self._conn.recv()
            except EOFError:
                raise LoopFailed("the training loop died without a word "
                                 f"(exit code {self._process.exitcode})") from None
            if message[0] == SNAPSHOT:
                self._conn.send(self._snapshot())
            elif message[0] == "error":
                raise LoopFailed(message[1])
            else:
                return message

    def run_epoch(self) -> dict:
        """Let a gated loop run its next epoch; that epoch's figures."""
        self.wait_ready()
        self.go()
        return self.epoch_ended()

    # Apart, for loops that run their epochs at once (a cluster's nodes): wait until every
    # one is ready, let them all go, then collect each one's figures.
    def wait_ready(self) -> None:
        """Wait until a gated loop is ready to start its next epoch."""
        self._expect(READY)

    def go(self) -> None:
        """Let a ready loop start its epoch."""
        self._conn.send(("go",))

    def epoch_ended(self) -> dict:
        """The figures of the epoch the loop runs, once it ends."""
        return self._expect("epoch")[1]

    def _expect(self, expected: str) -> tuple:
        message = self.next_message()
        if message[0] != expected:
            raise LoopFailed(f"the training loop said {message[0]!r}, not {expected!r}")
        return message

    def close(self) -> None:
        self._conn.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def run_in_child(config: LoopConfig, snapshot: Callable[[], Snapshot],
                 on_epoch: Callable[[dict], None], timeout_s: float) -> list[dict]:
    """Run :func:`run_loop` in a fresh process; serve its snapshot requests; return the epochs."""
    epochs: list[dict] = []
    with ChildLoop(config, snapshot, timeout_s) as loop:
        while (message := loop.next_message())[0] == "epoch":
            epochs.append(message[1])
            on_epoch(message[1])
    return epochs


# -- standalone --------------------------------------------------------------------------------

def _walk(root: str) -> list[tuple[str, int, int]]:
    found = []
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(directory, name)
            found.append((os.path.relpath(path, root), 0, os.path.getsize(path)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.driver",
                                     description="Train on every file under PATH and report "
                                     "samples/s and data stall per epoch.")
    parser.add_argument("path")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=87.0)
    parser.add_argument("--hints", action="store_true", help="send cachefs prefetch hints")
    parser.add_argument("--no-drop-caches", action="store_true",
                        help="keep the page cache between epochs (when not root)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.path):
        parser.exit(2, f"{parser.prog}: {args.path} is not a directory\n")
    examples = _walk(args.path)
    if not examples:
        parser.exit(2, f"{parser.prog}: no files under {args.path}\n")
    config = LoopConfig(root=args.path, examples=examples, whole_files=True, epochs=args.epochs,
                        batch_size=args.batch, num_workers=args.workers, step_ms=args.step_ms,
                        hints=args.hints, drop_caches=not args.no_drop_caches)

    def show(e: EpochResult) -> None:
        print(f"epoch {e.epoch}: {e.samples_per_second:8.0f} samples/s  stall "
              f"{e.stall_fraction:6.1%}  wait p50 {e.wait_p50_ms:6.1f} ms  p99 "
              f"{e.wait_p99_ms:6.1f} ms", flush=True)

    try:
        run_loop(config, dict, show)
    except PermissionError:
        parser.exit(1, f"{parser.prog}: cannot drop the page cache (not root); pass "
                    "--no-drop-caches\n")
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
