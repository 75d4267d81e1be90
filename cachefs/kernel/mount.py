"""Getting a /dev/fuse descriptor connected to a mount point, and letting go of it.

As root, the mount is made directly with mount(2) on a descriptor we open.  Anyone
else goes through the setuid ``fusermount3`` (or ``fusermount``), which mounts for us and
hands the descriptor back over a Unix socket named in ``_FUSE_COMMFD``; this is how
libfuse mounts for unprivileged users, and it enforces /etc/fuse.conf (``allow_other``
needs ``user_allow_other`` there).

A mount is always read-only, nosuid and nodev.
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2
FUSERMOUNT_TIMEOUT_SECONDS = 30.0


class MountFailed(OSError):
    """The kernel or fusermount refused the mount; the message says why."""


@dataclass(frozen=True)
class MountOptions:
    """What the kernel is told at mount time."""

    fsname: str
    subtype: str
    allow_other: bool = False
    # The kernel checks the mode bits the file system reports (the remote's), as for a
    # local file system; without it every user that may enter the mount may read anything.
    default_permissions: bool = True

    def kernel_text(self, fd: int) -> str:
        parts = [f"fd={fd}", "rootmode=40000", f"user_id={os.geteuid()}",
                 f"group_id={os.getegid()}"]
        parts += self._common()
        return ",".join(parts)

    def fusermount_text(self) -> str:
        names = [f"fsname={_escape(self.fsname)}", f"subtype={self.subtype}", "ro", "nosuid",
                 "nodev"]
        return ",".join(names + self._common())

    def _common(self) -> list[str]:
        return [name for name, on in (("default_permissions", self.default_permissions),
                                      ("allow_other", self.allow_other)) if on]


def _escape(text: str) -> str:
    # Commas separate options; fusermount takes a backslash before one as part of the value.
    return text.replace("\\", "\\\\").replace(",", "\\,")


def mount(mountpoint: str, options: MountOptions) -> int:
    """Mount and return the /dev/fuse descriptor that serves it (close-on-exec)."""
    if os.geteuid() == 0:
        return _mount_directly(mountpoint, options)
    return _mount_with_fusermount(mountpoint, options)


def _mount_directly(mountpoint: str, options: MountOptions) -> int:
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        result = _libc.mount(os.fsencode(options.fsname), os.fsencode(mountpoint),
                             f"fuse.{options.subtype}".encode(),
                             MS_RDONLY | MS_NOSUID | MS_NODEV,
                             options.kernel_text(fd).encode())
        if result != 0:
            code = ctypes.get_errno()
            raise MountFailed(code, f"mount: {os.strerror(code)}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def fusermount_command() -> str | None:
    return shutil.which("fusermount3") or shutil.which("fusermount")


def _mount_with_fusermount(mountpoint: str, options: MountOptions) -> int:
    tool = fusermount_command()
    if tool is None:
        raise MountFailed(errno.ENOENT, "mounting as a user needs fusermount3 or fusermount "
                                        "(Debian: apt-get install fuse3)")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        result = subprocess.run([tool, "-o", options.fusermount_text(), "--", mountpoint],
                                env=env, pass_fds=(theirs.fileno(),), capture_output=True,
                                text=True, timeout=FUSERMOUNT_TIMEOUT_SECONDS)
        theirs.close()
        if result.returncode != 0:
            lines = result.stderr.strip().splitlines()
            raise MountFailed(errno.EPERM, lines[-1] if lines else f"{tool} failed")
        fds = array.array("i")
        _message, ancillary, _flags, _addr = ours.recvmsg(1, socket.CMSG_SPACE(fds.itemsize))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        if not fds:
            raise MountFailed(errno.EIO, f"{tool} mounted but sent no descriptor")
        os.set_inheritable(fds[0], False)
        return fds[0]
    finally:
        theirs.close()
        ours.close()


def unmount(mountpoint: str) -> None:
    """Detach the mount (lazily: files still open keep it until they close), as libfuse does
    when its session ends.  Quiet when it is already gone."""
    if os.geteuid() == 0:
        if _libc.umount2(os.fsencode(mountpoint), MNT_DETACH) != 0:
            code = ctypes.get_errno()
            if code not in (errno.EINVAL, errno.ENOENT):  # not mounted (any more)
                raise OSError(code, f"umount {mountpoint}: {os.strerror(code)}")
        return
    tool = fusermount_command()
    if tool is not None:
        subprocess.run([tool, "-u", "-z", "-q", "--", mountpoint], capture_output=True,
                       timeout=FUSERMOUNT_TIMEOUT_SECONDS)
