"""Garbage collection for a long-running edge or node process.

CPython's collector runs a full (oldest generation) collection whenever the
objects that survived earlier collections grew by a quarter: while a process
ramps to thousands of streams that is dozens of full collections, each one
walking every live object, and at 5,000 streams one took up to 0.9 s, a pause
in which no request moved (measured: ``scripts/chaos.py --only ramp-5000``).
A full collection on a clock instead (tried: one a minute) pauses as long,
0.4-0.7 s at 5,000 streams, whether or not there is anything to free. And its
trigger for young collections, a count of allocations minus deallocations,
let 40,000+ young objects pile up behind a quiet count after a ramp: young
and middle collections of 60-100 ms.

Here the objects made at start are frozen (never scanned again), and
collections run from a task of the process (:func:`collect`):

- a young collection every ``TICK_S``, a middle one every ``MIDDLE_EVERY``
  ticks: each scans what was made since the last, so a pause is as long as
  scanning what 50 ms made takes. The automatic young collection remains
  only as a safety net (``SAFETY_THRESHOLD``), for a loop that stops running
  tasks;
- a full collection when the heap has grown by ``GROWTH`` (its size in
  allocated blocks) since the last one: Go's rule (GOGC=100). A ramp from 0
  to N streams costs a handful of full collections (the heap doubles a few
  times) and a steady load none at all, while cyclic garbage that reached the
  oldest generation can at most double the heap before it is freed.

Reference-counted garbage, most of it, is freed at once as always.
"""

from __future__ import annotations

import gc
import sys

import trio

TICK_S = 0.05  # between young collections
MIDDLE_EVERY = 4  # ticks between middle collections; what survives one goes old (tried 0: p99 116-256 ms, worse)
SAFETY_THRESHOLD = 50_000  # allocations minus deallocations that still force a young collection
NEVER = 1 << 30  # collections of a younger generation before an automatic older one: never
GROWTH = 1.0  # a full collection once the heap is (1 + GROWTH) times its size after the last one
FLOOR_BLOCKS = 500_000  # ...and at least this many blocks larger (a small heap collects rarely)
CHECK_EVERY = 20  # ticks between looks at the heap's size (~0.1 ms at 5M blocks)


def tune() -> None:
    """Freeze what exists now and leave collections to :func:`collect`."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(SAFETY_THRESHOLD, NEVER, NEVER)


def heap_blocks() -> int:
    return sys.getallocatedblocks()


async def collect(stop: trio.Event, tick_s: float = TICK_S, growth: float = GROWTH, floor: int = FLOOR_BLOCKS) -> None:
    """Young, middle and full collections as the module says, until ``stop``."""
    base = heap_blocks()
    tick = 0
    while True:
        with trio.move_on_after(tick_s):
            await stop.wait()
            return
        tick += 1
        if tick % CHECK_EVERY == 0 and heap_blocks() > max(base * (1 + growth), base + floor):
            gc.collect(2)
            base = heap_blocks()
        else:
            gc.collect(1 if MIDDLE_EVERY and tick % MIDDLE_EVERY == 0 else 0)
