"""The node's frames to its edge, straight to the link's socket.

Through trio-websocket, each message crossed ``send_message``, wsproto's
event and frame layers (its framing and masking) and ``_send``, whose lock
and ``send_all`` (a conflict detector, a memoryview loop, two checkpoints)
came before the ``send`` itself: about a third of the node's link sender.
:class:`DirectFrames` frames and masks binary messages itself (RFC 6455 5.2,
5.3: a client's frames are masked, with a fresh key each) and hands all the
messages of one batch to the kernel in one write, when nothing else is being
sent on the connection; the rest of a write the kernel took only part of
goes out under trio-websocket's own lock, as its ``_send`` would. Anything
else (TLS, a connection closing, another task sending, a broken socket) goes
trio-websocket's way, which also reports the failure as it always has.

It relies on trio-websocket 0.12's ``WebSocketConnection`` (``_stream``,
``_stream_lock``, ``_wsproto``, ``_close_reason``); each is checked once,
and when anything differs the link simply sends the old way.
"""

from __future__ import annotations

import os
import struct

import trio
from trio_websocket import ConnectionClosed
from wsproto.connection import ConnectionState

MAX_DIRECT = 256 * 1024  # larger batches go message by message (control frames may go between them)
_write = os.write  # (a name of this module's: tests give it a kernel that takes writes in part)


def masked_frame(payload: bytes) -> bytes:
    """A final, binary, masked frame (RFC 6455 5.2) carrying ``payload``."""
    n = len(payload)
    key = os.urandom(4)
    if n < 126:
        head = bytes((0x82, 0x80 | n))
    elif n < 65536:
        head = struct.pack("!BBH", 0x82, 0xFE, n)
    else:
        head = struct.pack("!BBQ", 0x82, 0xFF, n)
    if not n:
        return head + key
    repeated = key * (n // 4 + 1)
    body = int.from_bytes(payload, "little") ^ int.from_bytes(repeated[:n], "little")
    return head + key + body.to_bytes(n, "little")


class DirectFrames:
    """A trio-websocket client connection's plain TCP socket, for the link's sender."""

    __slots__ = ("_ws", "_stream", "_socket", "_lock")

    def __init__(self, ws, stream: trio.SocketStream, lock) -> None:
        self._ws = ws
        self._stream = stream
        self._socket = stream.socket
        self._lock = lock

    @classmethod
    def find(cls, ws) -> DirectFrames | None:
        """The plain TCP connection under a trio-websocket client connection; None otherwise."""
        stream = getattr(ws, "_stream", None)
        lock = getattr(ws, "_stream_lock", None)
        if type(stream) is not trio.SocketStream or not hasattr(lock, "locked") or not hasattr(ws, "_wsproto"):
            return None
        if not all(hasattr(ws, name) for name in ("_close_reason", "_abort_web_socket")):
            return None
        if not hasattr(lock, "acquire_nowait"):
            return None
        return cls(ws, stream, lock)

    def write(self, messages: list[bytes]) -> bytes | None:
        """Send ``messages`` as frames in one write: None if nothing was sent
        (send them trio-websocket's way), else what the kernel did not take
        (b"" when all), which :meth:`send_rest` must send before anything else."""
        ws = self._ws
        if self._lock.locked() or ws._close_reason is not None or ws._wsproto.state is not ConnectionState.OPEN:  # noqa: SLF001
            return None
        fd = self._socket.fileno()  # (-1 once closed: its number may be another socket's by now)
        if fd < 0 or sum(map(len, messages)) > MAX_DIRECT:
            return None
        data = b"".join([masked_frame(message) for message in messages])
        try:
            sent = _write(fd, data)
        except BlockingIOError:
            sent = 0
        except OSError:  # broken: trio-websocket's way finds it too, and closes the connection as it does
            return None
        return data[sent:]

    async def send_rest(self, rest: bytes) -> None:
        """The rest of a write, before any other frame: the lock is taken now (it
        was free, and nothing ran since the write). As trio-websocket's own
        send: a cancel may cut the frame (the link is ending then), and a
        broken connection is aborted and raised as ConnectionClosed."""
        ws = self._ws
        self._lock.acquire_nowait()
        try:
            await self._stream.send_all(rest)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await ws._abort_web_socket()  # noqa: SLF001
            raise ConnectionClosed(ws._close_reason) from None  # noqa: SLF001
        finally:
            self._lock.release()
