"""The emulated NFS remote the benchmark and the tests read through: a FUSE file system
that injects latency and faults (slowfs), its handle for tests and benchmarks (remote),
and the measurement of what it costs in CPU (remote_cost).
"""
