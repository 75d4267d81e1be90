"""One cachefs mount: wires the parts together, serves until unmounted, cleans up.

Under the supervisor (service/supervisor.py) a daemon is its serving child: the first mounts
and hands the descriptor up; a successor takes the connection over (kernel/takeover.py) with
the node and handle tables its predecessor left in the runtime directory.

Startup order matters: everything that can fail on bad input (paths, the cache
dir, the metrics port, the socket) is done before the FUSE mount, so a failure
leaves nothing mounted.  Readiness is reported once the kernel has completed
the FUSE handshake, through a pipe to the ``cachefs mount`` that started us
and through sd_notify for systemd.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import secrets
import signal
import socket
import sqlite3
import sys
import time
from pathlib import Path

import xxhash

from cachefs import __version__, limits
from cachefs.address import MetricsAddress
from cachefs.control.server import ControlServer, Peer, Reply
from cachefs.errors import CachefsError, UsageError
from cachefs.kernel import takeover
from cachefs.kernel.mount import MountOptions
from cachefs.kernel.session import Connection, Session
from cachefs.metrics import (
    FILL_RESULTS,
    HINT_RESULTS,
    PEER_FETCH_RESULTS,
    PREFETCH_RESULTS,
    READ_SOURCES,
    WARM_RESULTS,
    Metrics,
)
from cachefs.mirror.handles import HandleTable
from cachefs.mirror.mirrorfs import MirrorFS
from cachefs.mirror.nodes import NodeTable
from cachefs.mirror.tree import CONTROL_NAME, CachedTree, is_control_entry
from cachefs.peer.client import ClusterOrigin, PeerClient
from cachefs.peer.members import Members
from cachefs.peer.protocol import read_secret
from cachefs.peer.server import PeerServer
from cachefs.prefetch.paths import Caller, normalize, resolve
from cachefs.prefetch.prefetcher import Prefetcher
from cachefs.prefetch.staging import StagingArea
from cachefs.remote.attrcache import AttrCache, relpath_key
from cachefs.remote.fetcher import Fetcher
from cachefs.remote.handover import RemoteFiles
from cachefs.remote.origin import RemoteOrigin
from cachefs.remote.prune import Pruner
from cachefs.remote.remote import Remote
from cachefs.service import affinity, collector, heap, sdnotify
from cachefs.service.config import Settings
from cachefs.service.memory import default_held_files, default_staging_bytes
from cachefs.service.preflight import budget_beyond_disk
from cachefs.service.supervisor import Succession
from cachefs.store.admission import ClusterAdmission, FractionAdmission
from cachefs.store.store import CacheStore, refusal

log = logging.getLogger(__name__)

READY_FD_ENV = "CACHEFS_READY_FD"
# How long a daemon taking the mount over waits for its predecessor to let go of the cache
# dir: it commits the index's pending writes first (a fraction of a second; more on a
# loaded disk).
TAKEOVER_LOCK_WAIT = 10.0


def default_runtime_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/run/cachefs")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "cachefs" if runtime else Path(f"/tmp/cachefs-{os.geteuid()}")


def mount_name(mountpoint: Path) -> str:
    """A file-name-safe identifier of a mount point: ``/mnt/imagenet`` -> ``mnt-imagenet``."""
    text = str(mountpoint).strip("/").replace("/", "-") or "root"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:80]


def socket_path(settings: Settings) -> Path:
    # Unix socket paths are limited to 107 bytes: name the socket by a hash.
    digest = xxhash.xxh64_hexdigest(os.fsencode(os.path.realpath(settings.mountpoint)))
    return (settings.runtime_dir or default_runtime_dir()) / f"{digest}.sock"


def node_table_base(settings: Settings) -> Path:
    """Where the mount's node table lives (mirror/nodes.py): beside its control socket, in the
    runtime directory (tmpfs), where a daemon taking the mount over finds it."""
    return socket_path(settings).with_suffix("")


def default_log_file(mountpoint: Path) -> Path:
    if os.geteuid() == 0:
        base = Path("/var/log/cachefs")
    else:
        base = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "cachefs"
    return base / f"{mount_name(mountpoint)}.log"


class Daemon:
    """A mount being served.  Build with :meth:`start` (no FUSE yet), then :meth:`serve`."""

    def __init__(self, settings: Settings, succession: Succession | None = None) -> None:
        self.settings = settings
        self.succession = succession
        self.serving_since: float | None = None  # when this process started serving
        self.restart_pause: float | None = None  # death of the predecessor to serving here
        self.session: Session | None = None
        # The process HANDOVER gave the mount's descriptor to (its pid 0 when it is in a PID
        # namespace this one cannot see, another pod's; hence None for "nobody yet"), and
        # the token its RELINQUISH must bring back: a client that sends commands blindly
        # cannot end the daemon.
        self._handing_to: tuple[int, str] | None = None
        self._mount_text = str(settings.mountpoint)  # what request paths are relative to
        self.started_at = time.time()
        self.metrics = Metrics()
        self.metrics_port: int | None = None
        self.store: CacheStore | None = None
        self.remote: Remote | None = None
        self.control: ControlServer | None = None
        self.tree: CachedTree | None = None
        self.prefetcher: Prefetcher | None = None
        self.staging: StagingArea | None = None
        self.remote_files: RemoteFiles | None = None
        self.pruner: Pruner | None = None
        self.fs: MirrorFS | None = None
        self.cpus: frozenset[int] | None = None  # those the serving threads keep to; None: all
        self.peer_server: PeerServer | None = None
        self.peer_client: PeerClient | None = None
        self.data_path = "not mounted"
        self._warm_files = {r: self.metrics.warm_files.labels(r) for r in WARM_RESULTS}

    def start(self) -> None:
        """Everything but the mount.  Raises UsageError for bad input; undoes itself on failure."""
        s = self.settings
        m = self.metrics
        heap.map_large_blocks()  # before the tables that grow with the dataset
        collections = collector.collect_rarely()
        m.watch_collections(collections.collections, collections.seconds)
        # Before the threads start: they keep to the CPUs of the thread that starts them.
        self.cpus = affinity.serving_cpus(s.cpus, str(s.mountpoint))
        affinity.keep_to(self.cpus)
        try:
            members = None
            if s.peers is not None:
                secret = read_secret(s.peer_secret_file)
                members = Members(s.peers, s.peer_address)
                admission = ClusterAdmission(s.fraction, s.seed, members)
            else:
                admission = FractionAdmission(s.fraction, s.seed)
            # A daemon taking the mount over may start while the one it took it from still
            # commits its index and exits, holding the cache dir a moment longer.
            self.store = _open_store(s, admission, m, lock_wait_seconds=TAKEOVER_LOCK_WAIT
                                     if self._taking_over else 0)
            store = self.store
            if beyond := budget_beyond_disk(s.cache_dir, s.cache_size_bytes):
                log.warning(beyond)
            store.on_write_error = m.cache_write_errors.inc
            m.cache_capacity_bytes.set(s.cache_size_bytes)
            m.admission_fraction.set(s.fraction)
            m.bind_gauge(m.cache_bytes, lambda: store.used_bytes)
            m.bind_gauge(m.cache_files, lambda: store.complete_files)
            m.bind_gauge(m.cache_admitting, lambda: float(store.admitting))
            m.bind_gauge(m.cache_reconciling, lambda: float(store.reconciling))
            if s.metrics_addr is not None:
                self.metrics_port = m.serve(s.metrics_addr)
            self.remote = Remote(
                str(s.backing), s.remote_timeout_seconds,
                on_read_bytes=m.remote_read_bytes.inc,
                on_error=lambda kind: m.remote_errors.labels(kind).inc(),
                on_availability=lambda up: m.remote_available.set(1 if up else 0),
            )
            attrs = AttrCache(self.remote, s.revalidate_seconds, self._recorded_attr,
                              max_entries=s.attr_cache_entries)
            m.bind_gauge(m.attr_cache_entries, lambda: attrs.entries)
            m.attr_cache_capacity_entries.set(s.attr_cache_entries)
            m.bind_counter("cachefs_attr_cache_dropped", "Attributes dropped to stay within "
                           "--attr-cache-entries (a bound below the names a pass uses: each a "
                           "lookup on the remote again)", lambda: attrs.dropped)
            m.bind_gauge(m.attr_listing_used_ratio,
                         lambda: math.nan if (share := attrs.listing_used_share) is None else share)
            m.bind_gauge(m.attr_listing_pays_ratio, lambda: attrs.costs.pays_share)
            origin = RemoteOrigin(self.remote)
            if members is not None:
                own_remote_bytes = functools.partial(m.value, "cachefs_remote_read_bytes_total")
                self.peer_client = PeerClient(members, secret, s.peer_timeout_seconds, m,
                                              own_remote_bytes=own_remote_bytes)
                origin = ClusterOrigin(self.remote, members, self.peer_client)
            fetcher = Fetcher(origin, store)
            if members is not None:
                try:
                    self.peer_server = PeerServer(
                        s.peer_listen, secret, store=store, fetcher=fetcher, attrs=attrs,
                        metrics=m, own_remote_bytes=own_remote_bytes)
                except OSError as exc:
                    raise UsageError(f"cannot serve peers on {s.peer_listen}: {exc.strerror}; "
                                     "give --peer-listen a free port on this node") from None
            staging = self.staging = StagingArea(
                default_staging_bytes() if s.staging_bytes is None else s.staging_bytes,
                on_wasted=m.prefetch_files.labels("wasted").inc)
            m.bind_gauge(m.staging_bytes_max, lambda: staging.capacity_bytes)
            # Counted once per file filled: the labelled counters looked up once, here.
            fills = {result: m.fills.labels(result) for result in FILL_RESULTS}
            remote_files = self.remote_files = RemoteFiles(
                self.remote, store, on_fill=lambda result: fills[result].inc(),
                fill_processes=s.fill_processes)
            m.bind_gauge(m.fills_under_way, lambda: remote_files.fills_under_way)
            pruner = self.pruner = Pruner(self.remote, store, on_pruned=m.pruned_files.inc)
            store.on_no_room = pruner.no_room
            self.prefetcher = Prefetcher(
                mountpoint=str(s.mountpoint), store=store, fetcher=fetcher, remote=self.remote,
                attrs=attrs, staging=staging, metrics=m, concurrency=s.prefetch_concurrency,
                remote_files=remote_files)
            control_path = socket_path(s)
            self.tree = CachedTree(
                remote=self.remote, store=store, attrs=attrs, fetcher=fetcher, metrics=m,
                prefetcher=self.prefetcher, remote_files=remote_files,
                control_target=str(control_path),
            )
            self.control = ControlServer(
                control_path,
                {b"STATUS": self._status_request, b"PING": self._ping_request,
                 b"HINT": self._hint_request, b"FETCH": self._fetch_request,
                 b"READ": self._read_request, b"OPEN": self._open_request,
                 b"HANDOVER": self._handover_request,
                 b"RELINQUISH": self._relinquish_request},
                on_invalid=m.hints.labels("invalid").inc,
                takers={b"READ-AHEAD": self._read_ahead_request})
        except BaseException:
            self.stop()
            raise

    def _recorded_attr(self, relpath: str):
        record = self.store.lookup(relpath_key(relpath)) if self.store else None
        return record.attr if record is not None else None

    def serve(self) -> None:
        """Mount and serve until unmounted (fusermount -u, SIGTERM, SIGINT)."""
        s = self.settings
        log.info("mounting %s at %s (cache %s, %d bytes, fraction %g, seed %d)",
                 s.backing, s.mountpoint, s.cache_dir, s.cache_size_bytes, s.fraction, s.seed)
        try:
            self._serve_session()
        finally:
            log.info("unmounted %s", s.mountpoint)
            sdnotify.notify("STOPPING=1")

    @property
    def _taking_over(self) -> bool:
        """This process serves a mount an earlier one made (a restart, an upgrade)."""
        return self.succession is not None and self.succession.fd is not None

    def _tables(self, taking_over: bool) -> tuple[NodeTable, HandleTable]:
        base = node_table_base(self.settings)
        if taking_over:
            try:
                return (NodeTable(base, self.tree.getattr(""), take_over=True),
                        HandleTable(base, take_over=True))
            except (OSError, ValueError) as exc:
                # Served on with new tables: names the kernel holds are answered ESTALE (it
                # looks them up again), open files EBADF.
                log.error("the tables of the previous process are unusable (%s); node ids "
                          "the kernel holds are lost", exc)
        return NodeTable(base, self.tree.getattr("")), HandleTable(base)

    def _serve_session(self) -> None:
        s = self.settings
        succession = self.succession
        taking_over = self._taking_over
        nodes, handles = self._tables(taking_over)
        self.fs = MirrorFS(self.tree, on_mounted=self._on_mounted, metrics=self.metrics,
                           nodes=nodes, handles=handles,
                           max_held=s.held_files or default_held_files())
        self.metrics.bind_gauge(self.metrics.nodes, lambda: len(nodes))
        self.metrics.bind_gauge(self.metrics.held_files, lambda: self.fs.held_files)
        self.metrics.bind_gauge(self.metrics.held_files_max, lambda: self.fs.max_held_files)
        self.store.on_dropped = lambda key, version: self.fs.drop_held(os.fsdecode(key),
                                                                       version)
        session = self.session = Session(self.fs, want_passthrough=s.passthrough != "off",
                                         readdirplus=True, on_unexpected=None,
                                         on_resent=self.metrics.requests_resent.inc)
        if taking_over:
            self.metrics.restarts.inc(succession.restarts)
            session.mountpoint = str(s.mountpoint)
            session.take_over(succession.fd, succession.connection)  # serving from here
        else:
            try:
                session.mount(str(s.mountpoint), MountOptions(
                    fsname=str(s.backing), subtype="cachefs", allow_other=s.allow_other))
            except OSError as exc:
                raise RuntimeError(str(exc)) from None
            if succession is not None:
                succession.report_descriptor(session.fd)
        previous = {sig: signal.signal(sig, lambda *_: session.unmount())
                    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        collector.freeze_what_starting_made()
        try:
            session.serve()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            session.close()
            nodes.close(remove=True)  # unmounted: no successor needs them
            handles.close(remove=True)

    def _serving(self) -> None:
        """This process serves the mount from now on (after INIT, or taking it over)."""
        now = time.time()
        self.serving_since = now
        self.metrics.serving_start_time.set(now)
        died_at = self.succession.died_at if self.succession is not None else None
        if died_at is not None:
            self.restart_pause = max(0.0, now - died_at)
            self.metrics.restart_pause.set(self.restart_pause)
            log.info("took the mount over from a process gone %.3f s ago (restart %d)",
                     self.restart_pause, self.succession.restarts)

    def _on_mounted(self, connection: Connection) -> None:
        if self.serving_since is None:
            self._serving()
        if self.succession is not None:
            self.succession.report_connection(connection)
        if connection.passthrough and self.settings.passthrough == "auto":
            self.remote_files.enabled = True
            self.data_path = ("kernel passthrough: the kernel reads local files and, for a "
                              "miss, the remote's own file itself")
        elif connection.passthrough:
            self.data_path = ("kernel passthrough: the kernel reads local files itself; the "
                              "daemon reads the remote (--passthrough local)")
        else:
            self.data_path = f"served by the daemon: passthrough {connection.passthrough_note}"
        self.metrics.passthrough.set(1 if connection.passthrough else 0)
        self.metrics.passthrough_remote.set(1 if self.remote_files.enabled else 0)
        log.info("serving %s at %s; data path: %s", self.settings.backing,
                 self.settings.mountpoint, self.data_path)
        # systemd first: under ExecReload (cachefs upgrade) the new supervisor must be the
        # unit's main process before `cachefs upgrade`, told by report_ready, exits.
        main_pid = self.succession.supervisor_pid if self.succession else os.getpid()
        sdnotify.notify(f"READY=1\nSTATUS={self.status_line()}\nMAINPID={main_pid}")
        report_ready()
        sdnotify.keep_status_current(self.status_line)

    def stop(self) -> None:
        """Release everything :meth:`start` took; safe to call twice or after a failed start."""
        for part in (self.peer_server, self.control, self.prefetcher, self.remote_files,
                     self.pruner, self.peer_client, self.remote, self.staging):
            if part is not None:
                part.close()
        self.metrics.close()
        if self.store is not None:
            self.store.close()
        self.control = self.prefetcher = self.remote = self.store = self.staging = None
        self.remote_files = self.pruner = None
        self.peer_server = self.peer_client = None

    # -- status ----------------------------------------------------------------------------

    def status(self) -> dict:
        s, m = self.settings, self.metrics
        hits = m.value("cachefs_file_opens_total", result="hit")
        misses = m.value("cachefs_file_opens_total", result="miss")
        prefetched = m.value("cachefs_file_opens_total", result="prefetched")
        opens = hits + misses + prefetched
        read = {src: m.value("cachefs_read_bytes_total", source=src) for src in READ_SOURCES}
        total_read = sum(read.values())
        metrics_url = None
        if s.metrics_addr is not None and self.metrics_port is not None:
            address = MetricsAddress(s.metrics_addr.host, self.metrics_port)
            metrics_url = f"http://{address}/metrics"
        return {
            "version": __version__,
            "pid": os.getpid(),
            "supervisor_pid": self.succession.supervisor_pid if self.succession else None,
            # Which container serves the mount (cachefs status --served-here, unmount
            # --if-served-here): pids are the daemon's own namespace's.
            "pid_namespace": os.readlink("/proc/self/ns/pid"),
            # What `cachefs upgrade` starts again (service/upgrade.py).
            "command": sys.argv[1:] if self.succession else None,
            "cwd": os.getcwd(),
            "serving": self._serving_status(),
            "mountpoint": str(s.mountpoint),
            "backing": str(s.backing),
            "cache_dir": str(s.cache_dir),
            "uptime_seconds": round(time.time() - self.started_at, 1),
            "fraction": s.fraction,
            "seed": s.seed,
            "revalidate_seconds": s.revalidate_seconds,
            # Of all opens, those the stable cached fraction served; prefetched files
            # are local too but count apart, so this stays comparable with --fraction.
            "hit_ratio": hits / opens if opens else None,
            "byte_hit_ratio": (read["cache"] + read["prefetch"] + read["peer"]) / total_read
            if total_read else None,
            "file_opens": {"hit": int(hits), "prefetched": int(prefetched),
                           "miss": int(misses)},
            "read_bytes": {k: int(v) for k, v in read.items()},
            "remote_read_bytes": int(m.value("cachefs_remote_read_bytes_total")),
            "cache_bytes": int(m.value("cachefs_cache_bytes")),
            "cache_capacity_bytes": s.cache_size_bytes,
            "cache_files": int(m.value("cachefs_cache_files")),
            "admitting": bool(m.value("cachefs_cache_admitting")),
            "reconciling": self.store.reconciling if self.store else False,
            "verification": self.store.scrub_figures() if self.store else None,
            "cache_write_error": self.store.write_error if self.store else None,
            "integrity_failures": int(m.value("cachefs_integrity_failures_total")),
            "remote_available": bool(m.value("cachefs_remote_available")),
            "open_files": self.fs.open_files if self.fs else 0,
            "memory": self._memory_status(),
            "cores": limits.CORES,
            "cpus": affinity.describe(self.cpus),
            "data_path": self.data_path,
            "remote_handed_over": bool(self.remote_files and self.remote_files.enabled),
            "metrics_url": metrics_url,
            "hints": {r: int(m.value("cachefs_hints_total", result=r)) for r in HINT_RESULTS},
            "prefetch": {
                **{r: int(m.value("cachefs_prefetch_files_total", result=r))
                   for r in PREFETCH_RESULTS},
                **(self.prefetcher.figures() if self.prefetcher else {"queued": 0,
                                                                      "inflight": 0}),
                "staging_bytes": int(m.value("cachefs_staging_bytes")),
            },
            "fills": {
                **{r: int(m.value("cachefs_fills_total", result=r)) for r in FILL_RESULTS},
                "under_way": self.remote_files.fills_under_way if self.remote_files else 0,
                "processes": self.remote_files.fill_processes if self.remote_files else [],
            },
            "warm_read_ahead": self.prefetcher.read_ahead_figures() if self.prefetcher
            else {"pid": None, "warms": 0, "open": 0, "copied": 0, "installed": 0,
                  "dropped": 0, "read": 0, "left": 0},
            "cluster": self._cluster_status(),
        }

    def _serving_status(self) -> dict:
        """The process serving the mount, and the takeovers since the mount was made."""
        succession, session = self.succession, self.session
        return {
            "since": self.serving_since,
            "mounted_since": succession.mounted_at if succession else self.started_at,
            "restarts": succession.restarts if succession else 0,
            # "daemon" (cachefs upgrade, a new pod), "fdstore" (systemd), None (mounted here)
            "taken_over_from": succession.taken_over_from if succession else None,
            "last_restart_pause_seconds": None if self.restart_pause is None
            else round(self.restart_pause, 4),
            "requests_resent": session.resent_requests if session else 0,
            "resend_supported": session.resend_supported if session else None,
            "backing_ids_closed": self.fs.backing_ids_closed if self.fs else 0,
        }

    def _memory_status(self) -> dict:
        """What the daemon holds per file, against the bounds that keep it flat."""
        attrs = self.tree.attrs if self.tree else None
        return {
            "nodes": len(self.fs.nodes) if self.fs else 0,
            "node_table_bytes": self.fs.nodes.memory_bytes if self.fs else 0,
            "attr_cache_entries": attrs.entries if attrs else 0,
            "attr_cache_capacity_entries": attrs.max_entries if attrs else 0,
            "attr_cache_dropped": attrs.dropped if attrs else 0,
            "attr_listing_used_share": attrs.listing_used_share if attrs else None,
            "attr_listings_pay": attrs.listings_pay if attrs else True,
            "attr_listing_pays_share": attrs.costs.pays_share if attrs else None,
            "held_files": self.fs.held_files if self.fs else 0,
            "held_files_max": self.fs.max_held_files if self.fs else 0,
            "staging_bytes_max": self.staging.capacity_bytes if self.staging else 0,
        }

    def _cluster_status(self) -> dict | None:
        if self.peer_client is None:
            return None
        m, members = self.metrics, self.peer_client.members
        return {
            "me": members.me,
            "nodes": list(members.nodes),
            "peers_up": [p for p in members.others if self.peer_client.up(p)],
            "fetches": {r: int(m.value("cachefs_peer_fetches_total", result=r))
                        for r in PEER_FETCH_RESULTS},
            "served_bytes": int(m.value("cachefs_peer_served_bytes_total")),
            "cluster_remote_read_bytes": int(m.value("cachefs_cluster_remote_read_bytes")),
        }

    def status_line(self) -> str:
        """One line for systemd's STATUS=."""
        st = self.status()
        ratio = "-" if st["hit_ratio"] is None else f"{st['hit_ratio']:.1%}"
        return (f"hit ratio {ratio}, {st['cache_files']} files cached, "
                f"{st['cache_bytes']}/{st['cache_capacity_bytes']} bytes")

    def _status_request(self, peer, argument: bytes) -> Reply:
        return Reply({"ok": True, **self.status()})

    def _hint_request(self, peer: Peer, argument: bytes) -> None:
        self.prefetcher.hint(argument, _caller(peer))

    def _read_ahead_request(self, peer: Peer, conn: socket.socket) -> Reply:
        """A warm's list read ahead of its FETCHes: the connection goes to the reader-ahead
        (prefetch/readahead.py), which reads its paths itself."""
        refused = self.prefetcher.take_read_ahead(conn, _caller(peer))
        if refused:
            return Reply({"ok": False, "error": refused})
        # (How many such connections a warm opens, each with its share of the list.)
        return Reply(b'{"ok":true,"streams":%d}' % self.prefetcher.read_ahead_streams,
                     taken=True)

    def _fetch_request(self, peer: Peer, argument: bytes) -> Reply:
        answer = self.prefetcher.fetch_now(argument, _caller(peer))
        if not answer["ok"]:
            self._warm_files["failed"].inc()
            return Reply(answer)
        if not answer.get("counted"):  # (one the reader-ahead copied: counted as taken in)
            self._warm_files[answer["result"]].inc()
        # The reply to every file of a warm: formatted directly.
        return Reply(b'{"ok":true,"result":"%s","bytes":%d}'
                     % (answer["result"].encode(), answer["bytes"]))

    def _read_request(self, peer: Peer, argument: bytes) -> Reply:
        """The fast path: a local file's bytes over the socket, checked as the mount would
        check them; anything else is read through the mount (which gives the errno)."""
        return self._whole_file_reply(peer, argument, descriptor=False)

    def _open_request(self, peer: Peer, argument: bytes) -> Reply:
        """READ, but the local file comes as a read-only descriptor: the reader reads it
        itself, as the kernel does through passthrough, and the daemon never touches the
        bytes."""
        return self._whole_file_reply(peer, argument, descriptor=True)

    def _whole_file_reply(self, peer: Peer, argument: bytes, *, descriptor: bool) -> Reply:
        try:
            named = normalize(argument, self._mount_text)
            if is_control_entry(named):  # through the mount, the socket: never a file
                return Reply({"ok": False, "error": "the control entry"})
            relpath, attr = resolve(named, self.tree.attrs, self.remote, _caller(peer))
            found = self.tree.locate(relpath, attr, fetch=False)
        except (OSError, CachefsError) as exc:
            return Reply({"ok": False, "error": str(exc) or type(exc).__name__})
        if found is None or (found.kind == "remote" and not descriptor):
            if found is not None:
                os.close(found.fd)  # the remote's own file: read through the mount instead
            return Reply({"ok": False, "error": "not local"})
        if descriptor:  # the reply to every cached file: formatted directly
            return Reply(b'{"ok":true,"size":%d,"result":"%s","fd":1}'
                         % (attr.size, found.result.encode()), fd=found.fd)
        try:
            data = os.pread(found.fd, attr.size, 0)
        finally:
            os.close(found.fd)
        return Reply({"ok": True, "size": len(data), "result": found.result}, payload=data)

    def _handover_request(self, peer: Peer, argument: bytes) -> Reply:
        """`cachefs upgrade`: the mount's descriptor and what its handshake settled, for a new
        daemon of the same user (service/upgrade.py); RELINQUISH then ends this one."""
        session, succession = self.session, self.succession
        if peer.uid not in (0, os.geteuid()):
            return Reply({"ok": False, "error": "only the daemon's own user may take its "
                                                "mount over"})
        if session is None or session.fd < 0 or succession is None:
            return Reply({"ok": False, "error": "not serving a mount"})
        token = secrets.token_hex(16)
        self._handing_to = (peer.pid, token)
        connection = session.connection
        log.info("handing the mount over to process %d", peer.pid)
        return Reply({"ok": True, "pid": os.getpid(), "version": __version__, "token": token,
                      "connection": takeover.connection_text(connection) if connection else None,
                      "restarts": succession.restarts, "mounted_at": succession.mounted_at},
                     fd=os.dup(session.fd))

    def _relinquish_request(self, peer: Peer, argument: bytes) -> Reply:
        """Exit at once for the daemon that took the descriptor (``RELINQUISH <token>``, the
        token of its HANDOVER's reply): as a killed one would
        (nothing unmounted, the tables left for it, the requests in flight resent to it), with
        the index's pending writes committed and its supervisor exiting with it."""
        if self._handing_to is None or self._handing_to[0] != peer.pid:
            return Reply({"ok": False, "error": "HANDOVER first"})
        if argument.strip() != self._handing_to[1].encode():
            return Reply({"ok": False, "error": "RELINQUISH needs the token HANDOVER gave"})
        log.info("process %d took the mount over; exiting", peer.pid)
        try:
            if self.succession is not None:
                self.succession.report_handed_over()
            if self.store is not None:
                self.store.index.flush()
        finally:
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(0)  # 0: the supervisor exits too, without unmounting

    def _ping_request(self, peer, argument: bytes) -> Reply:
        # "cache" names the cache's contents (a new name once emptied): what a warm's
        # checkpoint was taken against.
        return Reply({"ok": True, "version": __version__,
                      "mountpoint": str(self.settings.mountpoint), "control": CONTROL_NAME,
                      "cache": self.store.layout.identity if self.store else None})


@functools.lru_cache(maxsize=4096)
def _caller(peer: Peer) -> Caller:
    """The peer with its supplementary groups (read once per process, not per hint)."""
    return Caller.of_process(peer.pid, peer.uid, peer.gid)


def _open_store(s: Settings, admission, m: Metrics, lock_wait_seconds: float) -> CacheStore:
    """The cache, or a one-line UsageError saying why the cache disk refuses it."""
    try:
        return CacheStore.open(s.cache_dir, s.cache_size_bytes, admission,
                               on_integrity_failure=m.integrity_failures.inc,
                               lock_wait_seconds=lock_wait_seconds)
    except (OSError, sqlite3.Error) as exc:
        raise UsageError(refusal(s.cache_dir, exc)) from None


def report_ready(error: str | None = None) -> None:
    """Tell the ``cachefs mount`` that started us whether the mount serves."""
    fd_text = os.environ.pop(READY_FD_ENV, None)
    if fd_text is None:
        return
    message = f"ERROR {error}\n" if error else "READY\n"
    try:
        fd = int(fd_text)
        os.write(fd, message.encode(errors="replace"))
        os.close(fd)
    except (OSError, ValueError):
        pass
