"""Which keys the index may hold, known without asking it: a Bloom filter.

A miss that the cache keeps asks the index whether the file is stored (it is not: that is what
a miss is), and in a first epoch every file is such a miss.  Asked of SQLite, the answer costs
10 to 60 us of the daemon's CPU; asked of this filter, a few hashes.  The filter never says
"absent" of a key the index holds; of a key it does not hold it says "maybe" about one time in a
hundred (more once it holds more keys than it was sized for), and the index is asked then.
Deleted keys stay in the filter (it cannot forget): they only cost a query each.

It is built at start from every key of the index (after a crash, by the background
reconciliation) or loaded from the file a clean stop left, and saved again at the next clean
stop.

Thread safety: keys are added one at a time (the index adds them under its memo lock, as the
record is written: a bit set is a read-modify-write of its byte); lookups take no lock (a
lookup racing the add of its own key finds the record in the index's pending writes first).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import xxhash

# Bits per key the filter is sized for, and hashes per key: about 1 % false "maybe".
BITS_PER_KEY = 10
HASHES = 7
MIN_KEYS = 1 << 20
_HEADER = struct.Struct("<8sQQ")  # magic, capacity in keys, keys added
_MAGIC = b"cfsbloom"
_PROBES = range(HASHES)
_LOW_64 = (1 << 64) - 1
_digest = xxhash.xxh3_128_intdigest


class KeyFilter:
    """A Bloom filter of bytes keys, sized for ``capacity`` keys."""

    def __init__(self, capacity: int, bits: bytearray | None = None, added: int = 0) -> None:
        self.capacity = max(MIN_KEYS, capacity)
        self._bits = bits if bits is not None else bytearray(self.capacity * BITS_PER_KEY // 8)
        self._mask = len(self._bits) * 8  # a multiple of 8, so any size works with modulo
        self.added = added

    @property
    def saturated(self) -> bool:
        """Holding more keys than it was sized for: its "maybe" grows less useful."""
        return self.added > self.capacity

    # Asked for every miss a kept file makes, several times (the open, the fill): written
    # as plain loops over the probes, which cost a quarter of a generator's (0.4 us against
    # 1.5 for a key that is absent).  The i-th probe is ``(first + i * step) % size``.

    def add(self, key: bytes) -> None:
        digest = _digest(key)
        position, step = digest & _LOW_64, (digest >> 64) | 1
        size, bits = self._mask, self._bits
        for _ in _PROBES:
            at = position % size
            bits[at >> 3] |= 1 << (at & 7)
            position += step
        self.added += 1

    def __contains__(self, key: bytes) -> bool:
        digest = _digest(key)
        position, step = digest & _LOW_64, (digest >> 64) | 1
        size, bits = self._mask, self._bits
        for _ in _PROBES:
            at = position % size
            if not bits[at >> 3] >> (at & 7) & 1:
                return False
            position += step
        return True

    def save(self, path: Path) -> None:
        """Write the filter to ``path`` (atomically)."""
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, self.capacity, self.added))
            f.write(self._bits)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> KeyFilter | None:
        """The filter saved at ``path``, or None when there is none or it does not read."""
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if len(data) < _HEADER.size:
            return None
        magic, capacity, added = _HEADER.unpack_from(data)
        bits = bytearray(data[_HEADER.size:])
        if magic != _MAGIC or len(bits) != max(MIN_KEYS, capacity) * BITS_PER_KEY // 8:
            return None
        return cls(capacity, bits, added)
