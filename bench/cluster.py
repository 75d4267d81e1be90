"""The cluster tier measured: N cachefs nodes that share one cache (``--peers``) beside N
caches unaware of each other, on this machine, behind one emulated remote.

    python3 -m bench.cluster            # 4 nodes, 4,000 files of about 64 KiB, 3 epochs
    python3 -m bench.cluster --quick    # a tiny run for CI, about a minute
    python3 -m bench.cluster --help     # nodes, fraction, sizes, epochs, workers, batch

Every node is a cachefs mount of its own (its own cache directory and daemon) with
``--fraction f`` (1/N by default) and a budget for the files its admission keeps, about
f of the dataset. The cluster's nodes list each other as peers: each file is kept by its
owner and read from it by the others. The independent caches all keep the same f of the
files and read the rest from the remote; they are warmed first (``cachefs warm``: each
holds its whole fraction, as after many epochs), so every epoch of theirs is the steady
state. The cluster's first epoch fills its caches.

Every node runs its DistributedSampler shard of the same training loop (bench/driver.py: a
real DataLoader in a process of its own), the N loops at once as in data-parallel training;
the cluster's epoch, then the independent caches' epoch, in turns, the page cache dropped
before each. Every example read is compared with the dataset's bytes (length and xxh3).

Per epoch: samples/s of each node; the share of the dataset read from the remote (cachefs's
``cachefs_remote_read_bytes_total`` summed over the nodes, and what the emulated remote
served) against the floor max(0, 1 - N x f) of the cluster and 1 - f of the independent
caches; the cluster's chunk fetches from peers (by result, and their latency from the
``cachefs_peer_fetch_seconds`` histogram); the daemons' CPU per file opened through them and
the emulated remote's per file it opened (user + system, from /proc/PID/stat).

Results: the tables on stdout, ``latest.json`` in --out (bench/results/cluster/, and
bench/results/quick/cluster/ with --quick). A line starting with ``!`` is a real problem
(the cluster read more than its floor from the second epoch on, or a peer's answer was
rejected), and the exit status is then 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash
from rich.console import Console
from rich.table import Table

from bench import counters, machine
from bench import dataset as dataset_mod
from bench.driver import ChildLoop, LoopConfig, LoopFailed, drop_page_cache
from bench.emulator import slowfs
from bench.emulator.remote import EmulatedRemote
from bench.measure import (
    BUDGET_OVERHEAD_BYTES,
    BUDGET_SLACK,
    allocated_bytes,
    cache_disk,
    remote_path,
)
from bench.mounts import CachefsMount, MountError
from bench.run import clear_leftovers, measure_this_tree, measured
from bench.settings import BENCH_DIR, ArgumentParser, count_arg, positive_float, positive_int

MIB = 2**20
CLUSTER = "cluster"
INDEPENDENT = "independent"
GROUPS = (CLUSTER, INDEPENDENT)
PEER_RESULTS = ("ok", "refused", "unavailable", "rejected")
# From the second epoch on the cluster may read this much more than its floor (files whose
# attributes fell due and changed: none here) before the run says something is wrong.
FLOOR_TOLERANCE = 0.02
PEERS_UP_TIMEOUT_S = 30.0
WARM_TIMEOUT_S = 600.0
LOG_TAIL_LINES = 20


@dataclass
class ClusterSettings:
    nodes: int = 4
    fraction: float | None = None  # None: 1 / nodes
    examples: int = 4000
    mean_kib: float = 64.0
    epochs: int = 3
    workers: int = 2  # per node
    batch: int = 32
    step_ms: float = 0.0  # 0: no simulated GPU step, the loaders run flat out
    profile: str = "efs"
    seed: int = 0
    out_dir: Path = BENCH_DIR / "results" / "cluster"
    work_dir: Path = BENCH_DIR / "work"
    timeout_s: float = 3600.0

    @property
    def node_fraction(self) -> float:
        return self.fraction if self.fraction is not None else 1.0 / self.nodes

    def dataset_spec(self) -> dataset_mod.DatasetSpec:
        return dataset_mod.DatasetSpec(examples=self.examples, mean_kib=self.mean_kib,
                                       seed=self.seed)

    def public(self) -> dict:
        out = dataclasses.asdict(self)
        out["fraction"] = self.node_fraction
        for key in ("out_dir", "work_dir"):
            out[key] = str(out[key])
        return out


QUICK = dict(examples=400, epochs=3, workers=2, batch=16, timeout_s=600.0,
             out_dir=BENCH_DIR / "results" / "quick" / "cluster")


def floor_share(group: str, epoch: int, nodes: int, fraction: float) -> float:
    """The least share of the dataset the group can read from the remote in an epoch: the
    cluster holds min(1, N x f) of it once filled (its first epoch reads every file once);
    caches unaware of each other all hold the same f."""
    if group == CLUSTER:
        return 1.0 if epoch == 1 else max(0.0, 1.0 - nodes * fraction)
    return 1.0 - fraction


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- the nodes -----------------------------------------------------------------------------------

def free_ports(count: int) -> list[int]:
    """Ports free on the loopback now (the nodes bind them a moment later)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def write_secret(path: Path) -> Path:
    """A fresh shared secret, readable by its owner only (cachefs refuses any other)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex())
    return path


def budget_bytes(eligible: Callable[[str], bool], sizes: dict[str, int]) -> int:
    """--cache-size for a node: what the files its admission keeps occupy, plus the index's
    room, as bench/measure.py sizes a cache for F (an operator would size it so)."""
    kept = [size for path, size in sizes.items() if eligible(path)]
    return int(allocated_bytes(kept) * (1 + BUDGET_SLACK)) + BUDGET_OVERHEAD_BYTES


def cluster_admissions(addresses: list[str], fraction: float, seed: int) -> list:
    """Each node's admission, by cachefs's own rule for a node of this cluster."""
    from cachefs.peer.members import Members, PeerList
    from cachefs.store.admission import ClusterAdmission

    peers = PeerList(nodes=tuple(addresses))
    return [ClusterAdmission(fraction, seed, Members(peers, me)) for me in addresses]


def node_snapshot(mount: CachefsMount) -> counters.Snapshot:
    text = mount.metrics_text()
    return {**counters.cachefs_snapshot(text), **counters.peer_snapshot(text),
            **counters.daemon_cpu_snapshot(mount.pid)}


def peers_up(mount: CachefsMount) -> int:
    """How many peers the node's health checks see answering."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(1 for family in text_string_to_metric_families(mount.metrics_text())
               for sample in family.samples
               if sample.name == "cachefs_peer_up" and sample.value == 1)


def wait_for_peers(mounts: list[CachefsMount], timeout_s: float = PEERS_UP_TIMEOUT_S) -> None:
    """Until every node sees every other answering, as a cluster is long before training."""
    deadline = time.monotonic() + timeout_s
    while (seen := [peers_up(m) for m in mounts]) != [len(mounts) - 1] * len(mounts):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster's nodes see {seen} peers answering, not "
                               f"{len(mounts) - 1} each, after {timeout_s:g} s")
        time.sleep(0.2)


def remote_snapshot(remote: EmulatedRemote) -> counters.Snapshot:
    """The emulated remote's counters, and every op it answered (lookups and attributes
    too, which cost it CPU when no byte is read)."""
    stats = remote.stats()
    ops = stats.get("ops", {})
    return {**counters.emulator_snapshot(stats), "remote_ops": float(sum(ops.values())),
            **{f"remote_ops_{op}": float(count) for op, count in ops.items()}}


def example_digests(data: dataset_mod.Dataset) -> list[int]:
    """xxh3_64 of every example's bytes, from the dataset's own copy."""
    digests = []
    for example in data.examples:
        fd = os.open(data.root / example.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            digests.append(xxhash.xxh3_64_intdigest(
                os.pread(fd, example.length, example.offset)))
        finally:
            os.close(fd)
    return digests


@dataclass
class Group:
    """N nodes, each a mount and the loop of one rank reading it."""

    name: str
    mounts: list[CachefsMount]
    loops: list[ChildLoop]

    def run_epoch(self, number: int, remote: EmulatedRemote) -> dict:
        """Every node's loop runs the epoch at once; their figures and the counters of each
        daemon and of the remote over it."""
        for loop in self.loops:
            loop.wait_ready()
        drop_page_cache()
        before = [node_snapshot(m) for m in self.mounts]
        remote_before = remote_snapshot(remote)
        started = time.monotonic()
        for loop in self.loops:
            loop.go()
        nodes = [loop.epoch_ended() for loop in self.loops]
        wall = time.monotonic() - started
        after = [node_snapshot(m) for m in self.mounts]
        remote_after = remote_snapshot(remote)
        for node, b, a in zip(nodes, before, after, strict=True):
            node.pop("waits_ms", None)
            node["counters"] = counters.delta(b, a)
        return {"epoch": number, "wall_seconds": wall, "nodes": nodes,
                "emulator": counters.delta(remote_before, remote_after)}


# -- the run -------------------------------------------------------------------------------------

def run(settings: ClusterSettings, log: Callable[[str], None] = _log) -> dict:
    """Mount both groups, warm the independent caches, run the epochs in turns; the raw
    results (what latest.json holds)."""
    if os.geteuid() != 0:
        raise PermissionError("the benchmark mounts FUSE file systems and drops the page cache: "
                              "run it as root")
    nodes, fraction = settings.nodes, settings.node_fraction
    run_dir = settings.work_dir / "run" / str(os.getpid())
    clear_leftovers(run_dir.parent)
    logs = settings.out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.time()
    source = measure_this_tree()
    datasets_dir = settings.work_dir / "datasets"
    data = dataset_mod.ensure(datasets_dir, settings.dataset_spec(), log)
    sizes = data.file_sizes()
    digests = example_digests(data)
    results: dict = {
        "settings": settings.public(), "machine": machine.describe(), "source": source,
        "dataset": {"name": data.spec.name(), "examples": len(data.examples),
                    "files": len(data.files), "bytes": data.total_bytes,
                    "allocated_bytes": allocated_bytes(list(sizes.values()))},
        "groups": {name: {"budgets": [], "epochs": []} for name in GROUPS},
        "warm": [], "error": None}
    log(f"dataset {data.spec.name()}: {len(data.examples):,} examples, "
        f"{data.total_bytes / MIB:.0f} MiB; {nodes} nodes at f = {fraction:g} in a cluster and "
        f"{nodes} independent caches; remote profile {settings.profile}")

    from cachefs.store.admission import FractionAdmission

    addresses = [f"127.0.0.1:{port}" for port in free_ports(nodes)]
    admissions = {
        CLUSTER: [a.eligible for a in cluster_admissions(addresses, fraction, settings.seed)],
        INDEPENDENT: [FractionAdmission(fraction, settings.seed).eligible] * nodes}
    try:
        with contextlib.ExitStack() as stack:
            (run_dir / "remote").mkdir(parents=True)
            secret = write_secret(run_dir / "peer.secret")
            remote = stack.enter_context(EmulatedRemote(
                datasets_dir, run_dir / "remote", profile=settings.profile,
                log_file=logs / "remote.log"))
            backing = remote_path(remote, data)
            groups: dict[str, Group] = {}
            for name in GROUPS:
                mounts = []
                for i in range(nodes):
                    budget = budget_bytes(admissions[name][i], sizes)
                    results["groups"][name]["budgets"].append(budget)
                    peer_args: tuple[str, ...] = ()
                    if name == CLUSTER:
                        peer_args = ("--peers", ",".join(addresses), "--peer-listen",
                                     addresses[i], "--peer-secret-file", str(secret))
                    work = run_dir / name / f"node{i}"
                    disk = stack.enter_context(cache_disk(work, budget, len(sizes)))
                    mounts.append(stack.enter_context(CachefsMount(
                        backing, work / "mnt", disk / "cache", cache_size_bytes=budget,
                        fraction=fraction, log_file=logs / f"{name}-node{i}.log",
                        extra_args=peer_args)))
                groups[name] = Group(name, mounts, [])
            log(f"mounted {nodes} cluster nodes ({', '.join(addresses)}) and {nodes} "
                "independent caches")
            # Every loop is started now (each imports torch, seconds on a small machine) and
            # waits at its first epoch until all are ready.
            for group in groups.values():
                for rank, mount in enumerate(group.mounts):
                    config = LoopConfig(
                        root=str(mount.path),
                        examples=[(e.path, e.offset, e.length) for e in data.examples],
                        whole_files=True, epochs=settings.epochs, batch_size=settings.batch,
                        num_workers=settings.workers, step_ms=settings.step_ms,
                        seed=settings.seed, drop_caches=False, gated=True,
                        child_snapshots=False, rank=rank, world=nodes, digests=digests)
                    group.loops.append(stack.enter_context(
                        ChildLoop(config, dict, settings.timeout_s)))
            for i, mount in enumerate(groups[INDEPENDENT].mounts):
                results["warm"].append(_warm(mount, remote, i, log))
            wait_for_peers(groups[CLUSTER].mounts)
            for number in range(1, settings.epochs + 1):
                for group in groups.values():
                    log(f"{group.name}, epoch {number} ...")
                    epoch = group.run_epoch(number, remote)
                    results["groups"][group.name]["epochs"].append(epoch)
                    figures = epoch_figures(epoch, results)
                    log(f"  {group.name} epoch {number}: "
                        + ", ".join(f"{x:,.0f}" for x in figures["node_samples_per_second"])
                        + f" samples/s; remote {figures['remote_share']:.1%} of the dataset")
    except (LoopFailed, MountError, OSError, RuntimeError) as exc:
        results["error"] = str(exc).strip() or repr(exc)
        log(f"FAILED: {results['error']}")
    finally:
        if not slowfs.is_mounted(run_dir / "remote"):
            shutil.rmtree(run_dir, ignore_errors=True)
    results["seconds"] = round(time.time() - started, 1)
    results["machine"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return results


def _warm(mount: CachefsMount, remote: EmulatedRemote, number: int,
          log: Callable[[str], None]) -> dict:
    """``cachefs warm`` one independent cache; what it took from the remote."""
    before = counters.emulator_snapshot(remote.stats())
    started = time.monotonic()
    done = mount.warm(WARM_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"cachefs warm {mount.path} failed: "
                           + "\n".join(done.stderr.strip().splitlines()[-LOG_TAIL_LINES:]))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    log(f"  independent node {number}: {summary}")
    return {"seconds": round(time.monotonic() - started, 2), "summary": summary,
            "remote_bytes": counters.delta(
                before, counters.emulator_snapshot(remote.stats()))["remote_bytes"]}


# -- the figures ---------------------------------------------------------------------------------

def _sum(nodes: list[dict], key: str) -> float:
    return sum(node["counters"].get(key, 0.0) for node in nodes)


def _per_file_us(seconds: float, files: float) -> float | None:
    return 1e6 * seconds / files if files else None


def epoch_figures(epoch: dict, results: dict) -> dict:
    """What the tables show of one group's epoch, from its raw figures."""
    nodes = epoch["nodes"]
    total = results["dataset"]["bytes"]
    samples = sum(n["samples"] for n in nodes)
    slowest = max(n["seconds"] for n in nodes)
    opens = [counters.cachefs_opens(n["counters"]) for n in nodes]
    cpu = [n["counters"].get("cachefs_cpu_seconds", 0.0) for n in nodes]
    histogram = {}
    for node in nodes:
        for key, value in node["counters"].items():
            if key.startswith(counters.PEER_BUCKET):
                histogram[key] = histogram.get(key, 0.0) + value
    fetches = _sum(nodes, "cachefs_peer_fetch_seconds_count")
    quantile = {share: counters.histogram_quantile(histogram, counters.PEER_BUCKET, share)
                for share in (0.5, 0.99)}
    emulator = epoch["emulator"]
    return {
        "node_samples_per_second": [n["samples_per_second"] for n in nodes],
        "samples": samples,
        "bytes_read": sum(n["bytes_read"] for n in nodes),
        # The job's pace: every node's samples over the time of the slowest, which the others
        # wait for at the epoch's end in data-parallel training.
        "samples_per_second": samples / slowest if slowest else 0.0,
        "remote_share": _sum(nodes, "cachefs_remote_bytes") / total,
        "emulator_share": emulator.get("remote_bytes", 0.0) / total,
        "remote_bytes": _sum(nodes, "cachefs_remote_bytes"),
        "emulator_bytes": emulator.get("remote_bytes", 0.0),
        "peer_bytes": _sum(nodes, "cachefs_peer_read_bytes"),
        "served_bytes": _sum(nodes, "cachefs_peer_served_bytes"),
        "hit_ratio": _sum(nodes, "cachefs_hit_opens") / sum(opens) if sum(opens) else None,
        "fetches": {r: _sum(nodes, f"cachefs_peer_{r}") for r in PEER_RESULTS},
        "fetch_mean_ms": (1000 * _sum(nodes, "cachefs_peer_fetch_seconds_sum") / fetches
                          if fetches else None),
        "fetch_p50_ms": None if quantile[0.5] is None else 1000 * quantile[0.5],
        "fetch_p99_ms": None if quantile[0.99] is None else 1000 * quantile[0.99],
        "daemon_us_per_file": _per_file_us(sum(cpu), sum(opens)),
        "node_daemon_us_per_file": [_per_file_us(c, o) for c, o in zip(cpu, opens, strict=True)],
        "remote_us_per_file": _per_file_us(emulator.get("remote_cpu_seconds", 0.0),
                                           emulator.get("remote_opens", 0.0)),
        "remote_cpu_seconds": emulator.get("remote_cpu_seconds", 0.0),
        "remote_opens": emulator.get("remote_opens", 0.0),
        "remote_ops": emulator.get("remote_ops", 0.0),
    }


def _num(value: float | None, spec: str = ",.0f") -> str:
    return "—" if value is None else format(value, spec)


def _rows(results: dict):
    """(group, epoch number, raw epoch, figures) in the order of the tables."""
    for name in GROUPS:
        for epoch in results["groups"][name]["epochs"]:
            yield name, epoch["epoch"], epoch, epoch_figures(epoch, results)


def tables(results: dict) -> list[Table]:
    s = results["settings"]
    nodes, fraction = s["nodes"], s["fraction"]
    rows = list(_rows(results))
    dataset_mib = results["dataset"]["bytes"] / MIB
    pace = ("no simulated GPU step, flat out" if not s["step_ms"]
            else f"a simulated GPU step of {s['step_ms']:g} ms per batch")

    speed = Table(title=f"Samples/s per node, the {nodes} nodes' loops at once ({pace})",
                  title_justify="left", caption=f"all nodes: the {nodes} shards' samples over "
                  "the slowest node's time (data-parallel training waits for it); independent "
                  "caches warmed first (each holds its whole fraction, as after many epochs)",
                  caption_justify="left")
    speed.add_column("caches")
    speed.add_column("epoch", justify="right")
    for i in range(nodes):
        speed.add_column(f"node {i}", justify="right")
    speed.add_column("all nodes", justify="right")
    speed.add_column("hit ratio", justify="right")
    for name, number, _, f in rows:
        speed.add_row(name, str(number) + (
            " (fill)" if name == CLUSTER and number == 1 else ""),
            *(f"{x:,.0f}" for x in f["node_samples_per_second"]),
            f"{f['samples_per_second']:,.0f}", _num(f["hit_ratio"], ".3f"))

    remote = Table(title=f"Read from the remote per epoch, share of the dataset "
                   f"({dataset_mib:,.0f} MiB)", title_justify="left",
                   caption=f"cachefs: cachefs_remote_read_bytes_total summed over the {nodes} "
                   "daemons; emulator: what the emulated remote served. Floor: max(0, 1 - N x "
                   f"f) = {max(0.0, 1 - nodes * fraction):g} for the cluster once filled (its "
                   f"first epoch reads each file once), 1 - f = {1 - fraction:g} for caches "
                   "that keep the same files", caption_justify="left")
    for column in ("caches", "epoch", "cachefs MiB", "cachefs share", "emulator MiB",
                   "emulator share", "floor", "from peers MiB"):
        remote.add_column(column, justify="left" if column == "caches" else "right")
    for name, number, _, f in rows:
        remote.add_row(name, str(number),
                       f"{f['remote_bytes'] / MIB:,.1f}", f"{f['remote_share']:.1%}",
                       f"{f['emulator_bytes'] / MIB:,.1f}", f"{f['emulator_share']:.1%}",
                       f"{floor_share(name, number, nodes, fraction):.1%}",
                       f"{f['peer_bytes'] / MIB:,.1f}")

    peers = Table(title="The cluster's chunk fetches from their owners, per epoch",
                  title_justify="left", caption="cachefs_peer_fetches_total by result, summed "
                  "over the nodes; latency of the ok ones from cachefs_peer_fetch_seconds "
                  "(mean: _sum / _count; p50, p99: interpolated in its buckets)",
                  caption_justify="left")
    for column in ("epoch", *PEER_RESULTS, "mean ms", "p50 ms", "p99 ms", "served MiB"):
        peers.add_column(column, justify="right")
    for name, number, _, f in rows:
        if name == CLUSTER:
            peers.add_row(str(number), *(f"{f['fetches'][r]:,.0f}" for r in PEER_RESULTS),
                          _num(f["fetch_mean_ms"], ".2f"), _num(f["fetch_p50_ms"], ".2f"),
                          _num(f["fetch_p99_ms"], ".2f"), f"{f['served_bytes'] / MIB:,.1f}")

    cpu = Table(title="CPU per file (user + system, all threads, from /proc/PID/stat)",
                title_justify="left", caption="daemon: the N cachefs daemons' CPU over the "
                "files opened through them (a cluster node's includes what it served its "
                "peers); remote: the emulated remote's CPU per file it opened; remote "
                "ops: every request it answered (lookups, attributes, opens, reads)",
                caption_justify="left")
    for column in ("caches", "epoch", "daemon us/file", "per node", "remote us/file",
                   "remote opens", "remote ops", "remote CPU s"):
        cpu.add_column(column, justify="left" if column == "caches" else "right")
    for name, number, _, f in rows:
        cpu.add_row(name, str(number),
                    _num(f["daemon_us_per_file"]),
                    " ".join(_num(x) for x in f["node_daemon_us_per_file"]),
                    _num(f["remote_us_per_file"]), f"{f['remote_opens']:,.0f}",
                    f"{f['remote_ops']:,.0f}", f"{f['remote_cpu_seconds']:.2f}")
    return [speed, remote, peers, cpu]


def header(results: dict) -> list[str]:
    """What ran, where: the lines above the tables."""
    s, d, m, src = results["settings"], results["dataset"], results["machine"], results["source"]
    return [
        f"{d['examples']:,} files, {d['bytes'] / MIB:,.0f} MiB, behind an emulated "
        f"{s['profile']} remote. cluster: {s['nodes']} cachefs nodes, each --fraction "
        f"{s['fraction']:g} with --peers (every file kept by its owner); independent: "
        f"{s['nodes']} cachefs caches at --fraction {s['fraction']:g}, no peers. Each node: "
        f"its DistributedSampler shard, {s['workers']} DataLoader workers, batch {s['batch']}.",
        f"{m['cores']} cores, load average {m['load_average'][0]:.1f} at the start; "
        f"{results['seconds']:.0f} s in all. Code: commit {src['commit']}"
        + (f" with {src['uncommitted_files']} uncommitted file(s) in cachefs/ and client/"
           if src["uncommitted_files"] else "") + "."]


def findings(results: dict) -> list[str]:
    """What the run shows, as sentences; a line starting with "!" is a real problem."""
    s, d = results["settings"], results["dataset"]
    nodes, fraction = s["nodes"], s["fraction"]
    lines = []
    budgets = {name: results["groups"][name]["budgets"] for name in GROUPS}
    if all(budgets.values()):
        lines.append(
            f"Budgets (the files each node's admission keeps, plus 2 % and 8 MiB for the "
            f"index): cluster nodes {', '.join(f'{b / MIB:.0f}' for b in budgets[CLUSTER])} "
            f"MiB, independent caches {budgets[INDEPENDENT][0] / MIB:.0f} MiB each; "
            f"the dataset occupies {d['allocated_bytes'] / MIB:.0f} MiB.")
    if results["warm"]:
        lines.append(f"The independent caches were warmed first (cachefs warm: "
                     f"{sum(w['remote_bytes'] for w in results['warm']) / MIB:.0f} MiB from "
                     f"the remote, the same {fraction:g} of the files into each): their every "
                     f"epoch is the steady state, {1 - fraction:.0%} of the dataset from the "
                     "remote.")
    rows = list(_rows(results))
    checked = [(f["samples"], f["bytes_read"]) for _, _, _, f in rows]
    if checked:
        lines.append(f"Every example read was compared with the dataset's bytes (length and "
                     f"xxh3): {sum(c[0] for c in checked):,} reads, "
                     f"{sum(c[1] for c in checked) / MIB:,.0f} MiB, all equal (each epoch, "
                     f"each group: {checked[0][0]:,} examples of {d['examples']:,}).")
    for name, number, _, f in rows:
        if f["samples"] < d["examples"] or f["bytes_read"] < d["bytes"]:
            lines.append(f"! {name} epoch {number} read {f['samples']:,} examples, "
                         f"{f['bytes_read']:,} bytes: less than the dataset")
        if name != CLUSTER:
            continue
        if f["fetches"]["rejected"]:
            lines.append(f"! cluster epoch {number}: {f['fetches']['rejected']:,.0f} answers of "
                         "peers were rejected (signature, checksum or version)")
        floor = floor_share(CLUSTER, number, nodes, fraction)
        if number > 1 and f["remote_share"] > floor + FLOOR_TOLERANCE:
            lines.append(f"! cluster epoch {number} read {f['remote_share']:.1%} of the dataset "
                         f"from the remote, above its floor {floor:.0%}")
    if results["error"]:
        lines.append(f"! the run failed: {results['error'].splitlines()[0]}")
    return lines


def write(results: dict, out_dir: Path) -> Path:
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "latest.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


# -- the command ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python3 -m bench.cluster",
                description="N cachefs nodes sharing one cache (--peers) beside N independent "
                "caches: samples/s per node, remote share, peer fetches, CPU per file.")
    p.add_argument("--quick", action="store_true", help="a tiny run (about a minute) written "
                   "to results/quick/cluster/")
    p.add_argument("--nodes", type=positive_int, help="nodes in each group (default 4)")
    p.add_argument("--fraction", type=positive_float, help="--fraction of every node "
                   "(default 1 / nodes)")
    p.add_argument("--examples", type=positive_int, help="files of the dataset (default 4000)")
    p.add_argument("--mean-kib", type=positive_float, help="mean file size, KiB (default 64)")
    p.add_argument("--epochs", type=positive_int, help="epochs of each group (default 3)")
    p.add_argument("--workers", type=count_arg, help="DataLoader workers per node (default 2)")
    p.add_argument("--batch", type=positive_int, help="batch size (default 32)")
    p.add_argument("--step-ms", type=float, help="simulated GPU step per batch, ms (default "
                   "0: flat out)")
    p.add_argument("--profile", choices=sorted(slowfs.PROFILES), help="latency profile of the "
                   "remote (default efs)")
    p.add_argument("--seed", type=count_arg, help="seed of the dataset, the admission and the "
                   "shuffling")
    p.add_argument("--out", type=Path, help="directory for latest.json and the daemons' logs")
    p.add_argument("--work-dir", type=Path, help="where datasets are generated and kept "
                   "(default bench/work)")
    return p


def settings_from_args(argv: list[str] | None) -> ClusterSettings:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    settings = ClusterSettings(**(QUICK if args.quick else {}))
    for flag, attribute in {"nodes": "nodes", "fraction": "fraction", "examples": "examples",
                            "mean_kib": "mean_kib", "epochs": "epochs", "workers": "workers",
                            "batch": "batch", "step_ms": "step_ms", "profile": "profile",
                            "seed": "seed", "out": "out_dir", "work_dir": "work_dir"}.items():
        value = getattr(args, flag)
        if value is not None:
            setattr(settings, attribute, value)
    if settings.nodes < 2:
        parser.exit(2, f"{parser.prog}: a cluster needs at least 2 nodes\n")
    if not 0 < settings.node_fraction <= 1:
        parser.exit(2, f"{parser.prog}: --fraction must be in (0, 1]\n")
    if settings.step_ms < 0:
        parser.exit(2, f"{parser.prog}: --step-ms must be 0 or more\n")
    try:
        settings.dataset_spec().check()
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    return settings


def main(argv: list[str] | None = None) -> int:
    settings = settings_from_args(argv)
    results, failed = measured("bench.cluster", lambda: run(settings))
    if failed:
        return failed
    path = write(results, settings.out_dir)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)
    console.print()
    for line in header(results):
        console.print(line, soft_wrap=True)
    for table in tables(results):
        console.print()
        console.print(table)
    console.print()
    notes = findings(results)
    for line in notes:
        console.print(line, soft_wrap=True)  # one line each, whatever the width
    console.print(f"\nwrote {path}")
    return 1 if any(line.startswith("!") for line in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
