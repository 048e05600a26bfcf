"""Turns a sealed step (ScheduledBatch) and its rows' block tables (the persistent batch's) into
one flat varlen batch: every scheduled token of every request in one row of [T], prefill chunks
and decodes alike. Reads only the batch's own copies, never a live request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica_engine.attention.base import AttentionMetadata, DecodeRows, NullBlockWriteError
from replica_engine.kv_cache_manager import NULL_BLOCK_ID
from replica_engine.scheduler.plan import ScheduledBatch


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attention: AttentionMetadata
    # [num_sampling] int64: each sampling request's last token (and its draft tokens), in order
    logits_indices: torch.Tensor

    def to(self, device: torch.device) -> FlatBatch:
        if device.type == "cpu":
            return self
        meta = self.attention
        return FlatBatch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
            attention=AttentionMetadata(
                cu_seqlens_q=meta.cu_seqlens_q.to(device, non_blocking=True),
                seq_lens_kv=meta.seq_lens_kv.to(device, non_blocking=True),
                block_tables=meta.block_tables.to(device, non_blocking=True),
                slot_mapping=meta.slot_mapping.to(device, non_blocking=True),
                max_query_len=meta.max_query_len,
                query_lens_cpu=meta.query_lens_cpu,
                seq_lens_kv_cpu=meta.seq_lens_kv_cpu,
                decode=meta.decode.to(device) if meta.decode is not None else None,
            ),
            logits_indices=self.logits_indices.to(device, non_blocking=True),
        )


def build_flat_batch(
    batch: ScheduledBatch, block_tables: torch.Tensor, block_size: int, pin_memory: bool = False
) -> FlatBatch:
    """`block_tables`: [rows, blocks] int32 in batch order, the null block past each row's own (a
    table short of blocks, a bug, then points a token at the null block, which is refused).

    A row with draft tokens attends as that many + 1 one-token rows over its blocks, each seeing
    the context up to its own token: the decode kernel then computes every verified token as it
    would a plain decode, so speculation changes no logit (the prompt kernel tiles queries, and
    in bfloat16 its sums round otherwise)."""
    input_ids: list[int] = []
    positions: list[int] = []
    request_rows: list[int] = []  # which attention row each token belongs to
    table_rows: list[int] = []  # which request's block table each attention row reads
    query_lens: list[int] = []
    seq_lens_kv: list[int] = []
    logits_indices: list[int] = []
    cached_kv: list[int] = []  # tokens whose K/V the cache holds already (prefix_hit_end)
    for index, row in enumerate(batch.rows):  # a row's figures read once: this runs every step
        start, num_tokens, drafts = row.start_position, len(row.token_ids), row.draft_token_ids
        end = start + num_tokens
        cached_kv.extend(range(len(input_ids), len(input_ids) + row.num_cached_kv_tokens))
        input_ids.extend(row.token_ids)
        positions.extend(range(start, end))
        if drafts:
            first = len(query_lens)
            request_rows.extend(range(first, first + num_tokens))
            table_rows.extend([index] * num_tokens)
            query_lens.extend([1] * num_tokens)
            seq_lens_kv.extend(range(start + 1, end + 1))
        else:
            request_rows.extend([len(query_lens)] * num_tokens)
            table_rows.append(index)
            query_lens.append(num_tokens)
            seq_lens_kv.append(end)
        if row.sampling is not None:  # the last token, and each draft token
            logits_indices.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
    if len(table_rows) != len(batch.rows):
        block_tables = block_tables[torch.tensor(table_rows)]

    positions_t = torch.tensor(positions, dtype=torch.int64)
    rows_t = torch.tensor(request_rows, dtype=torch.int64)
    slot_mapping = (
        block_tables[rows_t, positions_t // block_size].long() * block_size + positions_t % block_size
    )
    # Every slot is a real token's: one in the null block fails the step here, on the host, once,
    # instead of the write landing in scratch space (or, with other padding, in another
    # request's block) in every layer.
    if int(slot_mapping.min()) < block_size:
        raise NullBlockWriteError(f"slot {int(slot_mapping.min())} is in the null block")
    if cached_kv:  # recomputed, not rewritten: other requests read that block
        slot_mapping[torch.tensor(cached_kv)] = NULL_BLOCK_ID * block_size
    cu_seqlens_q = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    seq_lens_kv_t = torch.tensor(seq_lens_kv, dtype=torch.int32)
    decode = DecodeRows.pick(cu_seqlens_q, block_tables, seq_lens_kv_t, query_lens)

    def host(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if pin_memory else t

    return FlatBatch(
        input_ids=host(torch.tensor(input_ids, dtype=torch.int64)),
        positions=host(positions_t),
        attention=AttentionMetadata(
            cu_seqlens_q=host(cu_seqlens_q),
            seq_lens_kv=host(seq_lens_kv_t),
            block_tables=host(block_tables),
            slot_mapping=host(slot_mapping),
            max_query_len=max(query_lens),
            query_lens_cpu=query_lens,
            seq_lens_kv_cpu=seq_lens_kv,
            decode=decode,
        ),
        logits_indices=host(torch.tensor(logits_indices, dtype=torch.int64)),
    )
