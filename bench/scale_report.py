"""bench.scale's results: the table, the per-file costs, the verdicts; latest.md and latest.json.

Verdicts are computed, never asserted.  The targets are set for 1,000,000 files; a run with
fewer judges what grows with the files (memory, start time) by the per-file cost it measured,
projected to 1,000,000, and says so.

Redraw the Markdown from a run's JSON (verdicts recomputed)::

    python3 -m bench.scale_report bench/results/scale/latest.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cachefs.service.config import DEFAULT_REVALIDATE_SECONDS

MIB = 2**20
TARGET_FILES = 1_000_000
MAX_DAEMON_RSS = 400 * MIB
MAX_MOUNT_SECONDS = 3.0
FIRST_PASS_OF_STEADY = 0.7
MAX_WARM_CLIENT_RSS = 100 * MIB
MIN_WARM_FILES_PER_SECOND = 5000
MAX_STATUS_SECONDS = 0.5
WALK_FIRST_OF_TREE = 4.0
WALK_AGAIN_OF_TREE = 2.0
# The steady passes with bounds covering every file (bench/scale.py): the results' key
# (steady_<key>, rss_<key>_bytes) and the flags set to the number of files.
COVERING_VARIANTS = (("held_covered", ("--held-files",)),
                     ("covered", ("--held-files", "--attr-cache-entries")))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _rates(passes: list[dict]) -> list[float]:
    return [p["files_per_second"] for p in passes]


def _cpus(passes: list[dict]) -> list[float]:
    return [p["daemon_cpu_us_per_file"] for p in passes if "daemon_cpu_us_per_file" in p]


def _parts(passes: list[dict]) -> str:
    """What of the daemon's CPU per file the kernel took (its system calls and what they do)
    and its garbage collector, where the results and the daemon tell."""
    parts = []
    system = [p["daemon_system_us_per_file"] for p in passes if "daemon_system_us_per_file" in p]
    if system:
        parts.append(f"{_span(system)} us of it in the kernel")
    spent = [p["gc_us_per_file"] for p in passes if "gc_us_per_file" in p]
    if spent:
        parts.append(f"{_span(spent, ',.1f')} us{'' if system else ' of it'} in garbage "
                     "collection")
    return f" ({', '.join(parts)})" if parts else ""


def _span(values: list[float], fmt: str = ",.0f") -> str:
    if not values:
        return "—"
    low, high = min(values), max(values)
    text = format(low, fmt)
    return text if text == format(high, fmt) else f"{text}-{format(high, fmt)}"


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value / MIB:,.0f} MiB"


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} s"


def per_file(results: dict) -> dict:
    """What each file costs, from the figures of the run."""
    big, files = results["big"], results["settings"]["files"]
    empty_rss = big["rss_empty_bytes"]
    out = {
        "daemon_rss_bytes_after_warm": (big["rss_after_warm_bytes"] - empty_rss) / files,
        "daemon_rss_bytes_after_read": (max(big["rss_after_read_bytes"],
                                            big["rss_after_steady_bytes"]) - empty_rss) / files,
        "daemon_rss_bytes_after_find": (big["empty"]["rss_after_find_bytes"]
                                        - big["empty"]["rss_bytes"]) / files,
        "daemon_rss_bytes_after_ls": (big["empty"]["rss_after_ls_bytes"]
                                      - big["empty"]["rss_bytes"]) / files,
        "warm_daemon_cpu_us": big["warm"]["daemon_cpu_us_per_file"],
        "steady_daemon_cpu_us": _mean(_cpus(big["passes"]["steady"])),
        "first_pass_after_restart_daemon_cpu_us": big["passes"]["after_restart"][
            "daemon_cpu_us_per_file"],
        "first_pass_after_kill_daemon_cpu_us": big["passes"]["after_kill"][
            "daemon_cpu_us_per_file"],
        "start_us_per_cached_file_after_unmount":
            (big["mount_after_unmount_seconds"] - big["empty"]["mount_seconds"]) / files * 1e6,
        "start_us_per_cached_file_after_kill":
            (big["mount_after_kill_seconds"] - big["empty"]["mount_seconds"]) / files * 1e6,
        "warm_client_bytes_per_path": None,
    }
    small = results.get("small")
    if small and files > results["settings"]["small_files"]:
        out["warm_client_bytes_per_path"] = (
            (big["warm"]["client_peak_rss_bytes"] - small["warm"]["client_peak_rss_bytes"])
            / (files - results["settings"]["small_files"]))
    return out


def _projected(results: dict, at_n: float, per_file_cost: float) -> tuple[float, str]:
    """A figure measured at the run's N, taken to TARGET_FILES by its cost per file."""
    files = results["settings"]["files"]
    if files == TARGET_FILES:
        return at_n, ""
    # Linear: for memory an upper bound, since the attribute cache, the held files and the
    # index's memo stop growing at their bounds (200,000, 65,536 and 65,536 by default).
    return at_n + per_file_cost * (TARGET_FILES - files), \
        f" (projected linearly to {TARGET_FILES:,} from {files:,})"


def _verdict(target: str, met: bool | None, measured: str) -> dict:
    return {"target": target, "met": met, "measured": measured}


def verdicts(results: dict) -> list[dict]:
    big, files = results["big"], results["settings"]["files"]
    costs = per_file(results)
    out = []

    rss = max(big["rss_after_read_bytes"], big["rss_after_steady_bytes"])
    value, note = _projected(results, rss, costs["daemon_rss_bytes_after_read"])
    out.append(_verdict("daemon RSS <= 400 MiB after warm and a read pass at 1M files",
                        value <= MAX_DAEMON_RSS, f"{_mib(value)}{note}"))
    empty = big["empty"]
    value, note = _projected(results, empty["rss_after_find_bytes"],
                             costs["daemon_rss_bytes_after_find"])
    out.append(_verdict("daemon RSS <= 400 MiB through a find of the whole mount at 1M files",
                        value <= MAX_DAEMON_RSS, f"{_mib(value)}{note}"))
    for how, key in (("a clean unmount", "unmount"), ("kill -9", "kill")):
        cost = costs[f"start_us_per_cached_file_after_{key}"] / 1e6
        value, note = _projected(results, big[f"mount_after_{key}_seconds"], cost)
        out.append(_verdict(f"cachefs mount <= 3 s with 1M files cached, after {how}",
                            value <= MAX_MOUNT_SECONDS, f"{value:.1f} s{note}"))
    steady = _mean(_rates(big["passes"]["steady"]))
    for how, key in (("a clean restart", "after_restart"), ("kill -9", "after_kill")):
        share = big["passes"][key]["files_per_second"] / steady
        out.append(_verdict(f"first read pass after {how} >= 70 % of a steady pass",
                            share >= FIRST_PASS_OF_STEADY, f"{share:.0%}"))
    peak = big["warm"]["client_peak_rss_bytes"]
    if costs["warm_client_bytes_per_path"] is not None:
        value, note = _projected(results, peak, max(0.0, costs["warm_client_bytes_per_path"]))
    else:
        value, note = peak, ""
    out.append(_verdict("cachefs warm client <= 100 MiB RSS for a list of 1M paths",
                        value <= MAX_WARM_CLIENT_RSS, f"{_mib(value)}{note}"))
    rate = big["warm"]["files_per_second"]
    out.append(_verdict("cachefs warm >= 5,000 files/s", rate >= MIN_WARM_FILES_PER_SECOND,
                        f"{rate:,.0f} files/s at {files:,} files"))
    out.append(_verdict("cachefs status <= 0.5 s (the cache full)",
                        big["status_seconds"] <= MAX_STATUS_SECONDS,
                        f"{big['status_seconds']:.2f} s (the request alone "
                        f"{big['status_request_seconds'] * 1000:.1f} ms)"))
    tree_walks = big["local"]["walks"]
    for name, label in (("find", "find"), ("ls", "ls -lR")):
        mine, tree = empty["walks"][name], tree_walks[name]
        first, again = mine["first"] / tree["first"], mine["again"] / tree["first"]
        out.append(_verdict(f"{label} of the mount <= 4x the tree's, dentries dropped",
                            first <= WALK_FIRST_OF_TREE, f"{first:.1f}x"))
        out.append(_verdict(f"{label} of the mount repeated <= 2x the tree's first",
                            again <= WALK_AGAIN_OF_TREE, f"{again:.1f}x"))
    if results.get("small"):
        out += _against_small(results, steady)
    return out


# The small tree's passes each big pass is judged against (Baseline in bench/scale.py).
REVALIDATING = "revalidating every file as a pass here does"
WITHIN = "within --revalidate as well"


# How the passes of _against_small had their caches dropped: the results' key suffix, and
# the words of the verdict.
_DROPPED = (("", ""),
            ("_pages_only", ", only the pages dropped before each pass (what a node keeps "
                            "between epochs)"))


def _against_small(results: dict, steady: float) -> list[dict]:
    """Steady reads of the big tree against the small tree's, the same work per file: where a
    pass of the big tree outlasts --revalidate, each of its opens asks the remote again, and
    so do the small tree's passes compared with it.  At the default bounds (the target), then
    with each covering every file (what grows with the files, apart from what the bounds
    cost); with pages, dentries and inodes dropped before each pass, then only the pages."""
    small, passes = results["small"], results["big"]["passes"]
    files, small_files = results["settings"]["files"], results["settings"]["small_files"]
    revalidating = files / steady > DEFAULT_REVALIDATE_SECONDS
    tree, as_tree, tree_said = _tree_slowdown(results)
    out = []
    for suffix, how in _DROPPED:
        if f"steady{suffix}" not in passes:
            continue  # a run from before these passes
        for variant, flags in (("", ()), *COVERING_VARIANTS):
            key = f"steady_{variant}{suffix}" if variant else f"steady{suffix}"
            mine = passes.get(key)
            if not mine:
                continue
            if flags:
                target = f"the same, {' and '.join(flags)} covering the {files:,} files{how}"
            else:
                target = (f"steady reads at {files:,} files >= those at {small_files:,}"
                          f"{as_tree}{how}")
            cpu = None
            if revalidating:
                share, cpu, measured = _against_baseline(
                    mine, *_baseline(small, key, suffix), small_files)
                if not variant and not suffix:
                    within = steady / _mean(_rates(small["steady"]))
                    measured += f"; {within:.0%} of those within --revalidate"
            elif not suffix:
                share = _mean(_rates(mine)) / _mean(_rates(small["steady"]))
                cpu, said = _cpu_against(_cpus(mine), _cpus(small["steady"]), paired=False)
                measured = f"{share:.0%}{said}"
            else:
                share = None
                measured = (f"no pass at {small_files:,} files to compare (a pass here ends "
                            "within --revalidate)")
            out.append(_verdict(target, _no_slowdown(share, cpu, tree),
                                measured + tree_said))
    within = passes.get("steady_within")
    if within:
        share, cpu, measured = _against_baseline(
            within, results["big"].get("baseline_within", []), True, small_files, WITHIN)
        out.append(_verdict(f"steady reads at {files:,} files >= those at {small_files:,}"
                            f"{as_tree}, both bounds covering, both within --revalidate (no "
                            "file checked with the remote)",
                            _no_slowdown(share, cpu, tree), measured + tree_said))
    return out


def _tree_slowdown(results: dict) -> tuple[float, str, str]:
    """(the files/s the tree itself is read at directly with N files, as a share of its
    rate with SMALL_FILES, read in turns, at most 1; the words the target and the measured
    figure add), or (1.0, "", "") for a run from before those passes.

    Reading the same 4 KiB through the kernel alone costs more per file in a tree of a
    million files than in one of 10,000: the dentry, inode and page-cache tables and the
    file system's own are 100 times larger, and their entries are found in memory, not in the
    CPU's caches.  cachefs pays that too (each open walks the cache disk's tree of N files)
    and the same for its own tables (a lookup in a dict of a million paths took 0.91 - 0.92
    us against 0.08 - 0.09 us in one of 10,000).  So no slowdown at all is not the bound; no
    more slowdown than the tree's own is."""
    share = _tree_share(results["big"].get("local", {}))
    if share is None:
        return 1.0, "", ""
    bound = min(1.0, share)
    small_files = results["settings"]["small_files"]
    return (bound, " as the tree itself is (read directly, in turns)",
            f"; the tree read directly: {share:.0%} of its files/s at {small_files:,} files, "
            f"so the bound is {bound:.0%} and CPU per file {1 / bound:.2f}x")


def _tree_share(local: dict) -> float | None:
    """The files/s of the big tree's direct passes as a share of the small tree's, read in
    turns with them; None for a run from before those passes."""
    beside = local.get("small_beside")
    if not beside:
        return None
    return _mean(_rates(local["passes"])) / _mean(_rates(beside))


def _no_slowdown(share: float | None, cpu: float | None, tree: float = 1.0) -> bool | None:
    """No slowdown per file beyond the tree's own (``tree``: its files/s with N files as a
    share of those with SMALL_FILES, read directly): at least that share of the files a
    second, and no more of the daemon's CPU for each than the tree's time for each grew (the
    steadier of the two where the host is noisy)."""
    return None if share is None else share >= tree and (cpu is None or cpu <= 1.0 / tree)


def _baseline(small: dict, key: str, suffix: str) -> tuple[list[dict], bool]:
    """The small tree's passes, every file revalidated, that the big tree's passes ``key``
    are judged against, and whether they were read beside them (Baseline in bench/scale.py:
    one before each and one after the last); in a run from before that, its passes of the
    same drop, read apart from them."""
    paired = small.get("paired", {}).get(key)
    if paired:
        return paired, True
    return _read_apart(small, suffix), False


def _read_apart(small: dict, suffix: str) -> list[dict]:
    """A run from before Baseline: the small tree's passes revalidating every file, with the
    drop of ``suffix``, read after the big tree's rather than beside them."""
    return small.get(f"steady_revalidated{suffix}") or []


def _against_baseline(mine: list[dict], baseline: list[dict], paired: bool, small_files: int,
                      them: str = REVALIDATING) -> tuple[float | None, float | None, str]:
    """(the files/s share, the daemon's CPU per file as a multiple of the baseline's, in
    words): each of ``mine`` against the mean of the baseline's passes either side of it
    where they were read so, else the means."""
    if not baseline:
        return None, None, f"no pass at {small_files:,} files {them} to compare"
    rates, base = _rates(mine), _rates(baseline)
    paired = paired and len(base) == len(rates) + 1
    cpu, said = _cpu_against(_cpus(mine), _cpus(baseline), paired=paired)
    if not paired:
        share = _mean(rates) / _mean(base)
        return share, cpu, f"{share:.0%} of those {them}{said}"
    shares = _against_neighbours(rates, base)
    share = _mean(shares)
    # Passes either side of 100 % say the host's noise is larger than the difference.
    noise = "; within the host's noise" if min(shares) < 1.0 <= max(shares) else ""
    return share, cpu, (f"{share:.0%} of those {them}, read either side of each pass "
                        f"({_span([100 * x for x in shares])} %){noise}{said}")


def _against_neighbours(mine: list[float], baseline: list[float]) -> list[float]:
    """Each of ``mine`` as a multiple of the mean of the baseline's figures either side of it
    (the baseline read one before each and one after the last)."""
    return [value / ((baseline[i] + baseline[i + 1]) / 2) for i, value in enumerate(mine)]


def _cpu_against(mine: list[float], baseline: list[float], *, paired: bool
                 ) -> tuple[float | None, str]:
    """(the daemon's CPU per file as a multiple of the baseline's, in words; None and ""
    where a pass lacks it): each pass against the passes either side of it where ``paired``,
    else the means.  Steadier than files/s on a shared host: a pass of 10,000 files lasts a
    few seconds, too short to average out a neighbour's bursts, where CPU time is counted as
    it is spent (the run of 1bb42f3: files/s 64 - 165 % of the baseline's, CPU per file
    1.08 - 1.48x)."""
    if not mine or not baseline:
        return None, ""
    if paired and len(baseline) == len(mine) + 1:  # a pass may lack the figure
        ratios = _against_neighbours(mine, baseline)
        return _mean(ratios), (f"; daemon CPU per file {_mean(ratios):.2f}x theirs "
                               f"({_span(ratios, '.2f')}x)")
    ratio = _mean(mine) / _mean(baseline)
    return ratio, f"; daemon CPU per file {ratio:.2f}x theirs"


def rows(results: dict) -> list[tuple[str, str, str]]:
    """(what, cachefs, the tree directly): the table of the issue, measured."""
    big, settings = results["big"], results["settings"]
    files = settings["files"]
    costs = per_file(results)
    empty, passes, local = big["empty"], big["passes"], big["local"]
    steady, local_rates = _rates(passes["steady"]), _rates(local["passes"])
    share = [s / _mean(local_rates) for s in steady]
    out = [
        ("daemon RSS, empty", _mib(big["rss_empty_bytes"]), ""),
        ("daemon RSS after `cachefs warm` of every file",
         f"{_mib(big['rss_after_warm_bytes'])} "
         f"({costs['daemon_rss_bytes_after_warm']:,.0f} B per file)", ""),
        ("daemon RSS after a read pass through the mount (after more passes)",
         f"{_mib(big['rss_after_read_bytes'])} ({_mib(big['rss_after_steady_bytes'])}; "
         f"{costs['daemon_rss_bytes_after_read']:,.0f} B per file)", ""),
        ("`cachefs warm` client peak RSS (a list of every path)",
         f"{_mib(big['warm']['client_peak_rss_bytes'])}"
         + (f" ({_mib(results['small']['warm']['client_peak_rss_bytes'])} at "
            f"{settings['small_files']:,})" if results.get("small") else ""), ""),
        ("warm rate", f"{big['warm']['files_per_second']:,.0f} files/s, "
         f"{big['warm']['daemon_cpu_us_per_file']:,.0f} us of daemon CPU per file", ""),
        ("`cachefs mount` to return: empty / full after a clean unmount / after kill -9",
         f"{_s(empty['mount_seconds'])} / {_s(big['mount_after_unmount_seconds'])} / "
         f"{_s(big['mount_after_kill_seconds'])} "
         f"({costs['start_us_per_cached_file_after_unmount']:,.1f} / "
         f"{costs['start_us_per_cached_file_after_kill']:,.1f} us per cached file)", ""),
        ("first read pass after that restart: clean / kill -9",
         f"{passes['after_restart']['files_per_second']:,.0f} / "
         f"{passes['after_kill']['files_per_second']:,.0f} files/s, "
         f"{costs['first_pass_after_restart_daemon_cpu_us']:,.0f} / "
         f"{costs['first_pass_after_kill_daemon_cpu_us']:,.0f} us per file", ""),
        ("read pass right after the warm", f"{passes['after_warm']['files_per_second']:,.0f} "
         f"files/s, {passes['after_warm']['daemon_cpu_us_per_file']:,.0f} us per file", ""),
        ("steady read pass through the mount",
         f"{_span(steady)} files/s = {_span([100 * s for s in share])} % of local, "
         f"{_span(_cpus(passes['steady']))} us per file{_parts(passes['steady'])}",
         f"{_span(local_rates)} files/s"),
    ]
    out += _pages_only_row("the steady passes", passes.get("steady_pages_only"))
    for variant, flags in COVERING_VARIANTS:
        covered = passes.get(f"steady_{variant}")
        if covered:
            named = " and ".join(f"`{flag}`" for flag in flags)
            out.append((f"the same, {named} covering every file",
                        f"{_pass_figures(covered)}; daemon RSS "
                        f"{_mib(big[f'rss_{variant}_bytes'])}", ""))
            out += _pages_only_row(f"{named} covering",
                                   passes.get(f"steady_{variant}_pages_only"))
    small = results.get("small")
    if small:
        out.append((f"steady read pass at {settings['small_files']:,} files",
                    _pass_figures(small["steady"]), f"{_span(_rates(small['local']))} files/s"))
        beside = local.get("small_beside")
        if beside:
            out.append((f"the tree of {settings['small_files']:,} files read directly in turns "
                        f"with that of {files:,} (its passes above)", "",
                        f"{_span(_rates(beside))} files/s; {files:,} files at "
                        f"{_tree_share(local):.0%} of its rate"))
        for suffix, _ in _DROPPED:
            revalidated = _revalidated_passes(small, suffix)
            if revalidated:
                paired = " (read beside the passes above)" if small.get("paired") else ""
                how = ", only the pages dropped before each pass" if suffix else ""
                out.append((f"the same, every file revalidated (as a pass of {files:,} files "
                            f"outlasting --revalidate {DEFAULT_REVALIDATE_SECONDS:.0f} s "
                            f"does){paired}{how}", _pass_figures(revalidated), ""))
    within = passes.get("steady_within")
    if within:
        out.append((f"steady read pass at {files:,} files within --revalidate (longer than a "
                    "pass), both bounds covering every file", _pass_figures(within), ""))
        beside = big.get("baseline_within")
        if small and beside:
            out.append((f"the same at {settings['small_files']:,} files, read beside those "
                        "passes", _pass_figures(beside), ""))
    tree = local["walks"]
    out += [
        ("`cachefs status` / `cachefs unmount` (the cache full)",
         f"{_s(big['status_seconds'])} / {_s(big['unmount_seconds'])} (empty: "
         f"{_s(empty['status_seconds'])} / {_s(empty['unmount_seconds'])})", ""),
        ("`find` of the whole mount, dentries dropped / again",
         f"{_s(empty['walks']['find']['first'])} / {_s(empty['walks']['find']['again'])}",
         f"{_s(tree['find']['first'])} / {_s(tree['find']['again'])}"),
        ("`ls -lR` of the whole mount, dentries dropped / again",
         f"{_s(empty['walks']['ls']['first'])} / {_s(empty['walks']['ls']['again'])}",
         f"{_s(tree['ls']['first'])} / {_s(tree['ls']['again'])}"),
        ("daemon RSS after `find`, after `ls -lR` (an empty cache)",
         f"{_mib(empty['rss_after_find_bytes'])}, {_mib(empty['rss_after_ls_bytes'])}", ""),
        ("cache directory", f"{_mib(big['cache_dir_bytes'])} for "
         f"{_mib(files * settings['size'])} of data", ""),
    ]
    return out


def _pass_figures(passes: list[dict]) -> str:
    return (f"{_span(_rates(passes))} files/s, {_span(_cpus(passes))} us per file"
            f"{_parts(passes)}")


def _pages_only_row(what: str, passes: list[dict] | None) -> list[tuple[str, str, str]]:
    """The row of ``what`` (the passes of the row above) with only the pages dropped before
    each (none in a run from before them)."""
    if not passes:
        return []
    return [(f"{what}, only the pages dropped before each pass", _pass_figures(passes), "")]


def _revalidated_passes(small: dict, suffix: str) -> list[dict]:
    """Every pass of the small tree revalidating every file, with the drop of ``suffix``:
    those read beside the big tree's passes, or, in a run from before that, apart."""
    paired = [p for key, passes in small.get("paired", {}).items()
              if key.endswith("_pages_only") == bool(suffix) for p in passes]
    return paired or _read_apart(small, suffix)


COST_LABELS = {
    "daemon_rss_bytes_after_warm": ("daemon RSS after warm", "B"),
    "daemon_rss_bytes_after_read": ("daemon RSS after warm and read passes", "B"),
    "daemon_rss_bytes_after_find": ("daemon RSS after a find (empty cache)", "B"),
    "daemon_rss_bytes_after_ls": ("daemon RSS after find and ls -lR (empty cache)", "B"),
    "warm_client_bytes_per_path": ("warm client RSS per path of its list", "B"),
    "warm_daemon_cpu_us": ("daemon CPU per file warmed", "us"),
    "steady_daemon_cpu_us": ("daemon CPU per file, steady read", "us"),
    "first_pass_after_restart_daemon_cpu_us": ("daemon CPU per file, first read after a "
                                               "clean restart", "us"),
    "first_pass_after_kill_daemon_cpu_us": ("daemon CPU per file, first read after kill -9",
                                            "us"),
    "start_us_per_cached_file_after_unmount": ("start per cached file, after a clean unmount",
                                               "us"),
    "start_us_per_cached_file_after_kill": ("start per cached file, after kill -9", "us"),
}


def _cost_rows(results: dict) -> list[tuple[str, str]]:
    out = []
    for key, value in per_file(results).items():
        label, unit = COST_LABELS[key]
        out.append((label, "—" if value is None else f"{value:,.1f} {unit}"))
    return out


def _mark(met: bool | None) -> str:
    return {True: "met", False: "MISSED", None: "—"}[met]


def table(results: dict) -> str:
    """The console's text: the table, the per-file costs, the verdicts."""
    settings = results["settings"]
    lines = [f"bench.scale: {settings['files']:,} files of {settings['size']:,} bytes, f = 1, "
             f"a local tree as the remote, {settings['readers']} readers, pages, dentries and "
             f"inodes dropped before each pass (only the pages where said); "
             f"commit {results['source']['commit']}"
             + (f" (cachefs of {results['source']['measured_tree']})"
                if results["source"].get("measured_tree") else "") + ", "
             f"{results['machine']['cores']} cores, {results['seconds']:,.0f} s", ""]
    width = max(len(r[0]) for r in rows(results))
    for what, mine, tree in rows(results):
        lines.append(f"{what:<{width}}  {mine}" + (f"  [tree: {tree}]" if tree else ""))
    lines += ["", "per file:"]
    lines += [f"  {label}: {value}" for label, value in _cost_rows(results)]
    lines += ["", "targets:"]
    lines += [f"  {_mark(v['met']):<6} {v['target']}: {v['measured']}"
              for v in results["verdicts"]]
    return "\n".join(lines)


def markdown(results: dict) -> str:
    settings, m = results["settings"], results["machine"]
    out = [f"# bench.scale: {settings['files']:,} files of {settings['size']:,} bytes", "",
           f"f = 1, a local tree as the remote (cachefs mounted directly over it), "
           f"{settings['readers']} reader processes, pages, dentries and inodes dropped before "
           f"each pass (only the pages where said), "
           f"directories of {settings['files_per_directory']:,} files, the cache on "
           f"{'a fresh journaled ext4' if settings['cache_disk'] == 'ext4' else 'the root fs'}, "
           f"--passthrough {settings['passthrough']}; passes repeated {settings['repeats']} "
           f"times (ranges).", "",
           f"Commit {results['source']['commit']} ({results['source']['uncommitted_files']} "
           f"files changed"
           + (f"; cachefs of {results['source']['measured_tree']}"
              if results["source"].get("measured_tree") else "")
           + f"), {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux "
           f"{m['kernel']}, {m['date']}; load average {m['load_average']} before, "
           f"{m.get('load_average_after')} after; {results['seconds']:,.0f} s.", "",
           "| what | cachefs | the tree directly |", "|---|---|---|"]
    out += [f"| {what} | {mine} | {tree} |" for what, mine, tree in rows(results)]
    out += ["", "## Per file", "", "| cost | per file |", "|---|---|"]
    out += [f"| {label} | {value} |" for label, value in _cost_rows(results)]
    out += ["", "## Targets", "", "| target | verdict | measured |", "|---|---|---|"]
    out += [f"| {v['target']} | {_mark(v['met'])} | {v['measured']} |"
            for v in results["verdicts"]]
    return "\n".join(out) + "\n"


def write(results: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "latest.json", out_dir / "latest.md"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(markdown(results))
    return paths


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python3 -m bench.scale_report RESULTS.json", file=sys.stderr)
        return 2
    path = Path(args[0])
    results = json.loads(path.read_text())
    results["verdicts"] = verdicts(results)
    write(results, path.parent)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
