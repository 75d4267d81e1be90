"""Fixtures that build real mounts: an emulated NFS remote and cachefs in front of it.

Every mount made here is unmounted in teardown, even when the test failed or
the daemon hung (``fusermount -uz``, then SIGKILL), and a failing test gets the
daemon's log appended to its report.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachefs.kernel import protocol as p
from cachefs.kernel.mountpoint import find_mount, unmount
from cachefs.service.process import wait_gone

REPO = Path(__file__).resolve().parent.parent
# The mounts the running test made, by mount point (see shuffled_read_all).
_MOUNTED: dict[Path, CachefsMount] = {}


def run_cachefs(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    """The cachefs CLI as a user runs it, in a child process."""
    return subprocess.run([sys.executable, "-m", "cachefs", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, **kwargs)


def registered_backing_ids(supervisor: int, highest: int) -> int:
    """How many backing ids the kernel holds for the mount of ``supervisor``: each id up to
    ``highest`` that FUSE_DEV_IOC_BACKING_CLOSE accepts (and so closes: call at the end)."""
    fuse_fd = next(int(name) for name in os.listdir(f"/proc/{supervisor}/fd")
                   if os.readlink(f"/proc/{supervisor}/fd/{name}") == "/dev/fuse")
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(supervisor)
    try:
        fd = libc.syscall(438, pidfd, fuse_fd, 0)  # pidfd_getfd
        assert fd >= 0, os.strerror(ctypes.get_errno())
    finally:
        os.close(pidfd)
    count = 0
    try:
        for backing_id in range(1, highest + 1):
            try:
                fcntl.ioctl(fd, p.DEV_IOC_BACKING_CLOSE,
                            bytearray(backing_id.to_bytes(4, "little")), True)
                count += 1
            except OSError as exc:
                assert exc.errno == errno.ENOENT, exc
    finally:
        os.close(fd)
    return count


class CachefsMount:
    """A cachefs daemon serving ``backing`` at ``path``, started through the real CLI."""

    def __init__(self, backing: Path, path: Path, cache_dir: Path, log_file: Path,
                 options: dict[str, object]) -> None:
        self.backing = backing
        self.path = path
        self.cache_dir = cache_dir
        self.log_file = log_file
        self.options = options
        self.pid: int | None = None  # the serving process
        self.supervisor_pid: int | None = None  # the parent holding the connection
        self.metrics_url: str | None = None

    def command(self) -> list[str]:
        args = ["mount", str(self.backing), str(self.path), "--cache-dir", str(self.cache_dir),
                "--log-file", str(self.log_file)]
        for key, value in self.options.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                args.append(flag)
            elif value is not None and value is not False:
                args += [flag, str(value)]
        return args

    def start(self) -> CachefsMount:
        self.path.mkdir(parents=True, exist_ok=True)
        result = run_cachefs(*self.command())
        if result.returncode != 0:
            raise RuntimeError(f"cachefs mount failed: {result.stderr.strip()}\n{self.log_tail()}")
        status = self.status()
        self.pid = status["pid"]
        self.supervisor_pid = status.get("supervisor_pid")
        self.metrics_url = status["metrics_url"]
        return self

    def refresh(self) -> dict:
        """The status, with the serving process and metrics address it now names (a new one
        after a restart)."""
        status = self.status()
        self.pid = status["pid"]
        self.metrics_url = status["metrics_url"]
        return status

    def status(self) -> dict:
        result = run_cachefs("status", "--json", str(self.path))
        if result.returncode != 0:
            raise RuntimeError(f"cachefs status failed: {result.stderr.strip()}")
        return json.loads(result.stdout)

    def settle(self, timeout: float = 30) -> None:
        """Wait until no file is being copied into the cache in the background (with the
        kernel reading the remote, a miss is filled beside its reader, not before it)."""
        wait_for(lambda: self.status()["fills"]["under_way"] == 0, timeout=timeout,
                 what="fills done")

    @property
    def hands_over_remote(self) -> bool:
        """Whether the kernel reads the remote's own file for a miss (--passthrough auto
        where the kernel offers passthrough): the reader then sees what the NFS mount
        shows, as a reader of the remote itself would."""
        return self.status()["remote_handed_over"]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of the /metrics endpoint: {(name, sorted label items): value}."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def stop(self) -> None:
        """Unmount and wait for the daemon; escalate until nothing is left mounted."""
        if find_mount(self.path) is not None:
            result = run_cachefs("unmount", str(self.path), timeout=60)
            if result.returncode != 0 and find_mount(self.path) is not None:
                unmount(self.path, lazy=True)
        self._reap()

    def kill(self) -> None:
        """SIGKILL the daemon, supervisor and serving process, leaving a stale mount behind,
        as a crash of the whole service would."""
        for pid in (self.supervisor_pid, self.pid):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._reap()

    def _reap(self) -> None:
        if self.pid and not wait_gone(self.pid, 15):
            # The supervisor first: it would start a new serving process in place of a
            # killed one.
            for pid in filter(None, (self.supervisor_pid, self.pid)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.supervisor_pid and not wait_gone(self.supervisor_pid, 15):
            try:
                os.kill(self.supervisor_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.pid = self.supervisor_pid = None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return "(no daemon log)"
        return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(autouse=True)
def warm_checkpoints(tmp_path: Path, monkeypatch) -> Path:
    """Where ``cachefs warm`` keeps its checkpoints in a test (and its children): the
    test's own directory, never the host's state directory."""
    path = tmp_path / "state"
    monkeypatch.setenv("CACHEFS_STATE_DIR", str(path))
    return path


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """The directory the emulated remote serves (tests write the dataset here)."""
    path = tmp_path / "source"
    path.mkdir()
    return path


@pytest.fixture
def remote(tmp_path: Path, source: Path) -> Iterator:
    """An NFS-like remote over ``source``, without added latency unless a test sets it."""
    from bench.emulator.remote import EmulatedRemote

    (tmp_path / "remote").mkdir()
    emulator = EmulatedRemote(source, tmp_path / "remote", profile="local",
                              log_file=tmp_path / "slowfs.log")
    try:
        yield emulator.start()
    finally:
        emulator.stop()


@pytest.fixture
def mount_cachefs(tmp_path: Path, request) -> Iterator:
    """Factory: ``mount_cachefs(backing, **options)`` -> a serving CachefsMount."""
    mounts: list[CachefsMount] = []

    def factory(backing: Path, *, name: str = "mnt", cache_dir: Path | None = None,
                **options) -> CachefsMount:
        options.setdefault("cache_size", "1G")
        options.setdefault("metrics_addr", "127.0.0.1:0")
        # CI runs the mount tests a second time with the kernel's passthrough off, so that
        # the data path without it (older kernels, no CAP_SYS_ADMIN) is tested as well.
        if os.environ.get("CACHEFS_TEST_PASSTHROUGH"):
            options.setdefault("passthrough", os.environ["CACHEFS_TEST_PASSTHROUGH"])
        mount = CachefsMount(backing, tmp_path / name, cache_dir or tmp_path / "cache",
                             tmp_path / f"{name}.log", options)
        mounts.append(mount)
        _MOUNTED[mount.path] = mount
        return mount.start()

    yield factory
    for mount in mounts:
        _MOUNTED.pop(mount.path, None)
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for mount in mounts:
        if failed:
            sys.stderr.write(f"\n--- cachefs log of {mount.path} ---\n{mount.log_tail()}\n")
        mount.stop()


def pytest_collection_modifyitems(config, items):
    """A test marked neither fast nor soak is in the full tier (`pytest -m full`)."""
    for item in items:
        if item.get_closest_marker("fast") is None and item.get_closest_marker("soak") is None:
            item.add_marker(pytest.mark.full)


def pytest_assertrepr_compare(config, op, left, right):
    """Two unequal byte strings described by where they part, not by pytest's diff of their
    reprs: for a file of megabytes that diff runs for minutes, past the test's timeout."""
    if op != "==" or not isinstance(left, bytes) or not isinstance(right, bytes):
        return None
    if len(left) + len(right) < 4096:
        return None
    at = next((i for i, (a, b) in enumerate(zip(left, right, strict=False)) if a != b),
              min(len(left), len(right)))
    differing = sum(a != b for a, b in zip(left, right, strict=False))
    return [f"{len(left)} bytes == {len(right)} bytes",
            f"first difference at offset {at} (page {at // 4096}); "
            f"{differing} of the common {min(len(left), len(right))} bytes differ",
            f"left  [{at}:{at + 16}]: {left[at:at + 16].hex()}",
            f"right [{at}:{at + 16}]: {right[at:at + 16].hex()}"]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, "rep_" + report.when, report)
    return report


def shuffled_read_all(root: Path, paths: list[str], seed: int, *,
                      drop_pages: bool = False) -> dict[str, bytes]:
    """Read every file once in a shuffled order, as an epoch of training does.  When ``root``
    is a cachefs mount of this test, then wait for the fills the pass started: where the
    kernel reads the remote, a kept file is copied into the cache beside its reader, and the
    next pass is to find the cache as an epoch later would.

    ``drop_pages`` drops each file's pages from the kernel's cache after reading it, as memory
    pressure would, so that the next read of an unchanged file reaches the daemon again.
    """
    import random

    order = list(paths)
    random.Random(seed).shuffle(order)
    contents = {}
    for rel in order:
        with open(root / rel, "rb") as f:
            contents[rel] = f.read()
            if drop_pages:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    mount = _MOUNTED.get(Path(root))
    if mount is not None and mount.pid is not None:
        mount.settle()
    return contents


def make_files(root: Path, count: int, size: int | tuple[int, int] = 4096, *,
               seed: int = 0, per_dir: int = 200) -> list[str]:
    """``count`` files of random bytes in class-like subdirectories; returns relative paths."""
    import random

    rng = random.Random(seed)
    paths = []
    for i in range(count):
        rel = f"class{i // per_dir:04d}/img{i:06d}.bin"
        length = size if isinstance(size, int) else rng.randint(*size)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rng.randbytes(length))
        paths.append(rel)
    return paths


def disk_usage(path: Path) -> int:
    """Bytes under ``path`` as du counts them: allocated blocks of files and directories."""
    total = os.lstat(path).st_blocks * 512
    for directory, dirs, files in os.walk(path):
        for name in dirs + files:
            total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


def files_written(cache_dir: Path) -> int:
    """The files of a cache dir's tmp/ and data/: its cached files' data files (one each, for
    files of one chunk), and the copies of fills under way (a fill writes a file's data file
    in place, a fill process under tmp/)."""
    return sum(len(files) for directory in ("tmp", "data")
               for _, _, files in os.walk(cache_dir / directory))


def fill_under_way(mount) -> bool:
    """Whether a fill is writing a copy: more files written than the cache holds."""
    return files_written(mount.cache_dir) > mount.status()["cache_files"]


# -- helpers for fault, security and load tests ----------------------------------------------

def wait_for(predicate, timeout: float = 15.0, interval: float = 0.1, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g} s (last: {value!r})")
        time.sleep(interval)


def errno_of(action) -> int | None:
    """The errno ``action()`` fails with, or None when it succeeds."""
    try:
        action()
    except OSError as exc:
        return exc.errno
    return None


def process_figures(pid: int) -> dict[str, int]:
    """Open descriptors, threads, current and peak resident memory (bytes) of a process."""
    figures = {"fds": len(os.listdir(f"/proc/{pid}/fd")),
               "threads": len(os.listdir(f"/proc/{pid}/task"))}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                figures[key] = int(value.split()[0]) * 1024
    return figures


def closed_by_server(connection) -> bool:
    """Whether the other end of a connected socket has closed it (without reading from it)."""
    connection.setblocking(False)
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def control_socket_path(mountpoint: Path) -> str:
    """Where the hidden ``.cachefs.sock`` entry of a mount leads."""
    return os.readlink(mountpoint / ".cachefs.sock")


@pytest.fixture
def scratch_fs(tmp_path: Path) -> Iterator:
    """Factory of small file systems for the cache dir: ``scratch_fs("tmpfs", size_bytes)`` or
    ``scratch_fs("ext4", size_bytes)`` (a loop-mounted image, errors=remount-ro).  Returns the
    mount point; everything is unmounted in teardown, lazily when still busy."""
    mounted: list[Path] = []

    def factory(kind: str, size_bytes: int) -> Path:
        path = tmp_path / f"{kind}-{len(mounted)}"
        path.mkdir()
        if kind == "tmpfs":
            command = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs",
                       str(path)]
        else:
            image = tmp_path / f"{kind}-{len(mounted)}.img"
            with open(image, "wb") as f:
                f.truncate(size_bytes)
            subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True,
                           capture_output=True)
            command = ["mount", "-o", "loop,errors=remount-ro", str(image), str(path)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        mounted.append(path)
        return path

    yield factory
    for path in reversed(mounted):
        if find_mount(path) is None:
            continue
        result = subprocess.run(["umount", str(path)], capture_output=True)
        if result.returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def ext4_device_name(mountpoint: Path) -> str:
    """The block device name (``loop3``) of an ext4 mount, as /sys/fs/ext4 lists it."""
    entry = find_mount(mountpoint)
    assert entry is not None and entry.fstype == "ext4", entry
    return os.path.basename(os.path.realpath(entry.source))


def turn_read_only(mountpoint: Path) -> None:
    """Make an ext4 scratch file system read-only under its writers, as a disk error does
    with errors=remount-ro (a plain remount refuses while files are open for writing)."""
    import errno

    device = ext4_device_name(mountpoint)
    Path(f"/sys/fs/ext4/{device}/trigger_fs_error").write_text("1")
    wait_for(lambda: errno_of(lambda: os.mkdir(mountpoint / "probe")) == errno.EROFS,
             timeout=10, what="read-only file system")


def read_bounded(path: Path, timeout: float = 20.0) -> bytes | OSError:
    """Read a file from a helper thread; fail the test if it has not returned within ``timeout``
    (a read stuck on a hung remote must not hang the test run)."""
    result: list = []

    def run() -> None:
        try:
            result.append(path.read_bytes())
        except OSError as exc:
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert result, f"reading {path} did not return within {timeout:g} s"
    return result[0]
