"""The local cache: which files are kept (admission), where their bytes live (layout), what is
known of them (the index), the store that ties them together under a budget, and the check
of a cache directory (verify).

May import: the shared modules (cachefs.attr, errors, sizes, metrics, remotewait).
"""
