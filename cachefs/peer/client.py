"""Asking a file's owner before the remote, and knowing which peers answer.

A reader's miss of a file another node owns is one GET to that node (protocol.py) for each
chunk.  Whatever goes wrong with it, a peer that is down, slow, answers another version or
bytes that fail the signature or checksum, costs a bounded wait (``--peer-timeout``) and
then the remote read the node would have done without a cluster: never an error, never a
wrong byte.  A peer that failed to connect is skipped for ``DOWN_SECONDS`` (or until its
health check answers), so a dead node costs the others one timeout, not one per file.

The health check (every ``HEALTH_SECONDS``) also brings each peer's remote traffic, so
every node's metrics show the whole cluster's.

The client is the standard library's http.client over kept-alive connections, a few per
peer: measured here it costs the reading node about 90 us of CPU per request, urllib3's
pool about 210 us, and that CPU is taken from the daemon's one interpreter
(bench/peer_engines.py compares the engines).

Thread safety: see Connections; ``_down_until`` and ``_reported`` are dicts changed by
single assignments.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import threading
import time
from collections.abc import Callable

from cachefs import remotewait
from cachefs.attr import Attr, Version
from cachefs.peer import protocol
from cachefs.peer.members import Members, split
from cachefs.remote.origin import Chunk, RemoteOrigin
from cachefs.remote.remote import Remote
from cachefs.store.store import chunk_count, chunk_span

log = logging.getLogger(__name__)

HEALTH_SECONDS = 5.0
DOWN_SECONDS = 5.0
# A health answer is a line of JSON.
MAX_HEALTH_BYTES = 4096
# Idle connections kept open to each peer: about the readers and prefetchers asking at once.
CONNECTIONS_PER_PEER = 32
# Refused answers (404, 409, 503) are the owner's honest word; anything else is not.
_REFUSALS = (404, 409, 503)


class ClusterOrigin(RemoteOrigin):
    """The file's owner first, when that is another node; the remote otherwise."""

    def __init__(self, remote: Remote, members: Members, client: PeerClient) -> None:
        super().__init__(remote)
        self.members = members
        self.client = client

    def from_peer(self, relpath: str) -> bool:
        owner = self.members.owner(relpath)
        return owner != self.members.me and self.client.up(owner)

    def read_chunk(self, relpath: str, attr: Attr, number: int, *, peers: bool = True) -> Chunk:
        """``peers`` False: the remote only (an owner answering a peer never asks a third
        node, so a request cannot go round in circles while two nodes' lists differ)."""
        owner = self.members.owner(relpath)
        if peers and owner != self.members.me:
            data = self.client.fetch(owner, relpath, attr.version, number)
            if data is not None:
                return Chunk(data, "peer")
        return super().read_chunk(relpath, attr, number)

    def read_file(self, relpath: str, attr: Attr) -> Chunk:
        owner = self.members.owner(relpath)
        if owner != self.members.me:
            parts = []
            for number in range(chunk_count(attr.size)):
                data = self.client.fetch(owner, relpath, attr.version, number)
                if data is None:
                    break
                parts.append(data)
            else:
                return Chunk(b"".join(parts), "peer")
        return super().read_file(relpath, attr)


class Connections:
    """Kept-alive HTTP connections to the peers, a few idle ones each, reused last in first
    out.  Thread safety: a connection is used by one thread at a time (popped from its
    peer's idle list, appended back; both atomic)."""

    def __init__(self, timeout_seconds: float) -> None:
        self.timeout_seconds = timeout_seconds
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}

    def get(self, peer: str, path: str, headers: dict[str, str], max_bytes: int
            ) -> tuple[http.client.HTTPResponse, bytes | None]:
        """GET ``path`` of ``peer`` (``HOST:PORT``).  The body is None, unread and the
        connection closed, when the answer does not say its length or says more than
        ``max_bytes``: nothing a peer sends can fill this node's memory.  A kept connection
        the peer has closed meanwhile (idle too long, restarted) is replaced once; OSError
        or HTTPException otherwise."""
        idle = self._idle.setdefault(peer, [])
        for attempt in (1, 2):
            try:
                connection = idle.pop()
                kept = True
            except IndexError:
                host, port = split(peer)
                connection = http.client.HTTPConnection(host, port,
                                                        timeout=self.timeout_seconds)
                kept = False
            try:
                connection.request("GET", path, headers=headers)
                response = connection.getresponse()
                if response.length is None or response.length > max_bytes:
                    connection.close()
                    return response, None
                body = response.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                if kept and attempt == 1:
                    continue
                raise
            if response.will_close or len(idle) >= CONNECTIONS_PER_PEER:
                connection.close()
            else:
                idle.append(connection)
            return response, body
        raise AssertionError("unreachable")

    def close(self) -> None:
        for idle in list(self._idle.values()):
            while idle:
                idle.pop().close()


class PeerClient:
    """GETs to owners, checked; the peers' health and remote traffic."""

    def __init__(self, members: Members, secret: bytes, timeout_seconds: float, metrics, *,
                 own_remote_bytes: Callable[[], float]) -> None:
        self.members = members
        self.timeout_seconds = timeout_seconds
        self._secret = secret
        self._metrics = metrics
        self._own_remote_bytes = own_remote_bytes
        self._connections = Connections(timeout_seconds)
        self._down_until: dict[str, float] = {}
        self._reported: dict[str, int] = {}
        self._checked: set[str] = set()  # the peers the health check knows (peer-health only)
        self._results = {r: metrics.peer_fetches.labels(r) for r in
                         ("ok", "refused", "unavailable", "rejected")}
        self._closed = threading.Event()
        metrics.cluster_nodes.set_function(lambda: len(self.members.nodes))
        metrics.cluster_remote_read_bytes.set_function(self.cluster_remote_bytes)
        self._health = threading.Thread(target=self._health_loop, name="peer-health",
                                         daemon=True)
        self._health.start()

    def close(self) -> None:
        self._closed.set()
        self._connections.close()

    def up(self, peer: str) -> bool:
        return self._down_until.get(peer, 0.0) <= time.monotonic()

    # -- chunks -----------------------------------------------------------------------------

    def fetch(self, owner: str, relpath: str, version: Version, number: int) -> bytes | None:
        """Chunk ``number`` of version ``version`` from its owner; None, counted, when the
        owner cannot give it or its answer is not to be trusted."""
        if not self.up(owner):
            self._results["unavailable"].inc()
            return None
        _, length = chunk_span(version.size, number)
        path = protocol.chunk_path(relpath, number)
        headers = protocol.sign_request(self._secret, path, version)
        started = time.perf_counter()
        try:
            # Like a wait on the remote: the FUSE session serves other requests meanwhile.
            with remotewait.waiting(remote_call=False):
                response, body = self._connections.get(owner, path, headers, length)
        except (OSError, http.client.HTTPException) as exc:
            self._mark_down(owner, exc)
            self._results["unavailable"].inc()
            return None
        if response.status in _REFUSALS:
            self._results["refused"].inc()
            return None
        genuine = response.status == 200 and body is not None and len(body) == length \
            and response.headers.get(protocol.VERSION_HEADER) == protocol.format_version(version) \
            and protocol.response_is_genuine(self._secret, headers[protocol.AUTH_HEADER],
                                             response.headers, body)
        if not genuine:
            log.warning("peer %s answered chunk %d of %s with something not to be trusted "
                        "(status %d, %s); reading the remote", owner, number, relpath,
                        response.status, "a body too long to read" if body is None
                        else f"{len(body)} bytes")
            self._results["rejected"].inc()
            return None
        self._metrics.peer_fetch_seconds.observe(time.perf_counter() - started)
        self._results["ok"].inc()
        return body

    def _mark_down(self, peer: str, why) -> None:
        if self.up(peer):
            log.warning("peer %s does not answer (%s): reading its files from the remote",
                        peer, why)
        self._down_until[peer] = time.monotonic() + DOWN_SECONDS
        self._metrics.peer_up.labels(peer).set(0)

    # -- health -----------------------------------------------------------------------------

    def cluster_remote_bytes(self) -> float:
        """This node's remote bytes and what each current peer last reported."""
        others = self.members.others
        return self._own_remote_bytes() + sum(self._reported.get(p, 0) for p in others)

    def _health_loop(self) -> None:
        rounds = 0
        while not self._closed.wait(0 if rounds == 0 else HEALTH_SECONDS):
            rounds += 1
            self.members.refresh()
            others = self.members.others
            for gone in self._checked - set(others):  # left the list: no stale series
                with contextlib.suppress(KeyError):
                    self._metrics.peer_up.remove(gone)
                self._reported.pop(gone, None)
                self._down_until.pop(gone, None)
            self._checked = set(others)
            for peer in others:
                self._check(peer)

    def _check(self, peer: str) -> None:
        headers = protocol.sign_request(self._secret, protocol.HEALTH_PATH, None)
        try:
            response, body = self._connections.get(peer, protocol.HEALTH_PATH, headers,
                                                   MAX_HEALTH_BYTES)
            if response.status != 200 or body is None or not protocol.response_is_genuine(
                    self._secret, headers[protocol.AUTH_HEADER], response.headers, body):
                raise ValueError(f"answered {response.status} without a valid signature")
            self._reported[peer] = int(json.loads(body)["remote_read_bytes"])
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as exc:
            self._mark_down(peer, exc)
            return
        if not self.up(peer):
            log.warning("peer %s answers again", peer)
        self._down_until.pop(peer, None)
        self._metrics.peer_up.labels(peer).set(1)
