"""Prefill/decode disaggregation, as the Ingress sees it: one model served by two EngineReplica
deployments, prefill and decode. `DisaggregatedEngine` answers the calls the Ingress makes of an
engine's handle: `generate` asks a prefill replica (its router picks one by prefix-cache hits) to
compute the prompts and publish their KV blocks, then streams from a decode replica (its router
picks by KV pressure), which adopts the blocks and decodes. Everything else goes to the decode
deployment.

A prefill that fails (a lost replica or node, a full queue) or refuses costs nothing but time:
the decode replica computes the prompt itself (a refusal it then gives itself, as colocated
serving would). Cancelling the call cancels the prefill call in flight (its blocks are freed
there) or the decode call; blocks published for a call that ends before its decode replica
answered are dropped then (kv_connectors.discard), and any a publisher still holds unread at its
TTL (a prefill whose answer was lost with the call)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.serve.handle import DeploymentHandle

from common.kv_transfer import KvHandle
from common.messages import ChoiceDelta, GenerateError, GenerateRequest
from deployments import replica_calls
from deployments.in_process_engine import LocalMethod
from deployments.kv_connectors import discard

logger = logging.getLogger("ray.serve")


# After a prefill that failed or timed out, requests skip prefill for this long: a deployment
# whose replicas are gone (a lost node) would otherwise hold every request for its timeout.
PREFILL_BACKOFF_S = 5.0


@dataclass(frozen=True)
class PrefillDecode:
    """One model's two deployments (bound at build time, handles in the Ingress)."""

    prefill: Any  # DeploymentHandle in the Ingress
    decode: Any
    prefill_timeout_s: float  # then the decode replica computes the prompt


class _Streaming:
    """`engine.options(stream=True)`: generate goes through both deployments; the rest (embed)
    streams from the decode deployment."""

    def __init__(self, engine: DisaggregatedEngine) -> None:
        self._engine = engine

    @property
    def generate(self) -> LocalMethod:
        return LocalMethod(self._engine.generate)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine.decode.options(stream=True), name)


class DisaggregatedEngine:
    def __init__(self, pair: PrefillDecode) -> None:
        self.prefill: DeploymentHandle = pair.prefill
        self.decode: DeploymentHandle = pair.decode
        self.prefill_timeout_s = pair.prefill_timeout_s
        self._skip_prefill_until = 0.0  # loop time
        self._node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""

    def options(self, stream: bool = False) -> Any:
        return _Streaming(self) if stream else self.decode

    def __getattr__(self, name: str) -> Any:  # kv_pool_tokens, stats, ...: the decode replicas'
        return getattr(self.decode, name)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[list[ChoiceDelta] | GenerateError]:
        """A decode replica's stream for the request, its prompts prefilled elsewhere first."""
        loop_time = asyncio.get_running_loop().time()
        wanted = request.wants_prefill and loop_time >= self._skip_prefill_until
        handles = await self._prefill(request) if wanted else None
        decoded = dataclasses.replace(request, kv_handles=handles)
        call = self.decode.options(stream=True).generate.remote(decoded)
        answered = False
        try:
            async for item in call:
                answered = True
                yield item
        finally:
            replica_calls.cancel(call)
            if not answered and handles:  # the decode replica may never fetch them
                published = [handle for handle in handles if handle is not None]
                asyncio.get_running_loop().run_in_executor(None, _discard_all, published, self._node_id)

    async def _prefill(self, request: GenerateRequest) -> list[KvHandle | None] | None:
        """Where a prefill replica published each prompt's blocks; None if it could not."""
        call = self.prefill.prefill.remote(request)
        try:
            async with asyncio.timeout(self.prefill_timeout_s):
                result = await call
        except BaseException as error:
            replica_calls.cancel(call)
            if not isinstance(error, Exception):  # cancelled: the client went away
                raise
            # A lost replica, a full queue, no replica at all (the timeout): the decode replica
            # computes the prompts instead, and the next requests skip prefill for a while.
            logger.warning("prefill of %s failed (%r): decoding from the prompt", request.request_id, error)
            self._skip_prefill_until = asyncio.get_running_loop().time() + PREFILL_BACKOFF_S
            return None
        return None if isinstance(result, GenerateError) else result


def _discard_all(handles: list[KvHandle], node_id: str) -> None:
    for handle in handles:
        discard(handle, node_id)
