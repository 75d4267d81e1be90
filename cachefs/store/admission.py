"""Who gets into the cache: a stable pseudo-random fraction of the files.

Training reads every example once per epoch in a fresh order.  A cache that
admits a fixed random subset and never evicts it to make room hits exactly that
fraction every epoch, which no policy can beat; LRU evicts each file shortly
before its next use (about 2 % hits at 20 % capacity).

A file is eligible when ``xxh64(path relative to BACKING, seed) / 2**64 < F``.
The choice depends on nothing but the path, so it is the same after a restart
and on every node of a cluster that uses the same seed.
"""

from __future__ import annotations

import os

import xxhash

_SCALE = float(2**64)


class FractionAdmission:
    """Admits the files whose path hash falls below ``fraction``.  Thread safety: immutable."""

    def __init__(self, fraction: float, seed: int = 0) -> None:
        self.fraction = fraction
        self.seed = seed
        # Compare integers, not floats, on the per-file path.
        self._threshold = 2**64 if fraction >= 1.0 else int(fraction * _SCALE)

    def score(self, relpath: str) -> float:
        """Where ``relpath`` falls in [0, 1): eligible when below the fraction."""
        return xxhash.xxh64_intdigest(os.fsencode(relpath), seed=self.seed) / _SCALE

    def eligible(self, relpath: str) -> bool:
        return xxhash.xxh64_intdigest(os.fsencode(relpath), seed=self.seed) < self._threshold
