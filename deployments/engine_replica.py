"""EngineReplica: one Serve replica owning one AsyncEngine (the model steps on its own thread)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing
from typing import Any, Protocol, TypeVar

import ray
import torch
from ray import serve

from common.autoscaling_stats import KV_USAGE, WAITING, LoadMeter
from common.block_hash import root_hash
from common.finish_reason import FinishReason
from common.kv_transfer import KvBlocks, KvHandle, KvTransferError
from common.messages import ChoiceDelta, Embeddings, EmbedRequest, GenerateError, GenerateRequest
from common.routing_stats import RoutingReporter
from common.sampling_params import SamplingParams
from deployments.kv_connectors import DEFAULT_TTL_S, make_connector
from replica_engine import (
    AsyncEngine,
    EngineConfig,
    EngineDeadError,
    EngineStats,
    InvalidRequestError,
)
from replica_engine.metrics import EngineMetrics, RayServeSink
from replica_engine.outputs import RequestDelta

logger = logging.getLogger("ray.serve")


class ChoiceStream(Protocol):
    """One choice's outputs, as AsyncEngine.add_request streams them; closing it aborts the choice."""

    def __aiter__(self) -> AsyncIterator[RequestDelta]: ...

    async def aclose(self) -> None: ...


Answer = TypeVar("Answer")  # what a replica method makes of its streams' outputs


async def merge_choice_streams(streams: list[ChoiceStream]) -> AsyncIterator[list[tuple[int, RequestDelta]]]:
    """Interleave the choices' streams as they produce; each item is every (stream index,
    output) ready at that moment, so a busy replica sends fewer, larger messages. Closing this
    closes (and so aborts) every stream still running."""
    if len(streams) == 1:  # no task and queue in between: each output holds every token then ready
        try:
            async for output in streams[0]:
                yield [(0, output)]
        finally:
            await streams[0].aclose()
        return
    ready: asyncio.Queue[tuple[int, RequestDelta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: ChoiceStream) -> None:
        try:
            async for output in stream:
                ready.put_nowait((index, output))
            ready.put_nowait((index, None))
        except Exception as error:
            ready.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            batch: list[tuple[int, RequestDelta]] = []
            item = await ready.get()
            while True:
                index, output = item
                if isinstance(output, BaseException):
                    raise output
                if output is None:
                    running -= 1
                else:
                    batch.append((index, output))
                if ready.empty():
                    break
                item = ready.get_nowait()
            if batch:
                yield batch
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def _coalesce(batch: list[tuple[int, RequestDelta]]) -> list[ChoiceDelta]:
    """One delta per choice: a choice that advanced twice since the last message sends both at once."""
    merged: dict[int, RequestDelta] = {}
    for index, out in batch:
        merged[index] = merged[index].then(out) if index in merged else out
    return [
        ChoiceDelta(
            index,
            out.text_delta,
            list(out.new_token_ids),
            out.num_prompt_tokens,
            out.finish_reason,
            out.num_cached_tokens,
            list(out.logprobs),
            out.prompt_logprobs,
        )
        for index, out in merged.items()
    ]


async def _serve(
    starts: list[Callable[[], Awaitable[ChoiceStream]]],
    answer: Callable[[AsyncIterator[list[tuple[int, RequestDelta]]]], AsyncIterator[Answer]],
) -> AsyncIterator[Answer | GenerateError]:
    """Start every stream, then yield what `answer` makes of their merged outputs. A refused
    request yields one GenerateError and nothing else; a dead engine ends it with one."""
    try:
        streams = await _start_all(starts)
    except InvalidRequestError as error:
        yield GenerateError(str(error), error.param, error.code)
        return
    except EngineDeadError as error:  # Serve's health check will replace this replica
        yield GenerateError(str(error), None, "engine_unavailable", status=503)
        return
    try:
        async with aclosing(merge_choice_streams(streams)) as batches:  # closing aborts what still runs
            async for item in answer(batches):
                yield item
    except EngineDeadError as error:
        yield GenerateError(str(error), None, "engine_error", status=500)


async def _start_all(starts: list[Callable[[], Awaitable[ChoiceStream]]]) -> list[ChoiceStream]:
    """Start every stream, or none: a refusal (e.g. a prompt needs more KV blocks than the pool
    has) aborts the ones already started."""
    streams: list[ChoiceStream] = []
    try:
        for start in starts:
            streams.append(await start())
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return streams


def _engine_failed(what: str, index: int) -> GenerateError:
    message = f"the engine failed while computing {what} {index}; it goes on serving"
    return GenerateError(message, None, "engine_error", status=500)


async def _choice_deltas(
    batches: AsyncIterator[list[tuple[int, RequestDelta]]],
) -> AsyncIterator[list[ChoiceDelta] | GenerateError]:
    """Each batch as one delta per choice; a choice the engine failed ends the stream."""
    async for batch in batches:
        deltas = _coalesce(batch)
        failed = [d.index for d in deltas if d.finish_reason is FinishReason.ERROR]
        if failed:
            yield _engine_failed("choice", failed[0])
            return
        yield deltas


async def _embeddings(
    batches: AsyncIterator[list[tuple[int, RequestDelta]]],
) -> AsyncIterator[Embeddings | GenerateError]:
    """Every input's final output (the one with its embedding), as one Embeddings."""
    finals: dict[int, RequestDelta] = {}
    async for batch in batches:
        finals.update((index, output) for index, output in batch if output.finished)
    vectors = []
    for index in sorted(finals):
        embedding = finals[index].embedding
        if embedding is None:  # finished with reason error
            yield _engine_failed("input", index)
            return
        vectors.append(embedding)
    yield Embeddings(vectors, sum(output.num_prompt_tokens for output in finals.values()))


def _prompts(request: GenerateRequest) -> list[tuple[list[int], SamplingParams]]:
    return list(zip(request.prompt_token_ids, request.params, strict=True))


KV_FETCH_TIMEOUT_S = 30.0  # a decode replica waits this long for a prompt's blocks, then computes it


@serve.deployment(name="EngineReplica")
class EngineReplica:
    def __init__(
        self,
        engine_config: EngineConfig,
        model_name: str,
        cpu_threads: int | None = None,
        kv_connector: str | None = None,
        kv_ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        """`kv_connector`: prefill/decode disaggregation's (deployments/kv_connectors.py), for a
        replica of either role; None outside it. `kv_ttl_s`: how long its published blocks wait
        for their reader."""
        # Ray sets OMP_NUM_THREADS to the actor's CPU count (often 1); the CPU engine wants its cores.
        if cpu_threads or not torch.cuda.is_available():
            torch.set_num_threads(cpu_threads or len(os.sched_getaffinity(0)))
        self.metrics = EngineMetrics(RayServeSink(), model_name)
        self.engine = AsyncEngine(engine_config, self.metrics)
        inputs = self.engine.inputs
        self._load_meter = LoadMeter()
        self.num_ongoing_requests = 0  # generate and embed calls running (a request of n choices: one)
        self._reporter = RoutingReporter(
            inputs.config.block_size,
            root_hash(inputs.config.model, None),
            inputs.config.max_num_batched_tokens,
        )
        self.connector = None
        if kv_connector is not None:
            node_ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else node_ip
            self.connector = make_connector(kv_connector, node_id, node_ip, kv_ttl_s)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[list[ChoiceDelta] | GenerateError]:
        """Stream the choices' deltas; a refused request yields one GenerateError and nothing else,
        and one the engine fails ends with a GenerateError. Cancelling the call (the client went
        away) aborts every choice, freeing its KV blocks."""
        # A stream's position == choice index: input i's choice j is stream i * n + j.
        with self._ongoing():
            # A prompt's blocks from a prefill replica go with its first choice; the others find them cached.
            kv = await self._fetch(request.kv_handles or [None] * len(request.params))
            jobs = [
                (prompt, params.for_choice(j), kv[i] if j == 0 else None)
                for i, (prompt, params) in enumerate(_prompts(request))
                for j in range(request.n)
            ]
            starts = [
                functools.partial(
                    self.engine.add_request, prompt, params, f"{request.request_id}-{index}", kv=blocks
                )
                for index, (prompt, params, blocks) in enumerate(jobs)
            ]
            messages = 0
            try:  # closing it (a cancel) aborts at once
                async with aclosing(_serve(starts, _choice_deltas)) as items:
                    async for item in items:
                        messages += 1
                        yield item
            finally:  # once a call: a record per message was a large share of the event loop's time
                self.metrics.stream_messages.inc(messages, self.metrics.labels)

    async def prefill(self, request: GenerateRequest) -> list[KvHandle | None] | GenerateError:
        """Prefill/decode disaggregation's first half: compute each prompt (a token is sampled and
        dropped) and publish its full blocks for a decode replica (None for a prompt without one,
        or whose computation failed). A refused request gives one GenerateError. Cancelling the
        call aborts the prompts, freeing their blocks."""
        assert self.connector is not None, "this replica has no kv_connector: not a prefill replica"
        starts = [
            functools.partial(
                self.engine.add_request,
                prompt,
                SamplingParams(max_tokens=1, temperature=0.0, cache_salt=params.cache_salt, lora=params.lora),
                f"{request.request_id}-prefill-{index}",
                kv_export=True,
            )
            for index, (prompt, params) in enumerate(_prompts(request))
        ]
        finals: dict[int, KvBlocks | None] = {}

        async def keep_finals(batches: AsyncIterator[list[tuple[int, RequestDelta]]]) -> AsyncIterator[None]:
            async for batch in batches:
                finals.update((index, delta.kv) for index, delta in batch if delta.finished)
            yield None

        with self._ongoing():
            async with aclosing(_serve(starts, keep_finals)) as items:  # closing it (a cancel) aborts
                async for item in items:
                    if isinstance(item, GenerateError):
                        return item
        return [await self._publish(finals.get(index)) for index in range(len(starts))]

    async def _publish(self, blocks: KvBlocks | None) -> KvHandle | None:
        if blocks is None:
            return None
        assert self.connector is not None
        handle = await asyncio.to_thread(self.connector.publish, blocks)
        self.metrics.record_kv_transfer("sent")
        return handle

    async def _fetch(self, handles: list[KvHandle | None]) -> list[KvBlocks | None]:
        """Each prompt's blocks from where a prefill replica published them; None where it did
        not, or where they cannot be had (the prompt is then computed here)."""
        fetched: list[KvBlocks | None] = []
        for handle in handles:
            blocks = None
            if handle is not None and self.connector is not None:
                try:
                    blocks = await asyncio.to_thread(self.connector.fetch, handle, KV_FETCH_TIMEOUT_S)
                    self.metrics.record_kv_transfer("received", blocks.nbytes)
                except KvTransferError as error:
                    logger.warning("%s; computing the prompt here", error)
                    self.metrics.record_kv_transfer("lost")
            fetched.append(blocks)
        return fetched

    async def embed(self, request: EmbedRequest) -> AsyncIterator[Embeddings | GenerateError]:
        """Every input's embedding, in one Embeddings; or one GenerateError, as for generate. A
        stream of one item, so that the Ingress treats the call as it does generate's (deadline,
        cancelling, which aborts every input and frees its KV blocks, a lost replica's 503)."""
        starts = [
            functools.partial(self.engine.add_embedding_request, prompt, f"{request.request_id}-{index}")
            for index, prompt in enumerate(request.prompt_token_ids)
        ]
        with self._ongoing():
            async with aclosing(_serve(starts, _embeddings)) as items:  # closing it (a cancel) aborts at once
                async for item in items:
                    yield item

    @contextlib.contextmanager
    def _ongoing(self) -> Iterator[None]:
        """Count a generate or embed call while it runs, for the routing report."""
        self.num_ongoing_requests += 1
        try:
            yield
        finally:
            self.num_ongoing_requests -= 1

    def kv_pool_tokens(self) -> int:
        """Tokens the whole KV pool holds: the Ingress fits a default max_tokens to it."""
        inputs = self.engine.inputs
        return inputs.num_kv_blocks * inputs.config.block_size

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def pause(self) -> None:
        """AsyncEngine.pause, on this replica only (a handle's call reaches one replica)."""
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def record_routing_stats(self) -> dict[str, Any]:
        """For the routers, every ~0.5 s: a RoutingStats, as the plain dict Serve carries."""
        return self._reporter.report(self.engine.stats(), self.num_ongoing_requests).to_report()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """For the KV-pressure autoscaling policy (router.autoscaling): KV usage, queue depth and,
        from the second call on, the load's rates since the previous one."""
        stats = self.engine.stats()
        rates = self._load_meter.rates(
            time.monotonic(), stats.num_requests_added, stats.num_requests_finished, stats.step_work_s
        )
        return {KV_USAGE: stats.kv_cache_usage, WAITING: stats.num_waiting, **rates}

    def check_health(self) -> None:
        """Serve calls this every 10 s (and the Ingress's /health). The engine stopped (its core's
        process died, its steps kept failing, a pipeline stage was lost): once no call runs here
        (their streams have ended with the error) the replica exits, and Serve replaces it at once,
        where a check that raises is replaced after three in a row (30 s). While calls run, it
        raises. The call also re-sends the counters that start at zero (initialize_series)."""
        self.metrics.initialize_series()
        if self.engine.is_healthy:
            return
        error = f"engine step loop died: {self.engine.error!r}"
        if self.num_ongoing_requests:
            raise RuntimeError(error)
        logger.error("%s; the replica exits for Serve to replace it", error)
        self._release()
        self.exit_process(1)

    # How the replica exits (tests of the class alone, in their own process, record it instead).
    exit_process: Callable[[int], None] = staticmethod(os._exit)

    def _release(self) -> None:
        self.engine.shutdown()
        if self.connector is not None:
            self.connector.close()

    def __del__(self) -> None:
        self._release()
