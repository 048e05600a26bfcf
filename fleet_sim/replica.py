"""One replica without a model: the engine's own Scheduler and KVCacheManager, stepping on the
event loop; a step takes the time the step-time model predicts for its shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.block_hash import root_hash
from common.errors import InvalidRequestError
from common.routing_stats import RoutingReporter
from common.sampling_params import SamplingParams
from fleet_sim.clock import EventLoop
from fleet_sim.trace import SimRequest, output_token
from replica_engine.kv_cache_manager import KVCacheManager, check_pool_fits
from replica_engine.outputs import EngineStats
from replica_engine.request import Request
from replica_engine.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from replica_engine.scheduler.plan import ScheduledBatch
from replica_engine.scheduler.step_time_model import StepTime
from replica_engine.scheduler.token_budget import SLOTokenBudget


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
    model: str = "sim"  # part of every block's hash, as a real replica's model name is

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy: {self.scheduling_policy!r} is not one of {sorted(SCHEDULING_POLICIES)}"
            )


class ReplicaCore:
    """A replica's engine state and its step, without the model: what the engine's EngineCore
    does, with the forward pass replaced by each request's next simulated token."""

    def __init__(self, config: ReplicaConfig, step_time: StepTime) -> None:
        self.config = config
        self.step_time = step_time
        self.kv_cache_manager = KVCacheManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching, model=config.model
        )
        slo_budget = SLOTokenBudget(step_time, config.tbt_slo_s) if config.tbt_slo_s is not None else None
        scheduler_config = SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs)
        policy = SCHEDULING_POLICIES[config.scheduling_policy]
        self.scheduler = policy(scheduler_config, self.kv_cache_manager, slo_budget)

    def add(self, request: Request) -> None:
        num_tokens = request.num_prompt_tokens + request.sampling_params.max_tokens
        try:
            check_pool_fits(num_tokens, self.config.block_size, self.config.num_kv_blocks)
        except InvalidRequestError as error:
            raise ValueError(f"request {request.request_id!r}: {error}") from None
        self.scheduler.add_request(request)

    def schedule(self) -> ScheduledBatch:
        return self.scheduler.schedule()

    def duration(self, batch: ScheduledBatch) -> float:
        """The step's time: the step-time model's mean (uncalibrated) prediction."""
        return self.step_time.predict_raw(batch.shape())

    def update(self, batch: ScheduledBatch) -> list[Request]:
        """Advance the requests the step computed; the ones that got a token (some finished)."""
        requests = self.scheduler.requests
        tokens = [
            output_token(row.request_id, len(requests[row.request_id].output_token_ids))
            for row in batch.sampling_rows
        ]
        return self.scheduler.update(batch, tokens)

    def stats(self) -> EngineStats:
        return self.scheduler.stats()


def engine_request(request: SimRequest) -> Request:
    params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True, cache_salt=request.cache_salt)
    return Request(request.request_id, list(request.prompt_token_ids), params, arrival_time=request.arrival_s)


TokenListener = Callable[["SimReplica", Request, float], None]  # (replica, request, now), per token


class SimReplica:
    """A ReplicaCore on the event loop. Requests join between steps, as AsyncEngine's step
    thread adds them; a step's tokens are out when it ends; an idle replica steps at once."""

    def __init__(self, replica_id: str, core: ReplicaCore, loop: EventLoop, on_token: TokenListener) -> None:
        self.replica_id = replica_id
        self.core = core
        self.loop = loop
        self.on_token = on_token
        self.reporter = RoutingReporter(core.config.block_size, root_hash(core.config.model, None))
        self.num_ongoing = 0  # submitted and not finished: what Serve's max_ongoing_requests counts
        self._joining: list[Request] = []
        self._stepping = False
        self._dead = False

    def submit(self, request: Request) -> None:
        self._joining.append(request)
        self.num_ongoing += 1
        if not self._stepping:
            self._stepping = True
            self.loop.call_later(0.0, self._step)

    def _step(self) -> None:
        for request in self._joining:
            self.core.add(request)
        self._joining.clear()
        batch = self.core.schedule()
        if batch.is_empty:
            self._stepping = False
            return
        self.loop.call_later(self.core.duration(batch), lambda: self._end_step(batch))

    def kill(self) -> list[str]:
        """The replica dies now; the ids of the requests it held (lost with it)."""
        self._dead = True
        lost = [r.request_id for r in self._joining] + list(self.core.scheduler.requests)
        self.num_ongoing = 0
        return lost

    def _end_step(self, batch: ScheduledBatch) -> None:
        if self._dead:  # the step in flight when it died
            return
        now = self.loop.now
        for request in self.core.update(batch):
            if request.is_finished:
                self.num_ongoing -= 1
            self.on_token(self, request, now)
        self._step()
