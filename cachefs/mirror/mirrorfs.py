"""The mirror as the kernel sees it: node ids for paths, replies for requests, errnos.

A thin adapter over :class:`cachefs.mirror.tree.CachedTree`; it holds no cache logic.  It turns
the kernel's node ids into paths relative to BACKING, the tree's answers into reply bodies,
and every exception into an errno through the one table in errors.py (anything unexpected
is logged with a traceback by the session and answered EIO).

Nodes (nodes.py: a compact table in memory a successor can read).  A directory or symlink has
one node per path.  A regular file has one node per path *and version* (size, mtime): a file
changed on the remote gets a new node, so the kernel never mixes the pages, or the backing
file, of two versions.  An open of an old version's node once the change is known is
answered ESTALE, on which the kernel looks the name up again and retries the open (once) on
the new node.  Entries and attributes are cached by the kernel for as long as the daemon's
own attributes stay within ``--revalidate``, so no byte older than the interval is served.
A node's path is its parent's and its name; the paths of directories are remembered.

Opens.  Each open asks the tree where the file's bytes are (:meth:`CachedTree.locate`).
With kernel passthrough, a local file (the cache's own file, or a memory file) is
registered as a backing file and named in the reply: the kernel reads it, no READ comes
here.  The cache's files stay registered across opens (``HeldFiles``), so an open of a
cached file costs one OPEN and one RELEASE round trip.  Once registered, a file is the
kernel's to hold (it keeps its own reference): no descriptor of ours stays open for it, and
what bounds how many are held is the memory they cost the kernel (``max_held``), not our
limit of descriptors.  Without passthrough the same local file is read here with pread, and
the kernel keeps the pages of a node from one open to the next (a node is one version).
A file with no single local file (a large file not wholly cached) is read here chunk by
chunk.

The kernel allows one backing file per node while any passthrough open of it lasts, and
no passthrough open while the node has opens served here with its page cache; ``Opened``
tracks both for the nodes with open files, and an open that cannot use passthrough is served
here instead.  An open reads those counts and counts itself under one hold of the lock: in
between, the last RELEASE of a backing file may close it, or an open served here begin, and
the kernel answers an open that breaks either rule with EIO.  An open whose held file another
open of the same file pushed out (and closed) meanwhile reads through the tree instead.

Restarts (kernel/takeover.py).  A file handle is a slot of the handle table (handles.py), in a
mapped file beside the node table: a process taking the mount over adopts the open files
from it (:meth:`MirrorFS.init`), so that a READ of a handle served here is served (the file
opened again at the first one), the RELEASE of the last passthrough open of a backing file
closes it, and a new open of a node with passthrough opens names their backing file.  The
cache files the predecessor kept registered are closed.  A directory handle is not recorded: a
READDIR of one the process does not know lists the directory again.

Lock order: ``MirrorFS._lock`` (open nodes, handles and their table, held files, directory
paths), then the node table's, a leaf: taken under ``MirrorFS._lock`` where a directory's
path is remembered or a FORGET frees a node, never the other way round.  Neither is held
across a call into the tree, the store or the kernel.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

from cachefs.attr import Attr, Version
from cachefs.errors import errno_for
from cachefs.kernel import protocol as p
from cachefs.kernel.session import Connection, Request, Session
from cachefs.mirror import handles as h
from cachefs.mirror.held import HeldFiles
from cachefs.mirror.nodes import ROOT_ID, NodeInfo, NodeTable
from cachefs.mirror.tree import CachedTree, Located

log = logging.getLogger(__name__)

# Open flags that would write: the mirror is read-only (the mount is "ro" too).
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND
# Cache files kept registered with the kernel across opens, with passthrough, unless told:
# each costs the kernel an open file of its own and keeps the cache file's dentry and inode
# from reclaim (about 1.5 KiB), so 65,536 cost it some 100 MiB.  The service sizes the bound
# from the memory it may use, this at least (service/memory.py).
DEFAULT_MAX_HELD = 65536
# Without passthrough each held file is a descriptor of ours: a share of our limit on them.
MAX_HELD_DESCRIPTORS = 32768
# Directory paths remembered (a directory's path is asked for every name looked up in it).
MAX_DIR_PATHS = 65536


class Node(NamedTuple):
    """What a node id stands for now: its path (relative to BACKING) and attributes."""

    nodeid: int
    relpath: str
    attr: Attr


class Opened:
    """A node with files open: the kernel's rules for backing files, counted.  Changes under
    ``MirrorFS._lock`` only."""

    __slots__ = ("node", "backing", "passthrough", "served")

    def __init__(self, node: Node) -> None:
        self.node = node
        self.backing: Backing | None = None  # the backing file of the passthrough opens now
        self.passthrough = 0  # passthrough opens now
        self.served = 0       # opens served here with the page cache now

    @property
    def idle(self) -> bool:
        return not self.passthrough and not self.served


@dataclass(eq=False, slots=True)
class Listing:
    """The kernel's cached listing of a directory: the directory's version (mtime, ctime)
    it was read at, when it was read, and whether walks of it stat its names (``ls -l``:
    the kernel looked files up in it or asked for their attributes past the first page),
    carried over to the next listing.  Changes under ``MirrorFS._lock`` only, but for
    ``stats_names``, a hint (``MirrorFS._names_stated``)."""

    version: tuple[int, int]
    listed_at: float
    stats_names: bool = False


_HIT = ("hit", "cache")


@dataclass(eq=False, slots=True)
class Backing:
    """A local file registered with the kernel (``backing_id``; 0 without passthrough) and
    our descriptor of it (-1 once the kernel holds it alone), while opens use it.  ``held``:
    a cache file kept across opens (in ``HeldFiles``, as the number ``held_as``); otherwise
    it belongs to the opens using it and goes with the last."""

    fd: int
    backing_id: int
    reopened_as: tuple[str, str]  # (result, source) counted for another open sharing it
    opens: int = 0
    evicted: bool = False
    readable: bool = True  # False: no descriptor of ours, or the remote's file by path (O_PATH)
    held_key: int = 0  # held: its key in HeldFiles (held_key())
    held_as: int = 0   # held: its entry there (HeldFile.packed())
    record: int = 0    # held and registered: its slot in the handle table

    @property
    def held(self) -> bool:
        return self.held_as != 0

    @classmethod
    def held_file(cls, key: int, packed: int, held: HeldFile | None = None) -> Backing:
        """The Backing of the held file ``packed`` (``held``: it unpacked, when the caller
        has it already)."""
        if held is None:
            held = HeldFile.unpack(packed)
        return cls(held.fd, held.backing_id, _HIT, readable=held.fd >= 0, held_key=key,
                   held_as=packed, record=held.record)


@dataclass(eq=False)
class Handle:
    """One open file: its node, and either a backing (passthrough, or pread here from its
    descriptor) or a tree handle read chunk by chunk; neither for an open served here that a
    predecessor made (opened again at its first READ)."""

    opened: Opened
    backing: Backing | None
    passthrough: bool
    tree_handle: int = 0


def held_key(relpath: str, version: Version) -> int:
    """What a held file is found by: a 64-bit hash of its path and version (a collision is
    told apart by the file's ``checked_as``, see CachedTree.locate)."""
    return xxhash.xxh3_64_intdigest(os.fsencode(relpath), seed=version.mtime_ns & _SEED_MASK
                                    ^ version.size)


_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF
_U32 = 0xFFFF_FFFF
_U64 = 0xFFFF_FFFF_FFFF_FFFF


class HeldFile(NamedTuple):
    """A cache file kept registered across opens, as HeldFiles keeps it: 36 bytes each
    (``packed``) in a table of fixed slots, not an object, so that a held file costs the
    daemon 60 - 120 bytes, not 500, and the garbage collector nothing.
    192,844 of them are held at the defaults on a machine of 24 GiB (service/memory.py).
    A Backing is made for one only while opens use it (``MirrorFS._held_open``)."""

    backing_id: int  # 0 without passthrough
    fd: int          # -1 with passthrough: the kernel holds the file
    record: int      # its slot in the handle table, with passthrough
    checked_as: tuple[int, int, int]  # the cache file as checked: inode, mtime, ctime

    def packed(self) -> int:
        ino, mtime_ns, ctime_ns = self.checked_as
        # Never 0 (Backing.held): with passthrough the backing id is set, without it the
        # descriptor (stored plus one).
        return (self.record | (self.fd + 1) << 32 | self.backing_id << 64
                | (ino & _U64) << 96 | (mtime_ns & _U64) << 160 | (ctime_ns & _U64) << 224)

    @classmethod
    def unpack(cls, packed: int) -> HeldFile:
        return cls((packed >> 64) & _U32, ((packed >> 32) & _U32) - 1, packed & _U32,
                   ((packed >> 96) & _U64, _signed(packed >> 160 & _U64),
                    _signed(packed >> 224 & _U64)))


def _signed(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


def _unpacked(packed: int | None) -> HeldFile | None:
    return None if packed is None else HeldFile.unpack(packed)


def _checked_as(held: HeldFile | None) -> tuple[int, int, int] | None:
    return None if held is None else held.checked_as


def _entry(nodeid: int, timeout: float, a: Attr) -> bytes:
    return p.entry_with_attr(nodeid, timeout, a.mode, a.size, a.uid, a.gid, a.nlink, a.atime_ns,
                             a.mtime_ns, a.ctime_ns)


def _pack(nodeid: int, a: Attr) -> bytes:
    return p.attr(nodeid, a.mode, a.size, a.uid, a.gid, a.nlink, a.atime_ns, a.mtime_ns,
                  a.ctime_ns)


def _max_held_descriptors() -> int:
    # Each held file is a descriptor of ours: stay well inside the limit on them.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    limit = hard if hard != resource.RLIM_INFINITY else 1 << 20
    return max(64, min(MAX_HELD_DESCRIPTORS, limit // 4))


class MirrorFS:
    """The FUSE requests of one cachefs mount.

    Thread safety: ``_lock`` guards ``_opened``, ``_handles``, the handle table, ``_held``,
    ``_held_open``, ``_dir_paths``, ``_listed``, ``_last_listing`` and the counters of every
    Opened and Backing; the node table has its own lock, a leaf (taken under ``_lock``, never
    the other way round); everything else is the tree's.
    """

    def __init__(self, tree: CachedTree, *, on_mounted, metrics,
                 max_held: int | None = None, nodes: NodeTable | None = None,
                 handles: h.HandleTable | None = None) -> None:
        self.tree = tree
        self._on_mounted = on_mounted
        self._open_seconds = metrics.open_seconds
        self._served_reads = metrics.served_reads
        self._lookups = metrics.lookups
        self._held_opens = metrics.held_file_opens
        self.session: Session | None = None
        self.passthrough = False
        self._lock = threading.Lock()
        self.nodes = nodes if nodes is not None else NodeTable(None, tree.getattr(""))
        self._dir_paths: dict[int, str] = {ROOT_ID: ""}
        self._opened: dict[int, Opened] = {}
        self._handles: dict[int, Handle] = {}
        self.records = handles if handles is not None else h.HandleTable(None)
        # Directory handles (not recorded): from a number no predecessor of this process used.
        self._fhs = itertools.count(time.time_ns())
        # Backing ids a predecessor left registered that no open used, closed at takeover.
        self.backing_ids_closed = 0
        # An open directory's entries (None: not listed yet, the kernel has them cached).
        self._dirs: dict[int, list[tuple[bytes, int]] | None] = {}
        # Per directory node: the listing the kernel has cached.
        self._listed: dict[int, Listing] = {}
        self._last_listing: Listing | None = None  # the one read from the remote last
        self._max_held = max_held
        # Without passthrough (until INIT says otherwise) each held file is a descriptor.
        self._held = HeldFiles(min(max_held or MAX_HELD_DESCRIPTORS, _max_held_descriptors()))
        # The held files open now, by their entry in _held: the one Backing their opens
        # count (an entry pushed out meanwhile is closed by the last of those).
        self._held_open: dict[int, Backing] = {}

    # -- the session's calls -------------------------------------------------------------

    def init(self, session: Session, connection: Connection) -> None:
        self.session = session
        self.passthrough = connection.passthrough
        if self.passthrough:  # the kernel holds them, not descriptors of ours
            self._held.max_files = self._max_held or DEFAULT_MAX_HELD
        if self.records.inherited:
            self._adopt()
        self._on_mounted(connection)

    def _adopt(self) -> None:
        """Take the open files of the process that served the mount before (the handle
        table it left), before any request of this process is read."""
        shared: dict[int, Backing] = {}  # backing id -> the passthrough opens' backing
        held: list[h.Record] = []
        with self._lock:
            for record in self.records.records_locked():
                if record.kind == h.HELD:
                    held.append(record)
                    continue
                info = self.nodes.get(record.nodeid)
                if info is None:  # not a node the kernel holds: an open never answered
                    self.records.remove_locked(record.slot)
                    continue
                opened = self._opened_locked(Node(record.nodeid, "", info.attr))
                if record.kind == h.PASSTHROUGH:
                    backing = shared.get(record.backing_id)
                    if backing is None:
                        # The kernel holds the file; the last RELEASE closes the id.
                        backing = shared[record.backing_id] = Backing(
                            -1, record.backing_id, _HIT, readable=False)
                    backing.opens += 1
                    opened.backing = backing
                    opened.passthrough += 1
                    self._handles[record.slot] = Handle(opened, backing, True)
                else:
                    opened.served += 1
                    self._handles[record.slot] = Handle(opened, None, False)
            for record in held:
                self.records.remove_locked(record.slot)
        closing = [record.backing_id for record in held if record.backing_id not in shared]
        for backing_id in closing:
            self.session.backing_close(backing_id)
        self.backing_ids_closed = len(closing)
        log.info("took over %d open files (%d through the kernel); closed %d backing files "
                 "kept by the previous process", len(self._handles),
                 sum(b.opens for b in shared.values()), len(closing))

    def errno_for(self, exc: BaseException) -> int | None:
        return errno_for(exc)

    @property
    def open_files(self) -> int:
        return len(self._handles)

    @property
    def held_files(self) -> int:
        return len(self._held)

    @property
    def max_held_files(self) -> int:
        return self._held.max_files

    def _node(self, nodeid: int) -> Node:
        info = self._info(nodeid)
        if nodeid == ROOT_ID:
            return Node(nodeid, "", info.attr)
        return Node(nodeid, self._relpath(info), info.attr)

    def _info(self, nodeid: int) -> NodeInfo:
        info = self.nodes.get(nodeid)
        if info is None:  # forgotten: the kernel should not ask; it looks the name up again
            raise OSError(errno.ESTALE, "unknown node")
        return info

    def _relpath(self, info: NodeInfo) -> str:
        parent = self._dir_path(info.parent)
        name = os.fsdecode(info.name)
        return f"{parent}/{name}" if parent else name

    def _dir_path(self, nodeid: int) -> str:
        path = self._dir_paths.get(nodeid)  # the root's is always there
        if path is None:
            info = self._info(nodeid)
            path = self._relpath(info)
            with self._lock:
                # Remembered only while the id names the directory the path was worked out
                # for: a FORGET of it meanwhile (the id then given to another directory)
                # must not leave the old path under the id.
                now = self.nodes.get(nodeid)
                if now is None or now[:2] != info[:2]:
                    return path
                if len(self._dir_paths) >= MAX_DIR_PATHS:
                    self._dir_paths = {ROOT_ID: ""}
                self._dir_paths[nodeid] = path
        return path

    # -- names ----------------------------------------------------------------------------

    def lookup(self, req: Request, parent: int, name: bytes) -> bytes:
        self._lookups.inc()
        directory = self._dir_path(parent)
        if self.nodes.get(parent) is None:
            raise OSError(errno.ESTALE, "unknown node")
        text = os.fsdecode(name)
        relpath = f"{directory}/{text}" if directory else text
        attr, timeout = self.tree.getattr_fresh(relpath)
        nodeid = self.nodes.lookup(parent, name, attr)
        if not attr.is_dir:  # a walk looks directories up to enter them, stat or not
            self._names_stated(parent, seen=True)
        return _entry(nodeid, timeout, attr)

    def forget(self, nodeid: int, nlookup: int) -> None:
        # What is remembered under the id goes before the node does: once the node table
        # frees it, a LOOKUP on another thread may give the id to another directory, and the
        # kernel ask for names in that one by it at once, read without the lock.  The lock
        # keeps a path worked out meanwhile for the old node from being put back (_dir_path).
        with self._lock:
            path = self._dir_paths.pop(nodeid, None)
            listing = self._listed.pop(nodeid, None)
            if not self.nodes.forget(nodeid, nlookup):  # some lookups left: still this node
                if path is not None:
                    self._dir_paths[nodeid] = path
                if listing is not None:
                    self._listed[nodeid] = listing

    def getattr(self, req: Request, nodeid: int, fh: int | None) -> bytes:
        node = self._node(nodeid)
        if fh is not None and node.attr.is_file:
            return p.attr_out(0, _pack(nodeid, node.attr))  # fstat: the version that is open
        attr, timeout = self.tree.getattr_fresh(node.relpath)
        if node.attr.is_file and (not attr.is_file or not attr.same_version(node.attr)):
            # Changed on the remote: this node keeps its version; the next lookup of the
            # name finds the new one.
            return p.attr_out(0, _pack(nodeid, node.attr))
        if attr != node.attr:
            self.nodes.refresh(nodeid, attr)
        return p.attr_out(timeout, _pack(nodeid, attr))

    def readlink(self, req: Request, nodeid: int) -> bytes:
        return os.fsencode(self.tree.readlink(self._node(nodeid).relpath))

    def statfs(self, req: Request, nodeid: int) -> bytes:
        return p.statfs_out(self.tree.remote.statvfs())

    # -- directories ------------------------------------------------------------------------

    def opendir(self, req: Request, nodeid: int, flags: int) -> bytes:
        """The kernel keeps a directory's listing in its page cache (FOPEN_CACHE_DIR) and keeps
        it over the next open (FOPEN_KEEP_CACHE) while the directory's version is the one it
        was listed at, as an NFS client does: a repeated walk costs one attribute check per
        directory, not a listing of the remote.  Only the version is kept here, per directory
        node, not the listing: the kernel holds that.  The listing itself is read at the first
        READDIR, which says whether the attributes are wanted with the names.

        A listing whose names walks stat (``Listing.stats_names``) is not kept past the
        interval: its names are due by then, and read again from a cached listing each would
        cost a LOOKUP of its own (``ls -lR`` repeated a minute later: a request per file),
        where listed again they come with their attributes, a page of them per request."""
        node = self._node(nodeid)
        version = self._dir_version(node.relpath)
        fh = next(self._fhs)
        now = time.monotonic()
        interval = self.tree.attrs.interval
        with self._lock:
            listing = self._listed.get(nodeid)
            unchanged = listing is not None and listing.version == version and not (
                listing.stats_names and interval is not None
                and now - listing.listed_at >= interval)
            if not unchanged:
                self._listed[nodeid] = Listing(version, now, listing is not None
                                               and listing.stats_names)
            self._dirs[fh] = None
        return p.open_out(fh, p.FOPEN_CACHE_DIR | (p.FOPEN_KEEP_CACHE if unchanged else 0))

    def _dir_version(self, relpath: str) -> tuple[int, int]:
        attr = self.tree.getattr(relpath)
        if not attr.is_dir:
            raise OSError(errno.ENOTDIR, relpath)
        return attr.mtime_ns, attr.ctime_ns

    def readdir(self, req: Request, nodeid: int, fh: int, offset: int, size: int,
                plus: bool) -> bytes:
        with self._lock:
            # A handle this process does not know was opened by a predecessor: listed again.
            entries = self._dirs.setdefault(fh, None)
        if entries is None:
            relpath = self._node(nodeid).relpath
            # Names only for a walk that does not stat them; with their attributes once the
            # kernel asks for them past the first page (its lookups showed they are wanted),
            # or from the first page when the last walk of this directory stat its names.
            entries = [(os.fsencode(name), mode) for name, mode in self.tree.listdir(
                relpath, with_attrs=plus and (offset > 0 or self._walk_stats_names(nodeid)))]
            with self._lock:
                if fh in self._dirs:
                    self._dirs[fh] = entries
        if plus:
            if offset > 0:
                self._names_stated(nodeid, seen=True)
            return self._readdirplus(nodeid, entries, offset, size)
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

    def _walk_stats_names(self, nodeid: int) -> bool:
        """Whether the walk about to read this directory's listing will stat its names: the
        last walk of it did, or the directory listed before it had its names stat'ed (``ls
        -lR`` going from one directory to the next), so that the first page comes with the
        attributes too, not a LOOKUP per name."""
        stated = self._names_stated(nodeid)
        with self._lock:
            last, self._last_listing = self._last_listing, self._listed.get(nodeid)
        return stated or (last is not None and last.stats_names)

    def _names_stated(self, nodeid: int, seen: bool = False) -> bool:
        """Whether walks of the directory stat its names; ``seen``: this one does (a LOOKUP
        of a file in it, or READDIRPLUS past the first page).  Once seen, for as long as the
        kernel holds the directory: at worst a walk that does not stat them (``find``) has
        the directory listed with the attributes once per interval."""
        listing = self._listed.get(nodeid)
        if listing is None:
            return False
        if seen and not listing.stats_names:
            listing.stats_names = True  # a hint: set without the lock, a lost update is harmless
        return listing.stats_names

    def _readdirplus(self, parent: int, entries: list[tuple[bytes, int]], offset: int,
                     size: int) -> bytes:
        """Entries with their lookups (READDIRPLUS): ``ls -l`` or a walk that stats each file
        costs one request per page of entries, not a LOOKUP per name.  The kernel asks for
        the first page of every directory this way, wanted or not (``find`` does not stat):
        that page carries the attributes memory holds and none it would have to fetch; a
        later page is asked for so only after lookups in the directory, and its entries'
        attributes are fetched, the whole directory's in one listing.  Each entry given
        with attributes is one lookup the kernel will forget, so an entry is looked up only
        once it is known to fit."""
        directory = self._dir_path(parent)
        prefix = f"{directory}/" if directory else ""
        attrs = self.tree.attrs
        listed = offset == 0
        out = []
        used = 0
        for index in range(offset, len(entries)):
            name, mode = entries[index]
            needed = p.ENTRY_OUT_BYTES + p.dirent_size(name)
            if used + needed > size:
                break
            relpath = prefix + os.fsdecode(name)
            found = attrs.peek_fresh(relpath)
            if found is None and not listed:
                self.tree.listdir(directory)  # every name's attributes, in one listing
                listed = True
                found = attrs.peek_fresh(relpath)
            if found is None and offset > 0:
                try:
                    found = self.tree.getattr_fresh(relpath)
                except OSError:  # gone since the listing
                    pass
            if found is None:  # a name without attributes: the kernel looks it up if wanted
                entry, ino = p.entry_out(0, 0, 0.0, 0.0, bytes(p.ATTR.size)), 0xFFFF_FFFF
            else:
                attr, timeout = found
                ino = self.nodes.lookup(parent, name, attr)
                entry = _entry(ino, timeout, attr)
                mode = attr.mode
            out.append(p.direntplus(entry, ino, index + 1, mode, name))
            used += needed
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

    def _opened_locked(self, node: Node) -> Opened:
        opened = self._opened.get(node.nodeid)
        if opened is None:
            opened = self._opened[node.nodeid] = Opened(node)
        return opened

    def _open_passthrough(self, node: Node, attr: Attr) -> bytes:
        key = held_key(node.relpath, attr.version)
        with self._lock:
            opened = self._opened.get(node.nodeid)
            live = opened.backing if opened is not None else None
            if live is not None:
                # Passthrough opens of this node are live: the kernel insists on their
                # backing.  Joined under the lock that saw it, before a RELEASE of the last
                # of them can close it.
                fh = self._join_live_locked(opened)
            else:
                held = self._held.get_locked(key)
        if live is not None:
            self.tree.count_open(*live.reopened_as, attr.size)
            return p.open_out(fh, p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH, live.backing_id)
        unpacked = _unpacked(held)
        located = self.tree.locate(node.relpath, attr, held=_checked_as(unpacked))
        backing = self._backing_for(located, key, held, unpacked)
        if backing is None:
            return self._serve(node, located)
        return self._reply_passthrough(node, backing)

    def _backing_for(self, located: Located, key: int, held: int | None,
                     unpacked: HeldFile | None) -> Backing | None:
        """The backing file for ``located``; None when it has no single local file."""
        if located.kind == "held":
            self._held_opens.inc()
            return Backing.held_file(key, held, unpacked)
        if located.kind == "chunks":
            return None
        fd = located.fd
        try:
            backing_id = self.session.backing_open(fd)
        except OSError:
            os.close(fd)
            raise
        if located.kind != "cache":
            return Backing(fd, backing_id, (located.result, located.source),
                           readable=located.readable)
        # A cache file, whatever brought it (a miss, a prefetch), is a hit from now on, kept
        # registered where the held files have room, else for this open alone.  The kernel
        # keeps it open itself: we need no descriptor of it.
        os.close(fd)
        held = self._hold(key, backing_id, -1, located.checked_as)
        if held is not None:
            return held
        return Backing(-1, backing_id, (located.result, located.source), readable=False)

    def _hold(self, key: int, backing_id: int, fd: int, checked_as: tuple[int, int, int]
              ) -> Backing | None:
        """Keep a cache file across opens (registered, ``backing_id``, or open, ``fd``);
        those it pushes out (held.py) are closed, unless opens use them.  None when the held
        files have no room for it: the caller's open uses it alone."""
        with self._lock:
            room = self._held.room_locked(key)
            if room is None:
                return None
            record = self.records.add_locked(0, backing_id, h.HELD) if backing_id else 0
            held = HeldFile(backing_id, fd, record, checked_as)
            packed = held.packed()
            out = self._push_out_locked(room + self._held.put_locked(key, packed))
        for gone in out:
            self._close_backing(gone)
        return Backing.held_file(key, packed, held)

    def _push_out_locked(self, entries: list[tuple[int, int]]) -> list[Backing]:
        """The held files of ``entries``, no longer held: those opens use are closed by the
        last of them; the others are returned, to be closed (outside the lock)."""
        closing = []
        for key, packed in entries:
            backing = self._held_open.get(packed)
            if backing is not None:
                backing.evicted = True
            else:
                closing.append(Backing.held_file(key, packed))
        return closing

    def _in_use_locked(self, backing: Backing) -> Backing | None:
        """The Backing that counts the opens of ``backing``'s file, about to count one
        more: a held file's may be another open's; None when the file was pushed out of
        the held files since (and closed by whoever pushed it out)."""
        if not backing.held:
            return backing
        current = self._held_open.get(backing.held_as)
        if current is not None:
            return current
        if not self._held.holds_locked(backing.held_key, backing.held_as):
            return None
        self._held_open[backing.held_as] = backing
        return backing

    def _reply_passthrough(self, node: Node, backing: Backing) -> bytes:
        """Name ``backing`` (this open's own, or a held cache file) to the kernel, or what the
        node's other opens, decided meanwhile, leave this one: the kernel allows one backing
        file per node and no passthrough open beside opens served with its page cache."""
        closing = None
        with self._lock:
            opened = self._opened_locked(node)
            if opened.backing is not None:
                # Another open of this node won the race: the kernel insists on its file.
                if not backing.held and backing.opens == 0:
                    closing = backing
                fh, backing, passthrough = self._join_live_locked(opened), opened.backing, True
            elif (opened.served and not backing.readable) \
                    or (in_use := self._in_use_locked(backing)) is None:
                # Opens served here hold the node's pages and this file cannot be read here,
                # or it was pushed out of the held files by another open meanwhile (and
                # closed): read through the tree instead (a race, rare).
                if not backing.held and backing.opens == 0:
                    closing = backing
                backing = None
            else:
                backing = in_use
                # With opens served here holding the node's page cache, the kernel refuses
                # a passthrough open beside them: this one is served here too.
                passthrough = not opened.served
                if passthrough:
                    opened.backing = backing
                    opened.passthrough += 1
                else:
                    opened.served += 1
                backing.opens += 1
                fh = self.records.add_locked(node.nodeid, backing.backing_id if passthrough
                                             else 0, h.PASSTHROUGH if passthrough else h.SERVED)
                self._handles[fh] = Handle(opened, backing, passthrough)
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
        key = held_key(node.relpath, attr.version)
        with self._lock:
            held = self._held.get_locked(key)
        unpacked = _unpacked(held)
        located = self.tree.locate(node.relpath, attr, held=_checked_as(unpacked))
        if located.kind == "held":
            self._held_opens.inc()
            backing = Backing.held_file(key, held, unpacked)
        elif located.kind == "chunks":
            return self._serve(node, located)
        elif located.kind == "cache" and (
                held_now := self._hold(key, 0, located.fd, located.checked_as)) is not None:
            backing = held_now
        else:
            backing = Backing(located.fd, 0, (located.result, located.source),
                              readable=located.readable)
        with self._lock:
            in_use = self._in_use_locked(backing)  # None: pushed out by another open meanwhile
            gone = in_use is None
            if not gone:
                backing = in_use
                opened = self._opened_locked(node)
                backing.opens += 1
                opened.served += 1
                fh = self.records.add_locked(node.nodeid, 0, h.SERVED)
                self._handles[fh] = Handle(opened, backing, False)
        if gone:
            return self._serve(node, self.tree.read_through(node.relpath, node.attr))
        return p.open_out(fh, p.FOPEN_KEEP_CACHE | p.FOPEN_NOFLUSH)

    def _serve(self, node: Node, located: Located) -> bytes:
        """An open read chunk by chunk through the tree; or, when a passthrough open of the
        node began since the tree answered (another open raced this one), one more of those:
        the kernel fails an open served with the page cache beside them (EIO)."""
        tree_handle = self.tree.register(located.handle)
        with self._lock:
            opened = self._opened_locked(node)
            live = opened.backing
            if live is None:
                opened.served += 1
                fh = self.records.add_locked(node.nodeid, 0, h.SERVED)
                self._handles[fh] = Handle(opened, None, False, tree_handle)
            else:
                fh = self._join_live_locked(opened)
        if live is None:
            return p.open_out(fh, p.FOPEN_KEEP_CACHE | p.FOPEN_NOFLUSH)
        self.tree.release(tree_handle)
        return p.open_out(fh, p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH, live.backing_id)

    def _join_live_locked(self, opened: Opened) -> int:
        """One more passthrough open of ``opened``'s live backing file; its handle."""
        backing = opened.backing
        opened.passthrough += 1
        backing.opens += 1
        fh = self.records.add_locked(opened.node.nodeid, backing.backing_id, h.PASSTHROUGH)
        self._handles[fh] = Handle(opened, backing, True)
        return fh

    def read(self, req: Request, nodeid: int, fh: int, offset: int, size: int):
        handle = self._handles.get(fh)
        if handle is None:
            raise OSError(errno.EBADF, "file not open")
        self._served_reads.inc()
        if handle.backing is not None:
            return os.pread(handle.backing.fd, size, offset)
        if not handle.tree_handle:
            self._reopen(nodeid, handle)
        return self.tree.read(handle.tree_handle, size, offset)

    def _reopen(self, nodeid: int, handle: Handle) -> None:
        """Open again, chunk by chunk, a file a predecessor opened and served here."""
        node = self._node(nodeid)
        tree_handle = self.tree.register(self.tree.read_through(node.relpath, node.attr).handle)
        with self._lock:
            if not handle.tree_handle:
                handle.tree_handle, tree_handle = tree_handle, 0
        if tree_handle:  # another READ of the handle did it first
            self.tree.release(tree_handle)

    def release(self, req: Request | None, nodeid: int, fh: int) -> None:
        with self._lock:
            handle = self._handles.pop(fh, None)
            if handle is None:
                return
            self.records.remove_locked(fh)
            opened, backing = handle.opened, handle.backing
            if handle.passthrough:
                opened.passthrough -= 1
                if not opened.passthrough:
                    opened.backing = None
            else:
                opened.served -= 1
            if opened.idle and self._opened.get(opened.node.nodeid) is opened:
                del self._opened[opened.node.nodeid]
            closing = None
            if backing is not None:
                backing.opens -= 1
                if backing.opens == 0 and backing.held:
                    del self._held_open[backing.held_as]
                if backing.opens == 0 and (not backing.held or backing.evicted):
                    closing = backing
        if closing is not None:
            self._close_backing(closing)
        if handle.tree_handle:
            self.tree.release(handle.tree_handle)

    def _close_backing(self, backing: Backing) -> None:
        if backing.record:
            with self._lock:
                self.records.remove_locked(backing.record)
                backing.record = 0
        if backing.backing_id:
            self.session.backing_close(backing.backing_id)
        if backing.fd >= 0:
            os.close(backing.fd)

    def drop_held(self, relpath: str, version) -> None:
        """Stop handing over a held cache file (it changed or was dropped)."""
        key = held_key(relpath, version)
        with self._lock:
            packed = self._held.drop_locked(key)
            out = self._push_out_locked([(key, packed)]) if packed is not None else []
        for gone in out:
            self._close_backing(gone)
