"""The model runner's rows, kept across steps (vLLM v1's persistent batch): each running request's
block table row, its latest sampled token (on the device: a placeholder in the next batch reads
it there) and, for requests with penalties, its token counts. A sealed batch carries only what
changed since the runner last saw a request (its new blocks; its history once, when the runner
does not hold it yet) and the requests it may forget; the runner adds the tokens it samples to
the counts itself. So a step costs what changed, not every request's whole state.

Applying a batch is idempotent: a row's blocks are written from their offset, and a row at offset
0 (a new or resumed request) is set afresh, so the rows of a failed batch can be rerun one by one."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from replica_engine.device_transfer import to_device
from replica_engine.kv_cache_manager import NULL_BLOCK_ID, blocks_for_tokens
from replica_engine.scheduler.plan import PLACEHOLDER_TOKEN_ID, ScheduledBatch, ScheduledRow, TokenHistory

_HOST = torch.device("cpu")


class PersistentBatch:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        block_size: int,
        vocab_size: int,
        device: torch.device = _HOST,
    ) -> None:
        """Room for `max_num_seqs` requests of up to `max_num_tokens` tokens each. Block tables
        stay on the host (each step's rows go over with the batch's inputs); penalty counts live
        on `device`, beside the logits they adjust."""
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        width = blocks_for_tokens(max_num_tokens, block_size)
        self.block_table = torch.full((max_num_seqs, width), NULL_BLOCK_ID, dtype=torch.int32)
        self._slots: dict[str, int] = {}  # request id -> its row of block_table
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._output_counts: dict[str, torch.Tensor] = {}  # [vocab] float32: each output token's count
        self._prompt_seen: dict[str, torch.Tensor] = {}  # [vocab] bool: the prompt's tokens (repetition)
        # request id -> (a step's sampled token ids, its row there): its latest token, on the device
        self._latest_token: dict[str, tuple[torch.Tensor, int]] = {}

    @property
    def num_held(self) -> int:
        return len(self._slots)

    def holds(self, request_id: str) -> bool:
        return request_id in self._slots

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget requests that finished or were preempted (a resumed one comes back at offset 0)."""
        for request_id in request_ids:
            slot = self._slots.pop(request_id, None)
            if slot is not None:
                self.block_table[slot].fill_(NULL_BLOCK_ID)
                self._free_slots.append(slot)
            self._output_counts.pop(request_id, None)
            self._prompt_seen.pop(request_id, None)
            self._latest_token.pop(request_id, None)

    def apply(self, batch: ScheduledBatch) -> None:
        """Forget the batch's released requests, then take each row's changes."""
        self.release(batch.released_request_ids)
        for row in batch.rows:
            self._apply_row(row)

    def _apply_row(self, row: ScheduledRow) -> None:
        slot = self._slots.get(row.request_id)
        if slot is None:
            if row.block_offset:
                raise KeyError(f"request {row.request_id} has blocks from {row.block_offset} but no row")
            if not self._free_slots:
                raise RuntimeError(f"no free row for request {row.request_id}: more than max_num_seqs")
            slot = self._slots[row.request_id] = self._free_slots.pop()
        if row.block_offset == 0:
            self.block_table[slot].fill_(NULL_BLOCK_ID)
            if row.history is not None:
                self._set_history(row.request_id, row.history)
        if row.new_block_ids:  # most decodes have none: their row is touched only then
            new = torch.tensor(row.new_block_ids, dtype=torch.int32)
            self.block_table[slot, row.block_offset : row.block_offset + len(new)] = new

    def _set_history(self, request_id: str, history: TokenHistory) -> None:
        counts = torch.zeros(self.vocab_size, device=self.device)
        if history.output_token_ids:
            ids = to_device(history.output_token_ids, torch.int64, self.device)
            counts.index_add_(0, ids, torch.ones(len(ids), device=self.device))
        self._output_counts[request_id] = counts
        if history.prompt_token_ids:
            seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            seen[to_device(history.prompt_token_ids, torch.int64, self.device)] = True
            self._prompt_seen[request_id] = seen

    def block_tables(self, batch: ScheduledBatch) -> torch.Tensor:
        """[rows, blocks] for the batch's rows in batch order, as wide as its longest row needs."""
        width = max(blocks_for_tokens(row.end_position, self.block_size) for row in batch.rows)
        slots = torch.tensor([self._slots[row.request_id] for row in batch.rows])
        return self.block_table[slots, :width]

    def output_counts(self, request_id: str) -> torch.Tensor | None:
        return self._output_counts.get(request_id)

    def prompt_seen(self, request_id: str) -> torch.Tensor | None:
        return self._prompt_seen.get(request_id)

    def take_sampled(self, request_ids: list[str], token_ids: torch.Tensor) -> None:
        """The tokens a step sampled ([rows], on the device): each request's latest, and one
        more in its counts (penalty requests only). Nothing waits for the device."""
        for row, request_id in enumerate(request_ids):
            self._latest_token[request_id] = (token_ids, row)
            counts = self._output_counts.get(request_id)
            if counts is not None:
                counts.index_add_(0, token_ids[row : row + 1], torch.ones(1, device=counts.device))

    def fill_placeholders(self, batch: ScheduledBatch, input_ids: torch.Tensor) -> None:
        """Put each row's latest sampled token where the batch has a placeholder (a row's last
        token, sampled by the batch before, which was still in flight when this one was sealed)."""
        sources: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # by the step's tensor
        end = 0
        for row in batch.rows:
            end += row.num_tokens
            if row.token_ids[-1] != PLACEHOLDER_TOKEN_ID:
                continue
            tokens, index = self._latest_token[row.request_id]
            _, into, taken = sources.setdefault(id(tokens), (tokens, [], []))
            into.append(end - 1)
            taken.append(index)
        for tokens, into, taken in sources.values():
            device = input_ids.device
            input_ids[to_device(into, torch.int64, device)] = tokens[to_device(taken, torch.int64, device)]
