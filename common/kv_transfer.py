"""What moves between a prefill replica and a decode replica: a prompt's K/V blocks (KvBlocks), and
where a prefill replica published them for a decode replica to fetch (KvHandle).

The blocks are a prompt's leading *full* blocks, keyed by the prefix cache's chained hash: the
decode replica adopts them into its pool as prefix-cache blocks and computes the rest of the
prompt (its last, partial block, and always its last token, whose logits it samples) itself. So
every sampled token is the decode replica's, from its own request: seeds, logprobs, grammars and
penalties work as in colocated serving. Torch-free: the data is flat bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from common.block_hash import BlockHash


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """K and V of every layer for one block of tokens."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


class KvTransferError(RuntimeError):
    """Published blocks could not be fetched (gone, expired, on another node, a lost peer): the
    decode replica then computes the prompt itself."""


@dataclass(frozen=True)
class KvLayout:
    """The shape of one engine's KV pool: blocks move only between equal layouts."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch's name: "float32", "bfloat16", ...
    dtype_bytes: int

    @property
    def block_bytes(self) -> int:
        """K and V of every layer for one block."""
        heads = (self.num_kv_heads, self.head_dim)
        return kv_block_bytes(self.num_layers, self.block_size, *heads, self.dtype_bytes)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        """KvBlocks.data's layout: [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class KvBlocks:
    """A prompt's first `num_blocks` full blocks of K/V. `last_hash`: the prefix-cache key of the
    last of them (chained: it covers the model, the salt, the adapter and every token before), so
    a decode replica adopts them only for the very prompt they were computed for. `data`: flat
    bytes in `layout.shape(num_blocks)`; None in the fleet simulator, which moves no data."""

    layout: KvLayout
    num_blocks: int
    last_hash: BlockHash
    data: np.ndarray | None  # uint8, C-contiguous

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    def without_data(self) -> KvBlocks:
        return KvBlocks(self.layout, self.num_blocks, self.last_hash, None)


@dataclass(frozen=True)
class KvHandle:
    """Where a prefill replica published one prompt's KvBlocks (the blocks' description, without
    their data), for one decode replica to fetch once. `connector` says how: `shared_memory` (a
    file in /dev/shm on `node_id`'s node), `tcp` (ask `address` for `key`), `object_store` (Ray's
    object `ref`), or `auto` (the file where the reader is on `node_id`, else `address`)."""

    connector: str
    key: str
    node_id: str
    blocks: KvBlocks  # data None: it is what is fetched
    path: str | None = None
    address: tuple[str, int] | None = None
    ref: Any = None  # a ray.ObjectRef
