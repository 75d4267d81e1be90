"""The benchmark: every variant, one run, results as Markdown, PNG and JSON.

    python3 -m bench.run            # the full run, about 10-15 minutes on 2 cores
    python3 -m bench.run --quick    # the smoke run CI does, about 1-2 minutes
    python3 -m bench.run --help     # sizes, epochs, workers, batch, pace, profile, variants

Results go to bench/results/ (latest.md, latest.png, latest.json); --quick writes to
bench/results/quick/ so that CI never overwrites the committed results.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench import alternating, fastremote, filerate, firstepoch, machine, report, targets
from bench import dataset as dataset_mod
from bench.emulator import slowfs
from bench.emulator.remote import EmulatedRemote
from bench.measure import measure_variant
from bench.settings import RunSettings, build_parser, settings_from_args
from bench.variants import PEER_FRACTION
from cachefs.service.process import alive


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def clear_leftovers(runs_dir: Path) -> None:
    """Unmount and remove what runs killed with SIGKILL left behind (their pid is gone)."""
    if not runs_dir.exists():
        return
    for entry in runs_dir.iterdir():
        if not entry.name.isdigit() or alive(int(entry.name)):
            continue
        for directory, dirs, _ in os.walk(entry, topdown=True):
            for name in list(dirs):
                path = Path(directory) / name
                if slowfs.is_mounted(path):
                    slowfs.fusermount(path, lazy=True)
                    dirs.remove(name)
        shutil.rmtree(entry, ignore_errors=True)


REPO = Path(__file__).resolve().parent.parent


def measure_this_tree() -> dict:
    """Import cachefs and cachefs_client from this tree, whatever copies pip points to, in this
    process and in the loops' children (spawned children inherit sys.path); say which."""
    for path in (REPO, REPO / "client"):
        if str(path) in sys.path:
            sys.path.remove(str(path))
        sys.path.insert(0, str(path))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    changed = git("status", "--porcelain", "--", "cachefs", "client").splitlines()
    return {"tree": str(REPO), "commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "uncommitted_files": len(changed)}


def _eligible_shares(data: dataset_mod.Dataset, fractions: tuple[float, ...]) -> dict:
    """Share of the files cachefs keeps at each fraction (seed 0), by its own admission rule:
    the hit ratio a perfect run shows, which differs from F by the luck of the hash draw."""
    from cachefs.store.admission import FractionAdmission

    files = data.files
    return {f"{f:g}": sum(map(FractionAdmission(f).eligible, files)) / len(files)
            for f in fractions}


def sigterm_as_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def measured(name: str, measure: Callable[[], dict]) -> tuple[dict | None, int]:
    """``(measure(), 0)``, or ``(None, exit status)`` after one line on stderr: 130 when
    interrupted (Ctrl-C or SIGTERM; every mount is unmounted on the way out), 1 when a
    mount, the dataset or the machine failed."""
    signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    try:
        return measure(), 0
    except KeyboardInterrupt:
        print(f"{name}: interrupted; every mount was unmounted", file=sys.stderr)
        return None, 130
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"{name}: {exc}".splitlines()[0], file=sys.stderr)
        return None, 1


def run(settings: RunSettings, log: Callable[[str], None] = _log) -> dict:
    """Measure every selected variant; returns the raw results (also what latest.json holds)."""
    if os.geteuid() != 0:
        raise PermissionError("the benchmark mounts FUSE file systems and drops the page cache: "
                              "run it as root")
    datasets_dir = settings.work_dir / "datasets"
    # A directory per run, so that runs at the same time (CI and a developer) do not collide.
    run_dir = settings.work_dir / "run" / str(os.getpid())
    clear_leftovers(run_dir.parent)
    (settings.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    started = time.time()
    data = dataset_mod.ensure(datasets_dir, settings.dataset_spec(), log)
    fps_data = (dataset_mod.ensure(datasets_dir, settings.fps_spec(), log)
                if settings.fps_files else None)
    source = measure_this_tree()
    results: dict = {"settings": settings.public(), "machine": machine.describe(),
                     "source": source,
                     "dataset": {"name": data.spec.name(), "examples": len(data.examples),
                                 "files": len(data.files), "bytes": data.total_bytes},
                     "variants": [], "alternating": None, "first_epochs": None,
                     "files_per_second": None,
                     "fast_remote": None}
    log(f"dataset {data.spec.name()}: {len(data.examples)} examples, "
        f"{data.total_bytes / 2**20:.0f} MiB; pace {settings.pace:.0f} samples/s "
        f"(batch {settings.batch} every {settings.step_ms:.1f} ms), remote profile "
        f"{settings.profile}")
    (run_dir / "remote").mkdir(parents=True, exist_ok=True)
    try:
        with EmulatedRemote(datasets_dir, run_dir / "remote", profile=settings.profile,
                            bandwidth_mbps=settings.bandwidth_mbps,
                            log_file=settings.out_dir / "logs" / "remote.log") as remote:
            for variant in settings.variants:
                log(f"{variant.name}:")
                results["variants"].append(
                    measure_variant(variant, data, remote, settings, run_dir, log))
            if settings.share_rounds and data.spec.kind == dataset_mod.KIND_IMAGES:
                log(f"cachefs-f1-hints and local, {settings.share_rounds} unpaced epochs each "
                    "in turns:")
                results["alternating"] = alternating.measure(data, remote, settings, run_dir,
                                                             log)
            if settings.first_rounds and data.spec.kind == dataset_mod.KIND_IMAGES:
                log(f"the remote directly and cachefs-f{PEER_FRACTION:g} on an empty cache, "
                    f"{settings.first_rounds} first epochs each in turns:")
                results["first_epochs"] = firstepoch.measure(data, remote, settings, run_dir,
                                                             log)
            if fps_data is not None:
                log(f"files/s of {settings.fps_files} files of 64 KiB, warm cache, "
                    f"{settings.fps_threads} threads:")
                results["files_per_second"] = filerate.measure(fps_data, remote, settings,
                                                               run_dir, log)
        if settings.fast_files:
            log(f"misses against a fast remote (the local tree itself), {settings.fast_files} "
                f"files of {fastremote.FILE_BYTES // 1024} KiB, {settings.fast_rounds} round(s):")
            results["fast_remote"] = fastremote.measure(settings, run_dir, log)
    finally:
        if not slowfs.is_mounted(run_dir / "remote"):
            shutil.rmtree(run_dir, ignore_errors=True)
    results["dataset"]["eligible_share"] = _eligible_shares(data, settings.fractions)
    results["seconds"] = round(time.time() - started, 1)
    # Other work on the machine slows every variant: say how busy it was.
    results["machine"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    results["verdicts"] = targets.evaluate(results)
    return results


def main(argv: list[str] | None = None, preset: str = "full") -> int:
    parser = build_parser("python3 -m bench.run", "Measure training throughput and data stall "
                          "through cachefs and its alternatives.", quick_flag=True)
    settings = settings_from_args(parser, argv, preset)
    results, failed = measured("bench", lambda: run(settings))
    if failed:
        return failed
    paths = report.write(results, settings.out_dir)
    print(report.console_table(results))
    print("\n".join(f"wrote {p}" for p in paths))
    failed = [v["variant"] for v in results["variants"] if v["error"]]
    if failed:
        print(f"bench: {len(failed)} variant(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
