"""One HTTP request/response on raw ASGI, for the OpenAI routes.

The OpenAI routes bypass Quart's response machinery so that the request's
nursery owns the whole exchange: body, admission, run and every write happen
inside it, and a client disconnect (ASGI ``http.disconnect``) cancels it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from typing import NamedTuple

import trio

from edge.errors import APIError
from edge.openai.direct import DirectBody, close_stream, connection_lock, on_disconnect, peer_closed
from edge.openai.jsonbody import LARGE_BODY_BYTES
from edge.openai.schema import UsageOut
from edge.openai.sse import sse_error

JSON = b"application/json"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ErrorShape(NamedTuple):
    """How a front door's errors look: a whole JSON body (with the status of
    the :class:`APIError`), and the closing bytes of a stream that had started."""

    body: Callable[[APIError], bytes]
    stream: Callable[[str, str, str | None], bytes]  # (message, type, code)


OPENAI_ERRORS = ErrorShape(APIError.body, sse_error)


async def _released(message: dict | None = None) -> dict:
    raise RuntimeError("the exchange's request is over")


# A body that arrives in more pieces than this, averaging under SMALL_PIECE bytes, is refused:
# each piece costs the edge ~7.5 µs (h11, hypercorn, the receive), so 1-byte chunks of an 8 MiB
# body held a core for a minute (and a bytes object per byte); now 0.5 s at most. A client writes
# a body whole or in pieces of kilobytes, but a JSON encoder's generator (httpx with
# ``json.JSONEncoder().iterencode``) sends one chunk per token: 271 KB came in 20,013 pieces.
MAX_SMALL_PIECES = 65_536
BODY_RATE_GRACE_S = 5.0  # what a body may take whatever its rate (Kestrel's grace period too)
SMALL_PIECE = 256


class ClientGone(Exception):
    """The client closed the connection before its body arrived."""


def new_request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


def request_id_of(scope: dict) -> str:
    """The request's id, made once: whichever of the app and the HTTP layer (an
    answer to a body it could not read, :mod:`edge.connection`) needs it first."""
    request_id: str | None = scope.get("iop.request_id")
    if request_id is None:
        request_id = scope["iop.request_id"] = new_request_id()
    return request_id


def answered_unreadable(scope: dict) -> tuple[int, str] | None:
    """(status, error code) when the HTTP layer answered the request itself
    because its body was not valid HTTP: before its handler did (an answer the
    handler sends after that goes nowhere)."""
    return scope.get("iop.answered")


class Access:
    """What a request's one access line reports, filled in by its handler as
    it goes (never prompt text or keys): the rest comes from the exchange."""

    __slots__ = (
        "model",
        "stream",
        "node_id",
        "outcome",
        "usage",
        "usage_estimated",
        "partial",
        "earlier",
        "ttft_ms",
        "error",
        "refusal",
    )

    def __init__(self) -> None:
        self.model: str | None = None
        self.stream: bool | None = None
        self.node_id: str | None = None
        self.outcome: str | None = None  # None: the HTTP layer says (rejected_<status>, client_gone, ...)
        self.usage: UsageOut | None = None
        self.usage_estimated = False
        self.partial: tuple[int, int] | None = None  # no usage: (prompt estimate, deltas seen) of the last run
        self.earlier = (0, 0)  # (prompt, completion) tokens of the runs before the last (tool retries)
        self.ttft_ms: float | None = None
        self.error: str | None = None  # a refused request's error code (the console lists 429s)
        self.refusal = ""  # a 429's message: which limit, or the queue (the edge's own words)


# In a request's scope: True once it holds a large place, False when it was refused one before its
# body (edge.connection sent no 100 Continue for it, then).
LARGE_PLACE = "iop_large_place"


class LargeRequests:
    """Requests whose body is :data:`~edge.openai.jsonbody.LARGE_BODY_BYTES` or more, in flight
    at once: at most ``limit``, each held from its body's first large byte (or its declared
    length) to the request's end, its decoded prompt's life. Past it, a 503 before the body is
    read: 200 bodies of 8 MB at once took the edge past 2 GB (an outside audit). One key holds
    at most :data:`OWNER_SHARE` of them, and no more than its ``max_concurrent``: the places
    are taken before a key's limits are read (its body is not in yet), and one key of
    ``max_concurrent = 2`` trickling 64 bodies
    held all 64, every other client's large request refused for a minute at a time (an
    outside audit). Past its share, the key's request is a 429. (An open edge's clients have
    no share: behind a proxy not in ``trusted_proxies`` they are all one address.)"""

    __slots__ = ("limit", "held", "owners")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.owners: dict[str, int] = {}  # owner -> places it holds

    def take(self, owner: str | None, most: int = 0, full: bool = False) -> str | None:
        """A place for ``owner`` (a key's id; None: an open edge's client, no share; ``most``:
        its own limit, 0 for none); the owner, to give it back. ``full``: refused as when every
        place is taken (they were when its client was told not to send the body)."""
        share = max(1, int(self.limit * OWNER_SHARE))
        if most:
            share = min(share, most)
        held = self.owners.get(owner, 0) if owner is not None else 0
        if owner is not None and held >= share:
            raise APIError(
                429,
                f"Key {owner!r} has {held} requests of {LARGE_BODY_BYTES // 1024 // 1024} MiB or more in flight, "
                "the most one key may have at once; retry when one ends.",
                "rate_limit_exceeded",
                code="too_many_large_requests",
                headers=[(b"retry-after", b"1")],
            )
        if full or self.held >= self.limit:
            raise APIError(
                503,
                f"The edge is serving as many requests of {LARGE_BODY_BYTES // 1024 // 1024} MiB or more as it takes "
                f"at once ({self.limit}); retry.",
                "server_error",
                code="too_many_large_requests",
                headers=[(b"retry-after", b"1")],
            )
        self.held += 1
        if owner is not None:
            self.owners[owner] = held + 1
        return owner

    def give(self, owner: str | None) -> None:
        self.held -= 1
        if owner is None:
            return
        left = self.owners[owner] - 1
        if left:
            self.owners[owner] = left
        else:
            del self.owners[owner]


OWNER_SHARE = 0.25  # of LargeRequests' places, what one key may hold


class Exchange:
    __slots__ = (
        "scope",
        "_receive",
        "_send",
        "_direct",
        "started",
        "finished",
        "status",
        "body_read",
        "body_size",
        "request_id",
        "access",
        "errors",
        "api",
        "via",
        "key",
        "lease",
        "extra_headers",
        "_scope",
        "_task",
        "_left",
        "_closing",
        "_cut",
        "_large",
    )

    def __init__(self, scope, receive, send) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self._direct: DirectBody | bool | None = None  # found at the first write (False: none)
        self.started = False
        self.finished = False
        self.status = 0
        self.body_read = False
        self.body_size = 0  # its body's bytes, once read
        self.request_id = request_id_of(scope)  # also the x-request-id of every response
        self.access = Access()
        self.key = None  # the client's key (edge.keys.Key), when the edge has keys
        self.lease = None  # its admission (edge.keys.Lease), settled when the request ends
        self.extra_headers: list[tuple[bytes, bytes]] = []  # x-ratelimit-*
        self.errors = OPENAI_ERRORS  # the route's error shape (edge.openai.routes sets it)
        self.api = "chat"  # the route's front door: the ``api`` of its access line and metrics (routes sets it)
        self.via = ""  # the edges the request came through (x-iop-via), passed on to its node
        self._scope: trio.CancelScope | None = None  # cancelled when the client leaves (cancel_on_disconnect)
        self._task = None
        self._left = False  # the client left during one of our sends: cancel once it returns
        self._closing = False  # the last write is under way (finished, not yet written)
        self._cut = False  # the client left while the answer was still being written
        self._large: tuple[LargeRequests, str | None] | None = None  # its large body's place (and whose), to its end

    def header(self, name: bytes) -> bytes | None:
        """A request header (None once the response has started: see :meth:`_head`)."""
        for key, value in self.scope["headers"]:
            if key == name:
                return value
        return None

    async def read_body(self, limit: int, large: LargeRequests | None = None, min_rate: int = 0) -> bytes:
        """The whole body, at most ``limit`` bytes; one of ``large``'s places once it is a large
        one (declared so, or grown so as it arrives), held until the request ends. Past
        :data:`BODY_RATE_GRACE_S`, it must have come at ``min_rate`` bytes a second on average
        (as Kestrel's MinRequestBodyDataRate): slower is a 408 (0: no rate)."""
        length = self.header(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else 0
        if declared > limit:
            raise APIError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")
        if large is not None and declared >= LARGE_BODY_BYTES:
            self._take(large)
        parts: list[bytes] = []
        size = 0
        pieces = 0
        started: float | None = None  # (when it first waited for a piece)
        # What the server has queued already (the whole body of a small request,
        # read with its head) is taken without a pass through the scheduler.
        queued = getattr(getattr(self._receive, "__self__", None), "receive_nowait", None)
        while True:
            try:
                if queued is None:
                    raise trio.WouldBlock
                message = queued()
            except trio.WouldBlock:
                message = None
            if message is None:
                if not min_rate:
                    message = await self._receive()
                else:
                    if started is None:
                        started = trio.current_time()
                    with trio.move_on_at(started + max(BODY_RATE_GRACE_S, (size + 1) / min_rate)):
                        message = await self._receive()
                    if message is None:
                        raise APIError(
                            408,
                            f"The request body came slower than {min_rate} bytes a second; send it whole.",
                            code="request_timeout",
                        )
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")
            if size >= LARGE_BODY_BYTES and large is not None and self._large is None:
                self._take(large)
            if not message.get("more_body", False):
                self.body_read = True
                self.body_size = size
                parts.append(chunk)
                return b"".join(parts)
            pieces += 1
            if pieces > MAX_SMALL_PIECES and size < pieces * SMALL_PIECE:
                raise APIError(
                    400,
                    f"The request body came in over {MAX_SMALL_PIECES} pieces averaging under {SMALL_PIECE} "
                    "bytes; send it in larger writes.",
                    code="body_too_fragmented",
                )
            parts.append(chunk)

    def _take(self, large: LargeRequests) -> None:
        """One of ``large``'s places, for this request's key."""
        key = self.key
        scope = self.scope
        full = scope.get(LARGE_PLACE) is False  # (edge.connection sent no 100 Continue for it: the 503 it meant)
        if key is None:
            self._large = (large, large.take(None, full=full))
            scope[LARGE_PLACE] = True
            return
        try:
            self._large = (large, large.take(key.id, key.policy.max_concurrent, full))
            scope[LARGE_PLACE] = True
        except APIError as e:
            if e.status == 429:  # (its share: the key's refusals count it, as the key's other limits)
                key.limited["large_requests"] = key.limited.get("large_requests", 0) + 1
            raise

    def release(self) -> None:
        """The request is over (its handler returned): let go of the server's
        stream. Its disconnect hook holds this exchange (:meth:`cancel_on_disconnect`),
        and the exchange held the stream (its ``send``, its direct writer): a cycle,
        which left every request's objects (its task, coroutine, queue, about 60 in
        all) for the cyclic collector to find, where counting references frees them
        as the request ends."""
        self._send = self._receive = _released
        self._direct = False
        if self._large is not None:
            large, owner = self._large
            large.give(owner)
            self._large = None

    def closed_by_client(self) -> bool:
        """The client has closed its connection, though the server may not have told the app yet
        (:func:`~edge.openai.direct.peer_closed`)."""
        return peer_closed(self.scope, self._send)

    def cancel_on_disconnect(self, scope: trio.CancelScope) -> bool:
        """Have the server's own delivery of ``http.disconnect`` cancel
        ``scope``, with no task waiting for it (:func:`~edge.openai.direct.on_disconnect`);
        False when the server is wired otherwise: run :meth:`watch_disconnect`."""
        if not on_disconnect(self._send, self._client_left):
            return False
        self._scope = scope
        self._task = trio.lowlevel.current_task()
        return True

    def _client_left(self) -> None:
        # Our own last write ended the exchange; but a client gone while that write waits (an
        # HTTP/2 client that closed with a zero window: hypercorn's drain of the stream waited
        # for ever, and the run held its node's slot for good) still cancels it.
        if self.finished and not self._closing:
            return
        # (not during the last write: a client may close once it has read the end it wanted)
        self._cut = self.started and not self.finished
        if trio.lowlevel.current_task() is self._task:
            # Delivered from inside one of our sends (the server found the
            # socket broken): cancelling now would interrupt the server's own
            # bookkeeping, so the scope is cancelled once that send returns.
            self._left = True
        else:
            self._scope.cancel()

    def cut_short(self) -> str | None:
        """Why the client did not get the whole of an answer that had begun: ``write_timeout``
        (the edge closed the connection, its client having taken no bytes for ``write_timeout_s``),
        ``client_gone`` (it left while the answer was being written), or None. Call it before
        :meth:`release`."""
        if not self.started:
            return None
        if getattr(getattr(self._send, "__self__", None), "iop_gave_up", False):  # (an HTTP/2 stream: edge.h2_streams)
            return "write_timeout"
        # (its connection's: edge.send_lock; a connection whose send failed serves no later request)
        return getattr(connection_lock(self._send), "cut", None) or ("client_gone" if self._cut else None)

    def check_disconnect(self, scope: trio.CancelScope) -> None:
        """After the body: cancel ``scope`` if the client's disconnect is
        already queued (it came before :meth:`cancel_on_disconnect`)."""
        queued = getattr(getattr(self._receive, "__self__", None), "receive_nowait", None)
        if queued is None:
            return
        try:
            while True:
                if queued()["type"] == "http.disconnect":
                    scope.cancel()
                    return
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            pass

    async def watch_disconnect(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` when the client goes away (run after the body is read)."""
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    def _body_unread(self) -> bool:
        if self.body_read:
            return False
        length = self.header(b"content-length")
        return (length is not None and length != b"0") or self.header(b"transfer-encoding") is not None

    def _head(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> dict:
        """The ASGI ``http.response.start`` of this response."""
        if self._body_unread():
            # Answered before its body arrived (401, 413, 408): the server will
            # close the connection, so say so, or a client reuses it and fails.
            headers = [*headers, (b"connection", b"close")]
        if self.extra_headers:
            headers = [*headers, *self.extra_headers]
        # A provider's own id (passthrough) stays readable under another name.
        headers = [(b"x-upstream-request-id" if k == b"x-request-id" else k, v) for k, v in headers]
        headers.append((b"x-request-id", self.request_id.encode()))
        if self.body_read:
            # Everything that reads the request's headers has by now (its key, its session, its
            # body's framing), and an open stream would hold them all (an SDK sends a dozen or
            # more): they go. (hypercorn reads them again only to push, over HTTP/2, never asked.)
            self.scope["headers"] = []
        return {"type": "http.response.start", "status": status, "headers": headers}

    def start_now(
        self, status: int, headers: Iterable[tuple[bytes, bytes]], first: bytes
    ) -> tuple[DirectBody, bytes, bool] | None:
        """:meth:`start` without awaiting, when the connection takes the head
        and ``first`` (a chunked 200's first body bytes) in one direct write
        (:meth:`DirectBody.head_and_chunk`: one packet, one wake-up of the
        client). None if nothing was done (call :meth:`start`); else the
        writer, what the kernel did not take (for its ``send_rest``) and
        whether ``first`` was in the write (if not, write it after)."""
        if not first or status != 200 or self._direct is not None:
            return None
        direct = DirectBody.before_head(self.scope, self._send)
        if direct is None:
            return None
        done = direct.head_and_chunk(self._send, self._head(status, headers), first)
        if done is None:
            return None
        self.started = True
        self.status = status
        rest, included = done
        self._direct = direct if included else False
        return direct, rest, included

    async def start(self, status: int, headers: Iterable[tuple[bytes, bytes]], first: bytes = b"") -> None:
        """Send the response's head; with ``first`` (a chunked 200's first
        body bytes), both in one write when the connection allows
        (:meth:`start_now`)."""
        done = self.start_now(status, headers, first)
        if done is not None:
            direct, rest, included = done
            if rest:
                await direct.send_rest(rest)
            if not included:
                await self.write(first)
            return
        self.started = True
        self.status = status
        await self._asgi(self._head(status, headers))
        if first:
            await self.write(first)

    @property
    def direct(self) -> DirectBody | None:
        """The connection's direct writer, once the response's first body
        bytes found one (None: not yet, or the connection has none)."""
        return self._direct or None

    async def write(self, data: bytes) -> None:
        direct = self._direct
        if direct is None:
            direct = self._direct = DirectBody.find(self.scope, self._send) or False
        if direct and data:
            rest = direct.write(data)
            if rest is not None:
                if rest:
                    await direct.send_rest(rest)
                return
        await self._asgi({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, data: bytes = b"") -> None:
        self.finished = self._closing = True
        try:
            direct = self._direct  # a stream's: found at its first write
            if direct:  # the last chunk and the body's end in one write
                rest = direct.end(data)
                if rest is not None:
                    if rest:
                        await direct.send_rest(rest)
                    await close_stream(self._send)
                    return
            await self._send({"type": "http.response.body", "body": data, "more_body": False})
        finally:
            self._closing = False

    async def _asgi(self, message: dict) -> None:
        """Send ``message`` the ASGI way; if the client's disconnect was
        delivered inside that send, cancel the request now that it returned."""
        await self._send(message)
        if self._left:
            self._scope.cancel()

    async def respond(
        self,
        status: int,
        body: bytes,
        content_type: bytes = JSON,
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        await self.start(status, [(b"content-type", content_type), *headers])
        await self.finish(body)

    async def respond_error(self, error: APIError) -> None:
        access = self.access
        if not access.error:  # (a run's: a budget cut, a provider's 429; the console's 429s said nothing of it)
            access.error = error.code or error.type
            if error.status == 429:
                access.refusal = error.message
        await self.respond(error.status, self.errors.body(error), headers=error.headers)
