"""The remote (the NFS mount): calls bounded by --remote-timeout (remote), attributes kept
for --revalidate seconds (attrcache), and chunks fetched once however many readers want
them, stored in the cache on the way (fetcher).

May import: the shared modules, cachefs.store.
"""
