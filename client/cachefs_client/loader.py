"""A DataLoader that hints: torch's own, with a hinting sampler slipped in.

``cachefs_client.DataLoader(dataset, ..., path_of=...)`` takes the same
arguments as ``torch.utils.data.DataLoader``.  It first lets torch build the
samplers from those arguments, exactly as torch would, then wraps the batch
sampler (or, without automatic batching, the sampler) in a hinting one.
Nothing is drawn from any generator while doing so, so the batches and their
order are those of the plain DataLoader.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch.utils.data

from cachefs_client._daemon import check_daemon, warn_once
from cachefs_client.dataset import default_path_of
from cachefs_client.sampler import HintingBatchSampler, HintingSampler, default_lookahead

_SAMPLING_ARGUMENTS = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")
_SIGNATURE = inspect.signature(torch.utils.data.DataLoader.__init__)


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` that tells cachefs which files come next.

    ``path_of(index)`` returns the path of a dataset item's file; it defaults to
    what the dataset offers (``path_of``, ``samples``, ``imgs``, ``files``).
    ``lookahead`` is in batches; by default what the loader keeps in flight
    (``num_workers * prefetch_factor``) plus a margin.
    """

    def __init__(self, dataset, *args: Any, path_of: Callable[[int], Any] | None = None,
                 lookahead: int | None = None, **kwargs: Any) -> None:
        plain = torch.utils.data.DataLoader(dataset, *args, **kwargs)
        bound = _SIGNATURE.bind(self, dataset, *args, **kwargs).arguments
        rest = {k: v for k, v in bound.items()
                if k not in ("self", "dataset", *_SAMPLING_ARGUMENTS)}
        if isinstance(dataset, torch.utils.data.IterableDataset):
            warn_once("iterable", "an IterableDataset has no sampler to read ahead from; "
                      "no hints are sent")
            super().__init__(dataset, *args, **kwargs)
            return
        if path_of is None:
            path_of = default_path_of(dataset)
        _check_daemon_of(dataset, path_of)
        if lookahead is None:
            lookahead = default_lookahead(plain.num_workers, plain.prefetch_factor)
        # Persistent workers: torch draws their base seed from the generator only once.
        persistent = bool(plain.persistent_workers and plain.num_workers > 0)
        if plain.batch_sampler is not None:
            batches = HintingBatchSampler(plain.batch_sampler, path_of, lookahead=lookahead,
                                          loader_generator=plain.generator,
                                          persistent_workers=persistent)
            super().__init__(dataset, batch_sampler=batches, **rest)
            # ``loader.sampler`` stays the user's sampler, so that the usual
            # ``loader.sampler.set_epoch(epoch)`` reaches a DistributedSampler.  With a
            # batch sampler torch only reads ``sampler`` for its length; the attribute is
            # frozen after __init__, hence object.__setattr__.
            object.__setattr__(self, "sampler", plain.sampler)
        else:
            # Without automatic batching every item is a "batch" of one sample.
            indices = HintingSampler(plain.sampler, path_of, lookahead=lookahead,
                                     loader_generator=plain.generator,
                                     persistent_workers=persistent)
            super().__init__(dataset, batch_size=None, sampler=indices, **rest)


def _check_daemon_of(dataset, path_of: Callable[[int], Any]) -> None:
    """Find the daemon now, before the workers start: a warning that it cannot be reached
    is then shown once, here, and workers forked later inherit it instead of repeating it."""
    try:
        path = path_of(0) if len(dataset) else None
    except Exception:  # the hinting sampler reports a failing path_of when it is used
        return
    if path is not None:
        check_daemon(path)
