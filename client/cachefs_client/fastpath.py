"""Reading a file's bytes straight from the daemon, past FUSE, when they are local.

A read through a FUSE mount costs several round trips into the daemon (lookup,
open, reads, release), each a few tens of microseconds of Python, which adds up
to a ceiling of a few thousand small files per second.  ``read_file`` asks the
daemon over its control socket instead: one request, one reply carrying the
bytes.  The daemon answers only for files already local (cached or prefetched),
after the same checks the mount makes: the caller's permissions (from the
socket's peer credentials), the revalidated attributes, the chunk checksums.
Anything else (a miss, an error, a daemon that is gone) is read through the
mount, so the answer is always what ``open(path, "rb").read()`` gives.

Why bytes and not an open descriptor of the cached file: every cached chunk is
checked against its checksum before it is served, so the daemon reads it anyway;
a descriptor would either skip that check or make every client verify xxh3.
"""

from __future__ import annotations

import json
import os
import socket
import threading

from cachefs_client._daemon import CONTROL_NAME, per_process, process_state, warn_once

# A reply may wait for a prefetch of the file to land; the mount would wait as long.
READ_TIMEOUT_SECONDS = 60.0
MAX_REPLY_LINE = 65536


class DaemonReader:
    """This process's reading connection to the daemon of one mount.

    Thread safety: ``_lock`` serialises request and reply on the socket.
    """

    def __init__(self, mount_root: str) -> None:
        self.mount_root = mount_root
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._replies = None
        self._broken = False

    def read(self, relative: bytes) -> bytes | None:
        """The file's bytes from the daemon, or None when the mount must be used."""
        if b"\n" in relative:
            return None
        with self._lock:
            if self._broken:
                return None
            try:
                self._connect_locked()
                self._sock.sendall(b"READ " + relative + b"\n")
                header = json.loads(self._replies.readline(MAX_REPLY_LINE))
                if not header.get("ok"):
                    return None
                size = int(header["size"])
                data = self._replies.read(size)
                if len(data) != size:
                    raise OSError("short reply")
                return data
            except (OSError, ValueError, KeyError, TypeError) as exc:
                # A daemon too old to know READ, gone, or confused: use the mount from now
                # on in this process.  The mount gives the same bytes.
                self._close_locked()
                self._broken = True
                warn_once(f"fastpath:{self.mount_root}",
                          f"reading {self.mount_root} through the mount only ({exc!r})")
                return None

    def _connect_locked(self) -> None:
        if self._sock is not None:
            return
        target = os.readlink(os.path.join(self.mount_root, CONTROL_NAME))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(READ_TIMEOUT_SECONDS)
        try:
            sock.connect(target)
        except OSError:
            sock.close()
            raise
        self._sock, self._replies = sock, sock.makefile("rb")

    def _close_locked(self) -> None:
        for closable in (self._replies, self._sock):
            if closable is not None:
                try:
                    closable.close()
                except OSError:
                    pass
        self._sock = self._replies = None


def reader_for(mount_root: str) -> DaemonReader:
    return per_process("readers", mount_root, DaemonReader)


def read_file(path) -> bytes:
    """The bytes of the file at ``path``: from the cachefs daemon directly when the file
    is local to it, through the filesystem otherwise.  Same result as
    ``open(path, "rb").read()``, errors included."""
    absolute = os.path.abspath(os.fspath(path))
    root = process_state().mounts.root_of(absolute)
    if root is not None:
        data = reader_for(root).read(os.fsencode(absolute[len(root):].lstrip("/")))
        if data is not None:
            return data
    with open(path, "rb") as f:
        return f.read()
