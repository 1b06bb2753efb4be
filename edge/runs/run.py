"""One run: the events a node sends for it, its timers, and how it ends."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import trio

from proto import CancelRun, RunEvent, TunnelFrame
from proto.frames import DELTA, ERROR, REASONING_DELTA, TERMINAL_TYPES

TEXT_TYPES = frozenset((DELTA, REASONING_DELTA))

if TYPE_CHECKING:
    from edge.runs.service import Slot

# Causes a run can end with (metrics label values).
COMPLETE = "complete"
RUN_ERROR = "run_error"
CLIENT_GONE = "client_gone"
TIMEOUT = "timeout"
NODE_LOST = "node_lost"
SLOW_CLIENT = "slow_client"
SHUTDOWN = "shutdown"
UNSENDABLE = "unsendable"  # the run's request could not be encoded or framed for the node

T = TypeVar("T")

RUN_TIMED_OUT = "run timed out"
NODE_DISCONNECTED = "node disconnected"


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
        "_lot",
        "_max_buffered",
        "wait_timeout",
        "deadline",
        "last_event_at",
        "started_at",
        "first_event_at",
        "events_seen",
        "deltas_seen",
        "finished",
        "closed",
        "cause",
        "_on_close",
        "want",
        "request",
        "failed_over",
        "requeued",
        "api",
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
        self._lot = trio.lowlevel.ParkingLot()
        self._max_buffered = max_buffered
        self.wait_timeout = wait_timeout
        self.deadline = now + run_timeout
        self.started_at = now
        self.last_event_at = now
        self.first_event_at: float | None = None
        self.events_seen = 0
        self.deltas_seen = 0  # model-server text deltas in the events seen (a node joins those read together)
        self.finished = False  # a terminal event is queued: nothing more will arrive
        self.closed = False
        self.cause: str | None = None
        self._on_close = on_close
        self.want = None  # what the request needs of a node (for failover)
        self.request = None  # the RunRequest frame, kept until the run closes (for failover)
        self.failed_over = False
        self.requeued = None  # while a failed-over run waits for a slot: its place in the queue
        self.api = ""  # the front door its request came through (a metrics label; never sent to the node)

    @property
    def link(self):
        return self.slot.link

    # -- producer side (link reader, timers) ---------------------------------

    def deliver(self, event: RunEvent, now: float) -> None:
        """``now``: when the frame holding it arrived (read once per frame)."""
        if event.type in TEXT_TYPES:
            self.deltas_seen += event.parts or 1
        self._push(event, event.type in TERMINAL_TYPES, event.type == "complete", now)

    def deliver_frame(self, frame: TunnelFrame, now: float) -> None:
        """A tunnel frame (passthrough runs): ``end`` and ``error`` end the run."""
        self._push(frame, frame.kind in ("end", "error"), frame.kind == "end", now)

    def _push(self, item: RunEvent | TunnelFrame, terminal: bool, complete: bool, now: float) -> None:
        if self.finished:
            return
        self.last_event_at = now
        if self.first_event_at is None:
            self.first_event_at = now
            self.slot.link.started(self.id, now)
        self.events_seen += 1
        self._pending.append(item)
        if terminal:
            self.finished = True
            self.cause = COMPLETE if complete else RUN_ERROR
        elif len(self._pending) > self._max_buffered:
            self._pending.clear()
            self.fail("client is not reading the response; run cancelled", SLOW_CLIENT)
            return
        self._lot.unpark_all()

    def fail(self, message: str, cause: str) -> None:
        """End the run from the edge's side: the client sees ``message`` as a
        run error, and the node is told to stop (unless it is gone)."""
        if self.finished:
            return
        self.finished = True
        self.cause = cause
        self._pending.append(RunEvent(run_id=self.id, seq=0, type=ERROR, text=message))
        self._lot.unpark_all()
        self._cancel_on_node(cause)

    def _cancel_on_node(self, cause: str) -> None:
        if cause != NODE_LOST:  # a lost node has nothing left to cancel
            self.slot.link.send_nowait(CancelRun(run_id=self.id, reason=cause))

    async def enforce_timeouts(self) -> None:
        """Fail the run when the node is silent for ``wait_timeout`` or the
        whole-run deadline passes. Runs as a task the request owns, so it
        fires even while the response writer is blocked on a slow client."""
        while not self.finished:
            due = min(self.last_event_at + self.wait_timeout, self.deadline)
            if trio.current_time() >= due:
                self.fail(RUN_TIMED_OUT, TIMEOUT)
                return
            await trio.sleep_until(due)

    # -- consumer side (the request) -----------------------------------------

    async def next_batch(self) -> list[RunEvent]:
        """Every event queued since the last call (at least one)."""
        while not self._pending:
            await self._lot.park()
        batch = self._pending
        self._pending = []
        return batch

    async def next_batch_within(self, seconds: float) -> list[RunEvent] | None:
        """Like :meth:`next_batch`, or None after ``seconds`` of silence (keep-alive time)."""
        with trio.move_on_after(seconds):
            return await self.next_batch()
        return None

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
        self._on_close(self)


async def consume_run(run: Run, consume: Callable[[Run], Awaitable[T]]) -> T:
    """``consume`` the run inside a nursery that also enforces its timers.
    Whatever happens, the run is closed on the way out: cancelled on the node
    unless it ended, with cause ``client_gone`` when the caller's scope was
    cancelled (the client left, or the edge is shutting down)."""
    error: Exception | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run.enforce_timeouts)
            try:
                result = await consume(run)
            except Exception as e:  # raised below, unwrapped; Cancelled passes through
                error = e
            nursery.cancel_scope.cancel()
    finally:
        gone = trio.current_effective_deadline() == -math.inf
        run.close(CLIENT_GONE if gone else "abandoned")
    if error is not None:
        raise error
    return result
