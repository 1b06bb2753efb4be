"""``POST /v1/chat/completions``.

The request's life, all inside the nursery that :mod:`edge.openai.routes`
opens per request (a client disconnect cancels it):

1. parse and validate the body (400);
2. admission: a slot on a node (404, 503, 429; waiting in the queue);
3. start the run; a task in the request's nursery enforces the wait timeout
   and the run deadline (:meth:`Turn.run_on`);
4. shape events into SSE chunks (live or buffered) or one JSON body
   (:mod:`edge.openai.output`); a request with tools is collected and its
   calls validated, and retried, before the client sees them;
5. ``finally``: :meth:`Run.close` cancels the run on the node unless it has
   ended, and frees the slot. It is synchronous: nothing to shield.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from edge import errors
from edge.errors import APIError
from edge.openai import output
from edge.openai.exchange import Exchange
from edge.openai.passthrough import passthrough
from edge.openai.request import decode_body, parse_chat_request
from edge.openai.turn import Turn

if TYPE_CHECKING:
    from edge.app import Edge

log = structlog.get_logger("iop.edge.chat")


async def chat_completions(edge: Edge, ex: Exchange, body: bytes) -> None:
    cfg = edge.config
    raw = decode_body(body)
    model = raw.get("model")
    if isinstance(model, str) and cfg.policy(model).response_mode == "passthrough":
        # The provider gets the body as sent (only `model` rewritten): no chat schema check.
        await passthrough(edge, ex, raw, "/chat/completions")
        return
    req, forward = parse_chat_request(
        raw, max_messages=cfg.max_messages, max_tools=cfg.max_tools, max_output_tokens=cfg.max_output_tokens
    )
    turn = Turn(edge, ex, req, forward)
    if turn.contract is not None:
        problem = turn.contract.check_request()
        if problem:
            raise errors.bad_request(problem, "tools")
    t0 = time.perf_counter()
    outcome = "unknown"
    try:
        try:
            slot = await turn.acquire()
        except APIError as e:
            outcome = f"rejected_{e.status}"
            raise
        if not turn.stream:
            await output.respond_whole(turn, slot)
        elif turn.buffered:
            await output.stream_buffered(turn, slot)
        else:
            await output.stream_live(turn, slot)
    finally:
        run = turn.last_run
        if turn.outcome is not None:
            outcome = turn.outcome
        elif run is not None:
            outcome = run.cause or "unknown"
        edge.metrics.requests.labels(edge.metrics.model_label(req.model), outcome).inc()
        log.info(
            "chat completion",
            model=req.model,
            node_id=turn.node_id or None,
            stream=turn.stream,
            status=ex.status,
            cause=outcome,
            prompt_tokens=turn.usage.prompt_tokens if turn.usage else None,
            completion_tokens=turn.usage.completion_tokens if turn.usage else None,
            duration_ms=round((time.perf_counter() - t0) * 1000, 1),
        )
        structlog.contextvars.unbind_contextvars("run_id")
