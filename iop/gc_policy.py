"""Garbage collection for a long-running edge or node process.

CPython's collector runs a full (oldest generation) collection whenever the
objects that survived earlier collections grew by a quarter: while a process
ramps to thousands of streams that is dozens of full collections, each one
walking every live object, and at 5,000 streams one took up to 0.9 s, a pause
in which no request moved (measured: ``scripts/chaos.py --only ramp-5000``).

Here the objects made at start are frozen (never scanned again), young
collections run as usual (cheap, and they free most cyclic garbage), and the
automatic full collection is replaced by one every ``interval_s`` seconds
from a task of the process: a pause of the same length, but once a period
instead of every quarter of growth. Cyclic garbage that reached the oldest
generation waits at most that long. Reference-counted garbage, most of it,
is freed at once as always.
"""

from __future__ import annotations

import gc

import trio

YOUNG_THRESHOLD = 2000  # allocations minus deallocations before a young collection (CPython: 700)
MIDDLE_THRESHOLD = 20  # young collections before a middle one (CPython: 10)
NEVER = 1 << 30  # middle collections before an automatic full one: never


def tune() -> None:
    """Freeze what exists now and stop automatic full collections."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, NEVER)


async def collect_periodically(stop: trio.Event, interval_s: float = 60.0) -> None:
    """The full collections :func:`tune` took away, one per ``interval_s``, until ``stop``."""
    while True:
        with trio.move_on_after(interval_s):
            await stop.wait()
            return
        gc.collect(2)
