"""The mounts a benchmark variant reads through: cachefs (through its CLI) and rclone.

Each is a context manager that returns once the mount serves and, on the way out, leaves
nothing mounted, whatever happened inside: a clean unmount first, then ``fusermount -uz``,
then the daemon is killed. The emulated remote itself is bench.emulator.remote.EmulatedRemote.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.emulator import slowfs
from cachefs.service.process import wait_gone

REPO = Path(__file__).resolve().parent.parent
MOUNT_TIMEOUT_S = 60.0
UNMOUNT_TIMEOUT_S = 30.0
# How often settle() looks whether fills are still under way (see there).
SETTLE_POLL_SECONDS = 0.1
RCLONE_START_TIMEOUT_S = 30.0
# rclone only enforces --vfs-cache-max-size when it polls the cache (every minute by default);
# a shorter poll keeps it within the same budget as cachefs during short epochs.
RCLONE_CACHE_POLL = "2s"


class MountError(RuntimeError):
    """A mount that did not come up; the message says why and where the log is."""


def _cli_env(tree: Path = REPO) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    return env


def _force_unmount(path: Path) -> None:
    if slowfs.is_mounted(path) and not slowfs.fusermount(path):
        slowfs.fusermount(path, lazy=True)


class CachefsMount:
    """``cachefs mount BACKING PATH ...`` as a user runs it; ``metrics_url`` once mounted."""

    def __init__(self, backing: Path, path: Path, cache_dir: Path, *, cache_size_bytes: int,
                 fraction: float, log_file: Path, extra_args: tuple[str, ...] = (),
                 tree: Path = REPO, mount_timeout_s: float = MOUNT_TIMEOUT_S) -> None:
        self.backing = backing
        self.path = path
        self.cache_dir = cache_dir
        self.cache_size_bytes = cache_size_bytes
        self.fraction = fraction
        self.log_file = log_file
        self.extra_args = extra_args
        self.tree = tree  # the checkout whose cachefs serves (another one: a baseline)
        self.mount_timeout_s = mount_timeout_s
        self.pid: int | None = None  # the serving process
        self.supervisor_pid: int | None = None  # its parent, which restarts it if killed
        self.metrics_url: str | None = None
        # How long `cachefs mount` took to return, and `cachefs unmount` (once unmounted).
        self.mount_seconds: float | None = None
        self.unmount_seconds: float | None = None

    def _cli(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cachefs", *args], capture_output=True,
                              text=True, timeout=timeout, env=_cli_env(self.tree),
                              cwd=self.tree)

    def __enter__(self) -> CachefsMount:
        self.path.mkdir(parents=True, exist_ok=True)
        if slowfs.is_mounted(self.path):
            raise MountError(f"{self.path} is already a mount point")
        try:
            started = time.perf_counter()
            result = self._cli(
                "mount", str(self.backing), str(self.path), "--cache-dir", str(self.cache_dir),
                "--cache-size", str(self.cache_size_bytes), "--fraction", f"{self.fraction:g}",
                "--metrics-addr", "127.0.0.1:0", "--log-file", str(self.log_file),
                *self.extra_args, timeout=self.mount_timeout_s)
            self.mount_seconds = time.perf_counter() - started
            if result.returncode != 0:
                raise MountError(f"cachefs mount failed: {result.stderr.strip()} "
                                 f"(log: {self.log_file})")
            status = self._cli("status", "--json", str(self.path), timeout=MOUNT_TIMEOUT_S)
            if status.returncode != 0:
                raise MountError(f"cachefs status failed: {status.stderr.strip()}")
            info = json.loads(status.stdout)
            self.pid = info.get("pid")
            self.supervisor_pid = info.get("supervisor_pid")
            self.metrics_url = info.get("metrics_url")
            if not self.metrics_url:
                raise MountError("cachefs serves no /metrics; the benchmark needs them")
        except BaseException:
            self.close()
            raise
        return self

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return response.read().decode()

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until no file is being copied into the cache in the background (a miss handed
        to the kernel is filled beside its reader): the cache as the next epoch finds it.

        Each look is a scrape of /metrics, which costs the daemon some 3 ms of CPU (19 KB of
        text), counted in the CPU per file of the pass it ends: polled every 20 ms, the 0.2 -
        0.4 s that 4,000 fills of 64 KiB lag their readers added 8 - 11 us to each fill."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            under_way = re.search(r"^cachefs_fills_under_way (\S+)$", self.metrics_text(), re.M)
            if under_way is None or float(under_way.group(1)) == 0:  # none, or an older daemon
                return
            time.sleep(SETTLE_POLL_SECONDS)
        raise MountError(f"fills still under way after {timeout:g} s")

    def warm(self, timeout: float) -> subprocess.CompletedProcess:
        """``cachefs warm PATH``: fetch every file the mount's admission keeps into its cache,
        as many epochs would; the summary line is on stdout."""
        return self._cli("warm", str(self.path), timeout=timeout)

    def close(self) -> None:
        """Unmount and wait for the daemon; escalate until nothing is left mounted."""
        if slowfs.is_mounted(self.path):
            try:
                started = time.perf_counter()
                if self._cli("unmount", str(self.path), timeout=UNMOUNT_TIMEOUT_S).returncode == 0:
                    self.unmount_seconds = time.perf_counter() - started
            except subprocess.TimeoutExpired:
                pass
            _force_unmount(self.path)
        if self.pid and not wait_gone(self.pid, UNMOUNT_TIMEOUT_S):
            # The supervisor first: it would start a new serving process in place of a killed
            # one, which would hold the cache directory on.
            for pid in filter(None, (self.supervisor_pid, self.pid)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.supervisor_pid and not wait_gone(self.supervisor_pid, UNMOUNT_TIMEOUT_S):
            try:
                os.kill(self.supervisor_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.pid = self.supervisor_pid = None

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class RcloneMount:
    """``rclone mount`` of a ``local`` remote over ``backing`` with a full VFS cache."""

    def __init__(self, backing: Path, path: Path, cache_dir: Path, *, cache_size_bytes: int,
                 log_file: Path) -> None:
        self.backing = backing
        self.path = path
        self.cache_dir = cache_dir
        self.cache_size_bytes = cache_size_bytes
        self.log_file = log_file
        self._proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        config = self.cache_dir / "rclone.conf"
        return ["rclone", "mount", "--config", str(config), f"bench:{self.backing}",
                str(self.path), "--read-only", "--vfs-cache-mode", "full",
                # A bare number would be KiB to rclone: say bytes.
                "--vfs-cache-max-size", f"{self.cache_size_bytes}B",
                "--vfs-cache-poll-interval", RCLONE_CACHE_POLL,
                "--cache-dir", str(self.cache_dir / "vfs"), "--log-file", str(self.log_file),
                "--log-level", "NOTICE"]

    def __enter__(self) -> RcloneMount:
        self.path.mkdir(parents=True, exist_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        if slowfs.is_mounted(self.path):
            raise MountError(f"{self.path} is already a mount point")
        (self.cache_dir / "rclone.conf").write_text("[bench]\ntype = local\n")
        try:
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)
            deadline = time.monotonic() + RCLONE_START_TIMEOUT_S
            while not slowfs.is_mounted(self.path):
                if self._proc.poll() is not None:
                    raise MountError(f"rclone mount exited with {self._proc.returncode}; "
                                     f"see {self.log_file}")
                if time.monotonic() > deadline:
                    raise MountError(f"rclone did not mount within {RCLONE_START_TIMEOUT_S:g} s")
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        _force_unmount(self.path)
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for ask in (lambda: None, proc.terminate, proc.kill):
            if proc.poll() is not None:
                break
            ask()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
        _force_unmount(self.path)

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ScratchDisk:
    """A fresh journaled ext4 of ``size_bytes`` (a loop-mounted image under ``work``) for the
    caches of a benchmark, as a node's NVMe cache disk is: the root file system here is an
    ext4 without a journal, where each file created scans past the inodes deleted in the last
    minutes (9 % of a fill's CPU).  Unmounted by ``close`` (lazily when still busy)."""

    def __init__(self, work: Path, size_bytes: int, inodes: int | None = None) -> None:
        self.image = work / "cache-disk.img"
        self.path = work / "cache-disk"
        self.size_bytes = size_bytes
        self.inodes = inodes  # at least this many (mkfs's default: one per 16 KiB)
        self._mounted = False

    def __enter__(self) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.size_bytes)
        try:
            inodes = ["-N", str(self.inodes)] if self.inodes else []
            subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", *inodes, str(self.image)],
                           check=True, capture_output=True, timeout=300)
            subprocess.run(["mount", "-o", "loop", str(self.image), str(self.path)],
                           check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            self.image.unlink(missing_ok=True)
            raise MountError(f"cannot make a scratch ext4 for the caches: {exc}") from None
        self._mounted = True
        return self.path

    def close(self) -> None:
        if self._mounted:
            if subprocess.run(["umount", str(self.path)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self._mounted = False
        self.image.unlink(missing_ok=True)

    def __exit__(self, *exc_info: object) -> None:
        self.close()

