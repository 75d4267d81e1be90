"""Running cachefs as a service: the systemd unit, its generated drop-in, the mount(8)
helper and the deployment examples (Prometheus, Grafana, Kubernetes).

systemd is not PID 1 here, so the unit is checked with `systemd-analyze verify` and
its ExecStart/ExecStop command lines are run as systemd would run them: specifiers
and the drop-in's environment substituted, NOTIFY_SOCKET pointing at a datagram
socket this test reads. The only liberty taken is the location of the cachefs script
and of the config directory, which point into this environment instead of
/usr/local/bin and /etc/cachefs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachefs.kernel.mountpoint import find_mount, unmount
from cachefs.metrics import Metrics
from cachefs.service.cli import NOT_FOR_FSTAB, SETTING_FLAGS, build_parser
from cachefs.service.config import build_settings, read_config_file
from cachefs.service.mounthelper import EXIT_USAGE, build_command, mount_options, takes_value
from tests.conftest import make_files, read_bounded, run_cachefs

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "cachefs@.service"
GENERATOR = REPO / "systemd" / "cachefs-generator"
DEPLOY = REPO / "deploy"
INSTANCE = "imagenet"
UNIT_BINARY = "/usr/local/bin/cachefs"
UNIT_CONFIG_DIR = "/etc/cachefs"


def installed_cachefs() -> str:
    """The `cachefs` console script of this environment, what /usr/local/bin/cachefs is."""
    script = Path(sys.executable).with_name("cachefs")
    found = str(script) if script.exists() else shutil.which("cachefs")
    if not found:
        pytest.skip("the cachefs console script is not installed (pip install -e .)")
    return found


def read_unit(*paths: Path) -> dict[str, dict[str, list[str]]]:
    """Settings of a unit file and its drop-ins: {section: {key: [values in order]}}."""
    sections: dict[str, dict[str, list[str]]] = {}
    for path in paths:
        section = None
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("[") and line.endswith("]"):
                section = sections.setdefault(line[1:-1], {})
                continue
            key, _, value = line.partition("=")
            section.setdefault(key.strip(), []).append(value.strip())
    return sections


def expand(value: str, environment: dict[str, str]) -> list[str]:
    """An Exec*= line as systemd runs it: %i and %% expanded, ${VAR} as one word."""
    value = value.replace("%%", "\0").replace("%i", INSTANCE).replace("\0", "%")
    words = []
    for word in shlex.split(value):
        match = re.fullmatch(r"\$\{(\w+)\}", word)
        words.append(environment.get(match.group(1), "") if match else word)
    return words


def unit_environment(settings: dict[str, dict[str, list[str]]]) -> dict[str, str]:
    env = {}
    for value in settings["Service"].get("Environment", []):
        for assignment in shlex.split(value):
            name, _, text = assignment.partition("=")
            env[name] = text
    return env


@pytest.fixture
def service(tmp_path: Path) -> dict:
    """The unit, pointed at this environment, with a config and the generated drop-in."""
    etc = tmp_path / "etc"
    units = tmp_path / "units"
    backing = tmp_path / "remote"
    for directory in (etc, units, backing, tmp_path / "mnt"):
        directory.mkdir()
    (backing / "train").mkdir()
    payload = os.urandom(300_000)
    (backing / "train" / "a.bin").write_bytes(payload)
    config = etc / f"{INSTANCE}.toml"
    config.write_text(
        f'backing = "{backing}"\n'
        f'mountpoint = "{tmp_path / "mnt"}"\n'
        f'cache_dir = "{tmp_path / "cache"}"\n'
        'cache_size = "64MiB"\n'
        "fraction = 1.0\n"
        'metrics_addr = "127.0.0.1:0"\n'
        f'runtime_dir = "{tmp_path / "run"}"\n')
    text = UNIT.read_text().replace(UNIT_BINARY, installed_cachefs())
    text = text.replace(UNIT_CONFIG_DIR + "/", f"{etc}/")
    (units / UNIT.name).write_text(text)
    generated = tmp_path / "generated"
    result = subprocess.run(
        [sys.executable, str(GENERATOR), str(generated), str(tmp_path / "early"),
         str(tmp_path / "late")], capture_output=True, text=True, timeout=30,
        env=dict(os.environ, CACHEFS_CONFIG_DIR=str(etc)))
    assert result.returncode == 0, result.stderr
    dropin_dir = units / f"cachefs@{INSTANCE}.service.d"
    shutil.copytree(generated / dropin_dir.name, dropin_dir)
    return {"units": units, "unit": units / UNIT.name, "dropins": sorted(dropin_dir.iterdir()),
            "backing": backing, "mountpoint": tmp_path / "mnt", "cache_dir": tmp_path / "cache",
            "payload": payload, "config": config}


# -- the unit -----------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_unit_and_generated_dropin_pass_systemd_analyze_verify(service):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "--generators=no",
         f"./cachefs@{INSTANCE}.service"],
        cwd=service["units"], capture_output=True, text=True, timeout=50)
    # Complaints about units of the host (missing targets, ...) are not ours to fix.
    ours = [line for line in result.stderr.splitlines()
            if "cachefs" in line or str(service["units"]) in line]
    assert result.returncode == 0 and not ours, result.stderr


def test_generated_dropin_names_the_config_paths(service):
    settings = read_unit(*service["dropins"])
    mounts_for = shlex.split(settings["Unit"]["RequiresMountsFor"][0])
    assert mounts_for == [str(service["backing"]), str(service["cache_dir"])]
    assert unit_environment(settings)["CACHEFS_MOUNTPOINT"] == str(service["mountpoint"])


def test_generator_escapes_paths_and_skips_broken_configs(tmp_path):
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "odd.toml").write_text('backing = "/mnt/nfs/a b%c"\nmountpoint = "/mnt/x y"\n'
                                  'cache_dir = "/nvme/c"\ncache_size = "1G"\n')
    (etc / "broken.toml").write_text("backing = \n")
    (etc / "partial.toml").write_text('backing = "/mnt/nfs/b"\n')
    result = subprocess.run([sys.executable, str(GENERATOR), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=30,
                            env=dict(os.environ, CACHEFS_CONFIG_DIR=str(etc)))
    assert result.returncode == 0
    assert "broken.toml" in result.stderr and "partial.toml" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["cachefs@odd.service.d"]
    text = (tmp_path / "out" / "cachefs@odd.service.d" / "50-cachefs-paths.conf").read_text()
    assert 'RequiresMountsFor="/mnt/nfs/a b%%c" "/nvme/c"' in text
    assert 'Environment="CACHEFS_MOUNTPOINT=/mnt/x y"' in text


def test_generator_reads_the_paths_without_tomllib(tmp_path):
    """Older distributions' /usr/bin/python3 (Ubuntu 22.04: 3.10) have no tomllib."""
    etc = tmp_path / "etc"
    etc.mkdir()
    shutil.copy(REPO / "systemd" / "example.toml", etc / "imagenet.toml")
    run_without_tomllib = ("import runpy, sys; sys.modules['tomllib'] = None; "
                           "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], "
                           "run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", run_without_tomllib, str(GENERATOR),
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=30,
                            env=dict(os.environ, CACHEFS_CONFIG_DIR=str(etc)))
    assert result.returncode == 0, result.stderr
    settings = read_unit(tmp_path / "out" / "cachefs@imagenet.service.d" / "50-cachefs-paths.conf")
    assert settings["Unit"]["RequiresMountsFor"] == ['"/mnt/efs/imagenet" "/nvme/cachefs/imagenet"']
    assert unit_environment(settings) == {"CACHEFS_MOUNTPOINT": "/mnt/imagenet"}


# The kernel's own form of MemoryDenyWriteExecute (prctl PR_SET_MDWE, Linux 6.3+), inherited
# by the program it executes: no mapping may become writable and executable.
RUN_WITHOUT_WRITE_EXECUTE = """
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, REFUSE_EXEC_GAIN
    sys.exit(f"prctl: {os.strerror(ctypes.get_errno())}")
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def test_the_daemon_runs_where_memory_is_never_writable_and_executable(tmp_path, source,
                                                                          remote):
    """The unit sets MemoryDenyWriteExecute: the FUSE session, the mount and everything the
    daemon imports must work under it (a ctypes callback or a JIT would be refused)."""
    make_files(source, 3, size=5000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_WRITE_EXECUTE, "-m", "cachefs", "mount",
         str(remote.path), str(mnt), "--cache-dir", str(tmp_path / "cache"),
         "--cache-size", "64M", "--fraction", "1", "--metrics-addr", "0",
         "--log-file", str(tmp_path / "log")],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    try:
        assert mount.returncode == 0, mount.stderr
        for path in sorted(source.rglob("*")):
            if path.is_file():
                relative = path.relative_to(source)
                assert (mnt / relative).read_bytes() == path.read_bytes()
        status = run_cachefs("status", "--json", str(mnt))
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["data_path"]
    finally:
        run_cachefs("unmount", str(mnt))
        if find_mount(mnt) is not None:
            subprocess.run(["fusermount", "-uz", str(mnt)], check=False)


def test_unit_keeps_the_mount_visible_and_restarts_on_failure():
    service = read_unit(UNIT)["Service"]
    # Each of these gives the service its own mount namespace (or hides /dev/fuse):
    # the mount would exist only inside the service.
    for hiding in ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateMounts",
                   "PrivateDevices", "ProtectKernelTunables", "ProtectKernelModules",
                   "ProtectControlGroups", "ProtectClock",
                   "ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem"):
        assert hiding not in service, hiding
    # Hardening that hides nothing, and that the daemon's code runs under (next test).
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["MemoryDenyWriteExecute"] == ["yes"]
    # A umask that hides the control socket's directory from the training jobs' users.
    assert "UMask" not in service
    assert service["Type"] == ["notify"]
    assert service["Restart"] == ["on-failure"]
    assert "--foreground" in service["ExecStart"][0].split()
    assert service["ExecStop"][0].split()[1:] == ["unmount", "${CACHEFS_MOUNTPOINT}"]


def test_example_config_is_valid():
    raw = read_config_file(REPO / "systemd" / "example.toml")
    settings = build_settings(raw, config_file="example.toml", from_file=frozenset(raw))
    assert settings.fraction == 0.2 and settings.log_file is None


# -- ExecStart and ExecStop, for real ------------------------------------------------------

def read_with_timeout(path: Path, timeout: float = 20.0) -> bytes:
    """Read a file through a mount from a helper thread, so a hung daemon fails the test."""
    result = read_bounded(path, timeout)
    if isinstance(result, OSError):
        raise result
    return result


class NotifySocket:
    """What systemd listens on for sd_notify: a Unix datagram socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[dict[str, str]] = []

    def receive(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        message = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.messages.append(message)
        return message

    def wait_for(self, predicate, timeout: float,
                 process: subprocess.Popen | None = None) -> dict[str, str]:
        """The first message ``predicate`` accepts; fails early if ``process`` exits."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            message = self.receive(min(left, 0.5))
            if message is not None and predicate(message):
                return message
            if message is None and process is not None and process.poll() is not None:
                raise AssertionError(f"the daemon exited with {process.returncode}; "
                                     f"notifications: {self.messages}")
        raise AssertionError(f"no matching notification in {timeout} s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()


@pytest.mark.timeout(90)
def test_exec_start_notifies_ready_once_serving_and_exec_stop_unmounts(service, tmp_path):
    settings = read_unit(service["unit"], *service["dropins"])
    environment = unit_environment(settings)
    start = expand(settings["Service"]["ExecStart"][0], environment)
    stop = expand(settings["Service"]["ExecStop"][0], environment)
    mountpoint = service["mountpoint"]
    notify = NotifySocket(tmp_path / "notify.sock")
    stderr = open(tmp_path / "journal.log", "w+")
    daemon = subprocess.Popen(start, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                              env=dict(os.environ, NOTIFY_SOCKET=str(notify.path), **environment))
    try:
        ready = notify.wait_for(lambda m: "READY" in m, 30, daemon)
        assert ready["READY"] == "1", ready
        # READY=1 means serving: the mount is there and answers a read at once.
        assert find_mount(mountpoint).fstype == "fuse.cachefs"
        assert read_with_timeout(mountpoint / "train" / "a.bin") == service["payload"]
        # MAINPID names the process systemd started (the supervisor holding the connection).
        assert int(ready["MAINPID"]) == daemon.pid
        assert ready["STATUS"].startswith("hit ratio")
        # STATUS= is refreshed while the mount runs: the open above is in it now.
        notify.wait_for(lambda m: re.match(r"hit ratio \d+(\.\d)?%", m.get("STATUS", "")), 30,
                        daemon)

        result = subprocess.run(stop, capture_output=True, text=True, timeout=60,
                                env=dict(os.environ, **environment))
        assert result.returncode == 0, result.stderr
        assert find_mount(mountpoint) is None
        assert daemon.wait(timeout=30) == 0
        notify.wait_for(lambda m: m.get("STOPPING") == "1", 5)
    except BaseException:
        stderr.seek(0)
        sys.stderr.write(f"\n--- daemon output ---\n{stderr.read()}\n")
        raise
    finally:
        if find_mount(mountpoint) is not None:
            unmount(mountpoint, lazy=True)
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGKILL)
            daemon.wait(timeout=10)
        notify.close()
        stderr.close()


@pytest.mark.timeout(90)
def test_exec_start_clears_a_stale_mount_left_by_a_killed_daemon(service, tmp_path):
    # With "never" the kernel caches the root's attributes for a day: the stale mount must
    # be recognised without trusting stat.
    with open(service["config"], "a") as config:
        config.write('revalidate = "never"\n')
    settings = read_unit(service["unit"], *service["dropins"])
    start = expand(settings["Service"]["ExecStart"][0], unit_environment(settings))
    mountpoint = service["mountpoint"]
    notify = NotifySocket(tmp_path / "notify.sock")
    env = dict(os.environ, NOTIFY_SOCKET=str(notify.path))
    output = open(tmp_path / "journal.log", "w+")
    daemons: list[subprocess.Popen] = []
    try:
        for attempt in range(2):
            daemons.append(subprocess.Popen(start, stdin=subprocess.DEVNULL, stdout=output,
                                            stderr=output, env=env))
            ready = notify.wait_for(lambda m: "READY" in m, 30, daemons[-1])
            assert ready["READY"] == "1", ready
            assert read_with_timeout(mountpoint / "train" / "a.bin") == service["payload"]
            if attempt == 0:
                # What the OOM killer does; Restart=on-failure then runs ExecStart again.
                daemons[0].kill()
                daemons[0].wait(timeout=10)
                assert find_mount(mountpoint) is not None
        daemons[1].terminate()  # systemd's stop signal when ExecStop could not unmount
        assert daemons[1].wait(timeout=30) == 0
        assert find_mount(mountpoint) is None
    except BaseException:
        output.seek(0)
        sys.stderr.write(f"\n--- daemon output ---\n{output.read()}\n")
        raise
    finally:
        if find_mount(mountpoint) is not None:
            unmount(mountpoint, lazy=True)
        for daemon in daemons:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait(timeout=10)
        notify.close()
        output.close()


# -- the mount(8) helper ------------------------------------------------------------------

def test_mount_helper_translates_options_and_ignores_mount8_ones():
    command, fake, verbose = build_command([
        "/mnt/efs/ds", "/mnt/ds", "-n", "-o",
        "rw,nosuid,nodev,noatime,cache_dir=/nvme/ds,cache_size=500G,fraction=0.2,allow_other",
        "-o", "_netdev,nofail,x-systemd.automount,x-systemd.requires-mounts-for=/mnt/efs",
        "-t", "fuse.cachefs"])
    assert command == ["mount", "/mnt/efs/ds", "/mnt/ds", "--cache-dir", "/nvme/ds",
                       "--cache-size", "500G", "--fraction", "0.2", "--allow-other"]
    assert not fake and not verbose


def test_every_mount_flag_is_an_option_and_round_trips():
    """Each flag of `cachefs mount` is an -o option that gives the flag's value, spelt with
    _ or -, so a new flag is an fstab option without touching the helper."""
    options = mount_options()
    assert {key for key in SETTING_FLAGS if key not in ("backing", "mountpoint")} \
        <= options.keys()
    assert {"passthrough", "config", "debug"} <= options.keys()
    parser = build_parser()
    for name, action in options.items():
        if name in NOT_FOR_FSTAB:
            continue
        for spelling in (name, name.replace("_", "-")):
            value = f"{name}-value" if takes_value(action) else None
            option = f"{spelling}={value}" if value else spelling
            command, _, _ = build_command(["/remote", "/mnt", "-o", f"rw,{option},nofail"])
            args = parser.parse_args(command)
            assert getattr(args, action.dest) == (value or True), option
            assert (args.backing, args.mountpoint) == ("/remote", "/mnt")
    command, _, _ = build_command(["/r", "/m", "-o", "passthrough=off"])
    assert command[-2:] == ["--passthrough", "off"]


@pytest.mark.parametrize("options, words", [
    ("cache_dir=/c,bogus=1", ["unknown option 'bogus=1'", "cachefs mount --help"]),
    ("cache_sise=1G", ["did you mean cache_size"]),
    ("allow_other=yes", ["takes no value"]),
    ("cache_dir=", ["needs a value"]),
    ("passthrough", ["needs a value"]),
    ("foreground", ["not for mount(8) or fstab", "--foreground"]),
    ("dry-run", ["not for mount(8) or fstab", "--dry-run"]),
])
def test_mount_helper_rejects_bad_options_in_one_line(options, words):
    result = subprocess.run([sys.executable, "-m", "cachefs.service.mounthelper", "/a", "/b", "-o",
                             options], capture_output=True, text=True, timeout=30, cwd=REPO)
    assert result.returncode == EXIT_USAGE
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("mount.fuse.cachefs: ")
    for word in words:
        assert word in result.stderr, result.stderr
    # The list of options is not dumped on the user.
    assert len(result.stderr) < 250, result.stderr


def test_mount_helper_reports_a_bad_value_as_cachefs_mount_does(tmp_path):
    (tmp_path / "mnt").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "cachefs.service.mounthelper", str(tmp_path), str(tmp_path / "mnt"),
         "-o", f"cache_dir={tmp_path / 'c'},cache_size=1G,passthrough=sometimes"],
        capture_output=True, text=True, timeout=30, cwd=REPO)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == \
        ["cachefs mount: --passthrough: 'sometimes' is none of 'auto', 'local' and 'off'"]
    assert find_mount(tmp_path / "mnt") is None


def test_mount_helper_sloppy_ignores_unknown_options():
    command, _, _ = build_command(["/a", "/b", "-s", "-o", "cache_size=1G,bogus"])
    assert command == ["mount", "/a", "/b", "--cache-size", "1G"]


NAMESPACE_SCRIPT = """
set -euo pipefail
# mount(8) looks for helpers in /sbin only: give this namespace a copy with ours added.
cp -a /usr/sbin/. "$HELPER_DIR/"
mount --bind "$HELPER_DIR" /usr/sbin
mount -t fuse.cachefs "$BACKING" "$MNT1" -o "$OPTIONS1"
test "$(findmnt -n -o FSTYPE,SOURCE "$MNT1")" = "fuse.cachefs $BACKING"
cmp "$BACKING/train/a.bin" "$MNT1/train/a.bin"
"$PYTHON" -m cachefs status --json "$MNT1" > "$STATUS1"
umount "$MNT1"
# The fstab line, as `mount /mnt/...` at boot would use it.
LIBMOUNT_FSTAB="$FSTAB" mount "$MNT2"
cmp "$BACKING/train/a.bin" "$MNT2/train/a.bin"
"$PYTHON" -m cachefs unmount "$MNT2"
if findmnt "$MNT1" || findmnt "$MNT2"; then echo "still mounted"; exit 1; fi
echo NAMESPACE-OK
"""


@pytest.mark.timeout(120)
def test_mount8_and_fstab_mount_through_the_helper(tmp_path):
    """Real mount(8) runs, in a private mount and PID namespace: whatever happens, the
    kernel removes its mounts and daemons when the namespace's last process ends."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("findmnt"):
        pytest.skip("needs root, unshare(1) and findmnt(8)")
    helper_dir = tmp_path / "sbin"
    helper_dir.mkdir()
    helper = helper_dir / "mount.fuse.cachefs"
    helper.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
                      "from cachefs.service.mounthelper import main\nsys.exit(main())\n")
    helper.chmod(0o755)
    backing = tmp_path / "remote"
    (backing / "train").mkdir(parents=True)
    (backing / "train" / "a.bin").write_bytes(os.urandom(100_000))
    for name in ("mnt1", "mnt2"):
        (tmp_path / name).mkdir()
    common = f"metrics_addr=0,runtime_dir={tmp_path / 'run'}"
    options1 = (f"rw,nosuid,nodev,_netdev,nofail,x-systemd.automount,cache_dir={tmp_path / 'c1'}"
                f",cache_size=64MiB,fraction=0.5,{common},log_file={tmp_path / 'mnt1.log'},"
                "seed=7,revalidate=never,remote-timeout=20,prefetch_concurrency=8,"
                "staging_size=32MiB,passthrough=off,debug")
    fstab = tmp_path / "fstab"
    fstab.write_text(
        "# <source> <mount point> <type> <options> <dump> <pass>\n"
        f"{backing} {tmp_path / 'mnt2'} fuse.cachefs cache_dir={tmp_path / 'c2'},"
        f"cache_size=64MiB,allow_other,_netdev,nofail,{common},log_file={tmp_path / 'mnt2.log'}"
        " 0 0\n")
    env = dict(os.environ, HELPER_DIR=str(helper_dir), BACKING=str(backing),
               MNT1=str(tmp_path / "mnt1"), MNT2=str(tmp_path / "mnt2"), OPTIONS1=options1,
               FSTAB=str(fstab), PYTHON=sys.executable, STATUS1=str(tmp_path / "status1.json"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
         "bash", "-c", NAMESPACE_SCRIPT], capture_output=True, text=True, timeout=110, env=env)
    logs = "".join(f"\n--- {p.name} ---\n{p.read_text(errors='replace')}"
                   for p in sorted(tmp_path.glob("mnt*.log")))
    assert result.returncode == 0 and "NAMESPACE-OK" in result.stdout, \
        f"{result.stdout}\n{result.stderr}{logs}"
    assert find_mount(tmp_path / "mnt1") is None and find_mount(tmp_path / "mnt2") is None
    # The -o options reached the daemon.
    status = json.loads((tmp_path / "status1.json").read_text())
    assert (status["fraction"], status["seed"], status["revalidate_seconds"]) == (0.5, 7, None)
    assert status["data_path"].startswith("served by the daemon: passthrough switched off")


# -- Prometheus, Grafana, Kubernetes -------------------------------------------------------

def exported_metric_names() -> set[str]:
    """Every sample name a scrape of a cachefs daemon can show."""
    names = set()
    for family in Metrics().registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def test_dashboard_uses_only_exported_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "cachefs.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    assert exprs
    used = {name for expr in exprs for name in re.findall(r"\bcachefs_[a-z_]+", expr)}
    exported = exported_metric_names()
    assert used - exported == set(), f"not exported by cachefs/metrics.py: {used - exported}"
    for needed in ("cachefs_file_opens_total", "cachefs_read_bytes_total",
                   "cachefs_remote_read_bytes_total", "cachefs_prefetch_files_total",
                   "cachefs_cache_bytes", "cachefs_cache_capacity_bytes",
                   "cachefs_remote_errors_total", "cachefs_remote_available"):
        assert needed in used, needed


def test_prometheus_scrape_config_and_alerts_use_exported_metrics():
    yaml = pytest.importorskip("yaml")
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["cachefs"].get("metrics_path", "/metrics") == "/metrics"
    assert (DEPLOY / "prometheus" / scrape["rule_files"][0]).exists()
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "cachefs-alerts.yml").read_text())
    exprs = [rule["expr"] for group in alerts["groups"] for rule in group["rules"]]
    used = {name for expr in exprs for name in re.findall(r"\bcachefs_[a-z_]+", expr)}
    assert used and used <= exported_metric_names(), used - exported_metric_names()


def test_kubernetes_manifests_share_the_mount_with_the_host():
    yaml = pytest.importorskip("yaml")
    docs = [doc for doc in yaml.safe_load_all(
        (DEPLOY / "kubernetes" / "daemonset.yaml").read_text()) if doc]
    daemonset = next(doc for doc in docs if doc["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "cachefs")
    assert container["securityContext"]["privileged"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    host_paths = {v["hostPath"]["path"] for v in volumes.values() if "hostPath" in v}
    assert "/dev/fuse" in host_paths
    shared = [m for m in mounts.values() if m.get("mountPropagation") == "Bidirectional"]
    assert len(shared) == 1 and "hostPath" in volumes[shared[0]["name"]]
    assert "unmount" in container["lifecycle"]["preStop"]["exec"]["command"]
    assert "status" in container["livenessProbe"]["exec"]["command"]
    assert pod["terminationGracePeriodSeconds"] >= 30

    training = [doc for doc in yaml.safe_load_all(
        (DEPLOY / "kubernetes" / "training-pod.yaml").read_text()) if doc]
    spec = training[0]["spec"]
    dataset = next(v for v in spec["volumes"] if v.get("hostPath", {}).get("path")
                   == volumes[shared[0]["name"]]["hostPath"]["path"])
    dataset_mounts = [m for c in spec["containers"] for m in c["volumeMounts"]
                      if m["name"] == dataset["name"]]
    assert dataset_mounts and all(m["mountPropagation"] == "HostToContainer"
                                  for m in dataset_mounts)
