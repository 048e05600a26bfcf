"""The kv_prefix router on the real Ray cluster: two CPU replicas of the real SmolLM2, tenants
with long system prompts, the official `openai` client. The pure parts are tested without Ray
in test_prefix_router.py."""

from __future__ import annotations

import concurrent.futures
import math
import time
from pathlib import Path

import openai
import pytest
import ray
from ray import serve
from ray.util.state import list_actors

from deployments.app import AppArgs, build_app
from harness.metrics_scrape import scrape, scrape_by_replica
from harness.replicas import replica_actor_names, wait_replaced
from harness.serve_cluster import ServeCluster, delete_app, wait_for

APP = "prefix"
HITS = "ray_stallfree_prefix_cache_hits_total"


def system_prompt(company: str) -> str:
    facts = " ".join(
        f"Rule {i}: {company} answers question kind {i} politely and briefly." for i in range(30)
    )
    return f"You are the assistant of {company}. {facts}"  # ~420 tokens


TENANTS = {name: system_prompt(name) for name in ("Acme Rockets", "Zephyr Tea")}


@pytest.fixture(scope="module")
def client(serve_cluster: ServeCluster) -> openai.OpenAI:
    """Two replicas of 96 KV blocks (1,536 tokens) each, routed by kv_prefix (the default)."""
    args = AppArgs(
        num_replicas=2, num_cpus=0, cpu_threads=1, engine={"num_kv_blocks": 96, "max_model_len": 1536}
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield openai.OpenAI(base_url=f"{serve_cluster.base_url}/{APP}/v1", api_key="unused", max_retries=0)
    delete_app(APP)


def ask(client: openai.OpenAI, messages: list[dict]) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached prompt tokens)."""
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=8, temperature=0
    )
    usage = reply.usage
    return (
        reply.choices[0].message.content or "",
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
    )


def test_two_busy_tenants_settle_on_different_replicas_and_keep_their_hits(
    serve_cluster: ServeCluster, client: openai.OpenAI
):
    """First in the module, so both replicas start empty. Each tenant's first request computes
    its system prompt somewhere; once the replicas have reported it (every 0.5 s), the second
    tenant's (both replicas idle: they price alike) goes where less idle cached content would be
    crowded out: the other replica. Then a burst of both tenants at once goes to the two holders
    and finds the prompts there, the load guard never having a reason to move it (6 requests each
    side)."""
    before = scrape_by_replica(serve_cluster, HITS, {"application": APP})
    for system in TENANTS.values():
        ask(client, [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}])
        time.sleep(2.0)  # four report periods: the router sees the prompt cached where it ran
    questions = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Is {i} a lucky number?"}]
        for i in range(6)
        for system in TENANTS.values()
    ]
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        results = list(pool.map(lambda m: ask(client, m), questions))
    system_blocks_tokens = 400 // 16 * 16
    assert all(cached >= system_blocks_tokens for _, _, cached in results), results
    wait_for(
        lambda: (
            scrape(serve_cluster, HITS, {"application": APP}) - sum(before.values())
            >= sum(cached for _, _, cached in results)
        ),
        "hits reported",
    )
    after = scrape_by_replica(serve_cluster, HITS, {"application": APP})
    hits = {replica: after[replica] - before.get(replica, 0) for replica in after}
    assert len([h for h in hits.values() if h >= 6 * system_blocks_tokens]) == 2, hits


def test_a_conversations_turns_land_on_the_replica_that_holds_its_history(client: openai.OpenAI):
    for tenant, system in TENANTS.items():
        messages = [{"role": "system", "content": system}]
        previous_prompt_tokens = 0
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn} for {tenant}?"})
            answer, prompt_tokens, cached = ask(client, messages)
            if turn:  # the previous turn's prompt is this one's prefix: its full blocks are found
                assert cached >= previous_prompt_tokens // 16 * 16, (tenant, turn, cached)
            messages.append({"role": "assistant", "content": answer})
            previous_prompt_tokens = prompt_tokens


def test_a_restarted_replica_loses_its_cache_and_the_tenant_settles_again(
    serve_cluster: ServeCluster, client: openai.OpenAI
):
    system = TENANTS["Acme Rockets"]
    tenant_request = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    before = scrape_by_replica(serve_cluster, HITS, {"application": APP})
    _, _, cached = ask(client, tenant_request)
    assert cached > 0
    wait_for(
        lambda: scrape(serve_cluster, HITS, {"application": APP}) - sum(before.values()) >= cached, "hit"
    )
    after = scrape_by_replica(serve_cluster, HITS, {"application": APP})
    holder = max(after, key=lambda replica: after[replica] - before.get(replica, 0))
    victim = next(name for name in replica_actor_names(APP) if name.endswith(f"#{holder}"))
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    assert math.isfinite(wait_replaced(APP, victim, num_replicas=2)), "not replaced"
    # The holder's cache is gone with it: the router must not keep steering by it (the other
    # replica may hold the tenant too, after the load guard spread it), and once a request has
    # computed the prompt again the next ones find it.
    results = [
        ask(client, [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}])
        for i in range(4)
    ]
    assert all(cached >= 400 // 16 * 16 for _, _, cached in results[1:]), results


def test_the_ingress_process_never_loads_torch(serve_cluster: ServeCluster, client: openai.OpenAI):
    ingresses = list_actors(
        filters=[("class_name", "=", f"ServeReplica:{APP}:Ingress"), ("state", "=", "ALIVE")]
    )
    assert ingresses
    for actor in ingresses:
        # the right process: Ray titles an actor's worker after its class, and this Ingress has
        # tokenized the requests above (the `tokenizers` extension is mapped)
        assert "Ingress" in Path(f"/proc/{actor.pid}/cmdline").read_text()
        maps = Path(f"/proc/{actor.pid}/maps").read_text()
        assert "tokenizers" in maps
        assert "libtorch" not in maps


def test_rays_prefix_cache_affinity_router_is_selectable_and_serves(serve_cluster: ServeCluster):
    """The baseline runs unchanged on our request messages (it reads their `prompt` text)."""
    args = AppArgs(
        num_cpus=0, cpu_threads=1, request_router="prefix_cache_affinity", engine={"num_kv_blocks": 64}
    )
    serve.run(build_app(args), name="affinity", route_prefix="/affinity")
    try:
        client = openai.OpenAI(
            base_url=f"{serve_cluster.base_url}/affinity/v1", api_key="unused", max_retries=0
        )
        messages = [{"role": "system", "content": TENANTS["Zephyr Tea"]}, {"role": "user", "content": "Hi"}]
        assert ask(client, messages)[1] > 500
        # token ids reach it written out as text (empty text would hang it: it divides by the length)
        completion = client.completions.create(
            model="smollm2-135m-instruct", prompt=[1000] * 8, max_tokens=2, timeout=60
        )
        assert completion.usage.prompt_tokens == 8
    finally:
        delete_app("affinity")
