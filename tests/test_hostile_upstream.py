"""A model server that misbehaves loses its own run, never the node's link, the node or other
runs: status lines, interim heads, SSE line endings, odd usage, tool-call floods, huge events
and error bodies that never end (what an outside audit found against node/http1.py and the
openai adapter)."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest
import trio

from node.adapters import openai as openai_adapter
from tests.conftest import BOUND, http, model, settled, sse_events, start_edge, start_node

USER = [{"role": "user", "content": "hi"}]


def chunk(delta: dict | None, finish: str | None = None, **extra) -> bytes:
    body = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


@pytest.fixture
async def stack(nursery, upstream):
    edge = await start_edge(nursery)
    node = await start_node(
        nursery,
        edge,
        [
            model("bad", upstream, target="b", passthrough=True),
            model("calm", ttft_ms=0, tokens_per_s=50, sim_tokens=40),  # the sim: a bystander stream
        ],
    )
    yield edge, upstream, node
    await settled(edge, node.agent)


async def chat(client: httpx.AsyncClient, name: str = "bad", **body) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={"model": name, "messages": USER, **body})


async def test_a_bad_status_line_fails_its_run_not_the_link(stack):
    """A status line of `99999999999999999999999` reached the node's frame encoder as an
    integer past 2^64: the link's sender died and every run on the node with it, a stream of
    another model included. Now that run is a 502 naming the status; the bystander streams
    on, the node keeps its link, and a passthrough request gets a 502 too."""
    edge, upstream, node = stack
    link = edge.edge.runs.links["n1"]
    bad = b"HTTP/1.1 99999999999999999999999 OK\r\ncontent-length: 0\r\n\r\n"
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as nursery:
            seen: list[bytes] = []

            async def bystander() -> None:
                async with client.stream(
                    "POST", "/v1/chat/completions", json={"model": "calm", "messages": USER, "stream": True}
                ) as r:
                    seen.append(b"".join([part async for part in r.aiter_bytes()]))

            nursery.start_soon(bystander)
            await trio.sleep(0.2)  # streaming
            upstream.script_for("b", [("response", bad)])
            r = await chat(client)
            tunnel = await client.post("/v1/completions", json={"model": "bad", "prompt": "hi"})
            upstream.script_for("b", [("response", b"HTTP/1.1 600 Odd\r\ncontent-length: 0\r\n\r\n")])
            odd = await chat(client)
    assert r.status_code == 502 and "invalid status code" in r.json()["error"]["message"]
    assert tunnel.status_code == 502 and "invalid status code" in tunnel.json()["error"]["message"]
    assert odd.status_code == 502
    assert seen[0].rstrip().endswith(b"data: [DONE]") and b'"error"' not in seen[0]
    assert list(edge.edge.runs.links.values()) == [link]  # the same link all along


async def test_interim_heads_then_the_answer(stack):
    """`100 Continue` and `103 Early Hints` before the answer were taken for it: the run waited
    for the wait timeout, or the client got the raw answer inside an error."""
    edge, upstream, _ = stack
    body = chunk({"content": "hello"}) + chunk(None, "stop") + b"data: [DONE]\n\n"
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    upstream.script_for("b", [("response", answer)])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await chat(client)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello"


async def test_odd_but_readable_streams_are_read(stack):
    """Lines ending in a bare CR (the SSE spec allows it) and a usage chunk with `choices: null`
    and counts like `7.0` or `"3"` were a failed run; they are an answer (a count that is not
    one is unknown)."""
    edge, upstream, _ = stack
    usage = {"prompt_tokens": 7.0, "completion_tokens": 2, "total_tokens": "9", "prompt_tokens_details": "x"}
    script = [
        ("raw", chunk({"content": "bare "}).replace(b"\n", b"\r")),
        ("raw", chunk({"content": "cr"}, "stop").replace(b"\n", b"\r\n")),
        ("raw", b'data: {"choices": null, "usage": ' + msgspec.json.encode(usage) + b"}\r\r"),
        ("done",),
    ]
    upstream.script_for("b", script)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await chat(client)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "bare cr"
    assert r.json()["usage"]["prompt_tokens"] == 7 and r.json()["usage"]["completion_tokens"] == 2


async def test_a_tool_call_flood_ends_the_run_early(stack):
    """Tool-call fragments were kept whole until the end: 1,000 new calls an event grew the node
    by 756 MB before the edge's wait timer ended it. Past 1,024 calls (or 8 MiB) the run
    fails at once, naming why; the node serves the next run."""
    edge, upstream, _ = stack
    flood = [
        (
            "chunk",
            {
                "tool_calls": [
                    {"index": i * 200 + j, "id": f"c{i}_{j}", "function": {"name": "f", "arguments": "{}"}}
                    for j in range(200)
                ]
            },
        )
        for i in range(50)
    ]
    upstream.script_for("b", [*flood, ("hang",)])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await chat(client)
            upstream.script_for("b", [("chunk", {"content": "ok"}, "stop"), ("done",)])
            after = await chat(client)
    assert r.status_code == 502 and "passed 1024 calls" in r.json()["error"]["message"]
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == "ok"
    assert upstream.records[0].aborted_at is not None  # the node closed the model server's stream


async def test_one_chunk_of_many_call_fragments_is_refused_at_once(stack):
    """One chunk listing 60,000 call fragments (180 KB): each fragment looked for the largest
    call so far, 28 s of the node's event loop, and the edge closed the node's link (no frame
    for 15 s), failing every run on it. The run fails at once past 1,024 calls; the node's
    link stays and another model's stream on it completes."""
    edge, upstream, node = stack
    link = edge.edge.runs.links["n1"]
    named = [{"index": 0, "id": f"i{i}", "function": {"name": "f"}} for i in range(60_000)]
    for fragments, why in (
        ([{}] * 60_000, "passed 1024 calls"),
        (named, "more than 65536 JSON objects and arrays"),  # 120,000 of them: not decoded at all
        (named[:30_000], "passed 1024 calls"),
    ):
        upstream.script_for("b", [("chunk", {"tool_calls": fragments}), ("hang",)])
        with trio.fail_after(BOUND):
            async with http(edge) as client:
                r, calm = await chat(client), await chat(client, "calm", max_tokens=4)
        assert r.status_code == 502 and why in r.json()["error"]["message"], r.text
        assert calm.status_code == 200, calm.text
    assert edge.edge.runs.links["n1"] is link  # never closed


async def test_clients_leaving_a_flood_of_tiny_deltas_leave_the_link_up(stack):
    """A model server sends one-character deltas, content and reasoning in turn (nothing joins),
    as fast as it can; eight clients leave. What the node still had queued for their runs reached
    the edge after its cancels, past the allowance for them: the edge closed the link as a flood,
    failing a stream of another model on the node. The node drops a cancelled run's queued events,
    and the edge allows for what an honest node has on the way; the link stays, the bystander
    completes."""
    edge, upstream, node = stack
    link = edge.edge.runs.links["n1"]
    burst = b"".join(
        b'data: {"choices":[{"index":0,"delta":{"%s":"x"}}]}\n\n' % (b"content" if i % 2 else b"reasoning_content")
        for i in range(2000)
    )
    upstream.script_for("b", [("raw", burst)] * 2000)
    with trio.fail_after(BOUND * 2):
        async with http(edge) as client, trio.open_nursery() as nursery:
            calm: list[bytes] = []

            async def bystander() -> None:
                body = {"model": "calm", "messages": USER, "stream": True}
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    calm.append(b"".join([part async for part in r.aiter_bytes()]))

            async def leaver() -> None:
                body = {"model": "bad", "messages": USER, "stream": True}
                with trio.move_on_after(1.0):
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        async for _ in r.aiter_bytes():
                            pass

            nursery.start_soon(bystander)
            for _ in range(8):
                nursery.start_soon(leaver)
    assert b"data: [DONE]" in calm[0] and b'"error"' not in calm[0], calm[0][-300:]
    assert edge.edge.runs.links.get("n1") is link  # never closed


async def test_oversized_events_and_errors_are_bounded_messages(stack):
    """One event past the parser's 8 MiB was a node traceback ("adapter failed") and a
    message about a node bug; a 3 MB error in an error chunk reached the client whole.
    Now each is a run error of a few KB naming what happened."""
    edge, upstream, _ = stack
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for("b", [("raw", b"data: " + b"x" * (9 << 20)), ("hang",)])
            huge = await chat(client)
            upstream.script_for("b", [("raw", b'data: {"error": "' + b"e" * (3 << 20) + b'"}\n\n'), ("hang",)])
            loud = await chat(client)
    assert huge.status_code == 502
    assert huge.json()["error"]["message"] == "upstream sent a server-sent event larger than 8388608 bytes"
    assert loud.status_code == 502 and len(loud.json()["error"]["message"]) < 5000


def _json_answer(body: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    return head + body


F_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]  # (offered: its call kept)


async def test_answers_that_are_not_streams_are_relayed_or_say_so(stack):
    """A server that ignores `stream: true` answers a whole `chat.completion` (JSON): it was a
    502 "answered application/json, not an event stream, and sent no finished answer" though
    it had sent one (an outside audit). It is relayed as the one event it would have streamed:
    its text, reasoning, tool calls, finish reason and usage, streamed or not to the client. A
    JSON body that is no completion, or an encoding never asked for, says what came, not
    "closed the stream before it finished"."""
    edge, upstream, _ = stack
    whole = {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "hi there",
                    "reasoning_content": "thinking",
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12},
    }
    gzip_answer = b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 3\r\n\r\nabc"
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for("b", [("response", _json_answer(msgspec.json.encode(whole)))])
            relayed = await chat(client, tools=F_TOOL)
            upstream.script_for("b", [("response", _json_answer(msgspec.json.encode(whole)))])
            streamed = await chat(client, stream=True, stream_options={"include_usage": True}, tools=F_TOOL)
            upstream.script_for("b", [("response", _json_answer(b'{"object": "list", "data": []}'))])
            plain = await chat(client)
            upstream.script_for("b", [("response", gzip_answer)])
            zipped = await chat(client)
            # An event stream labelled application/json (as some servers do) is read as one still
            # (a re-check found it a 502); a whole body past an event's bounds is not decoded.
            sse = b'data: {"choices": [{"index": 0, "delta": {"content": "as events"}}]}\n\ndata: [DONE]\n\n'
            upstream.script_for("b", [("response", _json_answer(sse))])
            labelled = await chat(client)
            flood = b'{"error": [' + b"{}," * 70_000 + b"{}]}"
            upstream.script_for("b", [("response", _json_answer(flood))])
            flooded = await chat(client)
    assert labelled.status_code == 200 and labelled.json()["choices"][0]["message"]["content"] == "as events"
    assert flooded.status_code == 502 and "more than 65536 JSON objects" in flooded.json()["error"]["message"]
    assert relayed.status_code == 200, relayed.text
    message = relayed.json()["choices"][0]["message"]
    assert message["content"] == "hi there" and message["reasoning_content"] == "thinking", message
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "f", "arguments": '{"a": 1}'}]
    assert relayed.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert relayed.json()["usage"]["total_tokens"] == 12
    chunks = [json.loads(e) for e in sse_events(streamed.content) if e != b"[DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "hi there"
    assert chunks[-1]["usage"]["completion_tokens"] == 5, chunks[-1]
    assert "upstream answered application/json, not an event stream" in plain.json()["error"]["message"]
    assert "gzip-encoded body" in zipped.json()["error"]["message"]


async def test_a_tunnelled_answer_in_a_content_coding_says_so(stack):
    """A provider that compresses though asked for identity: the passthrough relayed its gzip
    bytes to a /v1/completions client as they were, without their content-encoding, a 200 no
    client could read (an outside audit). It is the tunnel's 502, naming the coding, as chat's
    run error does."""
    edge, upstream, _ = stack
    gzip_answer = b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 3\r\n\r\nabc"
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for("b", [("response", gzip_answer)])
            zipped = await client.post("/v1/completions", json={"model": "bad", "prompt": "hi"})
            upstream.script_for("b", [("response", _json_answer(b'{"object": "text_completion"}'))])
            plain = await client.post("/v1/completions", json={"model": "bad", "prompt": "hi"})
    assert zipped.status_code == 502, zipped.text
    assert zipped.json()["error"]["code"] == "provider_tunnel_error", zipped.text
    assert "gzip-encoded body" in zipped.json()["error"]["message"], zipped.text
    assert plain.status_code == 200 and plain.json() == {"object": "text_completion"}


async def test_an_error_body_that_never_ends(stack, monkeypatch):
    """A 400 whose body never ends was read until the wait timeout (504 "run timed out"): the
    body now has its own deadline, and what came of it is the message, with its status."""
    monkeypatch.setattr(openai_adapter, "_ERROR_BODY_S", 0.3)
    edge, upstream, _ = stack
    head = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 9999\r\n\r\n"
    upstream.script_for("b", [("response", head + b'{"error": '), ("hang",)])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await chat(client)
    assert r.status_code == 400 and r.json()["error"]["message"] == 'upstream returned 400: {"error": '


async def test_an_answer_that_never_says_done_completes(stack):
    """A server that sends its finish and usage but neither `[DONE]` nor the end of the body
    held the run until the wait timeout (504 after the answer was whole). After the finish the
    rest of the stream has 2 s; then the answer is complete, with its usage."""
    edge, upstream, _ = stack
    usage = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    upstream.script_for("b", [("chunk", {"content": "whole"}, "stop"), ("hang",)])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            started = trio.current_time()
            r = await chat(client)
            waited = trio.current_time() - started
            # Its usage after the finish: nothing more is awaited (it waited the 2 s as well); the
            # text read with them is the answer's (one read of the three)
            sse = b"".join(
                b"data: " + msgspec.json.encode(chunk) + b"\n\n"
                for chunk in (
                    {"choices": [{"index": 0, "delta": {"content": "whole"}}]},
                    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                    {"choices": [], "usage": usage},
                )
            )
            upstream.script_for("b", [("raw", sse), ("hang",)])
            started = trio.current_time()
            with_usage = await chat(client)
            at_once = trio.current_time() - started
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "whole", r.text
    assert with_usage.status_code == 200 and with_usage.json()["usage"]["total_tokens"] == 5, with_usage.text
    assert with_usage.json()["choices"][0]["message"]["content"] == "whole", with_usage.text
    assert waited >= 1.9 and at_once < 1.5, (waited, at_once)
    # The finish with its usage in one chunk (vLLM's usage in every chunk): at once too.
    upstream.script_for("b", [("raw", b"data: " + msgspec.json.encode(finish_with_usage(usage)) + b"\n\n"), ("hang",)])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            started = trio.current_time()
            same_chunk = await chat(client, stream=True)
            at_once = trio.current_time() - started
    assert same_chunk.status_code == 200 and b'"content":"whole"' in same_chunk.content, same_chunk.text
    assert at_once < 1.5, at_once


def finish_with_usage(usage: dict) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": "whole"}, "finish_reason": "stop"}], "usage": usage}


async def test_after_its_finish_an_answer_takes_only_its_usage(stack):
    """After the chunk that finished the answer: content the server goes on sending is not
    relayed (4.8 MB of it reached a client in the 2 s the rest of a stream has), and a chunk
    that cannot be read (a usage of 1e400) ends the stream; it failed an answer the client
    already had with a 502."""
    edge, upstream, _ = stack
    more = [("chunk", {"content": "MORE"})] * 100
    unreadable = b'data: {"choices":[],"usage":{"prompt_tokens":1e400}}\n\n'
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for("b", [("chunk", {"content": "whole"}, "stop"), *more, ("done",)])
            after = await chat(client)
            upstream.script_for("b", [("chunk", {"content": "whole"}, "stop"), ("raw", unreadable), ("hang",)])
            unread = await chat(client, stream=True)
            upstream.script_for("b", [("chunk", {"content": "whole"}, "stop"), ("raw", b"data: " + b"x" * (9 << 20))])
            oversized = await chat(client)
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == "whole", after.text
    assert unread.status_code == 200 and b'"content":"whole"' in unread.content, unread.text
    assert oversized.status_code == 200 and oversized.json()["choices"][0]["message"]["content"] == "whole"
    assert b'"error"' not in unread.content and unread.content.endswith(b"data: [DONE]\n\n"), unread.text[-300:]


async def test_an_upstream_error_after_the_finish_leaves_the_answer_whole(stack):
    """An error event or error chunk after the chunk that finished the answer failed it: an
    in-stream error in place of the finish, and a 502 for a whole answer the server had given
    (an outside audit). The answer stands, with its usage."""
    edge, upstream, _ = stack
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    head = [("chunk", {"content": "whole"}, "stop"), ("usage", usage)]
    late = {
        "error chunk": b'data: {"error": {"message": "late upstream error"}}\n\n',
        "error event": b'error: {"message": "late"}\n\n',
    }
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for what, raw in late.items():
                upstream.script_for("b", [*head, ("raw", raw), ("done",)])
                whole = await chat(client)
                upstream.script_for("b", [*head, ("raw", raw), ("done",)])
                streamed = await chat(client, stream=True, stream_options={"include_usage": True})
                assert whole.status_code == 200, (what, whole.text)
                assert whole.json()["choices"][0]["message"]["content"] == "whole", what
                assert whole.json()["usage"]["total_tokens"] == 10, what
                assert b'"error"' not in streamed.content, (what, streamed.text[-300:])
                assert b'"finish_reason":"stop"' in streamed.content and b'"total_tokens":10' in streamed.content


async def test_a_chunk_of_millions_of_values_is_not_decoded(stack):
    """One event of ``{"choices":[{},{},…]}`` (7 MiB, 2.4 million empty choices) took the node
    about 265 MB and held its loop 0.3-0.65 s while it was decoded, then read as an empty answer.
    A chunk, usage or error event holding more values than any chunk is not decoded: the run
    fails naming why, and another model's stream on the node completes. An honest chunk of
    7 MiB of text full of brackets and commas is served whole."""
    edge, upstream, _ = stack
    link = edge.edge.runs.links["n1"]
    many = b",".join([b"{}"] * ((7 << 20) // 3))
    floods = {
        b'data: {"choices":[' + many + b"]}\n\n": "more than 65536 JSON objects and arrays",
        b'data: {"usage":{"prompt_tokens_details":[' + b",".join([b"1"] * (3 << 20)) + b"]}}\n\n": (
            "more than 262144 JSON values"
        ),
    }
    text = "a, {b}, [c]; " * 500_000  # 6.5 MB: 1.5 million of each, inside one string
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for flood, why in floods.items():
                upstream.script_for("b", [("raw", flood), ("hang",)])
                r, calm = await chat(client), await chat(client, "calm", max_tokens=4)
                assert r.status_code == 502 and why in r.json()["error"]["message"], r.text[:300]
                assert calm.status_code == 200, calm.text
            upstream.script_for("b", [("raw", b'event: error\ndata: {"message":[' + many + b"]}\n\n"), ("hang",)])
            loud = await chat(client)
            upstream.script_for("b", [("chunk", {"content": text}, "stop"), ("done",)])
            honest = await chat(client)
    # the error event's text, as it came (not decoded into millions of objects and printed back)
    assert loud.status_code == 502 and loud.json()["error"]["message"].startswith('upstream error: {"message":[{},')
    assert honest.status_code == 200 and honest.json()["choices"][0]["message"]["content"] == text
    assert edge.edge.runs.links["n1"] is link  # never closed


async def test_output_the_client_never_sees_pays_for_a_bounded_stream(stack, monkeypatch):
    """Each character of output pays for 16 KiB of stream, and characters the client never sees
    paid too: 10 characters of `<|im_end|>` (removed by the edge) and 160 KB of padding a chunk
    read 6 GB in 30 s (a node core) for 833 bytes to the client. A stream has a bound in all
    (1 GiB; 8 MiB here): past it the run fails naming it, and another stream on the node is
    whole."""
    monkeypatch.setattr(openai_adapter, "_MAX_STREAM", 8 << 20)
    edge, upstream, _ = stack
    padded = chunk({"content": "<|im_end|>"}, padding=" " * 150_000)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for("b", [("raw", padded)] * 100 + [("hang",)])
            r, calm = await chat(client), await chat(client, "calm", max_tokens=4)
    said = r.json()["error"]["message"]
    assert r.status_code == 502 and said == "upstream sent more than 8 MiB for one answer", said
    assert calm.status_code == 200 and calm.json()["choices"][0]["message"]["content"]
    assert upstream.records[0].aborted_at is not None  # the node closed the model server's stream


async def test_bytes_with_no_output_end_the_run(stack):
    """A model server that sends bytes but no output (empty deltas without end, one character
    a MiB of them, or trailers without end after the last chunk) kept a node core reading
    until the edge's wait timeout (120 s). Past 32 MiB of stream that no output paid for (16
    KiB a character), or 64 KiB of trailers, the run fails naming why; trailers that never end
    after an answer that finished leave it whole."""
    edge, upstream, _ = stack
    empty = chunk({}) * ((1 << 20) // len(chunk({})))  # ~1 MB of empty deltas
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    def chunked(*events: bytes) -> bytes:
        return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n" + b"x-t: y\r\n" * 150_000

    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for("b", [("chunk", {"content": "hi"}), *[("raw", empty)] * 40, ("hang",)])
            quiet = await chat(client)
            # tool-call fragments that add nothing are no output either
            nothing = chunk({"tool_calls": [{"index": 0}]}) * ((1 << 20) // len(chunk({"tool_calls": [{"index": 0}]})))
            upstream.script_for("b", [("chunk", {"content": "hi"}), *[("raw", nothing)] * 40, ("hang",)])
            fragments = await chat(client)
            upstream.script_for("b", [*[("raw", empty), ("chunk", {"content": "x"})] * 40, ("hang",)])
            padded = await chat(client)
            upstream.script_for("b", [("response", head + chunked(chunk({"content": "hi"}))), ("hang",)])
            trailing = await chat(client)
            upstream.script_for("b", [("response", head + chunked(chunk({"content": "whole"}, "stop"))), ("hang",)])
            finished = await chat(client)
            upstream.script_for("b", [("chunk", {"content": "ok"}, "stop"), ("done",)])
            after = await chat(client)
    for silent in (quiet, fragments, padded):
        said = silent.json()["error"]["message"]
        assert silent.status_code == 502 and said == "upstream sent 32 MiB with little or no output", said
    assert trailing.status_code == 502 and "trailers too long" in trailing.json()["error"]["message"], trailing.text
    assert finished.status_code == 200 and finished.json()["choices"][0]["message"]["content"] == "whole"
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == "ok"
    assert upstream.records[0].aborted_at is not None  # the node closed the model server's stream
