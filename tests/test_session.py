"""The FUSE session alone (cachefs/kernel/), under a minimal file system
(tests/helpers/flatfs.py): the handshake, replies and errnos, passthrough switched on and
proven (no READ reaches the daemon), the fallback, and a mount made through fusermount by
an unprivileged user."""

from __future__ import annotations

import errno
import json
import os
import pwd
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.kernel.mountpoint import find_mount, unmount
from tests.conftest import REPO, errno_of, wait_for

pytestmark = [
    pytest.mark.fast,pytest.mark.timeout(60)]


class FlatMount:
    def __init__(self, source: Path, path: Path, *args: str, user: str | None = None) -> None:
        self.path = path
        self.as_user: list[str] = []
        if user is not None:
            entry = pwd.getpwnam(user)
            self.as_user = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}",
                            "--clear-groups"]
        command = [*self.as_user, sys.executable, "-m", "tests.helpers.flatfs", str(source),
                   str(path), *args]
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONPATH=str(REPO)))
        line = self.proc.stdout.readline()
        if line.strip() != "serving":
            self.stop()
            raise RuntimeError(f"flatfs did not mount: {line} {self.proc.stderr.read()}")

    def cat(self, name: str) -> bytes:
        """A file's bytes as read by ``cat`` run by the user who mounted (without
        allow_other, nobody else may enter the mount, root included)."""
        return subprocess.run([*self.as_user, "cat", str(self.path / name)],
                              capture_output=True, check=True).stdout

    def stats(self) -> dict:
        return json.loads(self.cat(".stats"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if find_mount(self.path) is not None:
            unmount(self.path, lazy=True)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory every user may traverse (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="cachefs-session-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


@pytest.fixture
def files(base: Path) -> dict[str, bytes]:
    source = base / "source"
    source.mkdir(mode=0o755)
    contents = {f"file{i}": os.urandom(size) for i, size in
                enumerate([0, 1, 4095, 4096, 65536, 3 * 2**20 + 7])}
    for name, data in contents.items():
        (source / name).write_bytes(data)
        (source / name).chmod(0o644)
    return contents


@pytest.fixture
def flat(base: Path) -> Iterator:
    mounts: list[FlatMount] = []

    def start(*args: str, user: str | None = None) -> FlatMount:
        path = base / f"mnt{len(mounts)}"
        path.mkdir()
        if user is not None:
            os.chown(path, pwd.getpwnam(user).pw_uid, -1)
        mounts.append(FlatMount(base / "source", path, *args, user=user))
        return mounts[-1]

    yield start
    for mount in mounts:
        mount.stop()


def _read_all_with_processes(mount: FlatMount, names) -> dict[str, bytes]:
    return {name: mount.cat(name) for name in names}


def test_passthrough_reads_never_reach_the_daemon(files, flat):
    mount = flat()
    assert mount.stats() == {"reads": 0, "passthrough": True}
    assert _read_all_with_processes(mount, files) == files
    assert sorted(os.listdir(mount.path)) == sorted(files)
    assert mount.stats()["reads"] == 0


def test_without_passthrough_the_daemon_serves_the_reads(files, flat):
    mount = flat("--no-passthrough")
    assert _read_all_with_processes(mount, files) == files
    stats = mount.stats()
    assert stats["passthrough"] is False and stats["reads"] > 0


def test_errors_reach_the_caller_as_errnos(files, flat):
    mount = flat()
    assert errno_of(lambda: (mount.path / "missing").stat()) == errno.ENOENT
    assert errno_of(lambda: open(mount.path / "file1", "r+b")) == errno.EROFS
    assert errno_of(lambda: (mount.path / "dir").mkdir()) == errno.EROFS
    assert errno_of(lambda: os.getxattr(mount.path / "file1", "user.x")) == errno.EOPNOTSUPP
    st = os.stat(mount.path / "file5")
    assert stat.S_ISREG(st.st_mode) and st.st_size == len(files["file5"])


def test_sigterm_unmounts(files, flat):
    mount = flat()
    mount.proc.terminate()
    mount.proc.wait(10)
    assert find_mount(mount.path) is None


def test_an_unprivileged_user_mounts_through_fusermount_without_passthrough(files, flat):
    # Debian's udev makes /dev/fuse 0666; a bare container may not.
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", 0o666)
    try:
        mount = flat(user="nobody")
        entry = wait_for(lambda: find_mount(mount.path), what="the user's mount")
        assert entry.fstype == "fuse.flatfs"
        # Backing files need CAP_SYS_ADMIN: the session serves the reads itself.
        assert mount.stats()["passthrough"] is False
        assert _read_all_with_processes(mount, ["file4"]) == {"file4": files["file4"]}
        mount.stop()
        deadline = time.monotonic() + 10
        while find_mount(mount.path) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert find_mount(mount.path) is None
    finally:
        os.chmod("/dev/fuse", mode)
