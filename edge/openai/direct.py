"""A shorter way from a streaming response to its socket (hypercorn, HTTP/1.1, plain TCP).

Through ASGI, each body write of a stream goes HTTPStream.app_send ->
H11Protocol.stream_send -> h11's chunk framing -> TCPServer.protocol_send (a
lock, a shielded cancel scope) -> SocketStream.send_all: about half of the
edge's CPU per streamed token (py-spy, 200 paced streams). For the writes in
the middle of a chunked response, :class:`DirectBody` frames the chunk itself
and hands it to the kernel at once when nothing else is being sent on the
connection: one ``send``, no task switch. Everything else goes the ASGI way:
the head and the last write, a body with a Content-Length (passthrough), a
connection busy with another send, a write the kernel takes only part of (its
rest is sent under hypercorn's own lock, as hypercorn would), a closed or
failing socket, HTTP/1.0, TLS, HTTP/2, another server. h11 counts no bytes
of a chunked body, so chunks it did not frame leave its state as it was.

:func:`on_disconnect` lets hypercorn's own delivery of ``http.disconnect``
cancel a request, so that no task per request waits on ``receive`` for it (a
task, its coroutine and a nursery: 2.4 KB of an idle stream's edge memory).

Both rely on how hypercorn 0.18 wires a connection (the objects behind the
ASGI ``send`` callable); each checks every link it follows and does nothing
when anything differs, so a change there costs speed, never bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import h11
import trio


class DirectBody:
    __slots__ = ("_socket", "_stream", "_lock", "_h11")

    def __init__(self, stream: trio.SocketStream, lock: Any, connection: h11.Connection) -> None:
        self._stream = stream
        self._socket = stream.socket
        self._lock = lock
        self._h11 = connection

    @classmethod
    def find(cls, scope: dict, send: Any) -> DirectBody | None:
        """The connection behind hypercorn's ASGI ``send``, if it is one this can
        write to: call it once the response's head has gone."""
        if scope.get("type") != "http" or scope.get("http_version") != "1.1":
            return None
        try:
            protocol = send.__self__.send.__self__  # HTTPStream.app_send -> H11Protocol.stream_send
            server = protocol.send.__self__  # -> TCPServer.protocol_send
            stream, lock, connection = server.stream, server.send_lock, protocol.connection
        except AttributeError:
            return None
        if type(protocol).__name__ != "H11Protocol" or not isinstance(connection, h11.Connection):
            return None
        if type(stream) is not trio.SocketStream or not hasattr(lock, "locked"):
            return None
        # Only a chunked body (not one with a Content-Length, nor HTTP/1.0's close-delimited one).
        if (
            connection.our_state is not h11.SEND_BODY
            or type(getattr(connection, "_writer", None)).__name__ != "ChunkedWriter"
        ):
            return None
        return cls(stream, lock, connection)

    def write(self, data: bytes) -> bytes | None:
        """Send ``data`` as one chunk, now: None if nothing was sent (send it
        the ASGI way), else what the kernel did not take (b"" when all),
        which must go out with :meth:`send_rest` before anything else."""
        if self._lock.locked() or self._h11.our_state is not h11.SEND_BODY:
            return None
        fd = self._socket.fileno()
        if fd < 0:  # closed: hypercorn's own path knows what to do
            return None
        framed = b"%x\r\n%b\r\n" % (len(data), data)
        try:
            sent = os.write(fd, framed)
        except OSError:  # full (EAGAIN) or broken: nothing was written
            return None
        return framed[sent:]

    async def send_rest(self, rest: bytes) -> None:
        """The rest of a chunk the kernel took part of, as hypercorn sends."""
        async with self._lock:
            try:
                with trio.CancelScope(shield=True):
                    await self._stream.send_all(rest)
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

    async def app_put(message: dict) -> None:
        if message.get("type") == "http.disconnect":
            callback()
        await put(message)

    stream.app_put = app_put
    return True
