"""EmulatedRemote: the Python handle that tests and benchmarks use for a slow NFS-like remote.

It runs ``python -m bench.emulator.slowfs SOURCE MOUNTPOINT --foreground`` as a child process,
waits until the mount serves, talks to the daemon's control socket (faults, settings, stats)
and always leaves nothing mounted when stopped. See bench/emulator/slowfs.py for what the
emulation does. ``cpu_seconds()`` is the CPU the daemon has used, for benchmarks to report what
the emulator took from the cores they measure on (bench/emulator/remote_cost.py weighs it
against the latency injected).

    with EmulatedRemote(source, mountpoint, profile="efs") as remote:
        remote.set_fault("errno", errno=errno.EIO, ops=["read"], glob="train/*.jpg")
        ...
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.emulator import slowfs


class EmulatedRemote:
    """A slow NFS-like remote: SOURCE directory served at a mount point by
    bench.emulator.slowfs in a child process."""

    def __init__(self, source: Path, mountpoint: Path, *, profile: str = "efs",
                 meta_ms: float | None = None, open_ms: float | None = None,
                 read_ms: float | None = None, bandwidth_mbps: float | None = None,
                 actimeo_s: float | None = None,
                 log_file: Path | None = None) -> None:
        if profile not in slowfs.PROFILES:
            raise ValueError(f"unknown profile {profile!r}: use one of {sorted(slowfs.PROFILES)}")
        self.source = Path(source).resolve()
        # Resolved now: once mounted, a dead daemon makes every stat of the mount point fail.
        self._mountpoint = Path(mountpoint).resolve()
        self.profile = profile
        self._overrides = {"meta_ms": meta_ms, "open_ms": open_ms, "read_ms": read_ms,
                           "bandwidth_mbps": bandwidth_mbps, "actimeo_s": actimeo_s}
        self.log_file = Path(log_file) if log_file is not None else None
        self._proc: subprocess.Popen | None = None
        self._tmpdir: Path | None = None
        self._socket: Path | None = None

    @property
    def path(self) -> Path:
        """The mount point: where the remote's files are."""
        return self._mountpoint

    def start(self) -> EmulatedRemote:
        """Mount and return once the mount serves; RuntimeError (with the log's tail) if not."""
        if self._proc is not None:
            raise RuntimeError("already started")
        if slowfs.is_mounted(self._mountpoint):
            # Checked before anything is ours, so stop() never unmounts somebody else's mount.
            raise RuntimeError(f"{self._mountpoint} is already a mount point")
        # A short directory of our own: AF_UNIX socket paths are limited to 107 bytes.
        self._tmpdir = Path(tempfile.mkdtemp(prefix="slowfs-"))
        self._socket = self._tmpdir / "control.sock"
        log_path = self.log_file or self._tmpdir / "slowfs.log"
        args = [str(self.source), str(self._mountpoint), "--profile", self.profile,
                "--control", str(self._socket), "--foreground"]
        for key, value in self._overrides.items():
            if value is not None:
                args += ["--" + key.replace("_", "-"), repr(float(value))]
        cmd, env = self._command(args)
        try:
            with open(log_path, "ab") as log:
                start = log.tell()
                # A session of its own, so that a Ctrl-C meant for the test run does not kill
                # the daemon before stop() has unmounted.
                self._proc = subprocess.Popen(cmd, env=env, cwd="/", stdin=subprocess.DEVNULL,
                                              stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True)
            problem = slowfs.wait_until_serving(self._mountpoint, self._proc)
        except BaseException:
            self.stop()
            raise
        if problem is not None:
            output = _tail(log_path, start)  # before stop() removes our temporary directory
            self.stop()
            reason = slowfs.failure_reason(output, problem)
            raise RuntimeError(f"slowfs did not serve {self.source} at {self._mountpoint}: "
                               f"{reason}\n--- log tail ---\n{output}")
        return self

    def stop(self) -> None:
        """Unmount and end the daemon. Idempotent, and safe after a failed start()."""
        if self._proc is not None and self._proc.poll() is None:
            try:  # Release hung ops first: they would keep the mount busy.
                self.clear_faults()
            except (OSError, RuntimeError, ValueError):
                pass
        proc, self._proc = self._proc, None
        unmounted = True
        if slowfs.is_mounted(self._mountpoint):
            unmounted = slowfs.fusermount(self._mountpoint)
            if not unmounted:  # busy: detach it now, it goes when the last file is closed
                slowfs.fusermount(self._mountpoint, lazy=True)
        if proc is not None:
            # An unmounted daemon exits by itself; otherwise SIGTERM, then SIGKILL.
            for ask in ([lambda: None] if unmounted else []) + [proc.terminate, proc.kill]:
                if proc.poll() is not None:
                    break
                ask()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    continue
        if slowfs.is_mounted(self._mountpoint):  # the daemon died without unmounting
            slowfs.fusermount(self._mountpoint, lazy=True)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    @property
    def pid(self) -> int | None:
        """The daemon's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def cpu_seconds(self) -> float:
        """The CPU time (user + system, all threads) the daemon has used since it started.

        Read from /proc, so it answers even while the control socket is busy, and for any
        version of the daemon; its resolution is the kernel's clock tick (10 ms). A benchmark
        takes the difference over a run, to show what the emulator took from the cores the
        daemon under test runs on.
        """
        if self.pid is None:
            raise RuntimeError("the emulated remote is not running")
        return process_cpu_seconds(self.pid)

    def __enter__(self) -> EmulatedRemote:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def set_fault(self, kind: str, *, errno: int | None = None, ops: list[str] | None = None,
                  glob: str | None = None) -> None:
        """Make matching ops fail with errno (kind "errno") or block until cleared ("hang")."""
        request: dict[str, Any] = {"cmd": "fault", "kind": kind}
        for key, value in (("errno", errno), ("ops", ops), ("glob", glob)):
            if value is not None:
                request[key] = value
        self._call(request)

    def clear_faults(self) -> None:
        """Remove all faults and release the ops that hang."""
        self._call({"cmd": "clear"})

    def configure(self, **settings: float | None) -> None:
        """Change meta_ms, open_ms, read_ms, bandwidth_mbps (0 or None: no cap) and/or actimeo_s
        now (what the kernel already keeps stays kept until its old timeout)."""
        self._call({"cmd": "set", **settings})

    def stats(self) -> dict[str, Any]:
        """Counters (ops, read_bytes, opens, errors_injected, ...) and the current settings."""
        reply = self._call({"cmd": "stats"})
        reply.pop("ok")
        return reply

    def _command(self, args: list[str]) -> tuple[list[str], dict[str, str]]:
        """argv and environment of the daemon, given its arguments."""
        return slowfs.child_command(args)

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._socket is None or self._proc is None:
            raise RuntimeError("the emulated remote is not running")
        # A fresh connection with a timeout each time: a test can never hang on the control path.
        reply = slowfs.control(self._socket, request, timeout=slowfs.CONTROL_TIMEOUT_S)
        if not reply.get("ok"):
            raise RuntimeError(f"slowfs refused {request}: {reply.get('error')}")
        return reply


def _cpu_ticks(pid: int) -> list[int]:
    """utime, stime, cutime and cstime of process pid, in clock ticks, from /proc/PID/stat
    (fields 14-17 of the line; split after the command name, which may hold ")")."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # fields[0] here is field 3 (state)
    return [int(x) for x in fields[11:15]]


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process pid (all its threads), from /proc/PID/stat."""
    return sum(_cpu_ticks(pid)[:2]) / os.sysconf("SC_CLK_TCK")


def process_tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process pid and every process it started (a daemon's
    fill processes): the live ones from their own /proc/PID/stat, the ended ones from the
    parent's account of its waited-for children (cutime and cstime)."""
    return process_tree_cpu_split(pid)[0]


def process_tree_cpu_split(pid: int) -> tuple[float, float]:
    """process_tree_cpu_seconds, and the part of it spent in the kernel (stime and cstime):
    the system calls, and the work the kernel does in their name (a passthrough
    registration, the path walk of an open, a disk read it waits on).  One reading of each
    process, so the part is never more than the whole."""
    total, system = _tree_ticks(pid)
    hz = os.sysconf("SC_CLK_TCK")
    return total / hz, system / hz


def _tree_ticks(pid: int) -> tuple[int, int]:
    utime, stime, cutime, cstime = _cpu_ticks(pid)
    total, system = utime + stime + cutime + cstime, stime + cstime
    for child in _children(pid):
        try:
            child_total, child_system = _tree_ticks(child)
        except OSError:  # ended meanwhile: counted once waited for
            continue
        total, system = total + child_total, system + child_system
    return total, system


def process_rss_bytes(pid: int) -> int | None:
    """The resident memory (VmRSS) of process pid; None once it is a zombie."""
    with open(f"/proc/{pid}/status") as f:
        return next((int(line.split()[1]) * 1024 for line in f
                     if line.startswith("VmRSS:")), None)


def process_tree_rss_bytes(pid: int) -> int:
    """The resident memory (VmRSS) of process pid and of every live process it started."""
    total = process_rss_bytes(pid) or 0
    for child in _children(pid):
        try:
            total += process_tree_rss_bytes(child)
        except OSError:  # ended meanwhile
            pass
    return total


def _children(pid: int) -> list[int]:
    """The processes pid started that still run, from each of its threads' list."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return children


def _tail(log_path: Path, start: int, limit: int = 4000) -> str:
    """What the daemon wrote to its log since offset start, at most the last limit bytes."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(start, os.path.getsize(log_path) - limit))
            return f.read().decode(errors="replace")
    except OSError as e:
        return f"(cannot read {log_path}: {e})"
