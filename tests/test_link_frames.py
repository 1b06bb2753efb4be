"""The node link's frames as the edge reads them: whole binary frames
without wsproto (edge.frame_limit), anything else still through it, in any
mix and any split."""

from __future__ import annotations

import os
import random

import msgspec
import pytest
import trio
from wsproto.frame_protocol import FrameProtocol, Opcode, XorMaskerSimple

from edge.frame_limit import whole_messages
from proto import Pong, decode_frame
from proto.wsframes import SMALL, xor_mask
from scripts.hostile_link import BINARY, open_link
from tests.conftest import BOUND, TOKEN, edge_config, eventually, start_edge


def ping(ts: float, pad: int = 0) -> bytes:
    """A node's Ping frame (the edge answers Pong(ts)), ``pad`` bytes longer."""
    return msgspec.msgpack.encode({"t": "ping", "ts": ts, "pad": bytes(pad)})


async def pong(frames) -> float:
    """The ts of the next Pong from the edge."""
    while True:
        opcode, payload = await frames.next()
        if opcode == BINARY and isinstance(frame := decode_frame(payload), Pong):
            return frame.ts


def masked(payload: bytes, *, fin: bool = True, opcode: Opcode = Opcode.BINARY) -> bytes:
    """A client's frame as wsproto writes it (a random key)."""
    return bytes(FrameProtocol(client=True, extensions=[])._serialize_frame(opcode, payload, fin=fin))


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, SMALL - 1, SMALL, SMALL + 1, 4001, 70_001])
def test_xor_mask_is_the_websocket_mask(size):
    payload, key = os.urandom(size), os.urandom(4)
    assert xor_mask(payload, key) == bytes(XorMaskerSimple(key).process(payload))
    assert xor_mask(xor_mask(payload, key), key) == payload


def test_whole_messages_reads_whole_binary_frames_and_stops_at_anything_else():
    messages = [os.urandom(n) for n in (0, 1, 125, 126, 65_535, 65_536, 200_000)]
    wire = b"".join(masked(m) for m in messages)
    got, used = whole_messages(wire, 1 << 20)
    assert got == messages and used == len(wire)
    # Cut anywhere: the messages whole before the cut, and the offset just after the last of them.
    bounds = [0]
    for m in messages:
        bounds.append(bounds[-1] + len(masked(m)))
    for cut in sorted(
        {*bounds, *(b + d for b in bounds for d in (1, 2, 5, 9, 13)), *random.sample(range(len(wire)), 200)}
    ):
        got, used = whole_messages(wire[:cut], 1 << 20)
        whole = max(i for i, b in enumerate(bounds) if b <= cut)
        assert got == messages[:whole] and used == bounds[whole], cut
    first = masked(b"first")
    for other in (
        masked(b"ping", opcode=Opcode.PING),
        masked(b"text", opcode=Opcode.TEXT),
        masked(b"part", fin=False),
        bytes([0xC2]) + masked(b"rsv1")[1:],  # a reserved bit (no extension was agreed)
        bytes([0x82, 5]) + b"plain",  # unmasked
        bytes([0x82, 0x80 | 126, 0, 5]) + os.urandom(4) + b"short",  # a length not in its shortest form
        bytes([0x82, 0x80 | 127]) + (300).to_bytes(8, "big") + os.urandom(4) + bytes(300),
        masked(bytes(2000)),  # over the limit below: left for the limit's own refusal
    ):
        got, used = whole_messages(first + other + first, 1000)
        assert got == [b"first"] and used == len(first), other[:4]


async def test_a_node_s_frames_in_any_mix_and_split_are_all_read_in_order(nursery):
    """Whole frames several to a write or one frame over several writes (cut in
    its head, its key, its payload), 16- and 64-bit lengths, messages in
    fragments with a websocket ping between them: every Ping is answered, in
    order, whatever the writes (six links, six ways of cutting)."""
    edge = await start_edge(nursery, edge_config())
    for seed in range(6):
        rng = random.Random(seed)
        wire, sent, bounds = bytearray(), [], []
        for i in range(50):
            ts = float(i)
            message = ping(ts, pad=rng.choice((0, 10, 200, 5_000, 70_000)))
            if rng.random() < 0.2:  # in three fragments, a ping control frame between the first two
                a, b = len(message) // 3, 2 * len(message) // 3
                wire += masked(message[:a], fin=False)
                wire += masked(b"are you there", opcode=Opcode.PING)
                wire += masked(message[a:b], fin=False, opcode=Opcode.CONTINUATION)
                wire += masked(message[b:], opcode=Opcode.CONTINUATION)
            else:
                wire += masked(message)
            sent.append(ts)
            bounds.append(len(wire))
        node_id = f"cut{seed}"
        with trio.fail_after(BOUND):
            stream, frames = await open_link(edge.port, TOKEN, node_id)
            async with stream:
                pos = 0
                while pos < len(wire):
                    if rng.random() < 0.5:  # up to a message's end (the edge reads whole frames itself)
                        end = rng.choice([b for b in bounds if b > pos][:3])
                    else:  # anywhere
                        end = pos + rng.choice((1, 2, 3, 7, 100, 1_000, 30_000, 100_000))
                    await stream.send_all(bytes(wire[pos:end]))
                    pos = end
                    if rng.random() < 0.5:
                        await trio.sleep(0.002)  # (so that the edge's reads end where the writes do)
                answered = [await pong(frames) for _ in sent]
                assert answered == sent, seed
                assert node_id in edge.edge.runs.links


@pytest.mark.parametrize(
    "bad",
    [
        bytes([0x82, 0x80 | 126, 0, 5]) + os.urandom(4) + b"short",  # a 16-bit length saying 5
        bytes([0x82, 0x80 | 127]) + (300).to_bytes(8, "big") + os.urandom(4) + bytes(300),  # 64-bit saying 300
        bytes([0x82, 5]) + b"plain",  # unmasked
        bytes([0xC2]) + masked(b"rsv1")[1:],  # a reserved bit (no extension was agreed)
    ],
    ids=["16-bit-length-of-5", "64-bit-length-of-300", "unmasked", "reserved-bit"],
)
async def test_what_wsproto_refuses_still_closes_the_link(nursery, bad):
    """After a good frame (answered), a frame wsproto refuses closes the link."""
    edge = await start_edge(nursery, edge_config())
    with trio.fail_after(BOUND):
        stream, frames = await open_link(edge.port, TOKEN)
        async with stream:
            await stream.send_all(masked(ping(1.0)))
            assert await pong(frames) == 1.0
            await stream.send_all(masked(ping(2.0)) + bad)  # (whether 2.0 is answered before the close: a race)
            with pytest.raises(EOFError):  # (wsproto's ParseFailed: hypercorn closes without a close frame)
                while True:
                    await frames.next()
    await eventually(lambda: "hostile" not in edge.edge.runs.links, what="the link dropped")
