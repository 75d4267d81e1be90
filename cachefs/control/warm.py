"""`cachefs warm`: fill the cache from a list of paths before training starts.

Sends ``FETCH path`` requests over several control connections (the daemon fetches each
file from the remote into the cache, if the file is admitted, on the connection's thread),
each connection carrying up to PIPELINE_DEPTH requests at once: the daemon answers them in
order, and never waits for the next request to come.  One thread reads the list, sends and
reads the answers, so that the client costs a few microseconds per path and holds only the
paths in flight, whatever the length of the list (warmlist.py).  A checkpoint of how far the
list was answered lets a warm run again go on where an interrupted one stopped
(checkpoint.py).  Progress goes to stderr (a bar on a terminal; plain lines otherwise), the
summary to stdout.

The paths go first to the daemon's reader-ahead (_Ahead, prefetch/readahead.py), which
copies most files into the cache itself and says which: those are answered here, with no
FETCH.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cachefs.control.checkpoint import (
    BLOCK_PATHS,
    COMMIT_SECONDS,
    RESULTS,
    Block,
    Checkpoint,
    Progress,
    block_hasher,
    skip_done,
)
from cachefs.control.client import connect, request
from cachefs.control.concurrency import ConcurrencyTuner
from cachefs.control.server import MAX_LINE_BYTES
from cachefs.control.warmlist import PathList
from cachefs.errors import UsageError
from cachefs.sizes import format_bytes

# At most this many files fetched at once; concurrency.py finds how many go fastest.
DEFAULT_CONNECTIONS = 32
# Requests sent ahead on each connection: the daemon's thread for it finds the next one
# waiting as it answers one (a round trip to the client would leave it idle).
PIPELINE_DEPTH = 16
# The answers are taken in rounds at most this often: a round handles every answer that came
# meanwhile, so that the client wakes a few hundred times a second, not once per file.
# (PIPELINE_DEPTH requests per connection cover a round at tens of thousands of files/s.)
ROUND_SECONDS = 0.002
# The daemon answers a FETCH once the file is in the cache, bounded by its --remote-timeout.
REPLY_TIMEOUT_SECONDS = 600.0
PROGRESS_EVERY_SECONDS = 0.1
# The list is read this many paths before they are fetched for each of the daemon's
# readers-ahead, each path told to one as it is read (READ-AHEAD), which starts the kernel
# reading the file where its fetch would copy it.
AHEAD_PATHS = 2048
# Paths not yet taken by a reader-ahead, at most: advice that cannot be sent at once waits
# this far, then is dropped, never holding the FETCHes up.
AHEAD_PENDING_BYTES = 1 << 20
# How long the daemon may take to say whether it reads a warm's paths ahead.
AHEAD_ANSWER_SECONDS = 5.0
# The list is dealt to the daemon's readers-ahead in batches of this many paths, a batch to
# each in turn: as many as one takes at once (BATCH_PATHS, prefetch/readahead.py).
AHEAD_BATCH_PATHS = 256
# Readers-ahead a warm tells its paths to, at most, whatever the daemon says.
MAX_AHEAD_STREAMS = 16
# Paths the readers-ahead said were copied and taken in, kept until they come up to be
# fetched, at most this many times the paths read ahead (a path said twice, or one whose
# FETCH was sent before it was said, stays).
TAKEN_IN_KEPT = 2
# A path the reader-ahead is still on its way to waits for it while it keeps its pace: after
# its last advance (a batch of its copies takes some 50 ms), for AHEAD_STALL_FACTOR times the
# longest it took between two advances so far, AHEAD_STALL_SECONDS to AHEAD_STALL_MAX_SECONDS
# (a batch that finds its directories cold takes longest: 0.85 s at most over a million
# files of 4 KiB with pages dropped, over 0.5 s for 16 of 23,000 advances, where a fixed
# 0.5 s had the warm fetch 10 % of the files the reader-ahead was copying); and for its
# first word at most AHEAD_FIRST_SECONDS (the daemon starts it at its first warm).  One
# silent past that is taken for stuck: the warm fetches on its own until it speaks again.
AHEAD_STALL_SECONDS = 1.0
AHEAD_STALL_FACTOR = 4
AHEAD_STALL_MAX_SECONDS = 10.0
AHEAD_FIRST_SECONDS = 3.0
# What _Ahead.next_path gives while the next path waits for the reader-ahead (told apart
# by identity: no path of a list is this object).
WAIT = b"\0(wait)"
MAX_ERRORS_SHOWN = 10


class WarmStopped(Exception):
    """The warm cannot go on (the daemon went away); the message says why, in one line."""


class _Progress:
    """Progress on stderr: rich's bar with rate and ETA on a terminal (no bar and no ETA
    without a total: stdin, a walk); into a pipe or a log, one plain line every
    ``PLAIN_EVERY_SECONDS`` (none for a warm shorter than that).

    Thread safety: used by one thread.
    """

    PLAIN_EVERY_SECONDS = 10.0

    def __init__(self, total: int | None, done: int) -> None:
        self.total = total
        self.started = time.monotonic()
        self._done_before = done
        self._last_line = self.started
        self._bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            if total is None:
                columns = [TextColumn("warming"), TextColumn("{task.completed:,.0f} files")]
            else:
                columns = [TextColumn("warming"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("files")]
            columns += [_files_per_second_column(), TextColumn("[cyan]{task.fields[cached]}"),
                        TimeElapsedColumn()]
            if total is not None:
                columns += [TextColumn("eta"), TimeRemainingColumn()]
            self._bar = Progress(*columns, console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task("warm", total=total, completed=done,
                                            cached=format_bytes(0))
            self._bar.start()

    def update(self, done: int, nbytes: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, cached=f"{format_bytes(nbytes)} new")
            return
        now = time.monotonic()
        if now - self._last_line >= self.PLAIN_EVERY_SECONDS:
            self._last_line = now
            rate = (done - self._done_before) / max(now - self.started, 1e-9)
            of = "" if self.total is None else f"/{self.total:,}"
            print(f"warm: {done:,}{of} files, {format_bytes(nbytes)} new, "
                  f"{rate:,.0f} files/s", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _files_per_second_column():
    from rich.progress import ProgressColumn
    from rich.text import Text

    class FilesPerSecond(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("-" if speed is None else f"{speed:,.0f}/s", style="green")

    return FilesPerSecond()


class _Stream:
    """One READ-AHEAD connection: a reader-ahead's share of the list, what it is told and
    what it says.

    Thread safety: used by one thread.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket | None = sock
        self.pending = bytearray()  # paths to tell it, not sent yet
        self.told = 0  # paths told (or to be, in pending)
        self.said = bytearray()  # of what it says, not a whole line yet
        self.done = 0  # of the paths told, those it is done with
        # Paths wait for it until then: it has started and said it was done with more
        # paths since, or it is stuck.
        self.patient_until = time.monotonic() + AHEAD_FIRST_SECONDS
        self.advanced_at: float | None = None  # when it last said it was done with more
        self.slowest = 0.0  # the longest it took between two of those, so far

    def advanced(self, done: int) -> None:
        """It is done with the first ``done`` paths told: the next ones wait for it as long
        as its pace so far allows."""
        now = time.monotonic()
        if self.advanced_at is not None:
            self.slowest = max(self.slowest, now - self.advanced_at)
        self.advanced_at = now
        self.done = done
        self.patient_until = now + min(AHEAD_STALL_MAX_SECONDS, max(
            AHEAD_STALL_SECONDS, AHEAD_STALL_FACTOR * self.slowest))


def _open_stream(target: str) -> tuple[socket.socket, int]:
    """A READ-AHEAD connection the daemon handed to a reader-ahead, and how many the daemon
    reads a warm's list ahead on; OSError when it refuses (a cluster, too many warms), or
    is gone."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(AHEAD_ANSWER_SECONDS)
        sock.connect(target)
        # The daemon hands the connection to its reader-ahead once it answers, and the
        # reader-ahead says nothing before it is told a path: the reply is all there is.
        try:
            reply = request(sock, b"READ-AHEAD")
            streams = int(reply.get("streams", 1)) if reply.get("ok") is True else 0
        except (UsageError, ValueError, TypeError, AttributeError):
            streams = 0
        if streams < 1:
            raise OSError("no read-ahead")
        sock.setblocking(False)
        return sock, min(streams, MAX_AHEAD_STREAMS)
    except OSError:
        sock.close()
        raise


class _Ahead:
    """The list read ahead of its fetches (AHEAD_PATHS paths for each reader-ahead), each
    path told to one of the daemon's readers-ahead as it is read, on a connection to each
    (a _Stream), a batch of AHEAD_BATCH_PATHS to each in turn: a path a reader-ahead has not
    taken waits (up to AHEAD_PENDING_BYTES), then is not told.

    On its connection, each reader-ahead says which of its paths it copied and the daemon
    took into the cache already (their size and the path, a line each), which need no
    FETCH, and how many of the paths told it it is done with ("@" and the count), every
    copy of them said.  A path told comes up to be fetched only once its reader-ahead is
    done with it, or has said nothing new for longer than its pace allows
    (AHEAD_STALL_FACTOR): the FETCHes wait for copies under way rather than fill the same
    files.

    Thread safety: used by one thread.
    """

    def __init__(self, paths: Iterator[bytes], target: str,
                 selector: selectors.BaseSelector, lead: int = AHEAD_PATHS) -> None:
        self._source = paths
        self._selector = selector
        # The paths read, each with the stream it was told to and its number among those
        # told there (None, -1: not told).
        self._queue: deque[tuple[bytes, _Stream | None, int]] = deque()
        self._exhausted = False
        self._dealt = 0  # paths dealt to the streams
        self._taken_in: dict[bytes, int] = {}  # path -> size, oldest first
        self._streams: list[_Stream] = []
        try:
            sock, count = _open_stream(target)
            self._add(sock)
            for _ in range(count - 1):
                self._add(_open_stream(target)[0])
        except OSError:
            pass  # fewer streams then, or none: the FETCHes alone, as slow as that is
        self._lead = lead * max(1, len(self._streams))

    def _add(self, sock: socket.socket) -> None:
        self._streams.append(_Stream(sock))
        self._selector.register(sock, selectors.EVENT_READ, None)

    def next_path(self) -> bytes | None:
        """The next path to fetch; None at the end of the list; WAIT while its reader-ahead
        is still on its way to it."""
        streams = self._streams
        while not self._exhausted and len(self._queue) <= self._lead:
            path = next(self._source, None)
            if path is None:
                self._exhausted = True
                break
            line = path + b"\n"
            stream, told = None, -1
            if streams and len(line) <= MAX_LINE_BYTES + 1 and b"\n" not in path:
                stream = streams[(self._dealt // AHEAD_BATCH_PATHS) % len(streams)]
                self._dealt += 1
                if stream.sock is not None and len(stream.pending) < AHEAD_PENDING_BYTES:
                    stream.pending += line
                    told = stream.told
                    stream.told += 1
                else:
                    stream = None
            self._queue.append((path, stream, told))
        if not self._queue:
            return None
        if self.waiting() and self._queue[0][0] not in self._taken_in:
            return WAIT
        return self._queue.popleft()[0]

    def waiting(self) -> float:
        """How long the next path may still wait for its reader-ahead (0: it does not)."""
        if not self._queue:
            return 0.0
        _, stream, told = self._queue[0]
        if stream is None or stream.sock is None or told < stream.done:
            return 0.0
        return max(0.0, stream.patient_until - time.monotonic())

    def send(self) -> None:
        """Send what the readers-ahead's connections take now of the paths read."""
        for stream in self._streams:
            if stream.sock is None or not stream.pending:
                continue
            try:
                sent = stream.sock.send(stream.pending)
            except BlockingIOError:
                continue
            except OSError:
                self._close(stream)  # it went away: the FETCHes go on without its advice
                continue
            del stream.pending[:sent]

    def receive(self) -> None:
        """Take in what the readers-ahead said since they were last asked."""
        taken_in = self._taken_in
        for stream in self._streams:
            while stream.sock is not None:
                try:
                    data = stream.sock.recv(65536)
                except BlockingIOError:
                    break
                except OSError:
                    data = b""
                if not data:
                    self._close(stream)  # it went away: the FETCHes go on without it
                    break
                said = stream.said
                said += data
                start = 0
                while (end := said.find(b"\n", start)) >= 0:
                    line = bytes(said[start:end])
                    start = end + 1
                    if line.startswith(b"@"):
                        done = int(line[1:]) if line[1:].isdigit() else 0
                        if done > stream.done:
                            stream.advanced(done)
                        continue
                    size, _, path = line.partition(b" ")
                    if size.isdigit():
                        taken_in[path] = int(size)
                del said[:start]
        while len(taken_in) > TAKEN_IN_KEPT * self._lead:
            del taken_in[next(iter(taken_in))]

    def taken_in(self, path: bytes) -> int | None:
        """The size of ``path`` when its reader-ahead said it copied it and the daemon took
        the copy in (said once), else None: the FETCH finds out."""
        return self._taken_in.pop(path, None) if self._taken_in else None

    def _close(self, stream: _Stream) -> None:
        if stream.sock is not None:
            try:
                self._selector.unregister(stream.sock)
            except (KeyError, ValueError):
                pass  # not registered yet
            stream.sock.close()
            stream.sock = None
        stream.pending.clear()

    def close(self) -> None:
        for stream in self._streams:
            self._close(stream)
        self._taken_in.clear()


@dataclass
class _OpenBlock:
    """A block of the list with paths read but not all answered."""

    hasher: object = field(default_factory=block_hasher)
    read: int = 0
    answered: int = 0
    counts: list[int] = field(default_factory=lambda: [0] * len(RESULTS))
    new_bytes: int = 0
    digest: int | None = None  # once every path of it has been read


@dataclass
class _Connection:
    sock: socket.socket
    inflight: deque[tuple[int, bytes]] = field(default_factory=deque)  # (block, path)
    outgoing: list[bytes] = field(default_factory=list)
    received: bytearray = field(default_factory=bytearray)


class _Warm:
    """One warm: the list read in order, its paths sent over the connections, the answers
    counted by block, and the checkpoint advanced as blocks complete.

    Thread safety: used by one thread.
    """

    def __init__(self, target: str, paths: Iterator[bytes], done: Progress,
                 checkpoint: Checkpoint | None, connections: int) -> None:
        self._selector = selectors.DefaultSelector()
        self.paths = _Ahead(paths, target, self._selector)
        self.done = done  # the blocks answered whole, from the start of the list
        self.checkpoint = checkpoint
        self.earlier = done.paths  # answered by an earlier warm
        self.counts: Counter[str] = done.counts()
        self.new_bytes = done.new_bytes()
        self.errors: list[str] = []
        self._blocks: dict[int, _OpenBlock] = {}
        self._next_block = len(done.blocks)  # the first block not answered whole
        self._position = done.paths  # of the next path read
        self._exhausted = False
        self._saved_blocks = len(done.blocks)
        self._saved_at = time.monotonic()
        self._tuner = ConcurrencyTuner(connections)
        self._target = target
        self._connections: list[_Connection] = []  # opened as the concurrency first needs

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(REPLY_TIMEOUT_SECONDS)
            sock.connect(self._target)
        except OSError as exc:
            sock.close()
            raise WarmStopped(f"cannot connect to the daemon ({_reason(exc)})") from None
        conn = _Connection(sock)
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self._connections.append(conn)

    def close(self) -> None:
        self.paths.close()
        self._selector.close()
        for conn in self._connections:
            conn.sock.close()

    @property
    def answered(self) -> int:
        return sum(self.counts.values())

    def run(self, progress: _Progress) -> None:
        last_shown = 0.0
        while True:
            while len(self._connections) < self._tuner.current:
                self._connect()
            self._send_more([conn for conn in self._connections[:self._tuner.current]
                             if len(conn.inflight) < PIPELINE_DEPTH])
            waiting = self.paths.waiting()
            if not waiting and not any(conn.inflight for conn in self._connections):
                break
            round_started = time.monotonic()
            events = self._selector.select(waiting or REPLY_TIMEOUT_SECONDS)
            if not events and not waiting:
                raise WarmStopped(f"the daemon answered nothing for {REPLY_TIMEOUT_SECONDS:g} s")
            pause = ROUND_SECONDS - (time.monotonic() - round_started)
            if pause > 0:
                time.sleep(pause)
                events = self._selector.select(0)
            before = self.answered
            for key, _ in events:
                if key.data is None:  # the reader-ahead's connection
                    self.paths.receive()
                else:
                    self._receive(key.data)
            now = time.monotonic()
            self._tuner.answered(self.answered - before, now)
            if now - self._saved_at >= COMMIT_SECONDS:
                self.save()
            if now - last_shown >= PROGRESS_EVERY_SECONDS:
                last_shown = now
                progress.update(self.answered, self.new_bytes)
        progress.update(self.answered, self.new_bytes)

    def save(self) -> None:
        """Commit the blocks answered whole since the last commit."""
        self._saved_at = time.monotonic()
        self._advance()
        if self.checkpoint is not None and len(self.done.blocks) != self._saved_blocks:
            self.checkpoint.save(self.done)
            self._saved_blocks = len(self.done.blocks)

    # -- sending ---------------------------------------------------------------------------

    def _send_more(self, connections: list[_Connection]) -> None:
        """Top ``connections`` up to PIPELINE_DEPTH requests each, then send them.  A path
        the reader-ahead copied into the cache is answered here, with no request."""
        self.paths.receive()
        self.paths.send()  # (while the paths wait for it, it must have them)
        for conn in connections:
            while not self._exhausted and len(conn.inflight) < PIPELINE_DEPTH:
                path = self.paths.next_path()
                if path is WAIT:
                    break
                if path is None:
                    self._exhausted = True
                    self._close_reading()
                    break
                number = self._position // BLOCK_PATHS
                self._position += 1
                block = self._blocks.get(number)
                if block is None:
                    block = self._blocks[number] = _OpenBlock()
                block.hasher.update(path + b"\n")
                block.read += 1
                if block.read == BLOCK_PATHS:
                    block.digest = block.hasher.intdigest()
                size = self.paths.taken_in(path)
                if size is not None:
                    self._count(number, path, "fetched", size, None)
                    continue
                line = b"FETCH " + path + b"\n"
                # The daemon would skip a line too long, unanswered; a name holding a newline
                # (one a walk of the mount found) would be two requests, and every answer
                # after it taken for the path before.
                if len(line) > MAX_LINE_BYTES + 1 or b"\n" in path:
                    why = "path too long" if b"\n" not in path else "name holds a newline"
                    self._answer(number, path, None, why)
                    continue
                conn.inflight.append((number, path))
                conn.outgoing.append(line)
            self.paths.send()
            if conn.outgoing:
                data = b"".join(conn.outgoing)
                conn.outgoing.clear()
                try:
                    conn.sock.sendall(data)
                except OSError as exc:
                    raise WarmStopped(f"lost the connection to the daemon ({_reason(exc)})") \
                        from None
        self._advance()

    def _close_reading(self) -> None:
        """The list is read to its end: its last block, however short, is read whole."""
        last = self._blocks.get((self._position - 1) // BLOCK_PATHS)
        if last is not None and last.digest is None:
            last.digest = last.hasher.intdigest()

    # -- answers ---------------------------------------------------------------------------

    def _receive(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(65536)
        except OSError as exc:
            raise WarmStopped(f"lost the connection to the daemon ({_reason(exc)})") from None
        if not data:
            raise WarmStopped("the daemon closed the connection (unmounted, or stopped)")
        received = conn.received
        received += data
        start = 0
        while (end := received.find(b"\n", start)) >= 0:
            number, path = conn.inflight.popleft()
            self._answer(number, path, bytes(received[start:end]))
            start = end + 1
        del received[:start]

    def _answer(self, number: int, path: bytes, reply: bytes | None,
                unsent: str = "") -> None:
        """Count the daemon's ``reply`` for ``path``; None for a path not sent, ``unsent``
        saying why."""
        result, size, error = _parse(reply) if reply is not None else ("failed", 0, unsent)
        self._count(number, path, result, size, error)

    def _count(self, number: int, path: bytes, result: str, size: int,
               error: str | None) -> None:
        block = self._blocks[number]
        if result == "fetched":
            block.new_bytes += size
            self.new_bytes += size
        block.counts[RESULTS.index(result)] += 1
        self.counts[result] += 1
        block.answered += 1  # last: a block is only saved once its counts are all in
        if error is not None and len(self.errors) < MAX_ERRORS_SHOWN:
            shown = os.fsdecode(path).replace("\n", "\\n")  # one line per failure
            self.errors.append(f"{shown}: {error}")

    def _advance(self) -> None:
        """Move the blocks answered whole, in order from the start, into ``done``."""
        while (block := self._blocks.get(self._next_block)) is not None \
                and block.digest is not None and block.answered == block.read:
            self.done.blocks.append(Block(block.digest, tuple(block.counts), block.new_bytes))
            del self._blocks[self._next_block]
            self._next_block += 1


def _parse(reply: bytes) -> tuple[str, int, str | None]:
    """(result, bytes fetched, error) of a FETCH reply."""
    try:
        body = json.loads(reply)
        if body.get("ok"):
            result = body["result"]
            if result in RESULTS and result != "failed":
                return result, int(body.get("bytes", 0)), None
            return "failed", 0, f"unexpected answer {reply[:80]!r}"
        return "failed", 0, str(body.get("error", "failed"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "failed", 0, f"unexpected answer {reply[:80]!r}"


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def warm(mountpoint: str, paths: PathList, connections: int = DEFAULT_CONNECTIONS, *,
         restart: bool = False, state_dir: Path | None = None) -> int:
    """Warm the paths of ``paths``; prints a summary, returns the exit status (1 when any
    failed, 130 when interrupted)."""
    probe = connect(mountpoint)  # fail early, with one line, when it is not a cachefs mount
    try:
        target = probe.getpeername()
        cache = _cache_of(probe)
    finally:
        probe.close()
    try:
        checkpoint = Checkpoint(Path(mountpoint), paths.identity, state_dir, cache)
    except OSError as exc:
        checkpoint = None
        print(f"warm: cannot keep a checkpoint ({exc}); an interrupted warm will start over",
              file=sys.stderr)
    try:
        return _warm_with(target, paths, connections, checkpoint, restart)
    finally:
        if checkpoint is not None:
            checkpoint.close()


def _cache_of(sock: socket.socket) -> str | None:
    """The name of the cache the daemon on ``sock`` serves (None from a daemon that names
    none): what a checkpoint is taken against."""
    try:
        cache = request(sock, b"PING").get("cache")
    except (OSError, ValueError, AttributeError):
        raise UsageError("the daemon does not answer on its control socket") from None
    return cache if isinstance(cache, str) else None


def _warm_with(target: str, paths: PathList, connections: int,
               checkpoint: Checkpoint | None, restart: bool) -> int:
    source = paths.paths()
    done = Progress()
    if checkpoint is not None and not restart:
        recorded, note = checkpoint.load()
        if recorded.blocks:
            done, source, note = skip_done(source, recorded)
        if note is not None:
            print(f"warm: {note}", file=sys.stderr)
        if done.blocks:
            print(f"warm: going on after path {done.paths:,} of the list, where an earlier "
                  "warm of it stopped (--restart to start over)", file=sys.stderr)
    started = time.monotonic()
    job = _Warm(target, source, done, checkpoint, connections)
    progress = _Progress(paths.total, job.earlier)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    stopped: str | None = None
    try:
        job.run(progress)
    except KeyboardInterrupt:
        stopped = "interrupted"
    except WarmStopped as exc:
        stopped = str(exc)
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.finish()
        job.close()
        if stopped is None and checkpoint is not None:
            checkpoint.remove()  # the whole list is answered: a next warm starts over
        elif checkpoint is not None:
            job.save()
    files = "file" if job.answered == 1 else "files"
    if stopped is not None:
        kept = job.done.paths
        resume = (f"run the same command again to go on after path {kept:,}" if
                  checkpoint is not None and kept else "nothing to go on from")
        print(f"warm: {stopped} after {job.answered:,} {files}; {resume}", file=sys.stderr)
        return 130 if stopped == "interrupted" else 1
    elapsed = time.monotonic() - started
    counts = job.counts
    earlier = f", {job.earlier:,} of them by an earlier warm" if job.earlier else ""
    print(f"warmed {job.answered:,} {files} in {elapsed:.1f} s{earlier}: "
          f"{counts['fetched']:,} fetched ({format_bytes(job.new_bytes)} now cached), "
          f"{counts['cached']:,} already cached, "
          f"{counts['not_admitted']:,} not admitted by the fraction, "
          f"{counts['cache_full']:,} left out (cache full), {counts['failed']:,} failed")
    for line in job.errors:
        print(f"  failed: {line}", file=sys.stderr)
    return 1 if counts["failed"] else 0
