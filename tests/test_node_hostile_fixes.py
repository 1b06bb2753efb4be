"""What an outside audit found the node doing with a hostile model server or schema, now
answered: JSON nested past msgspec's limit, an event that never ends sent a few bytes at a
time, a body kept open after `[DONE]`, a byte order mark, `[DONE] ` with a space, and tool
schemas that asked the sim for billions of values; and the sim answering `response_format`."""

from __future__ import annotations

import httpx
import jsonschema
import msgspec
import pydantic
import pytest
import trio

from node.adapters.sim_tools import sample
from node.adapters.sse import EventTooLarge, SSEParser
from tests.conftest import BOUND, http, model, sdk, settled, start_edge, start_node

USER = [{"role": "user", "content": "hi"}]
BOM = b"\xef\xbb\xbf"


def chunk(delta: dict | None, finish: str | None = None) -> bytes:
    body = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


@pytest.fixture
async def stack(nursery, upstream):
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("bad", upstream, target="b", max_concurrency=1)])
    yield edge, upstream, node
    await settled(edge, node.agent)


async def chat(client: httpx.AsyncClient, **body) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={"model": "bad", "messages": USER, **body})


async def test_json_nested_past_the_decoders_limit_is_undecodable_not_a_node_bug(stack):
    """msgspec raises RecursionError, not DecodeError, past about 1,000 levels: a 400 whose
    body was 1,000 `[` became a 502 "node adapter failed: RecursionError", and a stream event
    with a deeply nested field failed as a node bug. The 400 keeps its status and body; the
    event is an undecodable chunk."""
    edge, upstream, _ = stack
    deep = b"[" * 1000 + b"]" * 1000
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for("b", [("status", 400, deep)])
            refused = await chat(client)
            event = b'data: {"choices": [], "x": ' + deep + b"}\n\n"
            upstream.script_for("b", [("chunk", {"content": "before "}), ("raw", event), ("hang",)])
            broken = await chat(client)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "upstream returned 400: " + deep.decode()
    assert broken.status_code == 502
    assert "upstream sent an undecodable chunk" in broken.json()["error"]["message"]


async def test_a_body_kept_open_after_done_does_not_hold_the_nodes_slot(stack):
    """After `[DONE]` the node reads the rest of the body for up to 2 s (to reuse the
    connection), and held the run's slot meanwhile: with a server that never ends the body,
    the edge (which counted the run done) sent the next run and it waited those 2 s. The slot
    is given back with the answer: the next request reaches the model server while the first
    is still being drained, and no run waits for a slot."""
    edge, upstream, node = stack
    upstream.script_for("b", [("chunk", {"content": "whole"}, "stop"), ("done",), ("hang",)])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            first = await chat(client)
            second = await chat(client)
    assert first.json()["choices"][0]["message"]["content"] == "whole"
    assert second.json()["choices"][0]["message"]["content"] == "whole"
    first_seen, second_seen = upstream.records[0], upstream.records[1]
    assert first_seen.ended is None or second_seen.started < first_seen.ended  # not after the drain
    assert node.agent.slot_waits == 0


async def test_a_byte_order_mark_and_a_spaced_done(stack):
    """A UTF-8 BOM at the start of the stream dropped its first event (the spec says to strip
    it), and `data: [DONE] ` with a trailing space was a 502 "undecodable chunk" after a whole
    answer. Both are read as a model server meant them."""
    edge, upstream, _ = stack
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for("b", [("raw", BOM + chunk({"content": "marked"})), ("chunk", {}, "stop"), ("done",)])
            marked = await chat(client)
            upstream.script_for(
                "b", [("chunk", {"content": "spaced"}, "stop"), ("raw", b"data: [DONE] \n\n"), ("hang",)]
            )
            spaced = await chat(client)
    assert marked.status_code == 200 and marked.json()["choices"][0]["message"]["content"] == "marked"
    assert spaced.status_code == 200 and spaced.json()["choices"][0]["message"]["content"] == "spaced"


async def test_an_event_that_never_ends_costs_linear_time():
    """The parser joined each read onto the whole pending event and scanned it again: an
    event that never ends, 200 bytes a read, took minutes of CPU to reach the 8 MiB limit
    (the node's CPU was gone meanwhile). Each read is now looked at once."""
    parser = SSEParser()
    piece = b"x" * 200
    with trio.fail_after(10), pytest.raises(EventTooLarge):  # old code: about 3 minutes
        parser.feed(b"data: ")
        for i in range(1 << 20):
            parser.feed(piece)
            if i % 256 == 0:
                await trio.lowlevel.checkpoint()  # so fail_after can end the old code's loop


STREAM = (
    BOM + b": keep-alive\r\n\r\n"
    b"data: one\n\n"
    b"event: x\r\nid: 7\r\ndata: two\r\ndata:  lines\r\n\r\n"
    b"data:three\r\rdata: four\n\r\n"
    b"data: {}\r\n\n"
    b"data: [DONE]\n\n"
    b"data: unfinished"
)


def test_events_read_the_same_at_every_split():
    """CR, LF and CRLF line ends, comments, other fields, multi-line data and a BOM give the same
    events however the stream is cut into reads (a CRLF or blank line across reads included)."""
    expected = [b"one", b"two\n lines", b"three", b"four", b"{}", b"[DONE]"]
    for i in range(len(STREAM) + 1):
        for j in range(i, len(STREAM) + 1):
            parser = SSEParser()
            got = parser.feed(STREAM[:i]) + parser.feed(STREAM[i:j]) + parser.feed(STREAM[j:])
            assert got == expected, (i, j)


def test_events_as_model_servers_write_them_read_the_same_at_every_split():
    """One-line events ("data: " and the payload), as model servers write them: the same events
    at every split, a payload's own leading space kept, and a read that mixes in an event of two
    lines, a comment, an event with no data or another field."""
    plain = b'data: {"a":1}\n\ndata:  spaced\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    mixed = plain + b"data: x\ndata: y\n\n: c\n\nevent: e\n\nid: 1\ndata: z\n\ndata: w\n\n"
    expected = [b'{"a":1}', b" spaced", b'{"b":2}', b"[DONE]"]
    for stream, want in ((plain, expected), (mixed, [*expected, b"x\ny", b"z", b"w"])):
        for i in range(len(stream) + 1):
            for j in range(i, len(stream) + 1):
                parser = SSEParser()
                got = parser.feed(stream[:i]) + parser.feed(stream[i:j]) + parser.feed(stream[j:])
                assert got == want, (stream, i, j)


def test_an_event_past_the_limit_is_refused_whichever_way_it_arrives():
    """The 8 MiB bound (here 64 bytes) holds for an event in one read or in many."""
    for pieces in ([b"data: " + b"x" * 100], [b"data: "] + [b"x"] * 100, [b"data: x\n", b"data: " + b"y" * 70]):
        parser = SSEParser(max_event_bytes=64)
        with pytest.raises(EventTooLarge):
            for piece in pieces:
                parser.feed(piece)
    parser = SSEParser(max_event_bytes=64)
    assert parser.feed(b"data: " + b"x" * 50 + b"\n\n") == [b"x" * 50]


# A 300-byte schema whose definition requires itself three times asked for 3^32 values (the
# node at 100% CPU, growing 25 MB/s, deaf to SIGTERM); the others built a 1 GB string or a list
# of ten million items. No value within the sim's bound satisfies any of them.
BOMBS = {
    "self-reference": {
        "$defs": {
            "n": {
                "type": "object",
                "required": ["x", "y", "z"],
                "properties": {"x": {"$ref": "#/$defs/n"}, "y": {"$ref": "#/$defs/n"}, "z": {"$ref": "#/$defs/n"}},
            }
        },
        "$ref": "#/$defs/n",
    },
    "minLength": {"type": "object", "required": ["a"], "properties": {"a": {"type": "string", "minLength": 10**9}}},
    "minItems": {"type": "object", "required": ["a"], "properties": {"a": {"type": "array", "minItems": 10**7}}},
}


@pytest.fixture
async def sim_edge(nursery):
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("iop-sim", ttft_ms=0, tokens_per_s=0)])
    yield edge
    await settled(edge, node.agent)


async def test_tool_schemas_that_ask_for_too_much_are_answered_at_once(sim_edge):
    """Each bomb schema is answered at once, with the edge's clear 502 (the sim's work stops at
    10,000 values or 64 KiB of text, so its arguments do not match), and the node serves the
    next request."""
    outcomes = {}
    with trio.fail_after(BOUND):
        async with http(sim_edge) as client:
            for name, schema in BOMBS.items():
                tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
                body = {"model": "iop-sim", "messages": USER, "tools": tools, "tool_choice": "required"}
                outcomes[name] = await client.post("/v1/chat/completions", json=body)
            after = await client.post("/v1/chat/completions", json={"model": "iop-sim", "messages": USER})
    for name, r in outcomes.items():
        assert r.status_code == 502 and "do not match its schema" in r.json()["error"]["message"], name
    assert after.status_code == 200


def test_bounded_values_still_satisfy_ordinary_schemas():
    """The bound cuts only what is past it: a long minLength within 64 KiB, 5,000 items and a
    recursive schema still validate; 5,000 items of a 19,000-property definition under a `$ref`
    with a sibling are one merge of it, not 5,000 copies."""
    copies = {
        "$defs": {"d": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(19000)}}},
        "type": "array",
        "minItems": 5000,
        "items": {"$ref": "#/$defs/d", "title": "t"},
    }
    assert sample(copies) == [{}] * 5000
    schemas = [
        {"type": "string", "minLength": 60000},
        {"type": "array", "minItems": 5000, "items": {"type": "integer", "minimum": 3}},
        {
            "type": "object",
            "required": ["name", "children"],
            "properties": {
                "name": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#"}, "minItems": 0},
            },
        },
    ]
    for schema in schemas:
        jsonschema.validators.validator_for(schema)(schema).validate(sample(schema))


class Weather(pydantic.BaseModel):
    city: str
    rain: bool
    hours: list[int]


async def test_sim_answers_the_json_a_response_format_asks_for(sim_edge):
    """The sim answered prose whatever `response_format` said, so the SDK's `parse` raised.
    A json_schema gets a value of that schema, json_object a small object."""
    with trio.fail_after(BOUND):
        async with sdk(sim_edge) as client:
            parsed = await client.chat.completions.parse(model="iop-sim", messages=USER, response_format=Weather)
            plain = await client.chat.completions.create(
                model="iop-sim", messages=USER, response_format={"type": "json_object"}
            )
    assert isinstance(parsed.choices[0].message.parsed, Weather)
    assert parsed.choices[0].finish_reason == "stop"
    assert isinstance(msgspec.json.decode(plain.choices[0].message.content), dict)


def raw_delta(delta: bytes, finish: str | None = None) -> tuple:
    """An event whose delta's JSON is given as bytes, as a model server wrote them (perhaps
    not UTF-8)."""
    end = b', "finish_reason": "' + finish.encode() + b'"' if finish else b""
    return ("raw", b'data: {"choices": [{"index": 0, "delta": ' + delta + end + b"}]}\n\n")


# A party popper cut between two events: its UTF-8 bytes, then its UTF-16 escapes (a pair).
CUT_TEXT = [
    raw_delta(b'{"content": "Hi \xf0\x9f"}'),
    raw_delta(b'{"content": "\x8e\x89 ok"}'),
    raw_delta(b'{"reasoning_content": "think \\ud83c"}'),
    raw_delta(b'{"reasoning_content": "\\udf89"}'),
    raw_delta(b'{"content": " \\ud83c"}'),
    raw_delta(b'{"content": "\\udf89! \xff"}', "stop"),
    ("done",),
]


async def test_characters_cut_across_events_are_joined_not_a_failed_answer(stack):
    """A model server that sends a character's UTF-8 bytes, or its surrogate pair's escapes,
    in two events (text a token at a time: a token can be part of a character) failed the
    answer: a 502 "undecodable chunk: Invalid UTF-8 encoded string", or mid-stream an error
    and the rest lost (found from outside). The seeds' decoder never fails on it. The
    character is joined again, in text, reasoning and a tool call's arguments, streamed or
    not; a byte that is no character is U+FFFD."""
    edge, upstream, _ = stack
    want = "Hi 🎉 ok 🎉! \ufffd"
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for("b", CUT_TEXT)
            whole = await chat(client)
            upstream.script_for("b", CUT_TEXT)
            async with client.stream(
                "POST", "/v1/chat/completions", json={"model": "bad", "messages": USER, "stream": True}
            ) as r:
                events = [msgspec.json.decode(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
            call = [
                raw_delta(
                    b'{"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{\\"a\\": \\"\xe2\x82"}}]}'
                ),
                raw_delta(b'{"tool_calls": [{"index": 0, "function": {"arguments": "\xac\\"}"}}]}', "tool_calls"),
                ("done",),
            ]
            upstream.script_for("b", call)
            tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            called = await chat(client, tools=tools)
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert message["content"] == want
    assert message["reasoning_content"] == "think 🎉"
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == want
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "think 🎉"
    assert not [e for e in events if "error" in e]
    assert called.status_code == 200, called.text
    (tool_call,) = called.json()["choices"][0]["message"]["tool_calls"]
    assert msgspec.json.decode(tool_call["function"]["arguments"]) == {"a": "€"}
    # A cut character followed by whole text of its kind (a chunk msgspec reads) is U+FFFD there:
    # it was dropped, or put after that text when its rest came later (a re-check).
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for(
                "b",
                [
                    raw_delta(b'{"content": "a\xf0\x9f"}'),
                    raw_delta(b'{"content": "hello"}'),
                    raw_delta(b'{"content": "\x98\x80z"}', "stop"),
                    ("done",),
                ],
            )
            late = await chat(client)
    assert late.json()["choices"][0]["message"]["content"] == "a\ufffdhello\ufffd\ufffdz"
    # An error nested 900 deep with a byte that is no character: undecodable, as msgspec's limit
    # (mending its strings raised RecursionError out of the relay: the stop check's review).
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            deep = b"[" * 900 + b'"\xff"' + b"]" * 900
            upstream.script_for("b", [("raw", b'data: {"error": ' + deep + b"}\n\n"), ("hang",)])
            nested = await chat(client)
    assert nested.status_code == 502 and "undecodable chunk" in nested.json()["error"]["message"], nested.text
