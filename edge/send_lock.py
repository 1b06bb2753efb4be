"""hypercorn's per-connection send lock, in 56 bytes instead of 330.

hypercorn 0.18 gives every connection a ``trio.Lock`` (``TCPServer.send_lock``)
that its sends, and the edge's direct writes (:mod:`edge.openai.direct`,
:mod:`edge.ws`), take around ``send_all``. A trio lock is an attrs object, a
``ParkingLot`` and the lot's ordered dict of waiting tasks, made when the
connection opens and held for as long as it is open, though a connection's
sends almost never wait for each other. ``install()`` gives each connection
a :class:`SendLock` instead: the same ``async with`` and ``locked()``, the same
fairness (the lock is handed to the task that waited longest), and a
``ParkingLot`` only once a second task has had to wait.

Unlike ``trio.Lock`` it does not break when its owner exits while holding it
(trio's "parking lot breaker", a debugging aid): it is only ever held inside
``async with``, which releases it.

And every send under the lock is bounded in time (:func:`send_within`): a
peer that takes no bytes (a client that keeps its connection open and never
reads, or a node that stops reading its link) held the send, shielded, for as
long as it stayed, and with it the request, its run's answer in memory and,
on a node's link, every run of the node. A write that makes no progress
within the connection's write timeout (``write_timeout_s``) now closes the
connection, as nginx's ``send_timeout`` does (on TLS: that takes less than 64
KiB in that time).

Written against hypercorn 0.18 (pyproject pins >=0.18,<0.19); ``install()``
refuses a ``TCPServer`` that does not make a ``send_lock``.
"""

from __future__ import annotations

import fcntl
import functools
import inspect
import sys
import termios

import structlog
import trio
from hypercorn.trio.tcp_server import TCPServer

log = structlog.get_logger("iop.edge.http")

WRITE_TIMEOUT_S = 60.0  # of connections whose hypercorn config names none (see install)
PIECE = 64 * 1024  # on TLS a larger write is sent in pieces, each within the write timeout
STEPS = 8  # a waiting send looks at what the peer took this many times a write timeout


class SendLock:
    __slots__ = ("_owner", "_lot", "write_timeout", "cut")

    def __init__(self, write_timeout: float = WRITE_TIMEOUT_S) -> None:
        self._owner: trio.lowlevel.Task | None = None
        self._lot: trio.lowlevel.ParkingLot | None = None  # made when a task first has to wait
        self.write_timeout = write_timeout  # seconds a send may wait for the peer to take its bytes
        # Why a send failed (its request's access line says it): "write_timeout" (it closed the
        # connection, the peer taking no bytes), "client_gone" (the connection was lost).
        self.cut: str | None = None

    def locked(self) -> bool:
        return self._owner is not None

    async def __aenter__(self) -> None:
        # Not cancellable, unlike trio.Lock's: hypercorn's HTTP/2 flush takes every stream's
        # queued frames out of h2 and then waits here, so a request task cancelled in that wait
        # (its client left) dropped other streams' frames, and the connection's header
        # compression fell out of step (an honest client resetting 20 streams a second lost
        # the whole connection). The cancel is delivered at the caller's next checkpoint.
        task = trio.lowlevel.current_task()
        if self._owner is None and not self._lot:
            self._owner = task
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if self._owner is task:
            raise RuntimeError("attempt to re-acquire an already held SendLock")
        lot = self._lot
        if lot is None:
            lot = self._lot = trio.lowlevel.ParkingLot()
        with trio.CancelScope(shield=True):
            await lot.park()  # woken as the owner: release() hands the lock over

    async def __aexit__(self, *_: object) -> None:
        self.release()

    def release(self) -> None:
        if self._owner is not trio.lowlevel.current_task():
            raise RuntimeError("can't release a SendLock you don't own")
        lot = self._lot
        if lot:
            (self._owner,) = lot.unpark(count=1)
        else:
            self._owner = None


def install(write_timeout: float = WRITE_TIMEOUT_S) -> None:
    """Idempotent. ``write_timeout``: for connections whose hypercorn config
    names none (``iop_write_timeout_s``, which edge.serve sets): under
    hypercorn's own CLI, that of the app's config."""
    global WRITE_TIMEOUT_S
    WRITE_TIMEOUT_S = write_timeout
    if getattr(TCPServer.__init__, "iop_send_lock", False):
        return
    if "send_lock" not in inspect.unwrap(TCPServer.__init__).__code__.co_names:
        raise RuntimeError("hypercorn's TCPServer is not the one edge.send_lock was written for: review it")
    hypercorn_init = TCPServer.__init__

    @functools.wraps(hypercorn_init)  # (keeps the other patches' marks: each stays idempotent)
    def __init__(self: TCPServer, *args, **kwargs) -> None:
        hypercorn_init(self, *args, **kwargs)
        self.send_lock = SendLock(write_timeout_of(self.config))

    __init__.iop_send_lock = True  # type: ignore[attr-defined]
    TCPServer.__init__ = __init__  # type: ignore[method-assign]


def write_timeout_of(config: object) -> float:
    """A connection's write timeout: its hypercorn config's (edge.serve sets it), else the app's."""
    return getattr(config, "iop_write_timeout_s", WRITE_TIMEOUT_S)


async def send_within(lock: object, stream: trio.abc.Stream, data: bytes) -> None:
    """``stream.send_all(data)`` under ``lock`` (held by the caller), shielded: a
    cancel never cuts a write in half. A peer that takes no bytes of it for the
    lock's write timeout has its connection closed (hypercorn's reader then ends
    it: a request's client is gone, a node's link is lost), and
    ``trio.BrokenResourceError`` is raised. On plain TCP the timeout starts again
    whenever the peer takes bytes (:func:`_sent_progressing`); on TLS it bounds
    each :data:`PIECE` bytes (a peer that takes less in the timeout is closed too)."""
    timeout = getattr(lock, "write_timeout", WRITE_TIMEOUT_S)  # (a trio.Lock: edge.send_lock not installed)
    with trio.CancelScope(shield=True):
        try:
            if type(stream) is trio.SocketStream:
                if await _sent_progressing(stream, data, timeout):
                    return
            else:
                view = memoryview(data)
                for start in range(0, len(view) or 1, PIECE):
                    with trio.move_on_after(timeout) as timer:
                        await stream.send_all(view[start : start + PIECE])
                    if timer.cancelled_caught:
                        break
                else:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            _cut(lock, "client_gone")
            raise
        log.warning("connection closed: the peer took no bytes", write_timeout_s=timeout)
        _cut(lock, "write_timeout")
        await trio.aclose_forcefully(stream)
    raise trio.BrokenResourceError("the peer took no bytes within the write timeout")


def _cut(lock: object, why: str) -> None:
    if type(lock) is SendLock and lock.cut is None:
        lock.cut = why


async def _sent_progressing(stream: trio.SocketStream, data: bytes, idle_s: float) -> bool:
    """``stream.send_all(data)``; False when the peer took no bytes for ``idle_s``.

    The kernel wakes a writer only once half of what the socket holds has gone
    (a client reading a steady 4,000 bytes a second was closed as one that took
    nothing): so a send that waits asks the kernel, every :data:`STEPS`-th of
    ``idle_s``, whether what it holds unacknowledged (``SIOCOUTQ``) went down,
    and the silence runs from the last time it did. (Compared once a timeout, a
    client that stopped reading was closed after twice it: its kernel still
    took a few bytes after the write blocked, and that counted for a whole
    timeout more; an outside re-check.)"""
    if stream.socket.did_shutdown_SHUT_WR:
        raise trio.ClosedResourceError("can't send data after sending EOF")
    sock = stream.socket
    view = memoryview(data)
    step = idle_s / STEPS
    silent_since = held = None  # (while a send waits: since when nothing was taken, and what is held)
    while view:
        with trio.move_on_after(step):
            try:
                sent = await sock.send(view)
            except OSError as e:  # (as send_all: a closed socket, or a broken connection)
                if sock.fileno() == -1:
                    raise trio.ClosedResourceError("this socket was already closed") from None
                raise trio.BrokenResourceError(f"socket connection broken: {e}") from e
            view = view[sent:]
            silent_since = held = None
            continue
        now, before, held = trio.current_time(), held, _unacknowledged(sock)
        if silent_since is None:
            silent_since = now - step
        elif held is not None and before is not None and held < before:
            silent_since = now
        if now - silent_since >= idle_s:  # (where the kernel cannot be asked: the send's wait alone)
            return False
    return True


_OUTQ = getattr(termios, "TIOCOUTQ", None)  # (SIOCOUTQ on a TCP socket)
_INT = b"\0\0\0\0"


def _unacknowledged(sock: trio.socket.SocketType) -> int | None:
    """The bytes the kernel holds of what was sent on ``sock`` that the peer has
    not acknowledged (None where that cannot be asked)."""
    if _OUTQ is None:
        return None
    try:
        return int.from_bytes(fcntl.ioctl(sock.fileno(), _OUTQ, _INT), sys.byteorder, signed=True)
    except (OSError, ValueError):  # (ValueError: closed, its fileno -1; the send says so)
        return None
