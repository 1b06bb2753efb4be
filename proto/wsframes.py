"""RFC 6455 framing for the link's binary messages where the edge writes or
reads frames itself instead of through wsproto (``edge.ws``,
``edge.frame_limit``): a frame's head and the mask."""

from __future__ import annotations

import struct

SMALL = 1024  # payloads up to this are masked as one integer, longer ones by translate
_XOR = [bytes(a ^ b for a in range(256)) for b in range(256)]


def xor_mask(payload: bytes | memoryview, key: bytes) -> bytes:
    """``payload`` masked (or unmasked: the same) with the 4-byte ``key``."""
    n = len(payload)
    if n <= SMALL:
        keys = (key * ((n + 3) >> 2))[:n]
        return (int.from_bytes(payload, "little") ^ int.from_bytes(keys, "little")).to_bytes(n, "little")
    data = bytearray(payload)
    for i in range(4):
        data[i::4] = data[i::4].translate(_XOR[key[i]])
    return bytes(data)


def binary_head(size: int, masked: bool = False) -> bytes:
    """The head of a final binary frame of ``size`` bytes (its mask key not included)."""
    second = 0x80 if masked else 0
    if size < 126:
        return bytes((0x82, second | size))
    if size < 65536:
        return struct.pack("!BBH", 0x82, second | 126, size)
    return struct.pack("!BBQ", 0x82, second | 127, size)
