"""The settings of a benchmark run, their presets (full, quick, demo) and the command-line flags.

A bad flag or value ends the program with one line naming it and a non-zero exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench import variants as variants_mod
from bench.dataset import DEFAULT_MEAN_KIB, KIND_IMAGES, KINDS, DatasetSpec
from bench.emulator.slowfs import PROFILES
from cachefs.sizes import parse_size

BENCH_DIR = Path(__file__).resolve().parent
# ResNet-50 on a V100: n = 128 examples every t = 87 ms, about 1,457 examples/s (NOTES.md).
V100_BATCH = 128
V100_PACE = 1457.0


@dataclass
class RunSettings:
    examples: int
    epochs: int
    unpaced_epochs: int
    workers: int
    batch: int
    pace: float  # samples/s the simulated accelerator consumes; the step is batch / pace
    profile: str
    fps_files: int  # 64 KiB files for the files/s measurement; 0 skips it
    share_rounds: int  # epochs each of f = 1 with hints and the local copy, in turns; 0 skips
    # first epochs each of the remote directly and of cachefs on an empty cache, in turns
    # (bench/firstepoch.py); 0 skips them
    first_rounds: int
    # 64 KiB files for the misses against a fast remote (bench/fastremote.py); 0 skips them
    fast_files: int
    fast_rounds: int
    out_dir: Path
    work_dir: Path = BENCH_DIR / "work"
    dataset_kind: str = KIND_IMAGES
    mean_kib: float = DEFAULT_MEAN_KIB
    shards: int = 4
    seed: int = 0
    fractions: tuple[float, ...] = variants_mod.DEFAULT_FRACTIONS
    variant_names: str | None = None
    fps_threads: int = 8
    variant_timeout_s: float = 900.0
    # The remote's link in MB/s, in place of its profile's (None: the profile's).
    bandwidth_mbps: float | None = None
    variants: list = field(default_factory=list)

    @property
    def step_ms(self) -> float:
        return 1000.0 * self.batch / self.pace

    def dataset_spec(self) -> DatasetSpec:
        return DatasetSpec(kind=self.dataset_kind, examples=self.examples,
                           mean_kib=self.mean_kib, seed=self.seed, shards=self.shards)

    def fps_spec(self) -> DatasetSpec:
        return DatasetSpec(examples=self.fps_files, mean_kib=64.0, seed=self.seed,
                           fixed_size=True)

    def public(self) -> dict:
        """The settings as recorded next to the results."""
        out = dataclasses.asdict(self)
        out.pop("variants")
        out["variants"] = [v.name for v in self.variants]
        out["step_ms"] = round(self.step_ms, 2)
        for key in ("out_dir", "work_dir"):
            out[key] = str(out[key])
        return out


PRESETS = {
    # About 10-15 minutes on 2 cores: enough files that an epoch lasts seconds at the pace.
    "full": dict(examples=3000, epochs=3, unpaced_epochs=2, workers=8, batch=V100_BATCH,
                 pace=V100_PACE, profile="efs", fps_files=3000, share_rounds=10,
                 first_rounds=6, fast_files=4000, fast_rounds=3, out_dir=BENCH_DIR / "results"),
    # The CI smoke run: every variant, two epochs (the second is the steady state), small.
    "quick": dict(examples=320, epochs=2, unpaced_epochs=0, workers=4, batch=32,
                  pace=V100_PACE, profile="efs", fps_files=200, share_rounds=1,
                  first_rounds=1, fast_files=200, fast_rounds=1,
                  out_dir=BENCH_DIR / "results" / "quick"),
    # The README's first command, about a minute: the remote directly, then cachefs keeping a
    # fifth of the files with hints, and all of them read through the mount and through the
    # client. The first epoch fills the cache; the second runs flat out.
    "demo": dict(examples=1500, epochs=1, unpaced_epochs=1, workers=8, batch=64,
                 pace=V100_PACE, profile="efs", fps_files=0, share_rounds=0,
                 first_rounds=0, fast_files=0, fast_rounds=0,
                 out_dir=BENCH_DIR / "results" / "demo",
                 variant_names="direct,cachefs-f0.2-hints,cachefs-f1,cachefs-f1-hints"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of a usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError
    return value


def count_arg(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError
    return value


def size_arg(text: str) -> int:
    """A size in bytes as people write it (65536, 64KiB, 2G), for an argument's ``type``."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError
    return value


positive_int.__name__ = "positive integer"
count_arg.__name__ = "count (integer >= 0)"
positive_float.__name__ = "positive number"


def build_parser(prog: str, description: str, *, quick_flag: bool) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=description)
    if quick_flag:
        p.add_argument("--quick", action="store_true",
                       help="a small smoke run (about 1-2 minutes) written to results/quick/")
    p.add_argument("--examples", type=positive_int, help="training examples (files or records)")
    p.add_argument("--mean-kib", type=positive_float, help="mean example size in KiB")
    p.add_argument("--dataset", choices=KINDS, help="images: one file per example; shards: "
                   "records at random offsets in a few large files")
    p.add_argument("--shards", type=positive_int, help="shard files of the shards dataset")
    p.add_argument("--epochs", type=positive_int, help="epochs at the pace per variant")
    p.add_argument("--unpaced-epochs", type=count_arg,
                   help="extra epochs without the GPU step, measuring what the loader can do")
    p.add_argument("--workers", type=count_arg, help="DataLoader workers")
    p.add_argument("--batch", type=positive_int, help="batch size n")
    pace = p.add_mutually_exclusive_group()
    pace.add_argument("--pace", type=positive_float,
                      help=f"samples/s the simulated GPU consumes (default {V100_PACE:g}, a V100 "
                      "on ResNet-50); the step is batch / pace")
    pace.add_argument("--step-ms", type=positive_float, help="simulated GPU step per batch, ms")
    p.add_argument("--profile", choices=sorted(PROFILES), help="latency profile of the remote")
    p.add_argument("--bandwidth-mbps", type=positive_float, help="the remote's bandwidth in MB/s, "
                   "in place of the profile's (a lower one lowers its ceiling, and with it the "
                   "CPU an epoch at the ceiling needs)")
    p.add_argument("--variants", help="comma-separated subset, e.g. direct,cachefs-f0.2-hints "
                   "(default: all)")
    p.add_argument("--fractions", help="cachefs fractions to measure, e.g. 0,0.2,0.5,1")
    p.add_argument("--fps-files", type=count_arg, help="64 KiB files for the warm-cache files/s "
                   "measurement (0 skips it)")
    p.add_argument("--fast-files", type=count_arg, help="64 KiB files for the misses against "
                   "a fast remote (the local tree itself as the remote: the daemon's own CPU "
                   "per miss; 0 skips them)")
    p.add_argument("--share-rounds", type=count_arg, help="unpaced epochs each of cachefs at "
                   "f = 1 with hints and of the local copy, taken in turns, for the "
                   "share-of-local target (0 skips it)")
    p.add_argument("--first-rounds", type=count_arg, help="first epochs each of the remote "
                   "read directly and of cachefs at f = 0.2 on an empty cache, taken in turns, "
                   "for the first-epoch target (0 skips them)")
    p.add_argument("--seed", type=count_arg, help="seed of the dataset and of the shuffling")
    p.add_argument("--out", type=Path, help="directory for the results")
    p.add_argument("--work-dir", type=Path, help="where datasets are generated and kept "
                   "(default bench/work)")
    return p


def settings_from_args(parser: argparse.ArgumentParser, argv: list[str] | None,
                       preset: str) -> RunSettings:
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if getattr(args, "quick", False):
        preset = "quick"
    settings = RunSettings(**PRESETS[preset])
    simple = {"examples": "examples", "mean_kib": "mean_kib", "dataset": "dataset_kind",
              "shards": "shards", "epochs": "epochs", "unpaced_epochs": "unpaced_epochs",
              "workers": "workers", "batch": "batch", "pace": "pace", "profile": "profile",
              "fps_files": "fps_files", "share_rounds": "share_rounds", "seed": "seed",
              "first_rounds": "first_rounds",
              "fast_files": "fast_files",
              "bandwidth_mbps": "bandwidth_mbps",
              "out": "out_dir", "work_dir": "work_dir", "variants": "variant_names"}
    for flag, attribute in simple.items():
        value = getattr(args, flag)
        if value is not None:
            setattr(settings, attribute, value)
    if args.step_ms is not None:
        settings.pace = 1000.0 * settings.batch / args.step_ms
    if settings.fast_files and not settings.fast_rounds:
        settings.fast_rounds = 1
    try:
        if args.fractions is not None:
            settings.fractions = variants_mod.parse_fractions(args.fractions)
        settings.variants = variants_mod.select(settings.variant_names, settings.fractions)
        settings.dataset_spec().check()
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    return settings
