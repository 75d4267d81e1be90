"""bench.scale: what cachefs costs as the dataset grows: memory, start time, warm-up,
listings and reads, per file, with N files.

    python3 -m bench.scale              # 1,000,000 files of 4 KiB: about 50 minutes on 2 cores
    python3 -m bench.scale 100000       # a tenth: some 10 minutes
    python3 -m bench.scale --help

N files of SIZE bytes in directories of 1,000, f = 1, cachefs mounted directly over the tree
(no emulated remote: the daemon's own costs show), pages, dentries and inodes dropped before
each pass (only the pages where said: what a node keeps between epochs),
READERS reader processes (open, read whole, close, as DataLoader workers do), the cache on a
fresh journaled ext4 of its own (as a node's NVMe cache disk is).  One run measures, beside
the same on the tree directly:

* on an empty cache: the daemon's RSS; ``find`` and ``ls -lR`` of the whole mount (dentries
  dropped, then again) and the daemon's RSS after each; ``cachefs mount``, ``status`` and
  ``unmount``;
* ``cachefs warm`` of every file (a list of every path): files/s, the daemon's CPU per file,
  the client's peak RSS; the daemon's RSS after it, and after a read pass;
* steady read passes (files/s, daemon CPU per file), at the default bounds, with
  ``--held-files`` covering every file, with ``--attr-cache-entries`` as well, each also with
  only the pages dropped; the same at 10,000 files, and 10,000 files read again right before
  each of those passes and after the last, which each is judged against, allowing the
  slowdown the tree itself shows read directly (N files against 10,000, read in turns);
* ``cachefs mount`` with the cache full, after a clean unmount and after kill -9, and the
  first read pass after each;
* the cache directory's size for the data it holds,

and the per-file costs and the verdicts on the targets (bench/scale_report.py).  The trees
are made once under the work directory (named by N and SIZE) and reused.  Results go to
bench/results/scale/ (latest.md, latest.json); every mount is unmounted on the way out,
Ctrl-C and SIGTERM included, and what a killed run left is cleared by the next one.
"""

from __future__ import annotations

import argparse
import array
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import machine, scale_report
from bench.counters import gc_seconds
from bench.datapath import cpu_seconds
from bench.driver import drop_page_cache
from bench.emulator import slowfs
from bench.emulator.remote import process_rss_bytes, process_tree_cpu_split
from bench.mounts import REPO, CachefsMount, ScratchDisk, _cli_env
from bench.peakrss import run_with_peak_rss
from bench.readerpool import ReaderPool
from bench.run import measure_this_tree, measured
from bench.settings import ArgumentParser, size_arg
from cachefs.service.process import alive

DEFAULT_FILES = 1_000_000
DEFAULT_SIZE = 4096
SMALL_FILES = 10_000
# --revalidate of the small tree's mount read beside the big tree's passes (Baseline).  A pass
# of the big tree outlasts the default interval (a million files at some thousands a second),
# so every one of its opens asks the remote again; the small tree's passes, within the
# interval, ask nothing.  Its passes on this mount, each begun once the interval has passed,
# revalidate every file too: the per-file cost at two sizes compared with the same work per
# file.
REVALIDATE_SMALL_SECONDS = 2.0
# --revalidate of both trees' mounts for the passes within it (steady_within, Baseline with
# ``within``): longer than the big tree's passes last, so that neither tree's passes ask the
# remote anything, and what is left to compare is what grows with the number of files.  The
# passes above compare the same check of every file, but not the same work: the small tree's
# directories are listed in one go each (every name listed is used within the interval),
# the big tree's files each looked up on their own (a listing's names mostly fall due
# before the pass reaches them, so listing does not pay: AttrCache), on a local remote a
# cold inode read each.
WITHIN_REVALIDATE_SECONDS = 3600.0
FILES_PER_DIRECTORY = 1000
# Passes of the small tree read directly in each turn beside a pass of the big tree read
# directly (read_tree_in_turns): one of 10,000 files lasts a third of a second.
SMALL_PASSES_A_TURN = 5
# Where a run mounts: the big tree, the small tree's baseline, the small tree within
# --revalidate (under the run's directory); each is unmounted by a run that ends, or by the
# next run when one was killed.
MOUNT_NAMES = ("mnt", "mnt-small", "mnt-small-within")
READERS = 8
WRITE_CHUNK = 1 << 20
# Seconds for `cachefs mount` to return with the cache full (today ~60 us per cached file).
MOUNT_TIMEOUT_S = 600.0
WARM_TIMEOUT_S = 4 * 3600.0
LISTING_TIMEOUT_S = 3600.0
OUT_DIR = REPO / "bench" / "results" / "scale"
WORK_DIR = REPO / "bench" / "work"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the trees ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tree:
    """N files of SIZE bytes under ``root``, and a list of their paths relative to it."""

    root: Path
    listing: Path
    files: int
    size: int

    @property
    def data_bytes(self) -> int:
        return self.files * self.size

    @property
    def names_with_attributes(self) -> int:
        """Every name the daemon may remember attributes of: the files, their directories
        and the root."""
        return self.files + -(-self.files // FILES_PER_DIRECTORY) + 1

    def names(self) -> list[str]:
        with open(self.listing) as f:
            return f.read().split()


def tree_name(files: int, size: int) -> str:
    return f"tree-{files}x{size}"


def ensure_tree(work: Path, files: int, size: int, log: Callable[[str], None]) -> Tree:
    """The tree of ``files`` files of ``size`` bytes under ``work``: made once (into a
    directory renamed into place when complete) and found again by its name after."""
    name = tree_name(files, size)
    tree = Tree(work / name, work / f"{name}.paths", files, size)
    if tree.root.is_dir() and tree.listing.exists():
        return tree
    log(f"making {files:,} files of {size:,} bytes in {work} (once)")
    partial = work / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    started = time.monotonic()
    digits = max(4, len(str((files - 1) // FILES_PER_DIRECTORY)))
    block = random.Random(files * 1_000_003 + size).randbytes(size)
    with open(f"{tree.listing}.partial", "w") as listing:
        for i in range(files):
            directory = f"d{i // FILES_PER_DIRECTORY:0{digits}d}"
            if i % FILES_PER_DIRECTORY == 0:
                os.mkdir(partial / directory)
            rel = f"{directory}/f{i:08d}"
            # Each file its own bytes (its number first), the rest shared: quick to write.
            data = (b"%016d" % i + block[16:])[:size] if size > 16 else block
            fd = os.open(partial / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for offset in range(0, size, WRITE_CHUNK):
                    os.write(fd, data[offset:offset + WRITE_CHUNK])
            finally:
                os.close(fd)
            listing.write(rel + "\n")
    os.rename(f"{tree.listing}.partial", tree.listing)
    shutil.rmtree(tree.root, ignore_errors=True)
    os.rename(partial, tree.root)
    log(f"  made in {time.monotonic() - started:.0f} s")
    return tree


# -- readers --------------------------------------------------------------------------------

# The names of each pool's tree, by the pool's number: set before its processes fork, so
# that each has them (the big tree's and the small tree's pools read side by side).
_NAMES: dict[int, list[str]] = {}
_POOL_NUMBERS = itertools.count()


def _read_share(job: tuple[int, str, bytes]) -> int:
    pool, root, packed = job
    names = _NAMES[pool]
    indices = array.array("I")
    indices.frombytes(packed)
    total = 0
    for index in indices:
        with open(f"{root}/{names[index]}", "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
    return total


class Readers:
    """READERS processes, forked once the names are known, each reading its share of a pass
    (the shares go to them as packed indices, not paths)."""

    def __init__(self, names: list[str], count: int) -> None:
        self.number = next(_POOL_NUMBERS)
        _NAMES[self.number] = names
        self.names = names
        self.count = count
        self._pool = ReaderPool(count)

    def read_pass(self, root: Path, *, seed: int, expect_bytes: int,
                  pages_only: bool = False) -> float:
        """Every file once, in a shuffled order, the pages, dentries and inodes dropped first
        (only the pages with ``pages_only``): seconds."""
        order = list(range(len(self.names)))
        random.Random(seed).shuffle(order)
        jobs = [(self.number, str(root), array.array("I", order[i::self.count]).tobytes())
                for i in range(self.count)]
        drop_page_cache(names_too=not pages_only)
        started = time.perf_counter()
        read = sum(self._pool.map(_read_share, jobs))
        seconds = time.perf_counter() - started
        if read != expect_bytes:
            raise RuntimeError(f"a pass through {root} read {read} bytes, not {expect_bytes}")
        return seconds

    def close(self) -> None:
        self._pool.close()
        _NAMES.pop(self.number, None)


# -- what is measured -----------------------------------------------------------------------

def rss_bytes(pid: int) -> int:
    rss = process_rss_bytes(pid)
    if rss is None:
        raise RuntimeError(f"no VmRSS for {pid}")
    return rss


def allocated_bytes(path: Path) -> int:
    """Bytes under ``path`` as du counts them."""
    total = 0
    for directory, dirs, files in os.walk(path):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total + os.lstat(path).st_blocks * 512


def timed(command: list[str], timeout: float, env: dict | None = None,
          cwd: Path = REPO) -> float:
    """Seconds ``command`` took, its output thrown away; RuntimeError when it failed."""
    started = time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            timeout=timeout, env=env, cwd=cwd)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} failed: "
                           f"{result.stderr.decode(errors='replace').strip()[-300:]}")
    return seconds


def walks(root: Path, after: Callable[[str], None] = lambda name: None) -> dict:
    """``find`` and ``ls -lR`` of ``root``, each with dentries and inodes dropped first and
    then again: seconds.  ``after(name)`` is called after each."""
    out = {}
    for name, command in (("find", ["find", str(root)]), ("ls", ["ls", "-lR", str(root)])):
        drop_page_cache()
        first = timed(command, LISTING_TIMEOUT_S)
        out[name] = {"first": first, "again": timed(command, LISTING_TIMEOUT_S)}
        after(name)
    return out


def cachefs_cli(mount: CachefsMount, *args: str, timeout: float = 120.0) -> float:
    """Seconds a cachefs command of the mount's checkout took."""
    return timed([sys.executable, "-m", "cachefs", *args], timeout, env=_cli_env(mount.tree),
                 cwd=mount.tree)


def status_request_seconds(mount: CachefsMount) -> float:
    """STATUS on the control socket alone, without the CLI's start (Python's imports)."""
    target = os.readlink(mount.path / ".cachefs.sock")
    started = time.perf_counter()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(target)
        sock.sendall(b"STATUS\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    seconds = time.perf_counter() - started
    if not json.loads(reply).get("ok"):
        raise RuntimeError("STATUS failed")
    return seconds


def warm(mount: CachefsMount, tree: Tree, out_dir: Path) -> dict:
    """``cachefs warm`` of every file, its list a file: rate, the daemon's CPU per file, the
    client's own peak RSS."""
    drop_page_cache()
    cpu_before = cpu_seconds(mount.pid)
    stdout_path, stderr_path = out_dir / "warm.out", out_dir / "warm.err"
    started = time.perf_counter()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        status, peak = run_with_peak_rss(
            [sys.executable, "-m", "cachefs", "warm", str(mount.path), "--list",
             str(tree.listing), *mount_warm_flags(mount)], stdout=out, stderr=err,
            env=_cli_env(mount.tree), cwd=mount.tree)
    seconds = time.perf_counter() - started
    daemon_cpu = cpu_seconds(mount.pid) - cpu_before
    summary = stdout_path.read_text().strip()
    if status != 0 or f": {tree.files:,} fetched" not in summary:
        raise RuntimeError(f"cachefs warm did not fetch every file: {summary} "
                           f"{stderr_path.read_text()[-300:]}")
    return {"seconds": seconds, "files_per_second": tree.files / seconds,
            "daemon_cpu_us_per_file": daemon_cpu / tree.files * 1e6,
            "client_peak_rss_bytes": peak, "summary": summary}


def mount_warm_flags(mount: CachefsMount) -> list[str]:
    """--restart, where the checkout's warm has it (one from before it kept checkpoints has
    nothing to restart from)."""
    return ["--restart"] if (mount.tree / "cachefs" / "control" / "checkpoint.py").exists() \
        else []


def read_pass(readers: Readers, root: Path, tree: Tree, seed: int,
              mount: CachefsMount | None = None, *, pages_only: bool = False) -> dict:
    """One pass over every file; through ``mount``, with the daemon's CPU per file and the
    parts of it the kernel and its garbage collector took.  ``pages_only``: the dentries and
    inodes of the pass before are kept (Readers.read_pass)."""
    if mount:
        (cpu_before, system_before), gc_before = (process_tree_cpu_split(mount.pid),
                                                  gc_seconds(mount.metrics_text()))
    seconds = readers.read_pass(root, seed=seed, expect_bytes=tree.data_bytes,
                                pages_only=pages_only)
    out = {"files_per_second": tree.files / seconds}
    if mount:
        cpu_after, system_after = process_tree_cpu_split(mount.pid)
        out["daemon_cpu_us_per_file"] = (cpu_after - cpu_before) / tree.files * 1e6
        out["daemon_system_us_per_file"] = (system_after - system_before) / tree.files * 1e6
        gc_after = gc_seconds(mount.metrics_text())
        if gc_before is not None and gc_after is not None:
            out["gc_us_per_file"] = (gc_after - gc_before) / tree.files * 1e6
    return out


@dataclass
class Run:
    """What one run needs: its settings, its work directory, the mounts' common options."""

    args: argparse.Namespace
    run_dir: Path
    caches: Path
    log: Callable[[str], None]

    def mount(self, tree: Tree, cache: str, name: str = "mnt",
              extra_args: tuple[str, ...] = ()) -> CachefsMount:
        budget = cache_budget(tree)
        return CachefsMount(tree.root, self.run_dir / name, self.caches / cache,
                            cache_size_bytes=budget, fraction=1.0,
                            log_file=self.run_dir / f"{cache}.log", extra_args=extra_args,
                            tree=self.args.tree, mount_timeout_s=MOUNT_TIMEOUT_S)


def cache_budget(tree: Tree) -> int:
    """Room for every file (a whole block each), the index and the cache's directories."""
    per_file = -(-tree.size // 4096) * 4096 + 512
    return tree.files * per_file + (512 << 20)


class Baseline:
    """The small tree read beside the big tree's steady passes: one pass of it right before
    each of theirs and one after the last, with the same caches dropped, each of its files
    revalidated as each of a pass of the big tree is (a pass of a million files outlasts
    --revalidate).  Each big pass is then judged against the passes either side of it, read
    within seconds of it: a shared host's slow spell falls on both sides of a comparison,
    where the small tree's passes read apart from the big tree's (most of an hour later)
    could not tell a few per cent from the host's drift.

    Thread safety: used by one thread.
    """

    def __init__(self, run: Run, tree: Tree, within: bool = False) -> None:
        self.tree = tree
        self.passes: dict[str, list[dict]] = {}  # the big tree's key -> the small's passes
        # ``within``: no file revalidated (a cache of its own, warmed, on a mount whose
        # --revalidate outlasts the run), for the big tree's passes within theirs.
        self._within = within
        self._seeds = itertools.count(500 if within else 400)
        self._last_read = 0.0  # when the last pass of it ended (time.monotonic)
        self._readers = Readers(tree.names(), run.args.readers)
        revalidate = WITHIN_REVALIDATE_SECONDS if within else REVALIDATE_SMALL_SECONDS
        suffix = "-small-within" if within else "-small"
        self._mount = run.mount(tree, f"cache{suffix}", name=f"mnt{suffix}",
                                extra_args=("--revalidate", str(revalidate)))
        try:
            self._mount.__enter__()
            if within:
                warm(self._mount, tree, run.run_dir)
            self._read(pages_only=False)  # past the restart's checks, every file held
        except BaseException:
            self.close()
            raise

    def read(self, key: str, pages_only: bool) -> None:
        """One pass of the small tree beside the big tree's passes ``key``."""
        self.passes.setdefault(key, []).append(self._read(pages_only))

    def _read(self, pages_only: bool) -> dict:
        if not self._within:
            # Every file's attributes due: most often long since, a big tree's pass between.
            time.sleep(max(0.0, self._last_read + REVALIDATE_SMALL_SECONDS - time.monotonic()))
        try:
            return read_pass(self._readers, self._mount.path, self.tree, next(self._seeds),
                             self._mount, pages_only=pages_only)
        finally:
            self._last_read = time.monotonic()

    def close(self) -> None:
        try:
            self._mount.close()
        finally:
            self._readers.close()


def measure_big(run: Run, tree: Tree, baseline: Baseline | None = None) -> dict:
    args, log = run.args, run.log
    out: dict = {"passes": {}}
    readers = Readers(tree.names(), args.readers)
    seeds = itertools.count(101)  # a shuffled order of its own for each steady pass

    def steady(key: str, mount: CachefsMount, pages_only: bool = False,
               beside: Baseline | None = baseline) -> None:
        """--repeats steady passes as ``key``, each after one of the baseline's."""
        passes = out["passes"][key] = []
        for _ in range(args.repeats):
            if beside is not None:
                beside.read(key, pages_only)
            passes.append(read_pass(readers, mount.path, tree, next(seeds), mount,
                                    pages_only=pages_only))
        if beside is not None:
            beside.read(key, pages_only)

    try:
        log("the tree directly: read passes (in turns with the small tree's), find, ls -lR")
        out["local"] = read_tree_in_turns(run, tree, readers, baseline)
        out["local"]["walks"] = walks(tree.root)

        log("an empty cache: find, ls -lR, status, unmount")
        with run.mount(tree, "cache") as mount:
            empty = {"mount_seconds": mount.mount_seconds, "rss_bytes": rss_bytes(mount.pid)}

            def rss_after(name: str, pid: int = mount.pid) -> None:
                empty[f"rss_after_{name}_bytes"] = rss_bytes(pid)

            empty["walks"] = walks(mount.path, after=rss_after)
            empty["status_seconds"] = cachefs_cli(mount, "status", str(mount.path))
        empty["unmount_seconds"] = mount.unmount_seconds
        out["empty"] = empty

        log(f"cachefs warm of {tree.files:,} files")
        with run.mount(tree, "cache") as mount:
            out["rss_empty_bytes"] = rss_bytes(mount.pid)
            out["warm"] = warm(mount, tree, run.run_dir)
            log(f"  {out['warm']['summary']}")
            out["rss_after_warm_bytes"] = rss_bytes(mount.pid)
            log("read passes through the mount")
            out["passes"]["after_warm"] = read_pass(readers, mount.path, tree, 100, mount)
            out["rss_after_read_bytes"] = rss_bytes(mount.pid)
            steady("steady", mount)
            out["rss_after_steady_bytes"] = rss_bytes(mount.pid)
            out["status_seconds"] = cachefs_cli(mount, "status", str(mount.path))
            out["status_request_seconds"] = status_request_seconds(mount)
            steady("steady_pages_only", mount, pages_only=True)
        out["unmount_seconds"] = mount.unmount_seconds
        out["cache_dir_bytes"] = allocated_bytes(run.caches / "cache")

        log("restarts with the cache full: after a clean unmount, after kill -9")
        with run.mount(tree, "cache") as mount:
            out["mount_after_unmount_seconds"] = mount.mount_seconds
            out["rss_after_restart_bytes"] = rss_bytes(mount.pid)
            out["passes"]["after_restart"] = read_pass(readers, mount.path, tree, 200, mount)
            os.kill(mount.pid, signal.SIGKILL)  # a crash: close() clears the stale mount
        with run.mount(tree, "cache") as mount:
            out["mount_after_kill_seconds"] = mount.mount_seconds
            out["passes"]["after_kill"] = read_pass(readers, mount.path, tree, 201, mount)
            out["passes"]["steady_after_kill"] = read_pass(readers, mount.path, tree, 202,
                                                           mount)

        # The steady passes above run at the default bounds, which on this machine hold a
        # fraction of a million files (held files: a 64th of the memory; attributes:
        # 200,000 on any machine).  The same passes with the held files covering every file,
        # as their default does on a node of 128 GiB or more, then with both bounds covering
        # every file, tell what each bound costs from what grows with the files.  Each mount
        # also reads with only the pages dropped before a pass (steady_*_pages_only): between
        # epochs a node keeps the dentries and inodes of the pass before (the mount's and the
        # cache disk's) while its memory allows, where the passes above find none, the worst
        # case for an open of a file not held (its cache file's inode read from the disk).
        for variant, flags in scale_report.COVERING_VARIANTS:
            log(f"steady reads with {' and '.join(flags)} covering every file")
            with run.mount(tree, "cache", extra_args=covering_bounds(tree, flags)) as mount:
                read_pass(readers, mount.path, tree, next(seeds), mount)  # every file held
                steady(f"steady_{variant}", mount)
                out[f"rss_{variant}_bytes"] = rss_bytes(mount.pid)
                steady(f"steady_{variant}_pages_only", mount, pages_only=True)

        # The same with both bounds covering every file and no file revalidated, at both
        # sizes (WITHIN_REVALIDATE_SECONDS): what a file costs as the files grow, apart from
        # what checking each with the remote costs.
        if baseline is not None:
            log("steady reads within --revalidate at both sizes, both bounds covering")
            within = Baseline(run, baseline.tree, within=True)
            try:
                bounds = covering_bounds(tree, scale_report.COVERING_VARIANTS[-1][1])
                with run.mount(tree, "cache", extra_args=(
                        *bounds, "--revalidate", str(WITHIN_REVALIDATE_SECONDS))) as mount:
                    read_pass(readers, mount.path, tree, next(seeds), mount)  # all fetched
                    steady("steady_within", mount, beside=within)
            finally:
                within.close()
                out["baseline_within"] = within.passes.get("steady_within", [])
    finally:
        readers.close()
    return out


def read_tree_in_turns(run: Run, tree: Tree, readers: Readers,
                       baseline: Baseline | None) -> dict:
    """--repeats passes of the tree read directly and, where there is a small tree, passes of
    it read directly in turns with them (SMALL_PASSES_A_TURN before each and after the
    last): how much slower per file the kernel alone reads a tree of N files than one of
    SMALL_FILES, on this host, now.  The steady reads through cachefs are judged against
    that, not against no slowdown at all (scale_report.py): every open through the mount
    also walks the cache disk's tree of N files, and its reads the same page cache.  A
    pass of the small tree lasts a fraction of a second, hence several a turn."""
    args = run.args
    out: dict = {"passes": []}
    if baseline is None:
        out["passes"] = [read_pass(readers, tree.root, tree, seed)
                         for seed in range(args.repeats)]
        return out
    small = baseline.tree
    beside = out["small_beside"] = []
    small_readers = Readers(small.names(), args.readers)
    seeds = itertools.count(600)
    try:
        for seed in range(args.repeats + 1):
            beside += [read_pass(small_readers, small.root, small, next(seeds))
                       for _ in range(SMALL_PASSES_A_TURN)]
            if seed < args.repeats:
                out["passes"].append(read_pass(readers, tree.root, tree, seed))
    finally:
        small_readers.close()
    return out


def covering_bounds(tree: Tree, flags: tuple[str, ...]) -> tuple[str, ...]:
    """Mount arguments setting each of ``flags`` (--held-files, --attr-cache-entries) to a
    bound that covers every file of ``tree``: the held files are files, the attributes are
    of names, directories among them (a bound of the files alone leaves the directories'
    1,001 out, and an attribute cache one over its bound dropped its oldest tenth: a tenth
    of the files then looked up on the remote every pass)."""
    bounds = {"--held-files": tree.files, "--attr-cache-entries": tree.names_with_attributes}
    return tuple(arg for flag in flags for arg in (flag, str(max(bounds[flag], 1000))))


def measure_small(run: Run, tree: Tree) -> dict:
    """The same steady reads at SMALL_FILES files, within --revalidate; the cache they fill
    stays for the Baseline's passes."""
    args = run.args
    readers = Readers(tree.names(), args.readers)
    try:
        out = {"local": [read_pass(readers, tree.root, tree, seed)
                         for seed in range(args.repeats)]}
        with run.mount(tree, "cache-small", name="mnt-small") as mount:
            out["warm"] = warm(mount, tree, run.run_dir)
            out["steady"] = [read_pass(readers, mount.path, tree, 300 + r, mount)
                             for r in range(args.repeats + 1)]
    finally:
        readers.close()
    return out


def clear_leftovers(runs_dir: Path) -> None:
    """Unmount and remove what runs killed with SIGKILL left behind (their pid is gone): the
    FUSE mounts, then the cache disk."""
    if not runs_dir.exists():
        return
    for entry in runs_dir.iterdir():
        if not entry.name.isdigit() or alive(int(entry.name)):
            continue
        for name in MOUNT_NAMES:
            if slowfs.is_mounted(entry / name):
                slowfs.fusermount(entry / name, lazy=True)
        if slowfs.is_mounted(entry / "cache-disk"):
            subprocess.run(["umount", "-l", str(entry / "cache-disk")], capture_output=True)
        shutil.rmtree(entry, ignore_errors=True)


def run(args: argparse.Namespace, log: Callable[[str], None] = _log) -> dict:
    if os.geteuid() != 0:
        raise PermissionError("the benchmark mounts FUSE file systems and drops the page cache: "
                              "run it as root")
    work = args.work_dir / "scale"
    runs_dir = work / "run"
    clear_leftovers(runs_dir)
    run_dir = runs_dir / str(os.getpid())
    run_dir.mkdir(parents=True)
    started = time.time()
    source = measure_this_tree()
    if args.tree != REPO:
        source["measured_tree"] = str(args.tree)
    big = ensure_tree(work, args.files, args.size, log)
    small = ensure_tree(work, args.small, args.size, log) if args.small else None
    results: dict = {
        "settings": {"files": args.files, "size": args.size, "readers": args.readers,
                     "repeats": args.repeats, "small_files": args.small,
                     "files_per_directory": FILES_PER_DIRECTORY, "fraction": 1.0,
                     "passthrough": "auto", "cache_disk": args.cache_disk},
        "machine": machine.describe(), "source": source,
    }
    disk = None
    try:
        caches = run_dir
        if args.cache_disk == "ext4":
            need = cache_budget(big) + (2 * cache_budget(small) if small else 0)
            disk = ScratchDisk(run_dir, need + need // 2 + (1 << 30),
                               inodes=2 * (args.files + args.small) + 100_000)
            caches = disk.__enter__()
        this = Run(args, run_dir, caches, log)
        baseline = None
        if small is not None:
            log(f"steady reads at {small.files:,} files, then read beside the "
                f"{big.files:,} files' steady passes")
            results["small"] = measure_small(this, small)
            baseline = Baseline(this, small)
        try:
            results["big"] = measure_big(this, big, baseline)
        finally:
            if baseline is not None:
                baseline.close()
                results["small"]["paired"] = baseline.passes
    finally:
        if disk is not None:
            disk.close()
        if not any(slowfs.is_mounted(run_dir / n) for n in (*MOUNT_NAMES, "cache-disk")):
            shutil.rmtree(run_dir, ignore_errors=True)
    results["seconds"] = round(time.time() - started, 1)
    results["machine"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    results["verdicts"] = scale_report.verdicts(results)
    return results


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python3 -m bench.scale",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="?", type=int, default=DEFAULT_FILES,
                   help=f"files in the tree (default {DEFAULT_FILES:,})")
    p.add_argument("--size", type=size_arg, default=DEFAULT_SIZE,
                   help="bytes per file: 4096, 4KiB (default 4 KiB)")
    p.add_argument("--readers", type=int, default=READERS,
                   help=f"reader processes (default {READERS})")
    p.add_argument("--repeats", type=int, default=2,
                   help="passes of each kind repeated, for ranges (default 2)")
    p.add_argument("--small", type=int, default=SMALL_FILES,
                   help=f"files of the tree steady reads are compared with (default "
                   f"{SMALL_FILES:,}; 0: none)")
    p.add_argument("--cache-disk", choices=("ext4", "root"), default="ext4",
                   help="where the caches live: a fresh journaled ext4 of their own, as a "
                   "node's NVMe cache disk (default), or the work directory's file system")
    p.add_argument("--work-dir", type=Path, default=WORK_DIR,
                   help="where the trees are made and kept (default bench/work)")
    p.add_argument("--tree", type=lambda text: Path(text).resolve(), default=REPO,
                   help="the checkout whose cachefs is measured (default this one; another: "
                   "git worktree add DIR COMMIT)")
    p.add_argument("--out", type=Path, default=OUT_DIR,
                   help="where latest.md and latest.json go (default bench/results/scale)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.files < 1 or args.size < 1 or args.readers < 1 or args.repeats < 1 \
            or args.small < 0:
        parser.error("files, --size, --readers and --repeats must be positive")
    args.work_dir = args.work_dir.resolve()
    if not (args.tree / "cachefs" / "__main__.py").exists():
        parser.error(f"--tree {args.tree} is not a cachefs checkout")
    results, failed = measured("bench.scale", lambda: run(args))
    if failed:
        return failed
    paths = scale_report.write(results, args.out)
    print(scale_report.table(results))
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
