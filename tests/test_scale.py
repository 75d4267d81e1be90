"""What keeps the daemon's memory flat as the dataset grows, and the kernel's share of a
listing: bounded caches still give the right bytes, and listings the kernel caches or takes
with attributes are the remote's, changes included."""

from __future__ import annotations

import os
import random
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefs.sizes import format_bytes
from tests.conftest import registered_backing_ids

pytestmark = pytest.mark.timeout(300)

FILES_PER_DIRECTORY = 500


def make_tree(root: Path, directories: int, seed: int = 3) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {}
    for d in range(directories):
        (root / f"d{d:02d}").mkdir()
        for i in range(FILES_PER_DIRECTORY):
            rel = f"d{d:02d}/{i:04d}-{'n' * (i % 40)}.bin"
            data = rng.randbytes(rng.randint(0, 3000))
            (root / rel).write_bytes(data)
            files[rel] = data
    return files


def drop_dentries() -> None:
    """The kernel forgets the mount's nodes (FORGET reaches the daemon for each)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("2")


def test_a_tree_larger_than_every_bound_is_read_twice_with_the_right_bytes(
        source, remote, mount_cachefs):
    files = make_tree(source, directories=6)  # 3,000 files
    mount = mount_cachefs(remote.path, attr_cache_entries=1000, held_files=64, fraction=0.5)
    names = sorted(files)
    for epoch in range(2):
        random.Random(epoch).shuffle(names)
        for rel in names:
            assert (mount.path / rel).read_bytes() == files[rel], (epoch, rel)
        mount.settle()
        drop_dentries()  # the second epoch looks every name up again
    memory = mount.status()["memory"]
    assert 0 < memory["attr_cache_entries"] <= 1000
    assert memory["attr_cache_capacity_entries"] == 1000
    # 3,006 names (the directories' too) through 1,000 entries, twice: the room was made by
    # dropping, and the count says so, in status and in the metrics.
    assert memory["attr_cache_dropped"] >= 2 * (len(files) - 1000)
    assert mount.metric("cachefs_attr_cache_dropped_total") == memory["attr_cache_dropped"]
    shown = subprocess.run([sys.executable, "-m", "cachefs", "status", str(mount.path)],
                           capture_output=True, text=True, timeout=30).stdout
    assert f"(at most 1,000, {memory['attr_cache_dropped']:,} dropped for room)" in shown
    if mount.status()["data_path"].startswith("kernel passthrough"):
        assert 0 < memory["held_files"] <= memory["held_files_max"] == 64
    assert mount.metric("cachefs_attr_cache_capacity_entries") == 1000
    # The kernel forgot its nodes: the table holds what it still references, not every file.
    assert mount.metric("cachefs_nodes") < len(files) / 2


def test_a_bound_just_under_the_names_drops_few_of_them_each_pass(
        source, remote, mount_cachefs):
    """Past its bound the attribute cache drops its oldest names a few at a time: shuffled
    passes over a few more names than the bound (1,000 files, their 2 directories) each drop
    and look up again a few, where a tenth dropped at a time made it 100 a pass."""
    files = make_tree(source, directories=2)
    mount = mount_cachefs(remote.path, attr_cache_entries=1000, revalidate=600)
    names = sorted(files)
    dropped = []
    for epoch in range(3):
        before = mount.metric("cachefs_attr_cache_dropped_total")
        random.Random(epoch).shuffle(names)
        for rel in names:
            assert (mount.path / rel).read_bytes() == files[rel], (epoch, rel)
        mount.settle()
        drop_dentries()
        dropped.append(mount.metric("cachefs_attr_cache_dropped_total") - before)
    assert dropped[0] >= 1, dropped  # over the bound: some dropped
    assert all(later <= 30 for later in dropped[1:]), dropped


def test_a_stable_set_of_files_stays_held_across_shuffled_epochs(
        source, remote, mount_cachefs):
    """Past the bound, the files held are the first to come, not the most recently opened.
    Read in a new random order each epoch, the most recently opened were pushed out before
    their turn came again (6 of the 500 opens of an epoch found their file held); the first
    64 are found held every epoch."""
    files = make_tree(source, directories=1)  # 500 files
    mount = mount_cachefs(remote.path, held_files=64, fraction=1.0)
    names = sorted(files)
    for rel in names:  # filled
        assert (mount.path / rel).read_bytes() == files[rel]
    mount.settle()
    for epoch in range(3):  # the first holds the first 64 it opens
        held_opens = mount.metric("cachefs_held_file_opens_total")
        for rel in random.Random(epoch).sample(names, len(names)):
            assert (mount.path / rel).read_bytes() == files[rel], (epoch, rel)
        if epoch:
            assert mount.metric("cachefs_held_file_opens_total") - held_opens == 64, epoch
    assert mount.status()["memory"]["held_files"] == 64


def test_held_files_open_past_the_bound_stay_readable_and_are_all_accounted_for(
        source, remote, mount_cachefs):
    """Files held while readers keep them open, and files opened past the bound around them
    (registered for their open alone, let go at its release): all read right, and the kernel
    is left with no backing file the daemon lost track of."""
    files = make_tree(source, directories=1)  # 500 files
    mount = mount_cachefs(remote.path, held_files=64, fraction=1.0)
    passthrough = mount.status()["data_path"].startswith("kernel passthrough")
    names = sorted(files)
    for rel in names:  # filled
        assert (mount.path / rel).read_bytes() == files[rel]
    mount.settle()
    kept_open = names[:20]
    readers = [open(mount.path / rel, "rb") for rel in kept_open]  # held, then in use
    try:
        for reader, rel in zip(readers, kept_open, strict=True):
            assert reader.read(100) == files[rel][:100]
        for epoch in range(2):  # the held files filled up, the rest opened past the bound
            for rel in random.Random(epoch).sample(names[20:], len(names) - 20):
                assert (mount.path / rel).read_bytes() == files[rel], (epoch, rel)
        for reader, rel in zip(readers, kept_open, strict=True):
            assert reader.read() == files[rel][100:], rel
    finally:
        for reader in readers:
            reader.close()
    for rel in kept_open:  # held again
        assert (mount.path / rel).read_bytes() == files[rel]
    mount.settle()
    held = mount.status()["memory"]["held_files"]
    assert 20 <= held <= 64
    if passthrough:
        assert registered_backing_ids(mount.supervisor_pid, highest=4 * len(names)) == held
    else:  # each held file a descriptor of the daemon's
        data = f"{(mount.cache_dir / 'data').resolve()}/"
        open_files = [os.readlink(f"/proc/{mount.pid}/fd/{fd}")
                      for fd in os.listdir(f"/proc/{mount.pid}/fd")]
        assert sum(path.startswith(data) for path in open_files) == held


def walk_directory(mount, names: list[str]) -> None:
    """Each of ``names`` (files of 1 byte) looked up and stat'ed in turn, with a pause after
    the one whose lookup has its directory decided on in the background, to let it be."""
    from cachefs.remote.attrcache import LIST_AFTER_LOOKUPS

    for number, name in enumerate(names, 1):
        assert os.lstat(mount.path / name).st_size == 1
        if number == LIST_AFTER_LOOKUPS:
            time.sleep(0.2)


def test_directories_are_no_longer_listed_when_their_names_are_dropped_unused(
        source, remote, mount_cachefs):
    """A directory looked up name by name is listed in the background, so that its other
    names need no remote lookup; but when more names are walked than the attribute cache
    holds, a listing's names are dropped before they are looked up, and each listing only
    costs the remote and the daemon.  The daemon counts what its listings' names were used
    for and stops listing once fewer than half were, but for a directory now and then: once
    as many names were looked up one by one as the last listing brought."""
    from cachefs.remote.attrcache import LISTING_TALLY_MIN
    from tests.conftest import make_files

    directories, per_dir, later = 100, 200, 10
    rels = make_files(source, (directories + later) * per_dir, size=1, per_dir=per_dir)
    mount = mount_cachefs(remote.path, attr_cache_entries=1000, revalidate=600)
    by_dir = [rels[d * per_dir:(d + 1) * per_dir] for d in range(directories + later)]
    by_dir, later_dirs = by_dir[:directories], by_dir[directories:]
    before = dict(remote.stats()["ops"])
    # Across the directories, as a shuffled epoch walks them: each directory's listing comes
    # well before most of its names are looked up, by when the names of later listings
    # have pushed them out.
    for number in range(per_dir):
        for names in by_dir:
            assert os.lstat(mount.path / names[number]).st_size == 1
    mount.settle()
    listings = remote.stats()["ops"].get("readdir", 0) - before.get("readdir", 0)
    # Each directory is decided on once (revalidate outlasts the walk): listed until the
    # tally holds LISTING_TALLY_MIN names (all but a few of each listing's dropped unused),
    # then one per 200 names looked up one by one.  Listing every one took 100.
    assert LISTING_TALLY_MIN // per_dir <= listings <= directories // 2
    memory = mount.status()["memory"]
    assert memory["attr_listing_used_share"] < 0.5 and not memory["attr_listings_pay"]
    assert mount.metric("cachefs_attr_listing_used_ratio") == memory["attr_listing_used_share"]
    shown = subprocess.run([sys.executable, "-m", "cachefs", "status", str(mount.path)],
                           capture_output=True, text=True, timeout=30).stdout
    assert "a walked directory listed only now and then" in shown

    # Then directories walked one after another, each from its first name to its last: the
    # first is listed (it comes after many names looked up one by one), its names then found
    # in memory; the next is not (8 names looked up one by one since that listing, which
    # brought 200), and the rest of its names are looked up one by one; which has the third
    # listed; and so on: every other one.  Listing all would list 10, one in 16 none or one.
    before = dict(remote.stats()["ops"])
    for names in later_dirs:
        walk_directory(mount, names)
    listings = remote.stats()["ops"].get("readdir", 0) - before.get("readdir", 0)
    assert listings == later // 2, listings
    assert not mount.status()["memory"]["attr_listings_pay"]


def test_where_lookups_are_round_trips_a_listing_pays_with_a_fifth_of_its_names_used(
        source, remote, mount_cachefs):
    """On NFS a listing brings its names' attributes in a few round trips, where each name
    looked up on its own is one: a listing pays with far fewer of its names used than on a
    local disk, where it stats each name as a lookup would.  The daemon measures both costs.
    A pass over a quarter of each directory's names, walked one directory after another, so
    uses a fifth of what each listing brings, and every directory is still listed."""
    from tests.conftest import make_files

    directories, per_dir, read, later = 30, 200, 50, 10
    rels = make_files(source, (directories + later) * per_dir, size=1, per_dir=per_dir)
    remote.configure(meta_ms=2.0, actimeo_s=30.0)  # the listing's lstats: the NFS client's
    # Fewer attributes remembered than a pass lists: what a listing brought and the pass did
    # not use is dropped, and counted unused.
    mount = mount_cachefs(remote.path, attr_cache_entries=1000, revalidate=600)

    by_dir = [rels[d * per_dir:(d + 1) * per_dir] for d in range(directories + later)]
    for names in by_dir[:directories]:
        walk_directory(mount, names[:read])
    memory = mount.status()["memory"]
    assert 0.15 <= memory["attr_listing_used_share"] <= 0.3, memory
    pays = memory["attr_listing_pays_share"]
    assert pays < 0.15 and memory["attr_listings_pay"], memory
    assert mount.metric("cachefs_attr_listing_pays_ratio") == pytest.approx(pays)
    shown = subprocess.run([sys.executable, "-m", "cachefs", "status", str(mount.path)],
                           capture_output=True, text=True, timeout=30).stdout
    assert f"(they pay above {pays:.0%}): directories walked name by name listed" in shown

    # And so is every directory walked after the tally is trusted.  Judged by half of a
    # listing's names used, whatever the remote, 2 of these 10 were.
    before = dict(remote.stats()["ops"])
    for names in by_dir[directories:]:
        walk_directory(mount, names[:read])
    listings = remote.stats()["ops"].get("readdir", 0) - before.get("readdir", 0)
    assert listings == later, listings


def test_the_held_files_bound_is_a_share_of_the_memory_the_daemon_may_use(
        source, remote, mount_cachefs):
    from cachefs.limits import memory_limit_bytes
    from cachefs.service.memory import default_held_files

    (source / "f.bin").write_bytes(b"x")
    mount = mount_cachefs(remote.path)
    if not mount.status()["data_path"].startswith("kernel passthrough"):
        pytest.skip("held files are descriptors of the daemon's without passthrough")
    held_max = mount.status()["memory"]["held_files_max"]
    assert held_max == default_held_files() == \
        max(65536, min(10_000_000, memory_limit_bytes() // 64 // 2048))
    assert mount.metric("cachefs_held_files_max") == held_max
    shown = subprocess.run([sys.executable, "-m", "cachefs", "status", str(mount.path)],
                           capture_output=True, text=True, timeout=30).stdout
    assert f"(at most {held_max:,})" in shown
    # Given, it is what is given.
    mount.stop()
    mount = mount_cachefs(remote.path, name="given", held_files=1000)
    assert mount.status()["memory"]["held_files_max"] == 1000


def test_the_staging_bound_is_a_share_of_the_memory_the_daemon_may_use(
        source, remote, mount_cachefs):
    from cachefs.limits import memory_limit_bytes
    from cachefs.service.memory import default_staging_bytes

    (source / "f.bin").write_bytes(b"x")
    mount = mount_cachefs(remote.path)
    staging_max = mount.status()["memory"]["staging_bytes_max"]
    assert staging_max == default_staging_bytes() == \
        max(32 << 20, min(512 << 20, memory_limit_bytes() // 16))
    assert mount.metric("cachefs_staging_bytes_max") == staging_max
    shown = subprocess.run([sys.executable, "-m", "cachefs", "status", str(mount.path)],
                           capture_output=True, text=True, timeout=30).stdout
    assert f"(at most {format_bytes(staging_max)})" in shown
    mount.stop()
    mount = mount_cachefs(remote.path, name="given", staging_size="1MiB")
    assert mount.status()["memory"]["staging_bytes_max"] == 1 << 20


def test_the_memory_limit_is_the_lowest_of_the_cgroups_above(tmp_path):
    from cachefs.limits import cgroup_memory_limit
    from cachefs.service.memory import default_held_files, default_staging_bytes

    membership = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    (v2 / "pods" / "pod1" / "cachefs").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "pods" / "memory.max").write_text(f"{64 << 30}\n")
    (v2 / "pods" / "pod1" / "memory.max").write_text(f"{16 << 30}\n")
    (v2 / "pods" / "pod1" / "cachefs" / "memory.max").write_text("max\n")
    membership.write_text("0::/pods/pod1/cachefs\n")
    assert cgroup_memory_limit(v2, membership) == 16 << 30
    assert default_held_files(16 << 30) == 131072
    # In a container the cgroup it is in is the root it sees.
    container = tmp_path / "container"
    container.mkdir()
    (container / "cgroup.controllers").write_text("cpu memory\n")
    (container / "memory.max").write_text("max\n")
    membership.write_text("0::/elsewhere/cachefs\n")
    assert cgroup_memory_limit(container, membership) is None
    (container / "memory.max").write_text(f"{4 << 30}\n")
    assert cgroup_memory_limit(container, membership) == 4 << 30
    assert default_held_files(4 << 30) == 65536  # the floor
    assert default_staging_bytes(4 << 30) == 256 << 20
    assert default_staging_bytes(64 << 30) == 512 << 20  # the ceiling
    assert default_staging_bytes(256 << 20) == 32 << 20  # the floor

    v1 = tmp_path / "v1"
    (v1 / "memory" / "unit").mkdir(parents=True)
    (v1 / "memory" / "unit" / "memory.limit_in_bytes").write_text(f"{32 << 30}\n")
    membership.write_text("4:memory:/unit\n0::/\n")
    assert cgroup_memory_limit(v1, membership) == 32 << 30
    (v1 / "memory" / "unit" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_memory_limit(v1, membership) is None  # v1's "no limit"
    membership.write_text("garbage\n")
    assert cgroup_memory_limit(v1, membership) is None


def test_the_cores_are_the_fewest_the_affinity_and_the_cgroups_cpu_quotas_allow(tmp_path):
    from cachefs.limits import cpu_quota, usable_cores

    membership = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    (v2 / "kubepods" / "pod1" / "cachefs").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpu memory\n")
    (v2 / "kubepods" / "cpu.max").write_text("max 100000\n")
    (v2 / "kubepods" / "pod1" / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    (v2 / "kubepods" / "pod1" / "cachefs" / "cpu.max").write_text("400000 100000\n")
    membership.write_text("0::/kubepods/pod1/cachefs\n")
    assert cpu_quota(v2, membership) == 1.5
    assert usable_cores(v2, membership) == min(2, len(os.sched_getaffinity(0)))
    (v2 / "kubepods" / "pod1" / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(v2, membership) == 4.0
    (v2 / "kubepods" / "pod1" / "cachefs" / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(v2, membership) is None
    assert usable_cores(v2, membership) == len(os.sched_getaffinity(0))
    (v2 / "kubepods" / "pod1" / "cachefs" / "cpu.max").write_text("20000 100000\n")
    assert usable_cores(v2, membership) == 1  # a fifth of a CPU still runs a thread

    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "unit").mkdir(parents=True)  # mounted under the names it shares
    (v1 / "cpu,cpuacct" / "unit" / "cpu.cfs_period_us").write_text("100000\n")
    (v1 / "cpu,cpuacct" / "unit" / "cpu.cfs_quota_us").write_text("300000\n")
    membership.write_text("3:cpu,cpuacct:/unit\n4:memory:/unit\n")
    assert cpu_quota(v1, membership) == 3.0
    (v1 / "cpu,cpuacct" / "unit" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(v1, membership) is None  # v1's "no quota"
    membership.write_text("garbage\n")
    assert cpu_quota(v1, membership) is None


def _threads_cpus(pid: int) -> set[frozenset[int]]:
    """The CPUs each thread of ``pid`` may run on, as a set of the distinct sets."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def test_the_serving_threads_keep_to_one_cpu_unless_told_otherwise(
        source, remote, mount_cachefs):
    """--cpus: by default every thread of the serving process keeps to one CPU (they take
    turns at one interpreter lock); 'all' leaves them every CPU, a list the CPUs named."""
    (source / "f.bin").write_bytes(b"x" * 70_000)
    allowed = frozenset(os.sched_getaffinity(0))
    mount = mount_cachefs(remote.path, fraction=1.0)
    assert (mount.path / "f.bin").read_bytes() == b"x" * 70_000
    pid = mount.status()["pid"]
    assert len(os.listdir(f"/proc/{pid}/task")) > 5  # the fuse, fill, prefetch... threads
    ((cpu,),) = _threads_cpus(pid)  # one set of one CPU
    if len(allowed) > 1:
        assert mount.status()["cpus"] == str(cpu)
        shown = subprocess.run([sys.executable, "-m", "cachefs", "status", str(mount.path)],
                               capture_output=True, text=True, timeout=30).stdout
        assert f"serving on CPU {cpu};" in shown
    mount.stop()
    mount = mount_cachefs(remote.path, name="all", cpus="all")
    assert (mount.path / "f.bin").read_bytes() == b"x" * 70_000
    assert _threads_cpus(mount.status()["pid"]) == {allowed}
    assert mount.status()["cpus"] == "all it may run on"
    mount.stop()
    named = max(allowed)
    mount = mount_cachefs(remote.path, name="named", cpus=str(named))
    assert (mount.path / "f.bin").read_bytes() == b"x" * 70_000
    assert _threads_cpus(mount.status()["pid"]) == {frozenset({named})}


def test_the_daemon_sizes_its_threads_by_the_cores_it_may_run_on(
        source, remote, mount_cachefs):
    """A daemon started on one CPU of the machine's (its affinity, as `taskset` or a cpuset
    gives it) counts one core, and says so."""
    (source / "f.bin").write_bytes(b"x")
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        mount = mount_cachefs(remote.path)  # inherits this process's affinity
    finally:
        os.sched_setaffinity(0, allowed)
    assert mount.status()["cores"] == 1
    assert (mount.path / "f.bin").read_bytes() == b"x"
    shown = subprocess.run([sys.executable, "-m", "cachefs", "status", str(mount.path)],
                           capture_output=True, text=True, timeout=30).stdout
    assert "threads sized for 1 core" in shown
    mount.stop()
    mount = mount_cachefs(remote.path, name="all")
    assert mount.status()["cores"] == len(allowed)


def listing(root: Path) -> list[tuple[str, int, int, int]]:
    """(path, mode, size, mtime) of everything under ``root``, as ``ls -lR`` sees it."""
    found = []
    for directory, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            found.append((os.path.relpath(path, root), st.st_mode, st.st_size,
                          st.st_mtime_ns))
    return sorted(found)


def ls_lR(root: Path) -> list[str]:
    """What ``ls -lRn`` prints of ``root``, but for the block counts ("total" lines): a
    mount's are its own."""
    ls = subprocess.run(["ls", "-lRn", "--time-style=+%s"], cwd=root, capture_output=True,
                        text=True, check=True)
    return [line for line in ls.stdout.splitlines() if not line.startswith("total ")]


def test_listings_with_attributes_are_the_remotes_and_follow_its_changes(
        source, remote, mount_cachefs):
    make_tree(source, directories=3)
    os.symlink("d00/0001-n.bin", source / "link")
    mount = mount_cachefs(remote.path, revalidate=1)
    want = listing(source)
    assert listing(mount.path) == want  # names and attributes in one pass (READDIRPLUS)
    assert listing(mount.path) == want  # the kernel's cached listings
    assert ls_lR(mount.path) == ls_lR(source)

    # A directory's listing changes on the remote: seen after the interval, not before it
    # ends and never a mix of the two listings.
    (source / "d01" / "0007-nnnnnnn.bin").unlink()
    (source / "d01" / "new.bin").write_bytes(b"new")
    time.sleep(2.2)
    after = listing(mount.path)
    assert after == listing(source)
    new = next(row for row in after if row[0] == "d01/new.bin")
    assert new[1:3] == (stat.S_IFREG | 0o644, 3)
    assert (mount.path / "d01" / "new.bin").read_bytes() == b"new"


def test_ls_lR_repeated_after_the_interval_takes_the_attributes_with_the_listings(
        source, remote, mount_cachefs):
    """`ls -lR` again once the interval has passed: the names are due, and read from the
    kernel's cached listings each would be looked up on its own (a request per file); the
    directories are listed again instead, the attributes coming with the names, a page of
    them per request.  A file changed meanwhile shows its new size."""
    make_tree(source, directories=2)  # 1,000 files, several pages of a listing each
    mount = mount_cachefs(remote.path, revalidate=1)
    assert ls_lR(mount.path) == ls_lR(source)
    (source / "d01" / "0003-nnn.bin").write_bytes(b"grown" * 1000)
    time.sleep(1.5)  # every name is due
    before = mount.metric("cachefs_lookups_total")
    again = ls_lR(mount.path)
    assert again == ls_lR(source)
    assert any(" 5000 " in line and line.endswith(" 0003-nnn.bin") for line in again)
    # Read from the cached listings: a LOOKUP per name (1,000).
    assert mount.metric("cachefs_lookups_total") - before < 50


def test_the_serving_process_counts_and_times_its_garbage_collections(
        source, remote, mount_cachefs):
    """cachefs_gc_collections_total and cachefs_gc_seconds_total: what requests waited for
    Python's collector, by generation; a full one is made just before serving."""
    files = make_tree(source, 1)
    mount = mount_cachefs(remote.path, fraction=1.0)
    for rel, data in files.items():
        assert (mount.path / rel).read_bytes() == data
    samples = mount.metrics()
    for name in ("cachefs_gc_collections_total", "cachefs_gc_seconds_total"):
        assert {labels for sample, labels in samples if sample == name} == {
            (("generation", generation),) for generation in "012"}
    assert samples[("cachefs_gc_collections_total", (("generation", "2"),))] >= 1
    assert samples[("cachefs_gc_seconds_total", (("generation", "2"),))] > 0
