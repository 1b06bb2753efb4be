"""ASGI middleware in front of Quart for the OpenAI POST routes.

Quart serves everything else (models, health, metrics, the node link); these
routes run on raw ASGI so that one nursery per request owns the body, the
admission wait, the run and every write, and the client's disconnect cancels
exactly that nursery. Every request here gets a request id (``req_`` + hex,
the ``x-request-id`` of its response), one access line with its real status,
and one count in ``iop_requests_total``, rejections included.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog
import trio

from edge.errors import APIError
from edge.openai.chat import chat_completions
from edge.openai.exchange import ClientGone, Exchange
from edge.openai.passthrough import tunnel_route
from edge.openai.sse import sse_error

if TYPE_CHECKING:
    from edge.app import Edge

log = structlog.get_logger("iop.edge.http")

Handler = Callable[["Edge", Exchange, bytes], Awaitable[None]]

ROUTES: dict[str, Handler] = {
    "/v1/chat/completions": chat_completions,
    "/v1/completions": tunnel_route("/completions"),
    "/v1/embeddings": tunnel_route("/embeddings"),
}

CLIENT_CLOSED = 499  # the access line's status when the client left before any response (nginx's)
_MAX_MODEL_LOGGED = 256  # a model name is the client's string: bounded in the log


def openai_routes(edge: Edge, quart_asgi):
    async def asgi(scope, receive, send) -> None:
        if scope["type"] == "http":
            handler = ROUTES.get(scope["path"])
            if handler is not None:
                await _serve(edge, handler, Exchange(scope, receive, send))
                return
        await quart_asgi(scope, receive, send)

    return asgi


async def _serve(edge: Edge, handler: Handler, ex: Exchange) -> None:
    """One request: its response (every one carries ``x-request-id``), then
    its one access line and its count in ``iop_requests_total``."""
    t0 = time.perf_counter()
    structlog.contextvars.bind_contextvars(request_id=ex.request_id)
    outcome: str | None = None  # what ended it, when the handler did not say
    try:
        async with trio.open_nursery() as nursery:
            try:
                if ex.scope["method"] != "POST":
                    raise APIError(405, "Method not allowed; use POST.", code="method_not_allowed")
                problem = edge.refuse_request(ex)
                if problem is not None:
                    raise problem
                # The framework's body timeout does not reach raw ASGI: bound it here.
                try:
                    with trio.fail_after(edge.config.body_timeout_s):
                        body = await ex.read_body(edge.config.max_body_bytes)
                except trio.TooSlowError:
                    raise APIError(
                        408,
                        f"The request body did not arrive within {edge.config.body_timeout_s:g} s.",
                        code="request_timeout",
                    ) from None
                nursery.start_soon(ex.watch_disconnect, nursery.cancel_scope)
                await handler(edge, ex, body)
            except ClientGone:
                outcome = "client_gone"
            except APIError as e:
                outcome = f"rejected_{e.status}"
                if not ex.started:
                    await ex.respond_error(e)
                elif not ex.finished:
                    await ex.finish(sse_error(e.message, e.type, e.code))
            except Exception:
                outcome = "internal_error"
                log.exception("request failed")
                if not ex.started:
                    await ex.respond_error(APIError(500, "Internal error in the edge.", "server_error"))
                elif not ex.finished:
                    await ex.finish(sse_error("internal error in the edge", "server_error"))
            finally:
                nursery.cancel_scope.cancel()
    finally:
        _access(edge, ex, outcome, time.perf_counter() - t0)
        structlog.contextvars.unbind_contextvars("request_id", "run_id")


def _access(edge: Edge, ex: Exchange, outcome: str | None, seconds: float) -> None:
    """The request's one access line (no prompt text, no keys) and its counts."""
    access = ex.access
    if access.outcome is not None:
        outcome = access.outcome
    elif outcome is None:
        outcome = "unknown" if ex.finished else "client_gone"
    metrics = edge.metrics
    model = metrics.model_label(access.model)
    metrics.requests.labels(model, outcome).inc()
    usage = access.usage
    if access.usage_estimated:
        metrics.usage_estimated.labels(model).inc()
    log.info(
        "request",
        request_id=ex.request_id,
        method=ex.scope["method"],
        route=ex.scope["path"],
        model=access.model[:_MAX_MODEL_LOGGED] if access.model is not None else None,
        stream=access.stream,
        status=ex.status if ex.started else CLIENT_CLOSED,
        cause=outcome,
        node_id=access.node_id,
        prompt_tokens=usage.prompt_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else None,
        usage_estimated=access.usage_estimated if usage else None,
        duration_ms=round(seconds * 1000, 1),
    )
