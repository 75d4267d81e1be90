"""Fetching chunks from their origin (the remote, or in a cluster the file's owner first),
once per chunk however many readers want it.

A DataLoader worker that opens a file the prefetcher is fetching waits for that
fetch instead of starting a second one; two workers reading the same chunk of a
shard do the same.  The first caller does the remote read and the admission;
the others wait on its future, never longer than the remote timeout.
"""

from __future__ import annotations

import concurrent.futures
import threading

from cachefs import remotewait
from cachefs.attr import Attr, Version
from cachefs.errors import CacheCorrupt, RemoteChanged, RemoteUnavailable
from cachefs.remote.origin import Chunk, RemoteOrigin
from cachefs.store.store import CacheStore, chunk_span


class Fetcher:
    """Deduplicated chunk fetches.

    Thread safety: ``_lock`` guards ``_inflight`` only (a leaf lock, never held
    across a remote call).
    """

    def __init__(self, origin: RemoteOrigin, store: CacheStore) -> None:
        self.origin = origin
        self._remote = origin.remote
        self._store = store
        self._lock = threading.Lock()
        self._inflight: dict[tuple[bytes, Version, int], concurrent.futures.Future] = {}

    def fetch(self, relpath: str, key: bytes, attr: Attr, number: int, *, admit: bool,
              peers: bool = True) -> Chunk:
        """Chunk ``number`` of version ``attr`` of the file, from its origin: the file's
        owner in a cluster (unless ``peers`` is False), the remote otherwise.

        With ``admit`` the chunk is offered to the store (which may decline: not
        eligible, full, disk trouble).  Raises RemoteChanged when the remote file
        is no longer that version, RemoteUnavailable on timeout, OSError as the
        remote answered.
        """
        ident = (key, attr.version, number)
        with self._lock:
            future = self._inflight.get(ident)
            owner = future is None
            if owner:
                future = self._inflight[ident] = concurrent.futures.Future()
        if not owner:
            return self._wait(future)
        try:
            # The previous owner of this chunk stores it before it leaves _inflight, so
            # a caller that just missed that fetch finds the chunk here, not on the remote.
            chunk = self._stored(key, attr, number)
            if chunk is None:
                chunk = self.origin.read_chunk(relpath, attr, number, peers=peers)
                if len(chunk.data) != chunk_span(attr.size, number)[1]:
                    raise RemoteChanged(f"{relpath} is shorter than its attributes say")
                if admit:
                    self._store.store_chunk(key, attr, number, chunk.data)
        except BaseException as exc:
            future.set_exception(exc)
            raise
        else:
            future.set_result(chunk)
            return chunk
        finally:
            with self._lock:
                del self._inflight[ident]

    def _stored(self, key: bytes, attr: Attr, number: int) -> Chunk | None:
        record = self._store.lookup(key)
        if record is None or record.version != attr.version:
            return None
        try:
            data = self._store.read_chunk(key, record, number)
        except CacheCorrupt:
            return None  # dropped by the store; fetched again below
        return Chunk(data, "cache") if data is not None else None

    def inflight(self, key: bytes, attr: Attr, number: int) -> concurrent.futures.Future | None:
        return self._inflight.get((key, attr.version, number))

    def _wait(self, future: concurrent.futures.Future) -> Chunk:
        # The owner gives up after one remote timeout; allow it that and a little more.
        try:
            with remotewait.waiting(remote_call=False):
                return future.result(self._remote.timeout_seconds + 1.0)
        except concurrent.futures.TimeoutError:
            raise RemoteUnavailable("a fetch of this chunk by another reader did not finish") \
                from None
