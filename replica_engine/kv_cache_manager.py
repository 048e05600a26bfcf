"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and each request's block table.

Block 0 is the null block (vLLM's `null_block`): never given to a request, it pads block tables,
so a padded entry can only ever point at scratch space, never at another request's K/V."""

from __future__ import annotations

from collections import deque

from replica_engine.request import Request

NULL_BLOCK_ID = 0


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Allocates blocks for exactly the tokens scheduled; a request's blocks go back on finish,
    abort or preemption. Block ids index the cache tensors that the model runner owns, which
    hold `pool_size` = `num_blocks` + 1 blocks (the null block first)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks  # blocks requests can hold
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(NULL_BLOCK_ID + 1, num_blocks + 1))

    @property
    def pool_size(self) -> int:
        return self.num_blocks + 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def free_block_ids(self) -> tuple[int, ...]:
        return tuple(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free_block_ids) / self.num_blocks

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        needed = blocks_for_tokens(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(request.block_ids))

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold `num_new_tokens` more tokens; False if the pool is short."""
        num_new = self.num_new_blocks(request, num_new_tokens)
        if num_new > len(self._free_block_ids):
            return False
        request.block_ids.extend(self._free_block_ids.popleft() for _ in range(num_new))
        return True

    def free(self, request: Request) -> None:
        self._free_block_ids.extend(request.block_ids)
        request.block_ids = []
