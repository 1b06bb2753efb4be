"""Any OpenAI-compatible server (vLLM, llama.cpp, SGLang, Ollama, providers).

The request is always streamed upstream (``stream: true`` with usage), so a
cancel closes the HTTP response mid-generation and the server aborts it.

Every upstream failure is one warning line on the node naming the model, the
upstream's host:port and the error class or status, never the api_key,
headers or bodies: the client's ``run_error`` is not the only trace of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import msgspec
import structlog
import trio

from node.adapters import Counters, Sink
from node.adapters.sse import SSEParser
from node.config import ModelConfig
from proto import RunRequest, ToolCall, ToolCallFunction, TunnelRequest, Usage


class _FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCallDelta(msgspec.Struct):
    index: int = 0
    id: str | None = None
    type: str | None = None
    function: _FunctionDelta | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_ToolCallDelta] | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    finish_reason: str | None = None


class _CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    completion_tokens_details: _CompletionTokensDetails | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | str | None = None


log = structlog.get_logger("iop.node")

_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_encode = msgspec.json.Encoder().encode
_MAX_ERROR_BODY = 4096
_DRAIN_S = 2.0
_POOL_SIZE = (
    64  # concurrent requests per httpx client (see _Pools)  # after [DONE], how long the rest of the body may take
)


class UpstreamError(Exception):
    pass


class _Pools:
    """httpx clients of at most :data:`_POOL_SIZE` requests each.

    httpcore's pool scans every connection it holds for each request it
    assigns, so one pool with thousands of concurrent streams costs time
    quadratic in their number (measured: 1,200 streams starving a node's event
    loop for seconds). A request leases the least busy client; a new client is
    made only when every one is full, so the count stays at concurrency / 64.
    """

    def __init__(self, **client_kwargs) -> None:
        self._kwargs = client_kwargs
        self._clients: list[httpx.AsyncClient] = []
        self._busy: list[int] = []

    @contextlib.asynccontextmanager
    async def lease(self):
        busy = self._busy
        i = min(range(len(busy)), key=busy.__getitem__, default=-1)
        if i < 0 or busy[i] >= _POOL_SIZE:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=_POOL_SIZE)
            self._clients.append(httpx.AsyncClient(limits=limits, **self._kwargs))
            busy.append(0)
            i = len(busy) - 1
        busy[i] += 1
        try:
            yield self._clients[i]
        finally:
            busy[i] -= 1

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()


def _host_port(base_url: str) -> str:
    """``host:port`` of a base URL, for logs (no scheme, credentials or path)."""
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL:
        return "?"
    host = f"[{url.host}]" if ":" in url.host else url.host
    return f"{host}:{url.port or (443 if url.scheme == 'https' else 80)}"


class OpenAIAdapter:
    def __init__(
        self, model: ModelConfig, counters: Counters, *, connect_timeout_s: float = 10.0, read_timeout_s: float = 600.0
    ) -> None:
        self.model = model
        self.counters = counters
        self.upstream = _host_port(model.base_url)
        self.pools = _Pools(
            base_url=model.base_url,
            headers={"Authorization": f"Bearer {model.api_key}"} if model.api_key else {},
            timeout=httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=60.0, pool=None),
        )

    async def aclose(self) -> None:
        await self.pools.aclose()

    def _log_failure(self, error: str) -> None:
        log.warning("upstream request failed", model=self.model.name, upstream=self.upstream, error=error)

    def _log_status(self, status: int) -> None:
        log.warning("upstream error status", model=self.model.name, upstream=self.upstream, status=status)

    async def run(self, request: RunRequest, sink: Sink) -> None:
        body = dict(request.request)
        body["model"] = request.target or self.model.target or self.model.name
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        self.counters.active_upstream += 1
        try:
            for attempt in (1, 2):
                try:
                    async with (
                        self.pools.lease() as client,
                        client.stream(
                            "POST",
                            "/chat/completions",
                            content=_encode(body),
                            headers={"content-type": "application/json", "accept": "text/event-stream"},
                        ) as response,
                    ):
                        if response.status_code != 200:
                            self._log_status(response.status_code)
                            await sink.error(await _error_text(response), status=response.status_code)
                            return
                        async with _finished_on_cancel(response.aiter_raw()) as chunks:
                            await self._relay(chunks, sink)
                        return
                except httpx.RemoteProtocolError as e:
                    # A pooled keep-alive connection the server had just closed:
                    # nothing was answered, so sending again is safe, once.
                    if attempt == 1 and not sink.started:
                        continue
                    self._log_failure(type(e).__name__)
                    await sink.error(f"upstream request failed: {type(e).__name__}: {e}")
                    return
        except httpx.HTTPError as e:
            self._log_failure(type(e).__name__)
            await sink.error(f"upstream request failed: {type(e).__name__}: {e}".rstrip(": "))
        finally:
            self.counters.active_upstream -= 1

    async def tunnel(self, request: TunnelRequest, sink) -> None:
        """Relay one raw request; the provider's status, headers and body bytes go back unchanged."""
        headers = {k: v for k, v in request.headers or () if k.lower() in ("accept", "content-type")}
        headers.setdefault("content-type", "application/json")
        self.counters.active_upstream += 1
        try:
            async with (
                self.pools.lease() as client,
                client.stream(request.method, request.path, content=request.body, headers=headers) as response,
            ):
                if response.status_code >= 400:
                    self._log_status(response.status_code)
                await sink.start(
                    response.status_code, [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.headers.raw]
                )
                async with _finished_on_cancel(response.aiter_raw()) as chunks:
                    async for data in chunks:
                        await sink.body(data)
                await sink.end()
        except httpx.HTTPError as e:
            self._log_failure(type(e).__name__)
            await sink.error(f"provider request failed: {type(e).__name__}: {e}".rstrip(": "))
        finally:
            self.counters.active_upstream -= 1

    async def _relay(self, chunks: AsyncIterator[bytes], sink: Sink) -> None:
        # Leaving the body early is done by cancelling `reading`, never by
        # break/return: the Cancelled then finishes httpx's generator chain
        # instead of leaving it suspended for the garbage collector.
        parser = SSEParser()
        finish_reason = ""
        usage: Usage | None = None
        calls: dict[int, ToolCall] = {}
        with trio.CancelScope() as reading:
            async for raw in chunks:
                if sink.ended:
                    continue  # draining what follows [DONE]
                for data in parser.feed(raw):
                    if data == b"[DONE]":
                        await sink.complete(finish_reason or "stop", _ordered(calls), usage)
                        reading.deadline = trio.current_time() + _DRAIN_S
                        break
                    try:
                        chunk = _decode_chunk(data)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        self._log_failure("undecodable chunk")
                        await sink.error(f"upstream sent an undecodable chunk: {data[:200]!r}")
                        reading.cancel()
                        break
                    if chunk.error is not None:
                        self._log_failure("error chunk")
                        message = chunk.error.get("message") if isinstance(chunk.error, dict) else chunk.error
                        await sink.error(f"upstream error: {message}")
                        reading.cancel()
                        break
                    if chunk.usage is not None:
                        usage = _usage(chunk.usage)
                    for choice in chunk.choices:
                        if choice.index != 0:
                            continue
                        delta = choice.delta
                        if delta is not None:
                            reasoning = delta.reasoning_content or delta.reasoning
                            if reasoning:
                                await sink.reasoning(reasoning)
                            if delta.content:
                                await sink.delta(delta.content)
                            if delta.tool_calls:
                                _merge_tool_calls(calls, delta.tool_calls)
                        if choice.finish_reason:
                            finish_reason = choice.finish_reason
        if sink.ended:
            return
        # The body ended without [DONE]: still an answer if it said why it stopped.
        if finish_reason:
            await sink.complete(finish_reason, _ordered(calls), usage)
        else:
            self._log_failure("stream closed before it finished")
            await sink.error("upstream closed the stream before it finished")


@contextlib.asynccontextmanager
async def _finished_on_cancel(chunks: AsyncIterator[bytes]) -> AsyncIterator[AsyncIterator[bytes]]:
    """A cancel that arrives while the run waits for the link (outside httpx's
    generator chain) finishes that chain too, by cancelling inside it, rather
    than leaving it suspended for the garbage collector."""
    try:
        yield chunks
    except trio.Cancelled:
        with trio.CancelScope() as inside:
            inside.cancel()
            async for _ in chunks:
                pass
        raise


def _usage(u: _Usage) -> Usage:
    details = u.completion_tokens_details
    return Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
        reasoning_tokens=details.reasoning_tokens if details else None,
    )


def _merge_tool_calls(calls: dict[int, ToolCall], deltas: list[_ToolCallDelta]) -> None:
    for d in deltas:
        call = calls.get(d.index)
        if call is None:
            call = calls[d.index] = ToolCall(id="", function=ToolCallFunction())
        if d.id:
            call.id = d.id
        if d.function is not None:
            if d.function.name:
                call.function.name += d.function.name
            if d.function.arguments:
                call.function.arguments += d.function.arguments


def _ordered(calls: dict[int, ToolCall]) -> list[ToolCall] | None:
    return [calls[i] for i in sorted(calls)] if calls else None


async def _error_text(response: httpx.Response) -> str:
    body = b""
    with trio.CancelScope() as reading:
        async for part in response.aiter_raw():
            body += part
            if len(body) >= _MAX_ERROR_BODY:
                reading.cancel()  # not break: see _relay
    message = body[:_MAX_ERROR_BODY].decode("utf-8", "replace")
    try:
        parsed = msgspec.json.decode(body)
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            message = str(parsed["error"].get("message") or message)
    except msgspec.DecodeError:
        pass
    return f"upstream returned {response.status_code}: {message}"
