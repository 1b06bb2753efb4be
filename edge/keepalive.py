"""hypercorn's keep-alive idle timeout without a task per request.

hypercorn 0.18 times an idle HTTP/1.1 connection (between two requests) with
a task: each time a response ends it starts one in the connection's task
group (``TrioSingleTask.restart``: a lock, ``nursery.start``, a cancel
scope), and the next request cancels it (``stop``). Measured, that pair was
7-8% of the edge's CPU per request. ``install()`` gives every connection a
:class:`_IdleTimer` instead: going idle puts the connection in an
insertion-ordered dict with its deadline (every deadline is now + the same
``keep_alive_timeout``, so the dict is in deadline order), a request takes it
out, and one task per server (a trio system task, alive only while some
connection is idle) closes the connections whose deadline passed, checking
each :data:`TICK` seconds. So a connection is closed between
``keep_alive_timeout`` and ``keep_alive_timeout + TICK`` after it went idle,
and, as hypercorn does, at once when the server starts shutting down
(``context.terminated``).

Written against hypercorn 0.18 (pyproject pins >=0.18,<0.19); ``install()``
refuses a ``TCPServer`` that does not have the attributes it uses.
"""

from __future__ import annotations

import contextvars
import functools

import structlog
import trio
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext

log = structlog.get_logger("iop.edge")

TICK = 1.0  # seconds between two looks at the idle connections' deadlines


class _IdleConnections:
    """The idle connections of one hypercorn server (one ``WorkerContext``)."""

    __slots__ = ("context", "deadlines", "running")

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        self.deadlines: dict[TCPServer, float] = {}
        self.running = False

    def add(self, server: TCPServer) -> None:
        deadlines = self.deadlines
        deadlines.pop(server, None)  # re-inserted at the end: the dict stays in deadline order
        deadlines[server] = trio.current_time() + server.config.keep_alive_timeout
        if not self.running:
            self.running = True
            trio.lowlevel.spawn_system_task(self._reap, name="iop.edge.keepalive", context=contextvars.Context())

    async def _reap(self) -> None:
        deadlines = self.deadlines
        terminated = self.context.terminated
        try:
            while deadlines:
                with trio.move_on_after(TICK):
                    await terminated.wait()
                now = trio.current_time()
                closing = terminated.is_set()
                while deadlines:
                    server, deadline = next(iter(deadlines.items()))
                    if deadline > now and not closing:
                        break
                    del deadlines[server]
                    await _close(server)
        finally:
            self.running = False


async def _close(server: TCPServer) -> None:
    """What hypercorn's idle task does when its timeout passes."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(5):
            try:
                await server._initiate_server_close()
            except Exception:  # one connection's failure must not end the timer of the others
                log.exception("closing an idle connection failed")


class _IdleTimer:
    """A connection's ``idle_task``: ``restart`` when it goes idle, ``stop`` when a request comes."""

    __slots__ = ("_server", "_idle")

    def __init__(self, server: TCPServer) -> None:
        self._server = server
        context = server.context
        idle = getattr(context, "iop_idle", None)
        if idle is None:
            idle = context.iop_idle = _IdleConnections(context)
        self._idle: _IdleConnections = idle

    async def restart(self, task_group, action) -> None:  # noqa: ARG002 (hypercorn's signature)
        self._idle.add(self._server)

    async def stop(self) -> None:
        self._idle.deadlines.pop(self._server, None)


def install() -> None:
    """Idempotent."""
    if getattr(TCPServer.__init__, "iop_keepalive", False):
        return
    for name in ("_initiate_server_close", "_close", "protocol_send"):
        if not hasattr(TCPServer, name):
            raise RuntimeError("hypercorn's TCPServer is not the one edge.keepalive was written for: review it")
    hypercorn_init, hypercorn_close = TCPServer.__init__, TCPServer._close

    @functools.wraps(hypercorn_init)  # (keeps the other patches' marks: each stays idempotent)
    def __init__(self: TCPServer, *args, **kwargs) -> None:
        hypercorn_init(self, *args, **kwargs)
        self.idle_task = _IdleTimer(self)

    async def _close(self: TCPServer) -> None:
        self.idle_task._idle.deadlines.pop(self, None)  # a closed connection is nobody's to time
        await hypercorn_close(self)

    __init__.iop_keepalive = True  # type: ignore[attr-defined]
    TCPServer.__init__ = __init__  # type: ignore[method-assign]
    TCPServer._close = _close  # type: ignore[method-assign]
