"""What the client spends to map a file path to its daemon, per path, by the way it is named.

The client maps every path it hints or reads (cachefs_client/_paths.py): the first path of
a directory pays for resolving it (an lstat per component, realpath) and for finding its
mount in /proc/self/mountinfo; every later path of that directory is a dict lookup and a
string concatenation.  This measures both, in microseconds per path, on a real cachefs
mount reached by each of the ways a training job names its files, beside what
``os.path.abspath`` alone costs (all the client did per path before it resolved anything)::

    python3 -m bench.clientpaths [--dirs 100] [--files-per-dir 200] [--rounds 5]

Run as root (it mounts).  Each figure is the median of the rounds, with their range; a
fresh map per round, so every round pays the first path of each directory again.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.run import measure_this_tree

CACHE_SIZE_BYTES = 64 << 20


def _ways(work: Path, mount: Path) -> dict[str, tuple[Path, Path | None]]:
    """Way name -> (the directory the dataset's class directories are named under, the
    working directory for relative names, or None for absolute ones)."""
    (work / "data").symlink_to(work / "node")          # /data -> the disk holding the mount
    (work / "dataset").symlink_to(mount)               # a symlink to the mount point
    return {
        "mount point's own path": (mount, None),
        "symlinked parent directory": (work / "data" / mount.name, None),
        "symlinked mount point": (work / "dataset", None),
        "the mount bound elsewhere": (work / "bound", None),
        "relative, cwd inside the mount": (Path("."), mount),
        "on no cachefs mount": (work / "source", None),
    }


def _time_paths(locate: Callable, paths: list[str]) -> float:
    started = time.perf_counter_ns()
    for path in paths:
        locate(path)
    return (time.perf_counter_ns() - started) / 1000 / max(1, len(paths))


def measure_way(base: Path, cwd: Path | None, dirs: list[str], files_per_dir: int,
                rounds: int) -> dict[str, list[float]]:
    """Per round: us per first path of a directory, per later path, and per path for
    os.path.abspath alone over the same names (what the client spent before)."""
    from cachefs_client._paths import PathMap

    figures: dict[str, list[float]] = {"first": [], "later": [], "abspath": []}
    previous = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        names = {d: [str(base / d / f"img{i:06d}.jpg") for i in range(files_per_dir)]
                 for d in dirs}
        later = [p for d in dirs for p in names[d][1:]]
        for _ in range(rounds):
            paths = PathMap()
            paths.locate(str(base / "warm-up" / "x"))  # the mount table, read once per map
            figures["first"].append(_time_paths(paths.locate, [names[d][0] for d in dirs]))
            figures["later"].append(_time_paths(paths.locate, later))
            figures["abspath"].append(_time_paths(os.path.abspath, later))
    finally:
        os.chdir(previous)
    return figures


def _figure(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f} to {max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.clientpaths",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--dirs", type=int, default=100)
    parser.add_argument("--files-per-dir", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.exit(1, f"{parser.prog}: mounts cachefs: run it as root\n")
    source = measure_this_tree()
    from bench.mounts import CachefsMount

    work = Path(tempfile.mkdtemp(prefix="cachefs-clientpaths-"))
    dirs = [f"class{i:04d}" for i in range(args.dirs)]
    for d in dirs:
        (work / "source" / d).mkdir(parents=True)
    rows: list[tuple[str, ...]] = []
    bound = work / "bound"
    bound.mkdir()
    try:
        with CachefsMount(work / "source", work / "node" / "mnt", work / "cache",
                          cache_size_bytes=CACHE_SIZE_BYTES, fraction=1.0,
                          log_file=work / "cachefs.log") as mount:
            subprocess.run(["mount", "--bind", str(mount.path), str(bound)], check=True)
            try:
                for name, (base, cwd) in _ways(work, mount.path).items():
                    f = measure_way(base, cwd, dirs, args.files_per_dir, args.rounds)
                    added = [a - b for a, b in zip(f["later"], f["abspath"], strict=True)]
                    rows.append((name, _figure(f["first"]), _figure(f["later"]),
                                 _figure(f["abspath"]), _figure(added)))
            finally:
                subprocess.run(["umount", "-l", str(bound)], check=False)
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    print(f"client CPU per path, us: {args.dirs} directories x {args.files_per_dir} paths, "
          f"median of {args.rounds} rounds (range); cachefs_client of {source['tree']} at "
          f"{source['commit']}")
    print(f"{'way to the files':<31} {'first in its directory':>22} {'later':>22} "
          f"{'abspath alone':>22} {'later, added':>22}")
    for row in rows:
        print(f"{row[0]:<31} " + " ".join(f"{cell:>22}" for cell in row[1:]))
    print("first: a directory's first path (realpath, the mount table); later: every other "
          "path of it;\nabspath alone: what the client spent per path before it mapped "
          "paths; added: later - abspath alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
