"""The FUSE wire protocol, as the kernel's include/uapi/linux/fuse.h defines it (7.45).

Only what a read-only file system and its passthrough need: the request and reply
layouts as ``struct.Struct``s, the opcodes, the INIT and OPEN flag bits, and helpers that
pack the replies the session sends.  Times cross the wire as seconds plus nanoseconds.
"""

from __future__ import annotations

import stat
import struct

KERNEL_MAJOR = 7
# The newest minor version this code speaks; the session uses min(kernel's, this).
KERNEL_MINOR = 45
ROOT_ID = 1
# The kernel refuses reads of /dev/fuse into smaller buffers (FUSE_MIN_READ_BUFFER).
MIN_READ_BUFFER = 8192

# -- opcodes ---------------------------------------------------------------------------------
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
SETXATTR = 21
GETXATTR = 22
LISTXATTR = 23
REMOVEXATTR = 24
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
GETLK = 31
SETLK = 32
SETLKW = 33
ACCESS = 34
CREATE = 35
INTERRUPT = 36
BMAP = 37
DESTROY = 38
IOCTL = 39
POLL = 40
NOTIFY_REPLY = 41
BATCH_FORGET = 42
FALLOCATE = 43
READDIRPLUS = 44
RENAME2 = 45
LSEEK = 46
COPY_FILE_RANGE = 47
TMPFILE = 51
STATX = 52

# Requests that would change the tree: a read-only file system answers them EROFS.
MUTATIONS = frozenset({SETATTR, SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, WRITE,
                       SETXATTR, REMOVEXATTR, CREATE, FALLOCATE, RENAME2, COPY_FILE_RANGE,
                       TMPFILE})

# -- notifications (sent by the daemon, unique 0, the code in the error field) ---------------
NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_ENTRY = 3
NOTIFY_STORE = 4

# -- FUSE_INIT flags (flags | flags2 << 32) --------------------------------------------------
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
NO_OPEN_SUPPORT = 1 << 17
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
NO_OPENDIR_SUPPORT = 1 << 24
EXPLICIT_INVAL_DATA = 1 << 25
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37

# -- FOPEN_* flags of an OPEN reply ------------------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_CACHE_DIR = 1 << 3
FOPEN_NOFLUSH = 1 << 5
FOPEN_PASSTHROUGH = 1 << 7

# -- ioctls on /dev/fuse ------------------------------------------------------------------------
# _IOW(229, 1, struct fuse_backing_map) and _IOW(229, 2, uint32_t).
DEV_IOC_BACKING_OPEN = 0x4010E501
DEV_IOC_BACKING_CLOSE = 0x4004E502

# -- layouts --------------------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")   # len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
OUT_HEADER = struct.Struct("<IiQ")        # len, error (negative errno), unique
INIT_IN = struct.Struct("<IIIII")         # major, minor, max_readahead, flags, flags2
# major, minor, max_readahead, flags, max_background, congestion_threshold, max_write,
# time_gran, max_pages, map_alignment, flags2, max_stack_depth, request_timeout, unused[11]
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
GETATTR_IN = struct.Struct("<IIQ")        # getattr_flags, dummy, fh
OPEN_IN = struct.Struct("<II")            # flags, open_flags
READ_IN = struct.Struct("<QQII")          # fh, offset, size, read_flags (then more we ignore)
RELEASE_IN = struct.Struct("<QII")        # fh, flags, release_flags
FORGET_IN = struct.Struct("<Q")           # nlookup
BATCH_FORGET_IN = struct.Struct("<II")    # count, dummy
FORGET_ONE = struct.Struct("<QQ")         # nodeid, nlookup
ACCESS_IN = struct.Struct("<II")          # mask, padding
LSEEK_IN = struct.Struct("<QQI")          # fh, offset, whence
INTERRUPT_IN = struct.Struct("<Q")        # unique
GETXATTR_IN = struct.Struct("<II")        # size, padding

ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # struct fuse_attr, 88 bytes
_ENTRY_HEAD = struct.Struct("<QQQQII")     # nodeid, generation, entry_valid, attr_valid, nsecs
_ATTR_HEAD = struct.Struct("<QII")         # attr_valid, attr_valid_nsec, dummy
OPEN_OUT = struct.Struct("<QIi")           # fh, open_flags, backing_id
_DIRENT = struct.Struct("<QQII")           # ino, off, namelen, type
_ENTRY_WITH_ATTR = struct.Struct(_ENTRY_HEAD.format + ATTR.format[1:])
_KSTATFS = struct.Struct("<QQQQQIIII24x")  # blocks, bfree, bavail, files, ffree, bsize,
#                                            namelen, frsize, padding, spare[6]
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")  # nodeid, offset, length
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")  # parent, namelen, flags
BACKING_MAP = struct.Struct("<iIQ")        # fd, flags, padding
LSEEK_OUT = struct.Struct("<Q")
ENTRY_OUT_BYTES = _ENTRY_HEAD.size + ATTR.size


def split_seconds(seconds: float) -> tuple[int, int]:
    """A non-negative timeout as (seconds, nanoseconds), capped where the kernel caps it."""
    if seconds <= 0:
        return 0, 0
    seconds = min(seconds, 2**32)
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def attr(ino: int, mode: int, size: int, uid: int, gid: int, nlink: int, atime_ns: int,
         mtime_ns: int, ctime_ns: int, *, rdev: int = 0, blksize: int = 4096) -> bytes:
    """A ``struct fuse_attr``; blocks are the logical size in 512-byte units (what ``du``
    shows for the remote's files)."""
    a_s, a_n = divmod(atime_ns, 10**9)
    m_s, m_n = divmod(mtime_ns, 10**9)
    c_s, c_n = divmod(ctime_ns, 10**9)
    return ATTR.pack(ino, size, -(-size // 512), a_s & 0xFFFF_FFFF_FFFF_FFFF,
                     m_s & 0xFFFF_FFFF_FFFF_FFFF, c_s & 0xFFFF_FFFF_FFFF_FFFF, a_n, m_n, c_n,
                     mode, nlink, uid, gid, rdev, blksize, 0)


def entry_with_attr(nodeid: int, timeout: float, mode: int, size: int, uid: int, gid: int,
                    nlink: int, atime_ns: int, mtime_ns: int, ctime_ns: int) -> bytes:
    """``entry_out(nodeid, 0, timeout, timeout, attr(nodeid, ...))`` in one pack: a LOOKUP's
    reply, and the head of each READDIRPLUS entry (the listings' per-name path)."""
    t_s, t_n = split_seconds(timeout)
    a_s, a_n = divmod(atime_ns, 10**9)
    m_s, m_n = divmod(mtime_ns, 10**9)
    c_s, c_n = divmod(ctime_ns, 10**9)
    return _ENTRY_WITH_ATTR.pack(nodeid, 0, t_s, t_s, t_n, t_n, nodeid, size, -(-size // 512),
                                 a_s & 0xFFFF_FFFF_FFFF_FFFF, m_s & 0xFFFF_FFFF_FFFF_FFFF,
                                 c_s & 0xFFFF_FFFF_FFFF_FFFF, a_n, m_n, c_n, mode, nlink, uid,
                                 gid, 0, 4096, 0)


def entry_out(nodeid: int, generation: int, entry_timeout: float, attr_timeout: float,
              attr_bytes: bytes) -> bytes:
    e_s, e_n = split_seconds(entry_timeout)
    a_s, a_n = split_seconds(attr_timeout)
    return _ENTRY_HEAD.pack(nodeid, generation, e_s, a_s, e_n, a_n) + attr_bytes


def negative_entry(timeout: float) -> bytes:
    """The reply that caches "no such name" for ``timeout`` (nodeid 0)."""
    return entry_out(0, 0, timeout, 0, bytes(ATTR.size))


def attr_out(timeout: float, attr_bytes: bytes) -> bytes:
    a_s, a_n = split_seconds(timeout)
    return _ATTR_HEAD.pack(a_s, a_n, 0) + attr_bytes


def open_out(fh: int, flags: int, backing_id: int = 0) -> bytes:
    return OPEN_OUT.pack(fh, flags, backing_id)


def dirent_type(mode: int) -> int:
    """The DT_* of a dirent: the file type bits shifted down, as the kernel reads them."""
    return stat.S_IFMT(mode) >> 12


def dirent_size(name: bytes) -> int:
    """Bytes of the ``struct fuse_dirent`` of ``name``, padding included."""
    return (_DIRENT.size + len(name) + 7) & ~7


def dirent(ino: int, next_offset: int, mode: int, name: bytes) -> bytes:
    """One ``struct fuse_dirent``, padded to 8 bytes."""
    record = _DIRENT.pack(ino, next_offset, len(name), dirent_type(mode)) + name
    return record + b"\0" * (-len(record) % 8)


def direntplus(entry: bytes, ino: int, next_offset: int, mode: int, name: bytes) -> bytes:
    """One ``struct fuse_direntplus``: an entry_out (as a LOOKUP reply) then the dirent."""
    return entry + dirent(ino, next_offset, mode, name)


def statfs_out(st) -> bytes:
    """A ``struct fuse_statfs_out`` from an ``os.statvfs_result``."""
    return _KSTATFS.pack(st.f_blocks, st.f_bfree, st.f_bavail, st.f_files, st.f_ffree,
                         st.f_bsize, st.f_namemax, st.f_frsize, 0)
