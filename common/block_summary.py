"""What a replica tells routers about the KV blocks it holds: a Bloom filter over their prefix-cache
keys (replica_engine/block_hash.py), small enough to ride in every routing-stats report.

A Bloom filter answers "held?" with no false negatives and a false-positive rate set by its size:
m bits and k probes for n keys give (1 - e^(-kn/m))^k. Sized for the replica's whole pool, a
summary of 4,096 blocks at 1% is 4.8 KiB (9.6 bits a block, 7 probes). A pool larger than the
capacity it was sized for only raises the false-positive rate (the formula above, with the real
n), never hides a held block. Keys are sha256 digests, uniform already: the k probe positions
come from two 64-bit words of the key (double hashing), so no hashing is redone here.

Pure Python and numpy (no torch): the router imports it, and replicas build one per report."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 32  # a sha256 digest
_WORD = (1 << 64) - 1  # probe arithmetic wraps at 64 bits, as numpy's uint64


@dataclass(frozen=True)
class BlockSummary:
    num_bits: int
    num_probes: int
    bits: bytes  # num_bits bits, little-endian within each byte (numpy's packbits order "little")

    @staticmethod
    def geometry(capacity: int, false_positive_rate: float) -> tuple[int, int]:
        """(bits, probes) of the smallest filter holding `capacity` keys at that rate."""
        if capacity < 1 or not 0 < false_positive_rate < 1:
            raise ValueError("capacity must be >= 1 and false_positive_rate in (0, 1)")
        num_bits = math.ceil(-capacity * math.log(false_positive_rate) / math.log(2) ** 2)
        num_bits = -(-num_bits // 8) * 8  # whole bytes
        return num_bits, max(1, round(num_bits / capacity * math.log(2)))

    @classmethod
    def of(cls, keys: Iterable[bytes], capacity: int, false_positive_rate: float = 0.01) -> BlockSummary:
        num_bits, num_probes = cls.geometry(capacity, false_positive_rate)
        bits = np.zeros(num_bits, dtype=bool)
        joined = b"".join(keys)
        if joined:
            bits[_probe_positions(joined, num_bits, num_probes).ravel()] = True
        return cls(num_bits, num_probes, np.packbits(bits, bitorder="little").tobytes())

    def __contains__(self, key: bytes) -> bool:
        """One key, in plain Python: cheaper than numpy's setup for a single lookup."""
        h1, h2 = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little") | 1
        for probe in range(self.num_probes):
            position = ((h1 + probe * h2) & _WORD) % self.num_bits
            if not self.bits[position >> 3] >> (position & 7) & 1:
                return False
        return True

    def contains_each(self, keys: Sequence[bytes]) -> np.ndarray:
        """One bool per key."""
        if not keys:
            return np.zeros(0, dtype=bool)
        return self._unpacked[_lookup_positions(b"".join(keys), self.num_bits, self.num_probes)].all(axis=1)

    @functools.cached_property
    def _unpacked(self) -> np.ndarray:
        """One bool per bit: a router probes each report's summary once per request it ranks."""
        return np.unpackbits(np.frombuffer(self.bits, dtype=np.uint8), bitorder="little").astype(bool)

    def false_positive_rate(self, num_keys: int) -> float:
        """Expected, for a filter holding `num_keys` keys."""
        return (1 - math.exp(-self.num_probes * num_keys / self.num_bits)) ** self.num_probes


@functools.lru_cache(maxsize=16)  # a router probes one prompt's keys in every replica's summary
def _lookup_positions(joined_keys: bytes, num_bits: int, num_probes: int) -> np.ndarray:
    positions = _probe_positions(joined_keys, num_bits, num_probes)
    positions.flags.writeable = False  # shared by every caller
    return positions


def _probe_positions(joined_keys: bytes, num_bits: int, num_probes: int) -> np.ndarray:
    """[keys, probes] bit positions: (h1 + i * h2) mod m, h1 and h2 the key's first two words."""
    words = np.frombuffer(joined_keys, dtype="<u8").reshape(-1, KEY_BYTES // 8)
    h1, h2 = words[:, 0], words[:, 1] | np.uint64(1)
    probes = np.arange(num_probes, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wrapping uint64 arithmetic is the point
        return (h1[:, None] + probes[None, :] * h2[:, None]) % np.uint64(num_bits)
