"""Reading exceptions that came out of Trio nurseries."""

from __future__ import annotations


def first_leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside ``exc`` (nurseries wrap what their tasks raise)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
