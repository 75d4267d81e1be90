"""systemd's file descriptor store: the mount's /dev/fuse descriptor kept by the service
manager, so that the mount outlives the supervisor itself (kill -9, the OOM killer, a crash of
the whole daemon) as the supervisor makes it outlive its serving child.

Under systemd (``NOTIFY_SOCKET`` set, ``FileDescriptorStoreMax=`` in the unit) the supervisor
gives the descriptor to systemd once the mount serves (``FDSTORE=1``) and takes it back when the
mount ends (``FDSTOREREMOVE=1``).  While systemd holds it the connection lives on with no
process serving it: readers wait.  systemd hands it to the next start of the unit
(``Restart=on-failure``) as ``LISTEN_FDS``; that start takes the mount over as the new daemon
of ``cachefs upgrade`` does: no INIT, the node and handle tables the dead one left, the
requests it had read sent again.

The entry is named ``fuse-<digest of the mount point>`` (the digest the control socket is named
by): several mounts of one unit cannot clash, and the name is a valid FDNAME (at most 255
printable ASCII characters, no ``:``).  What the FUSE handshake settled is not in the
descriptor; it is kept in a record beside the node and handle tables in the runtime directory
(``<digest>.fdstore``), not in the name: the name is the key that FDSTOREREMOVE must repeat,
it cannot hold JSON (``:``), and without the tables next to it the descriptor could not be
served anyway (the kernel's node ids would mean nothing).  The record also holds the mount's
device number, so that a descriptor is never taken for a later mount at the same path.

A descriptor that is not /dev/fuse, whose connection is gone, that has no record, or whose
mount is not the one at the mount point any more is closed and dropped from the store, in one
line of the log, and the mount is made afresh (a stale mount cleared as after any crash).

Outside systemd none of this happens: no record, no message.
"""

from __future__ import annotations

import json
import logging
import os
import select
import stat
from pathlib import Path

import xxhash

from cachefs.kernel import takeover
from cachefs.kernel.mountpoint import find_mount
from cachefs.kernel.session import Connection
from cachefs.service import sdnotify
from cachefs.service.upgrade import Handover

log = logging.getLogger(__name__)

LISTEN_FDS_START = 3  # SD_LISTEN_FDS_START
LISTEN_ENV = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
FUSE_DEVICE = (10, 229)  # /dev/fuse's major and minor, where /dev/fuse cannot be looked at
FROM_STORE = "fdstore"  # Handover.source, and status: serving.taken_over_from


def fd_name(mountpoint: str | os.PathLike) -> str:
    """The FDNAME of a mount point's descriptor."""
    return "fuse-" + xxhash.xxh64_hexdigest(os.fsencode(os.path.realpath(mountpoint)))


def record_path(table_base: Path) -> Path:
    """Where the record of a stored descriptor lives: beside the node table at ``table_base``."""
    return Path(f"{table_base}.fdstore")


class FdStore:
    """The mount's entry in systemd's store and its record, kept by the supervisor."""

    def __init__(self, mountpoint: str, record: Path) -> None:
        self.mountpoint = mountpoint
        self.name = fd_name(mountpoint)
        self.record = record
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self.kept = False
        self._fields: dict | None = None  # the record but the restarts, once the mount serves

    def keep(self, fd: int, connection: Connection, mounted_at: float, restarts: int) -> None:
        """Write what a successor needs, then give systemd the descriptor (once: it is the same
        connection for every serving child)."""
        if not self.enabled:
            return
        entry = find_mount(self.mountpoint)
        self._fields = {"fdname": self.name, "mountpoint": self.mountpoint,
                        "device": entry.device if entry is not None else "",
                        "connection": takeover.connection_text(connection),
                        "mounted_at": mounted_at, "supervisor_pid": os.getpid()}
        self.update(restarts)
        if not self.kept and sdnotify.notify(f"FDSTORE=1\nFDNAME={self.name}", (fd,)):
            log.info("systemd keeps the descriptor of %s (%s)", self.mountpoint, self.name)
        self.kept = True

    def update(self, restarts: int) -> None:
        """Rewrite the record with the restarts so far (a successor counts on from them)."""
        if not self.enabled or self._fields is None:
            return
        temporary = self.record.with_name(self.record.name + ".tmp")
        try:
            temporary.write_text(json.dumps({**self._fields, "restarts": restarts}))
            os.replace(temporary, self.record)
        except OSError as exc:  # the next start mounts afresh instead: said there, too
            log.warning("cannot write %s (%s): a restart of the unit will not find the mount",
                        self.record, exc.strerror)

    def drop(self) -> None:
        """The mount ended: systemd closes its copy, and the record goes."""
        if not self.enabled or not self.kept:
            return
        sdnotify.notify(f"FDSTOREREMOVE=1\nFDNAME={self.name}")
        self.kept = False
        try:
            self.record.unlink()
        except FileNotFoundError:
            pass


class _Unusable(Exception):
    """Why a stored descriptor cannot serve the mount."""


def adopt(mountpoint: str, record: Path) -> Handover | None:
    """The mount's descriptor systemd passed to this start (LISTEN_FDS), checked, as a mount
    handed over; None when systemd passed none, or one that cannot be used (closed, dropped
    from the store and said in one line).  LISTEN_* leave the environment either way."""
    name = fd_name(mountpoint)
    passed = _listened_fds()
    ours = passed.pop(name, [])
    for fd in ours[1:]:  # one connection per mount: a second entry of the name is a leftover
        os.close(fd)
    if not ours:
        return None
    fd = ours[0]
    try:
        fields = _check(fd, mountpoint, name, record)
        connection = takeover.connection_from_text(fields["connection"])
        handover = Handover(fd, connection, int(fields.get("restarts", 0)) + 1,
                            float(fields["mounted_at"]), int(fields.get("supervisor_pid", 0)),
                            None, FROM_STORE)
    except (_Unusable, KeyError, TypeError, ValueError) as exc:
        os.close(fd)
        reason = str(exc) if isinstance(exc, _Unusable) else f"its record {record} is unusable"
        log.warning("the descriptor systemd kept for %s cannot serve it (%s); mounting afresh",
                    mountpoint, reason)
        sdnotify.notify(f"FDSTOREREMOVE=1\nFDNAME={name}")
        try:
            record.unlink()
        except FileNotFoundError:
            pass
        return None
    return handover


def _listened_fds() -> dict[str, list[int]]:
    """The descriptors systemd passed, by name (sd_listen_fds_with_names), made close-on-exec;
    LISTEN_* are taken out of the environment, so that no child takes them for its own."""
    pid, count, names = (os.environ.pop(key, None) for key in LISTEN_ENV)
    if not (pid and count and pid.isdigit() and count.isdigit()) or int(pid) != os.getpid():
        return {}
    labels = names.split(":") if names else []
    passed: dict[str, list[int]] = {}
    for index in range(int(count)):
        fd = LISTEN_FDS_START + index
        try:
            os.set_inheritable(fd, False)
        except OSError:  # not open after all
            continue
        passed.setdefault(labels[index] if index < len(labels) else "unknown", []).append(fd)
    return passed


def _check(fd: int, mountpoint: str, name: str, record: Path) -> dict:
    """The record of ``fd`` when ``fd`` is the live connection of the mount at ``mountpoint``."""
    st = os.fstat(fd)
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != _fuse_rdev():
        raise _Unusable("it is not /dev/fuse")
    poller = select.poll()
    poller.register(fd, 0)  # errors only: POLLERR once the connection is aborted or unmounted
    if any(events & (select.POLLERR | select.POLLHUP | select.POLLNVAL)
           for _fd, events in poller.poll(0)):
        raise _Unusable("its connection is gone")
    try:
        fields = json.loads(record.read_text())
    except FileNotFoundError:
        raise _Unusable(f"no record of it in {record.parent}") from None
    except (OSError, ValueError) as exc:
        raise _Unusable(f"its record {record} is unreadable: {exc}") from None
    entry = find_mount(mountpoint)
    if entry is None or not entry.fstype.startswith("fuse"):
        raise _Unusable(f"{mountpoint} is not a FUSE mount any more")
    if fields.get("fdname") != name or fields.get("device") != entry.device:
        raise _Unusable(f"the mount at {mountpoint} is not the one it served")
    return fields


def _fuse_rdev() -> int:
    try:
        return os.stat("/dev/fuse").st_rdev
    except OSError:
        return os.makedev(*FUSE_DEVICE)
