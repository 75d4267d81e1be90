"""What `cachefs status` shows a person: the figures that say whether the cache works."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from cachefs.errors import UsageError
from cachefs.sizes import format_bytes

# Each refresh costs the daemon a few milliseconds of CPU: no faster than this.
MIN_WATCH_SECONDS = 0.2


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {seconds}s"


def _data_path(st: dict) -> str:
    # Older daemons do not report it.
    return st.get("data_path") or "unknown (the daemon does not say)"


def _verification(v: dict) -> str:
    done = f"{v['files']:,} files ({format_bytes(v['bytes'])}) checked in the background"
    if v["running"]:
        return done + ", going on" + ("" if v["trusted"] else
                                      "; the others are checked as they are opened")
    return done + ("" if v["trusted"] else "; stopped")


def _restarts(st: dict, serving: dict) -> str:
    pause = serving["last_restart_pause_seconds"]
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(serving["since"]))
    text = (f"{serving['restarts']:,} since the mount (supervisor pid {st['supervisor_pid']}); "
            f"this process serves since {since}")
    if pause is not None:
        text += f" after a pause of {pause * 1000:.0f} ms"
    taken = _TAKEN_OVER_FROM.get(serving.get("taken_over_from"))
    if taken:
        text += f", the mount taken over from {taken}"
    return text + f"; {serving['requests_resent']:,} requests resent to it"


# How the supervisor got the mount, when it did not make it (service/upgrade.py, fdstore.py).
_TAKEN_OVER_FROM = {"daemon": "the daemon that served it", "fdstore": "systemd's descriptor store"}


def status_rows(st: dict) -> tuple[str, list[tuple[str, str]]]:
    """The title line and the (label, value) rows that ``cachefs status`` shows."""
    opens = st["file_opens"]
    read = st["read_bytes"]
    capacity = st["cache_capacity_bytes"]
    used = st["cache_bytes"]
    if st.get("cache_write_error"):
        admitting = f"not admitting: disk refused a write ({st['cache_write_error']})"
    elif st.get("reconciling"):
        admitting = "reconciling with its index after a crash: not admitting yet"
    elif st["admitting"]:
        admitting = "admitting"
    else:
        admitting = "full: not admitting, nothing evicted"
    revalidate = st["revalidate_seconds"]
    remote_state = "answering" if st["remote_available"] else \
        "NOT ANSWERING: serving cached files"
    title = f"cachefs {st['mountpoint']}  (pid {st['pid']}, up {_duration(st['uptime_seconds'])})"
    rows = [
        ("remote", f"{st['backing']}  ({remote_state})"),
        ("hit ratio", f"{_ratio(st['hit_ratio'])} of file opens "
                      f"({opens['hit']:,} hits, {opens['prefetched']:,} prefetched, "
                      f"{opens['miss']:,} misses); "
                      f"{_ratio(st['byte_hit_ratio'])} of bytes read"),
        ("cache", f"{format_bytes(used)} of {format_bytes(capacity)} "
                  f"({used / capacity:.0%}), {st['cache_files']:,} files, {admitting}"),
        ("admission", f"fraction {st['fraction']:g}, seed {st['seed']}; revalidate "
                      f"{'never' if revalidate is None else f'{revalidate:g} s'}"),
        ("data path", _data_path(st)),
        ("served", f"{format_bytes(read['cache'])} from cache, "
                   f"{format_bytes(read['prefetch'])} prefetched, "
                   + (f"{format_bytes(read['peer'])} from peers, " if st.get("cluster") else "")
                   + f"{format_bytes(read['remote'])} from remote"),
        ("remote read", format_bytes(st["remote_read_bytes"])),
    ]
    cores = st.get("cores")  # absent from a daemon of an earlier version
    if cores:
        on = st.get("cpus")
        rows.append(("cpu", (f"serving on CPU {on}; " if on and on[0].isdigit() else "")
                     + f"threads sized for {cores} core{'s' if cores != 1 else ''} "
                     "(its CPU affinity, its cgroups' CPU quota)"))
    memory = st.get("memory")
    if memory:
        rows.append(("memory", f"{memory['nodes']:,} nodes the kernel holds; attributes of "
                               f"{memory['attr_cache_entries']:,} names "
                               f"(at most {memory['attr_cache_capacity_entries']:,}, "
                               f"{memory.get('attr_cache_dropped', 0):,} dropped for room); "
                               f"{memory['held_files']:,} files held registered "
                               f"(at most {memory['held_files_max']:,}); "
                               f"{format_bytes(st['prefetch']['staging_bytes'])} of prefetched "
                               f"files staged (at most "
                               f"{format_bytes(memory.get('staging_bytes_max', 0))})"))
        used = memory.get("attr_listing_used_share")
        if used is not None:
            listed = "directories walked name by name listed" \
                if memory.get("attr_listings_pay", True) \
                else "a walked directory listed only now and then, to see whether they pay"
            pays = memory.get("attr_listing_pays_share")
            above = f" (they pay above {pays:.0%})" if pays is not None else ""
            rows.append(("listings", f"{used:.0%} of the names listed in the background were "
                                     f"used{above}: {listed}"))
    verification = st.get("verification")
    if verification:
        rows.append(("verified", _verification(verification)))
    cluster = st.get("cluster")
    if cluster:
        fetches = cluster["fetches"]
        others = len(cluster["nodes"]) - 1
        rows.append(("cluster", f"{len(cluster['nodes'])} nodes, this one {cluster['me']}; "
                                f"{len(cluster['peers_up'])} of {others} peers answering; "
                                f"{format_bytes(cluster['cluster_remote_read_bytes'])} read "
                                "from the remote by the cluster"))
        rows.append(("peer fetches", f"{fetches['ok']:,} ok, {fetches['refused']:,} refused, "
                                     f"{fetches['unavailable']:,} peer unavailable, "
                                     f"{fetches['rejected']:,} rejected; "
                                     f"{format_bytes(cluster['served_bytes'])} served to peers"))
    if "hints" in st:
        hints, prefetch = st["hints"], st["prefetch"]
        rows.append(("hints", f"{hints['accepted']:,} accepted, {hints['cached']:,} already "
                              f"cached, {hints['invalid']:,} invalid, "
                              f"{hints['dropped']:,} dropped"))
        rows.append(("prefetch", f"{prefetch['used']:,} used, {prefetch['wasted']:,} wasted, "
                                 f"{prefetch['failed']:,} failed; {prefetch['queued']:,} queued, "
                                 f"{prefetch['inflight']:,} in flight"))
    read_ahead = st.get("warm_read_ahead")
    if read_ahead and read_ahead["warms"]:
        rows.append(("warm read-ahead", f"{read_ahead['copied']:,} files copied ahead of their "
                                        f"fetches ({read_ahead['installed']:,} taken in, "
                                        f"{read_ahead['dropped']:,} dropped for want of "
                                        f"room), "
                                        f"{read_ahead['read']:,} read in or copied and "
                                        f"{read_ahead['left']:,} left alone by the warms that "
                                        f"ended; {read_ahead['open']:,} of "
                                        f"{read_ahead['warms']:,} warms' connections "
                                        f"reading ahead now, in "
                                        f"{len(read_ahead['pids']):,} processes"))
    serving = st.get("serving")
    if serving and serving["restarts"]:
        rows.append(("restarts", _restarts(st, serving)))
    if st["integrity_failures"]:
        rows.append(("integrity", f"{st['integrity_failures']:,} corrupt chunks dropped and "
                                  "refetched"))
    rows.append(("metrics", st["metrics_url"] or "off"))
    return title, rows


def format_status(st: dict) -> str:
    """Plain text, one row a line: what a pipe, a log or a test reads."""
    title, rows = status_rows(st)
    return "\n".join([title, *(f"  {label:<12} {value}" for label, value in rows)])


def _table(st: dict | None, error: str | None, interval: float):
    from rich import box
    from rich.table import Table
    from rich.text import Text

    stamp = time.strftime("%H:%M:%S")
    caption = f"{stamp}, every {interval:g} s; Ctrl-C to stop"
    if st is None:
        return Table(box=box.SIMPLE, show_header=False,
                     title=Text(f"cachefs status: {error}", style="bold red"), caption=caption)
    title, rows = status_rows(st)
    table = Table(box=box.ROUNDED, show_header=False, title=Text(title, style="bold"),
                  title_justify="left", caption=caption, caption_justify="left")
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column(overflow="fold")
    for label, value in rows:
        alarm = label == "remote" and not st["remote_available"] or \
            label == "cache" and st.get("cache_write_error")
        table.add_row(label, Text(value, style="bold red" if alarm else ""))
    return table


def watch(fetch: Callable[[], dict], interval: float) -> int:
    """Show the status every ``interval`` seconds until Ctrl-C.

    On a terminal, a table redrawn in place (rich's Live); into a pipe or a file, the
    plain status again and again, each followed by a line with the time, a blank line
    between them.
    """
    try:
        if sys.stdout.isatty():
            return _watch_live(fetch, interval)
        while True:
            try:
                text = format_status(fetch())
            except UsageError as exc:
                text = f"cachefs status: {exc}"
            sys.stdout.write(f"{text}\n  at {time.strftime('%H:%M:%S')}\n\n")
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        # The reader went away (`| head`): done, as for Ctrl-C.  What is left in the buffer
        # goes nowhere, or the interpreter's last flush would fail the same way.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _watch_live(fetch: Callable[[], dict], interval: float) -> int:
    from rich.console import Console
    from rich.live import Live

    def render():
        try:
            return _table(fetch(), None, interval)
        except UsageError as exc:
            return _table(None, str(exc), interval)

    with Live(render(), console=Console(), auto_refresh=False, transient=False) as live:
        while True:
            time.sleep(interval)
            live.update(render(), refresh=True)
