"""Synthetic training datasets, generated once into a work directory and reused.

Two shapes, both deterministic from a seed and filled with random bytes so that nothing
compresses or deduplicates along the way:

* ``images``: an ImageNet-like tree, class directories of many files whose sizes vary like
  JPEGs (lognormal around a mean, clipped), one file per training example;
* ``shards``: a few large files (tar/TFRecord-like) holding records of about the same sizes,
  one record per training example, read at its offset.

A dataset lives in ``WORK/<name>/data`` with a ``manifest.json`` beside it that records the
parameters it was made with and every example (path, offset, length). It is regenerated only
when the parameters differ or the manifest is missing (an interrupted generation writes none).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KIND_IMAGES = "images"
KIND_SHARDS = "shards"
KINDS = (KIND_IMAGES, KIND_SHARDS)
MANIFEST = "manifest.json"
# ImageNet's JPEGs: mean about 110 KiB, a long tail; sigma of the log-size fitted loosely.
DEFAULT_MEAN_KIB = 110.0
DEFAULT_SIGMA = 0.5
# Clip the tail so that no single example dominates a small dataset.
MIN_KIB = 4.0
MAX_FACTOR = 6.0
FILES_PER_CLASS = 100
WRITE_BLOCK = 16 * 2**20


@dataclass(frozen=True)
class DatasetSpec:
    """What to generate; two equal specs give byte-identical datasets."""

    kind: str = KIND_IMAGES
    examples: int = 4000
    mean_kib: float = DEFAULT_MEAN_KIB
    sigma: float = DEFAULT_SIGMA
    seed: int = 0
    shards: int = 4
    fixed_size: bool = False  # every example exactly mean_kib (for the files/s measurement)

    def name(self) -> str:
        size = f"{self.mean_kib:g}k" + ("fixed" if self.fixed_size else f"s{self.sigma:g}")
        shards = f"-{self.shards}sh" if self.kind == KIND_SHARDS else ""
        return f"{self.kind}-{self.examples}x{size}{shards}-seed{self.seed}"

    def check(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown dataset kind {self.kind!r}: use one of {', '.join(KINDS)}")
        if self.examples < 1:
            raise ValueError("a dataset needs at least one example")
        if not MIN_KIB <= self.mean_kib <= 64 * 1024:
            raise ValueError(f"mean size must be between {MIN_KIB:g} KiB and 64 MiB")
        if self.kind == KIND_SHARDS and not 1 <= self.shards <= self.examples:
            raise ValueError("shards must be between 1 and the number of examples")


@dataclass(frozen=True)
class Example:
    """One training example: a whole file (offset 0, its length) or a record in a shard."""

    path: str  # relative to the dataset root
    offset: int
    length: int


@dataclass
class Dataset:
    spec: DatasetSpec
    root: Path
    examples: list[Example]

    @property
    def total_bytes(self) -> int:
        """Bytes one epoch reads: every example once."""
        return sum(e.length for e in self.examples)

    @property
    def files(self) -> list[str]:
        return sorted({e.path for e in self.examples})

    def file_sizes(self) -> dict[str, int]:
        return {path: os.path.getsize(self.root / path) for path in self.files}


def example_sizes(spec: DatasetSpec) -> list[int]:
    """Byte sizes of the examples: lognormal with the requested mean, clipped."""
    mean = spec.mean_kib * 1024
    if spec.fixed_size:
        return [int(mean)] * spec.examples
    rng = np.random.default_rng([spec.seed, 1])
    # For a lognormal, mean = exp(mu + sigma^2 / 2).
    mu = math.log(mean) - spec.sigma**2 / 2
    sizes = rng.lognormal(mu, spec.sigma, spec.examples)
    sizes = np.clip(sizes, MIN_KIB * 1024, MAX_FACTOR * mean)
    return [int(s) for s in sizes]


def _layout(spec: DatasetSpec, sizes: list[int]) -> list[Example]:
    if spec.kind == KIND_IMAGES:
        return [Example(f"n{i // FILES_PER_CLASS:05d}/img_{i:07d}.jpg", 0, size)
                for i, size in enumerate(sizes)]
    # Records go to shards round-robin, so every shard holds about as many bytes.
    offsets = [0] * spec.shards
    examples = []
    for i, size in enumerate(sizes):
        shard = i % spec.shards
        examples.append(Example(f"shard-{shard:04d}.tar", offsets[shard], size))
        offsets[shard] += size
    return examples


def _write(root: Path, spec: DatasetSpec, examples: list[Example]) -> None:
    rng = np.random.default_rng([spec.seed, 2])
    by_file: dict[str, list[Example]] = {}
    for example in examples:
        by_file.setdefault(example.path, []).append(example)
    for path, records in by_file.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        remaining = sum(r.length for r in records)
        with open(target, "wb") as f:
            while remaining:
                block = min(remaining, WRITE_BLOCK)
                f.write(rng.bytes(block))
                remaining -= block


def _manifest(spec: DatasetSpec, examples: list[Example]) -> dict:
    return {"spec": dataclasses.asdict(spec),
            "examples": [[e.path, e.offset, e.length] for e in examples]}


def load(directory: Path, spec: DatasetSpec) -> Dataset | None:
    """The dataset in ``directory`` if it was generated from ``spec`` and is whole."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("spec") != dataclasses.asdict(spec):
        return None
    examples = [Example(path, offset, length) for path, offset, length in manifest["examples"]]
    dataset = Dataset(spec, directory / "data", examples)
    ends: dict[str, int] = {}
    for e in examples:
        ends[e.path] = max(ends.get(e.path, 0), e.offset + e.length)
    try:
        if any(os.path.getsize(dataset.root / path) != end for path, end in ends.items()):
            return None
    except OSError:
        return None
    return dataset


def ensure(work_dir: Path, spec: DatasetSpec, log=print) -> Dataset:
    """The dataset for ``spec`` under ``work_dir``: reused when present, else generated."""
    spec.check()
    directory = Path(work_dir).resolve() / spec.name()
    found = load(directory, spec)
    if found is not None:
        return found
    sizes = example_sizes(spec)
    examples = _layout(spec, sizes)
    log(f"generating {spec.name()} ({len(examples)} examples, "
        f"{sum(sizes) / 2**20:.0f} MiB) in {directory}")
    # Made under a name of our own and renamed into place when complete, so that a run that
    # is interrupted, or two runs at the same time, never see a half-written dataset.
    partial = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "data").mkdir(parents=True)
    try:
        _write(partial / "data", spec, examples)
        (partial / MANIFEST).write_text(json.dumps(_manifest(spec, examples)))
        if load(directory, spec) is None:  # nobody else finished it meanwhile
            shutil.rmtree(directory, ignore_errors=True)
            os.rename(partial, directory)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return Dataset(spec, directory / "data", examples)
