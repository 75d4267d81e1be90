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


def _threshold(share: float) -> int:
    """The hash below which a file falls in ``share``: integers, not floats, are compared on
    the per-file path."""
    return 2**64 if share >= 1.0 else int(max(0.0, share) * _SCALE)


class FractionAdmission:
    """Admits the files whose path hash falls below ``fraction``.  Thread safety: immutable."""

    # Whether the cache may hold files it would not admit now (see keeps_cached): if not, a
    # file it does not admit needs no look in the index.
    holds_others = False

    def __init__(self, fraction: float, seed: int = 0) -> None:
        self.fraction = fraction
        self.seed = seed
        self._threshold = _threshold(fraction)

    def score(self, relpath: str) -> float:
        """Where ``relpath`` falls in [0, 1): eligible when below the fraction."""
        return xxhash.xxh64_intdigest(os.fsencode(relpath), seed=self.seed) / _SCALE

    def eligible(self, relpath: str) -> bool:
        return xxhash.xxh64_intdigest(os.fsencode(relpath), seed=self.seed) < self._threshold

    def keeps_cached(self, relpath: str) -> bool:
        """Whether a file found in the cache at start stays (a changed fraction or seed
        drops the files it no longer admits)."""
        return self.eligible(relpath)

    def describe(self) -> str:
        """What decides which cached files stay: when it differs at the next start, the
        cache is reconciled with it (keeps_cached)."""
        return f"fraction {self.fraction!r} seed {self.seed}"


class ClusterAdmission(FractionAdmission):
    """In a cluster (cachefs/peer), the files this node owns first.

    With N nodes each keeping a fraction ``f`` of the dataset, the cluster can hold N x f of
    it.  A node keeps the files it owns that score below ``min(1, N x f)``; with budget left
    over (N x f > 1) it also keeps a stable share ``(N x f - 1) / (N - 1)`` of the others,
    so a node still keeps about ``f`` of the files and reads the rest from their owners.
    The node list comes from ``members`` (it may change under DNS); the thresholds are
    worked out again only when the number of nodes changes.
    Thread safety: ``_bounds`` is replaced whole (a tuple).
    """

    def __init__(self, fraction: float, seed: int, members) -> None:
        super().__init__(fraction, seed)
        self.members = members
        self._bounds = (0, 0, 0)  # (nodes, threshold of owned files, of the others')

    def _thresholds(self) -> tuple[int, int]:
        n = len(self.members.nodes)
        if self._bounds[0] != n:
            others = (n * self.fraction - 1) / (n - 1) if n > 1 else 0.0
            self._bounds = (n, _threshold(n * self.fraction), _threshold(others))
        return self._bounds[1], self._bounds[2]

    holds_others = True

    def describe(self) -> str:
        return "cluster"  # keeps every file it holds, whoever owns it

    def keeps_cached(self, relpath: str) -> bool:
        """Every file: the node list at start may be partial (DNS lists nodes as they come
        up), and a file this node holds is worth serving whoever owns it now.  The budget
        still applies."""
        return True

    def eligible(self, relpath: str) -> bool:
        owned, others = self._thresholds()
        bound = owned if self.members.owns(relpath) else others
        return xxhash.xxh64_intdigest(os.fsencode(relpath), seed=self.seed) < bound
