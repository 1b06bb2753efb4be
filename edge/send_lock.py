"""hypercorn's per-connection send lock, in 48 bytes instead of 330.

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

Written against hypercorn 0.18 (pyproject pins >=0.18,<0.19); ``install()``
refuses a ``TCPServer`` that does not make a ``send_lock``.
"""

from __future__ import annotations

import functools
import inspect

import trio
from hypercorn.trio.tcp_server import TCPServer


class SendLock:
    __slots__ = ("_owner", "_lot")

    def __init__(self) -> None:
        self._owner: trio.lowlevel.Task | None = None
        self._lot: trio.lowlevel.ParkingLot | None = None  # made when a task first has to wait

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


def install() -> None:
    """Idempotent."""
    if getattr(TCPServer.__init__, "iop_send_lock", False):
        return
    if "send_lock" not in inspect.unwrap(TCPServer.__init__).__code__.co_names:
        raise RuntimeError("hypercorn's TCPServer is not the one edge.send_lock was written for: review it")
    hypercorn_init = TCPServer.__init__

    @functools.wraps(hypercorn_init)  # (keeps the other patches' marks: each stays idempotent)
    def __init__(self: TCPServer, *args, **kwargs) -> None:
        hypercorn_init(self, *args, **kwargs)
        self.send_lock = SendLock()

    __init__.iop_send_lock = True  # type: ignore[attr-defined]
    TCPServer.__init__ = __init__  # type: ignore[method-assign]
