"""A shorter way from a streaming response to its socket (hypercorn, HTTP/1.1, plain TCP).

Through ASGI, each body write of a stream goes HTTPStream.app_send ->
H11Protocol.stream_send -> h11's chunk framing -> TCPServer.protocol_send (a
lock, a shielded cancel scope) -> SocketStream.send_all: about half of the
edge's CPU per streamed token (py-spy, 200 paced streams). For the writes in
the middle of a chunked response, :class:`DirectBody` frames the chunk itself
and hands it to the kernel at once when nothing else is being sent on the
connection: one ``send``, no task switch. A stream's head goes out with its
first chunk in one write (:meth:`DirectBody.head_and_chunk`: h11 makes the
head, as hypercorn would have it, and hypercorn's stream is moved on as its
own start would), and its last chunk with the end of the body in one write
(:meth:`DirectBody.end`: h11 and hypercorn's stream are moved on as their
own end of a body would; one ``send`` and one packet where the ASGI way took
two sends, a lock and h11's writer). Everything else goes the ASGI way: a
body with a Content-Length (passthrough), a connection busy with another
send, a write the kernel takes only part of (its rest is sent under
hypercorn's own lock, as hypercorn would), a closed or failing socket,
HTTP/1.0, TLS, HTTP/2, another server. h11 counts no bytes of a chunked body,
so chunks it did not frame leave its state as it was.

:func:`on_disconnect` lets hypercorn's own delivery of ``http.disconnect``
cancel a request, so that no task per request waits on ``receive`` for it (a
task, its coroutine and a nursery: 2.4 KB of an idle stream's edge memory).

All of it relies on how hypercorn 0.18 wires a connection (the objects behind the
ASGI ``send`` callable); each checks every link it follows and does nothing
when anything differs, so a change there costs speed, never bytes.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import h11
import trio
from hypercorn.protocol.events import StreamClosed

from edge.send_lock import send_within


class DirectBody:
    __slots__ = ("_socket", "_raw", "_stream", "_lock", "_h11", "_protocol")

    def __init__(
        self, stream: trio.SocketStream, raw: socket.socket, lock: Any, connection: h11.Connection, protocol: Any
    ) -> None:
        self._stream = stream
        self._socket = stream.socket
        self._raw = raw  # the stdlib socket under trio's (for send flags)
        self._lock = lock
        self._h11 = connection
        self._protocol = protocol

    @classmethod
    def _wired(cls, scope: dict, send: Any) -> DirectBody | None:
        if scope.get("type") != "http" or scope.get("http_version") != "1.1":
            return None
        protocol = getattr(
            getattr(send, "__self__", None), "send", None
        )  # HTTPStream.app_send -> H11Protocol.stream_send
        wired = plain_tcp(protocol)
        if wired is None or not isinstance(protocol.__self__.connection, h11.Connection):
            return None
        return cls(*wired, protocol.__self__.connection, protocol.__self__)

    @classmethod
    def find(cls, scope: dict, send: Any) -> DirectBody | None:
        """The connection behind hypercorn's ASGI ``send``, if it is one this can
        write to: call it once the response's head has gone."""
        direct = cls._wired(scope, send)
        # Only a chunked body (not one with a Content-Length, nor HTTP/1.0's close-delimited one).
        if direct is None or not direct._chunked():
            return None
        return direct

    @classmethod
    def before_head(cls, scope: dict, send: Any) -> DirectBody | None:
        """Like :meth:`find`, before the response's head: for :meth:`head_and_chunk`."""
        direct = cls._wired(scope, send)
        stream = getattr(send, "__self__", None)
        if direct is None or type(stream).__name__ != "HTTPStream" or getattr(stream, "response", None) is not None:
            return None
        if direct._h11.our_state is not h11.SEND_RESPONSE or getattr(stream.state, "name", None) != "REQUEST":
            return None
        return direct

    def _chunked(self) -> bool:
        connection = self._h11
        return (
            connection.our_state is h11.SEND_BODY
            and type(getattr(connection, "_writer", None)).__name__ == "ChunkedWriter"
        )

    def head_and_chunk(self, send: Any, message: dict, data: bytes) -> tuple[bytes, bool] | None:
        """The response's head (``message``, an ASGI ``http.response.start``
        of a 200 with no Content-Length) and ``data`` as its body's first
        chunk, in one write to the kernel, framed as hypercorn's HTTPStream and
        H11Protocol would (its date and server headers, ``connection: close``
        at the keep-alive limit); hypercorn's stream is left as after its own
        start. None if nothing was done (send both the ASGI way), else what
        the kernel did not take (for :meth:`send_rest`) and whether ``data``
        was in it (h11 chose a framing other than chunked: send it the ASGI
        way after the rest)."""
        if self._lock.locked() or self._h11.our_state is not h11.SEND_RESPONSE or self._socket.fileno() < 0:
            return None
        stream, protocol = send.__self__, self._protocol
        config = protocol.config
        headers = [(bytes(k).strip(), bytes(v).strip()) for k, v in message["headers"]]
        headers += config.response_headers("h11")
        if protocol.keep_alive_requests >= config.keep_alive_max_requests:
            headers.append((b"connection", b"close"))
        head = _send_head(self._h11, message["status"], headers)
        if head is None:
            try:
                head = self._h11.send(h11.Response(status_code=message["status"], headers=headers))
            except h11.LocalProtocolError:
                return None  # nothing changed: the ASGI way raises it where hypercorn does
        # What hypercorn reads of it later: the status (and "trailers", never asked for here). The
        # headers, which every open stream would hold (0.4 KB), serve only hypercorn's access log,
        # which the edge turns off (edge.serve); under hypercorn's CLI with one, its response-header
        # fields of a stream show "-".
        stream.response = {"type": message["type"], "status": message["status"]}
        stream.state = type(stream.state).RESPONSE
        chunked = self._chunked()
        framed = head + b"%x\r\n%b\r\n" % (len(data), data) if chunked else head
        try:
            sent = self._raw.send(framed)
        except OSError:  # full (EAGAIN) or broken: nothing was written
            sent = 0
        return framed[sent:], chunked

    def write(self, data: bytes) -> bytes | None:
        """Send ``data`` as one chunk, now: None if nothing was sent (send it
        the ASGI way), else what the kernel did not take (b"" when all),
        which must go out with :meth:`send_rest` before anything else. Nothing
        to send is nothing written (an empty chunk would end the body)."""
        if not data:
            return b""
        if self._lock.locked() or self._h11.our_state is not h11.SEND_BODY:
            return None
        if self._socket.fileno() < 0:  # closed: hypercorn's own path knows what to do
            return None
        framed = b"%x\r\n%b\r\n" % (len(data), data)
        try:
            sent = self._raw.send(framed)
        except OSError:  # full (EAGAIN) or broken: nothing was written
            return None
        return framed[sent:]

    def end(self, data: bytes) -> bytes | None:
        """``data`` (if any) as the body's last chunk and the chunked body's
        end (``0\r\n\r\n``, no trailers), in one write, now; h11 is moved
        on as its ``send(EndOfMessage())`` would (DONE, or MUST_CLOSE when
        the connection is not kept alive). None if nothing was done (end it
        the ASGI way); else what the kernel did not take, for
        :meth:`send_rest`. Then hypercorn's stream must be closed
        (:func:`close_stream`)."""
        connection = self._h11
        if self._lock.locked() or not self._chunked() or self._socket.fileno() < 0:
            return None
        try:
            connection._process_event(connection.our_role, h11.EndOfMessage())  # noqa: SLF001 (as send does)
        except h11.LocalProtocolError:
            return None  # refused before any state changed: the ASGI way raises it as it would
        framed = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"
        try:
            sent = self._raw.send(framed)
        except OSError:  # full (EAGAIN) or broken: all of it is the rest, sent under the lock
            sent = 0
        return framed[sent:]

    async def send_rest(self, rest: bytes) -> None:
        """The rest of a chunk the kernel took part of, as hypercorn sends."""
        await send_locked(self._lock, self._stream, rest)


_NAME = getattr(h11._headers, "_field_name_re", None)  # noqa: SLF001 (h11 0.16's own header grammar)
_VALUE = getattr(h11._headers, "_field_value_re", None)  # noqa: SLF001
_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection"))


def _send_head(connection: h11.Connection, status: int, headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """``connection.send(h11.Response(status_code=status, headers=headers))``
    for a 200 with no framing headers to an HTTP/1.1 POST (a stream's head):
    the same bytes and the same state after, with less work (h11 checks
    every header against its grammar twice and rebuilds the event between;
    measured, the edge's CPU per 4-token stream went from 1,150 to 1,122
    µs). None when this does not apply (h11 does it). Tested byte for byte
    against h11.

    The only framing header allowed is hypercorn's ``connection: close``
    appended last (its keep-alive request limit)."""
    if (
        _NAME is None
        or _VALUE is None
        or status != 200  # (h11 frames a 204 or 304 by length, and so the answer to a HEAD or CONNECT)
        or connection.our_role is not h11.SERVER
        or connection.their_http_version != b"1.1"
        or connection._request_method != b"POST"  # noqa: SLF001
        or not hasattr(connection, "_process_event")
    ):
        return None
    name_ok, value_ok = _NAME.fullmatch, _VALUE.fullmatch
    last = len(headers) - 1
    for i, (name, value) in enumerate(headers):
        if type(name) is not bytes or type(value) is not bytes or not name_ok(name) or not value_ok(value):
            return None
        if name.lower() in _FRAMING and not (i == last and name == b"connection" and value == b"close"):
            return None
    headers = [*headers, (b"Transfer-Encoding", b"chunked")]
    if not connection._cstate.keep_alive:  # noqa: SLF001 (the request said close: so does h11, last)
        headers = [(n, v) for n, v in headers if n != b"connection"]
        headers.append((b"Connection", b"close"))
    event = h11.Response(status_code=status, headers=headers, _parsed=True)
    try:
        connection._process_event(connection.our_role, event)  # noqa: SLF001 (what send does, but write)
    except h11.LocalProtocolError:
        return None  # refused before any state changed: h11's own send raises it as it would
    return b"HTTP/1.1 %d \r\n%b\r\n" % (status, b"".join([b"%s: %s\r\n" % pair for pair in headers]))


async def close_stream(send: Any) -> None:
    """What hypercorn 0.18's ``HTTPStream._send_closed`` does after the end of
    the body it sent (:meth:`DirectBody.end` sent it): the stream is closed,
    its access line logged and the connection moved on to its next request
    (or closed)."""
    stream = send.__self__
    stream.state = type(stream.state).CLOSED
    await stream.config.log.access(stream.scope, stream.response, time.time() - stream.start_time)
    await stream.send(StreamClosed(stream_id=stream.stream_id))


def peer_closed(scope: dict, send: Any) -> bool:
    """The request's client closed its connection, by what the kernel holds now (HTTP/1.1 on
    plain TCP: a peek, no read; False otherwise, or with bytes still unread, or read and not yet
    taken: a pipelined request)."""
    direct = DirectBody._wired(scope, send)  # noqa: SLF001
    if direct is None or direct._h11.trailing_data[0]:  # noqa: SLF001
        # (a pipelined request read already: its client may have half-closed after it, and waits)
        return False
    try:
        return direct._raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""  # noqa: SLF001
    except BlockingIOError:
        return False
    except OSError:  # (reset)
        return True


def connection_lock(send: Any) -> Any:
    """hypercorn's send lock of the connection behind an ASGI ``send`` (its
    ``HTTPStream.app_send`` -> the protocol's ``stream_send`` -> ``TCPServer.protocol_send``),
    HTTP/1.1 or HTTP/2, plain or TLS; None when it is wired otherwise."""
    protocol = getattr(getattr(getattr(send, "__self__", None), "send", None), "__self__", None)
    return getattr(getattr(getattr(protocol, "send", None), "__self__", None), "send_lock", None)


def plain_tcp(stream_send: Any) -> tuple[trio.SocketStream, socket.socket, Any] | None:
    """The socket stream, its stdlib socket and hypercorn's send lock behind an
    ``H11Protocol.stream_send`` (what an HTTP or websocket stream sends through),
    when the connection is plain TCP; else None."""
    protocol = getattr(stream_send, "__self__", None)
    if type(protocol).__name__ != "H11Protocol":
        return None
    try:
        server = protocol.send.__self__  # -> TCPServer.protocol_send
        stream, lock = server.stream, server.send_lock
    except AttributeError:
        return None
    if type(stream) is not trio.SocketStream or not hasattr(lock, "locked"):
        return None
    raw = getattr(stream.socket, "_sock", None)
    if type(raw) is not socket.socket:
        return None
    return stream, raw, lock


async def send_locked(lock: Any, stream: trio.SocketStream, data: bytes) -> None:
    """``data`` under hypercorn's send lock, shielded, as ``TCPServer.protocol_send``
    sends (for the rest of a write the kernel took only part of)."""
    async with lock:
        try:
            await send_within(lock, stream, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the connection is gone: hypercorn's reader tells the app


def on_disconnect(send: Any, callback: Callable[[], object]) -> bool:
    """Call ``callback`` when hypercorn delivers the request's
    ``http.disconnect``, from hypercorn's own task, so that no task of the
    request's waits on ``receive`` for it: ``send`` is hypercorn 0.18's
    ``HTTPStream.app_send``, whose stream hands each ASGI message to the app
    through its ``app_put``; this wraps that. False (nothing changed) when
    the wiring differs."""
    stream = getattr(send, "__self__", None)
    if type(stream).__name__ != "HTTPStream":
        return False
    put = getattr(stream, "app_put", None)
    if put is None or getattr(stream, "closed", True):
        return False

    stream.app_put = _HearDisconnect(put, callback)
    return True


class _HearDisconnect:
    """hypercorn's ``app_put``, calling back first on ``http.disconnect`` (an
    object, not a closure: a third of the memory, held by every open stream)."""

    __slots__ = ("_put", "_callback")

    def __init__(self, put: Callable[[dict], Any], callback: Callable[[], object]) -> None:
        self._put = put
        self._callback = callback

    def __call__(self, message: dict) -> Any:  # the put's awaitable, which hypercorn awaits
        if message.get("type") == "http.disconnect":
            self._callback()
        return self._put(message)
