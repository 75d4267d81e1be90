"""Every Prometheus metric cachefs exports, defined in one place.

Names follow prometheus.io conventions: ``cachefs_`` prefix, base units in the
name, ``_total`` on counters.  Label values come from small fixed sets; a file
path never becomes a label.  Dashboards and scripts rely on these names.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from cachefs.address import MetricsAddress
from cachefs.boundedserver import BoundedThreads
from cachefs.errors import UsageError
from cachefs.threadcounts import ThreadCounter, ThreadHistogram

log = logging.getLogger(__name__)

# Scrapes answered at once, at most: a Prometheus or two and someone with curl.  The
# endpoint may listen on the node's network (a DaemonSet's 0.0.0.0:9477).
MAX_METRICS_CONNECTIONS = 32
# A scrape sends its request at once: a connection silent this long is closed.
METRICS_IDLE_SECONDS = 10.0

READ_SOURCES = ("cache", "remote", "prefetch", "peer")
OPEN_RESULTS = ("hit", "prefetched", "miss")
HINT_RESULTS = ("accepted", "cached", "invalid", "dropped")
PREFETCH_RESULTS = ("used", "wasted", "failed")
REMOTE_ERROR_KINDS = ("timeout", "eio", "estale", "eacces", "other")
FILL_RESULTS = ("stored", "not_stored", "changed", "failed", "skipped")
WARM_RESULTS = ("fetched", "cached", "not_admitted", "cache_full", "failed")
PEER_FETCH_RESULTS = ("ok", "refused", "unavailable", "rejected")
PEER_SERVED_RESULTS = ("ok", "denied", "refused", "failed")
# A chunk from a peer on the same network: about a millisecond, more for a 4 MiB chunk.
PEER_LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                        0.5, 1, 2.5, 5)
# An open takes ~0.05 ms for a cached file up to seconds for a miss on a slow remote.
OPEN_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
    10, 30,
)


class Metrics:
    """The registry of one mount.  Thread safety: prometheus-client metrics are thread-safe,
    and so are threadcounts' (each thread adds to its own)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Counted on every read of a file: per thread, without a lock (threadcounts.py).
        self.read_bytes = ThreadCounter(
            "cachefs_read_bytes", "Bytes handed to readers, by where they came from: a file "
            "handed over whole (to the kernel or a fast-path reader) counts its size at open",
            r, "source", READ_SOURCES)
        self.remote_read_bytes = Counter(
            "cachefs_remote_read_bytes", "Bytes read from the remote for any reason", registry=r)
        self.file_opens = ThreadCounter(
            "cachefs_file_opens",
            "Files opened for reading: hit when the whole file was in the local cache already, "
            "prefetched when a hint brought it there (or into staging) first, miss otherwise",
            r, "result", OPEN_RESULTS)
        self.cache_bytes = Gauge(
            "cachefs_cache_bytes",
            "Bytes the cache occupies on disk (data, index, directories)", registry=r)
        self.cache_capacity_bytes = Gauge(
            "cachefs_cache_capacity_bytes", "The cache's byte budget (--cache-size)", registry=r)
        self.admission_fraction = Gauge(
            "cachefs_admission_fraction",
            "Share of the files the cache keeps (--fraction); remote traffic per epoch "
            "cannot fall below (1 - fraction) of the dataset without hints", registry=r)
        self.cache_files = Gauge(
            "cachefs_cache_files", "Files stored whole in the cache", registry=r)
        self.cache_reconciling = Gauge(
            "cachefs_cache_reconciling", "1 while the cache is reconciled with its index in the "
            "background after a crash (nothing new is admitted meanwhile)", registry=r)
        self.cache_admitting = Gauge(
            "cachefs_cache_admitting",
            "1 while new files are being admitted; 0 when the budget is used or the disk "
            "refused a write", registry=r)
        self.cache_write_errors = Counter(
            "cachefs_cache_write_errors", "Writes to the cache disk that failed (full, read-only, "
            "I/O error)", registry=r)
        self.pruned_files = Counter(
            "cachefs_cache_pruned_files", "Cached files dropped because they are gone from the "
            "remote (looked for when a file finds no room)", registry=r)
        self.integrity_failures = Counter(
            "cachefs_integrity_failures",
            "Cached chunks that failed their checksum or vanished; dropped and refetched",
            registry=r)
        self.open_seconds = ThreadHistogram(
            "cachefs_open_seconds", "Time to answer an open: what a reader waits for before its "
            "first byte (a miss includes the remote)", r, OPEN_LATENCY_BUCKETS)
        self.served_reads = ThreadCounter(
            "cachefs_served_reads", "READ requests the daemon answered itself; a file the "
            "kernel reads from its backing file (passthrough) or its page cache sends none", r)
        self.lookups = ThreadCounter(
            "cachefs_lookups", "LOOKUP requests: names the kernel did not hold, or held past "
            "--revalidate; names a listing gave with their attributes (READDIRPLUS) need none",
            r)
        self.passthrough = Gauge(
            "cachefs_passthrough", "1 when the kernel reads local files itself (FUSE "
            "passthrough), 0 when the daemon serves every read", registry=r)
        self.passthrough_remote = Gauge(
            "cachefs_passthrough_remote", "1 when the kernel also reads the remote's own file "
            "for a miss (--passthrough auto), 0 when every remote byte goes through the "
            "daemon", registry=r)
        self.remote_errors = Counter(
            "cachefs_remote_errors", "Remote operations that failed, by kind", ["kind"],
            registry=r)
        self.remote_available = Gauge(
            "cachefs_remote_available", "1 while the remote answers, 0 after a timeout until it "
            "answers again", registry=r)
        self.hints = Counter(
            "cachefs_hints", "Prefetch hints received, by what became of them", ["result"],
            registry=r)
        self.prefetch_files = Counter(
            "cachefs_prefetch_files", "Files prefetched, by outcome", ["result"], registry=r)
        self.prefetch_queued_files = Gauge(
            "cachefs_prefetch_queued_files", "Hinted files waiting to be prefetched", registry=r)
        self.prefetch_inflight_files = Gauge(
            "cachefs_prefetch_inflight_files", "Files being prefetched now", registry=r)
        self.fills = Counter(
            "cachefs_fills", "Files copied whole into the cache by the kernel from the "
            "remote's own file, by result: stored, not_stored (not admitted, or no room), "
            "changed (the remote file changed during the copy: nothing stored), failed, "
            "skipped (too many waiting: filled at a later open)", ["result"], registry=r)
        self.warm_files = Counter(
            "cachefs_warm_files", "Files cachefs warm asked for (FETCH, or copied ahead by its "
            "reader-ahead and taken in: fetched), by the answer: fetched, cached (already), "
            "not_admitted (outside the fraction), cache_full, failed",
            ["result"], registry=r)
        self.fills_under_way = Gauge(
            "cachefs_fills_under_way", "Files being copied into the cache by the kernel now, "
            "or waiting to be", registry=r)
        self.attr_cache_entries = Gauge(
            "cachefs_attr_cache_entries", "Attributes remembered of names the kernel does not "
            "hold (bounded by --attr-cache-entries)", registry=r)
        self.attr_cache_capacity_entries = Gauge(
            "cachefs_attr_cache_capacity_entries", "--attr-cache-entries", registry=r)
        self.attr_listing_used_ratio = Gauge(
            "cachefs_attr_listing_used_ratio", "Share of the names listed in the background "
            "(directories looked up name by name) looked up while remembered, recent ones "
            "weighing more; below cachefs_attr_listing_pays_ratio such listings mostly stop "
            "(NaN: none counted yet)", registry=r)
        self.attr_listing_pays_ratio = Gauge(
            "cachefs_attr_listing_pays_ratio", "Share of a background listing's names that must "
            "be looked up for it to pay: what a name listed costs against a name looked up on "
            "the remote on its own, both measured", registry=r)
        self.held_files = Gauge(
            "cachefs_held_files", "Cached files kept registered with the kernel between opens "
            "(bounded by cachefs_held_files_max)", registry=r)
        self.held_file_opens = ThreadCounter(
            "cachefs_held_file_opens", "Opens of cached files found held (cachefs_held_files): "
            "no open of the cache file, no registration with the kernel", r)
        self.held_files_max = Gauge(
            "cachefs_held_files_max", "--held-files, or the default sized from the memory the "
            "daemon may use", registry=r)
        self.nodes = Gauge(
            "cachefs_nodes", "Nodes the kernel holds (files and directories looked up, not yet "
            "forgotten)", registry=r)
        self.staging_bytes = Gauge(
            "cachefs_staging_bytes", "Prefetched bytes held in memory for files the cache does "
            "not keep", registry=r)
        self.staging_bytes_max = Gauge(
            "cachefs_staging_bytes_max", "--staging-size, or the default sized from the memory "
            "the daemon may use", registry=r)
        # The cluster tier (cachefs/peer); zero on a node alone.
        self.peer_fetches = Counter(
            "cachefs_peer_fetches", "Chunks asked of their owner node, by result: ok, refused "
            "(the owner has no such file or version, or its remote failed), unavailable "
            "(down or too slow), rejected (an answer that failed its signature, checksum or "
            "version check); all but ok are read from the remote instead", ["result"],
            registry=r)
        self.peer_fetch_seconds = Histogram(
            "cachefs_peer_fetch_seconds", "Time to get a chunk from its owner node",
            buckets=PEER_LATENCY_BUCKETS, registry=r)
        self.peer_served = Counter(
            "cachefs_peer_served", "Requests answered for other nodes, by result: ok, denied "
            "(bad signature), refused (no such file or version), failed (the remote did not "
            "answer)", ["result"], registry=r)
        self.peer_served_bytes = Counter(
            "cachefs_peer_served_bytes", "Bytes sent to other nodes", registry=r)
        self.peer_up = Gauge(
            "cachefs_peer_up", "1 while the peer node answers its health check", ["peer"],
            registry=r)
        self.cluster_nodes = Gauge(
            "cachefs_cluster_nodes", "Nodes in the cluster (1 for a node alone)", registry=r)
        self.cluster_remote_read_bytes = Gauge(
            "cachefs_cluster_remote_read_bytes", "Bytes the whole cluster read from the "
            "remote: this node's own and what each peer last reported", registry=r)
        for result in PEER_FETCH_RESULTS:
            self.peer_fetches.labels(result)
        for result in PEER_SERVED_RESULTS:
            self.peer_served.labels(result)
        self.cluster_nodes.set(1)
        self.cluster_remote_read_bytes.set_function(
            lambda: self.value("cachefs_remote_read_bytes_total"))
        # Restarts of the serving process under the supervisor (service/supervisor.py): each
        # process starts these from what its supervisor tells it.
        self.restarts = Counter(
            "cachefs_restarts", "Times a new process took the mount over after the one "
            "serving it died, since it was mounted", registry=r)
        self.requests_resent = Counter(
            "cachefs_requests_resent", "Requests the kernel sent again after a takeover (read "
            "by the process that died, never answered), counted by the process now serving",
            registry=r)
        self.serving_start_time = Gauge(
            "cachefs_serving_start_time_seconds", "When the process serving the mount now "
            "started serving it (Unix time)", registry=r)
        self.restart_pause = Gauge(
            "cachefs_restart_pause_seconds", "The last takeover: from the death of the serving "
            "process to its successor serving (what a reader waited at most, beyond its "
            "request's own time); 0 before any", registry=r)
        for result in HINT_RESULTS:
            self.hints.labels(result)
        for result in PREFETCH_RESULTS:
            self.prefetch_files.labels(result)
        for result in FILL_RESULTS:
            self.fills.labels(result)
        for result in WARM_RESULTS:
            self.warm_files.labels(result)
        for kind in REMOTE_ERROR_KINDS:
            self.remote_errors.labels(kind)
        self.remote_available.set(1)
        self._server = None

    def watch_collections(self, collections: list[int], seconds: list[float]) -> None:
        """Export the garbage collector's collections and the seconds they took, by
        generation, from lists their owner keeps current, read at scrape time."""
        self.registry.register(_Collections(collections, seconds))

    def bind_gauge(self, gauge: Gauge, read: Callable[[], float]) -> None:
        """Let ``gauge`` read its value from the owner of the figure at scrape time."""
        gauge.set_function(read)

    def bind_counter(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A counter ``name`` (``_total`` added) whose owner keeps the count, read at scrape
        time."""
        self.registry.register(_CounterFrom(name, documentation, read))

    def value(self, name: str, **labels: str) -> float:
        """The current value of a sample, as a scrape would show it (0 when absent)."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def serve(self, address: MetricsAddress) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port."""
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(
                address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            server_class = _MetricsServer6 if family == socket.AF_INET6 else _MetricsServer
            self._server = server_class(sockaddr[:2], _QuietHandler)
        except OSError as exc:
            raise UsageError(
                f"cannot serve metrics on {address}: {exc.strerror}; "
                "pass --metrics-addr HOST:PORT with a free port, or 0 to turn metrics off"
            ) from None
        self._server.set_app(make_wsgi_app(self.registry))
        threading.Thread(target=self._server.serve_forever, name="metrics",
                         daemon=True).start()
        port = self._server.server_port
        log.info("metrics on http://%s/metrics", MetricsAddress(address.host, port))
        return port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _MetricsServer(BoundedThreads, WSGIServer):
    max_connections = MAX_METRICS_CONNECTIONS
    what = "metrics connections"


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_IDLE_SECONDS

    def log_message(self, format, *args) -> None:  # noqa: A002 (the library's name)
        pass  # a line on stderr per scrape otherwise


class _CounterFrom(Collector):
    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def collect(self):
        return [CounterMetricFamily(self._name, self._documentation, value=self._read())]


class _Collections(Collector):
    def __init__(self, collections: list[int], seconds: list[float]) -> None:
        self._collections, self._seconds = collections, seconds

    def collect(self):
        collections = CounterMetricFamily(
            "cachefs_gc_collections", "Collections of Python's cyclic garbage collector in the "
            "serving process, by generation (2: a full collection)", labels=["generation"])
        seconds = CounterMetricFamily(
            "cachefs_gc_seconds", "Seconds the serving process spent in those collections, "
            "every request waiting meanwhile", labels=["generation"])
        for generation, (count, spent) in enumerate(zip(self._collections, self._seconds,
                                                        strict=True)):
            collections.add_metric([str(generation)], count)
            seconds.add_metric([str(generation)], spent)
        return [collections, seconds]
