"""The sampling half of a step, wherever the logits come from (this process's model, or the
last parallel worker's): the constrained rows' grammar bitmasks, filled on a thread while the
model runs; each row's penalty state from the persistent batch; one token per sampling row. The
tokens stay on the device; a PendingOutput reads them on the host when the core collects the step
(at once, or under async scheduling after the next step is on its way)."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from common.logprobs import TokenLogprob
from replica_engine.device_transfer import HostCopy
from replica_engine.executor import RunnerOutput, SampledTokens
from replica_engine.persistent_batch import PersistentBatch
from replica_engine.sampler import DeviceSample, sample
from replica_engine.scheduler.plan import SamplingRow, ScheduledBatch, ScheduledRow
from replica_engine.spec_decode.verify_batch import sample_with_drafts
from replica_engine.structured import new_bitmask


@dataclass(frozen=True)
class StepLogits:
    """What the model computed in a step, before sampling."""

    logits: torch.Tensor | None  # [sampling rows, vocab] float32; None when no row samples
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # by request id
    model_s: float = 0.0
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # embedding rows' parts, by request id


class PendingOutput:
    """A step's output before its sampled tokens reach the host: their copies are queued behind
    the step's work, and `result` waits for them (on a CPU they are there already). With CUDA
    events around the step, its model time is the device's, read then too."""

    def __init__(
        self,
        step: StepLogits,
        sampled: DeviceSample | None,
        sample_s: float,
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
    ) -> None:
        self._step = step
        self._sampled = sampled
        self._sample_s = sample_s
        self._events = events
        self._copy = HostCopy(sampled.tensors()) if sampled is not None else None

    def result(self) -> RunnerOutput:
        step = self._step
        sampled = SampledTokens([], [])
        if self._copy is not None and self._sampled is not None:
            sampled = self._sampled.read(self._copy.get())
        model_s = step.model_s + self._sample_s
        if self._events is not None:
            start, end = self._events
            end.synchronize()  # done already where tokens were copied: the copies came after it
            model_s = start.elapsed_time(end) / 1000
        return RunnerOutput(sampled, step.prompt_logprobs, model_s, step.pooled)


class BatchSampler:
    def __init__(self, rows: PersistentBatch) -> None:
        self.rows = rows
        # Fills grammar bitmasks while the model runs (the forward releases the GIL in its kernels).
        self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmasks")

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
        self,
        batch: ScheduledBatch,
        step: StepLogits,
        bitmasks: Future[torch.Tensor] | None,
        events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
    ) -> PendingOutput:
        """After the forward: a token per sampling row, on the device. `events`: the step's
        start, recorded before its forward, and its end, recorded here after sampling."""
        sampled, sample_s = None, 0.0
        if step.logits is not None:
            rows = batch.sampling_rows
            sampling = self._sampling(rows, bitmasks.result() if bitmasks is not None else None)
            started = time.perf_counter()
            if any(row.draft_token_ids for row in rows):
                sampled = sample_with_drafts(step.logits, rows, sampling)
            else:
                sampled = sample(step.logits, sampling)
            sample_s = time.perf_counter() - started
            # Last: a batch that raised before here took nothing, so its rows can be rerun alone.
            self.rows.take_sampled([row.request_id for row in rows], sampled.token_ids)
        if events is not None:
            events[1].record()
        return PendingOutput(step, sampled, sample_s, events)

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
