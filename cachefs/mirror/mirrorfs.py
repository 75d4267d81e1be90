"""The mirror as the kernel sees it: node ids for paths, replies for requests, errnos.

A thin adapter over :class:`cachefs.mirror.tree.CachedTree`; it holds no cache logic.  It turns
the kernel's node ids into paths relative to BACKING, the tree's answers into reply bodies,
and every exception into an errno through the one table in errors.py (anything unexpected
is logged with a traceback by the session and answered EIO).

Nodes.  A directory or symlink has one node per path.  A regular file has one node per
path *and version* (size, mtime): a file changed on the remote gets a new node, so the
kernel never mixes the pages, or the backing file, of two versions.  An open of an old
version's node once the change is known is answered ESTALE, on which the kernel looks the
name up again and retries the open (once) on the new node.  Entries and attributes are
cached by the kernel for as long as the daemon's own attributes stay within
``--revalidate``, so no byte older than the interval is served.

Opens.  Each open asks the tree where the file's bytes are (:meth:`CachedTree.locate`).
With kernel passthrough, a local file (the cache's own file, or a memory file) is
registered as a backing file and named in the reply: the kernel reads it, no READ comes
here.  The cache's files stay registered across opens (``HeldFiles``: the id and the
descriptor, bounded in number), so an open of a cached file costs one OPEN and one
RELEASE round trip.  Without passthrough the same local file is read here with pread, and
the kernel keeps the pages of a node from one open to the next (a node is one version).
A file with no single local file (a large file not wholly cached) is read here chunk by
chunk.

The kernel allows one backing file per node while any passthrough open of it lasts, and
no passthrough open while the node has opens served here with its page cache; ``Node``
tracks both, and an open that cannot use passthrough is served here instead.

Lock order: ``MirrorFS._lock`` (nodes, handles, held files) is a leaf: never held across
a call into the tree, the store or the kernel.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import resource
import stat
import threading
import time
from dataclasses import dataclass

from cachefs.attr import Attr
from cachefs.errors import errno_for
from cachefs.kernel import protocol as p
from cachefs.kernel.session import Connection, Request, Session
from cachefs.mirror.tree import CachedTree, Located, is_control_entry

log = logging.getLogger(__name__)

# Open flags that would write: the mirror is read-only (the mount is "ro" too).
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND
DEFAULT_MAX_HELD = 32768


class Node:
    """What a node id stands for.  Fields other than the first three change under
    ``MirrorFS._lock`` only."""

    __slots__ = ("nodeid", "relpath", "attr", "packed", "lookups", "backing", "passthrough",
                 "served")

    def __init__(self, nodeid: int, relpath: str, attr: Attr) -> None:
        self.nodeid = nodeid
        self.relpath = relpath
        self.attr = attr
        self.packed = _pack(nodeid, attr)
        self.lookups = 0
        self.backing: Backing | None = None  # the backing file of the passthrough opens now
        self.passthrough = 0  # passthrough opens now
        self.served = 0       # opens served here with the page cache now


@dataclass(eq=False)
class Backing:
    """A local file registered with the kernel (``backing_id``; 0 without passthrough) and
    our descriptor of it.  ``held``: a cache file kept across opens (in ``HeldFiles``);
    otherwise it belongs to the opens using it and goes with the last."""

    fd: int
    backing_id: int
    held: bool
    reopened_as: tuple[str, str]  # (result, source) counted for another open sharing it
    opens: int = 0
    evicted: bool = False
    readable: bool = True  # False: the remote's file named by path only (O_PATH)

    @classmethod
    def of(cls, fd: int, backing_id: int, located: Located) -> Backing:
        if located.kind == "cache":  # whatever brought it (a miss, a prefetch), now a hit
            return cls(fd, backing_id, True, ("hit", "cache"))
        return cls(fd, backing_id, False, (located.result, located.source),
                   readable=located.readable)


@dataclass(eq=False)
class Handle:
    """One open file: its node, and either a backing (passthrough, or pread here from its
    descriptor) or a tree handle read chunk by chunk."""

    node: Node
    backing: Backing | None
    passthrough: bool
    tree_handle: int = 0


class HeldFiles:
    """Cache files kept open (and registered) across opens, by (path, version), the least
    recently opened first out.  Thread safety: the caller holds ``MirrorFS._lock``."""

    def __init__(self, max_files: int) -> None:
        self.max_files = max_files
        self._files: collections.OrderedDict[tuple[str, object], Backing] = \
            collections.OrderedDict()

    def get_locked(self, key) -> Backing | None:
        backing = self._files.get(key)
        if backing is not None:
            self._files.move_to_end(key)
        return backing

    def put_locked(self, key, backing: Backing) -> list[Backing]:
        """Keep ``backing``; the ones pushed out (the caller closes those no open uses)."""
        old = self._files.pop(key, None)
        self._files[key] = backing
        out = [old] if old is not None else []
        while len(self._files) > self.max_files:
            out.append(self._files.popitem(last=False)[1])
        for gone in out:
            gone.evicted = True
        return out

    def drop_locked(self, key) -> Backing | None:
        backing = self._files.pop(key, None)
        if backing is not None:
            backing.evicted = True
        return backing

    def __len__(self) -> int:
        return len(self._files)


def _pack(nodeid: int, a: Attr) -> bytes:
    return p.attr(nodeid, a.mode, a.size, a.uid, a.gid, a.nlink, a.atime_ns, a.mtime_ns,
                  a.ctime_ns)


def _default_max_held() -> int:
    # Each held file is a descriptor of ours: stay well inside the limit on them.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    limit = hard if hard != resource.RLIM_INFINITY else 1 << 20
    return max(64, min(DEFAULT_MAX_HELD, limit // 4))


class MirrorFS:
    """The FUSE requests of one cachefs mount.

    Thread safety: ``_lock`` guards the node table, ``_handles``, ``_held`` and the
    counters of every Node and Backing; everything else is the tree's.
    """

    def __init__(self, tree: CachedTree, *, on_mounted, metrics,
                 max_held: int | None = None) -> None:
        self.tree = tree
        self._on_mounted = on_mounted
        self._open_seconds = metrics.open_seconds
        self._served_reads = metrics.served_reads
        self.session: Session | None = None
        self.passthrough = False
        self._lock = threading.Lock()
        root = Node(p.ROOT_ID, "", tree.getattr(""))
        root.lookups = 1
        self._nodes: dict[int, Node] = {p.ROOT_ID: root}
        self._by_path: dict[str, Node] = {"": root}
        self._ids = itertools.count(p.ROOT_ID + 1)
        self._handles: dict[int, Handle] = {}
        self._fhs = itertools.count(1)
        self._dirs: dict[int, list[tuple[bytes, int]]] = {}
        self._held = HeldFiles(max_held or _default_max_held())

    # -- the session's calls -------------------------------------------------------------

    def init(self, session: Session, connection: Connection) -> None:
        self.session = session
        self.passthrough = connection.passthrough
        self._on_mounted(connection)

    def errno_for(self, exc: BaseException) -> int | None:
        return errno_for(exc)

    @property
    def open_files(self) -> int:
        return len(self._handles)

    @property
    def held_files(self) -> int:
        return len(self._held)

    def _node(self, nodeid: int) -> Node:
        node = self._nodes.get(nodeid)
        if node is None:  # forgotten: the kernel should not ask; it looks the name up again
            raise OSError(errno.ESTALE, "unknown node")
        return node

    def _timeout(self, relpath: str) -> float:
        return self.tree.attrs.fresh_for(relpath)

    # -- names ----------------------------------------------------------------------------

    def lookup(self, req: Request, parent: int, name: bytes) -> bytes:
        directory = self._node(parent)
        text = os.fsdecode(name)
        relpath = f"{directory.relpath}/{text}" if directory.relpath else text
        attr = self.tree.getattr(relpath)
        node = self._remember(relpath, attr)
        timeout = 0.0 if is_control_entry(relpath) else self._timeout(relpath)
        return p.entry_out(node.nodeid, 0, timeout, timeout, node.packed)

    def _remember(self, relpath: str, attr: Attr) -> Node:
        """The node for ``relpath`` at ``attr``, counted as one more lookup by the kernel."""
        with self._lock:
            node = self._by_path.get(relpath)
            same_kind = node is not None and stat.S_IFMT(node.attr.mode) == stat.S_IFMT(
                attr.mode)
            if not same_kind or (attr.is_file and node.attr.version != attr.version):
                node = Node(next(self._ids), relpath, attr)
                self._nodes[node.nodeid] = node
                self._by_path[relpath] = node
            elif node.attr is not attr:
                node.attr, node.packed = attr, _pack(node.nodeid, attr)
            node.lookups += 1
            return node

    def forget(self, nodeid: int, nlookup: int) -> None:
        with self._lock:
            node = self._nodes.get(nodeid)
            if node is None or nodeid == p.ROOT_ID:
                return
            node.lookups -= nlookup
            if node.lookups <= 0:
                del self._nodes[nodeid]
                if self._by_path.get(node.relpath) is node:
                    del self._by_path[node.relpath]

    def getattr(self, req: Request, nodeid: int, fh: int | None) -> bytes:
        node = self._node(nodeid)
        if fh is not None and node.attr.is_file:
            return p.attr_out(0, node.packed)  # fstat: the version that is open
        attr = self.tree.getattr(node.relpath)
        if node.attr.is_file and (not attr.is_file or attr.version != node.attr.version):
            # Changed on the remote: this node keeps its version; the next lookup of the
            # name finds the new one.
            return p.attr_out(0, node.packed)
        if attr is not node.attr:
            with self._lock:
                node.attr, node.packed = attr, _pack(nodeid, attr)
        return p.attr_out(self._timeout(node.relpath), node.packed)

    def readlink(self, req: Request, nodeid: int) -> bytes:
        return os.fsencode(self.tree.readlink(self._node(nodeid).relpath))

    def statfs(self, req: Request, nodeid: int) -> bytes:
        return p.statfs_out(self.tree.remote.statvfs())

    # -- directories ------------------------------------------------------------------------

    def opendir(self, req: Request, nodeid: int, flags: int) -> bytes:
        node = self._node(nodeid)
        entries = [(os.fsencode(name), mode) for name, mode in
                   self.tree.listdir(node.relpath)]
        fh = next(self._fhs)
        with self._lock:
            self._dirs[fh] = entries
        return p.open_out(fh, 0)

    def readdir(self, req: Request, nodeid: int, fh: int, offset: int, size: int,
                plus: bool) -> bytes:
        entries = self._dirs.get(fh)
        if entries is None:
            raise OSError(errno.EBADF, "directory not open")
        out = []
        used = 0
        for index in range(offset, len(entries)):
            name, mode = entries[index]
            # The inode number of an entry comes with its lookup; readdir's is a placeholder.
            record = p.dirent(0xFFFF_FFFF, index + 1, mode, name)
            if used + len(record) > size:
                break
            out.append(record)
            used += len(record)
        return b"".join(out)

    def releasedir(self, req: Request, nodeid: int, fh: int) -> None:
        with self._lock:
            self._dirs.pop(fh, None)

    # -- files -------------------------------------------------------------------------------

    def open(self, req: Request, nodeid: int, flags: int) -> bytes:
        if flags & _WRITING:
            raise OSError(errno.EROFS, "read-only mirror")
        node = self._node(nodeid)
        if not node.attr.is_file:
            raise OSError(errno.EISDIR if node.attr.is_dir else errno.EACCES, node.relpath)
        started = time.perf_counter()
        attr = self.tree.attrs.get(node.relpath)
        if not attr.is_file or not attr.same_version(node.attr):
            # The kernel looks the name up again (finding the new version) and retries.
            raise OSError(errno.ESTALE, f"{node.relpath} changed on the remote")
        reply = self._open_passthrough(node, attr) if self.passthrough \
            else self._open_served(node, attr)
        self._open_seconds.observe(time.perf_counter() - started)
        return reply

    def _open_passthrough(self, node: Node, attr: Attr) -> bytes:
        held_key = (node.relpath, attr.version)
        with self._lock:
            live = node.backing
            held = self._held.get_locked(held_key)
        if live is not None:
            # Passthrough opens of this node are live: the kernel insists on their backing.
            self.tree.count_open(*live.reopened_as, attr.size)
            return self._reply_passthrough(node, live)
        located = self.tree.locate(node.relpath, attr, held=held is not None)
        backing = self._backing_for(node, located, held)
        if backing is None:
            return self._serve(node, located)
        return self._reply_passthrough(node, backing)

    def _backing_for(self, node: Node, located: Located, held: Backing | None
                     ) -> Backing | None:
        """The backing file for ``located``; None when it has no single local file."""
        if located.kind == "held":
            return held
        if located.kind == "chunks":
            return None
        fd = located.fd
        try:
            backing_id = self.session.backing_open(fd)
        except OSError:
            os.close(fd)
            raise
        backing = Backing.of(fd, backing_id, located)
        if backing.held:
            with self._lock:
                out = self._held.put_locked((node.relpath, node.attr.version), backing)
                out = [b for b in out if b.opens == 0]
            for gone in out:
                self._close_backing(gone)
        return backing

    def _reply_passthrough(self, node: Node, backing: Backing) -> bytes:
        closing = None
        with self._lock:
            passthrough = not node.served
            if not passthrough and not backing.readable:
                # Opens served here hold the node's pages, and this file cannot be read here:
                # read through the tree instead, as they are (a race, rare).
                if backing.opens == 0:
                    closing = backing
                backing = None
            elif not passthrough:
                # Opens served here hold the node's page cache: the kernel refuses a
                # passthrough open beside them, so this one is served here too.
                node.served += 1
            else:
                if node.backing is not None and node.backing is not backing:
                    # Another open of this node won the race: the kernel insists on its file.
                    if not backing.held and backing.opens == 0:
                        closing = backing
                    backing = node.backing
                node.backing = backing
                node.passthrough += 1
            if backing is not None:
                backing.opens += 1
                fh = next(self._fhs)
                self._handles[fh] = Handle(node, backing, passthrough)
        if closing is not None:
            self._close_backing(closing)
        if backing is None:
            return self._serve(node, self.tree.read_through(node.relpath, node.attr))
        if passthrough:
            return p.open_out(fh, p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH, backing.backing_id)
        return p.open_out(fh, p.FOPEN_KEEP_CACHE | p.FOPEN_NOFLUSH)

    def _open_served(self, node: Node, attr: Attr) -> bytes:
        """Without passthrough: the local file is read here (pread), the kernel keeps the
        node's pages across opens."""
        held_key = (node.relpath, attr.version)
        with self._lock:
            held = self._held.get_locked(held_key)
        located = self.tree.locate(node.relpath, attr, held=held is not None)
        if located.kind == "held":
            backing = held
        elif located.kind == "chunks":
            return self._serve(node, located)
        else:
            backing = Backing.of(located.fd, 0, located)
            if backing.held:
                with self._lock:
                    out = [b for b in self._held.put_locked(held_key, backing) if b.opens == 0]
                for gone in out:
                    self._close_backing(gone)
        with self._lock:
            backing.opens += 1
            node.served += 1
            fh = next(self._fhs)
            self._handles[fh] = Handle(node, backing, False)
        return p.open_out(fh, p.FOPEN_KEEP_CACHE | p.FOPEN_NOFLUSH)

    def _serve(self, node: Node, located: Located) -> bytes:
        """An open read chunk by chunk through the tree."""
        tree_handle = self.tree.register(located.handle)
        with self._lock:
            node.served += 1
            fh = next(self._fhs)
            self._handles[fh] = Handle(node, None, False, tree_handle)
        return p.open_out(fh, p.FOPEN_KEEP_CACHE | p.FOPEN_NOFLUSH)

    def read(self, req: Request, nodeid: int, fh: int, offset: int, size: int):
        handle = self._handles.get(fh)
        if handle is None:
            raise OSError(errno.EBADF, "file not open")
        self._served_reads.inc()
        if handle.backing is not None:
            return os.pread(handle.backing.fd, size, offset)
        return self.tree.read(handle.tree_handle, size, offset)

    def release(self, req: Request | None, nodeid: int, fh: int) -> None:
        with self._lock:
            handle = self._handles.pop(fh, None)
            if handle is None:
                return
            node, backing = handle.node, handle.backing
            if handle.passthrough:
                node.passthrough -= 1
                if not node.passthrough:
                    node.backing = None
            elif backing is not None or handle.tree_handle:
                node.served -= 1
            closing = None
            if backing is not None:
                backing.opens -= 1
                if backing.opens == 0 and (not backing.held or backing.evicted):
                    closing = backing
        if closing is not None:
            self._close_backing(closing)
        if handle.tree_handle:
            self.tree.release(handle.tree_handle)

    def _close_backing(self, backing: Backing) -> None:
        if backing.backing_id:
            self.session.backing_close(backing.backing_id)
        os.close(backing.fd)

    def drop_held(self, relpath: str, version) -> None:
        """Stop handing over a held cache file (it changed or was dropped)."""
        with self._lock:
            backing = self._held.drop_locked((relpath, version))
            closing = backing if backing is not None and backing.opens == 0 else None
        if closing is not None:
            self._close_backing(closing)
