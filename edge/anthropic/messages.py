"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (the Anthropic
Messages API, as Claude Code speaks it).

The request is decoded (:mod:`edge.anthropic.codec`) into the chat path's
request and lives the chat path's life (:class:`edge.openai.turn.Turn`):
admission and the queue, failover, timeouts, cancellation, tool validation
and retries (:func:`edge.openai.turn.collect_validated`), shaping
(:class:`edge.openai.shaping.Shaper`) and usage, and chat's stream loops
(:func:`edge.openai.output.stream_live`, :func:`~edge.openai.output.stream_buffered`).
Only the encoders here differ: a request with tools is collected and
validated, then sent as whole blocks (:class:`MessagesBuffered`); one without
streams live (:class:`MessagesLive`). As on the chat path, a stream commits
at its run's first event (or a due keep-alive, here ``event: ping``), so a
failure before that is a real HTTP error, in Anthropic's shape.

``count_tokens`` answers the edge's estimate (characters / 4, plus 4 per
message: :func:`edge.openai.request.estimate_input_tokens`), not a tokenizer's count.
It counts against its key's ``rpm`` (not its tpm or daily budget: it generates nothing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import structlog

from edge.anthropic.codec import (
    PING,
    MessageStream,
    chat_body,
    error_body,
    message_body,
    refused,
    session_id,
    stopped,
    stream_error,
    thinking_budget_problem,
    thread_problem,
)
from edge.errors import APIError, RunFailed, bad_request, model_not_found
from edge.openai import output
from edge.openai.exchange import ErrorShape, Exchange
from edge.openai.request import (
    MAX_CONTENT_PARTS,
    check_message_count,
    check_tool_count,
    decode_body,
    estimate_input_tokens,
    parse_chat_request,
)
from edge.openai.turn import Collected, Turn, collect_validated, end_reason, one_at_a_time, open_turn
from edge.runs import Run, Slot
from proto import RunEvent, ToolCall

if TYPE_CHECKING:
    from edge.app import Edge
    from edge.openai.schema import ChatRequest

log = structlog.get_logger("iop.edge.messages")
_encode = msgspec.json.Encoder().encode

ANTHROPIC_ERRORS = ErrorShape(error_body, stream_error)


class MessagesExchange(Exchange):
    """An exchange on a Messages route: every answer, errors included, also
    carries the request id as ``request-id``, the header Anthropic's SDKs read
    (``message._request_id``, ``APIStatusError.request_id``), not ``x-request-id``."""

    __slots__ = ()

    def _head(self, status: int, headers) -> dict:
        head = super()._head(status, headers)
        head["headers"].append((b"request-id", self.request_id.encode()))
        return head


async def no_such_route(edge: Edge, ex: Exchange, body: bytes) -> None:
    """Any other path under ``/v1/messages`` (``/v1/messages/batches``, ...): a 404 in Anthropic's shape."""
    path = ex.scope["path"][:200]  # the client's string: bounded
    raise APIError(
        404,
        f"Not found: {ex.scope['method']} {path}. This edge serves POST /v1/messages and /v1/messages/count_tokens.",
        "not_found_error",
        code="route_not_found",
    )


async def _decode(edge: Edge, ex: Exchange, body: bytes) -> tuple[dict, dict]:
    """The raw Messages body and the chat request it becomes (both validated)."""
    # (int64: the chat body made of it leaves unknown fields out, never encoded)
    raw = await decode_body(body, max_messages=edge.config.max_messages, max_tools=edge.config.max_tools, int64=True)
    model = raw.get("model")
    if isinstance(model, str):
        ex.access.model = model
    stream = raw.get("stream")
    ex.access.stream = stream if isinstance(stream, bool) else (False if stream is None else None)
    problem = thread_problem(raw)  # before the history is read: a continued thread sends only its new turn
    if problem is not None:
        try:
            raise problem
        finally:
            problem = None  # (its traceback holds this frame: a cycle that held the exchange)
    check_message_count(raw.get("messages"), edge.config.max_messages, "messages")  # (before either is translated)
    check_tool_count(raw.get("tools"), edge.config.max_tools)
    chat, server_tools = chat_body(raw)
    if server_tools:
        log.info("server tools left out", tools=[t[:64] for t in server_tools[:20]])
    return raw, chat


async def count_tokens(edge: Edge, ex: Exchange, body: bytes) -> None:
    cfg = edge.config
    raw, chat = await _decode(edge, ex, body)

    def read() -> tuple[ChatRequest, int]:  # (a heavy body's, one at a time, as a message's turn is made)
        req, _ = parse_chat_request(chat, max_messages=cfg.max_messages + MAX_CONTENT_PARTS, max_tools=cfg.max_tools)
        return req, estimate_input_tokens(req)

    req, tokens = await one_at_a_time(ex, read)
    if edge.runs.links and not edge.runs.is_known(req.model):  # as a message would be (no node at all: unknowable)
        raise edge.runs.unknown_model(req.model)
    if ex.key is not None and not ex.key.may_use(req.model):  # (nor learn that it exists)
        raise model_not_found(req.model)
    await edge.count_request(ex)  # one of the key's rpm
    ex.access.outcome = "counted"
    await ex.respond(200, _encode({"input_tokens": tokens}))


async def messages(edge: Edge, ex: Exchange, body: bytes) -> None:
    raw, chat = await _decode(edge, ex, body)
    if raw.get("max_tokens") is None:  # required by the Messages API (count_tokens takes none)
        raise bad_request("max_tokens: Field required", "max_tokens")
    problem = thinking_budget_problem(raw, ex.header(b"anthropic-beta") or b"")
    if problem is not None:
        try:
            raise problem
        finally:
            problem = None  # (as in _decode)
    session = session_id(raw)  # (not in `chat`: the model server is not sent it)
    del raw
    del body  # (see routes._serve)
    turn = await open_turn(edge, ex, chat, converted=True, session=session)
    del chat  # the turn keeps what it forwards
    access = ex.access
    try:
        slot = await turn.acquire()
        if not turn.stream:
            await _respond_whole(turn, slot)
        elif turn.buffered:  # (with tools, unless tool_stream = "live")
            await output.stream_buffered(turn, slot, MessagesBuffered(turn))
        else:
            await output.stream_live(turn, slot, MessagesLive)
    finally:
        turn.report(access)


def _message_id(ex: Exchange) -> str:
    return "msg_" + ex.request_id.removeprefix("req_")


# -- a whole message ---------------------------------------------------------------


async def _respond_whole(turn: Turn, slot: Slot) -> None:
    try:
        result = await collect_validated(turn, slot)
    except RunFailed as failed:
        await output.fail(turn, failed, stream_error)
        return
    finish_reason = refused(result.finish_reason, result.refusal)
    body = message_body(
        _message_id(turn.ex),
        turn.req.model,
        reasoning=result.reasoning,
        content=result.content,
        tool_calls=result.tool_calls,
        finish_reason=finish_reason,
        usage=result.usage,
        stop_sequence=_stop_sequence(turn, finish_reason, result.stop),
        refusal=result.refusal,
    )
    await turn.ex.respond(200, body)


# -- the encoders of output's stream loops -----------------------------------------


class MessagesBuffered:
    """A collected run as Messages events (the encoder of
    :func:`output.stream_buffered`): ``message_start`` at the commit,
    ``event: ping`` meanwhile, then every block."""

    keep_alive = PING

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.enc = MessageStream(_message_id(turn.ex), turn.req.model)

    def opening(self) -> bytes:
        return self.enc.start(self.turn.estimate)

    def error(self, message: str, type: str, code: str | None = None) -> bytes:
        return self.enc.error(message, type, output.futile(self.turn, type))

    def whole(self, run: Run, result: Collected) -> bytes:
        finish_reason = refused(result.finish_reason, result.refusal)
        return collected_events(self.enc, result, _stop_sequence(self.turn, finish_reason, result.stop))


def _stop_sequence(turn: Turn, finish_reason: str, stop: str) -> str | None:
    asked = turn.req.stop  # the request's stop_sequences, as chat's `stop`
    return stopped(finish_reason, stop, [asked] if isinstance(asked, str) else asked)[1]


def collected_events(enc: MessageStream, result: Collected, stop_sequence: str | None = None) -> bytes:
    parts = []
    if result.reasoning:
        parts.append(enc.thinking(result.reasoning))
    parts.append(enc.text(result.content))
    if result.refusal:
        parts.append(enc.refusal(result.refusal))
    parts.extend(enc.tool_use(call) for call in result.tool_calls or ())
    parts.append(enc.finish(refused(result.finish_reason, result.refusal), result.usage, stop_sequence))
    return b"".join(parts)


class MessagesLive(output.ToolLive):
    """A run's events as Messages events as they arrive (the encoder of
    :func:`output.stream_live`, which owns the commit and keep-alives); with
    tools and ``tool_stream = "live"``, text streams and the calls are
    validated at the end (:class:`output.ToolLive`)."""

    keep_alive = PING

    def __init__(self, turn: Turn, run: Run, previous: MessagesLive | None = None, attempt: int = 1) -> None:
        super().__init__(turn, run, attempt)
        # (a retry's: the stream's, so one message and its block indexes throughout)
        self.enc = enc = previous.enc if previous is not None else MessageStream(_message_id(turn.ex), turn.req.model)
        self.shaper = self.shape_tools(enc.text, enc.thinking)

    def text(self, text: str) -> bytes:
        return self.enc.text(text)

    def opening(self) -> bytes:
        return self.enc.start(self.turn.estimate)

    def error(self, message: str, type: str, code: str | None = None) -> bytes:
        return self.enc.error(message, type, output.futile(self.turn, type))

    def tail(self, event: RunEvent, calls: list[ToolCall] | None, usage) -> bytes:
        enc = self.enc
        parts: list[bytes] = []
        calls = self.turn.calls_to_send(calls)
        finish_reason = end_reason(event.finish_reason or "stop", bool(calls))  # (as the fallback names it)
        fallback = "" if event.refusal else self.shaper.fallback(finish_reason, bool(calls), own_block=True)
        if fallback:
            parts.append(enc.text(fallback))
        if event.refusal:
            parts.append(enc.refusal(event.refusal))
        for call in calls or ():
            parts.append(enc.tool_use(call))
        finish_reason = refused(finish_reason, event.refusal)
        parts.append(enc.finish(finish_reason, usage, _stop_sequence(self.turn, finish_reason, event.stop)))
        return b"".join(parts)
