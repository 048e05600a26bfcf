"""Prefix-cache keys for full KV blocks, chained: a block's hash covers every token before it.

hash(block i) = sha256(hash(block i-1) || its token ids as little-endian uint32), and the chain
starts from sha256 of the extra keys (the model and the request's `cache_salt`; then, for a
request run with a LoRA adapter, the adapter's name and path), so two requests share a block only
if the model, the salt, the adapter and every token up to the block's end are equal.

Why sha256: a collision would silently hand one request another's K/V (wrong output, and across
tenants a leak), so the key must be collision-resistant, not merely well spread; Python's own
`hash` is neither stable across processes nor wide enough. sha256 is in the standard library and
costs ~1 us per 16-token block here, against the ~ms a step takes. Torch-free, so a router can
compute the same keys from token ids alone."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

from common.lora import LoRARequest

BlockHash = bytes  # a 32-byte sha256 digest


def root_hash(model: str, cache_salt: str | None) -> BlockHash:
    """The chain's start: what every block's key depends on besides tokens."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    return hashlib.sha256(b"stallfree-kv\x00" + model.encode() + b"\x00" + salt).digest()


def adapter_root(root: BlockHash, lora: LoRARequest | None) -> BlockHash:
    """The chain's start for a request run with a LoRA adapter (its K/V differ from the base
    model's): derived from the model's root, so a router holding a replica's root finds it too.
    No adapter: `root` itself."""
    if lora is None:
        return root
    return hashlib.sha256(b"stallfree-lora\x00" + root + lora.key.encode()).digest()


def chain_block_hashes(root: BlockHash, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The keys of every full block of `token_ids`, chained from `root` (what a router hashes, and
    the engine as a request's blocks fill). The tokens are packed once, not block by block."""
    data, step = _uint32_le(token_ids), 4 * block_size
    hashes, parent = [], root
    for start in range(0, len(data) - step + 1, step):
        parent = hashlib.sha256(parent + data[start : start + step]).digest()
        hashes.append(parent)
    return hashes


_UINT32 = next(code for code in "IL" if array(code).itemsize == 4)


def _uint32_le(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32s (OverflowError for one outside 0..2**32-1)."""
    packed = array(_UINT32, token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()
