"""An incremental parser for the ``data:`` payloads of a server-sent event stream."""

from __future__ import annotations


class EventTooLarge(ValueError):
    """One event grew past the parser's limit without ending."""


class SSEParser:
    """Feed bytes, get the ``data`` payload of each complete event.

    Comments (``: keep-alive``) and ``event:``/``id:`` fields are skipped;
    multi-line data is joined with ``\\n`` as the SSE spec says. Lines may end
    in ``\\r\\n``, ``\\n`` or a bare ``\\r`` (the spec allows all three).
    """

    __slots__ = ("_buf", "_max")

    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024) -> None:
        self._buf = b""
        self._max = max_event_bytes

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        tail = b""
        if b"\r" in buf:
            if buf[-1:] == b"\r":  # perhaps the first half of a \r\n: kept for the next read
                buf, tail = buf[:-1], b"\r"
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events = buf.split(b"\n\n")
        self._buf = events.pop() + tail
        if len(self._buf) > self._max:
            raise EventTooLarge(f"a server-sent event larger than {self._max} bytes")
        out = []
        for block in events:
            if block.startswith(b"data:") and b"\n" not in block:
                payload = block[5:]
                out.append(payload[1:] if payload[:1] == b" " else payload)
                continue
            lines = [
                (line[6:] if line.startswith(b"data: ") else line[5:])
                for line in block.split(b"\n")
                if line.startswith(b"data:")
            ]
            if lines:
                out.append(b"\n".join(lines))
        return out
