"""Admission and dispatch: which node runs a request, and when."""

from __future__ import annotations

import collections
import hashlib
import itertools
import math
import random
import secrets
import time
from collections.abc import Callable, Container, Iterable
from typing import Any

import msgspec
import structlog
import trio

from edge import errors
from edge.config import EdgeConfig
from edge.runs.link import BROKE_THE_PROTOCOL, NodeLink
from edge.runs.placement import HeadShares, PrefixIndex, popular, ranked, rendezvous, rendezvous_key
from edge.runs.run import (
    NODE_DISCONNECTED,
    NODE_LOST,
    NODE_STALLED,
    RUN_ERROR,
    SHUTDOWN,
    TIMEOUT,
    UNSENDABLE,
    Buffered,
    Run,
    RunTimers,
    prompt_tokens,
)
from proto import ModelInfo, RunEvent, RunRequest, TunnelRequest

log = structlog.get_logger("iop.edge.runs")

# Runs of a model that failed on a node after their output began, in a row (no run of it completing
# there in between), past which the node is routed around for the model as a stalled one is, while
# another node serves it: a node that sent each run a token and then an error kept its share of
# traffic (223 of 600 requests failed), its first output clearing what counts failures at once.
ERRORS_AFTER_OUTPUT = 3
# A node that links again after leaving FLAPS times in a row, each within FLAP_WINDOW_S of the leaving
# before, is routed around for the models peers serve as a stalled node is (each drop of a link that
# fell every 2 s failed the runs it had started: 10 of 600 requests, an outside audit). A node that
# drained before it left did not drop: three restarts in a minute had it idle beside a busy peer. The
# node ids that left are remembered, the latest MAX_LEFT.
FLAPS = 3
# A node redials within relink_max_s (2 s) of losing its link: for this long after the edge starts,
# a model no linked node serves may be one whose node has not linked yet (errors.model_not_found).
START_GRACE_S = 10.0
LOST_GRACE_S = 5.0  # a model's last node lost: new requests wait this long for it to link again (a restart)
FLAP_WINDOW_S = 60.0
MAX_LEFT = 10_000
HOLD_RATIO = 16  # in the fleet's first window, a claim past this many times its largest peer's is held


def stall_after_s(config: EdgeConfig) -> float:
    """The least wait that judges a node stalled: ``stall_after_s``, or half the silence that
    times a run out if that is shorter (with ``wait_timeout_s`` 5, runs timed out before any
    was judged, and the node kept its traffic)."""
    return min(config.stall_after_s, config.wait_timeout_s / 2)


class Slot:
    """One unit of a node's capacity for one model, held from admission until
    the run is closed (or the waiter gives it back)."""

    __slots__ = ("link", "model", "released", "probe", "cancelling")

    def __init__(self, link: NodeLink, model: str) -> None:
        self.link = link
        self.model = model
        self.released = False
        self.cancelling = False  # its run is cancelled on a node that answers: taken until it does (NodeLink.cancel)
        # Taken on a node failing the model (NodeLink.failing): until its run's first event,
        # or its release, no other run is sent there while another node works (NodeLink.ejected).
        self.probe = False

    @property
    def info(self) -> ModelInfo:
        return self.link.models[self.model]

    def end_probe(self) -> None:
        """Its run's first event came, or it is released: the node may take another try."""
        if self.probe:
            self.probe = False
            self.link.probes[self.model] -= 1


def _avoided(link: NodeLink, model: str, now: float, healthy: bool) -> bool:
    """``link`` is routed around for ``model`` (:meth:`NodeLink.ejected`), or, for a
    ``healthy`` pick (a moved run), failing it at all."""
    return link.ejected(model, now) or (healthy and link.failing(model))


_SESSION_CHARS = 128  # a longer session id (a client's string, kept by _affinity) is kept as its digest


def session_key(session: str | None) -> str | None:
    """A session id as the edge keeps it: itself, or past :data:`_SESSION_CHARS`
    a 32-character digest of it, so that what the affinity map holds per session
    is bounded whatever a client sends as ``X-Session-Id`` or ``user``."""
    if not session:
        return None
    if len(session) <= _SESSION_CHARS:
        return session
    return "sha256:" + hashlib.sha256(session.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class Want(msgspec.Struct, frozen=True):
    """What a request needs from a node."""

    model: str
    session: str | None = None
    min_context: int = 0  # estimated input tokens + max_tokens; 0: anything fits
    max_tokens: int = 0  # of min_context, the part the request's max_tokens asks for (0: none asked; 1 counted)
    tunnel: bool = False  # the node must allow raw passthrough for the model
    prefix: tuple[int, ...] = ()  # the prompt's prefix chain (edge.runs.placement.prefix_chain)
    opening: int = 0  # the index in it of the conversation's opening (edge.runs.placement.prompt_chain)
    # The request body as it goes to the node, with a tunnel's headers: its frame, with the
    # prefix chain and FRAME_OVERHEAD for the rest, must fit the node's limit.
    body_bytes: int = 0

    @property
    def frame_bytes(self) -> int:
        """At most the size of this request's run frame (a prefix key is at most 9 bytes)."""
        return self.body_bytes + 9 * len(self.prefix) + FRAME_OVERHEAD

    def fits(self, link: NodeLink) -> bool:
        info = link.models.get(self.model)
        return info is not None and _takes(link, info, self.min_context, self.tunnel, self.frame_bytes)


def _takes(link: NodeLink, info: ModelInfo, min_context: int, tunnel: bool, frame_bytes: int) -> bool:
    """``link``, serving the model as ``info``, can run a request of these needs (a Want's, or
    the widest of a queue's: _queued)."""
    if tunnel and not info.passthrough or frame_bytes > link.frame_limit:
        return False
    return not (min_context and info.context_window and info.context_window < min_context)


def _granted_elsewhere(serving: list[NodeLink], model: str) -> int:
    """Slots of ``model`` on ``serving`` (not draining) that the nodes have granted other edges, not
    this one: ones those edges leave unused move here about 10 ms after this edge's queue says it
    needs them (grants follow demand), so a request they may serve waits for them, past
    ``max_queue`` (a burst at one of two edges was a 429 queue_full while the other's grant
    sat idle: an outside audit). Bounded by the fleet's capacity."""
    return sum(
        max(min(lk.models[model].max_concurrency, lk.trusted[model]) - lk.grants[model], 0)
        for lk in serving
        if not lk.draining
    )


class _Waiter:
    """A request waiting for a slot, or (``run`` set) a run moved off a node
    that died or stalled before it started, waiting to be sent again."""

    __slots__ = (
        "event",
        "slot",
        "gone",
        "cancelled",
        "refused",
        "want",
        "run",
        "client",
        "since",
        "wait_until",
        "prefer",
        "home",
        "passed",
        "deadline",
        "scope",
    )

    def __init__(self, want: Want, run: Run | None = None, wait_until: float = 0.0, client: Any = None) -> None:
        self.since = trio.current_time()
        self.deadline = math.inf  # its queue timeout's
        # Its wait's, while it waits: a model's last node lost, it ends sooner (LOST_GRACE_S),
        # unless a node links again
        self.scope: trio.CancelScope | None = None
        self.event = trio.Event()
        self.slot: Slot | None = None
        # No linked node can serve it any more: "lost", "drained" (the last one left), "without" (back without it)
        self.gone = ""
        self.cancelled = False  # by an operator (the console)
        self.refused: errors.APIError | None = None  # the edge ended its wait (it is shutting down)
        self.client = client  # the request's exchange (the console shows and cancels it)
        self.want = want
        self.run = run
        # Until then it may pass over free nodes to wait for the one holding
        # its prompt's prefix (``prefer``, whose demand it counts in).
        self.wait_until = wait_until
        self.prefer: str | None = None
        # The node its conversation is on (its session's, or holding its prompt past its
        # opening), if any: a slot freeing there may go to it ahead of the queue (_home_first).
        self.home: str | None = None
        self.passed = 0  # times a waiter behind it took a slot at its home first


# Queued requests of a model a node's demand looks at, from the head, when some of them do not fit
# every node (RunService.waiting_for: every 20 ms for each link while demand changes)
DEMAND_SCAN = 1024
_MAX_SESSIONS = 100_000
KNOWN_MODELS = 8192  # model names nodes advertised, the most recent kept (a few MB at most)
LOGGED_MODELS = 16  # model names in a "node linked" line (with the count of them all)
LOST_CONTEXT_S = 60.0  # a node that left this recently may be back: a request only it could hold is a 503
UNBOUNDED_CONTEXT = 1 << 62  # a node that advertised no context_window
# A request waits for the busy node holding its prefix only if that node holds
# this many more of its leading blocks (1 KB of text, ~256 tokens) than any free one.
PREFIX_WAIT_BLOCKS = 4
# A slot freeing on a node goes first to a waiter whose conversation is there, among the first
# HOME_WINDOW of the queue; a waiter is passed over so at most MAX_PASSED times, then the queue
# is FIFO from it again.
HOME_WINDOW = 32
MAX_PASSED = 8
PLACEMENTS = ("session", "prefix", "rendezvous", "least_loaded", "random")  # how a node was chosen


def new_run_id() -> str:
    return secrets.token_hex(12)


_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw])


def with_model(body: bytes, model: str) -> bytes:
    """A passthrough body (a JSON object, checked when it came in) with its
    ``model`` set to ``model``, every other member's value byte for byte as it
    was (a number such as ``1.0000000000000000001`` not rounded to a float)."""
    members = _decode_members.decode(body)
    members["model"] = msgspec.Raw(msgspec.json.encode(model))
    return msgspec.json.encode(members)


# A run frame's fields besides the request body and the prefix chain: ids, names, metadata (a
# retry's reason cut to 500 characters). The sender checks the exact size (a frame over it fails
# its run); 1,024 was too few with a tunnel's headers (a 1,000-byte Accept: an outside re-audit).
FRAME_OVERHEAD = 4096
_encode_msgpack = msgspec.msgpack.Encoder().encode


def encode_run_body(body: dict[str, Any], max_frame_bytes: int) -> msgspec.Raw:
    """The request body as the node will get it, encoded once, here, so that a
    body that cannot travel is this request's 400 or 413 before any node is
    touched (never an error in a link's sender).

    msgpack holds integers in [-2**63, 2**64 - 1] only, and a body of numbers
    grows when encoded (a float is 9 bytes): both are checked here.
    """
    try:
        data = _encode_msgpack(body)
    except OverflowError:
        raise _out_of_range(body) from None
    except (msgspec.EncodeError, RecursionError, TypeError, ValueError) as e:
        raise errors.bad_request(f"The request cannot be forwarded: {e}.") from None
    if len(data) + FRAME_OVERHEAD > max_frame_bytes:
        raise too_large_for_a_frame(len(data), max_frame_bytes)
    return msgspec.Raw(data)


def too_large_for_a_frame(size: int, max_frame_bytes: int) -> errors.APIError:
    """413 for a request of ``size`` bytes as the node gets it, more than a frame of
    ``max_frame_bytes`` holds (the edge's limit, or that of every node serving its model)."""
    return errors.APIError(
        413,
        f"The request is {size} bytes once encoded for the node, more than a link frame "
        f"holds ({max_frame_bytes - FRAME_OVERHEAD} bytes).",
        code="request_too_large",
    )


_AS_DIGITS = bytes(48 if 48 <= byte <= 57 else 32 for byte in range(256))  # a digit: "0"; else " "
_LONG_DIGITS = b"0" * 19  # no integer outside msgpack's 64 bits has fewer digits


def long_digits(text: bytes) -> bool:
    """Whether ``text`` holds a run of 19 digits or more: one pass over it, about 1.2 ms a
    MB (the regular expression ``[0-9]{19}`` tried 18 digits at each digit of a body of
    18-digit numbers: 260-355 ms for 7.8 MB, on the event loop; an outside audit)."""
    return text.translate(_AS_DIGITS).find(_LONG_DIGITS) >= 0


def check_int64(body: dict[str, Any], text: bytes | None = None) -> None:
    """The 400 :func:`encode_run_body` answers for an integer outside 64 bits anywhere in
    ``body``, an unknown field's too, for a body the node gets only in part or not as
    decoded (Messages, the tunnel). ``text``: the bytes ``body`` came from; without a run
    of 19 digits in them there is none, and nothing is encoded (a large body's steps:
    :func:`edge.openai.request.decode_body`'s ``int64``)."""
    if text is not None and not long_digits(text):
        return
    try:
        _encode_msgpack(body)  # (in C: 500,000 values walked in Python held the loop ~0.1 s)
    except OverflowError:
        raise _out_of_range(body) from None
    except (msgspec.EncodeError, RecursionError, TypeError, ValueError):
        pass  # (not this check's: the body that travels is encoded, and judged, on its way)


def _out_of_range(body: dict[str, Any]) -> errors.APIError:
    return errors.integer_out_of_range(next((k for k, v in body.items() if not _encodable(v)), None))


def _encodable(value: Any) -> bool:
    try:
        _encode_msgpack(value)
    except (OverflowError, msgspec.EncodeError, RecursionError, TypeError, ValueError):
        return False
    return True


class RunService:
    def __init__(self, config: EdgeConfig) -> None:
        self.config = config
        self.started = time.monotonic()  # (made before trio runs, under hypercorn's CLI)
        self.links: dict[str, NodeLink] = {}
        # node links authenticated and waiting for their hello, per credential (edge.link)
        self.pending_hellos: collections.Counter[str] = collections.Counter()
        self.closing_links = False  # the edge's drain closed its links: none is taken again
        self.link_refusals: dict[str, list[float]] = {}  # (edge.link) why -> [refused since its last line, then]
        self.runs: dict[str, Run] = {}
        self.timers = RunTimers()  # its task runs with the app (edge.app)
        self.buffered = Buffered(config.max_buffered_bytes)  # every run's events waiting for their clients
        self.models_version = 0  # changes as a link comes or goes: what models() says may differ
        self._queues: dict[str, collections.deque[_Waiter]] = collections.defaultdict(collections.deque)
        # Runs moved off a lost or stalled node, per model: served before the queue.
        # Bounded by the capacity of the nodes they came from.
        self._moved: dict[str, collections.deque[_Waiter]] = collections.defaultdict(collections.deque)
        self.on_stall: list[Callable[[NodeLink], None]] = []
        # (model, why: node_lost, node_stalled, node_failed, node_refused)
        self.on_move: list[Callable[[str, str], None]] = []
        # Models configured, and the last KNOWN_MODELS some node has advertised (a node may
        # name 1,024, and link again and again with new ones): a request for one of these
        # with no node linked is a 503, not a 404, and its name may be a metrics label.
        self._refusing: Callable[[], errors.APIError] | None = None  # set by refuse_waiting
        self._configured = frozenset(m.name for m in config.models)
        self._known: dict[str, None] = {}  # oldest first
        # Per model, when a node serving it last left and the largest context_window of those
        # that left within LOST_CONTEXT_S (0: unbounded): a request only such a node could hold
        # is a 503 to retry while it relinks, not a final 400 (a brief outage of the one
        # large-context node told clients their conversation was too long).
        self._lost_context: dict[str, tuple[float, int]] = {}
        # Per model, when its last node drained and left (a restart, most often: the same node
        # id cannot link again before it has left): its requests wait for a node within their
        # queue timeout of that, where they were a 503 at once (its whole queue, on every
        # `systemctl restart` of a model's only node: an outside audit). Or was lost (True: drained):
        # its queued requests wait on, and new ones within LOST_GRACE_S (its whole queue was a
        # 503 when an edge that had stood still closed its link, the node linking again 12 ms later).
        self._drained: dict[str, tuple[float, bool, str]] = {}  # (and the node's id)
        self.on_run_closed: list[Callable[[Run], None]] = []
        self._affinity: dict[str, str] = {}  # session -> node id, oldest first
        self.prefixes = PrefixIndex(config.prefix_index_entries)
        # Called with (how, matched prefix blocks) each time a node is chosen
        # for a request; ``how`` is one of PLACEMENTS.
        self.on_placed: list[Callable[[str, int], None]] = []
        # (model, api, seconds) for every request given a slot or that waited in a queue, however its wait
        # ended (a slot, the queue's timeout, an operator's cancel, the client leaving)
        self.on_queue_wait: list[Callable[[str, str, float], None]] = []
        self._placed: tuple[str, int] = ("least_loaded", 0)  # set by _pick, read by the _reserve after it
        self._wanted: str | None = None  # set by _pick: the busy node it would rather wait for
        # Set by _pick for the _reserve after it: a new conversation (its prompt matched no deeper
        # than its opening), and the shared head it matched (None: none).
        self._fresh: tuple[bool, int | None] = (False, None)
        self.heads = HeadShares()  # new conversations by the shared head they opened with
        # Called with True (placed on the node it waited for) or False (elsewhere, the wait
        # over) when a request that waited for its prefix's node leaves the queue for a node.
        self.on_prefix_wait: list[Callable[[bool], None]] = []
        # Per model: queued requests waiting for one node (its prefix's), by node id.
        self._preferring: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        # Of each model with requests queued, what the widest of them needs of a node: the largest
        # min_context, a passthrough, the largest frame (a node that fits it fits them all; it
        # narrows again only once the queue is empty: waiting_for).
        self._needs: dict[str, list] = {}
        self._run_closed = trio.lowlevel.ParkingLot()
        # Unparked when a model's in-flight or queue depth may have changed:
        # each link's demand reporter (edge.link) wakes to tell its node.
        self.demand_changed = trio.lowlevel.ParkingLot()
        # node id -> when it last left, and how many times in a row it left within FLAP_WINDOW_S
        # of the time before (oldest first, at most MAX_LEFT)
        self._left: dict[str, tuple[float, int]] = {}
        self._first_link_at: float | None = None  # when this edge's fleet began to link (add_link)

    # -- what is served --------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Runs open (on nodes, or moved off one and waiting for a slot)."""
        return len(self.runs)

    @property
    def on_nodes(self) -> int:
        """Runs on nodes: not those moved off one, waiting for a slot (queued: a dashboard
        adding ``iop_runs_in_flight`` and ``iop_queue_depth`` counted them twice)."""
        return len(self.runs) - sum(len(q) for q in self._moved.values())

    def queue_depth(self, model: str | None = None) -> int:
        if model is not None:
            return len(self._queues.get(model, ())) + len(self._moved.get(model, ()))
        return sum(len(q) for q in self._queues.values()) + sum(len(q) for q in self._moved.values())

    def queue_depths(self) -> dict[str, int]:
        """:meth:`queue_depth` of each model with a request waiting."""
        depths = {model: len(queue) for model, queue in self._queues.items() if queue}
        for model, queue in self._moved.items():
            if queue:
                depths[model] = depths.get(model, 0) + len(queue)
        return depths

    def waiting_for(self, model: str, node_id: str) -> int:
        """Queued requests of ``model`` that ``node_id`` may take (the demand its node
        grants slots by): all but those waiting for another node (the one holding their
        prefix) and those it does not fit (its context window, passthrough, frame limit;
        10 long prompts only a large node could run had a small one grant this edge half
        its slots, idle, while another edge's requests queued: an outside audit), counted
        up to its slots of the model (a node grants no more)."""
        depth = self.queue_depth(model)
        if not depth:
            self._needs.pop(model, None)
            return 0
        link = self.links.get(node_id)
        info = link.models.get(model) if link is not None else None
        need = self._needs.get(model)
        if need is not None and info is not None and not _takes(link, info, *need):
            taken, cap = 0, info.max_concurrency
            queued = itertools.chain(self._queues.get(model, ()), self._moved.get(model, ()))
            for waiter in itertools.islice(queued, DEMAND_SCAN):
                if (waiter.prefer is None or waiter.prefer == node_id) and waiter.want.fits(link):
                    taken += 1
                    if taken >= cap:
                        return taken
            return taken + max(depth - DEMAND_SCAN, 0)  # (past them, each as one it may take)
        counts = self._preferring.get(model)
        if not counts:
            return depth
        return depth - sum(counts.values()) + counts.get(node_id, 0)

    def _queued(self, want: Want) -> None:
        """``want`` waits in its model's queue: what the queue needs of a node widens to it."""
        need = self._needs.get(want.model)
        if need is None:
            self._needs[want.model] = [want.min_context, want.tunnel, want.frame_bytes]
        else:
            need[0] = max(need[0], want.min_context)
            need[1] = need[1] or want.tunnel
            need[2] = max(need[2], want.frame_bytes)

    def unknown_model(self, model: str) -> errors.APIError:
        """The 404 for a model no linked node serves: one to retry while the edge's nodes may
        still be linking (none linked yet, or within :data:`START_GRACE_S` of its start)."""
        starting = not self.links or time.monotonic() - self.started < START_GRACE_S
        return errors.model_not_found(model, starting=starting)

    def is_known(self, model: str) -> bool:
        """``model`` is configured (``[[models]]``), a linked node serves it, or some node
        has advertised it since the edge started (the last :data:`KNOWN_MODELS` names):
        never a name only a client made up. (Links of 1,024 new names each, dialled one
        after another, pushed a linked node's models out of those names, and
        ``count_tokens`` for them was a 404 until it linked again: an outside audit.)"""
        return model in self._configured or model in self._known or bool(self._serving(model))

    def models(self) -> dict[str, list[NodeLink]]:
        """Model name -> links serving it now."""
        served: dict[str, list[NodeLink]] = {}
        for link in self.links.values():
            if link.closed:
                continue
            for name in link.models:
                served.setdefault(name, []).append(link)
        return served

    def _serving(self, model: str) -> list[NodeLink]:
        return [lk for lk in self.links.values() if model in lk.models and not lk.closed]

    # -- links -------------------------------------------------------------------

    def add_link(self, link: NodeLink) -> None:
        served: set[str] = set()  # the models peers serve (a draining one serves no new run)
        for lk in self.links.values():
            if lk.node_id != link.node_id and not lk.closed and not lk.draining:  # (not itself, linking again)
                served.update(lk.models)
        peered = [model for model in link.models if model in served]
        now = trio.current_time()
        if self._first_link_at is None:
            self._first_link_at = now
        in_window = now - self._first_link_at < self.config.stall_after_s
        if not in_window:
            # A node that links beside peers of its model earns its capacity of it; not the fleet
            # linking to a new edge, in its first stall_after_s (three honest 128-slot nodes
            # ramping after an edge restart refused 129 of 1,009 requests in 20 s: an outside audit).
            for model in peered:
                link.on_trial(model, self.config.ramp_slots)
        self.links[link.node_id] = link
        self.models_version += 1
        if in_window:
            for model in peered:
                self._hold_the_largest(model)
        left = self._left.get(link.node_id)
        if peered and left is not None and left[1] >= FLAPS and now - left[0] < FLAP_WINDOW_S:
            self._route_around(link, peered, now, "node links again and again", relinks=left[1])
        known = self._known
        for model in link.models:
            known.pop(model, None)
            known[model] = None
            if self._drained.pop(model, None) is not None:
                self._unbound_waits(model)
        if self._drained:
            self._given_up(link)
        while len(known) > KNOWN_MODELS:
            del known[next(iter(known))]
        self._wake_waiting(link.models)
        names = sorted(link.models)
        # (the first names: a line of a node's 1,024 names of 256 characters was 265 KB, at each relink)
        log.info("node linked", node_id=link.node_id, models=names[:LOGGED_MODELS], model_count=len(names))

    def remove_link(self, link: NodeLink) -> None:
        """The link is gone: its unstarted runs move to other nodes, the rest
        fail at once; waiters that can no longer be served are woken."""
        link.closed = True
        link.freed(list(link.cancelling))  # (no answer comes: nothing of the node is held any more)
        self.models_version += 1
        if self.links.get(link.node_id) is link:
            del self.links[link.node_id]
        now, lost = trio.current_time(), self._lost_context
        if not link.draining:  # (a drained node left cleanly, its runs done: a rolling restart is no drop)
            before_left = self._left.pop(link.node_id, None)
            in_row = before_left[1] + 1 if before_left is not None and now - before_left[0] < FLAP_WINDOW_S else 1
            self._left[link.node_id] = (now, in_row)
            if len(self._left) > MAX_LEFT:
                del self._left[next(iter(self._left))]
        for model, info in link.models.items():
            window = info.context_window or UNBOUNDED_CONTEXT
            before = lost.pop(model, None)  # (re-inserted last: the oldest go first, past KNOWN_MODELS)
            if before is not None and now - before[0] < LOST_CONTEXT_S:
                window = max(window, before[1])
            lost[model] = (now, window)
        while len(lost) > KNOWN_MODELS:
            del lost[next(iter(lost))]
        awaited_back = not link.draining and link.close_code not in BROKE_THE_PROTOCOL  # (lost: it may link again)
        for run in list(link.runs.values()):
            if not self._fail_over(run, link, awaited_back=awaited_back):
                # Nothing sent yet and nothing linked serves the model now: a retry may find the node
                # linked again (the README's promise; it was a 502 `node_disconnected`, outside audit).
                # A node whose link the edge closed for breaking the protocol or flooding it failed
                # the run itself: that stays a 502.
                run.unserved = (
                    not run.events_seen
                    and link.close_code not in BROKE_THE_PROTOCOL
                    and all(lk.draining for lk in self._serving(run.want.model))  # (none, or only draining)
                )
                run.fail(NODE_DISCONNECTED, NODE_LOST)
        if any(lk.stalled_until for lk in self.links.values()):
            self._unjudge(link.models, now)
        self._trust_alone(link.models)
        drained = self._drained
        # (a node whose link the edge closed for breaking the protocol or flooding it is awaited by none)
        awaited = link.draining or link.close_code not in BROKE_THE_PROTOCOL
        for model in link.models:
            restart = awaited and not self._serving(model)
            if restart:
                drained.pop(model, None)
                drained[model] = (now, link.draining, link.node_id)
                while len(drained) > KNOWN_MODELS:
                    del drained[next(iter(drained))]
                if not link.draining:
                    self._bound_waits(model, now + LOST_GRACE_S)
            if restart or not (self._queues.get(model) or self._moved.get(model)):
                continue  # (nobody waits for it: no scan of every link, for each of its models)
            serving = self._serving(model)
            for queue in (self._queues.get(model), self._moved.get(model)):
                for waiter in list(queue or ()):
                    if any(waiter.want.fits(lk) for lk in serving):
                        continue
                    if self._end_wait(queue, waiter, NODE_DISCONNECTED, NODE_LOST):
                        waiter.gone = "drained" if link.draining else "lost"
                        waiter.event.set()
        log.info("node unlinked", node_id=link.node_id, reason=link.close_reason or "closed")

    def _hold_the_largest(self, model: str) -> None:
        """In the fleet's first window, a node claiming more than :data:`HOLD_RATIO` times the
        slots of ``model`` that its largest peer claims is trusted with that peer's claim (or
        ``ramp_slots``) and earns the rest; it is let go once a peer claiming within that ratio
        links. A node claiming 4,096 slots that linked with 4-slot peers took their traffic
        whole until it was judged (293 of 1,800 requests timed out, an outside audit). Honest
        fleets, alike or unequal within the ratio (one 64-slot node and three 8-slot ones), are
        trusted at once: holding any larger node (to 16) slowed such a fleet's first 20 s after
        an edge restart (131 of 210 requests waited over 5 s), and holding to a peer's held
        value held three 128-slot nodes to 16 behind one 8-slot node (an outside re-audit)."""
        serving = [lk for lk in self._serving(model) if not lk.draining]
        if len(serving) < 2 or self.config.ramp_slots <= 0:  # (0: every claim trusted at once)
            return
        claims = sorted((lk.models[model].max_concurrency for lk in serving), reverse=True)
        for lk in serving:
            claim = lk.models[model].max_concurrency
            largest_peer = claims[1] if claim == claims[0] else claims[0]
            if claim > HOLD_RATIO * largest_peer:
                if model not in lk.trial:
                    lk.on_trial(model, max(largest_peer, self.config.ramp_slots))
                    if model in lk.trial:
                        lk.held.add(model)
            elif model in lk.held:
                lk.trust(model)
                self._wake(model)

    def _trust_alone(self, models: Iterable[str]) -> None:
        """A node on trial left the only one serving one of ``models`` (its peers gone or
        draining) is trusted with its capacity of it: no peer to compare it with (a new
        node of a blue/green swap was held to 16 of its 128 slots while the old one drained)."""
        if not any(lk.trial for lk in self.links.values()):
            return
        for model in models:
            serving = [lk for lk in self._serving(model) if not lk.draining]
            if len(serving) == 1 and model in serving[0].trial:
                serving[0].trust(model)
                self._wake(model)

    def _fail_over(
        self,
        run: Run,
        old: NodeLink,
        failed: RunEvent | None = None,
        now_only: bool = False,
        awaited_back: bool = False,
    ) -> bool:
        """Move a run that has produced no event yet off ``old`` (lost, or not
        starting runs), at most once: to a node with a free slot now, else it
        waits for one ahead of the queue. Never to a draining node (it takes no
        new run: the run waited for it to leave, then failed), nor to a node failing the model
        (a healthy node slow to start its runs was judged stalled against a
        dead server's 1 ms failures, and its runs moved there to fail). A run
        ``old`` ``failed`` at once (that error event) waits as a queued
        request does, within the queue's size and timeout, then ends with that
        error (it waited for its silence, 120 s); with ``now_only``, it moves only
        to a node with a free slot now. False if it does not move. ``awaited_back``: ``old`` was
        lost, and may link again: with no other node serving the model, the run waits for it
        :data:`LOST_GRACE_S` as the requests queued behind it do (it was a 503 at once while
        they waited and were served by the node back: an outside re-check)."""
        if run.events_seen or run.failed_over or run.finished or run.request is None:
            return False
        model = run.want.model
        back = awaited_back and failed is None and not self._serving(model)
        if not back and not self._taken_elsewhere(run, old):
            return False
        moved = self._moved[model]
        link = None if moved or back else self._pick(run.want, exclude=old, healthy=True)
        if link is None and now_only:
            return False
        if link is None:  # it waits for a slot, within the queue's timeout (then: its node's error, or a 502)
            max_queue, timeout_ms = self._queue_bounds(model)
            if failed is not None and len(moved) + len(self._queues.get(model) or ()) >= max_queue:
                return False
            wait = min(timeout_ms / 1000, LOST_GRACE_S) if back else timeout_ms / 1000
            run.unserved = back  # (none linked within the grace: the 503 a queued request gets)
            run.held_error, run.move_until = failed, trio.current_time() + wait
            self.timers.reschedule(run)  # (sooner than it was due, maybe)
        if failed is None:  # (a node that failed the run has ended it)
            old.cancel(run.id, "moved to another node")  # no-op on a lost link
        old.forget_run(run.id)
        self.release(run.slot)
        run.failed_over = True
        if link is not None:
            self._dispatch(run, self._reserve(link, run.want))
        else:
            run.requeued = _Waiter(run.want, run)
            moved.append(run.requeued)
            self._queued(run.want)
        why = "node_lost" if old.closed else "node_stalled"
        if failed is not None:
            why = "node_refused" if now_only else "node_failed"
        for hook in self.on_move:
            hook(model, why)
        client = getattr(run.client, "scope", None)  # (the request's: logged from the link's task, not the request's)
        log.warning(
            "run moved",
            run_id=run.id,
            request_id=client.get("iop.request_id") if client is not None else None,
            from_node=old.node_id,
            to_node=link.node_id if link else None,
        )
        return True

    def _bound_waits(self, model: str, until: float) -> None:
        """``model``'s requests waiting for a slot wait until ``until`` at most (or their queue
        timeout, when a node serving it links: :meth:`_unbound_waits`)."""
        for waiter in self._queues.get(model) or ():
            if waiter.scope is not None:
                waiter.scope.deadline = min(waiter.deadline, until)

    def _unbound_waits(self, model: str) -> None:
        """A node of ``model`` linked after its last one left: its waiters wait their queue
        timeout again, but those no linked node can take (their size or context) end now (they
        waited it out for a 429 "at capacity", where a new request was a 503 at once: a re-check)."""
        serving = self._serving(model)
        queue = self._queues.get(model)
        for waiter in list(queue or ()):
            if not any(waiter.want.fits(lk) for lk in serving):
                if self._end_wait(queue, waiter, NODE_DISCONNECTED, NODE_LOST):
                    waiter.gone = "lost"
                    waiter.event.set()
            elif waiter.scope is not None:
                waiter.scope.deadline = waiter.deadline

    def _given_up(self, link: NodeLink) -> None:
        """``link``'s node left serving models no other serves, which its requests wait for it
        to serve again, and it is back without some of them: those waits end now, with a 503
        that says so (they waited out the grace for a 503 that said no node had linked: an
        outside re-check)."""
        drained = self._drained
        for model in [m for m, left in drained.items() if left[2] == link.node_id and m not in link.models]:
            del drained[model]
            for queue in (self._queues.get(model), self._moved.get(model)):
                for waiter in list(queue or ()):
                    if self._end_wait(queue, waiter, NODE_DISCONNECTED, NODE_LOST):
                        waiter.gone = "without"
                        waiter.event.set()

    def _awaits_restart(self, model: str) -> bool:
        """``model``'s last node drained and left within its queue timeout, or was lost within
        :data:`LOST_GRACE_S` of it: a request waits."""
        left = self._drained.get(model)
        if left is None:
            return False
        wait = self._queue_bounds(model)[1] / 1000
        return trio.current_time() - left[0] < (wait if left[1] else min(wait, LOST_GRACE_S))

    def _queue_bounds(self, model: str) -> tuple[int, int]:
        """The model's ``max_queue`` and ``queue_timeout_ms`` (its policy's, else the edge's)."""
        policy = self.config.policy(model)
        max_queue = self.config.max_queue if policy.max_queue is None else policy.max_queue
        timeout_ms = self.config.queue_timeout_ms if policy.queue_timeout_ms is None else policy.queue_timeout_ms
        return max_queue, timeout_ms

    def _failed_at_once(self, run: Run, error: RunEvent) -> bool:
        """``run``'s node failed it before any output (``error``), its model
        server's fault (counted: :meth:`NodeLink.failed_at_once`). Nothing has
        reached the client: it moves, at most once, to a node that is not failing
        (:meth:`_fail_over`). False: the client gets the error."""
        return self._fail_over(run, run.slot.link, failed=error)

    def _refused_at_once(self, run: Run, error: RunEvent) -> bool:
        """``run``'s node refused it at once with a 4xx (``error``): the request's
        fault, or its node's. Nothing has reached the client: it moves, at most once,
        to a healthy node with a free slot now, if there is one; answered there, the
        refusal was the node's (:attr:`Run.refused_by`, counted as a failure of the
        model there: a node whose server refuses every run is routed around). False:
        the client gets the error."""
        old = run.slot.link
        if not self._fail_over(run, old, failed=error, now_only=True):
            return False
        run.refused_by = old
        return True

    def _dispatch(self, run: Run, slot: Slot) -> None:
        """Send a moved run to its new slot's node."""
        run.slot = slot
        run.requeued = None
        run.held_error, run.move_until = None, math.inf
        link = slot.link
        link.runs[run.id] = run
        remaining = max(run.deadline - trio.current_time(), 0.0)
        request = run.request
        changes: dict[str, Any] = {"target": slot.info.target, "timeout_s": remaining}
        if type(request) is TunnelRequest and request.target != slot.info.target:
            # The node relays a tunnel's body as it is, its model the first node's target: the
            # new one's server would have answered 404, or with another model.
            changes["body"] = with_model(request.body, slot.info.target)
        run.request = msgspec.structs.replace(request, **changes)
        now = trio.current_time()
        run.last_event_at = now  # (its silence counts from here: it was the first node's, a 504 while it waited)
        self.timers.reschedule(run)  # (and is timed from here: it was due at its wait's deadline)
        link.send_nowait(run.request)
        link.sent(run.id, now)

    def check_stall(self, link: NodeLink) -> None:
        """Route around ``link`` for a model whose runs are not progressing there:
        its oldest unstarted run has waited, or a started run of it has been silent
        since its last event, ``stall_after_s`` and ten times the typical time to
        first event of that model on its peers (the other nodes starting runs of
        it). A model with no such peer is never judged: a lone node, or a model
        only this node serves, is left alone (a long prompt's first token can take
        minutes); so are nodes serving other models, whose times say nothing of
        this one's. All the judged models' unstarted runs move to other nodes (not
        only those past the wait: the younger ones waited out the routing's pause
        to be judged, then timed out), and the node is routed around for those
        models alone (a model only it serves keeps its slots). Started runs stay:
        their output has gone to their clients."""
        now = trio.current_time()
        if link.stalled_until:
            over = [model for model, until in link.stalled_until.items() if until <= now]
            for model in over:  # its time out is over: it gets traffic again
                del link.stalled_until[model]
            if over:
                self._wake_waiting(over)
        if not link.runs:
            return
        since: dict[str, float] = {}  # model -> when its oldest started run's silence began
        stall_after = stall_after_s(self.config)
        due = now - stall_after
        waiting: dict[str, list[tuple[float, int]]] = {}  # model -> its unstarted runs' (sent at, prompt tokens)
        for run_id, sent_at in link.unstarted.items():
            if sent_at > due:
                break  # (oldest first: only the runs waiting past stall_after_s are looked at)
            run = link.runs.get(run_id)
            if run is not None and not run.stall_moved and not link.stalled(now, run.slot.model):
                waiting.setdefault(run.slot.model, []).append((sent_at, prompt_tokens(run)))
        # A model the node makes progress on (a run of it completed, or had an event after its
        # first, within the wait) is not judged: a long prompt, or a long tool call (the node sends
        # a call whole, at its end), on a busy healthy node is not a stall.
        progressing = {model for model, at in link.completed_at.items() if at > due}
        for run in link.runs.values():
            first = run.first_event_at
            if run.finished or run.held:  # (a held tunnel's silence is the edge's doing)
                continue
            last = run.last_event_at
            if run.progress_first > -math.inf:  # (a tool call streaming: the node says so each second)
                first = run.progress_first if first is None else min(first, run.progress_first)
                last = max(last, run.progress_at)
            if first is None:
                continue
            model = run.slot.model
            if last > due:
                if last > first:
                    progressing.add(model)
            elif last < since.get(model, math.inf) and not link.stalled(now, model):
                since[model] = last
        judged: list[str] = []
        silent: list[str] = []  # of them, those judged by a started run's silence
        typical = waited = 0.0
        # At most half the silence that times a run out, however long its prompt: a long prompt
        # beside short ones on a dead node kept it from being judged, the short ones timing out.
        longest = max(stall_after, self.config.wait_timeout_s / 2)
        for model in dict.fromkeys([*waiting, *since]):
            if model in progressing:
                continue
            peers = self._peers_start(link, model, now)
            if peers is None:
                continue
            peer_typical, peer_prompt = peers
            wait = min(max(stall_after, 10 * peer_typical), longest)
            over = 0.0  # the longest a run of it waited, of those past their wait
            began = since.get(model)
            if began is not None and now - began >= wait:
                over = now - began
                silent.append(model)
            for sent_at, prompt in waiting.get(model, ()):
                # Each run is judged by its own wait: ten times the peers' time to a first event
                # for a prompt of its length (a 100,000-token prompt on an idle node was moved at
                # 10 s and started over; short prompts beside peers' long prefills waited 15 s on
                # a dead node), at most half the silence that times it out (they timed out where
                # they were, a peer idle). No peer has started a run of it yet: that half (a 20 s
                # prefill on a fresh fleet was moved).
                own = longest
                if peer_typical:
                    scaled = 10 * peer_typical * (prompt / peer_prompt if peer_prompt and prompt else 1.0)
                    own = min(max(stall_after, scaled), longest)
                if now - sent_at >= own:
                    over = max(over, now - sent_at)
            if over:
                judged.append(model)
                if over > waited:
                    typical, waited = peer_typical, over
        if judged:
            silent_models = sorted(silent)
            self._route_around(
                link,
                judged,
                now,
                "node's runs are not progressing" if silent_models else "node is not starting runs",
                silent=silent_models,
                waited_s=round(waited, 3),
                peers_ttft_s=round(typical, 4),
            )
            self._end_silent_collected(link, judged, due, now)

    def _end_silent_collected(self, link: NodeLink, models: list[str], due: float, now: float) -> None:
        """The collected runs of ``models`` on ``link`` silent since ``due``, whose requests would
        run them again (:attr:`Run.rerun_if_stalled`): they end (the node is told to stop) and
        run again, once, on another node. Their clients have seen none of their output; they
        waited out ``wait_timeout_s`` for a 504 while a peer was idle (an outside audit: 120 s
        by default, and every request of a coding agent, which sends tools, is collected)."""
        for run in list(link.runs.values()):
            if not run.rerun_if_stalled or run.finished or run.first_event_at is None or run.slot.model not in models:
                continue
            last = run.last_event_at if run.progress_first == -math.inf else max(run.last_event_at, run.progress_at)
            if last <= due and self._taken_elsewhere(run, link, now):
                run.fail("its node stopped making progress", NODE_STALLED)

    def _taken_elsewhere(self, run: Run, old: NodeLink, stalled_at: float | None = None) -> bool:
        """A node besides ``old`` serves ``run``'s model and would take it: it fits, is not
        failing the model, not draining (a draining node takes no new run) and, with
        ``stalled_at``, not routed around for the model then."""
        model = run.want.model
        return any(
            run.want.fits(lk)
            and not lk.failing(model)
            and not lk.draining
            and (stalled_at is None or not lk.stalled(stalled_at, model))
            for lk in self._serving(model)
            if lk is not old
        )

    def _peers_ttft(self, link: NodeLink, model: str, now: float) -> float | None:
        """The typical time to a first event of ``model`` on the nodes serving it
        besides ``link``, not routed around for it, failing it or draining (None: no such
        peer; 0: none has started a run of it yet, and ``stall_after_s`` alone judges:
        a silent node beside peers that had just linked was never judged, and every
        turn of a session went to it and timed out, an outside audit)."""
        peers = self._peers_start(link, model, now)
        return None if peers is None else peers[0]

    def _peers_start(self, link: NodeLink, model: str, now: float) -> tuple[float, float] | None:
        """:meth:`_peers_ttft`, and the typical estimated prompt tokens of the runs it was
        measured on (0: not known)."""
        peers = [
            lk
            for lk in self.links.values()
            if lk is not link
            and model in lk.models
            and not lk.closed
            and not lk.draining
            and not lk.stalled(now, model)
            and not lk.failing(model)  # (its model server fails its runs: no yardstick, and no place to go)
        ]
        if not peers:
            return None
        timed = sorted((lk.ttft_of[model], lk.prompt_of.get(model, 0.0)) for lk in peers if model in lk.ttft_of)
        return timed[len(timed) // 2] if timed else (0.0, 0.0)

    def _route_around(self, link: NodeLink, models: list[str], now: float, why: str, **said: Any) -> None:
        """Route around ``link`` for ``models`` (a backoff each) and move all their
        unstarted runs on it to other nodes."""
        backoff = max(link.mark_stalled(model, now) for model in models)
        for model in models:  # (its silent runs hold their slots until they time out)
            link.on_trial(model, self.config.ramp_slots)
        moved = 0
        for run_id in list(link.unstarted):
            run = link.runs.get(run_id)
            if run is not None and run.slot.model in models and self._fail_over(run, link):
                run.stall_moved = True
                moved += 1
        log.warning(
            f"{why}: routing around it",
            node_id=link.node_id,
            models=sorted(models),
            **said,
            runs_moved=moved,
            for_s=backoff,
        )
        for hook in self.on_stall:
            hook(link)

    def _unjudge(self, models: Iterable[str], now: float) -> None:
        """A node judged stalled for a model is judged against its peers: once none
        serves the model (left or draining) but nodes stalled for it, they serve it again (a
        request for it waited out its stall for a 429 when the peer left: an outside re-audit)."""
        for model in models:
            serving = [lk for lk in self._serving(model) if not lk.draining]  # (a draining peer takes none)
            if serving and all(lk.stalled(now, model) for lk in serving):
                for lk in serving:
                    del lk.stalled_until[model]
                self._wake(model)

    def set_grant(self, link: NodeLink, model: str, slots: int, seq: int) -> None:
        """The node granted this edge ``slots`` runs of ``model``: queued
        requests take the room it makes; the grant is acknowledged with the
        next demand report."""
        before = link.grant_seq.get(model)
        if link.set_grant(model, slots, seq):
            self._wake(model)
        elif link.grant_seq.get(model) != before:  # (a stale or repeated grant wakes no reporter)
            self.demand_changed.unpark_all()

    def freed(self, link: NodeLink, run_ids: list[str]) -> None:
        """The node took the cancels of these runs, and the grant that came with its
        answer is applied: their slots are free now."""
        for slot in link.freed(run_ids):
            self.release(slot)

    def set_draining(self, link: NodeLink, draining: bool) -> None:
        link.draining = draining
        if not draining:
            self._wake_waiting(link.models)
            return
        self._trust_alone(link.models)
        if any(lk.stalled_until for lk in self.links.values()):  # (its peers stalled for a model serve it)
            self._unjudge(link.models, trio.current_time())

    def _wake_waiting(self, models: Container[str]) -> None:
        """:meth:`_wake` those of ``models`` that have waiters: a node serves up to 1,024
        models, and one flipping its ``draining`` thousands of times a second woke them
        all at each flip (0.9 ms of the edge's CPU a frame)."""
        self.demand_changed.unpark_all()
        waiting = {model for queues in (self._moved, self._queues) for model, queue in queues.items() if queue}
        for model in waiting:
            if model in models:
                self._wake(model)

    # -- admission -----------------------------------------------------------

    def _pick(
        self, want: Want, exclude: NodeLink | None = None, wait_until: float = 0.0, healthy: bool = False
    ) -> NodeLink | None:
        """The node for ``want`` among those that can take it now (a free
        slot, the context fits, not stalled), by ``config.routing``:

        - ``session``: session affinity first (the same node while it has
          room, so the model server's prefix cache is reused), then the least
          loaded (in-flight / capacity), ties broken by rendezvous hashing of
          the session (every edge picks the same node for a new session), else
          at random;
        - ``prefix``: session affinity first, while the session's node's load is below
          full, or within ``prefix_max_load_gap`` of the least loaded; then, among the nodes at most
          ``prefix_max_load_gap`` busier than the least loaded, the one the
          edge sent the longest prefix of this prompt past its opening (the
          least loaded of several); with no such match, the least loaded, ties
          broken by rendezvous hashing of the session, else of the opening, so that
          every edge makes the same choice among equally loaded nodes; with
          neither, as ``least_loaded``. Until ``wait_until``, a node with no
          free slot here but within the load gap, holding at least
          :data:`PREFIX_WAIT_BLOCKS` more of the prefix than any free one, and
          past its opening, is waited for: None, with ``_wanted`` naming it;
        - ``least_loaded``: ties broken at random; ``random``: any.

        ``healthy`` (a moved run): never a node failing the model, not even
        when no other serves it. Sets ``_placed`` (how, matched blocks) for
        the :meth:`_reserve` that follows."""
        model = want.model
        now = trio.current_time()
        routing = self.config.routing
        self._placed = (routing, 0)
        self._wanted = None
        self._fresh = (False, None)
        if routing == "random":
            free = [
                lk
                for lk in self.links.values()
                if lk is not exclude and lk.free_slots(model) > 0 and want.fits(lk) and not lk.stalled(now, model)
            ]
            working = [lk for lk in free if not _avoided(lk, model, now, healthy)]
            if working:
                return random.choice(working)
            return random.choice(free) if free and not healthy and not self._working(model, exclude, now) else None
        sticky: NodeLink | None = None  # the session's node, if it can take the run
        if want.session is not None and routing != "least_loaded":
            node_id = self._affinity.get(want.session)
            link = self.links.get(node_id) if node_id is not None else None
            if (
                link is not None
                and link is not exclude
                and link.free_slots(model) > 0
                and want.fits(link)
                and not link.stalled(now, model)
                and not _avoided(link, model, now, healthy)
            ):
                if routing == "session":
                    self._placed = ("session", 0)
                    return link
                sticky = link  # (prefix: within the load gap of the least loaded, below)
        free: list[tuple[float, NodeLink]] = []
        busy: list[NodeLink] = []  # serving, no free slot here: worth waiting for if it holds the prefix
        may_wait = routing == "prefix" and bool(want.prefix) and now < wait_until
        best_load = math.inf
        failing: list[tuple[float, NodeLink]] = []  # free, but routed around while its model server fails
        for link in self.links.values():
            if link is exclude or not want.fits(link) or link.stalled(now, model):
                continue
            if link.free_slots(model) <= 0:
                if may_wait and not link.closed and not link.draining:
                    busy.append(link)
                continue
            load = link.load(model)
            if _avoided(link, model, now, healthy):
                failing.append((load, link))
                continue
            free.append((load, link))
            best_load = min(best_load, load)
        if not free:
            if failing and not healthy and not self._working(model, exclude, now):
                self._placed = ("least_loaded", 0)
                return min(failing, key=lambda pair: pair[0])[1]
            return None
        limit = best_load + self.config.prefix_max_load_gap
        if sticky is not None and routing == "prefix" and want.prefix and self._passed_by(want, sticky, free, limit):
            sticky = None
        if sticky is not None and ((load := sticky.load(model)) < 1.0 or load <= limit):
            # The session's node while it has capacity (issue #5: a session's overlapping requests
            # went to two nodes once its own ran 2 of 4, an outside audit), by its model server's
            # own load when it reports it: at full, unless within the gap of the least loaded (a
            # node reporting a full engine kept every turn of its sessions while others sat idle,
            # an outside audit; Claude Code's metadata.user_id is a session).
            self._placed = ("session", 0)
            return sticky
        if routing == "prefix":
            key = rendezvous_key(want.session, want.prefix, want.opening)
        else:  # (a new session: by its id among the least loaded, so every edge picks the same node)
            key = rendezvous_key(want.session, ()) if routing == "session" else None
        if key is None:
            self._placed = ("least_loaded", 0)
            best = [lk for load, lk in free if load == best_load]
            return best[0] if len(best) == 1 else random.choice(best)
        if routing == "session":
            self._placed = ("least_loaded", 0)
            best = {lk.node_id: lk for load, lk in free if load == best_load}
            return best[rendezvous(key, best)]
        near = {lk.node_id: (load, lk) for load, lk in free if load <= limit}
        depth, holders = self.prefixes.match(want.prefix, near) if want.prefix else (0, set())
        fresh = depth <= want.opening  # a new conversation: all it matched (if anything) is its head
        head_depth, head_holders = depth, holders
        waitable: dict[str, NodeLink] = {}
        if busy:
            waitable = {lk.node_id: lk for lk in busy if lk.load(model) <= limit}
            if waitable:
                deeper, held = self.prefixes.match(want.prefix, near.keys() | waitable.keys())
                # Only busy nodes hold that much of it, past the shared head (a system prompt a
                # busy node alone was sent is no reason to wait for it, unless its head's
                # nodes are all busy: below).
                if deeper >= depth + PREFIX_WAIT_BLOCKS and deeper > want.opening:
                    self._wanted = min(held, key=lambda node_id: (waitable[node_id].load(model), node_id))
                    return None
                if deeper > want.opening:  # (its conversation's node is busy: not a new one)
                    fresh = False
                elif fresh and deeper > depth:
                    head_depth, head_holders = deeper, held
        if fresh and depth and len(near) + len(waitable) < len(self.links):
            # Judged against the nodes within the gap only: a conversation whose node is past it
            # would count as new, its head's share swollen. Against every node, once.
            if self.prefixes.match(want.prefix, self.links.keys())[0] > want.opening:
                fresh = False
        if want.prefix:
            self._fresh = (fresh, want.prefix[head_depth - 1] if fresh and head_depth else None)
        if depth and not fresh and not popular(self.prefixes.holders(want.prefix[depth - 1])):
            # Several nodes hold the same prefix: the least loaded of them.
            low = min(near[node_id][0] for node_id in holders)
            pool = [node_id for node_id in holders if near[node_id][0] == low]
            self._placed = ("prefix", depth)
        elif head_depth and fresh:
            # A new conversation on a head others opened with (a system prompt and tools): over
            # the nodes that hold it, and more, up to as many as the head's share of new
            # conversations of late (HeadShares), by the head's rendezvous order; the least loaded of them,
            # by the opening; when they are all busy (within the gap), it waits for one as a
            # prompt waits for its prefix's node. (Sent where the head was, a system prompt on
            # one node drew every conversation there, as no other node was ever sent it: 4
            # nodes, one agent, all runs on one node, its cache overflowing while three sat
            # idle, a lower hit ratio than least_loaded's: an outside audit. Sent to any node
            # free, eight agents' heads filled every node's cache.)
            head = want.prefix[head_depth - 1]
            share = self.heads.share(head, now, counting=True)
            candidates = near.keys() | waitable.keys()  # (free within the gap, or busy within it)
            spread = max(1, math.floor(len(candidates) * share + 0.5), len(head_holders))
            chosen = ranked(b"h" + head.to_bytes(8, "little"), candidates, head_holders)[:spread]
            free_chosen = [node_id for node_id in chosen if node_id in near]
            if not free_chosen:
                if may_wait:
                    self._wanted = min(chosen, key=lambda node_id: (waitable[node_id].load(model), node_id))
                    return None
                free_chosen = list(near)  # (its wait is over: any node within the gap)
            low = min(near[node_id][0] for node_id in free_chosen)
            pool = [node_id for node_id in free_chosen if near[node_id][0] == low]
            self._placed = ("prefix", head_depth)
        elif depth:
            # All it matched is a block sent to more nodes than the index lists (a prefix the
            # fleet shares): any of the least loaded, by the conversation's opening. Among the
            # nodes listed only, the others never got a new conversation (8 nodes, 2 edges: one
            # got no run, found from outside).
            pool = [node_id for node_id, (load, _) in near.items() if load == best_load]
            self._placed = ("prefix", depth)
        else:
            # No node holds any of it: the least loaded, ties by rendezvous (idle nodes: every
            # edge picks the same one). Not any node within the gap: that queued new prompts
            # behind others on a node while one sat idle (p50 1.9x least_loaded's, 2 nodes).
            pool = [node_id for node_id, (load, _) in near.items() if load == best_load]
            self._placed = ("rendezvous", 0)
        return near[rendezvous(key, pool)][1]

    def _passed_by(self, want: Want, sticky: NodeLink, free: list[tuple[float, NodeLink]], limit: float) -> bool:
        """The session's node holds this conversation (its prompt past the opening), and another
        edge sent a later turn of it (deeper) to another node, free within the load gap (that
        node's ``placed`` relay says): the session follows the conversation there. (Each edge
        kept the session on its own node once two had placed it apart, one node full at the
        time: every turn went to the node missing the one before, for the conversation's
        life; an outside audit, 2-3 of 16 conversations behind two edges.) A session whose
        node holds none of the prompt stays there: the strongest hint, as before."""
        held = self.prefixes.match(want.prefix, (sticky.node_id,))[0]
        if held <= want.opening:
            return False
        near = [lk.node_id for load, lk in free if load <= limit and lk is not sticky]
        return bool(near) and self.prefixes.relayed_match(want.prefix, near)[0] > held

    def _working(self, model: str, exclude: NodeLink | None, now: float) -> bool:
        """Some node serving ``model`` is not routed around, full or not: else a
        failing one is used all the same (its own error beats a queue timeout)."""
        return any(
            lk is not exclude and not lk.ejected(model, now) and not lk.stalled(now, model)
            for lk in self._serving(model)
        )

    def placed_elsewhere(self, link: NodeLink, prefix: list[int]) -> None:
        """Another edge sent ``link``'s node a prompt with this prefix chain
        (the node relayed it): this edge's next turn of that conversation
        goes there too."""
        if self.config.routing == "prefix":
            self.prefixes.record(prefix, link.node_id, relayed=True)

    def _remember_session(self, want: Want, link: NodeLink) -> None:
        """``want``'s session is on ``link``'s node now, unless this run only spilled over
        from the session's node, full for now (its own overlapping requests, often): the
        session stays there (its later requests, one at a time, followed the spill to a node
        without its cache; an outside re-check). One its node is past the load gap, routed
        around or gone follows the run."""
        if want.session is None:
            return
        affinity = self._affinity
        home_id = affinity.get(want.session)
        if home_id is not None and home_id != link.node_id:
            home = self.links.get(home_id)
            if (
                home is not None
                and want.model in home.models
                and home.free_slots(want.model) <= 0
                and not home.draining
                and not home.closed
            ):
                return
        affinity.pop(want.session, None)
        affinity[want.session] = link.node_id
        if len(affinity) > _MAX_SESSIONS:
            del affinity[next(iter(affinity))]

    def _reserve(self, link: NodeLink, want: Want) -> Slot:
        link.in_flight[want.model] += 1
        slot = Slot(link, want.model)
        if link.failing(want.model):
            slot.probe = True
            link.probes[want.model] = link.probes.get(want.model, 0) + 1
        self.demand_changed.unpark_all()
        self._remember_session(want, link)
        if want.prefix and self.config.routing == "prefix":
            self.prefixes.record(want.prefix, link.node_id)
            fresh, head = self._fresh
            if fresh:
                self.heads.started(head, trio.current_time())
        how, depth = self._placed
        for hook in self.on_placed:
            hook(how, depth)
        return slot

    def release(self, slot: Slot) -> None:
        if slot.released or slot.cancelling:  # (given back by the node's answer: freed)
            return
        slot.released = True
        slot.end_probe()
        slot.link.in_flight[slot.model] -= 1
        self._wake(slot.model)

    def _wake(self, model: str) -> None:
        """Hand free slots to waiters: moved runs first, then the queue, in
        FIFO order. A waiter at the head that no free node fits does not
        block the ones behind it that fit."""
        self.demand_changed.unpark_all()
        moved = self._moved.get(model)
        for queue in (moved, self._queues.get(model)):
            if not queue:
                continue
            if queue is not moved and len(queue) > 1 and not self._home_first(queue, model):
                return
            for waiter in list(queue):
                if self._place(queue, waiter) and not any(lk.free_slots(model) > 0 for lk in self.links.values()):
                    return

    def _home_first(self, queue: collections.deque[_Waiter], model: str) -> bool:
        """Hand each free slot to a waiter among the queue's first :data:`HOME_WINDOW` whose
        conversation is on that node (its ``home``), ahead of those before it, each of which
        gives way at most :data:`MAX_PASSED` times. (Under overload every waiter outlived its
        ``prefix_wait_ms`` and the head took whichever node freed first: with 200 conversations
        on 24 slots, 2 stayed on their node, as random placement has it: an outside audit.)
        False when no slot is left free."""
        free = {lk.node_id for lk in self.links.values() if lk.free_slots(model) > 0}
        if not free:
            return False
        ahead: list[_Waiter] = []
        for waiter in list(itertools.islice(queue, HOME_WINDOW)):
            if waiter.home in free and (waiter.prefer is None or waiter.prefer == waiter.home):
                link = self._pick(waiter.want)
                if link is not None and link.node_id == waiter.home:
                    for before in ahead:
                        before.passed += 1
                    self._hand(queue, waiter, link)
                    if link.free_slots(model) <= 0:
                        free.discard(link.node_id)
                        if not free:
                            return False
                    continue
            if waiter.passed >= MAX_PASSED:
                break  # it has given way enough: FIFO from here
            ahead.append(waiter)
        return True

    def _home(self, want: Want, serving: list[NodeLink]) -> str | None:
        """The node ``want``'s conversation is on: its session's, else the one holding its prompt
        past its opening (:meth:`_pick`'s own choice when that node has a free slot)."""
        if want.session is not None:
            node_id = self._affinity.get(want.session)
            if node_id is not None:
                return node_id
        if not want.prefix:
            return None
        depth, holders = self.prefixes.match(want.prefix, {lk.node_id for lk in serving})
        if depth <= want.opening or not holders or popular(self.prefixes.holders(want.prefix[depth - 1])):
            return None
        return min(holders, key=lambda node_id: (self.links[node_id].load(want.model), node_id))

    def _place(self, queue: collections.deque[_Waiter], waiter: _Waiter) -> bool:
        """Give ``waiter`` a slot if :meth:`_pick` finds one for it now."""
        if waiter.run is not None and waiter.run.finished:
            # A moved run that failed while it waited (its timeout, a cancel, its key's budget),
            # not yet closed: its close forgets it. Sent on, a node ran it for no one (its
            # cancel had gone to the node it left), its slot counted free meanwhile.
            self._leave(queue, waiter)
            waiter.run.requeued = None
            return False
        if waiter.prefer is not None and trio.current_time() < waiter.wait_until:
            # Still waiting for its prefix's node: nothing to look at while that
            # node has no free slot (O(1) per waiter, however long the queue or prompt).
            preferred = self.links.get(waiter.prefer)
            if preferred is not None and preferred.free_slots(waiter.want.model) <= 0:
                return False
        # A moved run waits for a node that is not failing: sent back to the one it left when
        # that one was next free, it failed again and its client got that error.
        link = self._pick(waiter.want, wait_until=waiter.wait_until, healthy=waiter.run is not None)
        if link is None:
            if self._wanted is not None or waiter.wait_until <= trio.current_time():
                self._prefer(waiter, self._wanted)
            return False
        self._hand(queue, waiter, link)
        return True

    def _hand(self, queue: collections.deque[_Waiter], waiter: _Waiter, link: NodeLink) -> None:
        """Give ``waiter`` (out of ``queue``) a slot on ``link``, which :meth:`_pick` chose."""
        queue.remove(waiter)
        if waiter.prefer is not None:
            for hook in self.on_prefix_wait:
                hook(link.node_id == waiter.prefer)
            self._prefer(waiter, None)
        slot = self._reserve(link, waiter.want)
        if waiter.run is not None:
            self._dispatch(waiter.run, slot)
        else:
            waiter.slot = slot
            waiter.event.set()

    def _prefer(self, waiter: _Waiter, node_id: str | None) -> None:
        """``waiter`` now waits for ``node_id`` only (None: for any node)."""
        if waiter.prefer == node_id:
            return
        model = waiter.want.model
        counts = self._preferring[model]
        if waiter.prefer is not None:
            counts[waiter.prefer] -= 1
            if counts[waiter.prefer] <= 0:
                del counts[waiter.prefer]
        if node_id is not None:
            counts[node_id] += 1
        elif not counts:  # (none kept for a model no one waits for: see acquire's queues)
            del self._preferring[model]
        waiter.prefer = node_id
        self.demand_changed.unpark_all()

    def _leave(self, queue: collections.deque[_Waiter], waiter: _Waiter) -> None:
        _discard(queue, waiter)
        self._prefer(waiter, None)
        self.demand_changed.unpark_all()

    async def acquire(self, want: Want, client: Any = None) -> Slot:
        """A slot on a node serving ``want.model``: at once if one is free,
        else after waiting in the model's FIFO queue. Raises :class:`APIError`
        (404 unknown, 503 none linked, 400 nothing fits the context, 429 queue
        full or timed out, 499 cancelled by an operator while queued). A
        caller cancelled while queued leaves the queue at once. ``client``:
        the request's exchange, for the console."""
        if self._refusing is not None:  # the edge is shutting down: no new wait, no new work
            raise self._refusing()
        model = want.model
        serving = self._serving(model)
        if not serving:
            if not self._awaits_restart(model):
                # With no node linked at all the edge cannot tell what exists: 503.
                if self.is_known(model) or not self.links:
                    raise errors.no_node(model)
                raise self.unknown_model(model)
        elif not any(want.fits(link) for link in serving):
            if want.tunnel and not any(lk.models[model].passthrough for lk in serving):
                # a setting of the nodes, not an outage: a 503 had the SDKs retry it
                raise errors.APIError(
                    400,
                    f"No linked node serving the model `{model}` allows passthrough (a node's "
                    "`passthrough = true`), which this request needs: /v1/completions, /v1/embeddings, "
                    'or a model whose `response_mode` is "passthrough" here.',
                    "invalid_request_error",
                    param="model",
                    code="passthrough_not_allowed",
                )
            limit = max(lk.frame_limit for lk in serving if not want.tunnel or lk.models[model].passthrough)
            if want.frame_bytes > limit:  # (the nodes' own limits, below the edge's)
                raise too_large_for_a_frame(want.frame_bytes - FRAME_OVERHEAD, limit)
            lost = self._lost_context.get(model)
            if lost is not None and trio.current_time() - lost[0] < LOST_CONTEXT_S and lost[1] >= want.min_context:
                raise errors.no_node(
                    model,
                    f"No node linked now serving `{model}` has a context this request fits; one that left "
                    "moments ago had. Retry shortly.",
                )
            largest = max(lk.models[model].context_window for lk in serving)
            raise errors.context_too_long(want.min_context - (want.max_tokens or 1), want.max_tokens, largest)
        queue = self._queues.get(model) or _NO_QUEUE
        now = trio.current_time()
        wait_until = now + self.config.prefix_wait_ms / 1000 if self.config.routing == "prefix" else 0.0
        wanted = None
        if not queue and not self._moved.get(model):
            link = self._pick(want, wait_until=wait_until)
            if link is not None:
                self._waited(model, client, 0.0)
                return self._reserve(link, want)
            wanted = self._wanted
        max_queue, timeout_ms = self._queue_bounds(model)
        retry_after = max(1, math.ceil(timeout_ms / 1000 / 4))
        if len(queue) >= max_queue + _granted_elsewhere(serving, model):
            if wanted is not None:  # no room to wait for its prefix's node: a free one after all
                link = self._pick(want)
                if link is not None:
                    self._waited(model, client, 0.0)
                    return self._reserve(link, want)
            raise errors.queue_rejected(model, "queue is full", retry_after)
        waiter = _Waiter(want, wait_until=wait_until, client=client)
        if self.config.routing == "prefix" and queue:  # (behind others: its conversation's node, if any)
            waiter.home = self._home(want, serving)
        if queue is _NO_QUEUE:
            queue = self._queues[model] = collections.deque()
        queue.append(waiter)
        try:
            self._queued(want)
            self._prefer(waiter, wanted)
            self._wake(model)  # a free node may fit this request though not the ones ahead of it
            deadline = waiter.deadline = now + timeout_ms / 1000
            waited = False
            try:
                if wait_until > now:
                    with trio.move_on_at(min(wait_until, deadline)):
                        await waiter.event.wait()
                    if not waiter.event.is_set():  # still queued (leaving the queue sets it)
                        self._place(queue, waiter)  # its time to wait for its prefix's node is up: any node now
                with trio.move_on_at(deadline) as waiter.scope:
                    left = self._drained.get(model)
                    if left is not None and not left[1] and not self._serving(model):  # its last node lost
                        waiter.scope.deadline = min(deadline, left[0] + LOST_GRACE_S)
                    await waiter.event.wait()
                waited = True
            finally:
                waiter.scope = None
                self._waited(model, client, trio.current_time() - now)
                if not waited:
                    # Cancelled (the client left): give back a slot handed over
                    # in the same instant, or leave the queue.
                    if waiter.slot is not None:
                        self.release(waiter.slot)
                    else:
                        self._leave(queue, waiter)
            if waiter.slot is not None:
                # Handed a slot the instant after its client left (a burst of clients leaving at
                # once: each slot freed went to a waiter whose own disconnect was not yet heard, and
                # the model server started requests for 1-10 of 40 clients already gone).
                closed = getattr(client, "closed_by_client", None)
                if closed is not None and closed():
                    self.release(waiter.slot)
                    raise errors.client_gone()
                return waiter.slot
            self._leave(queue, waiter)
            if waiter.cancelled:
                raise errors.operator_cancelled()
            if waiter.refused is not None:
                raise waiter.refused
            if waiter.gone and self._serving(model):  # (nodes of the model are linked, none can take it)
                left = "drained and left" if waiter.gone == "drained" else "left"
                raise errors.no_node(
                    model,
                    f"The node serving `{model}` that could take this request (its size or its context) {left} "
                    "while it waited; the nodes linked now cannot.",
                )
            if waiter.gone == "drained":
                raise errors.no_node(
                    model, f"The last node serving `{model}` drained and left while this request waited."
                )
            if waiter.gone == "without":
                raise errors.no_node(model, f"The last node serving `{model}` linked again without it.")
            if waiter.gone:
                raise errors.no_node(model)
            serving = self._serving(model)
            if serving and all(lk.draining for lk in serving):  # not at capacity: leaving (a restart?)
                raise errors.no_node(
                    model,
                    f"Every node serving `{model}` is draining; none took this request within {timeout_ms / 1000:g} s.",
                )
            if not serving:
                left = self._drained.get(model)
                if left is not None and not left[1]:
                    waited = min(LOST_GRACE_S, timeout_ms / 1000)  # (the queue's timeout may come first)
                    said = f"The last node serving `{model}` was lost; none linked within {waited:g} s."
                    raise errors.no_node(model, said)
                raise errors.no_node(
                    model,
                    f"The last node serving `{model}` drained and left; none linked within {timeout_ms / 1000:g} s.",
                )
            raise errors.queue_rejected(model, "timed out waiting in the queue", retry_after)
        finally:
            # (an empty queue is not kept: a model name requested once held one for good, and a
            # node naming 1,024 new ones each time it linked grew the edge by 2.3 KB a name)
            if not queue and self._queues.get(model) is queue:
                del self._queues[model]

    def _waited(self, model: str, client: Any, seconds: float) -> None:
        api = getattr(client, "api", None) or "unknown"  # (the request's front door, for the metrics)
        for hook in self.on_queue_wait:
            hook(model, api, seconds)

    def queued(self) -> list[_Waiter]:
        """Every request waiting for a slot (not moved runs): ``want.model``,
        ``since`` and ``client`` say what it is."""
        return [w for queue in self._queues.values() for w in queue]

    def refuse_waiting(self, error: Callable[[], errors.APIError], message: str) -> None:
        """The edge is shutting down: every queued request ends with ``error()``
        and every run waiting to move fails with ``message``, now, not once a
        slot frees (they would start work on a node only to be cut); so does
        every :meth:`acquire` from now on (a request whose body came in late, a
        tool-call retry)."""
        self._refusing = error
        for queues in (self._queues, self._moved):
            for queue in queues.values():
                for waiter in list(queue):
                    if self._end_wait(queue, waiter, message, SHUTDOWN):
                        waiter.refused = error()
                        waiter.event.set()

    def _end_wait(self, queue: collections.deque[_Waiter], waiter: _Waiter, message: str, cause: str) -> bool:
        """Take ``waiter`` out of ``queue``: a run waiting to move fails with
        ``message``; True for a queued request (the caller says why, and wakes it)."""
        queue.remove(waiter)
        self._prefer(waiter, None)
        if waiter.run is None:
            return True
        waiter.run.requeued = None
        waiter.run.fail(message, cause)
        return False

    def cancel_queued(self, waiter: _Waiter) -> None:
        """An operator ends a queued request: it leaves the queue with a 499."""
        if not waiter.event.is_set():
            waiter.cancelled = True
            self._leave(self._queues.get(waiter.want.model, _NO_QUEUE), waiter)
            waiter.event.set()

    # -- runs ------------------------------------------------------------------

    def _new_run(
        self, slot: Slot, want: Want, metadata: dict[str, str], run_id: str | None, api: str, client: Any
    ) -> Run:
        cfg = self.config
        run = Run(
            run_id or new_run_id(),
            slot,
            wait_timeout=cfg.wait_timeout_s,
            run_timeout=cfg.run_timeout_s,
            max_buffered=cfg.max_buffered_events,
            metadata=metadata,
            on_close=self._closed,
        )
        run.want = want
        run.api = api
        run.client = client
        run.on_node_done = self._node_done
        run.on_failed_at_once = self._failed_at_once
        run.on_refused_at_once = self._refused_at_once
        run.buffered = self.buffered
        run.timers = self.timers
        self.runs[run.id] = run
        slot.link.runs[run.id] = run
        return run

    def start(
        self,
        slot: Slot,
        request: msgspec.Raw,
        *,
        want: Want,
        metadata: dict[str, str],
        run_id: str | None = None,
        api: str = "",
        client: Any = None,
    ) -> Run:
        """Create the run and send it to the slot's node (never blocks).
        ``request``: the body from :func:`encode_run_body`; ``api``: the front
        door the request came through, for metrics only (the node never sees it);
        ``client``: the request's exchange (the console shows its key)."""
        run = self._new_run(slot, want, metadata, run_id, api, client)
        run.request = RunRequest(
            run_id=run.id,
            model=slot.model,
            target=slot.info.target,
            request=request,
            timeout_s=self.config.run_timeout_s,
            metadata=metadata,
            prefix=want.prefix if want.prefix and slot.link.relays_prefixes else None,
        )
        slot.link.send_nowait(run.request)
        slot.link.sent(run.id, run.started_at)
        return run

    def start_tunnel(
        self,
        slot: Slot,
        *,
        want: Want,
        method: str,
        path: str,
        body: bytes,
        stream: bool,
        headers: list[tuple[str, str]],
        api: str = "",
        client: Any = None,
    ) -> Run:
        """A passthrough run: the node relays one raw HTTP request."""
        run = self._new_run(slot, want, {"response_mode": "passthrough"}, None, api, client)
        run.request = TunnelRequest(  # (kept: a run its node loses before any event moves, as a chat run does)
            run_id=run.id,
            model=slot.model,
            target=slot.info.target,
            method=method,
            path=path,
            body=body,
            timeout_s=self.config.run_timeout_s,
            stream=stream,
            headers=headers,
        )
        slot.link.send_nowait(run.request)
        slot.link.sent(run.id, run.started_at)
        return run

    async def wait_idle(self) -> None:
        """Return once no run is in flight."""
        while self.runs:
            await self._run_closed.park()

    def unsendable(self, link: NodeLink, frame: RunRequest | TunnelRequest, problem: str) -> None:
        """A request frame could not go to the node (encoding, size): that run
        fails, the link stays."""
        log.warning("run request not sendable", run_id=frame.run_id, node_id=link.node_id, problem=problem)
        run = link.runs.get(frame.run_id)
        if run is not None:
            run.fail(f"the request could not be sent to the node: {problem}", UNSENDABLE)

    def _steer_away(self, run: Run) -> None:
        """``run`` failed on its node after its output began, the node's fault (or timed out):
        its session, and its prompt's prefix, no longer lead there; the next request of it
        (the client's retry) goes to the least loaded other node serving the model, if one
        can take it. A node that failed every retry right after its first token kept a
        Claude Code session through 12 tries, two healthy peers idle (an outside audit)."""
        want, link = run.want, run.slot.link
        if want is None or not (want.session or want.prefix):
            return
        now, model = trio.current_time(), want.model
        others = [
            lk
            for lk in self._serving(model)
            if lk is not link
            and not lk.draining
            and want.fits(lk)
            and not lk.stalled(now, model)
            and not lk.ejected(model, now)
        ]
        if not others:
            return
        other = min(others, key=lambda lk: (lk.load(model), lk.node_id))
        if want.session is not None and self._affinity.get(want.session) == link.node_id:
            self._remember_session(want, other)
        if want.prefix and self.config.routing == "prefix":
            self.prefixes.forget(want.prefix, link.node_id)
            self.prefixes.record(want.prefix, other.node_id)

    def _node_done(self, run: Run) -> None:
        self.release(run.slot)
        if run.cause == RUN_ERROR and run.events_seen > 1 and run.node_fault():  # failed mid-answer, not for the client
            self._steer_away(run)
            link, model = run.slot.link, run.slot.model
            now = trio.current_time()
            if (
                link.errored(model) >= ERRORS_AFTER_OUTPUT
                and not link.stalled(now, model)
                and link.completed_at.get(model, -math.inf) <= now - stall_after_s(self.config)
                and self._peers_ttft(link, model, now) is not None
            ):
                link.errors_in_row.pop(model, None)
                self._route_around(link, [model], now, "node's runs fail after output", errors=ERRORS_AFTER_OUTPUT)

    def _closed(self, run: Run) -> None:
        if run.cause == TIMEOUT:  # (a client's retry of a silent run goes elsewhere, too)
            self._steer_away(run)
        self.timers.discard(run)
        model = run.want.model if run.want is not None else None
        moved = self._moved.get(model) if model is not None else None
        if moved is not None:
            if run.requeued is not None:
                _discard(moved, run.requeued)
            if not moved:  # (none kept for a model no run waits for: see acquire's queues)
                del self._moved[model]
        run.requeued = None
        self._run_closed.unpark_all()
        self.runs.pop(run.id, None)
        run.slot.link.forget_run(run.id)
        run.request = None
        self.release(run.slot)
        for hook in self.on_run_closed:
            hook(run)


_NO_QUEUE: collections.deque[_Waiter] = collections.deque(maxlen=0)  # a model's while none waits (never appended to)


def _discard(queue: collections.deque[_Waiter], waiter: _Waiter) -> None:
    try:
        queue.remove(waiter)
    except ValueError:
        pass


__all__ = ["RunService", "Slot", "Want"]
