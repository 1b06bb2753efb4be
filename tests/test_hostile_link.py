"""Hostile nodes on the link: a message over max_frame_bytes is refused before the edge buffers it."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import struct

import msgspec
import pytest
import structlog
import trio
from trio_websocket import ConnectionClosed

from edge import connection
from proto import PROTOCOL_VERSION, Hello, ModelInfo, Pong, Welcome, decode_frame, encode_frame
from scripts.hostile_link import (
    BINARY,
    CLOSE,
    CONTINUATION,
    endless_deflated_fragments,
    endless_fragments,
    flood,
    frame_header,
    huge_frame,
    open_link,
)
from tests.conftest import BOUND, TOKEN, edge_config, eventually, http, model, start_edge, start_node

LIMIT = 1024 * 1024
BUDGET = 8 * LIMIT  # what a hostile node may push before the edge must have cut it
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def hostile_edge(nursery):
    return await start_edge(nursery, edge_config(max_frame_bytes=LIMIT))


async def still_serves(nursery, edge, upstream) -> None:
    await eventually(lambda: "hostile" not in edge.edge.runs.links, what="hostile link gone")
    await start_node(nursery, edge, [model("m", upstream)])
    async with http(edge) as client:
        r = await client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200


async def test_header_declaring_2_40_bytes_is_refused_at_the_header(nursery, upstream):
    """A frame header declaring 2^40 bytes gets a 1009 close and the connection cut before
    its payload is taken; the edge then serves a normal node."""
    edge = await hostile_edge(nursery)
    with trio.fail_after(BOUND):
        stream, frames = await open_link(edge.port, TOKEN)
        async with stream:
            result = await flood(stream, frames, huge_frame(bytes(64 * 1024)), BUDGET)
        assert result.cut and result.sent < BUDGET, result
        assert result.close_code == 1009
        await still_serves(nursery, edge, upstream)


async def test_endless_fragments_are_refused_once_past_the_limit(nursery, upstream):
    """Fragments of one message that never ends are refused at the fragment that takes the
    message past max_frame_bytes; the edge then serves a normal node."""
    edge = await hostile_edge(nursery)
    with trio.fail_after(BOUND):
        stream, frames = await open_link(edge.port, TOKEN)
        async with stream:
            result = await flood(stream, frames, endless_fragments(bytes(LIMIT // 4)), BUDGET)
        assert result.cut and result.sent < BUDGET, result
        assert result.close_code == 1009
        await still_serves(nursery, edge, upstream)


async def test_link_declines_compression(nursery, upstream):
    """The link doesn't negotiate permessage-deflate (a message's wire size is its size), and
    compressed fragments that would inflate past the limit are cut."""
    edge = await hostile_edge(nursery)
    with trio.fail_after(BOUND):
        stream, frames = await open_link(edge.port, TOKEN, deflate=True)
        async with stream:
            assert b"permessage-deflate" not in frames.upgrade.lower()
            result = await flood(stream, frames, endless_deflated_fragments(bytes(LIMIT)), BUDGET)
        assert result.cut and result.sent < BUDGET, result
        await still_serves(nursery, edge, upstream)


def ping_of_size(ts: float, size: int) -> bytes:
    """A node Ping frame (the edge answers with Pong(ts)), padded to exactly ``size`` bytes."""
    short = msgspec.msgpack.encode({"t": "ping", "ts": ts, "pad": b""})
    data = msgspec.msgpack.encode({"t": "ping", "ts": ts, "pad": bytes(size - len(short) - 3)})  # bin32 head: +3
    assert len(data) == size
    return data


async def test_messages_up_to_the_limit_still_pass(nursery):
    """A message of exactly max_frame_bytes passes, whole or in fragments; one byte more is refused with 1009."""
    edge = await hostile_edge(nursery)

    async def pong(frames) -> float:
        while True:
            opcode, payload = await frames.next()
            assert opcode == BINARY
            frame = decode_frame(payload)
            if isinstance(frame, Pong):
                return frame.ts

    with trio.fail_after(BOUND):
        stream, frames = await open_link(edge.port, TOKEN)
        async with stream:
            whole = ping_of_size(1.0, LIMIT)
            await stream.send_all(frame_header(BINARY, len(whole)) + whole)
            assert await pong(frames) == 1.0
            parts = ping_of_size(2.0, LIMIT)
            cuts = [0, 1000, LIMIT // 2, LIMIT]
            for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
                opcode = BINARY if i == 0 else CONTINUATION
                await stream.send_all(frame_header(opcode, b - a, fin=b == LIMIT) + parts[a:b])
            assert await pong(frames) == 2.0
            assert "hostile" in edge.edge.runs.links
            over = ping_of_size(3.0, LIMIT + 1)
            result = await flood(stream, frames, [frame_header(BINARY, len(over)) + over], BUDGET)
            assert result.cut and result.close_code == 1009, result


def test_frame_limit_reads_headers_across_any_split():
    """FrameLimit adds up the sizes declared by one message's fragments (not its control frames),
    and trips at the header that passes the limit, however the bytes are split."""
    from edge.frame_limit import FrameLimit

    first = frame_header(BINARY, 300, fin=False) + bytes(300)  # 16-bit length
    ping = frame_header(0x9, 5) + b"hello"  # a control frame inside the message
    last_head = frame_header(CONTINUATION, 700)
    message = first + ping + last_head + bytes(700)  # 1000 bytes of payload
    huge = frame_header(BINARY, 1 << 40)  # 64-bit length
    for step in (1, 7, 4096):
        limit = FrameLimit(1000)
        data = message + message + huge
        tripped = [i for i in range(0, len(data), step) if limit.exceeded(data[i : i + step])]
        assert tripped == [(len(data) - 1) // step * step], step  # only at the huge header
        tight = FrameLimit(999)
        tripped_at = next(i for i in range(0, len(data), step) if tight.exceeded(data[i : i + step]))
        end_of_head = len(first + ping + last_head) - 1
        assert tripped_at == end_of_head // step * step, step


async def test_a_frame_after_a_close_is_not_read_for_its_size(nursery):
    """A node's close frame and, in the same read, a header declaring more than the limit: the
    edge answered the close with 1009 (message too big), counting a frame wsproto never reads
    after a close. It answers 1000, the node's own close."""
    edge = await hostile_edge(nursery)
    with trio.fail_after(BOUND):
        stream, frames = await open_link(edge.port, TOKEN)
        async with stream:
            code = struct.pack("!H", 1000)
            await stream.send_all(frame_header(CLOSE, len(code)) + code + frame_header(BINARY, LIMIT + 1))
            opcode, payload = await frames.next()
            while opcode != CLOSE:  # (a ping may come first)
                opcode, payload = await frames.next()
        assert struct.unpack("!H", payload[:2])[0] == 1000
        await eventually(lambda: "hostile" not in edge.edge.runs.links, what="the link gone")


def test_frame_limit_refuses_a_hypercorn_it_was_not_written_for(monkeypatch):
    """The hypercorn patch is installed by create_app, and refuses to patch another hypercorn series."""
    from hypercorn.protocol.ws_stream import WSStream

    from edge.app import create_app
    from edge.frame_limit import install

    create_app(edge_config())
    assert WSStream.handle.frame_limit
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.0")
    with pytest.raises(RuntimeError, match="hypercorn 0.19.0"):
        install()


async def test_an_edge_links_max_links_nodes_at_most(nursery, monkeypatch):
    """One node token opened links without end: 400 of them, of 1,024 models each, held the edge's
    loop up to 1.3 s and, leaving at once, timed out an honest node's link. Past MAX_LINKS a hello
    is refused with 1013 (try again later), and the nodes linked go on serving. A node with a
    token of its own is not held to the cap: links of the shared token filled it and kept such a
    node out for as long as they stayed (found from outside)."""
    from edge import link as edge_link
    from tests.test_link import closed_by_edge, fake_node, hello

    monkeypatch.setattr(edge_link, "MAX_LINKS", 2)
    edge = await start_edge(nursery, edge_config(node_tokens={"own": "tok-own"}))
    for i in range(2):
        await start_node(nursery, edge, [model("m")], node_id=f"n{i}")

    async def one_too_many(ws):
        await ws.send_message(hello(node_id="third"))
        return await closed_by_edge(ws)

    with trio.fail_after(BOUND):
        closed = await fake_node(edge, one_too_many, node_id="third")
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            )
    assert closed.reason.code == 1013 and "2 nodes at most" in closed.reason.reason
    assert r.status_code == 200 and sorted(edge.edge.runs.links) == ["n0", "n1"]
    with trio.fail_after(BOUND):
        await start_node(nursery, edge, [model("m")], node_id="own", token="tok-own")  # (linked, or it fails)
    assert sorted(edge.edge.runs.links) == ["n0", "n1", "own"]


async def test_an_edge_serves_max_linked_models_at_most(nursery, monkeypatch):
    """Links of 1,024 models each, of long names, made every console snapshot 67 MB at 100 links
    (and /v1/nodes 30 MB at 20). The models of all links together are bounded: a hello that
    would pass MAX_LINKED_MODELS is refused with 1013, and a node that fits still links."""
    from edge import link as edge_link
    from tests.test_link import closed_by_edge, fake_node, hello

    monkeypatch.setattr(edge_link, "MAX_LINKED_MODELS", 3)
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m"), model("m2")], node_id="n0")

    async def too_many(ws):
        info = [ModelInfo(name=f"x{i}", adapter="sim", target="t", max_concurrency=1) for i in range(2)]
        await ws.send_message(encode_frame(Hello(node_id="big", protocol=PROTOCOL_VERSION, models=info)))
        return await closed_by_edge(ws)

    async def fits(ws):
        await ws.send_message(hello(node_id="small"))
        return decode_frame(await ws.get_message())

    with trio.fail_after(BOUND):
        closed = await fake_node(edge, too_many, node_id="big")
        welcome = await fake_node(edge, fits, node_id="small")
    assert closed.reason.code == 1013 and "3 models of its nodes at most" in closed.reason.reason
    assert isinstance(welcome, Welcome)


@pytest.mark.parametrize(
    ("late", "token"), [(False, ""), (True, ""), (False, TOKEN)], ids=["at once", "after the 401", "with the token"]
)
async def test_an_upgrade_request_with_a_body_is_answered_without_an_error(nursery, late, token):
    """A websocket upgrade to the node link that carries a body, from anyone (no token needed):
    one answer (hypercorn's 400, or the link's 401 when the body came after it) and the connection
    closes at once, with no error in the edge's log (it logged two tracebacks, 7 KB a request);
    with the node token, the link's handler ends too (it waited for the node's hello, 60 s here)."""
    edge = await start_edge(nursery, edge_config(hello_timeout_s=60))
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    auth = f"authorization: Bearer {token}\r\n".encode() if token else b""
    head = (
        b"GET /v1/node/link HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: upgrade\r\n%s"
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\ncontent-length: 5\r\n\r\n"
    ) % auth
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        stream = await trio.open_tcp_stream(host, int(port))
        if late:
            await stream.send_all(head)
            await trio.sleep(0.2)
            await stream.send_all(b"hello")
        else:
            await stream.send_all(head + b"hello")
        received = b""
        while data := await stream.receive_some(65536):
            received += data
        await stream.aclose()
        await trio.sleep(0.2)
    assert received.startswith(b"HTTP/1.1 401" if late else b"HTTP/1.1 400") and received.count(b"HTTP/1.1") == 1
    if not late:  # an OpenAI error, as every refusal (it had an empty body)
        error = json.loads(received.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "body_with_upgrade" and error["type"] == "invalid_request_error"
    assert [e["event"] for e in logs if e["log_level"] in ("error", "critical")] == []
    await eventually(lambda: not [s for s in connection.OPEN if s.config.iop_edge is edge.edge], "its connection ended")
    async with http(edge) as client:
        assert (await client.get("/healthz")).status_code == 200


def _upgrade(token: str, node_id: str) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {token}",
        "X-Iop-Node-Id": node_id,
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version": "13",
    }


async def test_links_waiting_for_their_hello_are_bounded(nursery, monkeypatch):
    """Upgrades with a valid token that never send a hello held a descriptor each until the hello
    timeout: 4 dialers held 4,097 at once (an outside attack). Past MAX_PENDING_HELLOS at once
    (the shared token's) an upgrade is refused with 503; a node linking once they are gone
    links. A node id with its own token has MAX_PENDING_HELLOS_PER_NODE of its own: one
    holding all of them (an outside re-audit: 12,168 refusals in 30 s, and no other node could
    link) keeps no other node out."""
    from edge import link as edge_link
    from tests.test_link_safety import hello as send_hello
    from tests.test_link_safety import open_link as open_ws_link

    monkeypatch.setattr(edge_link, "MAX_PENDING_HELLOS", 2)
    tokens = {"evil": "token-of-evil", "good": "token-of-good"}
    edge = await start_edge(nursery, edge_config(hello_timeout_s=60, node_tokens=tokens))
    pending = edge.edge.runs.pending_hellos
    with trio.fail_after(BOUND):
        silent = [await open_ws_link(edge, f"quiet{i}", nursery=nursery) for i in range(2)]
        silent += [await open_ws_link(edge, "evil", tokens["evil"], nursery=nursery) for _ in range(4)]
        await eventually(lambda: sum(pending.values()) == 6)
        async with http(edge) as client:  # (one client each: the refused upgrade's connection closes)
            refused = await client.get("/v1/node/link", headers=_upgrade(TOKEN, "third"))
        async with http(edge) as client:
            evil = await client.get("/v1/node/link", headers=_upgrade(tokens["evil"], "evil"))
        assert refused.status_code == evil.status_code == 503 and "opening at once" in refused.text
        stream, ws = await open_ws_link(edge, "good", tokens["good"], nursery=nursery)
        assert isinstance(await send_hello(ws, "good"), Welcome)
        await stream.aclose()
        for silent_stream, _ in silent:
            await silent_stream.aclose()
        await eventually(lambda: not pending)
        stream, ws = await open_ws_link(edge, "later", nursery=nursery)
        assert isinstance(await send_hello(ws, "later"), Welcome)
        await stream.aclose()


async def test_hellos_sent_together_stay_within_max_linked_models(nursery, monkeypatch):
    """Hellos sent at the same moment were each checked against MAX_LINKED_MODELS before any
    was linked (the check came before the welcome's send): 100 at once linked 94 nodes of 1,024
    models, six times the bound (an outside re-audit). The check is made again, with nothing
    between it and the link: one of three 2-model hellos links under a bound of 3."""
    from edge import link as edge_link
    from tests.test_link_safety import open_link as open_ws_link

    monkeypatch.setattr(edge_link, "MAX_LINKED_MODELS", 3)
    edge = await start_edge(nursery)
    models = [ModelInfo(name=f"x{i}", adapter="sim", target="t", max_concurrency=1) for i in range(2)]
    codes: list[int] = []
    with trio.fail_after(BOUND):
        links = [await open_ws_link(edge, f"n{i}", nursery=nursery) for i in range(3)]
        for i, (_, ws) in enumerate(links):  # every hello out before any answer is read
            await ws.send_message(encode_frame(Hello(node_id=f"n{i}", protocol=PROTOCOL_VERSION, models=models)))

        async def outcome(ws) -> None:  # a refused one may have its welcome first, then the close
            with trio.move_on_after(2), contextlib.suppress(ConnectionClosed):
                try:
                    while True:
                        await ws.get_message()
                except ConnectionClosed as closed:
                    codes.append(closed.reason.code)
                    raise

        async with trio.open_nursery() as reading:
            for _, ws in links:
                reading.start_soon(outcome, ws)
        await eventually(lambda: sum(len(lk.models) for lk in edge.edge.runs.links.values()) == 2)
    assert len(edge.edge.runs.links) == 1 and codes == [1013, 1013], codes
    for stream, _ in links:
        await stream.aclose()


async def test_refused_dials_are_logged_once_a_second(nursery):
    """Dials with a wrong token were logged one line each: 300 in 0.5 s, and no credential is
    needed for that (an outside re-audit). One line a second, with how many were refused."""
    edge = await start_edge(nursery)
    started = trio.current_time()
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        for i in range(50):
            async with http(edge) as client:
                r = await client.get("/v1/node/link", headers=_upgrade("wrong-token", f"n{i}"))
            assert r.status_code == 401
    seconds = trio.current_time() - started  # (a loaded machine takes more than one)
    lines = [e for e in logs if e["event"] == "node link refused: bad token"]
    assert 1 <= len(lines) <= seconds + 2 and len(lines) < 25 and lines[0]["refused"] == 1, (seconds, lines)
    assert lines[0]["peer"] == "127.0.0.1"  # (who tries tokens: it said null)
