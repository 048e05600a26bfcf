"""`python -m bench record_ray_router`: Ray Serve LLM's PrefixCacheAffinityRouter choosing among 3
real EngineReplicas for a fixed sequence of token-id prompts, recorded into
tests/sim/data/ray_prefix_router_choices.json for tests/sim/test_ray_prefix_router.py, which replays
it through the simulator's RayPrefixCacheAffinity. Re-run it after upgrading Ray (about a minute;
it starts its own local Ray and shuts it down).

Real Serve from the handle on, in-process only for the router: `serve.run(build_app(...))` with
request_router prefix_cache_affinity and 3 replicas of dummy:tiny-llama, then a DeploymentHandle to
EngineReplica held here, so the router Serve builds for that handle (Ray's class, unchanged) runs in
this process. Not through HTTP: a response does not name its replica, and the Ingress's router, in
the Ingress's replica, cannot be looked at. Each request is the GenerateRequest the Ingress makes of
a token-id prompt; its `prompt`, the ids written out as the Ingress writes them, is the text Ray's
router reads (`_extract_text_from_request`: a `prompt` attribute) and what the fixture records.
Holding the router lets the recording note what it chose by: the order of Ray's replica set (among
equals the first listed wins), the order its tree took the replicas in (smallest-tenant ties), and
the queue lengths in its cache. Which replica took a request is read from Ray's tree:
`on_request_routed` stamps the replica it sent the request to, so the newest stamp at the root is it.

Requests go one after another; some are held open, decoding, so that their replica's queue length
is 1 while the next ones are routed (the cache is read before a request and after one not held: the
same, or the recording stops). The queue-length cache outlives the recording
(RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S below): a stale entry would make Serve probe, and probes
answer in no fixed order."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S", "3600")  # read when Serve is imported

import asyncio
import json
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from common.messages import GenerateRequest
from common.sampling_params import SamplingParams
from deployments.app import AppArgs, build_app

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "sim" / "data" / "ray_prefix_router_choices.json"
APP = "record"
NUM_REPLICAS = 3
VOCAB = 512  # tiny-llama's
HOLD_TOKENS = 1900  # a held request decodes for seconds; the context is 2048


@dataclass(frozen=True)
class Send:
    token_ids: list[int]
    note: str  # what the request is there to exercise
    hold: bool = False  # left decoding until the end of its phase


def phases(seed: int = 25) -> list[list[Send]]:
    """Tenants share a 4-token preamble, each its own 100-token system prompt, then a question.
    Match rates below are in characters of the written-out ids (about 4 per token). Ray matches
    characters, so where a prompt leaves a shared prefix its next id's first digit decides which
    branch it enters: ids there lead with chosen digits (`lead`), so that a prompt meant to stop at
    a shared node does not run a digit into one replica's branch."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    def lead(digit: int, n: int = 1) -> list[int]:
        """n ids, the first two digits long and starting with `digit`."""
        return [rng.randrange(10 * digit, 10 * digit + 10), *tokens(n - 1)]

    pre = lead(9, 4)
    system = [lead(k + 1, 100) for k in range(4)]
    system[2][6:7] = lead(1)  # the other branches off system[2][:6] lead with 2, 3, 4

    def ask(tenant: int, note: str = "", hold: bool = False) -> Send:
        return Send(pre + system[tenant] + tokens(rng.randrange(8, 17)), note or f"tenant {tenant}", hold)

    def short(digit: int, note: str) -> Send:
        return Send(pre + lead(digit, 12), f"preamble, ~25%: every replica owns it, a tie{note}")

    shared = pre + system[2][:6]  # ~9% of a 110-token prompt, ~35% of a 30-token one
    return [
        [
            ask(0, "empty tree: every replica is a smallest tenant"),
            ask(1, "preamble only (~4%): the two empty replicas tie"),
            ask(2),
            ask(0),
            ask(1),
            ask(3, "new tenant, ~4%: the replica with the fewest characters"),
            short(5, ""),
            Send(pre + system[0][:50] + tokens(60), "half a system prompt: the node splits"),
            Send(shared + lead(2, 100), "~9%, under the threshold: a smallest tenant"),
            Send(pre + system[2][:14] + tokens(80), "~18%, over the threshold: its owner"),
            Send(shared + lead(3, 20), "~35% of a node two replicas own: a tie"),
            Send(lead(5, 60), "no match at all"),
            ask(2),
            Send(pre + system[3][:40], "a prefix of a recorded prompt: 100%"),
        ],
        [
            ask(0, "tenant 0, held", hold=True),
            short(6, ", its first replica busy"),
            ask(1, "tenant 1, held", hold=True),
            short(7, ", two replicas busy"),
            ask(0, "its only owner is busy: still chosen (no load guard)"),
            Send(shared + lead(4, 20), "two owners, one busy"),
        ],
        [
            short(8, ", all idle again"),
            Send(lead(6, 150), "no match at all"),
        ],
    ]


def generate_request(send: Send) -> GenerateRequest:
    """As the Ingress makes it of a token-id prompt: the ids written out are the router's text."""
    max_tokens = HOLD_TOKENS if send.hold else 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    text = " ".join(map(str, send.token_ids))
    return GenerateRequest(uuid.uuid4().hex, [send.token_ids], [params], text)


QueueLens = dict[str, int | None]  # replica -> ongoing requests in the router's cache (None: stale)


def all_idle(queue_lens: QueueLens) -> bool:
    return list(queue_lens.values()) == [0] * NUM_REPLICAS


class Recorder:
    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle
        self.router: Any = None  # Ray's PrefixCacheAffinityRouter, once the handle has made it

    async def start(self) -> None:
        """A few calls without a prompt (Serve routes them by power of two, leaving the tree
        alone) so the handle makes its router, learns the replicas and fills the cache."""
        for _ in range(2 * NUM_REPLICAS):
            await self.handle.stats.remote()
        self.router = self.handle._router._asyncio_router.request_router
        await self.wait_queue_lens(all_idle, "every replica, idle")

    def queue_lens(self) -> QueueLens:
        cache = self.router._replica_queue_len_cache
        return {rid.to_full_id_str(): cache.get(rid) for rid in self.router._replica_id_set}

    async def wait_queue_lens(
        self, ready: Callable[[QueueLens], bool], why: str, timeout_s: float = 30
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready(lens := self.queue_lens()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router's queue lengths stayed {lens}, waiting for {why}")
            await asyncio.sleep(0.05)

    def tree(self, attribute: str) -> Any:
        return ray.get(self.router._tree_actor.getattr.remote(attribute))

    def last_routed(self) -> str:
        stamps = self.tree("root").tenant_to_last_access_time
        return max(stamps, key=stamps.get)

    async def record(self) -> dict[str, Any]:
        await self.start()
        # Ray's set orders (per process, from the replicas' hashes), and the tree's tenant order.
        candidates = [rid.to_full_id_str() for rid in self.router._replica_id_set]
        tenants = list(self.tree("tenant_to_char_count"))
        names = {rid: f"replica{i}" for i, rid in enumerate(candidates)}
        requests = []
        for phase in phases():
            held: list[DeploymentResponseGenerator] = []
            for send in phase:
                before = self.queue_lens()
                if None in before.values():
                    raise RuntimeError(
                        f"a stale queue length ({before}): Serve would probe, in no fixed order"
                    )
                request = generate_request(send)
                response = self.handle.options(stream=True).generate.remote(request)
                await anext(response)  # routed, and (held or not) already decoding
                chosen = self.last_routed()
                if send.hold:
                    held.append(response)
                else:
                    async for _ in response:
                        pass
                    await self.wait_queue_lens(lambda lens, b=before: lens == b, f"{before} again", 5)
                if [rid.to_full_id_str() for rid in self.router._replica_id_set] != candidates:
                    raise RuntimeError("Ray's replica set changed during the recording")
                requests.append(
                    {
                        "note": send.note,
                        "queue_lens": {names[rid]: before[rid] for rid in candidates},
                        "chosen": names[chosen],
                        "text": request.prompt,
                    }
                )
                print(f"{len(requests) - 1:2d} {names[chosen]} {before} {send.note}", flush=True)
            for response in held:
                response.cancel()
            await self.wait_queue_lens(all_idle, "every replica, idle")
        return {
            "ray_version": ray.__version__,
            "how": "bench/serving/record_ray_router.py",
            "replica_ids": {names[rid]: rid for rid in candidates},
            "candidate_order": [names[rid] for rid in candidates],
            "tenant_order": [names[rid] for rid in tenants],
            "requests": requests,
        }


def main() -> None:
    ray.init(address="local", include_dashboard=False, num_cpus=2)
    try:
        serve.start(proxy_location="Disabled")
        args = AppArgs(
            model="dummy:tiny-llama",
            num_replicas=NUM_REPLICAS,
            num_cpus=0,
            cpu_threads=1,
            request_router="prefix_cache_affinity",
        )
        serve.run(build_app(args), name=APP, route_prefix=None)
        handle = serve.get_deployment_handle("EngineReplica", app_name=APP)
        recording = asyncio.run(Recorder(handle).record())
    finally:
        serve.shutdown()
        ray.shutdown()
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(recording, indent=1) + "\n")
    print(f"wrote {FIXTURE} ({len(recording['requests'])} requests)")


if __name__ == "__main__":
    main()
