"""Timing single engine steps against a floor, shared by bench.engine.cpu and bench.gpu: what a step must
read and compute (StepWork), the model's share of a step (a step listener), and the decode and
mixed steps the stall-free scheduler makes, built by feeding an LLMEngine requests."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from bench.engine.host_phases import PHASES, host_phases
from replica_engine import LLMEngine, SamplingParams
from replica_engine.kernels.cpu import TiledWeight
from replica_engine.kernels.quantized_weight import QuantizedWeight
from replica_engine.model_runner import ModelRunner
from replica_engine.models.moe import Experts, SparseMoeBlock
from replica_engine.scheduler.plan import StepSummary


@dataclass(frozen=True)
class StepWork:
    """What one step must move and compute, for its floor."""

    bytes_read: float
    flops: float


def step_work(
    engine: LLMEngine, rows: list[tuple[int, int]], num_sampled: int, experts_read: float = 0.0
) -> StepWork:
    """Weights read once (as held: quantized ones in their own bytes), the KV cache of every
    request's context, and the FLOPs of the linear layers, attention (QK^T and PV) and the logits
    of the sampled rows. `rows`: per request, its query tokens this step and its context after
    them. A mixture of experts reads only the experts its tokens picked: `experts_read`, summed
    over its layers (measured: ExpertUse), and computes each token's top-k."""
    model = engine.core.runner.model
    layers = model.model.layers
    attention = layers[0].self_attn
    itemsize = engine.config.torch_dtype.itemsize
    linears = [m for m in layers.modules() if isinstance(m, torch.nn.Linear)]
    linear_params = sum(m.in_features * m.out_features for m in linears)
    vocab_params = model.config.vocab_size * model.config.hidden_size  # the logits' matrix, tied or not
    logits_weight = model._logits_weight()
    # (a shared expert's gate is a plain nn.Linear: no kernel weight)
    weight_bytes = sum(
        _bytes(getattr(m, "packed", None), m.in_features * m.out_features, itemsize) for m in linears
    )
    weight_bytes += _bytes(logits_weight, vocab_params, itemsize)
    kv_per_token = len(layers) * 2 * attention.num_kv_heads * attention.head_dim * itemsize
    attention_flops = sum(
        4 * q * (ctx - q / 2) * attention.num_heads * attention.head_dim * len(layers) for q, ctx in rows
    )
    num_tokens = sum(q for q, _ in rows)
    blocks = _sparse_blocks(engine)
    if blocks:  # every sparse layer alike
        weight_bytes += experts_read * expert_bytes(engine)
        hidden, width = model.config.hidden_size, blocks[0].shape.expert_width
        linear_params += blocks[0].shape.top_k * 3 * hidden * width * len(blocks)
    return StepWork(
        bytes_read=weight_bytes + kv_per_token * sum(ctx for _, ctx in rows),
        flops=2 * num_tokens * linear_params + 2 * num_sampled * vocab_params + attention_flops,
    )


def _sparse_blocks(engine: LLMEngine) -> list[SparseMoeBlock]:
    layers = engine.core.runner.model.model.layers
    return [layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoeBlock)]


def expert_bytes(engine: LLMEngine) -> float:
    """What one expert of one sparse layer holds (gate, up, down: quantized ones in their own
    bytes); every sparse layer's experts alike. 0 for a dense model."""
    blocks = _sparse_blocks(engine)
    if not blocks:
        return 0.0
    hidden, width = engine.core.runner.model.config.hidden_size, blocks[0].shape.expert_width
    experts, itemsize = blocks[0].experts, engine.config.torch_dtype.itemsize
    gate_up, down = experts.kernel_weights[0] if experts.kernel_weights else (None, None)
    return _bytes(gate_up, 2 * hidden * width, itemsize) + _bytes(down, hidden * width, itemsize)


def _bytes(weight: object, params: int, itemsize: int) -> int:
    """What a decode step's matmul reads of a weight: a quantized one's codes and scales (not its
    AMX copy, read by steps of many tokens only), else every value."""
    if isinstance(weight, TiledWeight):
        weight = weight.kernel_weight
    return weight.nbytes if isinstance(weight, QuantizedWeight) else params * itemsize


@dataclass(frozen=True)
class StepResult:
    dtype: str
    case: str  # decode-b<B>[-ctx<C>], prefill-<N> or mixed-<decodes>+<chunk>
    step_ms: float  # median wall time of the step (LLMEngine.step: the core's step and outputs)
    model_ms: float  # of which in the model's forward and sampling
    overhead_ms: float  # the rest: scheduling, the batch's inputs, applying and emitting outputs
    overhead_share: float  # overhead / step
    floor_ms: float
    floor_kind: str  # memory or compute
    ratio: float  # step / floor
    goal_met: bool
    host_ms: dict[str, float]  # a step's time in each host phase (host_phases.py), their mean
    device_idle_ms: float | None  # on a GPU: the device's wait before each step, their mean


def step_result(
    dtype: str,
    case: str,
    timing: StepTiming,
    work: StepWork,
    rates: tuple[float, float],
    memory_bound: bool,
    goal_ratio: float,
) -> StepResult:
    """`rates`: (bytes/s, FLOP/s) of the machine. The floor of a memory-bound step is the larger
    of its read and compute times; of the rest, its compute time."""
    step_s, model_s = timing.step_s, timing.model_s
    bytes_per_s, flops_per_s = rates
    memory_s, compute_s = work.bytes_read / bytes_per_s, work.flops / flops_per_s
    floor_s = max(memory_s, compute_s) if memory_bound else compute_s
    kind = "memory" if memory_bound and memory_s >= compute_s else "compute"
    ratio = step_s / floor_s
    overhead_s = step_s - model_s
    return StepResult(
        dtype, case, step_s * 1e3, model_s * 1e3, overhead_s * 1e3, overhead_s / step_s,
        floor_s * 1e3, kind, ratio, ratio <= goal_ratio,
        {phase: seconds * 1e3 for phase, seconds in timing.host_s.items()},
        None if timing.device_idle_s is None else timing.device_idle_s * 1e3,
    )  # fmt: skip


class ExpertUse:
    """A mixture of experts' use of its experts, step by step: the distinct experts its tokens
    picked, summed over the layers, and the time spent in the experts (a hook around each
    layer's Experts module; on a CPU the host's time is the work's). A step listener."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[tuple[int, float]] = []  # (experts read, seconds in the experts)
        self._read, self._seconds, self._started = 0, 0.0, 0.0
        for module in engine.core.runner.model.modules():
            if isinstance(module, Experts):
                module.register_forward_pre_hook(self._before)
                module.register_forward_hook(self._after)
        engine.step_listeners.append(self)

    def _before(self, module: Experts, args: tuple) -> None:
        self._read += int(torch.unique(args[1]).numel())  # args: (x, top_ids, top_weights)
        self._started = time.perf_counter()

    def _after(self, module: Experts, args: tuple, out: torch.Tensor) -> None:
        self._seconds += time.perf_counter() - self._started

    def __call__(self, summary: StepSummary) -> None:
        self.steps.append((self._read, self._seconds))
        self._read, self._seconds = 0, 0.0

    def median(self, last: int) -> tuple[float, float]:
        """Median (experts read, seconds in experts) over the last `last` steps."""
        recent = self.steps[-last:]
        return statistics.median(r for r, _ in recent), statistics.median(s for _, s in recent)


class ModelTime:
    """A step listener: the model's share of the latest step, from its summary."""

    def __init__(self, engine: LLMEngine) -> None:
        self.last_s = 0.0
        engine.step_listeners.append(self)

    def __call__(self, summary: StepSummary) -> None:
        self.last_s = summary.model_s


@dataclass(frozen=True)
class StepTiming:
    step_s: float  # median over the steps timed
    model_s: float  # median
    host_s: dict[str, float]  # each host phase's seconds a step, their mean (host_phases.py)
    # On a GPU, the device's idle time before each step (from the last one's end), their mean
    device_idle_s: float | None = None

    @staticmethod
    def median_of(timings: list[StepTiming]) -> StepTiming:
        idle = [t.device_idle_s for t in timings if t.device_idle_s is not None]
        return StepTiming(
            statistics.median(t.step_s for t in timings),
            statistics.median(t.model_s for t in timings),
            {phase: statistics.median(t.host_s[phase] for t in timings) for phase in PHASES},
            statistics.median(idle) if idle else None,
        )


def timed_steps(engine: LLMEngine, model_time: ModelTime, count: int) -> StepTiming:
    """`count` steps: their median step and model seconds, where the host's time went, and on a
    GPU how long the device waited for each."""
    runner = engine.core.runner
    gaps = isinstance(runner, ModelRunner) and runner.device.type == "cuda"
    idle_before = runner.device_idle_between_steps_s if gaps else 0.0
    steps, model = [], []
    with host_phases(engine) as host:
        for _ in range(count):
            started = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - started)
            model.append(model_time.last_s)
    idle = (runner.device_idle_between_steps_s - idle_before) / count if gaps else None
    host_s = {phase: host[phase] / count for phase in PHASES}
    return StepTiming(statistics.median(steps), statistics.median(model), host_s, idle)


def add_decoders(engine: LLMEngine, count: int, context: int, params: SamplingParams) -> list[str]:
    """`count` requests of `context` - 1 distinct prompt tokens each, to decode from."""
    vocab = engine.model_config.vocab_size  # a tiny dummy model's is 512 ids
    return [
        engine.add_request([(1000 + (7 * i + j) % 20000) % vocab for j in range(context - 1)], params)
        for i in range(count)
    ]


def _prefill_all(engine: LLMEngine) -> None:
    """Step until every request is decoding: no prompt waiting or half-computed."""
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(r.num_owed_tokens > 1 for r in scheduler.running):
        engine.step()


@contextmanager
def decoding(
    engine: LLMEngine, batch: int, context: int, num_steps: int, temperature: float = 0.0, top_p: float = 1.0
) -> Iterator[None]:
    """`batch` requests decoding ~`context` tokens in (prompts computed first, over as many steps
    as the engine's budget needs), with `num_steps` steps of theirs left to run, greedy unless
    `temperature` says otherwise; the engine left empty after."""
    warm_up_steps = -(-batch * context // engine.config.max_num_batched_tokens) + 1
    params = SamplingParams(
        max_tokens=warm_up_steps + num_steps + 2, temperature=temperature, top_p=top_p, ignore_eos=True
    )
    ids = add_decoders(engine, batch, context, params)
    _prefill_all(engine)
    try:
        yield
    finally:
        for request_id in ids:
            engine.abort_request(request_id)


def time_decode_steps(
    engine: LLMEngine,
    model_time: ModelTime,
    batch: int,
    context: int,
    num_steps: int,
    expert_use: ExpertUse | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> tuple[StepTiming, StepWork]:
    """Steps that decode `batch` requests ~`context` tokens in (`decoding`, sampled as
    `temperature` and `top_p` say). A mixture of experts' steps read the experts `expert_use` saw
    them pick."""
    with decoding(engine, batch, context, num_steps, temperature, top_p):
        contexts = [r.num_tokens + num_steps // 2 for r in engine.core.scheduler.running]
        timing = timed_steps(engine, model_time, num_steps)
    experts_read = expert_use.median(num_steps)[0] if expert_use is not None else 0.0
    work = step_work(engine, [(1, ctx) for ctx in contexts], num_sampled=batch, experts_read=experts_read)
    return timing, work


def time_mixed_steps(
    engine: LLMEngine, model_time: ModelTime, decodes: int, chunk: int, context: int, num_steps: int
) -> tuple[StepTiming, StepWork]:
    """Steps of `decodes` requests decoding (each ~`context` tokens in) beside a long prompt's
    `chunk`-token chunk, as the stall-free scheduler makes them when its budget is decodes +
    chunk (the engine's). Checks every timed step had that shape; leaves the engine empty. The
    long prompt fits the context, so a large chunk gets fewer than `num_steps` steps."""
    assert engine.config.max_model_len is not None  # resolved
    num_steps = min(num_steps, engine.config.max_model_len // chunk - 1)
    assert num_steps >= 1, f"a {chunk}-token chunk leaves no step in a {engine.config.max_model_len} context"
    scheduler = engine.core.scheduler
    summaries: list[StepSummary] = []
    engine.step_listeners.append(summaries.append)
    warm_up_steps = -(-decodes * context // chunk) + 1  # until every prompt is in
    params = SamplingParams(max_tokens=warm_up_steps + num_steps + 2, temperature=0, ignore_eos=True)
    ids = add_decoders(engine, decodes, context, params)
    _prefill_all(engine)
    contexts = [r.num_tokens + num_steps // 2 for r in scheduler.running]
    vocab = engine.model_config.vocab_size
    prompt = [(300 + (13 * j) % 20000) % vocab for j in range(chunk * (num_steps + 1))]
    ids.append(engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0)))
    summaries.clear()
    timing = timed_steps(engine, model_time, num_steps)
    engine.step_listeners.remove(summaries.append)
    shapes = {(s.num_decode_requests, s.num_prefill_tokens) for s in summaries}
    assert shapes == {(decodes, chunk)}, f"steps were not {decodes} decodes + {chunk}: {shapes}"
    rows = [(1, ctx) for ctx in contexts] + [(chunk, chunk * (num_steps // 2 + 1))]
    work = step_work(engine, rows, num_sampled=decodes)
    for request_id in ids:
        engine.abort_request(request_id)
    return timing, work
