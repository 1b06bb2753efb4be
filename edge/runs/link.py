"""The edge's view of one linked node."""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
import trio

from proto import CancelRun, Demand, EngineLoad, Frame, ModelInfo, Ping, Pong, RunRequest, TunnelRequest

if TYPE_CHECKING:
    from edge.frame_limit import LinkHold
    from edge.runs.run import Run
    from edge.runs.service import Slot

log = structlog.get_logger("iop.edge.link")

MAX_LIVENESS_QUEUED = 64  # pings and pongs waiting for the link's writer; more are dropped (the node is not reading)
# Prefix-chain keys relayed by one node (``placed``) the edge records per second; beyond
# that they are dropped (hints only). About 40 ms of the edge's CPU a second at most,
# against some 40,000 an honest node relays at 1,000 runs a second of 10k-token prompts.
PLACED_KEYS_PER_S = 200_000


def _finite(value: float | None) -> float | None:
    return value if value is not None and 0 <= value < math.inf else None


def _fraction(value: float | None) -> float | None:
    """A share (0..1, PROTOCOL.md): more is 1 (a node's 1e308 was shown in /v1/nodes and /metrics)."""
    value = _finite(value)
    return min(value, 1.0) if value is not None else None


KV_CACHE_FULL = 0.9  # a model server's KV cache past this fraction makes its node look busier
_STALL_BACKOFF_S = (10.0, 300.0)  # how long a stalled node is routed around: first time, at most
# A node whose model server fails run after run before any output (connection refused, 5xx) is
# routed around for a model after this many in a row, for this long (first time, at most).
EJECT_AFTER = 3
_EJECT_BACKOFF_S = (1.0, 30.0)
# The edge closes a link with these when the node is at fault: it broke the protocol, or flooded its
# link with events for no run (RFC 6455's policy violation; StrayFlood).
CLOSE_PROTOCOL = 4003
CLOSE_POLICY = 1008
BROKE_THE_PROTOCOL = (CLOSE_PROTOCOL, CLOSE_POLICY)  # the edge closed the link: its node is awaited by none
# Events that bring the edge nothing (for a run it does not have, or has ended; or with no
# output at all) cost its CPU for each (~0.25 us): a node sent 1.8 million a second, for ever.
# An honest node sends a few after the edge cancels a run (what was on its way), never empty
# ones. A link may bring STRAY_EVENTS of them per STRAY_WINDOW_S, plus STRAY_PER_CANCEL for
# each run this edge cancelled on the node (up to STRAY_MOST in hand); past that it is closed.
STRAY_EVENTS = 10_000
STRAY_WINDOW_S = 10.0
STRAY_PER_CANCEL = 8192  # a node's outbox holds 4,096 events by default, and more are on the wire
STRAY_MOST = 1_000_000
# A link whose reads waited for their part of the edge's time (edge.frame_limit) within this
# long is shown throttled (/v1/nodes, the console): its pinger waits the throttle out, so a node
# held back for minutes looked healthy, only the process-wide iop_link_throttled_seconds_total
# saying anything (an outside audit).
THROTTLE_SHOWN_S = 5.0


class StrayFlood(Exception):
    """Raised in the link's reader: the node sent more events that bring nothing
    than :meth:`NodeLink.stray` allows; its link is closed."""


class NodeLink:
    """A node's models, its capacity use, its runs and its outgoing frames.

    Frames to the node wait in two queues drained by the link's sender task,
    control frames (ping, pong, cancel) first; a ``demand`` keeps its place
    among the run requests (it acknowledges a grant: the node must have every
    run sent before it). :meth:`send_nowait` never
    blocks and never kills the link: a node that reads slowly is back-pressure,
    not death (the pinger judges death, by silence). The queues are bounded by
    construction: run and tunnel requests by the node's capacity (a request
    holds a slot; a run that ends before its request left takes it out, and
    sends no cancel), cancels by one per run, pings and pongs by one per beat.
    """

    def __init__(self, node_id: str, models: list[ModelInfo], grants: dict[str, int] | None = None) -> None:
        self.node_id = node_id
        self.models: dict[str, ModelInfo] = {m.name: m for m in models}
        self.in_flight: dict[str, int] = {m.name: 0 for m in models}
        # The node's grant per model (runs this edge may have on it) and the
        # grant's sequence number. A linked node starts with none (``{}``):
        # nothing is sent before its first grant. None: the whole capacity.
        self.grants: dict[str, int] = {
            m.name: m.max_concurrency if grants is None else grants.get(m.name, 0) for m in models
        }
        self.grant_seq: dict[str, int] = {m.name: 0 for m in models}
        # Per model, the runs placement may have on the node: its capacity, or, while it earns
        # that (:meth:`on_trial`), fewer, one more for each run of the model it completes.
        self.trusted: dict[str, int] = {m.name: m.max_concurrency for m in models}
        self.trial: set[str] = set()  # the models it is earning (trusted below their capacity)
        self.held: set[str] = set()  # of those, the ones held for a claim far past its peers' (RunService)
        self.runs: dict[str, Run] = {}
        self.linked_at = trio.current_time()
        self.linked_wall = time.time()
        self.last_rx = self.linked_at
        self.draining = False
        self.relays_prefixes = False  # the node tells other edges where this edge's prompts went
        self.holds_tunnels = False  # the node pauses a tunnel's body on a Hold frame
        self.answers_cancels = False  # the node answers a cancel naming the model with a grant (``freed``)
        # Runs cancelled here whose slot stays taken until the node's answer (run id -> slot):
        # at most the runs the node's grants allow, as each holds a slot.
        self.cancelling: dict[str, Slot] = {}
        # The largest frame the node takes (its hello's, within the edge's own): placement sends it
        # no run whose request is larger (:class:`edge.runs.service.Want`).
        self.frame_limit = 1 << 62
        self.hold: LinkHold | None = None  # its reads' part of the edge's time (edge.link sets it)
        self._placed_since = -math.inf  # the current second of ``placed`` keys, and the keys in it
        self._placed_keys = 0
        self.closed = False
        self.close_reason = ""
        self.close_code = 1000
        self._control: collections.deque[Frame] = collections.deque()
        self._requests: collections.deque[Frame] = collections.deque()
        self.demands_queued = 0  # demand frames waiting in _requests
        self._ready = trio.lowlevel.ParkingLot()
        # Set by the link's task: writes one frame to the node's socket now, returning None when
        # it cannot (the frame is then queued), else what the kernel did not take (b"" when all).
        self.write_now: Callable[[Frame], bytes | None] | None = None
        self._writer_idle = False  # the writer is parked with nothing queued
        self._rest = b""  # the unsent end of a frame written now: the writer sends it before anything else
        self._cancel_scope: trio.CancelScope | None = None
        # Runs sent and not started (no event yet), oldest first: run id -> when sent.
        self.unstarted: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.engine: dict[str, EngineLoad] = {}  # model -> its server's own load, as the node last reported
        self.ttft: float | None = None  # moving average of the time to a run's first event
        self.ttft_of: dict[str, float] = {}  # the same, per model (a stall is judged against a model's peers)
        self.prompt_of: dict[str, float] = {}  # the same of the runs' estimated prompt tokens (what a ttft was for)
        self.stalled_until: dict[str, float] = {}  # model -> routed around for it until then (runs not starting)
        self._stall_backoff: dict[str, float] = {}  # model -> for how long, the next time it stalls
        self.errors_in_row: dict[str, int] = {}  # model -> runs failed after output since one completed
        self.completed_at: dict[str, float] = {}  # model -> when a run of it last completed here
        # model -> [runs failed in a row before any output, routed around until, next backoff]:
        # there from a run's failure at once until a run of the model produces output
        self._failing: dict[str, list[float]] = {}
        self.probes: dict[str, int] = {}  # model -> runs sent while failing, not yet answered (Slot.probe)
        self._stray_left = STRAY_EVENTS  # events that bring nothing still allowed (stray)
        self._stray_since = self.linked_at  # when that allowance was last refilled
        self.strays = 0  # such events, in all

    def admit_placed(self, keys: int, now: float) -> bool:
        """Whether to record a relayed chain of ``keys`` keys: within
        :data:`PLACED_KEYS_PER_S` a second, so a node that floods the link
        with ``placed`` frames costs the edge bounded work."""
        if now - self._placed_since >= 1.0:
            self._placed_since, self._placed_keys = now, 0
        self._placed_keys += keys
        return self._placed_keys <= PLACED_KEYS_PER_S

    def stray(self, now: float) -> None:
        """The node sent an event that brings nothing: for a run this edge does
        not have (ended here, moved, never sent) or has ended, or with no output.
        Raises :class:`StrayFlood` past :data:`STRAY_EVENTS` in a window of
        :data:`STRAY_WINDOW_S` (and what cancels added: :meth:`cancel`)."""
        self.strays += 1
        self._stray_left -= 1
        if self._stray_left >= 0:
            return
        if now - self._stray_since >= STRAY_WINDOW_S:
            self._stray_since, self._stray_left = now, STRAY_EVENTS - 1
            return
        raise StrayFlood(
            f"over {STRAY_EVENTS} events in {STRAY_WINDOW_S:g} s for runs this edge does not have, or with no output"
        )

    def cancel(self, run_id: str, reason: str, slot: Slot | None = None) -> None:
        """Cancel a run on the node: what it already sent for the run may still
        come, and is allowed for (:meth:`stray`). With the run's ``slot``, of a node
        that answers cancels, the slot stays taken until its answer (:meth:`freed`)."""
        self._stray_left = min(self._stray_left + STRAY_PER_CANCEL, STRAY_MOST)
        if self.closed or (self._requests and self._unqueue(run_id)):
            return  # (the node never got the run: nothing to cancel, and its slot is free now)
        if slot is None or not self.answers_cancels or slot.released:
            self.send_nowait(CancelRun(run_id=run_id, reason=reason))
            return
        slot.cancelling = True
        self.cancelling[run_id] = slot
        self.send_nowait(CancelRun(run_id=run_id, reason=reason, model=slot.model))

    def freed(self, run_ids: list[str]) -> list[Slot]:
        """The node took these runs' cancels: their slots, to give back (of runs it
        was not asked about, none)."""
        slots = []
        for run_id in run_ids:
            slot = self.cancelling.pop(run_id, None)
            if slot is not None:
                slot.cancelling = False
                slots.append(slot)
        return slots

    # -- capacity ------------------------------------------------------------

    def free_slots(self, model: str) -> int:
        if self.closed or self.draining or model not in self.models:
            return 0
        return self.slots(model) - self.in_flight[model]

    def slots(self, model: str) -> int:
        """The runs of ``model`` placement may have on the node now: its capacity, this
        edge's grant of it, and what the node has earned of it (:meth:`on_trial`)."""
        info = self.models[model]
        return min(info.max_concurrency, self.grants[model], self.trusted[model])

    def on_trial(self, model: str, slots: int) -> None:
        """The node's advertised capacity of ``model`` is taken on trust only up to ``slots``
        runs from now, and one more for each run of it that completes here while at least half
        of them are in use (doubling by the length of a run while all are busy, as TCP's slow
        start). A node that claimed 4,096 slots and whose runs started and then went silent took
        594 of 1,800 runs before it was judged (an outside audit); on trial it takes ``slots``."""
        info = self.models.get(model)
        self.held.discard(model)
        if info is not None and 0 < slots < info.max_concurrency:
            self.trusted[model] = slots
            self.trial.add(model)

    def trust(self, model: str) -> None:
        """The node's advertised capacity of ``model`` is trusted whole (no peer to compare it with)."""
        self.held.discard(model)
        if model in self.trial:
            self.trial.discard(model)
            self.trusted[model] = self.models[model].max_concurrency

    def set_grant(self, model: str, slots: int, seq: int) -> bool:
        """Apply the node's grant for ``model``; True if it makes room."""
        if model not in self.grants or seq <= self.grant_seq[model]:
            return False
        before = self.free_slots(model)
        self.grants[model], self.grant_seq[model] = max(slots, 0), seq
        return self.free_slots(model) > before

    def load(self, model: str) -> float:
        """How busy the node is for ``model``, 0 = idle, 1 = every slot used:
        this edge's in-flight runs over the capacity (what of it the node has earned:
        :meth:`on_trial`); with the model server's
        own load (``engine``), its running requests when they are more (other
        edges, other clients), plus its queue, plus a steep term as its KV
        cache fills past :data:`KV_CACHE_FULL` (preemption is near)."""
        capacity = max(min(self.models[model].max_concurrency, self.trusted[model]), 1)
        engine = self.engine.get(model)
        if engine is None:
            return self.in_flight[model] / capacity
        busy = float(self.in_flight[model])
        if engine.running is not None and engine.running > busy:
            busy = engine.running
        if engine.waiting:
            busy += engine.waiting
        load = busy / capacity
        kv = engine.kv_cache_usage
        if kv is not None and kv > KV_CACHE_FULL:
            load += (kv - KV_CACHE_FULL) * 10
        return load

    def set_engine(self, engine: dict[str, EngineLoad]) -> None:
        """Apply a node's engine report: a model mapped to an empty load is no
        longer known. A value that is not a finite number >= 0 (NaN would
        break placement's comparisons) counts as not reported; a share past 1 is 1."""
        for model, load in engine.items():
            if model not in self.models:
                continue
            load = EngineLoad(
                waiting=_finite(load.waiting),
                running=_finite(load.running),
                kv_cache_usage=_fraction(load.kv_cache_usage),
                prefix_cache_hit_rate=_fraction(load.prefix_cache_hit_rate),
            )
            if load == EngineLoad():
                self.engine.pop(model, None)
            else:
                self.engine[model] = load

    # -- runs ----------------------------------------------------------------

    def sent(self, run_id: str, now: float) -> None:
        """A run request went to this node; it is unstarted until its first event."""
        self.unstarted[run_id] = now

    def started(self, run_id: str, now: float, timed: bool = True, model: str = "", prompt: int = 0) -> None:
        """A run of ``model`` had its first event (``timed``: output or its end, a time to
        first token; not an error at once, which says nothing of how fast runs start);
        ``prompt``: its estimated prompt tokens."""
        sent_at = self.unstarted.pop(run_id, None)
        if sent_at is None or not timed:
            return
        ttft = now - sent_at
        self.ttft = ttft if self.ttft is None else 0.8 * self.ttft + 0.2 * ttft
        if model in self.models:  # (keys bounded by the node's models)
            before = self.ttft_of.get(model)
            self.ttft_of[model] = ttft if before is None else 0.8 * before + 0.2 * ttft
            before = self.prompt_of.get(model)
            self.prompt_of[model] = prompt if before is None else 0.8 * before + 0.2 * prompt

    def completed(self, model: str, now: float) -> None:
        """A run of ``model`` ended whole here: a stall's next backoff starts over (not at
        a run's first event: a node whose runs start and then go silent took traffic
        half the time, 10 s routed around, 10 s sent runs that went silent), the
        failures after output are counted from none, and a node on trial earns a slot."""
        if self._stall_backoff:
            self._stall_backoff.pop(model, None)
        if self.errors_in_row:
            self.errors_in_row.pop(model, None)
        if model in self.models:  # (keys bounded by the node's models)
            self.completed_at[model] = now
        # (only while its trust is in use, as TCP's window grows only when full: a node that
        # completed short runs two at a time earned 248 slots in 30 s, then went silent with 81)
        if self.trial and model in self.trial and 2 * self.in_flight[model] >= self.trusted[model]:
            self.trusted[model] += 1
            if self.trusted[model] >= self.models[model].max_concurrency:
                self.trial.discard(model)
                self.held.discard(model)

    def errored(self, model: str) -> int:
        """A run of ``model`` failed here after its output began: how many in a row."""
        if model not in self.models:  # (keys bounded by the node's models)
            return 0
        errors = self.errors_in_row[model] = self.errors_in_row.get(model, 0) + 1
        return errors

    def stalled(self, now: float, model: str | None = None) -> bool:
        """Routed around for ``model`` now, its runs not starting (None: for any of its models)."""
        until = self.stalled_until
        if not until:
            return False
        if model is None:
            return any(t > now for t in until.values())
        return until.get(model, -1.0) > now

    def throttled(self, now: float) -> tuple[bool, float]:
        """Whether its reads waited for their part of the edge's time within
        :data:`THROTTLE_SHOWN_S` (or wait now), and how long they waited in all."""
        hold = self.hold
        if hold is None:
            return False, 0.0
        return hold.until > now - THROTTLE_SHOWN_S, hold.waited

    def ejected(self, model: str, now: float) -> bool:
        """Routed around for ``model`` now: its model server failed run after run
        (a pause), or a run of it failed at once since the last that produced
        output and a run sent since has no answer yet. A failing node gets one
        run at a time (a probe), not every slot it frees at once: under load a
        dead server's node looked the least loaded and took the whole queue."""
        failing = self._failing.get(model)
        return failing is not None and (failing[1] > now or self.probes.get(model, 0) > 0)

    def failing(self, model: str) -> bool:
        """A run of ``model`` failed here at once and none has produced output since."""
        return model in self._failing

    def failed_at_once(self, model: str, now: float, refused: bool = False) -> float:
        """A run of ``model`` failed here before any output, on its model server's side
        (unreachable, 5xx): after :data:`EJECT_AFTER` in a row the node is routed
        around for the model, for a backoff that doubles while the next try fails
        too. Returns for how long it is routed around now (0: not). ``refused``: a run
        it refused (a 4xx) that another node answered: the backoff stays at its first
        step, as the node may refuse only some requests (a smaller context than its
        peers': a client's long prompts in a row had it routed around for 30 s, its short
        ones too; a re-check)."""
        failing = self._failing.setdefault(model, [0, -1.0, _EJECT_BACKOFF_S[0]])
        failing[0] += 1
        if failing[0] < EJECT_AFTER or failing[1] > now:
            return 0.0
        backoff = _EJECT_BACKOFF_S[0] if refused else failing[2]
        failing[0], failing[1] = EJECT_AFTER - 1, now + backoff
        if not refused:
            failing[2] = min(backoff * 2, _EJECT_BACKOFF_S[1])
        log.warning(
            "node routed around: its model server refuses runs other nodes answer"
            if refused
            else "node routed around: its model server fails every run",
            node_id=self.node_id,
            model=model,
            for_s=backoff,
        )
        return backoff

    def served(self, model: str) -> None:
        """A run of ``model`` produced output here: its model server works."""
        if self._failing:
            self._failing.pop(model, None)

    def mark_stalled(self, model: str, now: float) -> float:
        """Route around this node for ``model`` for a while (doubling each time
        it stalls again without a run of it completing in between); returns for how long."""
        backoff = self._stall_backoff.get(model, _STALL_BACKOFF_S[0])
        self.stalled_until[model] = now + backoff
        self._stall_backoff[model] = min(backoff * 2, _STALL_BACKOFF_S[1])
        return backoff

    def forget_run(self, run_id: str) -> None:
        self.runs.pop(run_id, None)
        self.unstarted.pop(run_id, None)

    # -- frames --------------------------------------------------------------

    def send_nowait(self, frame: Frame) -> None:
        if self.closed:
            return
        if self._writer_idle and self.write_now is not None:
            # Nothing waits and the writer is idle: the frame goes to the kernel from here, with
            # no task switch on the way (a run's request, its cancel). The writer is still woken,
            # so frames that follow in the same tick are queued and leave together in one write.
            rest = self.write_now(frame)
            if rest is not None:
                self._rest = rest
                self._writer_idle = False
                self._ready.unpark_all()
                return
        if isinstance(frame, (RunRequest, TunnelRequest, Demand)):
            self.demands_queued += isinstance(frame, Demand)
            self._requests.append(frame)
        elif isinstance(frame, (Ping, Pong)) and len(self._control) >= MAX_LIVENESS_QUEUED:
            # A node that sends pings but reads nothing would grow this queue without end: a
            # liveness frame it cannot receive anyway is dropped (cancels are never dropped;
            # they are bounded by the node's runs). Its own ping timeout decides.
            return
        else:
            self._control.append(frame)
        self._ready.unpark_all()

    def _unqueue(self, run_id: str) -> bool:
        """Take a run's request out of the queue if it is still there: a node
        that reads nothing kept every ended run's request (its whole prompt)
        queued for as long as it stayed linked (150 clients gone: 149 MiB held)."""
        for i, queued in enumerate(self._requests):
            if type(queued) is not Demand and queued.run_id == run_id:
                del self._requests[i]
                return True
        return False

    @property
    def queued_frames(self) -> int:
        return len(self._control) + len(self._requests)

    async def next_frame(self) -> Frame:
        """The next frame to send: control frames first, then requests in order."""
        return (await self.next_frames(1))[0]

    async def next_frames(self, most: int) -> list[Frame]:
        """The frames waiting to be sent, at most ``most``, control frames
        first, then requests in order; at least one, unless the end of a
        frame written at once is waiting (:meth:`take_rest`)."""
        while not (self._control or self._requests or self._rest):
            self._writer_idle = True
            try:
                await self._ready.park()
            finally:
                self._writer_idle = False
        control, requests = self._control, self._requests
        frames: list[Frame] = []
        while control and len(frames) < most:
            frames.append(control.popleft())
        while requests and len(frames) < most:
            frame = requests.popleft()
            self.demands_queued -= isinstance(frame, Demand)
            frames.append(frame)
        return frames

    def take_rest(self) -> bytes:
        """What the kernel did not take of a frame written at once (b"" when
        nothing): the writer sends it before the frames it took."""
        rest, self._rest = self._rest, b""
        return rest

    def bind_scope(self, scope: trio.CancelScope) -> None:
        self._cancel_scope = scope

    def kill(self, reason: str, code: int = 1011) -> None:
        """Close the link from anywhere (synchronous): the link task ends."""
        if not self.close_reason:
            self.close_reason = reason
            self.close_code = code
            log.warning("closing node link", node_id=self.node_id, reason=reason)
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    def close_outbox(self) -> None:
        self.closed = True
        self._control.clear()
        self._requests.clear()
        self._rest = b""
        self.demands_queued = 0
