"""hypercorn's connection reader without a cancel scope per read.

hypercorn 0.18's ``TCPServer._read_data`` wraps every ``receive_some`` in
``trio.fail_after(config.read_timeout or inf)``: with no read timeout (the
edge sets none: a stream's client may say nothing for as long as it reads)
that is a cancel scope made and torn down per read, which can never fire, on
every client connection and on every node link, and one held by each idle
connection. ``install()`` replaces the method with a loop without the scope
when ``read_timeout`` is None, and leaves hypercorn's own otherwise. On a
plain TCP connection that loop reads the socket itself (:func:`_read_socket`),
and on a node link it hands the bytes to the websocket stream itself
(:func:`read_as_link`).

The same loop *lingers* on a connection the edge closes while its client
still sends a body (:func:`linger`): an answer given before the body is in
(401, 413, 400) went out, then the socket closed on unread bytes, and the
kernel's reset made the client lose the answer it had not read yet (24 of
40 requests of httpx's async client past ``max_body_bytes`` got a
``ReadError``, the OpenAI SDK an ``APIConnectionError`` it retries). As
nginx's lingering close: the edge sends its FIN after the answer, then
reads and drops what the client still sends, until the client closes,
:data:`LINGER_IDLE_S` pass with nothing, or :data:`LINGER_S` in all. Over
TLS (no FIN without ending the session) the edge only goes on reading and
dropping, within the same bounds: the client, done sending, reads the
answer and closes (40 of 40 httpx async uploads past the limit got a
``ReadError`` over HTTPS before).

Written against hypercorn 0.18 (pyproject pins >=0.18,<0.19); ``install()``
refuses a ``TCPServer`` that does not have the attributes it uses.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable

import h11
import trio
from hypercorn.events import Closed, RawData
from hypercorn.protocol.events import Data
from hypercorn.protocol.h11 import STREAM_ID, H11WSConnection
from hypercorn.trio import tcp_server
from hypercorn.trio.tcp_server import TCPServer

READY_READS = 8  # reads in a row that filled the buffer, before one waits (a schedule point)
LINGER_S = 10.0  # a lingering close reads what the client still sends this long at most (nginx: 30 s)
LINGER_IDLE_S = 2.0  # ... and ends after this long with nothing from it (nginx: 5 s)
LINK_SOCKET = "_iop_link_socket"  # a node link's WSStream: its connection's socket (_socket_of)


def linger(server: TCPServer) -> bool:
    """The protocol closes ``server``'s connection: if its client is still
    sending a request's body (HTTP/1.1), send the FIN now (plain TCP) and have
    the reader drop the rest until the client closes (the module's doc);
    False: close it as hypercorn does."""
    if getattr(server, "iop_linger", False):
        return True
    stream = server.stream
    tls = type(stream) is trio.SSLStream and type(stream.transport_stream) is trio.SocketStream
    if (
        not getattr(TCPServer._read_data, "iop_reads", False)  # (the readers below are the ones that drain)
        or server.config.read_timeout is not None
        or not (tls or type(stream) is trio.SocketStream)
    ):
        return False
    connection = getattr(getattr(server.protocol, "protocol", None), "connection", None)
    if type(connection) is not h11.Connection or connection.their_state is not h11.SEND_BODY:
        return False
    if tls:
        # The reader drains as it reads on; this ends it if the client goes quiet meanwhile.
        server.iop_linger = True
        server.iop_read_ended = trio.Event()
        server._task_group.spawn(_cut_lingering, stream.transport_stream.socket, server.iop_read_ended)
        return True
    sock = stream.socket
    try:
        sock.shutdown(trio.socket.SHUT_WR)  # (the answer is out: the protocol closes after its last send)
    except OSError:
        return False
    server.iop_linger = True
    trio.lowlevel.notify_closing(sock)  # the reader, waiting for the body's next bytes, drains from here
    return True


async def _cut_lingering(sock: trio.socket.SocketType, read_ended: trio.Event) -> None:
    """A lingering TLS connection whose reader has not ended within :data:`LINGER_S`
    (a client gone quiet without closing) is closed under it."""
    with trio.move_on_after(LINGER_S):
        await read_ended.wait()
        return
    if sock.fileno() >= 0:
        sock.close()


async def _drain(stream: trio.abc.ReceiveStream, max_recv: int) -> None:
    """Read and drop what the client still sends (a lingering close)."""
    until = trio.current_time() + LINGER_S
    while (now := trio.current_time()) < until:
        with trio.move_on_at(min(until, now + LINGER_IDLE_S)):
            try:
                if not await stream.receive_some(max_recv):
                    return
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return
            continue
        return  # (nothing from the client for LINGER_IDLE_S)


async def _read_socket(sock: trio.socket.SocketType, handle, max_recv: int, server: TCPServer | None = None) -> None:
    """Read a plain TCP connection's socket itself until it ends, giving
    ``handle`` each read, then ``Closed()``. trio's ``receive_some`` passes
    the bytes through three more coroutines and a pass through the scheduler
    per read, and an idle connection holds their frames (about 1.4 KB) while
    it waits.

    After a read that emptied the socket (less than ``max_recv``), the next
    one waits for bytes first, rather than try a read that finds nothing; a
    read that filled the buffer is followed by another at once, but every
    :data:`READY_READS`-th one waits first, so a peer that floods the
    connection cannot keep the other tasks from their turn. A lingering
    close (:func:`linger`) drains the rest."""
    wait, in_a_row = False, 0
    while sock.fileno() >= 0:  # (< 0: closed by the protocol while it handled the last bytes)
        if server is not None and server.iop_linger:
            await _drain(server.stream, max_recv)
            break
        if wait or in_a_row >= READY_READS:
            wait, in_a_row = False, 0
            try:
                await trio.lowlevel.wait_readable(sock)
            except trio.ClosedResourceError:  # closed meanwhile, or lingering
                continue
            except OSError:
                break
        fd = sock.fileno()
        if fd < 0:
            break
        try:
            data = os.read(fd, max_recv)
        except BlockingIOError:
            wait = True
            continue
        except OSError:  # reset by the peer: as hypercorn's reader, the end
            break
        in_a_row += 1
        wait, end = len(data) < max_recv, not data
        link = server.iop_link if server is not None else None
        if link is not None and data:
            await link.handle(Data(stream_id=STREAM_ID, data=data))
        else:
            await handle(RawData(data))
        data = None  # the protocol has it: a connection waiting for bytes holds none of its last read
        if end:
            break
    await handle(Closed())


async def _read_stream(stream: trio.abc.ReceiveStream, handle, max_recv: int, server: TCPServer | None = None) -> None:
    """hypercorn's loop without its cancel scope (TLS); a lingering close drains the rest."""
    while True:
        if server is not None and server.iop_linger:
            await _drain(stream, max_recv)
            break
        try:
            data = await stream.receive_some(max_recv)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            break
        await handle(RawData(bytes(data)))
        if data == b"":
            break
    ended = getattr(server, "iop_read_ended", None)
    if ended is not None:
        ended.set()  # (a lingering close's watch: done)
    await handle(Closed())


def _read_here(stream) -> tuple[object, TCPServer] | None:
    """The H11Protocol and TCPServer behind the websocket ``stream``, when the
    connection is plain TCP read by :func:`_read_socket` (no read timeout); else None."""
    protocol = getattr(getattr(stream, "send", None), "__self__", None)  # WSStream.send -> H11Protocol.stream_send
    server = getattr(getattr(protocol, "send", None), "__self__", None)  # -> TCPServer.protocol_send
    if (
        type(server) is not TCPServer
        or type(server.stream) is not trio.SocketStream
        or not getattr(TCPServer._read_data, "iop_reads", False)
        or server.config.read_timeout is not None
    ):
        return None
    return protocol, server


def read_as_link(stream) -> bool:
    """From now on, the reader of ``stream``'s connection (a node link's
    WSStream, upgraded from HTTP/1.1 on plain TCP) hands each read to the
    stream itself: hypercorn's H11Protocol only passes a websocket's bytes on
    (copied twice, into a buffer and out). False when the wiring differs."""
    wiring = _read_here(stream)
    if wiring is None:
        return False
    protocol, server = wiring
    connection = getattr(protocol, "connection", None)
    if (
        getattr(server.protocol, "protocol", None) is not protocol
        or getattr(protocol, "stream", None) is not stream
        or type(connection) is not H11WSConnection
        or connection.buffer  # (handled before the app's first receive: never, but then not here)
    ):
        return False
    server.iop_link = stream
    return True


def _socket_of(stream) -> socket.socket | None:
    """The socket under the node link ``stream``'s connection, when :func:`_read_socket`
    reads it, else None."""
    raw = stream.__dict__.get(LINK_SOCKET)
    if raw is not None:
        return raw
    wiring = _read_here(stream)
    raw = getattr(wiring[1].stream.socket, "_sock", None) if wiring else None  # (trio's socket's own: for a peek)
    if type(raw) is not socket.socket:
        return None
    stream.__dict__[LINK_SOCKET] = raw
    return raw


async def hold_reading(stream, until: float) -> None:
    """The reader of the node link ``stream`` waits until ``until`` (trio's
    clock) before it reads on (edge.frame_limit's budgets), unless the node
    leaves meanwhile with nothing unread before its end: then it reads on at
    once, and the link ends. A node that closed its link while the reader
    waited out its throttle stayed linked for the whole wait (2.2 s in an
    outside audit), and its redial was refused meanwhile as a node id already
    linked. What it sent before leaving is still read only after the wait."""
    raw = _socket_of(stream)
    if raw is None or raw.fileno() < 0:
        await trio.sleep_until(until)
        return
    with trio.move_on_at(until):
        try:
            await trio.lowlevel.wait_readable(raw)
        except (trio.ClosedResourceError, OSError):
            return  # closed meanwhile (the link ended here)
        try:
            if not raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return  # the node's end, and nothing before it
        except BlockingIOError:
            pass
        except OSError:
            return  # reset by the node, or closed here
        await trio.sleep_until(until)  # bytes wait: they are read after the wait


def install() -> None:
    """Idempotent."""
    hypercorn_read = TCPServer._read_data
    if getattr(hypercorn_read, "iop_reads", False):
        return
    if not hasattr(tcp_server, "MAX_RECV"):
        raise RuntimeError("hypercorn's TCPServer is not the one edge.reads was written for: review it")
    max_recv = tcp_server.MAX_RECV

    def _read_data(self: TCPServer) -> Awaitable[None]:
        # Not a coroutine: it hands hypercorn the loop's, and a connection holds no frame of its own.
        if self.config.read_timeout is not None:
            return hypercorn_read(self)
        stream = self.stream
        if isinstance(stream, trio.SocketStream):
            return _read_socket(stream.socket, self.protocol.handle, max_recv, self)
        return _read_stream(stream, self.protocol.handle, max_recv, self)  # TLS

    _read_data.iop_reads = True  # type: ignore[attr-defined]
    TCPServer._read_data = _read_data  # type: ignore[method-assign]
    TCPServer.iop_linger = False  # type: ignore[attr-defined]
    TCPServer.iop_link = None  # type: ignore[attr-defined]
