"""What a reader sees when the remote or the cache disk misbehaves: cached files keep being
served, reads that need the remote fail with an errno after a bounded wait, the daemon stays
responsive and recovers by itself, and no wrong byte is ever served."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cachefs.attr import Version
from cachefs.kernel.mountpoint import find_mount
from cachefs.store.index import FLUSH_SECONDS, data_key
from cachefs.store.layout import CacheLayout
from cachefs.store.store import CHUNK_BYTES
from tests.conftest import (
    disk_usage,
    errno_of,
    make_files,
    read_bounded,
    run_cachefs,
    shuffled_read_all,
    turn_read_only,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)

REMOTE_TIMEOUT = 2  # --remote-timeout in these tests, seconds


def data_file(mount, rel: str) -> Path:
    """The file under <cache-dir>/data/ holding the cached bytes of ``rel``."""
    st = os.stat(mount.backing / rel)
    layout = CacheLayout(mount.cache_dir, CHUNK_BYTES)
    path = Path(layout.data_path(data_key(os.fsencode(rel),
                                          Version(st.st_size, st.st_mtime_ns))))
    assert path.is_file(), f"{rel} is not stored"
    return path


# -- the remote fails ---------------------------------------------------------------------------

def test_remote_eio_serves_cached_files_and_fails_the_rest_with_eio(source, remote,
                                                                    mount_cachefs):
    rels = make_files(source, 20, size=(1000, 50_000))
    (source / "big.bin").write_bytes(random.Random(1).randbytes(9 * 2**20))
    cached, uncached = rels[:10] + ["big.bin"], rels[10:]
    mount = mount_cachefs(remote.path, revalidate=1, remote_timeout=REMOTE_TIMEOUT)
    shuffled_read_all(mount.path, cached, seed=1)
    want = {r: (source / r).read_bytes() for r in rels + ["big.bin"]}

    remote.set_fault("errno", errno=errno.EIO)
    try:
        # Past the revalidation interval, so attributes would be asked of the remote again.
        time.sleep(2.2)
        assert shuffled_read_all(mount.path, cached, seed=2) == {r: want[r] for r in cached}
        for rel in uncached:
            assert errno_of(lambda rel=rel: (mount.path / rel).read_bytes()) == errno.EIO
        # The daemon answers meanwhile.
        assert mount.status()["cache_files"] == len(cached)
        assert mount.metric("cachefs_remote_errors_total", kind="eio") > 0
        assert remote.stats()["errors_injected"] > 0
    finally:
        remote.clear_faults()
    # Recovery needs nothing but the remote answering again.
    assert shuffled_read_all(mount.path, uncached, seed=3) == {r: want[r] for r in uncached}
    assert mount.metric("cachefs_remote_available") == 1


@pytest.mark.fast
def test_hung_remote_fails_uncached_reads_after_the_timeout_and_recovers(source, remote,
                                                                         mount_cachefs):
    rels = make_files(source, 12, size=(1000, 50_000))
    cached, uncached = rels[:6], rels[6:]
    mount = mount_cachefs(remote.path, revalidate=1, remote_timeout=REMOTE_TIMEOUT)
    want = {r: (source / r).read_bytes() for r in rels}
    shuffled_read_all(mount.path, cached, seed=1)
    time.sleep(2.2)  # past the revalidation interval: the next opens ask the remote

    remote.set_fault("hang")
    try:
        # Needs the remote: EIO once --remote-timeout has passed, not a reader stuck for ever.
        assert getattr(read_bounded(mount.path / uncached[0]), "errno", None) == errno.EIO
        wait_for(lambda: mount.metric("cachefs_remote_available") == 0,
                 what="cachefs_remote_available 0")
        assert mount.metric("cachefs_remote_errors_total", kind="timeout") >= 1
        # Cached files are served, the control socket and the metrics endpoint answer.
        for rel in cached:
            assert read_bounded(mount.path / rel) == want[rel]
        status = mount.status()
        assert status["remote_available"] is False
        assert status["cache_files"] == len(cached)
        for rel in uncached[1:3]:
            assert getattr(read_bounded(mount.path / rel), "errno", None) == errno.EIO
        assert remote.stats()["hung_now"] > 0
    finally:
        remote.clear_faults()
    # The remote answers again: the daemon notices by itself, uncached files read again.
    wait_for(lambda: mount.metric("cachefs_remote_available") == 1, timeout=REMOTE_TIMEOUT + 10,
             what="cachefs_remote_available back to 1")
    assert shuffled_read_all(mount.path, rels, seed=2) == want
    assert mount.status()["remote_available"] is True


def test_many_readers_stuck_on_a_hung_remote_do_not_hold_up_cached_reads(source, remote,
                                                                         mount_cachefs):
    rels = make_files(source, 34, size=1000)
    cached, uncached = rels[:4], rels[4:]
    # A long timeout: the stuck readers must still be stuck when the cached reads are done.
    mount = mount_cachefs(remote.path, remote_timeout=10)
    want = {r: (source / r).read_bytes() for r in cached}
    shuffled_read_all(mount.path, cached, seed=1)
    # Attributes known, bytes not: the readers get stuck reading, not looking up (the kernel
    # lets one lookup at a time into a directory of a FUSE mount).
    for rel in uncached:
        (mount.path / rel).stat()

    remote.set_fault("hang")
    try:
        with ThreadPoolExecutor(len(uncached)) as pool:
            # Far more requests waiting on the remote than the mount has threads to start with.
            stuck = [pool.submit(read_bounded, mount.path / rel, 30) for rel in uncached]
            wait_for(lambda: remote.stats()["hung_now"] >= len(uncached) // 2,
                     what="readers waiting on the hung remote")
            assert {rel: read_bounded(mount.path / rel) for rel in cached} == want
            assert not any(f.done() for f in stuck)
    finally:
        remote.clear_faults()
    for rel, reader in zip(uncached, stuck, strict=True):
        got = reader.result()  # the remote came back before the timeout, or it did not
        assert got == (source / rel).read_bytes() or getattr(got, "errno", None) == errno.EIO


def test_misses_of_many_readers_wait_on_the_remote_together(source, remote, mount_cachefs):
    """The mount serves FUSE on few threads, but a thread waiting on the remote is replaced at
    once: readers of files outside the cache wait out the remote's latency side by side, not
    a few at a time.  (Each wait is shorter than the time after which busy threads double.)"""
    readers = 16
    rels = make_files(source, readers, size=1000)
    mount = mount_cachefs(remote.path, fraction=0.0)
    for rel in rels:  # the attributes known: the readers wait on the remote's open and read
        (mount.path / rel).stat()
    remote.configure(open_ms=40, read_ms=40)
    with ThreadPoolExecutor(readers) as pool:
        got = list(pool.map(lambda rel: (mount.path / rel).read_bytes(), rels))
    assert got == [(source / rel).read_bytes() for rel in rels]
    assert remote.stats()["peak_in_flight"] >= readers // 2


# -- the remote changes ---------------------------------------------------------------------------

@pytest.mark.parametrize("fraction", [1.0, 0.0], ids=["cached", "uncached"])
def test_removed_remote_file_is_enoent_after_the_interval(source, remote, mount_cachefs,
                                                          fraction):
    (source / "gone.bin").write_bytes(b"soon removed\n" * 100)
    (source / "kept.bin").write_bytes(b"stays\n" * 100)
    mount = mount_cachefs(remote.path, revalidate=1, fraction=fraction)
    assert (mount.path / "gone.bin").read_bytes() == b"soon removed\n" * 100
    assert (mount.path / "gone.bin").read_bytes() == b"soon removed\n" * 100

    (source / "gone.bin").unlink()
    time.sleep(2.2)  # the interval plus the kernel's 1 s attribute cache
    assert errno_of(lambda: (mount.path / "gone.bin").read_bytes()) == errno.ENOENT
    assert errno_of(lambda: os.stat(mount.path / "gone.bin")) == errno.ENOENT
    assert "gone.bin" not in os.listdir(mount.path)
    assert (mount.path / "kept.bin").read_bytes() == b"stays\n" * 100


def test_changed_uncached_file_is_not_served_stale(source, remote, mount_cachefs):
    """test_cache.py covers a cached file; here the file is outside the kept fraction."""
    (source / "label.txt").write_bytes(b"version one\n")
    mount = mount_cachefs(remote.path, revalidate=1, fraction=0.0)
    assert (mount.path / "label.txt").read_bytes() == b"version one\n"
    (source / "label.txt").write_bytes(b"version two, longer\n")
    time.sleep(2.2)
    assert (mount.path / "label.txt").read_bytes() == b"version two, longer\n"


def _replace(path: Path, data: bytes) -> None:
    """A new file under the old name (rename over it), as most writers of datasets do."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _rewrite(path: Path, data: bytes) -> None:
    """The same file rewritten in place (same inode), size and bytes changed."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


@pytest.mark.parametrize("change", [_replace, _rewrite], ids=["replaced", "rewritten"])
@pytest.mark.parametrize("fraction", [1.0, 0.0], ids=["cached", "uncached"])
@pytest.mark.parametrize("new_size", [6 * 2**20 + 3, 14 * 2**20 + 5], ids=["shrinks", "grows"])
def test_file_changing_while_read_gives_one_version_or_an_error(source, remote, mount_cachefs,
                                                                change, fraction, new_size):
    rng = random.Random(new_size)
    old, new = rng.randbytes(10 * 2**20 + 1), rng.randbytes(new_size)
    (source / "shard.bin").write_bytes(old)
    mount = mount_cachefs(remote.path, revalidate=1, fraction=fraction)
    with open(mount.path / "shard.bin", "rb", buffering=0) as f:
        got = f.read(CHUNK_BYTES)  # the first chunk, before the change
        change(source / "shard.bin", new)
        try:
            while piece := f.read(1 << 20):
                got += piece
        except OSError as exc:
            outcome = exc.errno
        else:
            outcome = None
    if outcome is not None:
        assert outcome in (errno.ESTALE, errno.EIO), os.strerror(outcome)
    elif not (mount.hands_over_remote and change is _rewrite):
        # Read to the end without an error: all of one version, never a mix.
        assert got in (old, new), "a mix of the old and the new file was served"
    # (A reader handed the remote's own file sees a file rewritten in place under it as the
    # NFS mount shows it, as a reader of the remote itself would; the cache never keeps it.)
    mount.settle()
    assert _cached_versions(mount, "shard.bin") <= {old, new}, "a mix was cached"
    # A fresh open after the interval sees the new file whole.
    time.sleep(2.2)
    assert (mount.path / "shard.bin").read_bytes() == new
    mount.settle()
    assert _cached_versions(mount, "shard.bin") <= {new}


def _cached_versions(mount, rel: str) -> set[bytes]:
    """The bytes of every version of ``rel`` the cache indexes whole (its data files).

    The index on disk follows the daemon's by up to FLUSH_SECONDS: a record read from it may
    be one the daemon has dropped since, with its data file (a version replaced on the
    remote).  Such a copy is read again once the drop reached the disk."""
    found: set[bytes] = set()
    wait_for(lambda: _read_cached_versions(mount, rel, found), timeout=10 * FLUSH_SECONDS,
             what="the index on disk to match the data files")
    return found


def _read_cached_versions(mount, rel: str, found: set[bytes]) -> bool:
    """Add to ``found`` the bytes of ``rel`` as the index on disk has it whole; False when its
    data file is gone (dropped since: the disk has yet to hear of it)."""
    from cachefs.store.index import CacheIndex
    from cachefs.store.store import chunk_count

    scratch = Path(str(mount.cache_dir) + "-index-copy")
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(mount.cache_dir / "index", scratch)
    index = CacheIndex(scratch)
    try:
        record = index.get_file(os.fsencode(rel))
    finally:
        index.close()
        shutil.rmtree(scratch, ignore_errors=True)
    if record is not None and record.stored_chunks >= chunk_count(record.attr.size):
        layout = CacheLayout(mount.cache_dir, CHUNK_BYTES)
        try:
            found.add(Path(layout.data_path(data_key(os.fsencode(rel), record.version)))
                      .read_bytes())
        except FileNotFoundError:
            return False
    return True


# -- errors the remote answers with --------------------------------------------------------------

@pytest.mark.parametrize("code", [errno.ESTALE, errno.EACCES, errno.ENOENT, errno.EIO],
                         ids=errno.errorcode.get)
@pytest.mark.parametrize("fraction", [1.0, 0.0], ids=["cached", "uncached"])
def test_remote_errno_reaches_the_reader_unchanged(source, remote, mount_cachefs, code,
                                                   fraction):
    ops = ["getattr", "open", "read"]
    rels = {op: f"{op}-fails.bin" for op in ops}
    for rel in rels.values():
        (source / rel).write_bytes(os.urandom(100_000))
    (source / "healthy.bin").write_bytes(b"fine\n")
    mount = mount_cachefs(remote.path, fraction=fraction, remote_timeout=REMOTE_TIMEOUT)
    for op, rel in rels.items():
        remote.set_fault("errno", errno=code, ops=[op], glob=rel)
    # A miss is handed to the kernel named by path, and the kernel opens it: an error of
    # that open reaches the reader as EIO (the kernel's word for any failed passthrough
    # open; README, "Where the bytes of a read come from").
    kernel_opens = mount.hands_over_remote
    try:
        for op, rel in rels.items():
            want = errno.EIO if op == "open" and kernel_opens else code
            got = errno_of(lambda rel=rel: (mount.path / rel).read_bytes())
            assert got == want, f"{op} failing with {errno.errorcode[code]} gave " \
                                f"{errno.errorcode.get(got, got)}"
        assert (mount.path / "healthy.bin").read_bytes() == b"fine\n"
        # The fill beside the reader meets the fault too (counted below), unless a loaded
        # machine runs it after the faults are cleared.
        mount.settle()
    finally:
        remote.clear_faults()
    for rel in rels.values():
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes()
    kind = {errno.ESTALE: "estale", errno.EACCES: "eacces", errno.EIO: "eio"}.get(code)
    if kind is not None:
        # A file handed to the kernel is opened and read by the kernel: those errors are
        # not the daemon's to count, but for a kept file its fill meets them too.
        counted = len(ops) - 2 * (kernel_opens and not fraction)
        assert mount.metric("cachefs_remote_errors_total", kind=kind) >= counted
    assert "Traceback" not in mount.log_file.read_text()


def test_a_file_the_index_cannot_record_is_still_served(source, remote, mount_cachefs):
    """A file dated after 2262 (nanoseconds past 2**63) cannot go into the index; it used to
    fail every read with EIO instead of being served from the remote."""
    far_future = 2**63 + 10**18
    path = source / "from_the_future.bin"
    path.write_bytes(b"bogus timestamp, good bytes\n")
    os.utime(path, ns=(far_future, far_future))
    mount = mount_cachefs(remote.path)
    assert os.stat(mount.path / "from_the_future.bin").st_mtime_ns == far_future
    for _ in range(2):
        assert (mount.path / "from_the_future.bin").read_bytes() == path.read_bytes()
    assert "Traceback" not in mount.log_file.read_text()


# -- the cache disk fails ----------------------------------------------------------------------

def _log_lines(mount, text: str) -> list[str]:
    return [line for line in mount.log_file.read_text().splitlines() if text in line]


def test_full_cache_disk_stops_admission_and_readers_see_no_error(source, remote, mount_cachefs,
                                                                  scratch_fs):
    rels = make_files(source, 120, size=(100_000, 300_000))  # ~24 MB onto a 6 MiB disk
    (source / "big.bin").write_bytes(random.Random(2).randbytes(9 * 2**20))
    rels.append("big.bin")
    disk = scratch_fs("tmpfs", 6 * 2**20)
    # The budget (1 GiB) is far above what the disk holds: the disk fills first.
    mount = mount_cachefs(remote.path, cache_dir=disk / "cache", cache_size="1G")
    want = {r: (source / r).read_bytes() for r in rels}

    # Small files first, so that some are stored whole before the disk is full.
    assert shuffled_read_all(mount.path, rels[:-1], seed=1) | \
        shuffled_read_all(mount.path, rels[-1:], seed=1) == want
    assert mount.metric("cachefs_cache_admitting") == 0
    assert mount.metric("cachefs_cache_write_errors_total") >= 1
    status = mount.status()
    assert status["admitting"] is False and "No space left" in status["cache_write_error"]
    # The budget was more than the disk from the start: said once, at the mount.
    assert len(_log_lines(mount, "--cache-size 1 GiB is more than the cache disk holds (6 "
                                 "MiB): the disk fills first, and admission pauses then")) == 1
    refused = _log_lines(mount, "cache disk refused a write")
    assert len(refused) == 1, refused  # said once, not once per file
    # Everything still reads right, from the cache where stored and the remote otherwise.
    assert shuffled_read_all(mount.path, rels, seed=2) == want
    assert mount.metric("cachefs_file_opens_total", result="hit") >= 1
    assert "Traceback" not in mount.log_file.read_text()
    assert len(_log_lines(mount, "cache disk refused a write")) == 1


def test_a_cache_disk_out_of_inodes_refuses_the_mount_in_one_line(tmp_path, remote,
                                                                   scratch_fs):
    disk = scratch_fs("ext4", 16 * 2**20)
    (disk / "cache").mkdir()
    filler = disk / "filler"
    filler.mkdir()
    with pytest.raises(OSError) as full:
        for i in range(1_000_000):
            (filler / str(i)).touch()
    assert full.value.errno == errno.ENOSPC
    (tmp_path / "mnt").mkdir()
    result = run_cachefs("mount", str(remote.path), str(tmp_path / "mnt"), "--cache-dir",
                         str(disk / "cache"), "--cache-size", "8M", "--metrics-addr", "0",
                         "--log-file", str(tmp_path / "mnt.log"))
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "cache disk is full" in result.stderr
    assert "Traceback" not in (tmp_path / "mnt.log").read_text()
    assert find_mount(tmp_path / "mnt") is None


def test_an_index_commit_meeting_a_read_only_disk_first_names_the_disk(tmp_path, scratch_fs):
    # SQLite reports a read-only remount as "disk I/O error": the store says what it is.
    from cachefs.store.admission import FractionAdmission
    from cachefs.store.index import FileRecord
    from cachefs.store.store import CacheStore
    from tests.test_store import attr_of

    disk = scratch_fs("ext4", 64 * 2**20)
    store = CacheStore.open(disk / "cache", 32 * 2**20, FractionAdmission(1.0))
    try:
        assert store.store_chunk(b"before", attr_of(4), 0, b"abcd")
        store.index.flush()
        turn_read_only(disk)
        store.index.put_file(b"after", FileRecord(attr_of(4), 0, 0))  # committed by the flusher
        wait_for(lambda: store.write_error is not None, timeout=10, what="a refused commit")
        assert store.write_error.startswith("Read-only file system (EROFS)"), store.write_error
        assert not store.store_chunk(b"later", attr_of(4), 0, b"efgh")  # admission paused
    finally:
        store.close()


def test_cache_disk_turning_read_only_stops_admission_and_readers_see_no_error(
        source, remote, mount_cachefs, scratch_fs):
    rels = make_files(source, 200, size=(1000, 60_000))
    first, later = rels[:100], rels[100:]
    disk = scratch_fs("ext4", 64 * 2**20)
    mount = mount_cachefs(remote.path, cache_dir=disk / "cache", cache_size="32MiB")
    want = {r: (source / r).read_bytes() for r in rels}
    assert shuffled_read_all(mount.path, first, seed=1) == {r: want[r] for r in first}
    assert mount.metric("cachefs_cache_files") == len(first)

    turn_read_only(disk)  # as a disk error does with errors=remount-ro
    assert shuffled_read_all(mount.path, later, seed=2) == {r: want[r] for r in later}
    assert mount.metric("cachefs_cache_admitting") == 0
    assert mount.metric("cachefs_cache_write_errors_total") >= 1
    assert "Read-only file system" in mount.status()["cache_write_error"]
    assert len(_log_lines(mount, "cache disk refused a write")) == 1
    # What was stored before is still served from the cache.
    hits = mount.metric("cachefs_file_opens_total", result="hit")
    assert shuffled_read_all(mount.path, rels, seed=3) == want
    assert mount.metric("cachefs_file_opens_total", result="hit") - hits == len(first)
    assert "Traceback" not in mount.log_file.read_text()


# -- the cache's own bytes go bad ---------------------------------------------------------------

def _flip(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _truncate(path: Path) -> None:
    os.truncate(path, os.path.getsize(path) // 3)


def _grow(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0")


DAMAGE = {"flipped": _flip, "truncated": _truncate, "deleted": os.unlink, "grown": _grow}


@pytest.mark.fast
def test_damaged_chunks_are_never_served_and_are_refetched(source, remote, mount_cachefs):
    small = make_files(source, len(DAMAGE), size=(10_000, 100_000))
    (source / "shard.bin").write_bytes(random.Random(4).randbytes(10 * 2**20 + 7))
    rels = small + ["shard.bin"]
    want = {r: (source / r).read_bytes() for r in rels}
    mount = mount_cachefs(remote.path)
    # The kernel's pages are dropped, or the re-read would be served from them, undamaged.
    assert shuffled_read_all(mount.path, rels, seed=1, drop_pages=True) == want
    assert mount.metric("cachefs_cache_files") == len(rels)

    # Behind the daemon's back: one kind of damage per small file, the middle chunk of the shard.
    for rel, damage in zip(small, DAMAGE.values(), strict=True):
        damage(data_file(mount, rel))
    _flip(data_file(mount, "shard.bin"))  # the middle of 10 MiB: its second chunk
    remote_before = mount.metric("cachefs_remote_read_bytes_total")

    assert shuffled_read_all(mount.path, rels, seed=2) == want
    assert mount.metric("cachefs_integrity_failures_total") == len(DAMAGE) + 1
    refetched = mount.metric("cachefs_remote_read_bytes_total") - remote_before
    # Only the damaged bytes came again from the remote: the small files whole, and of the
    # shard just its bad chunk (the rest of a large file stays cached).
    assert refetched == sum(len(want[r]) for r in small) + CHUNK_BYTES
    hits, remote_before = (mount.metric("cachefs_file_opens_total", result="hit"),
                           mount.metric("cachefs_remote_read_bytes_total"))
    assert shuffled_read_all(mount.path, rels, seed=4) == want
    assert mount.metric("cachefs_file_opens_total", result="hit") - hits == len(rels)
    assert mount.metric("cachefs_remote_read_bytes_total") == remote_before
    assert mount.metric("cachefs_integrity_failures_total") == len(DAMAGE) + 1


def test_cached_files_removed_behind_its_back_leave_the_account(source, remote, mount_cachefs):
    """A cleaner of aged files (systemd-tmpfiles on /var/cache, say) removes the cached files:
    they are read from the remote and cached again, and the bytes counted against the budget
    are those on the disk, not those plus the removed ones (which would fill the budget with
    nothing, and stop admission early)."""
    rels = make_files(source, 40, size=(20_000, 60_000))
    mount = mount_cachefs(remote.path, cache_size="16MiB")
    want = shuffled_read_all(mount.path, rels, seed=1, drop_pages=True)
    for rel in rels:
        os.unlink(data_file(mount, rel))
    assert shuffled_read_all(mount.path, rels, seed=2, drop_pages=True) == want
    assert mount.metric("cachefs_integrity_failures_total") == len(rels)
    wait_for(lambda: mount.metric("cachefs_cache_files") == len(rels), timeout=30)
    assert shuffled_read_all(mount.path, rels, seed=3, drop_pages=True) == want
    # The index's own size is measured at fills, at most every INDEX_MEASURE_SECONDS, and its
    # write-ahead log grows after the last fill's measure as its flusher writes the records
    # (72 KiB once, in a run of the data-path suite): up to 128 KiB may be uncounted, a
    # twelfth of what the removed files held.
    counted, on_disk = mount.metric("cachefs_cache_bytes"), disk_usage(mount.cache_dir)
    assert abs(counted - on_disk) < 128 * 1024, (counted, on_disk)


# -- the daemon dies ------------------------------------------------------------------------------

def _complete_files(cache_dir: Path, scratch: Path) -> set[str]:
    """Files the index (a copy of it, so the daemon's own reconciliation is not disturbed)
    records as stored whole."""
    from cachefs.store.index import CacheIndex, split_key
    from cachefs.store.store import chunk_count

    shutil.copytree(cache_dir / "index", scratch)
    index = CacheIndex(scratch)
    try:
        complete = set()
        for key in index.all_keys():
            if split_key(key)[1] is None:
                record = index.get_file(key)
                if record.stored_chunks >= chunk_count(record.attr.size):
                    complete.add(os.fsdecode(key))
        return complete
    finally:
        index.close()


def test_kill_9_while_caching_then_mount_again(tmp_path, source, remote, mount_cachefs):
    rels = make_files(source, 1500, size=(5_000, 40_000))
    for i in range(3):
        (source / f"shard{i}.bin").write_bytes(random.Random(i).randbytes(9 * 2**20))
    rels += [f"shard{i}.bin" for i in range(3)]
    capacity = 24 * 2**20  # less than the ~60 MB of data: the budget matters too
    remote.configure(read_ms=1.0, open_ms=0.5)
    mount = mount_cachefs(remote.path, cache_size=capacity)

    stop = threading.Event()

    def reader(seed: int) -> None:
        order = list(rels)
        random.Random(seed).shuffle(order)
        for rel in order:
            if stop.is_set():
                return
            try:
                (mount.path / rel).read_bytes()
            except OSError:
                return  # the daemon is gone

    readers = [threading.Thread(target=reader, args=(seed,), daemon=True) for seed in range(8)]
    for thread in readers:
        thread.start()
    # Kill it in the middle of filling the cache, with fills in flight.
    wait_for(lambda: mount.metric("cachefs_cache_bytes") >= capacity // 3, timeout=60,
             interval=0.05, what="a third of the cache filled")
    mount.kill()
    stop.set()
    for thread in readers:
        thread.join(30)
    assert errno_of(lambda: os.listdir(mount.path)) == errno.ENOTCONN  # a stale mount
    complete = _complete_files(mount.cache_dir, tmp_path / "index-copy")
    assert complete

    # Mount again: the stale mount is cleaned up by `cachefs mount` itself.
    result = run_cachefs(*mount.command())
    assert result.returncode == 0, result.stderr
    assert "stale mount" in result.stderr
    mount.pid = mount.status()["pid"]
    mount.metrics_url = mount.status()["metrics_url"]

    # Entries complete before the crash are served as they are, without the remote.
    remote_before = remote.stats()["read_bytes"]
    want = {r: (source / r).read_bytes() for r in rels}
    assert shuffled_read_all(mount.path, sorted(complete), seed=1) == \
        {r: want[r] for r in complete}
    assert remote.stats()["read_bytes"] == remote_before
    assert mount.metric("cachefs_remote_read_bytes_total") == 0
    assert mount.metric("cachefs_file_opens_total", result="hit") == len(complete)
    # Everything else reads right too; nothing half-written was kept.
    assert shuffled_read_all(mount.path, rels, seed=2) == want
    assert mount.metric("cachefs_integrity_failures_total") == 0
    assert os.listdir(mount.cache_dir / "tmp") == []
    assert disk_usage(mount.cache_dir) <= capacity
    assert mount.metric("cachefs_cache_bytes") <= capacity


# -- cachefs verify -------------------------------------------------------------------------------

def test_verify_refuses_a_cache_dir_in_use(source, remote, mount_cachefs):
    make_files(source, 3)
    mount = mount_cachefs(remote.path)
    result = run_cachefs("verify", "--cache-dir", str(mount.cache_dir))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use" in lines[0] and str(mount.pid) in lines[0], lines
    assert "Traceback" not in result.stderr


def test_verify_mends_an_unreadable_marker_that_the_mount_refuses(source, remote,
                                                                  mount_cachefs):
    """A damaged cachefs-cache.json: the mount sends the user to `cachefs verify`, which
    rewrites it (the index beside it shows the directory is a cache) and checks every chunk;
    the mount then serves the cached files.  A directory without an index stays refused."""
    rels = make_files(source, 10, size=(1000, 50_000))
    mount = mount_cachefs(remote.path)
    want = shuffled_read_all(mount.path, rels, seed=1)
    mount.stop()
    marker = mount.cache_dir / "cachefs-cache.json"
    marker.write_bytes(random.Random(3).randbytes(40))

    refused = run_cachefs("mount", str(remote.path), str(mount.path), "--cache-dir",
                          str(mount.cache_dir), "--cache-size", "64M", "--metrics-addr", "0")
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == [
        f"cachefs mount: cache dir {mount.cache_dir} has an unreadable cachefs-cache.json; "
        "run 'cachefs verify' or choose a new directory"]

    result = run_cachefs("verify", "--cache-dir", str(mount.cache_dir), "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["marker_rewritten"] and report["chunks_verified"] == len(rels)
    assert report["corrupt_chunks"] == 0 and report["files"] == len(rels)
    again = run_cachefs("verify", "--cache-dir", str(mount.cache_dir))
    assert again.returncode == 0 and "no problems found" in again.stdout, again.stdout

    mount.start()
    assert shuffled_read_all(mount.path, rels, seed=2) == want
    assert mount.metric("cachefs_file_opens_total", result="hit") == len(rels)
    assert mount.metric("cachefs_remote_read_bytes_total") == 0

    stranger = mount.cache_dir.parent / "not-a-cache"
    stranger.mkdir()
    (stranger / "cachefs-cache.json").write_text("{")
    result = run_cachefs("verify", "--cache-dir", str(stranger))
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"cachefs verify: {stranger} has an unreadable cachefs-cache.json and no cachefs "
        "index beside it; choose a new directory"]
    assert (stranger / "cachefs-cache.json").read_text() == "{"


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_a_damaged_index_empties_the_cache_and_the_mount_serves(source, remote, mount_cachefs,
                                                                damage):
    """The index's file damaged on the cache disk, after a clean stop: the mount starts all
    the same, with the cache emptied (the checksums went with the index), counts an integrity
    failure and serves the remote's bytes, filling the cache again.  `cachefs verify` says
    what it dropped."""
    rels = make_files(source, 20, size=(1000, 50_000))
    mount = mount_cachefs(remote.path)
    want = shuffled_read_all(mount.path, rels, seed=1)
    mount.stop()
    database = mount.cache_dir / "index" / "cache.db"
    if damage == "truncated":
        os.truncate(database, 5000)
    else:
        with open(database, "r+b") as f:
            f.seek(8192)
            f.write(random.Random(7).randbytes(4096))
    before = {p for p in (mount.cache_dir / "data").rglob("*") if p.is_file()}
    assert len(before) == len(rels)

    if damage == "truncated":  # cachefs verify first: it says so, and empties the cache
        result = run_cachefs("verify", "--cache-dir", str(mount.cache_dir))
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stdout.splitlines()[0] == \
            "the index was damaged (database disk image is malformed): dropped, the cache emptied"
        assert "Traceback" not in result.stderr
        assert not list(mount.cache_dir.glob("trash.*"))  # removed before it said so
    # As a stop in the middle of removing an earlier emptying's files leaves them.
    leftover = mount.cache_dir / "trash.earlier" / "data" / "ab"
    leftover.mkdir(parents=True)
    (leftover / "cdef").write_bytes(b"z" * 5000)
    mount.start()
    assert mount.metric("cachefs_integrity_failures_total") == (damage == "overwritten")
    assert mount.metric("cachefs_cache_files") == 0
    assert not any(p.is_file() for p in (mount.cache_dir / "data").rglob("*"))
    # The old files are put aside at once and removed in the background: none stays.
    wait_for(lambda: not list(mount.cache_dir.glob("trash.*")), timeout=30)
    assert not [p for p in mount.cache_dir.rglob("*") if p.is_file() and p in before]
    assert shuffled_read_all(mount.path, rels, seed=2) == want
    assert mount.metric("cachefs_file_opens_total", result="hit") == 0
    wait_for(lambda: mount.metric("cachefs_cache_files") == len(rels), timeout=30)
    assert shuffled_read_all(mount.path, rels, seed=3) == want
    assert mount.metric("cachefs_file_opens_total", result="hit") == len(rels)


def test_verify_checks_every_chunk_and_drops_the_bad_ones(source, remote, mount_cachefs):
    rels = make_files(source, 30, size=(1000, 100_000))
    (source / "shard.bin").write_bytes(random.Random(5).randbytes(9 * 2**20))
    rels.append("shard.bin")
    mount = mount_cachefs(remote.path)
    want = shuffled_read_all(mount.path, rels, seed=1)
    damaged = {"flipped": rels[0], "truncated": rels[1], "deleted": rels[2],
               "shard": "shard.bin"}
    paths = {what: data_file(mount, rel) for what, rel in damaged.items()}
    mount.stop()

    _flip(paths["flipped"])
    _truncate(paths["truncated"])
    os.unlink(paths["deleted"])
    _flip(paths["shard"])
    (mount.cache_dir / "tmp" / "half-written-fill").write_bytes(b"x" * 1000)
    stray = mount.cache_dir / "data" / "00" / "not-in-the-index"
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(b"y" * 1000)

    result = run_cachefs("verify", "--cache-dir", str(mount.cache_dir), "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["corrupt_chunks"] == 3  # flipped, truncated, the shard's middle chunk
    assert report["missing_chunks"] == 1
    assert report["leftover_fills"] == 1
    assert report["orphan_files"] == 1
    assert report["files"] == len(rels) - len(damaged)
    # Every stored chunk was read: the intact small files and the shard's two good chunks.
    assert report["chunks_verified"] == len(rels) - len(damaged) + 2
    assert not stray.exists()
    assert os.listdir(mount.cache_dir / "tmp") == []

    again = run_cachefs("verify", "--cache-dir", str(mount.cache_dir))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "no problems found" in again.stdout
    assert f"verified {len(rels) - len(damaged)} chunks" in again.stdout

    # Mounted again: the dropped files come from the remote, the rest from the cache.
    mount.start()
    assert shuffled_read_all(mount.path, rels, seed=2) == want
    assert mount.metric("cachefs_file_opens_total", result="hit") == len(rels) - len(damaged)
    assert mount.metric("cachefs_remote_read_bytes_total") == \
        sum(len(want[r]) for r in damaged.values())
    assert mount.metric("cachefs_integrity_failures_total") == 0
