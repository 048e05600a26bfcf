"""The KV-pressure router and autoscaling on the real Ray cluster, with CPU replicas of the real
model whose KV pools are small enough for placement to matter."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
import time

import httpx
import pytest
from ray import serve

from deployments.app import AppArgs, build_app
from harness.metrics_scrape import ENGINE_PREFIX, MetricsPage, scrape, scrape_by_replica, settled
from harness.replicas import replica_actor_names, replica_pid, wait_replaced
from harness.serve_cluster import ServeCluster, delete_app, wait_for
from harness.sse_client import StreamResult, client_session, stream_completion
from replica_engine import SamplingParams

LONG_PROMPT = "Summarise the history of the Roman Empire in detail. " * 12  # ~130 tokens
SHORT_PROMPT = "Say hello."
# Deadlines on state, sized for a 2-core machine under full load: on an idle one a replica starts
# and the autoscaler acts within ~20 s, and the streams below end within ~10 s.
SCALING_DEADLINE_S = 300
HANG_S = 300


def deploy(name: str, args: AppArgs) -> None:
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")


def routed_by_replica(cluster: ServeCluster, app: str) -> dict[str, float]:
    routed = f"{ENGINE_PREFIX}router_requests_routed_total"
    return MetricsPage(cluster).by_replica(routed, {"application": app}, per="target_replica")


def prompt_tokens_by_replica(cluster: ServeCluster) -> dict[str, float]:
    return scrape_by_replica(cluster, f"{ENGINE_PREFIX}prompt_tokens_total", {"application": "fleet"})


@pytest.fixture(scope="module")
def fleet(serve_cluster: ServeCluster) -> str:
    """Two replicas, 24 KV blocks each (384 tokens): two long requests (~12 blocks each) fit on
    one replica only by preempting."""
    args = AppArgs(
        num_replicas=2,
        num_cpus=0,
        cpu_threads=1,
        engine={"num_kv_blocks": 24, "max_model_len": 384, "max_num_batched_tokens": 256, "dtype": "float32"},
    )
    deploy("fleet", args)
    yield f"{serve_cluster.base_url}/fleet"
    delete_app("fleet")


def post_staggered(url: str, bodies: list[dict], gap_s: float) -> list[httpx.Response]:
    """Send each body on its own thread, `gap_s` apart (arrivals over time, as in real traffic)."""
    responses: list[httpx.Response | None] = [None] * len(bodies)

    def send(i: int) -> None:
        responses[i] = httpx.post(url, json=bodies[i], timeout=300)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
        time.sleep(gap_s)
    for thread in threads:
        thread.join()
    return responses  # type: ignore[return-value]


def test_skewed_load_spreads_without_preemption(serve_cluster: ServeCluster, fleet: str):
    long = {"prompt": LONG_PROMPT, "max_tokens": 48, "ignore_eos": True}
    short = {"prompt": SHORT_PROMPT, "max_tokens": 16, "ignore_eos": True}
    bodies = [long, short, long, short, short, short]
    responses = post_staggered(f"{fleet}/v1/completions", bodies, gap_s=0.3)
    assert [r.status_code for r in responses] == [200] * len(bodies)
    wait_for(
        lambda: sum(routed_by_replica(serve_cluster, "fleet").values()) >= len(bodies), "routing counted"
    )
    routed = routed_by_replica(serve_cluster, "fleet")
    assert len(routed) == 2, f"one replica idled: {routed}"
    preemptions = scrape(serve_cluster, "ray_stallfree_num_preemptions_total", {"application": "fleet"})
    assert preemptions == 0


def test_router_steers_away_from_a_loaded_replica(serve_cluster: ServeCluster, fleet: str):
    url, short = f"{fleet}/v1/completions", {"prompt": SHORT_PROMPT, "max_tokens": 4}
    # The Ingress asks a replica its KV pool size on its first request (a routed call of its own):
    # one request first, so the counts below are the test's requests only.
    assert httpx.post(url, json=short, timeout=HANG_S).status_code == 200
    before = settled(lambda: routed_by_replica(serve_cluster, "fleet"))
    prompts_before = settled(lambda: prompt_tokens_by_replica(serve_cluster))
    # One long, slow request pins a replica: up to 22 blocks of its 24 while it decodes. It streams, so
    # its first token says it runs; the shorts go at once (a metrics scrape could come seconds
    # later, on a loaded host after it ended: CI saw that).
    hog = StreamResult(status=0)
    hog_body = {"prompt": LONG_PROMPT, "max_tokens": 220, "ignore_eos": True}

    async def stream_hog() -> None:
        async with client_session(HANG_S) as http:
            await stream_completion(http, url, hog_body, result=hog)

    hog_thread = threading.Thread(target=asyncio.run, args=(stream_hog(),))
    hog_thread.start()
    # The app's one Ingress routed the hog: its router counts the hog's blocks from the send on,
    # until a report received REPORT_LAG_S after it (so taken after it) shows them; replicas report
    # every 0.5 s, passed on by Serve's controller once a loop (0.5 s in these clusters). The
    # shorts go once the hog has run 80 steps (~1.2 s on an idle host, longer on a loaded one),
    # with 140 of its steps still to come.
    wait_for(lambda: len(hog.chunk_times) >= 80 or hog.done_at is not None, "the long request's 80th token")
    for _ in range(6):
        assert httpx.post(url, json=short, timeout=HANG_S).status_code == 200
    hog_thread.join()
    assert hog.status == 200 and hog.completion_tokens == 220, hog
    after = settled(lambda: routed_by_replica(serve_cluster, "fleet"))
    assert sum(after.values()) - sum(before.values()) == 7, (before, after)
    # The long prompt's replica: the most prompt tokens since (shorts are a few tokens each).
    prompts = settled(lambda: prompt_tokens_by_replica(serve_cluster))
    hog_replica = max(prompts, key=lambda replica: prompts[replica] - prompts_before.get(replica, 0))
    shorts_on_hog = after.get(hog_replica, 0) - before.get(hog_replica, 0) - 1
    assert shorts_on_hog == 0, f"{shorts_on_hog} of 6 short requests went to the loaded replica"


def replica_count(app: str) -> int:
    deployment = serve.status().applications[app].deployments["EngineReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def wait_for_replica_count(app: str, count: int, why: str) -> None:
    deadline = time.monotonic() + SCALING_DEADLINE_S
    while replica_count(app) != count:
        assert time.monotonic() < deadline, f"not {count} replicas {why}: {replica_count(app)}"
        time.sleep(1)


def autoscaled(**settings) -> AppArgs:
    """1 to 2 replicas, scaling on a 2 s look-back after 2 s (up) or 5 s (down)."""
    autoscaling_config = {
        "min_replicas": 1,
        "max_replicas": 2,
        "upscale_delay_s": 2,
        "downscale_delay_s": 5,
        "look_back_period_s": 2,
        "metrics_interval_s": 0.5,
    }
    return AppArgs(
        num_replicas="auto", num_cpus=0, cpu_threads=1, autoscaling_config=autoscaling_config, **settings
    )


def load_until_two_replicas(app: str, url: str, body: dict) -> set[int]:
    """One request after another until Serve runs 2 replicas; their HTTP statuses."""
    scaled_up, statuses = threading.Event(), set()

    def send() -> None:
        while not scaled_up.is_set():
            statuses.add(httpx.post(url, json=body, timeout=600).status_code)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        wait_for_replica_count(app, 2, "under load")
    finally:
        scaled_up.set()
        sender.join()
    return statuses


def test_kv_pressure_scales_up_under_load_and_back_down_when_idle(serve_cluster: ServeCluster):
    """~9 to 21 of 24 blocks held, one request after another: usage 0.4-0.9 against a target of
    0.3, however fast a request runs."""
    args = autoscaled(
        target_kv_cache_usage=0.3,
        target_waiting_requests=8,
        engine={"num_kv_blocks": 24, "max_model_len": 384, "dtype": "float32"},
    )
    deploy("autoscale", args)
    try:
        assert replica_count("autoscale") == 1
        url = f"{serve_cluster.base_url}/autoscale/v1/completions"
        load_until_two_replicas(
            "autoscale", url, {"prompt": LONG_PROMPT, "max_tokens": 200, "ignore_eos": True}
        )
        wait_for_replica_count("autoscale", 1, "when idle")
    finally:
        delete_app("autoscale")


def test_the_load_the_replicas_report_scales_up_and_back_down(serve_cluster: ServeCluster):
    """The rates each replica reports (requests added and finished, step work) reach the policy:
    one short request at a time, against a `target_utilization` far below any real load, asks
    for the maximum, where queue depth and ongoing requests (1 against a target of 4) say 1.
    `dummy:tiny-llama` replicas: what the load is made of does not matter here."""
    deploy("autoscale-rates", autoscaled(model="dummy:tiny-llama", target_utilization=0.001))
    try:
        assert replica_count("autoscale-rates") == 1
        url = f"{serve_cluster.base_url}/autoscale-rates/v1/completions"
        statuses = load_until_two_replicas("autoscale-rates", url, {"prompt": [7] * 20, "max_tokens": 8})
        assert statuses == {200}, statuses
        wait_for_replica_count("autoscale-rates", 1, "when idle")  # the rates fall to 0
    finally:
        delete_app("autoscale-rates")


def test_killing_a_replica_mid_load_fails_only_its_requests_and_serve_replaces_it(
    serve_cluster: ServeCluster, fleet: str, llm
):
    # One request per replica, each as long as a replica's whole KV pool holds (the router sends
    # the second to the other replica): the kill must land while the victim's request still runs,
    # and on a loaded host the client's streams lagged the replicas by most of 100 tokens (make
    # test saw the victim's requests end before the kill when 6 requests of 100 tokens ran).
    prompts, tokens = ["1, 2, 3,", "11, 12, 13,"], 360
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
    url = f"{fleet}/v1/completions"
    bodies = [{"prompt": p, "max_tokens": tokens, "temperature": 0, "ignore_eos": True} for p in prompts]

    victim = replica_actor_names("fleet")[0]
    # Looked up now: the kill below must land at once, and a lookup can take seconds on a loaded
    # host. Its process is killed, as a crash would (ray.kill would go through the GCS first).
    victim_pid = replica_pid(victim)
    # The Ingress asks a replica its KV pool size on its first request (a routed call of its own):
    # one request first, so the counts below are the two requests' only.
    assert httpx.post(url, json={"prompt": SHORT_PROMPT, "max_tokens": 4}, timeout=HANG_S).status_code == 200
    routed_before = settled(lambda: routed_by_replica(serve_cluster, "fleet"))

    async def load_then_kill() -> list[StreamResult]:
        progress = [StreamResult(status=0) for _ in bodies]
        async with client_session(120) as http:
            streams = [
                asyncio.create_task(stream_completion(http, url, body, result=result))
                for body, result in zip(bodies, progress, strict=True)
            ]
            # Every stream has its first token: both run, one on each replica. Killed at
            # once, not after a metrics report: on a loaded host a report can come after the
            # requests have ended.
            deadline = time.monotonic() + HANG_S
            while not all(result.chunk_times for result in progress):
                assert time.monotonic() < deadline and not any(s.done() for s in streams), progress
                await asyncio.sleep(0.01)
            os.kill(victim_pid, signal.SIGKILL)
            # Bounded: a request on the dead replica must end, not hang (a hang detector).
            return await asyncio.wait_for(asyncio.gather(*streams), timeout=HANG_S)

    results = asyncio.run(load_then_kill())
    routed_after = settled(lambda: routed_by_replica(serve_cluster, "fleet"))
    routed = {name: routed_after[name] - routed_before.get(name, 0) for name in routed_after}
    assert sorted(routed.values()) == [1, 1], (routed_before, routed_after)
    failed = [r for r in results if r.error_code is not None]
    survivors = [(r, text) for r, text in zip(results, expected, strict=True) if r.error_code is None]
    assert len(failed) == len(survivors) == 1, [(r.error_code, len(r.chunk_times)) for r in results]
    # In flight on the dead replica: a clear error in the stream (headers were already sent).
    assert {(r.status, r.error_code) for r in failed} == {(200, "replica_failed")}
    for result, text in survivors:  # on the other replica: untouched, token for token
        assert result.text == text and result.completion_tokens == tokens
    # New requests succeed (on the survivor), and Serve starts a replacement.
    after = httpx.post(url, json=bodies[0], timeout=120)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected[0]
    assert math.isfinite(wait_replaced("fleet", victim, num_replicas=2)), "not replaced"
