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
import gc
import importlib.metadata
import ipaddress
import math
from time import thread_time

import structlog
import trio
from hypercorn.protocol.events import Body, Data, EndBody, Request, Response, StreamClosed
from hypercorn.protocol.ws_stream import ASGIWebsocketState, WSStream
from wsproto.connection import ConnectionState
from wsproto.events import CloseConnection
from wsproto.frame_protocol import CloseReason

from edge.connection import refusal
from edge.per_run import per_run
from edge.reads import hold_reading
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
        self._closed = False  # a close frame was read: what follows is not read (wsproto ignores it)

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
        while view and not self._closed:
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
            self._closed = opcode == 0x8
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


# How much of the edge's time node links take, all together. Frames are not alike: a `load` frame
# naming 1,024 models costs the edge 0.3-0.5 ms to decode, 30 times a frame of the same size holding
# text, so the budget above (frames and bytes) let one holder of the node token take 55% of the
# edge's CPU with one link, and 94% with 16 (other clients' /healthz p50 4 -> 420-568 ms). So the
# time the edge spends on a link's bytes (frames parsed, decoded and acted on) is measured, less
# what it spent handing events to the link's runs (shaping them and writing to their clients: the
# edge's work for its clients, most of an honest busy link's time), and the links together are held
# to LINKS_HOLD_PER_S seconds a second, shared fairly between the peers they come from (an address:
# the node's, or behind trusted proxies the one they name), not between links, of which one holder
# of the token may open hundreds (an outside audit: 128 links from one address left an honest node a
# 129th, 656 chunks a second of its 3,853). Each peer that held over PEER_BUSY_S this second or the
# last (busy) has an equal part, shared by its links. A peer within its part never waits; a peer
# past it may take what the others leave of the whole, and waits, as for the budget above, once the
# links together have spent it. So one busy node alone may take the whole, and one beside a flooding
# address at least half. A peer's part outlives its links for a while (PEER_IDLE_S): dialling anew
# brings no time with it. The peers that are not busy together hold at most the whole (edge.link's
# MAX_LINKS, 512, times PEER_BUSY_S).
# Time is the thread's CPU time less the collector's (link_clock): a link pays neither for the
# process being descheduled nor for a collection that fell in its read (a 100 ms full collection
# charged to one link among 17 made it wait 3.4 s, past a test's ping timeout).
LINKS_HOLD_PER_S = 0.5
PEER_BUSY_S = 0.00095  # held in a second, and more: a busy peer
PEER_HOLD_BURST_S = 0.002  # a peer's unused part kept, at most
LINKS_HOLD_BURST_S = 0.05  # the links' unused whole kept, at most
# Links a peer may dial a second (after a burst, which a fleet behind one address reconnecting at
# once fits in): a link's upgrade, hello, setup and end cost the edge 1.5-2 ms that no read of its
# frames is charged, and 16 dialers from one address churning links (dial, hello, one frame,
# close: 460 a second) held the edge at 97-100% (an outside audit).
DIALS_PER_S = 10.0
DIALS_BURST = 64
# Events a second for each of a link's live runs whose handing to the runs (shaping, writing to the
# clients) is not charged: far past any model server's pace (a few hundred tokens a second, a few
# thousand at the fastest), and what comes faster is charged as any frame is. A node that serves a
# model no one else does and streams to its own clients sent 500 one-character deltas a frame for
# each run and took the edge to 100% while charged 0.28 s a second (an outside audit).
EXEMPT_EVENTS_PER_RUN_S = 10_000
# ... and for a link's runs together at most: a node that serves its own clients chooses how many
# runs it has (64 runs' 640,000 events a second, each shaped alone, were more than the edge has).
EXEMPT_EVENTS_PER_LINK_S = 40_000
EVENT_SIZE = 128  # bytes of a frame that count as one event toward the pace (an honest event is 40-100)
PEER_IDLE_S = 60.0  # a peer not read this long is forgotten (when MAX_PEERS are remembered)
MAX_PEERS = 4096  # peers remembered; past it, the half read longest ago are forgotten
SHARE = "_iop_link_hold"  # a stream's LinkHold
_LINKS: trio.lowlevel.RunVar[LinkShare] = trio.lowlevel.RunVar("iop_link_share")  # (an edge's, in a process)


class PeerHold:
    """Sans-I/O: one peer's part (a token bucket of seconds, refilled at the
    whole's rate divided among the busy peers). It starts empty."""

    __slots__ = ("tokens", "at", "second", "held", "waited", "dials", "dialled_at")

    def __init__(self, now: float) -> None:
        self.tokens = 0.0
        self.at = now
        self.dials = float(DIALS_BURST)  # links it may still dial (a token bucket)
        self.dialled_at = now
        self.second = int(now)
        self.held = 0.0  # held this second
        self.waited = 0.0  # its links' waits, in all

    def dial(self, now: float) -> bool:
        """One more link from this peer: True, or False past :data:`DIALS_PER_S`."""
        dials = min(float(DIALS_BURST), self.dials + (now - self.dialled_at) * DIALS_PER_S)
        self.dialled_at = now
        if dials < 1.0:
            self.dials = dials
            return False
        self.dials = dials - 1.0
        return True

    def spend(self, share: LinkShare, held: float, now: float) -> float:
        """Take ``held`` seconds; 0.0, or how long the peer's link waits before it is read again."""
        second = int(now)
        peers = share.peers_busy(second)
        if second != self.second:
            self.second, self.held = second, 0.0
        before, self.held = self.held, self.held + held
        if before < PEER_BUSY_S <= self.held:
            share.busy += 1
            peers = max(peers, share.busy)
        rate = LINKS_HOLD_PER_S / peers
        tokens = min(PEER_HOLD_BURST_S, self.tokens + (now - self.at) * rate) - held
        wait = 0.0
        if share.take(held, now) and tokens < 0:  # past its part when the whole is spent: it waits
            wait = -tokens / rate
            share.waited += wait
            self.waited += wait
        elif tokens < -PEER_HOLD_BURST_S:  # (what others leave of the whole, it may take: no debt for it)
            tokens = -PEER_HOLD_BURST_S
        self.tokens, self.at = tokens, now
        return wait


class LinkShare:
    """Sans-I/O: the edge's links' whole (a token bucket of seconds), its
    peers' parts, and the count of busy peers, by whole seconds of the clock
    passed in (trio's, by default)."""

    __slots__ = ("second", "busy", "busy_before", "tokens", "at", "held", "waited", "peers")

    def __init__(self, now: float | None = None) -> None:
        if now is None:
            now = trio.current_time()
        self.second = int(now)
        self.busy = 0  # peers that held over PEER_BUSY_S this second
        self.busy_before = 0  # ... and in the second before
        self.tokens = LINKS_HOLD_BURST_S
        self.at = now
        self.held = 0.0  # what the links held, in all (iop_link_read_seconds_total)
        self.waited = 0.0  # the links' waits for their parts, in all (iop_link_throttled_seconds_total)
        self.peers: dict[str, PeerHold] = {}

    def peer(self, address: str, now: float) -> PeerHold:
        """``address``'s part (made, and the idle ones forgotten past MAX_PEERS)."""
        hold = self.peers.get(address)
        if hold is None:
            if len(self.peers) >= MAX_PEERS:
                peers = sorted(self.peers.items(), key=lambda item: item[1].at)
                self.peers = {key: peer for key, peer in peers[MAX_PEERS // 2 :] if now - peer.at < PEER_IDLE_S}
            hold = self.peers[address] = PeerHold(now)
        return hold

    def peers_busy(self, second: int) -> int:
        """The busy peers: those of this second or the last, at least one."""
        if second != self.second:
            self.busy_before = self.busy if second == self.second + 1 else 0
            self.busy, self.second = 0, second
        return max(self.busy, self.busy_before, 1)

    def take(self, held: float, now: float) -> float:
        """Take ``held`` from the whole; 0.0, or how long until it is back to none owed."""
        self.held += held
        tokens = min(LINKS_HOLD_BURST_S, self.tokens + (now - self.at) * LINKS_HOLD_PER_S) - held
        self.tokens, self.at = tokens, now
        return 0.0 if tokens >= 0 else -tokens / LINKS_HOLD_PER_S


class LinkHold:
    """Sans-I/O: one link's reads, charged to its peer's part."""

    __slots__ = ("peer", "served", "owed", "over", "until", "waited", "exempt", "exempt_at")

    def __init__(self, peer: PeerHold) -> None:
        self.peer = peer
        self.served = 0.0  # of the read's time, spent on the link's runs (the link's reader adds it: not held)
        self.owed = 0.0  # the link's runs' writers' time on the batches they timed since its last read (Run.shaped)
        self.over = False  # past its exemption, and not yet back to half of it: ``owed`` is charged
        self.until = -math.inf  # the link is not read before then (its node is not silent: its bytes wait here)
        self.waited = 0.0  # its waits, in all (/v1/nodes, the console, iop_node_link_throttled_seconds_total)
        self.exempt = 0.0  # events whose handing to runs may still go uncharged (a token bucket)
        self.exempt_at = -math.inf

    def exempts(self, events: int, runs: int, now: float) -> bool:
        """Whether handing ``events`` to the link's ``runs`` live runs goes uncharged
        (:data:`EXEMPT_EVENTS_PER_RUN_S`, :data:`EXEMPT_EVENTS_PER_LINK_S` at most, a
        second's worth kept at most). Past it, the link is ``over`` until half a second's
        worth is back: meanwhile its runs' writers' time on their batches is charged too (a
        frame within the pace forgave it, so a flood of small frames was never charged)."""
        most = min(EXEMPT_EVENTS_PER_RUN_S * max(runs, 1), EXEMPT_EVENTS_PER_LINK_S)
        exempt = min(most, self.exempt + (now - self.exempt_at) * most) - events
        self.exempt_at = now
        self.exempt = max(exempt, 0.0)
        if exempt < 0:
            self.over = True
            return False
        if self.over and exempt >= most / 2:
            self.over = False
        return True

    def spend(self, share: LinkShare, held: float, now: float) -> float:
        """Take ``held`` seconds; 0.0, or how long the link waits before it is read again."""
        held = max(0.0, held - self.served) + (self.owed if self.over else 0.0)
        self.served = self.owed = 0.0
        wait = self.peer.spend(share, held, now)
        if wait:
            self.until = now + wait
            self.waited += wait
        return wait


def peer_of(address: str) -> str:
    """The peer an address belongs to: an IPv4 address itself (an IPv4-mapped IPv6 one as
    IPv4), an IPv6 address its /64, which one host usually has whole; anything else as it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def may_dial(peer: str) -> bool:
    """A link from ``peer`` (an address) may be upgraded now (:data:`DIALS_PER_S`)."""
    now = trio.current_time()
    return per_run(_LINKS, LinkShare).peer(peer, now).dial(now)


def charge(hold: LinkHold, held: float) -> float:
    """Charge ``held`` seconds of the edge's time to ``hold``'s peer: 0.0, or how
    long the link waits before it is read again."""
    return hold.spend(per_run(_LINKS, LinkShare), held, trio.current_time())


def links_time() -> tuple[float, float]:
    """How long this edge's links have held it, and waited for their parts, in all
    (zeros outside the edge's run)."""
    try:
        share = _LINKS.get()
    except (LookupError, RuntimeError):
        return 0.0, 0.0
    return share.held, share.waited


_COLLECTED = [0.0, 0.0]  # the collector's CPU time in all, and when the running collection began


def _collection(phase: str, _info: dict) -> None:
    if phase == "start":
        _COLLECTED[1] = thread_time()
    else:
        _COLLECTED[0] += thread_time() - _COLLECTED[1]


def link_clock() -> float:
    """The clock a link's time is measured with (seconds)."""
    return thread_time() - _COLLECTED[0]


def link_hold(stream: WSStream, peer: str | None = None) -> LinkHold:
    """``stream``'s :class:`LinkHold`, made at its first use, charged to
    ``peer``'s part (by default the address the stream's bytes come from)."""
    hold = stream.__dict__.get(SHARE)
    if hold is None:
        if peer is None:
            peer = str(stream.client[0]) if stream.client else ""
        now = trio.current_time()
        hold = stream.__dict__[SHARE] = LinkHold(per_run(_LINKS, LinkShare).peer(peer, now))
    return hold


async def _own_time(stream: WSStream, handle, event) -> float:
    """Run ``handle(stream, event)`` (hypercorn's, for what the link's frames do not
    take whole); the link's time in it, less its sends (a ping's answer, a close's),
    which wait for the socket, and meanwhile the rest of the edge runs: charged to the
    link, an honest node's pings were charged another task's CPU (a link sending 20
    pings a second beside a busy event loop was held 1.9 s in 2 s, then waited 3.7 s; a
    fleet behind one address, its nodes dropping and dialling again, waited minutes
    for its reads while shown healthy: an outside audit). The link's messages are
    handled in it, charged: its ``app_put`` (edge.ws's) hands them over with no wait;
    before that (the hello), hypercorn's queue to the app may wait for room, not charged."""
    send, put = stream.send, stream.app_put
    paused = 0.0

    def timed(call):
        async def timed_call(message) -> None:
            nonlocal paused
            at = link_clock()
            try:
                await call(message)
            finally:
                paused += link_clock() - at

        return timed_call

    stream.send = timed_send = timed(send)
    timed_put = None
    if put is not None and DIRECT not in stream.__dict__:  # (not yet the link's own: edge.ws)
        stream.app_put = timed_put = timed(put)
    started = link_clock()
    try:
        await handle(stream, event)
    finally:  # (unless replaced meanwhile: the link's reader takes app_put over while this waits)
        if stream.send is timed_send:
            stream.send = send
        if timed_put is not None and stream.app_put is timed_put:
            stream.app_put = put
    return max(link_clock() - started - paused, 0.0)


# Frames of one read wsproto takes at once. A read that does not begin at a frame boundary goes
# to wsproto whole (whole_messages takes only reads that do), and wsproto parsed a 64 KiB read of
# 26-byte frames, 2,500 of them, in one go: a node sending small frames out of step with the
# edge's reads held the event loop about 100 ms at a time (eight such links: 1.2 s; an outside
# audit). Such a read is handed over in pieces of about this many frames, the loop free between
# them, each piece's time charged to the link as it goes.
SLICE_FRAMES = 128


async def _slices(stream: WSStream, handle, event, frames: int, hold: LinkHold, held: float) -> float:
    """Hand ``event`` (``frames`` frame headers in its bytes) to hypercorn's ``handle`` in
    pieces of about :data:`SLICE_FRAMES` frames; the link's time in all (``held`` so far), less
    what it was charged between pieces."""
    data = event.data
    if frames <= SLICE_FRAMES:
        return held + await _own_time(stream, handle, event)
    step = max(len(data) * SLICE_FRAMES // frames, 256)
    for at in range(0, len(data), step):
        if at:
            if wait := charge(hold, held):
                await hold_reading(stream, trio.current_time() + wait)
            else:
                await trio.lowlevel.checkpoint()
            held = 0.0
            if stream.closed:
                break
        held += await _own_time(stream, handle, dataclasses.replace(event, data=data[at : at + step]))
    return held


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
    gc.callbacks.append(_collection)

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
            started = link_clock()
            hold = link_hold(self)
            hold.served = 0.0
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
            slow, frames, limit.frames = limit.frames, limit.frames + taken, 0
            until = budget.spend(frames + size // BYTES_PER_TOKEN, now)
            held = link_clock() - started
            if until:
                await hold_reading(self, until)
            if event is not None:
                held = await _slices(self, hypercorn_handle, event, slow, hold, held)
            # ... and past its part of the links' time.
            if wait := charge(hold, held):
                await hold_reading(self, trio.current_time() + wait)
            return
        await hypercorn_handle(self, event)

    handle.frame_limit = True  # type: ignore[attr-defined]
    WSStream.handle = handle  # type: ignore[method-assign]
