"""Where one worker sits in its replica's parallel layout."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerPlace:
    """Rank `rank` of `tensor_parallel_size` x `pipeline_parallel_size` workers (one of them above
    1 for now): its tensor-parallel rank, or its pipeline stage."""

    rank: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel: bool = False  # tensor-parallel ranks split a mixture's experts, not their width

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def holds_logits(self) -> bool:
        """Whether this worker's step ends with the logits (every tensor-parallel rank; the last
        stage of a pipeline): the last rank answers for them."""
        return self.rank == self.world_size - 1


WHOLE_MODEL = WorkerPlace()  # one worker: no parallelism
