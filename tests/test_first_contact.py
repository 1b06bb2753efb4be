"""What real clients and a newcomer ran into first: reasoning on streamed tool requests, HTTP errors
before a stream's first event, usage that is always numbers, whole-message tool calls, tool calls cut
off by max_tokens, and one access line with a request id for every request."""

from __future__ import annotations

import asyncio
import email.utils
import gzip
import re
import time

import anthropic
import httpx
import msgspec
import openai
import pytest
import structlog
import trio
from pydantic_ai import Agent
from pydantic_ai.messages import ThinkingPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from scripts.upstream import native_call, steps, text_script, words
from tests.conftest import BOUND, edge_config, eventually, http, model, sdk, settled, sse_events, start_edge, start_node

MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [WEATHER]
CRASH = [("status", 500, b'{"error": {"message": "model crashed"}}')]


def joined(chunks, field: str) -> str:
    return "".join(getattr(c.choices[0].delta, field, None) or "" for c in chunks if c.choices)


@pytest.fixture
async def first(nursery, upstream):
    edge = await start_edge(nursery, edge_config(models=[{"name": "live", "tool_stream": "live"}]))
    node = await start_node(
        nursery,
        edge,
        [
            model("m", upstream, target="t"),
            model("live", upstream, target="t"),
            model("emb", upstream, target="emb-target", passthrough=True),
        ],
    )
    yield edge, upstream
    await settled(edge, node.agent)


async def stream_all(client: openai.AsyncOpenAI, **kw) -> list:
    stream = await client.chat.completions.create(messages=MESSAGES, stream=True, **kw)
    return [c async for c in stream]


# -- reasoning with tools -------------------------------------------------------------


@pytest.mark.parametrize(
    "deltas",
    [
        [{"reasoning_content": "let me "}, {"reasoning_content": "think"}, {"content": "It is sunny."}],
        [{"content": "<think>let me "}, {"content": "think</think>It is sunny."}],
    ],
    ids=["reasoning_field", "think_tags"],
)
async def test_streamed_request_with_tools_carries_reasoning(first, deltas):
    """A streamed request with tools (buffered by default, or live) carries the reasoning as
    delta.reasoning_content, like the whole response; a request that excludes reasoning gets none."""
    edge, upstream = first
    upstream.script_for("t", steps(*deltas))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            for name in ("m", "live"):
                chunks = await stream_all(client, model=name, tools=TOOLS)
                assert joined(chunks, "reasoning_content") == "let me think", name
                assert joined(chunks, "content") == "It is sunny.", name
            whole = await client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS)
            hidden = await stream_all(client, model="m", tools=TOOLS, extra_body={"reasoning": {"exclude": True}})
    assert whole.choices[0].message.reasoning_content == "let me think"
    assert joined(hidden, "reasoning_content") == "" and joined(hidden, "content") == "It is sunny."


async def pydantic_ai_run_stream(edge, prompt: str):
    """pydantic-ai's ``Agent.run_stream`` with one tool against the edge: (output, response parts, usage).
    pydantic-ai needs asyncio, so it runs in a worker thread with its own loop."""

    async def run():
        client = openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0, timeout=BOUND)
        agent = Agent(OpenAIChatModel("m", provider=OpenAIProvider(openai_client=client)))

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Current weather for a city."""
            return "sunny"

        async with client, agent.run_stream(prompt) as result:
            output = await result.get_output()
        return output, result.all_messages()[-1].parts, result.usage

    with trio.fail_after(BOUND):
        return await trio.to_thread.run_sync(asyncio.run, run(), abandon_on_cancel=True)


async def test_pydantic_ai_run_stream_with_tools_shows_reasoning(first):
    """pydantic-ai's run_stream with a tool attached gets the reasoning as a ThinkingPart."""
    edge, upstream = first
    usage = {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}
    upstream.script_for("t", steps({"reasoning_content": "let me think"}, {"content": "It is sunny."}, usage=usage))
    output, parts, _ = await pydantic_ai_run_stream(edge, "Weather in Paris?")
    assert output == "It is sunny."
    assert [p.content for p in parts if isinstance(p, ThinkingPart)] == ["let me think"]
    assert upstream.records[0].body["tools"][0]["function"]["name"] == "get_weather"


async def test_pydantic_ai_gets_usage_numbers_when_the_upstream_reports_none(first):
    """With no usage from the upstream, pydantic-ai still reads integer usage (no extraction warning)."""
    edge, upstream = first
    upstream.script_for("t", steps({"content": "It is "}, {"content": "sunny."}))
    output, _, usage = await pydantic_ai_run_stream(edge, "Weather in Paris?")
    assert output == "It is sunny."
    assert usage.output_tokens == 2 and usage.input_tokens > 0


# -- failures before the first event ---------------------------------------------------


async def test_stream_failing_before_its_first_event_is_an_http_error(first):
    """An upstream 500 before any event: a streamed request, live or with tools, gets a real 502 in the
    OpenAI shape (openai-python raises InternalServerError); an upstream 400 keeps its status."""
    edge, upstream = first
    upstream.script_for("t", CRASH)
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            for extra in ({}, {"tools": TOOLS}):
                with pytest.raises(openai.InternalServerError) as caught:
                    await stream_all(client, model="m", **extra)
                assert caught.value.status_code == 502
                assert "model crashed" in caught.value.message
                assert caught.value.response.headers["content-type"] == "application/json"
            upstream.script_for("t", [("status", 400, b'{"error": {"message": "bad temperature"}}')])
            with pytest.raises(openai.BadRequestError) as caught:
                await stream_all(client, model="m")
    assert "bad temperature" in caught.value.message


async def test_upstream_429_before_the_first_event_is_a_429_with_retry_after(first):
    """A saturated model server (429) before any event: the client gets HTTP 429 with Retry-After, streamed or not."""
    edge, upstream = first
    upstream.script_for("t", [("status", 429, b'{"error": {"message": "too many requests"}}')])
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            for stream in (True, False):
                with pytest.raises(openai.RateLimitError) as caught:
                    if stream:
                        await stream_all(client, model="m")
                    else:
                        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
                assert caught.value.status_code == 429
                assert caught.value.response.headers["retry-after"] == "1"


@pytest.mark.parametrize(
    ("said", "told"),
    [
        ("30", (30, 30)),
        ("date+120", (118, 121)),
        ("", (1, 1)),
        ("9999999", (3600, 3600)),
        ("soon", (1, 1)),
        ("\u00b3", (1, 1)),  # (a digit to str.isdigit, not to int: the node's adapter failed, a 502)
    ],
)
async def test_an_upstream_429_s_retry_after_reaches_the_client(first, said, told):
    """A model server's 429 with `Retry-After: 30` reached the client as `Retry-After: 1`, and
    the SDKs retried a saturated provider after a second (an outside audit; a passthrough
    kept it). Its Retry-After (seconds, or an HTTP date) is the client's, at least 1 s and at
    most an hour; none, or one that cannot be read, is 1 s."""
    edge, upstream = first
    if said == "date+120":
        said = email.utils.formatdate(time.time() + 120, usegmt=True)
    _answers_with(upstream, b"429 Too Many Requests", said)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert r.status_code == 429 and r.json()["error"]["code"] == "upstream_rate_limited", r.text
    assert told[0] <= int(r.headers["retry-after"]) <= told[1], r.headers["retry-after"]


async def test_an_upstream_503_s_retry_after_goes_with_its_502(first):
    """A model server's 503 (unavailable) is a 502 the SDKs retry; its Retry-After goes with it,
    so they wait as it asked (they retried on their own backoff; a re-check)."""
    edge, upstream = first
    _answers_with(upstream, b"503 Service Unavailable", "7")
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert r.status_code == 502 and r.headers["retry-after"] == "7", (r.text, r.headers)


def _answers_with(upstream, status: bytes, said: str) -> None:
    """The upstream answers every request with ``status`` and ``Retry-After: said`` (none if empty)."""
    body = b'{"error": {"message": "slow down"}}'
    head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n" % status
    head += b"retry-after: %s\r\n" % said.encode("latin-1") if said else b""
    upstream.script_for("t", [("response", head + b"content-length: %d\r\n\r\n%s" % (len(body), body))])


async def test_sdk_retries_a_stream_that_failed_before_its_first_event(first):
    """With max_retries=1, openai-python retries the 502 of a stream whose upstream failed once, and
    the second attempt streams the answer."""
    edge, upstream = first
    attempts: list[int] = []

    def fails_once(body):
        attempts.append(1)
        return CRASH if len(attempts) == 1 else steps({"content": "second "}, {"content": "time"})

    upstream.script_for("t", fails_once)
    with trio.fail_after(BOUND):
        async with openai.AsyncOpenAI(
            base_url=edge.url + "/v1", api_key="unused", max_retries=1, timeout=BOUND
        ) as client:
            chunks = await stream_all(client, model="m")
    assert joined(chunks, "content") == "second time"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len(upstream.records) == 2


async def test_wait_timeout_before_the_first_event_is_504(nursery, upstream):
    """The wait timeout firing before the first event (no keep-alive due yet) is a real 504, live
    and with tools, and the upstream is aborted."""
    edge = await start_edge(nursery, edge_config(wait_timeout_s=0.3, keepalive_s=10))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    upstream.script_for("t", [("hang",)])
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            for extra in ({}, {"tools": TOOLS}):
                with pytest.raises(openai.InternalServerError) as caught:
                    await stream_all(client, model="m", **extra)
                assert caught.value.status_code == 504
                assert caught.value.code == "run_timed_out"
        for rec in upstream.records:
            await rec.finished.wait()
    assert len(upstream.records) == 2 and all(rec.aborted for rec in upstream.records)
    await settled(edge, node.agent)


async def test_keep_alive_due_first_commits_the_stream(nursery, upstream):
    """When a keep-alive is due before the first event, the stream commits (200, role chunk, keep-alive)
    and a later failure arrives in-stream."""
    edge = await start_edge(nursery, edge_config(wait_timeout_s=0.6, keepalive_s=0.2))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    upstream.script_for("t", [("hang",)])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True})
    assert r.status_code == 200
    assert r.content.startswith(b'data: {"id":"chatcmpl-')
    assert b"\n\n: keep-alive\n\n" in r.content
    events = sse_events(r.content)
    assert msgspec.json.decode(events[0])["choices"][0]["delta"] == {"role": "assistant"}
    assert msgspec.json.decode(events[-2])["error"]["message"] == "run timed out" and events[-1] == b"[DONE]"
    await settled(edge, node.agent)


async def test_node_lost_before_the_first_event_with_no_node_left_is_a_503_to_retry(nursery, upstream):
    """A node lost before the first event, with no other node serving the model, is an HTTP
    error, not a stream that ends in one: the README's 503 `no_node_available` with
    `Retry-After: 1` (a retry may find the node linked again). It was a 502
    `node_disconnected` (an outside audit), streamed or not, on every API. (After LOST_GRACE_S,
    5 s, waiting for the node to link again: within the default keepalive_s, 10 s, before a
    stream commits.)"""
    edge = await start_edge(nursery, edge_config(keepalive_s=10))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    upstream.script_for("t", [("hang",)])
    caught: list[openai.APIStatusError] = []
    with trio.fail_after(BOUND):
        async with sdk(edge) as client, http(edge) as raw, trio.open_nursery() as clients:
            answers: list[httpx.Response] = []

            async def ask():
                try:
                    await stream_all(client, model="m")
                except openai.APIStatusError as e:
                    caught.append(e)

            async def ask_whole():
                answers.append(await raw.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}))

            async def ask_messages():
                body = {"model": "m", "max_tokens": 8, "messages": MESSAGES}
                answers.append(await raw.post("/v1/messages", json=body))

            for one in (ask, ask_whole, ask_messages):
                clients.start_soon(one)
            await upstream.wait_requests(3)
            node.stop()
    (error,) = caught
    assert isinstance(error, openai.APIStatusError)
    assert error.status_code == 503 and error.code == "no_node_available", error
    assert error.response.headers["retry-after"] == "1"
    assert "lost before it answered" in error.message
    chat, messages = sorted(answers, key=lambda r: str(r.url))
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "no_node_available", chat.text
    assert chat.headers["retry-after"] == "1"
    assert messages.status_code == 503 and messages.headers["retry-after"] == "1", messages.text
    assert messages.json()["type"] == "error" and "lost before it answered" in messages.json()["error"]["message"]


# -- usage ---------------------------------------------------------------------------------


async def test_usage_without_upstream_numbers_is_estimated_and_marked(first):
    """With no usage from the upstream, usage still holds integer prompt, completion and total tokens,
    stream and whole (the estimate: prompt as for admission, one completion token per delta); the
    access line says usage_estimated and iop_usage_estimated_total counts it. Reported usage is kept."""
    edge, upstream = first
    upstream.script_for("t", steps({"reasoning_content": "r"}, {"content": "a"}, {"content": "b"}))
    prompt = len("hi") // 4 + 4  # edge.openai.request.estimate_input_tokens
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):

        async def logged(n: int) -> None:  # one access line per request, in order
            await eventually(lambda: sum(e["event"] == "request" for e in logs) == n)

        async with sdk(edge) as client:
            chunks = await stream_all(client, model="m", stream_options={"include_usage": True})
            await logged(1)
            whole = await client.chat.completions.create(model="m", messages=MESSAGES)
            await logged(2)
            reported = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
            upstream.script_for("t", steps({"content": "a"}, usage=reported))
            kept = await client.chat.completions.create(model="m", messages=MESSAGES)
            await logged(3)
        async with http(edge) as raw:
            metrics = (await raw.get("/metrics")).text
    for usage in (chunks[-1].usage, whole.usage):
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt, 3, prompt + 3)
    assert (kept.usage.prompt_tokens, kept.usage.completion_tokens, kept.usage.total_tokens) == (7, 2, 9)
    lines = [e for e in logs if e["event"] == "request"]
    assert [e["usage_estimated"] for e in lines] == [True, True, False]
    assert [e["completion_tokens"] for e in lines] == [3, 3, 2]
    assert 'iop_usage_estimated_total{api="chat",model="m"} 2.0' in metrics


async def test_a_stream_its_client_left_logs_the_tokens_it_is_charged(first):
    """A client that leaves mid-stream: its access line says the tokens the key and the ledger are
    charged (the estimate of what streamed, usage_estimated), not nulls beside a ledger row of them;
    `iop_usage_estimated_total` counts it as the line does (it counted only a finished run's)."""
    edge, upstream = first
    upstream.script_for("t", text_script(words(200), interval=0.02))
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        async with http(edge) as client:
            body = {"model": "m", "messages": MESSAGES, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                seen = 0
                with trio.CancelScope() as reading:  # (its cancel closes the connection: the client is gone)
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: {") and '"content"' in line
                        if seen >= 5:
                            reading.cancel()
        await eventually(lambda: any(e["event"] == "request" for e in logs))
        async with http(edge) as client:
            metrics = (await client.get("/metrics")).text
    (line,) = [e for e in logs if e["event"] == "request"]
    assert line["cause"] == "client_gone" and line["usage_estimated"] is True
    assert 'iop_usage_estimated_total{api="chat",model="m"} 1.0' in metrics
    assert line["prompt_tokens"] == len("hi") // 4 + 4 and line["completion_tokens"] >= 5, line


# -- tool calls --------------------------------------------------------------------------


async def test_whole_message_tool_calls_carry_no_index(first):
    """A non-streamed message's tool_calls have no `index` (a streaming field); stream deltas keep it."""
    edge, upstream = first
    upstream.script_for("t", steps(*native_call("c1", "get_weather", '{"city": "Paris"}'), finish="tool_calls"))
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            whole = (await client.post("/v1/chat/completions", json=body)).json()
            streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    assert call == {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    deltas = [msgspec.json.decode(e)["choices"][0]["delta"] for e in sse_events(streamed.content)[:-1]]
    (streamed_call,) = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert streamed_call == {"index": 0, **call}


CUT = '<tool_call>{"name": "get_weather", "arguments": {"ci'
WHOLE = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
BROKEN = '<tool_call>{"name": "get_weather" "arguments": {}}</tool_call>'
CUT_IN_A_TAG = '<tool_call>{"name": "get_weather", "arguments": {"city": "a </tool_call> b'


@pytest.mark.parametrize(
    ("deltas", "arguments", "content"),
    [
        (native_call("c1", "get_weather", '{"city": "Pa'), ['{"city": "Pa'], ""),
        ([{"content": "Sure. " + CUT}], None, "Sure. " + CUT),
        # (A whole call before the cut one was text too, its markup with it: an outside audit.)
        ([{"content": "Sure. " + WHOLE + CUT}], ['{"city":"Rome"}'], "Sure. " + CUT),
        # (Only the block the cut ended is forgiven: one unreadable before it leaves it all text.)
        ([{"content": "Sure. " + BROKEN + WHOLE + CUT}], None, "Sure. " + BROKEN + WHOLE + CUT),
        # (Cut in a string that holds the closing tag: still the block the cut ended, a re-check found.)
        ([{"content": "Sure. " + WHOLE + CUT_IN_A_TAG}], ['{"city":"Rome"}'], "Sure. " + CUT_IN_A_TAG),
    ],
    ids=["native", "text", "text-after-a-whole-call", "text-after-a-broken-call", "text-cut-past-a-quoted-tag"],
)
async def test_tool_call_cut_off_by_max_tokens_is_returned_with_length(first, deltas, arguments, content):
    """A tool call cut off by max_tokens (finish_reason "length") is returned as produced, with
    finish_reason "length", whole and streamed (buffered and live), and never retried: a text
    call block cut off stays text, the whole ones before it are calls."""
    edge, upstream = first
    upstream.script_for("t", steps(*deltas, finish="length"))
    produced = content
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            whole = await client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=9)
            streams = [await stream_all(client, model=name, tools=TOOLS, max_tokens=9) for name in ("m", "live")]
    assert len(upstream.records) == 3  # one run each: no retry
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.content or "") == produced
    if arguments is None:
        assert choice.message.tool_calls is None
    else:
        assert [c.function.arguments for c in choice.message.tool_calls] == arguments
    for chunks in streams:
        assert chunks[-1].choices[0].finish_reason == "length"
        assert joined(chunks, "content") == produced
        calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
        assert [c.function.arguments for c in calls] == (arguments or [])


# -- access lines and request ids ----------------------------------------------------------


async def test_every_request_gets_one_access_line_and_a_request_id(first):
    """Every HTTP request (to an OpenAI route: 400 from validation, 404, 405, stream, whole,
    embeddings; and to what Quart serves: models, health, an unknown route) gets one access line
    with its real status and a request id, returned as x-request-id, and is counted; the line
    holds no prompt text and no key."""
    edge, upstream = first
    secret = "PROMPT-SECRET-7"
    headers = {"authorization": "Bearer sk-KEY-SECRET-9"}
    good = {"model": "m", "messages": [{"role": "user", "content": secret}]}
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        async with http(edge, headers=headers) as client:
            post = client.post
            responses: list[httpx.Response] = [
                await post("/v1/chat/completions", json={**good, "messages": [{"role": "wizard", "content": secret}]}),
                await post("/v1/chat/completions", json={**good, "model": "nope"}),
                await client.get("/v1/chat/completions"),
                await post("/v1/chat/completions", json={**good, "stream": True}),
                await post("/v1/chat/completions", json=good),
                await post("/v1/embeddings", json={"model": "emb", "input": secret}),
                await client.get("/v1/models"),
                await client.get("/v1/models/m"),
                await client.get("/v1/models/nope"),
                await post("/v1/models", json={}),
                await client.get("/healthz"),
                await client.get("/no/such/route"),
            ]
            await eventually(lambda: sum(e["event"] == "request" for e in logs) == len(responses))
            metrics = (await client.get("/metrics")).text
    assert [r.status_code for r in responses] == [400, 404, 405, 200, 200, 200, 200, 200, 404, 405, 200, 404]
    lines = {e["request_id"]: e for e in logs if e["event"] == "request"}
    ids = [r.headers["x-request-id"] for r in responses]
    assert len(set(ids)) == len(ids) and set(ids) <= set(lines)
    assert all(re.fullmatch(r"req_[0-9a-f]{24}", i) for i in ids)
    for r, request_id in zip(responses, ids, strict=True):
        line = lines[request_id]
        assert line["status"] == r.status_code and line["route"] == r.request.url.path
        assert "SECRET" not in repr(line)
    assert [lines[i]["cause"] for i in ids] == [
        "rejected_400",
        "rejected_404",
        "rejected_405",
        "complete",
        "complete",
        "complete",
        "ok",
        "ok",
        "rejected_404",
        "rejected_405",
        "ok",
        "rejected_404",
    ]
    assert [lines[i]["api"] for i in ids[6:]] == ["models", "models", "models", "models", "health", "other"]
    assert 'iop_requests_total{api="chat",model="m",outcome="rejected_400"} 1.0' in metrics
    assert 'iop_requests_total{api="chat",model="other",outcome="rejected_405"} 1.0' in metrics
    assert 'iop_requests_total{api="chat",model="m",outcome="complete"} 2.0' in metrics
    assert 'iop_requests_total{api="embeddings",model="emb",outcome="complete"} 1.0' in metrics
    assert 'iop_requests_total{api="models",model="m",outcome="ok"} 1.0' in metrics
    assert 'iop_requests_total{api="models",model="other",outcome="rejected_404"} 1.0' in metrics
    assert 'iop_requests_total{api="other",model="other",outcome="rejected_404"} 1.0' in metrics


async def test_cached_prompt_tokens_reach_every_api(nursery, upstream):
    """A model server's prompt_tokens_details.cached_tokens reaches the OpenAI SDK (chat and
    Responses) and the Anthropic SDK (cache_read_input_tokens, input_tokens without them)."""
    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 2,
        "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    upstream.script_for("m-target", lambda body: steps({"content": "hi "}, {"content": "there"}, usage=usage))
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", upstream)])
    with trio.fail_after(BOUND):
        async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="x", max_retries=0) as sdk:
            chat = await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}])
            assert chat.usage.prompt_tokens_details.cached_tokens == 32
            response = await sdk.responses.create(model="m", input="q")
            assert response.usage.input_tokens_details.cached_tokens == 32
        async with anthropic.AsyncAnthropic(base_url=edge.url, api_key="x", max_retries=0) as claude:
            message = await claude.messages.create(
                model="m", max_tokens=16, messages=[{"role": "user", "content": "q"}]
            )
    assert (message.usage.cache_read_input_tokens, message.usage.input_tokens) == (32, 8)


async def test_a_compressed_body_and_a_session_that_is_no_string_say_so(first):
    """A gzip body is a 415 naming the encoding, in each API's shape (it was a 400 "not valid
    JSON ... byte 0"); `metadata.user_id` (Messages) and `user` or `prompt_cache_key` (Responses)
    that are not strings are 400s naming them, as the reference APIs answer (a number was taken
    and kept no session). None reached the model."""
    edge, upstream = first
    chat = {"model": "m", "messages": MESSAGES}
    packed = gzip.compress(msgspec.json.encode(chat))
    gzipped = {"content-encoding": "gzip", "content-type": "application/json"}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            c = await client.post("/v1/chat/completions", content=packed, headers=gzipped)
            m = await client.post("/v1/messages", content=packed, headers=gzipped)
            same = await client.post("/v1/chat/completions", json=chat, headers={"content-encoding": "identity"})
            twice = [
                ("content-encoding", "identity"),
                ("content-encoding", "gzip"),
                ("content-type", "application/json"),
            ]
            second_line = await client.post("/v1/chat/completions", content=packed, headers=twice)
            keyed = await client.post(
                "/v1/responses", json={"model": "m", "input": "hi", "user": "", "prompt_cache_key": "k"}
            )
            bad = [
                await client.post("/v1/messages", json={**chat, "max_tokens": 8, "metadata": {"user_id": 5}}),
                await client.post("/v1/responses", json={"model": "m", "input": "hi", "user": 5}),
                await client.post("/v1/responses", json={"model": "m", "input": "hi", "prompt_cache_key": ["a"]}),
            ]
    assert c.status_code == 415 and c.json()["error"]["code"] == "unsupported_content_encoding"
    assert "`Content-Encoding: gzip`" in c.json()["error"]["message"]
    assert m.status_code == 415 and m.json()["type"] == "error"
    assert m.json()["error"]["type"] == "invalid_request_error" and "gzip" in m.json()["error"]["message"]
    assert same.status_code == 200
    assert second_line.status_code == 415 and "identity, gzip" in second_line.json()["error"]["message"]
    assert keyed.status_code == 200  # (an empty user is none: the cache key is the session, sent as itself)
    assert "user" not in upstream.records[-1].body and upstream.records[-1].body["prompt_cache_key"] == "k"
    assert [r.status_code for r in bad] == [400, 400, 400]
    assert "`metadata.user_id`: expected a string" in bad[0].json()["error"]["message"]
    assert [r.json()["error"]["param"] for r in bad[1:]] == ["user", "prompt_cache_key"]
    assert len(upstream.records) == 2


async def test_a_bad_tool_is_named_as_its_own_api_names_it(first):
    """A tool's bad name, parameters, description or strict is a 400 naming the field as the
    caller's API spells it: Messages' `tools[i].name` (a server tool before it counted), Responses'
    flat `tools[i].parameters`; both said chat's `tools[0].function.name` before."""
    edge, upstream = first
    schema = {"type": "object"}
    search = {"type": "web_search_20250305", "name": "web_search"}
    messages = {"model": "m", "max_tokens": 8, "messages": MESSAGES}
    cases = [
        (
            "/v1/messages",
            {**messages, "tools": [search, {"name": "a" * 100_000, "input_schema": schema}]},
            "tools[1].name",
        ),
        ("/v1/messages", {**messages, "tools": [{"name": "", "input_schema": schema}]}, "tools[0].name"),
    ]
    for field, value in (("name", "a" * 300), ("parameters", "obj"), ("description", 5), ("strict", "yes")):
        tool = {"type": "function", "name": "f", "parameters": schema, field: value}
        body = {"model": "m", "input": "hi", "tools": [{"type": "web_search"}, tool]}
        cases.append(("/v1/responses", body, f"tools[1].{field}"))
    for namespace, name in (("ns", "a" * 256), ("n" * 256, "f")):  # (the name the model sees: ns__name)
        tool = {"type": "namespace", "name": namespace, "tools": [{"type": "function", "name": name}]}
        cases.append(("/v1/responses", {"model": "m", "input": "hi", "tools": [tool]}, "tools[0].tools[0].name"))
    # Two tools the model would see by one name (a namespace's are NAMESPACE__NAME): their calls went to the last.
    fn = {"type": "function"}
    for clash in (
        [
            {"type": "namespace", "name": "a", "tools": [{**fn, "name": "b__c"}]},
            {"type": "namespace", "name": "a__b", "tools": [{**fn, "name": "c"}]},
        ],
        [{"type": "namespace", "name": "a", "tools": [{**fn, "name": "b"}]}, {**fn, "name": "a__b"}],
        [{**fn, "name": "a__b"}, {"type": "namespace", "name": "a", "tools": [{**fn, "name": "b"}]}],
    ):
        cases.append(("/v1/responses", {"model": "m", "input": "hi", "tools": clash}, "tools"))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for path, body, field in cases:
                r = await client.post(path, json=body)
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert f"`{field}`" in error["message"] and "function." not in error["message"], (field, error)
                if path == "/v1/responses":
                    assert error["param"] == field
    assert not upstream.records
