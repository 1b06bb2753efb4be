"""``POST /v1/responses``: the Responses codec (:mod:`edge.openai.responses`)
on the chat path's request life.

The body is decoded into a chat completion body and validated by
:func:`parse_chat_request`; a :class:`Turn` then does admission (queue, 429),
placement and failover, timeouts, cancellation and usage, as for chat. Three
ways out, as chat:

- not streamed: :func:`collect_validated`, then one ``response`` object;
- streamed with function tools (or a strict buffered model): collected and
  validated (and retried) first, keep-alives meanwhile, then every item,
  through :func:`output.stream_buffered` with :class:`ResponsesBuffered`;
- streamed without tools: live, through :func:`output.stream_live` with
  :class:`ResponsesLive` as its encoder.

A stream commits at the run's first event (or a due keep-alive), so a
failure before it is an HTTP error in the OpenAI shape; after it, the
stream ends with ``response.failed``, never silently.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from edge.errors import APIError, RunFailed, error_json
from edge.openai import output
from edge.openai.exchange import SSE_HEADERS, ErrorShape, Exchange
from edge.openai.request import check_message_count, check_tool_count, decode_body
from edge.openai.responses import ResponseEncoder, decode_request
from edge.openai.sse import sse_error
from edge.openai.turn import Collected, Turn, collect_validated, end_reason, open_turn
from edge.runs import Run, Slot
from proto import RunEvent, ToolCall

if TYPE_CHECKING:
    from edge.app import Edge

log = structlog.get_logger("iop.edge.responses")


def _error_body(error: APIError) -> bytes:
    """An HTTP error, the OpenAI shape; a context too small for the request in the Responses
    API's words (its `input` and `max_output_tokens`, where chat's speak of messages)."""
    if error.context is None:
        return error.body()
    if not error.estimated:  # a model server's own words and numbers
        return error_json(error.message, error.type, param="input", code=error.code)
    prompt, asked, largest = error.context
    if asked:
        told = (
            f"you requested {prompt + asked} tokens ({prompt} in the input, {asked} in max_output_tokens;"
            " the input as this edge estimates it). Please reduce the length of the input or max_output_tokens."
        )
    else:
        told = (
            f"your input resulted in {prompt} tokens (as this edge estimates it), leaving no room for"
            " the output. Please reduce the length of the input."
        )
    message = f"This model's maximum context length is {largest} tokens. However, {told}"
    return error_json(message, error.type, param="input", code=error.code)


RESPONSES_ERRORS = ErrorShape(_error_body, sse_error)

_encode = output._encode


async def create_response(edge: Edge, ex: Exchange, body: bytes) -> None:
    cfg = edge.config
    # (int64: as chat and Messages, where an unknown field's 2^64 was a 200, ignored; an outside audit)
    raw = await decode_body(body, max_messages=cfg.max_messages, max_tools=cfg.max_tools, items="input", int64=True)
    del body  # (see routes._serve)
    access = ex.access
    model = raw.get("model")
    if isinstance(model, str):
        access.model = model
    stream = raw.get("stream")
    access.stream = stream if isinstance(stream, bool) else (False if stream is None else None)
    kept = edge.response_items
    scope = ex.key.id if ex.key is not None else ""  # a reference resolves for the key whose response made it
    check_message_count(raw.get("input"), cfg.max_messages, "input")  # before references expand
    check_tool_count(raw.get("tools"), cfg.max_tools)  # (as the client sent them: before they are read)
    decoded = decode_request(raw, max_output_tokens=cfg.max_output_tokens, items=kept.finder(scope, cfg.max_body_bytes))
    keep = None if raw.get("store") is False else (lambda items: kept.keep(scope, items))
    if decoded.ignored_tools or decoded.ignored_items:
        log.info(
            "responses request: left out",
            tool_types=sorted({t[:64] for t in decoded.ignored_tools})[:20],  # a client's strings: bounded
            item_types=sorted({t[:64] for t in decoded.ignored_items})[:20],
        )
    turn = await open_turn(edge, ex, decoded.chat, converted=True, metadata=decoded.echo["metadata"])
    turn.max_tool_calls = decoded.echo["max_tool_calls"]
    enc = ResponseEncoder(
        "resp_" + ex.request_id.removeprefix("req_"),
        turn.req.model,
        int(time.time()),
        decoded.echo,
        decoded.namespaced,
        keep,
    )
    del raw, decoded  # the turn keeps what it forwards, the encoder what it echoes
    try:
        try:
            slot = await turn.acquire()
        except APIError as e:  # an operator's cancel in the queue: as after it (output.stops_codex)
            if not (turn.stream and e.code == "cancelled_by_operator"):
                raise
            turn.outcome = "cancelled"
            await ex.start(200, SSE_HEADERS, enc.opening())
            await ex.finish(enc.failed(e.message, e.type, True))
            return
        if not turn.stream:
            await _respond_whole(turn, slot, enc)
        elif turn.buffered:  # (with tools, unless tool_stream = "live")
            await output.stream_buffered(turn, slot, ResponsesBuffered(turn, enc))
        else:
            await output.stream_live(turn, slot, lambda t, run, _, attempt: ResponsesLive(t, run, enc, attempt))
    except Exception:
        if ex.started and not ex.finished:  # never a silent end
            await ex.finish(enc.failed("internal error in the edge", "server_error"))
        raise
    finally:
        turn.report(access)


async def _respond_whole(turn: Turn, slot: Slot, enc: ResponseEncoder) -> None:
    try:
        result = await collect_validated(turn, slot)
    except RunFailed as failed:
        turn.outcome = failed.cause
        turn.settle_failed()
        await turn.ex.respond_error(output.http_error(failed, turn.last_run))
        return
    response, _ = enc.whole(
        result.content, result.reasoning, result.tool_calls, result.usage, result.finish_reason, result.refusal
    )
    await turn.ex.respond(200, _encode(response))


class ResponsesBuffered:
    """A collected run as Responses events (the encoder of
    :func:`output.stream_buffered`): ``response.created`` at the commit,
    ``response.in_progress`` as the keep-alive meanwhile, then every item."""

    def __init__(self, turn: Turn, enc: ResponseEncoder) -> None:
        self.turn = turn
        self.enc = enc

    @property
    def keep_alive(self) -> bytes:
        return self.enc.in_progress()

    def opening(self) -> bytes:
        return self.enc.opening()

    def error(self, message: str, type: str, code: str | None = None) -> bytes:
        return self.enc.failed(message, type, output.futile(self.turn, type))

    def whole(self, run: Run, result: Collected) -> bytes:
        _, events = self.enc.whole(
            result.content, result.reasoning, result.tool_calls, result.usage, result.finish_reason, result.refusal
        )
        return events


class ResponsesLive(output.ToolLive):
    """A run's events as Responses stream events, as they arrive (the encoder
    of :func:`output.stream_live`, which owns the commit and keep-alives);
    with tools and ``tool_stream = "live"``, text streams and the calls are
    validated at the end (:class:`output.ToolLive`)."""

    def __init__(self, turn: Turn, run: Run, enc: ResponseEncoder, attempt: int = 1) -> None:
        super().__init__(turn, run, attempt)
        self.enc = enc  # (the request's: a retry's events go on the same response)
        self.shaper = self.shape_tools(enc.text, enc.reasoning)

    def text(self, text: str) -> bytes:
        return self.enc.text(text)

    @property
    def keep_alive(self) -> bytes:  # type: ignore[override]  # (a class attribute on LiveEncoder)
        return self.enc.in_progress()

    def opening(self) -> bytes:
        return self.enc.opening()

    def error(self, message: str, type: str, code: str | None = None) -> bytes:
        return self.enc.failed(message, type, output.futile(self.turn, type))

    def tail(self, event: RunEvent, calls: list[ToolCall] | None, usage) -> bytes:
        calls = self.turn.calls_to_send(calls)
        # (the end the client gets, before the fallback names it: a call dropped, no tools offered,
        # had the notice say "tool_calls" on a response that completed)
        finish_reason = end_reason(event.finish_reason or "stop", bool(calls))
        fallback = "" if event.refusal else self.shaper.fallback(finish_reason, bool(calls), own_block=True)
        tail = [self.enc.text(fallback)] if fallback else []
        if event.refusal:
            tail.append(self.enc.refusal(event.refusal))
        elif not tail and not calls and self.enc.empty:
            tail.append(self.enc.text(""))  # an empty answer is one empty message, as a whole response has
        if calls:
            status = "incomplete" if finish_reason == "length" else "completed"
            tail.append(self.enc.function_calls(calls, status))
        return b"".join([*tail, self.enc.completed(usage, finish_reason)])
