"""Where the bytes of a read come from, as a reader and an operator see it: with kernel
passthrough no READ of a local file reaches the daemon; without it (``--passthrough off``, or
a kernel that refuses) the daemon serves them; either way the mode is said once in the log,
in ``cachefs status`` and in a metric, and every kind of reader (read, mmap, O_DIRECT) gets
the remote's bytes, whatever kind of file holds them."""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import make_files, shuffled_read_all

pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]

PASSTHROUGH_LINE = "data path: kernel passthrough"
SERVED_LINE = "data path: served by the daemon"


def passthrough_on(mount) -> bool:
    return mount.status()["data_path"].startswith("kernel passthrough")


def test_the_data_path_mode_is_reported_once_in_the_log_status_and_a_metric(
        source, remote, mount_cachefs):
    make_files(source, 3, size=1000)
    on = mount_cachefs(remote.path, name="on", cache_dir=source.parent / "c1")
    off = mount_cachefs(remote.path, name="off", cache_dir=source.parent / "c2",
                        passthrough="off")
    # This kernel (>= 6.9, root) offers passthrough; the test suite may be run with it off.
    want_on = os.environ.get("CACHEFS_TEST_PASSTHROUGH", "auto") != "off"
    assert passthrough_on(on) is want_on
    assert on.metric("cachefs_passthrough") == (1 if want_on else 0)
    assert on.log_file.read_text().count("data path:") == 1
    assert off.status()["data_path"] == \
        "served by the daemon: passthrough switched off (--passthrough off)"
    assert off.metric("cachefs_passthrough") == 0
    log = off.log_file.read_text()
    assert log.count(SERVED_LINE) == 1 and PASSTHROUGH_LINE not in log


def test_cached_reads_reach_the_daemon_only_without_passthrough(source, remote, mount_cachefs):
    rels = make_files(source, 40, size=(1000, 300_000))
    mount = mount_cachefs(remote.path, fraction=1.0)
    want = {r: (source / r).read_bytes() for r in rels}
    assert shuffled_read_all(mount.path, rels, seed=1, drop_pages=True) == want
    before = mount.metric("cachefs_served_reads_total")
    assert shuffled_read_all(mount.path, rels, seed=2, drop_pages=True) == want
    served = mount.metric("cachefs_served_reads_total") - before
    assert mount.metric("cachefs_file_opens_total", result="hit") == len(rels)
    if passthrough_on(mount):
        assert served == 0  # the kernel read the cache's files itself
    else:
        assert served >= len(rels)  # pages dropped: every file read through the daemon


def drop_pages_of(path: Path) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _read_with_mmap(path: Path) -> bytes:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b""
        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
            return bytes(m)


def _read_with_o_direct(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buffer = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
        out = bytearray()
        while True:
            n = os.readv(fd, [buffer])
            out += buffer[:n]
            if n < len(buffer):
                return bytes(out)
    finally:
        os.close(fd)


@pytest.mark.parametrize("reader", [_read_with_mmap, _read_with_o_direct],
                         ids=["mmap", "o_direct"])
def test_every_kind_of_reader_gets_the_remote_bytes_from_every_kind_of_file(
        source, remote, mount_cachefs, reader):
    rng = random.Random(5)
    kept = {"kept/small.bin": rng.randbytes(70_000), "kept/large.bin": rng.randbytes(9 << 20)}
    passed = {"passed/small.bin": rng.randbytes(70_001),
              "passed/large.bin": rng.randbytes((9 << 20) + 3)}
    for rel, data in {**kept, **passed}.items():
        (source / rel).parent.mkdir(exist_ok=True)
        (source / rel).write_bytes(data)
    # Kept: the cache's own file (small), chunk by chunk while it fills (large).  Not kept:
    # a memory file (small), chunk by chunk from the remote (large).
    kept_mount = mount_cachefs(remote.path, name="kept", cache_dir=source.parent / "ck",
                               fraction=1.0)
    passed_mount = mount_cachefs(remote.path, name="passed", cache_dir=source.parent / "cp",
                                 fraction=0.0)
    for mount, files in ((kept_mount, kept), (passed_mount, passed)):
        for rel, data in files.items():
            assert reader(mount.path / rel) == data, f"first read of {rel}"
            drop_pages_of(mount.path / rel)
            assert reader(mount.path / rel) == data, f"second read of {rel}"
    kept_mount.settle()  # a miss handed to the kernel is copied into the cache beside it
    assert kept_mount.metric("cachefs_cache_files") == len(kept)
    assert passed_mount.metric("cachefs_cache_files") == 0


# Threads of the daemon switch this often in the racing-opens test (seconds; Python's default
# is 5 ms), and the readers race for so long in each of its two rounds.
RACING_SWITCH_INTERVAL = 1e-5
RACING_SECONDS = 10


def test_opens_racing_other_opens_and_releases_of_the_same_file_all_succeed(
        source, remote, mount_cachefs, monkeypatch):
    """Sixteen readers open, read and close a few files at random, so that opens of one file
    overlap each other and its last release: small files kept (after a restart, the first
    opens register the cache's file) and not kept (the remote's own file, closed with the
    last open), large ones read chunk by chunk or through the remote's file while they are
    copied into the cache.  The daemon's threads switch every 10 us, so that its decisions
    for one file interleave with each other's and with the releases as on a loaded machine.
    Every open succeeds and reads the remote's bytes."""
    small = make_files(source, 40, size=(1000, 40_000))
    (source / "large").mkdir()
    large = [f"large/shard{i}.tar" for i in range(6)]
    for i, rel in enumerate(large):
        (source / rel).write_bytes(random.Random(i).randbytes(6 * 2**20))
    helpers = Path(__file__).parent / "helpers" / "interleave"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(helpers), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("CACHEFS_TEST_SWITCH_INTERVAL", str(RACING_SWITCH_INTERVAL))
    mount = mount_cachefs(remote.path, fraction=0.5)
    want = {rel: (source / rel).read_bytes() for rel in small + large}
    errors: list[str] = []
    opens = [0]

    def read_at_random(number: int, deadline: float) -> None:
        rng = random.Random(number)
        while time.monotonic() < deadline:
            rel = rng.choice(large if rng.random() < 0.5 else small)
            offset = rng.randrange(len(want[rel]))
            try:
                fd = os.open(mount.path / rel, os.O_RDONLY)
                try:
                    got = os.pread(fd, rng.choice([1, 65536, 2 * 2**20]), offset)
                finally:
                    os.close(fd)
            except OSError as exc:
                errors.append(f"{rel}: {exc}")
                continue
            opens[0] += 1
            if got != want[rel][offset:offset + len(got)] or not got:
                errors.append(f"{rel}: other bytes than the remote's at {offset}")

    for round in range(2):
        if round:  # after a restart: nothing registered with the kernel yet
            mount.stop()
            mount.start()
        deadline = time.monotonic() + RACING_SECONDS
        threads = [threading.Thread(target=read_at_random, args=(round * 100 + n, deadline))
                   for n in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(RACING_SECONDS + 60)
        assert not any(t.is_alive() for t in threads), "a reader is stuck"
        assert not errors, f"{len(errors)} of {opens[0] + len(errors)} failed: {errors[:5]}"
    assert mount.status()["cache_files"] > 0
