"""One object per trio run, made at its first use: a limiter, a lock or a parking lot
belongs to the run that made it (tests start one run after another in a process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")


def per_run(var: trio.lowlevel.RunVar[T], make: Callable[[], T]) -> T:
    """``var``'s value in this run, ``make()`` the first time."""
    try:
        return var.get()
    except LookupError:
        value = make()
        var.set(value)
        return value
