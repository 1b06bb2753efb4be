"""The node link's websocket on raw ASGI, in front of Quart.

Through Quart, each frame a node sends crossed hypercorn's app channel, then
Quart's own receiving task, a signal and a second channel, before the link's
reader had it: two task switches per frame on the edge's busiest path (node
-> edge events). :func:`link_route` serves ``/v1/node/link`` itself:
:class:`RawWebsocket` reads hypercorn's ASGI ``receive`` directly and gives
:func:`edge.link.node_link` the few calls it makes (headers, accept, receive,
send, close, and an HTTP refusal before accepting).

The edge's frames to a node take a shorter way too (:class:`DirectFrames`):
through ASGI each crossed WSStream.app_send, wsproto's framing, H11Protocol
and TCPServer.protocol_send (a lock, a shielded cancel scope) before
``send_all``. When nothing else is being sent on the connection, the link's
writer frames its binary messages itself (a server's frames are not masked)
and hands every frame that is waiting to the kernel in one ``send``; the
rest of a write the kernel took only part of goes out under hypercorn's lock.
Anything unusual (an extension such as permessage-deflate, a closing
connection, TLS, another server) goes the ASGI way.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import structlog
import trio
from wsproto.connection import ConnectionState

from edge.errors import error_json
from edge.frame_limit import DIRECT, LinkHold, PeerHold, ReadBudget, link_hold, peer_of
from edge.openai.direct import plain_tcp, send_locked
from edge.reads import read_as_link
from proto.wsframes import binary_head

log = structlog.get_logger("iop.edge.link")

PATH = "/v1/node/link"


class LinkGone(Exception):
    """The node's side of the websocket is gone (ASGI ``websocket.disconnect``)."""


class DirectFrames:
    """Binary messages straight to a websocket's socket (hypercorn 0.18, HTTP/1.1
    upgrade, plain TCP, no extension); every link it follows is checked."""

    __slots__ = ("_ws", "_connection", "_socket", "_raw", "_stream", "_lock")

    def __init__(self, ws: Any, connection: Any, stream: trio.SocketStream, raw: socket.socket, lock: Any) -> None:
        # hypercorn's stream: once it is closed, the ASGI way drops what is sent (a frame wsproto
        # refused leaves wsproto OPEN), so a direct write after it would leave a gap before it
        self._ws = ws
        self._connection = connection  # wsproto's: its state says whether frames may still be sent
        self._stream = stream
        self._socket = stream.socket
        self._raw = raw
        self._lock = lock

    @classmethod
    def find(cls, send: Any) -> DirectFrames | None:
        """The connection behind hypercorn's ASGI ``send``, once the websocket is accepted."""
        ws = getattr(send, "__self__", None)
        if type(ws).__name__ != "WSStream":
            return None
        wired = plain_tcp(getattr(ws, "send", None))  # WSStream.send -> H11Protocol.stream_send
        try:
            connection = ws.connection
            extensions = connection._proto.extensions
        except AttributeError:
            return None
        if wired is None or extensions or connection.state is not ConnectionState.OPEN:
            return None
        return cls(ws, connection, *wired)

    def write(self, messages: list[bytes]) -> bytes | None:
        """Send ``messages`` as frames, in one write: None if nothing was sent
        (send them the ASGI way), else what the kernel did not take (b"" when
        all), which must go out with :meth:`send_rest` before anything else."""
        if (
            self._lock.locked()
            or self._ws.closed
            or self._connection.state is not ConnectionState.OPEN
            or self._socket.fileno() < 0
        ):
            return None
        parts = []
        for message in messages:
            parts.append(binary_head(len(message)))
            parts.append(message)
        data = b"".join(parts)
        try:
            sent = self._raw.send(data)
        except OSError:  # full (EAGAIN) or broken: nothing was written
            return None
        return data[sent:]

    async def send_rest(self, rest: bytes) -> None:
        await send_locked(self._lock, self._stream, rest)


class RawWebsocket:
    __slots__ = ("headers", "_receive", "_send", "_extensions", "_direct", "accepted", "closed", "hold", "peer")

    def __init__(self, scope: dict, receive, send) -> None:
        # Header names lowercased; a repeated header keeps its first value.
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        self.headers = headers
        self._receive = receive
        self._send = send
        self._extensions = scope.get("extensions") or {}
        self._direct: DirectFrames | None = None
        self.accepted = False
        self.closed = False
        # The link's part of the edge's time (edge.frame_limit; under hypercorn, the stream's
        # own from read_into on): the link's reader adds what it spends on its runs to `served`.
        self.hold = LinkHold(PeerHold(0.0))
        client = scope.get("client")
        self.peer = peer_of(str(client[0])) if client else ""  # (behind trusted proxies: the address they name)

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name.lower(), default)

    async def accept(self) -> None:
        message = await self._receive()
        if message["type"] != "websocket.connect":
            raise LinkGone
        await self._send({"type": "websocket.accept"})
        self.accepted = True
        self._direct = DirectFrames.find(self._send)
        stream = getattr(self._send, "__self__", None)
        if type(stream).__name__ == "WSStream":
            self.hold = link_hold(stream, self.peer)

    def _payload(self, message: dict) -> bytes | str | None:
        """A received message's payload; None for any other ASGI message;
        :class:`LinkGone` for the disconnect."""
        kind = message["type"]
        if kind == "websocket.receive":
            data = message.get("bytes")
            return data if data is not None else message.get("text") or ""
        if kind == "websocket.disconnect":
            self.closed = True
            raise LinkGone
        return None

    async def receive(self) -> bytes | str:
        while (data := self._payload(await self._receive())) is None:
            pass
        return data

    async def read_into(self, on_message: Callable[[bytes | str], None]) -> NoReturn:
        """Hand every message to ``on_message`` (synchronous) as it arrives,
        until the node leaves (:class:`LinkGone`) or ``on_message`` raises
        (raised here). Under hypercorn it is called from hypercorn's own
        reader task, through the stream's ``app_put`` (or, for the usual whole
        binary message, straight from :mod:`edge.frame_limit`'s reader): no
        channel and no task switch per message, and hypercorn reads no further
        until it returns."""
        stream = getattr(self._send, "__self__", None)
        put = getattr(stream, "app_put", None)
        queued = getattr(self._receive, "__self__", None)  # hypercorn's channel to the app
        if type(stream).__name__ != "WSStream" or put is None or not hasattr(queued, "receive_nowait"):
            budget = ReadBudget(trio.current_time())  # under hypercorn, edge.frame_limit reads by budget
            while True:
                on_message(await self.receive())
                now = trio.current_time()
                if until := budget.spend(1, now):
                    await trio.sleep_until(until)
        ended = trio.Event()
        outcome: list[BaseException] = []

        def take(message: dict) -> None:
            try:
                data = self._payload(message)
                if data is not None:
                    on_message(data)
            except Exception as error:  # noqa: BLE001 (LinkGone or on_message's: raised in the link's task below)
                outcome.append(error)
                ended.set()

        async def app_put(message: dict) -> None:
            if not ended.is_set():  # once the link ends, what still comes is dropped
                take(message)

        def take_whole(data: bytes) -> None:  # a binary message edge.frame_limit read itself
            if ended.is_set():
                return
            try:
                on_message(data)
            except Exception as error:  # noqa: BLE001 (as in take)
                outcome.append(error)
                ended.set()

        while not ended.is_set():  # what was queued before: first, and without a schedule point in between
            try:
                take(queued.receive_nowait())
            except trio.WouldBlock:
                break
        self.hold = link_hold(stream)
        stream.app_put = app_put
        stream.__dict__[DIRECT] = take_whole
        read_as_link(stream)
        try:
            await ended.wait()
        finally:
            ended.set()
        raise outcome[0]

    async def send(self, data: bytes) -> None:
        await self._send({"type": "websocket.send", "bytes": data})

    async def send_many(self, messages: list[bytes]) -> None:
        """Binary messages in order: in one write to the kernel when it can
        (:class:`DirectFrames`), else one ASGI send each. A schedule point."""
        direct = self._direct
        rest = direct.write(messages) if direct is not None else None
        if rest is None:
            for message in messages:
                await self.send(message)
        elif rest:
            await direct.send_rest(rest)
        else:
            await trio.lowlevel.checkpoint()

    def write_now(self, message: bytes) -> bytes | None:
        """One binary message straight to the socket, when it can go that way
        (:meth:`DirectFrames.write`): None if nothing was sent, else what the
        kernel did not take, for :meth:`send_rest` before anything else."""
        direct = self._direct
        return direct.write([message]) if direct is not None else None

    async def send_rest(self, rest: bytes) -> None:
        await self._direct.send_rest(rest)

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
        if scope["type"] != "websocket":
            await inner(scope, receive, send)
            return
        ws = RawWebsocket(scope, receive, send)
        if scope["path"] != PATH:  # (a node with a typo in its edge URL: said on both sides, not only the node's)
            client = scope.get("client")
            log.warning(
                "websocket upgrade to an unknown path refused",
                path=scope["path"][:128],
                client=f"{client[0]}:{client[1]}" if client else None,
            )
            body = error_json(f"Unknown route: nodes link at {PATH}.", "invalid_request_error", code="unknown_route")
            await ws.refuse(404, body)
            return
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
            if not isinstance(rest, Exception):  # cancelled (the edge is stopping, or the server's connection)
                raise rest from None  # (without the LinkGone: a group that held it was "Error in ASGI Framework")
            log.exception("node link failed")
            if ws.accepted:
                await ws.close(1011, "internal error in the edge")
            return
        if ws.accepted:
            await ws.close(1000)

    return asgi
