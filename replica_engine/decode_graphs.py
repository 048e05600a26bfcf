"""Decode-only steps from CUDA graphs (EngineConfig.cuda_graphs): at a batch of single-token rows,
the model's forward is hundreds of small kernel launches, and on a GPU their launch time, not the
HBM, sets the step. So the forward is captured once per padded batch size at start, after the KV
pool exists, and a decode step copies its inputs into the captured static tensors and replays.

Padding rows are idle: position 0, no context (kv length 0: the kernel reads no key), their K/V
written to the null block's first slot, which no real row reads. Only the Triton attention
backend is captured (it reads tensors alone; the CPU backends loop over host lists).

On a CPU there is no graph to capture: the same padded static batch runs eagerly, so the tests
check everything but the capture itself (the first GPU run checks that)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica_engine.attention.base import AttentionMetadata
from replica_engine.flat_batch import FlatBatch
from replica_engine.kv_cache_manager import NULL_BLOCK_ID
from replica_engine.models.llama import LlamaForCausalLM

# vLLM's shape: every size to 8, then steps of 8 to 256 (a request joining pads to the next size).
BATCH_SIZES = (1, 2, 4, *range(8, 257, 8))


@dataclass
class StaticDecodeInputs:
    """The captured forward's inputs, sized for the largest batch; a step fills their first rows."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    cu_seqlens_q: torch.Tensor  # [N + 1] int32: 0, 1, ..., N (one token a row, always)
    seq_lens_kv: torch.Tensor  # [N] int32
    block_tables: torch.Tensor  # [N, W] int32
    slot_mapping: torch.Tensor  # [N] int64

    @classmethod
    def empty(cls, max_batch: int, table_width: int, device: torch.device) -> StaticDecodeInputs:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            zeros(max_batch, dtype=torch.int64),
            zeros(max_batch, dtype=torch.int64),
            torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            zeros(max_batch, dtype=torch.int32),
            torch.full((max_batch, table_width), NULL_BLOCK_ID, dtype=torch.int32, device=device),
            zeros(max_batch, dtype=torch.int64),
        )

    def fill(self, flat: FlatBatch, size: int) -> None:
        """The step's `n` rows, then idle rows to `size`."""
        n = flat.input_ids.shape[0]
        meta = flat.attention
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(flat.input_ids, non_blocking=True)
        self.positions[:n].copy_(flat.positions, non_blocking=True)
        self.seq_lens_kv[:n].copy_(meta.seq_lens_kv, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:n, width:].fill_(NULL_BLOCK_ID)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        for idle in (self.input_ids, self.positions, self.seq_lens_kv, self.slot_mapping):
            idle[n:size].zero_()  # slot 0: the null block's first

    def metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            seq_lens_kv=self.seq_lens_kv[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            query_lens_cpu=[1] * size,
            seq_lens_kv_cpu=[],  # not read by the Triton backend, the only one captured
            decode=None,
        )


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        table_width: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = kv_caches[0][0].device
        self.sizes = (*(s for s in BATCH_SIZES if s < max_batch), max_batch)
        self.inputs = StaticDecodeInputs.empty(max_batch, table_width, self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def handles(self, flat: FlatBatch) -> bool:
        """Every row one token (decodes only), and no more rows than the largest size."""
        meta = flat.attention
        num_rows = meta.seq_lens_kv.shape[0]
        return meta.max_query_len == 1 and num_rows == flat.input_ids.shape[0] <= self.sizes[-1]

    def padded_size(self, num_rows: int) -> int:
        return next(s for s in self.sizes if s >= num_rows)

    def _forward(self, size: int) -> torch.Tensor:
        inputs = self.inputs
        return self.model(
            inputs.input_ids[:size], inputs.positions[:size], self.kv_caches, inputs.metadata(size)
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, largest first (smaller ones reuse its memory pool); GPU only."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm: Triton compiles, the allocator settles
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize(self.device)

    def run(self, flat: FlatBatch) -> torch.Tensor:
        """The hidden states of the step's rows: replayed where captured, else eagerly (the CPU)."""
        num_rows = flat.input_ids.shape[0]
        size = self.padded_size(num_rows)
        self.inputs.fill(flat, size)
        captured = self.graphs.get(size)
        if captured is None:
            return self._forward(size)[:num_rows]
        graph, hidden = captured
        graph.replay()
        return hidden[:num_rows]
