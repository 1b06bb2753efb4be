"""The edge's and node's garbage-collection policy (iop/gc_policy.py): no automatic
full collection; one when the heap has grown, none while it holds steady, and
cyclic garbage still freed."""

from __future__ import annotations

import gc
import weakref

import trio

from iop import gc_policy
from tests.conftest import BOUND


class _Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_a_full_collection_comes_when_the_heap_grows_and_frees_cycles():
    before = gc.get_threshold()
    try:
        gc_policy.tune()
        assert gc.get_threshold()[2] == gc_policy.NEVER
        garbage = _Cycle()
        alive = weakref.ref(garbage)
        for _ in range(3):  # into the oldest generation, where only a full collection finds it
            gc.collect(1)
        del garbage
        full = gc.get_stats()[2]["collections"]
        stop = trio.Event()
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gc_policy.collect, stop, 0.001, 0.0, 300_000)
                await trio.sleep(0.3)  # a steady heap: no full collection, the cycle waits
                assert gc.get_stats()[2]["collections"] == full
                assert alive() is not None
                grown = [object() for _ in range(400_000)]  # the heap grows by more than the floor
                while gc.get_stats()[2]["collections"] == full:
                    await trio.sleep(0.01)
                stop.set()
        assert alive() is None
        del grown
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
