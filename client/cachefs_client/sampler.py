"""Samplers that hint the daemon about the batches ahead, without changing them.

:class:`HintingBatchSampler` wraps any batch sampler.  It draws batches from it
``lookahead`` batches ahead of what it yields, sends the paths of each batch as
it is drawn, and yields the batches unchanged and in order.  The DataLoader
itself already keeps ``num_workers * prefetch_factor`` batches in flight, so the
hints arrive that much plus ``lookahead`` batches before a worker opens the
files.

Across epoch boundaries it hints the first batches of the next epoch when that
order can be known without disturbing anything: a copy of the sampler is made
and, if needed, its generator advanced as the DataLoader will advance the real
one; a DistributedSampler's copy gets ``set_epoch(epoch + 1)``.  The real
sampler and generator are never touched.  The prediction is checked against the
real batches when the next epoch starts; if it was wrong, hints across epochs
stop (with one warning) and nothing else changes.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import RandomSampler, Sampler

from cachefs_client._daemon import send_hints, warn_once

DEFAULT_WORKERS_TIMES_PREFETCH = 16  # 8 workers x prefetch_factor 2, torch's common setting
LOOKAHEAD_MARGIN = 4


def default_lookahead(num_workers: int | None, prefetch_factor: int | None) -> int:
    """Batches to hint ahead: what the loader keeps in flight, plus a margin."""
    if num_workers is None:
        return DEFAULT_WORKERS_TIMES_PREFETCH + LOOKAHEAD_MARGIN
    return max(1, num_workers * (prefetch_factor or 2)) + LOOKAHEAD_MARGIN


class _Lookahead:
    """The engine shared by both samplers: items are batches (lists) or single indices."""

    def __init__(self, source, path_of: Callable[[int], Any], lookahead: int,
                 indices_of: Callable[[Any], Iterable[int]], loader_generator,
                 persistent_workers: bool = False) -> None:
        if lookahead < 0:
            raise ValueError("lookahead must be >= 0")
        self.source = source
        self.path_of = path_of
        self.lookahead = lookahead
        self.indices_of = indices_of
        self.loader_generator = loader_generator
        self.persistent_workers = persistent_workers
        self.predict_next_epoch = True
        self._hinted_for_next: list = []

    def _hint(self, items: list) -> None:
        if not items:
            return
        try:
            paths = [self.path_of(i) for item in items for i in self.indices_of(item)]
        except Exception as exc:  # a bad path_of must not stop training
            warn_once("path_of", f"path_of failed ({exc!r}); training goes on without hints")
            return
        send_hints(paths)

    def __iter__(self) -> Iterator:
        predicted = self._hinted_for_next
        self._hinted_for_next = []
        source = iter(self.source)
        ahead: collections.deque = collections.deque()
        drawn = 0
        exhausted = False
        following: Iterator | None = None
        while True:
            fresh = []
            while not exhausted and len(ahead) <= self.lookahead:
                try:
                    item = next(source)
                except StopIteration:
                    exhausted = True
                    break
                if drawn < len(predicted) and _same(item, predicted[drawn]):
                    pass  # hinted at the end of the last epoch
                else:
                    if drawn < len(predicted):
                        self._mispredicted()
                        predicted = []
                    fresh.append(item)
                drawn += 1
                ahead.append(item)
            self._hint(fresh)
            if exhausted and self.predict_next_epoch:
                # Keep the hints ``lookahead`` items ahead into the next epoch.
                if following is None:
                    following = self._predict()
                if following is not None:
                    want = self.lookahead + 1 - len(ahead) - len(self._hinted_for_next)
                    extra = []
                    for _ in range(max(0, want)):
                        nxt = next(following, None)
                        if nxt is None:
                            break
                        extra.append(nxt)
                    self._hinted_for_next.extend(extra)
                    self._hint(extra)
            if not ahead:
                return
            yield ahead.popleft()

    def _mispredicted(self) -> None:
        self.predict_next_epoch = False
        warn_once("predict", "the next epoch's order differed from the prediction; hints "
                  "across epoch boundaries are off from now on")

    def _predict(self) -> Iterator | None:
        """The next epoch's items, from a copy of the source; None when unknowable."""
        sampler = getattr(self.source, "sampler", self.source)
        if isinstance(sampler, RandomSampler) and sampler.generator is None:
            return None  # seeded from torch's global RNG at the start of the epoch
        try:
            twin = copy.deepcopy(self.source, memo=_shared_data(self.source, sampler))
        except Exception:
            return None
        twin_sampler = getattr(twin, "sampler", twin)
        if hasattr(twin_sampler, "set_epoch") and hasattr(twin_sampler, "epoch"):
            twin_sampler.set_epoch(twin_sampler.epoch + 1)  # DistributedSampler
        generator = getattr(sampler, "generator", None)
        if generator is not None and generator is self.loader_generator \
                and not self.persistent_workers:
            # The DataLoader draws its workers' base seed from this same generator
            # before the sampler runs, each epoch (once only with persistent workers,
            # whose iterator lives on): advance the copy the same way.
            torch.empty((), dtype=torch.int64).random_(generator=twin_sampler.generator)
        return iter(twin)


def _shared_data(*samplers) -> dict:
    """A deepcopy memo that keeps the samplers' datasets shared, not copied: the twin
    needs only their length, and copying a dataset of a million paths takes seconds."""
    memo = {}
    for sampler in samplers:
        for name in ("data_source", "dataset"):
            data = getattr(sampler, name, None)
            if data is not None:
                memo[id(data)] = data
    return memo


def _same(a, b) -> bool:
    return list(a) == list(b) if isinstance(a, (list, tuple)) else a == b


class HintingBatchSampler(Sampler[list[int]]):
    """Wraps a batch sampler; yields its batches unchanged while hinting those ahead.

    ``path_of(index)`` gives the file path of a dataset index, on a cachefs mount.
    ``loader_generator``: the DataLoader's ``generator`` argument, when the
    sampler uses the same one (``DataLoader(shuffle=True, generator=g)``), and
    ``persistent_workers`` whether that loader keeps its workers (num_workers > 0).
    """

    def __init__(self, batch_sampler: Iterable[list[int]], path_of: Callable[[int], Any], *,
                 lookahead: int | None = None, loader_generator: torch.Generator | None = None,
                 persistent_workers: bool = False) -> None:
        self.batch_sampler = batch_sampler
        self._engine = _Lookahead(batch_sampler, path_of,
                                  default_lookahead(None, None) if lookahead is None else lookahead,
                                  lambda batch: batch, loader_generator, persistent_workers)

    @property
    def lookahead(self) -> int:
        return self._engine.lookahead

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._engine)

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the wrapped batch sampler's sampler (a DistributedSampler)."""
        inner = getattr(self.batch_sampler, "sampler", self.batch_sampler)
        inner.set_epoch(epoch)  # type: ignore[union-attr]

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]


class HintingSampler(Sampler[int]):
    """Wraps a sampler of single indices (``DataLoader(batch_size=None)``); ``lookahead``
    counts indices."""

    def __init__(self, sampler: Iterable[int], path_of: Callable[[int], Any], *,
                 lookahead: int | None = None, loader_generator: torch.Generator | None = None,
                 persistent_workers: bool = False) -> None:
        self.sampler = sampler
        self._engine = _Lookahead(sampler, path_of,
                                  default_lookahead(None, None) if lookahead is None else lookahead,
                                  lambda index: (index,), loader_generator, persistent_workers)

    def __iter__(self) -> Iterator[int]:
        return iter(self._engine)

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the wrapped sampler (a DistributedSampler's reshuffle)."""
        self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]
