"""The mirrored tree: where each open finds its bytes, cache, memory or remote (tree), and
the FUSE requests of a mount answered from it, with passthrough where the kernel offers it
(mirrorfs).

May import: the shared modules, cachefs.kernel, cachefs.store, cachefs.remote,
cachefs.prefetch.
"""
