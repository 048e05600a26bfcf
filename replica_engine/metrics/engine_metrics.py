"""The engine's metrics, recorded in one place whatever the sink. Names and meanings follow vLLM's
(`vllm:time_to_first_token_seconds` is our `stallfree_time_to_first_token_seconds`, and so on)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.finish_reason import FinishReason
from common.metrics_sinks import PREFIX, Counter, Gauge, Histogram, MetricOp, MetricsSink
from replica_engine.request import Request
from replica_engine.scheduler.plan import StepSummary
from replica_engine.scheduler.token_budget import BudgetDecision

if TYPE_CHECKING:
    from replica_engine.outputs import EngineStats

# Fine enough to read SLO lines off: 0.1 / 0.25 / 0.5 / 1 / 2 / 5 s for latencies ...
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640)
# ... and 5 / 10 / 25 / 50 / 100 / 200 / 500 ms between tokens.
TOKEN_INTERVAL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)
# measured / predicted step time: 1 is a perfect model; > 1, steps longer than predicted.
PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4)
OVERHEAD_FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
TOKEN_COUNT_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

MODEL_LABEL = "model_name"
REASON_LABEL = "finished_reason"
POSITION_LABEL = "position"
OUTCOME_LABEL = "outcome"


class EngineMetrics:
    def __init__(self, sink: MetricsSink, model_name: str) -> None:
        self.labels = {MODEL_LABEL: model_name}
        labels = (MODEL_LABEL,)
        self.by_name: dict[str, Counter | Gauge | Histogram] = {}  # replay's index

        def gauge(name: str, description: str) -> Gauge:
            instrument = sink.gauge(PREFIX + name, description, labels)
            self.by_name[PREFIX + name] = instrument
            return instrument

        def histogram(name: str, description: str, buckets: tuple[float, ...]) -> Histogram:
            instrument = sink.histogram(PREFIX + name, description, buckets, labels)
            self.by_name[PREFIX + name] = instrument
            return instrument

        def counter(name: str, description: str, extra_labels: tuple[str, ...] = ()) -> Counter:
            instrument = sink.counter(PREFIX + name, description, labels + extra_labels)
            self.by_name[PREFIX + name] = instrument
            return instrument

        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting to be scheduled (queue depth)"
        )
        self.num_requests_running = gauge("num_requests_running", "Requests holding KV cache")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV cache usage, 0 to 1")
        self.num_free_kv_blocks = gauge("num_free_kv_blocks", "Free KV cache blocks")
        self.num_pending_prompt_tokens = gauge(
            "num_pending_prompt_tokens",
            "Prompt tokens still to compute: waiting requests' (net of cached prefixes), running ones' rest",
        )

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output token", LATENCY_BUCKETS_S
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Time between consecutive output tokens (TBT)",
            TOKEN_INTERVAL_BUCKETS_S,
        )
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to finish", LATENCY_BUCKETS_S)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled", LATENCY_BUCKETS_S
        )
        self.iteration_tokens = histogram(
            "iteration_tokens", "Tokens scheduled in one step", TOKEN_COUNT_BUCKETS
        )
        self.step_duration = histogram(
            "step_duration_seconds", "Wall time of one step", TOKEN_INTERVAL_BUCKETS_S
        )
        self.step_overhead = histogram(
            "step_overhead_fraction",
            "Share of a step's wall time outside the model's forward and sampling",
            OVERHEAD_FRACTION_BUCKETS,
        )
        self.prompt_length = histogram(
            "request_prompt_tokens", "Prompt length of a request", TOKEN_COUNT_BUCKETS
        )
        self.output_length = histogram(
            "request_generation_tokens", "Output length of a finished request", TOKEN_COUNT_BUCKETS
        )

        self.step_token_budget = histogram(
            "step_token_budget",
            "Tokens a TBT target let a step carry (tbt_slo_s; steps with a prompt chunk)",
            TOKEN_COUNT_BUCKETS,
        )
        self.step_time_prediction_ratio = histogram(
            "step_time_prediction_ratio",
            "Measured / predicted step time (tbt_slo_s: the step-time model's fit, before calibration)",
            PREDICTION_RATIO_BUCKETS,
        )
        self.steps_over_slo = counter("steps_over_slo", "Steps that took longer than tbt_slo_s")
        self.steps_decodes_over_slo = counter(
            "steps_decodes_over_slo", "Steps whose decodes alone were predicted over tbt_slo_s"
        )

        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of requests (cached ones included; recomputation not counted)"
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (once per request)"
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.generation_tokens = counter("generation_tokens", "Output tokens generated")
        self.requests_finished = counter("requests_finished", "Requests finished, by reason", (REASON_LABEL,))
        self.preemptions = counter("num_preemptions", "Requests preempted for want of KV blocks")
        self.stream_messages = counter(
            "stream_messages",
            "Messages a replica sent on its requests' streams, each with every token then ready for "
            "its request (generation_tokens over this: tokens per message)",
        )
        # Speculative decoding, by vLLM's names: acceptance length = 1 + accepted / drafts.
        self.spec_drafts = counter("spec_decode_num_drafts", "Decodes that carried draft tokens")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens kept")
        self.spec_accepted_by_position = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens kept, by their position in the draft (0: the first)",
            (POSITION_LABEL,),
        )
        self.kv_transfers = counter(
            "kv_transfers",
            "Prefill/decode disaggregation: prompts' KV blocks a prefill replica sent, a decode "
            "replica received, or lost on the way (the decode replica then computed the prompt)",
            (OUTCOME_LABEL,),
        )
        self.kv_transfer_bytes = counter(
            "kv_transfer_bytes", "Prefill/decode disaggregation: KV bytes received by a decode replica"
        )
        self._zero_at_start_series: list[tuple[Counter, dict[str, str]]] = [
            (instrument, self.labels)
            for instrument in (
                self.prompt_tokens,
                self.prefix_cache_queries,
                self.prefix_cache_hits,
                self.generation_tokens,
                self.stream_messages,
                self.preemptions,
                self.steps_over_slo,
                self.steps_decodes_over_slo,
                self.spec_drafts,
                self.spec_draft_tokens,
                self.spec_accepted_tokens,
            )
        ]
        self._zero_at_start_series += [
            (self.requests_finished, {**self.labels, REASON_LABEL: reason.value}) for reason in FinishReason
        ]
        self.initialize_series()

    def initialize_series(self) -> None:
        """Export the counters that start at zero, adding 0. Ray's workers export counters as deltas
        and never re-send a 0 that a first export lost (a fresh replica's panels then show no data
        until its first count, CI saw it): the replica calls this again now and then."""
        for instrument, labels in self._zero_at_start_series:
            instrument.initialize(labels)

    def record_kv_transfer(self, outcome: str, num_bytes: int = 0) -> None:
        """A prompt's KV blocks `sent`, `received` (`num_bytes` of them) or `lost`."""
        self.kv_transfers.inc(1, {**self.labels, OUTCOME_LABEL: outcome})
        if num_bytes:
            self.kv_transfer_bytes.inc(num_bytes, self.labels)

    def replay(self, ops: list[MetricOp]) -> None:
        """Apply updates another process's EngineMetrics recorded (over a BufferedSink)."""
        for name, method, value, labels in ops:
            getattr(self.by_name[name], method)(value, labels)

    def record_stats(self, stats: EngineStats) -> None:
        self.num_requests_waiting.set(stats.num_waiting, self.labels)
        self.num_requests_running.set(stats.num_running, self.labels)
        self.kv_cache_usage.set(stats.kv_cache_usage, self.labels)
        self.num_free_kv_blocks.set(stats.num_free_blocks, self.labels)
        self.num_pending_prompt_tokens.set(stats.num_pending_prompt_tokens, self.labels)

    def record_step(self, summary: StepSummary) -> None:
        self.iteration_tokens.observe(summary.num_tokens, self.labels)
        self.step_duration.observe(summary.duration_s, self.labels)
        if summary.duration_s > 0:
            self.step_overhead.observe(summary.overhead_s / summary.duration_s, self.labels)
        if summary.num_preempted:
            self.preemptions.inc(summary.num_preempted, self.labels)

    def record_budget(
        self, decision: BudgetDecision | None, predicted_s: float, measured_s: float, tbt_slo_s: float
    ) -> None:
        """A step run under a TBT target: the budget it was given (if it had a prompt chunk) and how
        well its time was predicted."""
        self.step_time_prediction_ratio.observe(measured_s / max(predicted_s, 1e-9), self.labels)
        if measured_s > tbt_slo_s:
            self.steps_over_slo.inc(1, self.labels)
        if decision is not None:
            self.step_token_budget.observe(decision.token_budget, self.labels)
            if decision.decodes_over_slo:
                self.steps_decodes_over_slo.inc(1, self.labels)

    def record_token(
        self, request: Request, now: float, previous_token_time: float | None, num_tokens: int = 1
    ) -> None:
        """A request got `num_tokens` output tokens at `now` (more than one: draft tokens kept,
        each at an equal share of the interval); `record_generated` counts them, once a step."""
        if previous_token_time is None:
            self.time_to_first_token.observe(now - request.arrival_time, self.labels)
            self.prompt_tokens.inc(request.num_prompt_tokens, self.labels)
            self.prefix_cache_queries.inc(request.num_prompt_tokens, self.labels)
            self.prefix_cache_hits.inc(request.num_cached_tokens, self.labels)
        else:
            for _ in range(num_tokens):
                self.inter_token_latency.observe((now - previous_token_time) / num_tokens, self.labels)

    def record_generated(self, num_tokens: int) -> None:
        """A step's output tokens, all its requests' (one record a step, not one a request)."""
        if num_tokens:
            self.generation_tokens.inc(num_tokens, self.labels)

    def record_drafts(self, num_drafted: int, num_accepted: int) -> None:
        """One decode's draft: how many tokens it proposed, how many verification kept."""
        self.spec_drafts.inc(1, self.labels)
        self.spec_draft_tokens.inc(num_drafted, self.labels)
        self.spec_accepted_tokens.inc(num_accepted, self.labels)
        for position in range(num_accepted):
            self.spec_accepted_by_position.inc(1, {**self.labels, POSITION_LABEL: str(position)})

    def record_finished(self, request: Request, now: float) -> None:
        reason = request.finish_reason.value if request.finish_reason else "error"
        self.requests_finished.inc(1, {**self.labels, REASON_LABEL: reason})
        self.e2e_latency.observe(now - request.arrival_time, self.labels)
        if request.first_scheduled_time is not None:
            self.queue_time.observe(request.first_scheduled_time - request.arrival_time, self.labels)
        self.prompt_length.observe(request.num_prompt_tokens, self.labels)
        self.output_length.observe(len(request.output_token_ids), self.labels)
