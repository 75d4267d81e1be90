"""The figures each epoch is judged by, and the verdicts on the project's targets.

Verdicts are computed, never asserted: a missed target is a finding of the run, written into
the results with the margin by which it was missed. Steady state means the paced epochs from
the second on (the first fills the cache).
"""

from __future__ import annotations

from bench.counters import cachefs_opens
from bench.driver import percentile
from bench.variants import CACHEFS, LOCAL, PEER_FRACTION

HIT_RATIO_TOLERANCE = 0.01
REMOTE_BYTES_SLACK = 1.02
# cachefs_remote_read_bytes_total against what the emulated remote served, each epoch.
COUNTED_BYTES_TOLERANCE = 0.02
COUNTED_BYTES_TARGET = f"remote bytes counted = served (± {COUNTED_BYTES_TOLERANCE:.0%})"
SPEEDUP_OVER_DIRECT = 3.0
SPEEDUP_OVER_RCLONE = 4.0
# A fully cached dataset read with hints (the fast path) against the local copy.
SHARE_OF_LOCAL = 0.6
MAX_STALL = 0.05
MIN_FILES_PER_SECOND = 4000
# The first epoch at the peer fraction fills the cache: no slower than no cache at all.
FIRST_EPOCH_OF_DIRECT = 1.0
# Against the remote's own ceiling (its bandwidth over the bytes a sample must bring from it):
# a first epoch with hints on an empty cache, and a steady hinted epoch at the peer fraction.
FIRST_EPOCH_OF_CEILING = 0.8
STEADY_OF_CEILING = 0.9
# Attributes due for revalidation as an epoch starts, refreshed ahead by the hints.
DUE_SHARE_OF_FRESH = 0.9
# Daemon CPU per file, microseconds: filled into the cache, and passed through.
MAX_FILL_US = 250
MAX_PASS_THROUGH_US = 150
# Against a remote as fast as a local disk (bench/fastremote.py): files/s of each miss path
# as a share of the tree read directly.
FAST_FILLED_OF_DIRECT = 0.3
FAST_NOT_KEPT_OF_DIRECT = 0.4
FAST_REMOTE = "fast remote"


def epoch_figures(variant: dict, epoch: dict, dataset_bytes: int) -> dict:
    """Hit ratio, remote bytes and their floor for one epoch of one variant.

    cachefs: the hit ratio is its own (file opens served wholly by the cache) and remote bytes
    its cachefs_remote_read_bytes_total. Other variants have no such counters: their remote
    bytes are what the emulated remote served, and their hit ratio the share of the bytes read
    that it did not serve. The floor is (1 - f) of the dataset, f the variant's fraction or
    cache budget's fraction.
    """
    c = epoch["counters"]
    fraction = variant["fraction"] or 0.0
    out = {"hit_ratio": None, "remote_bytes": None, "emulator_bytes": c.get("remote_bytes"),
           "floor_bytes": None if variant["kind"] == LOCAL else (1 - fraction) * dataset_bytes,
           **cpu_figures(epoch)}
    if variant["kind"] == CACHEFS:
        opens = cachefs_opens(c)
        out["hit_ratio"] = c["cachefs_hit_opens"] / opens if opens else None
        out["remote_bytes"] = c["cachefs_remote_bytes"]
    elif variant["kind"] != LOCAL:
        out["remote_bytes"] = c["remote_bytes"]
        read = epoch["bytes_read"]
        out["hit_ratio"] = max(0.0, 1 - c["remote_bytes"] / read) if read else None
    return out


def ceiling(results: dict, variant: dict, epoch: dict) -> float | None:
    """The most samples/s the emulated remote allows an epoch: its bandwidth over the bytes a
    sample must bring from it, (1 - f) of a mean file (all of it in the first epoch of a
    cache, which starts empty), or the local copy's samples/s where that is lower.  None for
    the local copy itself, or a remote without a bandwidth cap."""
    if variant["kind"] == LOCAL:
        return None
    from bench.emulator.slowfs import PROFILES

    cap = results["settings"].get("bandwidth_mbps") \
        or PROFILES[results["settings"]["profile"]].bandwidth_mbps
    dataset = results["dataset"]
    kept = 0.0 if epoch["epoch"] == 1 or variant["kind"] != CACHEFS \
        else variant["fraction"] or 0.0
    bound = None
    if cap and kept < 1.0:
        bound = cap * 1e6 / ((1 - kept) * dataset["bytes"] / dataset["examples"])
    local = _by_name(results).get(LOCAL)
    local_rate = _mean([e["samples_per_second"] for e in (local or {}).get("epochs", [])
                        if e["paced"] == epoch["paced"]])
    return min(x for x in (bound, local_rate) if x is not None) \
        if (bound, local_rate) != (None, None) else None


def cpu_figures(epoch: dict) -> dict:
    """CPU per file of the cachefs daemon (per sample read through it) and of the emulated
    remote (per file it opened), in microseconds; None where not measured."""
    c = epoch["counters"]
    daemon = c.get("cachefs_cpu_seconds")
    remote, opens = c.get("remote_cpu_seconds"), c.get("remote_opens")
    total, idle = c.get("machine_cpu_seconds"), c.get("machine_idle_seconds")
    return {"daemon_us_per_file": 1e6 * daemon / epoch["samples"]
            if daemon is not None and epoch["samples"] else None,
            "remote_us_per_file": 1e6 * remote / opens if remote is not None and opens else None,
            "machine_busy": 1 - idle / total if total else None,
            "machine_steal": c.get("machine_steal_seconds", 0.0) / total if total else None}


def _busy_text(epochs: list[dict]) -> str:
    """What a verdict adds on how busy the machine's CPUs were over ``epochs`` (a range), or
    nothing where not measured: at 100 % every process of the run (loader, daemon, emulated
    remote) waited for a CPU, so the CPUs, not the path measured, set the rate."""
    busy = [b for e in epochs if (b := cpu_figures(e)["machine_busy"]) is not None]
    if not busy:
        return ""
    low, high = min(busy), max(busy)
    share = f"{high:.0%}" if round(100 * low) == round(100 * high) else f"{low:.0%} - {high:.0%}"
    return f"; the machine's CPUs {share} busy"


def steady(variant: dict) -> list[dict]:
    return [e for e in variant["epochs"] if e["paced"] and e["epoch"] >= 2]


def unpaced(variant: dict) -> list[dict]:
    return [e for e in variant["epochs"] if not e["paced"]]


def steady_p99_ms(variant: dict) -> float:
    """p99 batch wait over all steady epochs' batches together.

    An epoch of a small dataset has few batches, so its own p99 is its slowest batch; pooled,
    the steady epochs give the 99th percentile a training run of many batches would see.
    """
    epochs = steady(variant)
    if all("waits_ms" in e for e in epochs):
        return percentile([w for e in epochs for w in e["waits_ms"]], 0.99)
    return max(e["wait_p99_ms"] for e in epochs)


def steady_stall(variant: dict) -> float:
    """Time blocked on data over all steady epochs / their time."""
    epochs = steady(variant)
    return sum(e["wait_seconds"] for e in epochs) / sum(e["seconds"] for e in epochs)


def meets_pace(variant: dict, step_ms: float) -> bool | None:
    """Steady state: 99 % of batches within one step, and at most MAX_STALL of the time waiting."""
    if variant["error"] or not steady(variant):
        return None
    return steady_p99_ms(variant) <= step_ms and steady_stall(variant) <= MAX_STALL


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _verdict(target: str, met: bool | None, measured: str, variant: str = "") -> dict:
    return {"target": target, "variant": variant, "met": met, "measured": measured}


def _by_name(results: dict) -> dict[str, dict]:
    return {v["variant"]: v for v in results["variants"]}


def _cache_verdicts(results: dict) -> list[dict]:
    total = results["dataset"]["bytes"]
    eligible = results["dataset"].get("eligible_share", {})
    out = []
    for v in results["variants"]:
        if v["kind"] != CACHEFS:
            continue
        f = v["fraction"]
        figures = [epoch_figures(v, e, total) for e in steady(v)]
        if v["error"] or not figures:
            out.append(_verdict(f"hit ratio = share of files the hash keeps at f = {f:g}", None,
                                "not measured", v["variant"]))
            out.append(_verdict("remote bytes <= 1.02 x floor", None, "not measured",
                                v["variant"]))
            out.append(_verdict(COUNTED_BYTES_TARGET, None, "not measured", v["variant"]))
            continue
        ratios = [x["hit_ratio"] or 0.0 for x in figures]
        # The hash keeps each file with probability f: the share it keeps of this dataset
        # differs from f by the luck of the draw, and that share is what a run must show.
        share = eligible.get(f"{f:g}")
        expected = f if share is None else share
        out.append(_verdict(
            f"hit ratio = share of files the hash keeps at f = {f:g} (± {HIT_RATIO_TOLERANCE})",
            all(abs(r - expected) <= HIT_RATIO_TOLERANCE for r in ratios),
            f"{min(ratios):.3f} - {max(ratios):.3f} (share kept: {expected:.3f})",
            v["variant"]))
        # What the remote sent, as it counts it; the daemon's own count is judged below.
        limit = REMOTE_BYTES_SLACK * (1 - f) * total
        worst = max(_served(x) for x in figures)
        out.append(_verdict(
            "remote bytes <= 1.02 x (1 - f) x dataset", worst <= limit,
            f"{worst / 2**20:.1f} MiB, limit {limit / 2**20:.1f} MiB "
            f"({worst / total:.3f} of the dataset)", v["variant"]))
        out.append(_counted_verdict(v, total))
    return out


def _served(figures: dict) -> float:
    served = figures["emulator_bytes"]
    return figures["remote_bytes"] if served is None else served


def _counted_verdict(variant: dict, total: int) -> dict:
    """Whether cachefs_remote_read_bytes_total tells what the remote sent, every epoch."""
    errors = []
    for epoch in variant["epochs"]:
        x = epoch_figures(variant, epoch, total)
        if x["emulator_bytes"]:
            errors.append(x["remote_bytes"] / x["emulator_bytes"] - 1)
    if not errors:
        return _verdict(COUNTED_BYTES_TARGET, None, "not measured", variant["variant"])
    return _verdict(
        COUNTED_BYTES_TARGET, all(abs(e) <= COUNTED_BYTES_TOLERANCE for e in errors),
        f"{min(errors):+.1%} - {max(errors):+.1%} over the epochs", variant["variant"])


def _speed(v: dict | None) -> tuple[float | None, str]:
    """Samples/s a variant sustains: its unpaced epochs (the loader's capacity) if any, else its
    steady paced epochs."""
    if v is None or v["error"]:
        return None, ""
    free = unpaced(v)
    if free:
        return _mean([e["samples_per_second"] for e in free]), "unpaced"
    return _mean([e["samples_per_second"] for e in steady(v)]), "paced"


def _speedup_verdicts(results: dict) -> list[dict]:
    variants = _by_name(results)
    name = f"cachefs-f{PEER_FRACTION:g}-hints"
    ours, how = _speed(variants.get(name))
    limit = _speed_ceiling(results, variants.get(name))
    out = []
    for peer, factor in (("direct", SPEEDUP_OVER_DIRECT), ("rclone", SPEEDUP_OVER_RCLONE)):
        theirs, _ = _speed(variants.get(peer))
        target = f"samples/s >= {factor:g}x {peer}"
        if ours is None or not theirs:
            out.append(_verdict(target, None, "not measured", name))
            continue
        ratio = ours / theirs
        measured = f"{ratio:.2f}x ({ours:.0f} vs {theirs:.0f} samples/s, {how})"
        # A peer that reads the remote well leaves less above it than the factor: the run
        # says so, since no cache can pass the remote's ceiling.
        if limit and factor * theirs > limit:
            measured += (f"; above the remote's ceiling of {limit:.0f} samples/s "
                         f"({limit / theirs:.2f}x {peer}), of which this is {ours / limit:.0%}")
        out.append(_verdict(target, ratio >= factor, measured, name))
    return out


def _speed_ceiling(results: dict, variant: dict | None) -> float | None:
    """The remote's ceiling over the epochs :func:`_speed` takes a variant's speed from."""
    if variant is None or variant["error"]:
        return None
    epochs = unpaced(variant) or steady(variant)
    return _mean([c for e in epochs if (c := ceiling(results, variant, e))])


def _fast_path_verdict(results: dict) -> list[dict]:
    """Judged on the epochs taken in turns (bench/alternating.py) when the run has them; the
    variants' own unpaced epochs, minutes apart, are a fallback."""
    name = "cachefs-f1-hints"
    target = f"samples/s >= {SHARE_OF_LOCAL:.0%} of local"
    turns = _in_turns_verdict(target, name, results.get("alternating"), "share",
                              SHARE_OF_LOCAL, "epochs", "{:.0%}")
    if turns:
        return turns
    variants = _by_name(results)
    ours, how = _speed(variants.get(name))
    local, _ = _speed(variants.get(LOCAL))
    if ours is None or not local:
        return [_verdict(target, None, "not measured", name)]
    share = ours / local
    return [_verdict(target, share >= SHARE_OF_LOCAL,
                     f"{share:.0%} ({ours:.0f} vs {local:.0f} samples/s, {how})", name)]


def _pace_verdicts(results: dict) -> list[dict]:
    step, pace = results["settings"]["step_ms"], results["settings"]["pace"]
    target = (f"pace {pace:.0f} samples/s: p99 batch wait <= {step:.1f} ms and "
              f"stall <= {MAX_STALL:.0%}")
    out = []
    for v in results["variants"]:
        epochs = steady(v)
        met = meets_pace(v, step)
        measured = "not measured" if met is None else (
            f"p99 wait {steady_p99_ms(v):.1f} ms, stall {steady_stall(v):.1%}, "
            f"{_mean([e['samples_per_second'] for e in epochs]):.0f} samples/s")
        out.append(_verdict(target, met, measured, v["variant"]))
    name = f"cachefs-f{PEER_FRACTION:g}-hints"
    v = _by_name(results).get(name)
    if v is None or v["error"] or not steady(v):
        out.append(_verdict(f"stall <= {MAX_STALL:.0%}", None, "not measured", name))
    else:
        worst = max(e["stall_fraction"] for e in steady(v))
        out.append(_verdict(f"stall <= {MAX_STALL:.0%}", steady_stall(v) <= MAX_STALL,
                            f"{steady_stall(v):.1%} (worst epoch {worst:.1%})", name))
    return out


def _files_per_second_verdict(results: dict) -> list[dict]:
    """Warm means what it meant for the Python FUSE passthrough we started from (4,600 files/s
    warm, 2,000 cold): the files' pages are in memory, and every read is still a FUSE request
    the daemon serves. The figures with the page cache dropped (the disk alone bounds every
    path) and kept (the kernel answers reads without the daemon) are reported beside it."""
    fps = results.get("files_per_second")
    target = (f"warm-cache FUSE reads >= {MIN_FILES_PER_SECOND:,} files/s "
              "(64 KiB, default revalidation)")
    if not fps or fps.get("error") or "cachefs" not in fps:
        return [_verdict(target, None, "not measured", "cachefs-f1")]
    ours, local = fps["cachefs"], fps["local"]
    rate = ours.get("daemon")
    if rate is None:  # results of a run before this figure was measured
        return [_verdict(target, None, "not measured through the daemon", "cachefs-f1")]
    return [_verdict(target, rate >= MIN_FILES_PER_SECOND,
                     f"{rate:,} files/s through the daemon; page cache kept: "
                     f"{ours['page_cache']:,} (local copy {local['page_cache']:,}); dropped: "
                     f"{ours['cold']:,} (local copy {local['cold']:,})", "cachefs-f1")]


def _in_turns_verdict(target: str, name: str, turns: dict | None, key: str, least: float,
                      what: str, form: str) -> list[dict]:
    """The verdict on the median ``key`` of rounds taken in turns (at least ``least``), with
    their range; none when the run has no such rounds."""
    if not turns or turns.get("error") or not turns["rounds"]:
        return []
    values = [r[key] for r in turns["rounds"]]
    pairs = f"pair{'s' * (len(values) != 1)}"
    return [_verdict(target, turns[key] >= least,
                     f"{form.format(turns[key])} (median of {len(values)} {pairs} of {what} in "
                     f"turns, {form.format(min(values))} - {form.format(max(values))})", name)]


def _first_epoch_verdict(results: dict) -> list[dict]:
    """The filling epoch against the remote read directly (both mostly below the pace, so the
    paced epochs compare what each can deliver): judged on the first epochs taken in turns
    (bench/firstepoch.py) when the run has them; the variants' own epochs, minutes apart, are
    a fallback."""
    variants = _by_name(results)
    name = f"cachefs-f{PEER_FRACTION:g}"
    target = f"first epoch (filling) >= {FIRST_EPOCH_OF_DIRECT:g}x direct"
    turns = _in_turns_verdict(target, name, results.get("first_epochs"), "ratio",
                              FIRST_EPOCH_OF_DIRECT, "first epochs", "{:.2f}x")
    if turns:
        return turns
    ours, direct = variants.get(name), variants.get("direct")
    firsts = [e for e in (ours or {}).get("epochs", []) if e["epoch"] == 1]
    theirs = [e["samples_per_second"] for e in (direct or {}).get("epochs", []) if e["paced"]]
    if not firsts or not theirs or ours["error"] or direct["error"]:
        return [_verdict(target, None, "not measured", name)]
    rate, base = firsts[0]["samples_per_second"], _mean(theirs)
    return [_verdict(target, rate >= FIRST_EPOCH_OF_DIRECT * base,
                     f"{rate / base:.2f}x ({rate:.0f} vs {base:.0f} samples/s)"
                     + _busy_text(firsts[:1]), name)]


def _ceiling_verdicts(results: dict) -> list[dict]:
    """The first epoch with hints on an empty cache (f = 1 and the peer fraction) and a
    steady hinted epoch at the peer fraction, against what the remote itself allows."""
    variants = _by_name(results)
    out = []
    for name, first, share in (("cachefs-f1-hints", True, FIRST_EPOCH_OF_CEILING),
                               (f"cachefs-f{PEER_FRACTION:g}-hints", True,
                                FIRST_EPOCH_OF_CEILING),
                               (f"cachefs-f{PEER_FRACTION:g}-hints", False, STEADY_OF_CEILING)):
        target = (f"{'first epoch' if first else 'steady epochs'} >= {share:.0%} of the "
                  "remote's ceiling")
        v = variants.get(name)
        epochs = [] if v is None or v["error"] else \
            [e for e in v["epochs"] if e["epoch"] == 1] if first else steady(v)
        judged = [(e, c) for e in epochs if (c := ceiling(results, v, e))]
        if not judged:
            out.append(_verdict(target, None, "not measured", name))
            continue
        worst = min(e["samples_per_second"] / c for e, c in judged)
        out.append(_verdict(target, worst >= share, ", ".join(
            f"{e['samples_per_second']:.0f} of {c:.0f} samples/s "
            f"({e['samples_per_second'] / c:.0%})" for e, c in judged)
            + _busy_text([e for e, _ in judged]), name))
    return out


def _revalidation_verdict(results: dict) -> list[dict]:
    """Every attribute due as an epoch starts against the same with them fresh: with hints
    (the target) and through the mount alone."""
    variants = _by_name(results)
    target = f"attributes due: samples/s >= {DUE_SHARE_OF_FRESH:.0%} of fresh"
    out = []
    for name, fresh_name in (("cachefs-f1-hints-due", "cachefs-f1-hints"),
                             ("cachefs-f1-due", "cachefs-f1")):
        ours, how = _speed(variants.get(name))
        theirs, _ = _speed(variants.get(fresh_name))
        if ours is None or not theirs:
            out.append(_verdict(target, None, "not measured", name))
            continue
        out.append(_verdict(target, ours >= DUE_SHARE_OF_FRESH * theirs,
                            f"{ours / theirs:.0%} ({ours:.0f} vs {theirs:.0f} samples/s, {how})",
                            name))
    return out


def _daemon_cpu_verdicts(results: dict) -> list[dict]:
    """Fill: the first epoch at f = 1 fills every file; pass-through: f = 0 keeps none."""
    variants = _by_name(results)
    out = []
    for name, target, limit, pick in (
            ("cachefs-f1", "daemon CPU per filled file", MAX_FILL_US,
             lambda v: [e for e in v["epochs"] if e["epoch"] == 1]),
            ("cachefs-f0", "daemon CPU per file passed through", MAX_PASS_THROUGH_US,
             lambda v: v["epochs"])):
        v = variants.get(name)
        costs = [] if v is None or v["error"] else [
            c for c in (cpu_figures(e)["daemon_us_per_file"] for e in pick(v)) if c is not None]
        label = f"{target} <= {limit} us"
        if not costs:
            out.append(_verdict(label, None, "not measured", name))
            continue
        out.append(_verdict(label, max(costs) <= limit,
                            f"{min(costs):.0f} - {max(costs):.0f} us", name))
    return out


def _fast_remote_verdicts(results: dict) -> list[dict]:
    """The miss paths where nothing but the daemon stands between the readers and the bytes:
    files/s against the tree read directly in the same round (the worst round), and the
    daemon's CPU per file (the dearest round)."""
    fast = results.get("fast_remote") or {}
    rounds = [] if fast.get("error") else fast.get("rounds", [])
    out = []
    for path, fraction, share, limit, cpu_target in (
            ("fill", 1, FAST_FILLED_OF_DIRECT, MAX_FILL_US, "daemon CPU per filled file"),
            ("not_kept", 0, FAST_NOT_KEPT_OF_DIRECT, MAX_PASS_THROUGH_US,
             "daemon CPU per file passed through")):
        name = f"{FAST_REMOTE} f = {fraction}"
        speed = f"files/s >= {share:.0%} of the tree read directly"
        cpu = f"{cpu_target} <= {limit} us"
        if not rounds:
            out += [_verdict(speed, None, "not measured", name),
                    _verdict(cpu, None, "not measured", name)]
            continue
        shares = [r[path] / r["tree"] for r in rounds]
        costs = [r[f"{path}_us"] for r in rounds]
        out += [_verdict(speed, min(shares) >= share, ", ".join(
                    f"{r[path]:,} of {r['tree']:,} ({r[path] / r['tree']:.0%})"
                    for r in rounds), name),
                _verdict(cpu, max(costs) <= limit, f"{min(costs)} - {max(costs)} us", name)]
    return out


def evaluate(results: dict) -> list[dict]:
    """Every verdict, from the raw results alone (so a report can be redrawn from the JSON)."""
    return (_cache_verdicts(results) + _speedup_verdicts(results)
            + _first_epoch_verdict(results) + _ceiling_verdicts(results)
            + _revalidation_verdict(results)
            + _daemon_cpu_verdicts(results) + _fast_remote_verdicts(results)
            + _fast_path_verdict(results) + _pace_verdicts(results)
            + _files_per_second_verdict(results))


def machine_reaches_pace(results: dict, step_ms: float) -> bool | None:
    """Whether the local copy itself keeps the pace: if not, no variant can."""
    local = _by_name(results).get(LOCAL)
    return None if local is None else meets_pace(local, step_ms)
