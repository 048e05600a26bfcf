"""The Ingress's side of prefill/decode disaggregation (deployments/disaggregated_engine.py) on its
own: a prefill that fails or outlives prefill_timeout_s is computed by the decode replica (the
request goes on without KV handles) and requests then skip prefill for a while; a refusal is left
to the decode replica; prompt logprobs skip prefill. Stand-ins for the two deployments' handles:
a timeout and a failure at a chosen moment cannot be arranged through Serve (the Serve paths run
in test_disaggregation.py and tests/cluster/test_disaggregation_across_nodes.py)."""

from __future__ import annotations

import asyncio

import pytest

from common.messages import GenerateError, GenerateRequest
from common.sampling_params import SamplingParams
from deployments import disaggregated_engine
from deployments.disaggregated_engine import DisaggregatedEngine, PrefillDecode


class _Call:
    def __init__(self, result) -> None:
        self._result = result
        self.cancelled = False

    def __await__(self):
        return self._result().__await__()

    def cancel(self) -> None:
        self.cancelled = True


class _Prefill:
    """The prefill deployment's handle: `prefill.remote` runs `behaviour`."""

    def __init__(self, behaviour) -> None:
        self.behaviour = behaviour
        self.calls: list[_Call] = []
        self.prefill = self

    def remote(self, request: GenerateRequest) -> _Call:
        self.calls.append(_Call(self.behaviour))
        return self.calls[-1]


class _Decode:
    """The decode deployment's streaming handle: yields what it was sent."""

    def __init__(self) -> None:
        self.sent: list[GenerateRequest] = []
        self.generate = self

    def options(self, stream: bool = False) -> _Decode:
        return self

    def remote(self, request: GenerateRequest):
        self.sent.append(request)

        async def items():
            yield ["answer"]

        return _Stream(items())


class _Stream:
    def __init__(self, items) -> None:
        self._items = items

    def __aiter__(self):
        return self._items

    def cancel(self) -> None:
        pass


def _request(**params) -> GenerateRequest:
    return GenerateRequest("r", [[1, 2, 3]], [SamplingParams(max_tokens=4, **params)])


async def _answer(engine: DisaggregatedEngine, request: GenerateRequest) -> list:
    return [item async for item in engine.generate(request)]


def test_handles_go_to_decode_and_failures_fall_back_then_skip_prefill_for_a_while(monkeypatch):
    async def published():
        return ["handle"]

    async def lost():
        raise ConnectionError("the prefill replica's node is gone")

    async def never():
        await asyncio.sleep(3600)

    async def refused():
        return GenerateError("too long", "prompt", None)

    async def scenario():
        decode = _Decode()
        engine = DisaggregatedEngine(PrefillDecode(_Prefill(published), decode, prefill_timeout_s=0.2))
        assert await _answer(engine, _request()) == [["answer"]]
        assert decode.sent[-1].kv_handles == ["handle"]

        engine.prefill = _Prefill(refused)  # the decode replica gives (or computes) its own answer
        await _answer(engine, _request())
        assert decode.sent[-1].kv_handles is None

        for behaviour in (lost, never):
            engine._skip_prefill_until = 0.0
            engine.prefill = prefill = _Prefill(behaviour)
            await _answer(engine, _request())
            assert decode.sent[-1].kv_handles is None and prefill.calls[-1].cancelled
            await _answer(engine, _request())  # within the backoff: no prefill call at all
            assert len(prefill.calls) == 1

        engine._skip_prefill_until = 0.0
        engine.prefill = prefill = _Prefill(published)
        await _answer(engine, _request(prompt_logprobs=1))  # computed where it runs
        assert not prefill.calls and decode.sent[-1].kv_handles is None

    monkeypatch.setattr(disaggregated_engine, "PREFILL_BACKOFF_S", 60.0)
    asyncio.run(scenario())


def test_a_cancel_during_prefill_cancels_the_prefill_call():
    async def slow():
        await asyncio.sleep(3600)

    async def scenario():
        prefill, decode = _Prefill(slow), _Decode()
        engine = DisaggregatedEngine(PrefillDecode(prefill, decode, prefill_timeout_s=600))
        task = asyncio.create_task(_answer(engine, _request()))
        while not prefill.calls:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert prefill.calls[0].cancelled and not decode.sent

    asyncio.run(scenario())
