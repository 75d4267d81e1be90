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

    def keeps_cached(self, relpath: str) -> bool:
        """Whether a file found in the cache at start stays (a changed fraction or seed
        drops the files it no longer admits)."""
        return self.eligible(relpath)


class ClusterAdmission(FractionAdmission):
    """In a cluster (cachefs/peer), the files this node owns first.

    With N nodes each keeping a fraction ``f`` of the dataset, the cluster can hold N x f of
    it.  A node keeps the files it owns that score below ``min(1, N x f)``; with budget left
    over (N x f > 1) it also keeps a stable share ``(N x f - 1) / (N - 1)`` of the others,
    so a node still keeps about ``f`` of the files and reads the rest from their owners.
    The node list comes from ``members`` each time (it may change under DNS).
    Thread safety: no state of its own.
    """

    def __init__(self, fraction: float, seed: int, members) -> None:
        super().__init__(fraction, seed)
        self.members = members

    def _bounds(self) -> tuple[int, int]:
        n = len(self.members.nodes)
        owned = min(1.0, n * self.fraction)
        others = max(0.0, (n * self.fraction - 1) / (n - 1)) if n > 1 else 0.0
        return (2**64 if owned >= 1.0 else int(owned * _SCALE),
                2**64 if others >= 1.0 else int(others * _SCALE))

    def keeps_cached(self, relpath: str) -> bool:
        """Every file: the node list at start may be partial (DNS lists nodes as they come
        up), and a file this node holds is worth serving whoever owns it now.  The budget
        still applies."""
        return True

    def eligible(self, relpath: str) -> bool:
        owned, others = self._bounds()
        bound = owned if self.members.owns(relpath) else others
        return xxhash.xxh64_intdigest(os.fsencode(relpath), seed=self.seed) < bound
