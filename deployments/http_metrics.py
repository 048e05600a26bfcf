"""The API's HTTP outcomes as metrics: every request the Ingress answers, counted by route and
status code (`stallfree_http_requests_total`), so that an error rate can be read and alerted on
whatever stands in front of the Ingress (under HAProxy, Serve's own proxy metrics never see a
request). A pure ASGI middleware: streamed responses pass through it untouched."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from common.metrics_sinks import PREFIX, Counter, MetricsSink, RayServeSink

MODEL_LABEL, ROUTE_LABEL, STATUS_LABEL = "model_name", "route", "status"
UNMATCHED_ROUTE = "unmatched"  # a path no endpoint serves (its 404), one label value for all

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class HttpMetrics:
    def __init__(self, sink: MetricsSink) -> None:
        self.requests: Counter = sink.counter(
            PREFIX + "http_requests",
            "HTTP requests the API answered, by route (the endpoint's path, `unmatched` for "
            "others) and status code; a streamed answer counts once, with the status it started "
            "with (an error mid-stream is a `finished_reason` of `error`)",
            (MODEL_LABEL, ROUTE_LABEL, STATUS_LABEL),
        )


class HttpMetricsMiddleware:
    """Counts each HTTP request when its response starts, or as a 500 when the app raised before
    answering (Starlette's outermost handler writes that 500 outside any middleware). Its metrics
    are made on the first request: inside the Serve replica, where Ray's metrics can be made.
    `served` is filled in by the app's owner once it knows them (the Ingress: its first model's
    name, for routes that name no model; a route that does sets `request.state.model_name`)."""

    def __init__(self, app: ASGIApp, served: dict[str, str]) -> None:
        self.app = app
        self.served = served
        self._metrics: HttpMetrics | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counted_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self._count(scope, message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        except Exception:
            if not started:
                self._count(scope, 500)
            raise

    def _count(self, scope: Scope, status: int) -> None:
        if self._metrics is None:
            self._metrics = HttpMetrics(RayServeSink())
        route = getattr(scope.get("route"), "path", UNMATCHED_ROUTE)
        # the model the route served (its handler's request.state), else the app's first
        model = (scope.get("state") or {}).get(MODEL_LABEL) or self.served.get(MODEL_LABEL, "")
        self._metrics.requests.inc(1, {MODEL_LABEL: model, ROUTE_LABEL: route, STATUS_LABEL: str(status)})
