"""The ``cachefs`` command: mount, unmount, status, warm, verify, completion.

Bad input of any kind ends in one line on stderr naming the problem and the
fix, and a non-zero exit; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import logging.handlers
import math
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import shtab

from cachefs import __version__
from cachefs.control.status import MIN_WATCH_SECONDS, format_status, watch
from cachefs.errors import UsageError
from cachefs.service.config import DEFAULT_METRICS_PORT, build_settings, read_config_file

log = logging.getLogger("cachefs")

EXIT_USAGE = 2
EXIT_FAILURE = 1
MOUNT_WAIT_SECONDS = 300.0
# Set by systemd for ExecStop= and ExecStopPost= commands only.
SERVICE_RESULT_ENV = "SERVICE_RESULT"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of a usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def add_mount_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``cachefs mount``: the one list the flags, the config file keys and
    mount(8)'s ``-o`` options (cachefs/service/mounthelper.py) are all read from."""
    parser.add_argument("backing", nargs="?", help="the remote dataset directory (an NFS path)")
    parser.add_argument("mountpoint", nargs="?", help="an empty directory to mount on")
    parser.add_argument("--cache-dir", help="cache directory on the local SSD (created 0700)")
    parser.add_argument("--cache-size", help="byte budget of the cache: 500G, 1.5T, 200MiB, 10GB")
    parser.add_argument("--fraction", help="share of the files to keep, 0..1 (default 1.0)")
    parser.add_argument("--seed", help="seed choosing which files are kept (default 0)")
    parser.add_argument("--metrics-addr", help=f"HOST:PORT of /metrics (default "
                        f"127.0.0.1:{DEFAULT_METRICS_PORT}; 0 turns metrics off)")
    parser.add_argument("--revalidate", help="seconds before a file is checked against the remote "
                        "again, or 'never' for immutable datasets (default 60)")
    parser.add_argument("--remote-timeout", help="seconds a read waits on the remote before EIO "
                        "(default 30)")
    parser.add_argument("--prefetch-concurrency", help="files prefetched at once (default 32)")
    parser.add_argument("--attr-cache-entries", help="attributes of names (files and "
                        "directories) the kernel does not hold (a listing's, a hint's) "
                        "remembered at most, about 200 bytes each (default 200000)")
    parser.add_argument("--held-files", help="cached files kept registered with the kernel "
                        "between opens, about 2 KiB of memory each (default: a 64th of the "
                        "machine's or the cgroup's memory, 65536 at least)")
    parser.add_argument("--staging-size", help="memory for prefetched files the cache does not "
                        "keep (default: a 16th of the machine's or the cgroup's memory, "
                        "32MiB to 512MiB)")
    parser.add_argument("--allow-other", action="store_true", default=None,
                        help="let other users read the mount (permissions are enforced)")
    parser.add_argument("--passthrough", help="which files the kernel reads itself where it "
                        "can (FUSE passthrough, Linux 6.9+, as root): 'auto' (default), local "
                        "files and the remote's own file for a miss; 'local', local files only, "
                        "every remote byte through the daemon within --remote-timeout; 'off', "
                        "none, the daemon serves every read")
    parser.add_argument("--fill-processes", help="processes copying the files kept into the "
                        "cache as readers open them, with --passthrough auto (default 0: "
                        "threads of the daemon)")
    parser.add_argument("--cpus", help="CPUs the daemon's threads keep to: 'auto' (default), "
                        "one of those it may run on, chosen from the mount point (its threads "
                        "take turns at one interpreter lock: spread over CPUs, each turn "
                        "wakes another); 'all'; or a list such as 0,2-3")
    parser.add_argument("--runtime-dir", help="directory of the control socket")
    parser.add_argument("--peers", help="a cluster: HOST:PORT of every node, comma-separated, "
                        "or dns:NAME:PORT (a headless Service); each file is cached by one "
                        "node and read from it by the others before the remote")
    parser.add_argument("--peer-listen", help="HOST:PORT where this node serves its peers "
                        "(the cluster's private network; required with --peers)")
    parser.add_argument("--peer-address", help="this node as --peers lists it (default "
                        "--peer-listen)")
    parser.add_argument("--peer-secret-file", help="file holding the cluster's shared secret "
                        "(at least 16 bytes, mode 0600)")
    parser.add_argument("--peer-timeout", help="seconds a read waits on a peer before the "
                        "remote (default 2)")
    parser.add_argument("--foreground", action="store_true",
                        help="stay attached and log to stderr (for systemd)")
    parser.add_argument("--take-over", action="store_true",
                        help="take the mount from the cachefs daemon serving MOUNTPOINT, if one "
                        "does, without unmounting (a new pod of a rolling update); once this "
                        "daemon hands the mount on in turn, wait to be stopped instead of "
                        "exiting, so that its container is not started again")
    parser.add_argument("--config", help="TOML file with these settings; flags override it")
    parser.add_argument("--log-file", help="log here (default in /var/log/cachefs or "
                        "~/.local/state/cachefs when not in the foreground)")
    parser.add_argument("--debug", action="store_true", help="log every remote fault in detail")
    parser.add_argument("--dry-run", action="store_true",
                        help="check and show the settings, where each came from, the share of "
                        "the files the fraction keeps and the data path; mount nothing")


# Mount flags that mount(8) and /etc/fstab cannot use, and why: every other flag of
# add_mount_arguments is also an -o option (cachefs/service/mounthelper.py).
NOT_FOR_FSTAB = {
    "foreground": "mount(8) waits for the helper to return, which a daemon in the foreground "
                  "never does; systemd units run 'cachefs mount --foreground' instead",
    "dry_run": "run 'cachefs mount --dry-run' with the same settings instead",
    "take_over": "it is for a container's entrypoint (deploy/kubernetes); on a host, hand a "
                 "mount to a new daemon with 'cachefs upgrade'",
}


def _watch_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not MIN_WATCH_SECONDS <= seconds < math.inf:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of seconds, {MIN_WATCH_SECONDS:g} or more")
    return seconds


def _warm_connections(text: str) -> int:
    # The daemon serves one user this many control connections at most.
    from cachefs.control.server import MAX_CONNECTIONS_PER_USER

    try:
        count = int(text)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_CONNECTIONS_PER_USER:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number from 1 to {MAX_CONNECTIONS_PER_USER}")
    return count


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cachefs", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"cachefs {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    mount = commands.add_parser("mount", help="mount a cached mirror of a remote dataset")
    add_mount_arguments(mount)

    upgrade = commands.add_parser(
        "upgrade", help="hand a mount to a new daemon of this cachefs, without unmounting",
        description="Start the running daemon's mount command again with this cachefs and "
        "hand it the mount: open files stay open, readers wait a fraction of a second.")
    upgrade.add_argument("mountpoint")

    unmount = commands.add_parser("unmount", help="unmount and stop the daemon")
    unmount.add_argument("mountpoint")
    unmount.add_argument("--lazy", action="store_true",
                         help="detach now even if files are open (fusermount -uz)")
    unmount.add_argument("--if-served-here", action="store_true",
                         help="leave the mount be when the daemon serving it runs in another PID "
                         "namespace (a pod's preStop: a newer pod took the mount over)")

    status = commands.add_parser("status", help="hit ratio, cache use and traffic of a mount")
    status.add_argument("mountpoint")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--watch", nargs="?", const=2.0, type=_watch_seconds,
                        metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until interrupted")
    status.add_argument("--served-here", action="store_true",
                        help="fail unless the daemon serving the mount runs in this PID "
                        "namespace (a pod's startup probe: this pod took the mount over)")

    warm = commands.add_parser("warm", help="fill the cache from a list of paths")
    warm.add_argument("mountpoint")
    warm.add_argument("--list", metavar="FILE", help="paths, one per line, relative to the "
                      "mount or absolute inside it; '-' reads stdin (default: every file)")
    warm.add_argument("--connections", type=_warm_connections, default=32,
                      help="files fetched at once, at most (default 32; the warm uses as many "
                      "as make it faster)")
    warm.add_argument("--restart", action="store_true",
                      help="start from the top of the list, ignoring where an interrupted warm "
                      "of it stopped")

    verify = commands.add_parser("verify", help="check every cached chunk against its checksum")
    verify.add_argument("--cache-dir", required=True)
    verify.add_argument("--json", action="store_true", help="machine-readable output")

    completion = commands.add_parser(
        "completion", help="print a shell completion script",
        description="Print a completion script for SHELL, e.g. "
        "'cachefs completion bash > /etc/bash_completion.d/cachefs' or, for zsh, into a "
        "file named _cachefs in a directory of $fpath.")
    completion.add_argument("shell", choices=COMPLETION_SHELLS)
    for command in (mount, upgrade, unmount, status, warm, verify):
        _complete_paths(command)
    return parser


COMPLETION_SHELLS = ("bash", "zsh", "tcsh")
# What the shell offers for an argument's value, by its dest; other values are free text.
DIRECTORY_ARGUMENTS = frozenset({"backing", "mountpoint", "cache_dir", "runtime_dir"})
FILE_ARGUMENTS = frozenset({"config", "log_file", "list", "peer_secret_file"})


def _complete_paths(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if action.dest in DIRECTORY_ARGUMENTS:
            action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
        elif action.dest in FILE_ARGUMENTS:
            action.complete = shtab.FILE  # type: ignore[attr-defined]


# -- mount -----------------------------------------------------------------------------------

SETTING_FLAGS = ("backing", "mountpoint", "cache_dir", "cache_size", "fraction", "seed",
                 "metrics_addr", "revalidate", "remote_timeout", "prefetch_concurrency",
                 "attr_cache_entries", "held_files", "staging_size", "allow_other", "passthrough",
                 "fill_processes", "cpus", "log_file", "runtime_dir", "peers", "peer_listen",
                 "peer_address", "peer_secret_file", "peer_timeout")


def _settings_from_args(args: argparse.Namespace):
    return _resolve_settings(args)[0]


def _resolve_settings(args: argparse.Namespace):
    """(Settings, {setting: where its value came from}), flags over the config file."""
    raw: dict[str, Any] = read_config_file(args.config) if args.config else {}
    flags = {key: getattr(args, key) for key in SETTING_FLAGS if getattr(args, key) is not None}
    from_file = frozenset(raw.keys() - flags.keys())
    raw.update(flags)
    settings = build_settings(raw, config_file=args.config, from_file=from_file)
    sources = {}
    for key in SETTING_FLAGS:
        if key in flags:
            sources[key] = "argument" if key in ("backing", "mountpoint") else \
                "--" + key.replace("_", "-")
        elif key in from_file:
            sources[key] = f"config {args.config}"
        else:
            sources[key] = "default" if key != "log_file" else \
                "default (stderr with --foreground)"
    return settings, sources


def _configure_logging(log_file: Path | None, debug: bool) -> None:
    handler: logging.Handler
    if log_file is None:
        handler = logging.StreamHandler(sys.stderr)
    else:
        try:
            log_file.parent.mkdir(parents=True, exist_ok=True)
            # Reopens the file after logrotate moves it.
            handler = logging.handlers.WatchedFileHandler(log_file)
        except OSError as exc:
            raise UsageError(f"cannot write log file {log_file}: {exc.strerror}; pass "
                             "--log-file with a writable path") from None
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def cmd_mount(args: argparse.Namespace, argv: list[str]) -> int:
    from cachefs.service import daemon, preflight

    if args.dry_run:
        from cachefs.service import dryrun

        settings, sources = _resolve_settings(args)
        print(dryrun.report(settings, sources))
        return 0
    from cachefs.service import fdstore, upgrade

    settings = _settings_from_args(args)
    if not args.foreground:
        note = preflight.preflight(settings)
        if note:
            print(f"cachefs: {note}", file=sys.stderr)
        return _mount_in_background(settings, argv)

    from cachefs.service.supervisor import Supervisor

    _configure_logging(settings.log_file, args.debug)
    # Set by `cachefs upgrade`: the running daemon's control socket, to take its mount from.
    take_over_from = os.environ.pop(upgrade.TAKE_OVER_ENV, None)
    # Under systemd: the mount's descriptor systemd kept when the last supervisor died.
    record = fdstore.record_path(daemon.node_table_base(settings))
    inherited = fdstore.adopt(str(settings.mountpoint), record)
    if inherited is not None:
        take_over_from = None
        log.info("took the mount of %s over from systemd's file descriptor store (its "
                 "supervisor %d is gone)", settings.mountpoint, inherited.old_pid)
    elif take_over_from is None and args.take_over:
        take_over_from = upgrade.serving_daemon(settings.mountpoint,
                                                str(daemon.socket_path(settings)))
    preflight.preflight(settings, taking_over=inherited is not None or take_over_from is not None)
    # The supervisor holds the mount's connection; its children serve it, one after the other.
    ready = os.environ.pop(daemon.READY_FD_ENV, None)
    ready_fd = int(ready) if ready and ready.isdigit() else None
    if take_over_from is not None:
        try:
            inherited = upgrade.receive_mount(take_over_from)
        except UsageError as exc:
            if ready_fd is not None:
                os.environ[daemon.READY_FD_ENV] = str(ready_fd)
                daemon.report_ready(str(exc))
            raise
        log.info("took the mount of %s over from process %d", settings.mountpoint,
                 inherited.old_pid)
    supervisor = Supervisor(str(settings.mountpoint),
                            lambda succession: _serve_mount(settings, succession),
                            ready_fd=ready_fd, inherited=inherited,
                            fdstore=fdstore.FdStore(str(settings.mountpoint), record),
                            linger=args.take_over)
    return supervisor.run()


def _serve_mount(settings, succession) -> int:
    """A serving child: start the daemon, mount (or take the mount over) and serve until it
    ends; 0 when it ended by an unmount."""
    from cachefs.service import daemon

    instance = daemon.Daemon(settings, succession)
    try:
        try:
            instance.start()
        except UsageError as exc:
            daemon.report_ready(str(exc))
            raise
        try:
            instance.serve()
        except RuntimeError as exc:
            message = f"mounting {settings.mountpoint} failed ({exc}); see the log for the reason"
            daemon.report_ready(message)
            raise UsageError(message) from None
        finally:
            instance.stop()
    except UsageError as exc:
        print(f"cachefs mount: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    return 0


def _mount_in_background(settings, argv: list[str]) -> int:
    """Start the daemon detached and wait until it serves or fails, like mount(8)."""
    from cachefs.service import daemon

    log_file = settings.log_file or daemon.default_log_file(settings.mountpoint)
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log_stream = open(log_file, "ab")  # noqa: SIM115 (handed to the child below)
    except OSError as exc:
        raise UsageError(f"cannot write log file {log_file}: {exc.strerror}; pass --log-file "
                         "with a writable path") from None
    read_end, write_end = os.pipe()
    env = dict(os.environ, **{daemon.READY_FD_ENV: str(write_end)})
    command = [sys.executable, "-m", "cachefs", *argv, "--foreground", "--log-file", str(log_file)]
    with log_stream:
        child = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log_stream, stderr=log_stream,
            pass_fds=(write_end,), start_new_session=True, env=env, close_fds=True,
        )
    os.close(write_end)
    message = _wait_for_ready(read_end, child)
    os.close(read_end)
    if message == "READY":
        return 0
    if child.poll() is None:
        child.terminate()
    if not message:
        message = f"the daemon exited before mounting; see {log_file}"
        tail = _last_line(log_file)
        if tail:
            message += f" (last line: {tail})"
    raise UsageError(message)


def _wait_for_ready(fd: int, child: subprocess.Popen) -> str:
    deadline = time.monotonic() + MOUNT_WAIT_SECONDS
    received = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 4096)
            received += chunk
            if not chunk or b"\n" in received:
                break
        elif child.poll() is not None:
            break
    line = received.decode(errors="replace").strip()
    return line.removeprefix("ERROR ").strip() if line != "READY" else line


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


# -- unmount, status ---------------------------------------------------------------------------

def cmd_unmount(args: argparse.Namespace) -> int:
    from cachefs.control.client import status as fetch_status
    from cachefs.kernel.mountpoint import FSTYPE, find_mount, unmount
    from cachefs.service.process import wait_gone

    mountpoint = Path(os.path.abspath(args.mountpoint))
    entry = find_mount(mountpoint)
    if entry is None:
        raise UsageError(f"{mountpoint} is not mounted")
    if entry.fstype != FSTYPE:
        raise UsageError(f"{mountpoint} is a {entry.fstype} mount, not cachefs; use umount")
    if os.environ.get(SERVICE_RESULT_ENV) and not os.environ.get("MAINPID"):
        # systemd's ExecStop after the unit's main process died on its own (systemd sets
        # MAINPID only while it runs): the descriptor store keeps the mount, and the restart
        # takes it over (service/fdstore.py); unmounting would fail every reader.
        print(f"cachefs unmount: {mountpoint} left mounted: the daemon's main process is gone "
              "and the unit's restart takes the mount over", file=sys.stderr)
        return 0
    pid = supervisor = None
    try:
        st = fetch_status(mountpoint)
        pid, supervisor = st.get("pid"), st.get("supervisor_pid")
    except UsageError:
        pass  # a dead or hung daemon: unmounting is all there is to do
    else:
        if not _served_here(st):
            if args.if_served_here:
                print(f"cachefs unmount: {mountpoint} left mounted: another container's daemon "
                      "serves it now", file=sys.stderr)
                return 0
            pid = supervisor = None  # its pids name other processes here, or none
    result = unmount(mountpoint, lazy=args.lazy)
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"
        hint = "; close the files open in it or use --lazy" if "busy" in reason.lower() else ""
        raise UsageError(f"cannot unmount {mountpoint}: {reason}{hint}")
    if pid and not args.lazy:
        wait_gone(pid, 30.0)
    if supervisor and not args.lazy:
        wait_gone(supervisor, 10.0)
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    """Start the running daemon's command with this cachefs, which takes the mount over
    (service/upgrade.py); wait until it serves and the old daemon is gone."""
    import cachefs
    from cachefs.control.client import control_path
    from cachefs.control.client import status as fetch_status
    from cachefs.service import daemon, upgrade
    from cachefs.service.process import wait_gone

    mountpoint = Path(os.path.abspath(args.mountpoint))
    command, old = upgrade.running_command(str(mountpoint))
    control = control_path(mountpoint)
    if "--foreground" not in command:
        command.append("--foreground")
    # Its log: where the command says (the last --log-file), else where a mount's goes.
    given = [value for flag, value in zip(command, command[1:], strict=False)
             if flag == "--log-file"]
    log_file = Path(given[-1]) if given else daemon.default_log_file(mountpoint)
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        log_stream = open(log_file, "ab")  # noqa: SIM115 (handed to the child below)
    except OSError as exc:
        raise UsageError(f"cannot write log file {log_file}: {exc.strerror}") from None
    # This cachefs, whatever the directory: -P keeps the old daemon's directory off sys.path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(cachefs.__file__)))
    read_end, write_end = os.pipe()
    env = dict(os.environ, **{daemon.READY_FD_ENV: str(write_end),
                              upgrade.TAKE_OVER_ENV: control,
                              "PYTHONPATH": os.pathsep.join(
                                  [root, *filter(None, [os.environ.get("PYTHONPATH")])])})
    with log_stream:
        child = subprocess.Popen(
            [sys.executable, "-P", "-m", "cachefs", *command], stdin=subprocess.DEVNULL,
            stdout=log_stream, stderr=log_stream, pass_fds=(write_end,),
            start_new_session=True, env=env, close_fds=True, cwd=old.get("cwd") or "/")
    os.close(write_end)
    message = _wait_for_ready(read_end, child)
    os.close(read_end)
    if message != "READY":
        if child.poll() is None:
            child.terminate()
        raise UsageError(message or f"the new daemon exited before serving; see {log_file}")
    if old.get("supervisor_pid"):
        wait_gone(old["supervisor_pid"], 30.0)
    new = fetch_status(mountpoint)
    pause = new["serving"]["last_restart_pause_seconds"] or 0.0
    print(f"{mountpoint}: cachefs {old['version']} (pid {old['pid']}) -> cachefs "
          f"{new['version']} (pid {new['pid']}); readers waited at most "
          f"{pause * 1000:.0f} ms")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from cachefs.control.client import status as fetch_status

    if args.watch is not None:
        return watch(lambda: fetch_status(args.mountpoint), args.watch)
    st = fetch_status(args.mountpoint)
    if args.served_here and not _served_here(st):
        raise UsageError(f"{os.path.abspath(args.mountpoint)} is served by a daemon in another "
                         f"PID namespace ({st.get('pid_namespace') or 'an older cachefs'})")
    print(json.dumps(st, indent=2, sort_keys=True) if args.json else format_status(st))
    return 0


def _served_here(status: dict) -> bool:
    """Whether the daemon that gave ``status`` runs in this process's PID namespace: in this
    container, not in the pod of a rolling update that took the mount over or handed it on.
    A daemon too old to say counts as here (what every daemon was before)."""
    theirs = status.get("pid_namespace")
    return theirs is None or theirs == os.readlink("/proc/self/ns/pid")


def cmd_warm(args: argparse.Namespace) -> int:
    from cachefs.control.warm import warm
    from cachefs.control.warmlist import open_list

    mountpoint = Path(os.path.abspath(args.mountpoint))
    return warm(str(mountpoint), open_list(args.list, mountpoint), args.connections,
                restart=args.restart)


def cmd_verify(args: argparse.Namespace) -> int:
    from cachefs.store.verify import verify

    return verify(Path(os.path.abspath(args.cache_dir)), as_json=args.json)


def cmd_completion(args: argparse.Namespace) -> int:
    print(shtab.complete(build_parser(), shell=args.shell))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "mount":
            return cmd_mount(args, argv)
        if args.command == "unmount":
            return cmd_unmount(args)
        if args.command == "upgrade":
            return cmd_upgrade(args)
        if args.command == "status":
            return cmd_status(args)
        if args.command == "warm":
            return cmd_warm(args)
        if args.command == "verify":
            return cmd_verify(args)
        if args.command == "completion":
            return cmd_completion(args)
    except UsageError as exc:
        print(f"cachefs {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    raise AssertionError(args.command)
