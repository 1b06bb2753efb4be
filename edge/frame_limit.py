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

The same wrapper reads a node link's common frames itself (:func:`whole_messages`):
when wsproto and hypercorn hold no part of a frame or message, the leading
bytes that are whole, final, masked binary frames within the limit (a node's
every frame, almost always) are unmasked here and handed to the link's reader
(``DIRECT``, set by :meth:`edge.ws.RawWebsocket.read_into`) at once. Measured,
wsproto's parse, hypercorn's message buffer and the ASGI message between them
were a third of the edge's CPU per token at 200 paced streams. The first byte
of anything else (a control frame, a fragment, text, reserved bits, a length
not in its shortest form, a frame the read has not all of) and all after it go
the wsproto way, so pings, closes, fragments and protocol errors are handled as
before, and wsproto, which has seen nothing of the bytes taken here, resumes at
a frame boundary. The frames taken are handled as if they had come in a read of
their own: before the read's budget wait (below), and before a later frame of
the same read is refused over the limit (an outside differential fuzz of 1,300
byte streams against the code before found these two, and nothing else, to
differ: a refusal's close code can then be the link's own 4003 where the stream
used to end without one).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata

import structlog
import trio
from hypercorn.protocol.events import Body, Data, EndBody, Request, Response, StreamClosed
from hypercorn.protocol.ws_stream import ASGIWebsocketState, WSStream
from wsproto.connection import ConnectionState
from wsproto.events import CloseConnection
from wsproto.frame_protocol import CloseReason

from edge.connection import refusal
from proto.wsframes import xor_mask

log = structlog.get_logger("iop.edge.link")

HYPERCORN_SERIES = "0.18."
EXTENSIONS = b"sec-websocket-extensions"
STATE = "_iop_frame_limit"  # the FrameLimit of one WSStream, kept in its __dict__
BUDGET = "_iop_read_budget"  # its ReadBudget
DIRECT = "_iop_direct"  # the link reader's callable for a whole binary message (bytes), when it takes them so
WHOLE_BINARY = 0x82  # a frame's first byte: final, no reserved bits, binary


def whole_messages(data: bytes, limit: int) -> tuple[list[bytes], int]:
    """Sans-I/O: the payloads (unmasked) of the whole, final, masked binary
    frames of at most ``limit`` bytes that ``data`` begins with, and the
    offset of the first byte after them. ``data`` must begin at a frame
    boundary with no message in progress."""
    out: list[bytes] = []
    view = memoryview(data)
    pos, n = 0, len(data)
    while n - pos >= 6 and data[pos] == WHOLE_BINARY:
        second = data[pos + 1]
        if not second & 0x80:  # unmasked: wsproto's protocol error
            break
        size, head = second & 0x7F, pos + 2
        if size == 126:
            if n - head < 6:
                break
            size, head = int.from_bytes(data[head : head + 2], "big"), head + 2
            if size < 126:  # not the shortest form: wsproto's protocol error
                break
        elif size == 127:
            if n - head < 12:
                break
            size, head = int.from_bytes(data[head : head + 8], "big"), head + 8
            if size < 1 << 16:  # (also a first bit set: refused over the limit)
                break
        start = head + 4
        end = start + size
        if end > n or size > limit:
            break
        out.append(xor_mask(view[start:end], data[head:start]))
        pos = end
    return out, pos


def _idle(stream: WSStream, limit: FrameLimit) -> bool:
    """Neither wsproto, nor hypercorn's message buffer, nor ``limit`` holds
    part of a frame or message, and the connection is open."""
    connection = stream.connection
    try:
        proto = connection._proto
        decoder = proto._frame_decoder
        return (
            connection.state is ConnectionState.OPEN
            and not connection._events
            and decoder.header is None
            and not len(decoder.buffer)
            and proto._message_decoder.opcode is None
            and stream.buffer.value is None
            and limit.idle()
        )
    except AttributeError:  # (another wsproto: the wsproto way)
        return False


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

    def idle(self) -> bool:
        """At a frame boundary with no message in progress."""
        return not self._header and not self._payload_left and not self._message

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
            size = len(event.data)
            direct = self.__dict__.get(DIRECT)
            taken = 0
            if direct is not None and _idle(self, limit):
                messages, used = whole_messages(event.data, limit.limit)
                if messages:
                    for message in messages:
                        direct(message)
                    taken = len(messages)
                    if used == size:
                        event = None
                    else:
                        event = dataclasses.replace(event, data=event.data[used:])
            if event is not None and limit.exceeded(event.data):
                await _refuse(self)
                return
            # Past its budget, the link's reader waits before the rest is handled (or read).
            now = trio.current_time()
            budget = self.__dict__.get(BUDGET) or self.__dict__.setdefault(BUDGET, ReadBudget(now))
            frames, limit.frames = limit.frames + taken, 0
            until = budget.spend(frames + size // BYTES_PER_TOKEN, now)
            if until:
                await trio.sleep_until(until)
            if event is None:
                return
        await hypercorn_handle(self, event)

    handle.frame_limit = True  # type: ignore[attr-defined]
    WSStream.handle = handle  # type: ignore[method-assign]
