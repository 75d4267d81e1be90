"""Misses against a remote as fast as a local disk: what a miss costs the daemon itself.

The training-loop variants run against the EFS-like emulated remote, a FUSE file system in
user space: each call the daemon makes on it (the open of a fill, its copy) is a round trip
to another process, whose wake-ups on a virtual machine cost the caller system time that a
kernel NFS client would spend differently.  So the daemon's CPU per miss, and the share of
the remote's own speed a miss path keeps, are judged here, where nothing but the daemon
stands between the readers and the bytes: the local tree itself as the remote, no emulator
(``bench.datapath --profile tree``), READERS processes reading 64 KiB files whole, the page
cache dropped before each pass, in rounds:

* the tree read directly;
* cachefs at f = 1 on an empty cache: every open a fill (handed over, copied by the kernel);
* cachefs at f = 0: every open a file not kept (the remote's own file handed over).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench import datapath
from bench.settings import RunSettings

FILE_BYTES = 64 * 1024
READERS = 8
# bench.datapath's rows: (variant, path) to the name a round gives it here.
ROWS = {("-", "local"): "tree", ("auto", "fill"): "fill", ("auto", "not kept"): "not_kept"}


def measure(settings: RunSettings, run_dir: Path, log: Callable[[str], None]) -> dict:
    """Per round: files/s of each path, and the daemon's CPU per file on the two of cachefs.
    Its files and mounts go under ``run_dir`` (which a later run clears if this one is killed)."""
    result: dict = {"files": settings.fast_files, "file_bytes": FILE_BYTES, "readers": READERS,
                    "rounds": [], "error": None}
    args = datapath.parse_args([
        "--files", str(settings.fast_files), "--size", str(FILE_BYTES),
        "--readers", str(READERS), "--repeats", str(settings.fast_rounds), "--profile", "tree",
        "--variants", "auto", "--paths", "fill,not kept"])
    try:
        measured = datapath.run(args, run_dir)
    except (OSError, RuntimeError) as exc:
        result["error"] = str(exc).splitlines()[0]
        log(f"  a fast remote: FAILED: {result['error']}")
        return result
    for number in range(settings.fast_rounds):
        found: dict = {}
        for row, name in ROWS.items():
            rate, daemon_us, *_ = measured.samples[row][number]
            found[name] = round(rate)
            if daemon_us is not None:
                found[f"{name}_us"] = round(daemon_us)
        result["rounds"].append(found)
        log(f"  round {number + 1}: the tree {found['tree']:,} files/s; fill {found['fill']:,} "
            f"at {found['fill_us']} us; not kept {found['not_kept']:,} at "
            f"{found['not_kept_us']} us")
    return result
