"""hypercorn's queue of ASGI messages to the app (edge/app_queue.py): bounded, in order, and a
cancelled wait on either side loses and duplicates nothing. Through a real edge, a body sent
in many slow pieces reaches the model server whole."""

from __future__ import annotations

import msgspec
import trio
import trio.testing

from edge.app_queue import AppQueue
from tests.conftest import BOUND, model, sse_events, start_edge, start_node


async def test_a_sender_waits_while_the_queue_is_full_and_every_message_arrives_in_order():
    queue = AppQueue(10)
    sent = 0

    async def sender() -> None:
        nonlocal sent
        for i in range(50):
            await queue.send(i)
            sent += 1

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            await trio.testing.wait_all_tasks_blocked()
            assert sent == 10  # the bound: the eleventh send waits
            got = [queue.receive_nowait()]
            await trio.testing.wait_all_tasks_blocked()
            assert sent == 11  # a message taken makes room for exactly one
            while len(got) < 50:
                got.append(await queue.receive())
    assert got == list(range(50))
    try:
        queue.receive_nowait()
    except trio.WouldBlock:
        pass
    else:
        raise AssertionError("an empty queue gave a message")


async def test_cancelled_waits_lose_and_duplicate_nothing():
    queue = AppQueue(1)
    with trio.fail_after(BOUND):
        # A receive cancelled while it waits takes nothing: the next message goes to the next receive.
        with trio.move_on_after(0.01):
            await queue.receive()
        await queue.send("a")
        assert await queue.receive() == "a"
        # A send cancelled while it waits (the queue full) leaves its message out.
        await queue.send("b")
        with trio.move_on_after(0.01):
            await queue.send("lost")
        assert queue.receive_nowait() == "b"
        await queue.send("c")
        assert await queue.receive() == "c"
        # A waiting receiver is handed a message directly.
        async with trio.open_nursery() as nursery:
            got: list[str] = []

            async def receiver() -> None:
                got.append(await queue.receive())

            nursery.start_soon(receiver)
            await trio.testing.wait_all_tasks_blocked()
            await queue.send("d")
        assert got == ["d"]


async def test_a_queue_of_no_capacity_hands_each_message_over():
    queue = AppQueue(0)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(queue.send, "x")
            await trio.testing.wait_all_tasks_blocked()
            assert queue.receive_nowait() == "x"


async def test_a_body_in_more_pieces_than_the_queue_holds_reaches_the_model_server_whole(nursery, upstream):
    """A chat request whose body comes chunked in 200 pieces (twenty times the messages the
    queue holds at once), half of them in one write: the upstream receives exactly the text
    sent, and the client its stream."""
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", upstream)])
    text = "".join(f"piece {i:03d}. " for i in range(2000))
    body = msgspec.json.encode({"model": "m", "stream": True, "messages": [{"role": "user", "content": text}]})
    size = len(body) // 200
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    host, port = edge.url.removeprefix("http://").split(":")
    with trio.fail_after(BOUND):
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        # Half in one write (hypercorn reads many chunks at once and queues them faster than the
        # request's task takes them: the queue fills and the reader waits), half 1 ms apart.
        framed = [b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces]
        await stream.send_all(b"".join(framed[:100]))
        for chunk in framed[100:]:
            await stream.send_all(chunk)
            await trio.sleep(0.001)
        await stream.send_all(b"0\r\n\r\n")
        response = b""
        while b"data: [DONE]" not in response:
            data = await stream.receive_some(65536)
            assert data, response
            response += data
        await stream.aclose()
    assert len(pieces) >= 200
    assert response.startswith(b"HTTP/1.1 200 ")
    (record,) = upstream.records
    assert record.body["messages"] == [{"role": "user", "content": text}]
    body_part = response.partition(b"\r\n\r\n")[2]
    assert any(b'"content"' in event for event in sse_events(_dechunk(body_part)))


def _dechunk(body: bytes) -> bytes:
    out, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2 :]
    return out


async def test_the_streams_end_never_waits_and_releases_a_waiting_sender():
    """hypercorn hands the app `http.disconnect` from inside the app's own last send when
    the response ends: with the queue full of a body the app will never read (it answered
    413 first), that put waited for the app itself, and the connection never closed. The
    end is queued past the bound, and a sender still waiting (the connection's reader, with
    more body) is released: its message goes nowhere."""
    queue = AppQueue(2)
    body = {"type": "http.request", "body": b"x", "more_body": True}
    released = False

    async def reader() -> None:
        nonlocal released
        for _ in range(3):
            await queue.send(body)
        released = True

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert not released  # the third waits: the queue is full
            await queue.send({"type": "http.disconnect"})  # the app's side: does not wait
            await trio.testing.wait_all_tasks_blocked()
            assert released
    assert [queue.receive_nowait()["type"] for _ in range(3)] == ["http.request", "http.request", "http.disconnect"]
