"""The kernel's side: the FUSE protocol (protocol), a session serving /dev/fuse with
passthrough where the kernel offers it (session), mount(2) and fusermount (mount), and finding
and unmounting mounts (mountpoint).  It knows nothing of caching: a file system object answers
the requests.

May import: the shared modules (cachefs.attr, errors, sizes, metrics, remotewait).
"""
