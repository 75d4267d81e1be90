"""systemd's file descriptor store keeps the mount across the death of the supervisor itself
(service/fdstore.py), and `cachefs upgrade` from ExecReload makes the new daemon the unit's main
process (MAINPID=).

systemd's side is played by :class:`Manager`: the notify socket (READY=1, MAINPID=, FDSTORE=1,
FDSTOREREMOVE=1, each with the sender's pid from SCM_CREDENTIALS, as systemd reads them), the
store (descriptors by FDNAME, duplicates of one file kept once, as systemd does) and the start
of a main process with the stored descriptors (LISTEN_FDS from fd 3, LISTEN_FDNAMES,
LISTEN_PID).  Real mounts, real processes; what systemd itself does beyond that protocol (unit
states, ExecStop, restart jobs) is not played here: README, "Restarts and upgrades".
"""

from __future__ import annotations

import array
import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefs.kernel.mountpoint import find_mount
from cachefs.service.fdstore import fd_name
from cachefs.service.process import alive, wait_gone
from tests.conftest import REPO, CachefsMount, make_files, run_cachefs, wait_for
from tests.test_restart import Readers, _dataset, _plan

pytestmark = pytest.mark.timeout(150)

# Starts a command as systemd starts a unit's main process with stored descriptors: at fd 3
# onwards, LISTEN_PID naming the process itself (the pid survives the exec).
WITH_FDS = r"""
import fcntl, os, sys
passed = [int(fd) for fd in sys.argv[1].split(",") if fd]
moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in passed]
for fd in passed:
    os.close(fd)
for target, fd in enumerate(moved, 3):
    os.dup2(fd, target)
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS=str(len(moved)),
                  LISTEN_FDNAMES=sys.argv[2])
os.execvp(sys.argv[3], sys.argv[3:])
"""

_SYS_KCMP = 312  # x86_64
_KCMP_FILE = 0


def _same_file(a: int, b: int) -> bool:
    """Whether two descriptors are one open file (systemd's same_fd(), through kcmp)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pid = os.getpid()
    return libc.syscall(_SYS_KCMP, pid, pid, _KCMP_FILE, a, b) == 0


class Manager:
    """systemd, as far as one unit's notifications and file descriptor store go."""

    def __init__(self) -> None:
        self.address = f"@cachefs-test-{os.getpid()}-{time.monotonic_ns()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind("\0" + self.address[1:])
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.store: dict[str, list[int]] = {}
        self.messages: list[tuple[int, dict[str, str], float]] = []  # (pid, fields, when)
        self.processes: list[subprocess.Popen] = []

    def env(self) -> dict[str, str]:
        return dict(os.environ, NOTIFY_SOCKET=self.address)

    def start(self, command: list[str]) -> subprocess.Popen:
        """The unit's main process, with the store's descriptors passed as systemd passes them."""
        names = [name for name, fds in self.store.items() for _ in fds]
        fds = [fd for held in self.store.values() for fd in held]
        if fds:
            command = [sys.executable, "-c", WITH_FDS, ",".join(map(str, fds)),
                       ":".join(names), *command]
        process = subprocess.Popen(command, cwd=REPO, env=self.env(), pass_fds=fds,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.processes.append(process)
        return process

    def receive(self, timeout: float) -> bool:
        """Take one message, if one comes within ``timeout``; act on FDSTORE= as systemd does."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return False
        fds = array.array("i")
        data, ancillary, _flags, _address = self.sock.recvmsg(
            4096, socket.CMSG_SPACE(16 * fds.itemsize) + socket.CMSG_SPACE(12),
            socket.MSG_CMSG_CLOEXEC)
        pid = 0
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = int.from_bytes(payload[:4], "little")
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.messages.append((pid, fields, time.monotonic()))
        if fields.get("FDSTOREREMOVE") == "1":
            for fd in self.store.pop(fields["FDNAME"], []):
                os.close(fd)
        elif fields.get("FDSTORE") == "1":
            held = self.store.setdefault(fields.get("FDNAME", "stored"), [])
            for fd in fds:
                if any(_same_file(fd, kept) for kept in held):
                    os.close(fd)
                else:
                    held.append(fd)
        else:
            for fd in fds:
                os.close(fd)
        return True

    def drain(self) -> None:
        while self.receive(0):
            pass

    def wait_for(self, key: str, value: str | None = None, *, since: int = 0,
                 timeout: float = 60) -> tuple[int, dict[str, str], float]:
        """The first message from index ``since`` on that sets ``key`` (to ``value``)."""
        deadline = time.monotonic() + timeout
        while True:
            for message in self.messages[since:]:
                if key in message[1] and (value is None or message[1][key] == value):
                    return message
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {key}={value or '...'} within {timeout:g} s: "
                                     f"{[m[1] for m in self.messages]}")
            self.receive(min(left, 0.5))

    def close(self) -> None:
        for held in self.store.values():
            for fd in held:
                os.close(fd)
        self.store.clear()
        self.sock.close()


@pytest.fixture
def manager(tmp_path, remote, request):
    """A Manager and a mount at tmp_path/mnt of ``remote``, to be started through it; in
    teardown the mount is unmounted (lazily when no process serves it), every process it
    started is gone, and then the store is closed."""
    options = {"cache_size": "1G", "metrics_addr": "127.0.0.1:0", "fraction": 0.5}
    if os.environ.get("CACHEFS_TEST_PASSTHROUGH"):
        options["passthrough"] = os.environ["CACHEFS_TEST_PASSTHROUGH"]
    mount = CachefsMount(remote.path, tmp_path / "mnt", tmp_path / "cache",
                         tmp_path / "mnt.log", options)
    mount.path.mkdir()
    systemd = Manager()
    systemd.mount = mount
    systemd.command = [sys.executable, "-m", "cachefs", *mount.command(), "--foreground"]
    yield systemd
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    if failed:
        sys.stderr.write(f"\n--- cachefs log of {mount.path} ---\n{mount.log_tail()}\n")
    try:
        if find_mount(mount.path) is not None:
            if not any(process.poll() is None for process in systemd.processes) \
                    and not (mount.supervisor_pid and alive(mount.supervisor_pid)):
                run_cachefs("unmount", "--lazy", str(mount.path), timeout=60)
            mount.stop()
    finally:
        for process in systemd.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
        systemd.close()


def _serving(systemd: Manager, since: int = 0) -> dict:
    """Wait until the mount serves under ``systemd`` (READY=1 and its descriptor stored);
    the status, with the mount's pids updated."""
    systemd.wait_for("READY", "1", since=since)
    systemd.wait_for("FDSTORE", "1", since=since)
    status = systemd.mount.status()
    systemd.mount.pid, systemd.mount.supervisor_pid = status["pid"], status["supervisor_pid"]
    return status


def test_the_mount_outlives_its_supervisor_while_systemd_keeps_the_descriptor(source, manager):
    small, large = _dataset(source)
    mount = manager.mount
    first_process = manager.start(manager.command)
    first = _serving(manager)
    name = fd_name(mount.path)
    assert list(manager.store) == [name] and len(manager.store[name]) == 1
    assert first["supervisor_pid"] == first_process.pid
    assert first["serving"]["taken_over_from"] is None
    assert _record(mount).exists()
    for rel in small + [large]:
        (mount.path / rel).read_bytes()
    mount.settle()

    readers = Readers(mount.path, source, _plan(small, large), seconds=9)
    try:
        time.sleep(2.5)
        killed_at = time.monotonic()
        os.kill(first["supervisor_pid"], signal.SIGKILL)
        os.kill(first["pid"], signal.SIGKILL)
        assert wait_gone(first["supervisor_pid"], 10) and wait_gone(first["pid"], 10)
        first_process.wait(10)
        # Nothing serves the mount now: only the descriptor in the store keeps it.
        assert find_mount(mount.path) is not None
        # systemd runs ExecStop after a main process died too, without MAINPID: it leaves the
        # mount to the restart.
        stop = run_cachefs("unmount", str(mount.path), env=dict(
            os.environ, SERVICE_RESULT="signal", EXIT_CODE="killed", EXIT_STATUS="KILL"))
        assert stop.returncode == 0 and len(stop.stderr.splitlines()) == 1, stop.stderr
        assert "left mounted" in stop.stderr and find_mount(mount.path) is not None
        time.sleep(0.5)
        since = len(manager.messages)
        restarted_at = time.monotonic()
        second_process = manager.start(manager.command)
        second = _serving(manager, since)
        ready_at = manager.wait_for("READY", "1", since=since)[2]
        served_again, start = ready_at - killed_at, ready_at - restarted_at
        results = readers.results(timeout=90)
    finally:
        readers.kill()

    assert [r["errors"] for r in results] == [[]] * 8
    assert sum(r["wrong"] for r in results) == 0, [r["wrong_reads"][:3] for r in results]
    assert all(r["reads"] > 0 for r in results)
    longest = max(r["max_wait"] for r in results)
    assert second["supervisor_pid"] == second_process.pid != first["supervisor_pid"]
    assert second["serving"]["taken_over_from"] == "fdstore"
    assert second["serving"]["restarts"] == 1
    status_text = run_cachefs("status", str(mount.path), timeout=30).stdout
    assert "taken over from systemd's descriptor store" in status_text, status_text
    assert second["serving"]["mounted_since"] == first["serving"]["mounted_since"]
    # The new supervisor is the unit's main process, and still has systemd keep the descriptor.
    assert manager.wait_for("MAINPID", str(second_process.pid), since=since)
    assert list(manager.store) == [name] and len(manager.store[name]) == 1
    log = mount.log_file.read_text()
    assert "took the mount of" in log and "systemd's file descriptor store" in log
    print(f"\nsupervisor and serving process killed; served again after "
          f"{served_again * 1000:.0f} ms, of which the new start {start * 1000:.0f} ms; longest "
          f"reader wait {longest * 1000:.0f} ms; {sum(r['reads'] for r in results)} reads")
    assert longest <= served_again + 1.0, (longest, served_again)

    # A clean stop (systemctl stop: ExecStop while the main process runs): systemd is told
    # to drop the descriptor, and the record goes.
    since = len(manager.messages)
    result = run_cachefs("unmount", str(mount.path), env=dict(
        os.environ, SERVICE_RESULT="success", MAINPID=str(second_process.pid)))
    assert result.returncode == 0, result.stderr
    manager.wait_for("FDSTOREREMOVE", "1", since=since)
    assert manager.store == {}
    assert second_process.wait(30) == 0
    assert find_mount(mount.path) is None
    assert not _record(mount).exists()


def _record(mount: CachefsMount) -> Path:
    """Where the supervisor records what the stored descriptor's handshake settled: beside the
    node table, in the (default) runtime directory."""
    from cachefs.service.daemon import default_runtime_dir

    return default_runtime_dir() / f"{fd_name(mount.path).removeprefix('fuse-')}.fdstore"


def test_a_descriptor_that_is_not_the_mounts_is_dropped_in_one_line_and_the_mount_made_afresh(
        source, manager):
    (source / "a.bin").write_bytes(b"a fresh mount\n")
    mount = manager.mount
    name = fd_name(mount.path)
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    manager.store[name] = [read_end]
    try:
        process = manager.start(manager.command)
        removed = manager.wait_for("FDSTOREREMOVE", "1")
        assert removed[1]["FDNAME"] == name
        status = _serving(manager)
    finally:
        os.close(write_end)
    assert status["supervisor_pid"] == process.pid
    assert status["serving"]["taken_over_from"] is None
    assert (mount.path / "a.bin").read_bytes() == b"a fresh mount\n"
    warnings = [line for line in mount.log_file.read_text().splitlines()
                if "descriptor systemd kept" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].endswith(f"the descriptor systemd kept for {mount.path} cannot serve it "
                                "(it is not /dev/fuse); mounting afresh")
    assert len(manager.store[name]) == 1  # the new mount's, not the pipe
    assert os.fstat(manager.store[name][0]).st_rdev == os.stat("/dev/fuse").st_rdev
    result = run_cachefs("unmount", str(mount.path))
    assert result.returncode == 0, result.stderr
    assert process.wait(30) == 0
    manager.drain()
    assert manager.store == {}


def test_cachefs_upgrade_from_exec_reload_makes_the_new_supervisor_the_main_process(
        source, manager):
    small = make_files(source, 60, (4_000, 32_000), seed=9, per_dir=30)
    mount = manager.mount
    name = fd_name(mount.path)
    old_process = manager.start(manager.command)
    old = _serving(manager)
    plan = [("read", small), ("mmap", small), ("read", small[:30]), ("read", small[30:])]
    readers = Readers(mount.path, source, plan, seconds=6)
    try:
        time.sleep(1.5)
        since = len(manager.messages)
        # ExecReload=cachefs upgrade MOUNTPOINT, in the environment systemd gives it.
        reload = run_cachefs("upgrade", str(mount.path), timeout=90, env=dict(
            manager.env(), MAINPID=str(old_process.pid)))
        manager.drain()  # what systemd has read when the reload command exits
        results = readers.results(timeout=60)
    finally:
        readers.kill()
    assert reload.returncode == 0, reload.stderr
    new = mount.status()
    mount.pid, mount.supervisor_pid = new["pid"], new["supervisor_pid"]
    assert new["supervisor_pid"] != old["supervisor_pid"]
    assert new["serving"]["taken_over_from"] == "daemon"
    mainpids = [(pid, fields["MAINPID"]) for pid, fields, _ in manager.messages[since:]
                if "MAINPID" in fields]
    # Sent by the new serving process (NotifyAccess=all), before the reload command ended:
    # systemd's main process is the new supervisor when it looks again.
    assert mainpids == [(new["pid"], str(new["supervisor_pid"]))], mainpids
    assert old_process.wait(30) == 0  # exited, and cleanly: not a failure of the unit
    # The descriptor stays in the store, once: the old supervisor did not remove it.
    assert not any("FDSTOREREMOVE" in fields for _pid, fields, _ in manager.messages[since:])
    assert list(manager.store) == [name] and len(manager.store[name]) == 1
    assert [r["errors"] for r in results] == [[]] * 4
    assert sum(r["wrong"] for r in results) == 0, [r["wrong_reads"][:3] for r in results]
    longest = max(r["max_wait"] for r in results)
    print(f"\n{reload.stdout.strip()}; longest reader wait {longest * 1000:.0f} ms")

    since = len(manager.messages)
    result = run_cachefs("unmount", str(mount.path))
    assert result.returncode == 0, result.stderr
    manager.wait_for("FDSTOREREMOVE", "1", since=since)
    assert manager.store == {} and wait_gone(new["supervisor_pid"], 30)


def test_a_serving_process_that_keeps_dying_at_its_start_ends_the_mount(source, manager):
    """The crash-loop give-up (supervisor.py): a cache directory that is gone under the running
    daemon makes every successor fail at its start; after MAX_QUICK_DEATHS of them the mount
    is detached, systemd drops its descriptor, and the supervisor exits 1 (Restart=on-failure
    then mounts afresh, or gives up at the unit's start limit)."""
    from cachefs.service.supervisor import MAX_QUICK_DEATHS

    (source / "a.bin").write_bytes(b"served once\n")
    mount = manager.mount
    process = manager.start(manager.command)
    status = _serving(manager)
    assert (mount.path / "a.bin").read_bytes() == b"served once\n"
    mount.cache_dir.rename(mount.cache_dir.with_name("cache.gone"))
    mount.cache_dir.write_text("not a cache directory\n")
    os.kill(status["pid"], signal.SIGKILL)
    assert process.wait(timeout=60) == 1
    assert find_mount(mount.path) is None
    manager.wait_for("FDSTOREREMOVE", "1")
    assert manager.store == {}
    errors = process.stderr.read().splitlines()
    assert len(errors) == MAX_QUICK_DEATHS - 1 and "Traceback" not in "".join(errors)
    assert all(line.startswith(f"cachefs mount: cannot use cache dir {mount.cache_dir}: ")
               for line in errors), errors  # one line each, saying why
    log = mount.log_file.read_text()
    assert log.count("the serving process died (") == MAX_QUICK_DEATHS - 1
    assert (f"the serving process died {MAX_QUICK_DEATHS} times in a row within 2 s of its "
            f"start; unmounting {mount.path}") in log


def _connection_gone(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, 0)
    return any(events & select.POLLERR for _fd, events in poller.poll(0))


def test_a_descriptor_whose_mount_was_unmounted_meanwhile_is_dropped_and_the_mount_made_afresh(
        source, manager):
    """The supervisor dies, and someone unmounts the waiting mount before the restart (fusermount
    -uz): the stored descriptor's connection is gone; the start says so in one line, drops it
    and mounts again."""
    (source / "a.bin").write_bytes(b"mounted again\n")
    mount = manager.mount
    name = fd_name(mount.path)
    first_process = manager.start(manager.command)
    first = _serving(manager)
    os.kill(first["supervisor_pid"], signal.SIGKILL)
    os.kill(first["pid"], signal.SIGKILL)
    assert first_process.wait(30) == -signal.SIGKILL and wait_gone(first["pid"], 10)
    assert run_cachefs("unmount", "--lazy", str(mount.path)).returncode == 0
    [stored] = manager.store[name]
    wait_for(lambda: _connection_gone(stored), timeout=10, what="the connection aborted")

    since = len(manager.messages)
    second_process = manager.start(manager.command)
    assert manager.wait_for("FDSTOREREMOVE", "1", since=since)[1]["FDNAME"] == name
    second = _serving(manager, since)
    assert second["supervisor_pid"] == second_process.pid
    assert second["serving"]["taken_over_from"] is None
    assert (mount.path / "a.bin").read_bytes() == b"mounted again\n"
    warnings = [line for line in mount.log_file.read_text().splitlines()
                if "descriptor systemd kept" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"the descriptor systemd kept for {mount.path} cannot serve it (its connection is "
        "gone); mounting afresh"), warnings
    [fresh] = manager.store[name]
    assert not _connection_gone(fresh)
    assert run_cachefs("unmount", str(mount.path)).returncode == 0
    assert second_process.wait(30) == 0
