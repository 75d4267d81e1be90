"""The index against the files on disk: what a start needs to know, and how it learns it.

After a **clean stop** the store left a record of its account (``clean-stop.json``: the bytes
its data files take, how many files are whole) and of the keys its index holds
(``present-keys.bin``, see presence.py), every byte synced to the disk first.  The next start
takes both and scans nothing: it costs the same with ten files cached or ten million.

After a **crash** (kill -9, the OOM killer, a power cut) there is no such record, and the index
and the disk may disagree: a fill in place whose record was not committed yet (records are
committed in groups) or that was cut short, a record whose data file never reached the disk.
The mount serves at once; :func:`reconcile` runs in the background, admission paused meanwhile (the
account is not known).  It streams: a million records cost some 16 MiB of arrays, not a set of
a million names.

Whether the records' checks are trusted meanwhile depends on what crashed.  Only a crash of
the **machine** (a power cut, a kernel panic, a reset) can leave a committed record whose data
file never reached the disk, and it comes back with a new boot id: then every cached file is
verified against its checksums before it is handed over, until the scrub (scrub.py) has been
over it.  A crash of the **daemon** alone (kill -9, the OOM killer, a serving process's fault;
the supervisor then starts another on the same mount) loses no byte the kernel took: the data
files read as they were written, the page cache being the file system's, and every committed
record names a data file that was whole and checked when it was written (records follow their
data).  What it loses is records not yet committed, whose data files the reconciliation finds
without one, and fills cut short, which carry neither a record nor a check mark.  So a daemon
that trusted its cache leaves ``trusted-in-boot`` (the boot id and the index's identity), and
a start after a crash in the same boot trusts the records at once, as after a clean stop: the
first epoch after such a restart hashes nothing again.  The record is taken at every start,
and left again only once the store trusts its records, so trust is only ever carried from a
daemon that had it.

``cachefs verify`` runs :func:`reconcile` with every checksum read.

INVARIANT: every data file belongs to a file record (but one a fill is writing, in place,
until it is indexed), and every record with stored chunks has its data file.
INVARIANT: a file record's stored_chunks equals its chunk records (one for a single-chunk file).
INVARIANT: used bytes (data + index + directories) <= capacity.
INVARIANT (verify_data): every stored chunk matches its checksum.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from cachefs.store.index import CacheIndex, chunk_key, data_key, database_path, split_key
from cachefs.store.layout import CacheLayout, data_name
from cachefs.store.presence import KeyFilter

if TYPE_CHECKING:
    from cachefs.store.store import CacheStore

log = logging.getLogger(__name__)

CLEAN_STOP_NAME = "clean-stop.json"
PRESENT_KEYS_NAME = "present-keys.bin"
CLEAN_STOP_FORMAT = 1
TRUSTED_BOOT_NAME = "trusted-in-boot"
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


@dataclasses.dataclass
class CheckReport:
    """What :func:`reconcile` found (and fixed, when asked)."""

    files: int = 0
    complete_files: int = 0
    chunks: int = 0
    data_bytes: int = 0
    chunks_verified: int = 0
    corrupt_chunks: int = 0
    missing_chunks: int = 0
    orphan_files: int = 0
    miscounted_files: int = 0
    ineligible_files: int = 0
    over_budget_files: int = 0
    leftover_fills: int = 0

    @property
    def problems(self) -> int:
        return self.corrupt_chunks + self.missing_chunks + self.orphan_files + self.miscounted_files


@dataclasses.dataclass(frozen=True)
class Account:
    """What a clean stop leaves for the next start to trust."""

    data_bytes: int
    complete_files: int
    admission: str  # what kept the files (admission.py describe()): reconciled if it changes
    # Whether its records' checks were trusted: not by a store that started after a crash of
    # the machine and stopped before the scrub had verified every file (its next start goes
    # on verifying them, where a clean stop would otherwise have made them trusted).
    trusted: bool = True


# -- the clean stop -----------------------------------------------------------------------------

def leave_clean_stop(layout: CacheLayout, account: Account, present: KeyFilter | None) -> None:
    """Record ``account`` (and the index's keys) for the next start, once every byte written
    is on the disk: the next start then trusts the index, its account, and the data files whose
    identity matches what their records say."""
    if present is not None:
        present.save(layout.root / PRESENT_KEYS_NAME)
    layout.sync()
    marker = layout.root / CLEAN_STOP_NAME
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": CLEAN_STOP_FORMAT, **dataclasses.asdict(account)}))
    os.replace(tmp, marker)
    layout.sync_dir(layout.root)


def take_clean_stop(layout: CacheLayout) -> tuple[Account, KeyFilter | None] | None:
    """The account a clean stop left, and the keys' filter, removed from the disk (durably, so
    that a crash from now on is known at the next start); None after a crash or on a first
    start."""
    marker = layout.root / CLEAN_STOP_NAME
    try:
        info = json.loads(marker.read_text())
        account = Account(int(info["data_bytes"]), int(info["complete_files"]),
                          str(info["admission"]), info.get("trusted", True) is True)
        if info["format"] != CLEAN_STOP_FORMAT:
            raise ValueError(f"format {info['format']}")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("cache %s: the record of its last stop does not read (%s): reconciling",
                    layout.root, exc)
        account = None
    present = KeyFilter.load(layout.root / PRESENT_KEYS_NAME)
    for name in (CLEAN_STOP_NAME, PRESENT_KEYS_NAME):
        try:
            os.unlink(layout.root / name)
        except FileNotFoundError:
            pass
    layout.sync_dir(layout.root)
    return None if account is None else (account, present)


# -- a crash of the daemon alone ----------------------------------------------------------------

def _trust_identity(layout: CacheLayout) -> str | None:
    """This boot, and the index the cache's records are in (another index, a cache dir put
    back from a copy, is not the one trusted): None when either cannot be read."""
    try:
        boot = BOOT_ID_PATH.read_text().strip()
        index = os.stat(database_path(layout.index_dir))
    except OSError:
        return None
    return f"{boot} {index.st_dev} {index.st_ino}" if boot else None


def leave_trusted_boot(layout: CacheLayout) -> None:
    """Record that the records are trusted, in this boot (see the module's docstring).  Not
    synced: lost in a power cut, it costs a start the trust the new boot takes anyway."""
    identity = _trust_identity(layout)
    if identity is None:
        return
    marker = layout.root / TRUSTED_BOOT_NAME
    tmp = marker.with_suffix(".tmp")
    try:
        tmp.write_text(identity)
        os.replace(tmp, marker)
    except OSError as exc:  # the next start after a crash verifies, as after a power cut
        log.warning("cache %s: the record of its trust could not be written (%s)",
                    layout.root, exc.strerror or exc)


def take_trusted_boot(layout: CacheLayout) -> bool:
    """Whether the daemon before this one trusted the records in this boot, the record of it
    removed: a crash of this one before it trusts them is not taken for one after."""
    marker = layout.root / TRUSTED_BOOT_NAME
    try:
        recorded = marker.read_text()
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError):
        recorded = None
    try:
        os.unlink(marker)
    except FileNotFoundError:
        pass
    except OSError:
        return False  # it would be taken again at the next start
    return recorded is not None and recorded == _trust_identity(layout)


# -- reconciling --------------------------------------------------------------------------------

def _prefix(name: str) -> int | None:
    """The first 64 bits of a data file's name (``ab/cdef...``, 128 bits in hex); None for a
    name no data file of ours has (put there by something else)."""
    if len(name) != 33 or name[2] != "/":
        return None
    try:
        return int(name[:2] + name[3:17], 16)
    except ValueError:
        return None


def _sorted_array(values: array.array) -> array.array:
    return array.array("Q", sorted(values))


def _contains(sorted_values: array.array, value: int) -> bool:
    at = bisect.bisect_left(sorted_values, value)
    return at < len(sorted_values) and sorted_values[at] == value


def reconcile(store: CacheStore, *, fix: bool, verify_data: bool
              ) -> tuple[CheckReport, KeyFilter, list[bytes]]:
    """Compare the index with the files on disk; with ``fix``, repair what differs.

    Returns the report, a filter of the file keys kept, and (when the store is over its
    capacity, else none) the keys kept, for the caller to trim.  Safe beside readers, not beside
    writers: admission must be paused (a file dropped meanwhile by a reader is at worst
    counted once more than it is).
    """
    layout: CacheLayout = store.layout
    index: CacheIndex = store.index
    report = CheckReport(leftover_fills=layout.sweep_tmp() if fix else 0)
    index.flush()

    # The data files on disk: the first 64 bits of each name, and their bytes in all.
    on_disk = array.array("Q")
    disk_bytes = 0
    for name, allocated in layout.iter_data_files():
        prefix = _prefix(name)
        if prefix is not None:  # (anything else is an orphan, below)
            on_disk.append(prefix)
        disk_bytes += allocated
        store.stop_if_closing()
    on_disk = _sorted_array(on_disk)
    # Over budget (it shrank since the last run): the keys kept are wanted, to trim.
    over_budget = store.exceeds_capacity(disk_bytes)

    # Chunk records, by file (large files only: a file of one chunk has none).
    chunks_by_file: dict[bytes, list[int]] = {}
    files = 0
    for batch in index.batches():
        store.stop_if_closing()
        for key, _raw in batch:
            path, number = split_key(key)
            if number is None:
                files += 1
            else:
                chunks_by_file.setdefault(path, []).append(number)

    present = KeyFilter(2 * files)
    kept = array.array("Q")
    kept_keys: list[bytes] = []
    forgotten_bytes = 0
    for batch in index.batches():
        store.stop_if_closing()
        for key, raw in batch:
            if split_key(key)[1] is not None:
                continue
            record = index.file_record(raw)
            count = -(-record.attr.size // layout.chunk_bytes) or 1
            numbers = ([0] if record.stored_chunks else []) if count == 1 \
                else chunks_by_file.pop(key, [])
            name = data_name(data_key(key, record.version))
            healthy = True
            if len(numbers) != record.stored_chunks or any(n >= count for n in numbers):
                report.miscounted_files += 1
                healthy = False
            if numbers and not _contains(on_disk, _prefix(name)):
                report.missing_chunks += len(numbers)
                healthy = False
            elif verify_data:
                for number in numbers:
                    if store.chunk_intact(key, record, number):
                        report.chunks_verified += 1
                    else:
                        report.corrupt_chunks += 1
                        healthy = False
            eligible = store.admission.keeps_cached(os.fsdecode(key))
            report.ineligible_files += not eligible
            if fix and not (healthy and eligible):
                forgotten_bytes += store.forget_record(key, numbers, record.version,
                                                       multi_chunk=count > 1)
                continue
            report.files += 1
            report.chunks += len(numbers)
            report.complete_files += record.stored_chunks >= count
            kept.append(_prefix(name))
            present.add(key)
            if over_budget:
                kept_keys.append(key)
    for key, numbers in chunks_by_file.items():  # chunk records of no file record
        report.orphan_files += len(numbers)
        if fix:
            for number in numbers:
                index.delete(chunk_key(key, number))
    del on_disk
    kept = _sorted_array(kept)
    orphan_bytes = 0
    for name, allocated in layout.iter_data_files():
        prefix = _prefix(name)
        if prefix is None or not _contains(kept, prefix):
            report.orphan_files += 1
            if fix:
                layout.remove_data_name(name)
                orphan_bytes += allocated
    if fix:
        index.flush()
    report.data_bytes = disk_bytes - forgotten_bytes - orphan_bytes
    return report, present, kept_keys
