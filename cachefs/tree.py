"""The read-only mirror of BACKING, served from the local cache where it can be.

This is the plain-Python core behind the FUSE adapter (fuse_ops.py): paths
relative to BACKING in, bytes and attributes out, domain exceptions and remote
OSErrors for failures.  It can be driven without a mount.

A read is served, chunk by chunk, from the first of:
  1. the chunk this open file read last (kept in memory while it is open);
  2. the SSD cache, checksum verified;
  3. the prefetcher's staging area (files the cache does not keep; taken whole
     at open);
  4. the remote: a whole chunk when the file is admitted to the cache (it is
     stored on the way), a read-ahead to the end of the chunk for sequential
     readers, and just the bytes asked for otherwise, so random reads into
     large uncached files cost what they would cost on the remote itself.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
from dataclasses import dataclass, field

from cachefs.attr import Attr
from cachefs.attrcache import AttrCache, relpath_key
from cachefs.errors import CacheCorrupt, RemoteChanged
from cachefs.fetcher import Fetcher
from cachefs.index import FileRecord
from cachefs.metrics import OPEN_RESULTS, READ_SOURCES, Metrics
from cachefs.prefetch import Prefetcher
from cachefs.remote import Remote, RemoteFile
from cachefs.store import CHUNK_BYTES, CacheStore, chunk_count, chunk_span

log = logging.getLogger(__name__)

# The hidden entry at the root of the mount that leads to the control socket.
# Not listed by readdir, so `diff -r BACKING MOUNTPOINT` stays clean.
CONTROL_NAME = ".cachefs.sock"
READAHEAD_FROM_START = 2**20
# Larger files are read through the mount, chunk by chunk, rather than held whole.
MAX_WHOLE_READ_BYTES = 64 * 2**20


@dataclass(frozen=True)
class WholeFile:
    """A whole local file handed to a fast-path reader: its bytes, or a read-only
    descriptor of the one chunk that holds them and the xxh3-64 they must hash to."""

    result: str  # "hit" or "prefetched", as the open is counted
    data: bytes | None = None
    fd: int | None = None
    checksum: int | None = None


@dataclass(eq=False)
class OpenFile:
    """One open() of a file.  Thread safety: ``lock`` serialises reads of this handle."""

    relpath: str
    key: bytes
    attr: Attr
    record: FileRecord | None
    # The bytes this handle read last: [buffer_offset, buffer_offset + len(buffer)).
    buffer: bytes = b""
    buffer_offset: int = 0
    buffer_source: str = "cache"
    # "prefetch" for the first open of a file the prefetcher put in the cache.
    cache_source: str = "cache"
    next_offset: int = 0
    sequential_bytes: int = 0  # read back to back up to next_offset
    remote_file: RemoteFile | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class CachedTree:
    """Lookups, listings and reads of the mirror.  Thread safety: see each collaborator;
    ``_handles`` is a dict mutated only by single atomic operations."""

    def __init__(
        self,
        *,
        remote: Remote,
        store: CacheStore,
        attrs: AttrCache,
        fetcher: Fetcher,
        metrics: Metrics,
        prefetcher: Prefetcher | None = None,
        control_target: str | None = None,
    ) -> None:
        self.remote = remote
        self.store = store
        self.attrs = attrs
        self.fetcher = fetcher
        self.metrics = metrics
        self.prefetcher = prefetcher
        self.control_target = control_target
        self._handles: dict[int, OpenFile] = {}
        self._next_handle = itertools.count(1)
        self._read_bytes = {s: metrics.read_bytes.labels(s) for s in READ_SOURCES}
        self._opens = {r: metrics.file_opens.labels(r) for r in OPEN_RESULTS}

    # -- metadata ----------------------------------------------------------------------

    def getattr(self, relpath: str) -> Attr:
        if relpath == CONTROL_NAME and self.control_target:
            return self._control_attr()
        return self.attrs.get(relpath)

    def _control_attr(self) -> Attr:
        root = self.attrs.get("")
        target = os.fsencode(self.control_target or "")
        return Attr(stat.S_IFLNK | 0o777, len(target), root.uid, root.gid, 1,
                    root.atime_ns, root.mtime_ns, root.ctime_ns)

    def readlink(self, relpath: str) -> str:
        if relpath == CONTROL_NAME and self.control_target:
            return self.control_target
        return self.remote.readlink(relpath)

    def listdir(self, relpath: str) -> list[tuple[str, int]]:
        return self.remote.listdir(relpath)

    # -- open / read / release -------------------------------------------------------------

    def open(self, relpath: str) -> int:
        """Open a regular file for reading; returns a handle number."""
        attr = self.attrs.get(relpath)
        if not attr.is_file:
            raise IsADirectoryError(relpath) if attr.is_dir else PermissionError(relpath)
        f, result = self._settle(relpath, attr)
        self._opens[result].inc()
        handle = next(self._next_handle)
        self._handles[handle] = f
        return handle

    def _settle(self, relpath: str, attr: Attr) -> tuple[OpenFile, str]:
        """What is already local for an open of this file, and whether that makes the open
        a hit, prefetched or a miss."""
        key = relpath_key(relpath)
        # Settle the prefetcher first: a prefetch into the cache that finishes now must
        # be seen by the lookup below, not fetched a second time.
        prefetched = None
        if self.prefetcher is not None:
            prefetched = self.prefetcher.on_open(relpath, attr, self.remote.timeout_seconds)
        record = self.store.lookup(key)
        if record is not None and record.version != attr.version:
            log.info("%s changed on the remote: cached copy dropped", relpath)
            self.store.drop(key)
            record = None
        # An empty file needs no bytes: it is always whole in the cache.
        hit = attr.size == 0 or (record is not None and self.store.is_complete(record))
        f = OpenFile(relpath, key, attr, record)
        result = "hit" if hit else "miss"
        if prefetched is not None and prefetched.staged is not None:
            self._set_buffer(f, 0, prefetched.staged, "prefetch")
            result = "prefetched"
        elif prefetched is not None and prefetched.into_cache and hit:
            f.cache_source = "prefetch"
            result = "prefetched"
        return f, result

    def read_whole(self, relpath: str, attr: Attr, *, descriptor_ok: bool = False
                   ) -> WholeFile | None:
        """The whole file and how it was found (hit or prefetched), when it is local and
        small enough to hand over at once; None when it must be read through the mount.

        This is the control socket's fast path: no FUSE round trips, the same checks
        (revalidated attributes, checksums) and the same metrics as a read by the mount.
        With ``descriptor_ok``, a file stored as one chunk comes as an open descriptor
        of that chunk and the checksum its bytes must have: the reader reads the SSD
        itself and verifies them, so the daemon never touches the bytes.
        """
        if not attr.is_file or attr.size > MAX_WHOLE_READ_BYTES:
            return None
        f, result = self._settle(relpath, attr)
        if result == "miss":
            return None  # the mount fetches it (and counts the open)
        if f.buffer_source == "prefetch" and len(f.buffer) == attr.size:
            found, source = WholeFile(result, data=f.buffer), "prefetch"
        elif descriptor_ok and f.record is not None and chunk_count(attr.size) == 1 \
                and attr.size > 0:
            opened = self.store.open_chunk(f.key, f.record, 0)
            if opened is None:
                return None  # dropped and counted by the store; the mount refetches
            fd, chunk = opened
            found, source = WholeFile(result, fd=fd, checksum=chunk.checksum), f.cache_source
        else:
            pieces = []
            for number in range(chunk_count(attr.size)):
                try:
                    piece = self.store.read_chunk(f.key, f.record, number) \
                        if f.record is not None else None
                except CacheCorrupt:
                    piece = None  # dropped and counted by the store; the mount refetches
                if piece is None:
                    return None
                pieces.append(piece)
            found, source = WholeFile(result, data=b"".join(pieces)), f.cache_source
        self._opens[result].inc()
        self._read_bytes[source].inc(attr.size)
        return found

    def release(self, handle: int) -> OpenFile | None:
        """Close a handle; the open file it was, if it was open."""
        f = self._handles.pop(handle, None)
        if f is not None and f.remote_file is not None:
            f.remote_file.close()
        return f

    def handle(self, handle: int) -> OpenFile:
        return self._handles[handle]

    def read(self, handle: int, size: int, offset: int) -> bytes:
        f = self._handles[handle]
        start_offset = offset
        end = min(offset + size, f.attr.size)
        if offset >= end:
            return b""
        with f.lock:
            run = f.sequential_bytes if offset == f.next_offset else 0
            pieces = []
            while offset < end:
                if not f.buffer_offset <= offset < f.buffer_offset + len(f.buffer):
                    self._fill(f, offset, end)
                start = offset - f.buffer_offset
                piece = f.buffer[start : start + (end - offset)]
                self._read_bytes[f.buffer_source].inc(len(piece))
                pieces.append(piece)
                offset += len(piece)
            f.next_offset = end
            f.sequential_bytes = run + end - start_offset
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _fill(self, f: OpenFile, offset: int, end: int) -> None:
        """Load into ``f.buffer`` bytes that cover ``offset``."""
        number = offset // CHUNK_BYTES
        chunk_offset, chunk_length = chunk_span(f.attr.size, number)
        if f.record is not None:
            try:
                data = self.store.read_chunk(f.key, f.record, number)
            except CacheCorrupt:
                f.record = None
                data = None
            if data is not None:
                self._set_buffer(f, chunk_offset, data, f.cache_source)
                return
        admit = self.store.admitting and self.store.admission.eligible(f.relpath)
        if admit or self.fetcher.inflight(f.key, f.attr, number) is not None:
            data = self.fetcher.fetch(f.relpath, f.key, f.attr, number, admit=admit)
            self._set_buffer(f, chunk_offset, data, "remote")
            return
        # Not kept by the cache: read from the remote directly.  Random readers get what
        # they asked for.  Sequential readers get a read-ahead twice what they have read
        # in a row so far (1 MiB from the start of a file, which is usually read whole):
        # few round trips for a whole file, and a record read at a random offset inside
        # a shard costs at most about twice its size.
        wanted = end - offset
        if offset == f.next_offset:
            wanted = max(wanted, 2 * f.sequential_bytes, READAHEAD_FROM_START if offset == 0
                         else 0)
        length = min(offset + wanted, chunk_offset + chunk_length) - offset
        if f.remote_file is None:
            f.remote_file = self.remote.open(f.relpath, f.attr.version)
        data = f.remote_file.pread(offset, length)
        if len(data) != length:
            raise RemoteChanged(f"{f.relpath} changed on the remote while being read")
        self._set_buffer(f, offset, data, "remote")

    @staticmethod
    def _set_buffer(f: OpenFile, offset: int, data: bytes, source: str) -> None:
        f.buffer, f.buffer_offset, f.buffer_source = data, offset, source

    def statfs(self) -> dict[str, int]:
        """The remote's figures, as `df` on the remote would show them."""
        st = self.remote.statvfs()
        return {key: getattr(st, key) for key in (
            "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree",
            "f_favail", "f_namemax")}

    # -- figures -----------------------------------------------------------------------

    @property
    def open_files(self) -> int:
        return len(self._handles)
