"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, each request's block table, and
the prefix cache (full blocks kept, by content hash, after their requests let go of them).

Block 0 is the null block (vLLM's `null_block`): never given to a request, it pads block tables,
so a padded entry can only ever point at scratch space, never at another request's K/V.

A block is held (ref count > 0) by every running request whose table lists it, or free. Free
blocks wait in one LRU queue, head first to be reused. A full block whose K/V has been computed
gets its content hash (block_hash.py) and stays findable by it while free, until allocation
takes it from the head and drops the hash. Identical blocks are never merged: a hash maps to one
block, and a second block computed with the same content simply stays unhashed. No step ever
writes into a hashed block: a request's new tokens always land past its full, cached ones.

A cached block computed for a request asking for prompt logprobs keeps them (its tokens' logprobs
given all before them), so a later request asking for them (an evaluation harness scoring the
choices of one question) reads the block too. Such a hit recomputes its last token, for the
logprob of the token after it; that token's K/V write goes to the null block (flat_batch.py).

A request's prompt blocks still to compute are claimed by it, by hash, from its admission until
they are cached: a waiting request whose next block is claimed waits for it, passed over by
admission (vLLM instead hashes blocks as they are scheduled; here a hash still never points at K/V
not yet written)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from common.block_hash import BlockHash, adapter_root, chain_block_hashes, root_hash
from common.errors import InvalidRequestError
from common.logprobs import TokenLogprob
from replica_engine.request import Request

NULL_BLOCK_ID = 0


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def blocks_in_bytes(pool_bytes: int, block_bytes: int) -> int:
    """The blocks requests may hold in `pool_bytes` (the null block comes out of them too)."""
    return pool_bytes // block_bytes - 1


def check_pool_fits(num_tokens: int, block_size: int, num_kv_blocks: int) -> None:
    """A request of `num_tokens` (prompt + max_tokens) must fit the whole pool, or never runs."""
    needed = blocks_for_tokens(num_tokens, block_size)
    if needed > num_kv_blocks:
        raise InvalidRequestError(
            "prompt",
            f"{num_tokens} tokens need {needed} KV blocks, but this replica's whole KV pool has "
            f"{num_kv_blocks}; it could never run",
            code="context_length_exceeded",
        )


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # With its hash, when computed for a request asking for prompt logprobs: those of its tokens
    # (the first block's from its second token on), with `logprobs_top` alternatives each.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    logprobs_top: int = 0


class KVCacheManager:
    """Allocates blocks for exactly the tokens scheduled; a request's blocks go back on finish,
    abort or preemption. Block ids index the cache tensors that the model runner owns, which
    hold `pool_size` = `num_blocks` + 1 blocks (the null block first). With
    `enable_prefix_caching`, admission reuses the longest run of cached blocks of a prompt."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, model: str = ""
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks  # blocks requests can hold
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model = model  # part of every block's hash
        self.blocks = [Block(block_id) for block_id in range(num_blocks + 1)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(NULL_BLOCK_ID + 1, num_blocks + 1))
        self._cached: dict[BlockHash, int] = {}  # hash -> the one block holding that content
        self.num_free_cached_blocks = 0  # free blocks that still hold a hash (evictable)
        self._cached_snapshot: tuple[BlockHash, ...] | None = ()  # None: _cached changed since
        self._claimed: dict[BlockHash, Request] = {}  # hash -> the running request computing it

    def cached_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash the pool holds (blocks in use or cached free), copied only when it changed."""
        if self._cached_snapshot is None:
            self._cached_snapshot = tuple(self._cached)
        return self._cached_snapshot

    @property
    def pool_size(self) -> int:
        return self.num_blocks + 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no running request holds (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    # -- the prefix cache ---------------------------------------------------------------
    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The keys of the request's first `num_blocks` full blocks (computed once, kept on it)."""
        hashes = request.block_hashes
        num_blocks = min(num_blocks, request.num_tokens // self.block_size)
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else self._root(request)
            tokens = request.token_ids(len(hashes) * self.block_size, num_blocks * self.block_size)
            hashes += chain_block_hashes(parent, tokens, self.block_size)
        return hashes[:num_blocks]

    def _root(self, request: Request) -> BlockHash:
        params = request.sampling_params
        root = root_hash(self.model, params.cache_salt)
        return adapter_root(root, params.lora)

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding this content, if any (in use or cached free)."""
        return self._cached.get(block_hash)

    def cached_run(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks holding the longest leading run of these contents."""
        hits = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def find_cached_blocks(self, request: Request) -> list[int]:
        """The longest run of the request's leading full blocks that the cache holds, leaving at
        least its last token to compute (the step must produce logits). For a request still owed
        prompt logprobs, only blocks that kept them (as many alternatives or more); none for one
        that must compute its whole prompt (mean pooling)."""
        if not self.enable_prefix_caching or request.computes_whole_prompt:
            return []
        hits = self.cached_run(self.block_hashes(request, (request.num_tokens - 1) // self.block_size))
        if request.wants_prompt_logprobs:
            num_top = request.sampling_params.prompt_logprobs or 0
            kept = [self.blocks[block_id] for block_id in hits]
            usable = next((i for i, b in enumerate(kept) if not self._has_logprobs(b, num_top)), len(hits))
            hits = hits[:usable]
        return hits

    def num_hit_tokens(self, request: Request, num_hit_blocks: int) -> int:
        """The tokens a hit of `num_hit_blocks` counts as computed: all of them, but the last for
        a request still owed prompt logprobs (it computes that token for the next one's)."""
        num_tokens = num_hit_blocks * self.block_size
        return num_tokens - 1 if num_tokens and request.wants_prompt_logprobs else num_tokens

    @staticmethod
    def _has_logprobs(block: Block, num_top: int) -> bool:
        return block.prompt_logprobs is not None and block.logprobs_top >= num_top

    def _hit_prompt_logprobs(self, hits: list[Block], num_top: int) -> list[TokenLogprob]:
        """The prompt logprobs the hit blocks kept, with `num_top` alternatives each."""
        entries = [entry for block in hits for entry in block.prompt_logprobs or ()]
        if all(block.logprobs_top == num_top for block in hits):
            return entries
        return [replace(entry, top=entry.top[:num_top]) for entry in entries]

    def claim_prefix(self, request: Request) -> None:
        """The request, just admitted, computes its prompt's full blocks that are not cached: a
        waiting request sharing them waits for them (`waits_for_prefix`) instead of computing
        them again beside it."""
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes(request, (request.num_prompt_tokens - 1) // self.block_size)
        for block_hash in hashes[request.num_hashed_blocks :]:
            self._claimed.setdefault(block_hash, request)

    def waits_for_prefix(self, request: Request, hits: list[int]) -> bool:
        """The block after its hit is claimed by a running request computing it (with the prompt
        logprobs it wants, if it wants them): admitted a step or more later, it reads it."""
        return self._computed_for(request, len(hits))

    def num_expected_hit_blocks(self, request: Request) -> int:
        """The blocks it will read: those the cache holds, then those being computed for it."""
        num_blocks = len(self.find_cached_blocks(request))
        while self._computed_for(request, num_blocks):
            num_blocks += 1
        return num_blocks

    def _computed_for(self, request: Request, index: int) -> bool:
        """Its block `index` is claimed by another running request, which computes what it wants."""
        hashes = request.block_hashes
        owner = self._claimed.get(hashes[index]) if index < len(hashes) else None
        if owner is None or owner is request:
            return False
        if request.wants_prompt_logprobs:
            wanted = request.sampling_params.prompt_logprobs or 0
            return owner.wants_prompt_logprobs and (owner.sampling_params.prompt_logprobs or 0) >= wanted
        return True

    def _unclaim(self, request: Request, hashes: list[BlockHash]) -> None:
        for block_hash in hashes:
            if self._claimed.get(block_hash) is request:
                del self._claimed[block_hash]

    def cache_computed_blocks(self, request: Request) -> None:
        """Give every full block whose K/V the request has computed its hash, so later requests
        can find it. Only computed blocks: a hash never points at K/V still to be written. The
        block found by that hash keeps the request's prompt logprobs of its tokens, if it has
        them and the block has none (or fewer alternatives)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_hashed_blocks:
            return
        hashes = self.block_hashes(request, num_full)
        for index in range(request.num_hashed_blocks, num_full):
            block = self.blocks[request.block_ids[index]]
            if block.block_hash is None and hashes[index] not in self._cached:
                block.block_hash = hashes[index]
                self._cached[hashes[index]] = block.block_id
                self._cached_snapshot = None
            self._keep_prompt_logprobs(request, index, self.blocks[self._cached[hashes[index]]])
        self._unclaim(request, hashes[request.num_hashed_blocks : num_full])
        request.num_hashed_blocks = num_full

    def _keep_prompt_logprobs(self, request: Request, index: int, block: Block) -> None:
        num_top = request.sampling_params.prompt_logprobs
        end = (index + 1) * self.block_size - 1  # request.prompt_logprobs[i] is token i + 1's
        if num_top is None or len(request.prompt_logprobs) < end or self._has_logprobs(block, num_top):
            return
        block.prompt_logprobs = tuple(request.prompt_logprobs[max(0, end - self.block_size) : end])
        block.logprobs_top = num_top

    def hold_prefix(self, request: Request, num_blocks: int) -> list[tuple[int, int]]:
        """Adopt K/V computed elsewhere (a prefill replica's) for the request's first `num_blocks`
        full blocks: each is held for it until its admission takes it as a prefix-cache hit
        (`release_hold`). A block the cache already holds is held as it is; the others take free
        blocks, hashed now, and are returned as (block index, block id): the caller writes their
        K/V before any step runs. Stops where the pool runs short (the request computes the rest);
        nothing without prefix caching, which is how the request finds them."""
        if not self.enable_prefix_caching:
            return []
        to_write = []
        for index, block_hash in enumerate(self.block_hashes(request, num_blocks)):
            block_id = self._cached.get(block_hash)
            if block_id is not None:
                self._take_cached(self.blocks[block_id])
            elif self._free:
                block_id = self._take_free_block()
                self.blocks[block_id].block_hash = block_hash
                self._cached[block_hash] = block_id
                self._cached_snapshot = None
                to_write.append((index, block_id))
            else:
                break
            request.held_block_ids.append(block_id)
        return to_write

    def release_hold(self, request: Request) -> None:
        """Let go of the blocks held for the request by `hold_prefix` (once admitted, it holds
        the ones it found itself; aborted while waiting, they stay cached)."""
        self._release(request.held_block_ids)
        request.held_block_ids = []

    # -- allocation ---------------------------------------------------------------------
    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        needed = blocks_for_tokens(request.num_planned_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(request.block_ids))

    def allocate(self, request: Request, num_new_tokens: int, cached_block_ids: Sequence[int] = ()) -> bool:
        """Grow the request's block table to hold `num_new_tokens` more tokens, after first
        taking `cached_block_ids` (prefix-cache hits for a request holding nothing yet, whose
        tokens then count as computed). False, changing nothing, if the pool is short."""
        num_hit_tokens = self.num_hit_tokens(request, len(cached_block_ids))
        num_new = self.num_new_blocks(request, num_hit_tokens + num_new_tokens) - len(cached_block_ids)
        if cached_block_ids:
            hits = [self.blocks[block_id] for block_id in cached_block_ids]
            if num_new > len(self._free) - sum(block.ref_count == 0 for block in hits):
                return False
            for block in hits:
                self._take_cached(block)
                request.block_ids.append(block.block_id)
            if request.wants_prompt_logprobs:
                kept = self._hit_prompt_logprobs(hits, request.sampling_params.prompt_logprobs or 0)
                if len(kept) > len(request.prompt_logprobs):
                    request.prompt_logprobs = kept
            request.num_computed_tokens += num_hit_tokens
            request.num_hashed_blocks += len(hits)
            request.prefix_hit_end = len(hits) * self.block_size
        elif num_new > len(self._free):
            return False
        if num_new > 0:  # most steps' rows fit in the blocks they hold: nothing to take
            request.block_ids.extend([self._take_free_block() for _ in range(num_new)])
        return True

    def _take_cached(self, block: Block) -> None:
        """One more holder of a block found by its hash (out of the free queue if it was free)."""
        if block.ref_count == 0:
            del self._free[block.block_id]
            self.num_free_cached_blocks -= 1
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evicted: its content is about to be overwritten
            del self._cached[block.block_hash]
            self._cached_snapshot = None
            block.block_hash = None
            block.prompt_logprobs = None
            self.num_free_cached_blocks -= 1
        block.ref_count = 1
        return block_id

    def free(self, request: Request) -> None:
        """Let go of the request's blocks. Cached ones join the LRU tail in reverse, so its last
        blocks are evicted first (a shared prefix outlives its suffixes); blocks without a hash
        hold nothing reusable and go to the head, to be reused before any cached one."""
        self._release(request.block_ids)
        self._unclaim(request, request.block_hashes)
        request.block_ids = []
        request.num_hashed_blocks = 0
        request.prefix_hit_end = 0
        self.release_hold(request)

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)
            else:
                self.num_free_cached_blocks += 1
