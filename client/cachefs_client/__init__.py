"""cachefs_client: tell the cachefs daemon which files the next batches will read.

Two lines in a training script::

    from cachefs_client import DataLoader   # instead of torch.utils.data.DataLoader
    loader = DataLoader(dataset, batch_size=128, shuffle=True, num_workers=8,
                        generator=g, path_of=lambda i: dataset.samples[i][0])

Or wrap an existing batch sampler with :class:`HintingBatchSampler`.  Hints are
advisory: batches are exactly those of torch's DataLoader, and when the files
are not on a cachefs mount or the daemon is gone, training goes on unchanged.
"""

from cachefs_client._daemon import send_hints
from cachefs_client.dataset import FileDataset, default_path_of
from cachefs_client.fastpath import read_file, read_files
from cachefs_client.loader import DataLoader
from cachefs_client.sampler import HintingBatchSampler, HintingSampler

__version__ = "0.1.0"

__all__ = ["DataLoader", "FileDataset", "HintingBatchSampler", "HintingSampler",
           "default_path_of", "read_file", "read_files", "send_hints"]
