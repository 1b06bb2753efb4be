"""hypercorn's connection reader without a cancel scope per read.

hypercorn 0.18's ``TCPServer._read_data`` wraps every ``receive_some`` in
``trio.fail_after(config.read_timeout or inf)``: with no read timeout (the
edge sets none: a stream's client may say nothing for as long as it reads)
that is a cancel scope made and torn down per read, which can never fire, on
every client connection and on every node link, and one held by each idle
connection. ``install()`` replaces the method with a loop without the scope
when ``read_timeout`` is None, and leaves hypercorn's own otherwise. On a
plain TCP connection that loop reads the socket itself (:func:`_read_socket`).

Written against hypercorn 0.18 (pyproject pins >=0.18,<0.19); ``install()``
refuses a ``TCPServer`` that does not have the attributes it uses.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable

import trio
from hypercorn.events import Closed, RawData
from hypercorn.trio import tcp_server
from hypercorn.trio.tcp_server import TCPServer

READY_READS = 8  # reads in a row that filled the buffer, before one waits (a schedule point)


async def _read_socket(sock: trio.socket.SocketType, handle, max_recv: int) -> None:
    """Read a plain TCP connection's socket itself until it ends, giving
    ``handle`` each read, then ``Closed()``. trio's ``receive_some`` passes
    the bytes through three more coroutines and a pass through the scheduler
    per read, and an idle connection holds their frames (about 1.4 KB) while
    it waits.

    After a read that emptied the socket (less than ``max_recv``), the next
    one waits for bytes first, rather than try a read that finds nothing; a
    read that filled the buffer is followed by another at once, but every
    :data:`READY_READS`-th one waits first, so a peer that floods the
    connection cannot keep the other tasks from their turn."""
    wait, in_a_row = False, 0
    while sock.fileno() >= 0:  # (< 0: closed by the protocol while it handled the last bytes)
        if wait or in_a_row >= READY_READS:
            wait, in_a_row = False, 0
            try:
                await trio.lowlevel.wait_readable(sock)
            except (trio.ClosedResourceError, OSError):  # closed meanwhile
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
        await handle(RawData(data))
        data = None  # the protocol has it: a connection waiting for bytes holds none of its last read
        if end:
            break
    await handle(Closed())


async def _read_stream(stream: trio.abc.ReceiveStream, handle, max_recv: int) -> None:
    """hypercorn's loop without its cancel scope (TLS)."""
    while True:
        try:
            data = await stream.receive_some(max_recv)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            break
        await handle(RawData(bytes(data)))
        if data == b"":
            break
    await handle(Closed())


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
            return _read_socket(stream.socket, self.protocol.handle, max_recv)
        return _read_stream(stream, self.protocol.handle, max_recv)  # TLS

    _read_data.iop_reads = True  # type: ignore[attr-defined]
    TCPServer._read_data = _read_data  # type: ignore[method-assign]
