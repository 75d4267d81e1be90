"""The cluster tier: each node serves the files it owns to the other nodes over HTTP, so a
cluster reads each file from the remote once.  Who owns a file (ring), the wire format and
its signatures (protocol), the endpoint a node serves (server), and asking the owner
before the remote (client).

May import: the shared modules, cachefs.store, cachefs.remote.
"""
