"""The newcomer's first command: train on a synthetic dataset behind an emulated slow remote.

    python3 -m bench.demo

Generates a small ImageNet-like dataset (once, into bench/work/), starts the emulated EFS-like
remote and runs the same torch training loop four ways: reading the remote directly; through
cachefs keeping a fifth of the files, with the client's prefetch hints; and through cachefs
keeping every file, read through the mount and through the client. Each runs two epochs: the
first fills the cache, the second runs flat out. Prints the epochs, then what cachefs did for
the loop. About a minute; every mount is gone when it ends. Takes the flags of
``python3 -m bench.run`` (``--help``).
"""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.table import Table

from bench import report, targets
from bench.run import measured, run
from bench.settings import build_parser, settings_from_args

# What each variant of the demo stands for, in the order shown.
WAYS = {
    "direct": "the remote, directly",
    "cachefs-f0.2-hints": "cachefs f = 0.2, client",
    "cachefs-f1": "cachefs f = 1, mount",
    "cachefs-f1-hints": "cachefs f = 1, client",
}
CAPTION = ("mount: a plain DataLoader reading the mount; client: cachefs_client's DataLoader, "
           "which hints the next batches and reads cached files over the control socket")
MIB = 2**20


def _flat_out(variant: dict) -> dict | None:
    """The last epoch: the steady state, without the simulated GPU step when there is one."""
    return variant["epochs"][-1] if variant["epochs"] else None


def summary_table(results: dict) -> Table:
    """Samples/s of the last epoch of each way, against the remote read directly."""
    by_name = {v["variant"]: v for v in results["variants"]}
    direct = _flat_out(by_name["direct"]) if "direct" in by_name else None
    table = Table(title="The last epoch of each (the cache already filled)", title_justify="left",
                  caption=CAPTION, caption_justify="left")
    for column in ("way to the data", "samples/s", "x remote", "hit ratio", "remote MiB"):
        table.add_column(column, justify="left" if column == "way to the data" else "right")
    for name, way in WAYS.items():
        variant = by_name.get(name)
        epoch = _flat_out(variant) if variant else None
        if epoch is None:
            continue
        figures = targets.epoch_figures(variant, epoch, results["dataset"]["bytes"])
        speedup = (f"{epoch['samples_per_second'] / direct['samples_per_second']:.1f}x"
                   if direct and direct["samples_per_second"] else "-")
        hit = figures["hit_ratio"]
        table.add_row(way, f"{epoch['samples_per_second']:,.0f}", speedup,
                      "-" if hit is None else f"{hit:.3f}",
                      f"{(figures['remote_bytes'] or 0) / MIB:,.0f}")
    return table


def findings(results: dict) -> list[str]:
    """What the run shows, as sentences; a line starting with "!" is a real problem."""
    lines = []
    share = results["dataset"].get("eligible_share", {}).get("0.2")
    by_name = {v["variant"]: v for v in results["variants"]}
    kept = by_name.get("cachefs-f0.2-hints")
    if kept and kept["epochs"] and share is not None:
        epoch = _flat_out(kept)
        ratio = targets.epoch_figures(kept, epoch, results["dataset"]["bytes"])["hit_ratio"]
        if ratio is not None and abs(ratio - share) <= targets.HIT_RATIO_TOLERANCE:
            lines.append(f"At f = 0.2 the hash keeps {share:.1%} of these files (each file with "
                         f"probability 0.2), and {ratio:.1%} of the opens were cache hits: "
                         "the kept files are always there, whatever the order of the epoch.")
        elif ratio is not None:
            lines.append(f"! At f = 0.2 the hit ratio was {ratio:.3f}, but the hash keeps "
                         f"{share:.3f} of these files: they should match.")
    for v in results["variants"]:
        if v["error"]:
            lines.append(f"! {v['variant']} failed: {v['error']}")
    cores = os.cpu_count() or 1
    if cores <= 4:
        lines.append(f"This machine has {cores} cores, shared by the loader's "
                     f"{results['settings']['workers']} workers, the emulated remote and "
                     "cachefs: on a GPU node with more cores the cached ways pull further ahead.")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("python3 -m bench.demo", __doc__.strip().splitlines()[0],
                          quick_flag=False)
    settings = settings_from_args(parser, argv, "demo")
    console = Console(highlight=False)
    progress = Console(stderr=True, highlight=False)
    with progress.status("preparing the dataset and the emulated remote") as status:
        def log(line: str) -> None:
            # Epoch lines stay on screen; a variant's name starts the next wait.
            if line.endswith(":") and not line.startswith(" "):
                status.update(f"measuring {WAYS.get(line[:-1], line[:-1])} ...")
            else:
                print(line, file=sys.stderr, flush=True)
        results, failed = measured("demo", lambda: run(settings, log))
        if failed:
            return failed
    report.write(results, settings.out_dir)
    print()
    print(report.console_table(results))
    console.print()
    console.print(summary_table(results))
    console.print()
    notes = findings(results)
    for line in notes:
        console.print(line)
    console.print(f"\nFull results: {settings.out_dir / 'latest.md'}. The whole comparison "
                  "(rclone, other fractions, the local disk): python3 -m bench.run")
    return 1 if any(line.startswith("!") for line in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
