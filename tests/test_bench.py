"""The benchmark's smoke run, as CI does it: real mounts, a tiny dataset, every kind of variant.

It checks what a reader of the results relies on: the files are written, every variant has a
row per epoch, and the figures that do not depend on the machine's speed are right (cachefs at
F = 1 hits every file from the second epoch on and reads nothing from the remote; at F = 0 it
hits nothing and reads the whole dataset; direct reads read every byte from the remote); and
the cluster benchmark's: four nodes sharing one cache read the remote once, four caches unaware
of each other read three quarters of it every epoch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Fewer fractions than --quick alone, so the run stays well within the timeout on 2 busy cores.
VARIANTS = ["local", "direct", "cachefs-f0", "cachefs-f0-hints", "cachefs-f1", "cachefs-f1-hints",
            "rclone"]

pytestmark = [pytest.mark.soak,
              pytest.mark.skipif(os.geteuid() != 0,
                                 reason="mounts FUSE and drops the page cache")]


def _epoch(result: dict, name: str, number: int) -> dict:
    variant = next(v for v in result["variants"] if v["variant"] == name)
    assert variant["error"] is None, f"{name} failed: {variant.get('error_detail')}"
    return next(e for e in variant["epochs"] if e["epoch"] == number)


@pytest.mark.timeout(230)
def test_quick_run_writes_sane_results(tmp_path: Path) -> None:
    from bench.targets import cpu_figures

    out = tmp_path / "results"
    try:
        run = subprocess.run(
            [sys.executable, "-m", "bench.run", "--quick", "--fractions", "0,1", "--fps-files",
             "100", "--variants", ",".join(VARIANTS), "--out", str(out)],
            cwd=REPO, capture_output=True, text=True, timeout=220)
    except subprocess.TimeoutExpired as exc:  # where it was: the tail of its log
        log = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) \
            else exc.stderr or ""
        pytest.fail(f"bench.run --quick ran over {exc.timeout:g} s; its log ends:\n{log[-3000:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("latest.md", "latest.json", "latest.png"):
        assert (out / name).stat().st_size > 0

    result = json.loads((out / "latest.json").read_text())
    assert [v["variant"] for v in result["variants"]] == VARIANTS
    dataset_bytes = result["dataset"]["bytes"]
    for name in VARIANTS:
        for number in (1, 2):
            epoch = _epoch(result, name, number)
            assert epoch["samples"] == result["dataset"]["examples"]
            assert epoch["bytes_read"] == dataset_bytes
            assert epoch["samples_per_second"] > 0
            assert 0 <= epoch["stall_fraction"] <= 1
            # The machine's CPUs over the epoch: the loop itself keeps one of them busy.
            assert 0 < cpu_figures(epoch)["machine_busy"] <= 1

    for hints in ("", "-hints"):
        full = _epoch(result, f"cachefs-f1{hints}", 2)["counters"]
        opens = sum(v for k, v in full.items() if k.startswith("cachefs_") and k.endswith("_opens"))
        assert full["cachefs_hit_opens"] / opens == pytest.approx(1.0, abs=0.01)
        assert full["cachefs_remote_bytes"] == 0
        empty = _epoch(result, f"cachefs-f0{hints}", 2)["counters"]
        assert empty["cachefs_hit_opens"] == 0
        # Nothing is kept: without hints every epoch reads the whole dataset from the remote.
        # With hints some of epoch 2's files are fetched at the end of epoch 1, and a file
        # read late in epoch 1 and early in epoch 2 may be fetched once for both reads (all
        # 320 of them were, once): over the two epochs the remote sends the dataset at least
        # once, and the daemon's count, which judges from the page cache what a hand-over
        # fetches (remote/pagecache.py), is within the 2 % of the benchmark's own target.
        if not hints:
            assert empty["cachefs_remote_bytes"] >= dataset_bytes
        else:
            both = [_epoch(result, "cachefs-f0-hints", n)["counters"] for n in (1, 2)]
            sent = sum(c["remote_bytes"] for c in both)
            assert sent >= dataset_bytes
            assert sum(c["cachefs_remote_bytes"] for c in both) == pytest.approx(sent, rel=0.02)
    assert _epoch(result, "direct", 2)["counters"]["remote_bytes"] == dataset_bytes

    table = (out / "latest.md").read_text()
    for name in VARIANTS:
        assert f"| {name} | 2 |" in table
    assert "## Targets" in table and result["machine"]["cpu"] in table
    assert "| CPUs busy (stolen) |" in table
    # Each speed target is judged against a baseline of the same run.
    assert "| samples/s >= 60% of local | cachefs-f1-hints | " in table
    # ... on epochs of both taken in turns, with every open a hit.
    turns = result["alternating"]
    assert turns["error"] is None and len(turns["rounds"]) == 1
    assert turns["rounds"][0]["hit_ratio"] == 1.0 and turns["rounds"][0]["remote_bytes"] == 0
    assert "(median of 1 pair of epochs in turns" in table
    # The plain first epoch and the remote directly, in turns, cachefs on an empty cache.
    firsts = result["first_epochs"]
    assert firsts["error"] is None and len(firsts["rounds"]) == 1
    assert firsts["rounds"][0]["direct"] > 0 and firsts["rounds"][0]["cachefs"] > 0
    assert "(median of 1 pair of first epochs in turns" in table
    assert result["files_per_second"]["error"] is None
    # The misses against a fast remote: every round has each path, judged in the same round.
    fast = result["fast_remote"]
    assert fast["error"] is None and len(fast["rounds"]) == 1
    assert all(fast["rounds"][0][path] > 0 for path in ("tree", "fill", "not_kept"))
    assert "| files/s >= 30% of the tree read directly | fast remote f = 1 | " in table
    assert "| daemon CPU per file passed through <= 150 us | fast remote f = 0 | " in table


@pytest.mark.timeout(200)
def test_the_demo_shows_each_way_and_judges_the_hit_ratio_by_the_hash(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    run = subprocess.run(
        [sys.executable, "-m", "bench.demo", "--examples", "400", "--workers", "4", "--batch",
         "32", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=190)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for way in ("the remote, directly", "cachefs f = 0.2, client", "cachefs f = 1, mount",
                "cachefs f = 1, client"):
        assert way in run.stdout
    # The hit ratio is judged against the share of files the hash keeps, which it equals.
    result = json.loads((out / "latest.json").read_text())
    share = result["dataset"]["eligible_share"]["0.2"]
    assert f"the hash keeps {share:.1%} of these files" in run.stdout
    assert "MISSED" not in run.stdout and "\n!" not in run.stdout
    # Every way read every example, each epoch.
    for variant in result["variants"]:
        assert variant["error"] is None, variant.get("error_detail")
        assert [e["samples"] for e in variant["epochs"]] == [400, 400]


@pytest.mark.timeout(300)
def test_the_cluster_run_reads_the_remote_once_and_checks_every_byte(tmp_path: Path) -> None:
    out = tmp_path / "cluster"
    run = subprocess.run([sys.executable, "-m", "bench.cluster", "--quick", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=290)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((out / "latest.json").read_text())
    assert result["error"] is None
    nodes, examples = result["settings"]["nodes"], result["dataset"]["examples"]
    dataset_bytes = result["dataset"]["bytes"]
    for name in ("cluster", "independent"):
        epochs = result["groups"][name]["epochs"]
        assert [e["epoch"] for e in epochs] == [1, 2, 3]
        for epoch in epochs:
            # The shards of the N nodes together read every example once, each one checked.
            assert len(epoch["nodes"]) == nodes
            assert sum(n["samples"] for n in epoch["nodes"]) == examples
            assert sum(n["bytes_read"] for n in epoch["nodes"]) == dataset_bytes
            assert all(n["samples_per_second"] > 0 for n in epoch["nodes"])

    def share(epoch: dict, key: str = "cachefs_remote_bytes") -> float:
        """Of the dataset, summed over the nodes' cachefs counters."""
        return sum(n["counters"][key] for n in epoch["nodes"]) / dataset_bytes

    def emulator_share(epoch: dict) -> float:
        """Of the dataset, what the emulated remote itself served."""
        return epoch["emulator"]["remote_bytes"] / dataset_bytes

    cluster = result["groups"]["cluster"]["epochs"]
    # The first epoch fills the cluster: each file read from the remote once, by its owner.
    assert 0.98 <= share(cluster[0]) <= 1.02
    for epoch in cluster[1:]:
        # From the second on, every file is cached by its owner: the remote is not read...
        assert share(epoch) <= 0.02
        assert emulator_share(epoch) <= 0.02
        # ... and the other nodes' files come from their owners, every answer genuine.
        assert share(epoch, "cachefs_peer_read_bytes") >= 0.5
        assert sum(n["counters"]["cachefs_peer_ok"] for n in epoch["nodes"]) > 0
    for epoch in cluster:
        assert sum(n["counters"]["cachefs_peer_rejected"] for n in epoch["nodes"]) == 0
    for epoch in result["groups"]["independent"]["epochs"]:
        # Warmed caches unaware of each other hold the same quarter: 1 - f, every epoch.
        assert 0.6 <= share(epoch) <= 0.9
        assert emulator_share(epoch) == pytest.approx(share(epoch), abs=0.01)

    for title in ("Samples/s per node", "Read from the remote per epoch",
                  "chunk fetches from their owners", "CPU per file"):
        assert title in run.stdout
    assert "The independent caches were warmed first" in run.stdout
    assert f"compared with the dataset's bytes (length and xxh3): {6 * examples:,} reads" \
        in run.stdout
    assert "\n!" not in run.stdout


@pytest.mark.timeout(200)
def test_the_scale_run_prints_every_row_and_leaves_no_mount(tmp_path: Path) -> None:
    from bench import scale_report

    out, work = tmp_path / "scale", tmp_path / "work"
    run = subprocess.run(
        [sys.executable, "-m", "bench.scale", "10000", "--small", "2000", "--repeats", "1",
         "--work-dir", str(work), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=190)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open("/proc/self/mountinfo") as mounts:
        assert str(tmp_path) not in mounts.read()
    assert not (work / "scale" / "run").exists() or not any((work / "scale" / "run").iterdir())
    result = json.loads((out / "latest.json").read_text())
    table = (out / "latest.md").read_text()
    for what, mine, _tree in scale_report.rows(result):
        assert what in run.stdout and f"| {what} | {mine} |" in table
    # Every file was warmed and read: the passes read every byte (or the run would fail).
    big = result["big"]
    assert ": 10,000 fetched " in big["warm"]["summary"]
    assert big["warm"]["files_per_second"] > 0 and big["warm"]["client_peak_rss_bytes"] > 0
    assert big["rss_after_warm_bytes"] > big["rss_empty_bytes"] > 0
    assert all(p["files_per_second"] > 0 for p in big["passes"]["steady"])
    # ... and again with the held files, then both bounds, covering every file (a mount
    # of its own each).
    for variant in ("held_covered", "covered"):
        assert len(big["passes"][f"steady_{variant}"]) == 1 and big[f"rss_{variant}_bytes"] > 0
        assert all(p["files_per_second"] > 0 for p in big["passes"][f"steady_{variant}"])
    assert "`--held-files` covering every file" in table
    # ... each mount's also with only the pages dropped before a pass ...
    steady_keys = {"steady", "steady_held_covered", "steady_covered"}
    steady_keys |= {f"{key}_pages_only" for key in steady_keys}
    for key in steady_keys:
        assert len(big["passes"][key]) == 1 and big["passes"][key][0]["files_per_second"] > 0
    for what in ("the steady passes", "`--held-files` covering",
                 "`--held-files` and `--attr-cache-entries` covering"):
        assert f"| {what}, only the pages dropped before each pass |" in table
    # ... and the small tree read, revalidating every file, right before each of those passes
    # and after the last of each kind.
    paired = result["small"]["paired"]
    assert set(paired) == steady_keys
    assert all(len(passes) == 2 and all(p["files_per_second"] > 0 for p in passes)
               for passes in paired.values())
    assert "(read beside the passes above), only the pages dropped before each pass |" in table
    # ... and both trees within --revalidate, both bounds covering, on mounts of their own.
    assert len(big["passes"]["steady_within"]) == 1 and len(big["baseline_within"]) == 2
    assert all(p["files_per_second"] > 0 and p["daemon_cpu_us_per_file"] > 0
               for p in big["passes"]["steady_within"] + big["baseline_within"])
    assert "| the same at 2,000 files, read beside those passes |" in table
    # ... and the tree itself read directly, both sizes in turns: what the verdicts allow.
    assert len(big["local"]["passes"]) == 1 and len(big["local"]["small_beside"]) == 10
    assert all(p["files_per_second"] > 0 for p in big["local"]["small_beside"])
    assert "| the tree of 2,000 files read directly in turns with that of 10,000 " in table
    # ... and what the kernel took of each pass (/proc), and the daemon's garbage collector
    # (its metrics).
    steady = big["passes"]["steady"]
    assert all(0 < p["daemon_system_us_per_file"] <= p["daemon_cpu_us_per_file"] for p in steady)
    assert all(p["gc_us_per_file"] >= 0 for p in steady)
    assert "us of it in the kernel, " in table and " us in garbage collection" in table
    assert big["mount_after_kill_seconds"] > 0 and big["status_request_seconds"] > 0
    # The verdicts are computed, each target judged.
    verdicts = result["verdicts"]
    assert len(verdicts) == 20
    # A pass of 10,000 files ends within --revalidate, so it is judged against the small
    # tree's within it; with only the pages dropped the small tree has no such pass to
    # compare with, and the verdict says so rather than judging.
    pages_only = [v for v in verdicts if "only the pages dropped" in v["target"]]
    assert len(pages_only) == 3 and all(v["met"] is None for v in pages_only)
    assert all(v["met"] in (True, False) for v in verdicts if v not in pages_only)
    [within] = [v for v in verdicts if "within --revalidate (no file" in v["target"]]
    assert "of those within --revalidate as well, read either side of each pass" \
        in within["measured"]
    assert "projected linearly to 1,000,000 from 10,000" in table
    for verdict in verdicts:
        assert verdict["target"] in run.stdout
    steady_verdicts = [v for v in verdicts if "as the tree itself is" in v["target"]
                       or v["target"].startswith("the same, --held-files")]
    assert len(steady_verdicts) == 7
    assert all("; the tree read directly: " in v["measured"] for v in steady_verdicts)
    # The trees are kept for the next run, found by their name.
    assert (work / "scale" / "tree-10000x4096").is_dir()
    assert len((work / "scale" / "tree-10000x4096.paths").read_text().split()) == 10000


def test_a_big_pass_is_judged_against_the_small_passes_either_side_of_it() -> None:
    from bench.scale_report import _against_small

    def passes(*rates: float) -> list[dict]:
        return [{"files_per_second": rate} for rate in rates]

    # A million files at 6,000 files/s outlast --revalidate: judged against the small tree
    # revalidating every file.  The host slowed between the first pass and the second: each
    # pass against the small tree's passes either side of it is 90 % and 100 %, where the
    # means of all of them (6,500 against 6,000) would say 108 %.
    results = {"settings": {"files": 1_000_000, "small_files": 10_000},
               "big": {"passes": {"steady": passes(6_300, 6_700)}},
               "small": {"steady": passes(9_000),
                         "paired": {"steady": passes(7_000, 7_000, 6_400)}}}
    [verdict] = _against_small(results, 6_500)
    assert verdict["met"] is False
    assert verdict["measured"].startswith("95% of those revalidating every file")
    assert "either side of each pass (90-100 %)" in verdict["measured"]
    # A run from before the pairing: its small tree's passes, read apart, by their means.
    del results["small"]["paired"]
    results["small"]["steady_revalidated"] = passes(6_000, 6_000, 6_000)
    [verdict] = _against_small(results, 6_500)
    assert verdict["met"] is True and verdict["measured"].startswith("108% of those")
    assert "either side" not in verdict["measured"]


def test_a_big_pass_as_fast_but_dearer_per_file_misses() -> None:
    from bench.scale_report import _against_small

    def passes(*figures: tuple[float, float]) -> list[dict]:
        return [{"files_per_second": rate, "daemon_cpu_us_per_file": cpu}
                for rate, cpu in figures]

    # The small tree's passes, seconds long, caught a slow spell: the big tree's read 20 %
    # faster, but each of its files cost the daemon 1.2x the CPU.  A slowdown per file.
    results = {"settings": {"files": 1_000_000, "small_files": 10_000},
               "big": {"passes": {"steady": passes((6_000, 240))}},
               "small": {"steady": passes((9_000, 150)),
                         "paired": {"steady": passes((5_000, 200), (5_000, 200))}}}
    [verdict] = _against_small(results, 6_000)
    assert verdict["met"] is False
    assert verdict["measured"].startswith("120% of those revalidating every file")
    assert "daemon CPU per file 1.20x theirs (1.20x)" in verdict["measured"]
    # As fast and no dearer: met.
    results["big"]["passes"]["steady"] = passes((6_000, 190))
    [verdict] = _against_small(results, 6_000)
    assert verdict["met"] is True and "daemon CPU per file 0.95x theirs" in verdict["measured"]


def test_a_big_pass_may_slow_as_much_as_the_tree_itself_read_directly() -> None:
    """The kernel alone reads the tree of a million files at 80 % of the rate of the tree of
    10,000 (read in turns): cachefs's passes at 85 % of the small tree's, at 1.2x the CPU per
    file (within 1 / 0.8), slow no more than that.  At 1.3x the CPU per file they do."""
    from bench.scale_report import _against_small

    def passes(*figures: tuple[float, float]) -> list[dict]:
        return [{"files_per_second": rate, "daemon_cpu_us_per_file": cpu}
                for rate, cpu in figures]

    results = {"settings": {"files": 1_000_000, "small_files": 10_000},
               "big": {"passes": {"steady": passes((5_100, 120))},
                       "local": {"passes": passes((32_000, 0)),
                                 "small_beside": passes((40_000, 0), (40_000, 0))}},
               "small": {"steady": passes((9_000, 100)),
                         "paired": {"steady": passes((6_000, 100), (6_000, 100))}}}
    [verdict] = _against_small(results, 5_100)
    assert verdict["met"] is True
    assert "as the tree itself is (read directly, in turns)" in verdict["target"]
    assert "; the tree read directly: 80% of its files/s at 10,000 files, so the bound is " \
        "80% and CPU per file 1.25x" in verdict["measured"]
    results["big"]["passes"]["steady"] = passes((5_100, 130))
    [verdict] = _against_small(results, 5_100)
    assert verdict["met"] is False
    # A tree read faster with more files (a host's noise) leaves the bound at no slowdown.
    results["big"]["local"]["passes"] = passes((48_000, 0))
    results["big"]["passes"]["steady"] = passes((5_700, 105))
    [verdict] = _against_small(results, 5_700)
    assert verdict["met"] is False and "so the bound is 100%" in verdict["measured"]


def test_bounds_covering_a_tree_count_its_directories_among_the_names(tmp_path: Path) -> None:
    """An attribute cache one entry over its bound dropped its oldest tenth: a bound of the
    files alone left a million files' 1,001 directories out, and a tenth of the files went to
    the remote every pass that was meant to ask it nothing."""
    from bench.scale import Tree, covering_bounds

    tree = Tree(tmp_path, tmp_path / "paths", 1_000_000, 4096)
    assert covering_bounds(tree, ("--held-files", "--attr-cache-entries")) == (
        "--held-files", "1000000", "--attr-cache-entries", "1001001")
    assert covering_bounds(Tree(tmp_path, tmp_path / "paths", 1500, 1), (
        "--attr-cache-entries",)) == ("--attr-cache-entries", "1503")


def test_a_speed_up_above_the_remotes_ceiling_is_said_to_be() -> None:
    from bench.targets import _speedup_verdicts
    from bench.variants import CACHEFS, DIRECT

    def variant(name: str, kind: str, rate: float) -> dict:
        return {"variant": name, "kind": kind, "fraction": 0.2 if kind == CACHEFS else None,
                "error": None, "epochs": [{"epoch": 4, "paced": False,
                                           "samples_per_second": rate}]}

    # 1,000 files of 100 KB on a 200 MB/s link: at f = 0.2 each sample brings 80 KB, so the
    # remote allows 2,500 samples/s.
    results = {"settings": {"profile": "efs"},
               "dataset": {"bytes": 100_000_000, "examples": 1000},
               "variants": [variant("cachefs-f0.2-hints", CACHEFS, 2000),
                            variant("direct", DIRECT, 1000)]}
    direct = _speedup_verdicts(results)[0]
    assert direct["met"] is False
    assert "above the remote's ceiling of 2500 samples/s (2.50x direct), of which this is " \
        "80%" in direct["measured"]
    results["variants"][1]["epochs"][0]["samples_per_second"] = 500  # 3x is 1,500: below it
    direct = _speedup_verdicts(results)[0]
    assert direct["met"] is True and "ceiling" not in direct["measured"]


def test_the_ceiling_follows_the_bandwidth_a_run_sets() -> None:
    from bench.targets import ceiling
    from bench.variants import DIRECT

    # 1,000 files of 100 KB: the efs profile's 200 MB/s allows 2,000 samples/s in a first
    # epoch, a link of 50 MB/s a quarter of that.
    results = {"settings": {"profile": "efs"},
               "dataset": {"bytes": 100_000_000, "examples": 1000}, "variants": []}
    direct = {"variant": "direct", "kind": DIRECT, "fraction": None}
    first = {"epoch": 1, "paced": True}
    assert ceiling(results, direct, first) == pytest.approx(2000)
    results["settings"]["bandwidth_mbps"] = 50.0
    assert ceiling(results, direct, first) == pytest.approx(500)


@pytest.mark.timeout(60)
def test_what_a_killed_run_left_mounted_is_cleared_by_the_next(tmp_path: Path) -> None:
    from bench.emulator import slowfs
    from bench.mounts import ScratchDisk
    from bench.run import clear_leftovers

    # A run killed with SIGKILL leaves its variant's cache disk mounted, a file in it; its
    # directory is named by its pid, which no process has now.
    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read()) - 1
    runs = tmp_path / "run"
    disk = ScratchDisk(runs / str(dead) / "cachefs-f1", 64 << 20)
    try:
        cache = disk.__enter__()
        (cache / "cache").mkdir()
        (cache / "cache" / "data").write_bytes(b"x" * 4096)
        mine = runs / str(os.getpid())  # a run still going is left alone
        mine.mkdir()
        clear_leftovers(runs)
        assert not slowfs.is_mounted(cache)
        assert not (runs / str(dead)).exists()
        assert mine.is_dir()
    finally:
        if slowfs.is_mounted(disk.path):
            subprocess.run(["umount", "-l", str(disk.path)], capture_output=True)


@pytest.mark.timeout(230)
def test_a_scale_run_whose_processes_all_get_sigterm_ends_and_unmounts(tmp_path: Path) -> None:
    import signal
    import time

    # Its process group stopped (a unit stopped, a pod deleted) while its readers read: every
    # reader dies with the run, which unwinds and unmounts what it mounted.
    work, log = tmp_path / "work", tmp_path / "log"
    with open(log, "wb") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "bench.scale", "10000", "--small", "2000", "--repeats", "1",
             "--work-dir", str(work), "--out", str(tmp_path / "out")],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while b"read passes through the mount" not in log.read_bytes():
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(1.0)  # into the passes
        os.killpg(run.pid, signal.SIGTERM)
        assert run.wait(60) != 0
        assert "interrupted; every mount was unmounted" in log.read_text()
        with open("/proc/self/mountinfo") as mounts:
            assert str(tmp_path) not in mounts.read()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        with open("/proc/self/mountinfo") as mounts:
            for line in mounts:
                if str(tmp_path) in line:
                    subprocess.run(["umount", "-l", line.split()[4]], capture_output=True)
