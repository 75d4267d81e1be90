"""The control socket: a line protocol any language can speak.

The mount's root holds a hidden symlink, ``.cachefs.sock``, to a Unix stream
socket, so a client needs nothing but the mount path::

    printf 'HINT train/n01440764/img_1.jpg\\n' | socat - UNIX-CONNECT:/mnt/imagenet/.cachefs.sock

One request per line (``\\n``-terminated, at most MAX_LINE_BYTES); the command
word, a space, then the argument as raw bytes (a path may hold any byte but NUL
and newline).  ``HINT`` is fire-and-forget; the others get one JSON line back.  A
command of the ``takers`` (READ-AHEAD) hands its connection to another process: its answer
is the last line the daemon sends on it.
The README documents each command.

Each connection gets a thread, up to MAX_CONNECTIONS; further connections are
closed at once.  Overlong lines are skipped and counted, never buffered.
Peers are identified by SO_PEERCRED, so handlers can check what the calling
user may read.

The socket's file is made again when it goes (a cleaner of aged files in /tmp,
an operator's ``rm``): clients find the daemon by its path, and a training job
would otherwise lose its hints for good, without a word.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import struct
import threading
import time
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
# Replies to pipelined requests are held back at most this much before being sent.
MAX_HELD_PAYLOAD_BYTES = 2**20
MAX_FDS_PER_MESSAGE = 64  # clients accept up to SCM_MAX_FD (253) per message
# Only the replies to these (a batch's reads) wait for the requests after them; any
# other request (a FETCH may take seconds) first sends what is held...
COALESCED_COMMANDS = frozenset({b"OPEN", b"READ"})
# ... but for a FETCH after FETCHes that each took less than this, the first of their
# answers held for less than it too: a warm's of a fast remote (warm.py takes its answers in
# rounds of 2 ms anyway).  Such a FETCH takes some 200 us, and a send per answer cost the
# daemon 6 - 10 us of a fill's 200 (a warm of 100,000 files of 4 KiB from a cold disk, a
# local tree as the remote, 3 runs in turns: 4,714 - 4,903 files/s at 196 - 202 us of daemon
# CPU per file, against 4,553 - 4,735 at 200 - 209 answering each at once).  Answers of a
# remote with latency are sent as before, each before the next FETCH; one FETCH that takes
# long after quick ones holds their answers for as long, which costs the client nothing: the
# connection answers in order, so the requests it would send in their place would wait
# behind that one anyway.
FETCH_ANSWERS_HELD_SECONDS = 0.002
# Requests answered by no line (fire-and-forget).
UNANSWERED_COMMANDS = frozenset({b"HINT"})
# How often the socket's file is checked, and made again when it is gone.
PATH_CHECK_SECONDS = 5.0
BIND_ATTEMPTS = 3


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection (from the kernel, not from the client)."""

    pid: int
    uid: int
    gid: int


@dataclass
class Reply:
    """A JSON line to send back, and raw bytes right after it (its body says how many).

    ``body`` is a dict, or the line already encoded (bytes, no newline) where a reply
    is sent for every file and json.dumps would cost ten times the formatting.

    ``fd``, when set, travels with the line as SCM_RIGHTS ancillary data; the reply
    owns it and the server closes it once sent (or once the client is gone).

    ``taken``: the connection was handed to another process (a taker's reply); this is the
    last line sent on it here, and nothing more is read from it.
    """

    body: dict | bytes
    payload: bytes = b""
    fd: int | None = None
    taken: bool = False

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


Handler = Callable[[Peer, bytes], Reply | None]
# A command that may take the connection itself (it gets the socket, not an argument).
Taker = Callable[[Peer, socket.socket], Reply]


class ControlServer:
    """Accepts connections on a Unix socket and dispatches request lines.

    Thread safety: one thread accepts; each connection has its own thread;
    ``_lock`` guards ``_connections`` and ``_per_user``.  Handlers are called concurrently.
    """

    def __init__(self, path: Path, handlers: dict[bytes, Handler],
                 on_invalid: Callable[[], None] = lambda: None,
                 takers: dict[bytes, Taker] | None = None) -> None:
        self.path = path
        self._handlers = handlers
        self._takers = takers or {}
        self._on_invalid = on_invalid
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._per_user: dict[int, int] = {}  # uid -> connections held
        self._closed = False
        self.rejected_connections = 0
        self._listener, self._inode = self._bind()
        self._thread = threading.Thread(target=self._accept_loop, name="control-accept",
                                        daemon=True)
        self._thread.start()

    def _bind(self, *, replace: bool = True) -> tuple[socket.socket, int]:
        """A listening socket at ``path``, and the inode of its file there.  With
        ``replace``, a file already there (a killed daemon's socket, or the one of the daemon
        this one takes the mount over from) is removed first.  Bound at the path itself, not
        renamed there: a client's getpeername() names it."""
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for attempt in range(BIND_ATTEMPTS):
                if replace:
                    try:
                        self.path.unlink()
                    except FileNotFoundError:
                        pass
                try:
                    listener.bind(str(self.path))
                    break
                except OSError as exc:
                    # Made again meanwhile by the daemon before this one (its check found
                    # the path empty between the unlink and the bind): remove it again.
                    if exc.errno != errno.EADDRINUSE or not replace \
                            or attempt == BIND_ATTEMPTS - 1:
                        raise
            # Any local user may connect; handlers check what each peer may read.
            os.chmod(self.path, 0o666)
            inode = os.stat(self.path).st_ino
            listener.listen(128)
            listener.settimeout(PATH_CHECK_SECONDS)
        except BaseException:
            listener.close()
            raise
        return listener, inode

    def _path_is_mine(self) -> bool | None:
        """Whether ``path`` is this server's socket; None when nothing is there."""
        try:
            return os.stat(self.path).st_ino == self._inode
        except FileNotFoundError:
            return None

    def _keep_path(self) -> None:
        """Make the socket's file again when it has gone.  Another file in its place (a
        daemon that took the mount over) is left alone."""
        if self._path_is_mine() is not None:
            return
        try:
            listener, inode = self._bind(replace=False)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:  # made meanwhile: not ours to take
                return
            log.warning("the control socket %s was removed, and cannot be made again: %s",
                        self.path, exc.strerror)
            return
        log.warning("the control socket %s was removed: made again", self.path)
        old, self._listener, self._inode = self._listener, listener, inode
        old.close()
        if self._closed:
            self.close()

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
        if self._path_is_mine():  # not a successor's
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def _accept_loop(self) -> None:
        next_check = time.monotonic() + PATH_CHECK_SECONDS
        while not self._closed:
            if time.monotonic() >= next_check:
                self._keep_path()
                next_check = time.monotonic() + PATH_CHECK_SECONDS
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
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
            # A client that stops reading makes sends fail after this long.  Set on the
            # socket, not with settimeout(), which would add a poll() and two ioctl()s to
            # every reply.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("ll", int(SEND_TIMEOUT_SECONDS), 0))
            outbox = _Outbox(conn)
            failures = 0
            try:
                for line in _lines(conn, self._on_invalid):
                    if line is None:  # about to wait for more: answer what was asked so far
                        outbox.flush()
                        continue
                    command, _, argument = line.partition(b" ")
                    command = command.upper()
                    if command in self._takers:
                        outbox.flush()
                        reply = self._takers[command](peer, conn)
                        outbox.add(reply)
                        outbox.flush()
                        if reply.taken:
                            return  # (its client sends nothing more before this answer)
                        continue
                    fetch = command == b"FETCH"
                    if command not in COALESCED_COMMANDS \
                            and not (fetch and outbox.holds_quick_fetches_only()):
                        outbox.flush()  # this one may take long (a FETCH): answer the others
                    began = time.monotonic() if fetch else 0.0  # only a FETCH's time is asked
                    try:
                        reply = self._dispatch(peer, command, argument)
                    except Exception as exc:
                        # This request's failure, not the connection's: the requests after
                        # it (a warm's next thousands of files) are still answered.  Logged
                        # once per connection, not once per request.
                        if not failures:
                            log.exception("control request %s failed", command.decode(
                                errors="replace"))
                        failures += 1
                        reply = None if command in UNANSWERED_COMMANDS else \
                            Reply({"ok": False, "error": str(exc) or type(exc).__name__})
                    if reply is not None:
                        outbox.add(reply, time.monotonic() - began if fetch else None)
            finally:
                outbox.discard()
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

    def _dispatch(self, peer: Peer, command: bytes, argument: bytes) -> Reply | None:
        handler = self._handlers.get(command)
        if handler is None:
            self._on_invalid()
            return Reply({"ok": False, "error": "unknown command"})
        return handler(peer, argument)


def _peer_of(conn: socket.socket) -> Peer:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return Peer(*struct.unpack("3i", creds))


def _lines(conn: socket.socket, on_overlong: Callable[[], None]):
    """Complete lines from ``conn``, and None each time every line received so far has
    been yielded (the caller answers them before we wait for more).  A line longer
    than MAX_LINE_BYTES is skipped."""
    pending = bytearray()
    skipping = False
    while True:
        yield None
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


class _Outbox:
    """The replies to one connection's pipelined requests, sent together: one sendmsg
    (descriptors included) for a batch of requests, not one per request.  Held back
    only until the requests already received are answered, a request other than a
    read comes (but for a warm's quick FETCHes: FETCH_ANSWERS_HELD_SECONDS), or a bound
    (bytes, descriptors) is reached."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._replies: list[Reply] = []
        self._payload_bytes = 0
        self._fds = 0
        self._listening = True
        # Every reply held answers a FETCH that took under FETCH_ANSWERS_HELD_SECONDS.
        self._quick_fetches_only = True
        self._first_held_at = 0.0

    def add(self, reply: Reply, fetch_seconds: float | None = None) -> None:
        """Hold ``reply`` (the answer to a FETCH that took ``fetch_seconds``, or to another
        request) until a flush."""
        if not self._replies:
            self._first_held_at = time.monotonic()
        self._quick_fetches_only = self._quick_fetches_only and fetch_seconds is not None \
            and fetch_seconds < FETCH_ANSWERS_HELD_SECONDS
        self._replies.append(reply)
        self._payload_bytes += len(reply.payload)
        self._fds += reply.fd is not None
        if self._payload_bytes >= MAX_HELD_PAYLOAD_BYTES or self._fds >= MAX_FDS_PER_MESSAGE:
            self.flush()

    def holds_quick_fetches_only(self) -> bool:
        """Whether the replies held may wait for the next FETCH: each answers a quick FETCH,
        and the first was held under FETCH_ANSWERS_HELD_SECONDS (see there)."""
        return self._quick_fetches_only and bool(self._replies) \
            and time.monotonic() - self._first_held_at < FETCH_ANSWERS_HELD_SECONDS

    def flush(self) -> None:
        replies, self._replies = self._replies, []
        self._payload_bytes = self._fds = 0
        self._quick_fetches_only = True
        try:
            if replies and self._listening:
                _send(self._conn, replies)
        except OSError:
            # The client stopped reading (or closed after writing): the requests it
            # already sent are still carried out.
            self._listening = False
        finally:
            for reply in replies:
                reply.close()

    def discard(self) -> None:
        for reply in self._replies:
            reply.close()
        self._replies = []


# One encoder for every reply: json.dumps with options builds a new one per call.
_encode = json.JSONEncoder(separators=(",", ":")).encode


def _send(conn: socket.socket, replies: list[Reply]) -> None:
    # Reply lines are joined; payloads (possibly large) are sent as they are.
    pieces: list[bytes] = []
    lines: list[bytes] = []
    for reply in replies:
        body = reply.body
        lines.append((body if isinstance(body, bytes) else _encode(body).encode()) + b"\n")
        if reply.payload:
            pieces += [b"".join(lines), reply.payload]
            lines = []
    if lines:
        pieces.append(b"".join(lines))
    fds = [reply.fd for reply in replies if reply.fd is not None]
    if fds:
        # The descriptors ride on the first bytes, ahead of every line that announces
        # one; the client takes them in order.
        pieces[0] = pieces[0][socket.send_fds(conn, [pieces[0]], fds):]
    for piece in pieces:
        if piece:
            conn.sendall(piece)
