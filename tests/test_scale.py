"""What keeps the daemon's memory flat as the dataset grows, and the kernel's share of a
listing: bounded caches still give the right bytes, and listings the kernel caches or takes
with attributes are the remote's, changes included."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

FILES_PER_DIRECTORY = 500


def make_tree(root: Path, directories: int, seed: int = 3) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {}
    for d in range(directories):
        (root / f"d{d:02d}").mkdir()
        for i in range(FILES_PER_DIRECTORY):
            rel = f"d{d:02d}/{i:04d}-{'n' * (i % 40)}.bin"
            data = rng.randbytes(rng.randint(0, 3000))
            (root / rel).write_bytes(data)
            files[rel] = data
    return files


def drop_dentries() -> None:
    """The kernel forgets the mount's nodes (FORGET reaches the daemon for each)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("2")


def test_a_tree_larger_than_every_bound_is_read_twice_with_the_right_bytes(
        source, remote, mount_cachefs):
    files = make_tree(source, directories=6)  # 3,000 files
    mount = mount_cachefs(remote.path, attr_cache_entries=1000, held_files=64, fraction=0.5)
    names = sorted(files)
    for epoch in range(2):
        random.Random(epoch).shuffle(names)
        for rel in names:
            assert (mount.path / rel).read_bytes() == files[rel], (epoch, rel)
        mount.settle()
        drop_dentries()  # the second epoch looks every name up again
    memory = mount.status()["memory"]
    assert 0 < memory["attr_cache_entries"] <= 1000
    assert memory["attr_cache_capacity_entries"] == 1000
    if mount.status()["data_path"].startswith("kernel passthrough"):
        assert 0 < memory["held_files"] <= memory["held_files_max"] == 64
    assert mount.metric("cachefs_attr_cache_capacity_entries") == 1000
    # The kernel forgot its nodes: the table holds what it still references, not every file.
    assert mount.metric("cachefs_nodes") < len(files) / 2


def listing(root: Path) -> list[tuple[str, int, int, int]]:
    """(path, mode, size, mtime) of everything under ``root``, as ``ls -lR`` sees it."""
    found = []
    for directory, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            found.append((os.path.relpath(path, root), st.st_mode, st.st_size,
                          st.st_mtime_ns))
    return sorted(found)


def ls_lR(root: Path) -> list[str]:
    """What ``ls -lRn`` prints of ``root``, but for the block counts ("total" lines): a
    mount's are its own."""
    ls = subprocess.run(["ls", "-lRn", "--time-style=+%s"], cwd=root, capture_output=True,
                        text=True, check=True)
    return [line for line in ls.stdout.splitlines() if not line.startswith("total ")]


def test_listings_with_attributes_are_the_remotes_and_follow_its_changes(
        source, remote, mount_cachefs):
    make_tree(source, directories=3)
    os.symlink("d00/0001-n.bin", source / "link")
    mount = mount_cachefs(remote.path, revalidate=1)
    want = listing(source)
    assert listing(mount.path) == want  # names and attributes in one pass (READDIRPLUS)
    assert listing(mount.path) == want  # the kernel's cached listings
    assert ls_lR(mount.path) == ls_lR(source)

    # A directory's listing changes on the remote: seen after the interval, not before it
    # ends and never a mix of the two listings.
    (source / "d01" / "0007-nnnnnnn.bin").unlink()
    (source / "d01" / "new.bin").write_bytes(b"new")
    time.sleep(2.2)
    after = listing(mount.path)
    assert after == listing(source)
    new = next(row for row in after if row[0] == "d01/new.bin")
    assert new[1:3] == (stat.S_IFREG | 0o644, 3)
    assert (mount.path / "d01" / "new.bin").read_bytes() == b"new"


def test_ls_lR_repeated_after_the_interval_takes_the_attributes_with_the_listings(
        source, remote, mount_cachefs):
    """`ls -lR` again once the interval has passed: the names are due, and read from the
    kernel's cached listings each would be looked up on its own (a request per file); the
    directories are listed again instead, the attributes coming with the names, a page of
    them per request.  A file changed meanwhile shows its new size."""
    make_tree(source, directories=2)  # 1,000 files, several pages of a listing each
    mount = mount_cachefs(remote.path, revalidate=1)
    assert ls_lR(mount.path) == ls_lR(source)
    (source / "d01" / "0003-nnn.bin").write_bytes(b"grown" * 1000)
    time.sleep(1.5)  # every name is due
    before = mount.metric("cachefs_lookups_total")
    again = ls_lR(mount.path)
    assert again == ls_lR(source)
    assert any(" 5000 " in line and line.endswith(" 0003-nnn.bin") for line in again)
    # Read from the cached listings: a LOOKUP per name (1,000).
    assert mount.metric("cachefs_lookups_total") - before < 50
