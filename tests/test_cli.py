"""Bad input to `cachefs mount` gets one line naming the problem and the fix, a non-zero
exit, nothing mounted, and nothing already in the cache dir lost."""

from __future__ import annotations

import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from cachefs.kernel.mountpoint import find_mount
from cachefs.service import dryrun
from cachefs.service.config import build_settings
from cachefs.store.admission import FractionAdmission
from tests.conftest import REPO, make_files, run_cachefs

pytestmark = [pytest.mark.fast, pytest.mark.timeout(120)]


def snapshot(path) -> dict[str, bytes]:
    found = {}
    for directory, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(directory, name)
            with open(full, "rb") as f:
                found[os.path.relpath(full, path)] = f.read()
    return found


@pytest.fixture
def setup(tmp_path, source):
    make_files(source, 20, size=1000)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    return source, mnt, tmp_path / "cache"


def assert_refused(result, *words, mnt=None):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word.lower() in lines[0].lower(), lines[0]
    if mnt is not None:
        assert find_mount(mnt) is None


@pytest.mark.parametrize("flags, words", [
    (["--cache-size", "lots"], ["--cache-size", "not a size"]),
    (["--cache-size", "1K"], ["--cache-size", "minimum"]),
    (["--cache-size", "-5G"], ["--cache-size"]),
    (["--fraction", "1.5"], ["--fraction", "between 0 and 1"]),
    (["--fraction", "half"], ["--fraction"]),
    (["--seed", "-1"], ["--seed"]),
    (["--revalidate", "sometimes"], ["--revalidate", "never"]),
    (["--remote-timeout", "0"], ["--remote-timeout"]),
    (["--metrics-addr", "localhost:99999"], ["--metrics-addr", "out of range"]),
    (["--prefetch-concurrency", "0"], ["--prefetch-concurrency"]),
    (["--cpus", "some"], ["--cpus", "a list of CPUs such as 0,2-3"]),
    (["--cpus", "4096"], ["--cpus", "CPU 4096 is not one this process may run on"]),
    (["--staging-size", "1P"], ["--staging-size", "more than half the memory"]),
    (["--bogus-flag"], ["unrecognized arguments"]),
])
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["mount", "dry-run"])
def test_bad_flags(setup, flags, words, dry_run):
    source, mnt, cache = setup
    args = ["mount", str(source), str(mnt), "--cache-dir", str(cache), "--cache-size", "1G"]
    result = run_cachefs(*args, *dry_run, *flags)
    assert_refused(result, *words, mnt=mnt)
    assert not cache.exists()


def test_missing_required_settings(setup):
    source, mnt, cache = setup
    assert_refused(run_cachefs("mount", str(source), str(mnt), "--cache-size", "1G"),
                   "cache-dir")
    assert_refused(run_cachefs("mount", str(source), str(mnt), "--cache-dir", str(cache)),
                   "cache-size")


def test_bad_paths(setup, tmp_path):
    source, mnt, cache = setup
    base = ["--cache-dir", str(cache), "--cache-size", "1G"]
    assert_refused(run_cachefs("mount", str(tmp_path / "nope"), str(mnt), *base),
                   "BACKING", "does not exist", mnt=mnt)
    assert_refused(run_cachefs("mount", str(source / "class0000" / "img000000.bin"), str(mnt),
                               *base), "not a directory", mnt=mnt)
    assert_refused(run_cachefs("mount", str(source), str(tmp_path / "nomnt"), *base),
                   "MOUNTPOINT", "does not exist")
    (mnt / "stray").write_text("x")
    assert_refused(run_cachefs("mount", str(source), str(mnt), *base), "not empty", mnt=mnt)
    (mnt / "stray").unlink()
    assert_refused(run_cachefs("mount", str(source), str(mnt), "--cache-dir",
                               str(source / "cache"), "--cache-size", "1G"),
                   "inside BACKING", mnt=mnt)
    assert_refused(run_cachefs("mount", str(source), str(mnt), "--cache-dir",
                               str(mnt / "cache"), "--cache-size", "1G"), mnt=mnt)
    assert_refused(run_cachefs("mount", str(source), str(source / "class0000"), *base),
                   "contain each other")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert_refused(run_cachefs("mount", str(source), str(mnt), "--cache-dir", str(a_file),
                               "--cache-size", "1G"), "cache dir", "not a directory", mnt=mnt)
    assert a_file.read_text() == "x"


def test_cache_dir_that_is_not_a_cache_is_left_alone(setup):
    source, mnt, cache = setup
    cache.mkdir()
    (cache / "thesis.tex").write_text("precious")
    result = run_cachefs("mount", str(source), str(mnt), "--cache-dir", str(cache),
                         "--cache-size", "1G", "--metrics-addr", "0")
    assert_refused(result, "not empty", "not a cachefs cache", mnt=mnt)
    assert snapshot(cache) == {"thesis.tex": b"precious"}


def test_already_mounted_and_cache_in_use(setup, remote, mount_cachefs, tmp_path):
    source, mnt, cache = setup
    first = mount_cachefs(remote.path)
    contents = snapshot(first.cache_dir)
    other = tmp_path / "other"
    other.mkdir()
    assert_refused(run_cachefs("mount", str(remote.path), str(first.path), "--cache-dir",
                               str(tmp_path / "c2"), "--cache-size", "1G", "--metrics-addr", "0"),
                   "already mounted")
    assert_refused(run_cachefs("mount", str(remote.path), str(other), "--cache-dir",
                               str(first.cache_dir), "--cache-size", "1G", "--metrics-addr", "0"),
                   "in use by another cachefs daemon", mnt=other)
    assert snapshot(first.cache_dir).keys() >= contents.keys()


def test_metrics_port_in_use(setup):
    source, mnt, cache = setup
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cachefs("mount", str(source), str(mnt), "--cache-dir", str(cache),
                             "--cache-size", "1G", "--metrics-addr", f"127.0.0.1:{port}")
    assert_refused(result, "metrics", "--metrics-addr", mnt=mnt)


@pytest.mark.parametrize("content, words", [
    ("cache_size = \n", ["not valid TOML"]),
    ("cache_sise = '1G'\n", ["unknown setting", "cache_sise"]),
    ("fraction = 'most'\n", ["fraction in", "not a fraction"]),
    ("cache_size = 12\n", ["cache_size in", "minimum"]),
    ("cache_size = '1G'\nseed = 1.5\n", ["seed in", "1.5 is not a seed"]),
    ("cache_size = '1G'\nheld_files = 70000.5\n", ["held_files in", "not a whole number"]),
    ("cache_size = '1G'\nruntime_dir = '/dev/null/cachefs'\n",
     ["--runtime-dir", "/dev/null is not a directory"]),
])
def test_bad_config_files(setup, tmp_path, content, words):
    source, mnt, cache = setup
    config = tmp_path / "bad.toml"
    config.write_text(f"backing = '{source}'\ncache_dir = '{cache}'\n" + content)
    result = run_cachefs("mount", "--config", str(config), str(source), str(mnt))
    assert_refused(result, *words, mnt=mnt)


def test_unreadable_config(setup, tmp_path):
    source, mnt, _cache = setup
    assert_refused(run_cachefs("mount", "--config", str(tmp_path / "none.toml")),
                   "does not exist")
    assert_refused(run_cachefs("mount", "--config", str(tmp_path)), "directory")


def test_config_file_mounts_and_flags_override(source, remote, tmp_path):
    make_files(source, 10, size=100)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    config = tmp_path / "dataset.toml"
    config.write_text(
        f"backing = '{remote.path}'\nmountpoint = '{mnt}'\ncache_dir = '{tmp_path / 'cache'}'\n"
        "cache_size = '100MiB'\nfraction = 0.25\nmetrics_addr = '0'\nrevalidate = 'never'\n")
    result = run_cachefs("mount", "--config", str(config), "--fraction", "0.75",
                         "--log-file", str(tmp_path / "log"))
    try:
        assert result.returncode == 0, result.stderr
        status = run_cachefs("status", "--json", str(mnt))
        import json

        st = json.loads(status.stdout)
        assert st["fraction"] == 0.75
        assert st["revalidate_seconds"] is None
        assert st["cache_capacity_bytes"] == 100 * 2**20
        assert st["metrics_url"] is None
    finally:
        run_cachefs("unmount", str(mnt))
    assert find_mount(mnt) is None


def test_stale_mount_is_cleaned_up_and_reported(source, remote, mount_cachefs):
    make_files(source, 10, size=100)
    mount = mount_cachefs(remote.path)
    mount.kill()
    with pytest.raises(OSError):
        os.statvfs(mount.path)  # Transport endpoint is not connected
    result = run_cachefs(*mount.command())
    assert result.returncode == 0, result.stderr
    assert "stale mount" in result.stderr
    mount.pid = mount.status()["pid"]
    assert (mount.path / "class0000" / "img000000.bin").read_bytes() == \
        (source / "class0000" / "img000000.bin").read_bytes()


def test_status_and_unmount_of_something_else(tmp_path):
    result = run_cachefs("status", str(tmp_path))
    assert_refused(result, "not a cachefs mount")
    result = run_cachefs("unmount", str(tmp_path))
    assert_refused(result, "not mounted")


# -- mount --dry-run ---------------------------------------------------------------------------

def test_dry_run_shows_settings_their_sources_and_the_admitted_share(setup, tmp_path):
    source, mnt, cache = setup
    config = tmp_path / "dataset.toml"
    config.write_text(f"cache_dir = '{cache}'\ncache_size = '100MiB'\nfraction = 0.25\n"
                      "seed = 7\nmetrics_addr = '0'\n")
    result = run_cachefs("mount", str(source), str(mnt), "--config", str(config),
                         "--cache-size", "2GiB", "--passthrough", "off", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    settings_block = result.stdout.split("admission:")[0].splitlines()[2:]
    rows = {line.split()[0]: line.split() for line in settings_block}
    assert rows["fraction"][1:] == ["0.25", "config", str(config)]
    assert rows["seed"][1:] == ["7", "config", str(config)]
    assert rows["cache_size"][-1] == "--cache-size" and rows["cache_size"][1:3] == ["2", "GiB"]
    assert rows["revalidate"][1:] == ["60", "s", "default"]
    assert rows["backing"][1:] == [str(source), "argument"]
    # The share the hash keeps, counted over the whole tree (20 files).
    admission = FractionAdmission(0.25, 7)
    rels = [os.path.relpath(os.path.join(d, n), source)
            for d, _, names in os.walk(source) for n in names]
    kept = sum(admission.eligible(r) for r in rels)
    assert f"keeps {kept / len(rels):.1%} of the files: {kept} of {len(rels)}," in result.stdout
    assert "the whole tree" in result.stdout
    assert "served by the daemon: passthrough switched off" in result.stdout
    # Nothing mounted, nothing created.
    assert find_mount(mnt) is None and not cache.exists()


def test_dry_run_says_what_passthrough_depends_on(setup):
    source, mnt, cache = setup
    result = run_cachefs("mount", str(source), str(mnt), "--cache-dir", str(cache),
                         "--cache-size", "1G", "--metrics-addr", "0", "--dry-run")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "Linux 6.9" in text and "CAP_SYS_ADMIN" in text and os.uname().release in text


def test_dry_run_samples_a_huge_tree_and_says_so(setup):
    source, mnt, cache = setup
    settings = build_settings({"backing": str(source), "mountpoint": str(mnt),
                               "cache_dir": str(cache), "cache_size": "1G",
                               "metrics_addr": "0", "fraction": 0.5})
    count = dryrun.count_admitted(source, 0.5, 0, max_files=5)
    assert not count.complete and 5 <= count.files < 20
    text = dryrun.report(settings, {"fraction": "default"}, max_files=5)
    assert "sampled: the walk stopped after" in text
    assert dryrun.count_admitted(source, 0.5, 0).complete


def test_dry_run_refuses_what_a_mount_refuses(setup):
    source, mnt, cache = setup
    cache.mkdir()
    (cache / "thesis.tex").write_text("precious")
    base = ["--cache-size", "1G", "--metrics-addr", "0", "--dry-run"]
    assert_refused(run_cachefs("mount", str(source), str(mnt), "--cache-dir", str(cache), *base),
                   "not empty", "not a cachefs cache")
    (mnt / "stray").write_text("x")
    assert_refused(run_cachefs("mount", str(source), str(mnt), "--cache-dir",
                               str(cache / "sub"), *base), "MOUNTPOINT", "not empty")
    assert_refused(run_cachefs("mount", str(source), str(mnt), *base), "cache-dir")
    assert snapshot(cache) == {"thesis.tex": b"precious"}


# -- status and warm, in a pipe and on a terminal ------------------------------------------------

def read_until(fd: int, done, timeout: float = 20.0) -> str:
    """What a terminal (the master side of a pty) shows until ``done(text)`` or the timeout."""
    text = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done(text.decode(errors="replace")):
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            text += chunk
    return text.decode(errors="replace")


def interrupted_by_ctrl_c() -> None:
    """As an interactive shell starts a command: SIGINT interrupts it.  (A test run started
    in the background inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_with_ctrl_c(child: subprocess.Popen) -> int | None:
    child.send_signal(signal.SIGINT)
    try:
        return child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return None


def run_on_a_terminal(*args: str) -> tuple[subprocess.Popen, int]:
    primary, secondary = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="120", LINES="40")
    env.pop("NO_COLOR", None)
    child = subprocess.Popen([sys.executable, "-m", "cachefs", *args], stdin=secondary,
                             stdout=secondary, stderr=secondary, cwd=REPO, env=env,
                             preexec_fn=interrupted_by_ctrl_c)
    os.close(secondary)
    return child, primary


def test_status_names_the_data_path_and_watch_into_a_pipe_stays_plain(source, mount_cachefs):
    make_files(source, 5, size=1000)
    mount = mount_cachefs(source, passthrough="off")
    result = run_cachefs("status", str(mount.path))
    assert result.returncode == 0, result.stderr
    rows = {line[2:14].strip(): line[15:] for line in result.stdout.splitlines()[1:]}
    assert rows["data path"].startswith("served by the daemon: passthrough switched off")
    assert " of 1 GiB (" in rows["cache"]
    # --watch into a pipe: the same plain block again and again, no escapes.
    watcher = subprocess.Popen([sys.executable, "-m", "cachefs", "status", "--watch", "0.2",
                                str(mount.path)], stdout=subprocess.PIPE, text=True, cwd=REPO,
                               preexec_fn=interrupted_by_ctrl_c)
    try:
        blocks = []
        block: list[str] = []
        for line in watcher.stdout:
            if not line.strip():
                blocks.append(block)
                block = []
                if len(blocks) == 2:
                    break
            else:
                block.append(line.rstrip("\n"))
    finally:
        assert stop_with_ctrl_c(watcher) == 0
    for block in blocks:
        assert "\x1b" not in "".join(block)
        assert block[0].startswith(f"cachefs {mount.path}  (pid ")
        assert all(line.startswith("  ") and line[2:14].strip() for line in block[1:])
        assert any(line.startswith("  data path    served by the daemon") for line in block)
        assert block[-1].startswith("  at ")

    # A reader that stops reading (`| head`) ends the watch quietly.
    watcher = subprocess.Popen([sys.executable, "-m", "cachefs", "status", "--watch", "0.2",
                                str(mount.path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=REPO)
    watcher.stdout.readline()
    watcher.stdout.close()
    assert watcher.wait(timeout=30) == 0
    assert watcher.stderr.read() == b""
    # An interval it would spin on, or none, is refused in one line.
    for interval in ("0", "-1", "soon"):
        assert_refused(run_cachefs("status", "--watch", interval, str(mount.path)),
                       "--watch", "a number of seconds, 0.2 or more")


def test_watch_and_warm_on_a_terminal_draw_with_rich(tmp_path, source, mount_cachefs):
    rels = make_files(source, 40, size=2000)
    mount = mount_cachefs(source, cache_size="64MiB")
    watcher, screen = run_on_a_terminal("status", "--watch", "0.2", str(mount.path))
    try:
        shown = read_until(screen, lambda text: text.count("Ctrl-C to stop") >= 2)
        assert "╭" in shown and "data path" in shown, shown
        assert "Traceback" not in shown
    finally:
        exit_code = stop_with_ctrl_c(watcher)
        os.close(screen)
        assert exit_code == 0
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(rels) + "\n")
    warmer, screen = run_on_a_terminal("warm", str(mount.path), "--list", str(listing))
    try:
        shown = read_until(screen, lambda text: "failed" in text)
        assert warmer.wait(timeout=30) == 0, shown
    finally:
        if warmer.poll() is None:
            warmer.kill()
        os.close(screen)
    assert "warming" in shown and "40/40" in shown and "━" in shown, shown
    assert "warmed 40 files" in shown
    assert mount.metric("cachefs_cache_files") == 40


# -- shell completion ----------------------------------------------------------------------------

BASH_COMPLETE = """
source "$1"
complete_words() {
    COMP_WORDS=("$@"); COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
    COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}; COMPREPLY=()
    _shtab_cachefs
    echo "${COMPREPLY[*]}"
}
complete_words cachefs ""
complete_words cachefs mount --pass
complete_words cachefs mount --cache-dir "$2/"
"""


def test_bash_completion_is_valid_and_completes_commands_flags_and_paths(tmp_path):
    result = run_cachefs("completion", "bash")
    assert result.returncode == 0, result.stderr
    script = tmp_path / "cachefs.bash"
    script.write_text(result.stdout)
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                           timeout=30)
    assert check.returncode == 0, check.stderr
    (tmp_path / "nvme").mkdir()
    completed = subprocess.run(["bash", "-c", BASH_COMPLETE, "bash", str(script),
                                str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert completed.returncode == 0, completed.stderr
    commands, flags, paths = completed.stdout.splitlines()
    assert commands.split() == ["mount", "upgrade", "unmount", "status", "warm", "verify",
                                "completion"]
    assert flags == "--passthrough"
    assert f"{tmp_path}/nvme" in paths.split()


def test_zsh_completion_and_unknown_shells(tmp_path):
    result = run_cachefs("completion", "zsh")
    assert result.returncode == 0 and result.stdout.startswith("#compdef cachefs")
    assert "--passthrough" in result.stdout and "--dry-run" in result.stdout
    if subprocess.run(["sh", "-c", "command -v zsh"], capture_output=True).returncode == 0:
        script = tmp_path / "_cachefs"
        script.write_text(result.stdout)
        check = subprocess.run(["zsh", "-n", str(script)], capture_output=True, text=True,
                               timeout=30)
        assert check.returncode == 0, check.stderr
    assert_refused(run_cachefs("completion", "fish"), "invalid choice", "bash")
