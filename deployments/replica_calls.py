"""A call from the Ingress to its engine (the EngineReplica deployment's handle, or its own
engine when colocated), read as the Ingress needs it: the items, every way the call can end badly
as an ApiError, and its cancel."""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from common.messages import ChoiceDelta, Embeddings, GenerateError
from deployments.protocol import ApiError

logger = logging.getLogger("ray.serve")
RETRY_AFTER_S = 1  # when a replica's queue is full and Serve gives no hint


async def replies(
    replica_call: DeploymentResponseGenerator, deadline: float | None
) -> AsyncIterator[list[ChoiceDelta] | Embeddings]:
    """The replica's items for one request (delta batches; or embed's one Embeddings). Every way
    that can end badly becomes an ApiError: a refusal or engine fault (the replica's
    GenerateError), a full queue, a dead replica, or the request's deadline (loop time). The
    caller cancels `replica_call` (cancel) when done with it."""
    try:
        while True:
            async with asyncio.timeout_at(deadline):
                item = await anext(replica_call, None)
            if item is None:
                return
            if isinstance(item, GenerateError):
                error_type = "invalid_request_error" if item.status < 500 else "server_error"
                headers = {"Retry-After": str(RETRY_AFTER_S)} if item.status == 503 else None
                raise ApiError(item.status, item.message, item.param, item.code, error_type, headers)
            yield item
    except TimeoutError:
        raise ApiError(
            408, "request timed out (request_timeout_s)", code="request_timeout", error_type="timeout"
        ) from None
    except BackPressureError as error:
        retry_after = error.retry_after_s if error.retry_after_s is not None else RETRY_AFTER_S
        raise ApiError(
            503,
            f"server busy: {error.message} Retry later.",
            code="overloaded",
            error_type="server_error",
            headers={"Retry-After": str(max(1, round(retry_after)))},
        ) from None
    except RayActorError as error:  # the replica died (Serve starts a new one): the request is lost
        logger.warning("replica failed mid-request: %s", error)
        raise ApiError(
            503,
            "the replica serving this request stopped; retry the request",
            code="replica_failed",
            error_type="server_error",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None


def by_value(handle: DeploymentHandle) -> DeploymentHandle:
    """The handle, its calls over gRPC to the replica (Serve's by-value transport, which its
    throughput-optimized preset turns on): each streamed message a gRPC message rather than a
    Ray object reported to the caller, the costlier per message on both ends."""
    return handle.options(_by_reference=False)


def cancel(replica_call: DeploymentResponseGenerator) -> None:
    """Abort the replica call (a no-op once it has ended). Serve's cancel() re-raises a call
    that failed before reaching a replica (a full queue): that failure is already answered."""
    with contextlib.suppress(Exception):
        replica_call.cancel()


async def prepend(
    first: list[ChoiceDelta], rest: AsyncIterator[list[ChoiceDelta]]
) -> AsyncIterator[list[ChoiceDelta]]:
    yield first
    async for batch in rest:
        yield batch
