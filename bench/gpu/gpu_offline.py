"""bench.gpu's offline throughput (part c, and the mixture's beside it): a ShareGPT-like workload
through LLM.generate, every request at once: prompt and output lengths drawn log-normally to
ShareGPT's means as vLLM's benchmark samples it, prompts as token ids (dummy weights have no
tokenizer)."""

from __future__ import annotations

import gc
import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from bench.driver import Arrival
from bench.engine.host_phases import PHASES, host_phases
from common.model_shapes import dummy_config_dict
from replica_engine import LLM, SamplingParams
from replica_engine.model_runner import ModelRunner
from replica_engine.scheduler.plan import StepSummary

SHAREGPT_MEAN_TOKENS = (230, 200)  # prompt, output
LOGNORMAL_SIGMA = (1.0, 0.9)


def sharegpt_like(count: int, max_len: int, vocab_size: int, seed: int = 0) -> list[Arrival]:
    """Prompt and output lengths log-normal around ShareGPT's means, capped; prompts are token ids."""
    rng = random.Random(seed)

    def length(mean: int, sigma: float) -> int:
        mu = math.log(mean) - sigma**2 / 2  # the log-normal whose mean is `mean`
        return max(4, min(max_len, round(rng.lognormvariate(mu, sigma))))

    arrivals = []
    for _ in range(count):
        prompt_len = length(SHAREGPT_MEAN_TOKENS[0], LOGNORMAL_SIGMA[0])
        output_len = length(SHAREGPT_MEAN_TOKENS[1], LOGNORMAL_SIGMA[1])
        arrivals.append(Arrival(0.0, [rng.randrange(vocab_size) for _ in range(prompt_len)], output_len))
    return arrivals


def vocab_size(model: str) -> int:
    return dummy_config_dict(model.removeprefix("dummy:"))["vocab_size"]


ENGINE = {"dtype": "bfloat16", "attention_backend": "triton"}  # the offline runs' own settings


# vLLM's sizes on a GPU of 70 GB or more but an A100, its LLM class's (the anchor ran with them):
# 4x the requests at once and twice the token budget of ours (GPU_DEFAULTS)
VLLM_H100_SIZES = {"max_num_seqs": 1024, "max_num_batched_tokens": 16384}


def offline(model: str, device: str, num_requests: int, max_len: int, settings: dict | None = None) -> dict:
    """The workload eagerly and with decode steps from CUDA graphs, both with async scheduling
    (the GPU's default), with graphs in synchronous steps (what async scheduling gives), and
    with graphs at vLLM's H100 sizes (`graphs_1024`: what a wider batch gives). `settings` over
    ENGINE; with another attention backend (a CPU rehearsal: graphs need Triton's), eagerly with
    and without async scheduling."""
    graphs = {**ENGINE, **(settings or {})}["attention_backend"] == "triton"
    runs = (
        {
            "eager": (False, True, {}),
            "graphs": (True, True, {}),
            "graphs_sync": (True, False, {}),
            "graphs_1024": (True, True, VLLM_H100_SIZES),
        }
        if graphs
        else {"eager": (False, True, {}), "eager_sync": (False, False, {})}
    )
    return {
        name: offline_run(model, device, num_requests, max_len, graphs, ahead, {**(settings or {}), **sizes})
        for name, (graphs, ahead, sizes) in runs.items()
    }


@dataclass(frozen=True)
class WorkloadRun:
    """The ShareGPT-like workload through an LLM, timed: what the offline figures are made of."""

    arrivals: list[Arrival]
    summaries: list[StepSummary]  # every step's
    wall_s: float
    output_tokens: int
    gc_pause_s: float  # the garbage collector's time during the run (the whole process's)
    host_phases_s: dict[str, float]  # the step thread's seconds in each phase (host_phases.py)

    @property
    def model_s(self) -> float:
        """The steps' model (device) time, summed."""
        return sum(s.model_s for s in self.summaries)

    @property
    def mean_decodes_per_step(self) -> float:
        return sum(s.shape.num_decodes for s in self.summaries) / max(1, len(self.summaries))


def run_workload(llm: LLM, model: str, num_requests: int, max_len: int) -> WorkloadRun:
    """Every request at once through `llm.generate`; checks each got all its tokens."""
    arrivals = sharegpt_like(num_requests, max_len, vocab_size(model))
    params = [SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True) for a in arrivals]
    summaries: list[StepSummary] = []
    llm.engine.step_listeners.append(summaries.append)
    started = time.perf_counter()
    with collector_pauses() as gc_pauses, host_phases(llm.engine) as host:
        outputs = llm.generate([a.prompt for a in arrivals], params)
    wall_s = time.perf_counter() - started
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert output_tokens == sum(a.max_tokens for a in arrivals), "a request stopped short"
    phases = {phase: host[phase] for phase in PHASES}
    return WorkloadRun(arrivals, summaries, wall_s, output_tokens, sum(gc_pauses), phases)


def offline_run(
    model: str,
    device: str,
    num_requests: int,
    max_len: int,
    cuda_graphs: bool,
    async_scheduling: bool,
    settings: dict | None = None,
) -> dict:
    engine = {**ENGINE, "cuda_graphs": cuda_graphs, "async_scheduling": async_scheduling, **(settings or {})}
    llm = LLM(model=model, device=device, **engine)
    runner = llm.engine.core.runner
    assert isinstance(runner, ModelRunner)  # one process, no parallel workers
    runner.count_device_idle_afresh()
    run = run_workload(llm, model, num_requests, max_len)
    summaries, wall_s = run.summaries, run.wall_s
    decode_only = [s for s in summaries if s.shape.num_prefill_tokens == 0]
    model_s = run.model_s
    return {
        "requests": len(run.arrivals),
        "prompt_tokens": sum(len(a.prompt) for a in run.arrivals),
        "output_tokens": run.output_tokens,
        "wall_s": wall_s,
        "output_tok_per_s": run.output_tokens / wall_s,
        "budget": llm.engine.config.max_num_batched_tokens,
        "max_num_seqs": llm.engine.config.max_num_seqs,
        # where the time went: steps, the model's share, decode-only steps (the ones graphs replay)
        "steps": len(summaries),
        "model_s": model_s,
        # the host's side of each step (under async scheduling it overlaps the device's work)
        "overhead_s": sum(s.overhead_s for s in summaries),
        # what the host costs the device: the wall time in which it ran no step of the model
        "device_idle_s": wall_s - model_s,
        "device_idle_share": 1 - model_s / wall_s,
        # of it, between steps: waiting for the host to submit the next (None on a CPU); the
        # rest is before the first step and after the last
        "device_idle_between_steps_s": runner.device_idle_between_steps_s if device == "cuda" else None,
        # of the host's time, in the garbage collector (the whole process's: it stops the step loop)
        "gc_pause_s": run.gc_pause_s,
        # the step thread's seconds in each phase of the steps (bench/engine/host_phases.py)
        "host_phases_s": run.host_phases_s,
        "decode_only_steps": len(decode_only),
        "decode_only_s": sum(s.duration_s for s in decode_only),
        "mean_decodes_per_step": run.mean_decodes_per_step,
    }


@contextmanager
def collector_pauses() -> Iterator[list[float]]:
    """The garbage collector's pauses while the block runs, each in seconds."""
    pauses: list[float] = []
    started = 0.0

    def timed(phase: str, _info: dict) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started)

    gc.callbacks.append(timed)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(timed)
