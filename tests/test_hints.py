"""Prefetch hints end to end: the torch client in a real DataLoader with worker processes,
the daemon's prefetcher behind a remote with NFS-like latency, and `cachefs warm`."""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, Sampler

import cachefs_client
from bench.driver import drop_page_cache
from cachefs.remote.attrcache import LIST_AFTER_LOOKUPS
from cachefs_client import DataLoader, FileDataset, HintingBatchSampler
from tests.conftest import REPO, errno_of, make_files, run_cachefs


class IndexedFiles(torch.utils.data.Dataset):
    """Yields (index, file bytes) so that tests can compare both the order and the data."""

    def __init__(self, root: Path, rels: list[str]) -> None:
        self.paths = [str(root / rel) for rel in rels]

    def __len__(self) -> int:
        return len(self.paths)

    def path_of(self, index: int) -> str:
        return self.paths[index]

    def __getitem__(self, index: int) -> tuple[int, bytes]:
        with open(self.paths[index], "rb") as f:
            return index, f.read()


def collate(items):
    return [index for index, _ in items], [data for _, data in items]


class EvensFirst(Sampler[list[int]]):
    """A custom batch sampler: even indices then odd ones, in fixed-size batches."""

    def __init__(self, size: int, batch: int) -> None:
        self.order = list(range(0, size, 2)) + list(range(1, size, 2))
        self.batch = batch

    def __iter__(self):
        for start in range(0, len(self.order), self.batch):
            yield self.order[start : start + self.batch]

    def __len__(self) -> int:
        return -(-len(self.order) // self.batch)


def epochs_of(make_loader, epochs: int, set_epoch=None) -> list[list[int]]:
    loader = make_loader()
    seen = []
    for epoch in range(epochs):
        if set_epoch is not None:
            set_epoch(loader, epoch)
        seen.append([i for indices, _ in loader for i in indices])
    return seen


def hint_total(mount) -> float:
    return sum(mount.metric("cachefs_hints_total", result=r)
               for r in ("accepted", "cached", "invalid", "dropped"))


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- the client leaves the batches alone ----------------------------------------------------

LOADERS = {
    "shuffle-generator": lambda ds, wrap: wrap(
        ds, batch_size=7, shuffle=True, generator=torch.Generator().manual_seed(5)),
    "persistent-workers": lambda ds, wrap: wrap(
        ds, batch_size=7, shuffle=True, generator=torch.Generator().manual_seed(5),
        persistent_workers=True),
    "random-sampler": lambda ds, wrap: wrap(
        ds, batch_size=8, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(9))),
    "distributed": lambda ds, wrap: wrap(
        ds, batch_size=5, sampler=DistributedSampler(ds, num_replicas=2, rank=1, seed=3)),
    "custom-batch-sampler": lambda ds, wrap: wrap(ds, batch_sampler=EvensFirst(len(ds), 6)),
}


def distributed_epoch(loader, epoch: int) -> None:
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_batches_are_those_of_torch(kind, source, mount_cachefs):
    rels = make_files(source, 60, size=(100, 3000))
    mount = mount_cachefs(source, cache_size="64MiB")
    dataset = IndexedFiles(mount.path, rels)

    def plain():
        return LOADERS[kind](dataset, lambda ds, **kw: torch.utils.data.DataLoader(
            ds, num_workers=2, collate_fn=collate, **kw))

    def hinted():
        return LOADERS[kind](dataset, lambda ds, **kw: DataLoader(
            ds, num_workers=2, collate_fn=collate, **kw))

    expected = epochs_of(plain, 3, distributed_epoch)
    before = hint_total(mount)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a correct prediction never warns
        got = epochs_of(hinted, 3, distributed_epoch)
    assert got == expected
    assert len(set(expected[0])) == len(expected[0]) > 0
    # Every file the loader read was hinted (each at most once per epoch it was read in).
    reads = sum(len(e) for e in expected)
    wait_for(lambda: hint_total(mount) - before >= reads, what="hints to arrive")


def test_batch_sampler_wrapper_and_files_dataset(source, mount_cachefs):
    """The explicit form: wrap a batch sampler given a function from index to path."""
    make_files(source, 40, size=500)
    mount = mount_cachefs(source, cache_size="64MiB")
    dataset = FileDataset(mount.path)
    batches = list(BatchSampler(RandomSampler(dataset, generator=torch.Generator()
                                              .manual_seed(1)), 4, False))
    hinting = HintingBatchSampler(BatchSampler(RandomSampler(
        dataset, generator=torch.Generator().manual_seed(1)), 4, False), dataset.path_of,
        lookahead=3)
    assert list(hinting) == batches
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=hinting, num_workers=2,
                                         collate_fn=list)
    data = [item for batch in loader for item, _index in batch]
    assert sorted(data) == sorted(p.read_bytes() for p in sorted(source.rglob("*.bin")))
    wait_for(lambda: hint_total(mount) >= 40, what="hints to arrive")


def test_a_wrong_next_epoch_prediction_changes_nothing(source, mount_cachefs):
    """A sampler reseeded behind the client's back: hints across epochs stop, batches don't."""
    rels = make_files(source, 30, size=200)
    mount = mount_cachefs(source, cache_size="64MiB")
    dataset = IndexedFiles(mount.path, rels)

    def run(wrap):
        generator = torch.Generator().manual_seed(0)
        loader = wrap(dataset, batch_size=4, shuffle=True, generator=generator,
                      collate_fn=collate)
        out = []
        for epoch in range(3):
            generator.manual_seed(100 + epoch)  # unknowable to any prediction
            out.append([i for indices, _ in loader for i in indices])
        return out

    expected = run(torch.utils.data.DataLoader)
    with pytest.warns(RuntimeWarning, match="differed from the prediction"):
        got = run(DataLoader)
    assert got == expected


# -- hints make the misses local --------------------------------------------------------------

def remote_share(before: dict, after: dict) -> float:
    """Of the bytes readers got in between, the share they waited for from the remote."""
    def by_source(m, source):
        return m.get(("cachefs_read_bytes_total", (("source", source),)), 0.0)

    delta = {s: by_source(after, s) - by_source(before, s) for s in ("cache", "prefetch",
                                                                     "remote")}
    return delta["remote"] / sum(delta.values())


def train_epochs(mount, rels, *, hints: bool, epochs: int, step_seconds: float) -> list[float]:
    """Epochs of a DataLoader with 2 workers over the mount; the remote share of each."""
    dataset = IndexedFiles(mount.path, rels)
    wrap = DataLoader if hints else torch.utils.data.DataLoader
    loader = wrap(dataset, batch_size=8, shuffle=True, num_workers=2, collate_fn=collate,
                  generator=torch.Generator().manual_seed(7))
    shares = []
    for _ in range(epochs):
        # As for a dataset larger than the node's memory: no epoch finds the last one's pages.
        drop_page_cache()
        before = mount.metrics()
        for _batch in loader:
            time.sleep(step_seconds)  # the GPU step
        shares.append(remote_share(before, mount.metrics()))
    return shares


@pytest.mark.fast
@pytest.mark.skipif(os.geteuid() != 0, reason="drops the page cache")
def test_hints_take_the_remote_off_the_critical_path(tmp_path, source, remote, mount_cachefs):
    """f = 0.2 over an EFS-like remote: without hints about 80 % of the bytes a worker reads
    come from the remote while it waits; with hints almost none do."""
    rels = make_files(source, 240, size=(20_000, 60_000))
    remote.configure(meta_ms=1.0, open_ms=4.0, read_ms=4.0, bandwidth_mbps=200)
    # A pace the remote sustains: 8 files per 60 ms step, each file ~10 ms, 32 in flight.
    step = 0.06

    plain = mount_cachefs(remote.path, name="plain", cache_dir=tmp_path / "c1", fraction=0.2)
    unhinted = train_epochs(plain, rels, hints=False, epochs=2, step_seconds=step)
    plain.stop()

    hinted_mount = mount_cachefs(remote.path, name="hinted", cache_dir=tmp_path / "c2",
                                 fraction=0.2)
    hinted = train_epochs(hinted_mount, rels, hints=True, epochs=2, step_seconds=step)

    print(f"\nremote share of bytes read per epoch: without hints {unhinted}, with {hinted}")
    # Epoch 2: the cached fifth is local either way; hints make the other 80 % local too.
    assert unhinted[1] > 0.6
    assert hinted[1] < 0.05
    m = hinted_mount.metrics()
    used = m[("cachefs_prefetch_files_total", (("result", "used"),))]
    assert used >= 0.9 * 0.8 * len(rels)  # epoch 2's misses, at least
    assert m[("cachefs_prefetch_files_total", (("result", "failed"),))] == 0
    assert m[("cachefs_file_opens_total", (("result", "prefetched"),))] >= 0.9 * 0.8 * len(rels)
    # Nothing is read from the remote twice: epoch 1 reads everything, epoch 2 the
    # misses, plus what was prefetched for an epoch 3 that never came (still staged) and
    # the few hints that arrived after their file was opened (wasted).
    remote_bytes = m[("cachefs_remote_read_bytes_total", ())]
    dataset_bytes = sum((source / r).stat().st_size for r in rels)
    wasted = m[("cachefs_prefetch_files_total", (("result", "wasted"),))]
    assert wasted <= 0.1 * len(rels)
    assert remote_bytes <= (1 + 0.8) * dataset_bytes + m[("cachefs_staging_bytes", ())] \
        + wasted * 60_000


@pytest.mark.skipif(os.geteuid() != 0, reason="drops the page cache")
def test_remote_bytes_counted_in_a_hinted_first_epoch_are_those_the_remote_sent(
        source, remote, mount_cachefs):
    """f = 1, the first epoch with hints: readers overtake the prefetch, share its fills'
    files, or open files whose fill ends as they come; each file's bytes are counted once,
    as the remote sent them once."""
    rels = make_files(source, 300, size=(20_000, 120_000))
    remote.configure(meta_ms=0.5, open_ms=2.0, read_ms=2.0, bandwidth_mbps=100)
    mount = mount_cachefs(remote.path, fraction=1.0)
    before = remote.stats()["read_bytes"]
    train_epochs(mount, rels, hints=True, epochs=1, step_seconds=0.0)
    mount.settle()
    sent = remote.stats()["read_bytes"] - before
    assert sent == sum((source / rel).stat().st_size for rel in rels)
    assert mount.metric("cachefs_remote_read_bytes_total") == sent
    assert mount.status()["cache_files"] == len(rels)


def test_worker_read_mid_prefetch_fetches_once(source, remote, mount_cachefs):
    """A reader opening a file that is being prefetched waits for that fetch."""
    (source / "big.bin").write_bytes(os.urandom(3 * 2**20))
    remote.configure(read_ms=300.0)  # every remote read call takes 0.3 s
    mount = mount_cachefs(remote.path, cache_size="64MiB")
    reads_before = remote.stats()["read_bytes"]
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(os.readlink(mount.path / ".cachefs.sock"))
        sock.sendall(b"HINT big.bin\n")
    wait_for(lambda: mount.metric("cachefs_prefetch_inflight_files") == 1,
             what="the prefetch to start")
    assert (mount.path / "big.bin").read_bytes() == (source / "big.bin").read_bytes()
    assert remote.stats()["read_bytes"] - reads_before == 3 * 2**20


# -- attributes due: refreshed a directory at a time ahead of the reads ----------------------

def hint_and_settle(mount, rels: list[str]) -> None:
    """Send one HINT per path on the control socket and wait until each is settled."""
    settled = hint_total(mount)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(os.readlink(mount.path / ".cachefs.sock"))
        sock.sendall(b"".join(b"HINT " + rel.encode() + b"\n" for rel in rels))
    wait_for(lambda: hint_total(mount) >= settled + len(rels)
             and mount.metric("cachefs_prefetch_inflight_files") == 0, what="hints settled")


def remote_ops(remote) -> dict[str, int]:
    return dict(remote.stats()["ops"])


def ops_since(remote, before: dict[str, int]) -> dict[str, int]:
    return {op: n - before.get(op, 0) for op, n in remote_ops(remote).items()
            if n - before.get(op, 0)}


def test_hints_refresh_due_attributes_one_listing_per_directory(source, remote, mount_cachefs):
    """Every cached file's attributes due: the hints of the next epoch refresh them with one
    listing of each directory (the remote's attributes come with it, as NFS READDIRPLUS
    brings them), not one remote lookup per file, and the epoch reads no remote at all."""
    rels = make_files(source, 150, size=2000, per_dir=50)  # 3 directories
    remote.configure(actimeo_s=30.0)  # what an NFS client keeps of a listing
    mount = mount_cachefs(remote.path, fraction=1.0, revalidate=1)
    for rel in rels:
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes()
    time.sleep(1.3)  # every attribute due

    before = remote_ops(remote)
    hint_and_settle(mount, rels)
    refresh = ops_since(remote, before)
    assert 3 <= refresh.get("readdir", 0) <= 6, refresh
    assert refresh.get("getattr", 0) <= 6, refresh  # the directories themselves, at most

    before, hits = remote_ops(remote), mount.metric("cachefs_file_opens_total", result="hit")
    for rel in rels:
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes()
    assert ops_since(remote, before) == {}  # attributes fresh, bytes local
    assert mount.metric("cachefs_file_opens_total", result="hit") == hits + len(rels)


def test_a_directory_listing_sees_a_changed_file(source, remote, mount_cachefs):
    """The listing that refreshes a directory's attributes is a revalidation like any other:
    a file changed on the remote is read anew after it, the others stay cached."""
    rels = make_files(source, 20, size=3000, per_dir=20)
    mount = mount_cachefs(remote.path, fraction=1.0, revalidate=1)
    for rel in rels:
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes()
    (source / rels[7]).write_bytes(b"rewritten on the remote")
    time.sleep(1.3)
    hint_and_settle(mount, rels)
    remote_before = mount.metric("cachefs_remote_read_bytes_total")
    for rel in rels:
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes()
    assert mount.metric("cachefs_remote_read_bytes_total") - remote_before \
        <= len(b"rewritten on the remote")


def test_ls_through_the_mount_refreshes_the_names_listed(source, remote, mount_cachefs):
    """`ls -l` through the mount: the listing gives the names only (`find` wants no more),
    the first name stat'ed has the directory listed with its attributes, and the lookups of
    the other names use those, without a remote lookup of their own."""
    rels = make_files(source, 60, size=100, per_dir=60)
    mount = mount_cachefs(remote.path, revalidate=60)
    directory = mount.path / rels[0].split("/")[0]
    names = sorted(os.listdir(directory))
    assert names == sorted(rel.split("/")[1] for rel in rels)
    assert os.lstat(directory / names[0]).st_size == 100
    # From now on a remote lookup of any of those names fails.
    remote.set_fault("errno", errno=errno.EIO, ops=["getattr"], glob="*/img*")
    assert {name: os.lstat(directory / name).st_size for name in names[1:]} \
        == dict.fromkeys(names[1:], 100)
    with pytest.raises(OSError) as missing:
        os.lstat(directory / "img-not-listed")
    assert missing.value.errno == errno.EIO  # the fault is there, for what was not listed


def test_a_directory_read_name_by_name_is_listed_once_in_the_background(source, remote,
                                                                        mount_cachefs):
    """A first epoch looks its names up one at a time: a few lookups in a directory list
    nothing, but once LIST_AFTER_LOOKUPS of them have gone to the remote the directory is
    listed, once, off the readers' path, and the names after that need no lookup of their
    own on the remote."""
    rels = make_files(source, 120, size=300, per_dir=120)
    remote.configure(actimeo_s=30.0)  # the listing's lstats answered by the NFS client
    mount = mount_cachefs(remote.path, revalidate=60)
    before = remote_ops(remote)
    for rel in rels[:LIST_AFTER_LOOKUPS - 1]:
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes()
    time.sleep(0.5)
    assert "readdir" not in ops_since(remote, before)

    rel = rels[LIST_AFTER_LOOKUPS - 1]
    assert (mount.path / rel).read_bytes() == (source / rel).read_bytes()
    # From now on a remote lookup of a file fails: the rest read only with the listing's
    # attributes, once the daemon holds them.
    remote.set_fault("errno", errno=errno.EIO, ops=["getattr"], glob="*/img*")
    last = mount.path / rels[-1]
    wait_for(lambda: errno_of(last.read_bytes) is None, what="the listing's attributes")
    for rel in rels[LIST_AFTER_LOOKUPS:]:
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes()
    assert ops_since(remote, before).get("readdir") == 1


# -- hints are advisory -------------------------------------------------------------------------

def test_invalid_and_hostile_hints_are_counted_and_ignored(tmp_path, source, remote,
                                                           mount_cachefs):
    make_files(source, 3, size=1000)
    (tmp_path / "outside.bin").write_bytes(b"secret")
    os.symlink(tmp_path / "outside.bin", source / "leads-out")
    mount = mount_cachefs(remote.path, cache_size="64MiB")
    hostile = [
        b"../outside.bin", b"/etc/passwd", str(tmp_path / "outside.bin").encode(),
        b"leads-out", b"no/such/file", b"class0000/img000000.bin\x00../x", b"\xff\xfe\x00junk",
        b"class0000", b"",
    ]
    reads_before = remote.stats()["read_bytes"]
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(os.readlink(mount.path / ".cachefs.sock"))
        for path in hostile:
            sock.sendall(b"HINT " + path + b"\n")
        sock.sendall(b"HINT " + b"a" * 3_000_000 + b"\n")  # a multi-megabyte line
        sock.sendall(b"\x00\x01\x02 binary junk without a verb\n")
        sock.sendall(b"HINT class0000/img000001.bin\n")  # still heard after all that
    wait_for(lambda: mount.metric("cachefs_hints_total", result="accepted") == 1,
             what="the good hint")
    wait_for(lambda: mount.metric("cachefs_hints_total", result="invalid") >= len(hostile) + 1,
             what="the bad hints to be counted")
    assert mount.metric("cachefs_hints_total", result="accepted") == 1
    # Only the good file was read from the remote.
    assert remote.stats()["read_bytes"] - reads_before == 1000
    assert (mount.path / "class0000/img000002.bin").read_bytes() == \
        (source / "class0000/img000002.bin").read_bytes()



def test_a_hint_repeated_while_the_first_is_looked_at_counts_as_the_first(source, remote,
                                                                        mount_cachefs):
    """Hints of a path the remote does not have, sent again while the first is still being
    looked up (a slow remote), are all counted invalid; of a real file, all accepted."""
    make_files(source, 2, size=1000)
    mount = mount_cachefs(remote.path, cache_size="64MiB")
    remote.configure(meta_ms=1000)
    hints = b"HINT class0000/no-such-file.bin\nHINT class0000/img000001.bin\n"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(os.readlink(mount.path / ".cachefs.sock"))
        sock.sendall(hints)
        time.sleep(0.3)  # taken from the queue and waiting on the remote by now
        sock.sendall(hints * 2)
    wait_for(lambda: mount.metric("cachefs_hints_total", result="invalid") == 3
             and mount.metric("cachefs_hints_total", result="accepted") == 3,
             what="every hint counted")
    remote.configure(meta_ms=0)
    assert mount.metric("cachefs_hints_total", result="invalid") == 3
    assert mount.metric("cachefs_hints_total", result="accepted") == 3
    assert mount.metric("cachefs_hints_total", result="dropped") == 0
    assert (mount.path / "class0000/img000001.bin").read_bytes() == \
        (source / "class0000/img000001.bin").read_bytes()


# -- the sender survives the daemon -----------------------------------------------------------

HINTING_WORKERS = """
import os, sys, warnings
import torch
from cachefs_client import send_hints

class HintsFromWorkers(torch.utils.data.Dataset):
    def __init__(self, paths): self.paths = paths
    def __len__(self): return len(self.paths)
    def __getitem__(self, i):
        send_hints([self.paths[(i + 1) % len(self.paths)]])   # from the worker process
        with open(self.paths[i], "rb") as f:
            return len(f.read())

if __name__ == "__main__":
    method, paths = sys.argv[1], sys.argv[2:]
    loader = torch.utils.data.DataLoader(HintsFromWorkers(paths), batch_size=4,
                                         num_workers=2, multiprocessing_context=method)
    print(sum(int(b.sum()) for b in loader))
"""


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_workers_hint_under_every_start_method(tmp_path, method, source, mount_cachefs):
    rels = make_files(source, 24, size=700)
    mount = mount_cachefs(source, cache_size="64MiB")
    script = tmp_path / "hinting_workers.py"
    script.write_text(HINTING_WORKERS)
    before = hint_total(mount)
    result = subprocess.run([sys.executable, str(script), method,
                             *[str(mount.path / r) for r in rels]], capture_output=True,
                            text=True, timeout=100, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == 24 * 700
    # The client's warnings start "cachefs:"; Python's resource tracker may warn about a
    # semaphore at spawn teardown under load, which is not ours.
    assert "cachefs:" not in result.stderr
    wait_for(lambda: hint_total(mount) - before >= 24, what="the workers' hints")


KILLED_DAEMON = """
import os, signal, sys, time, warnings
import torch
from cachefs_client import DataLoader

class LocalFiles(torch.utils.data.Dataset):
    # Reads a local copy, hints the mount: the daemon's death must not matter.
    def __init__(self, local, mounted): self.local, self.mounted = local, mounted
    def __len__(self): return len(self.local)
    def path_of(self, i): return self.mounted[i]
    def __getitem__(self, i):
        with open(self.local[i], "rb") as f:
            return len(f.read())

if __name__ == "__main__":
    daemon_pid, n = int(sys.argv[1]), (len(sys.argv) - 2) // 2
    local, mounted = sys.argv[2:2 + n], sys.argv[2 + n:]
    loader = DataLoader(LocalFiles(local, mounted), batch_size=4, num_workers=2, shuffle=True)
    total = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            for number, batch in enumerate(loader):
                if epoch == 0 and number == 3:
                    os.kill(daemon_pid, signal.SIGKILL)
                total += int(batch.sum())
    print(total, sum("training goes on" in str(w.message) for w in caught))
"""


def test_training_goes_on_when_the_daemon_dies(tmp_path, source, mount_cachefs):
    rels = make_files(source, 80, size=300)
    mount = mount_cachefs(source, cache_size="64MiB")
    script = tmp_path / "killed_daemon.py"
    script.write_text(KILLED_DAEMON)
    result = subprocess.run([sys.executable, str(script), str(mount.pid),
                             *[str(source / r) for r in rels],
                             *[str(mount.path / r) for r in rels]],
                            capture_output=True, text=True, timeout=100, cwd=REPO)
    assert result.returncode == 0, result.stderr
    total, warned = result.stdout.split()
    assert int(total) == 2 * 80 * 300      # both epochs, every batch
    assert int(warned) == 1                # said once, not per batch
    mount.stop()


def test_hints_to_a_path_on_no_mount_warn_once(tmp_path):
    cachefs_client._daemon._warned.clear()
    with pytest.warns(RuntimeWarning, match="not on a cachefs mount"):
        assert cachefs_client.send_hints([tmp_path / "a", tmp_path / "b"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cachefs_client.send_hints([tmp_path / "c"]) == 0


NOT_A_PATH = """
import sys, warnings
import torch
from cachefs_client import DataLoader

class Numbers(torch.utils.data.Dataset):
    def __len__(self): return 40
    def __getitem__(self, i): return i

if __name__ == "__main__":
    # path_of gives the index, not a path: a slip of the user's, not a reason to stop.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = DataLoader(Numbers(), batch_size=4, num_workers=2, shuffle=True,
                            path_of=lambda i: i, generator=torch.Generator().manual_seed(3))
        seen = sorted(int(i) for epoch in range(2) for batch in loader for i in batch)
    print(seen == sorted(list(range(40)) * 2))
    print(len(caught), caught[0].message if caught else "")
"""


def test_a_path_of_that_gives_no_path_warns_once_and_training_goes_on(tmp_path):
    script = tmp_path / "not_a_path.py"
    script.write_text(NOT_A_PATH)
    result = subprocess.run([sys.executable, "-X", "dev", str(script)], capture_output=True,
                            text=True, timeout=100, cwd=REPO)
    assert result.returncode == 0, result.stderr
    every_sample, warning = result.stdout.splitlines()
    assert every_sample == "True"
    assert warning.startswith("1 cachefs: 0 is not a path ("), warning
    assert "no hints are sent for such paths" in warning
    assert "ResourceWarning" not in result.stderr and "Traceback" not in result.stderr


# -- warm -----------------------------------------------------------------------------------------

def test_warm_fills_the_cache_from_a_list(tmp_path, source, remote, mount_cachefs):
    rels = make_files(source, 50, size=(1000, 5000))
    (source / "loop").symlink_to("loop")
    mount = mount_cachefs(remote.path, cache_size="64MiB")
    listing = tmp_path / "list.txt"
    # Entries that fail, each in its own way, among the files: a name longer than the remote
    # allows (ENAMETOOLONG), a symlink to itself (ELOOP), a file taken for a directory.
    failing = ["no/such.bin", "../escape", "class0000/" + "x" * 300, "loop", f"{rels[0]}/a"]
    listing.write_text("\n".join([*rels[:25], *failing, *rels[25:]]) + "\n")
    result = run_cachefs("warm", str(mount.path), "--list", str(listing))
    assert result.returncode == 1, result.stderr   # the failing entries failed, and it says so
    summary = result.stdout + result.stderr
    assert "warmed 55 files" in summary and "50 fetched" in summary, summary
    assert f"{len(failing)} failed" in summary, summary
    assert "Traceback" not in summary
    assert mount.metric("cachefs_cache_files") == 50
    remote_before = mount.metric("cachefs_remote_read_bytes_total")
    for rel in rels:
        assert (mount.path / rel).read_bytes() == (source / rel).read_bytes()
    assert mount.metric("cachefs_remote_read_bytes_total") == remote_before
    assert mount.metric("cachefs_file_opens_total", result="hit") == 50
    # One file: said as one.
    listing.write_text(f"{rels[0]}\n")
    again = run_cachefs("warm", str(mount.path), "--list", str(listing))
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("warmed 1 file in "), again.stdout
    assert ": 0 fetched " in again.stdout and "1 already cached" in again.stdout, again.stdout


def test_warm_of_every_file_passes_over_a_name_it_cannot_send(source, mount_cachefs):
    """A walk of the mount finds a name holding a newline, which a request line cannot carry:
    it fails alone, and every other file is answered as itself (the answers once slid by
    one from there on, and the warm ended in a traceback)."""
    rels = make_files(source, 30, size=100)
    (source / "class0000" / "two\nlines.bin").write_bytes(b"x" * 100)
    mount = mount_cachefs(source, cache_size="64MiB")
    result = run_cachefs("warm", str(mount.path))
    assert result.returncode == 1, result.stderr
    assert "warmed 31 files" in result.stdout and "30 fetched" in result.stdout, result.stdout
    assert "1 failed" in result.stdout
    assert "  failed: class0000/two\\nlines.bin: name holds a newline" in result.stderr
    assert "Traceback" not in result.stderr
    assert mount.metric("cachefs_cache_files") == len(rels)
    for bad in ("0", "257", "many"):
        refused = run_cachefs("warm", str(mount.path), "--connections", bad)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
        assert "--connections" in refused.stderr and "from 1 to 256" in refused.stderr


def test_warm_of_every_file_passes_over_links_pipes_and_devices(source, mount_cachefs):
    """A dataset holding a symlink out of the tree, one into it, a pipe and a device node:
    a walk of the mount sees each as what it is, and a warm of the whole mount fetches the
    regular files and ends well (each such entry once failed it, with status 1)."""
    rels = make_files(source, 20, size=100)
    (source / "class0000" / "outside").symlink_to("/etc/hostname")
    (source / "class0000" / "inside").symlink_to(os.path.basename(rels[0]))
    os.mkfifo(source / "class0000" / "pipe")
    os.mknod(source / "class0000" / "zero", 0o644 | stat.S_IFCHR, os.makedev(1, 5))
    mount = mount_cachefs(source, cache_size="64MiB")
    # The listing gives each entry's own type, as its lookup does (it once said "regular
    # file" for the pipe and the device node, and `find -type f` listed them).
    with os.scandir(mount.path / "class0000") as entries:
        kinds = {e.name: (e.is_file(follow_symlinks=False), e.is_symlink()) for e in entries}
    assert kinds["pipe"] == kinds["zero"] == (False, False)
    assert kinds["outside"] == kinds["inside"] == (False, True)
    result = run_cachefs("warm", str(mount.path), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warmed 20 files" in result.stdout and "20 fetched" in result.stdout, result.stdout
    assert mount.metric("cachefs_cache_files") == len(rels)


def test_warm_reads_the_list_from_stdin(source, mount_cachefs):
    rels = make_files(source, 10, size=100)
    mount = mount_cachefs(source, cache_size="64MiB")
    result = subprocess.run([sys.executable, "-m", "cachefs", "warm", str(mount.path),
                             "--list", "-"], input="\n".join(str(mount.path / r) for r in rels),
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert mount.metric("cachefs_cache_files") == 10

