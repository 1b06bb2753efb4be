"""The raw provider tunnel: byte-identical relay of a provider's response.

Used for models in ``response_mode = "passthrough"`` (chat completions) and
always for ``POST /v1/completions`` and ``POST /v1/embeddings``, on nodes
that allow passthrough for the model. Only ``model`` in the request body is
rewritten (to the node's target); the provider's status, headers (hop-by-hop
ones removed) and body bytes reach the client unchanged. An error before the
provider's response starts is a 502 ``provider_tunnel_error``; after it, the
response is cut (the connection closes without the final chunk).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from edge import errors
from edge.errors import APIError
from edge.openai.exchange import Exchange
from edge.openai.request import decode_body
from edge.runs import Run, Want
from edge.runs.run import CANCELLED, NODE_LOST, TIMEOUT, consume_run
from edge.runs.service import session_key
from proto import RunEvent

if TYPE_CHECKING:
    from edge.app import Edge

log = structlog.get_logger("iop.edge.passthrough")

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_encode = msgspec.json.Encoder().encode


def tunnel_route(path: str):
    """A handler relaying ``POST /v1<path>`` through the tunnel."""

    async def handler(edge: Edge, ex: Exchange, body: bytes) -> None:
        await passthrough(edge, ex, decode_body(body), path)

    return handler


async def passthrough(edge: Edge, ex: Exchange, raw: dict[str, Any], path: str) -> None:
    """Relay one request whose body is ``raw`` (decoded once by the caller)."""
    if not isinstance(raw.get("model"), str) or not raw["model"]:
        raise errors.bad_request("Missing required parameter: `model`.", "model")
    model = raw["model"]
    ex.access.model = model
    ex.access.stream = bool(raw.get("stream"))
    session = (ex.header(b"x-session-id") or b"").decode("latin-1") or (
        raw.get("user") if isinstance(raw.get("user"), str) else None
    )
    want = Want(model, session=session_key(session), tunnel=True)
    await edge.admit(ex, model, 0, None)
    slot = await edge.runs.acquire(want, ex)
    raw["model"] = slot.info.target
    headers = []
    for name in (b"accept", b"content-type"):
        value = ex.header(name)
        if value is not None:
            headers.append((name.decode(), value.decode("latin-1")))
    run = edge.runs.start_tunnel(
        slot,
        want=want,
        method="POST",
        path=path,
        body=_encode(raw),
        stream=bool(raw.get("stream")),
        headers=headers,
        api=ex.api,
        client=ex,
    )
    structlog.contextvars.bind_contextvars(run_id=run.id)
    ex.access.node_id = slot.link.node_id
    try:
        await consume_run(run, partial(_relay, ex))
    finally:
        ex.access.outcome = run.cause or "unknown"  # the access line: edge.openai.routes


async def _relay(ex: Exchange, run: Run) -> None:
    """Write the tunnel's frames to the client as they come."""
    while True:
        batch = await run.next_batch()
        body: list[bytes] = []
        for item in batch:
            if isinstance(item, RunEvent):  # the edge ended it: timeout, node lost, slow client
                await _flush(ex, body)
                if run.cause == CANCELLED and not ex.started:
                    await ex.respond_error(errors.operator_cancelled(item.text))
                elif not ex.started:
                    status = 504 if run.cause == TIMEOUT else 502
                    code = "node_disconnected" if run.cause == NODE_LOST else None
                    await ex.respond_error(
                        APIError(status, item.text or "tunnel failed", "provider_tunnel_error", code=code)
                    )
                return  # after the start: cut
            kind = item.kind
            if kind == "body":
                if not ex.started:
                    await ex.start(200, [])
                body.append(item.body)
            elif kind == "response_start":
                if not ex.started:
                    await ex.start(item.status or 200, _response_headers(item.headers))
            elif kind == "end":
                if not ex.started:
                    await ex.respond_error(
                        APIError(502, "tunnel ended before the provider's response", "provider_tunnel_error")
                    )
                    return
                await ex.finish(b"".join(body))
                return
            elif kind == "error":
                await _flush(ex, body)
                if not ex.started:
                    await ex.respond_error(
                        APIError(502, item.error or "provider tunnel failed", "provider_tunnel_error")
                    )
                else:
                    log.warning("tunnel error after the response started; cutting it", error=item.error)
                return
            # "usage" frames are sideband and never merged into the body.
        await _flush(ex, body)


async def _flush(ex: Exchange, body: list[bytes]) -> None:
    if body and ex.started:
        data = b"".join(body)
        body.clear()
        await ex.write(data)


def _response_headers(headers: list[tuple[str, str]] | None) -> list[tuple[bytes, bytes]]:
    return [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in headers or ()
        if name.lower() not in HOP_BY_HOP
    ]
