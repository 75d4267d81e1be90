"""HTTP servers that answer each connection on a thread of its own, so many at most.

A threading server of the standard library starts a thread for every connection it accepts
and keeps it while the connection stays open.  Connections that send nothing (a port
scanner, a client gone wrong, anyone on the network for an endpoint bound to 0.0.0.0) would
take the serving process's threads without end, and with them what its FUSE requests need.
Here each connection takes a slot; with every slot taken a new connection is closed at
once, logged once per flood, not once per connection.

Thread safety: ``_slots`` is a semaphore; ``_refusing`` is only a hint for the log.
"""

from __future__ import annotations

import logging
import socketserver
import threading

log = logging.getLogger(__name__)


class BoundedThreads(socketserver.ThreadingMixIn):
    """Mixed in before a server class: at most ``max_connections`` served at once."""

    daemon_threads = True
    block_on_close = False
    max_connections = 64
    # What the log calls the connections, and why they come.
    what = "connections"

    def __init__(self, *args, **kwargs) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._refusing = False
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            if not self._refusing:
                log.warning("%s refused: %d open already (the latest from %s)", self.what,
                            self.max_connections, client_address[0])
            self._refusing = True
            self.shutdown_request(request)
            return
        self._refusing = False
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
