"""The control socket: the daemon's side (server: hints, the fast path's OPEN, status) and
the client's side used by the CLI (client, warm, status).

May import: the shared modules, cachefs.kernel, cachefs.mirror (for the socket's name).
"""
