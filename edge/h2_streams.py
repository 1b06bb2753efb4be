"""hypercorn's HTTP/2 streams, hardened: body data for a stream already closed is dropped.

hypercorn 0.18's ``H2Protocol`` looks a stream up by id for every ``DataReceived``
with no guard (its ``StreamEnded`` branch has one). A stream the app answered
before its request body had all come in (a 401 for a bad key, a 404, a 413) is
closed and gone from ``streams``, so the rest of that body raised ``KeyError``
and ended the whole connection: over TLS, behind a proxy that multiplexes clients
on one connection, one client's bad key cut other clients' streams (found from
outside: a stream cut after 11 chunks, with no error event and no ``[DONE]``).

``install()`` gives each ``H2Protocol`` a ``streams`` dict whose missing ids are
a closed stream that takes any event and does nothing; ``in``, ``pop`` and
``len`` see only the real ones. The data's flow-control credit is still given
back (the line after the lookup), so the connection's window does not shrink.

And when the connection closes, every stream's send buffer is closed too:
hypercorn's ``handle(Closed)`` closed the streams but not their buffers, so a
response waiting for its buffer to drain (the client had closed with a zero
flow-control window) waited for ever, holding its run and its node's slot
(found from outside: 4 runs held a model's whole capacity for 280 s).

And a client that resets streams faster than any honest one (HTTP/2 "rapid
reset", CVE-2023-44487), or makes the edge reset them (a frame h2 answers with a
reset, "MadeYouReset", CVE-2025-8671), loses its connection: past a burst of
:data:`RESET_BURST`, at most :data:`RESETS_PER_S` a second, the edge sends
GOAWAY (ENHANCE_YOUR_CALM) and closes it. Each reset stream had started a run,
cancelled at once: the edge freed the slot, but the node still worked through
every request and cancel in turn, and one client's 3,500 resets a second put a
node 17 s behind, the other clients' first tokens 10 s late. So does a client
that floods frames the app never sees (PING acks, WINDOW_UPDATE:
:data:`CONTROL_PER_S`).

And a stream whose client gives it no flow-control credit for the write
timeout (``write_timeout_s``) is reset: its socket may be read all along, so
the connection's own write timeout (:mod:`edge.send_lock`) never fires, and
the request held its answer for as long as the client stayed. Until then its
writes wait: hypercorn's stream buffer let a write through whenever its sender
found the stream's window shut (a pop of nothing "drained" it), so the edge's
writer emptied the run's events into hypercorn's buffer at any rate, out of
reach of ``max_buffered_bytes`` and of a tunnel's hold (found from outside: two
h2c clients that stopped giving credit put 290 MB of two answers in the edge).
A write now waits for the buffer to drain below its low water mark, and each
pop that sends bytes starts the write timeout again (a slow reader's write is
not cut while it progresses).

And a client's graceful GOAWAY (NO_ERROR) lets its streams finish, as RFC 9113 says
(h2 and hypercorn ended the connection at once, cutting its answers short).

And a client's priorities are ignored (a chain of PRIORITY frames made hypercorn's
priority tree recurse past Python's limit), a request without `:path` (a CONNECT) is
refused alone (it raised in hypercorn and ended the connection), and a header block
is at most :data:`MAX_HEADER_BLOCK` bytes (h2 kept 1 MiB of one a connection).

The budgets are spent frame by frame, as h2 parses them: checked once a read
was parsed, a read of 64 KiB of empty SETTINGS frames was 7,281 frames parsed
(and acknowledged) before the check, 79 ms of CPU a connection, and one client
reconnecting took a core.

Written against hypercorn 0.18 (pyproject pins >=0.18,<0.19).
"""

from __future__ import annotations

import importlib.metadata
import time

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.frame_buffer
import structlog
import trio
from h2.stream import StreamState
from hypercorn.events import Closed
from hypercorn.protocol.events import Body, Data, EndBody, EndData, Trailers
from hypercorn.protocol.h2 import BUFFER_LOW_WATER, H2Protocol, StreamBuffer
from hyperframe.frame import (
    AltSvcFrame,
    ContinuationFrame,
    DataFrame,
    ExtensionFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from edge import send_lock

log = structlog.get_logger("iop.edge.http")

# Streams a client may reset at once, and then this many a second; or make the edge reset (a DATA
# frame past a body's end, a WINDOW_UPDATE past a stream's largest window: "MadeYouReset",
# CVE-2025-8671, re-checked; h2 resets the stream, and its run is
# cancelled as by the client's own reset; one client started 3,674 runs in 12 s that way, never
# sent GOAWAY, and the other clients' requests were refused 429 behind them: an outside audit).
RESET_BURST = 200
RESETS_PER_S = 100
# Frames that ask nothing of the app (PING acks, WINDOW_UPDATE, SETTINGS, PRIORITY, unknown
# types): one connection's flood of PING acks took the edge's CPU to 100% and an honest
# client's p50 from 60 to 530 ms (four: 4.0 s). An honest client sends a window update per
# 32 KiB or so it reads (free: FREE_CREDIT); past this budget the connection gets GOAWAY ENHANCE_YOUR_CALM. The
# burst is what a new connection may spend at once: a client reconnecting to spend it again
# costs the edge ~3 ms a connection (at 2,000, a flood of WINDOW_UPDATE: 14 ms).
CONTROL_BURST = 500
CONTROL_PER_S = 1_000
# A SETTINGS frame costs the budget this, plus one for each setting it changes: a frame holds up
# to 2,730 of them (16 KiB), and three connections sending 537 such frames a second each, under
# a count of frames, took a core (found from outside). An honest client sends one or two.
SETTINGS_COST = 50
# A PING (or its ack) costs this: each is answered, and honest clients ping every few seconds.
PING_COST = 5
# Frames that cost the control budget one each (a CONTINUATION too: h2 takes 64 to a header
# block). So do the stream frames that bring the app nothing: a flood of each took a core and
# was never closed (found from outside: 1.2 s of CPU a megabyte, /healthz p50 179 ms), h2
# answering each with a RST_STREAM: any DATA or HEADERS frame for a stream that is closed (reset
# by the client, or ended), a DATA frame under SMALL_DATA for one the edge answered before its
# body was in (an honest client sends the rest of its body in full frames), and an empty DATA
# frame that ends nothing.
SMALL_DATA = 1024
# Small DATA frames of open streams (a body in pieces) are counted per request too (past
# 65,536 a 400, edge.openai.exchange); per connection, over all its streams, at most this many
# at once and then this many a second (one connection fed 100 streams a byte a frame: a core).
PIECES_BURST = 65_536
PIECES_PER_S = 16_384
_CONTROL = (PriorityFrame, ExtensionFrame, AltSvcFrame, ContinuationFrame, GoAwayFrame)
# A header block's bytes, HEADERS and its CONTINUATIONs: h2 keeps them until the block ends, and
# caps only their count (64 frames of 16 KiB: 1 MiB a connection; 100 connections that sent such
# blocks and closed left 122 MB the edge never gave back, an outside audit). Twice hypercorn's
# decoded limit (h2_max_header_list_size, 64 KiB): past it the connection gets ENHANCE_YOUR_CALM.
MAX_HEADER_BLOCK = 128 * 1024
# A WINDOW_UPDATE that gives back credit the edge's data used (its window back to no more than
# it was, by this much or more) is free: an honest client sends one per 32 KiB or so it reads,
# and one reading 21 MB/s got ENHANCE_YOUR_CALM (an outside re-check). Others cost one: tiny
# ones, or credit past any the window had (a client raising its window pays once).
FREE_CREDIT = 1024


class _Calm(h2.exceptions.ProtocolError):
    """Past a budget: h2 sends GOAWAY with this code and stops parsing; hypercorn closes."""

    error_code = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


class _Closed:
    """A stream that is gone: events for it are dropped."""

    __slots__ = ()

    async def handle(self, event: object) -> None:
        return None


_CLOSED = _Closed()


class _Streams(dict):
    __slots__ = ()

    def __missing__(self, stream_id: int) -> _Closed:
        return _CLOSED


def install() -> None:
    """Idempotent. Raises on a hypercorn it was not written for."""
    version = importlib.metadata.version("hypercorn")
    if not version.startswith("0.18."):
        raise RuntimeError(f"edge.h2_streams patches hypercorn 0.18.x internals; hypercorn {version} is installed")
    if getattr(H2Protocol.__init__, "iop_streams", False):
        return
    original = H2Protocol.__init__

    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        if not isinstance(self.streams, dict):
            raise RuntimeError("hypercorn's H2Protocol.streams is not the dict edge.h2_streams was written for")
        self.streams = _Streams(self.streams)
        self.connection._receive_frame = _within_budget(self.connection)  # noqa: SLF001
        frames = self.connection.incoming_buffer
        frames._update_header_buffer = _bounded_blocks(frames)  # noqa: SLF001

    __init__.iop_streams = True  # type: ignore[attr-defined]
    H2Protocol.__init__ = __init__  # type: ignore[method-assign]
    handle = H2Protocol.handle

    async def handle_closing_buffers(self, event) -> None:
        await handle(self, event)
        if isinstance(event, Closed):
            for buffer in list(self.stream_buffers.values()):
                await buffer.close()  # (a drain waiting on it returns)

    H2Protocol.handle = handle_closing_buffers  # type: ignore[method-assign]
    stream_send = H2Protocol.stream_send

    async def stream_send_within(self, event) -> None:
        if not isinstance(event, _BODY_EVENTS):
            await stream_send(self, event)
            return
        timeout = send_lock.write_timeout_of(self.config)
        buffer = self.stream_buffers.get(event.stream_id)
        with trio.move_on_after(timeout) as timer:
            if buffer is not None:
                buffer.iop_waiting = (timer, timeout)  # (its pops that send bytes push the deadline)
            try:
                await stream_send(self, event)
            finally:
                if buffer is not None:
                    buffer.iop_waiting = None
        if timer.cancelled_caught:
            await _reset_stalled(self, event.stream_id)

    H2Protocol.stream_send = stream_send_within  # type: ignore[method-assign]
    StreamBuffer.pop = _pop  # type: ignore[method-assign]
    H2Protocol._priority_updated = _priority_ignored  # type: ignore[method-assign]  # noqa: SLF001
    create_stream = H2Protocol._create_stream  # noqa: SLF001

    async def create_stream_with_a_path(self, request: h2.events.RequestReceived) -> None:
        # A request without `:path` (a CONNECT, as RFC 9113 8.5 allows) raised in hypercorn
        # (UnboundLocalError) and ended the whole connection, its other streams cut with no
        # error (an outside audit): it is refused alone, RST_STREAM.
        if not any(name == b":path" for name, _ in request.headers):
            log.info("stream refused: a request without a path", stream_id=request.stream_id)
            try:
                self.connection.reset_stream(request.stream_id, error_code=h2.errors.ErrorCodes.PROTOCOL_ERROR)
            except h2.exceptions.H2Error:
                pass
            await self._flush()  # noqa: SLF001
            return
        await create_stream(self, request)

    H2Protocol._create_stream = create_stream_with_a_path  # type: ignore[method-assign]  # noqa: SLF001


async def _priority_ignored(self: H2Protocol, event: h2.events.PriorityUpdated) -> None:
    """A client's priorities are not followed (RFC 9113 deprecates them): hypercorn put every
    stream a PRIORITY frame named into its tree, and a chain of 1,000 of them, within the control
    budget, made the ``priority`` package recurse past Python's limit (a 113 KB traceback logged
    a connection, 78% of the edge's CPU for eight clients; an outside audit)."""
    return None


async def _pop(self: StreamBuffer, max_length: int) -> bytes:
    """hypercorn's ``StreamBuffer.pop``, but its writer is let go only once the buffer is below
    its low water mark (hypercorn's: once a pop took less than that, a pop of nothing too, as
    when the stream's window is shut), and a pop that takes bytes pushes the deadline of the
    write waiting on it (:func:`stream_send_within`'s) back by the write timeout."""
    length = min(len(self.buffer), max_length)
    data = bytes(self.buffer[:length])
    del self.buffer[:length]
    if data:
        waiting = getattr(self, "iop_waiting", None)
        if waiting is not None:
            waiting[0].deadline = trio.current_time() + waiting[1]
    if len(self.buffer) < BUFFER_LOW_WATER:
        await self._paused.set()  # noqa: SLF001
    if len(self.buffer) == 0:
        await self._is_empty.set()  # noqa: SLF001
    return data


_BODY_EVENTS = (Body, Data, EndBody, EndData, Trailers)


async def _reset_stalled(protocol: H2Protocol, stream_id: int) -> None:
    """A stream whose client gave it no flow-control credit for the write timeout (its
    socket still read: edge.send_lock's timeout never fires) is reset, as a client's own
    reset would end it: the request hears its client gone, the buffer is dropped."""
    log.warning("stream reset: the client gave it no flow-control credit", stream_id=stream_id)
    stream = protocol.streams.get(stream_id)
    if stream is not None:
        stream.iop_gave_up = True  # (its request's access line says write_timeout: edge.openai.exchange)
    try:
        protocol.connection.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.CANCEL)
    except h2.exceptions.H2Error:
        pass  # (closed meanwhile)
    await protocol._flush()  # noqa: SLF001
    await protocol._close_stream(stream_id)  # noqa: SLF001
    await protocol._window_updated(stream_id)  # noqa: SLF001 (its buffer meets the closed stream and goes)


def _within_budget(connection: h2.connection.H2Connection):
    """h2's ``_receive_frame`` for ``connection``, spending its budgets first."""
    receive_frame = connection._receive_frame  # noqa: SLF001
    resets = _Bucket(RESET_BURST, RESETS_PER_S)
    control = _Bucket(CONTROL_BURST, CONTROL_PER_S)
    pieces = _Bucket(PIECES_BURST, PIECES_PER_S)
    window = [connection.outbound_flow_control_window]  # the connection's largest window so far

    def received(frame):
        events = receive_frame(frame)
        for event in events:  # (a frame the edge answers by resetting its stream: one reset)
            if type(event) is h2.events.StreamReset and not event.remote_reset and not resets.spend(1):
                raise _Calm("streams reset too fast")
        return events

    def receive(frame):
        kind = type(frame)
        if kind is DataFrame or kind is HeadersFrame:
            bucket = _stream_budget(frame, kind, connection, control, pieces)
            if bucket is not None and not bucket.spend(1):
                raise _Calm("too many control frames" if bucket is control else "a body in too many pieces")
            return received(frame)
        if kind is RstStreamFrame:
            if not resets.spend(1):
                raise _Calm("streams reset too fast")
            return receive_frame(frame)
        elif kind is SettingsFrame:
            cost = 1 if "ACK" in frame.flags else SETTINGS_COST + len(frame.settings)
        elif kind is PingFrame:
            cost = PING_COST
        elif kind is WindowUpdateFrame:
            cost = _credit_cost(frame, connection, window)
        elif kind in _CONTROL:
            cost = 1
        else:
            return receive_frame(frame)
        if not control.spend(cost):
            raise _Calm("too many control frames")
        if kind is GoAwayFrame and frame.error_code == 0:
            # A client's graceful GOAWAY: its streams finish (RFC 9113 6.8; Node's session.close(),
            # Go's Shutdown). h2 took it as the connection's end, nothing more to send, and hypercorn
            # closed it: a streamed answer was cut short with no error (the client's library said
            # it ended normally; an outside audit). The connection ends when the client closes it.
            return []
        return received(frame)  # (a WINDOW_UPDATE past a stream's window, too, is reset by h2)

    return receive


def _bounded_blocks(frames: h2.frame_buffer.FrameBuffer):
    """h2's ``FrameBuffer._update_header_buffer`` for ``frames``, which keeps a header block's
    frames until it ends: past :data:`MAX_HEADER_BLOCK` bytes of them, ENHANCE_YOUR_CALM."""
    update = frames._update_header_buffer  # noqa: SLF001

    def bounded(frame):
        if type(frame) is ContinuationFrame or (type(frame) is HeadersFrame and "END_HEADERS" not in frame.flags):
            held = sum(len(f.data) for f in frames._headers_buffer)  # noqa: SLF001 (64 frames at most)
            if held + len(frame.data) > MAX_HEADER_BLOCK:
                raise _Calm("a header block too large")
        return update(frame)

    return bounded


def _credit_cost(frame: WindowUpdateFrame, connection: h2.connection.H2Connection, window: list[int]) -> int:
    """What a WINDOW_UPDATE costs the control budget: nothing when it gives back :data:`FREE_CREDIT`
    or more of the credit the edge's data used (the connection's window back to no more than its
    largest, ``window[0]``; a stream's to no more than the initial window the client set), else 1."""
    increment = frame.window_increment
    if frame.stream_id == 0:
        after = connection.outbound_flow_control_window + increment
        if increment >= FREE_CREDIT and after <= window[0]:
            return 0
        window[0] = max(window[0], after)
        return 1
    stream = connection.streams.get(frame.stream_id)
    if stream is None or increment < FREE_CREDIT:
        return 1
    return int(stream.outbound_flow_control_window + increment > connection.remote_settings.initial_window_size)


def _stream_budget(frame, kind: type, connection: h2.connection.H2Connection, control: _Bucket, pieces: _Bucket):
    """The budget a DATA or HEADERS frame spends one of (None: none): ``control`` for one that
    brings the app nothing, ``pieces`` for a small piece of an open stream's body."""
    stream = connection.streams.get(frame.stream_id)
    if stream is None:  # (a HEADERS frame opening a stream: not yet one of h2's; any other: closed and gone)
        return None if kind is HeadersFrame and frame.stream_id > connection.highest_inbound_stream_id else control
    state = stream.state_machine.state
    if state is StreamState.CLOSED:
        return control
    if kind is HeadersFrame or len(frame.data) >= SMALL_DATA:
        return None
    if state is StreamState.HALF_CLOSED_LOCAL:  # (answered before its body was in)
        return control
    if "END_STREAM" in frame.flags:
        return None
    return pieces if frame.data else control  # (an empty frame that ends nothing)


class _Bucket:
    """A token bucket: ``burst`` at once, then ``per_s`` a second."""

    __slots__ = ("_at", "_burst", "_level", "_per_s")

    def __init__(self, burst: int, per_s: int) -> None:
        self._burst = float(burst)
        self._per_s = per_s
        self._level = float(burst)
        self._at = time.monotonic()

    def spend(self, count: int) -> bool:
        """Take ``count``; False once the bucket is empty."""
        now = time.monotonic()
        self._level = min(self._burst, self._level + (now - self._at) * self._per_s) - count
        self._at = now
        return self._level >= 0
