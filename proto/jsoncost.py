"""What a JSON text would cost decoded, counted with byte operations that run in C.

Shared by the edge (a client's request body, :mod:`edge.openai.jsonbody`) and
the node (a model server's stream chunks, :mod:`node.adapters.openai`): both
decode JSON that someone else wrote, and in valid JSON two things cost far more
than their bytes:

- nesting, which msgspec and what comes after it recurse on;
- values: an object or array is 2 bytes of text and 60-120 decoded, a string
  or number a few bytes and 30-80 decoded (8 MB of ``{},`` decoded to 170-185 MB).

:func:`decode` is ``msgspec.json.decode`` for JSON that a model wrote (a tool
call's arguments, as text or in a client's history), bounded like one chunk.

Both are counted outside strings with ``bytes.translate``, ``replace``,
``count`` and one regex, never a Python loop per value (:func:`past` only when
the raw counts, brackets and commas anywhere, strings included, pass a bound).
"""

from __future__ import annotations

import re
from array import array
from itertools import accumulate
from typing import Any

import msgspec

_STRUCTURAL = b'"[]{}'
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in _STRUCTURAL)
_STRING = re.compile(rb'"[^"]*"')
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes
_VALUE_MARKS = b'"[]{},'
_NOT_VALUE_MARKS = bytes(b for b in range(256) if b not in _VALUE_MARKS)


def _brackets(body: bytes, dropped: bytes = _NOT_STRUCTURAL) -> bytes:
    """The brackets of the JSON text ``body`` (valid JSON) outside its strings, in order
    (with its commas too, when ``dropped`` keeps them).

    For text that is not valid JSON the count may be wrong, but only past the
    first error, and a decoder stops there."""
    s = body
    if b"\\" in s:
        # Drop escaped backslashes, then escaped quotes: what is left of a
        # string is its quotes and any brackets inside it.
        s = s.replace(b"\\\\", b"").replace(b'\\"', b"")
    s = s.translate(None, dropped)
    # Quotes now alternate open/close: dropping two adjacent ones keeps every
    # bracket on its side of a string; the regex removes the strings left.
    return _STRING.sub(b"", s.replace(b'""', b""))


def nested_deeper_than(body: bytes, limit: int) -> bool:
    """Whether the JSON text ``body`` (valid JSON) nests arrays and objects
    more than ``limit`` levels deep."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    s = _brackets(body)
    if len(s) <= limit:
        return False
    return max(accumulate(array("b", s.translate(_STEP))), default=0) > limit


def past(body: bytes, max_containers: int, max_values: int) -> str | None:
    """Which bound the JSON text ``body`` passes, said as "more than N JSON objects
    and arrays" or "more than N JSON values" (its commas and containers, one more
    than the values at most), or None. Counted outside strings in one pass over the
    text, and only when the raw counts pass a bound: a text shorter than twice the
    smaller bound never costs more than the four counts."""
    containers = body.count(b"[") + body.count(b"{")
    if containers <= max_containers and containers + body.count(b",") < max_values:
        return None
    containers, values = _counts(body)
    return _said(containers > max_containers, values >= max_values, max_containers, max_values)


def _said(containers: bool, values: bool, max_containers: int, max_values: int) -> str | None:
    """Which bound was passed, as a reason reads it."""
    if containers:
        return f"more than {max_containers} JSON objects and arrays"
    if values:
        return f"more than {max_values} JSON values"
    return None


# What one piece of JSON a model wrote (a tool call's arguments) may hold: about 6 MB decoded.
# An honest call has tens of values; one with a table of numbers tens of thousands.
MAX_CONTAINERS = 65_536
MAX_VALUES = 262_144
COUNTED = 2 * MAX_CONTAINERS  # shorter text cannot pass either bound (each is 2 characters at least)


class TooCostly(msgspec.DecodeError):
    """JSON not decoded: its message says which bound it passes ("more than …")."""


def _counts(data: bytes) -> tuple[int, int]:
    """The arrays and objects of the JSON text ``data``, and its values (commas and
    containers: one more than the values at most), outside its strings."""
    containers = data.count(b"[") + data.count(b"{")
    if not containers and b"," not in data:
        return 0, 0
    s = _brackets(data, _NOT_VALUE_MARKS)
    containers = s.count(b"[") + s.count(b"{")
    return containers, containers + s.count(b",")


class Budget:
    """What several pieces of JSON a model wrote may hold together (one turn's tool
    calls: 80 calls each under the bound were 5.1 million arrays), each piece charged
    what it holds as it is decoded."""

    __slots__ = ("containers", "values")

    def __init__(self) -> None:
        self.containers = MAX_CONTAINERS
        self.values = MAX_VALUES

    def decode(self, text: str | bytes) -> Any:
        """``msgspec.json.decode(text)``, or :class:`TooCostly` (a
        :class:`msgspec.DecodeError`) once the pieces so far and this one hold more
        than :data:`MAX_CONTAINERS` arrays and objects or :data:`MAX_VALUES` values
        (8 MB of a tool call's ``[{},{},…]`` arguments decoded to 265 MB)."""
        data = text.encode() if isinstance(text, str) else text
        containers, values = _counts(data)
        why = _said(containers > self.containers, values >= self.values, MAX_CONTAINERS, MAX_VALUES)
        if why:
            raise TooCostly(why)
        self.containers -= containers
        self.values -= values
        return msgspec.json.decode(data)


def decode(text: str | bytes) -> Any:
    """One piece of JSON a model wrote, decoded within the bounds (:meth:`Budget.decode`)."""
    return Budget().decode(text)
