"""The node link's websocket on raw ASGI, in front of Quart.

Through Quart, each frame a node sends crossed hypercorn's app channel, then
Quart's own receiving task, a signal and a second channel, before the link's
reader had it: two task switches per frame on the edge's busiest path (node
-> edge events). :func:`link_route` serves ``/v1/node/link`` itself:
:class:`RawWebsocket` reads hypercorn's ASGI ``receive`` directly and gives
:func:`edge.link.node_link` the few calls it makes (headers, accept, receive,
send, close, and an HTTP refusal before accepting).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("iop.edge.link")

PATH = "/v1/node/link"


class LinkGone(Exception):
    """The node's side of the websocket is gone (ASGI ``websocket.disconnect``)."""


class RawWebsocket:
    __slots__ = ("headers", "_receive", "_send", "_extensions", "accepted", "closed")

    def __init__(self, scope: dict, receive, send) -> None:
        # Header names lowercased; a repeated header keeps its first value.
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        self.headers = headers
        self._receive = receive
        self._send = send
        self._extensions = scope.get("extensions") or {}
        self.accepted = False
        self.closed = False

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name.lower(), default)

    async def accept(self) -> None:
        message = await self._receive()
        if message["type"] != "websocket.connect":
            raise LinkGone
        await self._send({"type": "websocket.accept"})
        self.accepted = True

    async def receive(self) -> bytes | str:
        while True:
            message = await self._receive()
            kind = message["type"]
            if kind == "websocket.receive":
                data = message.get("bytes")
                return data if data is not None else message.get("text") or ""
            if kind == "websocket.disconnect":
                self.closed = True
                raise LinkGone

    async def send(self, data: bytes) -> None:
        await self._send({"type": "websocket.send", "bytes": data})

    async def close(self, code: int, reason: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        await self._send({"type": "websocket.close", "code": code, "reason": reason})

    async def refuse(self, status: int, body: bytes) -> None:
        """An HTTP response instead of the upgrade (before :meth:`accept`), when
        the server can send one; else the handshake is closed."""
        self.closed = True
        if "websocket.http.response" not in self._extensions:
            await self._send({"type": "websocket.close", "code": 1008})
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await self._send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await self._send({"type": "websocket.http.response.body", "body": body, "more_body": False})


def link_route(handler: Callable[[RawWebsocket], Awaitable[None]], inner):
    """ASGI: ``/v1/node/link`` websockets go to ``handler``; the rest to ``inner``."""

    async def asgi(scope, receive, send) -> None:
        if scope["type"] != "websocket" or scope["path"] != PATH:
            await inner(scope, receive, send)
            return
        ws = RawWebsocket(scope, receive, send)
        try:
            await handler(ws)
        except BaseException as error:  # noqa: BLE001 (re-raised below unless it is ours to end)
            rest: BaseException | None = error
            if isinstance(error, LinkGone):
                rest = None
            elif isinstance(error, BaseExceptionGroup):
                rest = error.split(LinkGone)[1]
            if rest is None:  # the node went away: nothing left to send
                return
            if not isinstance(rest, Exception):  # cancelled (the edge is stopping)
                raise
            log.exception("node link failed")
            if ws.accepted:
                await ws.close(1011, "internal error in the edge")
            return
        if ws.accepted:
            await ws.close(1000)

    return asgi
