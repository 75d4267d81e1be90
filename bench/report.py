"""Writing a run's results: latest.json (raw), latest.md (tables and verdicts), latest.png.

Redraw the Markdown and the plot from a run's JSON (verdicts recomputed)::

    python3 -m bench.report bench/results/latest.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from bench import plot, targets
from bench.filerate import CACHEFS_SETTINGS

MIB = 2**20


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value / MIB:.1f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _share(value: float, of: float | None) -> str:
    return "—" if not of else f"{value / of:.0%}"


def _count(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def epoch_rows(results: dict) -> list[dict]:
    """One row per variant and epoch, with the derived figures; failed variants get one row."""
    total = results["dataset"]["bytes"]
    rows = []
    for v in results["variants"]:
        if v["error"] and not v["epochs"]:
            rows.append({"variant": v["variant"], "error": v["error"]})
            continue
        for e in v["epochs"]:
            rows.append({"variant": v["variant"], "error": None, **e,
                         **targets.epoch_figures(v, e, total),
                         "ceiling": targets.ceiling(results, v, e)})
    return rows


STEP_OVERSHOOT_NOTED = 0.05


def _load(values: list[float] | None) -> str:
    return "unknown" if not values else ", ".join(f"{x:.1f}" for x in values)


def _step_overshoot(results: dict, step_ms: float) -> float:
    """How much longer than asked the simulated step took, at worst over paced epochs."""
    worst = 0.0
    for v in results["variants"]:
        for e in v["epochs"]:
            batches = -(-e["samples"] // results["settings"]["batch"])
            asked = batches * step_ms / 1000
            if e["paced"] and asked > 0 and "step_seconds" in e:
                worst = max(worst, e["step_seconds"] / asked - 1)
    return worst


def _epoch_label(row: dict) -> str:
    return str(row["epoch"]) + ("" if row["paced"] else " (unpaced)")


def console_table(results: dict) -> str:
    """The per-epoch table as plain text, for a terminal."""
    header = (f"{'variant':<20} {'epoch':>12} {'samples/s':>10} {'ceiling':>8} {'stall':>7} "
              f"{'p99 wait':>9} "
              f"{'hit ratio':>9} {'remote MiB':>11} {'floor MiB':>10} {'daemon us/file':>14} "
              f"{'remote us/file':>14} {'CPUs busy':>9}")
    lines = [header, "-" * len(header)]
    for row in epoch_rows(results):
        if row["error"]:
            lines.append(f"{row['variant']:<20} FAILED: {row['error']}")
            continue
        lines.append(
            f"{row['variant']:<20} {_epoch_label(row):>12} {row['samples_per_second']:>10.0f} "
            f"{_rate(row['ceiling']):>8} "
            f"{row['stall_fraction']:>7.1%} {row['wait_p99_ms']:>7.1f}ms "
            f"{_ratio(row['hit_ratio']):>9} {_mib(row['remote_bytes']):>11} "
            f"{_mib(row['floor_bytes']):>10} {_us(row['daemon_us_per_file']):>14} "
            f"{_us(row['remote_us_per_file']):>14} {_busy(row):>9}")
    return "\n".join(lines)


def _busy(row: dict, stolen: bool = False) -> str:
    """The share of the machine's CPU time not idle over the epoch (and of it stolen by the
    hypervisor): near 100 %, the CPUs set the rate, not the path."""
    busy = row.get("machine_busy")
    if busy is None:
        return "-"
    return f"{busy:.0%}" + (f" ({row['machine_steal']:.0%})" if stolen else "")


def _verdict_text(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "n/a"}[met]


def markdown(results: dict, png_name: str | None) -> str:
    s = results["settings"]
    m = results["machine"]
    d = results["dataset"]
    out = ["# cachefs benchmark", ""]
    out += [f"Run of {m['date']} on {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB RAM, "
            f"Linux {m['kernel']} (Python {m['python']}, torch {m['torch']}, {m['rclone']}); "
            f"{results['seconds']:.0f} s in all. Load average (1, 5, 15 min) "
            f"{_load(m.get('load_average'))} at the start, "
            f"{_load(m.get('load_average_after'))} at the end (the end figure counts the "
            "benchmark's own workers and daemons).", ""]
    # Only the load before the run tells of other work: the run itself loads the machine.
    busiest = (m.get("load_average") or [0])[0]
    if busiest > m["cores"]:
        out += [f"> **The machine was busy with other work** (load average {busiest:.0f} on "
                f"{m['cores']} cores): every variant got a fraction of the CPU, the FUSE daemons "
                "(Python) most of all, so the figures are lower and noisier than on an idle "
                "machine. Compare variants within this run only.", ""]
    src = results.get("source")
    if src:
        out += [f"Measured code: commit {src['commit']}"
                + (f" with {src['uncommitted_files']} uncommitted file(s) in cachefs/ and client/"
                   if src["uncommitted_files"] else "") + ".", ""]
    overshoot = _step_overshoot(results, s["step_ms"])
    if overshoot > STEP_OVERSHOOT_NOTED:
        out += [f"> The simulated GPU step took up to {overshoot:.0%} longer than asked "
                "(sleep on a busy machine): paced samples/s are that much lower than the loader "
                "alone would allow.", ""]
    out += [f"Dataset `{d['name']}`: {d['examples']:,} examples in {d['files']:,} files, "
            f"{d['bytes'] / MIB:.0f} MiB, behind an emulated `{s['profile']}` remote "
            + (f"with its bandwidth at {s['bandwidth_mbps']:g} MB/s "
               if s.get("bandwidth_mbps") else "")
            + "(bench/emulator/slowfs.py). "
            f"DataLoader: {s['workers']} workers, batch {s['batch']}, shuffled; a simulated GPU "
            f"step of {s['step_ms']:.1f} ms per batch, so a pace of {s['pace']:.0f} samples/s; "
            f"{s['epochs']} paced epoch(s) per variant"
            + (f" then {s['unpaced_epochs']} without the step (the loader's capacity)"
               if s["unpaced_epochs"] else "")
            + "; page cache dropped before every epoch. Each variant ran in a process of its "
            "own, on a fresh cache.", ""]
    budgets = [f"`{v['variant']}` {v['cache_size_bytes'] / MIB:.0f} MiB"
               for v in results["variants"] if v.get("cache_size_bytes") and not v["hints"]]
    if budgets:
        out += ["Cache budgets (what the files cachefs keeps occupy, plus 2 % and 8 MiB for the "
                "index; rclone gets the budget of cachefs at f = 0.2): "
                + ", ".join(budgets) + ".", ""]
    out += ["Settings: `" + json.dumps({k: v for k, v in s.items()
                                         if k not in ("out_dir", "work_dir")}) + "`", ""]

    reaches = targets.machine_reaches_pace(results, s["step_ms"])
    if reaches is False:
        out += [f"> **This machine cannot keep a pace of {s['pace']:.0f} samples/s even from "
                "its local disk** (the `local` variant misses it), so no variant can: "
                "rerun with a lower `--pace` to compare the variants at a pace the machine "
                "can feed.", ""]
    elif reaches is None:
        out += ["> The `local` variant was not measured: whether the machine itself keeps the "
                "pace is unknown.", ""]

    out += ["## Targets", "", "| target | variant | measured | verdict |", "|---|---|---|---|"]
    for v in results["verdicts"]:
        out.append(f"| {v['target']} | {v['variant']} | {v['measured']} | "
                   f"{_verdict_text(v['met'])} |")
    meeting = [v["variant"] for v in results["variants"]
               if targets.meets_pace(v, s["step_ms"])]
    out += ["", f"Variants that keep the pace of {s['pace']:.0f} samples/s: "
            + (", ".join(f"`{n}`" for n in meeting) if meeting else "none") + ".", ""]

    out += ["## Per epoch", "",
            "Hit ratio: cachefs's own (file opens served wholly by the cache); for the other "
            "variants, the share of bytes read that the remote did not serve. Remote MiB: "
            "cachefs's `cachefs_remote_read_bytes_total`, else what the emulated remote served; "
            "in brackets what the emulated remote served to cachefs. Floor: (1 - f) x dataset. "
            "CPU per file (user + system, all threads, from /proc): the cachefs daemon's per "
            "file read through it, the emulated remote's per file it opened. Ceiling: the most "
            "samples/s the remote allows the epoch, its bandwidth over (1 - f) of a mean "
            "sample (all of it in a cache's first epoch), or the local copy's if lower.",
            "",
            "| variant | epoch | samples/s | ceiling | of ceiling | stall | wait p50 ms | "
            "wait p99 ms | hit ratio | remote MiB | floor MiB | daemon us/file | "
            "remote us/file | CPUs busy (stolen) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in epoch_rows(results):
        if row["error"]:
            out.append(f"| {row['variant']} | failed: {row['error']} | | | | | | | | | | | | |")
            continue
        remote = _mib(row["remote_bytes"])
        if row["variant"].startswith("cachefs") and row["emulator_bytes"] is not None:
            remote += f" ({_mib(row['emulator_bytes'])})"
        out.append(
            f"| {row['variant']} | {_epoch_label(row)} | {row['samples_per_second']:.0f} | "
            f"{_rate(row['ceiling'])} | {_share(row['samples_per_second'], row['ceiling'])} | "
            f"{row['stall_fraction']:.1%} | {row['wait_p50_ms']:.1f} | {row['wait_p99_ms']:.1f} "
            f"| {_ratio(row['hit_ratio'])} | {remote} | {_mib(row['floor_bytes'])} "
            f"| {_us(row['daemon_us_per_file'])} | {_us(row['remote_us_per_file'])} "
            f"| {_busy(row, stolen=True)} |")
    hinted = [r for r in epoch_rows(results) if not r["error"] and r["variant"].endswith("-hints")]
    if hinted:
        out += ["", "Prefetch outcome of the hinted variants (cachefs counters per epoch; "
                "`wasted`: fetched but never served to a reader, so those bytes crossed the "
                "network for nothing).", "",
                "| variant | epoch | hints accepted | hints dropped | prefetched, used | "
                "prefetched, wasted | failed |", "|---|---|---|---|---|---|---|"]
        for row in hinted:
            c = row["counters"]
            out.append(f"| {row['variant']} | {_epoch_label(row)} | "
                       f"{c.get('cachefs_hints_accepted', 0):.0f} | "
                       f"{c.get('cachefs_hints_dropped', 0):.0f} | "
                       f"{c.get('cachefs_prefetch_used', 0):.0f} | "
                       f"{c.get('cachefs_prefetch_wasted', 0):.0f} | "
                       f"{c.get('cachefs_prefetch_failed', 0):.0f} |")
    failed = [v for v in results["variants"] if v["error"]]
    if failed:
        out += ["", "Failures:", ""]
        out += [f"* `{v['variant']}`: {v['error']}" for v in failed]

    out += _section("cachefs f = 1 with hints and the local copy, in turns",
                    results.get("alternating"), _alternating_lines)
    out += _section("The plain first epoch and the remote read directly, in turns",
                    results.get("first_epochs"), _first_epoch_lines)
    out += _section("Files/s on a warm cache", results.get("files_per_second"),
                    _files_per_second_lines)
    out += _section("Misses against a fast remote", results.get("fast_remote"),
                    _fast_remote_lines)
    if png_name:
        out += ["", f"![samples/s and stall per epoch]({png_name})"]
    return "\n".join(out) + "\n"


def _section(title: str, measured: dict | None, lines: Callable[[dict], list[str]]
             ) -> list[str]:
    """A section of its own for a measurement the run made: its heading, then what
    ``lines`` makes of it, or the one line that says why it failed; nothing if not made."""
    if not measured:
        return []
    heading = ["", f"## {title}", ""]
    if measured.get("error"):
        return heading + [f"Failed: {measured['error']}"]
    return heading + lines(measured)


def _alternating_lines(turns: dict) -> list[str]:
    return [
        "Both loaders started once, then one unpaced epoch each in turns (the order swapped "
        "every round; a first round started the workers and is not counted), so that each "
        "pair is measured within seconds. The share-of-local target is judged on the median "
        f"share: {turns['share']:.0%}.", "",
        "| round | local, samples/s | cachefs f = 1 hints, samples/s | share | hit ratio | "
        "remote MiB |", "|---|---|---|---|---|---|",
        *(f"| {number} | {r['local']:,.0f} | {r['cachefs']:,.0f} | {r['share']:.0%} | "
          f"{_ratio(r['hit_ratio'])} | {_mib(r['remote_bytes'])} |"
          for number, r in enumerate(turns["rounds"], 1))]


def _first_epoch_lines(turns: dict) -> list[str]:
    return [
        "Both loaders started once, then one paced epoch each in turns (the order swapped "
        "every round; a first round started the workers and is not counted), cachefs each "
        f"time at f = {turns['fraction']:g} without hints on a fresh, empty cache: every file "
        "comes from the remote in both. The first-epoch target is judged on the median "
        f"ratio: {turns['ratio']:.2f}x.", "",
        "| round | the remote directly, samples/s | cachefs, samples/s | ratio |",
        "|---|---|---|---|",
        *(f"| {number} | {r['direct']:,.0f} | {r['cachefs']:,.0f} | {r['ratio']:.2f}x |"
          for number, r in enumerate(turns["rounds"], 1))]


def _files_per_second_lines(fps: dict) -> list[str]:
    return [f"{fps['files']:,} files of {fps['file_bytes'] // 1024} KiB read whole by "
            f"{fps['threads']} threads in a shuffled order (no DataLoader), cachefs at "
            "f = 1.0 after one pass filled its cache, no hints.", "",
            "| path | files/s, page cache dropped (best of passes) | files/s through "
            "the daemon (best of passes) | files/s, page cache kept |",
            "|---|---|---|---|",
            f"| local copy | {fps['local']['cold']:,} ({fps['local']['cold_passes']}) | "
            f"— | {fps['local']['page_cache']:,} |",
            *(f"| {_fps_label(args)} | {fps[name]['cold']:,} "
              f"({fps[name]['cold_passes']}) | {_count(fps[name].get('daemon'))} "
              f"({fps[name].get('daemon_passes', '—')}) | "
              f"{fps[name]['page_cache']:,} |"
              for name, args in CACHEFS_SETTINGS.items() if name in fps),
            "", "Through the daemon: the cache disk's pages kept, the mount's dropped, so "
            "every read is a FUSE request served by cachefs and none waits on the disk "
            "(what a Python passthrough of warm files does). Page cache kept: the kernel "
            "keeps a file's pages across opens while the file is unchanged; with "
            "`--revalidate never` (a dataset that never changes) it also keeps "
            "attributes and entries, and cachefs never asks the remote.", "",
            f"cachefs hit ratio during the measured passes: "
            f"{_ratio(fps['cachefs']['hit_ratio'])}, remote bytes "
            f"{_mib(fps['cachefs']['remote_bytes'])} MiB."]


def _fast_remote_lines(fast: dict) -> list[str]:
    return [
        f"The local tree itself as the remote (no emulator: nothing but the daemon between the "
        f"readers and the bytes), {fast['files']:,} files of {fast['file_bytes'] // 1024} KiB "
        f"read whole by {fast['readers']} processes, the page cache dropped before each pass; "
        "cachefs on an empty cache at f = 1 (every open a fill) and at f = 0 (every open a file "
        "not kept). Daemon CPU: user + system of the serving process and its children, from "
        "/proc, per file.", "",
        "| round | the tree directly, files/s | fill, files/s (share) | fill, daemon CPU per "
        "file | not kept, files/s (share) | not kept, daemon CPU per file |",
        "|---|---|---|---|---|---|",
        *(f"| {number} | {r['tree']:,} | {r['fill']:,} ({r['fill'] / r['tree']:.0%}) | "
          f"{r['fill_us']} us | {r['not_kept']:,} ({r['not_kept'] / r['tree']:.0%}) | "
          f"{r['not_kept_us']} us |" for number, r in enumerate(fast["rounds"], 1))]


def _fps_label(args: tuple[str, ...]) -> str:
    """A files/s row of cachefs, named by the flags it was mounted with."""
    return f"cachefs, `{' '.join(args)}`" if args else "cachefs"


def write(results: dict, out_dir: Path, stem: str = "latest") -> list[Path]:
    """Write the JSON, the plot and the Markdown; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    png_path = out_dir / f"{stem}.png"
    drawn = plot.draw(results, png_path)
    md_path = out_dir / f"{stem}.md"
    md_path.write_text(markdown(results, png_path.name if drawn else None))
    return [md_path, json_path] + ([png_path] if drawn else [])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].endswith(".json"):
        print("usage: python3 -m bench.report RESULTS.json", file=sys.stderr)
        return 2
    path = Path(args[0])
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"bench.report: cannot read {path}: {exc}", file=sys.stderr)
        return 1
    results["verdicts"] = targets.evaluate(results)
    for written in write(results, path.parent, path.stem):
        print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
