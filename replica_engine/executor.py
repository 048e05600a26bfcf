"""What runs a sealed step for EngineCore: the model runner (model_runner.py, on a CPU or a GPU),
the parallel executor over worker processes (parallel/executor.py), or the fleet simulator's
stand-in (fleet_sim/replica.py: SimExecutor, a step-time model's time and each request's next
simulated token). Torch-free, so that the simulator runs the real core."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from common.logprobs import TokenLogprob
from replica_engine.scheduler.plan import ScheduledBatch

if TYPE_CHECKING:
    import numpy as np
    import torch

    from common.kv_transfer import KvLayout


@dataclass(frozen=True)
class SampledTokens:
    token_ids: list[int]  # one per sampling row: its last (after the draft tokens it kept)
    logprobs: list[TokenLogprob | None]  # per row: set where the request asked for logprobs
    num_accepted: tuple[int, ...] = ()  # per row, draft tokens kept; empty where no row had any

    def only(self, rows: list[int]) -> SampledTokens:
        """These rows' tokens, in this order."""
        accepted = tuple(self.num_accepted[i] for i in rows) if self.num_accepted else ()
        return SampledTokens([self.token_ids[i] for i in rows], [self.logprobs[i] for i in rows], accepted)


@dataclass(frozen=True)
class RunnerOutput:
    """What a step computed: a token per sampling row, prompt logprobs where asked, and each
    embedding request's chunk part (replica_engine/pooling.py)."""

    sampled: SampledTokens = field(default_factory=lambda: SampledTokens([], []))
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # by request id
    model_s: float = 0.0  # in the model's forward and sampling; the rest of a step is overhead
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # by request id; float32, on the host


class Executor(Protocol):
    pipeline_depth: int  # batches it can hold at once; above 1, a PipelinedExecutor
    # Async scheduling: a batch may hold requests of the batch before it, whose sampled tokens
    # it takes on the device (placeholders); else a request in flight sits out.
    schedules_ahead: bool
    # Its KV pool's shape, where it can read and write blocks for another replica (prefill/decode
    # disaggregation); None where it cannot (parallel workers hold parts of each block).
    kv_layout: KvLayout | None

    def allocate_kv_cache(self, pool_size: int) -> None:
        """`pool_size` blocks of K/V per layer, the null block included."""

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        """Compute every scheduled token; sample one token per `batch.sampling_rows`."""
        ...

    def read_kv_blocks(self, block_ids: list[int]) -> np.ndarray | None:
        """These blocks' K/V as flat bytes in `kv_layout.shape(len(block_ids))` (None: the
        simulator's, which holds no data). Only where kv_layout is set."""
        ...

    def write_kv_blocks(self, block_ids: list[int], data: np.ndarray, indices: list[int]) -> None:
        """Write blocks `indices` of `data` (read_kv_blocks' bytes) into `block_ids`."""


class PipelinedExecutor(Executor, Protocol):
    """One that holds several batches at once (pipeline stages, or async scheduling's two): the
    core submits the next batch while earlier ones are still running, and collects their
    outputs in order."""

    def submit(self, batch: ScheduledBatch) -> None:
        """Start the batch behind those in flight."""

    def collect(self) -> RunnerOutput:
        """The oldest batch in flight's output, once it has run; raises as execute would."""
        ...
