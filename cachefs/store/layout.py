"""Where cached bytes live on the local SSD.

::

    CACHE_DIR/                  mode 0700: copies of possibly private data
      cachefs-cache.json        marks the directory as ours; records the format
      lock                      flock()ed by the one daemon using the directory
      index/                    diskcache (SQLite): what is stored, with checksums
      data/ab/cdef...           one file per cached file, named by a hash of (path, version)
      tmp/                      copies renamed into data/ once whole; swept at every start
      trash.*/                  an emptied cache's index/, data/, tmp/, removed in the background

A cached file is one local file whatever its size, so that the kernel can be handed it
(FUSE passthrough).  Only the index makes a data file a cached file: a file a fill copies
whole is written at its own name and indexed once it is whole and hashed
(:meth:`CacheLayout.create_in_place`); a copy that replaces a file already there (another
version of it, its chunks) is written under ``tmp/`` and renamed into ``data/``; a larger
file read piecemeal is written chunk by chunk into its data file, and the index says which
chunks are there.  A data file of no record is an orphan, which a clean stop leaves none of
and the reconciliation after a crash removes.  There is no fsync:
every data file is checked against the checksums in the index before it is first used,
so a file torn by a power cut is caught and refetched, and skipping the flush keeps
admissions cheap.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import xxhash

from cachefs.attr import Version
from cachefs.errors import UsageError
from cachefs.store.mark import mark_checked

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
# Format 1 stored each chunk of a file in a file of its own.  Such a cache is emptied and
# refilled as files are read.
OLDER_FORMATS = frozenset({1})
MARKER_NAME = "cachefs-cache.json"
# What an emptied cache's subdirectories are renamed to, under the cache dir, until removed.
TRASH_PREFIX = "trash."
# How often a successor waiting for the cache dir tries its lock again.
LOCK_POLL_SECONDS = 0.01
# Allocation granularity assumed when the filesystem has not yet told us
# (delayed allocation); st_blocks is used when it is larger.
BLOCK_BYTES = 4096


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
# linux/falloc.h
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


class _Marker(NamedTuple):
    format: int
    chunk_bytes: int
    identity: str | None  # None: made by a version that wrote none


def _read_marker(marker: Path) -> _Marker | None:
    """What a cache dir's marker says; None when it cannot be read."""
    try:
        info = json.loads(marker.read_text())
        identity = info.get("id")
        return _Marker(info["format"], info["chunk_bytes"],
                       identity if isinstance(identity, str) else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def disk_full(path: Path) -> bool:
    """Whether the file system of ``path`` has no free space or no free inodes left."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail == 0 or (st.f_files > 0 and st.f_favail == 0)


def data_name(key: bytes) -> str:
    """``ab/cdef...``: a 128-bit hash of the data key, fanned out over 256 directories."""
    digest = xxhash.xxh3_128_hexdigest(key)
    return f"{digest[:2]}/{digest[2:]}"


def allocated_bytes(st: os.stat_result) -> int:
    """Bytes a file written whole (no holes) occupies on disk, as du counts them once the
    file system has allocated it."""
    return max(st.st_blocks * 512, -(-st.st_size // BLOCK_BYTES) * BLOCK_BYTES)


def held_bytes(st: os.stat_result) -> int:
    """Bytes a data file holds on disk, holes left out: a file filled chunk by chunk is
    sparse until its last chunk, and its size says nothing of what it holds."""
    return st.st_blocks * 512


def blocks_spanned(offset: int, length: int) -> int:
    """Bytes of the blocks a write of ``length`` bytes at ``offset`` fills."""
    if not length:
        return 0
    return (-(-(offset + length) // BLOCK_BYTES) - offset // BLOCK_BYTES) * BLOCK_BYTES


class NewFile(NamedTuple):
    """A data file being written: its descriptor, the path it is written at (under tmp/, or
    its own when written in place), where it goes."""

    fd: int
    tmp: str
    final: str

    @property
    def in_place(self) -> bool:
        """Written at its own name (see :meth:`CacheLayout.create_in_place`)."""
        return self.tmp == self.final

    @property
    def fan(self) -> str:
        """The fan-out directory it goes into (``ab`` of ``data/ab/cdef...``)."""
        return self.final[-33:-31]


class CacheLayout:
    """Paths and atomic file operations under one cache dir.  Thread safety: stateless."""

    def __init__(self, root: Path, chunk_bytes: int) -> None:
        self.root = root
        self.chunk_bytes = chunk_bytes
        self.index_dir = root / "index"
        self.data_dir = root / "data"
        self.tmp_dir = root / "tmp"
        self._data_prefix = f"{self.data_dir}/"  # chunk paths are built on every read
        self._tmp_prefix = f"{self.tmp_dir}/"
        self._lock_fd: int | None = None
        # Names this cache, its contents: a new one each time the cache is made or emptied,
        # so that what was recorded against its contents (a warm's checkpoint) is known to
        # be of another cache.  Read by prepare.
        self.identity: str | None = None

    # -- opening -------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the directory (mode 0700) or check that an existing one is a cachefs cache.

        Never deletes or overwrites anything that is not ours.
        """
        marker = self.root / MARKER_NAME
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            entries = set(os.listdir(self.root))
        except OSError as exc:
            # mkdir's EEXIST (exist_ok) means a file, not a directory, has the name.
            reason = "not a directory" if isinstance(exc, FileExistsError) else exc.strerror
            raise UsageError(
                f"cannot use cache dir {self.root}: {reason}; "
                "choose a writable directory on the local SSD"
            ) from None
        if MARKER_NAME in entries:
            info = _read_marker(marker)
            if info is None:
                raise UsageError(
                    f"cache dir {self.root} has an unreadable {MARKER_NAME}; "
                    "run 'cachefs verify' or choose a new directory"
                )
            version, chunk, self.identity = info
            if version in OLDER_FORMATS and chunk == self.chunk_bytes:
                self._empty_older_format(version)
            elif version != FORMAT_VERSION or chunk != self.chunk_bytes:
                raise UsageError(
                    f"cache dir {self.root} was made by another cachefs version "
                    f"(format {version}); choose a new directory"
                )
            elif self.identity is None:  # made before caches were named: named now
                self._write_marker(marker)
        elif entries - {"lost+found"}:
            raise UsageError(
                f"cache dir {self.root} is not empty and is not a cachefs cache; "
                "choose an empty or new directory"
            )
        else:
            self._write_marker(marker)
        if stat.S_IMODE(self.root.stat().st_mode) != 0o700:
            self.root.chmod(0o700)
        for sub in (self.index_dir, self.data_dir, self.tmp_dir):
            sub.mkdir(mode=0o700, exist_ok=True)

    def repair_marker(self) -> bool:
        """Rewrite a marker that cannot be read (a damaged disk) in a directory laid out as
        ours, its index present; True when it was rewritten.  For `cachefs verify` only,
        which then checks every stored chunk against its checksum: what the marker no
        longer says (the format the chunks were written in) is checked chunk by chunk."""
        marker = self.root / MARKER_NAME
        if _read_marker(marker) is not None:
            return False
        if not self.index_dir.is_dir() or not self.data_dir.is_dir():
            raise UsageError(f"{self.root} has an unreadable {MARKER_NAME} and no cachefs "
                             "index beside it; choose a new directory")
        self._write_marker(marker)
        return True

    def _empty_older_format(self, version: int) -> None:
        """Our own cache in a format this version no longer reads: emptied, not refused, so
        that an upgrade needs no hand work.  Only our subdirectories are touched."""
        log.warning("cache dir %s holds format %d of an older cachefs: emptied; it fills "
                    "again as files are read", self.root, version)
        self.empty()

    def empty(self) -> None:
        """Put the index and every cached file (our subdirectories only) aside at once, under
        a ``trash.*`` directory, and make the subdirectories anew.  Removing a million files
        takes minutes, which a mount must not wait for: :meth:`remove_trash` does it.  The
        cache emptied is another: it gets a new identity."""
        trash = Path(tempfile.mkdtemp(prefix=TRASH_PREFIX, dir=self.root))
        for sub in (self.index_dir, self.data_dir, self.tmp_dir):
            try:
                os.rename(sub, trash / sub.name)
            except FileNotFoundError:
                pass
            sub.mkdir(mode=0o700, exist_ok=True)
        self._write_marker(self.root / MARKER_NAME)

    def remove_trash(self) -> threading.Thread | None:
        """Remove, on a thread of its own, what :meth:`empty` put aside (now, or at an earlier
        start that a stop cut short: the next start goes on with it); the thread, or None
        when there is nothing to remove.  Its bytes are not on the store's account meanwhile:
        a disk it leaves full refuses a fill, which admission then waits out."""
        trash = [entry.path for entry in os.scandir(self.root)
                 if entry.name.startswith(TRASH_PREFIX) and entry.is_dir(follow_symlinks=False)]
        if not trash:
            return None

        def remove() -> None:
            started = time.monotonic()
            for path in trash:
                shutil.rmtree(path, ignore_errors=True)
            log.info("cache %s: what was emptied is removed (%.1f s)", self.root,
                     time.monotonic() - started)

        thread = threading.Thread(target=remove, name="remove-trash", daemon=True)
        thread.start()
        return thread

    def _write_marker(self, marker: Path) -> None:
        """Write the marker of this format, naming the cache anew."""
        self.identity = uuid.uuid4().hex
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"format": FORMAT_VERSION, "chunk_bytes": self.chunk_bytes,
                                   "id": self.identity}))
        os.replace(tmp, marker)

    def lock(self, wait_seconds: float = 0.0) -> None:
        """Take the cache dir for this process; UsageError when another daemon has it, still
        after ``wait_seconds`` (a successor waits for the daemon it took the mount from, which
        commits its index and exits as the successor starts)."""
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(LOCK_POLL_SECONDS)
                    continue
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UsageError(
                f"cache dir {self.root} is in use by another cachefs daemon (pid {holder}); "
                "unmount it first or choose another --cache-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- data files ----------------------------------------------------------------------

    def data_path(self, key: bytes) -> str:
        return self._data_prefix + data_name(key)

    def write_whole(self, key: bytes, data: bytes | memoryview, version: Version) -> int:
        """Store ``data``, hashed, as the whole data file of ``version``, marked (mark.py)
        and put in place atomically; returns the bytes allocated."""
        new = self.create_tmp(key)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(new.fd, view) :]
            mark_checked(new.fd, version)
            allocated = allocated_bytes(os.fstat(new.fd))
        except BaseException:
            os.close(new.fd)
            self.discard(new)
            raise
        os.close(new.fd)
        self.install(new)
        return allocated

    def create_tmp(self, key: bytes) -> NewFile:
        """A new file under tmp/ for the whole data file of ``key``, open for reading and
        writing.  The caller fills it, closes it, then installs or discards it."""
        final = self.data_path(key)
        # Unique per thread: two fills of one key must not write the same temporary file.
        tmp = self.tmp_path(final, str(threading.get_ident()))
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        return NewFile(fd, tmp, final)

    def create_in_place(self, key: bytes) -> NewFile | None:
        """The whole data file of ``key`` created at its own name, open for reading and
        writing; None when a file has that name already.  Nothing is renamed once it is
        whole: a rename is a third of what creating, writing and renaming a small file
        costs (11 of 30 us for 4 KiB on ext4), and a fill pays it for every file.  The
        index, not the name, says that a data file is whole: only the store's record of it
        makes it one, a file of no record is an orphan (removed by the reconciliation after
        a crash), and the store sees to it that no other file is written at that name
        meanwhile and that a clean stop leaves none half written (CacheStore.fill)."""
        final = self.data_path(key)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:
                fd = os.open(final, flags, 0o600)
            except FileNotFoundError:  # the first file of its fan-out directory
                os.makedirs(os.path.dirname(final), 0o700, exist_ok=True)
                fd = os.open(final, flags, 0o600)
        except FileExistsError:
            return None
        return NewFile(fd, final, final)

    def tmp_path(self, final: str, tag: str) -> str:
        """The temporary file under tmp/ of a fill of the data file ``final`` (by the writer
        ``tag`` names: a thread, a fill process's job)."""
        return f"{self._tmp_prefix}{final[-30:]}.{tag}"

    @staticmethod
    def link_in(fd: int, final: str) -> None:
        """Give the unnamed file ``fd`` (O_TMPFILE, of the cache's disk) the name ``final``,
        its data file's: one directory entry added, where a rename from tmp/ also looks up
        and removes one there.  Linked through /proc/self/fd, which needs no capability
        (AT_EMPTY_PATH needs CAP_DAC_READ_SEARCH).  FileExistsError when ``final`` is
        taken."""
        source = f"/proc/self/fd/{fd}"
        # Any src_dir_fd makes os.link call linkat, following the link (AT_SYMLINK_FOLLOW;
        # link(2) would link the symlink itself); an absolute source path ignores it.
        try:
            os.link(source, final, src_dir_fd=fd, follow_symlinks=True)
        except FileNotFoundError:  # the first file of its fan-out directory
            os.makedirs(os.path.dirname(final), 0o700, exist_ok=True)
            os.link(source, final, src_dir_fd=fd, follow_symlinks=True)

    def install(self, new: NewFile) -> None:
        """Rename a filled temporary file into place as its data file (nothing for one
        written in place)."""
        if new.in_place:
            return
        try:
            try:
                os.replace(new.tmp, new.final)
            except FileNotFoundError:
                # The first file of this fan-out directory; another thread may be
                # creating it at the same moment.
                os.makedirs(os.path.dirname(new.final), 0o700, exist_ok=True)
                os.replace(new.tmp, new.final)
        except BaseException:
            unlink_quietly(new.tmp)
            raise

    @staticmethod
    def discard(new: NewFile) -> None:
        unlink_quietly(new.tmp)

    def write_at(self, key: bytes, offset: int, data: bytes | memoryview) -> int:
        """Write ``data`` at ``offset`` of a data file written piecemeal (created sparse when
        new), into a hole; returns the bytes this adds to the file's allocation.  They are
        counted from the blocks written, not from stat: a file system allocating late
        reports none yet, and the file's size spans the holes before the offset."""
        final = self.data_path(key)
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(final, flags, 0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(final), 0o700, exist_ok=True)
            fd = os.open(final, flags, 0o600)
        added = blocks_spanned(offset, len(data))
        try:
            view = memoryview(data)
            while view:
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written
            return added
        finally:
            os.close(fd)

    def punch_out(self, key: bytes, offset: int, length: int) -> int:
        """Free the blocks of ``length`` bytes at ``offset`` of a data file, its size kept
        (fallocate PUNCH_HOLE); returns the bytes this takes off the file's allocation, the
        blocks :meth:`write_at` counted for them.  OSError where the file system cannot."""
        fd = os.open(self.data_path(key), os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                               ctypes.c_int64(offset), ctypes.c_int64(length)) != 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))
        finally:
            os.close(fd)
        return blocks_spanned(offset, length)

    def sync(self) -> None:
        """Every byte written to the cache's file system, on the disk (syncfs(2))."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if _libc.syncfs(fd) != 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))
        finally:
            os.close(fd)

    @staticmethod
    def sync_dir(path: Path) -> None:
        """A directory's entries (a rename, an unlink in it) on the disk."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def probe_write(self) -> OSError | None:
        """Write one byte to a new file under tmp/ and remove it: the error a write to this
        disk meets now (read-only, full, I/O), or None when the disk takes it."""
        probe = os.path.join(self.tmp_dir, f"probe.{threading.get_ident()}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"\0")
            finally:
                os.close(fd)
        except OSError as exc:
            return exc
        finally:
            try:
                os.unlink(probe)
            except OSError:  # never made, or the disk refuses this too: sweep_tmp at start
                pass
        return None

    def open_data(self, key: bytes) -> int:
        """A read-only descriptor of a data file (FileNotFoundError when it is gone)."""
        return os.open(self.data_path(key), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)

    def remove_data(self, key: bytes) -> int | None:
        """Remove a data file; the bytes it held on the disk (None when it was gone).  A file
        system that allocates late may not count a fresh file's yet: the caller takes off at
        least what it accounted."""
        path = self.data_path(key)
        try:
            allocated = held_bytes(os.stat(path))
            os.unlink(path)
        except FileNotFoundError:
            return None
        return allocated

    def fan_dir_bytes_of(self, key: bytes) -> tuple[str, int]:
        """(fan-out directory name, its bytes) for the directory holding ``key``'s data."""
        fan = data_name(key)[:2]
        return fan, self.fan_bytes(fan)

    def fan_bytes(self, fan: str) -> int:
        """The bytes of the fan-out directory ``fan`` (directories grow with their entries)."""
        return allocated_bytes(os.stat(os.path.join(self.data_dir, fan)))

    # -- whole-directory walks (startup, verify) -----------------------------------------

    def sweep_tmp(self) -> int:
        """Remove fills left by a crash; returns how many."""
        removed = 0
        for entry in os.scandir(self.tmp_dir):
            unlink_quietly(entry.path)
            removed += 1
        return removed

    def iter_data_files(self) -> Iterator[tuple[str, int]]:
        """(name as :func:`data_name` gives it, bytes held on the disk) of every data file."""
        for fan in os.scandir(self.data_dir):
            if not fan.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(fan.path):
                try:
                    allocated = held_bytes(entry.stat(follow_symlinks=False))
                except FileNotFoundError:
                    continue
                yield f"{fan.name}/{entry.name}", allocated

    def remove_data_name(self, name: str) -> None:
        unlink_quietly(os.path.join(self.data_dir, name))

    def fixed_bytes(self) -> int:
        """The cache dir itself, its small files and top-level directories."""
        total = 0
        for path in (self.root, self.index_dir, self.data_dir, self.tmp_dir):
            total += allocated_bytes(os.stat(path))
        for entry in os.scandir(self.root):
            try:
                if entry.is_file(follow_symlinks=False):
                    total += allocated_bytes(entry.stat(follow_symlinks=False))
            except FileNotFoundError:  # renamed meanwhile: clean-stop.tmp at a close
                continue
        return total

    def fan_dir_bytes(self) -> dict[str, int]:
        """Bytes of each fan-out directory under data/: directories grow with their entries."""
        return {
            fan.name: allocated_bytes(fan.stat(follow_symlinks=False))
            for fan in os.scandir(self.data_dir)
            if fan.is_dir(follow_symlinks=False)
        }

    def index_bytes(self) -> int:
        """The index database, its write-ahead log and shared-memory file."""
        total = 0
        for entry in os.scandir(self.index_dir):
            try:
                total += allocated_bytes(entry.stat(follow_symlinks=False))
            except FileNotFoundError:
                continue
        return total


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
