"""Peer reads in a cluster: memcached with extstore beside each daemon, or HTTP from each daemon.

    python3 -m bench.peer_engines [--files 2000] [--size-kib 64] [--rounds 3] [--work-dir DIR]

Four simulated nodes on loopback, each a server process of its own. ``memcached``: memcached
with extstore, little memory so that values live in the extstore file as a cache on SSD
would, asked with pymemcache's HashClient (rendezvous hashing). ``http``: cachefs's own peer
endpoint (cachefs/peer/server.py: HTTP/1.1, keep-alive) answering
``GET /v1/chunk/<n>/<path>`` from files in a directory, signed as cachefs/peer/protocol.py
says, asked of the owner cachefs/peer/ring.py names over cachefs's own kept-alive
connections (cachefs/peer/client.py). Each is given the files once (memcached: a set over
the network; http: the owner's own cache fill, a local write), then every file is read by
8 threads (files/s, CPU per file of this process and of the servers, from /proc), then by
one (latency), each read compared with the bytes given. Both serve from the page cache.
The two take turns ``--rounds`` times; the table shows median (min-max), as this machine is
shared and noisy.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import xxhash
from rich.console import Console
from rich.table import Table

from bench.emulator.remote import process_cpu_seconds
from cachefs.attr import Version
from cachefs.peer import protocol, ring
from cachefs.peer.client import Connections
from cachefs.peer.server import Handler, HTTPServer
from cachefs.store.store import chunk_count, chunk_span

NODES = 4
THREADS = 8
HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]  # where the http servers find this module
# memcached refuses an item over -I (1 MiB by default) with its header and key: a larger
# file is stored as parts, each its own key, as the http protocol has chunks of 4 MiB.
MEMCACHED_PART_BYTES = 2**20 - 4096


@dataclass
class Engine:
    put: Callable[[str, Version, bytes], None]
    get: Callable[[str, Version], bytes | None]
    server_pids: list[int]
    note: Callable[[], str] = lambda: ""


@contextmanager
def _servers(work: Path, command: Callable[[int], list[str]]) -> Iterator[tuple[list, list]]:
    """(ports, pids) of NODES servers, once each accepts connections. Each runs in a session
    of its own, so that killing its group leaves nothing behind, whatever happens."""
    listeners = [socket.create_server((HOST, 0)) for _ in range(NODES)]
    ports = [s.getsockname()[1] for s in listeners]
    for s in listeners:
        s.close()
    procs = []
    try:
        for port in ports:
            with open(work / f"server-{port}.log", "wb") as log:
                procs.append(subprocess.Popen(command(port), cwd=REPO, stdout=log,
                                              stderr=log, start_new_session=True))
        deadline = time.monotonic() + 10
        for proc, port in zip(procs, ports, strict=True):
            while True:
                try:
                    socket.create_connection((HOST, port), timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        why = (work / f"server-{port}.log").read_text(errors="replace")
                        raise RuntimeError(f"{proc.args[0]} did not start: {why[-300:]}") \
                            from None
                    time.sleep(0.05)
        yield ports, [p.pid for p in procs]
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


@contextmanager
def memcached(work: Path) -> Iterator[Engine]:
    try:
        from pymemcache.client.base import Client
        from pymemcache.client.hash import HashClient
        from pymemcache.exceptions import MemcacheServerError
    except ImportError:
        sys.exit("bench.peer_engines: pymemcache (memcached's client) is missing: "
                 "pip install pymemcache")
    if not shutil.which("memcached"):
        sys.exit("bench.peer_engines: memcached is missing: apt-get install -y memcached")
    user = ["-u", "root"] if os.geteuid() == 0 else []  # memcached refuses root without -u
    # -M: without it, sets faster than extstore's flusher evict values not yet written out,
    # silently; with it, such a set is refused, and retried below. ext_item_age=0: every
    # value goes to the extstore file, not only what overflows the 16 MiB of memory.
    work.mkdir(parents=True)
    with _servers(work, lambda port: [
            "memcached", "-p", str(port), "-U", "0", "-l", HOST, *user, "-m", "16", "-M",
            "-o", f"ext_path={work}/extstore-{port}:1G,ext_item_age=0"]) as (ports, pids):
        client = HashClient([(HOST, port) for port in ports], use_pooling=True,
                            max_pool_size=THREADS, default_noreply=False, timeout=10)

        def keys(relpath: str, version: Version) -> list[str]:
            # A key is at most 250 bytes of ASCII without spaces, which paths are not; the
            # version is in it, so that a changed file is a new key, never stale bytes.
            text = f"{relpath}\0{protocol.format_version(version)}"
            base = xxhash.xxh3_128_hexdigest(text.encode())
            return [f"{base}:{n}" for n in range(-(-version.size // MEMCACHED_PART_BYTES))]

        def put(relpath: str, version: Version, data: bytes) -> None:
            for n, key in enumerate(keys(relpath, version)):
                part = data[n * MEMCACHED_PART_BYTES:(n + 1) * MEMCACHED_PART_BYTES]
                deadline = time.monotonic() + 30
                while True:
                    try:
                        client.set(key, part)
                        break
                    except MemcacheServerError:  # out of memory until the flusher catches up
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.001)

        def get(relpath: str, version: Version) -> bytes | None:
            parts = [client.get(key) for key in keys(relpath, version)]
            return None if None in parts else b"".join(parts)

        def note() -> str:
            stats = [Client((HOST, port)).stats() for port in ports]
            share = sum(s[b"get_extstore"] for s in stats) / max(1, sum(s[b"get_hits"]
                                                                         for s in stats))
            return f"; {share:.0%} of gets from the extstore file"

        yield Engine(put, get, pids, note)


class _FileServer:
    """A node of the http candidate: answers as cachefs/peer/server.py does, from the files
    of a directory instead of a cache."""

    def __init__(self, root: Path, secret: bytes) -> None:
        self.root, self.secret = root, secret

    def answer(self, path: str, headers) -> tuple[int, dict[str, str], bytes]:
        auth = headers.get(protocol.AUTH_HEADER) or ""
        version_text = headers.get(protocol.VERSION_HEADER)
        if not protocol.request_is_genuine(self.secret, path, version_text, auth):
            return 401, {}, b""
        try:
            relpath, number = protocol.parse_chunk_path(path)
            version = protocol.parse_version(version_text)
            if ".." in relpath.split("/"):
                raise ValueError("outside the tree")
            fd = os.open(self.root / relpath, os.O_RDONLY | os.O_NOFOLLOW)
        except ValueError:
            return 400, {}, b""
        except FileNotFoundError:
            return 404, {}, b""
        try:
            st = os.fstat(fd)
            if Version(st.st_size, st.st_mtime_ns) != version:
                return 409, {}, b""
            offset, length = chunk_span(st.st_size, number)
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        return 200, protocol.sign_response(self.secret, auth, version, data), data


def serve(root: Path, port: int, secret_file: Path) -> int:
    """One node of the http candidate, in a process of its own so that its CPU is its own."""
    server = HTTPServer((HOST, port), Handler)  # cachefs's own peer endpoint
    server.peer = _FileServer(root, protocol.read_secret(secret_file))
    server.serve_forever()
    return 0


@contextmanager
def http_peers(work: Path) -> Iterator[Engine]:
    work.mkdir(parents=True)
    secret_file = work / "peer.secret"
    secret_file.touch(mode=0o600)
    secret_file.write_text(os.urandom(32).hex())
    secret = protocol.read_secret(secret_file)
    with _servers(work, lambda port: [sys.executable, "-m", "bench.peer_engines", "--serve",
                                      str(work / str(port)), str(port), str(secret_file)]
                  ) as (ports, pids):
        nodes = [f"{HOST}:{port}" for port in ports]
        connections = Connections(timeout_seconds=10)

        def put(relpath: str, version: Version, data: bytes) -> None:
            path = work / ring.owner(nodes, relpath).rpartition(":")[2] / relpath
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            os.utime(path, ns=(version.mtime_ns, version.mtime_ns))

        def get(relpath: str, version: Version) -> bytes | None:
            owner, parts = ring.owner(nodes, relpath), []
            for number in range(chunk_count(version.size)):
                path = protocol.chunk_path(relpath, number)
                headers = protocol.sign_request(secret, path, version)
                answer, body = connections.get(owner, path, headers,
                                               chunk_span(version.size, number)[1])
                if answer.status != 200 or body is None \
                        or answer.headers.get(protocol.VERSION_HEADER) \
                        != protocol.format_version(version) \
                        or not protocol.response_is_genuine(
                            secret, headers[protocol.AUTH_HEADER], answer.headers, body):
                    return None
                parts.append(body)
            return b"".join(parts)

        yield Engine(put, get, pids)


ENGINES = {"memcached": memcached, "http": http_peers}


def measure(engine: Engine, files: int, size: int, seed: int) -> dict:
    blob = random.Random(seed).randbytes(size + files)  # file i: size bytes from offset i
    names = [f"train/class{i % 100:03d}/img{i:07d}.jpg" for i in range(files)]
    versions = [Version(size, 1_700_000_000_000_000_000 + i) for i in range(files)]

    def servers_cpu() -> float:
        return sum(process_cpu_seconds(pid) for pid in engine.server_pids)

    own, servers = os.times(), servers_cpu()
    for i in range(files):
        engine.put(names[i], versions[i], blob[i:i + size])
    # memcached writes values out to extstore after the set has answered: that is the set's
    # cost, so wait for the servers to go idle before the reads.
    busy, deadline = servers_cpu(), time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.5)
        busy, before = servers_cpu(), busy
        if busy == before:
            break
    figures = {"set once: writer CPU µs/file": (sum(os.times()[:2]) - sum(own[:2])) / files * 1e6,
               "set once: servers' CPU µs/file": (servers_cpu() - servers) / files * 1e6}
    order = random.Random(seed).sample(range(files), files)

    def read(indexes: list[int]) -> int:
        return sum(engine.get(names[i], versions[i]) == blob[i:i + size] for i in indexes)

    own, servers, started = os.times(), servers_cpu(), time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        equal = sum(pool.map(read, [order[k::THREADS] for k in range(THREADS)]))
    seconds = time.perf_counter() - started
    client_cpu, server_cpu = sum(os.times()[:2]) - sum(own[:2]), servers_cpu() - servers
    latencies = []
    for i in order:
        started = time.perf_counter()
        equal += read([i])
        latencies.append(time.perf_counter() - started)
    latencies.sort()
    figures |= {"files/s, 8 threads": files / seconds,
                "latency p50 ms, 1 thread": latencies[len(latencies) // 2] * 1000,
                "latency p99 ms, 1 thread": latencies[int(0.99 * (files - 1))] * 1000,
                "get: reader CPU µs/file": client_cpu / files * 1e6,
                "get: servers' CPU µs/file": server_cpu / files * 1e6}
    return {"figures": figures, "equal": equal, "reads": 2 * files, "note": engine.note()}


def _form(figure: str, value: float) -> str:
    return f"{value:.2f}" if " ms" in figure else f"{value:,.0f}"


def table(results: dict[str, list[dict]], files: int, size_kib: int) -> Table:
    table = Table(title=f"{files:,} files of {size_kib} KiB, {NODES} nodes on loopback",
                  title_justify="left", caption_justify="left",
                  caption="median (min-max) over the rounds; CPU: user + system, the get's "
                          "over the 8-thread pass; servers: all 4")
    table.add_column("")
    for name in results:
        table.add_column(name, justify="right")
    for figure in next(iter(results.values()))[0]["figures"]:
        table.add_row(figure, *(
            f"{_form(figure, statistics.median(v))} ({_form(figure, min(v))}-"
            f"{_form(figure, max(v))})"
            for v in ([run["figures"][figure] for run in runs] for runs in results.values())))
    table.add_row("reads with the bytes given", *(
        f"{sum(r['equal'] for r in runs):,} of {sum(r['reads'] for r in runs):,}"
        for runs in results.values()))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.peer_engines",
                                     description=__doc__.strip().splitlines()[0])
    parser.add_argument("--files", type=int, default=2000, help="files set and read per "
                        "measurement (default: 2000)")
    parser.add_argument("--size-kib", type=int, default=64, help="each file's size (default: "
                        "64, a typical training example)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each engine, "
                        "in turns (default: 3)")
    parser.add_argument("--work-dir", type=Path, help="for the servers' files (default: a "
                        "temporary directory)")
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)  # ROOT PORT SECRET_FILE
    args = parser.parse_args(argv)
    if args.serve:
        return serve(Path(args.serve[0]), int(args.serve[1]), Path(args.serve[2]))
    if min(args.files, args.size_kib, args.rounds) < 1:
        parser.error("--files, --size-kib and --rounds must be at least 1")
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="cachefs-peer-engines-"))).resolve()
    console = Console(highlight=False)
    results: dict[str, list[dict]] = {name: [] for name in ENGINES}
    # The servers are in sessions of their own: only the finally blocks below end them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:  # a candidate that cannot run exits with one line; its servers are gone by then
        for number in range(args.rounds):
            # In turns, so that the machine's drifts fall on both alike.
            for name in list(ENGINES)[:: 1 if number % 2 == 0 else -1]:
                with ENGINES[name](work / f"{name}-{number}") as engine:
                    run = measure(engine, args.files, args.size_kib * 1024, seed=number)
                results[name].append(run)
                console.print(f"round {number + 1}, {name}: " + "; ".join(
                    f"{k} {_form(k, v)}" for k, v in run["figures"].items()) + run["note"])
    except KeyboardInterrupt:
        print("bench.peer_engines: interrupted; every server is stopped", file=sys.stderr)
        return 130
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    console.print(table(results, args.files, args.size_kib))
    return 0 if all(r["equal"] == r["reads"] for runs in results.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
