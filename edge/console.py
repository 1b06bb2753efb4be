"""The operator console: ``GET /console`` (a page shipped in the package:
plain HTML, CSS and JS, nothing fetched from elsewhere) and what it reads.

- ``GET /v1/admin/events``: server-sent events, admin key. ``snapshot`` (the
  fleet, the runs in flight, queues, recent 429s and run errors) every
  ``SNAPSHOT_EVERY_S``, and ``usage`` (tokens per minute over the last hour,
  today's totals per key and per model) at most once a second after a
  request ended, else every ``USAGE_EVERY_S`` (a ledger the edges share is
  asked for today's totals at that slower pace only; one only this edge
  writes, once a day: the edge counts what it writes). One
  task builds each event once for every subscriber, and only while someone
  is subscribed; a subscriber holds the latest of each kind, never a backlog,
  so a slow browser cannot grow the edge's memory and a busy edge sends no
  more often. Gzipped for a client that accepts it (every browser), each
  event flushed whole: a tab left open under load read 95 KB/s, about 340
  MB an hour (an outside audit), the same snapshot each time with a few
  numbers changed. Deflate sees 32 KiB back: a snapshot under that costs
  a tenth or less of itself, a larger one (about 165 runs in flight and
  more) about a fifth.
- ``GET /v1/admin/runs``: the same runs as JSON.
- ``POST /v1/admin/runs/{id}/cancel``: ends the run as a client leaving would
  end it: the node is told to cancel, the model server sees the request
  aborted; the client gets an error event (``cancelled by an operator``), or,
  before its response started, a 499 with ``x-should-retry: false`` (so the
  SDKs do not start it again). A queued request (by its request id) leaves
  the queue with the same 499.

The request path pays one call per request (:meth:`Console.request_done`:
counters, and a ring entry for a 429) and one per failed run.
"""

from __future__ import annotations

import collections
import heapq
import math
import time
import zlib
from functools import partial
from importlib import resources
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import trio
from quart import Response, request

from edge.admin import admin_refusal, error_response, json_response
from edge.errors import node_error
from edge.keys import RETRY_HINT
from edge.metrics import OTHER_MODEL
from edge.runs.run import CANCELLED, CLIENT_GONE, COMPLETE, Run

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from edge.app import Edge

log = structlog.get_logger("iop.edge.console")

SNAPSHOT_EVERY_S = 0.25
SNAPSHOT_LOOP_SHARE = 0.05  # of the event loop's time, at most, spent making snapshots (they come less often)
USAGE_EVERY_S = 5.0
# Of the time, what the ledger's reads of the day may take at most: a read that took longer than
# USAGE_EVERY_S * LEDGER_SHARE puts the next one further off (a day of 1.6 million rows read every
# 5 s took 45% of a core, an outside soak; the counts since the last read fill in meanwhile).
LEDGER_SHARE = 0.05
USAGE_MIN_S = 1.0
# (JSON that repeats the last snapshot: level 1 takes it to a tenth or less while a snapshot is under
# deflate's 32 KiB window; a larger one, 200 runs in flight, is compressed on its own: a fifth)
GZIP_LEVEL = 1
MAX_RUNS = 200  # runs listed in a snapshot, oldest first (the counts cover all)
RECENT = 50  # 429s and run errors remembered
MAX_SUBSCRIBERS = 16
STALE_S = 10.0  # a console that has not taken its events for this long loses its place (its socket is stuck)
MINUTES = 60
MAX_USAGE_ROWS = 50  # per table, the most tokens first; the rest summed in one row
MAX_LEDGER_MODELS = 1000  # today's model names kept as the ledger gave them; the rest are "other"

_encode = msgspec.json.Encoder().encode


class ModelView(msgspec.Struct):
    name: str
    adapter: str
    max_concurrency: int
    grant: int
    in_flight: int
    queued: int
    engine: dict[str, float | None] | None = None
    stalled: bool = False  # routed around for this model: its runs were not starting


class NodeView(msgspec.Struct):
    id: str
    linked_for_s: float
    draining: bool
    stalled: bool  # for some of its models (each model says)
    in_flight: int
    capacity: int
    ttft_ms: float | None
    models: list[ModelView]
    # its frames waited unread for their part of the edge's time (NodeLink.throttled), and how long in all
    throttled: bool = False
    throttled_s: float = 0.0


def _request_id(client: Any) -> str | None:
    """The request id of a run's client (an :class:`Exchange`; a tunnel's too), if it has one."""
    return getattr(client, "request_id", None)


class RunView(msgspec.Struct):
    id: str | None  # a queued request (no run yet): its request id (req_...); None only if it has none
    model: str
    node: str | None
    api: str
    key: str | None
    age_s: float
    tokens: int
    phase: str  # queued, waiting (for the first token), streaming, buffered
    request_id: str | None = None  # the request's (req_...), a run's too: a cancel may name it


class Rejection(msgspec.Struct):
    t: float  # the latest
    model: str
    key: str | None
    code: str | None
    message: str = ""  # which limit (or the queue), in the edge's words
    count: int = 1  # the same refusal, one after another


def _limit_of(refusal: str) -> str:
    """A refusal's words without its wait (after :data:`edge.keys.RETRY_HINT`),
    which changes every tenth of a second: the same limit refused over and over is one line."""
    return refusal.partition(RETRY_HINT)[0]


class RunError(msgspec.Struct):
    t: float
    run_id: str
    model: str
    node: str
    api: str
    cause: str
    message: str


class Snapshot(msgspec.Struct):
    t: float
    edge_id: str
    uptime_s: float
    draining: bool
    in_flight: int
    queued: int
    phases: dict[str, int]
    queues: dict[str, int]
    nodes: list[NodeView]
    runs: list[RunView]
    rejected: list[Rejection]
    errors: list[RunError]


class UsageRow(msgspec.Struct):
    name: str | None
    requests: int
    prompt_tokens: int
    completion_tokens: int


class Usage(msgspec.Struct):
    t: float
    source: str  # "ledger" (today's totals from it) or "memory" (since this edge started, today)
    minutes: list[tuple[int, int, int, int]]  # (unix minute, requests, prompt, completion), oldest first
    keys: list[UsageRow]
    models: list[UsageRow]


def _rows(name: str | None, row: dict) -> UsageRow:
    return UsageRow(name, row["requests"], row["prompt_tokens"], row["completion_tokens"])


def _top(rows) -> list[UsageRow]:
    """Rows with the same name merged, the most tokens first, at most
    MAX_USAGE_ROWS (the rest summed in one row named "(others)"). The rows
    given are not changed."""
    merged: dict[str | None, UsageRow] = {}
    for row in rows:
        seen = merged.get(row.name)
        if seen is None:
            merged[row.name] = UsageRow(row.name, row.requests, row.prompt_tokens, row.completion_tokens)
        else:
            seen.requests += row.requests
            seen.prompt_tokens += row.prompt_tokens
            seen.completion_tokens += row.completion_tokens
    ordered = sorted(merged.values(), key=lambda r: (-(r.prompt_tokens + r.completion_tokens), str(r.name)))
    if len(ordered) <= MAX_USAGE_ROWS:
        return ordered
    rest = ordered[MAX_USAGE_ROWS - 1 :]
    others = UsageRow(
        "(others)",
        sum(r.requests for r in rest),
        sum(r.prompt_tokens for r in rest),
        sum(r.completion_tokens for r in rest),
    )
    return [*ordered[: MAX_USAGE_ROWS - 1], others]


def _since(now: dict, then: dict) -> list[UsageRow]:
    """Rows of what ``now``'s counters (name -> [requests, prompt, completion])
    gained over ``then``'s."""
    rows = []
    for name, (requests, prompt, completion) in now.items():
        before = then.get(name, (0, 0, 0))
        if requests > before[0]:
            rows.append(UsageRow(name, requests - before[0], prompt - before[1], completion - before[2]))
    return rows


def phase(run: Run) -> str:
    if run.requeued is not None:
        return "queued"
    if run.first_event_at is None:
        return "waiting"
    client = run.client
    return "streaming" if client is None or client.access.stream else "buffered"


class _Subscriber:
    __slots__ = ("snapshot", "usage", "lot", "fresh", "closed", "taken")

    def __init__(self) -> None:
        self.fresh = True  # has had no usage event yet
        self.closed = False  # the edge is going away: end the stream once the last events are out
        self.snapshot: bytes | None = None
        self.usage: bytes | None = None
        self.lot = trio.lowlevel.ParkingLot()
        self.taken = trio.current_time()  # when it last took its events (or subscribed)

    async def next(self) -> bytes | None:
        """The latest events not yet sent; None: the stream is over."""
        while self.snapshot is None and self.usage is None:
            if self.closed:
                return None
            await self.lot.park()
        out = (self.usage or b"") + (self.snapshot or b"")
        self.snapshot = self.usage = None
        self.taken = trio.current_time()
        return out


class Console:
    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self.started = time.time()  # create_app may run outside trio (hypercorn's CLI)
        self._subscribers: set[_Subscriber] = set()
        self.closed = False
        self._subscribed = trio.lowlevel.ParkingLot()
        self.rejected: collections.deque[Rejection] = collections.deque(maxlen=RECENT)
        self.errors: collections.deque[RunError] = collections.deque(maxlen=RECENT)
        # (unix minute, requests, prompt, completion), one per minute of the last hour
        self._minutes: collections.deque[list[int]] = collections.deque(maxlen=MINUTES)
        self._day = 0
        self._by_key: dict[str | None, list[int]] = {}
        self._by_model: dict[str, list[int]] = {}
        self._usage_changed = False
        self._today: tuple[list[UsageRow], list[UsageRow]] | None = None  # from the ledger
        # This edge's own totals when the ledger was last read (day, by key, by model):
        # what it counted since is added to the ledger's figures until the next read.
        self._counted_at_read: tuple[int, dict, dict] = (0, {}, {})
        edge.runs.on_run_closed.append(self._run_closed)

    # -- what the request path tells it ------------------------------------------

    def request_done(
        self,
        model: str,
        key: str | None,
        status: int,
        code: str | None,
        prompt: int,
        completion: int,
        refusal: str = "",
    ) -> None:
        """One request ended (edge.openai.routes). ``model``: its metrics label (bounded)."""
        now = time.time()
        minute = int(now // 60)
        self._usage_changed = True
        minutes = self._minutes
        if not minutes or minutes[-1][0] != minute:
            minutes.append([minute, 0, 0, 0])
        row = minutes[-1]
        row[1] += 1
        row[2] += prompt
        row[3] += completion
        self._roll(minute // 1440)
        # Today's tables are the ledger's and what it will hold: a keyless request on an edge
        # that has keys (a 401) is no record there (anyone could add rows to "today from the
        # ledger", kept all day: an outside audit). The chart above counts it.
        counted = () if key is None and not self.edge.keys.open else ((self._by_key, key), (self._by_model, model))
        for table, name in counted:
            totals = table.get(name)
            if totals is None:
                totals = table[name] = [0, 0, 0]
            totals[0] += 1
            totals[1] += prompt
            totals[2] += completion
        if status == 429:
            refusal = refusal[:200]
            last = self.rejected[-1] if self.rejected else None
            if (
                last is not None
                and (last.model, last.key, last.code) == (model, key, code)
                and _limit_of(last.message) == _limit_of(refusal)
            ):
                last.count += 1
                last.t = round(now, 3)
                last.message = refusal  # the latest "Try again in"
            else:
                self.rejected.append(Rejection(round(now, 3), model, key, code, refusal))

    def _run_closed(self, run: Run) -> None:
        if run.cause in (COMPLETE, CLIENT_GONE, None) or run.error is None:
            return
        self.errors.append(
            RunError(
                round(time.time(), 3),
                run.id,
                run.slot.model,
                run.slot.link.node_id,
                run.api,
                run.cause,
                node_error(run.error[:300]),  # (a model server's words: no bidi override reverses a line)
            )
        )

    def tool_calls_invalid(self, run: Run, attempts: int) -> None:
        """A turn whose tool calls were still invalid after its attempts: an error of its own
        (its runs completed; the client got `invalid_tool_call`, which the list missed: an
        outside audit). Not the reason, which quotes the model's arguments (logged only when
        tracing)."""
        message = f"the model's tool calls were still invalid after {attempts} attempt{'s' if attempts > 1 else ''}"
        at, node = round(time.time(), 3), run.slot.link.node_id
        self.errors.append(RunError(at, run.id, run.slot.model, node, run.api, "tool_validation", message))

    def cancel(self, run_id: str) -> bool:
        """End a run in flight, or a request waiting in the queue or running (by
        its request id: a row the console showed queued may have started since),
        as its client leaving would; False: no such one."""
        runs = self.edge.runs
        run = runs.runs.get(run_id)
        if run is None:
            waiter = next((w for w in runs.queued() if w.client is not None and w.client.request_id == run_id), None)
            if waiter is not None:
                log.info("queued request cancelled by an operator", request_id=run_id, model=waiter.want.model)
                runs.cancel_queued(waiter)
                return True
            run = next((r for r in runs.runs.values() if _request_id(r.client) == run_id and not r.finished), None)
            if run is None:
                return False
        if run.finished:
            return False
        log.info("run cancelled by an operator", run_id=run.id, node_id=run.slot.link.node_id)
        run.fail("cancelled by an operator", CANCELLED)
        return True

    # -- what it shows -------------------------------------------------------------

    def run_views(self, limit: int = MAX_RUNS) -> tuple[list[RunView], dict[str, int]]:
        """The ``limit`` oldest runs and queued requests, and the count of each phase."""
        now = trio.current_time()
        runs = self.edge.runs
        phases = dict.fromkeys(("queued", "waiting", "streaming", "buffered"), 0)
        for run in runs.runs.values():
            phases[phase(run)] += 1
        queued = runs.queued()
        phases["queued"] += len(queued)
        views = []
        for run in heapq.nsmallest(limit, runs.runs.values(), key=lambda r: r.started_at):
            client = run.client
            key = client.key if client is not None else None
            views.append(
                RunView(
                    run.id,
                    run.slot.model,
                    run.slot.link.node_id if run.requeued is None else None,  # (moved: the node it left, shown)
                    run.api,
                    key.id if key is not None else None,
                    round(now - run.started_at, 2),
                    run.deltas_seen,
                    phase(run),
                    _request_id(client),
                )
            )
        for waiter in heapq.nsmallest(max(0, limit - len(views)), queued, key=lambda w: w.since):
            client = waiter.client
            key = client.key if client is not None else None
            views.append(
                RunView(
                    client.request_id if client is not None else None,
                    waiter.want.model,
                    None,
                    client.api if client is not None else "",
                    key.id if key is not None else None,
                    round(now - waiter.since, 2),
                    0,
                    "queued",
                    client.request_id if client is not None else None,
                )
            )
        views.sort(key=lambda v: -v.age_s)
        return views, phases

    def snapshot(self) -> Snapshot:
        edge = self.edge
        runs = edge.runs
        now = trio.current_time()
        nodes = []
        for link in sorted(runs.links.values(), key=lambda lk: lk.node_id):
            models = [
                ModelView(
                    name,
                    info.adapter,
                    info.max_concurrency,
                    link.slots(name),  # as placement counts it
                    link.in_flight.get(name, 0),
                    runs.queue_depth(name),
                    msgspec.structs.asdict(link.engine[name]) if name in link.engine else None,
                    link.stalled(now, name),
                )
                for name, info in sorted(link.models.items())
            ]
            nodes.append(
                NodeView(
                    link.node_id,
                    round(now - link.linked_at, 1),
                    link.draining,
                    link.stalled(now),
                    sum(link.in_flight.values()),
                    sum(link.slots(n) for n in link.models),
                    round(link.ttft * 1000, 1) if link.ttft is not None else None,
                    models,
                    *link.throttled(now),
                )
            )
        views, phases = self.run_views()
        queues = {name: runs.queue_depth(name) for name in sorted(runs.models())}
        return Snapshot(
            round(time.time(), 3),
            edge.id,
            round(time.time() - self.started, 1),
            edge.draining,
            runs.on_nodes,
            runs.queue_depth(),
            phases,
            queues,
            nodes,
            views,
            list(self.rejected),
            list(self.errors),
        )

    def _roll(self, day: int) -> None:
        """This edge's totals by key and by model are of ``day`` (UTC days since the epoch)."""
        if day != self._day:
            self._day = day
            self._by_key.clear()
            self._by_model.clear()

    async def usage(self, ask_ledger: bool = True) -> Usage:
        """``ask_ledger``: today's totals from the ledger now, else as it last said."""
        await self._read_ledger(ask_ledger)
        return self._usage_now()

    async def _read_ledger(self, ask_ledger: bool) -> None:
        """Today's totals from the ledger (see :meth:`usage`), when they are to be read."""
        minute = int(time.time() // 60)
        ledger = self.edge.ledger
        # A ledger only this edge writes (SQLite) is read once a day: what this edge counts since
        # is what it writes (1.6 million rows read every 5 s took 45% of a core, an outside soak).
        # One the edges share (PostgreSQL) is read at the pace asked, for the others' rows.
        again = ask_ledger and ledger is not None and ledger.dialect.postgres
        if ledger is not None and (again or self._today is None or self._counted_at_read[0] != minute // 1440):
            start = (minute // 1440) * 86400

            def counted() -> tuple[int, dict, dict]:
                # What this edge has counted as the read's records are fixed (stored, none stored
                # until it is read): the rows hold exactly those, and what it counts after adds to
                # them. (Taken after a read, a request queued during it was in neither: for good,
                # with a ledger read once a day.)
                self._roll(minute // 1440)
                return (
                    self._day,
                    {k: list(v) for k, v in self._by_key.items()},
                    {k: list(v) for k, v in self._by_model.items()},
                )

            try:
                (by_key, by_model), counted_then = await ledger.usage_at(start, [["key"], ["model"]], counted)
                # The ledger holds whatever model name a client sent (a 404 too): names no node
                # serves or the config lists are summed as "other", as in /metrics, when shown
                # (labelled as read, a model whose node had not linked again after a restart was
                # "other" until the next day's read: an outside audit). The names of the most
                # tokens are kept as read, the rest summed as "other" at once.
                models = sorted(
                    (_rows(r["model"], r) for r in by_model), key=lambda r: -(r.prompt_tokens + r.completion_tokens)
                )
                rest = models[MAX_LEDGER_MODELS:]
                if rest:
                    models = models[:MAX_LEDGER_MODELS]
                    models.append(
                        UsageRow(
                            OTHER_MODEL,
                            sum(r.requests for r in rest),
                            sum(r.prompt_tokens for r in rest),
                            sum(r.completion_tokens for r in rest),
                        )
                    )
                self._today = (_top(_rows(r["key"], r) for r in by_key), models)
                self._counted_at_read = counted_then
            except ledger._errors as e:  # the ledger's database is down: today's counts from memory
                log.warning("console: ledger unavailable, usage from memory", error=str(e))
                self._today = None

    def _usage_now(self) -> Usage:
        """The usage event: the last hour from memory, today's totals as the ledger last said
        (and what this edge counted since), or from memory."""
        now = time.time()
        minute = int(now // 60)
        recent = {row[0]: row for row in self._minutes}
        minutes = [
            tuple(recent.get(m, (m, 0, 0, 0))) for m in range(minute - MINUTES + 1, minute + 1)
        ]  # a full hour, empty minutes included
        ledger = self.edge.ledger
        if ledger is not None and self._today is not None:
            keys, read = self._today
            label = self.edge.metrics.model_label
            models = _top(UsageRow(label(r.name), r.requests, r.prompt_tokens, r.completion_tokens) for r in read)
            day, keys_then, models_then = self._counted_at_read
            if day == self._day:  # the ledger's figures, and what this edge counted since it was read
                keys = _top([*keys, *_since(self._by_key, keys_then)])
                models = _top([*models, *_since(self._by_model, models_then)])
            return Usage(round(now, 3), "ledger", minutes, keys, models)  # type: ignore[arg-type]
        keys = _top(UsageRow(k, *v) for k, v in self._by_key.items())
        models = _top(UsageRow(k, *v) for k, v in self._by_model.items())
        return Usage(round(now, 3), "memory", minutes, keys, models)  # type: ignore[arg-type]

    # -- the event stream --------------------------------------------------------------

    def subscribe(self) -> _Subscriber | None:
        if self.closed or len(self._subscribers) >= MAX_SUBSCRIBERS:
            return None
        sub = _Subscriber()
        self._subscribers.add(sub)
        self._subscribed.unpark_all()
        return sub

    def unsubscribe(self, sub: _Subscriber) -> None:
        self._subscribers.discard(sub)

    def close(self) -> None:
        """The edge has drained: every console gets a last snapshot and its
        stream ends (an open one would hold the server's shutdown for its
        whole grace period); no new one is taken."""
        self.closed = True
        snapshot = b"event: snapshot\ndata: " + _encode(self.snapshot()) + b"\n\n"
        for sub in self._subscribers:
            sub.snapshot = snapshot
            sub.closed = True
            sub.lot.unpark_all()

    async def run(self) -> None:
        """Publishes while anyone is subscribed (the app runs it in the background). The ledger
        is read in a task of its own, its usage event published when it is done: read inline,
        a PostgreSQL day of 5 million rows held every console's snapshots 1.5-2.2 s each time
        (found from outside)."""
        async with trio.open_nursery() as nursery:
            await self._publish(nursery)

    def _send_usage(self, subscribers: list[_Subscriber]) -> None:
        usage = b"event: usage\ndata: " + _encode(self._usage_now()) + b"\n\n"
        for sub in subscribers:
            sub.usage = usage
            sub.fresh = False
            sub.lot.unpark_all()

    async def _publish(self, nursery: trio.Nursery) -> None:
        usage_due = usage_sent = 0.0
        reading = False

        async def read(started: float) -> None:
            nonlocal usage_due, usage_sent, reading
            try:
                await self._read_ledger(True)
                took = trio.current_time() - started
                usage_due = started + max(USAGE_EVERY_S, took / LEDGER_SHARE)
                usage_sent = trio.current_time()
                self._usage_changed = False
                self._send_usage(list(self._subscribers))
            finally:
                reading = False

        while True:
            while not self._subscribers:
                await self._subscribed.park()
            now = trio.current_time()
            for sub in list(self._subscribers):
                if sub.snapshot is not None and now - sub.taken > STALE_S:
                    # Its last events are still there: its client stopped reading (a dead tab
                    # behind a proxy, a stuck socket). Its place goes to the next console.
                    log.warning("console dropped: not reading", stalled_s=round(now - sub.taken, 1))
                    self._subscribers.discard(sub)
                    sub.closed = True
                    sub.lot.unpark_all()
            if not self._subscribers:
                continue
            subscribers = list(self._subscribers)
            if now >= usage_due and not reading:
                reading = True
                usage_due = math.inf  # (set when the read is done)
                nursery.start_soon(read, now)
            fresh = any(sub.fresh for sub in subscribers)
            if reading and self._today is None and self.edge.ledger is not None:
                pass  # (the ledger's first read is under way: its usage, not memory's, comes first)
            elif fresh or (self._usage_changed and now - usage_sent >= USAGE_MIN_S):
                self._usage_changed = False
                usage_sent = now
                self._send_usage(subscribers)  # (today's totals as the ledger last said)
            started = time.perf_counter()
            snapshot = b"event: snapshot\ndata: " + _encode(self.snapshot()) + b"\n\n"
            for sub in subscribers:
                sub.snapshot = snapshot
                sub.lot.unpark_all()
            # A large fleet's snapshot costs the event loop more: they come less often, so that
            # making them takes at most SNAPSHOT_LOOP_SHARE of it (301 nodes of 41 models: 1.47 MB
            # 4 times a second, /healthz p99 19-26 -> 84-90 ms with one console: an outside audit).
            await trio.sleep(max(SNAPSHOT_EVERY_S, (time.perf_counter() - started) / SNAPSHOT_LOOP_SHARE))


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` takes gzip (not with ``q=0``)."""
    for part in accept_encoding.lower().split(","):
        coding, *params = part.split(";")
        if coding.strip() in ("gzip", "x-gzip"):
            for param in params:
                name, _, value = param.partition("=")
                if name.strip() == "q":
                    try:
                        return float(value) > 0
                    except ValueError:
                        return False
            return True
    return False


def console_routes(app: QuartTrio, edge: Edge) -> None:
    console = edge.console
    refused = partial(admin_refusal, edge)

    static = resources.files("edge") / "static"
    pages = {
        "console.js": "text/javascript; charset=utf-8",
        "console.css": "text/css; charset=utf-8",
    }

    @app.get("/console")
    @app.get("/console/")
    async def page() -> Response:
        body = (static / "console.html").read_bytes()
        return Response(body, 200, content_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    @app.get("/console/<name>")
    async def asset(name: str) -> Response:
        kind = pages.get(name)
        if kind is None:
            return error_response(404, "Unknown route.", "not_found")
        return Response((static / name).read_bytes(), 200, content_type=kind, headers=_PAGE_HEADERS)

    @app.get("/v1/admin/events")
    async def events() -> Response | tuple:
        problem = refused()
        if problem is not None:
            return problem
        if console.closed:
            return error_response(503, "The edge is shutting down.", "draining", "service_unavailable_error")
        sub = console.subscribe()
        if sub is None:
            return error_response(
                429, f"At most {MAX_SUBSCRIBERS} consoles at once.", "too_many_consoles", "rate_limit_error"
            )

        gzipped = accepts_gzip(request.headers.get("accept-encoding", ""))

        async def stream():
            packer = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31) if gzipped else None
            try:
                events: bytes | None = b": iop console events\n\n"
                while events is not None:
                    # (gzipped: each piece flushed, so the browser has every event as it is sent)
                    yield events if packer is None else packer.compress(events) + packer.flush(zlib.Z_SYNC_FLUSH)
                    events = await sub.next()
                if packer is not None:
                    yield packer.flush()  # (the stream's end: gzip's trailer)
            finally:
                console.unsubscribe(sub)

        response = Response(stream(), 200, content_type="text/event-stream")
        response.headers["vary"] = "accept-encoding"
        if gzipped:
            response.headers["content-encoding"] = "gzip"
        response.headers["cache-control"] = "no-cache"
        response.headers["x-accel-buffering"] = "no"
        response.timeout = None
        return response

    @app.get("/v1/admin/runs")
    async def list_runs() -> Response:
        problem = refused()
        if problem is not None:
            return problem
        views, phases = console.run_views(limit=10_000)
        return json_response(200, {"object": "list", "phases": phases, "data": views})

    @app.post("/v1/admin/runs/<run_id>/cancel")
    async def cancel(run_id: str) -> Response:
        problem = refused()
        if problem is not None:
            return problem
        if not console.cancel(run_id):
            return error_response(404, f"No run {run_id[:64]!r} in flight.", "run_not_found")
        return json_response(200, {"id": run_id, "cancelled": True})


# The page runs only its own files, and no other site may frame it.
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}
