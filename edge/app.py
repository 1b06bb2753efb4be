"""The edge application: ``create_app()`` for hypercorn, ``serve_edge`` for ``iop``.

IOP_EDGE_CONFIG=edge.toml hypercorn --worker-class trio --bind 127.0.0.1:8080 --backlog 4096 'edge.app:create_app()'

(hypercorn's CLI takes its own --bind, --backlog and TLS flags; it does not read those from edge.toml.)
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import sqlite3
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial

import msgspec
import structlog
import trio
from quart import Response
from quart_trio import QuartTrio

from edge.admin import admin_key_refused, admin_routes, is_admin
from edge.anthropic.codec import error_body as anthropic_error_body
from edge.app_queue import install as install_app_queue
from edge.auth import client_token
from edge.config import EdgeConfig, load_edge_config
from edge.connection import close as close_connections
from edge.connection import install as install_connection_guard
from edge.connection import stuck as stuck_connections
from edge.console import Console, console_routes
from edge.cors import Cors
from edge.errors import APIError, bad_request, draining, error_json, final_headers, model_not_found
from edge.forwarded import TrustedProxies, parse_networks
from edge.frame_limit import install as install_frame_limit
from edge.h2_streams import install as install_h2_streams
from edge.keepalive import install as install_keepalive
from edge.keys import Key, Keys, Policy
from edge.ledger import Ledger, is_postgres
from edge.link import node_link
from edge.metrics import CONTENT_TYPE, EdgeMetrics
from edge.openai.exchange import Exchange, LargeRequests
from edge.openai.items import ResponseItems
from edge.openai.routes import ROUTES, is_admin_path, openai_routes
from edge.openai.schema import ModelCard, ModelList
from edge.openai.shaping import TemplateThink
from edge.reads import install as install_reads
from edge.runs import NodeLink, RunService
from edge.runs.run import SHUTDOWN
from edge.send_lock import install as install_send_lock
from edge.shared_state import BORROW_S, SharedState
from edge.ws import link_route
from iop import logs
from iop.configfile import ConfigError
from iop.drain import within_grace
from iop.limits import more_open_files

log = structlog.get_logger("iop.edge")
# The routes as a client's base URL would end them (/chat/completions): a path under /v1 ending with
# one that is not one (/v1/chat/completions/chat/completions) had a base URL of the whole endpoint.
_ROUTE_TAILS = (*(path[3:] for path in ROUTES), "/models")


_encode = msgspec.json.Encoder().encode


class Edge:
    """Everything one edge process holds: config, run service, identity."""

    def __init__(self, config: EdgeConfig) -> None:
        self.config = config
        self.id = secrets.token_hex(6)
        self.runs = RunService(config)
        self.keys = Keys(config)
        target = config.ledger_target
        try:
            self.ledger = Ledger(target, config.state_dir, config.ledger_retention_days) if target else None
        except (sqlite3.Error, OSError) as e:
            raise ConfigError(
                f'ledger: cannot open {target}: {e} (set state_dir, a ledger path, or ledger = "off")'
            ) from None
        # A key id's day is one budget, whoever holds its secret: a key revoked today is kept
        # here by id, and one made again with its id goes on from its counters (make_key).
        self.retired: dict[str, Key] = {}
        self._unreadable_keys: set[tuple[str, str]] = set()  # (id, policy) rows logged as unreadable
        self._shadowed_keys: set[tuple[str, str]] = set()  # (id, sha256) of stored keys a config key shadows, logged
        self.day_at_start: tuple[int, dict[str, int]] = (0, {})  # the ledger's tokens today per id, at start
        if self.ledger is not None:
            state = self.ledger.startup_state()
            if state is None:
                # Its keys unknown, the edge asks every client for a key until it has read them (it
                # served requests with none while PostgreSQL was down: an outside re-audit).
                self.keys.unread = True
                log.warning("the ledger cannot be read: clients need a key until its keys are read")
                state = ([], False, {})
            rows, stored, today = state
            self.day_at_start = (int(time.time() // 86400), today)
            if not self.keys.unread:
                self.apply_stored_keys(rows, stored)
            self.ledger.on_keys = self.apply_stored_keys
            self.ledger.open = lambda: self.keys.open
            self.ledger.unkeyed = lambda: not self.keys.ever
            for key_id, used in today.items():
                key = self.keys.by_id.get(key_id)
                if key is not None:  # (restored: what shared state may find in Redis already)
                    key.day, key.day_used, key.restored = int(time.time() // 86400), used, used
        shared_ledger = self.ledger is not None and is_postgres(target)  # (every edge's rows: a day's floor)
        day_totals = self.ledger.day_totals if shared_ledger else None
        self.shared = SharedState(config.state, self.keys, self.id, day_totals) if config.state else None
        self.metrics = EdgeMetrics(self.runs, self)
        self.template_think = TemplateThink()  # models whose chat template opens <think> (live think tags)
        self.response_items = ResponseItems()  # the Responses API's recent output items (item_reference)
        self.cors = Cors(config.cors_origins) if config.cors_origins else None  # browsers from other origins
        nets = parse_networks(config.trusted_proxies)
        self.proxies = TrustedProxies(nets) if nets else None  # X-Forwarded-For names the client behind them
        self.console = Console(self)
        self.draining = False
        self.open_served = False  # an open edge's first request was looked at (is_loopback)
        self.hurry = trio.Event()  # a second signal: end the drain's grace now
        self.handling = 0  # API requests whose handler runs (edge.openai.routes)
        self.large_requests = LargeRequests(config.max_large_requests)  # (bodies of 1 MiB or more, in flight)
        self.handled = trio.lowlevel.ParkingLot()  # woken as the last of them ends

    async def quiet(self) -> None:
        """Return once no run is in flight and no API request is being answered: a request
        whose run has ended may still be writing its answer (a drain that ended on its runs
        alone shut down under a non-streamed answer about to go out: the client got a reset)."""
        await self.runs.wait_idle()
        while self.handling:
            await self.handled.park()

    async def drain(self) -> None:
        """Stop taking requests, let running ones finish within the grace
        period, then end the rest cleanly (an SSE error and ``[DONE]``) and
        close the node links with 1001."""
        self.draining = True
        grace_end = trio.current_time() + self.config.drain_grace_s
        log.info("draining", in_flight=self.runs.in_flight, grace_s=self.config.drain_grace_s)
        # Queued requests end now, as new ones do: given a slot during the grace, they would
        # start work on a node only to be cut when it ends.
        self.runs.refuse_waiting(draining, "the edge is shutting down")
        await within_grace(self.config.drain_grace_s, self.quiet, self.hurry)
        for run in list(self.runs.runs.values()):
            run.fail("the edge is shutting down", SHUTDOWN)
        with trio.move_on_after(2):
            await self.runs.wait_idle()
        self.runs.closing_links = True  # (a node's redial was taken, then cut with 1011 at the exit)
        for link in list(self.runs.links.values()):
            link.kill("edge shutting down", code=1001)
        self.console.close()
        with trio.move_on_after(1):  # (the links' close frames go out first; once, at shutdown: polled)
            while self.runs.links:  # noqa: ASYNC110
                await trio.sleep(0.01)

        unstuck = trio.Event()

        async def settle() -> None:
            # Those stuck now, until each is not: a connection that came since (a client asking
            # without pause, refused 503) is not waited for, or the drain took its whole grace.
            waiting = set(stuck_connections(self))
            while waiting:
                await trio.sleep(0.05)
                waiting &= set(stuck_connections(self))
            unstuck.set()

        # A client still taking its answer's last bytes has what is left of the grace. What is
        # still writing then (a client that reads nothing: its write waited for write_timeout_s,
        # 60 s) or still sending its body is stuck: closed, so the edge exits.
        await within_grace(max(grace_end - trio.current_time(), 0), settle, self.hurry)
        left = [] if unstuck.is_set() else stuck_connections(self)  # (not a write that began since)
        if left:
            close_connections(left)
            log.info("drained: closed the connections still stuck", connections=len(left))

    def refuse_request(self, ex: Exchange) -> APIError | None:
        """Authentication and drain checks for the API routes (in that order: a key's request
        refused while the edge drains is the key's, in its ledger, as any other refusal)."""
        if self.keys.open:
            if not self.open_served:  # (the address it came in on: under hypercorn only a request tells)
                self.open_served = True
                server = ex.scope.get("server")
                if server and not is_loopback(str(server[0])):
                    _warn_open(f"{server[0]}:{server[1]}")
            return draining() if self.draining else None
        authorization, x_api_key = ex.header(b"authorization"), ex.header(b"x-api-key")
        key = self.keys.authenticate(authorization, x_api_key)
        if key is None:
            return unauthorized(authorization, x_api_key)
        ex.key = key
        return draining() if self.draining else None

    def apply_stored_keys(self, rows: list[tuple], stored: bool) -> None:
        """Make the run-time keys match the ledger's keys not revoked,
        ``rows`` (another edge may have made, changed or revoked some): a
        run-time key not among them was revoked. ``stored``: the ledger holds
        a key, revoked or not (a revoked key still closes the edge). The
        config's keys win."""
        self.keys.unread = False
        if stored:
            self.keys.ever = True
        live = set()
        for key_id, sha, policy_json in rows:
            live.add(key_id)
            known = self.keys.by_id.get(key_id)
            if known is not None and known.source != "admin":
                if known.sha256 != sha and (key_id, sha) not in self._shadowed_keys:
                    # (its secret refused, and nothing said why: an outside audit)
                    self._shadowed_keys.add((key_id, sha))
                    log.warning(
                        "a run-time key has the id of a key in the config, which wins: its secret is refused",
                        key=key_id,
                    )
                continue
            if known is not None and known.sha256 != sha:  # made again, with a new secret
                self.retire(known)
                known = None
            try:
                policy = msgspec.json.decode(policy_json, type=Policy)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                # A row this edge cannot read (a newer edge's policy field, on shared PostgreSQL):
                # that key is left as it is here, and every other row still applies (one such row
                # ended the ledger's task, and a restart failed: an outside attack).
                if (key_id, policy_json) not in self._unreadable_keys:
                    self._unreadable_keys.add((key_id, policy_json))
                    log.warning("a stored key's policy cannot be read: left as it is", key=key_id, error=str(e)[:200])
                continue
            if known is None:
                self.make_key(key_id, sha, policy)
            elif known.policy != policy:
                self.keys.change(known, policy)
        for key in [k for k in self.keys.by_id.values() if k.source == "admin" and k.id not in live]:
            self.retire(key)

    def retire(self, key: Key) -> None:
        """Revoke ``key`` (its secret works no more), keeping its counters for a key
        made again with its id (:meth:`make_key`)."""
        self.keys.revoke(key)
        today = int(time.time() // 86400)
        for old in [k for k in self.retired.values() if k.day != today and not k.in_flight]:
            del self.retired[old.id]
        self.retired[key.id] = key

    def make_key(self, key_id: str, sha: str, policy: Policy) -> Key:
        """A run-time key (made here, or by another edge and read from the ledger).
        An id's day is one budget: a key revoked and made again (a rotated secret)
        goes on from the revoked one, which its requests in flight still settle
        on; one this edge never held starts from the ledger's tokens of the id
        today, read at start, as a restart restores a key's day. (It started at 0:
        a rotation served a 300-token budget 660, and with shared state added a
        negative amount to the day's counter in Redis.)"""
        key = self.retired.pop(key_id, None)
        if key is not None:
            key.sha256, key.revoked = sha, False
            key.set_policy(policy)
        else:
            key = Key(key_id, sha, policy, "admin")
            day, used = self.day_at_start[0], self.day_at_start[1].get(key_id, 0)
            if used and day == int(time.time() // 86400):
                key.day, key.day_used, key.restored = day, used, used
        self.keys.add(key)
        return key

    async def admit(self, ex: Exchange, model: str, prompt_estimate: int, max_tokens: int | None) -> None:
        """A keyed request's admission (edge.keys): raises 404/429, or holds
        a lease (settled by the access record) and sets its rate-limit headers.
        With shared state, a request this edge's balance cannot cover borrows
        what it lacks from Redis (a bounded wait) and is admitted once more."""
        key = ex.key
        if key is None:
            return
        try:
            try:
                ex.lease = self.keys.admit(key, model, prompt_estimate, max_tokens)
            except APIError as refusal:
                if self.shared is None:
                    raise
                covered = await self.shared.cover(key, refusal, prompt_estimate, max_tokens)
                budget = getattr(refusal, "limit", None) == "reserved"
                if covered:
                    try:
                        ex.lease = self.keys.admit(key, model, prompt_estimate, max_tokens)
                    except APIError as again:
                        # Refused for a slot (its budget passed), then for the budget held in
                        # Redis: what this edge holds of it went down while Redis was asked (a
                        # write not yet answered), not spent. The slot's refusal, to retry in a
                        # second (it was "has used its daily budget" until midnight, which the
                        # SDKs obey, during a Redis stall; found from outside).
                        if getattr(again, "limit", None) == "reserved" and not budget:
                            raise refusal from None
                        raise
                elif covered is None:
                    # Redis failed the budget's or the slot's round trip: judged here, as when it is
                    # down (a stall refused requests "over budget" until midnight, with 10 of 10M
                    # tokens used, and a key's every request for want of a slot, none in flight).
                    ex.lease = self.keys.admit(key, model, prompt_estimate, max_tokens, alone=True)
                elif budget:  # (no answer yet: not "spent until midnight")
                    raise APIError(
                        503,
                        "The key's daily budget could not be checked in time; retry.",
                        "service_unavailable_error",
                        code="budget_unchecked",
                        headers=[(b"retry-after", b"1")],
                    ) from None
                else:
                    raise
        except APIError as e:
            _count_refusal(key, e)
            raise
        ex.extra_headers += self.keys.headers(key)

    async def count_request(self, ex: Exchange) -> None:
        """A keyed request that generates nothing (Messages' ``count_tokens``): one of
        its key's ``rpm`` (a request is a request), or the usual 429; not its tpm,
        daily budget or concurrency, which it uses none of. (It ignored rpm: 20 of 20
        answered on rpm 2, each body up to max_body_bytes for the edge to read.)"""
        key = ex.key
        if key is None:
            return
        if key.policy.rpm:
            if self.keys.shared and key.req_level < 1 and self.shared is not None and self.shared.up:
                with trio.move_on_after(BORROW_S):  # (a leased balance, edge.shared_state: borrow one)
                    await self.shared.borrow(key, 1, 0)
            try:
                self.keys.take_request(key)
            except APIError as e:
                _count_refusal(key, e)
                raise
        ex.extra_headers += self.keys.headers(key)


_LIMIT_LABELS = {"slot": "concurrency", "reserved": "budget"}


def _count_refusal(key: Key, refusal: APIError) -> None:
    """``key``'s refusals by limit (iop_key_rate_limited_total)."""
    limit = getattr(refusal, "limit", None) or ("budget" if refusal.status == 429 else None)
    limit = _LIMIT_LABELS.get(limit, limit)  # (what edge.shared_state could not borrow or read again)
    if limit == "budget" and refusal.code == "rate_limit_exceeded":
        limit = "budget_held"  # (its requests in flight hold the rest: not spent, to retry)
    if limit is not None:
        key.limited[limit] = key.limited.get(limit, 0) + 1


def is_loopback(host: str) -> bool:
    """``127.0.0.1``, ``::1``, ``::ffff:127.0.0.1``, ``localhost`` (any case, a final dot)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host.lower().rstrip(".") == "localhost"
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def _warn_open(address: str) -> None:
    log.warning(
        "EDGE IS OPEN: bound to a non-loopback address with no api_keys; anyone who can reach it can use it",
        bind=address,
    )


NO_KEY = "Missing API key: send one as `Authorization: Bearer <key>` (or `x-api-key: <key>`)."
WRONG_KEY = "Invalid API key: not one this edge accepts (or revoked)."
NOT_BEARER = "The Authorization header holds no Bearer key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)."


def unauthorized(authorization: bytes | str | None, x_api_key: bytes | str | None) -> APIError:
    """The 401 of a request whose key was refused: none sent, or one not accepted (a newcomer
    was told "invalid or missing" either way, and not how to send one). A new error each time:
    one raised again and again grows its traceback, and holds every request it was raised in."""
    if client_token(authorization, x_api_key) is not None:
        message = WRONG_KEY
    elif authorization:  # (`Authorization: sk-...`, or Basic: it was "Missing API key")
        message = NOT_BEARER
    else:
        message = NO_KEY
    return APIError(401, message, "authentication_error", code="invalid_api_key")


def _json(status: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status, content_type="application/json", headers={**final_headers(status), **(headers or {})})


def _models_page(names: list[str], args) -> tuple[list[str], bool] | APIError:
    """The page of ``names`` (sorted) that Anthropic's ``limit``, ``after_id`` and ``before_id``
    ask for, and whether more follow it in that direction; without ``limit``, every model, as
    OpenAI lists them. An id is a cursor by its order, so a model that left since is one still."""
    limit = args.get("limit")
    after, before = args.get("after_id") or None, args.get("before_id") or None  # (empty: none)
    if after is not None and before is not None:
        return bad_request("Send `after_id` or `before_id`, not both.", "before_id")
    if after is not None:
        names = [n for n in names if n > after]
    elif before is not None:
        names = [n for n in names if n < before]
    if limit is None:
        return names, False
    if not (limit.isascii() and limit.isdigit() and len(limit) <= 4 and 1 <= int(limit) <= 1000):
        return bad_request("Invalid value for `limit`: expected an integer from 1 to 1000.", "limit")
    count = int(limit)
    if before is not None:  # the page just before it
        return names[-count:], len(names) > count
    return names[:count], len(names) > count


def _model_card(name: str, links: list[NodeLink]) -> ModelCard:
    """A model group as ``/v1/models`` lists it and ``/v1/models/{id}`` returns it."""
    created = int(min(lk.linked_wall for lk in links))
    window = max((lk.models[name].context_window for lk in links if name in lk.models), default=0)
    return ModelCard(
        id=name,
        created=created,
        nodes=sorted(lk.node_id for lk in links),
        display_name=name,
        created_at=datetime.datetime.fromtimestamp(created, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        max_input_tokens=window or None,
    )


class EdgeApp(QuartTrio):
    """Quart's ``__call__`` only awaits ``asgi_app``: one more coroutine frame
    between hypercorn and the edge's routes, held by every open stream (272
    bytes). Here the app, called, is its ``asgi_app`` itself."""

    @property
    def __call__(self):  # type: ignore[override]
        return self.asgi_app


def create_app(config: EdgeConfig | None = None) -> QuartTrio:
    """The ASGI app. With no ``config``, reads ``$IOP_EDGE_CONFIG`` (or
    defaults); a config that cannot be used then ends the process with one
    line naming the key (under hypercorn's CLI: its worker)."""
    if not structlog.is_configured():  # under hypercorn's CLI: `iop` and the tests configure it first
        problem = logs.setting_problem(None)
        if problem:  # (as `iop edge` refuses it: under hypercorn's CLI a typo fell back to info, saying nothing)
            raise SystemExit(f"iop: {problem}")
        logs.configure()
    if config is None:
        try:
            config = load_edge_config(None)
        except ConfigError as e:
            raise SystemExit(f"iop: {e}") from None
        hypercorn = _hypercorn_config()
        if hypercorn is not None:
            if hypercorn.worker_class != "trio":  # it started, then answered every request 500 with an empty body
                raise SystemExit("iop: the edge runs on trio: start hypercorn with --worker-class trio")
            if hypercorn.workers != 1:
                # Each worker was an edge of its own: a node linked to one, a request reached
                # another (503, no node), and a drain's idle worker ended first, then hypercorn
                # cut the rest. With none (0), no signal drained it.
                raise SystemExit("iop: the edge is one hypercorn worker: start hypercorn with --workers 1")
            hypercorn.h2_max_concurrent_streams = config.h2_max_streams  # (read as each connection opens)
            bind = _public_bind(hypercorn.bind)
            if bind is not None:  # hypercorn's own --bind: the address the open-edge warning names
                config = msgspec.structs.replace(config, bind=bind)
        more_open_files()  # (under `iop edge` its start does it)
        app = _create_app(config)
        _drain_under_hypercorn(app)
        return app
    return _create_app(config)


def _drain_under_hypercorn(app: QuartTrio) -> None:
    """Under hypercorn's CLI, the edge drains as under `iop edge` (new requests 503
    `draining`, running streams finish within ``drain_grace_s``, the rest end with an SSE
    error, the node links close 1001) before hypercorn's own graceful timeout, on the first of:

    - its worker's shutdown trigger (the parent's SIGTERM or SIGINT, passed on as an event);
    - a SIGTERM, SIGINT or SIGHUP to the worker itself: systemd's stop and ``kill -TERM -PGID``
      signal the whole process group (a closed terminal sends SIGHUP), and hypercorn leaves the
      worker's default handler, which ended it at once.

    A second signal to the worker ends the drain's grace at once. (Streams were cut 3 s after the signal,
    mid-body, with no error: found from outside.) Written against hypercorn 0.18's
    ``trio_worker``, which looks the trigger up after it loads the app."""
    import signal

    import hypercorn.trio.run as worker

    waits = getattr(worker.check_multiprocess_shutdown_event, "iop_waits", worker.check_multiprocess_shutdown_event)

    async def drained_first(shutdown_event, sleep) -> None:
        edge = edge_of(app)
        stop = trio.Event()
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:

                async def signalled() -> None:
                    seen = 0  # (signals to this worker: the parent's event is the same signal's echo)
                    async for _ in signals:
                        seen += 1
                        if seen > 1:
                            edge.hurry.set()
                        stop.set()

                async def told() -> None:
                    await waits(shutdown_event, sleep)
                    stop.set()

                nursery.start_soon(signalled)
                nursery.start_soon(told)
                await stop.wait()
                await edge.drain()
                nursery.cancel_scope.cancel()

    drained_first.iop_waits = waits  # type: ignore[attr-defined]  # (a second app replaces, not stacks)
    worker.check_multiprocess_shutdown_event = drained_first


def _hypercorn_config():
    """The hypercorn ``Config`` of the worker loading this app under hypercorn's CLI (its
    command line, any ``--config`` file and its defaults, as hypercorn read them), or None
    when something else calls :func:`create_app`. Found on the stack: hypercorn's worker
    (``trio_worker``, ``asyncio_worker``; its reloader's ``run``) holds it as ``config``."""
    import hypercorn.config

    frame = sys._getframe(1)
    while frame is not None:
        config = frame.f_locals.get("config") if frame.f_globals.get("__name__", "").startswith("hypercorn.") else None
        if isinstance(config, hypercorn.config.Config):
            return config
        frame = frame.f_back
    return None


def _public_bind(binds: list[str]) -> str | None:
    """The first public address of hypercorn's binds (not loopback, a unix socket or a file
    descriptor), or None: the app is told no address otherwise."""
    public = [b for b in binds if not b.startswith(("unix:", "fd://")) and not is_loopback(_host(b))]
    return public[0] if public else None


def _host(bind: str) -> str:
    """The host of a hypercorn bind: ``HOST:PORT``, ``[V6]:PORT``, or a host alone (port 8000)."""
    if bind.startswith("[") and "]" in bind:
        return bind[1 : bind.index("]")]
    host, colon, port = bind.rpartition(":")
    return host if colon and port.isdigit() else bind


async def _cancelled_alone(task: Callable[[], Awaitable[None]]) -> None:
    """Run a background task; a group of nothing but cancels out of its nurseries (the edge
    stopping) leaves as one ``trio.Cancelled``, which ends the task quietly: quart-trio logs
    every exception group a background task raises as an error, with its traceback (each
    graceful stop of an edge with ``state`` set logged one, on the line operators alert on)."""
    try:
        await task()
    except BaseExceptionGroup as group:
        cancels, rest = group.split(trio.Cancelled)
        if rest is not None or cancels is None:
            raise
        first: BaseException = cancels
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


def _create_app(config: EdgeConfig) -> QuartTrio:
    install_frame_limit()  # hypercorn checks a websocket message's size only after buffering it
    install_reads()  # hypercorn makes a cancel scope per read even with no read timeout
    install_keepalive()  # hypercorn starts and cancels a task per request to time idle connections
    install_app_queue()  # hypercorn's memory channel to the app: 1.7 KB an open stream holds
    install_send_lock(config.write_timeout_s)  # hypercorn's trio.Lock per connection: 0.3 KB an open stream holds
    install_connection_guard()  # an exception in one connection ends that connection, not the edge
    install_h2_streams()  # hypercorn's HTTP/2 ended the connection on body data for a stream it closed
    edge = Edge(config)
    app = EdgeApp("iop-edge")
    app.url_map.merge_slashes = False  # (/v1//models is the JSON 404 that says why, not an HTML 308 past the key check)
    logs.as_events(app.name)  # app.logger: Quart's errors as structlog events, not plain-text lines
    app.config["RESPONSE_TIMEOUT"] = None  # never cut a long stream
    app.config["BODY_TIMEOUT"] = config.body_timeout_s
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.extensions["iop"] = edge

    def refused_key() -> APIError:
        from quart import request

        return unauthorized(request.headers.get("Authorization"), request.headers.get("x-api-key"))

    def client_key() -> tuple[Key | None, Response | None]:
        """The request's key (None on an open edge), or the 401 refusing it."""
        from quart import request

        if edge.keys.open:
            return None, None
        key = edge.keys.authenticate(request.headers.get("Authorization"), request.headers.get("x-api-key"))
        if key is None:
            return None, _json(401, refused_key().body())
        request.scope["iop.key"] = key.id  # (its access line's: edge.openai.routes)
        return key, None

    def admin_auth() -> Response | None:
        """admin_keys when configured; else any client key (open edge: open)."""
        from quart import request

        if config.admin_keys:
            if is_admin(request.headers, config.admin_keys):
                return None
            refusal = error_json(admin_key_refused(request.headers), "authentication_error", code="invalid_api_key")
            return _json(401, refusal)
        return client_key()[1]

    def route_refusal(path: str) -> Response | None:
        """The 401 of a caller who may not learn that ``path`` is unknown or takes other
        methods: under the admin API, anyone without an admin key (an operator's key that
        guessed a method wrong was told the key was wrong; a client key learnt which admin
        routes exist); elsewhere under /v1, anyone without a client key."""
        if is_admin_path(path):
            return admin_auth()
        if path.startswith("/v1/") and client_key()[1] is not None:
            return models_error(refused_key())
        return None

    def models_error(err: APIError) -> Response:
        """An error of the models routes, in Anthropic's shape to the anthropic SDK (it sends
        anthropic-version), as /v1/messages answers it; else OpenAI's."""
        from quart import request

        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in err.headers}
        if "anthropic-version" in request.headers:
            return _json(err.status, anthropic_error_body(err), headers)
        return _json(err.status, err.body(), headers)

    def models_key() -> tuple[Key | None, Response | None]:
        key, refused = client_key()
        return (None, models_error(refused_key())) if refused is not None else (key, None)

    # The whole list as a request with no key gets it, kept until a link comes or goes: 16
    # nodes of 1,020 models each made an 11 MB list in 180 ms a request (an outside audit).
    listed: list = [-1, b""]

    @app.get("/v1/models")
    async def list_models() -> Response:
        key, refused = models_key()
        if refused is not None:
            return refused
        from quart import request

        whole = key is None and not request.args
        if whole and listed[0] == edge.runs.models_version:
            return _json(200, listed[1])
        version = edge.runs.models_version
        models = edge.runs.models()
        names = [name for name in sorted(models) if key is None or key.may_use(name)]
        page = _models_page(names, request.args)
        if isinstance(page, APIError):
            return models_error(page)
        names, more = page
        cards = [_model_card(name, models[name]) for name in names]
        first, last = (cards[0].id, cards[-1].id) if cards else (None, None)
        body = _encode(ModelList(data=cards, has_more=more, first_id=first, last_id=last))
        if whole:
            listed[:] = [version, body]
        return _json(200, body)

    @app.get("/v1/models/<path:model_id>")  # ids such as Qwen/Qwen3-8B hold slashes
    async def retrieve_model(model_id: str) -> Response:
        key, refused = models_key()
        if refused is not None:
            return refused
        models = edge.runs.models()
        links = models.get(model_id)
        if not links or (key is not None and not key.may_use(model_id)):
            # (a model the key may use may have a node still linking: retry, as a chat's 404 says)
            allowed = key is None or key.may_use(model_id)
            error = edge.runs.unknown_model(model_id) if allowed else model_not_found(model_id)
            served = model_id.rstrip("/")
            if served != model_id and served in models and (key is None or key.may_use(served)):
                error.message += f" The path ends with a /: the route is /v1/models/{served}."
            return models_error(error)
        return _json(200, _encode(_model_card(model_id, links)))

    @app.get("/v1/nodes")
    async def list_nodes() -> Response:
        refused = admin_auth()
        if refused is not None:
            return refused
        # Without admin_keys a client key sees the nodes, but only the models it may use (and
        # nodes that serve one): a key refused a model does not learn it exists (newcomer audit).
        key = None if config.admin_keys else client_key()[0]
        now = trio.current_time()
        shown = {
            link: [info for info in link.models.values() if key is None or key.may_use(info.name)]
            for link in sorted(edge.runs.links.values(), key=lambda lk: lk.node_id)
        }
        nodes = [
            {
                "id": link.node_id,
                "linked_for_s": round(now - link.linked_at, 3),
                "draining": link.draining,
                "stalled": any(link.stalled(now, info.name) for info in infos),  # (each model says)
                # its frames waited unread for their part of the edge's time (README "Hostile input")
                "throttled": link.throttled(now)[0],
                "throttled_s": round(link.throttled(now)[1], 3),
                "in_flight": sum(link.in_flight[info.name] for info in infos),
                "models": [
                    {
                        "name": info.name,
                        "adapter": info.adapter,
                        "target": info.target,
                        "max_concurrency": info.max_concurrency,
                        # this edge's share of max_concurrency (a node's claim past the edge's cap counts as the cap)
                        "grant": min(link.grants[info.name], info.max_concurrency),
                        # what of max_concurrency the node has earned (README "Many nodes": ramp_slots)
                        "trusted": link.trusted[info.name],
                        "in_flight": link.in_flight[info.name],
                        # routed around for it now: its runs were not starting or progressing (it was
                        # told only by the log and the console: an outside audit), or failing
                        "stalled": link.stalled(now, info.name),
                        "failing": link.ejected(info.name, now),
                        "context_window": info.context_window,
                        "native_tools": info.native_tools,
                        "passthrough": info.passthrough,
                        # the model server's own load (from its metrics), when the node samples it
                        **({"engine": link.engine[info.name]} if info.name in link.engine else {}),
                    }
                    for info in infos
                ],
            }
            for link, infos in shown.items()
            if infos or key is None
        ]
        return _json(200, _encode({"object": "list", "data": nodes}))

    @app.get("/metrics")
    async def metrics() -> Response:
        # Its series name every model and key id: an admin key's, as the admin API is; with keys
        # and no admin_keys, no one's (it gave every key's usage to anyone, then to any key holder;
        # outside audits). An open edge's is open.
        refused = admin_auth()
        if refused is not None:
            return refused
        if not config.admin_keys and not edge.keys.open:
            message = (
                "GET /metrics names every key and model: on an edge with keys it needs an admin key; "
                "set admin_keys in the edge config and scrape with one."
            )
            return _json(403, error_json(message, "permission_error", code="admin_disabled"))
        return Response(await edge.metrics.scrape(), 200, content_type=CONTENT_TYPE)

    @app.before_request
    async def slashes_first() -> None:
        """A path that begins with // and more (a base URL ending in /) is the 404 that says so:
        Quart's routes matched it as the path with one, answering //v1/models and //metrics
        (their access lines under api "other") where //v1/chat/completions was the 404."""
        from quart import abort, request

        path = request.scope.get("path", "")
        if path[:2] == "//" and path.strip("/"):
            abort(404)

    @app.get("/")  # (and HEAD /: Claude Code's check that the base URL answers, at every start)
    async def root() -> Response:
        text = "iop edge: an OpenAI- and Anthropic-compatible API under /v1 (GET /v1/models lists the models).\n"
        return Response(text, 200, content_type="text/plain; charset=utf-8")

    @app.get("/healthz")
    async def healthz() -> Response:
        return _json(200, b'{"status":"ok"}')

    @app.get("/readyz")
    async def readyz() -> Response:
        if edge.draining:
            return _json(503, b'{"status":"draining"}')
        if not edge.runs.links:
            return _json(503, b'{"status":"no node linked"}')
        if all(link.draining for link in edge.runs.links.values()):  # none takes a new run
            return _json(503, b'{"status":"every node draining"}')
        return _json(200, b'{"status":"ready"}')

    @app.errorhandler(404)
    async def not_found(_: Exception) -> Response:
        from quart import request

        # As OpenAI's own 404 does, with the method and path; and the usual cause, a base URL without /v1
        # (or, for the Anthropic SDK, with it: it adds /v1 itself).
        path = request.scope.get("path", request.path)[:200]  # (as sent: request.path drops a leading //)
        if path == "/v1/node/link":
            message = "This is the node link: a websocket that `iop node` dials (the request has no Upgrade)."
            return _json(426, error_json(message, "invalid_request_error", code="upgrade_required"))
        refused = route_refusal(path)  # a caller without a key learns no route
        if refused is not None:
            return refused
        hint = ""
        if path.startswith(("/chat/", "/responses", "/models", "/embeddings", "/completions", "/messages")):
            hint = " The API is under /v1: is the client's base URL missing /v1?"
        elif path.startswith("/v1/v1/"):
            hint = (
                " The path has /v1 twice: a client that adds /v1 itself (the Anthropic SDK does)"
                " needs a base URL without it."
            )
        elif "//" in path:
            hint = " The path has // in it: does the client's base URL end with a /?"
        elif path.endswith("/") and (path[:-1] in ROUTES or path[:-1] == "/v1/models"):
            hint = f" The path ends with a /: the route is {path[:-1]}."  # (not any one character more)
        elif path.startswith("/v1/") and path.endswith(_ROUTE_TAILS):
            hint = " The path has a route after another: is the base URL the whole endpoint? It ends at /v1."
        message = f"Unknown route: {request.method} {path}.{hint}"
        return models_error(APIError(404, message, "invalid_request_error", code="not_found"))  # (either API's shape)

    @app.errorhandler(405)
    async def not_allowed(e: Exception) -> Response:
        from quart import request

        refused = route_refusal(request.path)  # (as for an unknown route)
        if refused is not None:
            return refused
        methods = sorted(getattr(e, "valid_methods", None) or ())
        # (the methods too, not only in Allow: "Method not allowed." was all a newcomer's
        # POST /v1/models read)
        message = f"Method not allowed; use {' or '.join(methods)}." if methods else "Method not allowed."
        response = models_error(APIError(405, message, "invalid_request_error", code="method_not_allowed"))
        if methods:
            response.headers["allow"] = ", ".join(methods)
        return response

    @app.errorhandler(500)
    async def internal_error(_: Exception) -> Response:
        """A route's unexpected exception (Quart has logged it, traceback and all, through app.logger)."""
        return _json(500, error_json("Internal error in the edge.", "server_error", code="internal_error"))

    @app.before_serving
    async def start_background() -> None:
        app.add_background_task(_cancelled_alone, edge.runs.timers.run)
        app.add_background_task(_cancelled_alone, edge.console.run)
        app.add_background_task(_cancelled_alone, edge.keys.watch_budgets)
        if edge.ledger is not None:
            app.add_background_task(_cancelled_alone, edge.ledger.run)
            app.add_background_task(_cancelled_alone, edge.ledger.refresh_keys)
            if config.ledger_retention_days:
                app.add_background_task(_cancelled_alone, edge.ledger.fold_forever)
        if edge.shared is not None:
            app.add_background_task(_cancelled_alone, edge.shared.run)

    @app.before_serving
    async def warn_open() -> None:
        if not config.node_token and not config.node_tokens:
            log.warning("no node_token or node_tokens configured: no node can link to this edge")
        if not is_loopback(_host(config.bind)) and edge.keys.open:
            edge.open_served = True  # (said now)
            _warn_open(config.bind)
        elif edge.proxies is not None and edge.keys.open:  # (on loopback behind a public proxy: as open)
            log.warning(
                "EDGE IS OPEN: behind trusted_proxies with no api_keys; anyone who can reach the proxy can use it",
                bind=config.bind,
            )

    admin_routes(app, edge)
    console_routes(app, edge)
    # Outermost, the routes a stream is served on: every frame between hypercorn and the
    # request's own code is held by each open stream.
    app.asgi_app = link_route(partial(node_link, config, edge.runs, edge.id), app.asgi_app)  # type: ignore[method-assign]
    app.asgi_app = openai_routes(edge, app.asgi_app)  # type: ignore[method-assign]
    return app


def edge_of(app: QuartTrio) -> Edge:
    return app.extensions["iop"]
