"""Benchmark and test tooling for cachefs: the slow NFS-like remote emulator lives here."""
