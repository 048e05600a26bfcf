"""Prefill/decode disaggregation through Ray Serve on the real cluster, asked with the official
`openai` client: a PrefillReplica computes the prompt, its KV blocks move (shared memory, then
Ray's object store) to a DecodeReplica, which adopts them (the answer's `cached_tokens` counts
them) and answers as the colocated engine does (greedy, up to near-ties against transformers).
Requests cancelled at every point of their way (prefill, transfer, decode) leave no KV block
held in either deployment, and no published blocks behind once their TTL is out. The real
SmolLM2, fp32."""

from __future__ import annotations

import glob
import os
import time

import httpx
import openai
import pytest
from ray import serve

from deployments.app import AppArgs, build_app
from deployments.kv_connectors import SWEEP_EVERY_S, _shm_root
from harness.hf_reference import assert_matches_up_to_ties
from harness.replicas import STATS_TIMEOUT_S
from harness.serve_cluster import REPORT_WAIT_S, ServeCluster, delete_app, wait_for
from tests.engine.test_engine_integrity import story_ids

BLOCK = 16


def _stats(app: str, deployment: str):
    handle = serve.get_deployment_handle(deployment, app_name=app)
    return handle.stats.remote().result(timeout_s=STATS_TIMEOUT_S)


def _idle(app: str) -> bool:
    """No block held by a request in either deployment."""
    for deployment in ("PrefillReplica", "DecodeReplica"):
        stats = _stats(app, deployment)
        if stats.num_free_blocks != stats.num_total_blocks or stats.num_waiting or stats.num_running:
            return False
    return True


def _none_published() -> bool:
    return not glob.glob(os.path.join(_shm_root(), "stallfree-kv-*", "*"))


# Blocks published for a request cancelled before its decode replica fetched them wait this long
# (then the next sweep, every SWEEP_EVERY_S): well within wait_for's deadline, and long enough for
# a decode replica on a loaded host to fetch what it was sent.
KV_TTL_S = 15.0
assert KV_TTL_S + SWEEP_EVERY_S < REPORT_WAIT_S


@pytest.mark.parametrize("kv_connector", ["auto", "object_store"])
def test_prefill_and_decode_deployments_answer_as_colocated_and_hold_nothing_after_cancels(
    serve_cluster: ServeCluster, kv_connector, exact_llm, tokenizer, hf_model
):
    app = f"pd-{kv_connector.replace('_', '-')}"
    args = AppArgs(
        num_cpus=0,  # the 2-core test cluster has no CPU left to reserve
        engine={
            "dtype": "float32",
            "quantization": "none",
            "max_model_len": 1024,
            "kv_cache_bytes": 64 << 20,
        },
        disaggregation={"kv_connector": kv_connector, "kv_ttl_s": KV_TTL_S},
    )
    serve.run(build_app(args), name=app, route_prefix=f"/{app}")
    try:
        base_url = f"{serve_cluster.base_url}/{app}/v1"
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        for length in (300, 161):
            prompt = story_ids(tokenizer, length, offset=length // 7)
            completion = client.completions.create(
                model=client.models.list().data[0].id,
                prompt=prompt,
                max_tokens=12,
                temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            # The decode replica adopted the prompt's full blocks: it computed only the rest.
            assert completion.usage.prompt_tokens_details.cached_tokens == (length - 1) // BLOCK * BLOCK
            (offline,) = exact_llm.generate([prompt], _greedy(12))
            assert_matches_up_to_ties(
                hf_model, prompt, completion.choices[0].token_ids, offline.outputs[0].token_ids, app
            )
        wait_for(lambda: _idle(app), "both pools free after the answers")
        wait_for(_none_published, "no published blocks left after the answers (each fetched)")

        # Cancels: streams dropped 0.05 to 2 s after they were sent, on their way through
        # prefill, transfer and decode (before the first token: the read timing out).
        for index, delay_s in enumerate((0.05, 0.15, 0.3, 0.6, 1.0, 2.0)):
            _cancel_after(f"{base_url}/completions", story_ids(tokenizer, 600, offset=index), delay_s)
        prompt = story_ids(tokenizer, 200)
        wait_for(lambda: _idle(app), "both pools free after the cancels")
        wait_for(_none_published, "no published blocks left after the cancels (fetched or expired)")
        # And it still answers.
        again = client.completions.create(model=completion.model, prompt=prompt, max_tokens=4)
        assert again.choices[0].finish_reason == "length"
    finally:
        delete_app(app)


def _cancel_after(url: str, prompt: list[int], delay_s: float) -> None:
    """A streamed request whose client leaves `delay_s` after sending it."""
    body = {"prompt": prompt, "max_tokens": 200, "stream": True, "ignore_eos": True}
    started = time.monotonic()
    try:
        with (
            httpx.Client(timeout=httpx.Timeout(30, read=delay_s)) as http,
            http.stream("POST", url, json=body) as reply,
        ):
            for _ in reply.iter_lines():
                if time.monotonic() - started >= delay_s:
                    return
    except httpx.ReadTimeout:
        return


def _greedy(max_tokens: int):
    from common.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
