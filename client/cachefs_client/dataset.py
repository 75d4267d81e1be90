"""Datasets of files under a mount, and finding the file path of a dataset index."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.utils.data

from cachefs_client.fastpath import read_file, read_files


def default_path_of(dataset) -> Callable[[int], Any]:
    """``index -> path`` for the common dataset shapes; TypeError naming the fix otherwise."""
    if isinstance(dataset, torch.utils.data.Subset):
        inner = default_path_of(dataset.dataset)
        indices = dataset.indices
        return lambda i: inner(indices[i])
    if callable(getattr(dataset, "path_of", None)):
        return dataset.path_of
    samples = getattr(dataset, "samples", None) or getattr(dataset, "imgs", None)
    if isinstance(samples, (list, tuple)) and samples and isinstance(samples[0], (list, tuple)):
        return lambda i: samples[i][0]  # torchvision ImageFolder / DatasetFolder
    for name in ("files", "paths"):
        files = getattr(dataset, name, None)
        if isinstance(files, (list, tuple)):
            return files.__getitem__
    raise TypeError(f"cannot tell the file path of an item of {type(dataset).__name__}; "
                    "pass path_of=lambda index: ...")


class FileDataset(torch.utils.data.Dataset):
    """Every file under ``root`` (sorted), read whole; ``transform`` turns bytes into a sample.

    The default sample is ``(bytes, index)``.  Paths come back from :meth:`path_of`,
    which is what the hinting samplers need.
    """

    def __init__(self, root: str | os.PathLike, transform: Callable[[bytes], Any] | None = None,
                 extensions: tuple[str, ...] | None = None) -> None:
        self.root = os.fspath(root)
        self.transform = transform
        found = []
        for directory, dirs, files in os.walk(self.root):
            dirs.sort()
            for name in sorted(files):
                if extensions is None or name.lower().endswith(extensions):
                    found.append(os.path.join(directory, name))
        self.files = found

    def __len__(self) -> int:
        return len(self.files)

    def path_of(self, index: int) -> str:
        return self.files[index]

    def __getitem__(self, index: int):
        return self._sample(read_file(self.files[index]), index)

    def __getitems__(self, indices: list[int]) -> list:
        """A whole batch at once (DataLoader calls this when it exists): the files the
        daemon holds come in one round trip."""
        batch = read_files([self.files[i] for i in indices])
        return [self._sample(batch[k], i) for k, i in enumerate(indices)]

    def _sample(self, data: bytes, index: int):
        return self.transform(data) if self.transform else (data, index)
