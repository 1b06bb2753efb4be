"""One run: the events a node sends for it, its timers, and how it ends."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import TYPE_CHECKING, TypeVar

import trio

from proto import Hold, RunEvent, TunnelFrame
from proto.frames import (
    DELTA,
    EARLY_PROGRESS_PARTS,
    EARLY_PROGRESS_S,
    ERROR,
    PROGRESS,
    PROGRESS_S,
    REASONING_DELTA,
    TERMINAL_TYPES,
)

TEXT_TYPES = frozenset((DELTA, REASONING_DELTA))
# A batch of this many events or more is timed (an honest node sends a run's text read together as
# one event, and the edge joins a frame's consecutive deltas of a run: its batches hold one or two):
# its writer's time on it is owed by the node's link, charged while it is past its pace (Run.shaped).
MANY_EVENTS = 4
KNOWN_TYPES = TEXT_TYPES | TERMINAL_TYPES | {PROGRESS}

if TYPE_CHECKING:
    from edge.keys import Gauge
    from edge.runs.link import NodeLink
    from edge.runs.service import Slot

# Causes a run can end with (metrics label values).
COMPLETE = "complete"
RUN_ERROR = "run_error"
# A run's first event an error with one of these upstream statuses (or a 5xx): the node's fault, not
# the request's (0: unreachable; 401/403: its key refused; 404: its target model is not there; 429:
# its server (or its provider account) is saturated).
_NODE_FAULTS = frozenset((0, 401, 403, 404, 429))  # an error with such a status, or a 5xx: not the client's
CLIENT_GONE = "client_gone"
TIMEOUT = "timeout"
NODE_LOST = "node_lost"
NODE_STALLED = "node_stalled"  # a collected run silent on a node judged stalled: run again elsewhere
SLOW_CLIENT = "slow_client"
SHUTDOWN = "shutdown"
UNSENDABLE = "unsendable"  # the run's request could not be encoded or framed for the node
CANCELLED = "cancelled"  # by an operator (the console, POST /v1/admin/runs/{id}/cancel)
TOO_LARGE = "output_too_large"  # the node sent more than MAX_OUTPUT_BYTES of text for the run

# What one run may bring: the bytes of its events in all (text, reasoning, tool calls, every
# string field), and what waits for its reader (a tunnel's body too: an embeddings answer a
# slow client reads can be tens of MB); its calls are bounded by the frame (MAX_TOOL_CALLS). Far past any model's
# answer (131,072 tokens of 128 bytes; a node caps a run's calls at 1,024 and 8 MiB); each
# run's buffers on the edge stay bounded whatever a node sends. Text is counted 4 bytes a
# character unless it is ASCII (what Python holds it in, at most): a cap of 16 Mi characters
# let 8 runs of emoji take an edge from 55 MiB to 2.1 GB (outside audit).
MAX_OUTPUT_BYTES = 16 * 1024 * 1024
MAX_PENDING_BYTES = 32 * 1024 * 1024
MIN_BUFFERED_SHARE = 64 * 1024  # a run with less waiting than this is never cut for the edge's buffers
MAX_BATCH_BYTES = 256 * 1024  # of events a run's writer takes at once (the rest wait, in the bound)
# A tunnel's body waiting for its client past HOLD_BYTES is held on its node (a node that holds
# tunnels) until no more than GO_ON_BYTES waits: a 60 MB embeddings answer to a client reading
# slower than its provider wrote was cut at MAX_PENDING_BYTES.
HOLD_BYTES = 4 * 1024 * 1024
GO_ON_BYTES = 1024 * 1024
# While held, its writer takes this much at once, and each take is its silence's end: a client
# reading slower than a batch a wait_timeout_s (256 KiB: 2.2 KB/s at the defaults) was cut.
HELD_BATCH_BYTES = 64 * 1024


class Buffered:
    """What every run's events waiting for their readers hold, in bytes, and the edge's
    bound on it (``max_buffered_bytes``): past it, the runs with more than their share
    (1/4096 of the bound, 64 KiB at least) waiting, the most first, are their clients'
    fault, and are cut as slow clients, to a sixteenth under it (finished ones too: a client that reads nothing of an
    answer the node has ended holds it all the same; they kept theirs, and an honest slow
    reader was cut instead: a re-check). Each run alone stops at :data:`MAX_PENDING_BYTES`,
    but 60 clients that did not read held 1.3 GB of an edge, growing (an outside audit)."""

    __slots__ = ("bytes", "cap", "share", "heavy")

    def __init__(self, cap: float) -> None:
        self.bytes = 0
        self.cap = cap
        self.share = max(int(cap) >> 12, MIN_BUFFERED_SHARE) if cap != math.inf else math.inf
        self.heavy: set[Run] = set()  # runs with more than their share waiting (few: the bound / share)

    def evict(self, now: float) -> None:
        """Over the bound: cut the heaviest runs whose readers had their turn until a
        sixteenth under it (not one run each time it is crossed again)."""
        under = self.cap - (self.cap / 16)
        for run in sorted(self.heavy, key=_waiting, reverse=True):
            if self.bytes <= under:
                return
            if run._pending_from != now:  # (what came at once is not yet its reader's to take)
                run.cut_slow()


def _waiting(run: Run) -> int:
    return run._pending_bytes


def prompt_tokens(run: Run) -> int:
    """The run's estimated prompt tokens (0: not estimated, as a tunnel's)."""
    want = run.want
    return want.min_context - (want.max_tokens or 1) if want is not None and want.min_context else 0


UNBOUNDED = Buffered(math.inf)  # (a run no service made: tests of the run alone)
EVENT_BYTES = 64  # what an event costs waiting for its reader, beyond its text
MAX_PROGRESS_PARTS = 4096  # tool-call pieces one progress event may say were read (about a second's, at most)
# A run's events past max_buffered_events that came within this long of the oldest its reader has
# not taken are the node's flood, not a client that stopped reading (an outside audit: 8,192
# alternating reasoning and text events, shaped slower than they came, blamed the client).
FLOOD_S = 1.0


def _text_bytes(text: str) -> int:
    return len(text) if text.isascii() else 4 * len(text)  # (isascii: a flag of the string, no scan)


def _size(item: RunEvent | TunnelFrame) -> int:
    """The bytes an event or tunnel frame holds (its text at most 4 a character)."""
    if type(item) is RunEvent:
        size = _text_bytes(item.text)
        if item.finish_reason or item.stop or item.tool_calls or item.refusal:  # rare: a complete, or a node's oddity
            size += _text_bytes(item.finish_reason) + _text_bytes(item.stop) + _text_bytes(item.refusal)
            for call in item.tool_calls or ():
                function = call.function
                size += _text_bytes(call.id) + _text_bytes(call.type)
                size += _text_bytes(function.name) + _text_bytes(function.arguments)
        return size
    size = len(item.body) + len(item.error)
    for name, value in item.headers or ():
        size += len(name) + len(value)
    return size


T = TypeVar("T")

RUN_TIMED_OUT = "run timed out"
NODE_DISCONNECTED = "node disconnected"
NOT_MOVED = "node disconnected; no other node had room for the request within the queue's timeout"


class Run:
    """Events arrive from the link reader with :meth:`deliver` (never blocks);
    the request drains them in batches with :meth:`next_batch`.

    The pending list is bounded by ``max_buffered``: a client that stops
    reading gets its run cancelled on the node instead of growing memory.
    """

    __slots__ = (
        "id",
        "slot",
        "metadata",
        "_pending",
        "_reader",
        "_max_buffered",
        "wait_timeout",
        "deadline",
        "last_event_at",
        "progress_first",
        "progress_at",
        "progress_parts",
        "started_at",
        "first_event_at",
        "events_seen",
        "deltas_seen",
        "gauge",
        "finished",
        "closed",
        "cause",
        "_on_close",
        "on_node_done",
        "on_failed_at_once",
        "refused_by",
        "on_refused_at_once",
        "held_error",
        "move_until",
        "want",
        "request",
        "failed_over",
        "unserved",
        "rerun_if_stalled",
        "stall_moved",
        "held",
        "requeued",
        "api",
        "timers",
        "timer",
        "client",
        "error",
        "error_status",
        "keepalive",
        "idle_since",
        "quiet_since",
        "_idle",
        "sink",
        "_sunk_at",
        "_nudged",
        "output_bytes",
        "_pending_bytes",
        "buffered",
        "_pending_from",
    )

    def __init__(
        self,
        run_id: str,
        slot: Slot,
        *,
        wait_timeout: float,
        run_timeout: float,
        max_buffered: int,
        metadata: dict[str, str],
        on_close,
    ) -> None:
        now = trio.current_time()
        self.id = run_id
        self.slot = slot
        self.metadata = metadata
        self._pending: list[RunEvent] = []
        self._reader: trio.lowlevel.Task | None = None  # the request's task, while it waits for events
        self._max_buffered = max_buffered
        self.wait_timeout = wait_timeout
        self.deadline = now + run_timeout
        self.started_at = now
        self.last_event_at = now
        # ``progress`` events (the node's model server streams a tool call, sent whole at its end):
        # the first and the last, or -inf. They keep the run from timing out or looking stalled.
        self.progress_first = self.progress_at = -math.inf
        self.progress_parts = 0  # the tool-call pieces they said were read (a key's budget counts them)
        self.first_event_at: float | None = None
        self.events_seen = 0
        self.deltas_seen = 0  # model-server text deltas in the events seen (a node joins those read together)
        # A key's daily budget (edge.keys.Lease.follow): its deltas and tool-call pieces count
        # in the key's gauge as they come, which past its mark holds the runs to the budget.
        self.gauge: Gauge | None = None
        self.finished = False  # a terminal event is queued: nothing more will arrive
        self.closed = False
        self.cause: str | None = None
        self._on_close = on_close
        # The node ended the run (its terminal event): its slot is free now, whether or not the
        # client has read the run's last events (the service sets it; None: at close only).
        self.on_node_done: Callable[[Run], None] | None = None
        # Its node failed it before any output, the model server's fault: True if the service
        # moved it to another node (the client never sees that error).
        self.on_failed_at_once: Callable[[Run, RunEvent], bool] | None = None
        # Moved off a node that refused it at once with a 4xx (:meth:`RunService._refused_at_once`):
        # that node, counted as failing the model if the run is answered where it moved.
        self.refused_by: NodeLink | None = None
        self.on_refused_at_once: Callable[[Run, RunEvent], bool] | None = None
        # Moved off a node that failed it at once, waiting for a slot: that error, and when the
        # wait ends with it (the queue's timeout), as if the run had not moved.
        self.held_error: RunEvent | None = None
        self.move_until = math.inf
        self.want = None  # what the request needs of a node (for failover)
        self.request = None  # the RunRequest (or TunnelRequest) frame, kept until the run closes (for failover)
        self.failed_over = False
        # Moved off a node judged not to start it: no evidence against the next (a request
        # slow to start anywhere was moved, started over, and had its second node judged too).
        self.stall_moved = False
        self.held = False  # its tunnel's body is held on its node (HOLD_BYTES)
        self.unserved = False  # lost before its first event, and no node left serving its model: a 503 to retry
        # Collected, its client shown nothing, and its request would run it again: on a node judged
        # stalled it ends (NODE_STALLED) rather than wait out wait_timeout_s (RunService.check_stall).
        self.rerun_if_stalled = False
        self.requeued = None  # while a failed-over run waits for a slot: its place in the queue
        self.timers: RunTimers | None = None  # the service's, which enforce wait_timeout and the deadline
        self.timer: list | None = None  # this run's entry there
        self.api = ""  # the front door its request came through (a metrics label; never sent to the node)
        self.client = None  # the request's Exchange (its key and stream flag, for the console)
        self.error: str | None = None  # how it failed, when it did (for the console)
        self.error_status = 0  # the node's error event's status, when it failed there
        self.keepalive = 0.0  # > 0: the timers wake the reader after this long with nothing (next_batch_or_idle)
        self.idle_since = now  # the last event, or the last keep-alive the timers called
        # Set by a live stream while events arrive but give the client nothing (held: a strict
        # stream's head, a tool call in a live tool stream): when that began. Keep-alives are
        # due from it, not from the last event (the client heard nothing for 8 s of reasoning).
        self.quiet_since: float | None = None
        self._idle = False  # a keep-alive is due
        # While the reader waits for events, it may take text events as they arrive, in the
        # link reader's task (no wake-up of its own): True if it took the event (Run.sink).
        self.sink: Callable[[RunEvent], bool] | None = None
        self._sunk_at = -math.inf  # when the frame whose event the sink last took arrived
        self._nudged = False  # the sink left the reader something to do (next_batch_or_idle returns [])
        self.output_bytes = 0  # text of its events so far (_size)
        self._pending_bytes = 0  # text or body bytes of the events waiting for the reader
        self.buffered = UNBOUNDED  # every run's (the service's)
        self._pending_from = -math.inf  # when the frame of the oldest event waiting arrived

    @property
    def link(self):
        return self.slot.link

    # -- producer side (link reader, timers) ---------------------------------

    def deliver(self, event: RunEvent, now: float) -> None:
        """``now``: when the frame holding it arrived (read once per frame)."""
        gauge = self.gauge
        if event.type in TEXT_TYPES and event.text:
            parts = event.parts  # from the node: at most one delta per character counts
            parts = 1 if parts <= 1 else min(parts, len(event.text))
            self.deltas_seen += parts
            if gauge is not None:
                gauge.streamed += parts
        elif event.type == PROGRESS:
            self._progress(now, event.parts)
            return
        elif event.type not in KNOWN_TYPES:
            # A type this edge does not know (a newer node's): an event that brings nothing
            # (PROTOCOL.md). Shaped, it ended the run as its error: a 502 with the event's text
            # as the message, for every run of such a node.
            self.slot.link.stray(now)
            return
        self._push(event, event.type in TERMINAL_TYPES, event.type == "complete", now)
        if gauge is not None and gauge.streamed > gauge.mark and not self.finished:
            gauge.check()

    def deliver_frame(self, frame: TunnelFrame, now: float) -> None:
        """A tunnel frame (passthrough runs): ``end`` and ``error`` end the run."""
        gauge = self.gauge
        if frame.kind == "body":  # a streamed answer's SSE events: its "tokens so far" (the console's)
            events = frame.body.count(b"data:")
            self.deltas_seen += events
            if gauge is not None:
                gauge.streamed += events
        self._push(frame, frame.kind in ("end", "error"), frame.kind == "end", now)
        if gauge is not None and gauge.streamed > gauge.mark and not self.finished:
            gauge.check()

    def _progress(self, now: float, parts: int) -> None:
        """The node's model server is streaming a tool call (no output yet): the run is
        alive. The first is its time to a first event; more than one a half
        :data:`PROGRESS_S` (one a half :data:`EARLY_PROGRESS_S` saying at least
        :data:`EARLY_PROGRESS_PARTS` pieces) is what a flood is (:meth:`NodeLink.stray`):
        a node sent a million a second saying 64 each, and kept 300 runs alive on nothing."""
        since = now - self.progress_at
        if self.finished or since < EARLY_PROGRESS_S / 2 or (since < PROGRESS_S / 2 and parts < EARLY_PROGRESS_PARTS):
            self.slot.link.stray(now)
            return
        if self.progress_first == -math.inf:
            self.progress_first = now
            if self.first_event_at is None:
                self.slot.link.started(self.id, now, True, self.slot.model, prompt_tokens(self))
        self.progress_at = now
        parts = min(parts, MAX_PROGRESS_PARTS)
        self.progress_parts += parts
        gauge = self.gauge
        if gauge is not None:
            gauge.streamed += parts
            if gauge.streamed > gauge.mark:
                gauge.check()

    def _push(self, item: RunEvent | TunnelFrame, terminal: bool, complete: bool, now: float) -> None:
        if self.finished:
            self.slot.link.stray(now)  # (what a node sent before it heard the run's cancel)
            return
        timed_out = terminal and not complete and now >= self.deadline
        if timed_out and type(item) is RunEvent:
            # The node's own deadline (the timeout_s the edge sent it, counted from a little
            # later) ended the run as the edge's fell due: the run timed out, as the edge's timer
            # would have said (the node's error won the race now and then: a 502 run_error), and
            # is not moved to another node as a failure at once would be.
            item = RunEvent(run_id=self.id, seq=item.seq, type=ERROR, text=RUN_TIMED_OUT)
        size = _size(item)
        if not size and not terminal and (type(item) is RunEvent or item.kind == "body"):
            # No output: no progress. The run's silence timeout runs on (a node sending empty
            # deltas kept a run that made nothing for 30 minutes), and it is not started.
            self.slot.link.stray(now)
            return
        if type(item) is RunEvent:
            self.output_bytes += size
            if self.output_bytes > MAX_OUTPUT_BYTES:
                self._drop_pending()
                self.fail(f"the node sent more than {MAX_OUTPUT_BYTES} bytes for this run", TOO_LARGE)
                return
        self.last_event_at = now
        if self.first_event_at is None:
            slot = self.slot
            link = slot.link
            slot.end_probe()
            answered = complete or not terminal
            # (not timed unless answered: a dead server's 1 ms failures made a slow node look stalled)
            link.started(self.id, now, answered, slot.model, prompt_tokens(self))
            if answered and type(item) is TunnelFrame and (item.status in _NODE_FAULTS or item.status >= 500):
                # A passthrough answer's head of the node's fault (a 5xx, its key refused): not
                # served, and counted (it reset the node's failures: a model server failing every
                # request drew most embeddings, and chat runs too; a re-check). Its error is the
                # client's to read as the provider said it: no move.
                link.failed_at_once(slot.model, now)
            elif answered:
                link.served(slot.model)
                if self.refused_by is not None:  # (a node that refused it at once: its own fault, then)
                    self.refused_by.failed_at_once(slot.model, now, refused=True)
                    self.refused_by = None
            elif not timed_out and (getattr(item, "status", 0) in _NODE_FAULTS or item.status >= 500):
                # failed at once, not for the client
                link.failed_at_once(slot.model, now)
                if self.on_failed_at_once is not None and self.on_failed_at_once(self, item):
                    return  # moved to another node: its silence is counted from now
            elif not timed_out and 400 <= getattr(item, "status", 0) < 500 and self.on_refused_at_once is not None:
                # Refused at once for the request (its fault, or its node's: a server with a
                # smaller context than its peers', a template that refuses; one such node among
                # three failed 80% of requests, looking idle to placement: found from outside).
                if self.on_refused_at_once(self, item):
                    return
            self.first_event_at = now
        if type(item) is RunEvent or item.kind != "response_start":
            # (a tunnel's head alone commits nothing: the edge holds it until the body begins,
            # so a run lost before its first byte of body can still move or be told so)
            self.events_seen += 1
        # One event a frame at most goes to the sink: the rest of a frame's events for this run
        # wait for the reader, which takes them in one batch (a frame of 10^5 tiny events is
        # one chunk, not 10^5 writes from the link's reader).
        if not terminal and self.sink is not None and not self._pending and self._sunk_at != now and self.sink(item):
            self._sunk_at = now
            return
        if not self._pending:
            self._pending_from = now
        self._pending.append(item)
        self._pending_bytes += size + EVENT_BYTES
        buffered = self.buffered
        buffered.bytes += size + EVENT_BYTES
        if self._pending_bytes > buffered.share:
            buffered.heavy.add(self)
            if buffered.bytes > buffered.cap:
                buffered.evict(now)
                if not self._pending_bytes:  # (this one was cut)
                    return
        if self._pending_bytes > HOLD_BYTES and not self.held and type(item) is TunnelFrame and not terminal:
            link = self.slot.link
            if link.holds_tunnels:
                self.held = True
                link.send_nowait(Hold(run_id=self.id))
        if terminal:
            self.finished = True
            self.cause = COMPLETE if complete else TIMEOUT if timed_out else RUN_ERROR
            if complete:
                self.slot.link.completed(self.slot.model, now)
            else:
                self.error = getattr(item, "text", None) or getattr(item, "error", None) or "error"
                self.error_status = getattr(item, "status", 0)
            if self.on_node_done is not None:  # (a client that does not read holds no node capacity)
                self.on_node_done(self)
        elif len(self._pending) > self._max_buffered or self._pending_bytes > MAX_PENDING_BYTES:
            if self._pending_from != now:  # the reader had its turn since the first of them
                # A tunnel's bytes come as its provider sends them: past the bound in bytes (a node
                # that takes no hold), the client is the one behind (it was the node's flood).
                relayed = type(item) is TunnelFrame and len(self._pending) <= self._max_buffered
                self._drop_pending()
                if now - self._pending_from < FLOOD_S and not relayed:
                    # Its reader took a batch less than FLOOD_S ago: the client reads, and the node
                    # floods (an honest node joins the deltas it reads together into one event).
                    self.fail(
                        f"the node sent more than {self._max_buffered} events for this run faster than the"
                        " edge could send them on; run cancelled",
                        TOO_LARGE,
                    )
                else:
                    said = " fast enough; " if relayed else "; "
                    self.fail(f"client is not reading the response{said}run cancelled", SLOW_CLIENT)
                return
            if self._pending_bytes > MAX_PENDING_BYTES:  # one frame: the node's doing, not the client's
                self._drop_pending()
                self.fail(f"the node sent more than {MAX_PENDING_BYTES} bytes in one frame for this run", TOO_LARGE)
                return
        self._wake()

    def _go_on(self) -> None:
        """Its reader takes a batch of a held tunnel: the node goes on once little waits.
        Meanwhile its silence is the edge's doing: the reader's progress keeps it alive."""
        self.last_event_at = trio.current_time()
        if self._pending_bytes <= GO_ON_BYTES and not self.finished:
            self.held = False
            self.slot.link.send_nowait(Hold(run_id=self.id, hold=False))

    def _drop_pending(self) -> None:
        """Drop the events waiting for the reader (the run is failed next)."""
        self._pending.clear()
        self._taken()

    def _taken(self) -> None:
        """The events waiting for the reader are gone (taken, dropped)."""
        buffered = self.buffered
        buffered.bytes -= self._pending_bytes
        if self._pending_bytes > buffered.share:
            buffered.heavy.discard(self)
        self._pending_bytes = 0

    def cut_slow(self) -> None:
        """The edge's buffers are full and this client is among the furthest behind: what
        waits for it is dropped, and it gets an error in its place (its run cancelled on the
        node, if it goes on)."""
        finished = self.finished
        self._drop_pending()
        message = "client is not reading the response fast enough; run cancelled"
        if not finished:
            self.fail(message, SLOW_CLIENT)
            return
        self.cause = SLOW_CLIENT
        self.error = message
        self._pending.append(RunEvent(run_id=self.id, seq=0, type=ERROR, text=message))
        self._wake()

    def node_fault(self) -> bool:
        """The node's error event said the fault is the node's or its model server's
        (no status, or one of theirs), not the client's request (a 400)."""
        status = self.error_status
        return status in _NODE_FAULTS or status >= 500

    def fail(self, message: str, cause: str) -> None:
        """End the run from the edge's side: the client sees ``message`` as a
        run error, and the node is told to stop (unless it is gone)."""
        if self.finished:
            return
        self.finished = True
        self.cause = cause
        self.error = message
        self._pending.append(RunEvent(run_id=self.id, seq=0, type=ERROR, text=message))
        self._wake()
        self._cancel_on_node(cause)
        if cause != NODE_LOST and self.on_node_done is not None:
            # The node is told to stop: its slot is free once the node has the cancel (or now, of
            # a node that does not answer cancels), as for a run the node ended, not when the
            # request ends (8 clients that read nothing, their runs cut, held an 8-slot model's
            # every slot until write_timeout_s, the GPU idle: an outside audit).
            self.on_node_done(self)

    def _cancel_on_node(self, cause: str) -> None:
        if cause != NODE_LOST:  # a lost node has nothing left to cancel
            self.slot.link.cancel(self.id, cause, self.slot)

    def due(self) -> float:
        """When the run times out if nothing arrives (silence, or the whole-run
        deadline), or sooner when its reader's keep-alive is due."""
        due = self._times_out_at()
        if self.keepalive > 0:
            last = self.last_event_at if self.quiet_since is None else self.quiet_since
            return min(due, max(last, self.idle_since) + self.keepalive)
        return due

    def timed_out(self, now: float) -> bool:
        return self._times_out_at() <= now

    def _times_out_at(self) -> float:
        if self.requeued is not None:  # (no node has it: its wait ahead of the queue is move_until's)
            return min(self.deadline, self.move_until)
        last = self.last_event_at if self.last_event_at > self.progress_at else self.progress_at
        return min(last + self.wait_timeout, self.deadline, self.move_until)

    def give_up_move(self) -> None:
        """A run moved off a node that failed it at once found no slot within the
        queue's timeout: it ends with that node's error, as if it had not moved."""
        held, self.held_error = self.held_error, None
        assert held is not None
        self.finished = True
        self.cause = RUN_ERROR
        self.error = held.text
        self._pending.append(held)
        self._wake()

    # -- consumer side (the request) -----------------------------------------

    def _wait(self) -> Awaitable[None]:
        """Sleep until :meth:`_wake` (await it). A run has one reader, so this
        is a task slot, not a ParkingLot; and not a coroutine: the lot, its
        frame and this one's were 0.9 KB of every waiting stream."""
        if self._reader is not None:
            raise trio.BusyResourceError("another task is already reading this run")
        self._reader = trio.lowlevel.current_task()
        return trio.lowlevel.wait_task_rescheduled(self._abort_wait)  # noqa: ASYNC105 (the caller awaits it)

    def _abort_wait(self, _: object) -> trio.lowlevel.Abort:
        self._reader = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _wake(self) -> None:
        reader = self._reader
        if reader is not None:
            self._reader = None
            trio.lowlevel.reschedule(reader)

    async def next_batch(self) -> list[RunEvent]:
        """The events queued since the last call (at least one; :meth:`_batch`)."""
        await trio.lowlevel.checkpoint_if_cancelled()  # (see next_batch_or_idle)
        while not self._pending:
            await self._wait()
        return self._batch()

    def _batch(self) -> list[RunEvent]:
        """The waiting events, or as many of the oldest as hold :data:`MAX_BATCH_BYTES` (one
        at least) when they hold more: the rest wait, counted in the edge's bound. What a
        writer took is out of the bound's reach until its client takes it; a reader of the
        first bytes of an answer that then stopped held its whole batch (up to 32 MiB)."""
        most = HELD_BATCH_BYTES if self.held else MAX_BATCH_BYTES
        if self._pending_bytes <= most:
            batch = self._pending
            self._pending = []
            self._taken()
        else:
            batch = self._take_part(most)
        if self.held:
            self._go_on()
        return batch

    def _take_part(self, most: int) -> list[RunEvent]:
        """The oldest waiting events holding at most ``most`` bytes (one at least; rare: a
        client this far behind): the rest stay, counted."""
        pending = self._pending
        size = end = 0
        for item in pending:
            more = _size(item) + EVENT_BYTES
            if end and size + more > most:
                break
            size += more
            end += 1
        self._pending = pending[end:]
        buffered = self.buffered
        buffered.bytes -= size
        was = self._pending_bytes
        self._pending_bytes = left = was - size
        if was > buffered.share >= left:
            buffered.heavy.discard(self)
        return pending[:end]

    async def next_batch_or_idle(self) -> list[RunEvent] | None:
        """Like :meth:`next_batch`, or None when ``keepalive`` seconds passed
        with no event (and none since the last None): the run's
        :class:`RunTimers` say so, so waiting costs no cancel scope.

        A cancel is delivered here even when events are waiting: a stream whose
        next event was there each time it looked (a fast node) never waited, and
        once its client had left its writes went through the server's shielded
        send, so it never saw the cancel and its run went on for no one (200
        streams of a node writing in step with the edge: 35 to 141 runs still
        going 8 s after their clients left)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._pending:
            if self._idle:
                self._idle = False
                return None
            if self._nudged:
                self._nudged = False
                return []
            await self._wait()
        self._idle = False
        self._nudged = False
        return self._batch()

    def shaped(self, shape: Callable[[list[RunEvent]], T], batch: list[RunEvent]) -> T:
        """``shape(batch)``. A batch of :data:`MANY_EVENTS` or more, or any while its link is
        past its pace, is then emptied (its events freed), and the time of both is its link's
        (:class:`edge.frame_limit.LinkHold`'s ``owed``: charged at the link's next read
        while it is past its pace). A node that alternated reasoning and text one character
        at a time, 8,192 events a frame, had the edge's writers shape each alone, uncharged:
        the edge at 96%, ``/healthz`` p50 181 ms (an outside audit)."""
        hold = self.slot.link.hold
        if len(batch) < MANY_EVENTS and (hold is None or not hold.over):
            return shape(batch)
        started = perf_counter()
        try:
            return shape(batch)
        finally:
            batch.clear()
            if hold is not None:
                hold.owed += perf_counter() - started

    def nudge(self) -> None:
        """Wake the reader with nothing new (:meth:`next_batch_or_idle` returns
        ``[]``): the sink left it bytes to write, or an error to raise."""
        self._nudged = True
        self._wake()

    def idle_due(self, now: float) -> None:
        """Called by the timers ``keepalive`` seconds after the last event or keep-alive."""
        self.idle_since = now
        self._idle = True
        self._wake()

    def close(self, cause: str) -> None:
        """Release the run. If it has not ended, it is cancelled on the node
        with ``cause``. Synchronous and idempotent: safe in any ``finally``."""
        if self.closed:
            return
        if not self.finished:
            self.finished = True
            self.cause = cause
            self._cancel_on_node(cause)
        self.closed = True
        self._taken()  # (events no reader took)
        self._on_close(self)


async def consume_run(run: Run, consume: Callable[[Run], Awaitable[T]], keepalive: float = 0.0) -> T:
    """``consume`` the run while the service's :class:`RunTimers` enforce its
    timeouts (and, with ``keepalive``, wake :meth:`Run.next_batch_or_idle`).
    Whatever happens, the run is closed on the way out: cancelled on the node
    unless it ended, with cause ``client_gone`` when the caller's scope was
    cancelled (the client left, or the edge is shutting down)."""
    run.keepalive = keepalive
    if run.timers is not None:
        run.timers.add(run)
    try:
        return await consume(run)
    finally:
        gone = trio.current_effective_deadline() == -math.inf
        run.close(CLIENT_GONE if gone else "abandoned")


# The timers woke this much past a run's due time: the edge itself was held (a pause, a loop held),
# and its links are read for HELD_GRACE_S before any run's silence is judged.
HELD_S = 1.0
HELD_GRACE_S = 1.0


class RunTimers:
    """Fails every run whose node went silent for ``wait_timeout`` or whose
    whole-run deadline passed, and wakes the reader of a run with a
    ``keepalive`` when that long passed with no event, from one task for all
    runs (a heap of due times) rather than a task per run: a stream then holds
    no timer task, no nursery and no cancel scope while it waits, nor makes
    one per wait. A run's entry is re-armed
    when it comes due while events kept arriving; a closed run's entry is
    emptied at once and dropped when it comes up (or when empties pile up).
    The timeout fires even while the request's writer is blocked on a slow
    client: it fails the run (an error event, a cancel to the node)."""

    def __init__(self) -> None:
        self._heap: list[list] = []  # [due, seq, run or None]
        self._seq = itertools.count()
        self._changed = trio.lowlevel.ParkingLot()
        self._empty = 0

    def __len__(self) -> int:
        return len(self._heap) - self._empty

    def add(self, run: Run) -> None:
        entry = [run.due(), next(self._seq), run]
        run.timer = entry
        heapq.heappush(self._heap, entry)
        if self._heap[0] is entry:
            self._changed.unpark_all()  # sooner than what the task sleeps until

    def reschedule(self, run: Run) -> None:
        """The run's due time moved (sooner, maybe): its timer is set again."""
        if run.timer is not None:
            self.discard(run)
            self.add(run)

    def discard(self, run: Run) -> None:
        entry = run.timer
        if entry is None:
            return
        run.timer = None
        entry[2] = None
        self._empty += 1
        if self._empty > 1024 and 2 * self._empty > len(self._heap):
            # In place: this may run inside :meth:`run`'s walk of the heap (a run's timeout frees a
            # slot, and a moved run sent on it has its timer set again), which holds the list (a
            # new one left it pushing re-armed entries onto the old: runs due in 5 s not timed out
            # after 6; a review).
            self._heap[:] = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)
            self._empty = 0

    async def run(self) -> None:
        while True:
            now = trio.current_time()
            heap = self._heap
            while heap and heap[0][0] <= now:
                entry = heapq.heappop(heap)
                run = entry[2]
                if run is None:
                    self._empty -= 1
                    continue
                if run.timed_out(now):
                    run.timer = None
                    if run.held_error is not None and run.requeued is not None:
                        run.give_up_move()
                    elif run.requeued is not None and run.move_until <= now:
                        # Moved off a lost (or stalled) node and no slot within the queue's timeout:
                        # it waited out wait_timeout_s for a 504 "run timed out" it never started.
                        run.fail(NOT_MOVED, NODE_LOST)
                    else:
                        run.fail(RUN_TIMED_OUT, TIMEOUT)
                    continue
                due = run.due()
                if due <= now:  # only a keep-alive is due
                    run.idle_due(now)
                    due = run.due()
                entry[0], entry[1] = due, next(self._seq)
                heapq.heappush(heap, entry)
            deadline = heap[0][0] if heap else math.inf
            with trio.move_on_at(deadline):
                await self._changed.park()
            if trio.current_time() - deadline > HELD_S:
                # The edge itself was held past a run's due time (SIGSTOP, a paused VM, a loop held):
                # its links' bytes, events of runs that went on, wait unread. They are read first, and
                # a run's silence judged after (healthy streams of an edge paused 6 s, wait_timeout_s
                # 5, ended "run timed out", their nodes' events in the sockets: an outside audit).
                await trio.sleep(HELD_GRACE_S)
