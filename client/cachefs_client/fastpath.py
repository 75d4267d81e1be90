"""Reading a file's bytes straight from the daemon, past FUSE, when they are local.

A read through a FUSE mount costs several round trips into the daemon (lookup,
open, reads, release), each a few tens of microseconds of Python, which adds up
to a ceiling of a few thousand small files per second.  ``read_file`` asks the
daemon over its control socket instead: one request, one reply carrying the
bytes.  The daemon answers only for files already local (cached or prefetched),
after the same checks the mount makes: the caller's permissions (from the
socket's peer credentials), the revalidated attributes, the checksums.
Anything else (a miss, an error, a daemon that is gone) is read through the
mount, so the answer is always what ``open(path, "rb").read()`` gives.

The client asks for a descriptor rather than the bytes: the daemon passes an open
read-only descriptor of the local file that holds them (SCM_RIGHTS), the very
file the kernel would read through the mount (the cache's file, verified before
its first hand-over, or a sealed memory file), and the worker reads it itself.
The daemon then costs one small request per file, not a copy of every byte.
"""

from __future__ import annotations

import array
import collections
import ctypes
import functools
import json
import os
import socket
import threading

from cachefs_client._control import Unreachable, connect
from cachefs_client._daemon import (
    Connection,
    per_process,
    process_state,
    warn_once,
    warn_unreachable,
)

# A reply may wait for a prefetch of the file to land; the mount would wait as long.
READ_TIMEOUT_SECONDS = 60.0
MAX_REPLY_LINE = 65536
# Longer paths are not sent (the daemon skips overlong lines without a reply).
MAX_REQUEST_PATH_BYTES = 4096
# Requests sent at once; well under a Unix socket's buffer (about 200 KiB).
MAX_BATCH_REQUEST_BYTES = 32768
_REQUEST_FRAME_BYTES = len(b"OPEN \n")  # a request's bytes besides its path
# The daemon sends up to 64 descriptors in one message; room for the kernel's most.
_ANCILLARY_SPACE = socket.CMSG_SPACE(253 * array.array("i").itemsize)

# glibc's mallopt() parameters, and what a reading process keeps (see _keep_freed_memory).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
HEAP_ALLOCATION_MAX_BYTES = 32 << 20  # glibc's ceiling for the mmap threshold
KEPT_FREE_BYTES = 128 << 20


class DaemonReader(Connection):
    """This process's reading connection to the daemon of one mount.

    Requests are pipelined: a batch's requests go out in one write and the replies
    are read in order, so a batch costs the daemon one wake-up, not one per file.

    Thread safety: ``_lock`` serialises requests and replies on the socket.
    """

    def __init__(self, mount_point: str) -> None:
        self.mount_point = mount_point
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._replies: _Replies | None = None
        self._broken = False
        self._descriptors = True
        _keep_freed_memory()

    def read_many(self, relatives: list[bytes]) -> list[bytes | None]:
        """Each file's bytes from the daemon, or None where the mount must be used."""
        found: list[bytes | None] = [None] * len(relatives)
        with self._lock:
            if self._broken:
                return found
            try:
                self._connect_locked()
            except Unreachable as exc:
                self._broken = True
                warn_unreachable(self.mount_point, exc)
                return found
            try:
                wanted = [i for i, rel in enumerate(relatives)
                          if b"\n" not in rel and len(rel) <= MAX_REQUEST_PATH_BYTES]
                for batch in _batches(wanted, relatives):
                    command = b"OPEN" if self._descriptors else b"READ"
                    again = self._exchange_locked(command, batch, relatives, found)
                    # A daemon older than OPEN is asked with READ.
                    self._exchange_locked(b"READ", again, relatives, found)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                # A daemon too old to know READ, gone, or confused: use the mount from now
                # on in this process.  The mount gives the same bytes.
                self._close_locked()
                self._broken = True
                warn_once(f"fastpath:{self.mount_point}",
                          f"reading {self.mount_point} through the mount only ({exc!r})")
        return found

    def _exchange_locked(self, command: bytes, batch: list[int], relatives: list[bytes],
                         found: list[bytes | None]) -> list[int]:
        """Send ``command`` for each file of ``batch`` at once, then read the replies in
        order into ``found``; returns the files to ask again with READ."""
        if not batch:
            return []
        self._sock.sendall(b"".join(command + b" " + relatives[i] + b"\n" for i in batch))
        again = []
        for i in batch:
            header = json.loads(self._replies.readline(MAX_REPLY_LINE))
            if not header.get("ok"):
                if command == b"OPEN" and header.get("error") == "unknown command":
                    self._descriptors = False  # a daemon older than OPEN: ask for bytes
                    again.append(i)
                continue
            size = int(header["size"])
            if "fd" not in header:
                found[i] = self._replies.read(size)
                continue
            fd = self._replies.take_descriptor()
            try:
                data = os.pread(fd, size + 1, 0)  # a byte more tells a file that grew
            finally:
                os.close(fd)
            if len(data) == size:
                found[i] = data  # else the mount reads it (and the daemon finds out why)
        return again

    def _connect_locked(self) -> None:
        if self._sock is None:
            sock = connect(self.mount_point, READ_TIMEOUT_SECONDS)
            self._sock, self._replies = sock, _Replies(sock)

    def _close_locked(self) -> None:
        for closable in (self._replies, self._sock):
            if closable is not None:
                try:
                    closable.close()
                except OSError:
                    pass
        self._sock = self._replies = None


@functools.cache  # a setting of the process (kept across fork): made once
def _keep_freed_memory() -> None:
    """Let this process reuse the memory of one batch's files for the next batch.

    A batch's files are all alive at once (megabytes), then freed together.  glibc
    hands such memory back to the kernel at once (heap trim; munmap for allocations
    over 128 KiB), so the next batch takes a page fault for every 4 KiB it reads:
    measured here, that doubled a worker's CPU per 64 KiB file (about 50 us more
    than the read itself).  Keeping up to KEPT_FREE_BYTES of freed heap, and taking
    files of up to 32 MiB from the heap, makes the batches reuse one another's pages.
    The peak memory is the batch's, as before; it is just not returned in between.
    Elsewhere than glibc this does nothing.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt(_M_MMAP_THRESHOLD, HEAP_ALLOCATION_MAX_BYTES)
    mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_BYTES)


def _batches(wanted: list[int], relatives: list[bytes]) -> list[list[int]]:
    """``wanted`` cut so that one batch's requests fit in a socket buffer: the daemon
    never blocks sending replies while this process still blocks sending requests."""
    batches: list[list[int]] = []
    size = MAX_BATCH_REQUEST_BYTES
    for i in wanted:
        request_bytes = len(relatives[i]) + _REQUEST_FRAME_BYTES
        if size + request_bytes > MAX_BATCH_REQUEST_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(i)
        size += request_bytes
    return batches


class _Replies:
    """Reply lines from the daemon, the bytes that follow them, and the descriptors
    that arrived with them (a buffered file object would drop those).

    Descriptors are matched to replies in order: each reply that announces one
    (``fd``) carries exactly one, sent with its first byte, so by the time its
    line is complete its descriptor is here and every earlier one has been taken.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = bytearray()
        self._fds: collections.deque[int] = collections.deque()

    def readline(self, limit: int) -> bytes:
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > limit:
                raise ValueError("reply line too long")
            self._receive()
        line = bytes(self._buffer[: end + 1])
        del self._buffer[: end + 1]
        return line

    def take_descriptor(self) -> int:
        if not self._fds:
            raise OSError("a reply came without its descriptor")
        return self._fds.popleft()

    def read(self, size: int) -> bytes:
        out = bytearray(size)
        view = memoryview(out)
        got = min(size, len(self._buffer))
        view[:got] = self._buffer[:got]
        del self._buffer[:got]
        while got < size:
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise OSError("short reply")
            got += n
        return bytes(out)

    def _receive(self) -> None:
        data, ancillary, _flags, _addr = self._sock.recvmsg(
            65536, _ANCILLARY_SPACE, socket.MSG_CMSG_CLOEXEC)
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
                self._fds.extend(fds)
        if not data:
            raise OSError("the daemon closed the connection")
        self._buffer += data

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popleft())


def reader_for(mount_point: str) -> DaemonReader:
    return per_process("readers", mount_point, DaemonReader)


def read_file(path) -> bytes:
    """The bytes of the file at ``path``: from the cachefs daemon directly when the file
    is local to it, through the filesystem otherwise.  Same result as
    ``open(path, "rb").read()``, errors included."""
    return read_files([path])[0]


def read_files(paths) -> list[bytes]:
    """``read_file`` for a batch: the files local to the daemon come in one round trip
    (a DataLoader worker's ``__getitems__`` is the place to call it).  Same results as
    reading each file in turn, errors included."""
    paths = list(paths)
    found: list[bytes | None] = [None] * len(paths)
    by_mount: dict[str, tuple[list[int], list[bytes]]] = {}
    locate = process_state().paths.locate
    for i, path in enumerate(paths):
        located = locate(path)
        if located is not None and located[1]:
            indices, relatives = by_mount.setdefault(located[0], ([], []))
            indices.append(i)
            relatives.append(os.fsencode(located[1]))
    for mount_point, (indices, relatives) in by_mount.items():
        got = reader_for(mount_point).read_many(relatives)
        for k, i in enumerate(indices):
            found[i] = got[k]
    for i, data in enumerate(found):
        if data is None:
            # Unbuffered: a buffered open asks whether the file is a terminal, an ioctl
            # that a FUSE mount sends to its daemon, one more round trip per file.
            with open(paths[i], "rb", buffering=0) as f:
                found[i] = f.read()
    return found
