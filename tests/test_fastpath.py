"""The fast path (``cachefs_client.read_file``): a local file's bytes straight from the
daemon, with every guarantee of a read through the mount."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from cachefs_client import read_file, read_files
from tests.conftest import REPO, make_files, process_figures, wait_for


def control_socket(mount) -> str:
    return os.readlink(mount.path / ".cachefs.sock")


def served(mount, source: str) -> float:
    return mount.metric("cachefs_read_bytes_total", source=source)


@pytest.mark.fast
def test_cached_files_come_from_the_daemon_and_match(source, remote, mount_cachefs):
    rels = make_files(source, 30, size=(0, 9 * 2**20 // 30))
    (source / "empty.bin").write_bytes(b"")
    (source / "big.bin").write_bytes(os.urandom(9 * 2**20))  # three chunks
    rels += ["empty.bin", "big.bin"]
    mount = mount_cachefs(remote.path, cache_size="256MiB")
    for rel in rels:  # the first read goes through the mount and fills the cache
        assert read_file(mount.path / rel) == (source / rel).read_bytes()
    misses = mount.metric("cachefs_file_opens_total", result="miss")
    hits = mount.metric("cachefs_file_opens_total", result="hit")
    cache_bytes = served(mount, "cache")
    remote_bytes = mount.metric("cachefs_remote_read_bytes_total")
    for rel in rels:
        assert read_file(mount.path / rel) == (source / rel).read_bytes()
    assert mount.metric("cachefs_file_opens_total", result="hit") - hits == len(rels)
    assert mount.metric("cachefs_file_opens_total", result="miss") == misses
    assert mount.metric("cachefs_remote_read_bytes_total") == remote_bytes
    assert served(mount, "cache") - cache_bytes == sum((source / r).stat().st_size
                                                       for r in rels)


def test_errors_are_those_of_the_mount(source, mount_cachefs):
    make_files(source, 2, size=100)
    mount = mount_cachefs(source, cache_size="64MiB")
    with pytest.raises(FileNotFoundError):
        read_file(mount.path / "no-such-file")
    with pytest.raises(IsADirectoryError):
        read_file(mount.path / "class0000")
    assert read_file(mount.path / "class0000/../class0000/img000001.bin") == \
        (source / "class0000/img000001.bin").read_bytes()


def test_prefetched_files_are_taken_from_staging(source, remote, mount_cachefs):
    """f = 0: nothing is cached, but a hinted file is staged and handed over once."""
    rels = make_files(source, 5, size=50_000)
    mount = mount_cachefs(remote.path, cache_size="64MiB", fraction=0.0)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(control_socket(mount))
        sock.sendall(b"".join(b"HINT " + r.encode() + b"\n" for r in rels))
    deadline = time.monotonic() + 20
    while mount.metric("cachefs_staging_bytes") < 5 * 50_000 and time.monotonic() < deadline:
        time.sleep(0.05)
    for rel in rels:
        assert read_file(mount.path / rel) == (source / rel).read_bytes()
    assert served(mount, "prefetch") == 5 * 50_000
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == 5
    # Taken once: the next read is an ordinary miss through the mount.
    assert read_file(mount.path / rels[0]) == (source / rels[0]).read_bytes()
    assert mount.metric("cachefs_file_opens_total", result="miss") == 1


def test_a_corrupt_chunk_is_never_handed_over(source, remote, mount_cachefs):
    (source / "a.bin").write_bytes(os.urandom(100_000))
    mount = mount_cachefs(remote.path, cache_size="64MiB")
    assert read_file(mount.path / "a.bin") == (source / "a.bin").read_bytes()
    mount.settle()
    [chunk] = [p for p in (mount.cache_dir / "data").rglob("*") if p.is_file()]
    raw = bytearray(chunk.read_bytes())
    raw[500] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    assert read_file(mount.path / "a.bin") == (source / "a.bin").read_bytes()
    assert mount.metric("cachefs_integrity_failures_total") == 1


def open_request(mount, rel: str) -> tuple[dict, bytes | None]:
    """A raw OPEN request: the reply line and the bytes read from the descriptor it
    carried (None when none came)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(control_socket(mount))
        sock.sendall(b"OPEN " + rel.encode() + b"\n")
        line, fds, _, _ = socket.recv_fds(sock, 65536, 4)
        try:
            assert len(fds) <= 1
            data = os.pread(fds[0], 1 << 20, 0) if fds else None
        finally:
            for fd in fds:
                os.close(fd)
    return json.loads(line), data


def test_a_cached_file_is_handed_over_as_a_descriptor(source, remote, mount_cachefs):
    payload = os.urandom(300_000)
    (source / "a.bin").write_bytes(payload)
    mount = mount_cachefs(remote.path, cache_size="64MiB")
    reply, data = open_request(mount, "a.bin")
    if mount.hands_over_remote:  # not cached yet: the remote's own file, copied meanwhile
        assert reply == {"ok": True, "size": len(payload), "result": "miss", "fd": 1}
        assert data == payload
        mount.settle()
    else:
        assert reply == {"ok": False, "error": "not local"} and data is None  # not cached yet
        assert read_file(mount.path / "a.bin") == payload  # through the mount: cached now
    hits = mount.metric("cachefs_file_opens_total", result="hit")
    fds_before = process_figures(mount.pid)["fds"]
    for _ in range(50):
        reply, data = open_request(mount, "a.bin")
        assert data == payload
        assert reply == {"ok": True, "size": len(payload), "result": "hit", "fd": 1}
    assert mount.metric("cachefs_file_opens_total", result="hit") - hits == 50
    # Every descriptor closed (polled: the metrics request just made may still hold its
    # connection for a moment).
    wait_for(lambda: process_figures(mount.pid)["fds"] <= fds_before, timeout=5,
             what="the daemon's descriptors back to their number before")


def test_a_batch_comes_in_one_exchange_and_matches(tmp_path, source, remote, mount_cachefs):
    """read_files: 150 cached files (more descriptors than the daemon sends in one
    message), some not cached, one missing, one off the mount: each result is what a
    read of that file gives, in order."""
    rels = make_files(source, 150, size=(1, 20_000))
    (source / "late.bin").write_bytes(os.urandom(5000))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not on the mount")
    mount = mount_cachefs(remote.path, cache_size="64MiB")
    for rel in rels:
        read_file(mount.path / rel)
    mount.settle()  # cached now: each was filled beside its reader
    hits = mount.metric("cachefs_file_opens_total", result="hit")
    paths = [mount.path / rel for rel in rels] + [mount.path / "late.bin", outside]
    assert read_files(paths) == [(source / rel).read_bytes() for rel in rels] \
        + [(source / "late.bin").read_bytes(), outside.read_bytes()]
    assert mount.metric("cachefs_file_opens_total", result="hit") - hits == len(rels)
    assert mount.metric("cachefs_file_opens_total", result="miss") == len(rels) + 1
    with pytest.raises(FileNotFoundError):
        read_files([mount.path / rels[0], mount.path / "missing.bin"])


@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_a_batch_waits_for_its_hints_turn_and_shares_those_fetches(source, remote,
                                                                   mount_cachefs, fraction):
    """A DataLoader worker asks for its whole batch at once while the hints of its files
    still wait for the prefetch: the batch waits for the prefetch to take them, in the order
    they were hinted, and shares those fetches.  No hint is passed by its reader, and every
    file comes from the remote once, kept (f = 1) or not (f = 0)."""
    from cachefs_client import send_hints

    rels = make_files(source, 24, size=100_000)
    (source / "blocker.bin").write_bytes(b"b" * 1000)
    mount = mount_cachefs(remote.path, cache_size="64MiB", fraction=fraction,
                          prefetch_concurrency=1)
    for rel in [*rels, "blocker.bin"]:
        os.stat(mount.path / rel)  # looked up: a prefetch goes straight to the open
    remote.configure(open_ms=2)  # opens with a round trip: the workers set the order
    remote.set_fault("hang", ops=["open"], glob="blocker.bin")
    got: dict[str, list[bytes]] = {}
    batch = rels[12:]  # the second batch: the first one's hints are ahead of it
    reader = threading.Thread(
        target=lambda: got.update(batch=read_files([mount.path / rel for rel in batch])))
    try:
        assert send_hints([mount.path / "blocker.bin"]) == 1
        wait_for(lambda: remote.stats()["hung_now"] == 1, what="the one worker held")
        assert send_hints([mount.path / rel for rel in rels]) == len(rels)
        wait_for(lambda: mount.metric("cachefs_prefetch_queued_files") == len(rels),
                 what="the hints queued")
        reader.start()
        time.sleep(0.5)
        assert reader.is_alive(), "the batch did not wait for its hints' turn"
    finally:
        remote.clear_faults()
        if reader.ident is not None:  # started
            reader.join(timeout=60)
    assert got["batch"] == [(source / rel).read_bytes() for rel in batch]
    assert read_files([mount.path / rel for rel in rels[:12]]) == \
        [(source / rel).read_bytes() for rel in rels[:12]]
    wait_for(lambda: mount.metric("cachefs_hints_total", result="accepted") == len(rels) + 1,
             what="every hint acted on")
    assert mount.metric("cachefs_hints_total", result="dropped") == 0
    mount.settle()
    # Fetched once, not once by the batch and again by the prefetch (within a file: a
    # reader that came as its hint was taken, beside the read-in, may fetch a page twice).
    total = sum((source / rel).stat().st_size for rel in rels) + 1000
    assert total <= remote.stats()["read_bytes"] < total + 100_000
    assert total - 100_000 < mount.metric("cachefs_remote_read_bytes_total") < total + 100_000


def test_a_batch_takes_what_its_hint_staged_past_the_next_epochs_hint(source, remote,
                                                                       mount_cachefs):
    """The next epoch's hints come as this one starts: a file whose hint for this epoch was
    acted on (staged) has a second hint queued, far behind.  Its batch takes the staged copy
    without waiting for that hint's turn, and leaves it queued for the next read."""
    from cachefs_client import send_hints

    data = os.urandom(100_000)
    (source / "z.bin").write_bytes(data)
    (source / "blocker.bin").write_bytes(b"b" * 1000)
    mount = mount_cachefs(remote.path, cache_size="64MiB", fraction=0.0,
                          prefetch_concurrency=1)
    for rel in ("z.bin", "blocker.bin"):
        os.stat(mount.path / rel)
    remote.configure(open_ms=2)
    assert send_hints([mount.path / "z.bin"]) == 1
    wait_for(lambda: mount.metric("cachefs_hints_total", result="accepted") == 1,
             what="z.bin staged")
    remote.set_fault("hang", ops=["open"], glob="blocker.bin")
    got: dict[str, list[bytes]] = {}
    reader = threading.Thread(
        target=lambda: got.update(batch=read_files([mount.path / "z.bin"])))
    try:
        assert send_hints([mount.path / "blocker.bin", mount.path / "z.bin"]) == 2
        wait_for(lambda: remote.stats()["hung_now"] == 1, what="the one worker held")
        wait_for(lambda: mount.metric("cachefs_prefetch_queued_files") == 1,
                 what="the next epoch's hint queued")
        reader.start()
        reader.join(timeout=10)  # while the worker is still held
        assert not reader.is_alive(), "the batch waited for the next epoch's hint"
    finally:
        remote.clear_faults()
        if reader.ident is not None:  # started
            reader.join(timeout=60)
    assert got["batch"] == [data]
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == 1
    wait_for(lambda: mount.metric("cachefs_hints_total", result="accepted") == 3,
             what="z.bin staged again for its next read")
    assert read_files([mount.path / "z.bin"]) == [data]
    assert mount.metric("cachefs_file_opens_total", result="prefetched") == 2
    assert mount.metric("cachefs_hints_total", result="dropped") == 0


@pytest.mark.parametrize("damage", ["truncate", "delete", "grow"])
def test_a_damaged_chunk_file_is_never_handed_over(source, remote, mount_cachefs, damage):
    (source / "a.bin").write_bytes(os.urandom(100_000))
    mount = mount_cachefs(remote.path, cache_size="64MiB")
    assert read_file(mount.path / "a.bin") == (source / "a.bin").read_bytes()
    mount.settle()
    [chunk] = [p for p in (mount.cache_dir / "data").rglob("*") if p.is_file()]
    if damage == "truncate":
        os.truncate(chunk, 99_000)
    elif damage == "delete":
        chunk.unlink()
    else:
        with open(chunk, "ab") as f:
            f.write(b"x")
    assert read_file(mount.path / "a.bin") == (source / "a.bin").read_bytes()
    assert mount.metric("cachefs_integrity_failures_total") == 1
    # Refetched and stored again: the next read is a verified hit.
    assert read_file(mount.path / "a.bin") == (source / "a.bin").read_bytes()
    assert mount.metric("cachefs_integrity_failures_total") == 1


def test_a_changed_file_is_not_served_stale(source, remote, mount_cachefs):
    (source / "a.bin").write_bytes(b"old" * 1000)
    mount = mount_cachefs(remote.path, cache_size="64MiB", revalidate=1)
    assert read_file(mount.path / "a.bin") == b"old" * 1000
    assert read_file(mount.path / "a.bin") == b"old" * 1000
    (source / "a.bin").write_bytes(b"new!" * 1000)
    time.sleep(1.5)
    assert read_file(mount.path / "a.bin") == b"new!" * 1000


def test_a_daemon_without_the_fast_path_falls_back(tmp_path, source, mount_cachefs):
    """A server that answers READ with nonsense: the bytes come through the mount."""
    make_files(source, 1, size=300)
    mount = mount_cachefs(source, cache_size="64MiB")
    rel = "class0000/img000000.bin"
    assert read_file(mount.path / rel) == (source / rel).read_bytes()
    result = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT, str(mount.path / rel)],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(300)


FALLBACK_SCRIPT = """
import sys, warnings
from cachefs_client import fastpath
reader = fastpath.reader_for(fastpath.process_state().paths.locate(sys.argv[1])[0])
class Garbage:
    def readline(self, limit): return b"not json\\n"
    def close(self): pass
reader._connect_locked()
reader._replies = Garbage()
with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    print(len(fastpath.read_file(sys.argv[1])))
"""


@pytest.fixture
def shared_dirs():
    """Directories every user may traverse (pytest's own tmp dirs are root-only)."""
    base = Path(tempfile.mkdtemp(prefix="cachefs-perm-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


AS_NOBODY = """
import errno, json, os, socket, sys
from cachefs_client.fastpath import read_file
path, sock_path, rel = sys.argv[1:]
out = {}
try:
    read_file(path)
    out["read_file"] = "ok"
except OSError as exc:
    out["read_file"] = errno.errorcode[exc.errno]
with socket.socket(socket.AF_UNIX) as s:
    s.connect(sock_path)
    s.sendall(b"READ " + rel.encode() + b"\\n")
    out["reply"] = json.loads(s.makefile("rb").readline())
with socket.socket(socket.AF_UNIX) as s:
    s.connect(sock_path)
    s.sendall(b"OPEN " + rel.encode() + b"\\n")
    line, fds, _, _ = socket.recv_fds(s, 65536, 4)
    out["open_reply"], out["open_fds"] = json.loads(line), len(fds)
print(json.dumps(out))
"""


def test_the_daemon_checks_who_asks(shared_dirs, mount_cachefs):
    """A user who may not read a file gets EACCES, from the daemon as from the kernel."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to run as another user")
    backing = shared_dirs / "backing"
    backing.mkdir(mode=0o755)
    (backing / "secret.bin").write_bytes(b"private" * 100)
    (backing / "secret.bin").chmod(0o600)
    # The client's fast path, where that user can import it from (this checkout and the
    # site-packages with torch may be out of its reach).
    lib = shared_dirs / "lib" / "cachefs_client"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("")
    for module in ("_control.py", "_daemon.py", "_paths.py", "fastpath.py"):
        shutil.copy(REPO / "client" / "cachefs_client" / module, lib / module)
    mount = mount_cachefs(backing, name=str(shared_dirs / "mnt"), cache_dir=shared_dirs / "cache",
                          cache_size="64MiB", allow_other=True)
    # Reading it as root puts it in the cache: only permissions stand in the way now.
    assert read_file(mount.path / "secret.bin") == b"private" * 100
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         sys.executable, "-c", AS_NOBODY, str(mount.path / "secret.bin"),
         control_socket(mount), "secret.bin"],
        capture_output=True, text=True, timeout=60, cwd=str(shared_dirs),
        env={**os.environ, "PYTHONPATH": str(shared_dirs / "lib")})
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["read_file"] == errno.errorcode[errno.EACCES]
    assert out["reply"]["ok"] is False and "size" not in out["reply"]
    assert out["open_reply"]["ok"] is False and out["open_fds"] == 0
