"""The store and the small parts, without a mount: budget, checksums, reconciliation,
admission statistics, size and config parsing, and the errno table of the FUSE boundary."""

from __future__ import annotations

import errno
import os
import random
import select
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from cachefs.attr import Attr, Version
from cachefs.errors import CacheCorrupt, RemoteChanged, RemoteUnavailable, UsageError
from cachefs.kernel import protocol
from cachefs.kernel.session import Request, Session
from cachefs.metrics import Metrics
from cachefs.mirror.mirrorfs import MirrorFS
from cachefs.service.config import build_settings, parse_metrics_addr
from cachefs.sizes import parse_size
from cachefs.store import reconcile as reconcile_module
from cachefs.store.admission import FractionAdmission
from cachefs.store.index import data_key
from cachefs.store.store import CHUNK_BYTES, CacheStore, chunk_count
from tests.conftest import disk_usage, files_written, wait_for

pytestmark = pytest.mark.fast


def attr_of(size: int, mtime_ns: int = 1) -> Attr:
    return Attr(stat.S_IFREG | 0o644, size, 0, 0, 1, mtime_ns, mtime_ns, mtime_ns)


@pytest.fixture
def open_store(tmp_path):
    stores = []

    def factory(capacity=64 * 2**20, fraction=1.0):
        store = CacheStore.open(tmp_path / "cache", capacity, FractionAdmission(fraction))
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


@pytest.fixture
def another_boot(tmp_path, monkeypatch):
    """Calling it makes the starts from then on run in another boot of the machine, as after
    a power cut."""
    def switch() -> None:
        boot_id = tmp_path / f"boot_id.{uuid.uuid4().hex}"
        boot_id.write_text(f"{uuid.uuid4()}\n")
        monkeypatch.setattr(reconcile_module, "BOOT_ID_PATH", boot_id)
    return switch


def as_a_crash_leaves_it(store) -> None:
    """The cache dir of a store closed as a crash leaves it: no record of a clean stop."""
    (store.layout.root / reconcile_module.CLEAN_STOP_NAME).unlink()


def put_file(store, name: str, data: bytes, mtime_ns: int = 1) -> bool:
    key, attr = os.fsencode(name), attr_of(len(data), mtime_ns)
    stored = True
    for number in range(chunk_count(len(data))):
        piece = data[number * CHUNK_BYTES : (number + 1) * CHUNK_BYTES]
        stored &= store.store_chunk(key, attr, number, piece)
    return stored


def read_file(store, name: str) -> bytes | None:
    key = os.fsencode(name)
    record = store.lookup(key)
    if record is None or not store.is_complete(record):
        return None
    return b"".join(store.read_chunk(key, record, n) for n in range(chunk_count(record.attr.size)))


def tracked_and_recounted(store) -> tuple[int, int]:
    """(the account the store tracked, the account measured from scratch).  The index's last
    writes are committed first: its size is measured as it grows, not at every write."""
    store.index.flush()
    with store._lock:
        store._measure_index_locked(force=True)
    tracked = store.used_bytes
    store.check(fix=True, verify_data=False)
    return tracked, store.used_bytes


def test_store_round_trip_small_and_chunked(open_store):
    store = open_store()
    small, large = os.urandom(1000), os.urandom(2 * CHUNK_BYTES + 5)
    assert put_file(store, "a/small.jpg", small)
    assert put_file(store, "a/large.tar", large)
    assert put_file(store, "empty", b"")
    assert read_file(store, "a/small.jpg") == small
    assert read_file(store, "a/large.tar") == large
    assert read_file(store, "empty") == b""
    assert store.complete_files == 3
    assert store.check(fix=False, verify_data=True).problems == 0


def test_budget_counts_everything_on_disk(open_store, tmp_path):
    capacity = 5 * 2**20
    store = open_store(capacity=capacity)
    stored = sum(put_file(store, f"f{i}", os.urandom(10_000)) for i in range(1000))
    assert 100 < stored < 500
    assert not store.admitting
    assert store.used_bytes <= capacity
    assert disk_usage(tmp_path / "cache") <= capacity
    # Measured from scratch, the account agrees with what the store tracked.
    tracked, recounted = tracked_and_recounted(store)
    assert abs(recounted - tracked) <= 64 * 1024


def test_a_chunk_read_out_of_order_is_counted_as_the_blocks_it_holds(open_store, tmp_path):
    """A shard's last chunk read first (a random read into a tar): its data file is sparse,
    of the shard's full size, and holds one short chunk.  The account grows by that chunk,
    not by the size, so a cache of shards is not called full while its disk is nearly
    empty; and dropping the file takes off what it held."""
    store = open_store(capacity=64 * 2**20)
    data = os.urandom(4 * CHUNK_BYTES + 5000)
    key, attr = b"shard.tar", attr_of(len(data))
    before = store.used_bytes
    assert store.store_chunk(key, attr, 4, data[4 * CHUNK_BYTES :])
    grew = store.used_bytes - before
    assert 5000 <= grew <= 5000 + 64 * 1024
    assert store.store_chunk(key, attr, 1, data[CHUNK_BYTES : 2 * CHUNK_BYTES])
    assert store.used_bytes - before <= CHUNK_BYTES + grew
    store.drop(key)
    assert store.used_bytes - before <= 64 * 1024
    assert disk_usage(tmp_path / "cache") <= store.used_bytes


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "append"])
def test_corrupt_chunk_is_detected_and_dropped(open_store, damage):
    failures = []
    store = open_store()
    store._on_integrity_failure = lambda: failures.append(1)
    data = os.urandom(50_000)
    put_file(store, "img.jpg", data)
    path = store.layout.data_path(data_key(b"img.jpg", Version(len(data), 1)))
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(1234)
            byte = f.read(1)
            f.seek(1234)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(path, 100)
    elif damage == "delete":
        os.unlink(path)
    else:
        with open(path, "ab") as f:
            f.write(b"x")
    key = b"img.jpg"
    with pytest.raises(CacheCorrupt):
        store.read_chunk(key, store.lookup(key), 0)
    assert failures == [1]
    assert store.lookup(key) is None  # dropped: refetched next time, never served
    assert put_file(store, "img.jpg", data)
    assert read_file(store, "img.jpg") == data


def test_a_bad_chunk_fetched_again_is_counted_once(open_store, tmp_path):
    """A shard's middle chunk found damaged is forgotten and fetched again: the account
    grows by its blocks once, as a count from scratch finds, and the bytes are the remote's."""
    store = open_store()
    failures = []
    store._on_integrity_failure = lambda: failures.append(1)
    data = os.urandom(3 * CHUNK_BYTES)
    key = b"shard.tar"
    assert put_file(store, "shard.tar", data)
    path = store.layout.data_path(data_key(key, Version(len(data), 1)))
    with open(path, "r+b") as f:
        f.seek(CHUNK_BYTES + 99)
        f.write(bytes([data[CHUNK_BYTES + 99] ^ 0xFF]))
    with pytest.raises(CacheCorrupt):
        store.read_chunk(key, store.lookup(key), 1)
    assert failures == [1]
    assert not store.is_complete(store.lookup(key))
    assert store.store_chunk(key, attr_of(len(data)), 1, data[CHUNK_BYTES : 2 * CHUNK_BYTES])
    assert read_file(store, "shard.tar") == data
    tracked, recounted = tracked_and_recounted(store)
    assert recounted == tracked
    assert disk_usage(tmp_path / "cache") <= tracked


def test_the_background_scrub_finds_damage_no_reader_met(tmp_path):
    """After a clean stop, every file is verified in the background: a flipped byte that
    left the file's identity as checked (a fault of the disk) is found with no reader
    opening the file; a whole file is dropped, a shard loses only its bad chunk."""
    store = CacheStore.open(tmp_path / "cache", 64 * 2**20, FractionAdmission(1.0))
    files = {f"f{i}": os.urandom(20_000) for i in range(20)}
    files["shard.tar"] = os.urandom(2 * CHUNK_BYTES + 7)
    for name, data in files.items():
        assert put_file(store, name, data)
    store.close()

    def flip(name: str, offset: int) -> None:
        path = store.layout.data_path(data_key(os.fsencode(name), Version(len(files[name]), 1)))
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(bytes([files[name][offset] ^ 0xFF]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    flip("f3", 777)
    flip("shard.tar", CHUNK_BYTES + 5)
    failures = []
    store = CacheStore.open(tmp_path / "cache", 64 * 2**20, FractionAdmission(1.0),
                            on_integrity_failure=lambda: failures.append(1), scrub=True)
    try:
        wait_for(lambda: store._scrubber is not None and not store.scrub_figures()["running"],
                 timeout=30, what="the scrub's end")
        figures = store.scrub_figures()
        assert figures["trusted"] and not figures["running"]
        assert figures["files"] == len(files)
        assert len(failures) == 2
        assert store.lookup(b"f3") is None
        assert not store.is_complete(store.lookup(b"shard.tar"))
        for name, data in files.items():
            if name not in ("f3", "shard.tar"):
                assert read_file(store, name) == data
    finally:
        store.close()


def test_check_repairs_orphans_leftovers_and_fraction_changes(open_store, tmp_path):
    store = open_store()
    for i in range(200):
        put_file(store, f"f{i}", os.urandom(3000))
    (store.layout.tmp_dir / "half-written.123").write_bytes(b"partial")
    orphan = store.layout.data_dir / "ff" / ("0" * 30)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"no record")
    store.close()
    # As a crash leaves it: no record of a clean stop.
    (store.layout.root / "clean-stop.json").unlink()

    store = open_store(fraction=0.5)  # a smaller fraction at the next start
    assert store.ready.wait(10)  # reconciled in the background
    report = store.check(fix=False, verify_data=True)
    assert report.problems == 0 and report.leftover_fills == 0
    admission = FractionAdmission(0.5)
    kept = [i for i in range(200) if admission.eligible(f"f{i}")]
    assert store.complete_files == len(kept)
    assert not list(store.layout.tmp_dir.iterdir())
    assert not orphan.exists()


def test_shrunken_capacity_is_enforced_at_start(open_store, tmp_path):
    store = open_store(capacity=32 * 2**20)
    for i in range(1000):
        put_file(store, f"f{i}", os.urandom(10_000))
    store.close()
    store = open_store(capacity=6 * 2**20)
    assert store.ready.wait(10)  # trimmed in the background
    assert store.used_bytes <= 6 * 2**20
    assert disk_usage(tmp_path / "cache") <= 6 * 2**20
    # The survivors are the lowest admission scores: what a smaller fraction keeps.
    admission = FractionAdmission(1.0)
    kept = sorted(admission.score(f"f{i}") for i in range(1000)
                  if store.lookup(os.fsencode(f"f{i}")) is not None)
    dropped = sorted(admission.score(f"f{i}") for i in range(1000)
                     if store.lookup(os.fsencode(f"f{i}")) is None)
    assert kept and dropped and kept[-1] < dropped[0]


def test_a_full_cache_restarted_on_the_same_budget_keeps_every_file(open_store):
    """A full cache keeps room for its index to grow into; the index grown into it by the
    stop is no budget overrun: the same budget at the next start drops nothing."""
    store = open_store(capacity=4 * 2**20)
    stored = sum(put_file(store, f"f{i}", os.urandom(10_000)) for i in range(400))
    assert stored < 400  # full
    store.close()
    store = open_store(capacity=4 * 2**20)
    assert store.ready.wait(10)
    assert store.complete_files == stored
    assert store.startup_report.over_budget_files == 0


def test_a_cache_is_named_at_its_making_and_anew_when_emptied(tmp_path):
    """What a warm's checkpoint is taken against: the name a cache is given when it is made,
    kept across restarts, given to a cache made by a version that named none (its files
    kept), and new once its contents go (a damaged index empties it)."""
    import json

    def reopened():
        store = CacheStore.open(tmp_path / "cache", 64 * 2**20, FractionAdmission(1.0))
        assert store.ready.wait(10)
        return store

    marker = tmp_path / "cache" / "cachefs-cache.json"
    store = reopened()
    put_file(store, "x", b"kept")
    named = store.layout.identity
    assert named and json.loads(marker.read_text())["id"] == named
    store.close()
    store = reopened()
    assert store.layout.identity == named and read_file(store, "x") == b"kept"
    store.close()

    older = json.loads(marker.read_text())
    del older["id"]
    marker.write_text(json.dumps(older))
    store = reopened()
    renamed = store.layout.identity
    assert renamed not in (None, named) and json.loads(marker.read_text())["id"] == renamed
    assert read_file(store, "x") == b"kept"
    store.close()

    os.truncate(tmp_path / "cache" / "index" / "cache.db", 5000)
    store = reopened()
    try:
        assert store.complete_files == 0
        assert store.layout.identity not in (None, named, renamed)
        assert json.loads(marker.read_text())["id"] == store.layout.identity
    finally:
        store.close()


def test_new_version_replaces_old(open_store):
    store = open_store()
    put_file(store, "x", b"old bytes", mtime_ns=1)
    put_file(store, "x", b"new bytes!!", mtime_ns=2)
    record = store.lookup(b"x")
    assert record.attr.mtime_ns == 2
    assert read_file(store, "x") == b"new bytes!!"
    assert store.complete_files == 1


def test_fraction_admission_is_stable_and_unbiased():
    admission = FractionAdmission(0.2, seed=5)
    paths = [f"train/c{i % 100}/img{i}.jpg" for i in range(50_000)]
    chosen = [p for p in paths if admission.eligible(p)]
    assert abs(len(chosen) / len(paths) - 0.2) < 0.01
    assert chosen == [p for p in paths if FractionAdmission(0.2, seed=5).eligible(p)]
    other_seed = {p for p in paths if FractionAdmission(0.2, seed=6).eligible(p)}
    assert len(other_seed & set(chosen)) < 0.3 * len(chosen)
    assert FractionAdmission(0.0).eligible("x") is False
    assert all(FractionAdmission(1.0).eligible(p) for p in paths[:100])


@pytest.mark.parametrize("text, value", [
    ("500G", 500 * 2**30), ("1.5T", int(1.5 * 2**40)), ("200MiB", 200 * 2**20),
    ("10GB", 10 * 10**9), ("4096", 4096), ("64k", 65536), (" 2 g ", 2 * 2**30), (123, 123),
])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "1.2.3G", "5X", "ten", "-1G"])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_metrics_addr_forms():
    assert parse_metrics_addr("0") is None
    assert str(parse_metrics_addr("9000")) == "127.0.0.1:9000"
    assert str(parse_metrics_addr("0.0.0.0:9477")) == "0.0.0.0:9477"
    assert str(parse_metrics_addr("[::1]:9477")) == "[::1]:9477"


def test_settings_errors_name_their_source():
    base = {"backing": "/a", "mountpoint": "/b", "cache_dir": "/c", "cache_size": "1G"}
    with pytest.raises(UsageError, match="fraction in /etc/x.toml"):
        build_settings({**base, "fraction": 2}, config_file="/etc/x.toml",
                       from_file=frozenset({"fraction"}))
    with pytest.raises(UsageError, match="--fraction"):
        build_settings({**base, "fraction": 2})
    assert build_settings({**base, "revalidate": "never"}).revalidate_seconds is None


class _RaisingTree:
    """Stands in for the core to check the adapter's errno table alone: the root is a
    directory, every other name raises."""

    def __init__(self, exc):
        self.exc = exc

    def getattr(self, relpath):
        if relpath == "":
            return attr_of(0)._replace(mode=stat.S_IFDIR | 0o755)
        raise self.exc

    def getattr_fresh(self, relpath):
        return self.getattr(relpath), 0.0


@pytest.mark.parametrize("exc, code", [
    (FileNotFoundError(errno.ENOENT, "x"), errno.ENOENT),
    (OSError(errno.ESTALE, "stale"), errno.ESTALE),
    (PermissionError(errno.EACCES, "no"), errno.EACCES),
    (RemoteUnavailable("hung"), errno.EIO),
    (RemoteChanged("changed"), errno.ESTALE),
    (ValueError("a bug"), errno.EIO),
    (KeyError("a bug"), errno.EIO),
])
def test_adapter_maps_exceptions_to_errnos(exc, code, caplog):
    """What the kernel is answered when a lookup fails, through the session's real reply
    path (into a pipe instead of /dev/fuse); only a bug is logged with its traceback."""
    session = Session(MirrorFS(_RaisingTree(exc), on_mounted=lambda c: None, metrics=Metrics()))
    read_end, session.fd = os.pipe()
    try:
        session._lookup(Request(7, protocol.ROOT_ID, 0, 0, 0), memoryview(b"x\0"))
        length, error, unique = protocol.OUT_HEADER.unpack(os.read(read_end, 4096))
    finally:
        os.close(read_end)
        os.close(session.fd)
    assert (length, -error, unique) == (16, code, 7)
    bug = isinstance(exc, (ValueError, KeyError))
    assert bool([r for r in caplog.records if r.exc_info]) == bug


class _TwoDirectories:
    """Stands in for the core: directories ``a`` and ``b``, a file ``b/f`` of 5 bytes."""

    def getattr(self, relpath):
        if relpath in ("", "a", "b"):
            return attr_of(0)._replace(mode=stat.S_IFDIR | 0o755)
        if relpath == "b/f":
            return attr_of(5)
        raise FileNotFoundError(errno.ENOENT, relpath)

    def getattr_fresh(self, relpath):
        return self.getattr(relpath), 1.0


def test_a_directory_forgotten_as_its_id_goes_to_another_leaves_no_path_under_it():
    """A FORGET of directory ``a`` on one thread, a LOOKUP on another given ``a``'s freed id
    for directory ``b``, then a LOOKUP in ``b`` by that id: it looks ``b/f`` up, not
    ``a/f`` (ENOENT for a file that exists), whenever the forgetting thread drops the id's
    path.  The interleaving is forced: the second thread runs as the slot is freed."""
    fs = MirrorFS(_TwoDirectories(), on_mounted=lambda c: None, metrics=Metrics())
    req = Request(1, protocol.ROOT_ID, 0, 0, 0)

    def nodeid_of(entry: bytes) -> int:
        return int.from_bytes(entry[:8], "little")

    a = nodeid_of(fs.lookup(req, protocol.ROOT_ID, b"a"))
    with pytest.raises(FileNotFoundError):
        fs.lookup(req, a, b"f")  # a/f: none; a's path is remembered under its id
    outcome = {}

    def look_up_in_b():
        try:
            outcome["b"] = nodeid_of(fs.lookup(req, protocol.ROOT_ID, b"b"))
            outcome["entry"] = fs.lookup(req, outcome["b"], b"f")
        except OSError as exc:
            outcome["error"] = exc

    free = fs.nodes.forget

    def forget_racing(nodeid, nlookup):
        freed = free(nodeid, nlookup)
        racer = threading.Thread(target=look_up_in_b)
        racer.start()
        racer.join(0.5)  # finished, or waiting for the forget to let go of the mirror's lock
        outcome["racer"] = racer
        return freed

    fs.nodes.forget = forget_racing
    fs.forget(a, 1)
    outcome["racer"].join(10)
    assert outcome.get("b") == a  # the freed id went to b: the race the test is about
    assert "error" not in outcome, outcome.get("error")
    attr = protocol.ATTR.unpack_from(outcome["entry"], 40)
    assert attr[1] == 5  # b/f's size


def test_random_stress_of_store_against_a_model(open_store):
    """Random puts, replacements and drops; the store always returns what the model says."""
    rng = random.Random(9)
    capacity = 40 * 2**20
    store = open_store(capacity=capacity)
    model: dict[str, bytes | None] = {}
    for step in range(400):
        name = f"f{rng.randrange(60)}"
        action = rng.random()
        if action < 0.6:
            data = rng.randbytes(rng.choice([0, 10, 5000, 300_000, CHUNK_BYTES + 7]))
            if put_file(store, name, data, mtime_ns=step + 1):
                model[name] = data
            else:  # not admitted, or only some of its chunks: the old version, or nothing
                now = read_file(store, name)
                assert now in (None, model.get(name))
                model[name] = now
            assert store.used_bytes <= capacity
        elif action < 0.8:
            store.drop(os.fsencode(name))
            model.pop(name, None)
        else:
            assert read_file(store, name) == model.get(name)
    assert store.check(fix=False, verify_data=True).problems == 0
    for name, data in model.items():
        assert read_file(store, name) == data
    # The account is what the files hold on the disk, holes left out: measured from scratch,
    # it agrees with what the store tracked.
    tracked, recounted = tracked_and_recounted(store)
    assert recounted == tracked


def test_the_cache_dirs_own_bytes_skip_a_file_renamed_while_they_are_counted(
        tmp_path, monkeypatch):
    """A file of the cache dir renamed while the scrub counts the directory's own bytes (a
    close renames clean-stop.tmp into place meanwhile) is skipped: the count goes on, and
    the thread that asked lives."""

    from cachefs.store import layout as layout_module
    from cachefs.store.layout import CacheLayout

    layout = CacheLayout(tmp_path / "cache", CHUNK_BYTES)
    layout.prepare()
    written = layout.root / "clean-stop.tmp"
    written.write_bytes(b"x" * 100_000)
    with_it = layout.fixed_bytes()
    listing = os.scandir

    def renamed_once_listed(path):
        # The rename lands between the listing of a name and the stat of its file, as
        # a close's does on another thread.
        with listing(path) as entries:
            for entry in entries:
                if entry.path == str(written):
                    os.rename(written, layout.root / "clean-stop.json")
                yield entry

    monkeypatch.setattr(layout_module.os, "scandir", renamed_once_listed)
    without_it = layout.fixed_bytes()
    monkeypatch.undo()
    assert not written.exists()
    # The renamed file is counted at most once (under its new name, when the listing
    # still met it), never twice.
    assert without_it <= with_it


def test_chunks_written_at_once_into_a_new_directory_all_land(tmp_path):
    """Writers racing to create the same fan-out directory all succeed."""

    from cachefs.store.layout import CacheLayout, data_name

    layout = CacheLayout(tmp_path / "cache", CHUNK_BYTES)
    layout.prepare()
    by_dir: dict[str, list[bytes]] = {}
    for n in range(20_000):
        key = f"k{n}".encode()
        by_dir.setdefault(data_name(key)[:2], []).append(key)
    groups = [keys[:8] for keys in by_dir.values() if len(keys) >= 8][:40]
    failures = []

    def write(key: bytes, barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            layout.write_whole(key, key, Version(len(key), 1))
        except OSError as exc:
            failures.append(exc)

    for keys in groups:
        barrier = threading.Barrier(len(keys))
        threads = [threading.Thread(target=write, args=(k, barrier)) for k in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failures == []
    for keys in groups:
        for key in keys:
            with open(layout.data_path(key), "rb") as f:
                assert f.read() == key


def _copy_of(source: str):
    """A copy function as the kernel fill uses (sendfile from an open file)."""
    def copy(out: int) -> None:
        fd = os.open(source, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            offset = 0
            while offset < size:
                offset += os.sendfile(out, fd, offset, size - offset)
        finally:
            os.close(fd)
    return copy


@pytest.mark.parametrize("size", [0, 1000, CHUNK_BYTES, 2 * CHUNK_BYTES + 5])
def test_a_fill_from_a_descriptor_is_checked_and_indexed_whole(open_store, tmp_path, size):
    data = os.urandom(size)
    (tmp_path / "remote.bin").write_bytes(data)
    store = open_store()
    key, attr = b"d/remote.bin", attr_of(size)
    assert store.fill(key, attr, _copy_of(str(tmp_path / "remote.bin")))
    assert read_file(store, "d/remote.bin") == data
    assert store.complete_files == 1
    # Verified as written: handed over without reading it again.
    fd = store.local_file(key, store.lookup(key))
    assert fd is not None and os.pread(fd, size + 1, 0) == data
    os.close(fd)
    assert store.check(fix=False, verify_data=True).problems == 0
    assert not os.listdir(tmp_path / "cache" / "tmp")
    assert files_written(tmp_path / "cache") == 1  # written in place, nothing else


def test_a_fill_that_fails_or_changes_leaves_nothing(open_store, tmp_path):
    store = open_store()
    used = store.used_bytes

    def torn(out: int) -> None:
        os.write(out, b"half of it")
        raise RemoteChanged("the file changed on the remote while being copied")

    with pytest.raises(RemoteChanged):
        store.fill(b"torn.bin", attr_of(20), torn)
    assert store.lookup(b"torn.bin") is None
    assert files_written(tmp_path / "cache") == 0
    assert store.used_bytes == used and store.admitting

    # A copy shorter than the file's size is never indexed either.
    with pytest.raises(CacheCorrupt, match="wrote 3 bytes"):
        store.fill(b"short.bin", attr_of(20), lambda out: os.write(out, b"abc"))
    assert store.lookup(b"short.bin") is None


def test_a_fill_cut_short_by_a_clean_stop_leaves_no_file_behind(open_store, tmp_path):
    """A fill writes its data file in place; the store closing meanwhile removes it, so the
    account the clean stop leaves (trusted by the next start, which scans nothing) holds
    every file on the disk."""
    data = os.urandom(50_000)
    store = open_store()
    assert store.fill(b"kept.bin", attr_of(len(data)), _bytes_copy(data))

    def closed_midway(out: int) -> None:
        os.write(out, data[:1000])
        store.close()
        os.write(out, data[1000:])

    assert not store.fill(b"cut.bin", attr_of(len(data)), closed_midway)
    again = open_store()
    assert again.startup_report.files == again.complete_files == 1
    assert files_written(tmp_path / "cache") == 1
    assert read_file(again, "kept.bin") == data and again.lookup(b"cut.bin") is None
    assert again.check(fix=False, verify_data=True).problems == 0


def test_a_fill_finds_a_file_left_at_its_name_and_replaces_it(open_store, tmp_path):
    """A file at the data file's name that no record names (left by a crash before the
    reconciliation, say): the fill writes beside it and renames its copy over it."""
    data = os.urandom(30_000)
    store = open_store()
    key, attr = b"d/left.bin", attr_of(len(data))
    stale = store.layout.data_path(data_key(key, attr.version))
    os.makedirs(os.path.dirname(stale), exist_ok=True)
    with open(stale, "wb") as f:
        f.write(b"half of an earlier copy")
    assert store.fill(key, attr, _bytes_copy(data))
    assert read_file(store, "d/left.bin") == data
    assert files_written(tmp_path / "cache") == 1
    assert store.check(fix=False, verify_data=True).problems == 0


@pytest.mark.parametrize("size", [30_000, 2 * CHUNK_BYTES + 5])
def test_no_chunk_is_written_beside_a_fill_of_the_same_file(open_store, tmp_path, size):
    """A chunk of a file that a fill is writing in place (fetched meanwhile by a reader the
    daemon serves, or by the peer server) is not stored: the fill's copy is the file's, and
    nothing else writes at its name while it is written."""
    data = os.urandom(size)
    store = open_store()

    def raced(out: int) -> None:
        os.write(out, data)
        assert not put_file(store, "d/raced.bin", data)

    assert store.fill(b"d/raced.bin", attr_of(size), raced)
    assert read_file(store, "d/raced.bin") == data
    assert store.complete_files == 1
    assert files_written(tmp_path / "cache") == 1
    assert store.check(fix=False, verify_data=True).problems == 0
    assert put_file(store, "d/other.bin", data)  # once no fill writes it, a chunk is stored


def test_chunks_of_one_file_written_at_once_are_all_stored(open_store, monkeypatch):
    """Two readers storing different chunks of one large file at the same moment: neither
    keeps the other off its data file (only a fill in place does)."""
    data = os.urandom(2 * CHUNK_BYTES + 5)
    store = open_store()
    key, attr = b"d/large.bin", attr_of(len(data))
    write_at = store.layout.write_at

    def and_another(*args):
        monkeypatch.setattr(store.layout, "write_at", write_at)
        assert store.store_chunk(key, attr, 1, data[CHUNK_BYTES:2 * CHUNK_BYTES])
        return write_at(*args)

    monkeypatch.setattr(store.layout, "write_at", and_another)
    assert store.store_chunk(key, attr, 0, data[:CHUNK_BYTES])
    assert store.store_chunk(key, attr, 2, data[2 * CHUNK_BYTES:])
    assert read_file(store, "d/large.bin") == data


def test_a_clean_stop_during_a_chunk_write_keeps_the_file_its_records_name(open_store,
                                                                             monkeypatch):
    """A clean stop during a chunk write removes only the files fills were writing in
    place: the chunks stored before it are still read after the restart."""
    data = os.urandom(2 * CHUNK_BYTES + 5)
    store = open_store()
    key, attr = b"d/large.bin", attr_of(len(data))
    assert store.store_chunk(key, attr, 0, data[:CHUNK_BYTES])
    write_at = store.layout.write_at

    def closing_first(*args):
        store.close()
        return write_at(*args)

    monkeypatch.setattr(store.layout, "write_at", closing_first)
    store.store_chunk(key, attr, 1, data[CHUNK_BYTES:2 * CHUNK_BYTES])
    again = open_store()
    record = again.lookup(key)
    assert again.read_chunk(key, record, 0) == data[:CHUNK_BYTES]


def _bytes_copy(data: bytes):
    def copy(out: int) -> None:
        os.write(out, data)
    return copy


def test_a_fill_replaces_chunks_and_older_versions(open_store, tmp_path):
    store = open_store()
    old = os.urandom(2 * CHUNK_BYTES + 1)
    assert store.store_chunk(b"shard", attr_of(len(old)), 0, old[:CHUNK_BYTES])  # partial
    new = os.urandom(3000)
    (tmp_path / "new").write_bytes(new)
    dropped = []
    store.on_dropped = lambda key, version: dropped.append(version)
    assert store.fill(b"shard", attr_of(len(new), mtime_ns=2), _copy_of(str(tmp_path / "new")))
    assert read_file(store, "shard") == new
    assert dropped == [Version(len(old), 1)]
    assert store.check(fix=False, verify_data=True).problems == 0


def test_a_fill_respects_admission_and_budget(open_store, tmp_path):
    (tmp_path / "big").write_bytes(os.urandom(3 * 2**20))
    store = open_store(capacity=2 * 2**20)
    assert not store.fill(b"big", attr_of(3 * 2**20), _copy_of(str(tmp_path / "big")))
    assert store.lookup(b"big") is None
    store.close()
    store = open_store(fraction=0.0)
    assert not store.fill(b"x", attr_of(10), lambda out: os.write(out, b"0123456789"))


def test_a_clean_stop_lets_the_next_start_trust_its_account_without_a_scan(open_store):
    store = open_store()
    for i in range(50):
        put_file(store, f"f{i}", os.urandom(5000))
    used, files = store.used_bytes, store.complete_files
    store.close()
    assert (store.layout.root / "clean-stop.json").exists()

    store = open_store()
    assert store.ready.is_set() and not store.reconciling and store.admitting
    assert store.complete_files == files
    assert abs(store.used_bytes - used) <= 64 * 1024  # the index's last commit and the marker
    assert store.check(fix=False, verify_data=True).problems == 0
    assert not (store.layout.root / "clean-stop.json").exists()  # a crash now is known
    # Untouched since it was hashed: handed over as it is; touched (its bytes rewritten, its
    # mtime put back), it no longer matches its record, is verified, and fails.
    record = store.lookup(b"f1")
    fd = store.local_file(b"f1", record)
    assert fd is not None
    os.close(fd)
    path = store.layout.data_path(data_key(b"f2", store.lookup(b"f2").version))
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"\0" * 10)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert store.local_file(b"f2", store.lookup(b"f2")) is None
    assert store.lookup(b"f2") is None  # dropped


def _marked_bytes(store, name: str, version: Version) -> bytes | None:
    """The bytes of the copy the store finds by its check mark alone (no index), if any."""
    found = store.checked_file(os.fsencode(name), version)
    if found is None:
        return None
    fd, _checked_as = found
    try:
        return os.pread(fd, version.size + 1, 0)
    finally:
        os.close(fd)


def test_a_marked_copy_is_found_without_the_index_only_while_it_is_the_one_hashed(open_store,
                                                                                  another_boot):
    """A whole file of one chunk, filled by the kernel's copy or written from the daemon's
    bytes, is found by its check mark with no index query, the bytes that were hashed.  Not
    found that way (the index answers instead): another version, a copy written since, a file
    put in its place carrying its mark, a dropped one, one of a store not trusted yet."""
    store = open_store()
    files = {f"f{i}": os.urandom(5000 + i) for i in range(6)}
    for name, data in files.items():
        if name == "f0":
            assert store.fill(b"f0", attr_of(len(data)), lambda fd, d=data: os.write(fd, d))
        else:
            assert put_file(store, name, data)
    version = {name: Version(len(data), 1) for name, data in files.items()}
    path = {name: store.layout.data_path(data_key(os.fsencode(name), version[name]))
            for name in files}
    assert [_marked_bytes(store, n, version[n]) for n in files] == list(files.values())
    assert _marked_bytes(store, "f0", Version(len(files["f0"]), 2)) is None
    assert _marked_bytes(store, "absent", Version(10, 1)) is None

    time.sleep(0.05)  # past the clock tick of the fill's own writes
    with open(path["f1"], "r+b") as f:  # written since it was hashed
        f.write(b"\0")
    assert _marked_bytes(store, "f1", version["f1"]) is None
    assert store.local_file(b"f1", store.lookup(b"f1")) is None  # the index: verified, failed
    # Other bytes put in its place, carrying its mark and its mtime: only the inode differs.
    other = path["f2"] + ".other"
    Path(other).write_bytes(os.urandom(len(files["f2"])))
    shutil.copystat(path["f2"], other)  # the mark (an extended attribute) and the times
    os.replace(other, path["f2"])
    assert _marked_bytes(store, "f2", version["f2"]) is None
    store.drop(b"f3")
    assert _marked_bytes(store, "f3", version["f3"]) is None
    store.close()

    # As a crash of the machine leaves it: nothing is trusted until it is verified.
    as_a_crash_leaves_it(store)
    another_boot()
    store = open_store()
    assert store.ready.wait(10)
    assert _marked_bytes(store, "f4", version["f4"]) is None
    fd = store.local_file(b"f4", store.lookup(b"f4"))  # verified through the index
    os.close(fd)
    assert _marked_bytes(store, "f4", version["f4"]) == files["f4"]


def test_a_crash_of_the_daemon_alone_leaves_its_records_trusted_one_of_the_machine_not(
        tmp_path, another_boot):
    """After a crash of the daemon alone (kill -9: the same boot) the next start trusts the
    records as after a clean stop, and takes a check mark alone once reconciled.  After a crash
    of the machine (another boot) nothing is trusted until verified: nor by a start after that
    store crashed too, nor after it stopped cleanly, before its scrub had been over every file;
    a copy the power cut damaged then is found out, not handed over by its mark."""
    def reopen() -> CacheStore:
        return CacheStore.open(tmp_path / "cache", 64 * 2**20, FractionAdmission(1.0),
                               scrub=False)

    def marked(store: CacheStore) -> dict[str, bytes | None]:
        return {name: _marked_bytes(store, name, Version(len(data), 1))
                for name, data in files.items()}

    store = reopen()
    files = {f"f{i}": os.urandom(3000 + i) for i in range(20)}
    for name, data in files.items():
        assert put_file(store, name, data)
    store.close()
    as_a_crash_leaves_it(store)

    store = reopen()  # the daemon alone crashed, in this boot
    try:
        assert store.scrub_figures()["trusted"]
        assert store.ready.wait(10)
        assert marked(store) == files
    finally:
        store.close()
    as_a_crash_leaves_it(store)
    another_boot()

    for start in ("after the machine's crash", "after this one's crash", "after a clean stop"):
        store = reopen()
        try:
            assert not store.scrub_figures()["trusted"], start
            assert store.ready.wait(10)
            assert set(marked(store).values()) == {None}, start
        finally:
            store.close()
        if start == "after the machine's crash":
            as_a_crash_leaves_it(store)
        if start == "after this one's crash":  # a copy the power cut left with other bytes
            path = store.layout.data_path(data_key(b"f5", Version(len(files["f5"]), 1)))
            st = os.stat(path)
            with open(path, "r+b") as f:
                f.write(b"\0" * 100)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    store = reopen()
    try:
        assert store.local_file(b"f5", store.lookup(b"f5")) is None  # verified: found out
        assert store.lookup(b"f5") is None
        fd = store.local_file(b"f6", store.lookup(b"f6"))
        try:
            assert os.pread(fd, 10_000, 0) == files["f6"]
        finally:
            os.close(fd)
    finally:
        store.close()


def test_copies_of_an_older_cachefs_are_marked_by_the_scrub(tmp_path):
    """Copies without a check mark (an older cachefs wrote them) are found through the index,
    and marked as the scrub verifies them after the next start: from then on found by the
    mark, the bytes right, each record's check the file as it is now."""
    from cachefs.store.mark import MARK_NAME

    store = CacheStore.open(tmp_path / "cache", 64 * 2**20, FractionAdmission(1.0))
    files = {f"f{i}": os.urandom(3000 + i) for i in range(30)}
    for name, data in files.items():
        assert put_file(store, name, data)
    for name, data in files.items():
        os.removexattr(store.layout.data_path(data_key(os.fsencode(name),
                                                       Version(len(data), 1))), MARK_NAME)
    store.close()

    store = CacheStore.open(tmp_path / "cache", 64 * 2**20, FractionAdmission(1.0),
                            scrub=True)
    try:
        wait_for(lambda: store._scrubber is not None and not store.scrub_figures()["running"],
                 timeout=30, what="the scrub's end")
        assert store.scrub_figures()["files"] == len(files)
        for name, data in files.items():
            assert _marked_bytes(store, name, Version(len(data), 1)) == data
            fd = store.local_file(os.fsencode(name), store.lookup(os.fsencode(name)))
            assert fd is not None
            os.close(fd)
        assert store.check(fix=False, verify_data=True).problems == 0
    finally:
        store.close()


def test_a_changed_fraction_at_a_clean_start_drops_what_it_no_longer_keeps(open_store):
    store = open_store()
    for i in range(100):
        put_file(store, f"f{i}", os.urandom(3000))
    store.close()
    store = open_store(fraction=0.5)
    assert store.ready.wait(10) and not store.reconciling
    kept = [i for i in range(100) if FractionAdmission(0.5).eligible(f"f{i}")]
    assert store.complete_files == len(kept)
    assert all((store.lookup(os.fsencode(f"f{i}")) is not None) == (i in kept)
               for i in range(100))


def test_the_key_filter_never_says_absent_of_a_key_written(tmp_path):
    from cachefs.store.presence import KeyFilter

    keys = [os.urandom(20) for _ in range(20000)]
    present = KeyFilter(len(keys))
    for key in keys:
        present.add(key)
    assert all(key in present for key in keys)
    others = [os.urandom(20) for _ in range(20000)]
    assert sum(key in present for key in others) < 0.03 * len(others)
    present.save(tmp_path / "f.bin")
    loaded = KeyFilter.load(tmp_path / "f.bin")
    assert loaded is not None and all(key in loaded for key in keys)
    (tmp_path / "f.bin").write_bytes(b"junk")
    assert KeyFilter.load(tmp_path / "f.bin") is None


def test_a_successor_waits_for_the_cache_dir_its_predecessor_still_holds(tmp_path):
    """A daemon taking a mount over starts while the one before commits its index and exits:
    it waits for the cache dir's lock, up to a bound; without that wait it is refused."""
    CacheStore.open(tmp_path / "cache", 2**20, FractionAdmission(1.0)).close()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('held', flush=True); time.sleep(1.0)\n"
         "print('releasing', flush=True); fcntl.flock(fd, fcntl.LOCK_UN); time.sleep(60)",
         str(tmp_path / "cache" / "lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match="in use by another cachefs daemon"):
            CacheStore.open(tmp_path / "cache", 2**20, FractionAdmission(1.0))
        store = CacheStore.open(tmp_path / "cache", 2**20, FractionAdmission(1.0),
                                lock_wait_seconds=30)
        # Taken after the holder let go, not before: its last line is already there.
        assert select.select([holder.stdout], [], [], 0)[0]
        assert holder.stdout.readline().strip() == "releasing"
        store.close()
    finally:
        holder.kill()
        holder.wait()
