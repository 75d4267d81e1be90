"""What one file costs on each path through the daemon: files/s and daemon CPU per file.

The figure the data path is judged by is the daemon's own CPU per file (user + system, from
/proc/PID/stat): on a node it is shared with the training job's workers, and under one GIL
it also caps the files/s of a whole mount.  Beside it, the memory the daemon kept per file
over the pass (VmRSS from /proc/PID/status, after the pass less before it; the memory
files of staged hints are not mapped, so not in it: ``--staging-size`` bounds them).
And what a reader waits for, per file: its open (the name's lookup and the open itself: the
wait before its first byte) and its reads, in milliseconds, beside the same on the remote read
directly (the ``read_files`` paths open and read in one call: no split).

Each path is measured with READERS reader processes (open, read whole, close, as DataLoader
workers do) over FILES files of SIZE bytes, the page cache dropped before each pass unless
the path says otherwise:

* ``fill``: a file the cache keeps, read for the first time (fetched whole, stored, handed
  over);
* ``cached``: the same files again, from the cache disk;
* ``warm``: again, with the page cache kept (a node whose memory holds the dataset);
* ``client``: the cached files read with ``cachefs_client.read_files`` in batches of 64
  (the fast path: a descriptor of each local file over the control socket, no FUSE);
* ``not kept``: a file outside the fraction (``--fraction 0``), read through;
* ``prefetched``: the same, each reader hinting its share of the files (``HINT`` lines on the
  control socket, as the client's sampler does) before reading them: what the daemon costs
  per hinted file, from the hint to the read;
* ``client not kept``: files outside the fraction read with ``read_files`` (where the kernel
  reads the remote, the daemon hands over the remote's own file on the control socket);

beside the same readers on the local copy (``local``) and on the remote directly
(``remote``).  Variants (``--variants``) are measured in alternation, ``--repeats`` times, and
reported as ranges (this machine is shared and noisy):

* ``auto``: ``--passthrough auto``: the kernel reads local files, and the remote's own file
  for a miss (copying a kept one into the cache itself);
* ``local``: ``--passthrough local``: the kernel reads local files; the daemon reads the
  remote (every remote byte through Python, bounded by ``--remote-timeout``);
* ``off``: ``--passthrough off`` (the daemon serves every read);
* ``processes``: ``auto`` with ``--fill-processes 2`` (the kept files copied into the cache
  by two processes of their own; their CPU is counted as the daemon's);

and with ``--baseline TREE`` each variant also as another checkout's cachefs serves it
(``auto@baseline``), in turns with this one's, so a change is measured before and after in
one run.

``--no-idle`` keeps every CPU from going idle while it measures (:class:`NoIdleCPUs`): on a
virtual machine the daemon's CPU per file then shows its own work apart from the cost of
waking CPUs that halted.

Usage::

    python3 -m bench.datapath [--files 3000] [--size 65536] [--readers 8] [--repeats 3]
        [--variants auto,off] [--profile local] [--baseline TREE] [--no-idle]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from bench.driver import drop_page_cache
from bench.emulator.remote import EmulatedRemote, process_tree_cpu_seconds, process_tree_rss_bytes
from bench.mounts import REPO, CachefsMount, ScratchDisk
from bench.readerpool import ReaderPool
from bench.settings import ArgumentParser, size_arg
from cachefs.prefetch.prefetcher import RECENT_OPEN_SECONDS

PATHS = ("fill", "cached", "warm", "client", "not kept", "prefetched", "client not kept")
# The paths of a pass over files the cache keeps (fraction 1) and over files it does not.
KEPT_PATHS = ("fill", "cached", "warm", "client")
NOT_KEPT_PATHS = ("not kept", "prefetched", "client not kept")
CLIENT_BATCH = 64
VARIANTS = {name: ("--passthrough", name) for name in ("auto", "local", "off")}
# The kept files' copies made by processes of their own, not threads of the daemon.
VARIANTS["processes"] = ("--passthrough", "auto", "--fill-processes", "2")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, its threads and the processes it
    started (fill processes) included."""
    return process_tree_cpu_seconds(pid)


class Share(NamedTuple):
    """What one reader did in a pass: bytes read, and seconds in opens and in reads (None
    where the two are one call)."""

    read: int
    opening: float | None = None
    reading: float | None = None


def _read_files(paths: list[str]) -> Share:
    total, opening, reading = 0, 0.0, 0.0
    for path in paths:
        started = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            opened = time.perf_counter()
            while chunk := f.read(1 << 20):
                total += len(chunk)
            reading += time.perf_counter() - opened
        opening += opened - started
    return Share(total, opening, reading)


def _read_files_hinted(paths: list[str]) -> Share:
    from cachefs_client import send_hints

    send_hints(paths)
    return _read_files(paths)


def _read_files_client(paths: list[str]) -> Share:
    from cachefs_client import read_files

    total = 0
    for first in range(0, len(paths), CLIENT_BATCH):
        total += sum(len(data) for data in read_files(paths[first:first + CLIENT_BATCH]))
    return Share(total)


READERS = {"client": _read_files_client, "client not kept": _read_files_client,
           "prefetched": _read_files_hinted}


class Readers:
    """READERS processes, started once, each reading its share of a pass."""

    def __init__(self, count: int) -> None:
        self.count = count
        # The client is imported here, before the readers fork, not by each reader in its
        # first pass (it imports torch: seconds of CPU).
        import cachefs_client  # noqa: F401

        self._pool = ReaderPool(count)

    def read_pass(self, root: Path, names: list[str], *, seed: int, drop: bool = True,
                  path: str = "") -> tuple[float, Share]:
        """Read every file once, shuffled, as ``path`` says; the seconds it took, and what
        the readers did together."""
        order = [str(root / name) for name in names]
        random.Random(seed).shuffle(order)
        shares = [order[i::self.count] for i in range(self.count)]
        if drop:
            drop_page_cache()
        started = time.perf_counter()
        done = self._pool.map(READERS.get(path, _read_files), shares)
        seconds = time.perf_counter() - started
        split = all(share.opening is not None for share in done)
        return seconds, Share(sum(share.read for share in done),
                              sum(share.opening for share in done) if split else None,
                              sum(share.reading for share in done) if split else None)

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> Readers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def make_files(root: Path, count: int, size: int) -> list[str]:
    names = []
    for i in range(count):
        name = f"d{i % 32:02d}/f{i:06d}.bin"
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            for offset in range(0, size, 64 << 20):  # a large file in pieces
                f.write(os.urandom(min(64 << 20, size - offset)))
        names.append(name)
    return names


class Measurement:
    """(files/s, daemon CPU us per file, daemon memory kept per file in bytes, remote CPU us
    per file, a reader's ms per open and per file's reads) samples by (variant, path)."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, str], list[tuple[float | None, ...]]] = \
            defaultdict(list)

    def add(self, variant: str, path: str, files: int, seconds: float,
            daemon_cpu: float | None, remote_cpu: float | None,
            daemon_rss_growth: int | None = None, waits: Share | None = None) -> None:
        def per_file(total: float | None, unit: float) -> float | None:
            return None if total is None else total / files * unit

        kept = None if daemon_rss_growth is None else daemon_rss_growth / files
        opening, reading = (waits.opening, waits.reading) if waits else (None, None)
        self.samples[(variant, path)].append(
            (files / seconds, per_file(daemon_cpu, 1e6), kept, per_file(remote_cpu, 1e6),
             per_file(opening, 1e3), per_file(reading, 1e3)))

    def table(self) -> str:
        def span(values: list[float | None], fmt: str) -> str:
            values = [v for v in values if v is not None]
            if not values:
                return "-"
            low, high = min(values), max(values)
            return format(low, fmt) if f"{low:{fmt}}" == f"{high:{fmt}}" \
                else f"{low:{fmt}} - {high:{fmt}}"

        lines = ["| variant | path | files/s | daemon CPU per file (us) | daemon memory kept "
                 "per file (B) | remote CPU per file (us) | a reader's open (ms) | its reads "
                 "of a file (ms) |", "|---|---|---|---|---|---|---|---|"]
        for (variant, path), rows in self.samples.items():
            rate, daemon, kept, remote, opening, reading = zip(*rows, strict=True)
            lines.append(f"| {variant} | {path} | {span(list(rate), ',.0f')} | "
                         f"{span(list(daemon), ',.0f')} | {span(list(kept), ',.0f')} | "
                         f"{span(list(remote), ',.0f')} | {span(list(opening), '.2f')} | "
                         f"{span(list(reading), '.2f')} |")
        return "\n".join(lines)


def _measure_pass(m: Measurement, readers: Readers, variant: str, path: str, root: Path,
                  names: list[str], *, daemon_pid: int | None, remote_pid: int | None,
                  seed: int, drop: bool = True, expect_bytes: int,
                  settle: Callable[[], None] | None = None) -> None:
    """One pass: files/s as the readers saw it; the CPU of the daemon (and the remote) until
    the pass's fills are done too (``settle``: a kept file handed to the kernel is copied
    into the cache beside its reader, and may finish after it); and the daemon's resident
    memory after the pass less before it."""
    rss_before = process_tree_rss_bytes(daemon_pid) if daemon_pid else None
    before = [cpu_seconds(pid) if pid else None for pid in (daemon_pid, remote_pid)]
    seconds, done = readers.read_pass(root, names, seed=seed, drop=drop, path=path)
    if settle is not None:
        settle()
    after = [cpu_seconds(pid) if pid else None for pid in (daemon_pid, remote_pid)]
    rss_growth = process_tree_rss_bytes(daemon_pid) - rss_before if daemon_pid else None
    if done.read != expect_bytes:
        raise RuntimeError(f"{variant}/{path} read {done.read} bytes, expected {expect_bytes}")
    used = [None if b is None else a - b for a, b in zip(after, before, strict=True)]
    m.add(variant, path, len(names), seconds, *used, daemon_rss_growth=rss_growth, waits=done)


def run(args: argparse.Namespace, work_root: Path | None = None) -> Measurement:
    """Measure every path of every variant, ``args.repeats`` rounds, in a directory of its own
    under ``work_root`` (the system's temporary directory by default)."""
    m = Measurement()
    work = Path(tempfile.mkdtemp(prefix="cachefs-datapath-", dir=work_root))
    readers = Readers(args.readers)
    remote = None
    disk = ScratchDisk(work, 2 * (4 * args.files * args.size + (256 << 20))) \
        if args.cache_disk == "ext4" else None
    try:
        caches = disk.__enter__() if disk is not None else work
        source = work / "source"
        names = make_files(source, args.files, args.size)
        total = args.files * args.size
        if args.profile == "tree":  # the tree itself: a remote as fast as the local disk
            remote_path, remote_pid = source, None
        else:
            (work / "remote").mkdir()
            remote = EmulatedRemote(source, work / "remote", profile=args.profile).start()
            remote_path, remote_pid = remote.path, remote._proc.pid if remote._proc else None
        for repeat in range(args.repeats):
            seed = repeat
            _measure_pass(m, readers, "-", "local", source, names, daemon_pid=None,
                          remote_pid=None, seed=seed, expect_bytes=total)
            if remote is not None:
                _measure_pass(m, readers, "-", "remote", remote_path, names, daemon_pid=None,
                              remote_pid=remote_pid, seed=seed, expect_bytes=total)
            trees = [("", REPO)] + ([("@baseline", args.baseline)] if args.baseline else [])
            if repeat % 2:  # each checkout first in every other round: no order favours one
                trees.reverse()
            for variant, (suffix, tree) in itertools.product(args.variants, trees):
                label = variant + suffix
                for fraction, paths in ((1.0, KEPT_PATHS), (0.0, NOT_KEPT_PATHS)):
                    paths = [path for path in paths if path in args.paths]
                    if not paths:
                        continue
                    cache = caches / f"cache-{label}-{repeat}-{fraction:g}"
                    # Readers of their own per mount: a fast-path client's connection is to
                    # one daemon.
                    with CachefsMount(remote_path, work / "mnt", cache,
                                      cache_size_bytes=4 * total + (256 << 20),
                                      fraction=fraction, log_file=work / f"{label}.log",
                                      extra_args=VARIANTS[variant], tree=tree) as mount, \
                            Readers(args.readers) as mount_readers:
                        for path in paths:
                            if path == "prefetched":
                                # The pass before opened these files: hinted within
                                # RECENT_OPEN_SECONDS, they would be staged without a
                                # read-in (their pages taken for cached), which the page
                                # cache dropped since is not.  An epoch's files are older.
                                time.sleep(RECENT_OPEN_SECONDS)
                            _measure_pass(m, mount_readers, label, path, mount.path, names,
                                          daemon_pid=mount.pid, remote_pid=remote_pid,
                                          seed=seed, drop=path != "warm", expect_bytes=total,
                                          settle=mount.settle)
                    shutil.rmtree(cache, ignore_errors=True)
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    finally:
        readers.close()
        if remote is not None:
            remote.stop()
        if disk is not None:
            disk.close()
        shutil.rmtree(work, ignore_errors=True)
    return m


class NoIdleCPUs:
    """A busy loop per CPU at the lowest priority there is (SCHED_IDLE): it runs only when
    nothing else would, so no CPU halts.  On a virtual machine a halted CPU is woken by an
    interrupt through the hypervisor, and each wake-up of a thread on one (a reader blocked in
    open() woken by the daemon's reply, a turn at the interpreter lock handed to a thread
    that slept) costs the waker system time: on the 2-core VM this was written on, a fill
    cost the daemon 674 - 744 us of CPU with the CPUs idling and 270 - 352 us without
    (5,000 files, the local tree as the remote, 2 rounds in turns), and its voluntary
    context switches per fill from 28 to 3 - 4 (passes of 8,000 files).  What waits on the
    disk may go slower meanwhile (cached reads with the page cache dropped: 2,945 - 4,644
    files/s against 3,386 - 6,036): the busy CPUs share the host with the hypervisor's I/O."""

    def __enter__(self) -> NoIdleCPUs:
        self._loops = [multiprocessing.Process(target=_busy_loop, daemon=True)
                       for _ in range(os.cpu_count() or 1)]
        for loop in self._loops:
            loop.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for loop in self._loops:
            loop.kill()
        for loop in self._loops:
            loop.join(5)


def _busy_loop() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    parent = os.getppid()
    while os.getppid() == parent:  # ends with the benchmark, even one killed with SIGKILL
        for _ in range(1_000_000):
            pass


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python3 -m bench.datapath", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--size", type=size_arg, default=65536,
                        help="bytes per file: 65536, 64KiB, 2G (default 64 KiB)")
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", default="local",
                        help="the emulated remote's latency profile (default: local, none), "
                        "or 'tree': the local tree itself as the remote, no emulator")
    parser.add_argument("--variants", default="auto,local,off",
                        type=lambda text: [v for v in text.split(",") if v])
    parser.add_argument("--paths", default=",".join(PATHS),
                        type=lambda text: [p for p in text.split(",") if p],
                        help=f"the paths to measure (default: all of {', '.join(PATHS)})")
    parser.add_argument("--cache-disk", choices=("ext4", "root"), default="ext4",
                        help="where the caches live: a fresh journaled ext4 of their own, as a "
                        "node's NVMe cache disk (default), or the root file system")
    parser.add_argument("--baseline", type=lambda text: Path(text).resolve(),
                        help="another checkout (git worktree add DIR COMMIT) measured in turns "
                        "with this one")
    parser.add_argument("--no-idle", action="store_true",
                        help="keep every CPU from going idle while measuring (a busy loop per "
                        "CPU at SCHED_IDLE): the daemon's own costs, apart from the cost of "
                        "waking halted CPUs on a virtual machine")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked: a bad one ends the program with a line saying which."""
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}: use some of {', '.join(VARIANTS)}")
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown or not args.paths:
        parser.error(f"unknown path {unknown[0]!r}: use some of {', '.join(PATHS)}" if unknown
                     else "--paths names none")
    if args.baseline is not None and not (args.baseline / "cachefs" / "__main__.py").exists():
        parser.error(f"--baseline {args.baseline} is not a cachefs checkout")
    if args.files < 1 or args.size < 1 or args.readers < 1 or args.repeats < 1:
        parser.error("--files, --size, --readers and --repeats must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with NoIdleCPUs() if args.no_idle else contextlib.nullcontext():
            measured = run(args)
    except (OSError, RuntimeError) as exc:
        print(f"datapath: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    print(measured.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
