"""The control socket's server on a real Unix socket: a request whose handler fails is
answered with its error (or, for a hint, dropped) and the connection goes on; a socket
file removed is made again."""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time

import pytest

from cachefs.control.server import (
    FETCH_ANSWERS_HELD_SECONDS,
    PATH_CHECK_SECONDS,
    ControlServer,
    Reply,
)
from tests.conftest import control_socket_path, make_files, run_cachefs, wait_for


def fail_or_echo(peer, argument: bytes) -> Reply:
    if argument.startswith(b"bad"):
        raise OSError(errno.ENAMETOOLONG, "File name too long")
    return Reply({"ok": True, "echo": argument.decode()})


def failing_hint(peer, argument: bytes) -> None:
    raise RuntimeError("a hint that breaks")


@pytest.mark.timeout(30)
def test_a_failing_request_is_answered_and_the_connection_goes_on(tmp_path, caplog):
    server = ControlServer(tmp_path / "control.sock",
                           {b"ECHO": fail_or_echo, b"HINT": failing_hint})
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(str(server.path))
            conn.sendall(b"ECHO one\nECHO bad\nHINT x\nECHO bad again\nECHO two\n")
            reader = conn.makefile("rb")
            lines = [json.loads(reader.readline()) for _ in range(4)]
    finally:
        server.close()
    assert lines == [
        {"ok": True, "echo": "one"},
        {"ok": False, "error": "[Errno 36] File name too long"},
        {"ok": False, "error": "[Errno 36] File name too long"},
        {"ok": True, "echo": "two"},
    ]
    # One record for the connection's failures, not one per failed request.
    failures = [r for r in caplog.records if "control request" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]


@pytest.mark.timeout(60)
def test_answers_a_slow_fetch_or_a_read_before_the_next_fetch_runs(tmp_path):
    """A warm's FETCHes of a fast remote are answered a few at a time, but the answer to
    one that took long (a remote with latency), or to a read, is sent before the next FETCH
    runs: here that FETCH waits until the client has the answer before it."""
    answered = threading.Event()

    def fetch(peer, argument: bytes) -> Reply:
        if argument == b"slow":
            time.sleep(FETCH_ANSWERS_HELD_SECONDS * 10)
        elif argument == b"waits":
            released = answered.wait(10)
            answered.clear()
            return Reply({"ok": True, "released": released})
        return Reply({"ok": True, "fetched": argument.decode()})

    server = ControlServer(tmp_path / "control.sock", {b"FETCH": fetch, b"READ": fail_or_echo})
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(str(server.path))
            reader = conn.makefile("rb")
            answers = []
            for first in (b"FETCH slow", b"READ one"):
                conn.sendall(first + b"\nFETCH waits\n")
                answers.append(json.loads(reader.readline()))
                answered.set()
                answers.append(json.loads(reader.readline()))
            conn.sendall(b"FETCH a\nFETCH b\nFETCH c\n")
            answers += [json.loads(reader.readline()) for _ in range(3)]
    finally:
        server.close()
    assert answers == [
        {"ok": True, "fetched": "slow"}, {"ok": True, "released": True},
        {"ok": True, "echo": "one"}, {"ok": True, "released": True},
        {"ok": True, "fetched": "a"}, {"ok": True, "fetched": "b"},
        {"ok": True, "fetched": "c"},
    ]


@pytest.mark.timeout(30)
def test_a_socket_removed_is_made_again_and_a_successors_is_left_alone(tmp_path):
    path = tmp_path / "control.sock"
    first = ControlServer(path, {b"ECHO": fail_or_echo})
    try:
        path.unlink()  # a cleaner of aged files in /tmp, an operator's rm
        wait_for(lambda: _echo(path, b"back") == {"ok": True, "echo": "back"},
                 timeout=PATH_CHECK_SECONDS + 10, what="the socket made again")
        # A daemon taking the mount over binds the same path: the one before it neither
        # takes the path back nor removes it when it closes.
        second = ControlServer(path, {b"ECHO": lambda peer, arg: Reply({"ok": True})})
        try:
            time.sleep(PATH_CHECK_SECONDS + 1)
            first.close()
            assert _echo(path, b"x") == {"ok": True}
        finally:
            second.close()
    finally:
        first.close()
    assert not path.exists()
    assert not [p.name for p in tmp_path.iterdir()]  # no socket left beside it either


def _echo(path, argument: bytes) -> dict | None:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(5)
            conn.connect(str(path))
            conn.sendall(b"ECHO " + argument + b"\n")
            return json.loads(conn.makefile("rb").readline())
    except OSError:
        return None


@pytest.mark.timeout(120)
def test_a_mounts_control_socket_removed_is_made_again(source, remote, mount_cachefs):
    """`cachefs status` and the torch client find the daemon by the socket's path: when its
    file goes, it comes back, and the daemon answers again."""
    make_files(source, 3)
    mount = mount_cachefs(remote.path)
    os.unlink(control_socket_path(mount.path))
    assert run_cachefs("status", str(mount.path)).returncode != 0
    wait_for(lambda: run_cachefs("status", str(mount.path)).returncode == 0,
             timeout=PATH_CHECK_SECONDS + 20, what="status answered again")
    assert "made again" in mount.log_file.read_text()
