"""A link's outbox: everything the node sends to one edge, waiting for the
link's sender, the only task that writes to the websocket.

Nothing else ever waits for the network:

- control frames (pong, ping, load) go to a small bounded queue that the
  sender empties before anything else, even between two frames of a batch;
  a pong or ping that finds it full is dropped (the sender is stuck, so it
  could not have gone out anyway, and the peer's liveness check decides);
- grants go ahead of everything else, and are never dropped: only the latest
  grant of each model waits (a newer one replaces it; the edge acknowledges
  by sequence number, so a grant it never saw needs no answer);
- run events and tunnel frames wait in the pending lists; the sender takes
  all of them at once and packs the events into ``events`` frames of at most
  ``budget`` bytes. Run tasks wait while too much is pending. Text of a run
  that arrives while its previous delta is still pending joins that delta
  (up to :data:`MAX_JOINED` bytes): when the link is the bottleneck, tokens
  travel together instead of queueing one event each;
- ``placed`` hints (another edge's run went here) go with the next batch; at
  most :data:`MAX_HINTS` wait, the oldest dropped first.

Sizes are upper bounds estimated where an event is made, never measured by
encoding: :func:`text_bytes` counts one byte per character of an ASCII
string and four otherwise (O(1) in CPython), plus a fixed overhead per event.
So the sender encodes each frame once, and in the common case (everything
pending fits one frame) looks at no event at all.
"""

from __future__ import annotations

from collections import deque

import trio

from proto import Events, Grant, Load, Ping, Placed, Pong, RunEvent, ToolCall, TunnelFrame
from proto.frames import MAX_FRAME_EVENTS, MAX_FRAME_TOOL_CALLS, MAX_FREED

FRAME_MARGIN = 4096  # below the edge's limit: the frame's own keys, with room to spare
EVENT_OVERHEAD = 128  # one run event's keys, type, seq, status and msgpack headers
TOOL_CALL_OVERHEAD = 64
USAGE_BYTES = 128
HEADER_OVERHEAD = 16  # one tunnelled header pair's msgpack headers
MAX_CONTROL = 16  # control frames waiting for the sender
MIN_BUDGET = 1024  # an absurdly small limit from an edge must not split text into single characters
MAX_JOINED = 16 * 1024  # a pending delta grows by later text of its run up to this (bounds the copying)
MAX_HINTS = 256  # ``placed`` frames waiting for the sender; the oldest is dropped (a hint, not a duty)

ControlFrame = Pong | Ping | Load | Grant


def text_bytes(text: str) -> int:
    """An upper bound of ``len(text.encode())``, without encoding."""
    return len(text) if text.isascii() else 4 * len(text)


def tool_calls_bytes(calls: list[ToolCall] | None) -> int:
    if not calls:
        return 0
    return sum(
        TOOL_CALL_OVERHEAD
        + text_bytes(c.id)
        + text_bytes(c.type)
        + text_bytes(c.function.name)
        + text_bytes(c.function.arguments)
        for c in calls
    )


def frame_budget(node_limit: int, edge_limit: int) -> int:
    """The most bytes one frame may hold: the smaller of the two sides'
    limits (the edge's is 0 when it did not say), less a margin."""
    limit = min(node_limit, edge_limit) if edge_limit > 0 else node_limit
    return max(limit - min(FRAME_MARGIN, limit // 4), MIN_BUDGET)


def split_text(text: str, room: int) -> list[str]:
    """``text`` in consecutive pieces, each estimated at most ``room`` bytes."""
    step = max(room if text.isascii() else room // 4, 1)
    return [text[i : i + step] for i in range(0, len(text), step)]


# Pending bytes that cannot hold more than MAX_FRAME_TOOL_CALLS calls (each is counted
# TOOL_CALL_OVERHEAD bytes at least): up to this, take() need not count them.
CALLS_FIT = MAX_FRAME_TOOL_CALLS * TOOL_CALL_OVERHEAD


def _calls(event: RunEvent) -> int:
    return len(event.tool_calls) if event.tool_calls else 0


def pack(events: list[RunEvent], sizes: list[int], budget: int) -> list[list[RunEvent]]:
    """Consecutive batches of ``events`` whose estimated sizes sum to at most
    ``budget`` each (an event is never larger than the budget: the sinks split
    or refuse it), of at most :data:`MAX_FRAME_EVENTS` events and
    :data:`MAX_FRAME_TOOL_CALLS` tool calls (an event has MAX_TOOL_CALLS at most)."""
    batches: list[list[RunEvent]] = []
    start = total = calls = 0
    for i, size in enumerate(sizes):
        more = _calls(events[i])
        if (
            total + size > budget or i - start >= MAX_FRAME_EVENTS or calls + more > MAX_FRAME_TOOL_CALLS
        ) and i > start:
            batches.append(events[start:i])
            start, total, calls = i, 0, 0
        total += size
        calls += more
    batches.append(events[start:])
    return batches


class Outbox:
    def __init__(self, budget: int, max_events: int, max_bytes: int = 0) -> None:
        self.budget = budget
        self._max_items = max(max_events, 1)
        self._max_bytes = max_bytes or 2 * budget  # pending, before producers wait
        self._control: deque[ControlFrame] = deque()
        self._grants: dict[str, Grant] = {}  # model -> the latest grant not sent yet
        self._events: list[RunEvent] = []
        self._sizes: list[int] = []
        self._tunnel: list[TunnelFrame] = []
        self._hints: deque[Placed] = deque(maxlen=MAX_HINTS)
        self._bytes = 0  # estimated, of the pending events and tunnel frames
        self._busy = False  # the sender holds frames it has not sent yet
        self.generation = 0  # counts take()s and drop_run()s: an event queued in this generation is still pending
        self._wakeup = trio.lowlevel.ParkingLot()  # the sender waits here
        self._progress = trio.lowlevel.ParkingLot()  # producers and flushed() wait here

    # -- producers ----------------------------------------------------------

    def control_nowait(self, frame: ControlFrame) -> bool:
        """Queue a control frame; False (and nothing queued) when the queue is full."""
        if len(self._control) >= MAX_CONTROL:
            return False
        self._control.append(frame)
        self._wakeup.unpark_all()
        return True

    def grant(self, frame: Grant) -> None:
        """Queue a grant, replacing an unsent one of the same model (the runs
        that one said were freed, the new one says)."""
        unsent = self._grants.get(frame.model)
        if unsent is not None and unsent.freed:
            frame.freed = unsent.freed
        self._grants[frame.model] = frame
        self._wakeup.unpark_all()

    def freed(self, model: str, run_id: str, slots: int, seq: int) -> None:
        """Answer the edge's cancel of ``run_id``: the grant of ``model`` that stands
        after it goes with it (the unsent one, or the last sent again)."""
        unsent = self._grants.get(model)
        if unsent is None:
            self._grants[model] = Grant(model=model, slots=slots, seq=seq, freed=[run_id])
            self._wakeup.unpark_all()
        elif len(unsent.freed) < MAX_FREED:  # (an honest edge has no more cancels unanswered than slots)
            unsent.freed.append(run_id)

    def hint(self, frame: Placed) -> None:
        """Queue a ``placed`` hint (dropping the oldest waiting one when full;
        one that would not fit a frame is not sent at all)."""
        if EVENT_OVERHEAD + text_bytes(frame.model) + 9 * len(frame.prefix) > self.budget:
            return
        self._hints.append(frame)
        self._wakeup.unpark_all()

    async def control(self, frame: ControlFrame) -> None:
        """Queue a control frame, waiting for room."""
        while not self.control_nowait(frame):
            await self._progress.park()

    def event_nowait(self, event: RunEvent, size: int) -> bool:
        """Queue a run event of estimated ``size`` bytes (at most the budget);
        False: too much is pending now, await :meth:`room` before queueing more."""
        self._events.append(event)
        self._sizes.append(size)
        self._bytes += size
        if self._wakeup:
            self._wakeup.unpark_all()
        return self.has_room()

    async def event(self, event: RunEvent, size: int) -> None:
        """Queue a run event, then wait while too much is pending."""
        if not self.event_nowait(event, size):
            await self.room()

    def pending_index(self) -> int:
        """Where the next event will sit in the pending list."""
        return len(self._events)

    def grow(self, index: int, generation: int, extra: int) -> bool:
        """Count ``extra`` more bytes in the event queued at ``index`` in
        ``generation``, if it is still pending and stays small (the caller
        then adds them to it at once, and awaits :meth:`room`); False: queue a
        new event instead."""
        if generation != self.generation or self._sizes[index] + extra > MAX_JOINED:
            return False
        self._sizes[index] += extra
        self._bytes += extra
        return True

    def drop_run(self, run_id: str) -> None:
        """Forget the pending events of a run the edge cancelled: they would reach the edge as
        events of a run it no longer has (a flood of one-character deltas left 4,096 of them
        queued, and the edge closed the link for them, failing every other run on it). Joins
        start afresh (the pending list's positions moved)."""
        events, sizes = self._events, self._sizes
        kept = [i for i, e in enumerate(events) if e.run_id != run_id]
        if len(kept) == len(events):
            return
        self._bytes -= sum(sizes) - sum(sizes[i] for i in kept)
        self._events = [events[i] for i in kept]
        self._sizes = [sizes[i] for i in kept]
        self.generation += 1
        self._progress.unpark_all()

    def has_room(self) -> bool:
        return len(self._events) + len(self._tunnel) < self._max_items and self._bytes < self._max_bytes

    async def room(self) -> None:
        """Wait while too much is pending."""
        while not self.has_room():
            await self._progress.park()

    async def tunnel(self, frame: TunnelFrame, size: int, ahead: int = 0) -> None:
        """Queue a tunnel frame; wait while too much is pending, or (``ahead``) while more
        than that is."""
        self._tunnel.append(frame)
        self._bytes += size
        if self._wakeup:
            self._wakeup.unpark_all()
        await self.room()
        while ahead and self._bytes > ahead:
            await self._progress.park()

    async def flushed(self) -> None:
        """Return once everything queued so far has been sent."""
        while self._grants or self._control or self._events or self._tunnel or self._hints or self._busy:
            await self._progress.park()

    # -- the sender ---------------------------------------------------------

    async def wait(self) -> None:
        while not (self._grants or self._control or self._events or self._tunnel or self._hints):
            await self._wakeup.park()

    def next_control(self) -> ControlFrame | None:
        if self._grants:
            model = next(iter(self._grants))
            return self._grants.pop(model)
        if not self._control:
            return None
        frame = self._control.popleft()
        self._progress.unpark_all()
        return frame

    def take(self) -> list[Events | TunnelFrame | Placed]:
        """Every pending event, tunnel frame and hint, as frames under the budget.
        The outbox counts as busy until :meth:`done`."""
        events, sizes, tunnel, pending_bytes = self._events, self._sizes, self._tunnel, self._bytes
        self._events, self._sizes, self._tunnel, self._bytes = [], [], [], 0
        self.generation += 1
        self._busy = True
        self._progress.unpark_all()
        frames: list[Events | TunnelFrame | Placed] = []
        if (
            events
            and pending_bytes <= self.budget
            and len(events) <= MAX_FRAME_EVENTS
            and (pending_bytes <= CALLS_FIT or sum(map(_calls, events)) <= MAX_FRAME_TOOL_CALLS)
        ):  # one frame (and, unless over 256 KiB, no event looked at)
            frames.append(Events(events=events))
        elif events:
            frames.extend(Events(events=batch) for batch in pack(events, sizes, self.budget))
        frames.extend(tunnel)
        if self._hints:
            frames.extend(self._hints)
            self._hints.clear()
        return frames

    def done(self) -> None:
        self._busy = False
        self._progress.unpark_all()
