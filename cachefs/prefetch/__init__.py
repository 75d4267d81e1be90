"""Hints: the paths a client says it will read (paths), fetched ahead by a pool of workers
into the cache or, for files the cache does not keep, into memory (prefetcher, staging).

May import: the shared modules, cachefs.store, cachefs.remote.
"""
