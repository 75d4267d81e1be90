"""Snapshots of the counters a variant is judged by: cachefs /metrics and the remote's own.

A snapshot is a flat dict of numbers; an epoch's figures are the difference of two.
``remote_*`` keys come from the emulated remote (what really crossed the "network", for any
variant, and the emulator's own CPU); ``cachefs_*`` keys from the cachefs mount's Prometheus
endpoint, and ``cachefs_cpu_seconds`` from its daemon's /proc/PID/stat; ``machine_*`` keys
from /proc/stat, the whole machine's CPU time (whether an epoch left any CPU idle).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

Snapshot = dict[str, float]


def cachefs_snapshot(metrics_text: str) -> Snapshot:
    """The cachefs figures the benchmark uses, from one scrape of /metrics."""
    wanted = {
        ("cachefs_remote_read_bytes_total", ()): "cachefs_remote_bytes",
        ("cachefs_prefetch_files_total", (("result", "used"),)): "cachefs_prefetch_used",
        ("cachefs_prefetch_files_total", (("result", "wasted"),)): "cachefs_prefetch_wasted",
        ("cachefs_prefetch_files_total", (("result", "failed"),)): "cachefs_prefetch_failed",
        ("cachefs_hints_total", (("result", "accepted"),)): "cachefs_hints_accepted",
        ("cachefs_hints_total", (("result", "dropped"),)): "cachefs_hints_dropped",
        ("cachefs_cache_bytes", ()): "cachefs_cache_bytes",
    }
    found: Snapshot = dict.fromkeys(wanted.values(), 0.0)
    found.update(cachefs_hit_opens=0.0, cachefs_miss_opens=0.0)
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "cachefs_file_opens_total":
                # Every result counts as an open (hit, miss and any finer kind of miss).
                found[f"cachefs_{sample.labels.get('result')}_opens"] = float(sample.value)
                continue
            key = wanted.get((sample.name, tuple(sorted(sample.labels.items()))))
            if key is not None:
                found[key] = float(sample.value)
    return found


def gc_seconds(metrics_text: str) -> float | None:
    """Seconds the serving process has spent in garbage collections, every generation, from
    one scrape of /metrics (None: a daemon that does not export them, a baseline's)."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "cachefs_gc_seconds":
            return sum(sample.value for sample in family.samples)
    return None


PEER_BUCKET = "cachefs_peer_fetch_seconds_le_"


def peer_snapshot(metrics_text: str) -> Snapshot:
    """A cluster node's peer figures, from one scrape of /metrics: chunk fetches asked of
    owners by result (``cachefs_peer_<result>``), the fetch-time histogram (its sum, count
    and cumulative buckets, ``PEER_BUCKET`` + the bound), bytes read from peers and served
    to them. Zeros on a node alone."""
    found: Snapshot = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            if name == "cachefs_peer_fetches_total":
                found[f"cachefs_peer_{labels.get('result')}"] = float(sample.value)
            elif name == "cachefs_peer_fetch_seconds_bucket":
                found[PEER_BUCKET + labels["le"]] = float(sample.value)
            elif name in ("cachefs_peer_fetch_seconds_sum", "cachefs_peer_fetch_seconds_count"):
                found[name] = float(sample.value)
            elif name == "cachefs_read_bytes_total" and labels.get("source") == "peer":
                found["cachefs_peer_read_bytes"] = float(sample.value)
            elif name == "cachefs_peer_served_bytes_total":
                found["cachefs_peer_served_bytes"] = float(sample.value)
    return found


def histogram_quantile(snapshot: Snapshot, prefix: str, share: float) -> float | None:
    """The ``share`` quantile of a histogram's cumulative buckets in a snapshot (keys
    ``prefix`` + bound), interpolated within its bucket as Prometheus's histogram_quantile
    does; None without observations."""
    buckets = sorted((float(key[len(prefix):]), count) for key, count in snapshot.items()
                     if key.startswith(prefix))
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = share * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):  # beyond the last bound: say the last bound
                return lower_bound
            inside = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / inside
                                                          if inside else 1.0)
        lower_bound, lower_count = bound, count
    return lower_bound


def cachefs_opens(snapshot: Snapshot) -> float:
    """Files opened on the mount, whatever the result."""
    return sum(v for k, v in snapshot.items() if k.startswith("cachefs_") and k.endswith("_opens"))


def emulator_snapshot(stats: dict) -> Snapshot:
    """The emulated remote's counters (bench.emulator.remote.EmulatedRemote.stats())."""
    return {"remote_bytes": float(stats.get("read_bytes", 0)),
            "remote_opens": float(stats.get("opens", 0)),
            "remote_cpu_seconds": float(stats.get("cpu_seconds", 0.0))}


def daemon_cpu_snapshot(pid: int | None) -> Snapshot:
    """The daemon's CPU (user + system, all threads): what one file read through it costs is
    the figure the data path is designed around."""
    from bench.emulator.remote import process_tree_cpu_seconds

    try:
        return {"cachefs_cpu_seconds": process_tree_cpu_seconds(pid)} if pid else {}
    except OSError:  # the daemon is gone: the epoch fails on its own
        return {}


def machine_cpu_snapshot() -> Snapshot:
    """The machine's CPU seconds, all CPUs together: in all, idle (waiting on I/O included),
    and stolen by the hypervisor for other guests (a shared virtual machine).  Over an epoch,
    what was not idle says whether the CPUs were the limit: the loader's workers, the daemon
    and the emulated remote share them."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return {}
    # user nice system idle iowait irq softirq steal (guest times are inside user and nice)
    ticks = os.sysconf("SC_CLK_TCK")
    total = sum(fields[:8])
    return {"machine_cpu_seconds": total / ticks,
            "machine_idle_seconds": (fields[3] + fields[4]) / ticks,
            "machine_steal_seconds": fields[7] / ticks if len(fields) > 7 else 0.0}


def combined(*sources: Callable[[], Snapshot]) -> Callable[[], Snapshot]:
    """One snapshot function reading several sources in turn."""
    def snapshot() -> Snapshot:
        merged: Snapshot = {}
        for source in sources:
            merged.update(source())
        return merged
    return snapshot


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    """after - before, key by key; gauges (cache bytes) keep their final value."""
    out = {key: after[key] - before.get(key, 0.0) for key in after}
    if "cachefs_cache_bytes" in after:
        out["cachefs_cache_bytes"] = after["cachefs_cache_bytes"]
    return out
