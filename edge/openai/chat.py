"""``POST /v1/chat/completions``.

The request's life, all inside the nursery that :mod:`edge.openai.routes`
opens per request (a client disconnect cancels it):

1. parse and validate the body (400);
2. admission: a slot on a node (404, 503, 429; waiting in the queue);
3. start the run; a task in the request's nursery enforces the wait timeout
   and the run deadline;
4. shape events into SSE chunks (live or buffered) or one JSON body;
5. ``finally``: :meth:`Run.close` cancels the run on the node unless it has
   ended, and frees the slot. It is synchronous: nothing to shield.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import trio

from edge import errors
from edge.config import ModelPolicy
from edge.errors import APIError, RunFailed
from edge.openai.exchange import SSE_HEADERS, Exchange
from edge.openai.schema import (
    EDGE_ONLY_FIELDS,
    ChatCompletion,
    ChatRequest,
    CompletionChoice,
    ResponseMessage,
    UsageOut,
)
from edge.openai.shaping import Shaper, holds_xml_tool_use, wrap_in_completion_tool
from edge.openai.sse import DONE, KEEPALIVE, ChunkEncoder, sse_error
from edge.openai.trace import TRACE_METADATA_KEY, StreamTrace, trace_enabled
from edge.runs.run import CLIENT_GONE, NODE_LOST, SLOW_CLIENT, TIMEOUT, Run
from proto import RunEvent, ToolCall, Usage
from proto.frames import COMPLETE, DELTA, REASONING_DELTA

if TYPE_CHECKING:
    from edge.app import Edge

log = structlog.get_logger("iop.edge.chat")



# -- parsing -------------------------------------------------------------------


def _validation_message(err: msgspec.ValidationError) -> tuple[str, str | None]:
    text = str(err)
    param = None
    if " - at `$." in text:
        text, _, path = text.partition(" - at `$.")
        param = path.rstrip("`")
        return f"Invalid value for `{param}`: {text[0].lower()}{text[1:]}.", param
    if text.startswith("Object missing required field `"):
        param = text.split("`")[1]
        return f"Missing required parameter: `{param}`.", param
    return f"Invalid request: {text}", param


def parse_chat_request(body: bytes, *, max_messages: int, max_tools: int) -> tuple[ChatRequest, dict[str, Any]]:
    """The validated request, and the body to forward (edge-only keys removed)."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise errors.bad_request(f"The request body is not valid JSON: {e}.") from None
    if not isinstance(raw, dict):
        raise errors.bad_request("The request body must be a JSON object.")
    try:
        req = msgspec.convert(raw, ChatRequest)
    except msgspec.ValidationError as e:
        message, param = _validation_message(e)
        raise errors.bad_request(message, param) from None
    if len(req.messages) > max_messages:
        raise errors.bad_request(
            f"Too many messages: {len(req.messages)} (at most {max_messages}).", "messages", "too_many_messages"
        )
    if req.tools and len(req.tools) > max_tools:
        raise errors.bad_request(f"Too many tools: {len(req.tools)} (at most {max_tools}).", "tools", "too_many_tools")
    forward = {k: v for k, v in raw.items() if k not in EDGE_ONLY_FIELDS}
    reasoning = forward.get("reasoning")
    if isinstance(reasoning, dict) and set(reasoning) <= {"exclude"}:
        del forward["reasoning"]
    return req, forward


# -- the handler ---------------------------------------------------------------


async def chat_completions(edge: Edge, ex: Exchange, body: bytes) -> None:
    cfg = edge.config
    req, forward = parse_chat_request(body, max_messages=cfg.max_messages, max_tools=cfg.max_tools)
    policy = cfg.policy(req.model)
    session = (ex.header(b"x-session-id") or b"").decode("latin-1") or req.user
    stream = bool(req.stream)
    metadata = {"openai_stream": "true" if stream else "false", "attempt": "1"}
    user_meta = forward.get("metadata")
    if isinstance(user_meta, dict) and TRACE_METADATA_KEY in user_meta:
        metadata[TRACE_METADATA_KEY] = str(user_meta[TRACE_METADATA_KEY])

    t0 = time.perf_counter()
    queued_at = trio.current_time()
    try:
        slot = await edge.runs.acquire(req.model, session=session)
    except APIError as e:
        edge.metrics.requests.labels(req.model, f"rejected_{e.status}").inc()
        raise
    edge.metrics.queue_time.labels(req.model).observe(trio.current_time() - queued_at)
    run = edge.runs.start(slot, forward, metadata=metadata)
    structlog.contextvars.bind_contextvars(run_id=run.id)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run.enforce_timeouts)
            if not stream:
                await _respond_whole(edge, ex, req, run, policy)
            elif policy.strict_output and policy.stream_buffer:
                await _stream_buffered(edge, ex, req, run, policy)
            else:
                await _stream_live(edge, ex, req, run, policy)
            nursery.cancel_scope.cancel()
    except trio.Cancelled:
        run.close(CLIENT_GONE)
        raise
    finally:
        run.close("abandoned")
        edge.metrics.requests.labels(req.model, run.cause or "unknown").inc()
        log.info(
            "chat completion",
            model=req.model,
            node_id=slot.link.node_id,
            stream=stream,
            status=ex.status,
            cause=run.cause,
            duration_ms=round((time.perf_counter() - t0) * 1000, 1),
        )
        structlog.contextvars.unbind_contextvars("run_id")


def _failure(event: RunEvent, run: Run) -> RunFailed:
    cause = run.cause or "run_error"
    message = event.text or "run failed"
    if event.type == "cancelled" and not event.text:
        message = "run cancelled"
    return RunFailed(message, cause=cause, status=event.status)


def _usage_out(usage: Usage | None) -> UsageOut:
    if usage is None:
        return UsageOut()
    details = {"reasoning_tokens": usage.reasoning_tokens} if usage.reasoning_tokens is not None else None
    total = usage.total_tokens
    if total is None and usage.prompt_tokens is not None and usage.completion_tokens is not None:
        total = usage.prompt_tokens + usage.completion_tokens
    return UsageOut(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=total,
        completion_tokens_details=details,
    )


def _tool_calls_out(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "id": c.id,
            "type": "function",
            "function": {"name": c.function.name, "arguments": c.function.arguments},
        }
        for i, c in enumerate(calls)
    ]


# -- live stream -----------------------------------------------------------------


async def _stream_live(edge: Edge, ex: Exchange, req: ChatRequest, run: Run, policy: ModelPolicy) -> None:
    enc = ChunkEncoder(f"chatcmpl-{run.id}", int(time.time()), req.model, policy.reasoning_field)
    out: list[bytes] = []
    trace = StreamTrace() if trace_enabled(run.metadata) else None
    if trace is None:
        on_content = lambda text: out.append(enc.content(text))  # noqa: E731
        on_reasoning = lambda text: out.append(enc.reasoning(text))  # noqa: E731
    else:

        def on_content(text: str) -> None:
            trace.chunk("content", len(text))
            out.append(enc.content(text))

        def on_reasoning(text: str) -> None:
            trace.chunk("reasoning", len(text))
            out.append(enc.reasoning(text))

    shaper = Shaper(
        policy,
        include_reasoning=req.reasoning_included(),
        live=True,
        on_content=on_content,
        on_reasoning=on_reasoning,
    )
    keepalive = edge.config.keepalive_s
    await ex.start(200, SSE_HEADERS)
    await ex.write(enc.role())
    try:
        while True:
            batch = None
            with trio.move_on_after(keepalive):
                batch = await run.next_batch()
            if batch is None:
                await ex.write(KEEPALIVE)
                continue
            end: bytes | None = None
            for event in batch:
                kind = event.type
                if kind == DELTA:
                    if trace is None:
                        shaper.content(event.text)
                    else:
                        mark = trace.emitted
                        shaper.content(event.text)
                        trace.source("content", event.text, mark)
                elif kind == REASONING_DELTA:
                    if trace is None:
                        shaper.reasoning(event.text)
                    else:
                        mark = trace.emitted
                        shaper.reasoning(event.text)
                        trace.source("reasoning", event.text, mark)
                elif kind == COMPLETE:
                    end = _live_complete(shaper, enc, req, event, out, trace)
                    break
                else:
                    failed = _failure(event, run)
                    end = sse_error(failed.message, failed.type)
                    break
            if end is not None:
                out.append(end)
                await ex.finish(b"".join(out))
                return
            if out:
                data = b"".join(out)
                out.clear()
                await ex.write(data)
    finally:
        log.info(
            "chat completion stream closed",
            strict_output=policy.strict_output,
            strict_stream_buffer=policy.stream_buffer,
            content_len=shaper.content_len,
            reasoning_len=shaper.reasoning_len,
        )


def _live_complete(
    shaper: Shaper, enc: ChunkEncoder, req: ChatRequest, event: RunEvent, out: list[bytes], trace: StreamTrace | None
) -> bytes:
    shaper.finish()
    finish_reason = event.finish_reason or "stop"
    tail: list[bytes] = []
    if event.tool_calls:
        tail.append(enc.tool_calls(_tool_calls_out(event.tool_calls)))
        finish_reason = "tool_calls"
        if trace is not None:
            trace.chunk("tool_calls", 0, tool_call_count=len(event.tool_calls))
    fallback = shaper.fallback(finish_reason, bool(event.tool_calls))
    if fallback:
        out.append(enc.content(fallback))
        if trace is not None:
            trace.chunk("content", len(fallback), fallback=True)
    if trace is not None:
        trace.chunk("finish", 0, finish_reason=finish_reason)
    tail.append(enc.finish(finish_reason))
    if req.stream_options is not None and req.stream_options.include_usage:
        tail.append(enc.usage(_usage_out(event.usage)))
    tail.append(DONE)
    return b"".join(tail)


# -- collecting a whole run ----------------------------------------------------


class Collected(msgspec.Struct):
    content: str
    reasoning: str | None
    finish_reason: str
    tool_calls: list[ToolCall] | None
    usage: Usage | None
    normalized: bool = False


async def collect(
    run: Run, req: ChatRequest, policy: ModelPolicy, *, keepalive_s: float | None = None, on_idle=None
) -> Collected:
    """Read the run to its end. Raises :class:`RunFailed` if it fails."""
    shaper = Shaper(policy, include_reasoning=req.reasoning_included(), live=False)
    while True:
        if on_idle is None:
            batch = await run.next_batch()
        else:
            batch = None
            with trio.move_on_after(keepalive_s):
                batch = await run.next_batch()
            if batch is None:
                await on_idle()
                continue
        for event in batch:
            kind = event.type
            if kind == DELTA:
                shaper.content(event.text)
            elif kind == REASONING_DELTA:
                shaper.reasoning(event.text)
            elif kind == COMPLETE:
                shaper.finish()
                return _finish_collected(shaper, policy, event)
            else:
                raise _failure(event, run)


def _finish_collected(shaper: Shaper, policy: ModelPolicy, event: RunEvent) -> Collected:
    finish_reason = event.finish_reason or "stop"
    tool_calls = event.tool_calls or None
    if tool_calls:
        finish_reason = "tool_calls"
    content = shaper.content_text
    normalized = False
    if policy.strict_output and policy.xml_completion_tool and not tool_calls:
        if not holds_xml_tool_use(content, policy.xml_completion_tool):
            content = wrap_in_completion_tool(content, policy.xml_completion_tool)
            normalized = True
    fallback = shaper.fallback(finish_reason, bool(tool_calls))
    if fallback:
        content = fallback
    reasoning = shaper.reasoning_text if shaper.include_reasoning and shaper.reasoning_len else None
    return Collected(content, reasoning, finish_reason, tool_calls, event.usage, normalized)


# -- non-streaming ---------------------------------------------------------------


_encode = msgspec.json.Encoder().encode


async def _respond_whole(edge: Edge, ex: Exchange, req: ChatRequest, run: Run, policy: ModelPolicy) -> None:
    try:
        result = await collect(run, req, policy)
    except RunFailed as failed:
        await ex.respond_error(_http_error(failed, run))
        return
    message = ResponseMessage(
        role="assistant",
        content=result.content if result.content or not result.tool_calls else None,
        tool_calls=_tool_calls_out(result.tool_calls) if result.tool_calls else None,
    )
    body = ChatCompletion(
        id=f"chatcmpl-{run.id}",
        object="chat.completion",
        created=int(time.time()),
        model=req.model,
        choices=[CompletionChoice(index=0, message=message, finish_reason=result.finish_reason)],
        usage=_usage_out(result.usage),
    )
    data = msgspec.to_builtins(body)
    if result.reasoning is not None:
        data["choices"][0]["message"][policy.reasoning_field] = result.reasoning
    await ex.respond(200, _encode(data))


def _http_error(failed: RunFailed, run: Run) -> APIError:
    if 400 <= failed.status < 500:
        return APIError(failed.status, failed.message, "invalid_request_error", code="upstream_rejected")
    if run.cause == TIMEOUT:
        return APIError(504, failed.message, "timeout_error", code="run_timed_out")
    if run.cause == NODE_LOST:
        return APIError(502, failed.message, "run_error", code="node_disconnected")
    if run.cause == SLOW_CLIENT:
        return APIError(500, failed.message, "run_error")
    return APIError(502, failed.message, failed.type)


# -- buffered stream (strict + stream_buffer) ------------------------------------


async def _stream_buffered(edge: Edge, ex: Exchange, req: ChatRequest, run: Run, policy: ModelPolicy) -> None:
    await ex.start(200, SSE_HEADERS)
    try:
        result = await collect(
            run, req, policy, keepalive_s=edge.config.keepalive_s, on_idle=lambda: ex.write(KEEPALIVE)
        )
    except RunFailed as failed:
        await ex.finish(sse_error(failed.message, failed.type))
        return
    enc = ChunkEncoder(f"chatcmpl-{run.id}", int(time.time()), req.model, policy.reasoning_field)
    parts = [enc.role()]
    if result.content:
        parts.append(enc.content(result.content))
    if result.tool_calls:
        parts.append(enc.tool_calls(_tool_calls_out(result.tool_calls)))
    parts.append(enc.finish(result.finish_reason))
    if req.stream_options is not None and req.stream_options.include_usage:
        parts.append(enc.usage(_usage_out(result.usage)))
    parts.append(DONE)
    if trace_enabled(run.metadata):
        trace = StreamTrace()
        trace.chunk("role", 0)
        if result.content:
            trace.chunk("content", len(result.content))
        if result.tool_calls:
            trace.chunk("tool_calls", 0, tool_call_count=len(result.tool_calls))
        trace.chunk("finish", 0, finish_reason=result.finish_reason)
    log.info(
        "chat completion stream closed",
        strict_output=policy.strict_output,
        strict_stream_buffer=policy.stream_buffer,
        xml_completion_tool=policy.xml_completion_tool,
        normalized=result.normalized,
        content_len=len(result.content),
        reasoning_len=len(result.reasoning or ""),
    )
    await ex.finish(b"".join(parts))
