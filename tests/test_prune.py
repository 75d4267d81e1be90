"""Copies of files gone from the remote are dropped once the cache is full, and only while
the remote is the dataset it was."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from cachefs.attr import Attr
from cachefs.remote import prune
from cachefs.remote.remote import Remote
from cachefs.store.admission import FractionAdmission
from cachefs.store.store import CacheStore
from tests.conftest import make_files, shuffled_read_all, wait_for

pytestmark = pytest.mark.timeout(180)


def _stored(store: CacheStore, root, rels: list[str]) -> None:
    for rel in rels:
        data = (root / rel).read_bytes()
        st = os.lstat(root / rel)
        attr = Attr(stat.S_IFREG | 0o644, len(data), 0, 0, 1, st.st_mtime_ns, st.st_mtime_ns,
                    st.st_mtime_ns)
        assert store.store_chunk(os.fsencode(rel), attr, 0, data)


def _cached(store: CacheStore, rels: list[str]) -> list[str]:
    return [rel for rel in rels if store.lookup(os.fsencode(rel)) is not None]


def test_a_pass_drops_copies_of_files_gone_and_none_when_the_remote_is_another(
        tmp_path, caplog):
    dataset, elsewhere, empty = tmp_path / "dataset", tmp_path / "elsewhere", tmp_path / "empty"
    rels = make_files(dataset, 6, size=1000)
    make_files(elsewhere, 2, size=10, seed=1)
    empty.mkdir()
    root = tmp_path / "remote"  # where the NFS share is mounted
    root.symlink_to(dataset)
    remote = Remote(str(root), timeout_seconds=10)
    store = CacheStore.open(tmp_path / "cache", 64 * 2**20, FractionAdmission(1.0))
    pruned: list[int] = []
    pruner = prune.Pruner(remote, store, on_pruned=pruned.append)
    try:
        _stored(store, dataset, rels)
        # Removed, and replaced by a directory of that name: no file to open at either.
        (dataset / rels[0]).unlink()
        (dataset / rels[1]).unlink()
        (dataset / rels[1]).mkdir()
        pruner.no_room()
        wait_for(lambda: pruner.passes == 1, what="a pass")
        assert _cached(store, rels) == rels[2:]
        assert pruned == [2]
        # The share unmounted (an empty directory in its place), or another mounted there:
        # every file would look gone, and nothing is dropped.
        (dataset / rels[2]).unlink()
        for other in (empty, elsewhere):
            root.unlink()
            root.symlink_to(other)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger=prune.__name__):
                pruner._last_pass_ended = None  # (no wait for the interval)
                pruner.no_room()
                wait_for(lambda: "not looking for cached files" in caplog.text,
                         what="the pass refused")
            assert _cached(store, rels) == rels[2:]
        root.unlink()
        root.symlink_to(dataset)
        pruner._last_pass_ended = None
        pruner.no_room()
        wait_for(lambda: pruner.passes == 2, what="a second pass")
        assert _cached(store, rels) == rels[3:]
    finally:
        pruner.close()
        store.close()
        remote.close()


def test_a_full_cache_makes_room_from_the_files_a_dataset_update_removed(
        source, remote, mount_cachefs):
    """The dataset is updated in place while the node is down: the old files removed, new
    ones beside them.  The cache, full of the old files, lets the new ones in."""
    old = make_files(source, 80, size=50_000)
    mount = mount_cachefs(remote.path, cache_size=4 * 2**20, fraction=1.0)
    want = {rel: (source / rel).read_bytes() for rel in old}
    assert shuffled_read_all(mount.path, old, seed=1) == want
    mount.settle()
    kept = mount.metric("cachefs_cache_files")
    assert 10 <= kept < len(old)
    mount.stop()
    for rel in old:
        (source / rel).unlink()
    new = make_files(source / "v2", 20, size=50_000, seed=2)
    new = [f"v2/{rel}" for rel in new]
    want = {rel: (source / rel).read_bytes() for rel in new}
    mount.start()
    assert shuffled_read_all(mount.path, new, seed=2) == want
    wait_for(lambda: mount.metric("cachefs_cache_pruned_files_total") == kept, timeout=30,
             what="the old files' copies dropped")
    # Read again: the files missed while the pass ran come in now.
    assert shuffled_read_all(mount.path, new, seed=3) == want
    mount.settle()
    assert mount.metric("cachefs_cache_files") == len(new)
    assert shuffled_read_all(mount.path, new, seed=4) == want
    assert mount.metric("cachefs_file_opens_total", result="hit") >= len(new)
