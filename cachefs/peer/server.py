"""Serving this node's files to its peers (protocol.py says what crosses the wire).

An owner answers a chunk from its cache when it holds that version (the store checks the
chunk's checksum on the way out), and otherwise fetches it from the remote once, keeps it
when its admission says so, and answers: the cluster reads each file from the remote once.
It never asks a third node (see members.py), and it answers only what it could read
itself: a regular file of BACKING of exactly the version asked for, reached through
directories only (a symlink in the path, which could lead outside BACKING, is refused).
Whether the reader's user may read the file is checked where the reader is, by its kernel,
as for any file of the mount.

The server is the standard library's threading HTTP server: each connection's requests
are answered on its own thread, straight into the store and the remote, with no hand-off
to an event loop and back per request (which an asyncio server would need for the
blocking store and remote calls).  It listens only on ``--peer-listen``, answers nothing
before the request's signature is checked, and closes connections idle for a minute.
"""

from __future__ import annotations

import errno
import http.server
import json
import logging
import sys
import threading

from cachefs.boundedserver import BoundedThreads
from cachefs.errors import CacheCorrupt, CachefsError, RemoteChanged
from cachefs.peer import protocol
from cachefs.peer.members import split
from cachefs.remote.attrcache import AttrCache, relpath_key
from cachefs.remote.fetcher import Fetcher
from cachefs.store.store import CacheStore, chunk_count

log = logging.getLogger(__name__)

IDLE_SECONDS = 60.0
# Connections served at once, a thread each: every peer's readers and prefetchers (about 40
# per peer) with room to spare; beyond it a connection is closed at once, so that a flood
# of them (a peer gone wrong, or anyone on the network) cannot take the node's threads.
MAX_CONNECTIONS = 512


class Answer(Exception):
    """An answer other than the bytes: the HTTP status and the served-result it counts as."""

    def __init__(self, status: int, result: str, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.result = result


class PeerServer:
    """The peer endpoint of one mount.  Thread safety: each request on its own thread; the
    store, the fetcher and the attribute cache are thread-safe."""

    def __init__(self, address: str, secret: bytes, *, store: CacheStore, fetcher: Fetcher,
                 attrs: AttrCache, metrics, own_remote_bytes) -> None:
        self._secret = secret
        self._store = store
        self._fetcher = fetcher
        self._attrs = attrs
        self._metrics = metrics
        self._own_remote_bytes = own_remote_bytes
        self._served = {r: metrics.peer_served.labels(r) for r in
                        ("ok", "denied", "refused", "failed")}
        host, port = split(address)
        self._httpd = HTTPServer((host, port), Handler)  # OSError: the caller says why
        self._httpd.peer = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="peer-server",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def answer(self, path: str, headers) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) for a GET of ``path``."""
        version_text = headers.get(protocol.VERSION_HEADER)
        request_auth = headers.get(protocol.AUTH_HEADER) or ""
        if not protocol.request_is_genuine(self._secret, path, version_text, request_auth):
            self._served["denied"].inc()
            return 401, {}, b""
        if path == protocol.HEALTH_PATH:
            body = json.dumps({"remote_read_bytes": int(self._own_remote_bytes())}).encode()
            return 200, protocol.sign_response(self._secret, request_auth, None, body), body
        try:
            version, data = self._chunk(path, version_text)
        except Answer as answer:
            self._served[answer.result].inc()
            log.debug("peer request %s: %d %s", path, answer.status, answer)
            return answer.status, {}, b""
        self._served["ok"].inc()
        self._metrics.peer_served_bytes.inc(len(data))
        return 200, protocol.sign_response(self._secret, request_auth, version, data), data

    def _chunk(self, path: str, version_text: str | None):
        try:
            relpath, number = protocol.parse_chunk_path(path)
            version = protocol.parse_version(version_text)
        except ValueError as exc:
            raise Answer(400, "refused", str(exc)) from None
        if not _plain_relpath(relpath):
            raise Answer(400, "refused", "not a path inside the tree")
        key = relpath_key(relpath)
        record = self._store.lookup(key)
        if record is not None and record.version == version:
            try:  # checksum verified; None when not (or no longer) held
                data = self._store.read_chunk(key, record, number)
            except CacheCorrupt:
                data = None  # dropped by the store: fetched from the remote below
            if data is not None:
                return version, data
        try:
            attr = self._attrs.get(relpath)
            for parent in _parents(relpath):
                if not self._attrs.get(parent).is_dir:
                    raise Answer(404, "refused", f"{parent} is not a directory")
            if not attr.is_file or attr.version != version:
                raise Answer(409, "refused", "another version, or not a regular file")
            if number >= chunk_count(attr.size):
                raise Answer(400, "refused", "no such chunk")
            admit = self._store.admitting and self._store.admission.eligible(relpath)
            chunk = self._fetcher.fetch(relpath, key, attr, number, admit=admit, peers=False)
        except Answer:
            raise
        except RemoteChanged as exc:
            raise Answer(409, "refused", str(exc)) from None
        except FileNotFoundError as exc:
            raise Answer(404, "refused", str(exc)) from None
        except (OSError, CachefsError) as exc:
            code = getattr(exc, "errno", None)
            status = 404 if code in (errno.ENOTDIR, errno.ELOOP) else 503
            raise Answer(status, "refused" if status == 404 else "failed",
                         str(exc) or type(exc).__name__) from None
        return version, chunk.data


def _plain_relpath(relpath: str) -> bool:
    """A relative path of plain names, as the mount itself produces them."""
    return bool(relpath) and "\0" not in relpath and all(
        part not in ("", ".", "..") for part in relpath.split("/"))


def _parents(relpath: str):
    parts = relpath.split("/")[:-1]
    for end in range(1, len(parts) + 1):
        yield "/".join(parts[:end])


class HTTPServer(BoundedThreads, http.server.HTTPServer):
    """The peer endpoint's HTTP: each request answered by ``peer.answer(path, headers)``."""

    max_connections = MAX_CONNECTIONS
    what = "peer connections"
    # Every peer's readers and prefetchers may connect at once (the library's 5 drops
    # connections under a hinted epoch, which then wait a second for the SYN again).
    request_queue_size = 1024
    peer: PeerServer  # or anything with its answer()

    def handle_error(self, request, client_address) -> None:
        # The library prints a traceback for whatever a handler raised; a peer that died or
        # hung up mid-answer (a node restarting) is worth a debug line, not that.
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            log.debug("peer %s went away mid-answer: %s", client_address[0], sys.exc_info()[1])
            return
        log.exception("peer connection from %s failed", client_address[0])


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection carries many requests
    server_version = "cachefs-peer"
    timeout = IDLE_SECONDS
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802 (the library's name)
        try:
            status, headers, body = self.server.peer.answer(self.path, self.headers)
        except Exception:
            log.exception("peer request %s failed unexpectedly", self.path)
            status, headers, body = 500, {}, b""
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the library's name)
        log.debug("peer %s: " + format, self.client_address[0], *args)
