"""One linear layer's LoRA deltas for every slot, applied to a mixed batch in three ops.

A step's rows run with up to `num_slots` adapters (or none). Rather than a matmul pair per
adapter's rows (hundreds of small ops per step on a CPU), every slot's A is stacked into one
matrix and every B into another: x @ A_all gives each token every slot's low-rank projection; a
per-step mask zeroes the slots that are not the token's own (all of them for a base-model row);
and one matmul with B_all adds the token's own delta. Rows are ordered rank-major, (k, slot,
shard), so the first `step_rank * num_slots * num_shards` rows cover every rank a step's adapters
use: a step of rank-8 adapters pays for rank 8, not for max_lora_rank. The scaling (alpha / r)
is folded into B_all when an adapter is written into its slot."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAStep:
    """What a step's rows need of the slots: for each shard count n (1, 2 or 3 projections merged
    in a linear layer), how many leading rows of A_all/B_all the step reads and the [tokens, rows]
    mask keeping each token's own slot. Shared by every LoRA linear layer; set per step."""

    active: bool = False
    num_rows: dict[int, int] = field(default_factory=dict)
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def set(self, token_slots: torch.Tensor, step_rank: int, num_slots: int, dtype: torch.dtype) -> None:
        """`token_slots`: [T] each token's slot, -1 for a base-model token."""
        self.active = True
        for num_shards in (1, 2, 3):
            rows = step_rank * num_slots * num_shards
            row_slot = torch.arange(rows, device=token_slots.device) // num_shards % num_slots
            self.num_rows[num_shards] = rows
            self.masks[num_shards] = (token_slots[:, None] == row_slot[None, :]).to(dtype)

    def clear(self) -> None:
        self.active = False
        self.masks.clear()


class LoRALinear:
    """The slots of one (possibly merged) linear layer: `shard_ranges` are its projections'
    output ranges (q, k, v of qkv_proj; gate, up of gate_up_proj; one for o_proj and down_proj)."""

    def __init__(
        self,
        in_features: int,
        shard_ranges: list[tuple[int, int]],
        num_slots: int,
        max_rank: int,
        step: LoRAStep,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shard_ranges = shard_ranges
        self.num_shards = len(shard_ranges)
        self.num_slots = num_slots
        rows = max_rank * num_slots * self.num_shards
        out_features = shard_ranges[-1][1]
        self.a_all = torch.zeros((rows, in_features), dtype=dtype, device=device)
        self.b_all = torch.zeros((rows, out_features), dtype=dtype, device=device)  # B transposed
        self.step = step

    def _rows(self, slot: int, shard: int, rank: int) -> torch.Tensor:
        ranks = torch.arange(rank, device=self.a_all.device)
        return (ranks * self.num_slots + slot) * self.num_shards + shard

    def clear_slot(self, slot: int) -> None:
        rows = self._rows(slot, 0, self.a_all.shape[0] // (self.num_slots * self.num_shards))
        for shard in range(self.num_shards):
            self.a_all[rows + shard] = 0
            self.b_all[rows + shard] = 0

    def write(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """One projection's A ([rank, in]) and B ([out_shard, rank]) into a cleared slot."""
        rows = self._rows(slot, shard, a.shape[0])
        start, end = self.shard_ranges[shard]
        self.a_all[rows] = a.to(self.a_all)
        self.b_all[rows, start:end] = (b.t() * scaling).to(self.b_all)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each token's own adapter's x @ A^T @ B^T * scaling (in place)."""
        step = self.step
        if not step.active:
            return
        rows = step.num_rows[self.num_shards]
        projected = torch.mm(x, self.a_all[:rows].t())
        projected.mul_(step.masks[self.num_shards])
        out.addmm_(projected, self.b_all[:rows])
