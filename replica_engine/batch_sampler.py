"""The sampling half of a step, wherever the logits come from (this process's model, or the
last parallel worker's): the constrained rows' grammar bitmasks, filled on a thread while the
model runs; each row's penalty state from the persistent batch; one token per sampling row."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from common.logprobs import TokenLogprob
from replica_engine.executor import RunnerOutput, SampledTokens
from replica_engine.persistent_batch import PersistentBatch
from replica_engine.sampler import sample
from replica_engine.scheduler.plan import SamplingRow, ScheduledBatch, ScheduledRow
from replica_engine.structured import new_bitmask


@dataclass(frozen=True)
class StepLogits:
    """What the model computed in a step, before sampling."""

    logits: torch.Tensor | None  # [sampling rows, vocab] float32; None when no row samples
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # by request id
    model_s: float = 0.0
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # embedding rows' parts, by request id


class BatchSampler:
    def __init__(self, rows: PersistentBatch) -> None:
        self.rows = rows
        # Fills grammar bitmasks while the model runs (the forward releases the GIL in its kernels).
        self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmasks")

    def execute(self, batch: ScheduledBatch, forward: Callable[[], StepLogits]) -> RunnerOutput:
        """A whole step: `forward` computes the logits while the bitmasks fill; then a token per
        sampling row."""
        bitmasks = self.start(batch)
        try:
            step = forward()
        finally:  # the matchers are free again before anything (a rerun) touches them
            self.settle(bitmasks)
        return self.finish(batch, step, bitmasks)

    def start(self, batch: ScheduledBatch) -> Future[torch.Tensor] | None:
        """Before the batch's forward: its constrained rows' bitmasks, one batch mask filled on
        the grammar thread."""
        rows = batch.sampling_rows
        grammars = [row.sampling.grammar for row in rows if row.sampling and row.sampling.grammar]
        if not grammars:
            return None

        def fill() -> torch.Tensor:
            bitmask = new_bitmask(len(grammars), grammars[0].vocab_size)
            for index, grammar in enumerate(grammars):
                grammar.fill_allowed_tokens(bitmask, index)
            return bitmask

        return self._grammar_thread.submit(fill)

    @staticmethod
    def settle(bitmasks: Future[torch.Tensor] | None) -> None:
        """Wait until the bitmasks are filled (or failed)."""
        if bitmasks is not None:
            wait([bitmasks])

    def finish(
        self, batch: ScheduledBatch, step: StepLogits, bitmasks: Future[torch.Tensor] | None
    ) -> RunnerOutput:
        """After the forward: a token per sampling row."""
        if step.logits is None:
            return RunnerOutput(
                prompt_logprobs=step.prompt_logprobs, model_s=step.model_s, pooled=step.pooled
            )
        sampled, sample_s = self._sample(batch.sampling_rows, step.logits, bitmasks)
        return RunnerOutput(sampled, step.prompt_logprobs, step.model_s + sample_s, step.pooled)

    def _sample(
        self, rows: list[ScheduledRow], logits: torch.Tensor, bitmasks: Future[torch.Tensor] | None
    ) -> tuple[SampledTokens, float]:
        """A token per row (and the seconds it took); the rows' penalty counts take them in."""
        sampling = self._sampling(rows, bitmasks.result() if bitmasks is not None else None)
        started = time.perf_counter()
        sampled = sample(logits, sampling)
        seconds = time.perf_counter() - started
        # Last: a batch that raised before here counted nothing, so its rows can be rerun alone.
        self.rows.count_sampled([row.request_id for row in rows], sampled.token_ids)
        return sampled, seconds

    def _sampling(self, rows: list[ScheduledRow], bitmask: torch.Tensor | None) -> list[SamplingRow]:
        """Each sampling row with what the runner adds: its bitmask and its penalty counts."""
        sampling: list[SamplingRow] = []
        num_constrained = 0
        for row in rows:
            assert row.sampling is not None
            needs_history = row.sampling.params.needs_token_history
            if row.sampling.grammar is None and not needs_history:
                sampling.append(row.sampling)
                continue
            allowed = None
            if row.sampling.grammar is not None:
                assert bitmask is not None
                allowed = bitmask[num_constrained : num_constrained + 1]
                num_constrained += 1
            sampling.append(
                dataclasses.replace(
                    row.sampling,
                    allowed_tokens=allowed,
                    output_counts=self.rows.output_counts(row.request_id),
                    prompt_seen=self.rows.prompt_seen(row.request_id),
                )
            )
        return sampling
