"""An OpenAI completions / chat completions client over raw SSE that records what a user sees:
status, error code, chunk arrival times, usage. It can hang up mid-stream, as an impatient client
does. Over aiohttp, which spends less CPU per event than httpx did: a benchmark's client shares
the host with the servers it measures."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from common.latency import RequestTiming


@dataclass
class StreamResult:
    status: int  # HTTP status
    error_code: str | None = None  # from an error body, or an error event mid-stream
    sent_at: float = field(default_factory=time.monotonic)
    chunk_times: list[float] = field(default_factory=list)  # monotonic, one per chunk with tokens
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # when the request asked return_token_ids
    completion_tokens: int | None = None  # from the usage chunk
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of the prompt, found in the prefix cache
    finish_reason: str | None = None
    disconnected: bool = False  # we hung up before the end
    done_at: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def chunk_gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    def timing(self) -> RequestTiming:
        """What the client measured of a finished stream (token counts from its usage chunk)."""
        assert self.done_at is not None and self.ttft_s is not None, "a stream that ended with tokens"
        return RequestTiming(
            self.prompt_tokens or 0,
            self.completion_tokens or 0,
            self.ttft_s,
            self.done_at - self.sent_at,
            self.chunk_gaps_s,
        )


def client_session(
    timeout_s: float, connections: int = 100, reuse_connections: bool = True
) -> aiohttp.ClientSession:
    """A session for stream_completion: at most `connections` open at once (0: no cap), each
    connect and each read given `timeout_s` (as httpx's timeout). Made inside the event loop that
    uses it."""
    connector = aiohttp.TCPConnector(limit=connections, force_close=not reuse_connections)
    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20)


async def stream_completion(
    http: aiohttp.ClientSession,
    url: str,
    body: dict,
    disconnect_after_chunks: int | None = None,
    result: StreamResult | None = None,
) -> StreamResult:
    """POST `body` with stream + include_usage; read to [DONE], or hang up after that many chunks.
    `result`: filled as the stream arrives (a caller may watch its progress), and returned."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    result = result if result is not None else StreamResult(status=0)
    async with http.post(url, json=body) as response:
        result.status = response.status
        if response.status != 200:
            result.error_code, result.text = error_code(await response.read())
            result.done_at = time.monotonic()
            return result
        async for line in response.content:  # an event's line (b"data: {...}\n") or the blank after it
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            if "error" in chunk:
                result.error_code = chunk["error"]["code"]
            elif chunk.get("usage"):
                usage = chunk["usage"]
                result.completion_tokens = usage["completion_tokens"]
                result.prompt_tokens = usage["prompt_tokens"]
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            elif chunk["choices"]:
                choice = chunk["choices"][0]
                text = choice["text"] if "text" in choice else choice.get("delta", {}).get("content")
                if choice.get("delta") == {"role": "assistant"}:
                    continue  # a chat stream's opening role-only chunk carries no token
                result.chunk_times.append(time.monotonic())
                result.text += text or ""
                result.token_ids += choice.get("token_ids") or []  # vLLM sends null
                result.finish_reason = choice["finish_reason"] or result.finish_reason
                hang_up = disconnect_after_chunks is not None and result.finish_reason is None
                if hang_up and len(result.chunk_times) >= disconnect_after_chunks:
                    result.disconnected = True
                    response.close()  # the connection, not back to the pool
                    break
    result.done_at = time.monotonic()
    return result


def error_code(body: bytes) -> tuple[str, str]:
    """An error body's OpenAI `error.code`, or `not_openai` for any other body (Serve's proxy
    answers some failures in plain text); with the body's start, to say what it was."""
    text = body.decode(errors="replace")[:300]
    try:
        return str(json.loads(body)["error"]["code"]), text
    except (ValueError, KeyError, TypeError):
        return "not_openai", text
