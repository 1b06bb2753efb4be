"""The websocket endpoint nodes dial into: ``GET /v1/node/link``.

The node's token is checked on the upgrade request, before any frame is
read. Then: ``hello`` (version and node id checked), ``welcome``, and five
tasks in the link's nursery: the reader (this task), the sender (drains the
link's outbox; the only writer), the pinger (declares the node dead when it
falls silent: the only way a live link dies), the stall watch (routes
around a node whose runs do not start) and the demand reporter (tells the
node this edge's in-flight and queue depth per model, so that the node's
grants follow them). Whatever ends the link, its
unstarted runs move to other nodes and the rest fail at once with "node
disconnected"."""

from __future__ import annotations

import math
from collections.abc import Callable
from time import perf_counter

import msgspec
import structlog
import trio

from edge.auth import bearer_matches
from edge.config import MIN_FRAME_BYTES, EdgeConfig
from edge.errors import error_json
from edge.frame_limit import EVENT_SIZE, LinkHold, charge, link_clock, may_dial
from edge.runs import NodeLink, RunService
from edge.runs.link import CLOSE_POLICY, CLOSE_PROTOCOL, StrayFlood
from edge.runs.run import TEXT_TYPES
from edge.runs.service import stall_after_s
from edge.ws import RawWebsocket
from proto import (
    CLOSE_DUPLICATE,
    PROTOCOL_VERSION,
    Demand,
    Events,
    Frame,
    Grant,
    Hello,
    Load,
    Ping,
    Placed,
    Pong,
    RunEvent,
    RunRequest,
    TunnelFrame,
    TunnelRequest,
    Welcome,
    decode_frame,
    encode_frame,
)
from proto.frames import EARLY_PROGRESS_PARTS, MAX_MODEL_NAME, MAX_NODE_ID, TERMINAL_TYPES, name_problem

MAX_ADAPTER = 64  # characters of a model's adapter in a hello ("openai", "sim")
MAX_TARGET = 1024  # characters of its target (the model server's own name for it)

log = structlog.get_logger("iop.edge.link")

NODE_ID_HEADER = "X-Iop-Node-Id"

CLOSE_AUTH = 4001
CLOSE_VERSION = 4002
CLOSE_TRY_AGAIN = 1013  # RFC 6455: try again later

# Nodes linked to one edge at most: 400 links of one shared token, of 1,024 models each, held the
# event loop up to 1.3 s and, leaving at once, timed out an honest node's link (outside audit).
MAX_LINKS = 512
# Models of all linked nodes together (a node and a model counted once per pair): each is in
# every console snapshot and /v1/nodes. 100 links of 1,024 models of long names made a console
# snapshot 67 MB, once a second (outside audit).
MAX_LINKED_MODELS = 16384
# Links with a valid token that have not sent their hello yet, at once: 4 dialers held 4,097 such
# connections open (their descriptors) until the hello timeout (outside audit). Past it, a 503.
# Counted per credential: the shared node_token's links together, and each node_tokens id's
# apart (a node's own token held the 64 and no other node could link: an outside re-audit).
MAX_PENDING_HELLOS = 64
MAX_PENDING_HELLOS_PER_NODE = 4  # ... of one node id with a token of its own

MAX_BATCH_FRAMES = 64  # frames to a node taken at once by its writer (they go out in one write when they can)
MAX_BATCH_BYTES = 256 * 1024  # ... and written once this many bytes are encoded
DEMAND_INTERVAL_S = 0.02  # demand reports to one node are coalesced: at most one per model this often


class LinkProtocolError(Exception):
    """The node broke the protocol; the link is closed with code 4003."""


_SHARED = ""  # authenticated with the shared node_token: any node id without a token of its own


def _hello_problem(hello: Hello) -> str:
    """Why a hello's names cannot be linked ("" if they can): every id and name
    is shown in the console, logs and metrics, and the models of every node
    are in each console snapshot."""
    problem = name_problem(hello.node_id, MAX_NODE_ID)
    if problem:
        return f"node_id {problem}"
    for info in hello.models:
        problem = name_problem(info.name, MAX_MODEL_NAME)
        if problem:
            return f"a model name {problem}"
        # Shown as they come in /v1/nodes and every console snapshot (a 15 MB adapter was
        # 112 MB/s to two consoles): bounded, as names are.
        if len(info.adapter) > MAX_ADAPTER or len(info.target) > MAX_TARGET:
            return f"a model's adapter or target is longer than {MAX_ADAPTER} or {MAX_TARGET} characters"
    return ""


def _authenticate(config: EdgeConfig, node_id: str, header: str) -> str | None:
    """Which node ids this upgrade may link as: ``node_id`` when it presented
    that id's own token (``node_tokens``), :data:`_SHARED` for the shared
    ``node_token``, None when refused. An id that has its own token can link
    with that token only."""
    if node_id in config.node_tokens:
        return node_id if bearer_matches(header, [config.node_tokens[node_id]]) else None
    return _SHARED if bearer_matches(header, [config.node_token]) else None


def _refused(service: RunService, what: str, node_id: str, peer: str | None = None) -> None:
    """Log an upgrade refused before its hello at most once a second per ``what``, with how
    many since the last line (this one included) and this one's node id and peer: 300 dials
    with a wrong token in 0.5 s wrote 300 lines, and no credential is needed for that (an
    outside re-audit)."""
    counted = service.link_refusals.setdefault(what, [0, -math.inf])
    counted[0] += 1
    now = trio.current_time()
    if now - counted[1] >= 1.0:
        log.warning(what, node_id=node_id[:MAX_NODE_ID] or None, peer=peer, refused=counted[0])  # (the id: bounded)
        counted[0], counted[1] = 0, now


def _no_room(service: RunService, hello: Hello, own_token: bool) -> tuple[int, str] | None:
    """Why the edge cannot link ``hello``'s node now, as a close code and reason (logged), or None.
    A node with a token of its own (``node_tokens``) is not held to the caps: they bound what
    holders of the shared token can link, and 512 links of it kept such a node out (found from
    outside); those nodes are as many as the operator named."""
    if hello.node_id in service.links:
        log.warning("node link refused: already linked", node_id=hello.node_id)
        return CLOSE_DUPLICATE, "node id already linked"
    if own_token:
        return None
    if len(service.links) >= MAX_LINKS:
        log.warning("node link refused: the edge has its most nodes", node_id=hello.node_id, linked=len(service.links))
        return CLOSE_TRY_AGAIN, f"this edge links {MAX_LINKS} nodes at most"
    linked_models = sum(len(lk.models) for lk in service.links.values())
    if linked_models + len(hello.models) > MAX_LINKED_MODELS:
        log.warning(
            "node link refused: the edge serves its most models",
            node_id=hello.node_id,
            models=len(hello.models),
            linked_models=linked_models,
        )
        return CLOSE_TRY_AGAIN, f"this edge serves {MAX_LINKED_MODELS} models of its nodes at most"
    return None


async def node_link(config: EdgeConfig, service: RunService, edge_id: str, websocket: RawWebsocket) -> None:
    node_id = websocket.header(NODE_ID_HEADER)
    identity = _authenticate(config, node_id, websocket.header("Authorization"))
    if identity is None:
        if not (config.node_token or node_id in config.node_tokens):
            # (no token this node could send would do: a newcomer read "invalid node token" and
            # changed the node's, while the edge had none set)
            if config.node_tokens:  # (an id it has no token for: "has no node_token" sent a newcomer
                # to the edge's config, where the node's id was the mistake)
                _refused(service, "node link refused: no token for this node id", node_id, websocket.peer)
                message = (
                    "this edge has no token for this node id (its node_tokens name other ids, and it has no"
                    " shared node_token): check the node's node_id"
                )
                code = "unknown_node_id"
            else:
                _refused(service, "node link refused: this edge has no node_token", node_id, websocket.peer)
                message = "this edge has no node_token configured (nor a node_tokens entry for this node id): set one"
                code = "no_node_token"
            await websocket.refuse(401, error_json(message, "authentication_error", code=code))
            return None
        _refused(service, "node link refused: bad token", node_id, websocket.peer)
        await websocket.refuse(401, error_json("invalid node token", "authentication_error"))
        return None
    if service.closing_links:  # (the drain closed the links with 1001: its node's redial waits for another edge)
        await websocket.refuse(503, error_json("the edge is shutting down; retry", "server_error", code="draining"))
        return None
    if not may_dial(websocket.peer):
        _refused(service, "node link refused: too many links dialled from one address", node_id, websocket.peer)
        await websocket.refuse(503, error_json("too many node links dialled from this address; retry", "server_error"))
        return None
    pending = service.pending_hellos
    if pending[identity] >= (MAX_PENDING_HELLOS if identity == _SHARED else MAX_PENDING_HELLOS_PER_NODE):
        _refused(service, "node link refused: too many links opening at once", node_id, websocket.peer)
        await websocket.refuse(503, error_json("too many node links opening at once; retry", "server_error"))
        return None
    pending[identity] += 1
    try:
        await websocket.accept()
        with trio.fail_after(config.hello_timeout_s):
            data = await websocket.receive()
        started = link_clock()  # (the hello's handling is the peer's time: a link dialled anew is no way around it)
        hello = decode_frame(data)
        del data
    except msgspec.ValidationError as e:  # a hello past a bound (1,024 models) names it
        await websocket.close(CLOSE_PROTOCOL, f"invalid hello: {e}".encode()[:120].decode(errors="ignore"))
        return None
    except (trio.TooSlowError, msgspec.DecodeError, TypeError, RecursionError):
        await websocket.close(CLOSE_PROTOCOL, "expected a hello frame")
        return None
    finally:
        pending[identity] -= 1
        if not pending[identity]:
            del pending[identity]
    if not isinstance(hello, Hello):
        await websocket.close(CLOSE_PROTOCOL, "expected a hello frame")
        return None
    if hello.protocol != PROTOCOL_VERSION:
        reason = f"protocol version mismatch: edge speaks {PROTOCOL_VERSION}, node speaks {hello.protocol}"
        log.warning("node link refused", node_id=hello.node_id[:MAX_NODE_ID], reason=reason)
        await websocket.close(CLOSE_VERSION, reason)
        return None
    problem = _hello_problem(hello)
    if problem:
        log.warning("node link refused", node_id=hello.node_id[:MAX_NODE_ID], reason=problem)
        await websocket.close(CLOSE_PROTOCOL, problem[:120])  # a close reason fits 123 bytes
        return None
    if node_id and hello.node_id != node_id:
        # an authentication failure like the one below (README: 4001): the token was for another id
        log.warning("node link refused: the hello's id is not the one authenticated", node_id=node_id)
        await websocket.close(CLOSE_AUTH, "hello node_id differs from the upgrade's node id")
        return None
    if identity == _SHARED and hello.node_id in config.node_tokens:
        log.warning("node link refused: the shared token used for an id with its own token", node_id=hello.node_id)
        await websocket.close(CLOSE_AUTH, "this node id has its own token; link with it")
        return None
    may_serve = config.node_may_serve(hello.node_id)
    if may_serve is not None:
        refused = [info.name for info in hello.models if not may_serve.fullmatch(info.name)]
        if refused:
            log.warning(
                "node advertises models it may not serve (node_models): left out",
                node_id=hello.node_id,
                models=refused[:16],
                model_count=len(refused),
            )
            hello.models = [info for info in hello.models if may_serve.fullmatch(info.name)]
            if not hello.models:
                await websocket.close(CLOSE_AUTH, "node_models: this node may serve none of its models")
                return None
    refusal = _no_room(service, hello, identity != _SHARED)
    if refusal is not None:
        await websocket.close(*refusal)
        return None
    capped = []
    for info in hello.models:
        if info.max_concurrency < 1:
            await websocket.close(CLOSE_PROTOCOL, f"model {info.name}: max_concurrency must be >= 1")
            return None
        if info.context_window < 0:  # (-1 was linked, and its model then fit no request)
            await websocket.close(CLOSE_PROTOCOL, f"model {info.name}: context_window must be >= 0")
            return None
        if info.max_concurrency > config.max_node_concurrency:
            capped.append(info.name)
            info.max_concurrency = config.max_node_concurrency
    if capped:  # (one line a hello, not one a model)
        log.warning(
            "node advertises more capacity than the edge allows: capped",
            node_id=hello.node_id,
            models=capped[:16],
            model_count=len(capped),
            cap=config.max_node_concurrency,
        )

    link = NodeLink(hello.node_id, hello.models, grants={})  # the node's grants follow
    link.relays_prefixes = hello.relays_prefixes
    link.holds_tunnels = hello.holds_tunnels
    link.answers_cancels = hello.answers_cancels
    link.hold = websocket.hold
    # A node's frame limit below the edge's (0: not said, an older node): runs larger than it go to
    # other nodes or are a 413, where the node closed its link on them (1009) and, failed over, the
    # next node's too. Never below MIN_FRAME_BYTES: a node saying less gets that much.
    said = hello.max_frame_bytes
    link.frame_limit = config.max_frame_bytes if said <= 0 else min(max(said, MIN_FRAME_BYTES), config.max_frame_bytes)
    held = link_clock() - started
    await websocket.send(
        encode_frame(
            Welcome(
                edge_id=edge_id,
                protocol=PROTOCOL_VERSION,
                ping_interval_s=config.ping_interval_s,
                max_frame_bytes=config.max_frame_bytes,
                wants_prefixes=config.routing == "prefix",
                progress_parts=EARLY_PROGRESS_PARTS,
            )
        )
    )
    if wait := charge(websocket.hold, held):
        await trio.sleep(wait)
    # Again: other links may have come in while the welcome went out (of this id, or hellos sent
    # together, 94 links of 1,024 models past MAX_LINKED_MODELS: an outside re-audit).
    refusal = _no_room(service, hello, identity != _SHARED)
    if refusal is not None:
        await websocket.close(*refusal)
        return None
    link.write_now = _writer_now(websocket, link.frame_limit)
    service.add_link(link)  # at once after the check: no other link can come between
    try:
        async with trio.open_nursery() as nursery:
            link.bind_scope(nursery.cancel_scope)
            nursery.start_soon(_send_frames, link, service, link.frame_limit, websocket)
            nursery.start_soon(_ping, link, config, websocket.hold)
            nursery.start_soon(_watch_stall, link, service, config)
            nursery.start_soon(_report_demand, link, service)
            await _read_frames(link, service, websocket)
            nursery.cancel_scope.cancel()
    except* LinkProtocolError as group:
        e = group.exceptions[0]
        link.close_reason, link.close_code = str(e), CLOSE_PROTOCOL
        log.warning("node broke the link protocol", node_id=link.node_id, error=str(e))
    except* StrayFlood as group:
        e = group.exceptions[0]
        link.close_reason, link.close_code = str(e), CLOSE_POLICY
        log.warning(
            "node flooded its link with events that bring nothing: link closed", node_id=link.node_id, error=str(e)
        )
    finally:
        service.remove_link(link)
        link.close_outbox()
    if link.close_reason:
        with trio.move_on_after(1):
            await websocket.close(link.close_code, link.close_reason[:120])
    return None


def joined(events: list[RunEvent], runs: dict) -> list[RunEvent]:
    """A frame's ``events`` with each live run's consecutive text deltas of one kind
    joined into one event (the runs' own order kept; other runs' events between two of
    them do not part them). An honest node already sends a run's text read together as
    one delta; a node that sent 8,192 one-character deltas a frame made each of them
    an event queued for its run and scanned, joined and freed by the run's writer task,
    a quarter of the edge's time that its link's share never charged (``/healthz`` p50
    60-95 ms beside it: an outside audit). Joined here, in the link's time, they are one.
    A delta without text, or of a run not on the link or ended, is left as it is (a stray:
    joined, 8,191 deltas after a run's end counted as one, and no longer closed a flooding
    link; a re-check)."""
    out: list[RunEvent] = []
    last: dict[str, int] = {}  # run id -> where in ``out`` its latest event is, while that is text
    groups: dict[int, list[RunEvent]] = {}  # where in ``out`` -> the deltas joined there
    ended: set[str] = set()  # runs whose end came earlier in this frame
    for event in events:
        run_id = event.run_id
        if (
            event.type in TEXT_TYPES
            and event.text
            and (run := runs.get(run_id)) is not None
            and not run.finished
            and run_id not in ended
        ):
            at = last.get(run_id)
            if at is not None and out[at].type == event.type:
                group = groups.get(at)
                if group is None:
                    group = groups[at] = [out[at]]
                group.append(event)
                continue
            last[run_id] = len(out)
        else:
            last.pop(run_id, None)
            if event.type in TERMINAL_TYPES:
                ended.add(run_id)
        out.append(event)
    for at, group in groups.items():
        first = group[0]
        out[at] = RunEvent(
            run_id=first.run_id,
            seq=group[-1].seq,
            type=first.type,
            text="".join([event.text for event in group]),
            parts=sum([1 if event.parts <= 1 else min(event.parts, len(event.text)) for event in group]),
        )
    return out


async def _read_frames(link: NodeLink, service: RunService, websocket: RawWebsocket) -> None:
    """Every frame from the node, each handled as it arrives (under hypercorn,
    in its reader task: :meth:`RawWebsocket.read_into`). Ends by raising:
    :class:`LinkProtocolError`, or LinkGone when the node leaves."""

    def on_message(data: bytes | str) -> None:
        link.last_rx = now = trio.current_time()
        if not isinstance(data, bytes):
            raise LinkProtocolError("text message on the link")
        try:
            frame = decode_frame(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise LinkProtocolError(f"undecodable frame: {e}") from None
        except RecursionError:  # (msgspec's, past ~1,000 levels of nesting: not a DecodeError)
            raise LinkProtocolError("undecodable frame: nested too deep") from None
        match frame:
            case Events(events=events):
                # (what serving the runs took is timed by the wall clock: the link's own time, by
                # the thread's CPU clock, is 0.6 µs a reading on this machine, and two a frame were
                # a seventh of the edge's CPU at 200 streams; a wall clock errs, if ever, by time
                # the process was not running, here taken off the link's charge, never added)
                started, strays = perf_counter(), link.strays
                runs = link.runs
                count = len(events)
                if count > 1 and len({event.run_id for event in events}) < count:
                    events = joined(events, runs)
                # The exemption's measure: what the node sent, in events or, for large ones, in
                # EVENT_SIZE bytes (deltas of 960 bytes of think tags, 10,000 a second, a quarter of
                # the pace, cost the runs' writers 50 µs each, uncharged: a re-check).
                count = max(count, len(data) // EVENT_SIZE)
                for event in events:
                    run = runs.get(event.run_id)
                    if run is not None:
                        if type(run.request) is TunnelRequest:
                            raise LinkProtocolError("events frame for a passthrough run")
                        run.deliver(event, now)
                    else:
                        # A run that ended here (cancelled: the node had not heard yet). Not a
                        # protocol error even when it ended long ago: a node behind on 4,096 and
                        # more cancels (a burst of HTTP/2 resets) was not lying, and its link
                        # (every run on it) was dropped for it. A flood of them closes the link
                        # (NodeLink.stray). A run of another node is never in `runs`.
                        link.stray(now)
                # (a frame with events that bring nothing is the node's time, all of it; so is one past any
                # model server's pace)
                if link.strays == strays and websocket.hold.exempts(count, len(runs), now):
                    websocket.hold.served += perf_counter() - started
            case Pong():
                pass
            case Ping(ts=ts):
                link.send_nowait(Pong(ts=ts))
            case Grant(model=model, slots=slots, seq=seq, freed=freed):
                service.set_grant(link, model, slots, seq)
                if freed:
                    service.freed(link, freed)
            case Load(draining=draining, engine=engine):
                if engine:
                    link.set_engine(engine)
                if draining != link.draining:
                    service.set_draining(link, draining)
            case Placed(model=model, prefix=prefix):
                if not link.relays_prefixes:  # its hello did not say it relays: it may not place
                    raise LinkProtocolError("placed frame from a node whose hello did not set relays_prefixes")
                if model not in link.models:
                    raise LinkProtocolError(f"placed frame for model {model!r} the node does not serve")
                if link.admit_placed(len(prefix), now):
                    service.placed_elsewhere(link, prefix)
            case TunnelFrame(run_id=run_id):
                run = link.runs.get(run_id)
                if run is not None:
                    if type(run.request) is not TunnelRequest:  # (a chat run's consumers read events only)
                        raise LinkProtocolError("tunnel_frame for a run that is not a passthrough")
                    started = perf_counter()
                    run.deliver_frame(frame, now)
                    websocket.hold.served += perf_counter() - started
                else:  # a tunnel that ended here (as for events, above)
                    link.stray(now)
            case _:
                raise LinkProtocolError(f"unexpected {type(frame).__name__} frame from a node")

    await websocket.read_into(on_message)


def _writer_now(websocket: RawWebsocket, max_frame_bytes: int) -> Callable[[Frame], bytes | None]:
    """:attr:`NodeLink.write_now`: one frame straight to the socket (None when
    it cannot go that way, or is not sendable: the writer then deals with it)."""

    def write_now(frame: Frame) -> bytes | None:
        try:
            data = encode_frame(frame)
        except (OverflowError, msgspec.EncodeError, RecursionError, TypeError, ValueError):
            return None
        if len(data) > max_frame_bytes:
            return None
        return websocket.write_now(data)

    return write_now


async def _send_frames(link: NodeLink, service: RunService, max_frame_bytes: int, websocket: RawWebsocket) -> None:
    """The writer to the websocket: every frame that had to wait (the others
    go out at once, :meth:`NodeLink.send_nowait`). A frame that cannot be
    encoded or is over the frame limit fails its own run, never the link."""
    while True:
        frames = await link.next_frames(MAX_BATCH_FRAMES)
        rest = link.take_rest()
        if rest:
            await websocket.send_rest(rest)
        batch: list[bytes] = []
        size = 0
        for frame in frames:
            try:
                data = encode_frame(frame)
            except (OverflowError, msgspec.EncodeError, RecursionError, TypeError, ValueError) as e:
                problem = f"cannot encode it ({type(e).__name__})"
            else:
                if len(data) <= max_frame_bytes:
                    batch.append(data)
                    size += len(data)
                    if size >= MAX_BATCH_BYTES:
                        await websocket.send_many(batch)
                        batch, size = [], 0
                    continue
                problem = f"{len(data)} bytes, over the {max_frame_bytes}-byte frame limit"
            if isinstance(frame, (RunRequest, TunnelRequest)):
                service.unsendable(link, frame, problem)
            else:
                log.error(
                    "frame to a node not sendable", node_id=link.node_id, frame=type(frame).__name__, problem=problem
                )
        if batch:
            await websocket.send_many(batch)


async def _ping(link: NodeLink, config: EdgeConfig, hold: LinkHold) -> None:
    """A ping every ``ping_interval_s``, and the link killed once the node has been silent for
    ``ping_timeout_s``: at that moment, not at the next ping (up to an interval later: 17.8 s
    for the README's 15 with the defaults). A link waiting for its part of the edge's time
    (``hold``: its bytes are here, unread) is not silent until the wait ends."""
    interval, timeout = config.ping_interval_s, config.ping_timeout_s
    next_ping = trio.current_time() + interval
    while True:
        await trio.sleep_until(min(next_ping, max(link.last_rx, hold.until) + timeout))
        now = trio.current_time()
        if now - max(link.last_rx, hold.until) >= timeout:
            link.kill(f"no frame from the node for {timeout:g} s", code=1011)
            return
        if now >= next_ping:
            link.send_nowait(Ping(ts=now))
            next_ping = now + interval


async def _report_demand(link: NodeLink, service: RunService) -> None:
    """Tell the node, per model, this edge's runs on it, the model's queue
    depth here and the last grant applied, whenever one of them changes: at
    once after a quiet spell, then at most every DEMAND_INTERVAL_S. A report
    still waiting to go out (the node reads slowly) is not piled on."""
    sent: dict[str, tuple[int, int, int]] = {}
    while True:
        if link.demands_queued:
            await trio.sleep(DEMAND_INTERVAL_S)
            continue
        changed = False
        for model in link.models:
            state = (link.in_flight[model], service.waiting_for(model, link.node_id), link.grant_seq[model])
            if sent.get(model) != state:
                sent[model] = state
                link.send_nowait(Demand(model=model, in_flight=state[0], waiting=state[1], seq=state[2]))
                changed = True
        if changed:
            await trio.sleep(DEMAND_INTERVAL_S)
        else:
            await service.demand_changed.park()


async def _watch_stall(link: NodeLink, service: RunService, config: EdgeConfig) -> None:
    """Every so often: is this node starting the runs it was sent?"""
    every = min(1.0, stall_after_s(config) / 4)
    while True:
        asleep = trio.current_time()
        await trio.sleep(every)
        if trio.current_time() - asleep < 2 * every:  # (woke late: the edge's loop stood still, and the
            service.check_stall(link)  # events waiting in the sockets are not read yet: every run looked silent)
