"""A serving process that dies does not break the mount: the supervisor holds the connection
and a new process takes it over (service/supervisor.py, kernel/takeover.py).  What readers
see: no error, every byte the remote's, a wait of at most the restart time plus a second;
what the cache keeps: nothing partial; what is left behind: no descriptor, no backing id.
The handle table alone, without a mount, first."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.kernel.mountpoint import find_mount
from cachefs.mirror import handles as h
from cachefs.mirror.handles import HandleTable
from cachefs.service.process import alive, wait_gone
from tests.conftest import (
    REPO,
    CachefsMount,
    files_written,
    fill_under_way,
    make_files,
    registered_backing_ids,
    run_cachefs,
    shuffled_read_all,
    wait_for,
)
from tests.test_security import as_nobody

pytestmark = pytest.mark.timeout(150)

# One reader process: loops over its files for SECONDS, comparing every byte with the source,
# and reports the reads, the errors, the wrong reads (how each was wrong) and the longest
# single operation.
READER = r"""
import hashlib, json, mmap, os, random, sys, time
kind, mount, source, seconds, seed = sys.argv[1:6]
paths = json.loads(sys.stdin.read())
want = {rel: open(os.path.join(source, rel), "rb").read() for rel in paths}
rng = random.Random(int(seed))
end = time.monotonic() + float(seconds)
out = {"reads": 0, "errors": [], "wrong": 0, "wrong_reads": [], "max_wait": 0.0}
def check(rel, offset, got, expected):
    if got == expected:
        return
    out["wrong"] += 1
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    out["wrong_reads"].append(
        f"{kind} {rel} at {offset}: {len(got)} bytes of {len(expected)}, first different byte "
        f"{first}, {got.count(0)} zero bytes, {time.time():.3f}")
def timed(action):
    started = time.monotonic()
    try:
        return action()
    except OSError as exc:
        out["errors"].append(f"{exc.errno} {exc.strerror}")
        return None
    finally:
        out["max_wait"] = max(out["max_wait"], time.monotonic() - started)
def whole(rel):
    with open(os.path.join(mount, rel), "rb", buffering=0) as f:
        data = f.read()
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return data
def mapped(rel):
    with open(os.path.join(mount, rel), "rb") as f:
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as view:
            data = bytes(view)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return data
while time.monotonic() < end:
    if kind == "large":  # one open across many reads: the file is mid-read at the kill
        rel = paths[0]
        fd = timed(lambda: os.open(os.path.join(mount, rel), os.O_RDONLY))
        if fd is None:
            continue
        for offset in range(0, len(want[rel]), 1 << 18):
            piece = timed(lambda: os.pread(fd, 1 << 18, offset))
            out["reads"] += 1
            if piece is not None:
                check(rel, offset, piece, want[rel][offset:offset + (1 << 18)])
            time.sleep(0.005)
            if time.monotonic() > end:
                break
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        continue
    rel = rng.choice(paths)
    data = timed(lambda: (mapped if kind == "mmap" else whole)(rel))
    out["reads"] += 1
    if data is not None:
        check(rel, 0, data, want[rel])
print(json.dumps(out))
"""


class Readers:
    """Reader processes over a mount, started together, each reporting at its end."""

    def __init__(self, mount: Path, source: Path, plan: list[tuple[str, list[str]]],
                 seconds: float) -> None:
        self.procs = []
        for number, (kind, paths) in enumerate(plan):
            proc = subprocess.Popen(
                [sys.executable, "-c", READER, kind, str(mount), str(source), str(seconds),
                 str(number)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)
            proc.stdin.write(json.dumps(paths))
            proc.stdin.close()
            proc.stdin = None
            self.procs.append(proc)

    def results(self, timeout: float) -> list[dict]:
        out = []
        for proc in self.procs:
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError("a reader hung") from None
            assert proc.returncode == 0, stderr
            out.append(json.loads(stdout))
        return out

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.fast
def test_the_handle_table_is_what_a_successor_maps(tmp_path):
    table = HandleTable(tmp_path / "t")
    slots = [table.add_locked(nodeid, backing, kind) for nodeid, backing, kind in
             [(5, 3, h.PASSTHROUGH), (6, 0, h.SERVED), (0, 9, h.HELD)]]
    assert slots == [1, 2, 3]
    table.remove_locked(2)
    for _ in range(2000):  # grows the file
        table.add_locked(7, 0, h.SERVED)
    successor = HandleTable(tmp_path / "t", take_over=True)
    records = successor.records_locked()
    assert records[:3] == [h.Record(1, 5, 3, h.PASSTHROUGH), h.Record(2, 7, 0, h.SERVED),
                           h.Record(3, 0, 9, h.HELD)]
    assert len(records) == len(successor) == 2002
    successor.remove_locked(1)
    assert successor.add_locked(8, 0, h.SERVED) == 1  # a freed slot is used again
    successor.close(remove=True)
    table.close()
    with pytest.raises(OSError):
        HandleTable(tmp_path / "t", take_over=True)
    (tmp_path / "u.handles").write_bytes(b"x" * 4096)
    with pytest.raises(ValueError):
        HandleTable(tmp_path / "u", take_over=True)


def _dataset(source: Path) -> tuple[list[str], str]:
    small = make_files(source, 80, (8_000, 64_000), seed=3, per_dir=20)
    (source / "large.bin").write_bytes(random.Random(4).randbytes(12 * 2**20 + 7))
    return small, "large.bin"


def _kill_serving(mount, *, wait: bool = True) -> dict:
    """SIGKILL the serving process; with ``wait``, the status once its successor serves."""
    old = mount.pid
    os.kill(old, signal.SIGKILL)
    if not wait:
        return {}
    status = wait_for(lambda: _status_after(mount, old), timeout=30, interval=0.05,
                      what="a new serving process")
    return status


def _status_after(mount, old_pid: int) -> dict | None:
    try:
        status = mount.refresh()
    except RuntimeError:  # the control socket is being taken over
        return None
    return status if status["pid"] != old_pid else None


def _plan(small: list[str], large: str) -> list[tuple[str, list[str]]]:
    half = len(small) // 2
    return [("read", small), ("read", small[:half]), ("read", small[half:]), ("read", small),
            ("mmap", small), ("mmap", small[half:]), ("large", [large]), ("large", [large])]


@pytest.mark.parametrize("passthrough", ["auto", "off"])
def test_kill_9_under_8_readers_costs_them_a_wait_not_an_error(
        source, remote, mount_cachefs, passthrough):
    small, large = _dataset(source)
    mount = mount_cachefs(remote.path, fraction=0.5, passthrough=passthrough)
    shuffled_read_all(mount.path, small + [large], seed=1)  # the kept half is cached now
    first = mount.status()
    assert first["serving"]["restarts"] == 0 and first["cache_files"] > 0
    assert first["supervisor_pid"] not in (None, first["pid"])

    readers = Readers(mount.path, source, _plan(small, large), seconds=7)
    try:
        time.sleep(2.5)
        killed = mount.pid
        status = _kill_serving(mount)
        results = readers.results(timeout=60)
    finally:
        readers.kill()

    pause = status["serving"]["last_restart_pause_seconds"]
    assert not alive(killed)
    assert status["serving"]["restarts"] == 1
    assert status["supervisor_pid"] == first["supervisor_pid"]
    assert status["serving"]["since"] > first["serving"]["since"]
    assert 0 < pause < 5
    assert [r["errors"] for r in results] == [[]] * 8
    assert sum(r["wrong"] for r in results) == 0, [r["wrong_reads"][:3] for r in results]
    assert all(r["reads"] > 0 for r in results)
    longest = max(r["max_wait"] for r in results)
    assert longest <= pause + 1.0, (longest, pause)
    assert mount.metric("cachefs_restarts_total") == 1
    shown = run_cachefs("status", str(mount.path)).stdout
    assert f"restarts     1 since the mount (supervisor pid {first['supervisor_pid']})" in shown
    assert f"after a pause of {pause * 1000:.0f} ms" in shown
    assert mount.metric("cachefs_restart_pause_seconds") == pytest.approx(pause, abs=1e-3)
    print(f"\npassthrough {passthrough}: pause {pause * 1000:.0f} ms, longest reader wait "
          f"{longest * 1000:.0f} ms, {sum(r['reads'] for r in results)} reads")

    # Clean shutdown still holds: unmounted, no process left.
    supervisor = status["supervisor_pid"]
    serving = mount.pid
    result = run_cachefs("unmount", str(mount.path))
    assert result.returncode == 0, result.stderr
    assert find_mount(mount.path) is None
    assert wait_gone(serving, 10) and wait_gone(supervisor, 10)


def test_kill_9_twice_in_a_row(source, remote, mount_cachefs):
    small, large = _dataset(source)
    mount = mount_cachefs(remote.path, fraction=0.5)
    shuffled_read_all(mount.path, small, seed=2)
    plan = [("read", small), ("mmap", small), ("large", [large]), ("read", small)]
    readers = Readers(mount.path, source, plan, seconds=6)
    try:
        time.sleep(1.5)
        _kill_serving(mount)
        status = _kill_serving(mount)  # at once: the new process has just started serving
        results = readers.results(timeout=60)
    finally:
        readers.kill()
    assert status["serving"]["restarts"] == 2
    assert [r["errors"] for r in results] == [[]] * 4
    assert sum(r["wrong"] for r in results) == 0, [r["wrong_reads"][:3] for r in results]
    longest = max(r["max_wait"] for r in results)
    # Two pauses back to back: the second restart is delayed (a quick death, see supervisor.py)
    assert longest <= 2 * status["serving"]["last_restart_pause_seconds"] + 1.0 + 0.1, longest

    # SIGTERM to the supervisor (systemd's stop, docker stop): unmounted, no process left.
    supervisor, serving = status["supervisor_pid"], mount.pid
    os.kill(supervisor, signal.SIGTERM)
    assert wait_gone(supervisor, 20) and wait_gone(serving, 5)
    assert find_mount(mount.path) is None


def test_a_request_in_flight_at_the_kill_is_answered_by_the_successor(
        source, remote, mount_cachefs):
    (source / "slow.bin").write_bytes(b"opened across a restart\n" * 1000)
    mount = mount_cachefs(remote.path, fraction=0.0)
    remote.configure(meta_ms=1500)  # the LOOKUP of the name waits on the remote
    got: list = []

    def read() -> None:
        started = time.monotonic()
        try:
            got.append((Path(mount.path / "slow.bin").read_bytes(), time.monotonic() - started))
        except OSError as exc:
            got.append((exc, 0))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.7)  # the LOOKUP waits on the remote in the serving process
    status = _kill_serving(mount)
    reader.join(30)
    assert got and got[0][0] == (source / "slow.bin").read_bytes(), got
    status = mount.status()
    assert status["serving"]["requests_resent"] >= 1
    assert mount.metric("cachefs_requests_resent_total") >= 1


def test_a_directory_read_across_a_kill_lists_every_name_once(source, remote, mount_cachefs):
    names = sorted(rel.split("/")[1] for rel in make_files(source, 1500, 10, per_dir=1500))
    mount = mount_cachefs(remote.path)
    listing = os.scandir(mount.path / "class0000")  # 60 KiB of entries: several getdents
    try:
        seen = [next(listing).name for _ in range(50)]
        _kill_serving(mount)  # the successor never saw this directory opened
        seen += [entry.name for entry in listing]
    finally:
        listing.close()
    assert sorted(seen) == names
    assert sorted(os.listdir(mount.path / "class0000")) == names


def test_kill_9_during_a_fill_serves_nothing_wrong_and_indexes_nothing_partial(
        source, remote, mount_cachefs):
    data = random.Random(12).randbytes(24 * 2**20)
    (source / "shard.bin").write_bytes(data)
    (source / "small.bin").write_bytes(b"small and whole\n")
    mount = mount_cachefs(remote.path, fraction=1.0)
    assert (mount.path / "small.bin").read_bytes() == b"small and whole\n"
    mount.settle()
    remote.configure(bandwidth_mbps=10)  # a fill of 24 MiB takes over two seconds
    reader = os.open(mount.path / "shard.bin", os.O_RDONLY)
    try:
        assert os.pread(reader, 4096, 0) == data[:4096]
        if mount.hands_over_remote:  # the kernel reads the remote: its fill runs beside it
            wait_for(lambda: fill_under_way(mount), what="the fill under way")
        _kill_serving(mount)
        remote.configure(bandwidth_mbps=0)
        # The open file reads on, across the restart, with the remote's bytes.
        assert os.pread(reader, 2**20, 20 * 2**20) == data[20 * 2**20:21 * 2**20]
    finally:
        os.close(reader)
    status = wait_for(lambda: (st := mount.status())["reconciling"] is False and st,
                      what="the cache reconciled")
    assert status["cache_files"] == 1  # small.bin; nothing of the shard
    assert files_written(mount.cache_dir) == 1
    assert (mount.path / "shard.bin").read_bytes() == data
    mount.settle()
    assert mount.status()["cache_files"] == 2
    mount.stop()
    verify = run_cachefs("verify", "--cache-dir", str(mount.cache_dir), timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_three_restarts_leak_no_descriptors_and_no_backing_ids(source, remote, mount_cachefs):
    small = make_files(source, 40, 16_000, seed=5, per_dir=20)
    mount = mount_cachefs(remote.path, fraction=1.0)
    if not mount.status()["data_path"].startswith("kernel passthrough"):
        pytest.skip("no backing files without passthrough")
    shuffled_read_all(mount.path, small, seed=1)
    shuffled_read_all(mount.path, small, seed=2)  # cached now: every file held registered
    supervisor = mount.supervisor_pid
    supervisor_fds = _fd_count(supervisor)
    serving_fds = [_fd_count(mount.pid)]
    for restart in range(3):
        _kill_serving(mount)
        shuffled_read_all(mount.path, small, seed=10 + restart)
        serving_fds.append(_fd_count(mount.pid))
        assert _fd_count(supervisor) == supervisor_fds
    status = mount.status()
    assert status["serving"]["restarts"] == 3
    assert status["serving"]["backing_ids_closed"] == len(small)  # the predecessor's held
    # Each process registered at most one backing id per file: 4 x 40 ever allocated.
    held = status["memory"]["held_files"]
    assert held == len(small)
    assert max(serving_fds) <= serving_fds[0] + 2, serving_fds
    assert registered_backing_ids(supervisor, highest=1000) == held


# -- cachefs upgrade ----------------------------------------------------------------------------

def _other_checkout(tmp_path: Path) -> Path:
    """A copy of this cachefs under another version number: a daemon of another checkout."""
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "cachefs", checkout / "cachefs",
                    ignore=shutil.ignore_patterns("__pycache__"))
    init = checkout / "cachefs" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "', '__version__ = "9.9.9+'))
    return checkout


def _upgrade(mountpoint: Path, checkout: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), str(REPO / "client")]))
    return subprocess.run([sys.executable, "-m", "cachefs", "upgrade", str(mountpoint)],
                          capture_output=True, text=True, timeout=90, cwd=checkout, env=env)


class _Checked:
    """A DataLoader dataset over the mount: each sample says whether its bytes are the
    remote's; slowed so that an epoch lasts a few seconds."""

    def __init__(self, mount: Path, source: Path, paths: list[str]) -> None:
        self.mount, self.source, self.paths = mount, source, paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> bool:
        rel = self.paths[index]
        with open(self.mount / rel, "rb") as f:
            data = f.read()
        time.sleep(0.03)
        return data == (self.source / rel).read_bytes()


def test_cachefs_upgrade_to_another_checkout_during_a_dataloader_epoch(
        source, remote, mount_cachefs, tmp_path):
    torch = pytest.importorskip("torch")
    paths = make_files(source, 240, (4_000, 32_000), seed=7, per_dir=60)
    mount = mount_cachefs(remote.path, fraction=0.5)
    checkout = _other_checkout(tmp_path)
    loader = torch.utils.data.DataLoader(_Checked(mount.path, source, paths), batch_size=8,
                                         num_workers=4, shuffle=True)

    def epoch(during=None) -> tuple[list[bool], float]:
        before = mount.status()["file_opens"]
        checked = []
        for number, batch in enumerate(loader):
            checked += batch.tolist()
            if number == 2 and during is not None:
                during.start()
            if number == len(loader) // 2 and during is not None:
                # The rest of the epoch after the upgrade, however slow it is to start on a
                # loaded machine: the workers read ahead meanwhile.
                during.join(60)
        mount.settle()
        after = mount.refresh()["file_opens"]
        hits = after["hit"] - (before["hit"] if during is None else 0)
        opens = sum(after.values()) - (sum(before.values()) if during is None else 0)
        return checked, hits / max(opens, 1)

    epoch()  # fills the kept half
    checked, steady = epoch()
    assert all(checked) and steady > 0.3
    old = mount.status()

    upgraded: list = []
    upgrader = threading.Thread(target=lambda: upgraded.append(
        (_upgrade(mount.path, checkout), time.monotonic())))
    checked, _ratio = epoch(during=upgrader)  # an error in a worker fails the epoch
    epoch_end = time.monotonic()
    upgrader.join(60)
    result, finished = upgraded[0]
    assert result.returncode == 0, result.stderr + mount.log_tail()
    assert finished < epoch_end  # the upgrade happened during the epoch
    assert len(checked) == len(paths) and all(checked)
    new = mount.refresh()
    assert new["version"].startswith("9.9.9+") and old["version"] == new["version"][6:]
    assert new["pid"] != old["pid"] and new["supervisor_pid"] != old["supervisor_pid"]
    assert wait_gone(old["supervisor_pid"], 10) and not alive(old["pid"])
    print(f"\n{result.stdout.strip()}")
    checked, after_upgrade = epoch()  # counted in the new process alone: a whole epoch
    assert all(checked)
    assert after_upgrade == pytest.approx(steady, abs=0.01)
    # The new daemon stops cleanly: unmounted, no process left.
    result = run_cachefs("unmount", str(mount.path))
    assert result.returncode == 0, result.stderr
    assert find_mount(mount.path) is None and wait_gone(new["supervisor_pid"], 10)


def test_upgrade_refuses_what_it_cannot_do_in_one_line(tmp_path):
    (tmp_path / "plain").mkdir()
    result = run_cachefs("upgrade", str(tmp_path / "plain"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"cachefs upgrade: {tmp_path / 'plain'} is not a cachefs mount (not mounted)"]


def test_only_the_daemons_user_may_take_its_mount(source, remote, mount_cachefs):
    (source / "a.bin").write_bytes(b"a")
    mount = mount_cachefs(remote.path)
    ask = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
           "s.sendall(b'HANDOVER\\n'); line, fds, _f, _a = socket.recv_fds(s, 4096, 4); "
           "print(line.decode().strip(), len(fds))")
    result = as_nobody(ask, os.readlink(mount.path / ".cachefs.sock"))
    assert result.returncode == 0, result.stderr
    line, count = result.stdout.strip().rsplit(" ", 1)
    assert json.loads(line) == {"ok": False,
                                "error": "only the daemon's own user may take its mount over"}
    assert count == "0"
    assert (mount.path / "a.bin").read_bytes() == b"a"  # still serving, nothing handed


def test_the_mount_is_let_go_only_for_the_token_of_its_handover(source, remote, mount_cachefs):
    """A client of the daemon's user that asks for the descriptor and then says RELINQUISH
    without the token of the reply (a script sending commands blindly) does not end it."""
    (source / "a.bin").write_bytes(b"a")
    mount = mount_cachefs(remote.path)
    pid = mount.status()["pid"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(os.readlink(mount.path / ".cachefs.sock"))
        sock.sendall(b"HANDOVER\n")
        line, fds, _flags, _addr = socket.recv_fds(sock, 4096, 4)
        for fd in fds:
            os.close(fd)
        assert json.loads(line)["ok"] and len(fds) == 1
        reader = sock.makefile("rb")
        for asked in (b"RELINQUISH\n", b"RELINQUISH 0123456789abcdef\n"):
            sock.sendall(asked)
            assert json.loads(reader.readline()) == {
                "ok": False, "error": "RELINQUISH needs the token HANDOVER gave"}
    assert (mount.path / "a.bin").read_bytes() == b"a"  # still serving
    assert mount.status()["pid"] == pid and alive(pid)


# -- a rolling update's new pod (cachefs mount --take-over) -------------------------------------

def _status_or_none(mount) -> dict | None:
    try:
        return mount.status()
    except RuntimeError:
        return None


def _in_another_pid_namespace(*args: str) -> subprocess.CompletedProcess:
    """The cachefs CLI run as from another container: in a PID namespace of its own."""
    return subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-m", "cachefs",
                           *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_a_new_pod_takes_the_mount_from_the_old_one_and_the_old_one_lets_go(
        source, remote, tmp_path):
    """deploy/kubernetes/daemonset.yaml's rolling update on one machine: a second `cachefs mount
    --foreground --take-over` of the same settings takes the mount from the running one (as
    cachefs upgrade's new daemon does), which then waits, holding nothing, until it is stopped,
    so that its container is not started again; each pod's probe and preStop tell their own
    daemon from the other's by its PID namespace."""
    small = make_files(source, 60, (4_000, 32_000), seed=11, per_dir=30)
    mount = CachefsMount(remote.path, tmp_path / "mnt", tmp_path / "cache", tmp_path / "mnt.log",
                         {"cache_size": "1G", "metrics_addr": "127.0.0.1:0", "fraction": 0.5,
                          "take_over": True})
    mount.path.mkdir()
    command = [sys.executable, "-m", "cachefs", *mount.command(), "--foreground"]

    def start_pod() -> subprocess.Popen:
        pods.append(subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True))
        return pods[-1]

    with _pods(mount) as pods:
        old_pod = start_pod()  # nothing to take over: it mounts
        old = wait_for(lambda: _status_or_none(mount), timeout=60, what="the old pod serving")
        assert old["supervisor_pid"] == old_pod.pid
        assert old["serving"]["taken_over_from"] is None
        shuffled_read_all(mount.path, small, seed=1)
        plan = [("read", small), ("mmap", small), ("read", small[:30]), ("read", small[30:])]
        readers = Readers(mount.path, source, plan, seconds=6)
        try:
            time.sleep(1.5)
            new_pod = start_pod()
            new = wait_for(lambda: (st := _status_or_none(mount)) and
                           st["supervisor_pid"] == new_pod.pid and st, timeout=60,
                           what="the new pod serving")
            results = readers.results(timeout=60)
        finally:
            readers.kill()
        mount.pid, mount.supervisor_pid = new["pid"], new["supervisor_pid"]
        assert new["serving"]["taken_over_from"] == "daemon"
        assert wait_gone(old["pid"], 10)
        assert old_pod.poll() is None  # the old pod's supervisor waits to be stopped
        assert [r["errors"] for r in results] == [[]] * 4
        assert sum(r["wrong"] for r in results) == 0, [r["wrong_reads"][:3] for r in results]
        longest = max(r["max_wait"] for r in results)
        print(f"\nthe new pod took the mount over: longest reader wait {longest * 1000:.0f} ms")

        # The new pod's startup probe passes here and fails from another container.
        assert run_cachefs("status", "--served-here", str(mount.path)).returncode == 0
        elsewhere = _in_another_pid_namespace("status", "--served-here", str(mount.path))
        assert elsewhere.returncode == 1
        assert elsewhere.stderr.startswith(
            f"cachefs status: {mount.path} is served by a daemon in another PID namespace")
        # The old pod is deleted: its preStop leaves the new pod's mount, SIGTERM ends it.
        prestop = _in_another_pid_namespace("unmount", "--if-served-here", str(mount.path))
        assert prestop.returncode == 0, prestop.stderr
        assert prestop.stderr.strip() == (f"cachefs unmount: {mount.path} left mounted: another "
                                          "container's daemon serves it now")
        old_pod.send_signal(signal.SIGTERM)
        assert old_pod.wait(30) == 0
        assert (mount.path / small[0]).read_bytes() == (source / small[0]).read_bytes()
        assert mount.status()["supervisor_pid"] == new_pod.pid

        # The new pod's own preStop unmounts, and it exits.
        result = run_cachefs("unmount", "--if-served-here", str(mount.path))
        assert result.returncode == 0, result.stderr
        assert find_mount(mount.path) is None
        assert new_pod.wait(30) == 0


@contextlib.contextmanager
def _pods(mount: CachefsMount) -> Iterator[list[subprocess.Popen]]:
    """The pods (daemons started with --foreground) a test runs on ``mount``: on a failure the
    log's tail is shown; at the end the mount is detached if it is still there, and every pod
    still running killed, with what it runs (a pod in a PID namespace of its own runs the
    daemon as its child)."""
    pods: list[subprocess.Popen] = []
    try:
        yield pods
    except BaseException:
        sys.stderr.write(f"\n--- cachefs log ---\n{mount.log_tail()}\n")
        raise
    finally:
        if find_mount(mount.path) is not None:
            run_cachefs("unmount", "--lazy", str(mount.path))
        for pod in pods:
            if pod.poll() is None:
                for child in _children(pod.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child, signal.SIGKILL)
                pod.kill()
            pod.wait(30)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except FileNotFoundError:  # it has just exited
        return []


def test_a_new_pod_in_a_pid_namespace_of_its_own_takes_the_mount_over(source, remote, tmp_path):
    """Pods are containers with PID namespaces of their own, siblings: the new pod's daemon sees
    no pid for the old pod's serving process (SO_PEERCRED says 0) and waits for the end of its
    control connection instead; the old one's own pid, which names another process here or
    none, is not waited for."""
    small = make_files(source, 40, (4_000, 32_000), seed=12, per_dir=20)
    mount = CachefsMount(remote.path, tmp_path / "mnt", tmp_path / "cache", tmp_path / "mnt.log",
                         {"cache_size": "1G", "metrics_addr": "127.0.0.1:0", "fraction": 0.5,
                          "take_over": True})
    mount.path.mkdir()
    command = ["unshare", "--pid", "--fork", sys.executable, "-m", "cachefs", *mount.command(),
               "--foreground"]
    own_namespace = os.readlink("/proc/self/ns/pid")
    with _pods(mount) as pods:
        pods.append(subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True))
        old = wait_for(lambda: _status_or_none(mount), timeout=60, what="the old pod serving")
        assert old["supervisor_pid"] == 1 and old["pid_namespace"] != own_namespace
        shuffled_read_all(mount.path, small, seed=1)
        readers = Readers(mount.path, source, [("read", small), ("mmap", small)], seconds=5)
        try:
            time.sleep(1.0)
            pods.append(subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, text=True))
            new = wait_for(lambda: (st := _status_or_none(mount)) and
                           st["pid_namespace"] not in (old["pid_namespace"], own_namespace)
                           and st, timeout=60, what="the new pod serving")
            results = readers.results(timeout=60)
        finally:
            readers.kill()
        assert new["serving"]["taken_over_from"] == "daemon"
        assert [r["errors"] for r in results] == [[]] * 2
        assert sum(r["wrong"] for r in results) == 0, [r["wrong_reads"][:3] for r in results]
        assert "did not exit" not in mount.log_file.read_text()
        [old_supervisor] = _children(pods[0].pid)  # the old pod's PID 1, as seen here
        assert pods[0].poll() is None  # waiting to be stopped
        os.kill(old_supervisor, signal.SIGTERM)
        assert pods[0].wait(30) == 0
        assert (mount.path / small[0]).read_bytes() == (source / small[0]).read_bytes()
        result = run_cachefs("unmount", str(mount.path))
        assert result.returncode == 0, result.stderr
        assert pods[1].wait(30) == 0
