"""mfusepy against fusepy: warm-cache files/s of the same daemon under each binding.

cachefs uses mfusepy, the maintained fork of fusepy with the same API.  This runs the
daemon unchanged under each binding (fusepy stands in for mfusepy by module aliasing),
fills the cache, then reads every file through the mount with a few threads, the
bindings taking turns so that drift in the machine's load hits both alike.

    python3 -m bench.binding [--files 3000] [--rounds 3] [--threads 4]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cachefs.mountpoint import find_mount, unmount

REPO = Path(__file__).resolve().parent.parent
# The daemon, with the named binding importable as mfusepy.
DAEMON = """
import importlib, sys
sys.modules["mfusepy"] = importlib.import_module(sys.argv.pop(1))
from cachefs.cli import main
sys.exit(main(sys.argv[1:]))
"""


def mount(module: str, source: Path, mountpoint: Path, cache: Path, log: Path
          ) -> subprocess.Popen:
    """The daemon in the foreground (a background mount would re-exec without the alias)."""
    daemon = subprocess.Popen(
        [sys.executable, "-c", DAEMON, module, "mount", str(source), str(mountpoint),
         "--cache-dir", str(cache), "--cache-size", "2G", "--metrics-addr", "0",
         "--foreground", "--log-file", str(log)], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while find_mount(mountpoint) is None:
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            raise SystemExit(f"bench.binding: mounting with {module} failed; see {log}")
        time.sleep(0.1)
    return daemon


def read_all(root: Path, names: list[str], threads: int, seed: int) -> float:
    order = list(names)
    random.Random(seed).shuffle(order)

    def read(name: str) -> int:
        with open(root / name, "rb") as f:
            return len(f.read())

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        sum(pool.map(read, order))
    return len(order) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.binding", description=__doc__)
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args(argv)
    if args.files < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("--files, --rounds and --threads must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="cachefs-binding-"))
    bindings = {"mfusepy": "mfusepy", "fusepy": "fuse"}  # name -> module
    mounts = {b: work / f"mnt-{b}" for b in bindings}
    daemons: list[subprocess.Popen] = []
    try:
        source = work / "source"
        source.mkdir()
        names = [f"f{i:05d}" for i in range(args.files)]
        for name in names:
            (source / name).write_bytes(os.urandom(65536))
        for binding, mountpoint in mounts.items():
            mountpoint.mkdir()
            daemons.append(mount(bindings[binding], source, mountpoint,
                                 work / f"cache-{binding}", work / f"{binding}.log"))
            read_all(mountpoint, names, args.threads, seed=0)  # fills the cache
        rates: dict[str, list[float]] = {b: [] for b in bindings}
        for round_number in range(args.rounds):
            for binding in bindings:
                rates[binding].append(read_all(mounts[binding], names, args.threads,
                                               seed=round_number + 1))
        print(f"warm-cache reads of {args.files} files of 64 KiB, {args.threads} threads, "
              f"{args.rounds} rounds (median files/s):")
        for binding in bindings:
            print(f"  {binding:<8} {statistics.median(rates[binding]):8.0f}   "
                  f"rounds: {', '.join(f'{r:.0f}' for r in rates[binding])}")
        ratio = statistics.median(rates["mfusepy"]) / statistics.median(rates["fusepy"])
        print(f"  mfusepy / fusepy = {ratio:.2f}")
        return 0
    finally:
        for mountpoint in mounts.values():
            if find_mount(mountpoint) is not None:
                unmount(str(mountpoint), lazy=True)
        for daemon in daemons:
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
