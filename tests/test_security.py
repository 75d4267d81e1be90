"""Who may read what through a mount and its control socket: the kernel enforces the remote's
permission bits for other users, hints and warm requests never reach outside BACKING nor past
the caller's own permissions, the cache and the metrics reveal nothing, and a flood of junk on
the control socket is shrugged off."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from cachefs.control.server import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_USER, MAX_LINE_BYTES
from cachefs.prefetch.prefetcher import MAX_QUEUED_HINTS
from tests.conftest import (
    CachefsMount,
    closed_by_server,
    control_socket_path,
    make_files,
    process_figures,
    run_cachefs,
    shuffled_read_all,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)

NOBODY = 65534

# Runs as an unprivileged user: reads a file, prints "ok <sha256>" or "errno <n>".
READER = """
import hashlib, sys
try:
    data = open(sys.argv[1], "rb").read()
except OSError as exc:
    print("errno", exc.errno)
else:
    print("ok", hashlib.sha256(data).hexdigest())
"""

# Runs as an unprivileged user: sends request lines to a control socket, prints the replies
# of the ones that get one (argv: socket, then "HINT x" / "FETCH x" lines).
CONTROL_CLIENT = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(30)
sock.connect(sys.argv[1])
for line in sys.argv[2:]:
    sock.sendall(line.encode("utf-8", "surrogateescape") + b"\\n")
    if line.startswith("FETCH"):
        reply = b""
        while not reply.endswith(b"\\n"):
            reply += sock.recv(65536)
        sys.stdout.write(reply.decode())
sock.close()
"""


def as_nobody(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=60, cwd="/")


def read_as_nobody(path: Path) -> str:
    result = as_nobody(READER, str(path))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def shared_base() -> Path:
    """A directory every user may traverse (pytest's tmp_path is private to root)."""
    base = Path(tempfile.mkdtemp(prefix="cachefs-shared-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base
    subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


@pytest.fixture
def shared_mount(tmp_path: Path, shared_base: Path, request):
    """Factory: a cachefs mount of ``backing`` at a mount point other users can reach."""
    mounts: list[CachefsMount] = []

    def factory(backing: Path, **options) -> CachefsMount:
        options.setdefault("cache_size", "256MiB")
        options.setdefault("metrics_addr", "127.0.0.1:0")
        name = f"mnt{len(mounts)}"
        mount = CachefsMount(backing, shared_base / name, tmp_path / f"cache{len(mounts)}",
                             tmp_path / f"{name}.log", options)
        mounts.append(mount)
        return mount.start()

    yield factory
    for mount in mounts:
        if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
            sys.stderr.write(f"\n--- cachefs log of {mount.path} ---\n{mount.log_tail()}\n")
        mount.stop()


def build_private_tree(root: Path) -> dict[str, bytes]:
    rng = random.Random(9)
    files = {"public.bin": 0o644, "secret.bin": 0o600, "private/inner.bin": 0o644,
             "group_only.bin": 0o640}
    contents = {}
    (root / "private").mkdir()
    os.chmod(root / "private", 0o700)
    for rel, mode in files.items():
        contents[rel] = rng.randbytes(20_000)
        (root / rel).write_bytes(contents[rel])
        os.chmod(root / rel, mode)
    return contents


# -- the kernel enforces the remote's permission bits -------------------------------------------

def test_allow_other_enforces_the_remote_permission_bits(shared_base, shared_mount):
    backing = shared_base / "backing"
    backing.mkdir(mode=0o755)
    contents = build_private_tree(backing)
    mount = shared_mount(backing, allow_other=True)
    # Root reads everything first, so every file is in the cache: the cache must not become
    # a way around the permission bits.
    for rel, data in contents.items():
        assert (mount.path / rel).read_bytes() == data
    mount.settle()  # a miss handed to the kernel is copied into the cache beside its reader
    assert mount.metric("cachefs_cache_files") == len(contents)

    assert read_as_nobody(mount.path / "public.bin") == f"ok {sha(contents['public.bin'])}"
    for rel in ("secret.bin", "private/inner.bin", "group_only.bin"):
        assert read_as_nobody(mount.path / rel) == f"errno {errno.EACCES}", rel
    listing = as_nobody("import os,sys; print(sorted(os.listdir(sys.argv[1])))",
                        str(mount.path / "private"))
    assert "Permission denied" in listing.stderr


def test_without_allow_other_other_users_cannot_enter_the_mount(shared_base, shared_mount):
    backing = shared_base / "backing"
    backing.mkdir(mode=0o755)
    contents = build_private_tree(backing)
    mount = shared_mount(backing)
    assert (mount.path / "public.bin").read_bytes() == contents["public.bin"]
    assert read_as_nobody(mount.path / "public.bin") == f"errno {errno.EACCES}"


# -- hints and warm requests stay inside the tree and inside the caller's rights ------------------

def hint_results(mount) -> dict[str, float]:
    m = mount.metrics()
    return {key[1][0][1]: value for key, value in m.items() if key[0] == "cachefs_hints_total"}


def send_lines(sock_path: str, lines: list[bytes]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(sock_path)
        sock.sendall(b"".join(line + b"\n" for line in lines))
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):  # replies to the lines that are not hints
            pass


def test_hints_and_warm_never_reach_outside_backing(tmp_path, source, remote, mount_cachefs):
    secret = tmp_path / "outside-secret.bin"  # beside the remote's directory, not in it
    secret.write_bytes(b"must never be read through cachefs\n" * 100)
    (source / "inside.bin").write_bytes(b"inside the tree\n" * 100)
    (source / "sub").mkdir()
    os.symlink(str(secret), source / "link_absolute")
    os.symlink("../outside-secret.bin", source / "link_relative_out")
    os.symlink("../../outside-secret.bin", source / "sub" / "link_relative_out")
    os.symlink("/etc", source / "link_to_etc")
    os.symlink("link_loop", source / "link_loop")
    os.symlink("inside.bin", source / "link_inside")
    (source / "new\nline.bin").write_bytes(b"a name no request line can carry\n")
    mount = mount_cachefs(remote.path, fraction=1.0)
    sock = control_socket_path(mount.path)
    mnt = os.fsencode(mount.path)
    bad = [
        b"../outside-secret.bin", b"sub/../../outside-secret.bin", b"/etc/passwd",
        os.fsencode(secret), os.fsencode(source / "inside.bin"),  # the same file, not via mount
        mnt + b"/../outside-secret.bin", mnt + b"x/inside.bin", b"link_absolute",
        b"link_relative_out", b"sub/link_relative_out", b"link_to_etc/passwd", b"link_loop",
        b"inside.bin\0/etc/passwd", b"", b".", b"..", b"/", b"sub", b"x" * 5000,
        b"new\nline.bin",  # two lines on the wire: "HINT new" and "line.bin"
    ]
    split = sum(path.count(b"\n") for path in bad)  # extra lines, unknown commands
    invalid = len(bad) + split
    stats_before, hints_before = remote.stats(), hint_results(mount)
    send_lines(sock, [b"HINT " + path for path in bad])
    wait_for(lambda: hint_results(mount)["invalid"] - hints_before["invalid"] >= invalid,
             what="every bad hint counted invalid")
    # FETCH (what `cachefs warm` sends) with the same paths, and warm itself.
    for path in bad:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(sock)
            conn.sendall(b"FETCH " + path + b"\n")
            reply = json.loads(conn.makefile("rb").readline())
        assert reply["ok"] is False, (path, reply)
        assert "must never be read" not in json.dumps(reply)
    listing = tmp_path / "warm.list"
    listing.write_bytes(b"".join(p + b"\n" for p in bad if p and b"\0" not in p))
    warm = run_cachefs("warm", str(mount.path), "--list", str(listing))
    assert warm.returncode == 1
    assert "0 fetched" in warm.stdout
    assert "must never be read" not in warm.stdout + warm.stderr

    stats_after = remote.stats()
    assert stats_after["read_bytes"] == stats_before["read_bytes"]
    assert stats_after["opens"] == stats_before["opens"]
    assert mount.metric("cachefs_remote_read_bytes_total") == 0
    assert mount.metric("cachefs_cache_files") == 0
    hints = hint_results(mount)
    assert hints["invalid"] - hints_before["invalid"] == invalid + split  # + FETCH's split
    assert hints["accepted"] == hints_before["accepted"]

    # The channel works for what is inside: a symlink staying in the tree is followed.
    send_lines(sock, [b"HINT link_inside"])
    wait_for(lambda: mount.metric("cachefs_cache_files") == 1, what="the inside file fetched")
    assert remote.stats()["read_bytes"] - stats_after["read_bytes"] == \
        len((source / "inside.bin").read_bytes())


def test_unprivileged_hints_fetch_only_what_the_caller_may_read(source, remote, mount_cachefs):
    contents = build_private_tree(source)
    mount = mount_cachefs(remote.path, fraction=1.0)
    sock = control_socket_path(mount.path)
    before = remote.stats()["read_bytes"]

    denied = ["secret.bin", "private/inner.bin", "group_only.bin"]
    result = as_nobody(CONTROL_CLIENT, sock, *[f"HINT {rel}" for rel in denied],
                       *[f"FETCH {rel}" for rel in denied])
    assert result.returncode == 0, result.stderr
    replies = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(replies) == len(denied) and not any(r["ok"] for r in replies), replies
    wait_for(lambda: hint_results(mount)["invalid"] >= len(denied), what="hints judged")
    assert remote.stats()["read_bytes"] == before
    assert mount.metric("cachefs_cache_files") == 0

    # What nobody may read is fetched for nobody; what root may read, for root.
    result = as_nobody(CONTROL_CLIENT, sock, "HINT public.bin")
    assert result.returncode == 0, result.stderr
    wait_for(lambda: mount.metric("cachefs_cache_files") == 1, what="public.bin fetched")
    send_lines(sock, [b"HINT secret.bin"])
    wait_for(lambda: mount.metric("cachefs_cache_files") == 2, what="secret.bin fetched")
    assert remote.stats()["read_bytes"] - before == \
        len(contents["public.bin"]) + len(contents["secret.bin"])
    assert hint_results(mount)["invalid"] == len(denied)


def test_a_hint_lists_no_directory_outside_the_tree_or_beyond_the_caller(
        tmp_path, source, remote, mount_cachefs):
    """A hinted file's directory is listed (to refresh its attributes in one pass) only when
    it is reached through directories the caller may search: never through a symlink, which
    could lead out of the tree, nor into a directory the caller may not enter."""
    from bench.emulator.remote import EmulatedRemote

    build_private_tree(source)
    (source / "open").mkdir()
    (source / "open" / "a.bin").write_bytes(b"listed for anyone\n")
    elsewhere_source = tmp_path / "elsewhere-source"
    (elsewhere_source / "dir").mkdir(parents=True)
    (elsewhere_source / "dir" / "x.bin").write_bytes(b"outside the tree\n")
    (tmp_path / "elsewhere").mkdir()
    elsewhere = EmulatedRemote(elsewhere_source, tmp_path / "elsewhere", profile="local",
                               log_file=tmp_path / "elsewhere.log").start()
    try:
        os.symlink(str(elsewhere.path / "dir"), source / "link_out")
        mount = mount_cachefs(remote.path, fraction=1.0)
        sock = control_socket_path(mount.path)

        def listings(emulator=remote) -> int:
            return emulator.stats()["ops"].get("readdir", 0)

        before, outside = listings(), listings(elsewhere)  # (its start lists its root)
        result = as_nobody(CONTROL_CLIENT, sock, "HINT private/inner.bin")
        assert result.returncode == 0, result.stderr
        send_lines(sock, [b"HINT link_out/x.bin"])
        wait_for(lambda: hint_results(mount)["invalid"] >= 2, what="both hints judged")
        assert listings() == before  # private/ was not listed for nobody
        assert listings(elsewhere) == outside  # nor anything outside the tree

        result = as_nobody(CONTROL_CLIENT, sock, "HINT open/a.bin")
        assert result.returncode == 0, result.stderr
        wait_for(lambda: mount.metric("cachefs_cache_files") == 1, what="open/a.bin fetched")
        assert listings() == before + 1  # what nobody may enter is listed for nobody
    finally:
        elsewhere.stop()


# -- nothing leaks through the cache dir or the metrics -------------------------------------------

def _listening_tcp(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                address, port = local.split(":")
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def test_cache_dir_is_private_and_metrics_are_local_and_pathless(tmp_path, source, remote,
                                                                 mount_cachefs):
    names = ["SECRET-PROJECT-alpha.jpg", "patient_0042_scan.dcm", "nested/dir/ünïcode.bin"]
    for rel in names:
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        (source / rel).write_bytes(os.urandom(5000))
    existing = tmp_path / "existing-cache"
    existing.mkdir(mode=0o755)  # an empty directory made by someone with a loose umask
    os.chmod(existing, 0o755)

    default_port_free = _port_is_free(9477)
    # metrics_addr None: the flag is left out, so the default address applies.
    mount = mount_cachefs(remote.path, metrics_addr=None if default_port_free else "0")
    other = mount_cachefs(remote.path, name="mnt2", cache_dir=existing)
    for m in (mount, other):
        assert os.stat(m.cache_dir).st_mode & 0o7777 == 0o700
        for sub in ("data", "index", "tmp"):
            assert os.stat(m.cache_dir / sub).st_mode & 0o077 == 0, sub
    shuffled_read_all(mount.path, names, seed=1)
    shuffled_read_all(other.path, names, seed=1)
    for m in (mount, other):  # the copies of the data themselves are private too
        chunks = [os.path.join(d, name) for d, _dirs, files in os.walk(m.cache_dir / "data")
                  for name in files]
        assert len(chunks) == len(names)
        assert all(os.stat(chunk).st_mode & 0o077 == 0 for chunk in chunks)

    if default_port_free:
        assert mount.metrics_url == "http://127.0.0.1:9477/metrics"
        assert _listening_tcp(mount.pid) == [("127.0.0.1", 9477)]
        text = urllib.request.urlopen(mount.metrics_url, timeout=10).read().decode()
    else:
        assert mount.metrics_url is None
        text = urllib.request.urlopen(other.metrics_url, timeout=10).read().decode()
        print("port 9477 in use: default metrics address not checked")
    assert [addr for addr, _port in _listening_tcp(other.pid)] == ["127.0.0.1"]
    assert "cachefs_file_opens_total" in text
    for needle in ["SECRET", "patient", "nested", "ünïcode", str(source), str(remote.path),
                   str(mount.cache_dir), str(mount.path)]:
        assert needle not in text, needle


# -- a flood of junk on the control socket ------------------------------------------------------

def _ping(sock_path: str) -> dict | None:
    """One PING on a fresh connection: the reply, or None when the daemon closed it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(sock_path)
        try:
            conn.sendall(b"PING\n")
            line = conn.makefile("rb").readline()
        except OSError:
            return None
    return json.loads(line) if line else None


def connect_past_backlog(path: str, *, timeout: float, deadline: float) -> socket.socket:
    """A connection to ``path``, retried while its listen backlog is full (EAGAIN: the
    daemon has not accepted the connections before it yet)."""
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(timeout)
        try:
            conn.connect(path)
            return conn
        except BlockingIOError:
            conn.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_flood_of_hints_and_junk_is_shrugged_off(source, remote, mount_cachefs):
    rels = make_files(source, 200, size=(1000, 20_000))
    want = {r: (source / r).read_bytes() for r in rels}
    mount = mount_cachefs(remote.path, fraction=0.5, staging_size="16MiB")
    sock = control_socket_path(mount.path)
    assert shuffled_read_all(mount.path, rels, seed=1) == want
    before = process_figures(mount.pid)
    rng = random.Random(5)

    # 1. Far more hints than the queue holds, for files that do not exist, in one burst.
    flood = b"".join(b"HINT nowhere/%d.jpg\n" % i for i in range(3 * MAX_QUEUED_HINTS))
    # 2. Binary junk, with and without newlines; 3. lines of megabytes, with and without a
    # command word; 4. NUL bytes and a partial last line.
    junk = [rng.randbytes(4 * 2**20), rng.randbytes(4 * 2**20).replace(b"\n", b"")]
    long_lines = [b"HINT " + b"a" * (3 * 2**20) + b"\n", b"b" * (5 * 2**20) + b"\n",
                  b"HINT " + b"c" * (MAX_LINE_BYTES + 1) + b"\n"]
    payloads = [flood, *junk, b"".join(long_lines), b"\0" * 100_000 + b"\nHINT x\0y\nHINT"]

    def blast(payload: bytes) -> None:
        with connect_past_backlog(sock, timeout=60, deadline=time.monotonic() + 30) as conn:
            try:
                conn.sendall(payload)
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(1 << 20):
                    pass
            except OSError:
                pass  # the daemon may hang up on junk

    blasters = [threading.Thread(target=blast, args=(p,)) for p in payloads]
    for thread in blasters:
        thread.start()

    # 5. Many hundreds of simultaneous connections, each holding a slot.
    held = []
    deadline = time.monotonic() + 30
    while len(held) < MAX_CONNECTIONS + 150 and time.monotonic() < deadline:
        held.append(connect_past_backlog(sock, timeout=30, deadline=deadline))
    assert len(held) == MAX_CONNECTIONS + 150
    answered = 0
    for conn in held:
        try:
            conn.sendall(b"PING\n")
            if conn.makefile("rb").readline():
                answered += 1
        except OSError:
            pass
    during = process_figures(mount.pid)
    for conn in held:
        conn.close()
    for thread in blasters:
        thread.join(60)
        assert not thread.is_alive()

    # Connections beyond the limit were refused, not served by ever more threads.
    assert answered <= MAX_CONNECTIONS
    # One thread per connection at most, plus the remote pool (64) and FUSE workers.
    assert during["threads"] <= before["threads"] + MAX_CONNECTIONS + 64 + 16
    # The daemon is alive and serves, the control socket answers again.
    wait_for(lambda: _ping(sock), timeout=30, what="PING answered after the flood")
    status = mount.status()
    assert status["prefetch"]["queued"] <= MAX_QUEUED_HINTS
    assert shuffled_read_all(mount.path, rels, seed=2) == want
    wait_for(lambda: process_figures(mount.pid)["threads"] <= before["threads"] + 40,
             timeout=30, what="connection threads gone")
    after = process_figures(mount.pid)
    hints = hint_results(mount)
    print(f"\nflood: threads {before['threads']} -> {during['threads']} (held "
          f"{len(held)} connections, {answered} answered) -> {after['threads']}; "
          f"RSS {before['VmRSS'] >> 20} -> {after['VmRSS'] >> 20} MiB, peak "
          f"{after['VmHWM'] >> 20} MiB; hints {hints}")
    # Memory: the hint queue is bounded, long lines are skipped, never buffered.
    assert after["VmHWM"] - before["VmRSS"] < 200 * 2**20
    assert hints["invalid"] >= 3  # at least the long lines were counted


def _scraped(mount) -> bool:
    try:
        return mount.metric("cachefs_file_opens_total", result="miss") > 0
    except OSError:  # refused while the flood's connections were being let go
        return False


@pytest.mark.timeout(120)
def test_a_flood_of_metrics_connections_takes_a_bounded_share_of_threads(source, remote,
                                                                         mount_cachefs):
    """/metrics may listen on the node's network (a DaemonSet's 0.0.0.0): connections that
    send nothing take a thread each up to a cap, those past it are closed at once, a silent
    one is closed after a while, and the mount serves throughout."""
    from cachefs.metrics import MAX_METRICS_CONNECTIONS, METRICS_IDLE_SECONDS

    rels = make_files(source, 20, size=(1000, 20_000))
    mount = mount_cachefs(remote.path)
    before = process_figures(mount.pid)
    address = urllib.parse.urlsplit(mount.metrics_url)
    flood = []
    try:
        for _ in range(MAX_METRICS_CONNECTIONS + 200):  # connected, never a byte sent
            flood.append(socket.create_connection((address.hostname, address.port), timeout=5))
        wait_for(lambda: sum(map(closed_by_server, flood)) >= 200, timeout=30,
                 what="the connections past the cap closed")
        assert process_figures(mount.pid)["threads"] <= \
            before["threads"] + MAX_METRICS_CONNECTIONS + 16
        for rel in rels:
            assert (mount.path / rel).read_bytes() == (source / rel).read_bytes()
    finally:
        for connection in flood:
            connection.close()
    wait_for(lambda: _scraped(mount), timeout=30, what="a scrape answered after the flood")
    silent = socket.create_connection((address.hostname, address.port), timeout=5)
    try:
        started = time.monotonic()
        wait_for(lambda: closed_by_server(silent), timeout=METRICS_IDLE_SECONDS + 20,
                 what="a silent connection closed")
        assert time.monotonic() - started >= METRICS_IDLE_SECONDS - 1
    finally:
        silent.close()


# Runs as an unprivileged user: holds as many control connections as it can get, PINGs on
# each, prints how many were answered, and keeps them until its stdin closes.
HOARDER = """
import socket, sys, time
held, answered = [], 0
while len(held) < int(sys.argv[2]):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)
    try:
        conn.connect(sys.argv[1])
    except BlockingIOError:  # the listen backlog is full: let the daemon catch up
        conn.close()
        time.sleep(0.01)
        continue
    held.append(conn)
for conn in held:
    try:
        conn.sendall(b"PING\\n")
        answered += bool(conn.makefile("rb").readline())
    except OSError:
        pass
print(answered, flush=True)
sys.stdin.read()
"""


def test_one_user_cannot_lock_the_others_out(source, mount_cachefs):
    """A local user hoarding control connections gets its share, and no more: hints and
    status from everyone else still get through."""
    make_files(source, 2, size=100)
    mount = mount_cachefs(source, cache_size="64MiB")
    sock = control_socket_path(mount.path)
    hoarder = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         sys.executable, "-c", HOARDER, sock, str(MAX_CONNECTIONS_PER_USER + 40)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        answered = int(hoarder.stdout.readline())
        assert answered == MAX_CONNECTIONS_PER_USER
        assert _ping(sock) is not None      # root still gets in
        assert mount.status()["pid"] == mount.pid
    finally:
        hoarder.stdin.close()
        hoarder.wait(30)
