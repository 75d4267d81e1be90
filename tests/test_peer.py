"""The cluster tier's parts without a mount: who owns a file, what a node keeps, the
signatures on the wire, the node list from DNS."""

from __future__ import annotations

import collections
import socket

import pytest

from cachefs.attr import Version
from cachefs.peer import protocol, ring
from cachefs.peer.members import Members, PeerList
from cachefs.store.admission import ClusterAdmission, FractionAdmission
from tests.conftest import wait_for

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]

PATHS = [f"class{i // 100:03d}/img{i:06d}.jpg" for i in range(20_000)]
NODES = [f"10.0.0.{i}:9478" for i in range(1, 9)]


def test_each_node_owns_its_share_and_a_leaving_node_moves_only_its_own():
    owners = {rel: ring.owner(NODES, rel) for rel in PATHS}
    shares = collections.Counter(owners.values())
    assert set(shares) == set(NODES)
    for count in shares.values():
        assert abs(count / len(PATHS) - 1 / len(NODES)) < 0.01
    # The order of the list does not matter: every node computes the same owner.
    assert all(ring.owner(list(reversed(NODES)), rel) == owners[rel] for rel in PATHS[:2000])
    gone = NODES[3]
    after = {rel: ring.owner([n for n in NODES if n != gone], rel) for rel in PATHS}
    moved = [rel for rel in PATHS if after[rel] != owners[rel]]
    assert moved and all(owners[rel] == gone for rel in moved)


class _Fixed:
    def __init__(self, nodes, me):
        self.nodes, self.me = tuple(nodes), me

    def owns(self, relpath):
        return ring.owner(self.nodes, relpath) == self.me


@pytest.mark.parametrize("fraction", [0.125, 0.25, 0.5])
def test_the_cluster_keeps_n_times_f_and_each_node_about_f(fraction):
    nodes = NODES[:4]
    kept = [{rel for rel in PATHS if ClusterAdmission(fraction, 0, _Fixed(nodes, me))
             .eligible(rel)} for me in nodes]
    union = set().union(*kept)
    assert abs(len(union) / len(PATHS) - min(1.0, 4 * fraction)) < 0.015
    for mine in kept:
        assert abs(len(mine) / len(PATHS) - fraction) < 0.015


def test_a_node_alone_keeps_what_the_plain_fraction_keeps():
    alone = ClusterAdmission(0.3, 5, _Fixed(NODES[:1], NODES[0]))
    plain = FractionAdmission(0.3, 5)
    assert all(alone.eligible(rel) == plain.eligible(rel) for rel in PATHS[:5000])


def test_an_answer_is_bound_to_its_request_its_version_and_its_bytes():
    secret = b"k" * 32
    path = protocol.chunk_path("a dir/ü.jpg", 0)
    assert protocol.parse_chunk_path(path) == ("a dir/ü.jpg", 0)
    request = protocol.sign_request(secret, path, Version(5, 7))
    auth = request[protocol.AUTH_HEADER]
    assert protocol.request_is_genuine(secret, path, request[protocol.VERSION_HEADER], auth)
    assert not protocol.request_is_genuine(b"x" * 32, path, "5:7", auth)
    assert not protocol.request_is_genuine(secret, path, "5:8", auth)  # another version
    assert not protocol.request_is_genuine(secret, protocol.chunk_path("b", 0), "5:7", auth)
    old = protocol.sign_request(secret, path, Version(5, 7), now=1_000_000)
    assert not protocol.request_is_genuine(secret, path, "5:7", old[protocol.AUTH_HEADER])

    answer = protocol.sign_response(secret, auth, Version(5, 7), b"hello")
    assert protocol.response_is_genuine(secret, auth, answer, b"hello")
    assert not protocol.response_is_genuine(secret, auth, answer, b"hellO")
    assert not protocol.response_is_genuine(secret, "another request", answer, b"hello")
    forged = {**answer, protocol.VERSION_HEADER: "5:8"}
    assert not protocol.response_is_genuine(secret, auth, forged, b"hello")


@pytest.mark.parametrize("text", ["", "nohost", "host:", "host:0", "host:70000", "host:x"])
def test_bad_peer_lists_are_refused(text):
    with pytest.raises(ValueError):
        PeerList.parse(text)


def test_peer_lists_parse_as_written():
    assert PeerList.parse("a:1, b:2,a:1").nodes == ("a:1", "b:2")
    assert PeerList.parse(["[::1]:9", "h:9"]).nodes == ("[::1]:9", "h:9")
    dns = PeerList.parse("dns:cachefs-peers.ns.svc:9478")
    assert (dns.dns_name, dns.dns_port) == ("cachefs-peers.ns.svc", 9478)


def test_a_dns_list_follows_the_name_and_survives_a_failed_lookup():
    answers = [["10.0.0.2", "10.0.0.1"], OSError("no answer"), ["10.0.0.1", "10.0.0.3"]]

    def resolve(name, port, type):  # noqa: A002 (socket.getaddrinfo's name)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in answer]

    members = Members(PeerList.parse("dns:peers:9478"), "10.0.0.1:9478", resolve=resolve)
    assert members.nodes == ("10.0.0.1:9478", "10.0.0.2:9478")
    members.refresh()  # too soon: no lookup
    assert len(answers) == 2
    members._next_lookup = 0.0
    members.refresh()  # the lookup fails: the last list stays
    assert members.nodes == ("10.0.0.1:9478", "10.0.0.2:9478")
    members._next_lookup = 0.0
    members.refresh()
    assert members.nodes == ("10.0.0.1:9478", "10.0.0.3:9478")
    assert members.others == ("10.0.0.3:9478",)


def test_a_peer_that_leaves_the_list_leaves_the_metrics(monkeypatch):
    from cachefs.metrics import Metrics
    from cachefs.peer import client as peer_client

    monkeypatch.setattr(peer_client, "HEALTH_SECONDS", 0.05)
    listed = [["127.0.0.1"], ["127.0.0.1", "127.0.0.2"]]

    def resolve(name, port, type):  # noqa: A002 (socket.getaddrinfo's name)
        return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in listed[-1]]

    members = Members(PeerList.parse("dns:peers:1"), "127.0.0.1:1", resolve=resolve)
    metrics = Metrics()
    client = peer_client.PeerClient(members, b"k" * 32, 0.5, metrics,
                                    own_remote_bytes=lambda: 0)
    try:
        # 127.0.0.2:1 refuses: down, and shown as down.
        wait_for(lambda: metrics.registry.get_sample_value(
            "cachefs_peer_up", {"peer": "127.0.0.2:1"}) == 0, what="the peer shown down")
        listed.pop()
        members._next_lookup = 0.0
        wait_for(lambda: metrics.registry.get_sample_value(
            "cachefs_peer_up", {"peer": "127.0.0.2:1"}) is None, what="its series gone")
        assert members.nodes == ("127.0.0.1:1",)
    finally:
        client.close()
