"""The node agent: one link per edge URL, each redialled for ever.

Per link, four tasks in the link's nursery: the reader (this task) starts a
task per run and never waits for the network; the sender, the only task that
writes to the websocket, sends the link's :class:`~node.outbox.Outbox`
(control frames first, then every run event produced since its last send,
packed into frames under the edge's frame limit); the pinger queues pings;
the watchdog, which never sends, declares the edge dead when no frame has
arrived for the ping timeout, even while the sender is stuck in a send. When
a link ends for any reason its nursery is cancelled, which cancels every run
on it and so closes their upstream requests.

A model's capacity is split between the linked edges as grants that follow
their demand (:mod:`node.grants`): an edge never has more runs here than its
grant, so no run waits for a slot inside the node.

    NodeError
      LinkRefused     the edge refused the link (token, version, duplicate id)
      LinkDead        the edge went silent past the ping timeout
"""

from __future__ import annotations

import math
import random
import ssl
import urllib.parse
from functools import partial

import h11
import msgspec
import structlog
import trio
import wsproto.utilities
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError, wrap_client_stream

from iop import __version__
from iop.drain import within_grace
from iop.exceptions import first_leaf
from node import http1
from node.adapters import Adapter, Counters, Via, make_adapter
from node.adapters.sim import SimAdapter
from node.config import NodeConfig
from node.engine import EngineSampler
from node.grants import GrantBook
from node.outbox import (
    EVENT_OVERHEAD,
    HEADER_OVERHEAD,
    USAGE_BYTES,
    Outbox,
    frame_budget,
    split_text,
    text_bytes,
    tool_calls_bytes,
)
from proto import (
    CLOSE_DUPLICATE,
    PROTOCOL_VERSION,
    CancelRun,
    Demand,
    EngineLoad,
    Hello,
    Hold,
    Load,
    ModelInfo,
    Ping,
    Placed,
    Pong,
    RunEvent,
    RunRequest,
    ToolCall,
    TunnelFrame,
    TunnelRequest,
    Usage,
    Welcome,
    decode_frame,
    encode_frame,
)
from proto.frames import (
    COMPLETE,
    DELTA,
    EARLY_PROGRESS_S,
    ERROR,
    MAX_ANSWERED_ID,
    MAX_HEADERS,
    PROGRESS,
    PROGRESS_S,
    REASONING_DELTA,
)

log = structlog.get_logger("iop.node")

_MIN_PING_INTERVAL_S = 0.01  # an edge's ping interval of 0 must not spin the pinger
GRANT_PROBE_S = 0.5  # an edge holding grant it does not use, while another waits: looked at (pinged) this often...
GRANT_SILENCE_S = 2.0  # ...and a ping unanswered this long, that grant is taken back (EdgeLink._watch_grants)
_EARLY_CANCELS = 1024  # cancels remembered per link for runs not seen yet
# Deltas one event joins at most while the outbox is busy: the edge holds a run to its key's daily
# budget event by event (a model server answering at once joined thousands: a run went 1,000 and
# more past its budget's bound; an outside re-check).
JOINED_PARTS = 64


class NodeError(Exception):
    pass


class LinkRefused(NodeError):
    pass


class HelloUnanswered(LinkRefused):
    """The edge's address took the websocket and sent no welcome within ``hello_timeout_s``."""


TRANSIENT_REFUSALS = frozenset({502, 503, 504})
# What an operator fixes when the edge refuses a link so (a newcomer read "invalid node token"
# and did not know which key of which side to change).
_REFUSAL_FIXES = {
    401: "the node's `token` must equal the edge's `node_token` (or its `node_tokens` entry for this node id)",
}
# By the code of the edge's refusal (its JSON body's), the fix to log.
_CODE_FIXES = {
    b'"no_node_token"': (
        "the edge has no `node_token`: set one in the edge's config, and the same as this node's `token`"
    ),
    b'"unknown_node_id"': (
        "the edge has no token for this `node_id`: is it the id the edge's `node_tokens` names? (or give the edge a"
        " shared `node_token`)"
    ),
}


def _edge_shaped(refusal: ConnectionRejected) -> bool:
    """Whether a refused upgrade was answered as an edge (or a proxy in front of one) answers:
    an error status, and a JSON error body unless a proxy's 502-504."""
    if refusal.status_code < 400:
        return False
    if refusal.status_code in TRANSIENT_REFUSALS:
        return True
    try:
        body = msgspec.json.decode(refusal.body or b"")
    except msgspec.DecodeError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict)


def _tls_fix(error: str) -> str | None:
    """What to change for a TLS failure with the edge, from OpenSSL's words."""
    if "WRONG_VERSION_NUMBER" in error or "wrong version number" in error or "record layer failure" in error:
        return "the edge does not serve TLS at this address: use a ws:// URL (or give the edge certfile and keyfile)"
    if "CERTIFICATE_VERIFY_FAILED" in error:
        return "the node does not trust the edge's certificate: set `ca_file` to the CA bundle (PEM) that signed it"
    if "IP address mismatch" in error or "Hostname mismatch" in error:
        return "the edge's certificate does not name the host in this URL: dial the name it was issued for"
    return None


class _ReaderWatch:
    """The nursery trio-websocket's client starts its reader task in: the reader ending
    (the connection closed, no error) ends the wait for the upgrade's answer at once.
    trio-websocket waits for that answer for ever once its reader has read the end of the
    stream; the node then redialled only after ``connect_timeout_s`` (10 s: an edge that
    closed connections as it restarted was relinked 7.5-9.8 s after it was back, an
    outside audit). After the upgrade, cancelling the finished scope does nothing.

    The reader is shielded from the link's cancel until :meth:`stop` (``_link_once`` calls it on
    every way out): a node shut down then still reads the edge's answer to its close frame, so
    the close handshake takes a round trip, where it waited out its whole bound (0.25 s a link)
    with nobody left to read the answer."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.upgrade = trio.CancelScope()
        self._reading = trio.CancelScope(shield=True)
        self.connection = None  # trio-websocket's WebSocketConnection (its reader is a method of it)

    def rejection(self) -> ConnectionRejected | None:
        """The refusal the upgrade got, if its answer was an HTTP status whose body ended with
        the connection (HTTP/1.0 with no length: a proxy's 502): trio-websocket raises its
        ConnectionRejected only for a body whose end it read before the stream's."""
        status = getattr(self.connection, "_reject_status", None)
        if not isinstance(status, int) or not status:  # (0: no status line read)
            return None
        body = getattr(self.connection, "_reject_body", b"")
        return ConnectionRejected(status, getattr(self.connection, "_reject_headers", ()), body=body or None)

    def start_soon(self, fn, *args, name=None) -> None:
        self.connection = getattr(fn, "__self__", None)

        async def watched() -> None:
            with self._reading:
                await fn(*args)
            self.upgrade.cancel()

        self.nursery.start_soon(watched, name=name or fn)

    def stop(self) -> None:
        self._reading.cancel()


class LinkDead(NodeError):
    pass


class RunSink:
    """Where an adapter reports one run's output (see :mod:`node.adapters`).

    Every event fits one frame: a delta too large for it goes out as several
    consecutive deltas; a ``complete`` too large for it becomes this run's
    error; an error message is cut to fit."""

    __slots__ = (
        "_link",
        "_outbox",
        "_run_id",
        "_seq",
        "_base",
        "ended",
        "_last",
        "_last_at",
        "_last_gen",
        "slot",
        "_progress_at",
        "_progress_parts",
        "_early",
    )

    def __init__(self, link: EdgeLink, run_id: str) -> None:
        self._link = link
        self._outbox = link.outbox
        self._run_id = run_id
        self._seq = 0
        self._base = EVENT_OVERHEAD + text_bytes(run_id)
        self.ended = False
        self._last: RunEvent | None = None  # the last delta queued, maybe still pending
        self._last_at = 0  # its index in the outbox's pending list
        self._last_gen = -1  # the outbox generation it was queued in
        self.slot: _Slot | None = None  # the run's slot on this node, given back when the run ends
        self._progress_at = -math.inf  # (trio clock) the last progress event
        self._progress_parts = 0  # tool-call pieces read since it
        self._early = link.progress_parts  # ...of which this many go at once (EdgeLink.progress_parts)

    @property
    def started(self) -> bool:
        """Some event has been reported."""
        return self._seq > 0

    async def _emit(self, size: int, kind: str, **fields) -> None:
        self._seq += 1
        await self._outbox.event(RunEvent(run_id=self._run_id, seq=self._seq, type=kind, **fields), size)

    def _split(self, kind: str, text: str) -> bool:
        room = True
        for piece in split_text(text, self._outbox.budget - self._base):
            self._seq += 1
            event = RunEvent(self._run_id, self._seq, kind, piece)
            room = self._outbox.event_nowait(event, self._base + text_bytes(piece))
        return room

    # The hot path: one event per upstream read, queued from the node's poll
    # of upstream sockets (node.http1._Poll), so it never waits; False: the
    # outbox is full, and the adapter awaits room() before reading on.
    def _text(self, kind: str, text: str, parts: int) -> bool:
        extra = len(text) if text.isascii() else 4 * len(text)
        outbox = self._outbox
        last = self._last
        if (
            last is not None
            and last.type == kind
            and last.parts < JOINED_PARTS
            and outbox.grow(self._last_at, self._last_gen, extra)
        ):
            last.text += text  # still pending: it leaves with this text too
            last.parts = (last.parts or 1) + parts
            return outbox.has_room()
        size = self._base + extra
        if size > outbox.budget:
            self._last = None
            return self._split(kind, text)
        self._seq += 1
        event = RunEvent(self._run_id, self._seq, kind, text)
        if parts > 1:
            event.parts = parts
        self._last, self._last_at, self._last_gen = event, outbox.pending_index(), outbox.generation
        return outbox.event_nowait(event, size)

    def delta_nowait(self, text: str, parts: int = 1) -> bool:
        return self._text(DELTA, text, parts)

    def reasoning_nowait(self, text: str, parts: int = 1) -> bool:
        return self._text(REASONING_DELTA, text, parts)

    def progress_nowait(self, parts: int = 1) -> bool:
        """The model server is streaming a tool call (``parts`` pieces of it read now), which
        goes out whole at its end: the edge hears that the run is alive, and how many pieces
        (one ``progress`` event a :data:`PROGRESS_S` at most). A 30 s tool call looked silent,
        and the edge moved the run of a healthy node (an outside audit)."""
        self._progress_parts += parts
        now = trio.current_time()
        since = now - self._progress_at
        if since < PROGRESS_S and not (0 < self._early <= self._progress_parts and since >= EARLY_PROGRESS_S):
            return True
        self._progress_at = now
        self._seq += 1
        event = RunEvent(self._run_id, self._seq, PROGRESS, parts=self._progress_parts)
        self._progress_parts = 0
        return self._outbox.event_nowait(event, self._base)

    async def room(self) -> None:
        await self._outbox.room()

    async def delta(self, text: str, parts: int = 1) -> None:
        if not self._text(DELTA, text, parts):
            await self._outbox.room()

    async def reasoning(self, text: str, parts: int = 1) -> None:
        if not self._text(REASONING_DELTA, text, parts):
            await self._outbox.room()

    async def complete(
        self,
        finish_reason: str,
        tool_calls: list[ToolCall] | None = None,
        usage: Usage | None = None,
        stop: str = "",
        refusal: str = "",
    ) -> None:
        if self.ended:
            return
        size = self._base + text_bytes(finish_reason) + tool_calls_bytes(tool_calls) + USAGE_BYTES + text_bytes(stop)
        size += text_bytes(refusal)
        if size > self._outbox.budget:
            log.warning("run output too large to relay", run_id=self._run_id, estimated_bytes=size)
            await self.error("run output too large to relay")
            return
        self.ended = True
        # The edge frees its slot when this event arrives and may send the next
        # run at once: the grant and the node's slot are given back now, not when
        # the task ends (an adapter may still be reading the rest of the upstream
        # body: for up to 2 s after [DONE], and a held slot made the next run wait).
        self._link._uncount(self._run_id)
        if self.slot is not None:
            self.slot.release()
        await self._emit(
            size, COMPLETE, finish_reason=finish_reason, tool_calls=tool_calls, usage=usage, stop=stop, refusal=refusal
        )

    async def error(self, message: str, status: int = 0, retry_after: float = 0.0) -> None:
        if self.ended:
            return
        self.ended = True
        self._link._uncount(self._run_id)  # as in complete()
        if self.slot is not None:
            self.slot.release()
        room = self._outbox.budget - self._base
        if text_bytes(message) > room:
            message = split_text(message, room)[0]
        more = {"retry_after": retry_after} if retry_after else {}
        await self._emit(self._base + text_bytes(message), ERROR, text=message, status=status, **more)


class _Slot:
    """A run's hold on one of its model's slots on this node, given back once:
    when its answer is whole (:meth:`RunSink.complete`) or when its task ends.
    While held, the run's cancel scope is in ``holders`` (the model's)."""

    __slots__ = ("_semaphore", "_holders", "_scope")

    def __init__(self, semaphore: trio.Semaphore, holders: set[trio.CancelScope], scope: trio.CancelScope) -> None:
        self._semaphore: trio.Semaphore | None = semaphore
        self._holders = holders
        self._scope = scope
        holders.add(scope)

    def release(self) -> None:
        semaphore, self._semaphore = self._semaphore, None
        if semaphore is not None:
            self._holders.discard(self._scope)
            semaphore.release()


class EdgeLink:
    """One live websocket to one edge."""

    def __init__(self, agent: NodeAgent, url: str, ws, welcome: Welcome) -> None:
        self.agent = agent
        self.url = url
        self.ws = ws
        self.ping_interval = max(welcome.ping_interval_s, _MIN_PING_INTERVAL_S)
        self.ping_timeout = self.ping_interval * max(agent.config.ping_misses, 1)
        self.edge_id = welcome.edge_id
        self.wants_prefixes = welcome.wants_prefixes
        # progress events saying this many pieces go at once (0: one a PROGRESS_S, as to an older edge)
        self.progress_parts = welcome.progress_parts
        self.runs: dict[str, trio.CancelScope] = {}
        self.tunnels: dict[str, TunnelSink] = {}  # the tunnels running (an edge may hold their bodies)
        self.counted: dict[str, str] = {}  # run id -> model: runs holding a slot of this edge's grant
        self._early: dict[str, None] = {}  # run ids cancelled before they arrived, oldest first
        self.last_rx = trio.current_time()
        self.lapsed = False  # its idle grants were taken back for its silence (GrantBook.lapse)
        budget = frame_budget(agent.config.max_frame_bytes, welcome.max_frame_bytes)
        self.outbox = Outbox(budget, agent.config.max_pending_events)

    async def serve(self) -> None:
        agent = self.agent
        for model, book in agent.grants.items():
            book.add(self)
            agent.rebalance(model)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_frames)
                nursery.start_soon(self._ping)
                nursery.start_soon(self._watch)
                nursery.start_soon(self._watch_grants)
                await self._read(nursery)
        finally:
            if self.runs:
                log.info("link lost: runs cancelled", edge=self.url, runs=len(self.runs))
            # Every run of this link has ended (the nursery waited for them): its grants go back.
            for model, book in agent.grants.items():
                book.remove(self)
                agent.rebalance(model)

    def _answer_cancel(self, run_id: str, model: str) -> None:
        """The edge counts a run it cancelled as holding its slot until this answer: the
        grant it stands under now (the cancel's rebalance made it) goes with the run's id.
        (The edge gave the slot back at once, and its own queue sent the next run under
        the larger grant the node still held for it unacknowledged: another edge's share
        did not come while that queue lasted, 18 s against 4.7: an outside re-check.)"""
        book = self.agent.grants.get(model)
        share = book.shares.get(self) if book is not None else None
        if share is not None:
            self.outbox.freed(model, run_id, share.grant, share.seq)

    def _uncount(self, run_id: str) -> None:
        """The run no longer counts against this edge's grant: it ended, or
        the edge cancelled it (the edge has taken the slot back already)."""
        model = self.counted.pop(run_id, None)
        if model is not None:
            self.agent.grants[model].end(self)
            self.agent.rebalance(model)

    async def _send_frames(self) -> None:
        """The only writer to the websocket: control frames first, also between
        the frames of one batch."""
        outbox, ws = self.outbox, self.ws
        while True:
            await outbox.wait()
            while (control := outbox.next_control()) is not None:
                await ws.send_message(encode_frame(control))
            frames = outbox.take()
            try:
                for frame in frames:
                    while (control := outbox.next_control()) is not None:
                        await ws.send_message(encode_frame(control))
                    await ws.send_message(encode_frame(frame))
            finally:
                outbox.done()

    async def flushed(self) -> None:
        """Return once everything queued so far has been sent."""
        await self.outbox.flushed()

    async def _ping(self) -> None:
        while True:
            await trio.sleep(self.ping_interval)
            self.outbox.control_nowait(Ping(ts=trio.current_time()))

    async def _watch(self) -> None:
        """Declare the edge dead when no frame has arrived for the ping timeout.
        Never sends, so a send stuck on a frozen edge cannot stop it."""
        while True:
            deadline = self.last_rx + self.ping_timeout
            if trio.current_time() >= deadline:
                raise LinkDead(f"no frame from the edge for {self.ping_timeout:g} s")
            await trio.sleep_until(deadline)

    async def _watch_grants(self) -> None:
        """While this edge holds grant it runs nothing on and another edge waits for some:
        ping it, and if it leaves the ping unanswered :data:`GRANT_SILENCE_S`
        (a SIGSTOP, a VM pause: its link is judged dead only after the ping timeout, 15 s
        by default, and a 6-slot node ran 3 while another edge queued), take that grant
        back (:meth:`GrantBook.lapse`) until it is heard from again."""
        agent = self.agent
        probed = -math.inf  # when the last probe went
        while True:
            await trio.sleep(GRANT_PROBE_S)
            if self.lapsed or not any(book.contended(self) for book in agent.grants.values()):
                continue
            now = trio.current_time()
            if now - self.last_rx < GRANT_PROBE_S:
                continue
            if probed < self.last_rx:  # (no probe since it was last heard: an idle edge may be quiet 5 s)
                probed = now
                self.outbox.control_nowait(Ping(ts=now))  # (its pong says it is there)
            elif now - probed >= GRANT_SILENCE_S:  # (a probe unanswered that long)
                silent = round(now - self.last_rx, 1)
                log.warning("edge silent: its idle grant goes to others", edge=self.url, silent_s=silent)
                self.lapsed = True
                for model, book in agent.grants.items():
                    book.lapse(self)
                    agent.rebalance(model)

    def _revive(self) -> None:
        self.lapsed = False
        log.info("edge heard from again", edge=self.url)
        for model, book in self.agent.grants.items():
            book.revive(self)
            self.agent.rebalance(model)

    async def _read(self, nursery: trio.Nursery) -> None:
        while True:
            data = await self.ws.get_message()
            self.last_rx = trio.current_time()
            if self.lapsed:
                self._revive()
            try:
                frame = decode_frame(data)
            except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
                raise NodeError(f"undecodable frame from the edge: {e}") from None
            match frame:
                case RunRequest() | TunnelRequest():
                    self._start(frame, nursery)
                case CancelRun(run_id=run_id, model=model):
                    scope = self.runs.get(run_id)
                    if scope is not None:
                        scope.cancel()
                        self._uncount(run_id)
                        self.outbox.drop_run(run_id)  # (the edge no longer has it)
                    else:  # overtook its run on the wire (cancels go ahead of requests), or ended
                        self._early[run_id] = None
                        if len(self._early) > _EARLY_CANCELS:
                            del self._early[next(iter(self._early))]
                    if model and len(run_id) <= MAX_ANSWERED_ID:  # (no run of the edge's is longer)
                        self._answer_cancel(run_id, model)
                case Hold(run_id=run_id, hold=hold):
                    tunnel = self.tunnels.get(run_id)
                    if tunnel is not None:
                        tunnel.hold(hold)
                case Demand(model=model, in_flight=in_flight, waiting=waiting, seq=seq):
                    book = self.agent.grants.get(model)
                    if book is not None:
                        book.report(self, in_flight, waiting, seq)
                        self.agent.rebalance(model)
                case Ping(ts=ts):
                    self.outbox.control_nowait(Pong(ts=ts))  # full: the sender is stuck, the pong could not go
                case Pong():
                    pass
                case _:
                    log.warning("unexpected frame from the edge", frame=type(frame).__name__)

    def _start(self, request: RunRequest | TunnelRequest, nursery: trio.Nursery) -> None:
        if request.run_id in self.runs:
            return
        if request.run_id in self._early:  # the edge cancelled it before it arrived
            del self._early[request.run_id]
            return
        scope = self.runs[request.run_id] = trio.CancelScope()
        adapter = self.agent.adapters.get(request.model)
        if isinstance(request, RunRequest):
            sink: RunSink | TunnelSink = RunSink(self, request.run_id)
            refusal = None if adapter is not None else f"this node does not serve model {request.model!r}"
            work = partial(adapter.run, request, sink) if adapter is not None else None
        else:
            sink = self.tunnels[request.run_id] = TunnelSink(self, request.run_id)
            allowed = adapter is not None and self.agent.passthrough[request.model] and hasattr(adapter, "tunnel")
            refusal = None if allowed else f"this node does not allow passthrough for model {request.model!r}"
            work = partial(adapter.tunnel, request, sink) if allowed else None
        if refusal is None:
            if isinstance(request, RunRequest) and request.prefix:
                self.agent.placed(self, request.model, request.prefix)
            if self.agent.grants[request.model].start(self):
                self.counted[request.run_id] = request.model
            else:
                # Only an edge that does not keep to its grant gets here. The run
                # is still served (the slot semaphore bounds the upstream), never
                # failed: a client must not pay for an accounting race.
                self.agent.beyond_grant += 1
                log.warning("run beyond the edge's grant: it may wait for a slot", edge=self.url, model=request.model)
        nursery.start_soon(self._serve_one, request, scope, sink, work, refusal)

    async def _serve_one(self, request, scope: trio.CancelScope, sink, work, refusal: str | None) -> None:
        """One run or tunnel: in its own cancel scope (CancelRun), within the
        model's capacity on this node, bounded by the run's deadline."""
        agent = self.agent
        agent.counters.active_runs += 1
        try:
            with scope:
                if refusal is not None:
                    await sink.error(refusal)
                    return
                slots, holders = agent.slots[request.model], agent.holders[request.model]
                # Grants should make a wait impossible (count it), but for a slot still held by a run
                # the edge cancelled: the edge counts it free at once, the run gives it back as its
                # task unwinds (its upstream request closed), a few ms later.
                if slots.value == 0 and not any(held.cancel_called for held in holders):
                    agent.slot_waits += 1
                    log.warning("run waits for a slot on the node", run_id=request.run_id, model=request.model)
                try:  # a free slot (the usual case) is taken without a pass through the scheduler
                    slots.acquire_nowait()
                except trio.WouldBlock:
                    await slots.acquire()
                slot = _Slot(slots, holders, scope)
                if isinstance(sink, RunSink):
                    sink.slot = slot
                try:
                    with trio.move_on_after(max(request.timeout_s, 0)) as deadline:
                        try:
                            await work()
                        except Exception as e:  # a bug in an adapter; trio.Cancelled is not an Exception
                            log.exception("adapter failed", run_id=request.run_id)
                            await sink.error(f"node adapter failed: {type(e).__name__}: {e}")
                    if deadline.cancelled_caught:
                        await sink.error("run deadline exceeded on the node")
                    elif not sink.ended:
                        await sink.error("adapter ended without a result")
                finally:
                    slot.release()
        finally:
            agent.counters.active_runs -= 1
            agent.counters.run_ended.unpark_all()
            self.runs.pop(request.run_id, None)
            self.tunnels.pop(request.run_id, None)
            self._uncount(request.run_id)


# A tunnel's body goes in pieces of at most TUNNEL_PIECE bytes, with no more than TUNNEL_AHEAD
# of the link's frames queued meanwhile: the edge's hold takes effect within a few MiB (the outbox
# took 32 MiB, and the edge held a 48 MB answer's 31.9 MB for a slow client).
TUNNEL_PIECE = 256 * 1024
TUNNEL_AHEAD = 1024 * 1024


class TunnelSink:
    """Where an adapter sends one tunnelled response, frame by frame, in order.
    Body bytes too large for one frame go out as several ``body`` frames. While the
    edge holds it (its client is behind), the body waits: the adapter stops reading
    the provider's (an answer more than 32 MiB ahead of a slow client was cut)."""

    __slots__ = ("_outbox", "_run_id", "_seq", "_base", "started", "ended", "_held")

    def __init__(self, link: EdgeLink, run_id: str) -> None:
        self._outbox = link.outbox
        self._run_id = run_id
        self._seq = 0
        self._base = EVENT_OVERHEAD + text_bytes(run_id)
        self.started = False
        self.ended = False
        self._held: trio.Event | None = None  # set when the edge lets it go on

    def hold(self, hold: bool) -> None:
        held = self._held
        if hold and held is None:
            self._held = trio.Event()
        elif not hold and held is not None:
            self._held = None
            held.set()

    async def _send(self, size: int, kind: str, ahead: int = 0, **fields) -> None:
        self._seq += 1
        frame = TunnelFrame(run_id=self._run_id, seq=self._seq, kind=kind, **fields)
        await self._outbox.tunnel(frame, size, ahead)

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.started = True
        headers = headers[:MAX_HEADERS]  # (a frame carries no more; an edge relays a few it knows)
        size = self._base + sum(HEADER_OVERHEAD + text_bytes(k) + text_bytes(v) for k, v in headers)
        if size > self._outbox.budget:
            await self.error("provider response headers too large to relay")
            return
        await self._send(size, "response_start", status=status, headers=headers)

    async def body(self, data: bytes) -> None:
        if self.ended:
            return
        room = max(min(self._outbox.budget - self._base, TUNNEL_PIECE), 1)
        for i in range(0, len(data), room):
            while self._held is not None:  # (the run's deadline and cancel end this wait)
                await self._held.wait()
            piece = data[i : i + room] if len(data) > room else data
            await self._send(self._base + len(piece), "body", TUNNEL_AHEAD, body=piece)

    async def end(self) -> None:
        if not self.ended:
            self.ended = True
            await self._send(self._base, "end")

    async def error(self, message: str) -> None:
        if not self.ended:
            self.ended = True
            room = self._outbox.budget - self._base
            if text_bytes(message) > room:
                message = split_text(message, room)[0]
            await self._send(self._base + text_bytes(message), "error", error=message)


class NodeAgent:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.counters = Counters()
        self.via = Via()  # the edges linked now, for the x-iop-via of upstream requests
        self.adapters: dict[str, Adapter] = {
            m.name: make_adapter(
                m,
                self.counters,
                connect_timeout_s=config.upstream_connect_timeout_s,
                read_timeout_s=config.upstream_read_timeout_s,
                ca_file=config.ca_file,
                via=self.via,
            )
            for m in config.models
        }
        # Capacity is the node's own: split between the edges it links to as
        # grants; the semaphores are the last guard, never waited on while
        # every edge keeps to its grant (slot_waits counts the waits).
        self.slots = {m.name: trio.Semaphore(m.max_concurrency) for m in config.models}
        self.grants = {m.name: GrantBook(m.name, m.max_concurrency) for m in config.models}
        self.beyond_grant = 0  # runs an edge sent beyond its grant (served anyway)
        self.slot_waits = 0
        self.holders: dict[str, set[trio.CancelScope]] = {m.name: set() for m in config.models}  # (_Slot)
        self.passthrough = {m.name: m.passthrough for m in config.models}
        self.links: dict[str, EdgeLink] = {}
        self.draining = False
        self.hurry = trio.Event()  # a second signal: end the drain's grace now
        self.engine: dict[str, EngineLoad] = {}  # model -> its server's load (models with a metrics_url)
        self.samplers = [EngineSampler(m, self._engine_changed, config.ca_file) for m in config.models if m.metrics_url]
        self.models = [
            ModelInfo(
                name=m.name,
                adapter=m.adapter,
                target=m.target or m.name,
                max_concurrency=m.max_concurrency,
                context_window=m.context_window,
                native_tools=m.native_tools,
                passthrough=m.passthrough,
            )
            for m in config.models
        ]

    def rebalance(self, model: str) -> None:
        """Move ``model``'s grants toward the edges' demand; queue the changes."""
        for link, grant in self.grants[model].rebalance():
            link.outbox.grant(grant)

    def placed(self, origin: EdgeLink, model: str, prefix: list[int]) -> None:
        """``origin``'s edge sent a run with this prefix chain here: tell the
        other edges that route by prefix, so that all of them send the
        conversation's next turn to this node (each edge otherwise knows only
        the turns it placed itself)."""
        frame = None
        for link in self.links.values():
            if link is not origin and link.wants_prefixes:
                frame = frame or Placed(model=model, prefix=prefix)
                link.outbox.hint(frame)

    async def _prune_idle_connections(self) -> None:
        """Every few seconds, the model servers' idle connections they closed or that expired
        are closed (:meth:`node.http1.Client.prune`)."""
        clients = [c for a in self.adapters.values() if isinstance(c := getattr(a, "client", None), http1.Client)]
        while clients:
            await trio.sleep(http1.KEEPALIVE_EXPIRY_S)
            for client in clients:
                client.prune()

    async def _report_sim_cache(self, model: str, adapter: SimAdapter, interval: float) -> None:
        """A ``sim`` model with a prefix cache reports its hit rate as a model
        server's metrics would (``iop_engine_prefix_cache_hit_rate`` on the edges)."""
        reported: float | None = None
        while True:
            await trio.sleep(interval)
            prompt = adapter.hit_tokens + adapter.miss_tokens
            rate = round(adapter.hit_tokens / prompt, 4) if prompt else None
            if rate != reported:
                reported = rate
                self._engine_changed(model, EngineLoad(prefix_cache_hit_rate=rate))

    def _engine_changed(self, model: str, load: EngineLoad) -> None:
        """Tell every linked edge (a link whose control queue is full is stuck:
        its liveness check decides, and a new link gets the whole view)."""
        self.engine[model] = load
        frame = Load(in_flight={}, draining=self.draining, engine={model: load})
        for link in self.links.values():
            link.outbox.control_nowait(frame)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for sampler in self.samplers:
                    nursery.start_soon(sampler.run)
                for model in self.config.models:
                    adapter = self.adapters[model.name]
                    if isinstance(adapter, SimAdapter) and adapter.cache is not None and not model.metrics_url:
                        nursery.start_soon(self._report_sim_cache, model.name, adapter, model.metrics_interval_s)
                for url in self.config.edges:
                    nursery.start_soon(self._dial_forever, url)
                nursery.start_soon(self._prune_idle_connections)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                for adapter in self.adapters.values():
                    await adapter.aclose()

    async def drain(self) -> None:
        """Take no new runs (each edge is told), finish the running ones within
        ``drain_grace_s``; the caller then cancels :meth:`serve`."""
        self.draining = True
        for link in list(self.links.values()):
            with trio.move_on_after(1):  # queued for that link's sender, ahead of its events
                await link.outbox.control(Load(in_flight={}, draining=True))
        log.info("draining", runs=self.counters.active_runs, grace_s=self.config.drain_grace_s)

        async def runs_ended() -> None:
            while self.counters.active_runs:
                await self.counters.run_ended.park()

        await within_grace(self.config.drain_grace_s, runs_ended, self.hurry)
        with trio.move_on_after(2):  # the last events of those runs are still on their way out
            for link in list(self.links.values()):
                await link.flushed()

    async def _dial_forever(self, url: str) -> None:
        """Dial ``url`` for ever. Failures to link in a row back off
        exponentially (jittered) from ``reconnect_min_s`` to
        ``reconnect_max_s``; a link that was up (welcomed) starts that over,
        and for ``relink_window_s`` after it is lost the node redials at least
        every ``relink_max_s``, so an edge restart is relinked within seconds."""
        cfg = self.config
        backoff = cfg.reconnect_min_s
        lost_at = -math.inf  # when the last link that was up went down
        refused_at = math.inf  # when refusals for its id (4009) in a row began
        failing_since = trio.current_time()  # when the dials that did not link began
        while True:
            linked = trio.Event()
            try:
                await self._link_once(url, linked)
            except Exception as exc:  # trio.Cancelled is a BaseException: never caught here
                e = first_leaf(exc)
                if linked.is_set():  # (a link that was up: its loss starts the count anew)
                    failing_since = trio.current_time()
                # A dial that has failed for relink_window_s needs the operator: said at error
                # level (an edge address that answers nothing was a warning a dial, for ever).
                failing_for = trio.current_time() - failing_since
                long = {"failing_for_s": round(failing_for)} if failing_for >= cfg.relink_window_s else None
                if isinstance(e, ConnectionRejected) and not _edge_shaped(e):
                    # (a model server or another web server at the address: it was "edge refused the
                    # link", status 200, with no hint; a newcomer had pointed `edges` at vLLM)
                    error = f"answered HTTP {e.status_code} to the link's websocket upgrade: not an iop edge"
                    fix = "is `edges` the edge's address (ws://<edge host:port>/v1/node/link), not a model server's?"
                    body = (e.body or b"").decode("utf-8", "replace")[:200]
                    (log.warning if long is None else log.error)(
                        "link failed", edge=url, error=error, status=e.status_code, body=body, fix=fix, **(long or {})
                    )
                elif isinstance(e, ConnectionRejected):
                    body = (e.body or b"").decode("utf-8", "replace")[:200]
                    # A 503 (the edge busy linking others, or draining) passes as the node redials,
                    # and so does a proxy's 502 or 504 (its edge restarting); any other refusal (a
                    # wrong token: 401) needs the operator.
                    transient = e.status_code in TRANSIENT_REFUSALS and long is None
                    level = log.warning if transient else log.error
                    said = e.body or b""
                    fix = next((f for code, f in _CODE_FIXES.items() if code in said), None)
                    fix = fix or _REFUSAL_FIXES.get(e.status_code)
                    level(
                        "edge refused the link",
                        edge=url,
                        status=e.status_code,
                        body=body,
                        **({"fix": fix} if fix else {}),
                        **(long or {}),
                    )
                elif isinstance(e, ConnectionClosed):
                    reason = e.reason
                    code = getattr(reason, "code", None)
                    said = {"code": code, "reason": getattr(reason, "reason", None)}
                    if long is None:
                        log.warning("link closed", edge=url, **said)
                    else:  # (a node id another live process holds was refused so for ever, as warnings)
                        fix = "another live node uses this node_id" if code == CLOSE_DUPLICATE else None
                        log.error("link closed", edge=url, **said, **long, **({"fix": fix} if fix else {}))
                elif isinstance(e, (OSError, HandshakeError, NodeError, trio.TooSlowError, trio.BrokenResourceError)):
                    error = f"{type(e).__name__}: {e}"
                    # (the fix from the first dial on: a node that had never linked said what to
                    # check only after relink_window_s, 60 s)
                    fix = _tls_fix(error) or "is the edge running, and is this its address (the node's `edges`)?"
                    if isinstance(e, HelloUnanswered):
                        fix = "is `edges` an iop edge's link address? If so, it is too busy: raise hello_timeout_s"
                    level = log.warning if long is None else log.error
                    level("link failed", edge=url, error=error, fix=fix, **(long or {}))
                elif isinstance(e, (h11.ProtocolError, wsproto.utilities.ProtocolError)):
                    # Bytes that are not HTTP where the edge's answer should be (a wrong port, a
                    # proxy): a crash with a traceback at error level, every dial, before.
                    error = f"not an HTTP answer to the websocket upgrade: {e}"
                    (log.warning if long is None else log.error)("link failed", edge=url, error=error, **(long or {}))
                else:
                    log.error("link crashed", edge=url, exc_info=exc)
                duplicate = isinstance(e, ConnectionClosed) and getattr(e.reason, "code", None) == CLOSE_DUPLICATE
            else:
                duplicate = False
            now = trio.current_time()
            if linked.is_set():
                backoff, lost_at = cfg.reconnect_min_s, now
            refused_at = min(refused_at, now) if duplicate else math.inf
            cap = cfg.reconnect_max_s
            # Refused as its id is linked already: its old link, half dead, goes at the edge's ping
            # timeout, so for relink_window_s it redials as after a lost link (backing off took
            # 5-11 s more); then as any failure (another live process of that id: a mistake).
            # (refused_at is inf when no refusals run: now - inf, -inf, was "within" the window, and
            # every failure was capped at relink_max_s: a newcomer's audit)
            if now - lost_at < cfg.relink_window_s or 0 <= now - refused_at < cfg.relink_window_s:
                cap = min(cap, cfg.relink_max_s)
            backoff = min(backoff, cap)
            delay = backoff * random.uniform(0.5, 1.0)  # jitter: relinking nodes do not stampede
            log.info("redialling edge", edge=url, in_s=round(delay, 2))
            await trio.sleep(delay)
            backoff = min(backoff * 2, cap)

    async def _link_once(self, url: str, linked: trio.Event) -> None:
        cfg = self.config
        host, port, host_header, resource, secure = _parse_ws_url(url)
        # The TCP stream is ours to close: trio-websocket leaves it open when
        # the edge rejects the upgrade (a wrong token), which would leak a
        # socket per redial.
        with trio.fail_after(cfg.connect_timeout_s):
            if secure:
                context = ssl.create_default_context(cafile=cfg.ca_file or None)
                stream = await trio.open_ssl_over_tcp_stream(host, port, ssl_context=context, https_compatible=True)
                try:  # now, not inside the upgrade, whose client waited out the timeout on a TLS failure
                    await stream.do_handshake()
                except BaseException as e:  # (re-raised: a cancel included; only the stream is closed)
                    await trio.aclose_forcefully(stream)
                    if isinstance(e, trio.BrokenResourceError):
                        raise LinkRefused(f"TLS with the edge failed: {e.__cause__ or e}") from None
                    raise
            else:
                stream = await trio.open_tcp_stream(host, port)
        try:
            async with trio.open_nursery() as ws_nursery:
                reader = _ReaderWatch(ws_nursery)
                try:
                    await self._upgraded(url, (host_header, resource, secure), reader, stream, linked)
                finally:
                    reader.stop()
                    ws_nursery.cancel_scope.cancel()
        finally:
            await trio.aclose_forcefully(stream)

    async def _upgraded(
        self, url: str, target: tuple[str, str, bool], reader: _ReaderWatch, stream: trio.abc.Stream, linked: trio.Event
    ) -> None:
        """The websocket upgrade over ``stream``, then the link's life over it."""
        cfg = self.config
        host_header, resource, secure = target
        headers = [(b"Authorization", f"Bearer {cfg.token}".encode()), (b"X-Iop-Node-Id", cfg.node_id.encode())]
        try:
            with trio.fail_after(cfg.connect_timeout_s), reader.upgrade:
                ws = await wrap_client_stream(
                    reader,  # type: ignore[arg-type]  (it starts the reader task only)
                    stream,
                    host_header,
                    resource,
                    extra_headers=headers,
                    max_message_size=cfg.max_frame_bytes,
                    receive_buffer_size=None,  # trio's default read size, not 4 KiB per read
                )
        except trio.TooSlowError:
            raise LinkRefused(
                f"no answer to the websocket upgrade in {cfg.connect_timeout_s:g} s"
                + ("" if secure else " (an edge serving TLS needs a wss:// URL)")
            ) from None
        if reader.upgrade.cancelled_caught:  # (a TLS edge closes a plain connection so too)
            refused = reader.rejection()
            if refused is not None:
                raise refused
            raise LinkRefused(
                "the edge closed the connection before answering the websocket upgrade"
                + ("" if secure else " (an edge serving TLS needs a wss:// URL)")
            )
        try:
            await self._speak(url, ws, linked)
        finally:
            # A polite close handshake, briefly: the edge may be gone too.
            with trio.CancelScope(shield=True), trio.move_on_after(0.25):
                await ws.aclose()

    async def _speak(self, url: str, ws, linked: trio.Event) -> None:
        cfg = self.config
        await ws.send_message(
            encode_frame(
                Hello(
                    node_id=cfg.node_id,
                    protocol=PROTOCOL_VERSION,
                    models=self.models,
                    software=f"iop {__version__}",
                    relays_prefixes=True,
                    max_frame_bytes=cfg.max_frame_bytes,
                    holds_tunnels=True,
                    answers_cancels=True,
                )
            )
        )
        try:
            with trio.fail_after(cfg.hello_timeout_s):
                data = await ws.get_message()
        except trio.TooSlowError:  # (it was logged as "TooSlowError: ", pointing nowhere: an audit)
            raise HelloUnanswered(
                f"the edge took the websocket but sent no welcome to the hello within hello_timeout_s "
                f"({cfg.hello_timeout_s:g} s)"
            ) from None
        try:
            welcome = decode_frame(data)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
            raise LinkRefused("the edge answered the hello with an undecodable frame") from None
        if not isinstance(welcome, Welcome):
            raise LinkRefused(f"expected welcome, got {type(welcome).__name__}")
        if welcome.protocol != PROTOCOL_VERSION:
            raise LinkRefused(
                f"protocol version mismatch: node speaks {PROTOCOL_VERSION}, edge speaks {welcome.protocol}"
            )
        link = EdgeLink(self, url, ws, welcome)
        self.links[url] = link
        self.via.linked(welcome.edge_id)
        if self.engine:
            link.outbox.control_nowait(Load(in_flight={}, draining=self.draining, engine=dict(self.engine)))
        linked.set()
        log.info("linked", edge=url, edge_id=welcome.edge_id)
        try:
            await link.serve()
        finally:
            self.links.pop(url, None)
            self.via.unlinked(welcome.edge_id)


def _parse_ws_url(url: str) -> tuple[str, int, str, str, bool]:
    parts = urllib.parse.urlsplit(url)
    secure = parts.scheme == "wss"
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if secure else 80)
    host_header = host if port in (80, 443) else f"{host}:{port}"
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return host, port, host_header, resource, secure


__all__ = ["NodeAgent"]
