"""A minimal file system on cachefs's FUSE session, for testing the session alone.

    python -m tests.helpers.flatfs SOURCE MOUNTPOINT [--no-passthrough]

Serves the regular files directly inside SOURCE, read-only, at MOUNTPOINT.  Opens are
answered with a passthrough backing file when the session has passthrough, else reads are
served from a descriptor.  ``.stats`` (not listed) holds JSON counters: the READ requests
that reached this process for real files, and whether passthrough is on.  Prints "serving"
once mounted; SIGTERM or SIGINT unmounts.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import sys
import threading

from cachefs.kernel import protocol as p
from cachefs.kernel.mount import MountOptions
from cachefs.kernel.session import Filesystem, Session

STATS = b".stats"
STATS_ID = 2
TIMEOUT = 1.0


class FlatFS(Filesystem):
    def __init__(self, source: str) -> None:
        self.source = source
        self.names = sorted(os.fsencode(n) for n in os.listdir(source)
                            if os.path.isfile(os.path.join(source, n)))
        self.ids = {name: i for i, name in enumerate(self.names, start=3)}
        self.reads = 0
        self.passthrough = False
        self.backing: dict[int, int] = {}
        self.lock = threading.Lock()

    def init(self, session: Session, connection) -> None:
        self.session = session
        self.passthrough = connection.passthrough
        print("serving", flush=True)

    def _path(self, nodeid: int) -> bytes:
        return os.path.join(os.fsencode(self.source), self.names[nodeid - 3])

    def _stats(self) -> bytes:
        return json.dumps({"reads": self.reads, "passthrough": self.passthrough}).encode()

    def _attr(self, nodeid: int) -> bytes:
        if nodeid == p.ROOT_ID:
            return p.attr(1, stat.S_IFDIR | 0o755, 0, 0, 0, 2, 0, 0, 0)
        if nodeid == STATS_ID:
            return p.attr(2, stat.S_IFREG | 0o444, 4096, 0, 0, 1, 0, 0, 0)
        st = os.stat(self._path(nodeid))
        return p.attr(nodeid, stat.S_IFREG | (st.st_mode & 0o777), st.st_size, st.st_uid,
                      st.st_gid, 1, st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns)

    def lookup(self, req, parent, name):
        nodeid = STATS_ID if name == STATS else self.ids.get(name)
        if parent != p.ROOT_ID or nodeid is None:
            raise FileNotFoundError(errno.ENOENT, "no such file")
        return p.entry_out(nodeid, 0, TIMEOUT, TIMEOUT, self._attr(nodeid))

    def getattr(self, req, nodeid, fh):
        return p.attr_out(TIMEOUT, self._attr(nodeid))

    def open(self, req, nodeid, flags):
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise OSError(errno.EROFS, "read-only")
        if nodeid == STATS_ID:
            return p.open_out(0, p.FOPEN_DIRECT_IO)
        if self.passthrough:
            with self.lock:
                backing = self.backing.get(nodeid)
                if backing is None:
                    fd = os.open(self._path(nodeid), os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        backing = self.backing[nodeid] = self.session.backing_open(fd)
                    finally:
                        os.close(fd)
            return p.open_out(0, p.FOPEN_PASSTHROUGH, backing)
        return p.open_out(os.open(self._path(nodeid), os.O_RDONLY | os.O_CLOEXEC), 0)

    def read(self, req, nodeid, fh, offset, size):
        if nodeid == STATS_ID:
            return self._stats()[offset:offset + size]
        with self.lock:
            self.reads += 1
        return os.pread(fh, size, offset)

    def release(self, req, nodeid, fh):
        if fh:
            os.close(fh)

    def readdir(self, req, nodeid, fh, offset, size, plus):
        out = b""
        for index in range(offset, len(self.names)):
            entry = p.dirent(index + 3, index + 1, stat.S_IFREG, self.names[index])
            if len(out) + len(entry) > size:
                break
            out += entry
        return out

    def opendir(self, req, nodeid, flags):
        return p.open_out(0, 0)

    def statfs(self, req, nodeid):
        return p.statfs_out(os.statvfs(self.source))


def main() -> int:
    source, mountpoint = sys.argv[1], sys.argv[2]
    session = Session(FlatFS(source), want_passthrough="--no-passthrough" not in sys.argv)
    session.mount(mountpoint, MountOptions(fsname="flatfs", subtype="flatfs"))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: session.unmount())
    session.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
