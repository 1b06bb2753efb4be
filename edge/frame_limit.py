"""The link's message limit, enforced before hypercorn buffers a byte past it.

Why: hypercorn 0.18's ``WSStream`` appends every data event to its message
buffer and only then compares the length with ``websocket_max_message_size``;
past the limit it sends a 1009 close but keeps the connection, so the next
events are appended again before the same check fails. A node that ignores the
close (one header declaring 2^40 bytes, or fragments that never end) grows the
edge by the link's speed until the ping timeout: 2.1 GiB in 15 s on loopback.
With permessage-deflate (which hypercorn always accepts) it is worse: each
fragment is inflated before the check, 1.4 MB on the wire made 0.9 GiB.

What: ``install()`` wraps ``WSStream.handle`` (the one entry point for the
peer's bytes, HTTP/1.1 and HTTP/2 alike):

- the upgrade request reaches hypercorn without ``Sec-WebSocket-Extensions``,
  so compression is declined (nodes don't offer it) and a message's size on the
  wire is its size;
- ``FrameLimit`` reads the frame headers in the bytes before wsproto sees them
  and adds up the payload lengths they declare per message; a message declared
  over the limit is refused at its header, before any of its payload is
  buffered: the edge sends the 1009 close (message too big) and ends the stream
  at once, so the connection closes and the app sees the link go.

Written against hypercorn 0.18 (pyproject pins >=0.18,<0.19). It relies on
``WSStream.handle``/``_send_wsproto_event``/``send``, its ``closed``,
``handshake.accepted``, ``state``, ``app_put``, ``_send_error_response``,
``config.websocket_max_message_size``, ``client`` and ``stream_id``, and
on ``Request``/``Data``/``Body``/``StreamClosed`` events;
``install()`` refuses another hypercorn series, and tests/test_hostile_link.py
checks the behaviour end to end.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata

import structlog
import trio
from hypercorn.protocol.events import Body, Data, EndBody, Request, Response, StreamClosed
from hypercorn.protocol.ws_stream import ASGIWebsocketState, WSStream
from wsproto.events import CloseConnection
from wsproto.frame_protocol import CloseReason

from edge.connection import refusal

log = structlog.get_logger("iop.edge.link")

HYPERCORN_SERIES = "0.18."
EXTENSIONS = b"sec-websocket-extensions"
STATE = "_iop_frame_limit"  # the FrameLimit of one WSStream, kept in its __dict__
BUDGET = "_iop_read_budget"  # its ReadBudget


class FrameLimit:
    """Sans-I/O: the payload sizes a peer's frame headers declare, per message.

    Feed it the bytes a websocket client sends, in order, across any split;
    ``exceeded`` turns true at the header that takes a data message (its
    fragments added up) over ``limit``. Control frames don't count (wsproto
    caps them at 125 bytes). Protocol errors are left to wsproto.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._header = bytearray()  # a frame header split across reads
        self._payload_left = 0  # payload bytes of the current frame still to come
        self._message = 0  # payload declared so far by the data message in progress
        self.frames = 0  # frame headers read so far, of every kind (data, continuation, control)

    def _header_size(self) -> int:
        if len(self._header) < 2:
            return 2
        short = self._header[1] & 0x7F
        extended = 2 if short == 126 else 8 if short == 127 else 0
        masked = 4 if self._header[1] & 0x80 else 0
        return 2 + extended + masked

    def exceeded(self, data: bytes) -> bool:
        """Take the next bytes from the peer; true if a header in them passes the limit."""
        view = memoryview(data)
        while view:
            if self._payload_left:
                step = min(self._payload_left, len(view))
                self._payload_left -= step
                view = view[step:]
                continue
            need = self._header_size() - len(self._header)
            self._header += view[:need]
            view = view[need:]
            if len(self._header) == self._header_size() and self._frame_over_limit():
                return True
        return False

    def _frame_over_limit(self) -> bool:
        self.frames += 1
        header, self._header = self._header, bytearray()
        fin, opcode, short = header[0] & 0x80, header[0] & 0x0F, header[1] & 0x7F
        if short == 126:
            length = int.from_bytes(header[2:4], "big")
        elif short == 127:
            length = int.from_bytes(header[2:10], "big")
        else:
            length = short
        self._payload_left = length
        if opcode & 0x8:  # control frame
            return False
        self._message += length
        over = self._message > self.limit
        if fin:
            self._message = 0
        return over


# How fast a link is read: a token bucket of FRAMES_PER_S frames a second (a burst of
# FRAMES_BURST), each frame of any kind (data, continuation, ping) costing one and every
# BYTES_PER_TOKEN bytes one more. Past it, hypercorn's reader of that link waits (TCP
# holds the rest at the node): a node flooding tiny frames, empty continuation fragments or
# pings slows itself, not the edge (57,000 pings a second took 79% of the edge's CPU and
# other clients' p50 from 80 to 780 ms; zero-length fragments, 2,423 ms). An honest busy
# node sends events in batches, a few hundred frames a second (measured: 150-200 at 300
# streams), and a reader that waits makes it batch more.
FRAMES_PER_S = 10_000
FRAMES_BURST = 1_000
BYTES_PER_TOKEN = 8192  # so at most about 80 MB a second


class ReadBudget:
    """Sans-I/O token bucket (the clock is passed in)."""

    __slots__ = ("tokens", "at")

    def __init__(self, now: float) -> None:
        self.tokens = float(FRAMES_BURST)
        self.at = now

    def spend(self, cost: float, now: float) -> float:
        """Take ``cost``; 0.0, or the time the link may be read again."""
        tokens = min(FRAMES_BURST, self.tokens + (now - self.at) * FRAMES_PER_S) - cost
        self.tokens, self.at = tokens, now
        return 0.0 if tokens >= 0 else now - tokens / FRAMES_PER_S


async def _refuse(stream: WSStream) -> None:
    log.warning(
        "node link closed: message over the frame limit",
        limit=stream.config.websocket_max_message_size,
        peer=stream.client[0] if stream.client else None,
    )
    await stream._send_wsproto_event(CloseConnection(code=CloseReason.MESSAGE_TOO_BIG))
    await stream.send(StreamClosed(stream_id=stream.stream_id))


def install() -> None:
    """Wrap ``WSStream.handle`` (idempotent). Raises on a hypercorn it wasn't written for."""
    version = importlib.metadata.version("hypercorn")
    if not version.startswith(HYPERCORN_SERIES):
        raise RuntimeError(
            f"edge.frame_limit patches hypercorn {HYPERCORN_SERIES}x internals; "
            f"hypercorn {version} is installed: review the patch"
        )
    if getattr(WSStream.handle, "frame_limit", False):
        return
    if not hasattr(WSStream, "_send_wsproto_event"):
        raise RuntimeError("hypercorn's WSStream is not the one edge.frame_limit was written for: review it")
    hypercorn_handle = WSStream.handle

    async def handle(self: WSStream, event) -> None:
        if isinstance(event, Request):
            headers = [(name, value) for name, value in event.headers if name.lower() != EXTENSIONS]
            event = dataclasses.replace(event, headers=headers)
        elif isinstance(event, (Body, Data)) and not self.closed and not self.handshake.accepted:
            # A body with the upgrade request: hypercorn answers 400 and only then marks the stream
            # closed, so the app's answer (a 401 for the token) meeting the connection in between
            # broke it, with two error tracebacks in the log for any client. Closed first here, and
            # no second answer when the app's has begun (then the bytes are dropped).
            if self.state == ASGIWebsocketState.HANDSHAKE:
                self.closed = True
                message = "A websocket upgrade carries no body."
                headers, body = refusal(self.config, 400, message, "body_with_upgrade")
                await self.send(Response(stream_id=self.stream_id, status_code=400, headers=headers))
                await self.send(Body(stream_id=self.stream_id, data=body))
                await self.send(EndBody(stream_id=self.stream_id))
                await self.send(StreamClosed(stream_id=self.stream_id))  # (the connection closes)
                if self.app_put is not None:  # the link's handler, waiting for the node's hello, ends now
                    await self.app_put({"type": "websocket.disconnect", "code": 1006})
            return
        elif isinstance(event, (Body, Data)) and not self.closed and self.handshake.accepted:
            limit = self.__dict__.get(STATE) or self.__dict__.setdefault(
                STATE, FrameLimit(self.config.websocket_max_message_size)
            )
            if limit.exceeded(event.data):
                await _refuse(self)
                return
            # Past its budget, the link's reader waits before these bytes are handled.
            now = trio.current_time()
            budget = self.__dict__.get(BUDGET) or self.__dict__.setdefault(BUDGET, ReadBudget(now))
            frames, limit.frames = limit.frames, 0
            until = budget.spend(frames + len(event.data) // BYTES_PER_TOKEN, now)
            if until:
                await trio.sleep_until(until)
        await hypercorn_handle(self, event)

    handle.frame_limit = True  # type: ignore[attr-defined]
    WSStream.handle = handle  # type: ignore[method-assign]
