"""Where the bytes of a file this node does not hold come from.

Without a cluster, the remote.  In a cluster (cachefs/peer/client.py) the file's owner
first, then the remote.  The fetcher (fetcher.py) asks its origin for each chunk it does
not find in the store.
"""

from __future__ import annotations

from typing import NamedTuple

from cachefs.attr import Attr
from cachefs.remote.remote import Remote
from cachefs.store.store import chunk_span


class Chunk(NamedTuple):
    data: bytes
    source: str  # "remote", "peer", or "cache" (stored meanwhile by another reader)

    @property
    def read_source(self) -> str:
        """The source its bytes count under (cachefs_read_bytes_total): a chunk another
        reader stored meanwhile was fetched for this miss all the same."""
        return "peer" if self.source == "peer" else "remote"


class RemoteOrigin:
    """Where bytes this node does not hold come from without a cluster: the remote."""

    def __init__(self, remote: Remote) -> None:
        self.remote = remote

    def read_chunk(self, relpath: str, attr: Attr, number: int, *, peers: bool = True) -> Chunk:
        offset, length = chunk_span(attr.size, number)
        return Chunk(self.remote.read(relpath, offset, length, attr.version), "remote")

    def read_file(self, relpath: str, attr: Attr) -> Chunk:
        return Chunk(self.remote.read(relpath, 0, attr.size, attr.version), "remote")

    def from_peer(self, relpath: str) -> bool:
        return False
