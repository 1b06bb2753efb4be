"""A hand-rolled node link for hostile-input checks: raw websocket frames over TCP.

A real client library refuses to send what these checks need (a frame header
declaring 2^40 bytes, a message that never ends), so this speaks RFC 6455 by
hand: the upgrade with a node token, a valid hello, then whatever bytes the
caller chooses. Used by tests/test_hostile_link.py and scripts/chaos.py.
"""

from __future__ import annotations

import base64
import os
import socket
import struct
import zlib
from dataclasses import dataclass

import trio

from proto import PROTOCOL_VERSION, Hello, ModelInfo, encode_frame

BINARY = 0x2
CONTINUATION = 0x0
CLOSE = 0x8
NO_MASK = b"\x00\x00\x00\x00"  # a masked frame whose key leaves the payload as it is


def frame_header(opcode: int, length: int, *, fin: bool = True, compressed: bool = False) -> bytes:
    """A client (masked) frame header declaring ``length`` payload bytes."""
    first = (0x80 if fin else 0) | (0x40 if compressed else 0) | opcode
    if length < 126:
        return struct.pack("!BB", first, 0x80 | length) + NO_MASK
    if length < 1 << 16:
        return struct.pack("!BBH", first, 0x80 | 126, length) + NO_MASK
    return struct.pack("!BBQ", first, 0x80 | 127, length) + NO_MASK


class ServerFrames:
    """Unmasked frames read from the edge, parsed as they come."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.upgrade = b""  # the edge's 101 response head

    async def _fill(self, n: int) -> None:
        while len(self.buffer) < n:
            data = await self.stream.receive_some(65536)
            if not data:
                raise EOFError("the edge closed the connection")
            self.buffer += data

    async def next(self) -> tuple[int, bytes]:
        """The next frame's opcode and payload (EOFError at the end)."""
        await self._fill(2)
        length = self.buffer[1] & 0x7F
        start = 2
        if length == 126:
            await self._fill(4)
            (length,) = struct.unpack_from("!H", self.buffer, 2)
            start = 4
        elif length == 127:
            await self._fill(10)
            (length,) = struct.unpack_from("!Q", self.buffer, 2)
            start = 10
        await self._fill(start + length)
        opcode, payload = self.buffer[0] & 0x0F, bytes(self.buffer[start : start + length])
        del self.buffer[: start + length]
        return opcode, payload


async def open_link(
    port: int,
    token: str,
    node_id: str = "hostile",
    *,
    deflate: bool = False,
    max_concurrency: int = 1,
    source: str | None = None,
    receive_buffer: int | None = None,
) -> tuple[trio.SocketStream, ServerFrames]:
    """Dial the edge's link on loopback (from the address ``source``: another of
    127.0.0.0/8, for a peer of its own), upgrade with the node token (offering
    permessage-deflate if ``deflate``; ``frames.upgrade`` says if it was taken), send a
    hello and read the welcome. The send buffer is kept small, so bytes counted as sent
    are close to bytes the edge has taken. ``receive_buffer`` sizes the socket's receive
    buffer before it connects (for a node that reads nothing: shrunk after, below the
    segments already agreed on, the kernel drops what the edge sends, and with it the
    edge's window updates, and the link stalls for seconds in TCP itself)."""
    if receive_buffer is None:
        stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
    else:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        if source is not None:
            await sock.bind((source, 0))
        await sock.connect(("127.0.0.1", port))
        stream = trio.SocketStream(sock)
    try:
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        key = base64.b64encode(os.urandom(16)).decode()
        extensions = "Sec-WebSocket-Extensions: permessage-deflate\r\n" if deflate else ""
        await stream.send_all(
            (
                f"GET /v1/node/link HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                f"Authorization: Bearer {token}\r\nX-Iop-Node-Id: {node_id}\r\n{extensions}\r\n"
            ).encode()
        )
        frames = ServerFrames(stream)
        while b"\r\n\r\n" not in frames.buffer:
            await frames._fill(len(frames.buffer) + 1)
        head, _, rest = bytes(frames.buffer).partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 101"):
            raise RuntimeError(f"upgrade refused: {head.splitlines()[0]!r}")
        frames.upgrade = head
        frames.buffer = bytearray(rest)
        models = [ModelInfo(name="hostile", adapter="sim", target="t", max_concurrency=max_concurrency)]
        hello = encode_frame(Hello(node_id=node_id, protocol=PROTOCOL_VERSION, models=models))
        await stream.send_all(frame_header(BINARY, len(hello)) + hello)
        opcode, _ = await frames.next()
        if opcode != BINARY:
            raise RuntimeError(f"expected a welcome frame, got opcode {opcode}")
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream, frames


@dataclass
class Flood:
    sent: int  # bytes written to the socket, headers included
    cut: bool  # the edge stopped taking bytes: the connection was reset or closed under the sender
    close_code: int | None  # from the edge's close frame, if one was read


async def flood(stream: trio.SocketStream, frames: ServerFrames, chunks, budget: int) -> Flood:
    """Send the byte strings ``chunks`` yields, as a hostile node would: ignoring a
    close frame, until the edge cuts the connection or ``budget`` bytes are sent.
    Reads the edge's frames meanwhile (pings, the close)."""
    result = Flood(0, False, None)
    read_done = trio.Event()

    async def read() -> None:
        try:
            while result.close_code is None:
                opcode, payload = await frames.next()
                if opcode == CLOSE and len(payload) >= 2:
                    result.close_code = struct.unpack("!H", payload[:2])[0]
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        read_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        try:
            for chunk in chunks:
                if result.sent >= budget:
                    break
                await stream.send_all(chunk)
                result.sent += len(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            result.cut = True
            with trio.move_on_after(1):  # a close frame read before the reset is still reported
                await read_done.wait()
        nursery.cancel_scope.cancel()
    return result


def huge_frame(zeros: bytes):
    """One binary frame declaring 2^40 bytes, then zeros for ever."""
    yield frame_header(BINARY, 1 << 40)
    while True:
        yield zeros


def endless_fragments(zeros: bytes):
    """One binary message of ``len(zeros)``-byte fragments, none of them final."""
    yield frame_header(BINARY, len(zeros), fin=False) + zeros
    while True:
        yield frame_header(CONTINUATION, len(zeros), fin=False) + zeros


def endless_deflated_fragments(zeros: bytes):
    """One compressed (permessage-deflate) message of fragments that are each
    ``len(zeros)`` bytes once inflated and a few hundred on the wire, none final."""
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    first = True
    while True:
        payload = compressor.compress(zeros) + compressor.flush(zlib.Z_SYNC_FLUSH)
        opcode = BINARY if first else CONTINUATION
        yield frame_header(opcode, len(payload), fin=False, compressed=first) + payload
        first = False
