"""Model servers as they really stream, through node and edge to the openai SDK: parallel
tool calls that all say `index: 0` (Ollama, SGLang), TGI's tool call sent as an object,
llama.cpp's `error:` line after its 200, and finish reasons that are not OpenAI's (what an
outside audit replayed from captured streams)."""

from __future__ import annotations

import msgspec
import openai
import pytest
import structlog
import trio

from tests.conftest import BOUND, model, sdk, settled, start_edge, start_node

USER = [{"role": "user", "content": "Weather in Paris and Rome?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
USAGE = ("usage", {"prompt_tokens": 30, "completion_tokens": 20, "total_tokens": 50})
PARIS, ROME = '{"city":"Paris"}', '{"city":"Rome"}'


def call(call_id: str, name: str | None, arguments: str, index: int = 0) -> dict:
    return {"id": call_id, "index": index, "type": "function", "function": {"name": name, "arguments": arguments}}


# ollama/ollama#15457: each call whole, every one with index 0.
OLLAMA = [
    ("chunk", {"role": "assistant", "content": "", "tool_calls": [call("call_ab12", "get_weather", PARIS)]}),
    ("chunk", {"role": "assistant", "content": "", "tool_calls": [call("call_cd34", "get_weather", ROME)]}),
    ("chunk", {"role": "assistant", "content": ""}, "tool_calls"),
    USAGE,
    ("done",),
]
# SGLang (as InternLM/lmdeploy#3412 captured it): the second call is index 0 with id "1".
SGLANG = [
    ("chunk", {"tool_calls": [call("0", "get_weather", "")]}),
    ("chunk", {"tool_calls": [call("0", None, PARIS)]}),
    ("chunk", {"tool_calls": [call("1", "get_weather", "")]}),
    ("chunk", {"tool_calls": [call("1", None, ROME)]}),
    ("chunk", {}, "tool_calls"),
    USAGE,
    ("done",),
]
# vLLM: the id on each index's first fragment only, the arguments in pieces after it.
VLLM = [
    ("chunk", {"tool_calls": [call("chatcmpl-tool-a", "get_weather", "")]}),
    ("chunk", {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
    ("chunk", {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    ("chunk", {"tool_calls": [call("chatcmpl-tool-b", "get_weather", "", index=1)]}),
    ("chunk", {"tool_calls": [{"index": 1, "function": {"arguments": ROME}}]}),
    ("chunk", {}, "tool_calls"),
    USAGE,
    ("done",),
]


@pytest.fixture
async def stack(nursery, upstream):
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    yield edge, upstream
    await settled(edge, node.agent)


async def answers(edge, **body) -> tuple[openai.types.chat.ChatCompletion, list]:
    """The whole answer, and the streamed chunks of the same request."""
    async with sdk(edge) as client:
        whole = await client.chat.completions.create(model="m", messages=USER, **body)
        stream = await client.chat.completions.create(model="m", messages=USER, stream=True, **body)
        chunks = [chunk async for chunk in stream]
    return whole, chunks


def streamed_calls(chunks: list) -> list[tuple[str, str, str]]:
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for c in choice.delta.tool_calls or ():
                got = calls.setdefault(c.index, ["", "", ""])
                got[0] = got[0] or c.id or ""
                got[1] += c.function.name or ""
                got[2] += c.function.arguments or ""
    return [tuple(c) for _, c in sorted(calls.items())]


def finish(chunks: list) -> list[str]:
    return [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]


@pytest.mark.parametrize(
    ("script", "ids"),
    [(OLLAMA, ["call_ab12", "call_cd34"]), (SGLANG, ["0", "1"]), (VLLM, ["chatcmpl-tool-a", "chatcmpl-tool-b"])],
    ids=["ollama", "sglang", "vllm"],
)
async def test_parallel_calls_that_all_say_index_0_are_two_calls(stack, script, ids):
    """Ollama's and SGLang's parallel calls, each new id with `index: 0`, were merged into one
    call `get_weatherget_weather` with arguments `{"city":"Paris"}{"city":"Rome"}`: the edge
    found no such tool, retried (a whole generation) and every API got a 502. A new id at an
    index starts a new call; vLLM's pieces still join as they did."""
    edge, upstream = stack
    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        whole, chunks = await answers(edge, tools=TOOLS)
    expected = [(ids[0], "get_weather", PARIS), (ids[1], "get_weather", ROME)]
    message = whole.choices[0].message
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == expected
    assert whole.choices[0].finish_reason == "tool_calls"
    assert streamed_calls(chunks) == expected and finish(chunks) == ["tool_calls"]
    assert len(upstream.records) == 2  # one generation a request: no retry


async def test_tgi_tool_call_sent_as_an_object(stack):
    """TGI 2.x sends `delta.tool_calls` as one object, not a list: every chunk of it was
    "undecodable" and every API a 502 quoting 200 bytes of the model server's payload."""
    edge, upstream = stack

    def piece(name: str | None, arguments: str) -> dict:
        return {"role": "assistant", "tool_calls": call("", name, arguments)}

    upstream.script_for(
        "t",
        [
            ("chunk", piece("get_weather", '{"')),
            ("chunk", piece(None, 'city": "Paris"}')),
            ("chunk", {"role": "assistant", "content": ""}, "eos_token"),
            ("done",),
        ],
    )
    with trio.fail_after(BOUND):
        whole, chunks = await answers(edge, tools=TOOLS)
    (got,) = whole.choices[0].message.tool_calls
    assert (got.function.name, got.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert whole.choices[0].finish_reason == "tool_calls"
    assert [c[1:] for c in streamed_calls(chunks)] == [("get_weather", '{"city": "Paris"}')]


async def test_an_unreadable_chunk_is_named_not_quoted(stack):
    """A chunk the node cannot read was a 502 quoting its first 200 bytes to the client (a
    model server's payload may carry anything). The client is told which field was wrong;
    neither the client nor the node's log is shown the chunk's words (completion text)."""
    edge, upstream = stack
    odd = b'data: {"choices": [{"index": 0, "delta": {"content": 7, "note": "private words"}}]}\n\n'
    upstream.script_for("t", [("raw", odd), ("done",)])
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        async with sdk(edge) as client:
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(model="m", messages=USER)
    message = caught.value.body["message"]
    assert caught.value.status_code == 502 and "private words" not in message
    assert "$.choices[0].delta.content" in message, message
    (line,) = [e for e in logs if e.get("error") == "undecodable chunk"]
    assert line["chunk_bytes"] == len(odd) - 8 and "private words" not in str(line), line


@pytest.mark.parametrize(
    "event",
    [
        # llama.cpp's server_sent_event(sink, "error", ...) after its 200 (then, from some builds, [DONE])
        b'error: {"code":400,"message":"the request exceeds the available context size, try increasing it",'
        b'"type":"exceed_context_size_error","n_prompt_tokens":5000,"n_ctx":4096}\n\n',
        b'event: error\ndata: {"error": {"code": 400, "message": "the request exceeds the available context size'
        b', try increasing it"}}\n\n',
    ],
    ids=["error-field", "event-error"],
)
async def test_an_error_event_after_the_200_is_the_upstream_error(stack, event):
    """llama.cpp reports a request that does not fit its context as an `error:` line in the
    event stream: it was dropped, and the client got a 502 "upstream closed the stream before
    it finished" (with [DONE] after it, an empty answer). Now its message reaches the client,
    with its code as the status: a 400, which the SDK does not retry, streamed or not."""
    edge, upstream = stack
    first = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": null}}]}\n\n'
    upstream.script_for("t", [("raw", first), ("raw", event), ("done",)])
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        async with sdk(edge) as client:
            with pytest.raises(openai.BadRequestError) as whole:
                await client.chat.completions.create(model="m", messages=USER)
            with pytest.raises(openai.BadRequestError) as streamed:  # nothing was sent yet: a 400 too
                await client.chat.completions.create(model="m", messages=USER, stream=True)
    said = "upstream error: the request exceeds the available context size, try increasing it"
    assert whole.value.body["message"] == said and streamed.value.body["message"] == said
    assert [e["error"] for e in logs if e.get("event") == "upstream request failed"] == ["error event, status 400"] * 2


async def test_a_mid_stream_error_chunk_keeps_its_status(stack):
    """vLLM's error chunk carries its HTTP code: a 400 is the client's 400 (no SDK retries
    it), a 500 stays a 502."""
    edge, upstream = stack
    bad = {"error": {"object": "error", "message": "max_tokens is too large", "type": "BadRequestError", "code": 400}}
    upstream.script_for("t", [("raw", b"data: " + msgspec.json.encode(bad) + b"\n\n"), ("done",)])
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="m", messages=USER)
            bad["error"].update(code=500, message="CUDA out of memory")
            upstream.script_for("t", [("raw", b"data: " + msgspec.json.encode(bad) + b"\n\n"), ("done",)])
            with pytest.raises(openai.InternalServerError) as crashed:
                await client.chat.completions.create(model="m", messages=USER)
    assert caught.value.body["message"] == "upstream error: max_tokens is too large"
    assert crashed.value.status_code == 502 and crashed.value.body["message"] == "upstream error: CUDA out of memory"


@pytest.mark.parametrize(
    ("said", "expected"),
    [
        ("eos_token", "stop"),  # TGI before 2.0
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("abort", "length"),  # vLLM: cut short
        ("content_filter", "content_filter"),
        ("length", "length"),
        ("something_new", "stop"),
    ],
)
async def test_finish_reasons_that_are_not_openais(stack, said, expected):
    """Older TGI's `eos_token` reached clients as it was: a typed client may know only
    OpenAI's five values. Known others are mapped to them; an unknown one is `stop`."""
    edge, upstream = stack
    upstream.script_for("t", [("chunk", {"content": "Hello"}), ("chunk", {}, said), USAGE, ("done",)])
    with trio.fail_after(BOUND):
        whole, chunks = await answers(edge)
    assert whole.choices[0].message.content == "Hello"
    assert whole.choices[0].finish_reason == expected and finish(chunks) == [expected]


# vLLM's gpt-oss streaming and Poolside's API: a new id on every chunk of one call.
ID_PER_CHUNK = [
    ("chunk", {"tool_calls": [call("call_a", "get_weather", '{"city":')]}),
    ("chunk", {"tool_calls": [call("call_b", None, '"Paris"}')]}),
    ("chunk", {}, "tool_calls"),
    USAGE,
    ("done",),
]
# The whole name again on a later fragment of the same call.
NAME_AGAIN = [
    ("chunk", {"tool_calls": [call("call_a", "get_weather", '{"city":')]}),
    ("chunk", {"tool_calls": [call("call_a", "get_weather", '"Paris"}')]}),
    ("chunk", {}, "tool_calls"),
    USAGE,
    ("done",),
]


@pytest.mark.parametrize("script", [ID_PER_CHUNK, NAME_AGAIN], ids=["id-per-chunk", "name-again"])
async def test_one_call_whose_fragments_change_id_or_repeat_its_name_stays_one(stack, script):
    """A new id on a fragment that names no function is the same call (servers that mint an id
    per chunk): splitting it made two broken calls, a retry and a 502 (an outside re-audit of
    the index-0 fix); a fragment repeating the call's whole name made `get_weatherget_weather`."""
    edge, upstream = stack
    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        whole, chunks = await answers(edge, tools=TOOLS)
    expected = [("call_a", "get_weather", PARIS)]
    assert [(c.id, c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == expected
    assert streamed_calls(chunks) == expected
    assert len(upstream.records) == 2  # no retry


@pytest.mark.parametrize(
    ("line", "status", "message"),
    [
        (b'error: {"code":"400","message":"too long"}\n\n', 400, "upstream error: too long"),
        (b"event: error\ndata:\n\n", 502, "the model server reported an error, with no message"),
    ],
    ids=["quoted-code", "empty"],
)
async def test_an_error_event_s_odd_shapes_are_read(stack, line, status, message):
    """A code in quotes is still the status; an error event with nothing in it says so, where
    the client got "upstream error: " (an outside re-audit)."""
    edge, upstream = stack
    upstream.script_for("t", [("raw", line)])
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(model="m", messages=USER)
    assert caught.value.status_code == status and caught.value.body["message"] == message, caught.value.body
