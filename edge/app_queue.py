"""hypercorn's queue of ASGI messages to the app, without a trio memory channel.

hypercorn 0.18 hands each request's (and each websocket's) messages to the
app through ``trio.open_memory_channel(config.max_app_queue_size)``
(``TaskGroup.spawn_app``): a channel state, two channel ends, their
statistics and the ordered dicts of waiting tasks, about 1.7 KB that every
open stream holds until it ends, and each ``send`` is two passes through
trio's checkpoint machinery in the connection's reader. ``install()`` gives
``spawn_app`` an :class:`AppQueue` instead: the same bound (a sender waits
while it is full), the same order, the same ``receive``/``receive_nowait``
the edge's own code uses (:meth:`Exchange.read_body`, :class:`RawWebsocket`),
in about 300 bytes. A ``send`` that does not have to wait is not a
schedule point: the reader reaches one at its next read. The app is called
without ``ASGIWrapper``'s coroutine between (:class:`_Direct`).

Written against hypercorn 0.18 (pyproject pins >=0.18,<0.19); ``install()``
refuses a ``TaskGroup`` that does not have what it uses.
"""

from __future__ import annotations

import inspect

import outcome
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.trio import task_group
from hypercorn.trio.task_group import TaskGroup

_ENDS = frozenset(("http.disconnect", "websocket.disconnect"))


class AppQueue:
    """A bounded first-in first-out queue with one receiver (the app) and one
    sender (the connection's reader); either may wait, and be cancelled while
    it waits without losing or duplicating a message."""

    __slots__ = ("_items", "_capacity", "_receiver", "_senders")

    def __init__(self, capacity: int) -> None:
        self._items: list = []
        self._capacity = max(capacity, 0)
        self._receiver: trio.lowlevel.Task | None = None  # the task waiting in receive
        self._senders: list | None = None  # [task, message] of each waiting send, in order

    def receive_nowait(self):
        """The next message; ``trio.WouldBlock`` if there is none."""
        items, senders = self._items, self._senders
        if items:
            message = items.pop(0)
            if senders:  # room now: the first waiting sender's message joins the queue
                task, waiting = senders.pop(0)
                items.append(waiting)
                trio.lowlevel.reschedule(task)
            return message
        if senders:  # (a queue of no capacity) the sender hands it over
            task, message = senders.pop(0)
            trio.lowlevel.reschedule(task)
            return message
        raise trio.WouldBlock

    async def receive(self):
        """The next message, waiting for one. A checkpoint, as trio's receive."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            message = self.receive_nowait()
        except trio.WouldBlock:
            pass
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return message
        if self._receiver is not None:
            raise trio.BusyResourceError("another task is already receiving from this queue")
        self._receiver = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._receiver = None
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    async def send(self, message) -> None:
        """Queue ``message``; waits while the queue is full. The stream's end
        (``http.disconnect``, ``websocket.disconnect``) never waits, and
        releases any sender still waiting: its message goes nowhere, the
        stream is over. (Else an app that answered before reading a body
        its client was still sending, a 413, deadlocked: hypercorn hands the
        disconnect over from inside the app's last send, the full queue
        waited for the app, and the connection never closed.)"""
        receiver = self._receiver
        if receiver is not None:  # the app waits on an empty queue: it takes this one directly
            self._receiver = None
            trio.lowlevel.reschedule(receiver, outcome.Value(message))
            return
        if type(message) is dict and message.get("type") in _ENDS:
            self._items.append(message)
            senders, self._senders = self._senders, None
            for task, _ in senders or ():
                trio.lowlevel.reschedule(task)
            return
        if len(self._items) < self._capacity and not self._senders:
            self._items.append(message)
            return
        if self._senders is None:
            self._senders = []
        entry = [trio.lowlevel.current_task(), message]
        self._senders.append(entry)

        def abort(_: object) -> trio.lowlevel.Abort:
            senders = self._senders
            del senders[next(i for i, e in enumerate(senders) if e is entry)]
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


class _Direct:
    """hypercorn's ``ASGIWrapper`` calls the app from a coroutine of its own,
    one more frame that every open stream holds (288 bytes): this calls it
    as the wrapper would, handing back the app's coroutine itself. An app
    whose ``asgi_app`` has an ``iop_dispatch`` (the edge's routes: a plain
    function that returns the request's coroutine) is called through that,
    which spares the routes' own frame too."""

    __slots__ = ("app",)

    def __init__(self, app) -> None:
        self.app = getattr(getattr(app, "asgi_app", None), "iop_dispatch", app)

    def __call__(self, scope, receive, send, sync_spawn, call_soon):  # noqa: ARG002 (the wrapper's signature)
        return self.app(scope, receive, send)


def install() -> None:
    """Idempotent."""
    if getattr(TaskGroup.spawn_app, "iop_app_queue", False):
        return
    if not hasattr(task_group, "_handle") or list(inspect.signature(TaskGroup.spawn_app).parameters) != [
        "self",
        "app",
        "config",
        "scope",
        "send",
    ]:
        raise RuntimeError("hypercorn's TaskGroup is not the one edge.app_queue was written for: review it")
    handle = task_group._handle  # noqa: SLF001

    async def spawn_app(self: TaskGroup, app, config, scope, send):
        queue = AppQueue(config.max_app_queue_size)
        if type(app) is ASGIWrapper:
            app = app.__dict__.get("iop_direct") or app.__dict__.setdefault("iop_direct", _Direct(app.app))
        self._nursery.start_soon(  # noqa: SLF001
            handle, app, config, scope, queue.receive, send, trio.to_thread.run_sync, trio.from_thread.run
        )
        return queue.send

    spawn_app.iop_app_queue = True  # type: ignore[attr-defined]
    TaskGroup.spawn_app = spawn_app  # type: ignore[method-assign]
