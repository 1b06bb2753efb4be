"""Streamed chunks written straight to the client's socket (edge.openai.direct): the same bytes
as through ASGI, on a kept-alive connection, and when the kernel takes only part of a write."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import h11
import httpx
import msgspec
import trio

from edge.openai import direct
from tests.conftest import BOUND, model, sse_events, start_edge, start_node

STREAM = {"model": "m", "stream": True}
# The most a socket's send buffer grows to here (autotuning): a slow reader's stream must
# outgrow it for the kernel to take a write only in part.
SEND_BUFFER_MAX = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])


class Spy:
    """Counts what DirectBody.write did (the real method runs)."""

    def __init__(self, monkeypatch) -> None:
        self.whole = self.partial = self.declined = self.ends = 0
        self.heads: list[tuple[bytes, bool] | None] = []  # what each head_and_chunk did
        write, head_and_chunk, end = direct.DirectBody.write, direct.DirectBody.head_and_chunk, direct.DirectBody.end

        def counted(body, data: bytes) -> bytes | None:
            rest = write(body, data)
            if rest is None:
                self.declined += 1
            elif rest:
                self.partial += 1
            else:
                self.whole += 1
            return rest

        def counted_end(body, data: bytes) -> bytes | None:
            rest = end(body, data)
            self.ends += rest == b""  # all of it taken at once: one send for the last chunk and the end
            return rest

        def counted_head(body, send, message, data):
            done = head_and_chunk(body, send, message, data)
            self.heads.append(done)
            if done is not None:  # a direct write too (with the head before the chunk)
                self.partial += bool(done[0])
                self.whole += not done[0]
            return done

        monkeypatch.setattr(direct.DirectBody, "write", counted)
        monkeypatch.setattr(direct.DirectBody, "head_and_chunk", counted_head)
        monkeypatch.setattr(direct.DirectBody, "end", counted_end)


def content_of(sse: bytes) -> str:
    """The text of an SSE chat stream's content deltas; it must end with [DONE]."""
    events = sse_events(sse)
    assert events[-1] == b"[DONE]"
    return "".join(
        choice["delta"].get("content") or ""
        for event in events[:-1]
        for choice in msgspec.json.decode(event)["choices"]
    )


def roles(sse: bytes) -> int:
    """How many chunks of an SSE chat stream open the assistant's message."""
    return sum(
        "role" in choice["delta"] for event in sse_events(sse)[:-1] for choice in msgspec.json.decode(event)["choices"]
    )


def chat_request(client: h11.Connection, host: str, body: bytes) -> bytes:
    """The bytes of a POST of ``body`` to /v1/chat/completions, from ``client``."""
    request = h11.Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[("host", host), ("content-type", "application/json"), ("content-length", str(len(body)))],
    )
    return client.send(request) + client.send(h11.Data(data=body)) + client.send(h11.EndOfMessage())


async def read_response(client: h11.Connection, receive) -> tuple[h11.Response, bytes]:
    """A response's head and body, read with ``client`` from ``receive()``'s bytes."""
    head, received = None, bytearray()
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            client.receive_data(await receive())
        elif isinstance(event, h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            received += event.data
        elif isinstance(event, h11.EndOfMessage):
            return head, bytes(received)


async def streams_in_turn(edge, words: list[str], n: int) -> tuple[trio.SocketStream, list[h11.Response]]:
    """``n`` stream requests one after another on one connection, each answered with
    ``words``: the connection (left open) and the heads of the answers."""
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    body = msgspec.json.encode({**STREAM, "messages": [{"role": "user", "content": "x"}]})
    client = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream(host, int(port))
    heads = []
    for _ in range(n):
        await stream.send_all(chat_request(client, host, body))
        head, received = await read_response(client, lambda: stream.receive_some(65536))
        assert head.status_code == 200 and content_of(received) == "".join(words)
        heads.append(head)
        if client.our_state is h11.DONE and client.their_state is h11.DONE:
            client.start_next_cycle()
    return stream, heads


async def edge_with_paced_words(nursery, upstream, n: int):
    """An edge and a node whose model streams ``n`` words 2 ms apart: (the words, the edge)."""
    words = [f"w{i} " for i in range(n)]
    upstream.script_for(
        "m-target",
        [*(step for w in words for step in (("chunk", {"content": w}), ("sleep", 0.002)))]
        + [("chunk", {}, "stop"), ("done",)],
    )
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", upstream)])
    return words, edge


async def test_streamed_chunks_go_straight_to_the_socket_and_keep_their_bytes(nursery, upstream, monkeypatch):
    """Two streams, one after the other on one kept-alive connection: each arrives whole and
    well framed (httpx parses the chunked body), and their middle chunks took the direct path."""
    spy = Spy(monkeypatch)
    words, edge = await edge_with_paced_words(nursery, upstream, 40)
    with trio.fail_after(BOUND):
        async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND) as client:
            for _ in range(2):
                r = await client.post(
                    "/v1/chat/completions", json={**STREAM, "messages": [{"role": "user", "content": "x"}]}
                )
                assert r.status_code == 200 and content_of(r.content) == "".join(words)
                # The head written with the first chunk says what hypercorn's own would.
                assert r.headers["transfer-encoding"] == "chunked" and r.headers["content-type"] == "text/event-stream"
                assert {"date", "server", "x-request-id"} <= r.headers.keys()
    assert spy.whole >= 20
    # Each stream's head went out with its first chunk in one write, its last chunk with
    # the end of the body in another; the connection was then reused for the next request.
    assert spy.heads == [(b"", True), (b"", True)] and spy.ends == 2


async def test_a_kept_alive_connection_serves_streams_until_its_limit_then_closes(nursery, upstream, monkeypatch):
    """The end of a stream's body is written with its last chunk, h11 and hypercorn moved on
    as their own end would: the same connection then serves the next request, and at
    hypercorn's keep_alive_max_requests the last response says ``connection: close`` and the
    connection is closed after its body, as hypercorn's own end does."""
    from hypercorn.config import Config

    monkeypatch.setattr(Config, "keep_alive_max_requests", 3)
    spy = Spy(monkeypatch)
    words, edge = await edge_with_paced_words(nursery, upstream, 5)
    with trio.fail_after(BOUND):
        stream, heads = await streams_in_turn(edge, words, 3)
        assert await stream.receive_some(65536) == b""  # the server closed it after the third
        await stream.aclose()
    closes = [(b"connection", b"close") in head.headers for head in heads]
    assert closes == [False, False, True] and spy.ends == 3


class _Kernel:
    """A stream's socket whose ``send`` takes only half of what it is given, or
    nothing (EAGAIN): the kernel of a client that has stopped reading, on cue."""

    def __init__(self, raw, takes_nothing: bool) -> None:
        self.raw = raw
        self.takes_nothing = takes_nothing

    def send(self, data: bytes, *flags) -> int:
        if self.takes_nothing:
            raise BlockingIOError
        return self.raw.send(data[: len(data) // 2], *flags)


async def test_the_end_of_a_body_the_kernel_takes_in_part_or_not_at_all_arrives_whole(nursery, upstream, monkeypatch):
    """A stream's last chunk and end, when the kernel takes half of the write or none of it:
    the rest goes out under hypercorn's lock, the body arrives whole and well framed, and the
    kept-alive connection serves the next request."""
    end = direct.DirectBody.end
    rests: list[int] = []

    def reluctant(body, data: bytes) -> bytes | None:
        raw = body._raw
        body._raw = _Kernel(raw, takes_nothing=len(rests) % 2 == 1)
        try:
            rest = end(body, data)
        finally:
            body._raw = raw
        rests.append(len(rest) if rest is not None else -1)
        return rest

    monkeypatch.setattr(direct.DirectBody, "end", reluctant)
    words, edge = await edge_with_paced_words(nursery, upstream, 5)
    with trio.fail_after(BOUND):
        stream, _ = await streams_in_turn(edge, words, 2)  # both on this one connection
        await stream.aclose()
    assert len(rests) == 2 and all(rest > 0 for rest in rests), rests  # half taken, then none


async def test_a_write_taken_in_part_after_the_streams_task_began_it_arrives_whole(nursery, upstream, monkeypatch):
    """A stream whose head its own task wrote (the connection took no head with the first chunk
    from the link's reader) then had a chunk the kernel took only in part: the rest's sender
    was never set, the request failed with an AttributeError and the client's stream was cut
    (slow readers under load; an outside audit). The rest goes out first; it arrives whole."""
    write = direct.DirectBody.write
    partial: list[int] = []

    def half(body, data: bytes) -> bytes | None:
        raw = body._raw
        body._raw = _Kernel(raw, takes_nothing=False)
        try:
            rest = write(body, data)
        finally:
            body._raw = raw
        partial.append(len(rest or b""))
        return rest

    monkeypatch.setattr(direct.DirectBody, "write", half)
    monkeypatch.setattr(direct.DirectBody, "head_and_chunk", lambda body, send, message, data: None)
    words, edge = await edge_with_paced_words(nursery, upstream, 20)
    with trio.fail_after(BOUND):
        async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND) as client:
            r = await client.post(
                "/v1/chat/completions", json={**STREAM, "messages": [{"role": "user", "content": "x"}]}
            )
    assert r.status_code == 200 and content_of(r.content) == "".join(words)
    assert any(partial), partial  # (writes were taken in part)


async def test_pipelined_requests_are_answered_in_order(nursery, upstream, monkeypatch):
    """Two requests sent at once on one connection (HTTP/1.1 pipelining): the first
    stream's direct end moves the connection on, and the second, already read, is
    answered after it, whole."""
    spy = Spy(monkeypatch)
    words, edge = await edge_with_paced_words(nursery, upstream, 5)
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    body = msgspec.json.encode({**STREAM, "messages": [{"role": "user", "content": "x"}]})
    client = h11.Connection(h11.CLIENT)
    with trio.fail_after(BOUND):
        stream = await trio.open_tcp_stream(host, int(port))
        # h11 sends a request only once the last is answered: the second one's bytes, made ahead.
        await stream.send_all(chat_request(client, host, body) + chat_request(h11.Connection(h11.CLIENT), host, body))
        for i in range(2):
            head, received = await read_response(client, lambda: stream.receive_some(65536))
            assert head.status_code == 200 and content_of(received) == "".join(words)
            if i == 0:
                client.start_next_cycle()
                chat_request(client, host, body)  # (already sent) h11 now expects its answer
        await stream.aclose()
    assert spy.ends == 2


async def test_a_reader_slower_than_the_stream_gets_every_byte_in_order(nursery, upstream, monkeypatch):
    """8 MB of deltas (at least twice the largest send buffer) to a client with a small receive
    window that reads only after a pause: the kernel's send buffer fills, writes are taken in part or declined and finish the ASGI
    way, and the client still reads one well-formed chunked body with the exact text."""
    spy = Spy(monkeypatch)
    rng = random.Random(7)
    pieces: list[str] = []
    while sum(map(len, pieces)) < max(2 * SEND_BUFFER_MAX, 8_000_000):
        pieces.append(rng.choice("abcdefghij") * rng.randint(1_000, 16_000))
    upstream.script_for("m-target", [*(("chunk", {"content": p}) for p in pieces), ("chunk", {}, "stop"), ("done",)])
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", upstream)])
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    body = msgspec.json.encode({**STREAM, "messages": [{"role": "user", "content": "x"}]})
    client = h11.Connection(h11.CLIENT)
    with trio.fail_after(BOUND * 2):
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect((host, int(port)))
        await sock.send(chat_request(client, host, body))
        await trio.sleep(1.0)  # not reading: the edge's writes pile up in the kernel
        head, received = await read_response(client, lambda: sock.recv(65536))
        assert head.status_code == 200
        sock.close()
    assert content_of(received) == "".join(pieces)
    assert spy.whole and spy.partial + spy.declined  # both ways were taken


async def test_an_http_1_0_client_gets_its_stream_unframed(nursery, upstream, monkeypatch):
    """HTTP/1.0 has no chunked encoding: the body is delimited by the connection's close, so
    nothing may be chunk-framed; such a stream goes the ASGI way and arrives as plain SSE."""
    spy = Spy(monkeypatch)
    words, edge = await edge_with_paced_words(nursery, upstream, 20)
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    body = msgspec.json.encode({**STREAM, "messages": [{"role": "user", "content": "x"}]})
    with trio.fail_after(BOUND):
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(
            b"POST /v1/chat/completions HTTP/1.0\r\nhost: %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (host.encode(), len(body), body)
        )
        raw = b""
        while not raw.endswith(b"data: [DONE]\n\n"):
            raw += await stream.receive_some(65536)
        await stream.aclose()
    head, _, sse = raw.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"200" and b"transfer-encoding" not in head.lower()
    assert content_of(sse) == "".join(words) and spy.whole == spy.partial == 0
    assert roles(sse) == 1  # the link's reader shaped the first text, and left the commit to the stream's task


async def test_paced_chunks_are_written_as_their_events_arrive_and_arrive_whole(nursery, upstream, monkeypatch):
    """Each text event is shaped and written to the client's socket by the task that reads
    the node's link, as it arrives, the first one with the response's head: the stream's own
    task is not woken per chunk, nor to commit. The client reads the same text, framed as ever."""
    writers: list[str] = []
    head_writers: list[str] = []
    write, head_and_chunk = direct.DirectBody.write, direct.DirectBody.head_and_chunk

    def spied(body, data: bytes) -> bytes | None:
        writers.append(trio.lowlevel.current_task().name)
        return write(body, data)

    def spied_head(body, send, message, data):
        head_writers.append(trio.lowlevel.current_task().name)
        return head_and_chunk(body, send, message, data)

    monkeypatch.setattr(direct.DirectBody, "write", spied)
    monkeypatch.setattr(direct.DirectBody, "head_and_chunk", spied_head)
    words, edge = await edge_with_paced_words(nursery, upstream, 40)
    with trio.fail_after(BOUND):
        async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND) as client:
            r = await client.post(
                "/v1/chat/completions", json={**STREAM, "messages": [{"role": "user", "content": "x"}]}
            )
    assert r.status_code == 200 and content_of(r.content) == "".join(words) and roles(r.content) == 1
    from_link = [name for name in writers if name.endswith("_run_handler")]  # hypercorn's reader of the link
    assert len(from_link) >= 20, writers
    assert len(head_writers) == 1 and head_writers[0].endswith("_run_handler"), head_writers


async def test_a_failure_shaping_a_chunk_on_the_link_fails_that_request_not_the_link(nursery, upstream, monkeypatch):
    """Shaping runs in the link reader's task for a committed stream: a bug there (an
    exception) ends that request's stream with an error event, and the node's link, and
    every other request on it, carry on."""
    from edge.openai import output

    feed = output.LiveStream.feed

    def broken(self, batch):
        if any(event.text == "w10 " for event in batch):
            raise RuntimeError("a bug in shaping")
        return feed(self, batch)

    monkeypatch.setattr(output.LiveStream, "feed", broken)
    words, edge = await edge_with_paced_words(nursery, upstream, 20)
    link = edge.edge.runs.links["n1"]
    with trio.fail_after(BOUND):
        async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND) as client:
            request = {**STREAM, "messages": [{"role": "user", "content": "x"}]}
            r = await client.post("/v1/chat/completions", json=request)
            assert r.status_code == 200
            events = sse_events(r.content)
            assert any(b"internal error in the edge" in event for event in events)
            assert b"w9 " in r.content and b"w10 " not in r.content
            monkeypatch.setattr(output.LiveStream, "feed", feed)
            r = await client.post("/v1/chat/completions", json=request)
            assert r.status_code == 200 and content_of(r.content) == "".join(words)
    assert edge.edge.runs.links["n1"] is link  # the same link served both


def _server_after(request: bytes) -> h11.Connection:
    """A server-side h11 connection that has read ``request`` whole."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(request)
    while type(conn.next_event()) is not h11.EndOfMessage:
        pass
    return conn


def test_a_streams_head_is_what_h11_would_send_and_leaves_h11_as_h11_would():
    """The head of a stream, made without h11's send (direct._send_head): the same bytes and the
    same connection state after (framing, keep-alive, the next chunk's bytes) as h11's own send,
    with hypercorn's keep-alive-limit close header and a client's Connection: close; anything
    with framing or headers it does not vouch for is left to h11."""
    post = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n%b\r\n{}"
    ours = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"req_1"), (b"date", b"Tue, 01 Dec 2026")]
    cases = [
        (b"", ours),
        (b"", [*ours, (b"connection", b"close")]),  # hypercorn's keep_alive_max_requests
        (b"connection: close\r\n", ours),
        (b"Connection: keep-alive, close\r\n", [*ours, (b"connection", b"close")]),
    ]
    for request_extra, headers in cases:
        theirs, mine = _server_after(post % request_extra), _server_after(post % request_extra)
        expected = theirs.send(h11.Response(status_code=200, headers=headers))
        assert direct._send_head(mine, 200, list(headers)) == expected
        assert (mine.our_state, mine._cstate.keep_alive) == (theirs.our_state, theirs._cstate.keep_alive)
        assert mine.send(h11.Data(data=b"x")) == theirs.send(h11.Data(data=b"x")) == b"1\r\nx\r\n"
        assert mine.send(h11.EndOfMessage()) == theirs.send(h11.EndOfMessage())
        assert mine.our_state is theirs.our_state
    left_to_h11 = [
        [*ours, (b"content-length", b"10")],
        [*ours, (b"transfer-encoding", b"chunked")],
        [(b"connection", b"close"), *ours],  # a close header anywhere but hypercorn's place
        [*ours, (b"x-evil", b"a\r\nset-cookie: b")],  # header injection
        [*ours, (b"bad name", b"v")],
    ]
    for headers in left_to_h11:
        conn = _server_after(post % b"")
        assert direct._send_head(conn, 200, headers) is None
        assert conn.our_state is h11.SEND_RESPONSE  # untouched
    conn = _server_after(post % b"")
    assert direct._send_head(conn, 204, ours) is None  # h11 frames a 204 by length
    http10 = h11.Connection(h11.SERVER)
    http10.receive_data(b"POST / HTTP/1.0\r\ncontent-length: 0\r\n\r\n")
    while type(http10.next_event()) is not h11.EndOfMessage:
        pass
    assert direct._send_head(http10, 200, ours) is None  # h11 frames it by closing
