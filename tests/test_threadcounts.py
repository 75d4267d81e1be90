"""The request path's counters and histogram (cachefs/threadcounts.py) export what
prometheus-client's would for the same counts, whatever threads made them."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from cachefs.threadcounts import ThreadCounter, ThreadHistogram

BUCKETS = (0.0001, 0.001, 0.5, 1, 30)
# Values on a bound count in that bucket (Prometheus's ``le``), past the last in +Inf.
VALUES = (0.00005, 0.0001, 0.0003, 0.001, 0.7, 1, 29.9, 30, 31, 1e6)


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    """Each sample of the exposition text (its name and labels) and its value."""
    lines = generate_latest(registry).decode().splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines
                                                   if not line.startswith("#")
                                                   and "_created" not in line)}


def test_counts_from_many_threads_export_as_prometheus_clients_do():
    ours, theirs = CollectorRegistry(auto_describe=True), CollectorRegistry()
    opens = ThreadCounter("x_opens", "Opens", ours, "result", ("hit", "miss"))
    lookups = ThreadCounter("x_lookups", "Lookups", ours)
    seconds = ThreadHistogram("x_open_seconds", "Seconds", ours, BUCKETS)
    their_opens = Counter("x_opens", "Opens", ["result"], registry=theirs)
    their_lookups = Counter("x_lookups", "Lookups", registry=theirs)
    their_seconds = Histogram("x_open_seconds", "Seconds", buckets=BUCKETS, registry=theirs)
    their_opens.labels("miss")
    rounds, threads = 20_000, 8
    start = threading.Barrier(threads)

    def count() -> None:
        start.wait()  # all at once: the threads' increments interleave
        hit = opens.labels("hit")
        for _ in range(rounds):
            hit.inc()
            lookups.inc(2)
        for value in VALUES:
            seconds.observe(value)

    workers = [threading.Thread(target=count) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    their_opens.labels("hit").inc(rounds * threads)
    their_lookups.inc(2 * rounds * threads)
    for _ in range(threads):
        for value in VALUES:
            their_seconds.observe(value)
    # The sum of the values as well, added in another order.
    assert _samples(ours) == pytest.approx(_samples(theirs), rel=1e-12)
    assert ours.get_sample_value("x_opens_total", {"result": "hit"}) == rounds * threads
    assert ours.get_sample_value("x_open_seconds_bucket", {"le": "0.0001"}) == 2 * threads


def test_the_counts_of_threads_that_ended_stay_and_their_numbers_go():
    """A thread per control connection counts and ends: its counts stay in the totals,
    while what is kept per thread goes with it."""
    registry = CollectorRegistry(auto_describe=True)
    opens = ThreadCounter("x_opens", "Opens", registry, "result", ("hit", "miss"))
    opens.labels("miss").inc(5)  # this thread's, alive throughout
    for _ in range(200):
        worker = threading.Thread(target=opens.labels("hit").inc, args=(3,))
        worker.start()
        worker.join()
    assert registry.get_sample_value("x_opens_total", {"result": "hit"}) == 600
    assert registry.get_sample_value("x_opens_total", {"result": "miss"}) == 5
    assert len(opens._live) == 1
