"""One replica without a model: the engine's own EngineCore (scheduler, KV cache manager, step and
update) over a SimExecutor, stepping on the event loop; a step takes the time the step-time model
predicts for its shape."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from common.block_hash import root_hash
from common.errors import InvalidRequestError
from common.kv_transfer import KvBlocks, KvLayout
from common.lora import LoRARequest
from common.routing_stats import RoutingReporter, RoutingStats
from common.sampling_params import SamplingParams
from fleet_sim.clock import EventLoop
from fleet_sim.trace import SimRequest, output_token
from replica_engine.engine_core import EngineCore
from replica_engine.executor import RunnerOutput, SampledTokens
from replica_engine.kv_cache_manager import check_pool_fits
from replica_engine.lora.slots import AdapterSlots
from replica_engine.outputs import CoreOutput, EngineStats
from replica_engine.request import Request
from replica_engine.scheduler import SCHEDULING_POLICIES
from replica_engine.scheduler.plan import ScheduledBatch
from replica_engine.scheduler.step_time_model import (
    CONTEXTS,
    StepShape,
    StepTime,
    StepTimeModel,
    profile_shapes,
)


@dataclass(frozen=True)
class ReplicaConfig:
    """The engine settings a simulated replica runs with (EngineConfig's scheduling fields)."""

    num_kv_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    scheduling_policy: str = "stall_free"
    enable_prefix_caching: bool = True
    tbt_slo_s: float | None = None
    pipeline_parallel_size: int = 1  # stages, each 1/N of a step's time; N batches in flight
    model: str = "sim"  # part of every block's hash, as a real replica's model name is
    max_loras: int = 4  # LoRA adapters running at once
    max_cpu_loras: int | None = None  # adapters held loaded (None: max_loras)
    lora_load_s: float = 0.0  # a step that needs an adapter not held loaded stalls this long to load it
    speculative: None = None  # no speculative decoding simulated

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy: {self.scheduling_policy!r} is not one of {sorted(SCHEDULING_POLICIES)}"
            )
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size: must be at least 1, got {self.pipeline_parallel_size}")
        if self.max_loras < 1 or (self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras):
            raise ValueError("max_loras must be >= 1, and max_cpu_loras (if set) >= max_loras")
        if self.lora_load_s < 0:
            raise ValueError(f"lora_load_s: must be >= 0, got {self.lora_load_s}")


# Every simulated replica's KV layout: blocks move only between equal layouts, and these carry
# nothing (the bytes a transfer takes are the fleet's kv_bytes_per_token).
SIM_KV_LAYOUT = KvLayout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=1, dtype="sim", dtype_bytes=0)


class SimAdapters:
    """The runner's LoRA adapters without weights, by its own policy (replica_engine/lora/slots.py):
    `max_loras` device slots, a host LRU of `max_cpu_loras`, and a load from disk (`load_s`) when
    a step needs an adapter in neither."""

    def __init__(self, max_loras: int, max_cpu_loras: int, load_s: float) -> None:
        self.load_s = load_s
        self.loads: Counter[str] = Counter()  # adapter name -> loads from disk
        self.placement: AdapterSlots[None] = AdapterSlots(max_loras, max_cpu_loras, self._load)

    def _load(self, lora: LoRARequest) -> None:
        self.loads[lora.name] += 1

    def prepare(self, adapters: Iterable[LoRARequest | None]) -> float:
        """Slots for a step's adapters; the seconds its loads from disk take."""
        before = sum(self.loads.values())
        self.placement.assign(list(dict.fromkeys(lora for lora in adapters if lora is not None)))
        return (sum(self.loads.values()) - before) * self.load_s


class SimExecutor:
    """The forward pass replaced: each sampling row's token is its request's next simulated token,
    and a step takes the step-time model's mean (uncalibrated) prediction for its shape, on a
    virtual clock (`elapsed_s`). With N pipeline stages (`pipeline_depth`), each stage takes 1/N
    of that (an even split of the work; stage-to-stage transfers are not modeled) and starts a
    batch once the stage before has passed it on and its previous batch is done, so N batches
    overlap as in the engine's pipeline. A step that loads LoRA adapters takes their load time
    more, in its first stage."""

    def __init__(
        self, step_time: StepTime, pipeline_depth: int = 1, adapters: SimAdapters | None = None
    ) -> None:
        self.step_time = step_time
        self.pipeline_depth = pipeline_depth
        self.schedules_ahead = False
        self.kv_layout = SIM_KV_LAYOUT  # blocks move between simulated replicas without data
        self.adapters = adapters or SimAdapters(1, 1, 0.0)
        self.elapsed_s = 0.0
        self.last_step_s: float | None = None  # of the latest step call; 0: it only submitted
        self.requests: dict[str, Request] = {}  # the scheduler's, bound by sim_core
        self._stage_free_at = [0.0] * pipeline_depth
        self._in_flight: deque[tuple[ScheduledBatch, float]] = deque()  # with when each is out

    def allocate_kv_cache(self, pool_size: int) -> None:
        """No tensors: the KV cache manager's block accounting is all there is."""

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        self.submit(batch)
        return self.collect()

    def read_kv_blocks(self, block_ids: list[int]) -> None:
        """No data: a transfer's time is the fleet's to model (fleet_sim/disaggregated.py)."""

    def write_kv_blocks(self, block_ids: list[int], data: object, indices: list[int]) -> None:
        """No data to write."""

    def submit(self, batch: ScheduledBatch) -> None:
        stage_s = self.step_time.predict_raw(batch.shape()) / self.pipeline_depth
        load_s = self.adapters.prepare(row.lora for row in batch.rows)
        at = self.elapsed_s
        for stage, free_at in enumerate(self._stage_free_at):
            at = max(at, free_at) + stage_s + (load_s if stage == 0 else 0.0)
            self._stage_free_at[stage] = at
        self._in_flight.append((batch, at))
        self.last_step_s = self.last_step_s or 0.0

    def collect(self) -> RunnerOutput:
        """The oldest batch's tokens, once the clock reaches its end."""
        batch, out_at = self._in_flight.popleft()
        waited = max(0.0, out_at - self.elapsed_s)
        self.elapsed_s += waited
        self.last_step_s = (self.last_step_s or 0.0) + waited
        tokens = [
            output_token(row.request_id, len(self.requests[row.request_id].output_token_ids))
            for row in batch.sampling_rows
        ]
        return RunnerOutput(SampledTokens(tokens, [None] * len(tokens)), model_s=waited)

    def clock(self) -> float:
        return self.elapsed_s


def sim_core(config: ReplicaConfig, step_time: StepTime) -> EngineCore:
    """The engine's own EngineCore (scheduler, KV cache manager, its step and update) over a
    SimExecutor; a TBT target plans with `step_time` itself."""
    max_cpu_loras = config.max_cpu_loras or config.max_loras
    adapters = SimAdapters(config.max_loras, max_cpu_loras, config.lora_load_s)
    executor = SimExecutor(step_time, config.pipeline_parallel_size, adapters)
    core = EngineCore(config, executor, config.num_kv_blocks, None, step_time=step_time, clock=executor.clock)
    executor.requests = core.scheduler.requests
    return core


def engine_request(request: SimRequest) -> Request:
    params = SamplingParams(
        max_tokens=request.max_tokens,
        ignore_eos=True,
        cache_salt=request.cache_salt,
        lora=request.lora_request,
    )
    return Request(request.request_id, list(request.prompt_token_ids), params, arrival_time=request.arrival_s)


def learned_coefficients(step_time: StepTime, config: ReplicaConfig) -> tuple[float, ...]:
    """What the replica's own step-time model would say: the fitted model's coefficients, or a
    GPU roofline's as a replica fits them, on its startup profile's shapes."""
    if isinstance(step_time, StepTimeModel):
        return tuple(float(c) for c in step_time.coefficients)
    cap = config.max_num_batched_tokens
    shapes = [StepShape.of(rows) for rows in profile_shapes(cap, cap + max(CONTEXTS), config.max_num_seqs)]
    model = StepTimeModel()
    model.fit_profile((shape, step_time.predict_raw(shape)) for shape in shapes)
    return tuple(float(c) for c in model.coefficients)


TokenListener = Callable[["SimReplica", CoreOutput, float], None]  # (replica, output, now), per token


class SimReplica:
    """A sim_core on the event loop. Requests join between steps, as the engine core applies its
    adds; a step's tokens are out when it ends (its time: the SimExecutor's); an idle replica
    steps at once. Its stats are what the real core publishes: after the adds, and after each
    step, once that step has ended."""

    def __init__(
        self,
        replica_id: str,
        config: ReplicaConfig,
        step_time: StepTime,
        loop: EventLoop,
        on_token: TokenListener,
    ) -> None:
        self.replica_id = replica_id
        self.config = config
        self.core = sim_core(config, step_time)
        self.executor: SimExecutor = self.core.runner  # type: ignore[assignment]
        self.loop = loop
        self.on_token = on_token
        self.reporter = RoutingReporter(
            config.block_size, root_hash(config.model, None), config.max_num_batched_tokens
        )
        self.step_time_coefficients = learned_coefficients(step_time, config)
        self.num_ongoing = 0  # submitted and not finished: what Serve's max_ongoing_requests counts
        self._published = self.core.stats
        self._joining: list[tuple[Request, KvBlocks | None]] = []
        self._stepping = False
        self._dead = False
        self._finishing: list[str] = []  # requests the step in flight finishes: out when it ends

    def stats(self) -> EngineStats:
        return self._published

    def holds_block(self, block_hash: bytes) -> bool:
        """Whether its prefix cache holds this block now (what vLLM's KV events tell llm-d)."""
        return self.core.kv_cache_manager.cached_block(block_hash) is not None

    def report(self) -> RoutingStats:
        """The routing report, with the step-time model a real replica would have learned."""
        stats = self.reporter.report(self._published, self.num_ongoing)
        return replace(stats, step_time_coefficients=self.step_time_coefficients)

    def submit(self, request: Request, kv: KvBlocks | None = None) -> None:
        """Queue a request for the next step (with `kv`, blocks of its prompt a prefill replica
        computed, which it adopts); ValueError if it could never fit the KV pool."""
        num_tokens = request.num_prompt_tokens + request.sampling_params.max_tokens
        try:
            check_pool_fits(num_tokens, self.config.block_size, self.config.num_kv_blocks)
        except InvalidRequestError as error:
            raise ValueError(f"request {request.request_id!r}: {error}") from None
        self._joining.append((request, kv))
        self.num_ongoing += 1
        if not self._stepping:
            self._stepping = True
            self.loop.call_later(0.0, self._step)

    def _step(self) -> None:
        if self._joining:  # else the stats are the last step's, published as it ended
            for request, kv in self._joining:
                self.core.add_request(request, kv)
            self._joining.clear()
            self.core.publish_stats()
            self._published = self.core.stats
        self.executor.last_step_s = None
        outputs = self.core.step()
        if self.executor.last_step_s is None:  # nothing was scheduled
            self._stepping = False
            return
        stats = self.core.stats
        self._finishing = [output.request_id for output in outputs if output.finished]
        self.loop.call_later(self.executor.last_step_s, lambda: self._end_step(outputs, stats))

    def kill(self) -> list[str]:
        """The replica dies now; the ids of the requests it held (lost with it), those whose last
        token the step in flight was computing too (the engine has let them go, the client has not)."""
        self._dead = True
        lost = [r.request_id for r, _ in self._joining] + list(self.core.scheduler.requests) + self._finishing
        self.num_ongoing = 0
        return lost

    def _end_step(self, outputs: list[CoreOutput], stats: EngineStats) -> None:
        if self._dead:  # the step in flight when it died
            return
        self._published = stats
        now = self.loop.now
        for output in outputs:
            if output.finished:
                self.num_ongoing -= 1
            self.on_token(self, output, now)
        self._step()
