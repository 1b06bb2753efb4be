"""hypercorn's per-connection send lock (edge/send_lock.py): one holder at a time, handed
to the task that waited longest, and a waiter cancelled before its turn never holds it."""

from __future__ import annotations

import trio
import trio.testing

from edge.send_lock import SendLock
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


async def test_a_cancelled_waiter_never_holds_it_and_the_next_one_does():
    lock = SendLock()
    got: list[str] = []
    first = trio.CancelScope()

    async def send(name: str, scope: trio.CancelScope) -> None:
        with scope:
            async with lock:
                got.append(name)

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
            first.cancel()  # the longest waiter gives up before its turn
            await trio.testing.wait_all_tasks_blocked()
            assert got == [] and lock.locked()
            release.set()
    assert got == ["second"]
    assert not lock.locked()
