"""The client finds its daemon from any path a training job uses: a symlink above the mount
or to it, a bind mount of a subdirectory (a Kubernetes hostPath of it, or a subPath), another
mount namespace (a container) that shows the mount at its own path, a relative path from a
working directory inside the mount.  Each case trains with a real DataLoader and checks what
a user would: the bytes are the remote's, the daemon accepted hints, and the fast path
answered (files the daemon handed over without an open through the mount)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from cachefs.kernel.mountpoint import find_mount
from cachefs_client import _control, _daemon, _paths, read_file
from cachefs_client._control import RUNTIME_DIR_ENV, Unreachable
from cachefs_client._paths import PathMap
from tests.conftest import REPO, control_socket_path, errno_of, make_files

# A training script: a DataLoader of the client over the paths given, reading each batch
# with read_files (the fast path), two epochs; prints how many files it read and how many
# differed from the remote's own copy.
TRAIN = """
import json, sys
import torch
from cachefs_client import DataLoader, read_files

class Files(torch.utils.data.Dataset):
    def __init__(self, paths): self.paths = paths
    def __len__(self): return len(self.paths)
    def path_of(self, i): return self.paths[i]
    def __getitem__(self, i): return self.__getitems__([i])[0]
    def __getitems__(self, indices):
        return list(zip(indices, read_files([self.paths[i] for i in indices])))

if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    loader = DataLoader(Files(config["paths"]), batch_size=8, shuffle=True, num_workers=2,
                        collate_fn=lambda items: items,
                        generator=torch.Generator().manual_seed(1))
    seen = wrong = 0
    for _ in range(2):
        for batch in loader:
            for i, data in batch:
                seen += 1
                with open(config["sources"][i], "rb") as f:
                    wrong += f.read() != data
    print(json.dumps({"seen": seen, "wrong": wrong}))
"""


def train(tmp_path: Path, paths: list[str], sources: list[Path], *, cwd: Path = REPO,
          prefix: list[str] = (), env: dict | None = None) -> tuple[dict, list[str]]:
    """Run TRAIN (after ``prefix``, e.g. an unshare command); its result and the client's
    warnings, from the main process and the workers alike."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    config = json.dumps({"paths": paths, "sources": [str(s) for s in sources]})
    result = subprocess.run([*prefix, sys.executable, str(script), config], cwd=cwd,
                            capture_output=True, text=True, timeout=100,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "RuntimeWarning: cachefs:" in line]
    return json.loads(result.stdout.splitlines()[-1]), warned


def daemon_figures(mount) -> dict[str, float]:
    """Hints accepted, and opens answered over the control socket: every open the daemon
    counted, less those that came through the mount (each timed in cachefs_open_seconds)."""
    m = mount.metrics()
    opens = sum(m.get(("cachefs_file_opens_total", (("result", r),)), 0.0)
                for r in ("hit", "prefetched", "miss"))
    through_mount = m.get(("cachefs_open_seconds_count", ()), 0.0)
    hints = {r: m.get(("cachefs_hints_total", (("result", r),)), 0.0)
             for r in ("accepted", "invalid")}
    return {**hints, "fast_path": opens - through_mount}


def assert_served_by_the_daemon(mount, outcome: dict, warned: list[str], files: int) -> None:
    assert outcome == {"seen": 2 * files, "wrong": 0}
    assert warned == []
    figures = daemon_figures(mount)
    # Every hint named a file of the daemon's tree (a hint of a path it does not know is
    # counted invalid).
    assert figures["accepted"] > 0 and figures["invalid"] == 0, figures
    # The second epoch at least: every file cached by then, each handed over by the daemon.
    assert figures["fast_path"] >= files, figures


@pytest.fixture
def bind_mounts(mount_cachefs):
    """Factory: ``bind(source, target)``; every bind mount is gone before the cachefs mounts
    (which this fixture depends on) are unmounted."""
    made: list[Path] = []

    def bind(source: Path, target: Path) -> Path:
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "--bind", str(source), str(target)], check=True,
                       capture_output=True)
        made.append(target)
        return target

    yield bind
    for target in reversed(made):
        if find_mount(target) is not None and subprocess.run(
                ["umount", str(target)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts")


# -- the DataLoader through each way to the files ----------------------------------------------

@needs_root
@pytest.mark.parametrize("link", ["parent directory", "mount point"])
def test_paths_through_a_symlink(tmp_path, source, remote, mount_cachefs, link):
    """/data -> /local-disk, the mount at /local-disk/mnt; or a symlink to the mount itself."""
    rels = make_files(source, 48, size=(1000, 30_000), per_dir=16)
    mount = mount_cachefs(remote.path, name="disk/mnt")
    if link == "parent directory":
        (tmp_path / "data").symlink_to(tmp_path / "disk")
        root = tmp_path / "data" / "mnt"
    else:
        (tmp_path / "dataset").symlink_to(mount.path)
        root = tmp_path / "dataset"
    outcome, warned = train(tmp_path, [str(root / r) for r in rels], [source / r for r in rels])
    assert_served_by_the_daemon(mount, outcome, warned, len(rels))


@needs_root
def test_a_bind_mount_of_a_subdirectory(tmp_path, source, remote, mount_cachefs, bind_mounts):
    """What Kubernetes makes of a hostPath of a subdirectory, or a subPath: the daemon's
    ``class0001/x`` is ``P/x`` here."""
    rels = make_files(source, 48, size=(1000, 30_000), per_dir=16)
    mount = mount_cachefs(remote.path)
    view = bind_mounts(mount.path / "class0001", tmp_path / "P")
    mine = [r for r in rels if r.startswith("class0001/")]
    outcome, warned = train(tmp_path, [str(view / Path(r).name) for r in mine],
                            [source / r for r in mine])
    assert_served_by_the_daemon(mount, outcome, warned, len(mine))


@needs_root
def test_relative_paths_from_a_working_directory_inside_the_mount(tmp_path, source, remote,
                                                                  mount_cachefs):
    rels = make_files(source, 48, size=(1000, 30_000), per_dir=16)
    mount = mount_cachefs(remote.path)
    # From class0000: its own files by name, the others through "..".
    relative = [Path(r).name if r.startswith("class0000/") else f"../{r}" for r in rels]
    outcome, warned = train(tmp_path, relative, [source / r for r in rels],
                            cwd=mount.path / "class0000")
    assert_served_by_the_daemon(mount, outcome, warned, len(rels))


# A pod, built with a mount namespace: the mount appears at POD/data (all of it, or one
# subdirectory as a subPath), the node's path to it is hidden, and the daemon's runtime
# directory is hidden too, then bind-mounted back at its own path ("same path"), or at
# POD/cachefs-run named by CACHEFS_RUNTIME_DIR ("override"), or not at all ("missing").
POD = """
set -e
mount --bind "$VIEW" "$POD/data"
mount --bind "$RUN" "$POD/cachefs-run"
mount -t tmpfs tmpfs "$RUN"
mount -t tmpfs tmpfs "$NODE_DIR"
if [ "$SOCKETS" = "same path" ]; then mount --bind "$POD/cachefs-run" "$RUN"; fi
if [ "$SOCKETS" != "override" ]; then umount "$POD/cachefs-run"; fi
exec "$@"
"""


def in_a_pod(tmp_path: Path, mount, view: Path, sockets: str) -> tuple[list[str], dict]:
    pod = tmp_path / "pod"
    for name in ("data", "cachefs-run"):
        (pod / name).mkdir(parents=True, exist_ok=True)
    env = {"VIEW": str(view), "POD": str(pod), "SOCKETS": sockets,
           "RUN": os.path.dirname(control_socket_path(mount.path)),
           "NODE_DIR": str(mount.path.parent)}
    if sockets == "override":
        env[RUNTIME_DIR_ENV] = str(pod / "cachefs-run")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", POD, "sh"], env


@needs_root
@pytest.mark.parametrize("view, sockets", [("whole", "same path"), ("subPath", "override")])
def test_another_mount_namespace(tmp_path, source, remote, mount_cachefs, view, sockets):
    rels = make_files(source, 48, size=(1000, 30_000), per_dir=16)
    mount = mount_cachefs(remote.path, name="node/mnt")
    mine = [r for r in rels if view == "whole" or r.startswith("class0001/")]
    shown = mount.path if view == "whole" else mount.path / "class0001"
    prefix, env = in_a_pod(tmp_path, mount, shown, sockets)
    data = tmp_path / "pod" / "data"
    paths = [str(data / (r if view == "whole" else Path(r).name)) for r in mine]
    outcome, warned = train(tmp_path, paths, [source / r for r in mine], prefix=prefix, env=env)
    assert_served_by_the_daemon(mount, outcome, warned, len(mine))
    assert find_mount(data) is None  # the pod's mounts were its own


@needs_root
def test_a_pod_without_the_socket_trains_on_with_one_warning(tmp_path, source, remote,
                                                             mount_cachefs):
    rels = make_files(source, 32, size=(1000, 30_000), per_dir=16)
    mount = mount_cachefs(remote.path, name="node/mnt")
    prefix, env = in_a_pod(tmp_path, mount, mount.path, "missing")
    data = tmp_path / "pod" / "data"
    outcome, warned = train(tmp_path, [str(data / r) for r in rels], [source / r for r in rels],
                            prefix=prefix, env=env)
    assert outcome == {"seen": 2 * len(rels), "wrong": 0}
    assert len(warned) == 1, warned  # the main process's; the workers inherit it
    assert "not visible here" in warned[0] and RUNTIME_DIR_ENV in warned[0]
    assert daemon_figures(mount) == {"accepted": 0.0, "invalid": 0.0, "fast_path": 0.0}


# -- the hidden control entry ----------------------------------------------------------------

@needs_root
def test_the_control_entry_is_in_every_directory_and_never_listed(source, remote,
                                                                  mount_cachefs):
    make_files(source, 4, size=100, per_dir=2)
    (source / "class0001" / "deeper").mkdir()
    mount = mount_cachefs(remote.path)
    target = control_socket_path(mount.path)
    for directory in ("class0000", "class0001", "class0001/deeper"):
        assert os.readlink(mount.path / directory / ".cachefs.sock") == target
        assert ".cachefs.sock" not in os.listdir(mount.path / directory)
    assert ".cachefs.sock" not in os.listdir(mount.path)
    diff = subprocess.run(["diff", "-r", "--no-dereference", str(source), str(mount.path)],
                          capture_output=True, text=True)
    assert diff.returncode == 0, diff.stdout + diff.stderr


@needs_root
def test_a_remote_file_named_like_the_control_entry_is_hidden(source, remote, mount_cachefs):
    """The name always means the control entry: a client finds the daemon in any directory,
    and listings agree with lookups.  The remote's own file is not reachable through the
    mount, by the fast path neither."""
    make_files(source, 2, size=100)
    (source / "class0000" / ".cachefs.sock").write_bytes(b"a file of the remote")
    mount = mount_cachefs(remote.path)
    entry = mount.path / "class0000" / ".cachefs.sock"
    assert os.readlink(entry) == control_socket_path(mount.path)
    assert ".cachefs.sock" not in os.listdir(mount.path / "class0000")
    assert errno_of(lambda: read_file(entry)) == errno_of(lambda: open(entry, "rb").read()) \
        == errno.ENXIO


# -- the mapping of paths, without a mount ---------------------------------------------------

def mountinfo_line(number: int, root: str, mount_point: str, fstype: str) -> str:
    escape = lambda text: text.replace(" ", "\\040")  # noqa: E731
    return (f"{number} 1 0:{number} {escape(root)} {escape(mount_point)} rw,relatime "
            f"shared:{number} - {fstype} src rw\n")


@pytest.fixture
def mountinfo(tmp_path):
    """A mount table of our own: ``write(*lines)`` and its path."""
    path = tmp_path / "mountinfo"

    def write(*lines: str) -> str:
        path.write_text(mountinfo_line(1, "/", "/", "ext4") + "".join(lines))
        return str(path)

    return write


@pytest.mark.fast
def test_paths_map_to_the_daemons_relative_paths(tmp_path, mountinfo, monkeypatch):
    mnt, view = tmp_path / "mnt", tmp_path / "with space"
    for directory in (mnt / "a", view / "sub", tmp_path / "disk"):
        directory.mkdir(parents=True)
    (tmp_path / "link").symlink_to(mnt)
    (tmp_path / "disk" / "up").symlink_to(tmp_path)
    paths = PathMap(mountinfo(mountinfo_line(2, "/", str(mnt), "fuse.cachefs"),
                              mountinfo_line(3, "/c03", str(view), "fuse.cachefs"),
                              mountinfo_line(4, "/", str(mnt / "other"), "tmpfs")))
    assert paths.locate(str(mnt / "a/x.jpg")) == (str(mnt), "a/x.jpg")
    assert paths.locate(mnt / "x.jpg") == (str(mnt), "x.jpg")
    assert paths.locate(os.fsencode(mnt / "a/x.jpg")) == (str(mnt), "a/x.jpg")
    assert paths.locate(str(tmp_path / "link/a/x.jpg")) == (str(mnt), "a/x.jpg")
    assert paths.locate(str(tmp_path / "disk/up/mnt/a/x.jpg")) == (str(mnt), "a/x.jpg")
    assert paths.locate(str(view / "x.jpg")) == (str(view), "c03/x.jpg")
    assert paths.locate(str(view / "sub/x.jpg")) == (str(view), "c03/sub/x.jpg")
    assert paths.locate(str(mnt / "other/x.jpg")) is None  # another file system on top
    assert paths.locate(str(tmp_path / "x.jpg")) is None
    assert paths.locate("") is None
    monkeypatch.chdir(mnt / "a")
    assert paths.locate("x.jpg") == (str(mnt), "a/x.jpg")
    assert paths.locate("../b/x.jpg") == (str(mnt), "b/x.jpg")


@pytest.mark.fast
def test_a_directory_is_resolved_once(tmp_path, mountinfo, monkeypatch):
    (tmp_path / "mnt" / "a").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "mnt")
    paths = PathMap(mountinfo(mountinfo_line(2, "/", str(tmp_path / "mnt"), "fuse.cachefs")))
    resolved = []
    realpath = os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda p: resolved.append(p) or realpath(p))
    for i in range(100):
        assert paths.locate(f"{tmp_path}/link/a/{i}.jpg") == (str(tmp_path / "mnt"),
                                                              f"a/{i}.jpg")
    assert resolved == [f"{tmp_path}/link/a"]


@pytest.mark.fast
def test_a_mount_made_later_is_found(tmp_path, mountinfo, monkeypatch):
    monkeypatch.setattr(_paths, "MOUNT_TABLE_REFRESH_SECONDS", 0.0)
    table = mountinfo()
    paths = PathMap(table)
    assert paths.locate(str(tmp_path / "mnt/x.jpg")) is None
    mountinfo(mountinfo_line(2, "/", str(tmp_path / "mnt"), "fuse.cachefs"))
    assert paths.locate(str(tmp_path / "mnt/x.jpg")) == (str(tmp_path / "mnt"), "x.jpg")


@pytest.mark.fast
def test_an_unreadable_mount_table_is_named_in_the_warning(tmp_path):
    paths = PathMap(str(tmp_path / "no-mountinfo"))
    assert paths.locate(str(tmp_path / "x.jpg")) is None
    message = _daemon.not_on_mount_message(paths, tmp_path / "x.jpg")
    assert "no-mountinfo" not in message and "/proc/self/mountinfo" in message
    assert "No such file" in message


# -- finding the control socket, without a mount ----------------------------------------------

@pytest.fixture
def fake_mount(tmp_path):
    """A directory whose ``.cachefs.sock`` leads where no socket is, and a listening socket
    of that name in another directory (where a container would see the daemon's)."""
    mount, elsewhere = tmp_path / "mnt", tmp_path / "run-elsewhere"
    mount.mkdir()
    elsewhere.mkdir()
    (mount / ".cachefs.sock").symlink_to(tmp_path / "run-on-the-node" / "0123abcd.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(elsewhere / "0123abcd.sock"))
        listener.listen(4)
        yield mount, elsewhere


def unreachable_message(mount: Path) -> str:
    with pytest.raises(Unreachable) as caught:
        _control.connect(str(mount), 1.0)
    return str(caught.value)


@pytest.mark.fast
def test_the_runtime_dir_override_finds_the_socket(fake_mount, monkeypatch):
    mount, elsewhere = fake_mount
    monkeypatch.delenv(RUNTIME_DIR_ENV, raising=False)
    message = unreachable_message(mount)
    assert "is not visible here" in message and RUNTIME_DIR_ENV in message
    assert str(mount.parent / "run-on-the-node") in message
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(elsewhere))
    with _control.connect(str(mount), 1.0) as sock:
        assert sock.getpeername() == str(elsewhere / "0123abcd.sock")


@pytest.mark.fast
@pytest.mark.parametrize("value, says", [
    ("run/cachefs", "is not an absolute path"),
    ("/no/such/dir", "is not a directory here"),
    ("EMPTY_DIR", "no control socket 0123abcd.sock"),
])
def test_a_bad_runtime_dir_override_says_what_to_do(fake_mount, tmp_path, monkeypatch, value,
                                                    says):
    mount, _ = fake_mount
    if value == "EMPTY_DIR":
        value = str(tmp_path / "empty")
        os.mkdir(value)
    monkeypatch.setenv(RUNTIME_DIR_ENV, value)
    message = unreachable_message(mount)
    assert says in message and RUNTIME_DIR_ENV in message
    assert "runtime directory" in message


@pytest.mark.fast
def test_an_unreachable_daemon_is_one_warning_and_the_mount_reads(fake_mount, monkeypatch):
    """Hints and reads of the same mount in one process: one warning between them."""
    mount, _ = fake_mount
    (mount / "x.jpg").write_bytes(b"bytes")
    monkeypatch.delenv(RUNTIME_DIR_ENV, raising=False)
    monkeypatch.setattr(_daemon, "_state", None)
    monkeypatch.setattr(_daemon, "_warned", set())
    state = _daemon.process_state()
    state.paths = PathMap(_write_table(mount))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _daemon.send_hints([mount / "x.jpg"]) == 0
        assert read_file(mount / "x.jpg") == b"bytes"
    assert len(caught) == 1
    assert "training goes on without hints, reading through the mount" in str(caught[0].message)


def _write_table(mount: Path) -> str:
    path = mount.parent / "mountinfo"
    path.write_text(mountinfo_line(1, "/", "/", "ext4")
                    + mountinfo_line(2, "/", str(mount), "fuse.cachefs"))
    return str(path)


@pytest.mark.fast
def test_the_training_pod_example_sees_the_daemon_at_paths_of_its_own():
    """deploy/kubernetes: the pod mounts the dataset at another path than the node's, and
    the daemon's runtime directory where the client looks for it."""
    import tomllib

    import yaml

    deploy = REPO / "deploy" / "kubernetes"
    docs = [d for d in yaml.safe_load_all((deploy / "daemonset.yaml").read_text()) if d]
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["imagenet.toml"]
    settings = tomllib.loads(config)
    [pod] = [d for d in yaml.safe_load_all((deploy / "training-pod.yaml").read_text()) if d]
    [container] = pod["spec"]["containers"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"]}
    mounted = {host_paths[m["name"]]: m["mountPath"] for m in container["volumeMounts"]}
    dataset_dir = os.path.dirname(settings["mountpoint"])
    assert mounted[dataset_dir] != dataset_dir
    assert container["command"][-1].startswith(mounted[dataset_dir] + "/")
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    runtime_dir = mounted[settings["runtime_dir"]]
    assert runtime_dir == settings["runtime_dir"] or env[RUNTIME_DIR_ENV] == runtime_dir
