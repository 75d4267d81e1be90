"""remote_cost: what the emulated remote (bench/emulator/slowfs.py) costs in CPU per file,
beside the latency it injects.

The emulator runs on the same cores as the daemon under test, so every millisecond of CPU it
burns is taken from what is being measured. It must stay small beside what it emulates: its own
CPU per file at most TARGET_RATIO (10 %) of the latency it injects per file.

    python3 -m bench.emulator.remote_cost [--files 2000] [--size 65536] [--readers 8]
        [--profile efs] [--repeats 3] [--slowfs FILE] [--against FILE]...

Makes FILES files of SIZE bytes in a temporary directory, serves them with the emulator (a
fresh mount per repeat), reads every file once with READERS processes (open, read to the end,
close), and prints for each run: files/s, the latency injected per file (from the emulator's
op counters and its settings), the emulator's CPU per file (utime + stime from /proc over the
reads only) and their ratio, with the verdict. ``--slowfs FILE`` runs another slowfs.py
instead of this tree's; ``--against FILE`` measures another one too, the two taking turns run
by run, for a before/after figure (``git show REV:bench/emulator/slowfs.py > old.py``). Another
slowfs.py's control socket must speak the same protocol.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.emulator import slowfs
from bench.emulator.remote import EmulatedRemote

TARGET_RATIO = 0.10
DATASET_DIR = "data"
READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class Run:
    """One pass over the dataset through a fresh mount."""

    files: int
    seconds: float
    cpu_seconds: float  # the emulator's, over the reads
    injected_seconds: float  # latency and transfer time the emulator added, all files
    ops: dict[str, int]  # the emulator's op counts over the reads

    @property
    def files_per_second(self) -> float:
        return self.files / self.seconds

    @property
    def cpu_per_file(self) -> float:
        return self.cpu_seconds / self.files

    @property
    def injected_per_file(self) -> float:
        return self.injected_seconds / self.files

    @property
    def ratio(self) -> float:
        return self.cpu_seconds / self.injected_seconds if self.injected_seconds else float("inf")


class ScriptRemote(EmulatedRemote):
    """An EmulatedRemote run by another slowfs.py file (an older version, say)."""

    def __init__(self, script: Path, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.script = Path(script).resolve()

    def _command(self, args: list[str]) -> tuple[list[str], dict[str, str]]:
        _cmd, env = slowfs.child_command(args)
        return [sys.executable, str(self.script), *args], env


def make_dataset(root: Path, files: int, size: int) -> list[str]:
    """FILES files of SIZE random bytes under root/DATASET_DIR, 100 to a directory; their
    paths relative to root."""
    names = []
    block = os.urandom(size)
    for index in range(files):
        rel = f"{DATASET_DIR}/{index // 100:03d}/{index:06d}.bin"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        # Files differ in their first bytes, so nothing can share them.
        path.write_bytes(index.to_bytes(8, "little") + block[8:])
        names.append(rel)
    return names


def _read_all(paths: Sequence[str]) -> int:
    """Read each file to its end, as a data loader does; the number of bytes read."""
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while chunk := os.read(fd, READ_CHUNK):
                total += len(chunk)
        finally:
            os.close(fd)
    return total


def injected_seconds(before: dict, after: dict) -> float:
    """The latency and transfer time the emulator added between two of its stats."""
    settings = after["settings"]
    total = 0.0
    for op, count in after["ops"].items():
        field = slowfs.LATENCY_OF.get(op)
        if field is not None:
            total += (count - before["ops"].get(op, 0)) * settings[field] / 1000
    if settings["bandwidth_mbps"]:
        total += (after["read_bytes"] - before["read_bytes"]) / (settings["bandwidth_mbps"] * 1e6)
    return total


def measure_once(remote: EmulatedRemote, paths: list[str], readers: int) -> Run:
    """Read every path once with `readers` processes through a started remote."""
    shares = [paths[i::readers] for i in range(readers)]
    with multiprocessing.get_context("fork").Pool(readers) as pool:
        pool.map(abs, range(readers))  # the workers are up before the clock starts
        before = remote.stats()
        cpu_before = remote.cpu_seconds()
        started = time.monotonic()
        read = sum(pool.map(_read_all, shares))
        seconds = time.monotonic() - started
        cpu_after = remote.cpu_seconds()
        after = remote.stats()
    if after["read_bytes"] - before["read_bytes"] != read:
        raise RuntimeError("the emulator served a different number of bytes than were read")
    ops = {op: count - before["ops"].get(op, 0) for op, count in after["ops"].items()
           if count != before["ops"].get(op, 0)}
    return Run(len(paths), seconds, cpu_after - cpu_before, injected_seconds(before, after), ops)


def measure(files: int = 2000, size: int = 64 << 10, readers: int = 8, profile: str = "efs",
            repeats: int = 3, variants: Sequence[Path | None] = (None,),
            report=print) -> list[list[Run]]:
    """Runs of the whole measurement for each variant (a slowfs.py file, None for this tree's),
    the variants taking turns so that drift in the machine's load hits them alike; the dataset
    lives in a temporary directory, removed after."""
    work = Path(tempfile.mkdtemp(prefix="remote-cost-"))
    runs: list[list[Run]] = [[] for _ in variants]
    try:
        source = work / "source"
        names = make_dataset(source, files, size)
        for repeat in range(repeats):
            for index, script in enumerate(variants):
                mountpoint = work / f"mnt{repeat}-{index}"
                mountpoint.mkdir()
                options = {"profile": profile, "log_file": work / "slowfs.log"}
                remote = (ScriptRemote(script, source, mountpoint, **options) if script
                          else EmulatedRemote(source, mountpoint, **options))
                try:
                    remote.start()
                    paths = [str(mountpoint / name) for name in names]
                    run = measure_once(remote, paths, readers)
                finally:
                    remote.stop()
                runs[index].append(run)
                report(f"run {repeat + 1}, {label(script)}: {describe(run)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return runs


def label(script: Path | None) -> str:
    return str(script) if script else "this tree"


def describe(run: Run) -> str:
    per_file = ", ".join(f"{op} {count / run.files:.2f}" for op, count in sorted(run.ops.items()))
    return (f"{run.files_per_second:,.0f} files/s; injected {run.injected_per_file * 1e3:.2f} "
            f"ms/file; emulator CPU {run.cpu_per_file * 1e3:.3f} ms/file = "
            f"{run.ratio:.1%} of injected ({verdict(run.ratio)}); ops/file: {per_file}")


def verdict(ratio: float) -> str:
    return "ok" if ratio <= TARGET_RATIO else f"over the {TARGET_RATIO:.0%} target"


def summary(runs: list[Run]) -> str:
    def span(values: list[float], fmt: str) -> str:
        return f"{fmt.format(min(values))}-{fmt.format(max(values))}"

    worst = max(run.ratio for run in runs)
    return (f"files/s {span([r.files_per_second for r in runs], '{:,.0f}')}; "
            f"emulator CPU {span([r.cpu_per_file * 1e3 for r in runs], '{:.3f}')} ms/file; "
            f"injected {span([r.injected_per_file * 1e3 for r in runs], '{:.2f}')} ms/file; "
            f"CPU/injected {span([r.ratio * 100 for r in runs], '{:.1f}')} %: "
            f"{verdict(worst)} (target <= {TARGET_RATIO:.0%})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m bench.emulator.remote_cost",
        description="Measure the emulated remote's own CPU per file against the latency it "
                    "injects (target: at most 10 %).")
    parser.add_argument("--files", type=int, default=2000, help="files in the dataset")
    parser.add_argument("--size", type=int, default=64 << 10, help="bytes per file")
    parser.add_argument("--readers", type=int, default=8, help="reading processes")
    parser.add_argument("--profile", choices=sorted(slowfs.PROFILES), default="efs")
    parser.add_argument("--repeats", type=int, default=3, help="runs, each on a fresh mount")
    parser.add_argument("--slowfs", type=Path, help="run this slowfs.py instead of this tree's")
    parser.add_argument("--against", type=Path, action="append", default=[],
                        help="also measure this slowfs.py (an older one, say), in turns")
    args = parser.parse_args(argv)
    if min(args.files, args.size, args.readers, args.repeats) < 1:
        parser.error("--files, --size, --readers and --repeats must be at least 1")
    variants = [args.slowfs, *args.against]
    for script in filter(None, variants):
        if not script.is_file():
            parser.error(f"{script}: no such file")
    settings = ", ".join(f"{key} {value}" for key, value in
                         asdict(slowfs.PROFILES[args.profile]).items())
    print(f"profile {args.profile} ({settings}): {args.files} files of {args.size:,} bytes, "
          f"{args.readers} readers, {args.repeats} runs of "
          f"{', '.join(label(script) for script in variants)}", flush=True)
    try:
        runs = measure(args.files, args.size, args.readers, args.profile, args.repeats,
                       variants, report=lambda line: print(line, flush=True))
    except (OSError, RuntimeError) as exc:
        print(f"remote_cost: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    for script, its_runs in zip(variants, runs, strict=True):
        print(f"{label(script)}: {summary(its_runs)}")
    return 0 if max(run.ratio for run in runs[0]) <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
