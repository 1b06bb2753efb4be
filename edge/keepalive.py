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
import itertools
import resource

import structlog
import trio
from hypercorn.events import Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext

log = structlog.get_logger("iop.edge")

TICK = 1.0  # seconds between two looks at the idle connections' deadlines
SHED_AT = 0.8  # of the process's descriptor limit: past it, a new connection closes the longest idle
MAX_OPEN: int | None = None  # (tests) connections past which idle ones are shed; None: SHED_AT of the limit


def _max_open() -> int:
    if MAX_OPEN is not None:
        return MAX_OPEN
    return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0] * SHED_AT)


class _IdleConnections:
    """The idle connections of one hypercorn server (one ``WorkerContext``), and how many it has
    open: past :func:`_max_open`, each connection that goes idle (a new one, before its first
    request, included) closes the two idle longest, as nginx does when it runs out of
    connections, so that idle ones cannot hold every descriptor (found from outside: 20,000
    connections that sent nothing made the edge refuse every new client for as long as they
    were held; reconnecting every 75 s keeps them so)."""

    __slots__ = ("context", "deadlines", "running", "open", "limit", "shed")

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        self.deadlines: dict[TCPServer, float] = {}
        self.running = False
        self.open: set[TCPServer] = set()
        self.limit = _max_open()
        self.shed = 0  # idle connections closed early, for want of descriptors

    async def add(self, server: TCPServer) -> None:
        deadlines = self.deadlines
        deadlines.pop(server, None)  # re-inserted at the end: the dict stays in deadline order
        deadlines[server] = trio.current_time() + server.config.keep_alive_timeout
        if not self.running:
            self.running = True
            trio.lowlevel.spawn_system_task(self._reap, name="iop.edge.keepalive", context=contextvars.Context())
        if len(self.open) > self.limit:
            for old in list(itertools.islice(deadlines, 2)):
                # (popped, not deleted: while one is closed, another connection's add or close
                # may take the second out: a KeyError closed the connection shedding them)
                if old is not server and deadlines.pop(old, None) is not None:
                    self.shed += 1
                    if self.shed == 1 or self.shed % 1000 == 0:
                        log.warning("idle connections closed early: too many open", shed=self.shed, open=len(self.open))
                    await _close(old)

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
        idle.open.add(server)

    async def restart(self, task_group, action) -> None:  # noqa: ARG002 (hypercorn's signature)
        await self._idle.add(self._server)

    async def stop(self) -> None:
        self._idle.deadlines.pop(self._server, None)

    def forget(self) -> None:
        """The connection is closed (or closing): nobody's to time, and no longer open."""
        self._idle.deadlines.pop(self._server, None)
        self._idle.open.discard(self._server)


def install() -> None:
    """Idempotent."""
    if getattr(TCPServer.__init__, "iop_keepalive", False):
        return
    for name in ("_initiate_server_close", "_close", "protocol_send"):
        if not hasattr(TCPServer, name):
            raise RuntimeError("hypercorn's TCPServer is not the one edge.keepalive was written for: review it")
    if not hasattr(H2Protocol, "idle") or not hasattr(ProtocolWrapper, "handle"):
        raise RuntimeError("hypercorn's protocols are not the ones edge.keepalive was written for: review it")
    hypercorn_init, hypercorn_close, hypercorn_run = TCPServer.__init__, TCPServer._close, TCPServer.run
    hypercorn_handle = ProtocolWrapper.handle

    @functools.wraps(hypercorn_handle)
    async def handle(self: ProtocolWrapper, event) -> None:
        """HTTP/2 by prior knowledge (h2c): h11 reads its preface as a request, which takes the
        connection off the idle timer, and an HTTP/2 connection goes back on it only when a
        stream ends: one that opens none was never timed (found from outside: 20,000 such
        connections held every descriptor of the edge). Put back on the timer as it switches."""
        before = self.protocol
        await hypercorn_handle(self, event)
        protocol = self.protocol
        if protocol is not before and type(protocol) is H2Protocol and protocol.idle:
            await self.send(Updated(idle=True))

    @functools.wraps(hypercorn_init)  # (keeps the other patches' marks: each stays idempotent)
    def __init__(self: TCPServer, *args, **kwargs) -> None:
        hypercorn_init(self, *args, **kwargs)
        self.idle_task = _IdleTimer(self)

    async def _close(self: TCPServer) -> None:
        self.idle_task.forget()
        await hypercorn_close(self)

    @functools.wraps(hypercorn_run)  # (keeps edge.connection's mark)
    async def run(self: TCPServer) -> None:
        try:
            await hypercorn_run(self)
        finally:
            # However it ended: a TLS handshake that fails returns before hypercorn's _close (a
            # load balancer's TCP health checks stayed counted open, and past the limit every
            # connection going idle closed two healthy ones, until the edge restarted).
            self.idle_task.forget()

    __init__.iop_keepalive = True  # type: ignore[attr-defined]
    TCPServer.__init__ = __init__  # type: ignore[method-assign]
    TCPServer._close = _close  # type: ignore[method-assign]
    TCPServer.run = run  # type: ignore[method-assign]
    ProtocolWrapper.handle = handle  # type: ignore[method-assign]
