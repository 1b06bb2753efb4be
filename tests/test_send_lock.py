"""hypercorn's per-connection send lock (edge/send_lock.py): one holder at a time, handed
to the task that waited longest, and a waiter cancelled in line still takes its turn."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from edge.send_lock import SendLock, send_within
from tests.conftest import BOUND


async def test_one_holder_at_a_time_in_the_order_the_tasks_came():
    lock = SendLock()
    held: list[str] = []
    order: list[str] = []

    async def send(name: str) -> None:
        async with lock:
            held.append(name)
            assert len(held) == 1, held  # nobody else inside
            await trio.sleep(0.01)
            order.append(name)
            held.remove(name)

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            for name in "abcd":
                nursery.start_soon(send, name)
                await trio.testing.wait_all_tasks_blocked()  # each arrives while the lock is held
            assert lock.locked()
    assert order == list("abcd")
    assert not lock.locked()


async def test_a_waiter_cancelled_in_line_still_takes_its_turn_then_sees_the_cancel():
    """A waiter cancelled while it waits (its client left) still gets the lock and sends
    what it holds; the cancel comes at its next checkpoint. hypercorn's HTTP/2 flush waits
    here holding every stream's frames, already taken out of h2: dropping them made the
    client's header decoder fail, losing the whole connection (20 resets a second did it)."""
    lock = SendLock()
    got: list[str] = []
    first = trio.CancelScope()

    async def send(name: str, scope: trio.CancelScope) -> None:
        with scope:
            async with lock:
                got.append(name)  # (what a flush writes)
                await trio.lowlevel.checkpoint()  # the cancel comes here, the lock released on the way out

    async def holder(release: trio.Event) -> None:
        async with lock:
            await release.wait()

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            release = trio.Event()
            nursery.start_soon(holder, release)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(send, "first", first)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(send, "second", trio.CancelScope())
            await trio.testing.wait_all_tasks_blocked()
            first.cancel()  # the longest waiter's request ends while it waits
            await trio.testing.wait_all_tasks_blocked()
            assert got == [] and lock.locked()
            release.set()
    assert got == ["first", "second"] and first.cancelled_caught
    assert not lock.locked()


async def test_a_send_on_a_socket_closed_meanwhile_is_a_closed_resource():
    """A write to a client whose socket another task has closed (the edge's 413 to a client that
    had left): the write timeout's check of the kernel's queue raised ValueError on the closed
    descriptor, logged as an error with its traceback ("Error in ASGI Framework", 107 times in
    an outside soak). It is trio's ClosedResourceError, which the server takes as the end."""
    a, b = trio.socket.socketpair()
    stream = trio.SocketStream(a)
    a.close()
    lock = SendLock(1.0)
    with trio.fail_after(BOUND):
        async with lock:
            with pytest.raises(trio.ClosedResourceError):
                await send_within(lock, stream, b"x" * 100)
    assert lock.cut == "client_gone"
    b.close()
