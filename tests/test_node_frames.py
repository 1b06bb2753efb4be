"""The node's frames to its edge written straight to the link's socket (node.ws_direct):
framed and masked as RFC 6455 asks, a batch in one write, the rest of a partial write
before anything else, and the old way when the connection is not plain."""

from __future__ import annotations

import os
import random

import httpx
import msgspec
import trio
from wsproto.frame_protocol import FrameProtocol, Opcode

from node import ws_direct
from tests.conftest import BOUND, model, sse_events, start_edge, start_node

STREAM = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}


def test_masked_frames_read_back_as_a_server_reads_them():
    """Every length encoding (7, 16 and 64 bits, at their edges) reads back, in wsproto's
    server-side parser, as one final binary frame with the exact payload; keys differ."""
    rng = random.Random(3)
    sizes = [0, 1, 3, 4, 5, 125, 126, 127, 65535, 65536, 1_000_003]
    data = b""
    payloads = []
    for size in sizes:
        payload = rng.randbytes(size)
        payloads.append(payload)
        data += ws_direct.masked_frame(payload)
    parser = FrameProtocol(client=False, extensions=[])
    parser.receive_bytes(data)
    frames = list(parser.received_frames())
    assert [(f.opcode, f.frame_finished, f.message_finished) for f in frames] == [(Opcode.BINARY, True, True)] * len(
        sizes
    )
    assert [f.payload for f in frames] == payloads
    keys = {ws_direct.masked_frame(b"same")[2:6] for _ in range(50)}
    assert len(keys) > 45  # a fresh key each frame (RFC 6455 5.3), not one reused


async def streamed(nursery, upstream, n: int) -> tuple[str, str]:
    """A stream of ``n`` words 1 ms apart through an edge and a node: (sent, received)."""
    words = [f"w{i} " for i in range(n)]
    upstream.script_for(
        "m-target",
        [*(step for w in words for step in (("chunk", {"content": w}), ("sleep", 0.001)))]
        + [("chunk", {}, "stop"), ("done",)],
    )
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", upstream)])
    with trio.fail_after(BOUND):
        async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND) as client:
            r = await client.post("/v1/chat/completions", json=STREAM)
    assert r.status_code == 200
    events = sse_events(r.content)
    assert events[-1] == b"[DONE]"
    text = "".join(
        choice["delta"].get("content") or ""
        for event in events[:-1]
        for choice in msgspec.json.decode(event)["choices"]
    )
    return "".join(words), text


async def test_a_node_sends_its_batches_in_one_write_each(nursery, upstream, monkeypatch):
    """On a plain connection each batch of the node's link (its events, and the control
    frames before them) goes to the kernel in one write, and the client reads the text."""
    writes = {"whole": 0, "declined": 0}
    write = ws_direct.DirectFrames.write

    def counted(self, messages):
        rest = write(self, messages)
        writes["whole" if rest == b"" else "declined"] += 1
        return rest

    monkeypatch.setattr(ws_direct.DirectFrames, "write", counted)
    sent, received = await streamed(nursery, upstream, 30)
    assert received == sent
    assert writes["whole"] >= 10 and writes["declined"] == 0, writes


async def test_a_write_the_kernel_takes_in_part_is_finished_before_the_next(nursery, upstream, monkeypatch):
    """A kernel that takes only a third of each write (a full socket buffer, as when the
    edge reads slowly): the rest of every frame goes out before any other, and the
    client reads the exact text."""
    partial = {"n": 0}
    real_write = os.write

    def a_third(fd: int, data: bytes) -> int:
        if len(data) > 3:
            partial["n"] += 1
            return real_write(fd, data[: len(data) // 3])
        return real_write(fd, data)

    monkeypatch.setattr(ws_direct, "_write", a_third)
    sent, received = await streamed(nursery, upstream, 30)
    assert received == sent and partial["n"] >= 10, partial
