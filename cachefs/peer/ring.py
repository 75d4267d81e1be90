"""Who owns a file: rendezvous (highest random weight) hashing of its path over the nodes.

Every node computes the same owner from the same node list, with no coordination.  When a
node joins or leaves, only the files it owns (or will own) move: 1/N of them, the least
any scheme can move.  A few lines over xxh64, which the cache already uses for admission.
"""

from __future__ import annotations

import os

import xxhash


def owner(nodes: list[str] | tuple[str, ...], relpath: str) -> str:
    """The node (``HOST:PORT`` as listed) that owns ``relpath``; ValueError with no nodes."""
    if not nodes:
        raise ValueError("no nodes")
    path = os.fsencode(relpath)
    return max(nodes, key=lambda node: xxhash.xxh64_intdigest(path, seed=_seed(node)))


def _seed(node: str) -> int:
    return xxhash.xxh64_intdigest(node.encode())
