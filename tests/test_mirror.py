"""The mount is a faithful read-only mirror of BACKING: what `diff -r`, stat, checksums,
mmap, concurrent readers and writers see."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import random
import stat
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import make_files

pytestmark = pytest.mark.timeout(180)


def build_tree(root: Path) -> None:
    rng = random.Random(7)
    (root / "train" / "cats").mkdir(parents=True)
    (root / "train" / "dogs").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    for i in range(30):
        (root / "train" / ("cats" if i % 2 else "dogs") / f"{i:03d}.jpg").write_bytes(
            rng.randbytes(rng.randint(1, 300_000)))
    (root / "empty.bin").write_bytes(b"")
    (root / "five_mb.bin").write_bytes(rng.randbytes(5_000_000 + 17))
    (root / "naïve café – 日本語.txt").write_text("non-ASCII name\n")
    (root / os.fsdecode(b"latin1-\xe9t\xe9.txt")).write_bytes(b"a name that is not UTF-8\n")
    (root / "with space and\ttab.txt").write_text("spaces\n")
    os.symlink("train/cats/001.jpg", root / "relative_link")
    os.symlink("/etc/passwd", root / "absolute_link_out")
    os.symlink("../outside", root / "train" / "dangling_link_out")
    os.chmod(root / "train" / "dogs" / "000.jpg", 0o600)
    os.chown(root / "train" / "dogs" / "002.jpg", 1234, 5678)
    os.link(root / "train" / "cats" / "001.jpg", root / "hardlink.jpg")
    # Over 4 GiB, sparse: offsets past 2**32 must work.
    with open(root / "huge_sparse.bin", "wb") as f:
        f.seek(5 * 2**30)
        f.write(b"tail of a file larger than 4 GiB")


def all_paths(root: Path) -> list[str]:
    found = []
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)


@pytest.mark.fast
def test_listing_stat_and_bytes_match_the_remote(source, remote, mount_cachefs):
    build_tree(source)
    mnt = mount_cachefs(remote.path).path

    assert all_paths(mnt) == all_paths(source)
    for rel in all_paths(source):
        want, got = os.lstat(source / rel), os.lstat(mnt / rel)
        for field in ("st_mode", "st_size", "st_uid", "st_gid", "st_nlink", "st_mtime_ns"):
            assert getattr(got, field) == getattr(want, field), (rel, field)
        if stat.S_ISLNK(want.st_mode):
            assert os.readlink(mnt / rel) == os.readlink(source / rel)
        elif stat.S_ISREG(want.st_mode) and rel != "huge_sparse.bin":
            assert (mnt / rel).read_bytes() == (source / rel).read_bytes(), rel

    # The 5 GiB sparse file's bytes are compared where they matter in the next test.
    diff = subprocess.run(["diff", "-r", "--no-dereference", "--exclude=huge_sparse.bin",
                           str(source), str(mnt)],
                          capture_output=True, text=True)
    assert diff.returncode == 0, diff.stdout + diff.stderr


def test_offsets_past_4_gib_and_empty_files(source, remote, mount_cachefs):
    build_tree(source)
    mnt = mount_cachefs(remote.path).path
    with open(mnt / "huge_sparse.bin", "rb") as f:
        f.seek(5 * 2**30)
        assert f.read() == b"tail of a file larger than 4 GiB"
        f.seek(3 * 2**30)
        assert f.read(4096) == bytes(4096)
    assert (mnt / "empty.bin").read_bytes() == b""


def test_mmap_reads_the_remote_bytes(source, remote, mount_cachefs):
    build_tree(source)
    mnt = mount_cachefs(remote.path).path
    want = (source / "five_mb.bin").read_bytes()
    with open(mnt / "five_mb.bin", "rb") as f, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m[:] == want
        assert m[4_999_000:5_000_010] == want[4_999_000:5_000_010]


@pytest.mark.parametrize("fraction", [1.0, 0.0], ids=["cached", "uncached"])
def test_random_reads_inside_a_large_file(source, remote, mount_cachefs, fraction):
    rng = random.Random(3)
    size = 21 * 2**20 + 12345  # six chunks, the last one partial
    want = rng.randbytes(size)
    (source / "shard.tar").write_bytes(want)
    mnt = mount_cachefs(remote.path, fraction=fraction).path
    with open(mnt / "shard.tar", "rb", buffering=0) as f:
        for _ in range(400):
            offset = rng.randrange(size)
            length = rng.choice([1, 512, 4096, 65536, 300_000, 5 * 2**20])
            assert os.pread(f.fileno(), length, offset) == want[offset : offset + length]
    # And once more whole, in one sequential pass.
    assert (mnt / "shard.tar").read_bytes() == want


def _checksums(paths: list[str]) -> dict[str, str]:
    return {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


def test_many_concurrent_reader_processes(source, remote, mount_cachefs):
    rels = make_files(source, 400, size=(1, 200_000))
    (source / "big.bin").write_bytes(random.Random(1).randbytes(9 * 2**20))
    rels.append("big.bin")
    mnt = mount_cachefs(remote.path, fraction=0.5).path
    want = {str(mnt / r): hashlib.sha256((source / r).read_bytes()).hexdigest() for r in rels}
    work = list(want)
    random.Random(2).shuffle(work)
    slices = [work[i::16] + ["" + str(mnt / "big.bin")] for i in range(16)]
    with ProcessPoolExecutor(16) as pool:
        for result in pool.map(_checksums, slices):
            for path, digest in result.items():
                assert digest == want[path], path


@pytest.mark.parametrize("operation", [
    "open_write", "create", "mkdir", "unlink", "rmdir", "rename", "chmod", "chown", "symlink",
    "link", "truncate", "utime",
])
@pytest.mark.fast
def test_every_mutation_fails_with_erofs(source, remote, mount_cachefs, operation):
    build_tree(source)
    mnt = mount_cachefs(remote.path).path
    target = mnt / "train" / "cats" / "001.jpg"
    actions = {
        "open_write": lambda: open(target, "r+b"),
        "create": lambda: open(mnt / "new.txt", "wb"),
        "mkdir": lambda: os.mkdir(mnt / "newdir"),
        "unlink": lambda: os.unlink(target),
        "rmdir": lambda: os.rmdir(mnt / "empty_dir"),
        "rename": lambda: os.rename(target, mnt / "moved.jpg"),
        "chmod": lambda: os.chmod(target, 0o777),
        "chown": lambda: os.chown(target, 1, 1),
        "symlink": lambda: os.symlink("x", mnt / "newlink"),
        "link": lambda: os.link(target, mnt / "newhard"),
        "truncate": lambda: os.truncate(target, 0),
        "utime": lambda: os.utime(target, (1, 1)),
    }
    with pytest.raises(OSError) as info:
        actions[operation]()
    assert info.value.errno == errno.EROFS
    assert (source / "train" / "cats" / "001.jpg").exists()


def test_missing_names_are_enoent(source, remote, mount_cachefs):
    build_tree(source)
    mnt = mount_cachefs(remote.path).path
    with pytest.raises(FileNotFoundError):
        os.stat(mnt / "no-such-file")
    with pytest.raises(FileNotFoundError):
        open(mnt / "train" / "nope.jpg", "rb")
    with pytest.raises(NotADirectoryError):
        os.listdir(mnt / "five_mb.bin")


def test_python_reader_in_subprocess_sees_same_bytes(source, remote, mount_cachefs):
    """A separate interpreter, as a DataLoader worker is, reads through the mount."""
    rels = make_files(source, 50, size=(100, 50_000))
    mnt = mount_cachefs(remote.path).path
    code = ("import hashlib,sys;"
            "print(hashlib.sha256(b''.join(open(p,'rb').read() for p in sys.argv[1:]))"
            ".hexdigest())")
    out = subprocess.run([sys.executable, "-c", code, *[str(mnt / r) for r in rels]],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == hashlib.sha256(b"".join((source / r).read_bytes() for r in rels)).hexdigest()
