"""What `cachefs status` shows a person: the figures that say whether the cache works."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from cachefs.errors import UsageError
from cachefs.sizes import format_bytes


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


def format_status(st: dict) -> str:
    opens = st["file_opens"]
    read = st["read_bytes"]
    capacity = st["cache_capacity_bytes"]
    used = st["cache_bytes"]
    if st.get("cache_write_error"):
        admitting = f"not admitting: disk refused a write ({st['cache_write_error']})"
    elif st["admitting"]:
        admitting = "admitting"
    else:
        admitting = "full: not admitting, nothing evicted"
    revalidate = st["revalidate_seconds"]
    lines = [
        f"cachefs {st['mountpoint']}  (pid {st['pid']}, up {_duration(st['uptime_seconds'])})",
        f"  remote       {st['backing']}  "
        f"({'answering' if st['remote_available'] else 'NOT ANSWERING: serving cached files'})",
        f"  hit ratio    {_ratio(st['hit_ratio'])} of file opens "
        f"({opens['hit']:,} hits, {opens['prefetched']:,} prefetched, "
        f"{opens['miss']:,} misses); "
        f"{_ratio(st['byte_hit_ratio'])} of bytes read",
        f"  cache        {format_bytes(used)} of {format_bytes(capacity)} "
        f"({used / capacity:.0%}), {st['cache_files']:,} files, {admitting}",
        f"  admission    fraction {st['fraction']:g}, seed {st['seed']}; revalidate "
        f"{'never' if revalidate is None else f'{revalidate:g} s'}",
        f"  served       {format_bytes(read['cache'])} from cache, "
        f"{format_bytes(read['prefetch'])} prefetched, {format_bytes(read['remote'])} from remote",
        f"  remote read  {format_bytes(st['remote_read_bytes'])}",
    ]
    if "hints" in st:
        hints, prefetch = st["hints"], st["prefetch"]
        lines.append(
            f"  hints        {hints['accepted']:,} accepted, {hints['cached']:,} already cached, "
            f"{hints['invalid']:,} invalid, {hints['dropped']:,} dropped")
        lines.append(
            f"  prefetch     {prefetch['used']:,} used, {prefetch['wasted']:,} wasted, "
            f"{prefetch['failed']:,} failed; {prefetch['queued']:,} queued, "
            f"{prefetch['inflight']:,} in flight")
    if st["integrity_failures"]:
        lines.append(f"  integrity    {st['integrity_failures']:,} corrupt chunks dropped and "
                     "refetched")
    lines.append(f"  metrics      {st['metrics_url'] or 'off'}")
    return "\n".join(lines)


def watch(fetch: Callable[[], dict], interval: float) -> int:
    """Redraw the status every ``interval`` seconds until Ctrl-C."""
    interval = max(0.2, interval)
    try:
        while True:
            try:
                text = format_status(fetch())
            except UsageError as exc:
                text = f"cachefs status: {exc}"
            stamp = time.strftime("%H:%M:%S")
            sys.stdout.write(f"\x1b[H\x1b[2J{text}\n\n  {stamp}, every {interval:g} s; "
                             "Ctrl-C to stop\n")
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
