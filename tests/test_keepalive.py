"""Idle kept-alive client connections (edge.keepalive): closed once hypercorn's
keep_alive_timeout passes with no request, never while a request is in flight
or while requests keep coming, and at once when the edge starts shutting down."""

from __future__ import annotations

import itertools
import re
import ssl
from functools import partial

import hypercorn.trio
import trio
import trustme

from edge import keepalive
from edge.app import create_app, edge_of
from edge.keepalive import TICK
from edge.serve import hypercorn_config, serve_edge
from scripts.upstream import text_script, words
from tests.conftest import BOUND, EdgeHandle, edge_config, model, start_edge, start_node

TIMEOUT = 1.0  # the keep-alive timeout these edges run with (the edge's own is 75 s)
GET = b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n"


async def serve(nursery, shutdown: trio.Event | None = None, keep_alive: float = TIMEOUT):
    """An edge whose hypercorn has a short keep_alive_timeout; its port and the task's scope."""
    app = create_app(edge_config())
    hc = hypercorn_config(app, "127.0.0.1:0")
    hc.keep_alive_timeout = keep_alive
    trigger = shutdown.wait if shutdown is not None else None
    stopped = trio.Event()

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        try:
            await hypercorn.trio.serve(app, hc, shutdown_trigger=trigger, task_status=task_status)
        finally:
            stopped.set()

    binds = await nursery.start(run)
    return app, int(binds[0].rsplit(":", 1)[1]), stopped


async def request(sock: trio.SocketStream, raw: bytes, until: bytes) -> bytes:
    await sock.send_all(raw)
    data = b""
    while until not in data:
        more = await sock.receive_some(65536)
        assert more, f"the edge closed the connection mid-response: {data!r}"
        data += more
    return data


async def closed_after(sock: trio.SocketStream) -> float:
    """Seconds until the edge closes ``sock`` (EOF or reset)."""
    start = trio.current_time()
    try:
        while await sock.receive_some(65536):
            pass
    except trio.BrokenResourceError:
        pass
    return trio.current_time() - start


async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(nursery):
    _, port, _ = await serve(nursery)
    with trio.fail_after(BOUND):
        async with await trio.open_tcp_stream("127.0.0.1", port) as sock:
            assert b"HTTP/1.1 200 " in await request(sock, GET, b'"ok"}')
            waited = await closed_after(sock)
    assert TIMEOUT - 0.1 <= waited <= TIMEOUT + TICK + 1.0


async def test_requests_that_keep_coming_keep_the_connection(nursery):
    """Gaps shorter than the timeout, for three times the timeout (nine gaps of a third of it):
    one connection serves them all."""
    _, port, _ = await serve(nursery)
    with trio.fail_after(BOUND):
        async with await trio.open_tcp_stream("127.0.0.1", port) as sock:
            for i in range(10):  # a count, not a time: a slow machine's slower requests change nothing
                if i:
                    await trio.sleep(TIMEOUT / 3)
                assert b"HTTP/1.1 200 " in await request(sock, GET, b'"ok"}')
            idle_since = trio.current_time()  # from the last answer, not from after another gap
            await closed_after(sock)
            assert TIMEOUT - 0.1 <= trio.current_time() - idle_since  # and idle again, it is timed again


async def test_a_stream_longer_than_the_timeout_is_not_cut(nursery, upstream):
    """While a request is in flight its connection is not idle, however long the answer takes."""
    app, port, _ = await serve(nursery)
    upstream.script_for("slow", lambda body: text_script(words(12), interval=0.25))
    handle = EdgeHandle(app, edge_of(app), f"http://127.0.0.1:{port}", trio.CancelScope())
    await start_node(nursery, handle, [model("m", upstream, target="slow")])
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    post = b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
    post += b"content-length: %d\r\n\r\n%s" % (len(body), body)
    with trio.fail_after(BOUND):
        while not edge_of(app).runs.links:
            await trio.sleep(0.02)
        async with await trio.open_tcp_stream("127.0.0.1", port) as sock:
            start = trio.current_time()
            answer = await request(sock, post, b"data: [DONE]\n\n\r\n0\r\n\r\n")
            assert trio.current_time() - start > 2 * TIMEOUT
            assert b"tok11" in answer
            assert b"HTTP/1.1 200 " in await request(sock, GET, b'"ok"}')  # the same connection, still open


async def test_shutdown_closes_idle_connections_at_once(nursery):
    shutdown = trio.Event()
    # A keep-alive timeout far longer than "at once" may take on a slow machine.
    _, port, stopped = await serve(nursery, shutdown, keep_alive=10 * TIMEOUT)
    with trio.fail_after(BOUND):
        socks = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
        for sock in socks:
            assert b"HTTP/1.1 200 " in await request(sock, GET, b'"ok"}')
        shutdown.set()
        for sock in socks:
            assert await closed_after(sock) < 5 * TIMEOUT  # not after the keep-alive timeout
            await sock.aclose()
        await stopped.wait()


async def test_a_connection_close_request_is_closed_after_its_answer(nursery):
    """`Connection: close` on a route Quart serves: the edge closes the connection after its
    answer, every time. About half stayed open for good (quart-trio cancelled hypercorn's close
    as it began; not idle, so no keep-alive timeout reaped them): 2,000 such requests held 1,016
    sockets at 85 s, and an edge out of descriptors answered no one."""
    _, port, _ = await serve(nursery, keep_alive=60)
    answers = []

    async def ask(path: bytes) -> None:
        sock = await trio.open_tcp_stream("127.0.0.1", port)
        async with sock:
            raw = b"GET " + path + b" HTTP/1.1\r\nhost: edge\r\nconnection: close\r\n\r\n"
            answers.append(await request(sock, raw, b"\r\n\r\n"))
            await closed_after(sock)

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as clients:
            for i in range(60):
                clients.start_soon(ask, (b"/healthz", b"/v1/zzz", b"/readyz")[i % 3])
    assert len(answers) == 60 and all(b"connection: close" in a.lower() for a in answers)


async def test_bytes_after_a_connections_last_request_are_ignored_not_an_error(nursery):
    """A request that says it is its connection's last (`Connection: close`, HTTP/1.0) and is
    followed by more bytes: a stray CRLF (RFC 9112 2.2: ignore it) or a pipelined request (9.6:
    never process it). The request gets its own answer, whole, and the connection closes: it got
    400 `invalid_http` (its run already sent to the node), or a stream cut mid-way."""
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", sim_tokens=3)])
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": %b}'
    after = (b"\r\n", b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n")
    with trio.fail_after(BOUND):
        for stream, version, extra, trailing in itertools.product(
            (b"true", b"false"), (b"1.1", b"1.0"), (b"connection: close\r\n", b""), after
        ):
            if version == b"1.1" and not extra:
                continue  # (kept alive: the pipelined request is answered too, elsewhere)
            data = body % stream
            head = b"POST /v1/chat/completions HTTP/%b\r\nhost: edge\r\ncontent-type: application/json\r\n" % version
            raw = head + extra + b"content-length: %d\r\n\r\n" % len(data) + data + trailing
            async with await trio.open_tcp_stream("127.0.0.1", edge.port) as sock:
                await sock.send_all(raw)
                received = b""
                while more := await sock.receive_some(65536):
                    received += more
            case = (stream, version, extra, trailing)
            assert received.startswith(b"HTTP/1.1 200 "), (case, received[:200])
            assert received.count(b"HTTP/1.1 ") == 1, case  # the pipelined request: not answered
            assert b'"finish_reason":"stop"' in received, (case, received[-300:])  # whole
            assert (b"data: [DONE]" in received) == (stream == b"true"), case


async def test_blank_lines_between_requests_are_ignored(nursery):
    """Blank lines before a request on a kept-alive connection (RFC 9112 2.2: a server SHOULD
    ignore them): a POST, a CRLF and a GET in one write; a CRLF alone after an answer, then a
    request; LFs before the first. Each request gets its own answer, in order. h11 raised on
    them: the request behind them got a 400 `invalid_http` and the connection closed (a
    re-check found it)."""
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", sim_tokens=3)])
    data = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    post = b"POST /v1/chat/completions HTTP/1.1\r\nhost: edge\r\ncontent-type: application/json\r\n"
    post += b"content-length: %d\r\n\r\n" % len(data) + data
    get = b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n"
    last = post.replace(b"host: edge\r\n", b"host: edge\r\nconnection: close\r\n")
    with trio.fail_after(BOUND):
        async with await trio.open_tcp_stream("127.0.0.1", edge.port) as sock:
            await sock.send_all(b"\n\n" + post + b"\r\n" + get)
            await trio.sleep(0.5)  # (answered: the next CRLF comes alone, between requests)
            await sock.send_all(b"\r\n")
            await trio.sleep(0.1)
            await sock.send_all(last)
            received = b""
            while more := await sock.receive_some(65536):
                received += more
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", received)
    assert statuses == [b"200", b"200", b"200"], received[-600:]
    assert received.count(b'"finish_reason":"stop"') == 2
    assert b"invalid_http" not in received


H2C_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # and an empty SETTINGS


async def test_a_connection_that_never_sends_a_request_is_closed_after_the_timeout(nursery):
    """Connections that connect and send no request, or only HTTP/2's preface (h2c, prior
    knowledge), or half a request head, are closed as idle ones are. An h2c connection with no
    stream was never closed (found from outside: 20,000 of them held every descriptor of the
    edge, and no new client could connect)."""
    _, port, _ = await serve(nursery)
    with trio.fail_after(BOUND):
        for opening in (b"", H2C_PREFACE, b"GET /healthz HTTP/1.1\r\nhost: e"):
            async with await trio.open_tcp_stream("127.0.0.1", port) as sock:
                if opening:
                    await sock.send_all(opening)
                waited = await closed_after(sock)
            assert waited <= TIMEOUT + TICK + 1.0, (opening[:20], waited)


async def test_past_the_descriptor_budget_a_new_connection_closes_the_longest_idle(nursery, monkeypatch):
    """Past the edge's budget of open connections (80% of its descriptor limit; 4 here) each
    connection closes the two idle longest, so idle connections cannot lock new clients out for
    the keep-alive timeout (reconnecting every 75 s, for good). The newest is served."""
    monkeypatch.setattr(keepalive, "MAX_OPEN", 4)
    _, port, _ = await serve(nursery, keep_alive=30 * TIMEOUT)
    with trio.fail_after(BOUND):
        idle = []
        for _ in range(4):
            idle.append(await trio.open_tcp_stream("127.0.0.1", port))
            await trio.sleep(0.05)  # (accepted in this order: the first is the longest idle)
        async with await trio.open_tcp_stream("127.0.0.1", port) as newest:
            assert b"HTTP/1.1 200 " in await request(newest, GET, b'"ok"}')
            assert await closed_after(idle[0]) < 5 * TIMEOUT and await closed_after(idle[1]) < 5 * TIMEOUT
            for sock in idle[2:]:  # (the budget holds again: these stay)
                with trio.move_on_after(TIMEOUT):
                    await closed_after(sock)
                    raise AssertionError("a connection within the budget was closed")
        for sock in idle:
            await sock.aclose()


async def test_failed_tls_handshakes_do_not_count_as_open_connections(nursery, monkeypatch, tmp_path):
    """A TLS edge, and connections that never finish their handshake (a load balancer's TCP
    health check, a scanner): each stayed counted open for good (hypercorn returns before its
    close), and once they passed the budget every connection going idle closed the two idle
    longest, healthy ones, until the edge restarted (found from outside). After 12 of them,
    on a budget of 10, a kept-alive client is still served on its connection."""
    monkeypatch.setattr(keepalive, "MAX_OPEN", 10)
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    app = create_app(edge_config())
    url = await nursery.start(partial(serve_edge, app, "127.0.0.1:0", certfile=str(certfile), keyfile=str(keyfile)))
    port = int(url.rsplit(":", 1)[1])
    with trio.fail_after(BOUND):
        kept = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=context)
        assert b"HTTP/1.1 200 " in await request(kept, GET, b'"ok"}')
        for _ in range(12):
            await (await trio.open_tcp_stream("127.0.0.1", port)).aclose()
        async with await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=context) as other:
            assert b"HTTP/1.1 200 " in await request(other, GET, b'"ok"}')  # (it goes idle: it would shed)
            await trio.sleep(0.3)
            assert b"HTTP/1.1 200 " in await request(kept, GET, b'"ok"}')
        await kept.aclose()


async def test_shedding_goes_on_when_a_connection_it_picked_leaves_meanwhile(monkeypatch):
    """The two idle longest are closed one after the other; while the first closes, the second
    may end or become busy (another connection's task takes it off the list). Shedding skips it:
    it raised KeyError, which closed the connection that was shedding, a new client's (found
    from outside: 1,085 tracebacks in 9 s of a flood, and fresh clients dropped)."""
    monkeypatch.setattr(keepalive, "MAX_OPEN", 1)

    class Connection:
        def __init__(self, idle, name: str) -> None:
            self.name, self.idle = name, idle
            self.config = type("Config", (), {"keep_alive_timeout": 60.0})()

        async def _initiate_server_close(self) -> None:
            closed.append(self.name)
            self.idle.deadlines.pop(second, None)  # (meanwhile, the second went busy)
            await trio.lowlevel.checkpoint()

    context = type("Context", (), {"terminated": trio.Event()})()
    idle = keepalive._IdleConnections(context)
    first, second, newest = Connection(idle, "first"), Connection(idle, "second"), Connection(idle, "newest")
    closed: list[str] = []
    with trio.fail_after(BOUND):
        for connection in (first, second, newest):
            idle.open.add(connection)
        idle.deadlines[first] = idle.deadlines[second] = 0.0
        await idle.add(newest)  # (raised KeyError)
        context.terminated.set()  # (its reaper ends)
    assert closed == ["first"] and list(idle.deadlines) == [newest]
