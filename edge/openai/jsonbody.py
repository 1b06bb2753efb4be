"""A client's JSON body decoded at a cost bounded by its size.

Some things in valid JSON cost far more than their bytes. Each is checked
before decoding with byte operations that run in C (``bytes.translate``,
``replace``, ``count``, one regex), never a Python loop per value; the
counting is :mod:`proto.jsoncost`, which the node uses on a model server's
chunks too:

- Nesting. msgspec decodes ~1,000 levels before a ``RecursionError``, and
  what comes after it on the request path (msgpack for the run frame, JSON
  Schema checks, the node's own decoding) recurses too. A body nested deeper
  than :data:`MAX_JSON_DEPTH` levels (the body's own object is level 1) is
  refused. The check counts brackets outside strings; measured: nothing for
  a body with at most 64 brackets, ~8 ms for 8 MB of text, ~170 ms for 8 MB
  of nothing but brackets (whose decoding alone takes 0.8-1.8 s).
- Arrays and objects. Each is 2 bytes of text and 60-120 bytes decoded: 8 MB
  of ``{},`` decoded to 170-185 MB, held for the whole run, and held the
  event loop 0.6-1.2 s. A body with more than :data:`MAX_JSON_CONTAINERS`
  (counted outside strings, with the same byte operations, before decoding)
  is refused.
- Values. A string or number is a few bytes of text and 50-80 decoded: 30
  bodies of 8 MB, each an array of two million ``"a"``, took the edge to
  4.8 GB and held its loop 5-22 s (a node's link timed out). A body of more
  than :data:`MAX_JSON_VALUES` values (its commas and containers, counted
  outside strings as above) is refused.
- Floats with a large exponent. msgspec's exact fallback for literals like
  ``1e299`` takes ~10-15 µs each: 8 MB of them held the event loop for ~15 s.
  A body holding more than :data:`LONG_EXPONENTS_EXACT` positive exponents of
  two or more digits is decoded with Python's ``float`` instead (~0.5 µs each,
  the same values; 8 MB: ~0.8 s). Counting them costs a ``translate`` of the
  body (~8 ms for 8 MB) and a count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from proto import jsoncost

MAX_JSON_DEPTH = 64
# A body of this size or more is a large one: decoded one at a time in the process
# (edge.openai.request), and one of the edge's max_large_requests in flight (edge.openai.exchange).
LARGE_BODY_BYTES = 1024 * 1024
# Far past a real request: 2,048 messages of 10,000 parts, tool schemas of 20,000 nodes in all.
MAX_JSON_CONTAINERS = 250_000
# Values of any kind: 25-40 MB decoded at most (a prompt of 500,000 token ids is one too many).
MAX_JSON_VALUES = 500_000


def too_large(body: bytes) -> str | None:
    """Why the JSON text ``body`` would cost far more decoded than its size, or None:
    more than :data:`MAX_JSON_CONTAINERS` arrays and objects (each 60-120 bytes
    decoded, against 2 of text), or more than about :data:`MAX_JSON_VALUES` values
    (see :func:`proto.jsoncost.past`)."""
    why = jsoncost.past(body, MAX_JSON_CONTAINERS, MAX_JSON_VALUES)
    return f"The request body holds {why}." if why else None


# -- floats ----------------------------------------------------------------------

# digits -> "0", e/E -> "e", signs kept, everything else -> " ".
_EXPONENT_SHAPE = bytes(
    0x30 if 0x30 <= b <= 0x39 else 0x65 if b in (0x45, 0x65) else b if b in (0x2B, 0x2D) else 0x20 for b in range(256)
)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise ValueError("Number out of range")  # msgspec's own message for these
    return value


_decode = msgspec.json.Decoder().decode
_decode_with_python_floats = msgspec.json.Decoder(float_hook=_finite_float).decode


def _long_exponents(body: bytes) -> int:
    shape = body.translate(_EXPONENT_SHAPE)
    return shape.count(b"0e00") + shape.count(b"0e+00")  # negative exponents take the fast path


# Long exponents msgspec's exact path takes (10-15 µs each: 15 ms at most); past them, Python's float
# (0.5 µs a float, but every float of the body: one 1e300 beside 400,000 floats held the loop 150-200
# ms, where msgspec takes them all in 10; a re-check).
LONG_EXPONENTS_EXACT = 1_000


def decoder_for(body: bytes) -> Callable[[Any], Any]:
    """The decode for ``body`` and its pieces: msgspec's, or with Python's float
    when ``body`` holds more than :data:`LONG_EXPONENTS_EXACT` long exponents."""
    return _decode_with_python_floats if _long_exponents(body) > LONG_EXPONENTS_EXACT else _decode


EXPONENT_STEP = 1 << 20  # bytes of a body searched for long exponents at a time (decoder_in_steps)


async def decoder_in_steps(body: bytes) -> Callable[[Any], Any]:
    """:func:`decoder_for`, the body searched a MiB at a time, other tasks running between
    (8 MB of digits took the search 40-48 ms in one go; an outside audit). (The steps
    overlap by 4 bytes, so a "0e+00" across two is found: one there may count twice.)"""
    found = 0
    for at in range(0, len(body), EXPONENT_STEP):
        if at:
            await trio.lowlevel.checkpoint()
        found += _long_exponents(body[max(at - 4, 0) : at + EXPONENT_STEP])
        if found > LONG_EXPONENTS_EXACT:
            return _decode_with_python_floats
    return _decode


def decode_json(body: bytes) -> Any:
    """``msgspec.json.decode(body)``, minus msgspec's slow float path.

    Raises :class:`msgspec.DecodeError` (or ``RecursionError`` for very deep
    nesting) like it."""
    return decoder_for(body)(body)
