"""A cluster of cachefs nodes on one machine: four daemons, each with its own mount and cache
directory, in front of one emulated remote, each file cached by its owner and read from it
by the others.  Every node runs its DistributedSampler shard of the same training loop (a
real DataLoader, in a process of its own), and every byte read is compared with the
remote's."""

from __future__ import annotations

import http.server
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import xxhash

from bench.cluster import free_ports
from cachefs.kernel.mountpoint import find_mount, unmount
from cachefs.peer import protocol
from tests.conftest import (
    REPO,
    closed_by_server,
    make_files,
    process_figures,
    run_cachefs,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)

NODES = 4
SECRET = b"a-test-secret-of-32-bytes-or-so!"


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "peer.secret"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


@pytest.fixture
def start_cluster(mount_cachefs, remote, secret_file):
    """Factory: ``start_cluster(prefix, addresses=None, **options)`` -> N serving mounts
    that list each other as peers (or, with ``addresses``, as that list says)."""

    def factory(prefix: str, *, nodes: int = NODES, addresses: list[str] | None = None,
                listen: list[str] | None = None, **options):
        listen = listen or [f"127.0.0.1:{port}" for port in free_ports(nodes)]
        addresses = addresses or listen
        mounts = []
        for i in range(nodes):
            node_options = {"fraction": 1 / nodes, "peers": ",".join(addresses),
                            "peer_listen": listen[i], "peer_address": addresses[i],
                            "peer_secret_file": secret_file, **options}
            mounts.append(mount_cachefs(remote.path, name=f"{prefix}{i}",
                                        cache_dir=remote.path.parent / f"{prefix}-cache{i}",
                                        **node_options))
        if nodes > 1:  # as a cluster's nodes are, long before training starts
            for mount in mounts:
                wait_for_peers(mount, nodes - 1)
        return mounts

    return factory


def wait_for_peers(mount, count: int) -> None:
    wait_for(lambda: len(mount.status()["cluster"]["peers_up"]) == count, timeout=20,
             what=f"{mount.path.name} seeing {count} peers up")


def start_epoch(mounts, epoch: int, *, hints: bool = False) -> list[subprocess.Popen]:
    """Every node's shard of ``epoch`` started, the nodes in parallel as in data-parallel
    training."""
    procs = []
    for rank, mount in enumerate(mounts):
        command = [sys.executable, "-m", "tests.helpers.shard_epoch", str(mount.path),
                   "--rank", str(rank), "--world", str(len(mounts)), "--epoch", str(epoch)]
        procs.append(subprocess.Popen(command + (["--hints"] if hints else []), cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def finish_epoch(procs, *, lost: frozenset[int] = frozenset()) -> dict[str, str]:
    """The digests of all the files the shards read; every shard but ``lost`` ones must
    succeed."""
    digests: dict[str, str] = {}
    failures = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if rank in lost:
            continue
        if proc.returncode != 0:
            failures.append(f"node {rank}: exit {proc.returncode}: {err[-2000:]}")
        else:
            digests.update(json.loads(out))
    assert not failures, "\n".join(failures)
    return digests


def run_epoch(mounts, epoch: int, *, hints: bool = False) -> dict[str, str]:
    return finish_epoch(start_epoch(mounts, epoch, hints=hints))


def remote_digests(source: Path, paths: list[str]) -> dict[str, str]:
    return {rel: xxhash.xxh3_64_hexdigest((source / rel).read_bytes()) for rel in paths}


def total(mounts, name: str, **labels: str) -> float:
    return sum(mount.metric(name, **labels) for mount in mounts)


def test_the_cluster_reads_the_remote_once(start_cluster, mount_cachefs, remote, source):
    paths = make_files(source, 240, (16 * 1024, 48 * 1024), per_dir=60)
    expected = remote_digests(source, paths)
    dataset_bytes = sum((source / rel).stat().st_size for rel in paths)
    cluster = start_cluster("node", cache_size="16M")
    alone = [mount_cachefs(remote.path, name=f"alone{i}", cache_dir=remote.path.parent /
                           f"alone-cache{i}", fraction=1 / NODES, cache_size="16M")
             for i in range(NODES)]
    for mount in alone:  # each holds its whole quarter, as after enough epochs
        assert run_cachefs("warm", str(mount.path)).returncode == 0

    for epoch in range(3):
        before = [total(cluster, "cachefs_remote_read_bytes_total"),
                  total(alone, "cachefs_remote_read_bytes_total")]
        assert run_epoch(cluster, epoch, hints=epoch == 2) == expected
        assert run_epoch(alone, epoch) == expected
        cluster_share = (total(cluster, "cachefs_remote_read_bytes_total") - before[0]) \
            / dataset_bytes
        alone_share = (total(alone, "cachefs_remote_read_bytes_total") - before[1]) \
            / dataset_bytes
        if epoch == 0:
            # The first epoch reads each file once, through whichever node owns it.
            assert 0.98 <= cluster_share <= 1.02, cluster_share
        else:
            # From the second on, every file is cached by its owner: the remote is not read.
            assert cluster_share <= 0.02, (epoch, cluster_share, {
                r: total(cluster, "cachefs_peer_fetches_total", result=r)
                for r in ("ok", "refused", "unavailable", "rejected")})
        # Four caches of a quarter each, unaware of each other, hold the same quarter and
        # read the other three from the remote, every epoch.
        assert 0.6 <= alone_share <= 0.9, (epoch, alone_share)

    peer_bytes = total(cluster, "cachefs_read_bytes_total", source="peer")
    assert peer_bytes > 0.5 * dataset_bytes  # the last epochs' non-owned files
    assert total(cluster, "cachefs_peer_fetches_total", result="rejected") == 0
    assert total(cluster, "cachefs_peer_fetches_total", result="ok") > 0
    # The hinted epoch fetched other nodes' files ahead, from their owners.
    assert total(cluster, "cachefs_prefetch_files_total", result="used") > 0
    # Any node's metrics show the cluster's remote traffic.
    wait_for(lambda: cluster[0].metric("cachefs_cluster_remote_read_bytes")
             == total(cluster, "cachefs_remote_read_bytes_total"), timeout=20,
             what="node 0 showing the cluster's remote bytes")
    status = cluster[0].status()["cluster"]
    assert len(status["nodes"]) == NODES and len(status["peers_up"]) == NODES - 1


def test_a_node_that_dies_costs_the_others_only_remote_reads(start_cluster, remote, source):
    paths = make_files(source, 400, 24 * 1024, per_dir=100)
    expected = remote_digests(source, paths)
    cluster = start_cluster("node", cache_size="32M", peer_timeout=1)
    # A remote slow enough that the first epoch is still under way when a node dies.
    remote.configure(meta_ms=1, open_ms=5, read_ms=5)
    procs = start_epoch(cluster, 0)
    dead = cluster[-1]
    wait_for(lambda: dead.metric("cachefs_peer_served_total", result="ok") >= 20,
             timeout=60, what="the others reading files from the node that will die")
    served_before = dead.metric("cachefs_peer_served_total", result="ok")
    dead.kill()
    if find_mount(dead.path) is not None:
        unmount(dead.path, lazy=True)
    # The dead node's own shard is lost with it; the others finish with the right bytes.
    read = finish_epoch(procs, lost=frozenset({len(cluster) - 1}))
    assert read and all(read[rel] == expected[rel] for rel in read)
    assert total(cluster[:-1], "cachefs_peer_fetches_total", result="unavailable") > 0
    assert served_before < len(paths) / 4  # it died early in the epoch, not after it

    survivors = cluster[:-1]
    before = total(survivors, "cachefs_remote_read_bytes_total")
    # The survivors read everything (the dead node's files among them), still correct.
    assert run_epoch(survivors, 1) == expected
    assert total(survivors, "cachefs_remote_read_bytes_total") > before
    dead_address = dead.options["peer_address"]
    wait_for(lambda: cluster[0].metric("cachefs_peer_up", peer=dead_address) == 0,
             timeout=20, what="the dead peer marked down")


class _FakePeer:
    """An HTTP server on a free loopback port standing where a peer should be."""

    def _serve(self, handler) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _CorruptingProxy(_FakePeer):
    """A peer address that forwards to a real node but flips a byte of every body it
    passes on, as a broken NIC or a bad disk on the owner would."""

    def __init__(self, target: str) -> None:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802
                request = urllib.request.Request(f"http://{target}{self.path}",
                                                 headers=dict(self.headers))
                try:
                    with urllib.request.urlopen(request, timeout=10) as response:
                        status, headers, body = response.status, response.headers, \
                            response.read()
                except urllib.error.HTTPError as exc:
                    status, headers, body = exc.code, exc.headers, exc.read()
                except OSError:  # the node behind is not up yet
                    status, headers, body = 502, {}, b""
                if body and "/v1/chunk/" in self.path:
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
                    proxy.corrupted += 1
                self.send_response(status)
                for name, value in headers.items():
                    if name.lower() not in ("content-length", "connection", "date", "server"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.corrupted = 0
        self._serve(Handler)


def test_a_corrupted_answer_is_never_served(start_cluster, source):
    paths = make_files(source, 60, 20 * 1024, per_dir=30)
    listen = [f"127.0.0.1:{port}" for port in free_ports(2)]
    proxy = _CorruptingProxy(listen[1])
    try:
        # Node 0 reaches node 1 only through the proxy; node 1 reaches node 0 directly.
        reader = start_cluster("reader", nodes=1, listen=listen[:1],
                               addresses=[listen[0], proxy.address], revalidate=0)[0]
        start_cluster("owner", nodes=1, listen=listen[1:], addresses=[listen[1], listen[0]])
        wait_for_peers(reader, 1)
        # Node 1 owns about half the files (by the reader's list, through the proxy).
        for rel in paths:
            assert (reader.path / rel).read_bytes() == (source / rel).read_bytes()
        assert proxy.corrupted > 0
        assert reader.metric("cachefs_peer_fetches_total", result="rejected") == proxy.corrupted
        assert reader.metric("cachefs_peer_fetches_total", result="ok") == 0
    finally:
        proxy.close()


class _BoastingPeer(_FakePeer):
    """A peer with the secret whose health answers are genuine but whose chunks claim
    10 GiB (or no length at all) and then stream up to 600 MiB, as a peer gone wrong might."""

    def __init__(self, *, say_length: bool) -> None:
        boaster = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802
                auth = self.headers.get(protocol.AUTH_HEADER) or ""
                if self.path == protocol.HEALTH_PATH:
                    body = json.dumps({"remote_read_bytes": 0}).encode()
                    headers = protocol.sign_response(SECRET, auth, None, body)
                else:
                    body = b"x" * 2**20
                    headers = {}
                self.send_response(200)
                for name, value in headers.items():
                    self.send_header(name, value)
                if self.path == protocol.HEALTH_PATH or say_length:
                    length = len(body) if self.path == protocol.HEALTH_PATH else 10 * 2**30
                    self.send_header("Content-Length", str(length))
                else:
                    self.send_header("Connection", "close")
                self.end_headers()
                streams = 1 if self.path == protocol.HEALTH_PATH or boaster.streamed else 600
                boaster.streamed = True  # one long answer is enough to tell
                try:
                    for _ in range(streams):
                        self.wfile.write(body)
                except OSError:  # the reader hung up, as it should
                    pass
                if self.path != protocol.HEALTH_PATH:
                    self.close_connection = True

            def log_message(self, *args):
                pass

        self.streamed = False
        self._serve(Handler)


@pytest.mark.parametrize("say_length", [True, False], ids=["10GiB", "no-length"])
def test_a_peer_boasting_a_huge_answer_is_not_read(start_cluster, source, say_length):
    paths = make_files(source, 40, 20 * 1024, per_dir=40)
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    peer = _BoastingPeer(say_length=say_length)
    try:
        reader = start_cluster("reader", nodes=1, listen=[listen],
                               addresses=[listen, peer.address])[0]
        wait_for_peers(reader, 1)
        for rel in paths:
            assert (reader.path / rel).read_bytes() == (source / rel).read_bytes()
        assert reader.metric("cachefs_peer_fetches_total", result="rejected") > 0
        assert reader.metric("cachefs_peer_fetches_total", result="ok") == 0
        assert process_figures(reader.pid)["VmHWM"] < 300 * 2**20
    finally:
        peer.close()


def test_a_stale_owner_is_not_believed(start_cluster, source):
    paths = make_files(source, 40, 20 * 1024, per_dir=40)
    listen = [f"127.0.0.1:{port}" for port in free_ports(2)]
    # The owner trusts its attributes for ever; the reader checks the remote at every open.
    reader = start_cluster("reader", nodes=1, listen=listen[:1], addresses=listen,
                           revalidate=0)[0]
    start_cluster("owner", nodes=1, listen=listen[1:], addresses=[listen[1], listen[0]],
                  revalidate="never")
    wait_for_peers(reader, 1)
    for rel in paths:  # the owner caches its share, the reader learns the versions
        assert (reader.path / rel).read_bytes() == (source / rel).read_bytes()
    assert reader.metric("cachefs_peer_fetches_total", result="ok") > 0
    for i, rel in enumerate(paths):  # rewritten on the remote: same size, new bytes
        data = (source / rel).read_bytes()
        (source / rel).write_bytes(bytes(b ^ 0x5A for b in data))
        os.utime(source / rel, ns=(10**18, 10**18 + i))
    for rel in paths:
        assert (reader.path / rel).read_bytes() == (source / rel).read_bytes(), rel
    # The owner still believes the old version: it refused, and the remote answered.
    assert reader.metric("cachefs_peer_fetches_total", result="refused") > 0


def test_peers_with_another_secret_are_refused(start_cluster, source, tmp_path):
    paths = make_files(source, 40, 16 * 1024, per_dir=40)
    listen = [f"127.0.0.1:{port}" for port in free_ports(2)]
    other_secret = tmp_path / "other.secret"
    other_secret.write_bytes(b"x" * 32)
    other_secret.chmod(0o600)
    reader = start_cluster("reader", nodes=1, listen=listen[:1], addresses=listen)[0]
    start_cluster("other", nodes=1, listen=listen[1:], addresses=[listen[1], listen[0]],
                  peer_secret_file=other_secret)
    for rel in paths:
        assert (reader.path / rel).read_bytes() == (source / rel).read_bytes()
    assert reader.metric("cachefs_peer_fetches_total", result="ok") == 0
    # Asked and refused, or known down by its health check already and not asked at all
    # (a miss handed to the kernel goes to the remote unless the owner is up).
    assert reader.metric("cachefs_peer_fetches_total", result="rejected") \
        + reader.metric("cachefs_peer_fetches_total", result="unavailable") > 0 \
        or reader.metric("cachefs_peer_up", peer=listen[1]) == 0


def test_a_flood_of_connections_costs_a_node_no_more_than_its_cap(start_cluster, source):
    from cachefs.peer.server import MAX_CONNECTIONS

    paths = make_files(source, 40, 16 * 1024, per_dir=40)
    reader, owner = start_cluster("node", nodes=2)
    host, port = owner.options["peer_listen"].rsplit(":", 1)
    flood = []
    try:
        for _ in range(MAX_CONNECTIONS + 300):  # connected, never a byte sent
            flood.append(socket.create_connection((host, int(port)), timeout=5))
        # The connections past the cap are closed by the owner at once; the others wait.
        wait_for(lambda: sum(map(closed_by_server, flood)) >= 300, timeout=30,
                 what="the connections past the cap closed")
        assert process_figures(owner.pid)["threads"] < MAX_CONNECTIONS + 100
        # Everything still reads right: from the remote while the owner is refusing.
        for rel in paths:
            assert (reader.path / rel).read_bytes() == (source / rel).read_bytes()
            assert (owner.path / rel).read_bytes() == (source / rel).read_bytes()
    finally:
        for connection in flood:
            connection.close()
    wait_for(lambda: process_figures(owner.pid)["threads"] < 100, timeout=30,
             what="the flood's threads gone")
    wait_for_peers(reader, 1)
    before = reader.metric("cachefs_peer_fetches_total", result="ok")
    make_files(source / "more", 20, 16 * 1024, per_dir=20, seed=1)
    for rel in (source / "more").rglob("*.bin"):
        assert (reader.path / rel.relative_to(source)).read_bytes() == rel.read_bytes()
    assert reader.metric("cachefs_peer_fetches_total", result="ok") > before


@pytest.mark.fast
@pytest.mark.parametrize(("flags", "message"), [
    (["--peers", "127.0.0.1:1"], "--peers needs --peer-listen"),
    (["--peers", "127.0.0.1:1", "--peer-listen", "127.0.0.1:1"], "--peer-secret-file"),
    (["--peer-listen", "127.0.0.1:1"], "--peer-listen needs --peers"),
    (["--peers", "127.0.0.1:1,nohost", "--peer-listen", "127.0.0.1:1"], "is not HOST:PORT"),
    (["--peers", "127.0.0.1:2", "--peer-listen", "127.0.0.1:1", "--peer-secret-file", "/x"],
     "is not in --peers"),
    (["--peers", "dns:cachefs-peers:9478", "--peer-listen", "0.0.0.0:9478",
      "--peer-secret-file", "/x"], "give --peer-address"),
])
def test_cluster_flags_are_checked_before_mounting(tmp_path, flags, message):
    result = run_cachefs("mount", str(tmp_path), str(tmp_path / "mnt"), "--cache-dir",
                         str(tmp_path / "cache"), "--cache-size", "64M", "--dry-run", *flags)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("content", "mode", "message"), [
    (SECRET, 0o644, "readable by others"),
    (b"short", 0o600, "shorter than 16 bytes"),
])
def test_a_weak_secret_is_refused(tmp_path, source, content, mode, message):
    secret = tmp_path / "weak.secret"
    secret.write_bytes(content)
    secret.chmod(mode)
    (tmp_path / "mnt").mkdir()
    port = free_ports(1)[0]
    result = run_cachefs("mount", str(source), str(tmp_path / "mnt"), "--cache-dir",
                         str(tmp_path / "cache"), "--cache-size", "64M", "--metrics-addr", "0",
                         "--peers", f"127.0.0.1:{port}", "--peer-listen", f"127.0.0.1:{port}",
                         "--peer-secret-file", str(secret), "--log-file",
                         str(tmp_path / "log"))
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert find_mount(tmp_path / "mnt") is None


def test_kill_9_of_a_serving_process_during_peer_fetches_serves_nothing_wrong(
        start_cluster, remote, source):
    """The owner's serving process killed while it reads the remote for a peer, then the asking
    node's while it reads from the owner: the supervisors restart them (tests/test_restart.py);
    the readers on the asking node see every byte the remote's, and neither cache indexes a
    partial file."""
    import random
    import signal

    from cachefs.peer import ring
    from tests.test_restart import Readers, _kill_serving

    listen = [f"127.0.0.1:{port}" for port in free_ports(2)]
    # Four files each node owns: the ring's split of any fixed names depends on the ports.
    theirs, ours = [], []
    for number in itertools.count():
        rel = f"shards/s{number:02d}.bin"
        side = theirs if ring.owner(listen, rel) == listen[1] else ours
        if len(side) < 4:
            side.append(rel)
        if len(theirs) == len(ours) == 4:
            break
    paths = sorted(theirs + ours)
    rng = random.Random(21)
    (source / "shards").mkdir(exist_ok=True)
    for number, rel in enumerate(paths):
        (source / rel).write_bytes(rng.randbytes(3 * 2**20 + number))
    asker, owner = start_cluster("kill", nodes=2, listen=listen, cache_size="64M",
                                 peer_timeout=5)
    remote.configure(bandwidth_mbps=2)  # a file of 3 MiB takes the owner a second and more
    plan = [("read", theirs), ("read", theirs), ("read", theirs), ("read", ours)]
    readers = Readers(asker.path, source, plan, seconds=10)
    try:
        wait_for(lambda: owner.metric("cachefs_remote_read_bytes_total") > 0, timeout=30,
                 interval=0.05, what="the owner reading the remote for its peer")
        owner_status = _kill_serving(owner)
        wait_for(lambda: asker.metric("cachefs_peer_fetches_total", result="ok") > 0,
                 timeout=30, interval=0.05, what="the asking node reading from the owner")
        os.kill(asker.pid, signal.SIGKILL)  # mid-way through its reads from the owner
        wait_for(lambda: (status := asker.refresh())["serving"]["restarts"] == 1 and status,
                 timeout=30, what="the asking node serving again")
        results = readers.results(timeout=120)
    finally:
        readers.kill()
    remote.configure(bandwidth_mbps=0)
    assert owner_status["serving"]["restarts"] == 1
    assert [r["errors"] for r in results] == [[]] * 4
    assert sum(r["wrong"] for r in results) == 0, [r["wrong_reads"][:3] for r in results]
    assert all(r["reads"] > 0 for r in results)
    # Read once more, now that both serve: still the remote's bytes.
    expected = remote_digests(source, paths)
    assert {rel: xxhash.xxh3_64_hexdigest((asker.path / rel).read_bytes())
            for rel in paths} == expected
    for mount in (asker, owner):
        wait_for(lambda m=mount: (st := m.status())["reconciling"] is False
                 and st["fills"]["under_way"] == 0, what=f"{mount.path.name} settled")
    assert owner.status()["cache_files"] <= len(theirs)
    assert asker.status()["cache_files"] <= len(ours)
    for mount in (asker, owner):
        mount.stop()
        verify = run_cachefs("verify", "--cache-dir", str(mount.cache_dir), timeout=60)
        assert verify.returncode == 0, verify.stdout + verify.stderr
