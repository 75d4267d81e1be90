"""Remote attributes, remembered for --revalidate seconds.

Every lookup, stat and open needs the remote file's attributes, and each costs
a round trip to the NFS server.  They are kept here for ``revalidate_seconds``
(``None``: for ever, the dataset is immutable).  The interval is the promise:
once it has passed since a change on the remote, no old bytes are served.

A listing of a directory brings its entries' attributes in the same round trip
(NFS READDIRPLUS), so a directory is refreshed as a whole: by `ls` through the mount,
ahead of a hinted epoch (:meth:`AttrCache.refresh_directory_of`), and in the background
once its names are looked up one by one (an epoch's first reads, or its attributes all
due): one listing then stands in for a round trip per file.

When the remote cannot answer (timeout, EIO), the last known attributes, or
those recorded with a cached file, are used instead: a training job keeps
reading its cached files through a remote outage.  When the remote answers
that a file is gone (ENOENT), it is gone.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import struct
import threading
import time
from collections.abc import Callable

from cachefs.attr import Attr
from cachefs.errors import RemoteUnavailable
from cachefs.remote.remote import Remote

log = logging.getLogger(__name__)

# Attributes remembered at most (about 200 bytes each: 40 MiB).  A file the kernel holds keeps
# its attributes in its node as well (mirror/nodes.py); these are for the names it does not
# hold yet: a listing's, a hint's.
DEFAULT_MAX_ENTRIES = 200_000
# An entry: mode, size, uid, gid, nlink, atime, mtime, ctime, when it was fetched (the
# monotonic clock) and whether it came from a listing made for walked names and has not
# been used since (LISTED_UNUSED), packed: a fifth of the objects an Attr and a tuple take.
_ENTRY = struct.Struct("<IQIIIqqqdB")
USED, LISTED_UNUSED = 0, 1
_USED_FLAG = bytes([USED])
# How long the kernel may keep entries and attributes that never change (--revalidate never).
IMMUTABLE_KERNEL_SECONDS = 86400.0
# Past its bound the cache drops its oldest entries, this share of the bound at a time: a
# few at once, since a dict's oldest are found by skipping the slots dropped before them
# (one by one would skip them on every insert), but few, since an entry dropped unused comes
# back as a round trip.  A tenth at a time, a shuffled pass over 0.1 % more names than the
# bound looked a tenth of them up on the remote again every pass; a thousandth, a quarter of
# a percent (simulated, 100,101 names through 100,000), for 260 ns more per insert (a
# million entries, 938 ns against 674).
TRIM_SHARE = 1 / 1000
# Names of a listing remembered per turn of the lock.
LISTING_SLICE = 4096
# Names of one directory looked up on the remote one at a time, within an interval, before
# the directory is listed in the background: a walk through it (a first epoch, or one whose
# attributes are all due) then costs one listing and a few round trips instead of one per
# name, while a few stats in a huge directory list nothing.  A listing costs about what
# 1/20 of its names' lookups would (5 us of CPU a name against 100 and a round trip).
LIST_AFTER_LOOKUPS = 8
LISTED_NAMES_MAX = 4096
# A listing pays only when the names it brings are looked up while remembered, enough of
# them to outweigh what listing the others cost.  What a name listed costs against a name
# looked up on its own depends on the remote, so both are measured (ListingCosts): on a
# local disk a listing stats each name as a lookup would and saves only what surrounds the
# stat (behind the test emulator without latency a name listed took 0.9 of a name looked
# up, in wall time); on NFS a listing's names come with their attributes
# (READDIRPLUS), a few round trips per thousand names, where each lookup is a round trip
# (on the EFS-like remote, a pass over 20,000 cached files outlasting --revalidate 1:
# 8,370 - 8,551 files/s at 100 us of daemon CPU per file listing its directories, 5,132 -
# 5,185 at 143 - 145 declining them below half of their names used).  A share under that
# ratio is a dataset of more names than --attr-cache-entries read in a random order (a
# million files on a local disk: listing a directory after its eighth lookup brought 1,000
# names a pass used a fifth of, 26 % of the daemon's time in a steady pass), or a pass over
# a sample of the files.  Below it a walked directory is still listed now and then,
# to see whether listings pay again (a pass over a smaller set, say): once as many names
# were looked up one by one since the last listing as that listing brought.  Probes so cost
# at most a name listed per name looked up, a twentieth of what the lookups cost, whatever
# the size of the directories, and come the sooner the faster names are looked up.  Listing
# one in 16 walked directories instead cost 2 names listed per lookup where every directory
# of 1,000 names is walked each interval (300,000 files in 300 directories, --revalidate 2),
# and came only as often as directories were decided on (once per directory and interval).
# Until both costs are measured, half the names must be used; measured, the share is kept
# within these bounds (a listing whose names go nearly all unused never pays).
LISTING_PAYS_SHARE = 0.5
LISTING_PAYS_SHARE_MIN, LISTING_PAYS_SHARE_MAX = 0.02, 0.9
# Weights of the newest sample in the costs' moving averages: lookups over about as many
# names as the tally's least (LISTING_TALLY_MIN), listings over the last 16 or so (16,000
# names of directories of 1,000).
# A lookup is a round trip or, where the remote's client has the attributes still (NFS's
# actimeo), a few microseconds: the average spans both.
LOOKUP_COST_WEIGHT = 1 / 4096
LISTING_COST_WEIGHT = 1 / 16
# Listed names counted (used, or dropped or due unused) before the share is trusted, and at
# most: beyond that both counts are halved, so the share follows what the passes do now.
LISTING_TALLY_MIN = 4096
LISTING_TALLY_MAX = 65536


class RecentDirectories(dict):
    """directory -> when it was last listed or decided on, or how often it was walked;
    forgotten all at once at ``limit`` entries.  A directory forgotten is only listed or
    decided on again: these maps steer work, they never answer a lookup."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, directory: str, value: float) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[directory] = value

    def within(self, directory: str, now: float, ttl: float | None) -> bool:
        """Whether ``directory``'s time is less than ``ttl`` old (``None``: for ever)."""
        when = self.get(directory)
        return when is not None and (ttl is None or now - when < ttl)


class ListingCosts:
    """Seconds (wall time: a reader waits for a lookup whatever keeps it, a round trip or
    the disk) a name costs looked up on the remote on its own and listed in the background,
    as moving averages; the share of a listing's names that must be used for it to pay.

    Thread safety: updated by any thread without a lock; a lost update only delays the
    average by a sample."""

    def __init__(self) -> None:
        self.lookup_seconds: float | None = None
        self.listed_name_seconds: float | None = None
        self._lookups = self._listings = 0

    def count_lookup(self, seconds: float) -> None:
        self._lookups += 1
        self.lookup_seconds = _averaged(self.lookup_seconds, seconds,
                                        max(LOOKUP_COST_WEIGHT, 1 / self._lookups))

    def count_listing(self, seconds: float, names: int) -> None:
        if names:
            self._listings += 1
            self.listed_name_seconds = _averaged(self.listed_name_seconds, seconds / names,
                                                 max(LISTING_COST_WEIGHT, 1 / self._listings))

    @property
    def pays_share(self) -> float:
        """A listing pays when more than this share of its names are used: a name listed
        costs this share of a name looked up."""
        lookup, listed = self.lookup_seconds, self.listed_name_seconds
        if not lookup or listed is None:
            return LISTING_PAYS_SHARE
        return min(LISTING_PAYS_SHARE_MAX, max(LISTING_PAYS_SHARE_MIN, listed / lookup))


def _averaged(average: float | None, sample: float, weight: float) -> float:
    """The moving average with ``sample`` in; the plain mean of the first 1 / weight."""
    return sample if average is None else average + (sample - average) * weight


class AttrCache:
    """Attributes by path relative to BACKING.

    Thread safety: ``_lock`` guards ``_entries``, ``dropped``, ``_listed``, ``_listing``,
    ``_walked``, ``_to_list``, ``_names_listed``, ``_declined`` and the listing tally (a leaf
    lock, never held across a remote call or a wait).  Listings in the background run on
    one thread at a time, started when there is one to make.
    """

    def __init__(
        self,
        remote: Remote,
        revalidate_seconds: float | None,
        recorded_attr: Callable[[str], Attr | None],
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self._remote = remote
        self._ttl = revalidate_seconds
        self._recorded_attr = recorded_attr
        self._max_entries = max_entries
        self._lock = threading.Lock()
        # path -> (attr, monotonic time it was fetched); insertion order is age order.
        # packed _ENTRY (an Attr and the time only for times that do not pack)
        self._entries: dict[str, bytes | tuple[Attr, float]] = {}
        # directory -> when its last listing started; directories being listed now.
        self._listed = RecentDirectories(max_entries)
        self._listing: dict[str, threading.Event] = {}
        # directory -> names looked up on the remote one by one since it was last listed;
        # directories waiting for the background listing, and whether its thread runs.
        self._walked = RecentDirectories(max_entries)
        # Directories whose names the kernel has without attributes (names_listed).
        self._names_listed = RecentDirectories(LISTED_NAMES_MAX)
        self._to_list: dict[str, None] = {}
        self._lister_running = False
        # Names of background listings looked up while remembered, and dropped or due
        # unused; names looked up one by one since the last background listing, and the
        # names that listing brought (see LISTING_PAYS_SHARE).
        self._listed_used = 0
        self._listed_unused = 0
        self._lookups_since_listing = 0
        self._last_listing_names = 0
        # directory -> when its background listing was declined (not listed again by its
        # walk within the interval either: one decision per directory and interval).
        self._declined = RecentDirectories(max_entries)
        self.costs = ListingCosts()
        # Entries dropped for room since the start: a bound below the names a pass uses
        # shows here (each a round trip at the name's next lookup).
        self.dropped = 0

    def get(self, relpath: str) -> Attr:
        """The file's attributes, fetched from the remote when older than the interval."""
        return self.get_fresh(relpath)[0]

    def get_fresh(self, relpath: str) -> tuple[Attr, float]:
        """``get``, with the seconds the attributes stay within the interval (what the kernel
        may cache them for): 0 for attributes served past it (the remote unavailable)."""
        now = time.monotonic()
        raw = self._entries.get(relpath)
        entry = None if raw is None else _unpack(raw)
        if entry is not None:
            ttl = self._ttl
            left = IMMUTABLE_KERNEL_SECONDS if ttl is None else ttl - (now - entry[1])
            if left > 0 or not self._remote.available:
                if type(raw) is bytes and raw[-1] == LISTED_UNUSED:
                    self._count_use(relpath, raw)
                return entry[0], max(0.0, left)
        elif self._ttl is None:
            recorded = self._recorded_attr(relpath)
            if recorded is not None:
                self._remember(relpath, recorded, now)
                return recorded, IMMUTABLE_KERNEL_SECONDS
        if relpath and self._remote.available:
            directory = relpath.rpartition("/")[0]
            if directory in self._names_listed:
                with self._lock:
                    self._names_listed.pop(directory, None)
                self._refresh_directory(directory)
                found = self.peek_fresh(relpath)
                if found is not None:
                    return found
            self._count_walk(directory, now)
        try:
            asked = time.monotonic()
            attr = self._remote.lstat(relpath)
            answered = time.monotonic()
            self.costs.count_lookup(answered - asked)
        except FileNotFoundError:
            self.forget(relpath)
            raise
        except (RemoteUnavailable, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno != errno.EIO:
                raise  # ESTALE, EACCES, ...: the remote's answer, passed on
            fallback = entry[0] if entry is not None else self._recorded_attr(relpath)
            if fallback is None:
                raise
            return fallback, 0.0
        self._remember(relpath, attr, now)
        if self._ttl is None:
            return attr, IMMUTABLE_KERNEL_SECONDS
        return attr, max(0.0, self._ttl - (answered - now))

    def peek(self, relpath: str) -> Attr | None:
        """The attributes if memory holds them within the interval; never a round trip."""
        found = self.peek_fresh(relpath)
        return None if found is None else found[0]

    def peek_fresh(self, relpath: str) -> tuple[Attr, float] | None:
        """``peek`` with ``fresh_for``, the entry read once (a listing's path, per name)."""
        raw = self._entries.get(relpath)
        if raw is None:
            return None
        attr, fetched = _unpack(raw)
        if self._ttl is None:
            return attr, IMMUTABLE_KERNEL_SECONDS
        left = self._ttl - (time.monotonic() - fetched)
        return (attr, left) if left > 0 else None

    def list_directory(self, relpath: str, *, tallied: bool = False) -> list[tuple[str, int]]:
        """(name, file type bits) of each entry of the directory, from the remote; the
        attributes that come with the listing are remembered for the interval.
        ``tallied``: a background listing for walked names, whose use is counted."""
        flag = LISTED_UNUSED if tallied else USED
        started = time.monotonic()
        listing = self._remote.listdir(relpath)
        prefix = f"{relpath}/" if relpath else ""
        entries = self._entries
        # In slices, so that a huge directory does not hold up the lookups remembering
        # their own attributes meanwhile.
        for first in range(0, len(listing), LISTING_SLICE):
            with self._lock:
                for name, _, attr in listing[first:first + LISTING_SLICE]:
                    if attr is None:
                        continue
                    path = prefix + name
                    known = entries.pop(path, None)
                    if known is not None and _fetched(known) >= started:
                        entries[path] = known  # a lookup's, newer than the listing: kept
                    else:
                        if known is not None:
                            self._count_unused_locked(known)
                        entries[path] = _pack(attr, started, flag)
                self._trim_locked()
        with self._lock:
            self._listed.put(relpath, started)
            self._walked.pop(relpath, None)
            if tallied:
                self._last_listing_names = len(listing)
        if tallied:
            self.costs.count_listing(time.monotonic() - started, len(listing))
        return [(name, kind) for name, kind, _ in listing]

    def refresh_directory_of(self, relpath: str) -> bool:
        """Before ``relpath``'s attributes are needed (a hinted file): if memory has none
        within the interval, list its directory, which refreshes every name in it in one
        round trip.  A directory is listed once per interval at most, and by one caller at
        a time: another caller meanwhile waits for that listing.  True when this call
        listed it.  Never raises: whatever the listing could not refresh is looked up name
        by name when it is needed."""
        if self.peek(relpath) is not None or not self._remote.available:
            return False
        return self._refresh_directory(relpath.rpartition("/")[0])

    def _refresh_directory(self, directory: str, tallied: bool = False) -> bool:
        # A listing follows symlinks: only a directory reached through directories.
        if not self._reached_through_directories(directory):
            return False
        now = time.monotonic()
        with self._lock:
            underway = self._listing.get(directory)
            if underway is None:
                if self._listed.within(directory, now, self._ttl):
                    return False  # listed within the interval: the name was not in it
                underway = self._listing[directory] = threading.Event()
                mine = True
            else:
                mine = False
        if not mine:
            underway.wait(self._remote.timeout_seconds)
            return False
        try:
            self.list_directory(directory, tallied=tallied)
            return True
        except (RemoteUnavailable, OSError) as exc:
            log.debug("listing %r to refresh its attributes failed: %s", directory, exc)
            return False
        finally:
            with self._lock:
                del self._listing[directory]
            underway.set()

    # -- directories walked name by name: listed in the background ---------------------------

    def _count_walk(self, directory: str, now: float) -> None:
        """One more name of ``directory`` looked up on the remote on its own; the
        LIST_AFTER_LOOKUPS-th since its last listing has the directory listed."""
        with self._lock:
            self._lookups_since_listing += 1
            if directory in self._to_list or directory in self._listing \
                    or self._listed.within(directory, now, self._ttl) \
                    or self._declined.within(directory, now, self._ttl):
                return
            walked = self._walked.get(directory, 0) + 1
            if walked < LIST_AFTER_LOOKUPS:
                self._walked.put(directory, walked)
                return
            self._walked.pop(directory, None)
            if not self._may_list_locked():
                # Declined now, not on the lister's thread: while listings do not pay (a
                # shuffled pass over more names than are remembered), nearly every walked
                # directory is declined, and a thread started for each decision cost one
                # thread per 30 files read (200,000 cached files, 8 readers).
                self._declined.put(directory, now)
                return
            self._to_list[directory] = None
            if self._lister_running:
                return
            self._lister_running = True
        threading.Thread(target=self._list_walked, name="attr-lister", daemon=True).start()

    def names_listed(self, directory: str) -> None:
        """The kernel was given ``directory``'s names without their attributes (a walk that
        may not stat them, ``find``).  If it does stat them (``ls -l``), the first name
        looked up without attributes in memory has the whole directory listed with them,
        the lookups meanwhile waiting for that listing, not asking name by name."""
        with self._lock:
            self._names_listed.put(directory, 0.0)

    def _list_walked(self) -> None:
        while True:
            with self._lock:
                if not self._to_list:
                    self._lister_running = False
                    return
                directory = next(iter(self._to_list))
                del self._to_list[directory]
                # Decided here, not when it was queued: the tally is the newest now.
                if not self._listings_pay_locked():
                    self._declined.put(directory, time.monotonic())
                    continue
            try:
                self._refresh_directory(directory, tallied=True)
            except Exception:  # the names are then looked up one by one, as before
                log.exception("listing %r in the background failed", directory)

    # -- whether background listings pay ---------------------------------------------------

    def _may_list_locked(self) -> bool:
        """Whether a walked directory is to be listed: while listings pay, and otherwise once
        the names looked up one by one since the last listing outnumber the names it brought
        (each directory is decided on once per interval)."""
        return self.listings_pay or self._lookups_since_listing >= self._last_listing_names

    def _listings_pay_locked(self) -> bool:
        """The same, asked again as the lister takes the directory (the tally is newer
        then); a yes starts the count of lookups to the next probe."""
        if not self._may_list_locked():
            return False
        self._lookups_since_listing = 0
        return True

    def _count_use(self, relpath: str, raw: bytes) -> None:
        with self._lock:
            if self._entries.get(relpath) is raw:  # not replaced or dropped meanwhile
                self._entries[relpath] = raw[:-1] + _USED_FLAG  # its place in age order kept
                self._listed_used += 1
                self._halve_tally_locked()

    def _count_unused_locked(self, raw: bytes | tuple[Attr, float]) -> None:
        if type(raw) is bytes and raw[-1] == LISTED_UNUSED:
            self._listed_unused += 1
            self._halve_tally_locked()

    def _halve_tally_locked(self) -> None:
        if self._listed_used + self._listed_unused > LISTING_TALLY_MAX:
            self._listed_used //= 2
            self._listed_unused //= 2

    @property
    def listings_pay(self) -> bool:
        """Whether enough of the names background listings brought were used to pay for
        listing the others (``costs.pays_share``; or too few were counted yet to say)."""
        used, unused = self._listed_used, self._listed_unused
        return used + unused < LISTING_TALLY_MIN \
            or used >= self.costs.pays_share * (used + unused)

    @property
    def listing_used_share(self) -> float | None:
        """The share of the names background listings brought that were used (recent ones
        weigh more); None before any was counted."""
        used, unused = self._listed_used, self._listed_unused
        return used / (used + unused) if used + unused else None

    def _reached_through_directories(self, directory: str) -> bool:
        """Whether every component of ``directory`` is a directory (no symlink, which could
        lead out of the tree); False too when the remote cannot say."""
        done = ""
        try:
            for part in directory.split("/") if directory else ():
                done = f"{done}/{part}" if done else part
                if not self.get(done).is_dir:
                    return False
        except (RemoteUnavailable, OSError):
            return False
        return True

    def put(self, relpath: str, attr: Attr) -> None:
        """Remember attributes learned elsewhere (a fresh fstat of the open file)."""
        self._remember(relpath, attr, time.monotonic())

    def forget(self, relpath: str) -> None:
        with self._lock:
            self._entries.pop(relpath, None)

    def _remember(self, relpath: str, attr: Attr, now: float) -> None:
        with self._lock:
            self._remember_locked(relpath, attr, now)

    def _remember_locked(self, relpath: str, attr: Attr, now: float) -> None:
        known = self._entries.pop(relpath, None)
        if known is not None:
            self._count_unused_locked(known)  # due: looked up on the remote again
        self._entries[relpath] = _pack(attr, now)
        self._trim_locked()

    def _trim_locked(self) -> None:
        over = len(self._entries) - self._max_entries
        if over > 0:
            # The oldest, the first to fall due: as many as a listing's slice brought over
            # the bound, and a few more (TRIM_SHARE).
            batch = max(1, int(self._max_entries * TRIM_SHARE))
            oldest = list(itertools.islice(self._entries, over - 1 + batch))
            for old in oldest:
                self._count_unused_locked(self._entries.pop(old))
            self.dropped += len(oldest)

    @property
    def interval(self) -> float | None:
        """Seconds attributes are trusted for (``--revalidate``); None: for ever."""
        return self._ttl

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def max_entries(self) -> int:
        return self._max_entries


_new_tuple = tuple.__new__


def _pack(attr: Attr, fetched: float, flag: int = USED) -> bytes | tuple[Attr, float]:
    try:
        return _ENTRY.pack(attr.mode, attr.size, attr.uid, attr.gid, attr.nlink,
                           attr.atime_ns, attr.mtime_ns, attr.ctime_ns, fetched, flag)
    except struct.error:  # a time past 2262 (a broken clock): kept as it is
        return attr, fetched


def _unpack(raw: bytes | tuple[Attr, float]) -> tuple[Attr, float]:
    if type(raw) is tuple:
        return raw
    mode, size, uid, gid, nlink, atime, mtime, ctime, fetched, _ = _ENTRY.unpack(raw)
    return _new_tuple(Attr, (mode, size, uid, gid, nlink, atime, mtime, ctime)), fetched


def _fetched(raw: bytes | tuple[Attr, float]) -> float:
    if type(raw) is tuple:
        return raw[1]
    return _FETCHED.unpack_from(raw, _ENTRY.size - 9)[0]


_FETCHED = struct.Struct("<d")


def relpath_of(fuse_path: str) -> str:
    """FUSE's ``/a/b`` as ``a/b``; the root is ``""``."""
    return fuse_path.lstrip("/")


def relpath_key(relpath: str) -> bytes:
    return os.fsencode(relpath)
