"""The control socket's server on a real Unix socket: a request whose handler fails is
answered with its error (or, for a hint, dropped) and the connection goes on."""

from __future__ import annotations

import errno
import json
import socket

import pytest

from cachefs.control.server import ControlServer, Reply


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
