"""A small parent that holds the mount's /dev/fuse descriptor while its serving child comes and
goes: a serving process that dies (a crash, kill -9, the OOM killer) no longer ends the mount.

``cachefs mount --foreground`` (and so the daemon ``cachefs mount`` starts, the systemd unit,
the container) runs this.  It forks the serving child, which starts the daemon, mounts and
sends the descriptor back here (SCM_RIGHTS over a socket pair), then what the FUSE handshake
settled.  When the child dies of anything but the end of the mount, a new child is forked at
once on the same descriptor: it skips INIT, maps the node and handle tables the dead one left
in the runtime directory, asks the kernel to resend the requests in flight
(kernel/takeover.py) and serves on.  Readers only wait meanwhile.

What a child's exit means: 0, the mount ended (unmounted): the supervisor exits 0.  Anything
else before the mount was made: the supervisor exits with it (a bad setting, reported by the
child).  Anything else after: a restart; quick deaths in a row are restarted after a growing
delay, and after ``MAX_QUICK_DEATHS`` the mount is detached and the supervisor exits 1.

SIGTERM, SIGINT, SIGHUP: the mount is detached (lazily, as the daemon itself does); the child
then sees the end of the session and exits.  The child dies with the supervisor
(PR_SET_PDEATHSIG).  A killed supervisor is a killed daemon, whose stale mount the next start
clears, unless systemd keeps the descriptor (service/fdstore.py): then the mount lives on, its
readers waiting, and the next start of the unit takes it over.

A child that handed the mount to another daemon (``cachefs upgrade``, a new pod) says so before
it exits: the supervisor then exits without unmounting and leaves systemd's entry to the new
one, or, with ``linger``, waits holding nothing until it is stopped (a container whose exit
would be restarted, and would take the mount back).

The supervisor stays single-threaded (it forks), does no I/O on the mount and imports what
the child needs before the first fork, so that a restart costs the child's start only.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from cachefs.kernel import mount as kmount
from cachefs.kernel import takeover
from cachefs.kernel.session import Connection
from cachefs.service.fdstore import FdStore
from cachefs.service.process import die_with_parent
from cachefs.service.upgrade import Handover

log = logging.getLogger(__name__)

# A child that dies within QUICK_SECONDS of its start is a quick death; the next start waits
# RESTART_DELAY_SECONDS doubled for each quick death in a row after the first, at most
# MAX_RESTART_DELAY_SECONDS.  The first restart is immediate: a single crash costs no wait.
QUICK_SECONDS = 2.0
RESTART_DELAY_SECONDS = 0.1
MAX_RESTART_DELAY_SECONDS = 5.0
MAX_QUICK_DEATHS = 8


@dataclass
class Succession:
    """What a serving child is handed by its supervisor."""

    supervisor_pid: int
    channel: socket.socket | None  # to send the descriptor and the handshake back
    fd: int | None = None  # the connection, when an earlier child mounted
    connection: Connection | None = None  # what its handshake settled, when it completed
    restarts: int = 0
    died_at: float | None = None  # when the previous child died (time.time())
    mounted_at: float = 0.0  # when the supervisor started (time.time())
    taken_over_from: str | None = None  # how the supervisor got the mount (Handover.source)

    def report_descriptor(self, fd: int) -> None:
        if self.channel is not None:
            takeover.send_fd(self.channel, b"FD", fd)

    def report_connection(self, connection: Connection) -> None:
        if self.channel is not None:
            self.channel.send(b"CONNECTION " + takeover.connection_text(connection).encode())

    def report_handed_over(self) -> None:
        """The mount is another daemon's from now on: not to be unmounted, nor dropped from
        systemd's store, when this child exits."""
        if self.channel is not None:
            self.channel.send(b"HANDED")


class Supervisor:
    """Runs serving children one after the other on one mount.  Build, then :meth:`run`."""

    def __init__(self, mountpoint: str, serve: Callable[[Succession], int],
                 ready_fd: int | None = None, inherited: Handover | None = None,
                 fdstore: FdStore | None = None, linger: bool = False) -> None:
        """``inherited``: a mount handed over by the daemon that served it (upgrade.py) or by
        systemd (fdstore.py); ``fdstore``: systemd's entry of the mount, kept while it lives;
        ``linger``: after handing the mount over, wait to be stopped instead of exiting."""
        self.mountpoint = mountpoint
        self._serve = serve
        self._ready_fd = ready_fd  # the first child reports readiness through it
        self._fd: int | None = None
        self._connection: Connection | None = None
        self._child = 0
        self._stopping = False
        self._handed_over = False
        self._linger = linger
        self._fdstore = fdstore
        self._started_at = time.time()
        self._restarts = 0
        self._died_at: float | None = None
        self._taken_over_from: str | None = None
        if inherited is not None:
            self._fd, self._connection = inherited.fd, inherited.connection
            self._restarts, self._died_at = inherited.restarts, inherited.gone_at
            self._started_at = inherited.mounted_at
            self._taken_over_from = inherited.source

    def run(self) -> int:
        wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        previous_wakeup = signal.set_wakeup_fd(wake_write)
        handlers = {sig: signal.signal(sig, self._on_stop)
                    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        handlers[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda *_: None)
        quick, died_at = 0, self._died_at
        if self._fd is not None and self._connection is not None:
            self._keep()  # inherited: systemd's entry, if any, is the same connection
        try:
            while True:
                started = time.monotonic()
                code = self._run_child(Succession(os.getpid(), None, self._fd, self._connection,
                                                  self._restarts, died_at, self._started_at,
                                                  self._taken_over_from), wake_read)
                if self._handed_over:
                    return self._let_go(wake_read)
                if code == 0 or self._stopping:
                    self._mount_ended()
                    return 0 if self._fd is not None or self._stopping else code
                if self._fd is None:
                    return code  # never mounted: the child said why
                died_at = time.time()
                quick = quick + 1 if time.monotonic() - started < QUICK_SECONDS else 0
                if quick >= MAX_QUICK_DEATHS:
                    log.error("the serving process died %d times in a row within %g s of "
                              "its start; unmounting %s", quick, QUICK_SECONDS, self.mountpoint)
                    kmount.unmount(self.mountpoint)
                    self._mount_ended()
                    return 1
                self._restarts += 1
                if self._fdstore is not None:
                    self._fdstore.update(self._restarts)
                if quick > 1:
                    time.sleep(min(MAX_RESTART_DELAY_SECONDS,
                                   RESTART_DELAY_SECONDS * 2 ** (quick - 2)))
                log.warning("the serving process died (%s); restart %d on the same "
                            "connection", _exit_text(code), self._restarts)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_wakeup)
            os.close(wake_read)
            os.close(wake_write)
            if self._fd is not None:
                os.close(self._fd)

    def _keep(self) -> None:
        """The mount serves: systemd may keep its descriptor (fdstore.py)."""
        if self._fdstore is not None and not self._fdstore.kept and self._fd is not None:
            self._fdstore.keep(self._fd, self._connection, self._started_at, self._restarts)

    def _mount_ended(self) -> None:
        if self._fdstore is not None:
            self._fdstore.drop()

    def _let_go(self, wake_read: int) -> int:
        """The child handed the mount to another daemon and exited: let go of the descriptor
        without unmounting, and of systemd's entry without removing it (the new daemon's now).
        With ``linger``, wait for a stop signal, holding nothing."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        log.info("the mount of %s is another daemon's now", self.mountpoint)
        if not self._linger:
            return 0
        while not self._stopping:  # a signal writes to wake_read
            select.select([wake_read], [], [], 60.0)
            try:
                os.read(wake_read, 512)
            except BlockingIOError:
                pass
        return 0

    def _on_stop(self, signum, _frame) -> None:
        self._stopping = True
        if self._fd is not None:
            kmount.unmount(self.mountpoint)
        elif self._child:
            try:
                os.kill(self._child, signal.SIGTERM)  # still starting: nothing mounted yet
            except ProcessLookupError:
                pass  # it ended, and the wait this signal interrupted has reaped it

    def _run_child(self, succession: Succession, wake_read: int) -> int:
        """Fork a child, take what it reports, and wait for it; its exit code (128 + the
        signal that killed it)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ready_fd, self._ready_fd = self._ready_fd, None
        pid = os.fork()
        if pid == 0:  # the serving child
            code = 1
            try:
                ours.close()
                os.close(wake_read)
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
                    signal.signal(sig, signal.SIG_DFL)
                die_with_parent(succession.supervisor_pid)  # as KillMode=mixed would
                if ready_fd is not None:
                    from cachefs.service.daemon import READY_FD_ENV

                    os.environ[READY_FD_ENV] = str(ready_fd)
                succession.channel = theirs
                code = self._serve(succession)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                log.exception("the serving process failed")
            finally:
                logging.shutdown()
                os._exit(code)
        self._child = pid
        theirs.close()
        if ready_fd is not None:
            os.close(ready_fd)  # the child has it
        log.info("serving process %d started", pid)
        try:
            return self._wait(pid, ours, wake_read)
        finally:
            ours.close()
            self._child = 0

    def _wait(self, pid: int, channel: socket.socket, wake_read: int) -> int:
        watched = [channel, wake_read]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                self._drain(channel)
                return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) \
                    else 128 + os.WTERMSIG(status)
            readable, _, _ = select.select(watched, [], [], 1.0)
            if wake_read in readable:
                try:
                    os.read(wake_read, 512)
                except BlockingIOError:
                    pass
            if channel in readable and not self._take(channel):
                watched = [wake_read]  # the child closed its end

    def _drain(self, channel: socket.socket) -> None:
        channel.setblocking(False)
        try:
            while self._take(channel):
                pass
        except OSError:  # nothing more (EAGAIN), or the child's end reset as it exited
            pass

    def _take(self, channel: socket.socket) -> bool:
        """One report of the child; False at the end of them."""
        try:
            message, fds = takeover.receive(channel)
        except ConnectionError:  # the child's end reset as it exited: no more reports
            return False
        if not message:
            return False
        if message == b"FD" and fds:
            if self._fd is not None:
                os.close(self._fd)
            self._fd = fds.pop(0)  # close-on-exec; the next child gets it by fork
            if self._stopping:  # asked to stop while the child mounted
                kmount.unmount(self.mountpoint)
        elif message.startswith(b"CONNECTION "):
            self._connection = takeover.connection_from_text(message[11:].decode())
            self._keep()
        elif message == b"HANDED":
            self._handed_over = True
        for fd in fds:
            os.close(fd)
        return True


def _exit_text(code: int) -> str:
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"exit status {code}"
