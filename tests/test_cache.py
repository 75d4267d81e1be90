"""The cache keeps a stable random fraction, stays within its budget, survives restarts,
never serves stale bytes after the revalidation interval, and says so in its metrics."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import mmap
import os
import random
import time

import pytest
import xxhash

from cachefs.remote.attrcache import IMMUTABLE_KERNEL_SECONDS, AttrCache
from cachefs.remote.remote import Remote
from tests.conftest import disk_usage, make_files, shuffled_read_all, wait_for

pytestmark = pytest.mark.timeout(240)


def eligible(rel: str, fraction: float, seed: int) -> bool:
    """The documented admission rule, written out independently of cachefs."""
    return xxhash.xxh64_intdigest(rel.encode(), seed=seed) / 2**64 < fraction


def opens(mount) -> tuple[float, float]:
    m = mount.metrics()
    return (m[("cachefs_file_opens_total", (("result", "hit"),))],
            m[("cachefs_file_opens_total", (("result", "miss"),))])


@pytest.mark.fast
@pytest.mark.parametrize("fraction", [0.2, 0.5])
def test_second_shuffled_pass_hits_the_fraction(source, remote, mount_cachefs, fraction):
    count, seed = 2000, 11
    rels = make_files(source, count, size=(500, 3000))
    mount = mount_cachefs(remote.path, fraction=fraction, seed=seed)

    first = shuffled_read_all(mount.path, rels, seed=1)
    hits_before, misses_before = opens(mount)
    second = shuffled_read_all(mount.path, rels, seed=2)
    hits_after, misses_after = opens(mount)

    hits = hits_after - hits_before
    assert hits + (misses_after - misses_before) == count
    # Exactly the files the documented rule admits, and so F within sampling error.
    assert hits == sum(eligible(r, fraction, seed) for r in rels)
    sigma = math.sqrt(fraction * (1 - fraction) / count)
    assert abs(hits / count - fraction) < 4 * sigma
    assert first == second == {r: (source / r).read_bytes() for r in rels}


def test_budget_is_never_exceeded_and_the_cached_set_is_stable(source, remote, mount_cachefs):
    rels = make_files(source, 2000, size=8192)  # 16 MiB of data, 8 MiB of cache
    capacity = 8 * 2**20
    mount = mount_cachefs(remote.path, cache_size=capacity, fraction=1.0)

    shuffled_read_all(mount.path, rels, seed=1)
    assert disk_usage(mount.cache_dir) <= capacity
    assert mount.metric("cachefs_cache_bytes") <= capacity
    assert mount.metric("cachefs_cache_admitting") == 0  # full: admission stopped
    cached = mount.metric("cachefs_cache_files")
    assert 0.3 * len(rels) < cached < 0.5 * len(rels)

    for epoch in (2, 3):
        before = opens(mount)
        shuffled_read_all(mount.path, rels, seed=epoch)
        after = opens(mount)
        # Nothing evicted, nothing added: every epoch hits exactly the cached files.
        assert after[0] - before[0] == cached
        assert mount.metric("cachefs_cache_files") == cached
        assert disk_usage(mount.cache_dir) <= capacity


def test_a_file_larger_than_the_room_left_leaves_admission_on(source, remote, mount_cachefs):
    """A shard larger than the whole budget, read first: it is not stored whole (a file that
    fills chunk by chunk keeps what fits), and the small files read after it still are."""
    (source / "huge.bin").write_bytes(random.Random(9).randbytes(12 * 2**20))
    rels = make_files(source, 40, size=(2000, 20_000))
    mount = mount_cachefs(remote.path, cache_size=8 * 2**20, fraction=1.0)
    want = {r: (source / r).read_bytes() for r in rels}
    assert (mount.path / "huge.bin").read_bytes() == (source / "huge.bin").read_bytes()
    mount.settle()
    assert shuffled_read_all(mount.path, rels, seed=1) == want
    mount.settle()
    assert mount.metric("cachefs_cache_admitting") == 1
    hits = opens(mount)[0]
    assert shuffled_read_all(mount.path, rels, seed=2) == want
    assert opens(mount)[0] - hits == len(rels)  # every small file came in
    assert mount.metric("cachefs_cache_bytes") <= 8 * 2**20


def test_restart_serves_cached_files_without_remote_reads(source, remote, mount_cachefs):
    rels = make_files(source, 300, size=(1000, 60_000))
    (source / "shard.bin").write_bytes(os.urandom(10 * 2**20))
    rels.append("shard.bin")
    mount = mount_cachefs(remote.path)
    want = shuffled_read_all(mount.path, rels, seed=1)
    mount.stop()

    remote_before = remote.stats()["read_bytes"]
    again = mount.start()
    got = shuffled_read_all(again.path, rels, seed=2)
    assert got == want
    assert again.metric("cachefs_remote_read_bytes_total") == 0
    assert again.metric("cachefs_file_opens_total", result="hit") == len(rels)
    assert remote.stats()["read_bytes"] == remote_before


@pytest.mark.fast
def test_changed_remote_file_is_not_served_stale(source, remote, mount_cachefs):
    (source / "label.txt").write_bytes(b"version one\n")
    mount = mount_cachefs(remote.path, revalidate=1)
    assert (mount.path / "label.txt").read_bytes() == b"version one\n"
    mount.settle()  # (where the kernel copies it in beside the reader)
    assert (mount.path / "label.txt").read_bytes() == b"version one\n"
    assert mount.metric("cachefs_file_opens_total", result="hit") == 1

    (source / "label.txt").write_bytes(b"version two, longer\n")
    # The promise: after the interval (plus the kernel's 1 s attribute cache), new bytes.
    time.sleep(2.2)
    assert (mount.path / "label.txt").read_bytes() == b"version two, longer\n"

    # Same size, new mtime: still detected.
    (source / "label.txt").write_bytes(b"version 3!, longer\n\n")
    time.sleep(2.2)
    assert (mount.path / "label.txt").read_bytes() == b"version 3!, longer\n\n"


@contextlib.contextmanager
def pages_pinned(path, size: int):
    """The file's pages in the page cache, locked there (mmap + mlock): so that only the
    file system, not the machine's memory reclaim, can drop them meanwhile."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mlock.argtypes = libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address != ctypes.c_void_p(-1).value, os.strerror(ctypes.get_errno())
        try:
            assert libc.mlock(address, size) == 0, os.strerror(ctypes.get_errno())
            yield
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def test_unchanged_file_is_read_again_from_the_kernel_page_cache(source, remote, mount_cachefs):
    data = os.urandom(100_000)
    (source / "image.jpg").write_bytes(data)
    mount = mount_cachefs(remote.path, revalidate=1)
    assert (mount.path / "image.jpg").read_bytes() == data
    # The fill is committed, and the kernel's release sent, in the background: an open
    # before then is another miss, or shares the miss's backing file.
    wait_for(lambda: mount.metric("cachefs_cache_files") == 1
             and mount.status()["open_files"] == 0, what="the file cached and closed")
    with pages_pinned(mount.path / "image.jpg", len(data)):
        served_reads = mount.metric("cachefs_served_reads_total")
        time.sleep(2.2)  # past the interval: the next open asks the remote (unchanged)
        assert (mount.path / "image.jpg").read_bytes() == data
    # The later opens were answered (hits); the bytes came from the kernel (its page cache,
    # or the cache file through passthrough), not from a READ answered by the daemon.
    assert mount.metric("cachefs_file_opens_total", result="hit") == 2
    assert mount.metric("cachefs_served_reads_total") == served_reads
    assert mount.metric("cachefs_read_bytes_total", source="cache") == 2 * len(data)
    assert mount.metric("cachefs_remote_read_bytes_total") == len(data)


def test_pages_an_old_handle_reads_after_a_change_are_not_kept(source, remote, mount_cachefs):
    (source / "label.txt").write_bytes(b"version one\n")
    mount = mount_cachefs(remote.path, revalidate=1)
    path = mount.path / "label.txt"
    with open(path, "rb", buffering=0) as old:
        assert old.read() == b"version one\n"
        (source / "label.txt").write_bytes(b"version two\n")  # same size, new mtime
        time.sleep(2.2)
        with open(path, "rb", buffering=0):
            # This open dropped the kernel's pages; the old handle, still open, reads its
            # own version into them again.  (Where the kernel reads the remote's own file,
            # the old handle reads what the NFS mount shows, as a reader of the remote would.)
            if not mount.hands_over_remote:
                assert os.pread(old.fileno(), 100, 0) == b"version one\n"
    # Once no handle of the old version is open, an open must not keep those pages.
    assert path.read_bytes() == b"version two\n"


def test_revalidate_never_trusts_the_cache(source, remote, mount_cachefs):
    (source / "frozen.bin").write_bytes(b"immutable dataset\n")
    mount = mount_cachefs(remote.path, revalidate="never")
    assert (mount.path / "frozen.bin").read_bytes() == b"immutable dataset\n"
    mount.stop()
    mount.start()
    # Any remote round trip for this file now fails: attributes and bytes must come from the
    # index and the cache alone.
    remote.set_fault("errno", errno=errno.EIO, glob="*frozen.bin")
    assert (mount.path / "frozen.bin").read_bytes() == b"immutable dataset\n"
    assert mount.metric("cachefs_remote_read_bytes_total") == 0


def test_attributes_are_given_to_the_kernel_for_what_is_left_of_the_interval(tmp_path):
    """What a LOOKUP or GETATTR tells the kernel it may keep the attributes for: the rest of
    --revalidate since they were fetched, a whole interval once fetched again, 0 for
    attributes served past it while the remote does not answer, a day for a dataset that
    never changes."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f").write_bytes(b"one")
    remote = Remote(str(tmp_path / "data"), timeout_seconds=10)
    attrs = AttrCache(remote, 60.0, recorded_attr=lambda relpath: None)
    attr, left = attrs.get_fresh("f")
    assert attr.size == 3 and 59.0 < left <= 60.0
    time.sleep(0.2)
    attr, left = attrs.get_fresh("f")
    assert attr.size == 3 and 50.0 < left <= 59.8
    brief = AttrCache(remote, 0.3, recorded_attr=lambda relpath: None)
    assert brief.get_fresh("f")[0].size == 3
    (tmp_path / "data" / "f").write_bytes(b"two, longer")
    time.sleep(0.4)
    attr, left = brief.get_fresh("f")
    assert attr.size == 11 and 0.0 < left <= 0.3
    time.sleep(0.4)
    remote.timed_out()  # unavailable until its probe finds it answering a second later
    try:
        assert brief.get_fresh("f") == (attr, 0.0)
    finally:
        remote.close()
    never = AttrCache(remote, None, recorded_attr=lambda relpath: attr)
    assert never.get_fresh("f") == (attr, IMMUTABLE_KERNEL_SECONDS)


def test_metrics_and_status_report_what_happened(source, remote, mount_cachefs):
    rels = make_files(source, 100, size=1000)
    mount = mount_cachefs(remote.path, fraction=1.0, cache_size="64MiB")
    shuffled_read_all(mount.path, rels, seed=1, drop_pages=True)
    shuffled_read_all(mount.path, rels, seed=2)

    m = mount.metrics()
    assert m[("cachefs_file_opens_total", (("result", "hit"),))] == 100
    assert m[("cachefs_file_opens_total", (("result", "miss"),))] == 100
    assert m[("cachefs_read_bytes_total", (("source", "cache"),))] == 100 * 1000
    assert m[("cachefs_read_bytes_total", (("source", "remote"),))] == 100 * 1000
    assert m[("cachefs_remote_read_bytes_total", ())] == 100 * 1000
    assert m[("cachefs_cache_capacity_bytes", ())] == 64 * 2**20
    assert m[("cachefs_cache_files", ())] == 100
    assert 100 * 4096 <= m[("cachefs_cache_bytes", ())] <= 64 * 2**20
    assert m[("cachefs_open_seconds_count", ())] == 200
    for (_name, labels) in m:
        for _key, value in labels:
            assert "/" not in value and "img" not in value  # never a path as a label

    status = mount.status()
    assert status["hit_ratio"] == pytest.approx(0.5)
    assert status["cache_files"] == 100
    assert status["remote_read_bytes"] == 100 * 1000
    assert status["cache_capacity_bytes"] == 64 * 2**20


def test_concurrent_first_reads_all_get_cached(source, mount_cachefs):
    """Many readers filling the cache at once (new fan-out directories appear under
    all of them) store every file and never trip over each other."""
    from concurrent.futures import ThreadPoolExecutor

    rels = make_files(source, 800, size=1000)
    mount = mount_cachefs(source, cache_size="64MiB")
    with ThreadPoolExecutor(16) as pool:
        contents = list(pool.map(lambda rel: (mount.path / rel).read_bytes(), rels))
    assert contents == [(source / rel).read_bytes() for rel in rels]
    mount.settle()
    assert mount.metric("cachefs_cache_write_errors_total") == 0
    assert mount.metric("cachefs_cache_admitting") == 1
    assert mount.metric("cachefs_cache_files") == len(rels)
