"""ASGI middleware in front of Quart for the OpenAI POST routes.

Quart serves everything else (models, health, metrics, the node link); these
routes run on raw ASGI so that one nursery per request owns the body, the
admission wait, the run and every write, and the client's disconnect cancels
exactly that nursery.
"""

from __future__ import annotations

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


def openai_routes(edge: Edge, quart_asgi):
    async def asgi(scope, receive, send) -> None:
        if scope["type"] == "http":
            handler = ROUTES.get(scope["path"])
            if handler is not None:
                if scope["method"] != "POST":
                    ex = Exchange(scope, receive, send)
                    await ex.respond_error(APIError(405, "Method not allowed; use POST.", code="method_not_allowed"))
                    return
                await _serve(edge, handler, Exchange(scope, receive, send))
                return
        await quart_asgi(scope, receive, send)

    return asgi


async def _serve(edge: Edge, handler: Handler, ex: Exchange) -> None:
    async with trio.open_nursery() as nursery:
        try:
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
            pass
        except APIError as e:
            if not ex.started:
                await ex.respond_error(e)
            elif not ex.finished:
                await ex.finish(sse_error(e.message, e.type, e.code))
        except Exception:
            log.exception("request failed")
            if not ex.started:
                await ex.respond_error(APIError(500, "Internal error in the edge.", "server_error"))
            elif not ex.finished:
                await ex.finish(sse_error("internal error in the edge", "server_error"))
        finally:
            nursery.cancel_scope.cancel()
