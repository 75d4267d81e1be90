"""Tests of the slow NFS-like remote emulator (bench.emulator.slowfs, bench.emulator.remote) on
real FUSE mounts.

They check what a user of the mount sees: the same bytes and metadata as SOURCE, a read-only
file system, changes in SOURCE visible at once, ESTALE on files replaced under an open fd,
injected faults, and latency and bandwidth that are really paid.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.emulator import remote_cost, slowfs
from bench.emulator.remote import EmulatedRemote
from cachefs.kernel.protocol import ROOT_ID
from cachefs.kernel.session import Connection, Request

NON_UTF8 = b"raw-\xff.bin"

pytestmark = pytest.mark.fast


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "source"
    (src / "sub").mkdir(parents=True)
    (src / "empty").write_bytes(b"")
    (src / "a.txt").write_bytes(b"hello remote\n")
    (src / "sub" / "random.bin").write_bytes(os.urandom(5_000_000))
    (src / "données-é.txt").write_bytes(b"non-ASCII name\n")
    with open(os.path.join(os.fsencode(src), NON_UTF8), "wb") as f:
        f.write(b"non-UTF-8 name\n")
    os.symlink("sub/random.bin", src / "link")
    os.symlink("/nowhere/at/all", src / "dangling")
    return src


@pytest.fixture
def start_remote(tmp_path: Path, source: Path):
    """Start an EmulatedRemote of `source` (profile "local" unless told); stop all at teardown."""
    remotes: list[EmulatedRemote] = []

    def start(**options) -> EmulatedRemote:
        mountpoint = tmp_path / f"mnt{len(remotes)}"
        mountpoint.mkdir()
        options.setdefault("profile", "local")
        remote = EmulatedRemote(source, mountpoint, log_file=tmp_path / "slowfs.log", **options)
        remotes.append(remote)
        return remote.start()

    yield start
    for remote in remotes:
        remote.stop()
    assert not any(slowfs.is_mounted(r.path) for r in remotes)


def read(path: Path | bytes) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def errno_of(fn, *args) -> int | None:
    try:
        fn(*args)
    except OSError as e:
        return e.errno
    return None


@pytest.mark.timeout(60)
def test_mount_shows_source_exactly(source: Path, start_remote) -> None:
    remote = start_remote(profile="efs")
    src, mnt = os.fsencode(source), os.fsencode(remote.path)
    assert sorted(os.listdir(mnt)) == sorted(os.listdir(src))
    for rel in [b"empty", b"a.txt", b"sub/random.bin", "données-é.txt".encode(), NON_UTF8]:
        assert read(os.path.join(mnt, rel)) == read(os.path.join(src, rel)), rel
        theirs, ours = os.lstat(os.path.join(src, rel)), os.lstat(os.path.join(mnt, rel))
        for field in ("st_size", "st_mode", "st_uid", "st_gid", "st_nlink", "st_ino",
                      "st_mtime_ns", "st_ctime_ns"):
            assert getattr(ours, field) == getattr(theirs, field), (rel, field)
    for link in ("link", "dangling"):  # shown as symlinks, never followed by the daemon
        assert (remote.path / link).is_symlink()
        assert os.readlink(remote.path / link) == os.readlink(source / link)
    assert read(remote.path / "link") == read(source / "sub" / "random.bin")
    assert os.statvfs(remote.path).f_blocks == os.statvfs(source).f_blocks


@pytest.mark.timeout(60)
def test_attribute_cache_as_nfs(source: Path, start_remote) -> None:
    """The efs profile keeps attributes for actimeo, and a listing brings them (READDIRPLUS):
    an lstat of each name listed costs no round trip; once actimeo passes, each costs one."""
    names = [f"n{i:02}" for i in range(40)]
    (source / "many").mkdir()
    for name in names:
        (source / "many" / name).write_bytes(name.encode())
    remote = start_remote(profile="efs", actimeo_s=1.0)
    listed = remote.path / "many"

    def getattrs(action) -> int:
        before = remote.stats()["ops"].get("getattr", 0)
        action()
        return remote.stats()["ops"].get("getattr", 0) - before

    def lstat_all() -> None:
        for name in names:
            assert os.lstat(listed / name).st_size == len(name)

    def list_and_lstat() -> None:
        with os.scandir(listed) as it:
            assert sorted(e.name for e in it if e.stat(follow_symlinks=False).st_size) == names

    assert getattrs(list_and_lstat) <= 1  # the directory's own lookup at most
    assert getattrs(lstat_all) == 0
    time.sleep(1.2)
    assert getattrs(lstat_all) >= len(names)
    assert read(listed / "n07") == b"n07"


@pytest.mark.timeout(60)
def test_sparse_file_over_4gib(source: Path, start_remote) -> None:
    offset = 4_500_000_000
    with open(source / "huge.bin", "wb") as f:
        f.truncate(5 << 30)
        f.seek(offset)
        f.write(b"beyond 4 GiB")
    remote = start_remote()
    assert (remote.path / "huge.bin").stat().st_size == 5 << 30
    fd = os.open(remote.path / "huge.bin", os.O_RDONLY)
    try:
        assert os.pread(fd, 12, offset) == b"beyond 4 GiB"
        assert os.pread(fd, 4, (5 << 30) - 4) == b"\0" * 4
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_mount_is_read_only(source: Path, start_remote) -> None:
    remote = start_remote()
    mnt = remote.path
    attempts = {
        "create": lambda: os.open(mnt / "new.txt", os.O_WRONLY | os.O_CREAT),
        "write": lambda: os.open(mnt / "a.txt", os.O_RDWR),
        "append": lambda: os.open(mnt / "a.txt", os.O_WRONLY | os.O_APPEND),
        "mkdir": lambda: os.mkdir(mnt / "newdir"),
        "unlink": lambda: os.unlink(mnt / "a.txt"),
        "rename": lambda: os.rename(mnt / "a.txt", mnt / "b.txt"),
        "symlink": lambda: os.symlink("a.txt", mnt / "newlink"),
        "chmod": lambda: os.chmod(mnt / "a.txt", 0o600),
        "truncate": lambda: os.truncate(mnt / "a.txt", 0),
        "utime": lambda: os.utime(mnt / "a.txt", (0, 0)),
    }
    for name, attempt in attempts.items():
        assert errno_of(attempt) == errno.EROFS, name
    assert read(source / "a.txt") == b"hello remote\n"
    assert sorted(os.listdir(mnt)) == sorted(os.listdir(source))


@pytest.mark.timeout(60)
def test_changes_in_source_show_at_once(source: Path, start_remote) -> None:
    remote = start_remote()
    mnt = remote.path
    assert read(mnt / "a.txt") == b"hello remote\n"
    (source / "a.txt").write_bytes(b"rewritten, and longer than before\n")
    assert read(mnt / "a.txt") == b"rewritten, and longer than before\n"
    assert (mnt / "a.txt").stat().st_size == 34
    (source / "added.txt").write_bytes(b"new")
    assert "added.txt" in os.listdir(mnt)
    assert read(mnt / "added.txt") == b"new"
    (source / "added.txt").unlink()
    assert errno_of(os.stat, mnt / "added.txt") == errno.ENOENT
    assert "added.txt" not in os.listdir(mnt)


@pytest.mark.timeout(60)
def test_open_file_goes_stale_when_removed_or_replaced(source: Path, start_remote) -> None:
    remote = start_remote()
    removed = os.open(remote.path / "a.txt", os.O_RDONLY)
    replaced = os.open(remote.path / "sub" / "random.bin", os.O_RDONLY)
    try:
        assert os.pread(removed, 5, 0) == b"hello"
        (source / "a.txt").unlink()
        assert errno_of(os.stat, remote.path / "a.txt") == errno.ENOENT
        # The pages read before stay readable, as on NFS; a read that reaches the server fails.
        assert os.pread(removed, 5, 0) == b"hello"
        os.posix_fadvise(removed, 0, 0, os.POSIX_FADV_DONTNEED)
        assert errno_of(os.pread, removed, 5, 0) == errno.ESTALE
        assert errno_of(os.lseek, removed, 0, os.SEEK_END) == errno.ESTALE  # getattr by fd

        (source / "sub" / "new.bin").write_bytes(b"replacement")
        os.replace(source / "sub" / "new.bin", source / "sub" / "random.bin")
        assert errno_of(os.pread, replaced, 5, 0) == errno.ESTALE
        assert read(remote.path / "sub" / "random.bin") == b"replacement"  # a new open is fine
    finally:
        os.close(removed)
        os.close(replaced)


@pytest.mark.timeout(60)
def test_errno_fault_and_clear(source: Path, start_remote) -> None:
    remote = start_remote()
    mnt = remote.path
    remote.set_fault("errno", errno=errno.EIO, ops=["read"], glob="sub/*.bin")
    assert errno_of(read, mnt / "sub" / "random.bin") == errno.EIO
    # Each read the kernel sent failed: the reader's, and the readahead's ahead of it.
    failed_reads = remote.stats()["errors_injected"]
    assert failed_reads >= 1
    assert read(mnt / "a.txt") == b"hello remote\n"  # glob does not match
    remote.set_fault("errno", errno=errno.ETIMEDOUT, ops=["open"], glob="a.txt")
    assert errno_of(read, mnt / "a.txt") == errno.ETIMEDOUT
    assert os.listdir(mnt)  # the root is not matched by these globs
    assert remote.stats()["errors_injected"] == failed_reads + 1

    remote.clear_faults()
    assert read(mnt / "sub" / "random.bin") == read(source / "sub" / "random.bin")
    assert read(mnt / "a.txt") == b"hello remote\n"

    remote.set_fault("errno", errno=errno.EACCES, ops=["getattr"])  # every path, the root too
    assert errno_of(os.stat, mnt) == errno.EACCES
    remote.clear_faults()
    assert os.stat(mnt)


@pytest.mark.timeout(60)
def test_hang_fault_blocks_until_cleared(source: Path, start_remote) -> None:
    remote = start_remote()
    remote.set_fault("hang", ops=["read"], glob="a.txt")
    result: list[bytes | Exception] = []

    def reader() -> None:
        try:
            result.append(read(remote.path / "a.txt"))
        except Exception as e:  # reported by the assertion below
            result.append(e)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        assert thread.is_alive() and not result
        stats = remote.stats()  # the control socket answers while an op hangs
        assert stats["hung_now"] == 1
        assert read(remote.path / "empty") == b""  # other files are served meanwhile
    finally:
        remote.clear_faults()
    thread.join(5)
    assert result == [b"hello remote\n"]


@pytest.mark.timeout(60)
def test_open_latency_is_paid(start_remote) -> None:
    remote = start_remote(open_ms=50)
    started = time.monotonic()
    for _ in range(5):
        os.close(os.open(remote.path / "a.txt", os.O_RDONLY))
    assert time.monotonic() - started >= 0.25


@pytest.mark.timeout(60)
def test_bandwidth_cap_holds(source: Path, start_remote) -> None:
    (source / "ten.bin").write_bytes(os.urandom(10_000_000))
    remote = start_remote(bandwidth_mbps=20)
    started = time.monotonic()
    assert len(read(remote.path / "ten.bin")) == 10_000_000
    assert time.monotonic() - started >= 0.45


@pytest.mark.timeout(60)
def test_stats_and_settings(start_remote) -> None:
    remote = start_remote(profile="efs", read_ms=3)
    before = remote.stats()
    assert before["settings"] == {"meta_ms": 0.5, "open_ms": 2.0, "read_ms": 3.0,
                                  "bandwidth_mbps": 200.0, "actimeo_s": 3.0}
    assert len(read(remote.path / "sub" / "random.bin")) == 5_000_000
    after = remote.stats()
    assert after["read_bytes"] - before["read_bytes"] == 5_000_000
    assert after["opens"] - before["opens"] == 1
    assert after["ops"]["read"] > before["ops"].get("read", 0)

    remote.configure(open_ms=0, bandwidth_mbps=None)
    assert remote.stats()["settings"]["bandwidth_mbps"] is None
    with pytest.raises(RuntimeError, match="unknown setting"):
        remote.configure(latency=1)
    with pytest.raises(RuntimeError, match="kind"):
        remote.set_fault("explode")


@pytest.mark.timeout(60)
def test_control_socket_survives_bad_requests(start_remote) -> None:
    remote = start_remote()
    sock = remote._socket
    for line in ["not json", "[1, 2]", '{"cmd": "reboot"}', '{"cmd": "fault", "kind": "errno"}',
                 '{"cmd": "fault", "kind": "hang", "ops": ["write"]}']:
        reply = json.loads(slowfs.control_raw(sock, line))
        assert reply["ok"] is False and reply["error"], line
    assert remote.stats()["faults"] == []
    assert read(remote.path / "a.txt") == b"hello remote\n"


@pytest.mark.timeout(60)
def test_cli_mounts_in_background_and_unmounts_on_sigterm(source: Path, tmp_path: Path) -> None:
    mnt, sock, log = tmp_path / "cli-mnt", tmp_path / "ctl.sock", tmp_path / "cli.log"
    mnt.mkdir()
    cmd, env = slowfs.child_command([str(source), str(mnt), "--profile", "local",
                                     "--control", str(sock), "--log-file", str(log)])
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert read(mnt / "a.txt") == b"hello remote\n"  # serving as soon as the command returns

        ctl, _ = slowfs.child_command(["ctl", str(sock), '{"cmd": "stats"}'])
        reply = subprocess.run(ctl, env=env, capture_output=True, text=True, timeout=30)
        assert reply.returncode == 0
        stats = json.loads(reply.stdout)
        assert stats["ok"] and stats["opens"] == 1

        os.kill(stats["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 10
        while slowfs.is_mounted(mnt) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not slowfs.is_mounted(mnt)
        assert "SIGTERM: unmounting" in log.read_text()
    finally:
        if slowfs.is_mounted(mnt):
            slowfs.fusermount(mnt, lazy=True)

    bad, _ = slowfs.child_command([str(source), str(tmp_path / "missing"), "--control", str(sock)])
    failed = subprocess.run(bad, env=env, capture_output=True, text=True, timeout=30)
    assert failed.returncode != 0
    assert len(failed.stderr.splitlines()) == 1 and "not a directory" in failed.stderr


@pytest.mark.timeout(60)
def test_failed_start_raises_and_leaves_nothing(source: Path, tmp_path: Path) -> None:
    remote = EmulatedRemote(source, tmp_path / "missing", profile="local")
    with pytest.raises(RuntimeError, match="not a directory"):
        remote.start()
    remote.stop()  # idempotent after a failed start
    assert not slowfs.is_mounted(tmp_path / "missing")


@pytest.mark.timeout(60)
def test_stop_unmounts_despite_open_files_and_hung_ops(start_remote) -> None:
    remote = start_remote()
    held = os.open(remote.path / "a.txt", os.O_RDONLY)  # keeps a plain unmount busy
    remote.set_fault("hang", ops=["read"])
    result: list[bytes | OSError] = []

    def reader() -> None:
        try:
            result.append(read(remote.path / "a.txt"))
        except OSError as e:
            result.append(e)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        remote.stop()
        assert not slowfs.is_mounted(remote.path)
        thread.join(5)
        assert not thread.is_alive() and result
    finally:
        os.close(held)


class RecordedReplies:
    """Stands in for the FUSE session: keeps what would have been sent to the kernel."""

    def __init__(self) -> None:
        self.sent: dict[int, bytes | int] = {}
        self.answered = threading.Event()

    def reply(self, unique: int, body: bytes = b"") -> bool:
        return self._keep(unique, body)

    def reply_data(self, unique: int, data: bytes) -> bool:
        return self._keep(unique, bytes(data))

    def reply_error(self, unique: int, code: int) -> bool:
        return self._keep(unique, code)

    def _keep(self, unique: int, answer: bytes | int) -> bool:
        self.sent[unique] = answer
        self.answered.set()
        return True


def unmounted_fs(source: Path, settings: slowfs.Settings | None = None
                 ) -> tuple[slowfs.SlowFS, RecordedReplies]:
    fs = slowfs.SlowFS(slowfs.Emulator(os.fsencode(source),
                                       settings or slowfs.Settings(0, 0, 0, None)))
    replies = RecordedReplies()
    fs.init(replies, Connection(minor=45, passthrough=False))
    return fs, replies


def request(unique: int, nodeid: int = ROOT_ID) -> Request:
    return Request(unique, nodeid, os.getuid(), os.getgid(), os.getpid())


@pytest.mark.timeout(60)
def test_unexpected_errors_become_eio(source: Path) -> None:
    # Without a mount: a read on a handle the daemon never gave out is a bug, answered EIO.
    fs, replies = unmounted_fs(source)
    fs.read(request(1), ROOT_ID, 123456, 0, 10)
    assert replies.sent[1] == errno.EIO
    fs.lookup(request(2), ROOT_ID, b"no-such-file")
    assert replies.sent[2] == errno.ENOENT  # real errors keep their errno
    fs.lookup(request(3), ROOT_ID, b"a.txt")
    assert isinstance(replies.sent[3], bytes)  # an entry for a file that is there


@pytest.mark.timeout(60)
def test_latency_is_paid_on_the_timer_not_by_the_caller(source: Path) -> None:
    # The handler returns at once; the answer (an error too) follows when the latency is paid.
    fs, replies = unmounted_fs(source, slowfs.Settings(200, 0, 0, None))
    started = time.monotonic()
    fs.lookup(request(1), ROOT_ID, b"no-such-file")
    assert time.monotonic() - started < 0.1 and not replies.sent
    assert replies.answered.wait(5)
    assert time.monotonic() - started >= 0.2
    assert replies.sent == {1: errno.ENOENT}


@pytest.mark.timeout(60)
def test_timer_runs_callbacks_in_order_never_early() -> None:
    timer = slowfs.Timer()
    ran: list[tuple[str, float, float]] = []
    done = threading.Event()
    now = time.monotonic()
    for name, delay in [("c", 0.15), ("a", 0.05), ("b", 0.10), ("past", -1.0)]:
        timer.at(now + delay, lambda name=name, due=now + delay: ran.append(
            (name, due, time.monotonic())))
    timer.at(now + 0.2, done.set)
    assert done.wait(5)
    assert [name for name, _, _ in ran] == ["past", "a", "b", "c"]
    assert all(at >= due for _, due, at in ran)


@pytest.mark.timeout(60)
def test_hang_times_out_without_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slowfs, "HANG_LIMIT_S", 0.1)
    faults = slowfs.Faults(slowfs.Timer())
    faults.add(slowfs.Fault("hang", ops=("read",)))
    outcome: list[str | int] = []
    done = threading.Event()

    def park() -> None:
        fault = faults.match("read", b"a.txt")
        faults.park(fault, lambda: (outcome.append("resumed"), done.set()),
                    lambda code: (outcome.append(code), done.set()))

    threads = threading.active_count()
    park()
    assert faults.hung_now == 1 and threading.active_count() == threads
    assert done.wait(5) and outcome == [errno.ETIMEDOUT] and faults.hung_now == 0

    done.clear()
    monkeypatch.setattr(slowfs, "HANG_LIMIT_S", 60)
    park()
    faults.clear()
    assert done.wait(5) and outcome[1:] == ["resumed"]
    assert faults.match("read", b"a.txt") is None


@pytest.mark.timeout(60)
def test_waiting_and_hung_requests_hold_no_thread(start_remote) -> None:
    remote = start_remote(open_ms=1000)
    remote.set_fault("hang", ops=["open"], glob="sub/*")
    opened: list[float] = []

    def open_a() -> None:
        os.close(os.open(remote.path / "a.txt", os.O_RDONLY))
        opened.append(time.monotonic())

    readers = [threading.Thread(target=read, args=(remote.path / "sub" / "random.bin",),
                                daemon=True) for _ in range(10)]
    openers = [threading.Thread(target=open_a, daemon=True) for _ in range(20)]
    started = time.monotonic()
    for thread in readers + openers:
        thread.start()
    try:
        time.sleep(0.5)
        stats = remote.stats()
        assert stats["hung_now"] == 10
        assert stats["in_flight"] == 30  # 20 opens paying their latency, 10 hung ones
        assert stats["threads"] <= 10  # the daemon's, whatever waits
    finally:
        remote.clear_faults()
    for thread in readers + openers:
        thread.join(10)
    assert len(opened) == 20
    assert 1.0 <= max(opened) - started < 3.0  # the opens waited side by side


@pytest.mark.timeout(60)
def test_cpu_seconds_are_reported(start_remote) -> None:
    remote = start_remote(profile="efs")
    assert read(remote.path / "a.txt") == b"hello remote\n"
    stats = remote.stats()
    assert stats["cpu_seconds"] > 0
    assert stats["cpu_seconds"] == pytest.approx(
        stats["cpu_user_seconds"] + stats["cpu_system_seconds"], abs=1e-5)
    assert 0 <= remote.cpu_seconds() <= stats["cpu_seconds"] + 0.1
    remote.stop()
    with pytest.raises(RuntimeError, match="not running"):
        remote.cpu_seconds()


@pytest.mark.timeout(60)
def test_private_and_shared_mmap_read_the_source(source: Path, start_remote) -> None:
    remote = start_remote()
    want = read(source / "sub" / "random.bin")
    with open(remote.path / "sub" / "random.bin", "rb") as f:
        for flags in (mmap.MAP_PRIVATE, mmap.MAP_SHARED):
            with mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ) as view:
                assert view[:] == want


@pytest.mark.timeout(60)
def test_pages_stay_cached_across_opens_while_the_file_is_unchanged(source: Path,
                                                                    start_remote) -> None:
    """Close-to-open, as an NFS client does: a file read again unchanged costs an open and no
    read; a file changed since (in place, or replaced) is read again, whole and new."""
    remote = start_remote()
    path = remote.path / "sub" / "random.bin"
    want = read(source / "sub" / "random.bin")
    assert read(path) == want
    reads = remote.stats()["ops"]["read"]
    read_bytes = remote.stats()["read_bytes"]
    assert read(path) == want
    assert remote.stats()["ops"]["read"] == reads
    assert remote.stats()["read_bytes"] == read_bytes

    rewritten = os.urandom(len(want))  # same size: only the times tell
    time.sleep(0.01)
    with open(source / "sub" / "random.bin", "r+b") as f:
        f.write(rewritten)
    assert read(path) == rewritten
    assert remote.stats()["read_bytes"] >= read_bytes + len(want)

    (source / "sub" / "new.bin").write_bytes(b"replaced")
    os.replace(source / "sub" / "new.bin", source / "sub" / "random.bin")
    assert read(path) == b"replaced"


@pytest.mark.timeout(60)
def test_an_open_beside_one_that_found_the_file_changed_reads_the_new_bytes(
        source: Path, start_remote) -> None:
    """Two opens of a file rewritten in place: the first finds it changed, and its process
    is slow to wake (kept off its CPU by a real-time busy loop); the second, answered
    meanwhile, reads the new bytes, not the old pages: an NFS client marks the pages invalid
    for every reader, not for the one that noticed.  (Dropped only as the first opener woke,
    the second read the old version's pages every time.)"""
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1: one kept busy, one to read on")
    remote = start_remote()
    path = remote.path / "sub" / "random.bin"
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {1})
    try:
        for _ in range(3):
            before = read(source / "sub" / "random.bin")
            assert read(path) == before  # its pages cached
            rewritten = os.urandom(len(before))
            with open(source / "sub" / "random.bin", "r+b") as f:
                f.write(rewritten)
            remote.configure(open_ms=300)  # both opens are answered after their work
            opens = remote.stats()["ops"]["open"]
            slow = subprocess.Popen([sys.executable, "-c",
                                     "import os, sys; os.sched_setaffinity(0, {0}); "
                                     "os.close(os.open(sys.argv[1], os.O_RDONLY))", str(path)])
            hog = None
            try:
                deadline = time.monotonic() + 10
                while remote.stats()["ops"]["open"] == opens and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert remote.stats()["ops"]["open"] > opens, "the first open never came"
                hog = subprocess.Popen([sys.executable, "-c",
                                        "import os; os.sched_setaffinity(0, {0}); "
                                        "os.sched_setscheduler(0, os.SCHED_FIFO, "
                                        "os.sched_param(1)); exec('while True: pass')"])
                time.sleep(0.05)
                if hog.poll() is not None:
                    pytest.skip("no real-time scheduling here (needs CAP_SYS_NICE)")
                got = read(path)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
                slow.wait(timeout=30)
                remote.configure(open_ms=0)
            assert got == rewritten
    finally:
        os.sched_setaffinity(0, allowed)


@pytest.mark.timeout(120)
def test_two_first_opens_at_once_fetch_a_file_once(tmp_path: Path, source: Path,
                                                   start_remote) -> None:
    """A file's first two opens at once, as a reader's beside a fill's: the pages one of them
    reads stay for the other, so the remote sends the file once.  (The kernel drops a file's
    pages as an open answered without FOPEN_KEEP_CACHE returns, which on a busy host may come
    after the other open's reads: with the host busy, 2 to 11 files of these 100 were
    fetched twice.)"""
    names = [f"race-{i}.bin" for i in range(100)]
    for name in names:
        (source / name).write_bytes(os.urandom(100_000))
    remote = start_remote()
    remote.configure(open_ms=2)
    for name in names:
        os.stat(remote.path / name)  # looked up: the two opens go straight to OPEN
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        before = remote.stats()["read_bytes"]
        for name in names:
            start = threading.Barrier(2)

            def copy(path: Path = remote.path / name,
                     start: threading.Barrier = start) -> None:
                start.wait()
                fd = os.open(path, os.O_RDONLY)
                out = os.open(tmp_path / "copy", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                try:
                    while os.sendfile(out, fd, None, 1 << 20) > 0:
                        pass
                finally:
                    os.close(out)
                    os.close(fd)

            copier = threading.Thread(target=copy)
            copier.start()
            start.wait()
            assert read(remote.path / name) == read(source / name)
            copier.join()
        assert remote.stats()["read_bytes"] - before == 100 * 100_000
    finally:
        for process in busy:
            process.kill()
            process.wait()


@pytest.mark.timeout(60)
def test_reads_ahead_as_an_efs_mount_does(source: Path, start_remote) -> None:
    remote = start_remote()
    assert read(remote.path / "sub" / "random.bin") == read(source / "sub" / "random.bin")
    entry = slowfs.find_mount(remote.path)
    setting = Path(f"/sys/class/bdi/{entry.device}/read_ahead_kb").read_text()
    assert int(setting) == slowfs.READ_AHEAD_KB
    # 5 MB in requests of up to 1 MiB each, not of 128 KiB.
    assert remote.stats()["ops"]["read"] <= 8


@pytest.mark.timeout(60)
def test_remote_cost_accounts_for_what_was_injected() -> None:
    lines: list[str] = []
    ((run,),) = remote_cost.measure(files=30, size=64 << 10, readers=2, profile="efs",
                                    repeats=1, report=lines.append)
    # Each file: a lookup of itself (the directories' are kept for actimeo, so asked once),
    # an open and one read of its bytes (the kernel's readahead: the end of the file is then
    # known without asking); then its bytes at 200 MB/s.
    lookups = run.ops.pop("getattr")
    assert 30 < lookups <= 33
    assert run.ops == {"open": 30, "read": 30, "release": 30}
    assert run.injected_per_file == pytest.approx(
        lookups / 30 * 0.5e-3 + 2e-3 + 2e-3 + (64 << 10) / 200e6)
    assert run.cpu_seconds >= 0 and run.files_per_second > 0
    assert lines and "files/s" in lines[0]
