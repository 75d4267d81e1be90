"""cachefs: a read-only FUSE mirror of a remote training dataset that keeps a stable
random fraction of its files on local NVMe and prefetches the rest from hints."""

__version__ = "0.1.0"
