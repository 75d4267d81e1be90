"""Misses through the kernel (``--passthrough auto``): an open of a file the cache does not
hold is answered with the remote's own file, which the kernel reads for the reader, and a
file the cache keeps is copied into it by the kernel beside the reader.  What a reader and an
operator see: the remote's bytes for every kind of reader, no READ through the daemon, each
kept file read from the remote once, nothing partial or mixed ever indexed (a remote rewritten
during a fill, a daemon killed during one), and the strict switch (``--passthrough local``)
bounding every read by ``--remote-timeout``."""

from __future__ import annotations

import errno
import io
import mmap
import os
import random
import signal
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from bench.driver import drop_page_cache
from cachefs.attr import Version
from cachefs.store.index import FLUSH_SECONDS, data_key
from cachefs.store.layout import CacheLayout
from cachefs.store.store import CHUNK_BYTES
from tests.conftest import files_written, fill_under_way, read_bounded, run_cachefs, wait_for

pytestmark = pytest.mark.timeout(120)

KERNEL = {"passthrough": "auto"}


def _whole(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def _pread_backwards(path: Path) -> bytes:
    """Random access: 64 KiB preads from the end of the file to its start."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pieces = []
        for offset in range(((size - 1) // 65536) * 65536, -1, -65536):
            pieces.append(os.pread(fd, 65536, offset))
        return b"".join(reversed(pieces))
    finally:
        os.close(fd)


def _mmap(path: Path) -> bytes:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
        return bytes(view)


def _o_direct(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buffer = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
        out = bytearray()
        while n := os.readv(fd, [buffer]):
            out += buffer[:n]
        return bytes(out)
    finally:
        os.close(fd)


def _numpy(path: Path) -> bytes:
    return np.memmap(path, dtype=np.uint8, mode="r").tobytes()


READERS = {"read": _whole, "pread": _pread_backwards, "mmap": _mmap, "o_direct": _o_direct,
           "numpy": _numpy}


def _dataset(source: Path, seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {"small.bin": rng.randbytes(70_000), "large.bin": rng.randbytes(9 * 2**20 + 5)}
    for rel, data in files.items():
        (source / rel).write_bytes(data)
    return files


@pytest.mark.fast
@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("fraction", [1.0, 0.0], ids=["kept", "not-kept"])
def test_every_reader_gets_the_remote_bytes_and_the_daemon_moves_none(
        source, remote, mount_cachefs, reader, fraction):
    files = _dataset(source, seed=len(reader))
    mount = mount_cachefs(remote.path, fraction=fraction, **KERNEL)
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files: misses go through the daemon")
    read_before = remote.stats()["read_bytes"]
    for rel, data in files.items():
        assert READERS[reader](mount.path / rel) == data, rel
    mount.settle()
    assert mount.metric("cachefs_served_reads_total") == 0  # the kernel read every byte
    assert mount.metric("cachefs_file_opens_total", result="miss") == len(files)
    if fraction:
        assert mount.metric("cachefs_fills_total", result="stored") == len(files)
        assert mount.status()["cache_files"] == len(files)
        for rel, data in files.items():  # the copy is the remote's bytes, and is served
            assert _cached_bytes(mount, source, rel) == data
            assert READERS[reader](mount.path / rel) == data
        assert mount.metric("cachefs_file_opens_total", result="hit") == len(files)
    else:
        assert mount.status()["cache_files"] == 0
    if fraction and reader != "o_direct":  # (O_DIRECT bypasses the NFS client's pages)
        # The reader and the copy shared the remote file's pages: read from it once, not
        # twice.  (A page the machine's memory reclaim dropped between the two is read again:
        # hence not exactly once on a busy machine.)
        total = sum(map(len, files.values()))
        assert total <= remote.stats()["read_bytes"] - read_before < 1.5 * total
    assert mount.metric("cachefs_remote_read_bytes_total") == sum(map(len, files.values()))


def _cached_bytes(mount, source: Path, rel: str) -> bytes:
    st = os.stat(source / rel)
    layout = CacheLayout(mount.cache_dir, CHUNK_BYTES)
    key = data_key(os.fsencode(rel), Version(st.st_size, st.st_mtime_ns))
    return Path(layout.data_path(key)).read_bytes()


def test_a_tar_shard_read_with_tarfile_through_the_kernel(source, remote, mount_cachefs):
    """A real library reading a shard at random offsets (tarfile seeks to each member)."""
    rng = random.Random(7)
    members = {f"img{i:03d}.jpg": rng.randbytes(rng.randint(1000, 200_000)) for i in range(60)}
    with tarfile.open(source / "shard.tar", "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    mount = mount_cachefs(remote.path, fraction=1.0, **KERNEL)
    for _ in range(2):  # through the remote's file, then through the cache's copy
        with tarfile.open(mount.path / "shard.tar") as tar:
            names = list(members)
            random.Random(1).shuffle(names)
            for name in names:
                assert tar.extractfile(name).read() == members[name]
        mount.settle()
    assert mount.status()["cache_files"] == 1


def test_hinted_misses_are_staged_as_copies_the_kernel_made(source, remote, mount_cachefs):
    """Not kept and hinted: the kernel copies the remote file into a memory file before the
    reader comes; the reader's open takes it (counted prefetched), no byte through Python,
    and the reader asks nothing of the remote: no open (a reader handed the remote's own
    file opens it again, a round trip on NFS) and no read, even once the machine's page
    cache was dropped."""
    from cachefs_client import send_hints

    rng = random.Random(3)
    files = {f"d/f{i}.bin": rng.randbytes(50_000) for i in range(20)}
    (source / "d").mkdir()
    for rel, data in files.items():
        (source / rel).write_bytes(data)
    mount = mount_cachefs(remote.path, fraction=0.0, **KERNEL)
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files")
    # A slow link (a read-ahead would still be under way once the files are staged) that
    # fails every open and read once they are: the readers then read what staging brought,
    # or fail.
    remote.configure(bandwidth_mbps=2)
    assert send_hints([mount.path / rel for rel in files]) == len(files)
    wait_for(lambda: mount.status()["hints"]["accepted"] == len(files),
             what="every hinted file staged")
    assert mount.status()["prefetch"]["staging_bytes"] == 50_000 * len(files)
    assert mount.metric("cachefs_remote_read_bytes_total") == 50_000 * len(files)
    for rel in files:
        os.stat(mount.path / rel)  # looked up before the faults: what is asked is the open
    remote.set_fault("errno", errno=errno.EIO, ops=["open", "read"])
    before = remote.stats()
    drop_page_cache()
    for rel, data in files.items():
        assert _whole(mount.path / rel) == data
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == len(files)
    assert mount.metric("cachefs_served_reads_total") == 0
    after = remote.stats()
    assert (after["opens"], after["read_bytes"]) == (before["opens"], before["read_bytes"])
    assert mount.metric("cachefs_remote_read_bytes_total") == 50_000 * len(files)
    assert mount.status()["prefetch"]["staging_bytes"] == 0


def test_a_remote_whose_opens_are_fast_has_every_miss_filled_and_every_hint_fetched(
        source, mount_cachefs):
    """A remote that opens files without a round trip (here a plain directory: a local disk,
    an NFS client holding delegations) has its kept misses opened by the fill threads and
    its hints fetched by as many workers as there are cores (Remote.opens_fast): every fill
    still lands, with the remote's bytes, and every hinted file is cached before its reader
    comes.  More files than the window of opens that decides it (32), in both parts."""
    from cachefs_client import send_hints

    rng = random.Random(11)
    files = {f"d{i % 4}/f{i}.bin": rng.randbytes(20_000 + i) for i in range(240)}
    for rel, data in files.items():
        (source / rel).parent.mkdir(exist_ok=True)
        (source / rel).write_bytes(data)
    mount = mount_cachefs(source, fraction=1.0, **KERNEL)
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files")
    read, hinted = sorted(files)[:120], sorted(files)[120:]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda rel: _whole(mount.path / rel), read)) \
            == [files[rel] for rel in read]
    mount.settle()
    assert mount.metric("cachefs_fills_total", result="stored") == len(read)
    assert mount.metric("cachefs_fills_total", result="skipped") == 0
    assert send_hints([mount.path / rel for rel in hinted]) == len(hinted)
    wait_for(lambda: mount.status()["hints"]["accepted"] == len(hinted),
             what="every hinted file fetched")
    assert mount.status()["cache_files"] == len(files)
    for rel, data in files.items():
        assert _cached_bytes(mount, source, rel) == data
        assert _whole(mount.path / rel) == data
    assert mount.metric("cachefs_file_opens_total", result="miss") == len(read)
    assert mount.metric("cachefs_file_opens_total", result="hit") == len(read)
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == len(hinted)


def _not_kept(source, remote, mount_cachefs, rel: str, seed: int, **options):
    """A file of 400,000 random bytes at ``rel``, mounted at f = 0 (kept by none) where the
    kernel takes backing files: the mount and the file's bytes."""
    data = random.Random(seed).randbytes(400_000)
    (source / rel).write_bytes(data)
    mount = mount_cachefs(remote.path, fraction=0.0, **KERNEL, **options)
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files")
    return mount, data


def _reading_in(source, remote, mount_cachefs, mbps: float):
    """A hinted file not kept, 400,000 bytes, being read in for staging over a link slowed
    to ``mbps`` MB/s: the mount and the file's bytes."""
    from cachefs_client import send_hints

    mount, data = _not_kept(source, remote, mount_cachefs, "big.bin", seed=5)
    remote.configure(bandwidth_mbps=mbps)
    reads = remote.stats()["ops"].get("read", 0)
    assert send_hints([mount.path / "big.bin"]) == 1
    # The read-in's first read at the remote, not the prefetch merely begun (which on a busy
    # machine may still be opening the file as the reader comes: a reader before the
    # read-in); asked of the remote's control socket every 20 ms, not of a `cachefs status`
    # process per look, which can take longer than the read-in.
    wait_for(lambda: remote.stats()["ops"].get("read", 0) > reads, interval=0.02,
             what="the read-in under way")
    return mount, data


def test_a_reader_during_the_staging_read_leaves_nothing_staged(source, remote, mount_cachefs):
    """A reader that opens a hinted file not kept while its pages are being read in is
    handed the file the prefetch is reading and reads the pages as they come: the staged
    copy, meant for that reader, is not left behind holding staging room until its time to
    live."""
    mount, data = _reading_in(source, remote, mount_cachefs, mbps=0.5)  # for some 0.8 s
    assert _whole(mount.path / "big.bin") == data
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == 1
    wait_for(lambda: mount.status()["hints"]["accepted"] == 1, what="the prefetch done")
    prefetch = mount.status()["prefetch"]
    assert prefetch["staging_bytes"] == 0
    assert (prefetch["used"], prefetch["wasted"]) == (1, 0)


def test_a_reader_sharing_a_read_in_that_fails_counts_its_own_bytes(source, remote,
                                                                    mount_cachefs):
    """A reader handed the file a prefetch reads in, whose read-in then fails: the reader
    reads the rest from the remote itself, and the file's bytes are counted (the read-in,
    which was to count them, never did)."""
    mount, data = _reading_in(source, remote, mount_cachefs, mbps=0.2)  # for some 2 s
    with open(mount.path / "big.bin", "rb", buffering=0) as f:
        remote.set_fault("errno", errno=errno.EIO, ops=["read"])  # the read-in's next read
        try:
            wait_for(lambda: mount.status()["prefetch"]["failed"] == 1, timeout=20,
                     what="the read-in given up")
        finally:
            remote.clear_faults()
        assert f.read() == data
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == 1
    assert mount.metric("cachefs_remote_read_bytes_total") == len(data)


@pytest.mark.parametrize("prefetch", ["reads-in", "fails"])
def test_a_reader_before_the_staging_read_is_a_miss_counted_once(source, remote,
                                                                 mount_cachefs, prefetch):
    """A reader that opens a hinted file not kept before its prefetch has opened it (here:
    the prefetch waits for staging room) reads the remote itself: a miss, its bytes counted
    once, whether the prefetch then reads the file in (sharing the reader's pages) or
    fails."""
    from cachefs_client import send_hints

    rng = random.Random(9)
    staged = {f"a{i}.bin": rng.randbytes(60_000) for i in range(4)}  # the staging, full
    late = rng.randbytes(60_000)
    for rel, data in [*staged.items(), ("b.bin", late)]:
        (source / rel).write_bytes(data)
    mount = mount_cachefs(remote.path, fraction=0.0, staging_size=240_000, **KERNEL)
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files")
    assert send_hints([mount.path / rel for rel in staged]) == len(staged)
    wait_for(lambda: mount.status()["prefetch"]["staging_bytes"] == 240_000,
             what="the staging full")
    assert send_hints([mount.path / "b.bin"]) == 1
    wait_for(lambda: mount.status()["prefetch"]["inflight"] == 1, what="b's prefetch waiting")
    assert _whole(mount.path / "b.bin") == late
    if prefetch == "fails":
        remote.set_fault("errno", errno=errno.EIO, ops=["open"], glob="b.bin")
    for rel, data in staged.items():  # room for b's prefetch
        assert _whole(mount.path / rel) == data
    wait_for(lambda: mount.status()["hints"]["accepted"] == len(staged) + 1,
             what="b's prefetch done")
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == len(staged)
    assert mount.metric("cachefs_file_opens_total", result="miss") == 1  # b
    assert mount.metric("cachefs_remote_read_bytes_total") == 60_000 * (len(staged) + 1)
    assert mount.status()["prefetch"]["staging_bytes"] == 0


def test_a_reader_before_the_prefetchs_fill_opens_is_a_miss_counted_once(
        source, remote, mount_cachefs):
    """A kept file whose prefetch has not opened the remote file yet (its open hangs here):
    a reader then opens the file itself, a miss, and counts its bytes; the fill, which
    shares the reader's pages, does not count them again."""
    from cachefs_client import send_hints

    data = random.Random(13).randbytes(300_000)
    (source / "k.bin").write_bytes(data)
    mount = mount_cachefs(remote.path, fraction=1.0, **KERNEL)
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files")
    os.stat(mount.path / "k.bin")  # looked up: the prefetch goes straight to the fill
    remote.set_fault("hang", ops=["open"], glob="k.bin")
    try:
        assert send_hints([mount.path / "k.bin"]) == 1
        wait_for(lambda: remote.stats()["hung_now"] == 1, what="the fill's open hung")
        reader = ThreadPoolExecutor(1)
        read = reader.submit(_whole, mount.path / "k.bin")
        wait_for(lambda: remote.stats()["hung_now"] == 2, what="the reader's open hung")
    finally:
        remote.clear_faults()
    assert read.result(timeout=30) == data
    reader.shutdown()
    mount.settle()
    assert mount.metric("cachefs_file_opens_total", result="miss") == 1
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == 0
    assert mount.metric("cachefs_fills_total", result="stored") == 1
    assert mount.metric("cachefs_remote_read_bytes_total") == len(data)
    assert _whole(mount.path / "k.bin") == data


def test_a_file_hinted_after_its_reader_is_staged_from_its_cached_pages(
        source, remote, mount_cachefs):
    """The next epoch's hint for a file this epoch's reader has just read: the kernel copies
    it from the pages that reader pulled, so the remote sends nothing more and nothing more
    is counted; its next reader, after the page cache was dropped, reads the staged copy."""
    from cachefs_client import send_hints

    mount, data = _not_kept(source, remote, mount_cachefs, "x.bin", seed=17)
    before = remote.stats()["read_bytes"]
    assert _whole(mount.path / "x.bin") == data  # a miss: the remote sends the file
    assert send_hints([mount.path / "x.bin"]) == 1
    wait_for(lambda: mount.status()["hints"]["accepted"] == 1, what="x.bin staged")
    drop_page_cache()
    assert _whole(mount.path / "x.bin") == data
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == 1
    assert remote.stats()["read_bytes"] - before == len(data)
    assert mount.metric("cachefs_remote_read_bytes_total") == len(data)


def test_a_file_hinted_as_a_reader_opens_it_is_counted_once(source, remote, mount_cachefs):
    """The next epoch's hint for a file this epoch's reader has just opened, before that
    reader's reads begin: the file is not copied beside the reader, and the bytes the remote
    sends once are counted once.  It is staged as the remote's own file, whose next reader,
    after the page cache was dropped, fetches it again: counted again.  So
    ``cachefs_remote_read_bytes_total`` follows the bytes the remote sent."""
    from cachefs_client import send_hints

    mount, data = _not_kept(source, remote, mount_cachefs, "y.bin", seed=23)
    before = remote.stats()["read_bytes"]
    with open(mount.path / "y.bin", "rb", buffering=0) as f:
        assert send_hints([mount.path / "y.bin"]) == 1
        wait_for(lambda: mount.status()["hints"]["accepted"] == 1, what="y.bin staged")
        assert f.read() == data
    assert remote.stats()["read_bytes"] - before == len(data)
    assert mount.metric("cachefs_remote_read_bytes_total") == len(data)
    drop_page_cache()
    assert _whole(mount.path / "y.bin") == data  # the staged remote file, its pages gone
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == 1
    assert remote.stats()["read_bytes"] - before == 2 * len(data)
    assert mount.metric("cachefs_remote_read_bytes_total") == 2 * len(data)


def test_a_file_read_from_its_staged_copy_and_hinted_again_is_copied_again(
        source, remote, mount_cachefs):
    """This epoch's reader reads a file from its staged copy in memory, and the next epoch's
    hint for it comes just after: none of the remote file's pages are on their way to that
    reader (they were dropped, as at an epoch's start), so the hint copies the file in again
    rather than stage the remote's own file, and its next reader reads memory."""
    from cachefs_client import send_hints

    mount, data = _not_kept(source, remote, mount_cachefs, "w.bin", seed=31)
    before = remote.stats()["read_bytes"]
    assert send_hints([mount.path / "w.bin"]) == 1
    wait_for(lambda: mount.status()["hints"]["accepted"] == 1, what="w.bin staged")
    drop_page_cache()
    assert _whole(mount.path / "w.bin") == data  # the copy in memory
    assert send_hints([mount.path / "w.bin"]) == 1
    wait_for(lambda: mount.status()["hints"]["accepted"] == 2,
             what="w.bin staged for its next read")
    assert remote.stats()["read_bytes"] - before == 2 * len(data)  # copied in again
    drop_page_cache()
    assert _whole(mount.path / "w.bin") == data
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == 2
    assert remote.stats()["read_bytes"] - before == 2 * len(data)  # nothing more
    assert mount.metric("cachefs_remote_read_bytes_total") == 2 * len(data)


def test_a_file_hinted_for_two_reads_while_queued_is_staged_for_the_second(
        source, remote, mount_cachefs):
    """The end of one epoch and the start of the next name the same file while its first
    hint still waits for a worker: the first reader passes the hint and reads the file
    itself; the hint for the second read stays, and that reader finds the file staged."""
    from cachefs_client import send_hints

    mount, data = _not_kept(source, remote, mount_cachefs, "z.bin", seed=29,
                            prefetch_concurrency=1)
    (source / "blocker.bin").write_bytes(b"b" * 1000)
    for rel in ("z.bin", "blocker.bin"):
        os.stat(mount.path / rel)  # looked up: the prefetch goes straight to the opens
    remote.set_fault("hang", ops=["open"], glob="blocker.bin")
    try:
        assert send_hints([mount.path / "blocker.bin"]) == 1
        wait_for(lambda: remote.stats()["hung_now"] == 1, what="the one worker held")
        assert send_hints([mount.path / "z.bin", mount.path / "z.bin"]) == 2
        wait_for(lambda: mount.status()["prefetch"]["queued"] == 1, what="z.bin queued")
        assert _whole(mount.path / "z.bin") == data  # passes the first hint
    finally:
        remote.clear_faults()
    wait_for(lambda: mount.status()["hints"]["accepted"] == 2,  # blocker.bin's, z.bin's
             what="z.bin staged for its second read")
    assert mount.metric("cachefs_hints_total", result="dropped") == 1  # the hint passed
    assert _whole(mount.path / "z.bin") == data
    assert mount.metric("cachefs_file_opens_total", result="miss") == 1
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == 1
    assert mount.metric("cachefs_remote_read_bytes_total") == len(data) + 1000


def _reading_during_a_slow_fill(mount, remote, rel: str, mbps: float):
    """``rel`` open through the mount and its first 4 KiB read, the remote slowed to ``mbps``
    MB/s so that the fill this open started is still copying on return: the open file and
    the bytes read."""
    remote.configure(bandwidth_mbps=mbps)
    f = open(mount.path / rel, "rb", buffering=0)  # noqa: SIM115 - the caller's to close
    try:
        head = f.read(4096)
        wait_for(lambda: fill_under_way(mount), what="the fill under way")
    except BaseException:
        f.close()
        raise
    return f, head


def test_a_large_copy_runs_on_every_cpu_while_the_serving_threads_keep_to_one(
        source, remote, mount_cachefs):
    """--cpus auto keeps the daemon's threads to one CPU; the thread copying a file over a
    piece (1 MiB) into the cache runs on every CPU for that copy, then keeps to the one
    again."""
    allowed = frozenset(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: there is nothing to keep to")
    data = random.Random(5).randbytes(8 * 2**20)
    (source / "shard.bin").write_bytes(data)
    mount = mount_cachefs(remote.path, fraction=1.0, **KERNEL)
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files: misses go through the daemon")
    pid = mount.status()["pid"]

    def masks() -> list[frozenset[int]]:
        return [frozenset(os.sched_getaffinity(int(tid)))
                for tid in os.listdir(f"/proc/{pid}/task")]

    f, head = _reading_during_a_slow_fill(mount, remote, "shard.bin", 4)  # about 2 s
    with f:
        during = masks()
        remote.configure(bandwidth_mbps=0)
        assert head + f.read() == data
    assert during.count(allowed) == 1  # the fill thread, copying
    (one,) = set(during) - {allowed}
    assert len(one) == 1 and str(min(one)) == mount.status()["cpus"]
    mount.settle()
    assert mount.metric("cachefs_fills_total", result="stored") == 1
    assert set(masks()) == {one}  # the copy done, its thread keeps to the one CPU again
    assert _cached_bytes(mount, source, "shard.bin") == data


# Who copies a kept file into the cache: threads of the daemon, or processes of their own.
FILLERS = {"threads": {}, "processes": {"fill_processes": 2}}


def _fill_processes(mount) -> list[int]:
    """The pids of the daemon's fill processes, as /proc shows its children (and checked
    against what its status says)."""
    pid = mount.status()["pid"]
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                    if b"cachefs.remote.fillprocess" in cmdline.read():
                        found.append(int(child))
    assert sorted(found) == sorted(mount.status()["fills"]["processes"])
    return found


@pytest.mark.parametrize("filler", sorted(FILLERS))
def test_a_remote_rewritten_during_a_fill_is_never_cached(source, remote, mount_cachefs,
                                                           filler):
    rng = random.Random(11)
    old, new = rng.randbytes(24 * 2**20), rng.randbytes(24 * 2**20)
    (source / "shard.bin").write_bytes(old)
    mount = mount_cachefs(remote.path, fraction=1.0, revalidate=1, **KERNEL, **FILLERS[filler])
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files")
    f, head = _reading_during_a_slow_fill(mount, remote, "shard.bin", 20)  # about a second
    with f:
        assert head == old[:4096]
        with open(source / "shard.bin", "r+b") as w:  # in place: same inode, new bytes
            w.write(new)
    remote.configure(bandwidth_mbps=0)
    mount.settle()
    assert mount.metric("cachefs_fills_total", result="changed") == 1
    assert mount.status()["cache_files"] == 0
    assert files_written(mount.cache_dir) == 0
    time.sleep(2.2)  # past the interval: the new version is read, and filled, whole
    assert _whole(mount.path / "shard.bin") == new
    mount.settle()
    assert mount.status()["cache_files"] == 1
    assert _cached_bytes(mount, source, "shard.bin") == new


@pytest.mark.parametrize("filler", sorted(FILLERS))
def test_kill_9_during_a_fill_leaves_nothing_indexed(source, remote, mount_cachefs, filler):
    rng = random.Random(12)
    data = rng.randbytes(24 * 2**20)
    (source / "shard.bin").write_bytes(data)
    (source / "small.bin").write_bytes(b"small and whole\n")
    mount = mount_cachefs(remote.path, fraction=1.0, **KERNEL, **FILLERS[filler])
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files")
    assert _whole(mount.path / "small.bin") == b"small and whole\n"
    mount.settle()
    # Indexed, and committed: the index commits what it was given every FLUSH_SECONDS, and a
    # crash loses at most those (the file's data then goes at the reconciliation).
    time.sleep(3 * FLUSH_SECONDS)
    remote.configure(bandwidth_mbps=10)  # a fill of 24 MiB takes over two seconds
    reader = os.open(mount.path / "shard.bin", os.O_RDONLY)
    try:
        assert os.pread(reader, 4096, 0) == data[:4096]
        wait_for(lambda: fill_under_way(mount), what="the fill under way")
        mount.kill()  # the supervisor too: the whole service is gone
    finally:
        os.close(reader)
    remote.configure(bandwidth_mbps=0)
    mount.start()  # cleans the stale mount up; the cache is reconciled in the background
    status = wait_for(lambda: (st := mount.status())["reconciling"] is False and st,
                      what="the cache reconciled")
    assert status["cache_files"] == 1  # small.bin; nothing of the shard
    assert files_written(mount.cache_dir) == 1
    assert _whole(mount.path / "shard.bin") == data
    assert _whole(mount.path / "small.bin") == b"small and whole\n"
    mount.settle()
    assert mount.status()["cache_files"] == 2
    mount.stop()
    verify = run_cachefs("verify", "--cache-dir", str(mount.cache_dir), timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.fast
def test_fill_processes_store_what_the_readers_read(source, remote, mount_cachefs):
    """--fill-processes: the kept files are copied and hashed by processes of the daemon's
    own; what readers and the cache get is the same as with fill threads."""
    rng = random.Random(13)
    files = {f"d{i % 3}/f{i}.bin": rng.randbytes(rng.choice([1, 4096, 70_000, 5 * 2**20 + 3]))
             for i in range(40)}
    for rel, data in files.items():
        (source / rel).parent.mkdir(exist_ok=True)
        (source / rel).write_bytes(data)
    mount = mount_cachefs(remote.path, fraction=1.0, fill_processes=2, **KERNEL)
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files: misses go through the daemon")
    read_before = remote.stats()["read_bytes"]
    for rel, data in files.items():
        assert _whole(mount.path / rel) == data, rel
    mount.settle()
    fillers = _fill_processes(mount)
    assert 1 <= len(fillers) <= 2
    # Started by the serving process, which keeps to one CPU; they copy on every CPU.
    for pid in fillers:
        assert os.sched_getaffinity(pid) == os.sched_getaffinity(0)
    assert mount.metric("cachefs_fills_total", result="stored") == len(files)
    assert mount.status()["cache_files"] == len(files)
    assert not os.listdir(mount.cache_dir / "tmp")
    assert files_written(mount.cache_dir) == len(files)
    total = sum(map(len, files.values()))
    assert total <= remote.stats()["read_bytes"] - read_before < 1.5 * total
    for rel, data in files.items():
        assert _cached_bytes(mount, source, rel) == data
        assert _mmap(mount.path / rel) == data
    assert mount.metric("cachefs_file_opens_total", result="hit") == len(files)
    mount.stop()  # the fill processes end with the daemon
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in fillers),
             what="the fill processes ended")
    verify = run_cachefs("verify", "--cache-dir", str(mount.cache_dir), timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _kill_the_fill_process_mid_copy(mount, remote, data: bytes) -> int:
    """Read shard.bin (``data``) through the mount while its fill, slowed, is killed with its
    process: the reader reads on with the right bytes; the pid killed."""
    reader, head = _reading_during_a_slow_fill(mount, remote, "shard.bin", 10)  # over 2 s
    with reader:
        assert head == data[:4096]
        (victim,) = _fill_processes(mount)
        os.kill(victim, signal.SIGKILL)
        remote.configure(bandwidth_mbps=0)
        assert data[4096:] == reader.read()
    mount.settle()
    assert mount.metric("cachefs_fills_total", result="failed") == 1
    wait_for(lambda: not fill_under_way(mount), what="the copy removed")
    return victim


def test_a_fill_process_killed_mid_copy_loses_that_fill_only(source, remote, mount_cachefs):
    """A fill process that dies (the OOM killer, a bug): the reader never notices, the file
    is not indexed, its temporary copy is removed, and the next open fills it through a new
    process."""
    rng = random.Random(14)
    data = rng.randbytes(24 * 2**20)
    (source / "shard.bin").write_bytes(data)
    (source / "small.bin").write_bytes(b"small and whole\n")
    mount = mount_cachefs(remote.path, fraction=1.0, fill_processes=1, **KERNEL)
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files")
    assert _whole(mount.path / "small.bin") == b"small and whole\n"  # the process's first
    mount.settle()
    victim = _kill_the_fill_process_mid_copy(mount, remote, data)
    assert mount.status()["cache_files"] == 1  # small.bin; nothing of the shard
    assert _whole(mount.path / "shard.bin") == data  # a new open: a new fill, a new process
    mount.settle()
    assert mount.metric("cachefs_fills_total", result="stored") == 2
    assert _cached_bytes(mount, source, "shard.bin") == data
    (successor,) = _fill_processes(mount)
    assert successor != victim


def test_a_fill_process_that_ends_before_its_first_file_leaves_fills_to_threads(
        source, remote, mount_cachefs):
    """Processes that cannot work here (one ends at once, before any answer): the daemon
    says so in its log and fills on its threads from then on, not process after process."""
    rng = random.Random(15)
    data = rng.randbytes(24 * 2**20)
    (source / "shard.bin").write_bytes(data)
    mount = mount_cachefs(remote.path, fraction=1.0, fill_processes=1, **KERNEL)
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files")
    _kill_the_fill_process_mid_copy(mount, remote, data)
    assert mount.status()["cache_files"] == 0
    wait_for(lambda: "the daemon's threads fill from now on" in mount.log_tail(),
             what="the fall back to threads logged")
    assert _whole(mount.path / "shard.bin") == data
    mount.settle()
    assert mount.metric("cachefs_fills_total", result="stored") == 1
    assert _cached_bytes(mount, source, "shard.bin") == data
    assert _fill_processes(mount) == []


def test_a_fill_process_stuck_on_a_hung_remote_is_killed_after_the_timeout(source, remote,
                                                                          mount_cachefs):
    """A fill process whose copy waits on a remote that does not answer: after
    --remote-timeout the daemon kills it, gives the fill's room and copy back and marks the
    remote unavailable (as the watchdog does for a fill thread's copy); once the remote
    answers, the next open fills the file through a new process."""
    data = random.Random(16).randbytes(300_000)
    (source / "stuck.bin").write_bytes(data)
    mount = mount_cachefs(remote.path, fraction=1.0, fill_processes=1, remote_timeout=2,
                          **KERNEL)
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files")
    os.stat(mount.path / "stuck.bin")
    remote.set_fault("hang", ops=["read"], glob="stuck.bin")  # the copy's reads hang
    try:
        os.close(os.open(mount.path / "stuck.bin", os.O_RDONLY))  # the open starts the fill
        (victim,) = _fill_processes(mount)
        wait_for(lambda: mount.metric("cachefs_fills_total", result="failed") == 1,
                 timeout=15, what="the stuck fill given up")
        assert mount.metric("cachefs_remote_available") == 0
        assert mount.metric("cachefs_remote_errors_total", kind="timeout") >= 1
        assert mount.status()["fills"]["under_way"] == 0
        assert files_written(mount.cache_dir) == 0
        assert mount.status()["cache_files"] == 0
    finally:
        remote.clear_faults()
    # Killed, it ends once its copy returns (a read in flight in FUSE, as on a hard NFS
    # mount, cannot be cut short).
    wait_for(lambda: not os.path.exists(f"/proc/{victim}"), what="the stuck process gone")
    wait_for(lambda: mount.metric("cachefs_remote_available") == 1, timeout=15,
             what="the remote back")
    assert _whole(mount.path / "stuck.bin") == data
    mount.settle()
    assert mount.metric("cachefs_fills_total", result="stored") == 1
    assert _cached_bytes(mount, source, "stuck.bin") == data
    assert _fill_processes(mount) != [victim]


@pytest.mark.parametrize("filler", sorted(FILLERS))
def test_a_fill_slower_than_the_timeout_is_left_to_finish_while_it_copies(
        source, remote, mount_cachefs, filler):
    """A copy that takes longer than --remote-timeout but keeps copying (a large file, a
    slow link) is not a remote that does not answer: it is stored, the remote stays
    available."""
    data = random.Random(17).randbytes(6 * 2**20)
    (source / "slow.bin").write_bytes(data)
    # Each piece of the copy (1 MiB, about 1 s at this link) must come within the timeout:
    # 2 s was too little margin on a busy host, where one piece took longer.
    mount = mount_cachefs(remote.path, fraction=1.0, remote_timeout=4, **KERNEL,
                          **FILLERS[filler])
    if not mount.hands_over_remote:
        pytest.skip("this kernel takes no backing files")
    os.stat(mount.path / "slow.bin")
    remote.configure(bandwidth_mbps=1)  # about 6 s for the copy
    try:
        os.close(os.open(mount.path / "slow.bin", os.O_RDONLY))  # the open starts the fill
        mount.settle(timeout=60)
    finally:
        remote.configure(bandwidth_mbps=0)
    assert mount.metric("cachefs_fills_total", result="stored") == 1
    assert mount.metric("cachefs_remote_available") == 1
    assert mount.metric("cachefs_remote_errors_total", kind="timeout") == 0
    assert _cached_bytes(mount, source, "slow.bin") == data


@pytest.mark.fast
def test_what_the_daemon_does_on_the_remote_stays_bounded_and_local_bounds_every_read(
        source, remote, mount_cachefs):
    """With the kernel reading the remote, the daemon's own calls stay bounded by
    --remote-timeout on a hung remote: a lookup fails with EIO, the open of a file to copy is
    given up on (the remote marked as not answering).  The reader's own open and reads of a
    handed-over file are the NFS mount's, bounded by its options (README): a kept miss waits
    for the kernel's open of the remote file, as a reader of the NFS mount would, not for the
    daemon's.
    ``--passthrough local`` bounds every read by --remote-timeout."""
    for name in ("a.bin", "b.bin", "c.bin"):
        (source / name).write_bytes(os.urandom(100_000))
    kernel = mount_cachefs(remote.path, name="kernel", cache_dir=source.parent / "ck",
                           fraction=1.0, remote_timeout=2, **KERNEL)
    strict = mount_cachefs(remote.path, name="strict", cache_dir=source.parent / "cs",
                           fraction=0.0, remote_timeout=2, passthrough="local")
    for mount in (kernel, strict):
        os.stat(mount.path / "a.bin")
        os.stat(mount.path / "b.bin")

    def fails_in_time(path: Path) -> None:
        started = time.monotonic()
        assert getattr(read_bounded(path), "errno", None) == errno.EIO
        assert time.monotonic() - started < 2 + 2

    remote.set_fault("hang", ops=["getattr"], glob="c.bin")  # a lookup hangs
    try:
        for mount in (kernel, strict):
            fails_in_time(mount.path / "c.bin")
    finally:
        remote.clear_faults()
    for mount in (kernel, strict):
        wait_for(lambda m=mount: m.metric("cachefs_remote_available") == 1, timeout=15,
                 what="the remote back")
    remote.set_fault("hang", ops=["open"], glob="a.bin")  # every open of it hangs
    if kernel.hands_over_remote:
        reading = ThreadPoolExecutor(1)
        try:
            read = reading.submit(_whole, kernel.path / "a.bin")
            # The fill's own open is given up on after the timeout (the remote is marked as
            # not answering); the reader still waits for the kernel's, as any reader of the
            # hung NFS mount does.
            wait_for(lambda: kernel.metric("cachefs_remote_available") == 0, timeout=15,
                     what="the fill's open given up on")
            assert not read.done()
        finally:
            remote.clear_faults()
        assert read.result(timeout=20) == (source / "a.bin").read_bytes()
        reading.shutdown()
    else:  # the daemon opens it for the reader
        try:
            fails_in_time(kernel.path / "a.bin")
        finally:
            remote.clear_faults()
    remote.set_fault("hang", ops=["read"], glob="b.bin")  # the daemon's read hangs
    try:
        fails_in_time(strict.path / "b.bin")
    finally:
        remote.clear_faults()
    for mount in (kernel, strict):
        wait_for(lambda m=mount: m.metric("cachefs_remote_available") == 1, timeout=15,
                 what="the remote back")
        for name in ("a.bin", "b.bin", "c.bin"):
            assert _whole(mount.path / name) == (source / name).read_bytes()
