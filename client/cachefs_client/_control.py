"""Connecting to the control socket of the daemon behind a mount, from any mount namespace.

Every directory of a cachefs mount answers the hidden symlink ``.cachefs.sock`` (never
listed), whose target is the daemon's Unix socket: ``/run/cachefs/<hash>.sock`` when the
daemon runs as root (its ``runtime_dir``).  So the mount point a process sees, whatever
subdirectory of the mount it shows, leads to the socket's name.  In a container the target's
directory may not exist: the container must see the daemon's runtime directory, either at
the same path (mount the host's /run/cachefs at /run/cachefs) or anywhere, named by
RUNTIME_DIR_ENV; the socket's file name is taken from the symlink either way, so several
mounts in one directory never get mixed up.

Failures raise :class:`Unreachable` with one line that says what failed and what to do.
"""

from __future__ import annotations

import errno
import os
import socket

CONTROL_NAME = ".cachefs.sock"
RUNTIME_DIR_ENV = "CACHEFS_RUNTIME_DIR"


class Unreachable(Exception):
    """The daemon's control socket cannot be reached; the message says why and what to do."""


def runtime_dir_override() -> tuple[str | None, str | None]:
    """(the directory RUNTIME_DIR_ENV names, None) when set and usable; (None, why not)
    when set but unusable; (None, None) when unset."""
    value = os.environ.get(RUNTIME_DIR_ENV)
    if not value:
        return None, None
    if not value.startswith("/"):
        return None, f"{RUNTIME_DIR_ENV}={value!r} is not an absolute path"
    if not os.path.isdir(value):
        return None, f"{RUNTIME_DIR_ENV}={value!r} is not a directory here"
    return value, None


def socket_path(mount_point: str) -> tuple[str, str]:
    """(the control socket of the daemon serving ``mount_point`` as this process reaches
    it, where the daemon itself put it)."""
    entry = os.path.join(mount_point, CONTROL_NAME)
    try:
        target = os.readlink(entry)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise Unreachable(f"the daemon of {mount_point} is gone (stale mount); remount it"
                              ) from None
        raise Unreachable(f"cannot read {entry} ({exc.strerror}): the daemon of "
                          f"{mount_point} is older than this client or not a cachefs daemon; "
                          "upgrade it") from None
    directory, bad = runtime_dir_override()
    if bad is not None:
        raise Unreachable(f"{bad}; set it to where the daemon's runtime directory "
                          f"({os.path.dirname(target)} where the daemon runs) is mounted, "
                          "or unset it")
    if directory is not None:
        return os.path.join(directory, os.path.basename(target)), target
    return target, target


def connect(mount_point: str, timeout: float) -> socket.socket:
    """A connected control socket of the daemon serving ``mount_point``; Unreachable if not."""
    path, target = socket_path(mount_point)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    except OSError as exc:  # out of descriptors, say
        raise Unreachable(f"cannot make a socket for the daemon of {mount_point} "
                          f"({exc.strerror})") from None
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise Unreachable(_why_not(mount_point, path, target, exc)) from None
    return sock


def _why_not(mount_point: str, path: str, target: str, exc: OSError) -> str:
    host_dir = os.path.dirname(target)
    if exc.errno == errno.ENOENT:
        if path != target:
            return (f"no control socket {os.path.basename(path)} of the mount at "
                    f"{mount_point} in {RUNTIME_DIR_ENV}={os.path.dirname(path)}; set it to "
                    f"where the daemon's runtime directory ({host_dir} where the daemon "
                    "runs) is mounted")
        return (f"the control socket {path} of the mount at {mount_point} is not visible here "
                f"(another mount namespace: a container?); mount the daemon's {host_dir} at "
                f"{host_dir}, or anywhere and set {RUNTIME_DIR_ENV} to it")
    if exc.errno == errno.ECONNREFUSED:
        return (f"the daemon of {mount_point} does not answer on {path} (gone, or restarting); "
                "check that it runs")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"may not connect to {path}, the control socket of {mount_point} "
                f"({exc.strerror}); make it reachable by this user")
    return f"cannot connect to {path}, the control socket of {mount_point} ({exc.strerror})"
