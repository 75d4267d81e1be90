"""The node table: the kernel's node ids and what each stands for, in mapped files a successor
can read.  Unit tests of the data structure (the mounts that use it are tested through FUSE in
test_mirror and test_scale)."""

from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
import time

import pytest

from cachefs.attr import Attr
from cachefs.mirror.nodes import ROOT_ID, SLOT_BYTES, NodeTable
from tests.conftest import REPO

DIR = Attr(stat.S_IFDIR | 0o755, 4096, 0, 0, 2, 1, 1, 1)


def file_attr(size: int, mtime: int = 1) -> Attr:
    return Attr(stat.S_IFREG | 0o644, size, 0, 0, 1, mtime, mtime, mtime)


def names(count: int) -> list[bytes]:
    """Names of every length a slot holds inline and of every block size beyond it."""
    rng = random.Random(1)
    return [f"{i}-{'x' * rng.randint(0, 240)}".encode() for i in range(count)]


@pytest.fixture(params=["private", "files"])
def table(request, tmp_path):
    base = None if request.param == "private" else tmp_path / "t"
    t = NodeTable(base, DIR)
    yield t
    t.close(remove=True)


def test_a_lookup_gives_one_id_per_name_and_counts_the_kernels_references(table):
    all_names = names(5000)
    ids = {n: table.lookup(ROOT_ID, n, file_attr(i)) for i, n in enumerate(all_names)}
    assert len(set(ids.values())) == len(all_names)
    for i, n in enumerate(all_names):
        assert table.lookup(ROOT_ID, n, file_attr(i)) == ids[n]
        info = table.get(ids[n])
        assert (info.parent, info.name, info.attr.size, info.lookups) == (ROOT_ID, n, i, 2)
    assert table.get(ROOT_ID).name == b""
    assert len(table) == len(all_names) + 1


def test_a_new_version_is_a_new_node_and_the_old_lives_until_forgotten(table):
    old = table.lookup(ROOT_ID, b"f", file_attr(10, mtime=1))
    new = table.lookup(ROOT_ID, b"f", file_attr(10, mtime=2))
    assert new != old
    assert table.get(old).attr.mtime_ns == 1 and table.get(new).attr.mtime_ns == 2
    assert table.lookup(ROOT_ID, b"f", file_attr(10, mtime=2)) == new
    assert table.forget(old, 1) is True
    assert table.get(old) is None
    assert table.lookup(ROOT_ID, b"f", file_attr(10, mtime=2)) == new


def test_forgotten_slots_and_names_are_reused(table):
    all_names = names(4000)
    ids = {n: table.lookup(ROOT_ID, n, file_attr(1)) for n in all_names}
    peak = table.memory_bytes
    for round_ in range(3):
        for n in all_names:
            assert table.forget(ids[n], 1) is True
        assert len(table) == 1
        ids = {n: table.lookup(ROOT_ID, n, file_attr(round_)) for n in all_names}
    assert table.memory_bytes == peak
    for n in all_names:
        assert table.get(ids[n]).name == n


def test_a_partial_forget_keeps_the_node(table):
    nid = table.lookup(ROOT_ID, b"kept", file_attr(1))
    table.lookup(ROOT_ID, b"kept", file_attr(1))
    assert table.forget(nid, 1) is False
    assert table.get(nid).lookups == 1


def test_children_of_different_parents_do_not_mix(table):
    a = table.lookup(ROOT_ID, b"a", DIR)
    b = table.lookup(ROOT_ID, b"b", DIR)
    in_a = table.lookup(a, b"same", file_attr(1))
    in_b = table.lookup(b, b"same", file_attr(2))
    assert in_a != in_b
    assert table.get(in_a).parent == a and table.get(in_b).parent == b


def test_the_memory_per_node_is_a_slot_and_an_index_entry(table):
    for i in range(20000):
        table.lookup(ROOT_ID, b"n%d" % i, file_attr(i))
    # a slot, and 2 to 4 index buckets of 8 bytes (at most half full, doubled when fuller)
    assert table.memory_bytes / 20000 <= SLOT_BYTES + 4 * 8 + 1


def test_a_successor_maps_the_same_table(tmp_path):
    base = tmp_path / "t"
    first = NodeTable(base, DIR)
    all_names = names(3000)
    ids = {n: first.lookup(ROOT_ID, n, file_attr(i)) for i, n in enumerate(all_names)}
    for n in all_names[::2]:
        first.forget(ids[n], 1)
    first.close()
    second = NodeTable(base, DIR, take_over=True)
    try:
        for i, n in enumerate(all_names):
            if i % 2:
                assert second.get(ids[n]).name == n
                assert second.lookup(ROOT_ID, n, file_attr(i)) == ids[n]
            else:
                assert second.get(ids[n]) is None
    finally:
        second.close(remove=True)
    assert not list(tmp_path.iterdir())


def test_times_beyond_what_a_slot_holds_are_kept_exactly(table):
    far_future = 2**63 + 10**18
    attr = Attr(stat.S_IFREG | 0o644, 5, 0, 0, 1, far_future, far_future, -(2**64))
    nid = table.lookup(ROOT_ID, b"future", attr)
    assert table.lookup(ROOT_ID, b"future", attr) == nid  # the same version
    assert table.get(nid).attr == attr
    table.refresh(nid, file_attr(5, mtime=far_future))
    assert table.get(nid).attr.mtime_ns == far_future
    table.refresh(nid, file_attr(5, mtime=far_future - 2**63))  # back in range
    assert table.get(nid).attr.mtime_ns == far_future - 2**63


# A process looking names up and forgetting nodes, as a daemon does for the kernel: it says
# "B name" before a lookup, "L name id" once it has the node (its reply), "F id" before a
# forget (the kernel lets go first), until it is killed.
_WORKER = r"""
import os, random, stat, sys
from pathlib import Path
from cachefs.attr import Attr
from cachefs.mirror.nodes import ROOT_ID, NodeTable
base, round_, take_over = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
rng = random.Random(round_)
table = NodeTable(base, Attr(stat.S_IFDIR | 0o755, 4096, 0, 0, 2, 1, 1, 1), take_over=take_over)
known = []
out = os.fdopen(1, "w", buffering=1)
for i in range(10**9):
    if known and rng.random() < 0.3:
        nodeid = known.pop(rng.randrange(len(known)))
        out.write(f"F {nodeid}\n")
        table.forget(nodeid, 1)
        continue
    name = f"r{round_}-{i}-" + "x" * rng.choice([0, 5, 40, 100, 200])
    out.write(f"B {name}\n")
    nodeid = table.lookup(ROOT_ID, name.encode(), Attr(stat.S_IFREG | 0o644, i, 0, 0, 1, 1, 1, 1))
    out.write(f"L {name} {nodeid}\n")
    known.append(nodeid)
"""


def test_a_process_killed_anywhere_in_a_change_leaves_a_table_its_successor_serves_right(
        tmp_path):
    """A daemon killed at a random moment, many times over, each successor taking the table
    over: every node the kernel holds (a lookup answered, or the one its resent LOOKUP gets)
    still names its file, and no new lookup hands out a node id the kernel holds."""
    base = tmp_path / "t"
    held: dict[int, bytes] = {}  # node id -> name: what the kernel holds
    rng = random.Random(7)
    for round_ in range(25):
        worker = subprocess.Popen([sys.executable, "-c", _WORKER, str(base), str(round_),
                                   "1" if round_ else "0"], stdout=subprocess.PIPE, cwd=REPO)
        time.sleep(0.3 + rng.random() * 0.2)
        os.kill(worker.pid, signal.SIGKILL)
        lines = worker.communicate()[0].decode().split("\n")[:-1]  # the last may be cut
        in_flight = None
        for line in lines:
            kind, *fields = line.split(" ")
            if kind == "B":
                in_flight = fields[0].encode()
            elif kind == "L":
                held[int(fields[1])] = fields[0].encode()
                in_flight = None
            else:
                held.pop(int(fields[0]), None)
        successor = NodeTable(base, DIR, take_over=True)
        try:
            for nodeid, name in held.items():
                info = successor.get(nodeid)
                assert info is not None and info.name == name, (round_, nodeid, name, info)
            if in_flight is not None:  # the LOOKUP the kernel resends
                nodeid = successor.lookup(ROOT_ID, in_flight, file_attr(1))
                assert held.get(nodeid, in_flight) == in_flight, (round_, nodeid)
                held[nodeid] = in_flight
            for i in range(50):
                name = f"s{round_}-{i}".encode()
                nodeid = successor.lookup(ROOT_ID, name, file_attr(1))
                assert nodeid not in held, (round_, nodeid, held[nodeid])
                successor.forget(nodeid, 1)
        finally:
            successor.close()
    assert held
