"""The startup profile of the step-time model: a few synthetic steps of known composition (prompt
chunks 64, 512 and 2,048 tokens into a sequence, decode batches at those contexts, and a mix), timed on
the real model before the replica takes requests, once (the replica logs how long it took). With a
TBT target, prompt chunks stop growing at a context once one takes PROFILE_REACH times the target:
the budget schedules no such chunk, and on a CPU the largest took most of the profile (seconds each)."""

from __future__ import annotations

import time

from common.sampling_params import SamplingParams
from replica_engine.config import EngineConfig
from replica_engine.kv_cache_manager import NULL_BLOCK_ID, blocks_for_tokens
from replica_engine.model_runner import ModelRunner
from replica_engine.parallel.executor import ParallelExecutor
from replica_engine.scheduler.plan import SamplingRow, ScheduledBatch, ScheduledRow
from replica_engine.scheduler.step_time_model import StepShape, profile_shapes

TOKEN_ID = 100  # any id: timing does not depend on values
PROFILE_REACH = 8.0  # x the TBT target: the longest prompt-chunk step worth timing
_GREEDY = SamplingRow(SamplingParams(max_tokens=1, temperature=0.0), None)


def profile_step_times(
    runner: ModelRunner | ParallelExecutor,
    config: EngineConfig,
    num_kv_blocks: int,
    prompts: bool = True,
    reach_s: float | None = None,
) -> list[tuple[StepShape, float]]:
    """Each shape run twice, the second timed (the first warms caches and allocators). Rows share
    the pool's blocks cyclically: their K/V is garbage, written and read, never cached. With
    `reach_s`, a shape whose prompt chunk is as long as, and starts no earlier than, one of a
    shape timed over `reach_s` is skipped: it would take longer still."""
    samples = []
    too_long: list[tuple[int, int]] = []  # (start, tokens) of the prompt chunks timed over reach_s
    cap, max_len, max_seqs = config.max_num_batched_tokens, config.max_model_len, config.max_num_seqs
    assert cap is not None and max_len is not None and max_seqs is not None
    for rows in profile_shapes(cap, max_len, max_seqs, prompts):
        chunks = [(start, n) for start, n, decode in rows if not decode]
        if any(start >= s and n >= t for start, n in chunks for s, t in too_long):
            continue
        batch = ScheduledBatch(
            tuple(
                profile_row(i, start, n, decode, config, num_kv_blocks)
                for i, (start, n, decode) in enumerate(rows)
            )
        )
        runner.execute(batch)
        started = time.perf_counter()
        runner.execute(batch)
        seconds = time.perf_counter() - started
        samples.append((batch.shape(), seconds))
        runner.release([row.request_id for row in batch.rows])
        if reach_s is not None and seconds > reach_s:
            too_long += chunks
    return samples


def profile_row(
    index: int,
    start: int,
    num_tokens: int,
    is_decode: bool,
    config: EngineConfig,
    num_kv_blocks: int,
    num_drafts: int = 0,
) -> ScheduledRow:
    """A synthetic row: `num_tokens` tokens after `start`, the last `num_drafts` of them draft
    tokens to verify (a decode with drafts), on blocks of the pool taken cyclically."""
    num_blocks = blocks_for_tokens(start + num_tokens, config.block_size)
    block_ids = tuple(NULL_BLOCK_ID + 1 + (index + b) % num_kv_blocks for b in range(num_blocks))
    drafts = (TOKEN_ID,) * num_drafts
    return ScheduledRow(
        f"profile-{index}",
        (TOKEN_ID,) * num_tokens,
        start,
        block_ids,
        is_decode,
        _GREEDY,
        draft_token_ids=drafts,
        num_prompt_tokens=0 if is_decode or num_drafts else num_tokens,
    )
