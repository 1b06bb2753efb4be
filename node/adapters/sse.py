"""An incremental parser for the ``data:`` payloads of a server-sent event stream."""

from __future__ import annotations

_BOM = b"\xef\xbb\xbf"


class EventTooLarge(ValueError):
    """One event grew past the parser's limit without ending."""


class ErrorEvent(bytes):
    """The payload of an event that says the stream failed: an ``error:`` field
    (llama.cpp's server writes ``error: {"code":400,"message":...}`` after its
    200 when a request cannot run) or the data of an ``event: error`` event."""

    __slots__ = ()


class SSEParser:
    """Feed bytes, get the ``data`` payload of each complete event, or an
    :class:`ErrorEvent` for an event that reports an error.

    Comments (``: keep-alive``) and other ``event:``/``id:`` fields are skipped;
    multi-line data is joined with ``\\n`` as the SSE spec says. Lines may end
    in ``\\r\\n``, ``\\n`` or a bare ``\\r`` (the spec allows all three), and a
    byte order mark at the start of the stream is dropped (as the spec says).

    Each read is looked at once: an event that spans reads is kept as a list
    of its pieces, joined when it ends. (Joining the new bytes onto the whole
    pending event at each read, and scanning it all again, made an event that
    never ends, sent 100 bytes at a time, cost the node 79 s of CPU in 120 s.)
    """

    __slots__ = ("_parts", "_size", "_cr", "_head", "_max")

    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024) -> None:
        self._parts: list[bytes] = []  # the event begun in earlier reads, its line ends as \n
        self._size = 0  # bytes in _parts
        self._cr = False  # the last read ended in \r: perhaps the first half of a \r\n
        self._head: bytes | None = b""  # the stream's first bytes while they may be a BOM; None after
        self._max = max_event_bytes

    def feed(self, data: bytes) -> list[bytes]:
        if self._head is not None:
            data = self._head + data
            if len(data) < len(_BOM) and _BOM.startswith(data):
                self._head = data
                return []
            self._head = None
            if data.startswith(_BOM):
                data = data[len(_BOM) :]
        if self._cr:
            data = b"\r" + data
            self._cr = False
        if b"\r" in data:
            if data[-1:] == b"\r":  # kept for the next read, which may start with its \n
                data, self._cr = data[:-1], True
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if not data:
            return []
        out: list[bytes] = []
        parts = self._parts
        if parts:
            # The pending event ends at the first blank line: its first \n may have
            # ended the last read.
            if parts[-1][-1:] == b"\n" and data[:1] == b"\n":
                end, start = 0, 1
            else:
                end = data.find(b"\n\n")
                start = end + 2
            if end < 0:
                parts.append(data)
                self._size += len(data)
                if self._size > self._max:
                    raise EventTooLarge(f"a server-sent event larger than {self._max} bytes")
                return out
            parts.append(data[:end])
            _parse(b"".join(parts), out)
            parts.clear()
            self._size = 0
            data = data[start:]
        events = data.split(b"\n\n")
        rest = events.pop()
        if rest:
            if len(rest) > self._max:
                raise EventTooLarge(f"a server-sent event larger than {self._max} bytes")
            parts.append(rest)
            self._size = len(rest)
        for block in events:
            _parse(block, out)
        return out


def _parse(block: bytes, out: list[bytes]) -> None:
    """Add the data of one event (its lines ending in \\n) to ``out``, if it has any."""
    if block.startswith(b"data:") and b"\n" not in block:  # the usual event: one data line
        payload = block[5:]
        out.append(payload[1:] if payload[:1] == b" " else payload)
        return
    data: list[bytes] = []
    error: list[bytes] = []
    failed = False
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            data.append(_value(line, 5))
        elif line.startswith(b"error:"):
            error.append(_value(line, 6))
        elif line.startswith(b"event:") and _value(line, 6) == b"error":
            failed = True
    if error:
        out.append(ErrorEvent(b"\n".join(error)))
    elif failed:
        out.append(ErrorEvent(b"\n".join(data)))
    elif data:
        out.append(b"\n".join(data))


def _value(line: bytes, start: int) -> bytes:
    """A field's value: the line from ``start`` (just past the colon), less one leading space."""
    return line[start + 1 :] if line[start : start + 1] == b" " else line[start:]
