"""Mount settings: defaults, the TOML config file, command-line overrides, validation.

Every problem is a :class:`UsageError` whose message is one line naming what is
wrong and what to do; the CLI prints it and exits non-zero before anything is
mounted or touched in the cache dir.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachefs.address import MetricsAddress
from cachefs.errors import UsageError
from cachefs.limits import memory_limit_bytes
from cachefs.peer.members import PeerList, parse_address
from cachefs.remote.attrcache import DEFAULT_MAX_ENTRIES as DEFAULT_ATTR_CACHE_ENTRIES
from cachefs.service.affinity import parse_cpus
from cachefs.sizes import format_bytes, parse_size

DEFAULT_METRICS_PORT = 9477
DEFAULT_REVALIDATE_SECONDS = 60.0
DEFAULT_REMOTE_TIMEOUT_SECONDS = 30.0
DEFAULT_PREFETCH_CONCURRENCY = 32
# Staging's default where memory allows (service/memory.py sizes it from the memory limit).
DEFAULT_STAGING_BYTES = 512 * 2**20
# Staged files are memory files the kernel can neither write back nor drop: a staging area
# near the memory the daemon may use (its cgroup's limit, or the machine's) would have it
# killed by the OOM killer as hints fill it, and every read through the mount fail after.
MAX_STAGING_SHARE = 0.5
# A peer on the cluster's network answers in a millisecond; one that takes seconds is
# better skipped for the remote.
DEFAULT_PEER_TIMEOUT_SECONDS = 2.0
# Below this the index and its write-ahead log leave no room for data.
MIN_CACHE_BYTES = 4 * 2**20


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a mount needs, validated.  Paths are absolute."""

    backing: Path
    mountpoint: Path
    cache_dir: Path
    cache_size_bytes: int
    fraction: float = 1.0
    seed: int = 0
    metrics_addr: MetricsAddress | None = MetricsAddress("127.0.0.1", DEFAULT_METRICS_PORT)
    # None means "never": trust the cache, the dataset is immutable.
    revalidate_seconds: float | None = DEFAULT_REVALIDATE_SECONDS
    remote_timeout_seconds: float = DEFAULT_REMOTE_TIMEOUT_SECONDS
    prefetch_concurrency: int = DEFAULT_PREFETCH_CONCURRENCY
    # Attributes of names the kernel does not hold, remembered at most (about 200 bytes each).
    attr_cache_entries: int = DEFAULT_ATTR_CACHE_ENTRIES
    # Cached files whose backing file stays registered with the kernel between opens (None:
    # 65,536 with passthrough, what the kernel's memory allows; a share of our descriptors
    # without it).
    held_files: int | None = None
    # Memory for prefetched files the cache does not keep (None: sized from the memory the
    # daemon may use, service/memory.py).
    staging_bytes: int | None = None
    allow_other: bool = False
    # Which files the kernel reads itself (FUSE passthrough) where it can: "auto", local
    # files and, for a miss, the remote's own file; "local", local files only (every byte
    # from the remote through the daemon, bounded by --remote-timeout); "off", none (the
    # daemon serves every read).
    passthrough: str = "auto"
    # Processes that copy and hash the fills of readers' files (remote/fillprocess.py); 0:
    # threads of the daemon.
    fill_processes: int = 0
    # The CPUs the serving process's threads keep to (service/affinity.py): "auto", one of
    # those it may run on; "all"; or the CPUs named.
    cpus: str | frozenset[int] = "auto"
    log_file: Path | None = None
    runtime_dir: Path | None = None
    # The cluster tier (cachefs/peer): off unless peers are given.
    peers: PeerList | None = None
    peer_listen: str | None = None
    peer_address: str | None = None  # this node as --peers lists it (default: peer_listen)
    peer_secret_file: Path | None = None
    peer_timeout_seconds: float = DEFAULT_PEER_TIMEOUT_SECONDS


# Config file keys are the flag names with "_" for "-"; each maps to a parser.
def _path(value: Any) -> Path:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty path string")
    return Path(os.path.abspath(os.path.expanduser(value)))


def _number(value: Any, kind: type, problem: str) -> Any:
    """``kind(value)``, or a ValueError that says what was expected instead of Python's text."""
    try:
        # A config file's true is no number, and its 1.5 no whole one (int() would take 1).
        if isinstance(value, bool) or (kind is int and isinstance(value, float)
                                       and not value.is_integer()):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{value!r} {problem}") from None


def _fraction(value: Any) -> float:
    problem = "is not a fraction between 0 and 1"
    number = _number(value, float, problem)
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{value!r} {problem}")
    return number


def _seed(value: Any) -> int:
    problem = "is not a seed between 0 and 2**64-1"
    number = _number(value, int, problem)
    if not 0 <= number < 2**64:
        raise ValueError(f"{value!r} {problem}")
    return number


def _cache_size(value: Any) -> int:
    size = parse_size(value)
    if size < MIN_CACHE_BYTES:
        raise ValueError(f"{value!r} is below the minimum of 4MiB")
    return size


def _staging_size(value: Any) -> int:
    size = parse_size(value)
    limit = memory_limit_bytes()
    if size > limit * MAX_STAGING_SHARE:
        raise ValueError(f"{value!r} is more than half the memory this daemon may use "
                         f"({format_bytes(limit)}); staged files stay in memory until read")
    return size


def _revalidate(value: Any) -> float | None:
    if isinstance(value, str) and value.strip().lower() == "never":
        return None
    problem = "is neither a number of seconds >= 0 nor 'never'"
    number = _number(value, float, problem)
    if not 0 <= number < math.inf:
        raise ValueError(f"{value!r} {problem}")
    return number


def _positive_seconds(value: Any) -> float:
    problem = "is not a positive number of seconds"
    number = _number(value, float, problem)
    if not 0 < number < math.inf:
        raise ValueError(f"{value!r} {problem}")
    return number


def _whole_number(low: int, high: int) -> Callable[[Any], int]:
    """A parser of a whole number from ``low`` to ``high``."""
    problem = f"is not a whole number between {low:,} and {high:,}"

    def parse(value: Any) -> int:
        number = _number(value, int, problem)
        if not low <= number <= high:
            raise ValueError(f"{value!r} {problem}")
        return number

    return parse


_entries = _whole_number(1000, 100_000_000)
MAX_HELD_FILES = 10_000_000
_held_files = _whole_number(64, MAX_HELD_FILES)
_concurrency = _whole_number(1, 1024)
_processes = _whole_number(0, 64)


PASSTHROUGH_MODES = ("auto", "local", "off")


def _passthrough(value: Any) -> str:
    text = str(value).strip().lower() if isinstance(value, str) else value
    if text not in PASSTHROUGH_MODES:
        raise ValueError(f"{value!r} is none of 'auto', 'local' and 'off'")
    return text


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"{value!r} is not true or false")


def parse_metrics_addr(value: Any) -> MetricsAddress | None:
    """``HOST:PORT``, ``:PORT``, ``PORT`` or ``0`` (metrics off).  Port 0 picks a free port."""
    text = str(value).strip()
    if text in ("0", "", "off", "none"):
        return None
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{text!r} is not HOST:PORT") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    return MetricsAddress(host, port)


PARSERS = {
    "backing": _path,
    "mountpoint": _path,
    "cache_dir": _path,
    "cache_size": _cache_size,
    "fraction": _fraction,
    "seed": _seed,
    "metrics_addr": parse_metrics_addr,
    "revalidate": _revalidate,
    "remote_timeout": _positive_seconds,
    "prefetch_concurrency": _concurrency,
    "attr_cache_entries": _entries,
    "held_files": _held_files,
    "staging_size": _staging_size,
    "allow_other": _bool,
    "passthrough": _passthrough,
    "fill_processes": _processes,
    "cpus": parse_cpus,
    "log_file": _path,
    "runtime_dir": _path,
    "peers": PeerList.parse,
    "peer_listen": parse_address,
    "peer_address": parse_address,
    "peer_secret_file": _path,
    "peer_timeout": _positive_seconds,
}

# Config key -> Settings field, where the field name carries the unit.
FIELD_FOR_KEY = {
    "cache_size": "cache_size_bytes",
    "revalidate": "revalidate_seconds",
    "remote_timeout": "remote_timeout_seconds",
    "staging_size": "staging_bytes",
    "peer_timeout": "peer_timeout_seconds",
}


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The raw settings in a TOML file, keys checked against the known ones."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"config file {path} does not exist") from None
    except PermissionError:
        raise UsageError(f"config file {path} is not readable by this user") from None
    except IsADirectoryError:
        raise UsageError(f"config file {path} is a directory, not a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"config file {path} is not valid TOML: {exc}") from None
    # Keys are the flag names, spelt cache-size or cache_size as the writer prefers.
    settings: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in PARSERS:
            known = ", ".join(sorted(PARSERS))
            raise UsageError(f"config file {path}: unknown setting {key!r} (known: {known})")
        if name in settings:
            raise UsageError(f"config file {path}: {key!r} is set twice")
        settings[name] = value
    return settings


def build_settings(raw: dict[str, Any], *, config_file: str | None = None,
                   from_file: frozenset[str] = frozenset()) -> Settings:
    """Parse and check ``raw`` (config file values overridden by flags) into Settings.

    ``from_file`` names the keys whose values came from ``config_file``, so an
    error points at the file or at the flag, wherever the bad value was written.
    """
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if value is None:
            continue
        try:
            values[FIELD_FOR_KEY.get(key, key)] = PARSERS[key](value)
        except (ValueError, TypeError, OverflowError) as exc:
            where = f"{key} in {config_file}" if key in from_file else "--" + key.replace("_", "-")
            raise UsageError(f"{where}: {exc}") from None
    for required, hint in (
        ("backing", "the remote dataset directory, e.g. /mnt/efs/imagenet"),
        ("mountpoint", "an empty directory to mount on"),
        ("cache_dir", "--cache-dir on the local NVMe"),
        ("cache_size_bytes", "--cache-size, e.g. 500G"),
    ):
        if required not in values:
            name = required.removesuffix("_bytes").replace("_", "-")
            raise UsageError(f"missing {name}: give {hint}")
    _check_cluster(values)
    return Settings(**values)


def _check_cluster(values: dict[str, Any]) -> None:
    """The cluster settings go together: peers, where to listen, the secret."""
    peers = values.get("peers")
    if peers is None:
        for key in ("peer_listen", "peer_address", "peer_secret_file"):
            if key in values:
                raise UsageError(f"--{key.replace('_', '-')} needs --peers: the HOST:PORT of "
                                 "every node, or dns:NAME:PORT")
        return
    if "peer_listen" not in values:
        raise UsageError("--peers needs --peer-listen HOST:PORT: where this node serves its "
                         "peers (on the cluster's private network)")
    if "peer_secret_file" not in values:
        raise UsageError("--peers needs --peer-secret-file: a file holding the cluster's "
                         "shared secret (at least 16 bytes), the same on every node")
    me = values.setdefault("peer_address", values["peer_listen"])
    host = me.rpartition(":")[0].strip("[]")
    if host in ("0.0.0.0", "::", ""):
        raise UsageError(f"--peer-listen {me} is every address: give --peer-address "
                         "HOST:PORT, this node as --peers lists it")
    if peers.dns_name is None and me not in peers.nodes:
        raise UsageError(f"this node ({me}) is not in --peers ({peers}): give --peer-address "
                         "as the list spells it")
