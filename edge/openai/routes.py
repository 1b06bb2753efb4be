"""ASGI middleware in front of Quart for the OpenAI POST routes.

Quart serves everything else (models, health, metrics, the node link); these
routes (and the Anthropic Messages routes, :mod:`edge.anthropic`) run on raw
ASGI so that one cancel scope per request owns the body, the admission wait,
the run and every write, and the client's disconnect cancels exactly that
scope. Under hypercorn the disconnect reaches the scope from hypercorn's own
delivery of it (:func:`edge.openai.direct.on_disconnect`): no task of the
request's waits for it. Under another server a task does.
Every request here gets a request id (``req_`` + hex, the ``x-request-id`` of
its response), one access line with its real status
and the API it spoke (``api``), and one count in ``iop_requests_total``,
rejections included. Each route renders errors in its API's shape
(:class:`~edge.openai.exchange.ErrorShape`). The HTTP requests Quart serves
(models, nodes, health, metrics, admin, console, unknown routes) get the
same: an id, an access line and a count, their ``api`` named by
:func:`_quart_api`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NamedTuple

import structlog
import trio

from edge.anthropic.messages import ANTHROPIC_ERRORS, MessagesExchange, count_tokens, messages, no_such_route
from edge.cors import for_api, host_name, local_host
from edge.errors import APIError
from edge.openai.chat import chat_completions
from edge.openai.exchange import (
    OPENAI_ERRORS,
    ClientGone,
    ErrorShape,
    Exchange,
    answered_unreadable,
    request_id_of,
)
from edge.openai.passthrough import tunnel_route
from edge.openai.responses_route import RESPONSES_ERRORS, create_response
from proto.frames import is_token_count

if TYPE_CHECKING:
    from edge.app import Edge

log = structlog.get_logger("iop.edge.http")

Handler = Callable[["Edge", Exchange, bytes], Awaitable[None]]


class Route(NamedTuple):
    handler: Handler
    api: str  # the access line's ``api``: which front door
    errors: ErrorShape = OPENAI_ERRORS
    exchange: type[Exchange] = Exchange  # (the Messages routes' adds Anthropic's ``request-id``)
    post_only: bool = True  # any other method is a 405


ROUTES: dict[str, Route] = {
    "/v1/chat/completions": Route(chat_completions, "chat"),
    "/v1/completions": Route(tunnel_route("/completions"), "completions"),
    "/v1/embeddings": Route(tunnel_route("/embeddings"), "embeddings"),
    "/v1/responses": Route(create_response, "responses", RESPONSES_ERRORS),
    "/v1/messages": Route(messages, "messages", ANTHROPIC_ERRORS, MessagesExchange),
    "/v1/messages/count_tokens": Route(count_tokens, "messages", ANTHROPIC_ERRORS, MessagesExchange),
}
# Any other path under /v1/messages/ (the Batches API, ...): Anthropic's 404, whatever the method.
_MESSAGES_PREFIX = "/v1/messages/"
_MESSAGES_NOT_FOUND = Route(no_such_route, "messages", ANTHROPIC_ERRORS, MessagesExchange, post_only=False)

CLIENT_CLOSED = 499  # the access line's status when the client left before any response (nginx's)
_OUTCOMES = {"cancelled_by_operator": "cancelled", "client_gone": "client_gone"}  # by an APIError's code
_MAX_MODEL_LOGGED = 256  # a model name is the client's string: bounded in the log


def openai_routes(edge: Edge, quart_asgi):
    cors = edge.cors
    proxies = edge.proxies

    def dispatch(scope, receive, send) -> Awaitable[None]:
        """The app, called: not a coroutine, so no frame of its own that
        every open stream holds (:class:`edge.app_queue._Direct` calls this)."""
        if scope["type"] == "http":
            if proxies is not None:  # (before anything reads the client's address)
                proxies.rewrite(scope)
            path = scope["path"]
            if path[:1] != "/":
                path = _origin_form(scope)
            extra = None
            if cors is not None and for_api(path):  # (edge.cors: a browser's request from another origin)
                allow = cors.allowed(_header(scope, b"origin"))
                if allow is not None:
                    if scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method"):
                        requested = _header(scope, b"access-control-request-headers")
                        return _serve_quart(edge, _answer(204, cors.preflight(allow, requested)), scope, receive, send)
                    extra = cors.headers(allow)
            route = ROUTES.get(path)
            if route is None and path.startswith(_MESSAGES_PREFIX):
                route = _MESSAGES_NOT_FOUND
            if route is not None:
                ex = route.exchange(scope, receive, send)
                if extra:
                    ex.extra_headers += extra
                return _serve(edge, route, ex)
            app = _refuse_ambiguous_framing if _framed_twice(scope) else quart_asgi  # (found from outside: a
            return _serve_quart(edge, app, scope, receive, send, extra)  # 201 for an admin key made so)
        if proxies is not None and scope["type"] == "websocket":  # (a node link's peer: its part of the edge)
            proxies.rewrite(scope)
        return quart_asgi(scope, receive, send)

    async def asgi(scope, receive, send) -> None:  # what servers see: a coroutine function is ASGI 3
        await dispatch(scope, receive, send)

    asgi.iop_dispatch = dispatch  # type: ignore[attr-defined]
    return asgi


class _Unwatched:
    """In place of the watcher's nursery when the server's own delivery of
    the disconnect cancels the request (hypercorn): nothing to open or wait for."""

    __slots__ = ()

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *_: object) -> None:
        return None


_UNWATCHED = _Unwatched()


def _content_encoding(headers) -> bytes | None:
    """The request's ``Content-Encoding``, every line of it joined (RFC 9110: a second line
    of gzip after one of identity is still gzip), if it names any coding but identity."""
    lines = [value for name, value in headers if name == b"content-encoding"]
    if not lines:
        return None
    joined = b", ".join(lines)
    if all(part.strip().lower() in (b"", b"identity") for part in joined.split(b",")):
        return None
    return joined


_OWN_ORIGIN = object()  # (what _foreign_origin says of a browser's request from the edge's own origin)


def _foreign_origin(scope: dict, cors) -> bytes | object | None:
    """The origin of a browser's request from another site that ``cors_origins`` does not
    list; :data:`_OWN_ORIGIN` for one from the edge's own origin (None: not a browser's, or
    one that ``cors_origins`` lists). A web page may send a POST there with no preflight, as a form or
    a ``no-cors`` fetch whose body is ``text/plain``; it cannot read the answer, but the run
    ran: on an edge without keys (the demo, a laptop's), any page its user opened could spend
    its GPUs (found from outside). Browsers say where a request comes from in
    ``Sec-Fetch-Site``; one too old to, in ``Origin``, against ``Host`` (as Go's
    CrossOriginProtection does). Other clients send neither."""
    origin = site = host = None
    for name, value in scope["headers"]:
        if name == b"origin":
            origin = value
        elif name == b"sec-fetch-site":
            site = value
        elif name == b"host":
            host = value
    if origin is None and site is None:
        return None
    if origin is not None and cors is not None and cors.allowed(origin) is not None:
        return None
    if site is not None:
        return _OWN_ORIGIN if site in (b"same-origin", b"none") else (origin or b"another site")
    if host is not None and origin.partition(b"://")[2].lower() == host.lower():
        return _OWN_ORIGIN
    return origin


def _check_host(scope: dict, allowed: list[str]) -> None:
    """A keyless edge answers a browser's call from its own origin only at localhost, an IP
    address, or a name of ``allowed_hosts``: a web page on another site can take the edge's
    origin for its own through DNS rebinding (its name resolved to the edge's address), and
    read the answers too (a re-check, in Chromium)."""
    host = next((value for name, value in scope["headers"] if name == b"host"), b"")
    if local_host(host) or "*" in allowed:
        return
    name = host_name(host)
    if any(name == entry.lower().rstrip(".") for entry in allowed):  # (names match in any case)
        return
    shown = host[:128].decode("latin-1")
    raise APIError(
        403,
        f"This edge has no api_keys, and answers a web page's calls only at localhost or an IP address: "
        f"`Host: {shown}` is none (a page on another site can take that name through DNS rebinding). "
        "List the name in the edge's `allowed_hosts`, or give the edge api_keys.",
        "permission_error",
        code="host_not_allowed",
    )


def _cross_site(origin: bytes) -> APIError:
    shown = origin[:128].decode("latin-1")
    return APIError(
        403,
        f"A web page on {shown} may not call this edge: a browser's request from another site is refused"
        " unless its origin is in the edge's `cors_origins`.",
        "permission_error",
        code="cross_origin_request",
    )


_MAX_VIA = 512  # of an x-iop-via passed on (16 edge ids, and room)


def _via(edge: Edge, headers) -> str:
    """The edges a request came through (``x-iop-via``, which a node's upstream requests
    carry: :class:`node.adapters.Via`), passed on to the node that runs it. One that came
    through this edge is a loop: a node's model whose base_url leads back here, directly or
    through other edges; each went round until the queue timed out, 30 s, then a 429 "at
    capacity" that named no cause (found from outside). A 508 the node relays, at once.
    (After the key check: a caller without a key learns nothing of this edge's id.)"""
    via = ""
    for name, value in headers:
        if name == b"x-iop-via":
            via = f"{via},{value.decode('latin-1')}" if via else value.decode("latin-1")
    if not via:
        return ""
    if edge.id in via.split(","):
        raise APIError(
            508,
            "Loop: this request came from a node of this edge (through its model server, or other edges):"
            " the base_url of a node's model leads back here. Set it to the model server's URL.",
            "invalid_request_error",
            code="loop_detected",
        )
    return via[-_MAX_VIA:]


def _compressed(encoding: bytes) -> APIError:
    shown = encoding.decode("latin-1")[:32]
    return APIError(
        415,
        f"Unsupported `Content-Encoding: {shown}`: this edge takes request bodies uncompressed; send it without one.",
        code="unsupported_content_encoding",
    )


async def _serve(edge: Edge, route: Route, ex: Exchange) -> None:
    """One request, in one frame: its body and its handler run inside a
    cancel scope that the client's disconnect cancels (through the server's
    own delivery of it, or a task in a nursery under another server's
    wiring). Every response carries ``x-request-id``; then its one access
    line and its count in ``iop_requests_total``."""
    t0 = time.perf_counter()
    ex.errors = route.errors
    ex.api = route.api
    structlog.contextvars.bind_contextvars(request_id=ex.request_id)
    outcome: str | None = None  # what ended it, when the handler did not say
    counted = False  # among the requests a drain waits for (those it did not refuse)
    try:
        with trio.CancelScope() as scope:
            async with _UNWATCHED if ex.cancel_on_disconnect(scope) else trio.open_nursery() as watcher:
                try:
                    if _framed_twice(ex.scope):
                        raise _ambiguous_framing()
                    problem = edge.refuse_request(ex)  # (before the method: a caller without a key
                    if problem is not None:  # learns nothing of which routes exist)
                        try:
                            raise problem
                        finally:  # (its traceback holds this frame: kept, a cycle held each refused request)
                            problem = None
                    if route.post_only and ex.scope["method"] != "POST":
                        raise APIError(
                            405,
                            "Method not allowed; use POST.",
                            code="method_not_allowed",
                            headers=[(b"allow", b"POST")],
                        )
                    foreign = _foreign_origin(ex.scope, edge.cors)
                    if foreign is not None:
                        if foreign is not _OWN_ORIGIN:
                            raise _cross_site(foreign)  # type: ignore[arg-type]
                        if edge.keys.open:
                            _check_host(ex.scope, edge.config.allowed_hosts)
                    encoding = _content_encoding(ex.scope["headers"])
                    if encoding is not None:
                        raise _compressed(encoding)  # (a 400 "not valid JSON at byte 0" before)
                    ex.via = _via(edge, ex.scope["headers"])
                    edge.handling += 1  # (a drain waits for its answer)
                    counted = True
                    # The framework's body timeout does not reach raw ASGI: bound it here.
                    try:
                        with trio.fail_after(edge.config.body_timeout_s):
                            config = edge.config
                            body = await ex.read_body(config.max_body_bytes, edge.large_requests, config.min_body_rate)
                    except trio.TooSlowError:
                        raise APIError(
                            408,
                            f"The request body did not arrive within {edge.config.body_timeout_s:g} s.",
                            code="request_timeout",
                        ) from None
                    if watcher is not None:
                        watcher.start_soon(ex.watch_disconnect, scope)
                    else:
                        ex.check_disconnect(scope)  # one queued behind the body, before the hook was in place
                    handling = route.handler(edge, ex, body)
                    del body  # the handler drops it once decoded: an open stream holds no copy of its request's bytes
                    await handling
                except ClientGone:
                    outcome = "client_gone"
                except APIError as e:
                    # (said first: a client that closes as the answer arrives cancels the send)
                    # (an operator's cancel of a queued request is "cancelled", as of a run; a
                    # queued request found gone as it got a slot, "client_gone": its 499 goes to no one)
                    outcome = _OUTCOMES.get(e.code) or f"rejected_{e.status}"
                    ex.access.error = e.code or e.type
                    if e.status == 429:
                        ex.access.refusal = e.message
                    if not ex.started:
                        if ex.key is not None and not _limits_said(ex, e):  # (a 400 or 404 to a key too)
                            ex.extra_headers += edge.keys.headers(ex.key)
                        await ex.respond_error(e)
                    elif not ex.finished:
                        await ex.finish(ex.errors.stream(e.message, e.type, e.code))
                except Exception:
                    outcome = "internal_error"
                    log.exception("request failed")
                    if not ex.started:
                        await ex.respond_error(APIError(500, "Internal error in the edge.", "server_error"))
                    elif not ex.finished:
                        await ex.finish(ex.errors.stream("internal error in the edge", "server_error", None))
                finally:
                    scope.cancel()  # ends the disconnect watcher, if there is one
    finally:
        if counted:
            edge.handling -= 1
            if not edge.handling:
                edge.handled.unpark_all()
        _access(edge, ex, route.api, outcome, time.perf_counter() - t0)
        structlog.contextvars.unbind_contextvars("request_id", "run_id")
        ex.release()


def _origin_form(scope: dict) -> str:
    """The path of a request line in absolute form (``POST http://host/v1/... HTTP/1.1``), which
    an HTTP/1.1 server must accept (RFC 9112 3.2.2): the path is what routes it, its host
    nothing. It was a 404 that blamed a // in the path. Any other form is left as it is."""
    path = scope["path"]
    scheme, sep, rest = path.partition("://")
    if sep and scheme.lower() in ("http", "https"):
        path = "/" + rest.partition("/")[2]
        scope["path"] = path
        scope["raw_path"] = path.encode()
    return path


def _limits_said(ex: Exchange, error: APIError) -> bool:
    """The answer already carries its key's ``x-ratelimit-*`` (admitted, or refused for a limit)."""
    return any(name.startswith(b"x-ratelimit-") for name, _ in (*ex.extra_headers, *(error.headers or ())))


def _framed_twice(scope: dict) -> bool:
    """An HTTP/1.1 request with both Content-Length and Transfer-Encoding (h11 reads it by the
    latter): a sign of request smuggling through a proxy that reads the other, which RFC 9112
    6.3 says to answer and then close the connection on, whatever its route. (Answered before
    its body is read, a response says ``Connection: close`` and hypercorn closes it.)"""
    length = chunked = False
    for name, _ in scope["headers"]:
        if name == b"content-length":
            length = True
        elif name == b"transfer-encoding":
            chunked = True
    return length and chunked


def _ambiguous_framing() -> APIError:
    return APIError(
        400, "The request has both Content-Length and Transfer-Encoding; send one.", code="ambiguous_framing"
    )


async def _refuse_ambiguous_framing(scope, receive, send) -> None:
    """For a route Quart serves (:func:`_serve_quart` adds ``Connection: close``: its body is unread)."""
    error = _ambiguous_framing()
    headers = [(b"content-type", b"application/json"), *error.headers]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": error.body()})


def is_admin_path(path: str) -> bool:
    """Under the admin API (``/v1/admin``, ``/v1/nodes``): an admin key's, when admin_keys are set."""
    return path in ("/v1/admin", "/v1/nodes") or path.startswith(("/v1/admin/", "/v1/nodes/"))


def _quart_api(path: str) -> str:
    """The ``api`` label of a request Quart serves: one of a fixed few, never the client's string."""
    if path == "/v1/models" or path.startswith("/v1/models/"):
        return "models"
    if is_admin_path(path):
        return "admin"
    if path == "/console" or path.startswith("/console/"):
        return "console"
    if path in ("/healthz", "/readyz"):
        return "health"
    if path == "/metrics":
        return "metrics"
    return "other"


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _answer(status: int, headers: list[tuple[bytes, bytes]]):
    """An ASGI app that answers every request with ``status``, ``headers`` and no body."""

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    return app


async def _serve_quart(edge: Edge, quart_asgi, scope, receive, send, extra_headers=None) -> None:
    """A request Quart serves, with its ``x-request-id``, its access line and its count
    (and ``extra_headers`` on its answer)."""
    t0 = time.perf_counter()
    request_id = request_id_of(scope)
    header = (b"x-request-id", request_id.encode())
    status = 0
    # Whether the request's body has all come in: an answer sent before it did (a 404 or
    # 405 to a POST, a 401) closes the connection, as the routes above do. Kept open, the
    # rest of that body and the next request met a connection that never answered again.
    body_in = not any(
        name in (b"content-length", b"transfer-encoding") and value not in (b"0", b"")
        for name, value in scope.get("headers", ())
    )

    async def receive_body():
        nonlocal body_in
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            body_in = True
        return message

    async def send_with_id(message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            extra = [header] if body_in else [header, (b"connection", b"close")]
            if extra_headers:
                extra += extra_headers
            message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    structlog.contextvars.bind_contextvars(request_id=request_id)
    try:
        await quart_asgi(scope, receive_body, send_with_id)
    finally:
        path = scope["path"]
        api = _quart_api(path)
        model = path[len("/v1/models/") :] if path.startswith("/v1/models/") else None
        unreadable = answered_unreadable(scope)
        if unreadable is not None:  # its body was not valid HTTP: edge.connection answered it first
            status, outcome = unreadable[0], f"rejected_{unreadable[0]}"
        elif not status:
            status, outcome = CLIENT_CLOSED, "client_gone"
        else:
            outcome = "ok" if status < 400 else f"rejected_{status}"
        edge.metrics.requests.labels(api, edge.metrics.model_label(model), outcome).inc()
        log.info(
            "request",
            request_id=request_id,
            method=scope["method"],
            route=path[:_MAX_MODEL_LOGGED],
            client=_client(scope),
            api=api,
            model=model[:_MAX_MODEL_LOGGED] if model is not None else None,
            status=status,
            cause=outcome,
            key=scope.get("iop.key"),  # (a client key's route, as the OpenAI routes' lines say it)
            duration_ms=round((time.perf_counter() - t0) * 1000, 1),
        )
        structlog.contextvars.unbind_contextvars("request_id")


def _client(scope: dict) -> str | None:
    """The access line's ``client``: the peer's address, or the client's behind ``trusted_proxies``."""
    client = scope.get("client")
    return str(client[0]) if client else None


def _access(edge: Edge, ex: Exchange, api: str, outcome: str | None, seconds: float) -> None:
    """The request's one access line (no prompt text, no keys) and its counts."""
    access = ex.access
    unreadable = answered_unreadable(ex.scope)
    if unreadable is not None:  # its body was not valid HTTP: edge.connection answered it first
        outcome, access.error = f"rejected_{unreadable[0]}", unreadable[1]
    elif access.outcome is not None:
        outcome = access.outcome
        # (what its run said; but the client did not get the whole answer: the edge gave up on a
        # client that took no bytes, whatever the run's end, or the client left after a complete run)
        cut = ex.cut_short()
        if cut == "write_timeout" or (cut is not None and outcome == "complete"):
            outcome = cut
    elif outcome is None:
        outcome = "unknown" if ex.finished else "client_gone"
    metrics = edge.metrics
    model = metrics.model_label(access.model)
    metrics.requests.labels(api, model, outcome).inc()
    usage = access.usage
    # (else no run started: nothing used; or only runs replaced, as a lost run whose move found no node)
    counted = usage is not None or access.partial is not None or access.earlier != (0, 0)
    if usage is not None:
        prompt, completion, estimated = usage.prompt_tokens, usage.completion_tokens, access.usage_estimated
    elif access.partial is not None:  # ended without usage (cancelled, failed): what it had streamed
        (prompt, completion), estimated = access.partial, True
    else:  # (the runs replaced: a lost run's by estimate, and said so: it was recorded as exact)
        prompt = completion = 0
        estimated = access.usage_estimated
    if estimated:  # as the access line, the ledger and the key have it
        metrics.usage_estimated.labels(api, model).inc()
    if access.earlier != (0, 0):  # the runs a tool retry replaced: their tokens were spent too
        prompt, completion = prompt + access.earlier[0], completion + access.earlier[1]
    if not (is_token_count(prompt) and is_token_count(completion)):  # (never, from a run: a last guard for the ledger)
        log.warning("usage out of range, not recorded", prompt=str(prompt)[:40], completion=str(completion)[:40])
        prompt = completion = 0
    if prompt:
        metrics.tokens.labels(api, model, "prompt").inc(prompt)
    if completion:
        metrics.tokens.labels(api, model, "completion").inc(completion)
    key = ex.key
    if key is not None:
        key.requests += 1
        key.prompt_tokens += prompt
        key.completion_tokens += completion
        if ex.lease is not None:
            edge.keys.settle(ex.lease, prompt + completion)
    status = unreadable[0] if unreadable is not None else ex.status if ex.started else CLIENT_CLOSED
    edge.console.request_done(
        model, key.id if key is not None else None, status, access.error, prompt, completion, access.refusal
    )
    if edge.ledger is not None:
        edge.ledger.record(
            (
                time.time(),
                ex.request_id,
                key.id if key is not None else None,
                access.model[:_MAX_MODEL_LOGGED] if access.model is not None else None,
                access.node_id,
                api,
                status,
                outcome,
                prompt,
                completion,
                int(estimated),
                access.ttft_ms,
                round(seconds * 1000, 1),
            )
        )
    log.info(
        "request",
        request_id=ex.request_id,
        method=ex.scope["method"],
        route=ex.scope["path"],
        client=_client(ex.scope),
        api=api,
        model=access.model[:_MAX_MODEL_LOGGED] if access.model is not None else None,
        stream=access.stream,
        status=status,
        cause=outcome,
        key=key.id if key is not None else None,
        node_id=access.node_id,
        # As the ledger and the key have them (a cut stream: its estimate); none when no run started.
        prompt_tokens=prompt if counted else None,
        completion_tokens=completion if counted else None,
        usage_estimated=estimated if counted else None,
        duration_ms=round(seconds * 1000, 1),
    )
