"""The grace of a drain, shared by the edge and the node: wait for the work in flight
to end, for at most the grace, or until a second signal says not to wait."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


async def within_grace(seconds: float, done: Callable[[], Awaitable[object]], hurry: trio.Event) -> None:
    """``await done()`` for at most ``seconds``, or until ``hurry`` is set."""
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:

            async def hurried() -> None:
                await hurry.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(hurried)
            await done()
            nursery.cancel_scope.cancel()
