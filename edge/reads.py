"""hypercorn's connection reader without a cancel scope per read.

hypercorn 0.18's ``TCPServer._read_data`` wraps every ``receive_some`` in
``trio.fail_after(config.read_timeout or inf)``: with no read timeout (the
edge sets none: a stream's client may say nothing for as long as it reads)
that is a cancel scope made and torn down per read, which can never fire, on
every client connection and on every node link, and one held by each idle
connection. ``install()`` replaces the method with the same loop without the
scope when ``read_timeout`` is None, and leaves hypercorn's own otherwise.

Written against hypercorn 0.18 (pyproject pins >=0.18,<0.19); ``install()``
refuses a ``TCPServer`` that does not have the attributes it uses.
"""

from __future__ import annotations

import trio
from hypercorn.events import Closed, RawData
from hypercorn.trio import tcp_server
from hypercorn.trio.tcp_server import TCPServer


def install() -> None:
    """Idempotent."""
    hypercorn_read = TCPServer._read_data
    if getattr(hypercorn_read, "iop_reads", False):
        return
    if not hasattr(tcp_server, "MAX_RECV"):
        raise RuntimeError("hypercorn's TCPServer is not the one edge.reads was written for: review it")
    max_recv = tcp_server.MAX_RECV

    async def _read_data(self: TCPServer) -> None:
        if self.config.read_timeout is not None:
            await hypercorn_read(self)
            return
        receive_some, handle = self.stream.receive_some, self.protocol.handle
        while True:
            try:
                data = await receive_some(max_recv)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            await handle(RawData(bytes(data)))
            if data == b"":
                break
        await handle(Closed())

    _read_data.iop_reads = True  # type: ignore[attr-defined]
    TCPServer._read_data = _read_data  # type: ignore[method-assign]
