"""Tensor and pipeline parallelism on the CPU: worker processes joined over torch.distributed's
gloo backend (the NCCL path on a GPU is the same code; only one GPU is ever lent here, so it is
untested). A tensor-parallel worker holds its share of the heads, the MLP and the vocabulary; a
pipeline stage its run of layers. The engine core samples from the last worker's logits. The
oracle is the same model unsplit."""

from __future__ import annotations

import os
import signal

import pytest

from common.errors import InvalidRequestError
from replica_engine import LLM, SamplingParams
from replica_engine.errors import StepFailedError
from replica_engine.parallel.executor import WorkerDiedError
from replica_engine.parallel.pipeline_parallel import stage_layers
from replica_engine.scheduler.plan import ScheduledBatch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
LOGPROB_TOLERANCE = 1e-4  # float32, partial sums added in another order


def assert_same_up_to_near_ties(split, whole) -> None:
    """Token ids identical, each token's logprob within the tolerance; where they differ, the
    whole model's top two must be within the tolerance of each other (a near-tie)."""
    for ours, theirs in zip(split, whole, strict=True):
        for mine, reference in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=False):
            if mine.token_id != reference.token_id:
                (_, best), (_, second) = reference.top[:2]
                assert best - second <= LOGPROB_TOLERANCE, (
                    ours.outputs[0].token_ids,
                    theirs.outputs[0].token_ids,
                )
                break
            assert abs(mine.logprob - reference.logprob) <= LOGPROB_TOLERANCE


def test_three_workers_answer_as_one_model_with_chunked_prompts_and_preemption(exact_llm):
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2, prompt_logprobs=1)
    whole = exact_llm.generate(PROMPTS, params)
    # An 8-token budget chunks every prompt; 5 blocks of 16 tokens for 3 requests preempts.
    split_llm = LLM(dtype="float32", tensor_parallel_size=3, max_num_batched_tokens=8, num_kv_blocks=5)
    split = split_llm.generate(PROMPTS, params)
    assert_same_up_to_near_ties(split, whole)
    for ours, theirs in zip(split, whole, strict=True):
        assert ours.prompt_logprobs is not None and theirs.prompt_logprobs is not None
        for mine, reference in zip(ours.prompt_logprobs, theirs.prompt_logprobs, strict=True):
            assert abs(mine.logprob - reference.logprob) <= LOGPROB_TOLERANCE
    stats = split_llm.engine.stats()
    assert stats.num_preemptions > 0
    manager = split_llm.engine.core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks  # nothing held after


def test_qwen3_shape_on_two_workers_matches_one():
    """q/k norms and a 16/8-head split, with random weights of Qwen3-0.6B's real shape."""
    settings = dict(model="dummy:qwen3-0.6b", dtype="float32", kv_cache_bytes=32 << 20, max_model_len=512)
    prompts = [[11, 2000 + i, 31, 400 * i + 7, 5] for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    whole = LLM(**settings).generate(prompts, params)
    split = LLM(**settings, tensor_parallel_size=2).generate(prompts, params)
    assert_same_up_to_near_ties(split, whole)


@pytest.fixture(scope="module")
def staged_llm() -> LLM:
    """Two stages. A 16-token budget chunks every prompt; 4 blocks of 16 tokens for 3 requests
    preempts."""
    return LLM(
        dtype="float32",
        quantization="none",
        pipeline_parallel_size=2,
        max_num_batched_tokens=16,
        num_kv_blocks=4,
    )


def test_two_pipeline_stages_answer_as_one_model_with_chunked_prompts_and_preemption(exact_llm, staged_llm):
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2)
    whole = exact_llm.generate(PROMPTS, params)
    staged = staged_llm.generate(PROMPTS, params)
    assert_same_up_to_near_ties(staged, whole)  # chunks change the order of attention's sums
    assert staged_llm.engine.stats().num_preemptions > 0
    manager = staged_llm.engine.core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_two_pipeline_stages_embed_as_one_model(exact_llm, staged_llm):
    """The last stage pools; its chunks' parts come back with the step, as logits do."""
    for staged, whole in zip(staged_llm.embed(PROMPTS), exact_llm.embed(PROMPTS), strict=True):
        assert max(abs(a - b) for a, b in zip(staged.embedding, whole.embedding, strict=True)) <= 1e-4


def test_two_batches_are_in_the_pipeline_at_once_and_an_abort_there_loses_nothing(exact_llm, staged_llm):
    engine, core = staged_llm.engine, staged_llm.engine.core
    params = SamplingParams(max_tokens=3, temperature=0)
    busy_before = core.runner.stage_busy_s()
    first = engine.add_request(PROMPTS[0], params)
    assert engine.step() == []  # submitted; the pipeline has room for another batch
    second = engine.add_request(PROMPTS[1], params)
    # The second batch holds only the new request (the first is in the pipeline); with the
    # pipeline full, the first batch is collected.
    assert [output.request_id for output in engine.step()] == [first]
    assert core.scheduler.in_flight == {second}
    assert [output.request_id for output in engine.step()] == [second]  # first's decode went in
    assert core.scheduler.in_flight == {first}
    assert engine.abort_request(first) is not None  # while its decode is in the pipeline
    while engine.has_unfinished_requests():
        outputs = engine.step()
        assert first not in {output.request_id for output in outputs}
    manager = core.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks and not core.scheduler.in_flight
    # Nothing of the aborted request is left behind in the stages: the same prompt again
    # answers as the whole model does.
    again = staged_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, logprobs=2))
    assert_same_up_to_near_ties(
        again, exact_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, logprobs=2))
    )
    busy_after = core.runner.stage_busy_s()
    assert len(busy_after) == 2
    assert all(after > before for after, before in zip(busy_after, busy_before, strict=True))


def test_layers_are_split_in_contiguous_runs_as_even_as_can_be():
    assert [len(run) for run in stage_layers(30, 4)] == [8, 8, 7, 7]
    assert [run.start for run in stage_layers(30, 4)] == [0, 8, 16, 23]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tensor_parallel_size": 2}, r"tensor_parallel_size: 2 does not divide the model's 9 query heads"),
        ({"pipeline_parallel_size": 31}, r"pipeline_parallel_size: 31 stages for the model's 30 layers"),
        (
            {"tensor_parallel_size": 3, "pipeline_parallel_size": 2},
            r"pipeline_parallel_size: not yet combined",
        ),
        ({"pipeline_parallel_size": 2, "cuda_graphs": True}, r"cuda_graphs: not captured across"),
    ],
)
def test_layouts_the_model_cannot_take_are_refused_by_name(settings, message):
    with pytest.raises(InvalidRequestError, match=message):
        LLM(dtype="float32", **settings)


@pytest.mark.parametrize(
    "layout",
    [{"model": "dummy:tiny-llama"}, {"model": "dummy:tiny-moe", "enable_expert_parallel": True}],
    ids=["tensor_parallel", "expert_parallel"],
)
def test_a_dead_worker_fails_the_request_and_no_one_hangs(layout):
    split_llm = LLM(dtype="float32", kv_cache_bytes=4 << 20, tensor_parallel_size=2, **layout)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert len(split_llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids) == 4
    executor = split_llm.engine.core.runner
    worker = executor._workers[1].process
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    for _ in range(2):  # and each later step at once: the survivor's replies are out of step
        with pytest.raises(StepFailedError):
            split_llm.generate([[1, 2, 3]], params)
    with pytest.raises(WorkerDiedError, match="worker 1 exited"):
        executor.execute(ScheduledBatch(()))
    processes = [link.process for link in executor._workers]
    executor.close()  # the survivor, stuck in a collective with the dead one, is stopped
    assert all(process.poll() is not None for process in processes)
