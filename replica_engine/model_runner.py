"""Runs a sealed step on the model: owns the KV cache tensors and the persistent batch, builds the
flat batch, samples. It reads only the ScheduledBatch it is given and what it kept of earlier
ones, never a live request (but a constrained request's grammar, read-only during the step).
`forward` is the half a parallel worker runs: every worker computes the step, and the last one's
logits go to the sampler in the engine core (parallel/executor.py).

With async scheduling the core submits a step and collects it after submitting the next: on a
GPU, `submit` only queues the step's work (its sampled tokens stay on the device, the next step's
placeholders read them there) and `collect` waits for its tokens' copies to the host; on a CPU,
`submit` computes the step."""

from __future__ import annotations

import time
import warnings
from collections import deque

import numpy as np
import torch
from transformers import PretrainedConfig

from common.kv_transfer import KvLayout
from common.logprobs import TokenLogprob
from common.model_source import ModelSource
from common.sampling_params import SamplingParams
from replica_engine.attention import get_backend
from replica_engine.batch_sampler import BatchSampler, PendingOutput, StepLogits
from replica_engine.config import EngineConfig
from replica_engine.decode_graphs import DecodeGraphs
from replica_engine.executor import RunnerOutput
from replica_engine.flat_batch import FlatBatch, build_flat_batch
from replica_engine.kernels.prompt_rows import PromptRows, prompt_rows
from replica_engine.kv_cache_manager import NULL_BLOCK_ID, blocks_for_tokens, blocks_in_bytes
from replica_engine.logprobs import logprobs_of
from replica_engine.lora.manager import LoRAManager
from replica_engine.models.llama import LlamaForCausalLM
from replica_engine.models.loader import load_model
from replica_engine.parallel.place import WHOLE_MODEL, WorkerPlace
from replica_engine.persistent_batch import PersistentBatch
from replica_engine.scheduler.plan import SamplingRow, ScheduledBatch, ScheduledRow

# Positions per logits pass: their logits, 128 x a 128k vocabulary, are 64 MB of fp32. On the CPU a
# 620-token prompt's logits and logprobs took 0.22 s in passes of 512, 0.09 s in passes of 128.
PROMPT_LOGPROBS_SLICE = 128


class ModelRunner:
    """The Executor of a real replica: a PipelinedExecutor of two batches under async scheduling."""

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.device = config.torch_device
        self.schedules_ahead = bool(config.async_scheduling)
        self.pipeline_depth = 2 if self.schedules_ahead else 1
        # Submitted, not yet collected: each step's output, and on a GPU the events around the
        # device's idle time before it (the previous step's end, its own start)
        self._pending: deque[tuple[PendingOutput, tuple[torch.cuda.Event, torch.cuda.Event] | None]] = deque()
        # On a GPU: the device's idle time between steps, summed (the wall time it waited for the
        # host to submit the next step); and the last submitted step's end
        self.device_idle_between_steps_s = 0.0
        self._last_end: torch.cuda.Event | None = None
        attention = model.model.layers[0].self_attn
        self.kv_shape = (config.block_size, attention.num_kv_heads, attention.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_graphs: DecodeGraphs | None = None  # with cuda_graphs, once the pool exists
        assert config.max_num_seqs is not None and config.max_model_len is not None  # resolved
        assert config.max_num_batched_tokens is not None
        vocab_size = model.config.vocab_size
        self.rows = PersistentBatch(
            config.max_num_seqs, config.max_model_len, config.block_size, vocab_size, self.device
        )
        self.sampler = BatchSampler(self.rows)
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            assert config.max_cpu_loras is not None  # resolved
            self.lora = LoRAManager(
                model,
                config.max_loras,
                config.max_lora_rank,
                config.max_cpu_loras,
                config.torch_dtype,
                self.device,
            )

    @property
    def kv_layout(self) -> KvLayout:
        dtype = self.config.torch_dtype
        name = str(dtype).removeprefix("torch.")
        return KvLayout(len(self.model.model.layers), *self.kv_shape, name, dtype.itemsize)

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block of tokens."""
        return self.kv_layout.block_bytes

    def num_kv_blocks(self) -> int:
        """How many blocks requests may hold (the null block comes on top): num_kv_blocks where
        given; else what kv_cache_bytes holds; else (GPU) what is left of gpu_memory_utilization
        after the weights and the peak of a full-budget step."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_bytes is not None:
            return blocks_in_bytes(self.config.kv_cache_bytes, self.bytes_per_block)
        peak_activation_bytes = self._profile_peak_step_bytes()
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        used_bytes = total_bytes - free_bytes
        budget = total_bytes * self.config.gpu_memory_utilization - used_bytes - peak_activation_bytes
        return blocks_in_bytes(max(0, int(budget)), self.bytes_per_block)

    def _profile_peak_step_bytes(self) -> int:
        """Run one step of max_num_batched_tokens tokens against a throwaway pool and measure
        the memory it needed beyond what was allocated before. The budget may exceed the context
        (positions past it have no rotary angle): rows of at most max_model_len tokens share it."""
        num_tokens = self.config.max_num_batched_tokens
        row_len = self.config.max_model_len
        lengths = [min(row_len, num_tokens - start) for start in range(0, num_tokens, row_len)]
        row_blocks = [blocks_for_tokens(length, self.config.block_size) for length in lengths]
        self._allocate_pool(sum(row_blocks) + 1)
        sampling = SamplingRow(SamplingParams(max_tokens=1, temperature=0.0), None)
        rows, first_block = [], NULL_BLOCK_ID + 1
        for index, (length, num_blocks) in enumerate(zip(lengths, row_blocks, strict=True)):
            block_ids = tuple(range(first_block, first_block + num_blocks))
            rows.append(ScheduledRow(f"profile-{index}", (0,) * length, 0, block_ids, False, sampling))
            first_block += num_blocks
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.execute(ScheduledBatch(tuple(rows)))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.rows.release([row.request_id for row in rows])
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, pool_size: int) -> None:
        """`pool_size` blocks per layer for K and for V, the null block included; then, with
        cuda_graphs, the decode graphs over that pool (captured on a GPU)."""
        self._allocate_pool(pool_size)
        if self.config.cuda_graphs:
            width = self.rows.block_table.shape[1]
            assert self.config.max_num_seqs is not None  # resolved
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.config.max_num_seqs, width)
            if self.device.type == "cuda":
                self.decode_graphs.capture()

    def _allocate_pool(self, pool_size: int) -> None:
        self.kv_caches = [
            (
                torch.zeros((pool_size, *self.kv_shape), dtype=self.config.torch_dtype, device=self.device),
                torch.zeros((pool_size, *self.kv_shape), dtype=self.config.torch_dtype, device=self.device),
            )
            for _ in self.model.model.layers
        ]

    @torch.inference_mode()
    def read_kv_blocks(self, block_ids: list[int]) -> np.ndarray:
        """These blocks' K/V, copied to the host as flat bytes in kv_layout.shape(len(block_ids))."""
        index = torch.tensor(block_ids, device=self.device)
        shape = (len(self.kv_caches), 2, len(block_ids), *self.kv_shape)
        out = torch.empty(shape, dtype=self.config.torch_dtype, pin_memory=self.device.type == "cuda")
        for layer, caches in enumerate(self.kv_caches):
            for kind, cache in enumerate(caches):  # K, V
                if self.device.type == "cuda":
                    out[layer, kind].copy_(cache.index_select(0, index), non_blocking=True)
                else:  # straight into the buffer: one copy, not two
                    torch.index_select(cache, 0, index, out=out[layer, kind])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return out.view(torch.uint8).numpy().reshape(-1)

    @torch.inference_mode()
    def write_kv_blocks(self, block_ids: list[int], data: np.ndarray, indices: list[int]) -> None:
        """Write blocks `indices` of `data` (read_kv_blocks' bytes, of this layout) into `block_ids`."""
        num_blocks = data.nbytes // self.bytes_per_block
        with warnings.catch_warnings():  # a fetched buffer may be read-only: it is only read
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(data).view(self.config.torch_dtype)
        blocks = blocks.view(len(self.kv_caches), 2, num_blocks, *self.kv_shape)
        first = indices[0]
        # consecutive blocks (the usual: all of them) are a view, which a CPU copies only once
        picked = (
            blocks[:, :, first : first + len(indices)]
            if indices == list(range(first, first + len(indices)))
            else blocks[:, :, indices]
        )
        source = picked.to(self.device, non_blocking=True)
        index = torch.tensor(block_ids, device=self.device)
        for layer, (keys, values) in enumerate(self.kv_caches):
            keys.index_copy_(0, index, source[layer, 0])
            values.index_copy_(0, index, source[layer, 1])

    def release(self, request_ids: list[str]) -> None:
        """Forget rows outside the scheduler's batches (a startup profile's)."""
        self.rows.release(request_ids)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Compute every scheduled token; sample one token per `batch.sampling_rows`."""
        self.submit(batch)
        return self.collect()

    @torch.inference_mode()
    def submit(self, batch: ScheduledBatch) -> None:
        """Queue the step behind those submitted before (on a CPU: compute it)."""
        events = None
        if self.device.type == "cuda":  # the step's device time, read when it is collected
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        bitmasks = self.sampler.start(batch)
        try:
            step = self.forward(batch, events[0] if events else None)
        finally:  # the matchers are free again before anything (a rerun) touches them
            self.sampler.settle(bitmasks)
        gap = (self._last_end, events[0]) if events and self._last_end else None
        self._pending.append((self.sampler.finish(batch, step, bitmasks, events), gap))
        self._last_end = events[1] if events else None

    def count_device_idle_afresh(self) -> None:
        """device_idle_between_steps_s from 0, counted from the next step on (a benchmark's run,
        not the startup's profile before it)."""
        self.device_idle_between_steps_s = 0.0
        self._last_end = None

    def collect(self) -> RunnerOutput:
        """The oldest submitted step's output, once its tokens are on the host."""
        pending, gap = self._pending.popleft()
        output = pending.result()
        if gap is not None:  # both events have run: the step's end was waited for
            self.device_idle_between_steps_s += gap[0].elapsed_time(gap[1]) / 1000
        return output

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, start: torch.cuda.Event | None = None) -> StepLogits:
        """The step's forward, its prompt logprobs and its sampling rows' logits. `start` is
        recorded once its inputs are queued: the host's work before it is not the device's."""
        self.rows.apply(batch)
        tables = self.rows.block_tables(batch)
        on_gpu = self.device.type == "cuda"
        flat = build_flat_batch(batch, tables, self.config.block_size, pin_memory=on_gpu).to(self.device)
        self.rows.fill_placeholders(batch, flat.input_ids)
        if start is not None:
            start.record()
        started = time.perf_counter()
        if self.lora is not None:
            self.lora.prepare((row.lora, row.num_tokens) for row in batch.rows)
        rows = PromptRows.of((r.num_tokens, r.num_prompt_tokens) for r in batch.rows) if not on_gpu else None
        with prompt_rows(rows):  # the CPU kernels' path per token (on a GPU: none to choose)
            hidden = self._forward(flat)
        if hidden is None:  # a pipeline stage before the last: its output went to the next stage
            return StepLogits(None, {}, time.perf_counter() - started)
        prompt_logprobs = self._prompt_logprobs(batch.rows, hidden)
        logits = self.model.compute_logits(hidden[flat.logits_indices]) if batch.sampling_rows else None
        pooled = self._pooled_parts(batch.rows, hidden)
        return StepLogits(logits, prompt_logprobs, time.perf_counter() - started, pooled)

    @staticmethod
    def _pooled_parts(rows: tuple[ScheduledRow, ...], hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each embedding row's part of its vector (pooling.py), from its chunk's hidden states,
        moved to the host together (one copy, not one per row)."""
        parts: dict[str, torch.Tensor] = {}
        row_start = 0
        for row in rows:
            if row.pooling is not None:
                parts[row.request_id] = row.pooling.chunk_part(hidden[row_start : row_start + row.num_tokens])
            row_start += row.num_tokens
        if not parts:
            return {}
        on_host = torch.stack(list(parts.values())).cpu()
        return dict(zip(parts, on_host, strict=True))

    def _forward(self, flat: FlatBatch) -> torch.Tensor | None:
        graphs = self.decode_graphs
        with_lora = self.lora is not None and self.lora.step.active  # not captured in the graphs
        if graphs is not None and not with_lora and graphs.handles(flat):  # one token a row: replayed (GPU)
            return graphs.run(flat)
        return self.model(flat.input_ids, flat.positions, self.kv_caches, flat.attention)

    def _prompt_logprobs(
        self, rows: tuple[ScheduledRow, ...], hidden: torch.Tensor
    ) -> dict[str, list[TokenLogprob]]:
        """Logprobs of the prompt tokens each asking row's chunk predicts (rows' tokens lie in
        `hidden` one after another, in batch order)."""
        results: dict[str, list[TokenLogprob]] = {}
        row_start = 0
        for row in rows:
            wanted = row.prompt_logprobs
            if wanted is not None:
                found = results.setdefault(row.request_id, [])
                first = row_start + wanted.offset
                for done in range(0, len(wanted.targets), PROMPT_LOGPROBS_SLICE):
                    targets = list(wanted.targets[done : done + PROMPT_LOGPROBS_SLICE])
                    at = first + done
                    logits = self.model.compute_logits(hidden[at : at + len(targets)])
                    found += logprobs_of(logits, targets, [wanted.num_top] * len(targets))
            row_start += row.num_tokens
        return results


def load_runner(
    source: ModelSource,
    model_config: PretrainedConfig,
    config: EngineConfig,
    place: WorkerPlace = WHOLE_MODEL,
) -> ModelRunner:
    """The model (or one parallel worker's share of it) behind a runner; `config` resolved."""
    torch.manual_seed(config.seed)
    model = load_model(
        source,
        model_config,
        get_backend(config.attention_backend),
        config.torch_dtype,
        config.torch_device,
        config.max_model_len,
        config.seed,
        place,
        config.quantization,
        config.amx_weights,
    )
    return ModelRunner(model, config)
