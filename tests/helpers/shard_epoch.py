"""One node's share of a training epoch: a real DataLoader over a DistributedSampler shard of
the files under a mount, printing ``{relative path: xxh3 of the bytes read}`` as JSON.

    python -m tests.helpers.shard_epoch MOUNT --rank R --world N --epoch E [--hints]

With ``--hints`` the loader is cachefs_client's, which tells the daemon what comes next.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import xxhash
from torch.utils.data import DistributedSampler

from cachefs_client import DataLoader, FileDataset


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mount")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--epoch", type=int, required=True)
    parser.add_argument("--hints", action="store_true")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    dataset = FileDataset(args.mount, transform=xxhash.xxh3_64_hexdigest)
    sampler = DistributedSampler(dataset, num_replicas=args.world, rank=args.rank,
                                 shuffle=True, seed=7, drop_last=False)
    sampler.set_epoch(args.epoch)
    loader_class = DataLoader if args.hints else torch.utils.data.DataLoader
    extra = {"path_of": dataset.path_of} if args.hints else {}
    loader = loader_class(dataset, batch_size=16, sampler=sampler, num_workers=args.workers,
                          collate_fn=list, **extra)
    digests = {}
    indices = list(iter(sampler))
    position = 0
    for batch in loader:
        for digest in batch:
            path = dataset.path_of(indices[position])
            digests[os.path.relpath(path, args.mount)] = digest
            position += 1
    json.dump(digests, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
