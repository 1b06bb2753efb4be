"""Bad input gets a clear OpenAI-shaped error and changes nothing else."""

from __future__ import annotations

import openai
import pytest
import trio

from tests.conftest import BOUND, edge_config, http, sdk, settled, start_edge

MESSAGES = [{"role": "user", "content": "hi"}]


def assert_openai_error(r, status: int, *, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": []}', "messages"),
        (b'{"model": "m", "messages": "hi"}', "messages"),
        (b'{"model": 3, "messages": [{"role": "user", "content": "hi"}]}', "model"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}', "temperature"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "stream"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
        # Asked to hide reasoning with the wrong type: a 400, never the reasoning shown.
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "reasoning": {"exclude": "true"}}',
            "reasoning.exclude",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "reasoning": {"exclude": 1}}',
            "reasoning.exclude",
        ),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": 5}', "metadata"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}',
            "messages[0].content[0].text",
        ),
        (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": ["x"]}', "metadata"),
    ],
)
async def test_malformed_requests_are_400(edge, node, body, param):
    """Malformed JSON and wrong types are a 400 naming the offending field; no run starts."""
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400, param=param)
    assert err["type"] == "invalid_request_error"
    assert edge.edge.runs.in_flight == 0


async def test_unknown_model_is_404_model_not_found(edge, node):
    """A model no node serves (or ever served) is a 404 with code model_not_found, saying where the
    served ones are listed; the SDK raises NotFoundError."""
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            with pytest.raises(openai.NotFoundError) as caught:
                await client.chat.completions.create(model="nope", messages=MESSAGES)
    assert caught.value.code == "model_not_found"
    assert "GET /v1/models lists" in caught.value.message


async def test_any_model_is_503_while_no_node_is_linked(edge):
    """With no node linked at all, the edge cannot tell a model from a typo: 503, not 404."""
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "anything", "messages": MESSAGES})
    assert_openai_error(r, 503, code="no_node_available")
    assert r.headers["retry-after"] == "1"  # (nodes relink within a second or two of an edge's start)


async def test_configured_model_with_no_node_is_503(nursery):
    """A model the edge knows (configured) with no node linked is a 503, not a 404."""
    edge = await start_edge(nursery, edge_config(models=[{"name": "later"}]))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "later", "messages": MESSAGES})
    assert_openai_error(r, 503, code="no_node_available")


async def test_model_whose_node_left_is_503(edge, node):
    """Once a node served a model, its absence is a temporary 503."""
    node.stop()
    with trio.fail_after(BOUND):
        while edge.edge.runs.links:
            await trio.sleep(0.005)
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert_openai_error(r, 503)


async def test_body_over_the_limit_is_413(nursery):
    """A body over max_body_bytes is refused with 413 before it is parsed."""
    edge = await start_edge(nursery, edge_config(max_body_bytes=1000))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
            r = await client.post("/v1/chat/completions", json=big)
    assert_openai_error(r, 413, code="request_too_large")


async def test_too_many_messages_is_400(nursery):
    """The message count limit gives a 400 that says so."""
    edge = await start_edge(nursery, edge_config(max_messages=2))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES * 3})
    assert_openai_error(r, 400, param="messages", code="too_many_messages")


async def test_unknown_route_and_wrong_method(edge, node):
    """Unknown routes and methods answer in the OpenAI error shape too."""
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            assert_openai_error(await client.get("/v1/nothing"), 404)
            # As OpenAI's 404: the method and path, and the base-URL mistakes that cause most of them.
            unknown = await client.get("/v1/nothing")
            assert unknown.json()["error"]["message"] == "Unknown route: GET /v1/nothing."
            no_v1 = (await client.post("/chat/completions", json={})).json()["error"]["message"]
            assert no_v1.startswith("Unknown route: POST /chat/completions.") and "missing /v1" in no_v1
            twice = (await client.post("/v1/v1/messages", json={})).json()["error"]["message"]
            assert "adds /v1 itself" in twice
            # A base URL ending in /: the path as sent (it said "POST /v1/chat/completions", a route).
            slashes = (await client.post(f"{edge.url}//v1/chat/completions", json={})).json()["error"]["message"]
            assert slashes.startswith("Unknown route: POST //v1/chat/completions.") and "end with a /" in slashes
            # A base URL of the whole endpoint, or a path ending in /: said (it was a bare "Unknown route").
            whole = await client.post("/v1/chat/completions/chat/completions", json={})
            assert "the whole endpoint" in whole.json()["error"]["message"]
            trailing = await client.post("/v1/chat/completions/", json={})
            assert "the route is /v1/chat/completions." in trailing.json()["error"]["message"]
            nul = (await client.post("/v1/chat/completions%00", json={})).json()["error"]["message"]
            assert "Unknown route" in nul and "ends with a /" not in nul, nul  # (it said so: an outside audit)
            models = (await client.get("/v1/models")).json()["data"]
            card = await client.get(f"/v1/models/{models[0]['id']}/")
            assert f"the route is /v1/models/{models[0]['id']}." in card.json()["error"]["message"]
            link = await client.get("/v1/node/link")  # (a node's websocket, not a route for plain HTTP)
            assert link.status_code == 426 and "iop node" in link.json()["error"]["message"]
            wrong = await client.get("/v1/chat/completions")
            assert_openai_error(wrong, 405)
            assert wrong.headers["allow"] == "POST"  # what a 405 must say (RFC 9110)
            quart = await client.post("/v1/models")
            assert_openai_error(quart, 405)
            assert "GET" in quart.headers["allow"]
    await settled(edge, node.agent)


async def test_absolute_form_request_lines_and_double_slashes(edge, node):
    """A request line in absolute form (``POST http://host/v1/... HTTP/1.1``), which an HTTP/1.1
    server must accept, is served by its path (it was a 404 blaming a //); a GET route with //
    in its path is the JSON 404 that says why, not an HTML 308 redirect past the key check."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'

    async def raw(line: bytes, body: bytes = b"") -> bytes:
        stream = await trio.open_tcp_stream("127.0.0.1", edge.port)
        head = line + b"\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
        await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        answer = b""
        while data := await stream.receive_some(65536):
            answer += data
        await stream.aclose()
        return answer

    with trio.fail_after(BOUND):
        served = await raw(b"POST http://elsewhere.example/v1/chat/completions HTTP/1.1", body)
        models = await raw(b"GET HTTPS://elsewhere.example/v1/models HTTP/1.1")
        async with http(edge) as client:
            doubled = await client.get("/v1//models")
        # Leading: Quart's routes matched them as the path with one / (200s, logged under api "other")
        leading = [await raw(b"GET %s HTTP/1.1" % path) for path in (b"//v1/models", b"//metrics", b"///healthz")]
        root = await raw(b"GET // HTTP/1.1")
    assert served.startswith(b"HTTP/1.1 200 ") and b'"choices"' in served, served[:300]
    assert models.startswith(b"HTTP/1.1 200 ") and b'"data"' in models, models[:300]
    assert_openai_error(doubled, 404)
    assert "end with a /" in doubled.json()["error"]["message"]
    for answer in leading:
        assert answer.startswith(b"HTTP/1.1 404 ") and b"end with a /" in answer, answer[:300]
    assert root.startswith(b"HTTP/1.1 200 "), root[:300]  # (a base URL of / alone: the edge's root)
    await settled(edge, node.agent)


async def test_bad_requests_leave_the_edge_serving(edge, node):
    """After a burst of bad requests the edge still serves good ones."""
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for _ in range(20):
                await client.post("/v1/chat/completions", content=b"\x00\xff garbage")
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 1})
    assert r.status_code == 200
    await settled(edge, node.agent)
