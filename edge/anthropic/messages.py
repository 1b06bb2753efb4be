"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (the Anthropic
Messages API, as Claude Code speaks it).

The request is decoded (:mod:`edge.anthropic.codec`) into the chat path's
request and lives the chat path's life (:class:`edge.openai.turn.Turn`):
admission and the queue, failover, timeouts, cancellation, tool validation
and retries (:func:`edge.openai.turn.collect_validated`), shaping
(:class:`edge.openai.shaping.Shaper`) and usage. Only the encoding differs:
a request with tools is collected and validated, then sent as whole blocks;
one without streams live. As on the chat path, a stream commits at its run's
first event (or a due keep-alive, here ``event: ping``), so a failure before
that is a real HTTP error, in Anthropic's shape.

``count_tokens`` answers the edge's estimate (characters / 4, plus 4 per
message: :func:`edge.openai.request.estimate_input_tokens`), not a tokenizer's count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import structlog

from edge import errors
from edge.anthropic.codec import PING, MessageStream, chat_body, error_body, message_body, stream_error
from edge.errors import RunFailed
from edge.openai.exchange import SSE_HEADERS, ErrorShape, Exchange
from edge.openai.output import http_error
from edge.openai.request import decode_body, estimate_input_tokens, parse_chat_request
from edge.openai.shaping import Shaper
from edge.openai.tools import with_ids
from edge.openai.turn import Collected, Turn, collect_validated, failure
from edge.runs import Run, Slot
from proto.frames import COMPLETE, DELTA, REASONING_DELTA

if TYPE_CHECKING:
    from edge.app import Edge

log = structlog.get_logger("iop.edge.messages")
_encode = msgspec.json.Encoder().encode

ANTHROPIC_ERRORS = ErrorShape(error_body, stream_error)


def _decode(edge: Edge, ex: Exchange, body: bytes) -> tuple[dict, dict]:
    """The raw Messages body and the chat request it becomes (both validated)."""
    raw = decode_body(body)
    model = raw.get("model")
    if isinstance(model, str):
        ex.access.model = model
    stream = raw.get("stream")
    ex.access.stream = stream if isinstance(stream, bool) else None
    chat, server_tools = chat_body(raw)
    if server_tools:
        log.info("server tools left out", tools=server_tools[:20])
    return raw, chat


async def count_tokens(edge: Edge, ex: Exchange, body: bytes) -> None:
    cfg = edge.config
    _, chat = _decode(edge, ex, body)
    req, _ = parse_chat_request(chat, max_messages=cfg.max_messages, max_tools=cfg.max_tools)
    ex.access.outcome = "counted"
    await ex.respond(200, _encode({"input_tokens": estimate_input_tokens(req)}))


async def messages(edge: Edge, ex: Exchange, body: bytes) -> None:
    cfg = edge.config
    _, chat = _decode(edge, ex, body)
    req, forward = parse_chat_request(
        chat, max_messages=cfg.max_messages, max_tools=cfg.max_tools, max_output_tokens=cfg.max_output_tokens
    )
    turn = Turn(edge, ex, req, forward)
    if turn.contract is not None:
        problem = turn.contract.check_request()
        if problem:
            raise errors.bad_request(problem, "tools")
    access = ex.access
    try:
        slot = await turn.acquire()
        if not turn.stream:
            await _respond_whole(turn, slot)
        elif turn.contract is not None or turn.buffered:
            await _stream_buffered(turn, slot)
        else:
            await _stream_live(turn, slot)
    finally:
        # What the access line (edge.openai.routes) reports of the run.
        run = turn.last_run
        if turn.outcome is not None:
            access.outcome = turn.outcome
        elif run is not None:
            access.outcome = run.cause or "unknown"
        access.node_id = turn.node_id or None
        access.usage, access.usage_estimated = turn.usage, turn.usage_estimated


def _message_id(ex: Exchange) -> str:
    return "msg_" + ex.request_id.removeprefix("req_")


async def _fail(turn: Turn, failed: RunFailed) -> None:
    """Tell the client: an HTTP error if nothing was sent yet, else ``event: error``."""
    turn.outcome = failed.cause
    if turn.ex.started:
        await turn.ex.finish(stream_error(failed.message, failed.type))
    else:
        await turn.ex.respond_error(http_error(failed, turn.last_run))


# -- a whole message ---------------------------------------------------------------


async def _respond_whole(turn: Turn, slot: Slot) -> None:
    try:
        result = await collect_validated(turn, slot)
    except RunFailed as failed:
        await _fail(turn, failed)
        return
    body = message_body(
        _message_id(turn.ex),
        turn.req.model,
        reasoning=result.reasoning,
        content=result.content,
        tool_calls=result.tool_calls,
        finish_reason=result.finish_reason,
        usage=result.usage,
    )
    await turn.ex.respond(200, body)


# -- a buffered stream (requests with tools) ---------------------------------------


async def _stream_buffered(turn: Turn, slot: Slot) -> None:
    """Collect (and validate) the whole run, sending only pings, then every block."""
    ex = turn.ex
    enc = MessageStream(_message_id(ex), turn.req.model)

    async def commit() -> None:
        if not ex.started:
            await ex.start(200, SSE_HEADERS)
            await ex.write(enc.start(turn.estimate))

    async def keep_alive() -> None:
        await commit()
        await ex.write(PING)

    try:
        result = await collect_validated(turn, slot, on_idle=keep_alive, on_started=commit)
    except RunFailed as failed:
        await _fail(turn, failed)
        return
    await commit()
    await ex.finish(collected_events(enc, result))


def collected_events(enc: MessageStream, result: Collected) -> bytes:
    parts = []
    if result.reasoning:
        parts.append(enc.thinking(result.reasoning))
    parts.append(enc.text(result.content))
    parts.extend(enc.tool_use(call) for call in result.tool_calls or ())
    parts.append(enc.finish(result.finish_reason, result.usage))
    return b"".join(parts)


# -- a live stream -----------------------------------------------------------------


async def _stream_live(turn: Turn, slot: Slot) -> None:
    try:
        await turn.run_on(slot, lambda run: _write_live(turn, run))
    except RunFailed as failed:  # before the stream committed
        await _fail(turn, failed)


async def _write_live(turn: Turn, run: Run) -> None:
    """Raises :class:`RunFailed` if the run fails before the stream commits."""
    ex = turn.ex
    enc = MessageStream(_message_id(ex), turn.req.model)
    out: list[bytes] = []
    shaper = Shaper(
        turn.policy,
        include_reasoning=turn.req.reasoning_included(),
        live=True,
        on_content=lambda text: out.append(enc.text(text)),
        on_reasoning=lambda text: out.append(enc.thinking(text)),
    )
    keepalive = turn.edge.config.keepalive_s
    try:
        while True:
            batch = await run.next_batch_within(keepalive)
            if not ex.started:
                if batch is not None and batch[0].type not in (DELTA, REASONING_DELTA, COMPLETE):
                    raise failure(batch[0], run)
                await ex.start(200, SSE_HEADERS)
                out.append(enc.start(turn.estimate))
            if batch is None:
                out.append(PING)
                data = b"".join(out)
                out.clear()
                await ex.write(data)
                continue
            end: bytes | None = None
            for event in batch:
                kind = event.type
                if kind == DELTA:
                    shaper.content(event.text)
                elif kind == REASONING_DELTA:
                    shaper.reasoning(event.text)
                elif kind == COMPLETE:
                    end = _complete(turn, run, shaper, enc, event)
                    break
                else:
                    failed = failure(event, run)
                    turn.outcome = failed.cause
                    end = stream_error(failed.message, failed.type)
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
        log.info("message stream closed", content_len=shaper.content_len, reasoning_len=shaper.reasoning_len)


def _complete(turn: Turn, run: Run, shaper: Shaper, enc: MessageStream, event) -> bytes:
    usage = turn.usage_of(run, event)
    shaper.finish()  # flushes held-back text through the callbacks
    parts: list[bytes] = []
    finish_reason = event.finish_reason or "stop"
    calls = with_ids(event.tool_calls) if event.tool_calls else None
    fallback = shaper.fallback(finish_reason, bool(calls))
    if fallback:
        parts.append(enc.text(fallback))
    for call in calls or ():
        parts.append(enc.tool_use(call))
    if calls and finish_reason != "length":
        finish_reason = "tool_calls"
    parts.append(enc.finish(finish_reason, usage))
    return b"".join(parts)
