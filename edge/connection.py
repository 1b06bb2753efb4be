"""hypercorn's per-connection server, hardened: one connection can end only itself.

hypercorn 0.18 runs every connection (``TCPServer.run``) in the server's own
nursery and catches only ``OSError`` there, so any other exception a
connection raises ends the nursery, and with it the listener and every other
connection: the whole edge. One such exception was found from outside: an
edge frozen for a few seconds (SIGSTOP, a VM pause) resumed, closed the node
links whose pings it had missed, and died of ``trio.BusyResourceError``.
``TCPServer._close`` calls ``send_eof`` without the connection's send lock,
and ``send_eof`` holds trio's send-conflict detector across a checkpoint; a
pong or close reply that the connection's reader sent meanwhile, under the
lock, met that detector.

``install()`` patches these:

- ``protocol_send``: a close while the client still sends a body lingers
  (:func:`edge.reads.linger`); a close is shielded (bounded by :data:`CLOSE_S`):
  quart-trio cancelled it as it began, leaving the socket open for good; bytes
  whose ``send_all`` meets ``_close`` in progress are dropped, as if the
  socket had closed under them (it is closing); and a send the peer takes
  nothing of within the connection's write timeout closes the connection
  (:func:`edge.send_lock.send_within`), where hypercorn waited for as long
  as the peer kept it open;
- ``H11Protocol._send_error_response``: a request h11 cannot read (a head
  past 16 KiB still incomplete: 431; not HTTP/1.1: 400) is answered in the OpenAI error
  shape, where hypercorn sent the status with an empty body (an SDK showed
  "Error code: 431" and nothing else); one whose body turns unreadable (a bad
  chunk size) while its handler reads it is that handler's request: its
  request id, and its access line and count say the 400;
- ``H11Protocol._send_h11_event``: no ``100 Continue`` for a request whose
  Content-Length is past ``max_body_bytes`` (its 413 comes without it);
- ``H11Protocol._check_protocol``: ``Upgrade: h2c`` is not honoured (RFC 9113
  dropped it): hypercorn switched to HTTP/2 on any path, past a proxy that
  passes one path's upgrades;
- h11's reader of a client that said its request was the last (``Connection:
  close``, HTTP/1.0): bytes after that request are dropped unread (RFC 9112
  9.6: a server MUST NOT process them; 2.2: it SHOULD ignore a stray CRLF).
  h11 raised on them, and hypercorn answered the request, read whole and
  already running on a node, 400 ``invalid_http``, or cut its stream;
- h11's reading of a client between requests: blank lines are dropped as they
  come (RFC 9112 2.2), where h11 paused on them after a request (hypercorn
  then read no more, and missed the client's close) and raised on them
  before one (a 400 that lost the request behind them);
- ``run``: any other exception a connection raises is logged and ends that
  connection only. ``trio.Cancelled`` (not an ``Exception``) goes on as it
  was. While it runs, the connection is in :data:`OPEN`, for
  :func:`stuck` and :func:`close` at the end of a drain.

Written against hypercorn 0.18 (pyproject pins >=0.18,<0.19); ``install()``
refuses a ``TCPServer`` that lacks what it wraps.
"""

from __future__ import annotations

import functools

import h11
import structlog
import trio
from h11 import _readers as h11_readers
from hypercorn.events import Closed, RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio.tcp_server import TCPServer

from edge.errors import NO_RETRY, error_json
from edge.metrics import OTHER_MODEL
from edge.openai.exchange import LARGE_PLACE, new_request_id, request_id_of
from edge.openai.jsonbody import LARGE_BODY_BYTES
from edge.reads import linger
from edge.send_lock import send_within

log = structlog.get_logger("iop.edge.http")

OPEN: set[TCPServer] = set()  # the connections being served (run)
CLOSE_S = 2.0  # a connection's close (a TLS close_notify to a peer that reads nothing: then abrupt)


def stuck(edge: object) -> list[TCPServer]:
    """The connections ``edge`` serves (its hypercorn config's ``iop_edge``, which
    edge.serve sets) that are stuck at the end of a drain: a write waiting on
    its peer, or an HTTP/1.1 request whose body is still arriving."""
    found = []
    for server in OPEN:
        if getattr(server.config, "iop_edge", None) is not edge:
            continue
        connection = getattr(getattr(server.protocol, "protocol", None), "connection", None)
        if server.send_lock.locked() or (
            type(connection) is h11.Connection and connection.their_state is h11.SEND_BODY
        ):
            found.append(server)
    return found


def close(servers: list[TCPServer]) -> None:
    """Close these connections' sockets now. A write waiting on a peer that
    takes nothing is shielded and bounded only by ``write_timeout_s`` (60 s):
    one client that stopped reading held the edge's exit that long past its
    grace. Closing the socket ends that write, the connection's reader and a
    request still waiting for its body."""
    for server in servers:
        stream = server.stream
        sock = getattr(stream, "socket", None) or getattr(getattr(stream, "transport_stream", None), "socket", None)
        if sock is not None and sock.fileno() >= 0:
            sock.close()  # (trio's: tasks waiting on it get ClosedResourceError)


# What h11 could not read, by the status it hints: the OpenAI error's message and code.
_UNREADABLE = {
    431: ("The request's header fields are too large for the edge to read.", "headers_too_large"),
}
_UNREADABLE_DEFAULT = ("The request is not valid HTTP/1.1.", "invalid_http")


async def _nowhere(_event: object) -> None:
    """Where a stream's events go once the connection answered its request itself (the
    connection then closes, and hypercorn's close ends the stream)."""


def refusal(
    config, status_code: int, message: str, code: str, request_id: str | None = None, client: str | None = None
):
    """The head and body of an answer the connection gives itself (no handler saw the request):
    an OpenAI error, the connection closing. Counted and logged as every request is, unless it
    is a handler's request (``request_id``: its handler's access line and count say it), with
    the peer's address (``client``: an operator looking for who sent it had none)."""
    body = error_json(message, "invalid_request_error", code=code)
    if request_id is None:
        request_id = new_request_id()
        outcome = f"rejected_{status_code}"
        edge = getattr(config, "iop_edge", None)
        if edge is not None:
            edge.metrics.requests.labels("other", OTHER_MODEL, outcome).inc()
        log.info(
            "request", request_id=request_id, client=client, api="other", status=status_code, cause=outcome, error=code
        )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
        (b"x-request-id", request_id.encode()),
        NO_RETRY,  # (the same request gets the same answer)
        *config.response_headers("h11"),
    ]
    return headers, body


async def _send_error_response(self: H11Protocol, status_code: int) -> None:
    message, code = _UNREADABLE.get(status_code, _UNREADABLE_DEFAULT)
    stream = self.stream
    request_id = None
    if isinstance(stream, HTTPStream):  # its body was unreadable: its handler's access line and count say this answer
        stream.send = _nowhere  # the handler's own answer, if it comes now, goes nowhere (not into this one)
        request_id = request_id_of(stream.scope)
        stream.scope["iop.answered"] = (status_code, code)
    peer = str(self.client[0]) if self.client else None
    headers, body = refusal(self.config, status_code, message, code, request_id, peer)
    await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
    await self._send_h11_event(h11.Data(data=body))
    await self._send_h11_event(h11.EndOfMessage())


def install() -> None:
    """Idempotent."""
    if getattr(TCPServer.run, "iop_guarded", False):
        return
    if not all(callable(getattr(TCPServer, name, None)) for name in ("run", "protocol_send", "_close")):
        raise RuntimeError("hypercorn's TCPServer is not the one edge.connection was written for: review it")
    hypercorn_run = TCPServer.run
    hypercorn_protocol_send = TCPServer.protocol_send

    @functools.wraps(hypercorn_protocol_send)
    async def protocol_send(self: TCPServer, event) -> None:
        if not isinstance(event, RawData):
            if type(event) is Closed and linger(self):  # the reader closes it once the client is done
                await self.protocol.handle(Closed())
                return
            if type(event) is Closed:
                # Shielded (bounded): quart-trio cancels the task answering as the request ends,
                # which was often this close, begun as it asked (Connection: close): the socket
                # stayed open, not idle, so no timeout ever closed it.
                with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_S):
                    await self._close()
                await self.protocol.handle(Closed())
                return
            await hypercorn_protocol_send(self, event)
            return
        async with self.send_lock:  # hypercorn's own RawData branch, its send bounded in time
            try:
                await send_within(self.send_lock, self.stream, event.data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
            except trio.BusyResourceError:
                pass  # _close's send_eof holds the stream: the connection is closing, these bytes go nowhere

    @functools.wraps(hypercorn_run)
    async def run(self: TCPServer) -> None:
        OPEN.add(self)
        try:
            await hypercorn_run(self)
        except Exception:
            log.exception("connection failed; closed it, the edge goes on")
        finally:
            OPEN.discard(self)

    protocol_send.iop_guarded = True  # type: ignore[attr-defined]
    run.iop_guarded = True  # type: ignore[attr-defined]
    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]
    if not callable(getattr(H11Protocol, "_send_error_response", None)):
        raise RuntimeError("hypercorn's H11Protocol is not the one edge.connection was written for: review it")
    H11Protocol._send_error_response = _send_error_response  # type: ignore[method-assign]
    TCPServer.run = run  # type: ignore[method-assign]
    hypercorn_send_h11_event = H11Protocol._send_h11_event

    async def _send_h11_event(self: H11Protocol, event) -> None:
        # No `100 Continue` for a body the edge will refuse (RFC 9110 10.1.1): its 413 answers the
        # request's head, and the client sends none of it (it was told to go on, then refused); nor
        # for a large one while every place for one is taken (its 503 as well).
        if type(event) is h11.InformationalResponse and event.status_code == 100 and _declared_unwelcome(self):
            return
        await hypercorn_send_h11_event(self, event)

    H11Protocol._send_h11_event = _send_h11_event  # type: ignore[method-assign]
    hypercorn_check_protocol = H11Protocol._check_protocol

    async def _check_protocol(self: H11Protocol, event: h11.Request) -> None:
        # `Upgrade: h2c` is not honoured (the request is served as HTTP/1.1): hypercorn switched to
        # HTTP/2 on any path, so a proxy that passes only /v1/node/link, upgrades included (the
        # nodes' nginx of the README), let a client through to every route, its own
        # X-Forwarded-For believed (found from outside). HTTP/2 by prior knowledge (its preface,
        # read as a PRI request) and over TLS are served as before.
        if event.method == b"PRI" and not any(name == b"upgrade" for name, _ in event.headers):
            await hypercorn_check_protocol(self, event)

    H11Protocol._check_protocol = _check_protocol  # type: ignore[method-assign]
    if h11_readers.READERS.get((h11.CLIENT, h11.MUST_CLOSE)) is not h11_readers.expect_nothing:
        raise RuntimeError("h11's readers are not the ones edge.connection was written for: review it")
    h11_readers.READERS[(h11.CLIENT, h11.MUST_CLOSE)] = _ignore_the_rest
    h11_next = getattr(h11.Connection, "_extract_next_receive_event", None)
    probe = getattr(h11.Connection(h11.SERVER), "_receive_buffer", None)
    if not callable(h11_next) or type(getattr(probe, "_data", None)) is not bytearray or not hasattr(probe, "_extract"):
        raise RuntimeError("h11's Connection is not the one edge.connection was written for: review it")

    @functools.wraps(h11_next)
    def _extract_next_receive_event(self: h11.Connection):
        # Blank lines between requests are dropped as they come (RFC 9112 2.2: a server SHOULD
        # ignore at least one empty line before a request-line). After a request, h11 took
        # them for the next request coming and paused, and hypercorn read the connection no
        # more until the answer was out: the client's close went unseen, and its run went on
        # (a non-streamed one to its end); before a request, h11 raised, and hypercorn
        # answered 400 and closed, losing the request behind them (found from outside).
        if self.our_role is h11.SERVER and (self.their_state is h11.DONE or self.their_state is h11.IDLE):
            data = self._receive_buffer._data  # noqa: SLF001
            if data and data[0] in _BLANK:  # (an int: no slice made on every event)
                self._receive_buffer._extract(len(data) - len(data.lstrip(b"\r\n")))  # noqa: SLF001
        return h11_next(self)

    h11.Connection._extract_next_receive_event = _extract_next_receive_event  # type: ignore[method-assign]


_BLANK = (13, 10)  # CR, LF


def _ignore_the_rest(buf) -> None:
    """h11's reader of a client in MUST_CLOSE (its last request read whole): what it sends
    after is dropped, not an error (h11's ``expect_nothing`` raised)."""
    buf.maybe_extract_at_most(len(buf))


def _declared_unwelcome(protocol: H11Protocol) -> bool:
    """The request's Content-Length is past the edge's ``max_body_bytes``, or is a large body's
    (:data:`~edge.openai.jsonbody.LARGE_BODY_BYTES`) while every ``max_large_requests`` place
    is taken."""
    edge = getattr(protocol.config, "iop_edge", None)
    scope = getattr(getattr(protocol, "stream", None), "scope", None)
    if edge is None or not isinstance(scope, dict):
        return False
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            if not value.isdigit():
                return False
            length, places = int(value), edge.large_requests
            if length > edge.config.max_body_bytes:
                return True
            if length >= LARGE_BODY_BYTES and places.held >= places.limit and LARGE_PLACE not in scope:
                # Its handler refuses it so, if a place frees meanwhile too: the client, told
                # neither to go on nor no, would wait for a 100 that never came (curl 1 s). (One
                # whose handler took its place first is not refused for its own.)
                scope[LARGE_PLACE] = False
                return True
            return False
    return False
