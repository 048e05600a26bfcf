"""bench.gpu --rehearse's overlap part: how much of a GPU's time async scheduling leaves idle,
rehearsed on this CPU with a stand-in device, so that a stall in the engine's own loop shows
without a GPU (the H200's offline run left its device idle 16.9% of the time).

The host's side is all the engine's own: the offline LLM loop, the scheduler, the update and the
outputs, and of each step's submission the runner's persistent batch, the flat batch's inputs
and the placeholders. The device is a worker thread that takes the submitted steps in order, as
a CUDA stream does, and sleeps each one's time on an H100 (fleet_sim/roofline.py's, for the GPU
plan's Llama-3-8B shape, its per-step overhead left out: that is the host's here); every sampled
token is token 1. Not in the stand-in: the kernel launches' host time (a graph's replay, an eager
step's hundreds of launches) and any wait a real device adds. The KV pool is as many blocks as
an H100 would hold (90% of its memory, less the weights), on the tiny model."""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from bench.gpu.gpu_offline import run_workload
from common.model_shapes import dummy_config_dict
from fleet_sim.roofline import ACCELERATORS, ModelCost, RooflineStepTime
from replica_engine import LLM
from replica_engine.engine_core import EngineCore
from replica_engine.executor import RunnerOutput, SampledTokens
from replica_engine.flat_batch import build_flat_batch
from replica_engine.model_runner import ModelRunner
from replica_engine.scheduler.plan import ScheduledBatch

DEVICE = "h100-sxm"  # the goal's GPU
DEVICE_MODEL = "llama3-8b"  # the GPU plan's shape, whose steps the device's times are
SAMPLED_TOKEN = 1


class StandInDevice:
    """A PipelinedExecutor over a real runner's host side and a sleeping device thread."""

    kv_layout = None  # holds no K/V to hand over

    def __init__(
        self, runner: ModelRunner, seconds_of: Callable[[ScheduledBatch], float], ahead: bool
    ) -> None:
        self.runner = runner
        self.seconds_of = seconds_of
        self.schedules_ahead = ahead
        self.pipeline_depth = 2 if ahead else 1
        self.idle_between_steps_s = 0.0  # the device's waits from one step's end to the next's start
        self.most_in_flight = 0  # steps submitted and not yet collected, at most
        self._stream = ThreadPoolExecutor(1, thread_name_prefix="stand-in-device")
        self._pending: deque[tuple[Future[float], ScheduledBatch]] = deque()
        self._last_end: float | None = None

    def allocate_kv_cache(self, pool_size: int) -> None:
        self.runner.allocate_kv_cache(pool_size)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        self.submit(batch)
        return self.collect()

    def submit(self, batch: ScheduledBatch) -> None:
        """The runner's host side of the step, then the step queued on the device thread."""
        rows = self.runner.rows
        rows.apply(batch)
        flat = build_flat_batch(batch, rows.block_tables(batch), self.runner.config.block_size)
        rows.fill_placeholders(batch, flat.input_ids)
        sampled = torch.full((len(batch.sampling_rows),), SAMPLED_TOKEN, dtype=torch.int64)
        rows.take_sampled([row.request_id for row in batch.sampling_rows], sampled)
        self._pending.append((self._stream.submit(self._run, self.seconds_of(batch)), batch))
        self.most_in_flight = max(self.most_in_flight, len(self._pending))

    def _run(self, seconds: float) -> float:
        """On the device thread: the step's time, after the wait since the step before it."""
        started = time.perf_counter()
        if self._last_end is not None:
            self.idle_between_steps_s += started - self._last_end
        time.sleep(seconds)
        self._last_end = time.perf_counter()
        return self._last_end - started

    def collect(self) -> RunnerOutput:
        done, batch = self._pending.popleft()
        busy_s = done.result()
        count = len(batch.sampling_rows)
        return RunnerOutput(SampledTokens([SAMPLED_TOKEN] * count, [None] * count), model_s=busy_s)

    def close(self) -> None:
        self._stream.shutdown()


def h100_roofline() -> tuple[RooflineStepTime, int]:
    """The device's step times (its per-step overhead left out) and its pool in 16-token blocks."""
    accelerator = dataclasses.replace(ACCELERATORS[DEVICE], step_overhead_s=0.0)
    cost = ModelCost.of(dummy_config_dict(DEVICE_MODEL))
    pool_bytes = 0.9 * accelerator.memory_bytes - cost.weight_bytes
    return RooflineStepTime(accelerator, cost), int(pool_bytes // (16 * cost.kv_bytes_per_token))


def overlap(model: str, num_requests: int, max_len: int, engine: dict) -> dict:
    """The GPU plan's offline workload with async scheduling and in synchronous steps."""
    return {
        name: overlap_run(model, num_requests, max_len, engine, ahead)
        for name, ahead in (("async", True), ("sync", False))
    }


def overlap_run(model: str, num_requests: int, max_len: int, engine: dict, ahead: bool) -> dict:
    roofline, num_kv_blocks = h100_roofline()
    llm = LLM(model=model, device="cpu", dtype="bfloat16", num_kv_blocks=num_kv_blocks, **engine)
    runner = llm.engine.core.runner
    assert isinstance(runner, ModelRunner)
    device = StandInDevice(runner, lambda batch: roofline.predict_raw(batch.shape()), ahead)
    core = EngineCore(llm.engine.config, device, num_kv_blocks, None, step_time=roofline)
    core.cached_hashes_every_s = math.inf  # as LLMEngine's: no router reads an offline engine's keys
    llm.engine.core = core
    run = run_workload(llm, model, num_requests, max_len)
    device.close()
    busy_s = run.model_s
    return {
        "device": f"{DEVICE} roofline, {DEVICE_MODEL}",
        "requests": len(run.arrivals),
        "steps": len(run.summaries),
        "wall_s": run.wall_s,
        "device_busy_s": busy_s,
        "device_idle_share": 1 - busy_s / run.wall_s,
        "device_idle_between_steps_s": device.idle_between_steps_s,
        "most_steps_in_flight": device.most_in_flight,
        "mean_decodes_per_step": run.mean_decodes_per_step,
        "gc_pause_s": run.gc_pause_s,
        "host_phases_s": run.host_phases_s,
        # what the roofline device would give with this host: not a GPU's measurement
        "output_tok_per_s": run.output_tokens / run.wall_s,
    }
