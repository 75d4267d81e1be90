"""The read-only mirror of BACKING, served from the local cache where it can be.

This is the plain-Python core behind the FUSE adapter (cachefs/mirror/mirrorfs.py) and
the control socket's fast path: paths relative to BACKING in, attributes and local files
out, domain exceptions and remote OSErrors for failures.  It can be driven without a mount.

The question every open asks is "which local file holds these bytes?"
(:meth:`CachedTree.locate`).  The answer, in order:

  1. the cache's own file, when the file is wholly cached (verified before its first
     hand-over, see store.py);
  2. a memory file the prefetcher staged (files the cache does not keep);
  3. for any other miss, where the kernel reads backing files (passthrough) and the
     settings let it read the remote: the remote's own file, opened and checked here, for
     the kernel to read; a file the cache keeps is copied into it beside the reader, by the
     kernel (remote/handover.py).  The daemon moves none of its bytes;
  4. otherwise, for a miss of a small file (one chunk), a fetch of the whole file first
     (one remote read, or in a cluster one request to the file's owner): into the cache
     when the file is admitted, else into a memory file;
  5. otherwise (a large file not wholly cached) no single local file: the file is read
     chunk by chunk through :meth:`CachedTree.read`, from the cache where chunks are
     stored and from the remote for the rest (admitted chunks are stored on the way; a
     read-ahead for sequential readers; just the bytes asked for otherwise, so random
     reads into large uncached files cost what they would cost on the remote itself).

A file is handed over whole: to the kernel (FUSE passthrough, or read by the adapter where
the kernel has none) or to a fast-path client over the control socket.  Either way the
bytes are counted when the file is handed over.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
from dataclasses import dataclass, field

from cachefs.attr import Attr
from cachefs.errors import CacheCorrupt, RemoteChanged
from cachefs.metrics import OPEN_RESULTS, READ_SOURCES, Metrics
from cachefs.prefetch.prefetcher import Prefetched, Prefetcher
from cachefs.prefetch.staging import memory_file
from cachefs.remote.attrcache import AttrCache, relpath_key
from cachefs.remote.fetcher import Fetcher
from cachefs.remote.handover import RemoteFiles
from cachefs.remote.remote import Remote, RemoteFile
from cachefs.store.index import FileRecord
from cachefs.store.store import CHUNK_BYTES, CacheStore, chunk_span

log = logging.getLogger(__name__)

# The hidden entry that leads to the control socket, answered in every directory of the
# mount: a client that sees only a subdirectory (a bind mount of it, a container's subPath)
# finds the daemon there too.  Never listed, so `diff -r BACKING MOUNTPOINT` stays clean; a
# remote file of that name is hidden by it (listed nowhere, looked up as the entry).
CONTROL_NAME = ".cachefs.sock"
_CONTROL_SUFFIX = "/" + CONTROL_NAME
READAHEAD_FROM_START = 2**20
# A miss of a file up to this size is fetched whole at open (one remote read) and handed
# over as a local file; larger files are read chunk by chunk through the daemon.
WHOLE_FETCH_BYTES = CHUNK_BYTES


def is_control_entry(relpath: str) -> bool:
    """Whether ``relpath`` (relative to BACKING) names the hidden control entry."""
    return relpath == CONTROL_NAME or relpath.endswith(_CONTROL_SUFFIX)


@dataclass(frozen=True)
class Located:
    """Where the bytes of one open of a file are.

    ``kind``: "cache" (``fd`` is the cache's own file of this version: the caller may keep
    it for later opens, see ``held`` of :meth:`CachedTree.locate`), "held" (the caller's
    kept descriptor is still good), "memory" (``fd`` is a memory file of this open's own),
    "remote" (``fd`` is the remote's own file, this open's own: only where the kernel reads
    it), or "chunks" (no single local file: read through ``handle``).
    """

    kind: str
    result: str  # "hit", "prefetched" or "miss", as the open is counted
    source: str  # "cache", "prefetch" or "remote", as the bytes are counted
    fd: int | None = None
    handle: OpenFile | None = None
    readable: bool = True  # False: ``fd`` names the remote's file by path only (O_PATH)
    checked_as: tuple[int, int, int] | None = None  # "cache": the file as last checked


@dataclass(eq=False)
class OpenFile:
    """One open() of a file read chunk by chunk.  Thread safety: ``lock`` serialises
    reads of this handle."""

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
    """Lookups, listings and opens of the mirror.  Thread safety: see each collaborator;
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
        remote_files: RemoteFiles | None = None,
        control_target: str | None = None,
    ) -> None:
        self.remote = remote
        self.store = store
        self.attrs = attrs
        self.fetcher = fetcher
        self.metrics = metrics
        self.prefetcher = prefetcher
        self.remote_files = remote_files
        self.control_target = control_target
        self._handles: dict[int, OpenFile] = {}
        self._next_handle = itertools.count(1)
        self._read_bytes = {s: metrics.read_bytes.labels(s) for s in READ_SOURCES}
        self._opens = {r: metrics.file_opens.labels(r) for r in OPEN_RESULTS}

    # -- metadata ----------------------------------------------------------------------

    def getattr(self, relpath: str) -> Attr:
        if self.control_target and is_control_entry(relpath):
            return self._control_attr()
        return self.attrs.get(relpath)

    def getattr_fresh(self, relpath: str) -> tuple[Attr, float]:
        """``getattr``, with the seconds the kernel may keep the attributes: none for the
        control entry, whose target is the daemon serving now."""
        if is_control_entry(relpath):
            return self.getattr(relpath), 0.0
        return self.attrs.get_fresh(relpath)

    def _control_attr(self) -> Attr:
        root = self.attrs.get("")
        target = os.fsencode(self.control_target or "")
        return Attr(stat.S_IFLNK | 0o777, len(target), root.uid, root.gid, 1,
                    root.atime_ns, root.mtime_ns, root.ctime_ns)

    def readlink(self, relpath: str) -> str:
        if self.control_target and is_control_entry(relpath):
            return self.control_target
        return self.remote.readlink(relpath)

    def listdir(self, relpath: str, *, with_attrs: bool = True) -> list[tuple[str, int]]:
        """(name, file type bits) of each entry; ``with_attrs``, the attributes that come with
        the listing are remembered (a walk that stats the names: ``ls -l``), else only the
        names are read (``find``)."""
        if with_attrs:
            entries = self.attrs.list_directory(relpath)
        else:
            entries = self.remote.listnames(relpath)
            self.attrs.names_listed(relpath)
        if self.control_target:  # a remote file of that name is hidden by the entry
            entries = [entry for entry in entries if entry[0] != CONTROL_NAME]
        return entries

    # -- open ------------------------------------------------------------------------------

    def locate(self, relpath: str, attr: Attr, *, fetch: bool = True,
               held: tuple[int, int, int] | None = None) -> Located | None:
        """Where this open of the regular file ``relpath`` (version ``attr``) finds its bytes,
        counted as an open.  Without ``fetch`` (the fast path), only a whole local file, or
        the remote's own file where the kernel reads it, is an answer: None (nothing
        counted) otherwise.  ``held``: the caller kept this version's cache file from an
        earlier answer, the file as it was checked then (``checked_as``); when that is still
        the file, untouched, the answer is "held"."""
        key = relpath_key(relpath)
        # Settle the prefetcher first: a prefetch into the cache that finishes now must
        # be seen by the lookup below, not fetched a second time.
        prefetched = None
        if self.prefetcher is not None:
            prefetched = self.prefetcher.on_open(relpath, attr, self.remote.timeout_seconds,
                                                 in_turn=not fetch)
        cache_result, cache_source = "hit", "cache"
        if prefetched is not None and prefetched.into_cache:
            cache_result, cache_source = "prefetched", "prefetch"
        if held is not None and (prefetched is None or prefetched.staged is None) \
                and self.store.still_held(key, attr, held):
            # The kept file is the one checked when it was registered, and its record stands
            # (dropping it removes the file or lets the holder go): no index query.
            self.count_open(cache_result, cache_source, attr.size)
            return Located("held", cache_result, cache_source)
        admission = self.store.admission
        eligible = admission.eligible(relpath)
        # A file the cache would not keep is not in it: no index lookup for it.
        kept = eligible or admission.holds_others
        if kept and (prefetched is None or prefetched.staged is None):
            # A small file whose cache copy says it is this version, whole and checked: no
            # index query either (what it cannot tell, the index answers below).
            marked = self.store.checked_file(key, attr.version)
            if marked is not None:
                self.count_open(cache_result, cache_source, attr.size)
                return Located("cache", cache_result, cache_source, fd=marked[0],
                               checked_as=marked[1])
        record = self.store.lookup(key) if kept else None
        if record is not None and record.version != attr.version:
            log.info("%s changed on the remote: cached copy dropped", relpath)
            self.store.drop(key)
            record = None
        if prefetched is not None and prefetched.staged is not None:
            found = Located(prefetched.staged_kind, "prefetched", "prefetch",
                            fd=prefetched.staged)
        elif attr.size == 0:  # no bytes to fetch: always whole in the cache
            found = Located("memory", cache_result, cache_source, fd=memory_file(relpath, b""))
        elif record is not None and self.store.is_complete(record):
            found = self._cached(relpath, key, attr, record, cache_result, cache_source)
        else:
            found = None
        if found is None and self._hands_over(relpath, key, attr, record):
            # The kernel reads the remote's own file (its reads are bounded by the NFS
            # mount's options, not --remote-timeout; README, "Where the bytes of a read come
            # from"), and copies a kept file into the cache beside the reader.  So may a
            # fast-path reader.
            found = self._hand_over(relpath, key, attr, admit=eligible and self.store.admitting,
                                    prefetched=prefetched, for_kernel=fetch)
            if found is None:  # a fill stored it meanwhile: the cache's copy
                if prefetched is not None and prefetched.underway:  # the prefetch's fill
                    cache_result, cache_source = "prefetched", "prefetch"
                record = self.store.lookup(key)
                if record is not None:
                    found = self._cached(relpath, key, attr, record, cache_result,
                                         cache_source)
        if not fetch and (found is None or found.kind == "chunks"):
            return None
        if found is None:
            found = self._miss(relpath, key, attr, admit=eligible and self.store.admitting)
        self.count_open(found.result, found.source, 0 if found.kind == "chunks" else attr.size)
        return found

    def count_open(self, result: str, source: str, handed_bytes: int) -> None:
        """Count an open, and the bytes of a file handed over whole at open: once the kernel
        reads a backing file itself, the open is the last this daemon sees of it."""
        self._opens[result].inc()
        if handed_bytes:
            self._read_bytes[source].inc(handed_bytes)

    def _cached(self, relpath: str, key: bytes, attr: Attr, record: FileRecord,
                result: str, source: str) -> Located | None:
        found = self._cache_file(key, record, result, source)
        if found is not None:
            return found
        record = self.store.whole(key, attr.version)
        if record is not None:
            # Whole but not verified yet (a large file, in the background): chunk by chunk,
            # each chunk verified as it is read.
            handle = self._handle(relpath, key, attr, record)
            handle.cache_source = source
            return Located("chunks", result, source, handle=handle)
        return None  # dropped as damaged: fetched again

    def _hands_over(self, relpath: str, key: bytes, attr: Attr, record: FileRecord | None
                    ) -> bool:
        """Whether a miss is answered with the remote's own file: where the kernel reads
        it, for a file neither partly cached (a large one with a damaged chunk, say: read
        chunk by chunk, the cached chunks from the cache) nor owned by another node."""
        remote_files = self.remote_files
        if remote_files is None or not remote_files.enabled:
            return False
        if record is not None:  # it may have been dropped since (a damaged file)
            record = self.store.lookup(key)
            if record is not None and record.version == attr.version \
                    and record.stored_chunks > 0:
                return False
        return not self.fetcher.origin.from_peer(relpath)

    def _hand_over(self, relpath: str, key: bytes, attr: Attr, *, admit: bool,
                   prefetched: Prefetched | None, for_kernel: bool) -> Located | None:
        # Served by a prefetch: the reader shares the open file of its fill (the pages on
        # their way), or it read the file in (the pages cached, their bytes counted).  A
        # reader that came first opens the file itself, a miss, whose pages a fill to come
        # shares through the remote file's page cache.
        fetched = prefetched is not None and prefetched.fetched
        handed = self.remote_files.open_for_reader(relpath, key, attr, keep=admit,
                                                   for_kernel=for_kernel, counted=fetched)
        if handed is None:
            return None
        if fetched or handed.shared and prefetched is not None and prefetched.underway:
            return Located("remote", "prefetched", "prefetch", fd=handed.fd,
                           readable=handed.readable)
        return Located("remote", "miss", "remote", fd=handed.fd, readable=handed.readable)

    def read_through(self, relpath: str, attr: Attr) -> Located:
        """An open read chunk by chunk through :meth:`read` (from the cache where chunks are
        stored, the remote otherwise), whatever else is local."""
        key = relpath_key(relpath)
        return Located("chunks", "miss", "remote",
                       handle=self._handle(relpath, key, attr, self.store.lookup(key)))

    def _miss(self, relpath: str, key: bytes, attr: Attr, *, admit: bool) -> Located:
        """A miss the daemon fetches itself: whole into the cache or a memory file (small
        files), or chunk by chunk as it is read (large ones)."""
        if attr.size > WHOLE_FETCH_BYTES:
            return self.read_through(relpath, attr)
        chunk = self.fetcher.fetch(relpath, key, attr, 0, admit=admit)
        if admit:
            record = self.store.lookup(key)
            if record is not None and record.version == attr.version:
                found = self._cache_file(key, record, "miss", chunk.read_source)
                if found is not None:
                    return found
        return Located("memory", "miss", chunk.read_source,
                       fd=memory_file(relpath, chunk.data))

    def _cache_file(self, key: bytes, record: FileRecord, result: str, source: str
                    ) -> Located | None:
        """The cache's file of ``record``, checked (None when it is not whole or failed)."""
        fd = self.store.local_file(key, record)
        if fd is None:
            return None
        # The record as it is once the file is checked: what tells this file apart from any
        # other, for a caller that keeps it (see ``held``).
        checked = self.store.lookup(key)
        return Located("cache", result, source, fd=fd,
                       checked_as=checked.checked_as if checked is not None else None)

    def _handle(self, relpath: str, key: bytes, attr: Attr, record: FileRecord | None
                ) -> OpenFile:
        if record is not None and record.version != attr.version:
            record = None
        return OpenFile(relpath, key, attr, record)

    def register(self, f: OpenFile) -> int:
        """A handle number for reads of ``f`` through :meth:`read`."""
        handle = next(self._next_handle)
        self._handles[handle] = f
        return handle

    def release(self, handle: int) -> OpenFile | None:
        """Close a handle; the open file it was, if it was open."""
        f = self._handles.pop(handle, None)
        if f is not None and f.remote_file is not None:
            f.remote_file.close()
        return f

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
        if admit or self.fetcher.inflight(f.key, f.attr, number) is not None \
                or self.fetcher.origin.from_peer(f.relpath):
            chunk = self.fetcher.fetch(f.relpath, f.key, f.attr, number, admit=admit)
            self._set_buffer(f, chunk_offset, chunk.data, chunk.read_source)
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
