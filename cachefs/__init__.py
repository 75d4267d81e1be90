"""cachefs: a read-only FUSE mirror of a remote training dataset that keeps a stable
random fraction of its files on local NVMe and prefetches the rest from hints.

The packages follow the path of a read, each importing only those below it (ARCHITECTURE.md):
service, control, mirror, prefetch, remote, store, kernel; and the modules here, shared by all
(attr, errors, sizes, metrics, remotewait).
"""

__version__ = "0.1.0"
