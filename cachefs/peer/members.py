"""The nodes of the cluster: a list from configuration, or every address a DNS name gives
(a Kubernetes headless Service), never a consensus of our own.

Every node computes each file's owner from the same list (ring.py), so the nodes need only
agree on the list.  A DNS list is looked up again every ``REFRESH_SECONDS``; while two
nodes' views differ (a node joining or leaving), a file may have two owners for a moment,
which costs at most an extra remote read: an owner answers a peer from its cache or the
remote, never by asking a third node, so no request goes round in circles.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time

from cachefs.peer import ring

log = logging.getLogger(__name__)

REFRESH_SECONDS = 10.0
DNS_PREFIX = "dns:"


def parse_address(text: str) -> str:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) checked and written one way; ValueError else."""
    text = str(text).strip()
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return join(host, int(port_text))


def join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclasses.dataclass(frozen=True)
class PeerList:
    """``--peers`` as given: fixed addresses, or a DNS name and the port every node uses."""

    nodes: tuple[str, ...] = ()
    dns_name: str | None = None
    dns_port: int = 0

    @classmethod
    def parse(cls, value) -> PeerList:
        """A list of ``HOST:PORT``, one string of them separated by commas, or
        ``dns:NAME:PORT``; ValueError with what is wrong."""
        if isinstance(value, str) and value.strip().startswith(DNS_PREFIX):
            name, port = split(parse_address(value.strip()[len(DNS_PREFIX):]))
            return cls(dns_name=name, dns_port=port)
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if not isinstance(value, list | tuple) or not value:
            raise ValueError("must list HOST:PORT of every node, or be dns:NAME:PORT")
        nodes = tuple(dict.fromkeys(parse_address(item) for item in value))
        return cls(nodes=nodes)

    def __str__(self) -> str:
        if self.dns_name is not None:
            return f"{DNS_PREFIX}{join(self.dns_name, self.dns_port)}"
        return ",".join(self.nodes)


class Members:
    """The current node list and this node's place in it.

    Thread safety: ``nodes`` is replaced whole (a tuple), so readers need no lock.
    """

    def __init__(self, peers: PeerList, me: str, resolve=socket.getaddrinfo) -> None:
        self.peers = peers
        self.me = me
        self._resolve = resolve
        self.nodes: tuple[str, ...] = peers.nodes if peers.dns_name is None else (me,)
        self._next_lookup = 0.0
        if peers.dns_name is not None:
            self.refresh()

    def owner(self, relpath: str) -> str:
        return ring.owner(self.nodes, relpath)

    def owns(self, relpath: str) -> bool:
        return self.owner(relpath) == self.me

    @property
    def others(self) -> tuple[str, ...]:
        return tuple(node for node in self.nodes if node != self.me)

    def refresh(self) -> None:
        """Look the DNS name up again if the last lookup is ``REFRESH_SECONDS`` old (nothing
        to do for a fixed list).  A failed lookup keeps the last list: a DNS hiccup must not
        reshuffle every file's owner."""
        if self.peers.dns_name is None or time.monotonic() < self._next_lookup:
            return
        self._next_lookup = time.monotonic() + REFRESH_SECONDS
        try:
            infos = self._resolve(self.peers.dns_name, self.peers.dns_port,
                                  type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("cannot look up the peers %s: %s; keeping %d nodes",
                        self.peers, exc, len(self.nodes))
            return
        found = {join(info[4][0], self.peers.dns_port) for info in infos}
        found.add(self.me)  # this node serves whether or not DNS lists it yet
        nodes = tuple(sorted(found))
        if nodes != self.nodes:
            log.info("cluster of %d nodes: %s", len(nodes), ", ".join(nodes))
            self.nodes = nodes
