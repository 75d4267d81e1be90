"""The control socket: a line protocol any language can speak.

The mount's root holds a hidden symlink, ``.cachefs.sock``, to a Unix stream
socket, so a client needs nothing but the mount path::

    printf 'HINT train/n01440764/img_1.jpg\\n' | socat - UNIX-CONNECT:/mnt/imagenet/.cachefs.sock

One request per line (``\\n``-terminated, at most MAX_LINE_BYTES); the command
word, a space, then the argument as raw bytes (a path may hold any byte but NUL
and newline).  ``HINT`` is fire-and-forget; the others get one JSON line back.
The README documents each command.

Each connection gets a thread, up to MAX_CONNECTIONS; further connections are
closed at once.  Overlong lines are skipped and counted, never buffered.
Peers are identified by SO_PEERCRED, so handlers can check what the calling
user may read.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 8192
MAX_CONNECTIONS = 1024
# One local user cannot hold every connection and lock the others (and status) out.
# A node of 8 training processes with 8 workers each holds 2 x 72 connections.
MAX_CONNECTIONS_PER_USER = 256
SEND_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection (from the kernel, not from the client)."""

    pid: int
    uid: int
    gid: int


@dataclass
class Reply:
    """A JSON line to send back, and raw bytes right after it (its body says how many)."""

    body: dict
    payload: bytes = b""


Handler = Callable[[Peer, bytes], Reply | None]


class ControlServer:
    """Accepts connections on a Unix socket and dispatches request lines.

    Thread safety: one thread accepts; each connection has its own thread;
    ``_lock`` guards ``_connections`` and ``_per_user``.  Handlers are called concurrently.
    """

    def __init__(self, path: Path, handlers: dict[bytes, Handler],
                 on_invalid: Callable[[], None] = lambda: None) -> None:
        self.path = path
        self._handlers = handlers
        self._on_invalid = on_invalid
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._per_user: dict[int, int] = {}  # uid -> connections held
        self._closed = False
        self.rejected_connections = 0
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        # Any local user may connect; handlers check what each peer may read.
        os.chmod(path, 0o666)
        self._listener.listen(128)
        self._thread = threading.Thread(target=self._accept_loop, name="control-accept",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            try:
                peer = _peer_of(conn)
            except OSError:
                conn.close()
                continue
            with self._lock:
                mine = self._per_user.get(peer.uid, 0)
                full = len(self._connections) >= MAX_CONNECTIONS \
                    or (peer.uid != 0 and mine >= MAX_CONNECTIONS_PER_USER)
                if not full:
                    self._connections.add(conn)
                    self._per_user[peer.uid] = mine + 1
            if full:
                self.rejected_connections += 1
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="control-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, peer: Peer) -> None:
        try:
            conn.settimeout(None)
            listening = True
            for line in _lines(conn, self._on_invalid):
                reply = self._dispatch(peer, line)
                if reply is not None and listening:
                    try:
                        _send(conn, reply)
                    except OSError:
                        # The client stopped reading (or closed after writing): the
                        # requests it already sent are still carried out.
                        listening = False

        except OSError:
            pass  # the client went away
        except Exception:
            log.exception("control connection failed")
        finally:
            with self._lock:
                self._connections.discard(conn)
                left = self._per_user[peer.uid] - 1
                if left:
                    self._per_user[peer.uid] = left
                else:
                    del self._per_user[peer.uid]
            conn.close()

    def _dispatch(self, peer: Peer, line: bytes) -> Reply | None:
        command, _, argument = line.partition(b" ")
        handler = self._handlers.get(command.upper())
        if handler is None:
            self._on_invalid()
            return Reply({"ok": False, "error": "unknown command"})
        return handler(peer, argument)


def _peer_of(conn: socket.socket) -> Peer:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Peer(*struct.unpack("3i", creds))


def _lines(conn: socket.socket, on_overlong: Callable[[], None]):
    """Complete lines from ``conn``; a line longer than MAX_LINE_BYTES is skipped."""
    pending = bytearray()
    skipping = False
    while True:
        data = conn.recv(65536)
        if not data:
            return
        pending += data
        while True:
            newline = pending.find(b"\n")
            if newline < 0:
                break
            line = bytes(pending[:newline])
            del pending[: newline + 1]
            if skipping:
                skipping = False
                continue
            if len(line) > MAX_LINE_BYTES:
                on_overlong()
                continue
            yield line.rstrip(b"\r")
        if len(pending) > MAX_LINE_BYTES:
            if not skipping:
                on_overlong()
            skipping = True
            pending.clear()


def _send(conn: socket.socket, reply: Reply) -> None:
    message = json.dumps(reply.body, separators=(",", ":")).encode() + b"\n"
    conn.settimeout(SEND_TIMEOUT_SECONDS)
    try:
        conn.sendall(message)
        if reply.payload:
            conn.sendall(reply.payload)
    finally:
        conn.settimeout(None)
