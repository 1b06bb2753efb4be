"""``POST /v1/chat/completions``.

The request's life, all inside the cancel scope that :mod:`edge.openai.routes`
opens per request (a client disconnect cancels it):

1. parse and validate the body (400);
2. admission: a slot on a node (404, 503, 429; waiting in the queue);
3. start the run; the run service's timers enforce the wait timeout and the
   run deadline (:meth:`Turn.run_on`);
4. shape events into SSE chunks (live or buffered) or one JSON body
   (:mod:`edge.openai.output`); a request with tools is collected and its
   calls validated, and retried, before the client sees them;
5. ``finally``: :meth:`Run.close` cancels the run on the node unless it has
   ended, and frees the slot. It is synchronous: nothing to shield.

The request's one access line and its count in ``iop_requests_total`` are
written by :mod:`edge.openai.routes`, from what the handler records in
``ex.access``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from edge.openai import output
from edge.openai.exchange import Exchange
from edge.openai.passthrough import passthrough
from edge.openai.request import check_message_count, check_tool_count, decode_body
from edge.openai.responses import chat_tools
from edge.openai.turn import open_turn

if TYPE_CHECKING:
    from edge.app import Edge

log = structlog.get_logger("iop.edge.chat")


async def chat_completions(edge: Edge, ex: Exchange, body: bytes) -> None:
    cfg = edge.config
    raw = await decode_body(body, max_messages=cfg.max_messages, max_tools=cfg.max_tools)
    model = raw.get("model")
    access = ex.access
    if isinstance(model, str):
        access.model = model
    stream = raw.get("stream")
    access.stream = stream if isinstance(stream, bool) else (False if stream is None else None)
    if isinstance(model, str) and cfg.policy(model).response_mode == "passthrough":
        # The provider gets the body as sent (only `model` rewritten): no chat schema check, but
        # the edge's counts hold (a large body was counted before it was decoded: the same).
        check_message_count(raw.get("messages"), cfg.max_messages, "messages")
        check_tool_count(raw.get("tools"), cfg.max_tools)
        handling = passthrough(edge, ex, raw, "/chat/completions", body)
        del raw, body  # (the relay holds neither: routes._serve)
        await handling
        return
    del body  # (see routes._serve)
    left_out = chat_tools(raw)  # custom tools and allowed_tools, as the Responses route takes them
    if left_out:
        log.info("chat request: left out", tool_types=sorted(set(left_out)))
    turn = await open_turn(edge, ex, raw)
    del raw  # the turn keeps what it forwards
    try:
        slot = await turn.acquire()
        if not turn.stream:
            await output.respond_whole(turn, slot)
        elif turn.buffered:
            await output.stream_buffered(turn, slot)
        else:
            await output.stream_live(turn, slot)
    finally:
        turn.report(access)
