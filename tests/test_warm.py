"""`cachefs warm` at scale: a list streamed in bounded memory, a warm that goes on where an
interrupted one stopped (and starts over, saying so, when its checkpoint cannot be used),
and the concurrency it settles on.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.peakrss import run_with_peak_rss
from cachefs import limits
from cachefs.control.checkpoint import (
    BLOCK_PATHS,
    Block,
    Checkpoint,
    Progress,
    block_digest,
    skip_done,
)
from cachefs.control.client import connect, request
from cachefs.control.concurrency import ConcurrencyTuner
from cachefs.errors import UsageError
from cachefs.prefetch.paths import Caller
from cachefs.store.admission import FractionAdmission
from tests.conftest import REPO, make_files, run_cachefs, wait_for


def warm_command(mount, listing: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cachefs", "warm", str(mount.path), "--list", str(listing),
            *extra]


def run_warm_measured(tmp_path: Path, mount, listing: Path) -> tuple[int, str, str, int]:
    """(exit status, stdout, stderr, peak RSS in bytes) of one ``cachefs warm``, its own (not
    this test process's, which its ru_maxrss would include)."""
    out_path, err_path = tmp_path / "warm.out", tmp_path / "warm.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        code, peak = run_with_peak_rss(warm_command(mount, listing), stdout=out, stderr=err,
                                       cwd=REPO)
    return code, out_path.read_text(), err_path.read_text(), peak


def cache_of(mount) -> str:
    """The name of the cache the mount serves, as its daemon tells a warm."""
    sock = connect(mount.path)
    try:
        return request(sock, b"PING")["cache"]
    finally:
        sock.close()


def checkpoint_of(mount, listing: Path, state_dir: Path) -> Checkpoint:
    """The checkpoint a warm of ``listing`` on ``mount`` keeps (closed: not held)."""
    checkpoint = Checkpoint(mount.path, os.path.realpath(listing), state_dir, cache_of(mount))
    checkpoint.close()
    return checkpoint


def write_list(path: Path, paths) -> Path:
    with open(path, "w") as f:
        for rel in paths:
            f.write(f"{rel}\n")
    return path


def warm_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warm: ")
            and " files/s" not in line]  # (the plain progress lines, every 10 s)


# -- the checkpoint and the concurrency, without a mount ------------------------------------------

def paths_of(count: int, prefix: str = "d") -> list[bytes]:
    return [f"{prefix}{i // 1000:03d}/f{i:07d}".encode() for i in range(count)]


def progress_of(paths: list[bytes], blocks: int) -> Progress:
    counts = (BLOCK_PATHS, 0, 0, 0, 0)
    return Progress([Block(block_digest(paths[n * BLOCK_PATHS:(n + 1) * BLOCK_PATHS]), counts,
                           BLOCK_PATHS * 10) for n in range(blocks)])


@pytest.mark.fast
def test_a_checkpoint_skips_what_its_list_answered_and_no_more():
    listing = paths_of(3 * BLOCK_PATHS + 10)
    recorded = progress_of(listing, 2)

    kept, rest, note = skip_done(iter(listing), recorded)
    assert note is None and kept.paths == 2 * BLOCK_PATHS
    assert kept.counts()["fetched"] == 2 * BLOCK_PATHS and kept.new_bytes() == 20 * BLOCK_PATHS
    assert list(rest) == listing[2 * BLOCK_PATHS:]

    # The list changed in its second block: the first still holds, the rest is warmed.
    changed = listing.copy()
    changed[BLOCK_PATHS + 7] = b"elsewhere/new.jpg"
    kept, rest, note = skip_done(iter(changed), recorded)
    assert kept.paths == BLOCK_PATHS and list(rest) == changed[BLOCK_PATHS:]
    assert note == f"the list differs from the checkpoint's after path {BLOCK_PATHS:,}: " \
        "warming from there"

    # Another list altogether, and one shorter than the checkpoint: from the start.
    other = paths_of(3 * BLOCK_PATHS, prefix="x")
    kept, rest, note = skip_done(iter(other), recorded)
    assert kept.paths == 0 and list(rest) == other and "starting over" in note
    short = listing[:BLOCK_PATHS + 5]
    kept, rest, note = skip_done(iter(short), recorded)
    assert kept.paths == BLOCK_PATHS and list(rest) == short[BLOCK_PATHS:]


@pytest.mark.fast
def test_a_damaged_checkpoint_is_ignored_and_a_second_warm_of_the_list_refused(tmp_path):
    checkpoint = Checkpoint(tmp_path / "mnt", "/lists/train.txt", tmp_path / "state")
    try:
        progress = progress_of(paths_of(2 * BLOCK_PATHS), 2)
        checkpoint.save(progress)
        assert checkpoint.load() == (progress, None)
        with pytest.raises(UsageError, match="another cachefs warm of this list"):
            Checkpoint(tmp_path / "mnt", "/lists/train.txt", tmp_path / "state")
        # Another list on the same mount has a checkpoint of its own.
        Checkpoint(tmp_path / "mnt", "/lists/val.txt", tmp_path / "state").close()

        state = json.loads(checkpoint.path.read_text())
        for damage in ('{"format": 1, "blocks": [', "\0" * 40,
                       json.dumps({**state, "format": 99}),
                       json.dumps({**state, "blocks": [["00ff", 1, 2, 3, 4, 5, 6]]}),
                       json.dumps({**state, "blocks": [["zz", BLOCK_PATHS, 0, 0, 0, 0, 0]]}),
                       json.dumps({**state, "list": "/lists/other.txt"})):
            checkpoint.path.write_text(damage)
            recorded, note = checkpoint.load()
            assert recorded.paths == 0, damage
            assert note.startswith(f"the checkpoint {checkpoint.path} is damaged ("), note
        # Taken against another cache than the one mounted now (a new disk, one emptied):
        # not damaged, but of no use.
        checkpoint.save(progress)
        checkpoint.cache = "another"
        assert checkpoint.load() == (Progress(), f"the checkpoint {checkpoint.path} was taken "
                                     "against another cache than the one mounted now: "
                                     "starting over")
        checkpoint.remove()
        assert checkpoint.load() == (Progress(), None)
        # Nothing of it is left; the other list's lock stays until its warm ends.
        left = sorted(p.name for p in checkpoint.path.parent.iterdir())
        assert len(left) == 1 and left[0].endswith(".lock")
        assert checkpoint.path.stem not in left[0]
    finally:
        checkpoint.close()


def settle_on(rate_of, maximum: int = 32, seconds: float = 60.0) -> int:
    """The concurrency a tuner uses most over ``seconds`` of answers coming at
    ``rate_of(concurrency)`` a second, counted every 2 ms as a warm counts them."""
    tuner = ConcurrencyTuner(maximum)
    used: dict[int, int] = {}
    now, owed = 0.0, 0.0
    while now < seconds:
        owed += rate_of(tuner.current) * 0.002
        count = int(owed)
        owed -= count
        tuner.answered(count, now)
        used[tuner.current] = used.get(tuner.current, 0) + 1
        now += 0.002
    return max(used, key=used.get)


@pytest.mark.fast
def test_the_warm_fetches_as_many_at_once_as_make_it_faster():
    # A remote with latency: each fetch waits 10 ms, the remote serves 1,600 files/s at most.
    assert settle_on(lambda c: min(c * 100, 1600)) == 16
    # A fast remote: more at once only contend for the daemon (rates measured on 2 cores).
    rates = {1: 1276, 2: 1390, 4: 1368, 8: 1212, 16: 930, 32: 800}
    assert settle_on(rates.__getitem__) == 2
    assert settle_on(lambda c: min(c * 100, 1600), maximum=4) == 4


@pytest.mark.fast
def test_the_warm_finds_how_many_at_once_within_its_first_seconds():
    """A probe that does not pay is followed at once by one the other way: a warm from a fast
    remote reaches one at a time in seconds, not after a stay at the starting concurrency
    (which cost a warm of 50,000 files a third of its rate)."""
    fast = {1: 4542, 2: 4100, 4: 3600, 8: 3100, 16: 2800, 32: 2500}  # 4 KiB files, 2 cores
    assert settle_on(fast.__getitem__, seconds=8) == 1
    assert settle_on(lambda c: min(c * 100, 1600), seconds=10) == 16


# -- real mounts -----------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_warm_streams_a_long_list_in_bounded_memory(tmp_path, source, mount_cachefs):
    """200,000 lines, in the client's memory one pipeline at a time: it holds no more for
    them than for 2,000 (the whole list held as before took some 2 KiB a path, 400 MiB)."""
    rels = make_files(source, 2000, size=64, per_dir=500)
    missing = [f"class{i:04d}/no-such-{i}.bin" for i in range(50)]
    mount = mount_cachefs(source, fraction=0.1, cache_size="64MiB")
    admitted = sum(map(FractionAdmission(0.1).eligible, rels))

    code, out, err, small_peak = run_warm_measured(tmp_path, mount,
                                                   write_list(tmp_path / "small.txt", rels))
    assert code == 0, err
    assert "warmed 2,000 files in " in out and f": {admitted:,} fetched" in out

    rounds = 100
    long_list = write_list(tmp_path / "long.txt", [*missing, *(rels * rounds)])
    code, out, err, peak = run_warm_measured(tmp_path, mount, long_list)
    assert code == 1, err  # the missing ones failed, and it says so
    lines = rounds * len(rels) + len(missing)
    assert f"warmed {lines:,} files in " in out, out
    assert (f": 0 fetched (0 B now cached), {admitted * rounds:,} already cached, "
            f"{(len(rels) - admitted) * rounds:,} not admitted by the fraction, "
            f"0 left out (cache full), {len(missing)} failed") in out, out
    assert err.count("  failed: ") == 10 and "Traceback" not in err
    assert peak < 100 * 2**20, peak
    assert peak - small_peak < 8 * 2**20, (small_peak, peak)
    assert mount.metric("cachefs_warm_files_total", result="not_admitted") == \
        (len(rels) - admitted) * (rounds + 1)
    assert mount.metric("cachefs_cache_files") == admitted


def warm_requests(mount) -> float:
    """The FETCH requests the daemon answered."""
    return sum(mount.metric("cachefs_warm_files_total", result=r)
               for r in ("fetched", "cached", "not_admitted", "cache_full", "failed"))


def warm_requests_once_quiet(mount, quiet_seconds: float = 1.0) -> float:
    """``warm_requests`` once it stopped moving (the daemon carries out the requests a killed
    client had sent)."""
    last, since = warm_requests(mount), time.monotonic()
    deadline = since + 60
    while time.monotonic() - since < quiet_seconds:
        assert time.monotonic() < deadline, "the daemon kept answering"
        time.sleep(0.1)
        value = warm_requests(mount)
        if value != last:
            last, since = value, time.monotonic()
    return last


@pytest.mark.timeout(240)
def test_warm_killed_goes_on_where_it_stopped(tmp_path, source, remote, mount_cachefs,
                                              warm_checkpoints):
    count = 3 * BLOCK_PATHS + 300
    rels = make_files(source, count, size=(16, 256), per_dir=500)
    remote.configure(open_ms=3)  # slow enough to be killed half-way
    mount = mount_cachefs(remote.path, cache_size="256MiB")
    listing = write_list(tmp_path / "train.txt", random.Random(7).sample(rels, count))
    state = checkpoint_of(mount, listing, warm_checkpoints).path

    first = subprocess.Popen(warm_command(mount, listing), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=REPO)
    try:
        wait_for(lambda: state.exists() and json.loads(state.read_text())["blocks"],
                 timeout=120, interval=0.02, what="a checkpoint of a block")
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    done = len(json.loads(state.read_text())["blocks"]) * BLOCK_PATHS
    assert BLOCK_PATHS <= done < count
    asked_before = warm_requests_once_quiet(mount)
    assert asked_before >= done

    remote.configure(open_ms=0)
    again = run_cachefs("warm", str(mount.path), "--list", str(listing), timeout=200)
    assert again.returncode == 0, again.stderr
    assert warm_lines(again.stderr) == [
        f"warm: going on after path {done:,} of the list, where an earlier warm of it stopped "
        "(--restart to start over)"]
    assert f"warmed {count:,} files in " in again.stdout
    assert f", {done:,} of them by an earlier warm: " in again.stdout
    assert "0 not admitted by the fraction, 0 left out (cache full), 0 failed" in again.stdout
    # Only what the checkpoint did not hold was asked again ...
    assert warm_requests(mount) - asked_before == count - done
    # ... and the cache is whole and right: every file read back is the remote's, from it.
    assert mount.metric("cachefs_cache_files") == count
    assert not state.exists()  # answered to the end: the next warm starts over
    remote_bytes = mount.metric("cachefs_remote_read_bytes_total")
    for rel in rels:
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes(), rel
    assert mount.metric("cachefs_remote_read_bytes_total") == remote_bytes
    assert mount.metric("cachefs_file_opens_total", result="hit") == count


@pytest.mark.timeout(120)
def test_warm_with_a_checkpoint_it_cannot_use_starts_over_and_says_so(
        tmp_path, source, mount_cachefs, warm_checkpoints):
    rels = make_files(source, 300, size=100)
    mount = mount_cachefs(source, cache_size="64MiB")
    listing = write_list(tmp_path / "train.txt", rels)
    checkpoint = checkpoint_of(mount, listing, warm_checkpoints)
    state = checkpoint.path

    state.write_text('{"format": 1, "blocks": [["0123')  # cut short (a full disk)
    result = run_cachefs("warm", str(mount.path), "--list", str(listing))
    assert result.returncode == 0, result.stderr
    (line,) = warm_lines(result.stderr)
    assert line.startswith(f"warm: the checkpoint {state} is damaged (") \
        and line.endswith("): starting over"), line
    assert ": 300 fetched " in result.stdout and not state.exists()

    # A checkpoint of another list at this path (rewritten since): from the start as well.
    checkpoint.save(progress_of(paths_of(BLOCK_PATHS), 1))
    result = run_cachefs("warm", str(mount.path), "--list", str(listing))
    assert result.returncode == 0, result.stderr
    assert warm_lines(result.stderr) == ["warm: the list is not the one of the checkpoint: "
                                         "starting over"]
    assert "warmed 300 files in " in result.stdout and ": 0 fetched " in result.stdout
    assert "300 already cached" in result.stdout

    # One of this list, taken against another cache (a new disk mounted here since): what
    # it says was warmed is not in this one, so it starts over, and says why.
    # (A list of a block and more: the files again and again.)
    longer = [os.fsencode(rel) for rel in rels] * (BLOCK_PATHS // len(rels) + 1)
    other = checkpoint_of(mount, write_list(tmp_path / "longer.txt", map(os.fsdecode, longer)),
                          warm_checkpoints)
    other.cache = "another"
    other.save(progress_of(longer, 1))
    result = run_cachefs("warm", str(mount.path), "--list", str(tmp_path / "longer.txt"))
    assert result.returncode == 0, result.stderr
    assert warm_lines(result.stderr) == [f"warm: the checkpoint {other.path} was taken "
                                         "against another cache than the one mounted now: "
                                         "starting over"]
    assert f"warmed {len(longer):,} files in " in result.stdout, result.stdout
    assert "by an earlier warm" not in result.stdout

    # --restart ignores a checkpoint altogether, without a word.
    checkpoint.cache = cache_of(mount)
    checkpoint.save(progress_of(paths_of(BLOCK_PATHS), 1))
    result = run_cachefs("warm", str(mount.path), "--list", str(listing), "--restart")
    assert result.returncode == 0 and warm_lines(result.stderr) == [], result.stderr
    assert "warmed 300 files in " in result.stdout and not state.exists()


def interrupted_by_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(120)
def test_warm_interrupted_says_so_in_one_line(tmp_path, source, remote, mount_cachefs):
    rels = make_files(source, 2000, size=100)
    remote.configure(open_ms=20)
    mount = mount_cachefs(remote.path, cache_size="64MiB")
    listing = write_list(tmp_path / "train.txt", rels)
    child = subprocess.Popen(warm_command(mount, listing), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=REPO,
                             preexec_fn=interrupted_by_ctrl_c)
    try:
        wait_for(lambda: mount.metric("cachefs_warm_files_total", result="fetched") >= 20,
                 timeout=60, what="files fetched")
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130
    assert out == "" and "Traceback" not in err
    (line,) = warm_lines(err)
    assert line.startswith("warm: interrupted after ") and line.endswith(
        " files; nothing to go on from"), line


# -- reading ahead ---------------------------------------------------------------------------------

def uncached(path: Path, nbytes: int | None = None) -> int:
    """Bytes of the first ``nbytes`` of ``path`` (all of it) not in the page cache."""
    from cachefs.remote.pagecache import uncached_bytes

    fd = os.open(path, os.O_RDONLY)
    try:
        return uncached_bytes(fd, os.fstat(fd).st_size if nbytes is None else nbytes)
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def copies_held_open(cache_dir: Path, pid: int | str = "self") -> list[str]:
    """This process's descriptors of files under the cache's tmp/ (a copy ahead waiting is
    an unnamed file there, "tmp/#123 (deleted)")."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith(f"{cache_dir}/tmp/"):
            held.append(target)
    return held


@pytest.mark.timeout(60)
def test_the_reader_ahead_copies_or_reads_in_what_a_fetch_would_copy_and_nothing_else(
        tmp_path):
    """A warm's connection is handed to a process of its own, which takes its paths in order: a
    small regular file the fraction admits and the caller may read is copied ahead and taken
    into the store, with the remote's bytes, and the warm is told so (its FETCH need not
    come); a large one is read in only as far as READ_AHEAD_BYTES; a FIFO holds nothing up,
    and a symlink, a file the caller may not read (its owner's bits deny the owner, though
    the others' allow), one in a directory the caller may not search, one behind a symlinked
    directory (which the FETCH would resolve), one the cache holds, one outside the fraction
    and a path outside the mount are left alone.  The warm is told how many of its lines it
    is done with.  What it did is counted as each warm ends.  A caller's supplementary
    groups count, as they do for the FETCH."""
    import socket

    from cachefs.attr import Attr
    from cachefs.prefetch.readahead import COPY_AHEAD_MAX_BYTES, READ_AHEAD_BYTES, ReadAhead
    from cachefs.store.store import CacheStore

    remote = tmp_path / "remote"
    remote.mkdir()
    admission = FractionAdmission(0.5, seed=7)
    store = CacheStore.open(tmp_path / "cache", 64 * 2**20, admission)
    names = [f"f{i}.bin" for i in range(200)]
    outside = next(n for n in names if not admission.eligible(n))
    wanted, last, large, private, cached, target, grouped, denied = \
        [n for n in names if admission.eligible(n)][:8]
    closed = next(n for n in (f"closed/{n}" for n in names) if admission.eligible(n))
    behind = next(n for n in (f"sub/{n}" for n in names)
                  if admission.eligible(n.replace("sub/", "sublink/")))
    sizes = {wanted: 64 << 10, last: 8 << 10, large: 2 * COPY_AHEAD_MAX_BYTES,
             private: 64 << 10, cached: 64 << 10, target: 64 << 10, outside: 64 << 10,
             closed: 64 << 10, behind: 64 << 10, grouped: 64 << 10, denied: 64 << 10}
    (remote / "closed").mkdir(mode=0o700)
    (remote / "sub").mkdir()
    for name, size in sizes.items():
        (remote / name).write_bytes(random.randbytes(size))
    (remote / private).chmod(0o600)
    os.chown(remote / grouped, 0, 4242)
    (remote / grouped).chmod(0o640)  # readable by the group the first warm's caller is in
    os.chown(remote / denied, 1000, 0)
    (remote / denied).chmod(0o004)  # the kernel denies its owner, whatever the others may
    (remote / "link").symlink_to(target)
    (remote / "sublink").symlink_to("sub")
    os.mkfifo(remote / "fifo")

    def attr(name):
        return Attr.from_stat((remote / name).stat())

    def fill(name):
        with open(remote / name, "rb") as src:
            assert store.fill(name.encode(), attr(name),
                              lambda out: os.sendfile(out, src.fileno(), 0, sizes[name]))

    fill(cached)
    for name in sizes:
        evict(remote / name)
    if any(uncached(remote / name) != size for name, size in sizes.items()):
        pytest.skip("this file system keeps the pages of clean files it was told to drop")

    mountpoint = str(tmp_path / "mnt")
    reader = ReadAhead(str(remote), store, mountpoint, admission)
    warms = [socket.socketpair() for _ in range(2)]
    try:
        callers = (Caller(1000, 1000, frozenset({1000, 4242})), Caller(0, 0))
        for (theirs, _), caller in zip(warms, callers, strict=True):
            assert reader.take(theirs, caller) is None
            theirs.close()  # the reader-ahead holds its own
        pids = reader.figures()["pids"]
        assert len(pids) == 2  # a process each: neither warm waits for the other's
        warms[0][1].sendall(b"".join(name.encode() + b"\n"
                                     for name in (private, closed, denied, grouped)))
        warms[0][1].close()
        paths = ["fifo", "link", cached, outside, f"{mountpoint}/{large}",
                 f"{mountpoint}/../{wanted}", f"{mountpoint}/x/../{wanted}", "no-such.bin",
                 behind.replace("sub/", "sublink/"), last]
        warms[1][1].sendall(b"".join(p.encode() + b"\n" for p in paths))
        warms[1][1].shutdown(socket.SHUT_WR)  # what it is told still comes
        figures = wait_for(lambda: (f := reader.figures())["open"] == 0 and f,
                           what="both warms counted")
        assert figures == {"pids": pids, "warms": 2, "open": 0, "copied": 3, "installed": 3,
                           "dropped": 0, "read": 4, "left": 10}
        told = b""
        while piece := warms[1][1].recv(65536):
            told += piece
        assert told == b"%d %s/x/../%s\n%d %s\n@10\n" % (
            sizes[wanted], mountpoint.encode(), wanted.encode(), sizes[last], last.encode())
        # The large file read in as far as a fetch's start, not copied; the files left alone
        # not read at all.
        assert uncached(remote / large, READ_AHEAD_BYTES) == 0
        assert uncached(remote / large) >= COPY_AHEAD_MAX_BYTES
        for name in (private, cached, target, outside, closed, behind, denied):
            assert uncached(remote / name) == sizes[name], name
        # The copies are in the cache, with the remote's bytes; the warm was told of them,
        # so a FETCH of one would find it already cached.
        for name in (wanted, last, grouped):
            record = store.whole(name.encode(), attr(name).version)
            assert record is not None, name
            assert store.read_chunk(name.encode(), record, 0) == (remote / name).read_bytes()
            assert not reader.took(name)
        # Each copy was an unnamed file, closed once taken in: none is held open, and none
        # has a name left to sweep.
        assert copies_held_open(tmp_path / "cache") == []
        assert not any((tmp_path / "cache" / "tmp").iterdir())
    finally:
        reader.close()
        store.close()
        for _, ours in warms:
            ours.close()
    for pid in pids:  # ended and reaped with its daemon's end
        assert not Path(f"/proc/{pid}").exists()
    assert reader.figures()["pids"] == []


def peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


@pytest.mark.timeout(60)
def test_what_is_no_list_costs_the_reader_ahead_a_bounded_buffer(tmp_path):
    """A READ-AHEAD connection that sends what is no list (64 MiB with no line end) costs
    the reader-ahead a buffer of its bound, not the 64 MiB, and a path sent after it is
    still copied ahead."""
    import socket

    from cachefs.prefetch.readahead import BUFFERED_BYTES, ReadAhead
    from cachefs.store.store import CacheStore

    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "a.bin").write_bytes(random.randbytes(4096))
    admission = FractionAdmission(1.0, seed=0)
    store = CacheStore.open(tmp_path / "cache", 64 * 2**20, admission)
    reader = ReadAhead(str(remote), store, str(tmp_path / "mnt"), admission)
    theirs, ours = socket.socketpair()
    try:
        assert reader.take(theirs, Caller(0, 0)) is None
        theirs.close()
        (pid,) = reader.figures()["pids"]
        ours.sendall(b"b.bin\n")  # (once read, the process is all loaded)
        wait_for(lambda: peak_rss_kib(pid) > 0, what="started")
        time.sleep(0.5)
        before = peak_rss_kib(pid)
        chunk = b"x" * (1 << 20)
        for _ in range(64):
            ours.sendall(chunk)
        ours.sendall(b"\na.bin\n")
        ours.shutdown(socket.SHUT_WR)
        figures = wait_for(lambda: (f := reader.figures())["open"] == 0 and f,
                           what="the warm counted")
        assert figures["installed"] == 1, figures
        assert peak_rss_kib(pid) - before < 4 * BUFFERED_BYTES // 1024, (before, figures)
    finally:
        reader.close()
        store.close()
        ours.close()


@pytest.mark.timeout(120)
def test_a_warm_reads_its_files_ahead_in_processes_the_daemon_ends(tmp_path, source,
                                                                   mount_cachefs):
    """A warm of a remote whose opens are fast deals its paths among the daemon's
    readers-ahead, one for each core, which copy them ahead of their fetches into the cache
    and tell the warm so, and end with the daemon; the bytes are the remote's."""
    rels = make_files(source, 3000, size=(1, 4000), per_dir=500)
    mount = mount_cachefs(source, fraction=1.0)
    result = subprocess.run(warm_command(mount, write_list(tmp_path / "list.txt", rels)),
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert ": 3,000 fetched" in result.stdout, result.stdout
    ahead = wait_for(lambda: (st := mount.status())["warm_read_ahead"]["open"] == 0
                     and st["warm_read_ahead"], what="the warm's read-ahead counted")
    # The list dealt among the processes, a connection to each.
    streams = len(ahead["pids"])
    assert streams == min(4, limits.CORES), ahead
    assert ahead["warms"] == streams and ahead["read"] > 0, ahead
    assert ahead["read"] + ahead["left"] <= 3000, ahead
    assert 0 < ahead["installed"] <= ahead["copied"], ahead
    assert all(Path(f"/proc/{pid}").exists() for pid in ahead["pids"])
    status_text = run_cachefs("status", str(mount.path)).stdout
    assert f"{ahead['copied']:,} files copied ahead of their fetches " \
           f"({ahead['installed']:,} taken in, {ahead['dropped']:,} dropped for want of " \
           "room)" in status_text, status_text
    for rel in rels[::97]:
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes(), rel
    mount.stop()
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in ahead["pids"]),
             what="the readers-ahead ended")


@pytest.mark.timeout(120)
def test_a_warm_whose_reader_ahead_stops_answering_fetches_its_files_itself(
        tmp_path, source, mount_cachefs):
    """Readers-ahead that stop (here SIGSTOP) take a warm's connections and say nothing: the
    warm waits for their first word a few seconds at most, then fetches every file itself,
    and each is counted once, with the remote's bytes."""
    rels = make_files(source, 600, size=(1, 4000), per_dir=300)
    mount = mount_cachefs(source, fraction=1.0)
    first = subprocess.run(warm_command(mount, write_list(tmp_path / "first.txt", rels[:10])),
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert ": 10 fetched" in first.stdout, first.stdout + first.stderr
    pids = mount.status()["warm_read_ahead"]["pids"]
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        result = subprocess.run(warm_command(mount, write_list(tmp_path / "rest.txt", rels)),
                                capture_output=True, text=True, timeout=60, cwd=REPO)
        assert result.returncode == 0, result.stderr
        assert ": 590 fetched" in result.stdout and "10 already cached" in result.stdout, \
            result.stdout
        assert mount.metric("cachefs_warm_files_total", result="fetched") == 600
        # They never got to its connections.
        assert mount.status()["warm_read_ahead"]["open"] == len(pids)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    for rel in rels[::37]:
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes(), rel


@pytest.mark.timeout(60)
def test_a_warm_waits_for_its_reader_ahead_as_long_as_its_pace_so_far_allows(tmp_path):
    """A reader-ahead whose batches come slowly (here 0.9 s between two of its advances)
    is waited for as long as that pace allows (AHEAD_STALL_FACTOR times it): the next path
    still waits 1.5 s after its last word, where a fixed bound of AHEAD_STALL_SECONDS would
    have had its FETCH sent, and filled what the reader-ahead was copying.  Silent past
    that, it is taken for stuck, and the paths come, each once."""
    import selectors
    import socket
    import threading

    from cachefs.control.warm import AHEAD_STALL_FACTOR, WAIT, _Ahead

    target = str(tmp_path / "control.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(target)
    server.listen()
    speak = threading.Event()
    said: list[bytes] = []

    def reader_ahead() -> None:  # answers READ-AHEAD, then says what it is told to
        conn, _ = server.accept()
        with conn:
            assert conn.recv(64) == b"READ-AHEAD\n"
            conn.sendall(b'{"ok":true}\n')
            while speak.wait(30) and said:
                speak.clear()
                conn.sendall(said.pop(0))
            conn.recv(1 << 20)

    thread = threading.Thread(target=reader_ahead, daemon=True)
    thread.start()
    selector = selectors.DefaultSelector()
    paths = [b"d/%d.bin" % i for i in range(4)]
    ahead = _Ahead(iter(paths), target, selector)
    try:
        ahead.send()

        def say(line: bytes) -> None:
            said.append(line)
            speak.set()
            wait_for(lambda: not said, what="said")
            time.sleep(0.05)
            ahead.receive()

        assert ahead.next_path() is WAIT  # its first word not come yet
        say(b"@1\n")
        assert ahead.next_path() == paths[0]
        time.sleep(0.9)
        say(b"@2\n")  # its slowest pace so far: some 0.9 s between two advances
        assert ahead.next_path() == paths[1]
        time.sleep(1.5)
        ahead.receive()
        assert ahead.next_path() is WAIT  # 1.5 s of silence is within 4 times its pace
        assert 0 < ahead.waiting() <= AHEAD_STALL_FACTOR * 1.5
        stuck = time.monotonic()
        while (path := ahead.next_path()) is WAIT:
            assert time.monotonic() - stuck < 15
            time.sleep(0.05)
        assert path == paths[2] and ahead.next_path() == paths[3]
        assert ahead.next_path() is None and not ahead.waiting()
    finally:
        said.clear()
        speak.set()
        ahead.close()
        server.close()
        thread.join(5)


@pytest.mark.timeout(120)
def test_a_remote_whose_opens_take_a_round_trip_is_not_read_ahead(tmp_path, source, remote):
    """The reader-ahead times its own opens: against a remote whose opens take milliseconds
    it stops once half a window of them were slow, and then tries one path a quarter second;
    every path is still taken (the warm is never held up) and counted."""
    import socket

    from cachefs.prefetch.readahead import SLOW_PROBE_SECONDS, ReadAhead
    from cachefs.remote.remote import OPEN_TIMES_WINDOW
    from cachefs.store.store import CacheStore

    rels = make_files(source, 400, size=(16, 256), per_dir=400)
    remote.configure(open_ms=3)
    store = CacheStore.open(tmp_path / "cache", 64 * 2**20, FractionAdmission(1.0))
    reader = ReadAhead(str(remote.path), store, str(tmp_path / "mnt"), FractionAdmission(1.0))
    theirs, ours = socket.socketpair()
    try:
        began = time.monotonic()
        assert reader.take(theirs, Caller(0, 0)) is None
        theirs.close()
        ours.sendall(b"".join(rel.encode() + b"\n" for rel in rels))
        ours.close()
        figures = wait_for(lambda: (f := reader.figures())["open"] == 0 and f, timeout=100,
                           what="the warm counted")
        seconds = time.monotonic() - began
    finally:
        reader.close()
        store.close()
    assert figures["read"] + figures["left"] == len(rels), figures
    assert OPEN_TIMES_WINDOW // 2 <= figures["read"] \
        <= OPEN_TIMES_WINDOW // 2 + 1 + seconds / SLOW_PROBE_SECONDS, (figures, seconds)


@pytest.mark.timeout(180)
def test_a_warm_into_a_cache_too_small_keeps_what_fits_and_leaves_no_copy_behind(
        tmp_path, source, mount_cachefs):
    """A warm of more than the cache holds, its files copied ahead by the reader-ahead:
    the files that fit are cached with the remote's bytes, the rest are left out and said
    so, and no copy made ahead stays on the cache disk."""
    rels = make_files(source, 2000, size=(8000, 16000), per_dir=500)  # some 23 MiB
    mount = mount_cachefs(source, fraction=1.0, cache_size="12MiB")
    result = subprocess.run(warm_command(mount, write_list(tmp_path / "list.txt", rels)),
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    fetched = int(result.stdout.split(": ")[1].split(" fetched")[0].replace(",", ""))
    assert 0 < fetched < 2000, result.stdout
    assert f"{2000 - fetched:,} left out (cache full)" in result.stdout, result.stdout
    ahead = wait_for(lambda: (st := mount.status())["warm_read_ahead"]["open"] == 0
                     and st["warm_read_ahead"], what="the warm's read-ahead counted")
    assert ahead["copied"] > 0, ahead  # (the list's last files: the cache was full by then)
    wait_for(lambda: not any((mount.cache_dir / "tmp").iterdir()), timeout=30,
             what="no copy left in tmp/")
    assert mount.metric("cachefs_cache_files") == fetched
    for rel in rels[::41]:
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes(), rel
