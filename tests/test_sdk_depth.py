"""What the real `openai` and `anthropic` SDKs read that the edge once left out: a provider's
refusal on every API, Anthropic's `request-id`, Responses' `cache_write_tokens`, chat's
`allowed_tools` and custom tools, and the Messages API's `thinking` checks, unknown sub-paths and
file documents. Real edge, node and scripted upstream on loopback."""

from __future__ import annotations

import anthropic
import openai
import pytest
import trio
from openai.types.responses import ResponseCompletedEvent, ResponseIncompleteEvent
from pydantic import BaseModel

from scripts.upstream import steps, text_script
from tests.conftest import BOUND, edge_config, http, model, sdk, settled, start_edge, start_node

USER = [{"role": "user", "content": "hi"}]
USAGE = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
REFUSAL = "I can't help with that."


@pytest.fixture
async def setup(nursery, upstream):
    edge = await start_edge(nursery, edge_config())
    node = await start_node(nursery, edge, [model("m", upstream, target="t", max_concurrency=4)])
    yield edge, upstream
    await settled(edge, node.agent)


def claude(edge) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=edge.url, api_key="unused", max_retries=0, timeout=BOUND)


def refusing(upstream) -> None:
    """The model server declines as OpenAI does: the refusal in two `delta.refusal` pieces."""
    upstream.script_for("t", steps({"refusal": "I can't "}, {"refusal": "help with that."}, usage=USAGE))


# -- 1. a refusal, on every API -----------------------------------------------------------------


class Person(BaseModel):
    name: str
    age: int


async def test_chat_parse_gets_the_refusal(setup):
    """`chat.completions.parse`: `message.refusal` is the model's words, content and parsed null."""
    edge, upstream = setup
    refusing(upstream)
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            done = await client.chat.completions.parse(model="m", messages=USER, response_format=Person)
            raw = await client.chat.completions.create(model="m", messages=USER)
    message = done.choices[0].message
    assert message.refusal == REFUSAL
    assert message.content is None and message.parsed is None
    assert raw.choices[0].message.refusal == REFUSAL and raw.choices[0].message.content is None
    assert raw.choices[0].finish_reason == "stop"


async def test_a_refusal_without_usage_counts_its_words(setup):
    """A model server that sends no usage: the refusal's words count as completion tokens (an
    estimate, marked so) on every API, as a text answer's do: they counted 0, so a key's
    budget and the ledger charged nothing for them."""
    edge, upstream = setup
    with trio.fail_after(BOUND):
        async with sdk(edge) as client, claude(edge) as anthropic_client:
            upstream.script_for("t", steps({"refusal": "I can't "}, {"refusal": "help with that."}))
            chat = await client.chat.completions.create(model="m", messages=USER)
            upstream.script_for("t", steps({"refusal": "I can't "}, {"refusal": "help with that."}))
            response = await client.responses.create(model="m", input="hi")
            upstream.script_for("t", steps({"refusal": "I can't "}, {"refusal": "help with that."}))
            message = await anthropic_client.messages.create(model="m", max_tokens=50, messages=USER)
    expected = -(-len(REFUSAL) // 4)
    assert chat.choices[0].message.refusal == REFUSAL and chat.usage.completion_tokens == expected
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + expected
    assert response.usage.output_tokens == expected
    assert message.stop_reason == "refusal" and message.usage.output_tokens == expected


@pytest.mark.parametrize("buffered", [False, True], ids=["live", "buffered"])
async def test_chat_stream_gets_refusal_events(nursery, upstream, buffered):
    """`chat.completions.stream`: `refusal.delta` and `refusal.done` events, the final message's
    refusal set; the chunk that carries it has `content: null`, as OpenAI's. Live and buffered."""
    policy = [{"name": "m", "strict_output": True, "stream_buffer": True}] if buffered else []
    edge = await start_edge(nursery, edge_config(models=policy))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    refusing(upstream)
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            async with client.chat.completions.stream(model="m", messages=USER) as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_completion()
        async with http(edge) as raw:
            body = (await raw.post("/v1/chat/completions", json={"model": "m", "messages": USER, "stream": True})).text
    assert "refusal.delta" in kinds and "refusal.done" in kinds
    assert "content.delta" not in kinds
    assert final.choices[0].message.refusal == REFUSAL and not final.choices[0].message.content
    assert '"delta":{"content":null,"refusal":"I can\'t help with that."}' in body
    await settled(edge, node.agent)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_responses_output_is_a_refusal_part(setup, stream):
    """Responses: one message whose only content part is `{"type": "refusal"}` (no output_text),
    and in a stream `response.refusal.delta` / `.done`."""
    edge, upstream = setup
    refusing(upstream)
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            if stream:
                kinds = []
                async with client.responses.stream(model="m", input="hi") as events:
                    async for event in events:
                        kinds.append(event.type)
                    response = await events.get_final_response()
            else:
                response = await client.responses.create(model="m", input="hi")
    assert len(response.output) == 1 and response.output[0].type == "message"
    assert [part.type for part in response.output[0].content] == ["refusal"]
    assert response.output[0].content[0].refusal == REFUSAL
    if stream:
        assert "response.refusal.delta" in kinds and "response.refusal.done" in kinds
        assert "response.output_text.delta" not in kinds


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_messages_stop_reason_is_refusal(setup, stream):
    """Messages: Anthropic's own `stop_reason: "refusal"`, the refusal's words a text block."""
    edge, upstream = setup
    refusing(upstream)
    with trio.fail_after(BOUND):
        async with claude(edge) as client:
            if stream:
                async with client.messages.stream(model="m", max_tokens=50, messages=USER) as events:
                    message = await events.get_final_message()
            else:
                message = await client.messages.create(model="m", max_tokens=50, messages=USER)
    assert message.stop_reason == "refusal"
    assert [(block.type, block.text) for block in message.content] == [("text", REFUSAL)]


# -- 2. Anthropic's request-id ------------------------------------------------------------------


async def test_anthropic_sdk_reads_the_request_id(setup):
    """The anthropic SDK reads `request-id` (not `x-request-id`): a message's `_request_id` and an
    error's `request_id` are the edge's id, the same as its `x-request-id`."""
    edge, upstream = setup
    upstream.script_for("t", steps({"content": "Hello."}, usage=USAGE))
    with trio.fail_after(BOUND):
        async with claude(edge) as client:
            raw = await client.messages.with_raw_response.create(model="m", max_tokens=10, messages=USER)
            message = await raw.parse()
            with pytest.raises(anthropic.NotFoundError) as missing:
                await client.messages.create(model="nope", max_tokens=10, messages=USER)
            counted = await client.messages.with_raw_response.count_tokens(model="m", messages=USER)
    assert message._request_id and message._request_id.startswith("req_")
    assert message._request_id == raw.headers["x-request-id"]
    assert missing.value.request_id and missing.value.request_id == missing.value.response.headers["x-request-id"]
    assert counted.request_id == counted.headers["x-request-id"]


# -- 3. Responses usage as SDK 3.57 types it ----------------------------------------------------


@pytest.mark.parametrize("finish", ["stop", "length"])
async def test_responses_usage_validates_against_the_sdk_types(setup, finish):
    """`usage.input_tokens_details.cache_write_tokens` is there (SDK 3.57 requires it): the whole
    response and the stream's `response.completed` / `response.incomplete` validate strictly."""
    edge, upstream = setup
    upstream.script_for("t", text_script(["a", "b"], finish=finish, usage=USAGE))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            whole = await client.post("/v1/responses", json={"model": "m", "input": "hi"})
            streamed = await client.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True})
    response = openai.types.responses.Response.model_validate(whole.json())
    assert response.usage.input_tokens_details.cache_write_tokens == 0
    kind = "response.completed" if finish == "stop" else "response.incomplete"
    event_type = ResponseCompletedEvent if finish == "stop" else ResponseIncompleteEvent
    ends = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ") and kind in line]
    assert len(ends) == 1
    event = event_type.model_validate_json(ends[0])
    assert event.response.usage.input_tokens_details.cache_write_tokens == 0
    assert event.response.usage.input_tokens == 11


# -- 4. chat: allowed_tools and custom tools ----------------------------------------------------

GET_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
GET_TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
}


def calling_get_time(upstream) -> None:
    upstream.script_for(
        "t",
        steps(
            {"tool_calls": [{"index": 0, "id": "call_t", "type": "function", "function": {"name": "get_time"}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"tz": "UTC"}'}}]},
            finish="tool_calls",
            usage=USAGE,
        ),
    )


async def test_chat_allowed_tools_offers_only_those(setup):
    """Chat's `tool_choice: {"type": "allowed_tools", ...}`, as the Responses route takes it: the
    model server is offered only the listed functions, with the mode as its tool_choice."""
    edge, upstream = setup
    calling_get_time(upstream)
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]},
    }
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            done = await client.chat.completions.create(
                model="m", messages=USER, tools=[GET_WEATHER, GET_TIME], tool_choice=choice
            )
            with pytest.raises(openai.BadRequestError) as unknown:
                bad = {
                    **choice,
                    "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "x"}}]},
                }
                await client.chat.completions.create(
                    model="m", messages=USER, tools=[GET_WEATHER, GET_TIME], tool_choice=bad
                )
    call = done.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("get_time", '{"tz": "UTC"}')
    sent = upstream.records[0].body
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_time"]
    assert sent["tool_choice"] == "required"
    assert unknown.value.body["param"] == "tool_choice.allowed_tools.tools[0]"
    assert len(upstream.records) == 1


async def test_chat_custom_tools_are_left_out(setup):
    """Chat's `custom` tools are left out (as the Responses route leaves them), never a 400: with
    a function beside them it is offered alone; with none the request runs without tools."""
    edge, upstream = setup
    custom = {"type": "custom", "custom": {"name": "apply_patch"}}
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            calling_get_time(upstream)
            mixed = await client.chat.completions.create(model="m", messages=USER, tools=[custom, GET_TIME])
            upstream.script_for("t", steps({"content": "Hello."}, usage=USAGE))
            alone = await client.chat.completions.create(
                model="m",
                messages=USER,
                tools=[custom],
                tool_choice={"type": "custom", "custom": {"name": "apply_patch"}},
            )
    assert mixed.choices[0].message.tool_calls[0].function.name == "get_time"
    assert [t["function"]["name"] for t in upstream.records[0].body["tools"]] == ["get_time"]
    assert alone.choices[0].message.content == "Hello."
    assert "tools" not in upstream.records[1].body and "tool_choice" not in upstream.records[1].body


# -- 5. /v1/messages: thinking, other paths, file documents -------------------------------------


@pytest.mark.parametrize(
    ("thinking", "max_tokens", "param"),
    [
        ({"type": "enabled", "budget_tokens": 500}, 2000, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 4000}, 2000, "max_tokens"),
        ({"type": "enabled"}, 2000, "thinking.budget_tokens"),
        ({"type": "bogus"}, 2000, "thinking.type"),
    ],
)
async def test_messages_thinking_is_checked_as_anthropic_does(setup, thinking, max_tokens, param):
    """An unknown thinking type, a budget under 1024, none, or one not below max_tokens: a 400 in
    Anthropic's shape, and nothing reaches the model server."""
    edge, upstream = setup
    with trio.fail_after(BOUND):
        async with claude(edge) as client:
            with pytest.raises(anthropic.BadRequestError) as refused:
                await client.messages.create(model="m", max_tokens=max_tokens, messages=USER, thinking=thinking)
    body = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert param.split(".")[-1] in body["error"]["message"]
    assert upstream.records == []


async def test_messages_thinking_with_a_forced_tool_is_refused_as_anthropic_does(setup):
    """Thinking with a `tool_choice` that forces a tool (`any`, or `tool` by name) is Anthropic's
    400, in its words, before any model server is asked (it ran: an outside audit); with `auto`
    it runs."""
    edge, upstream = setup
    tool = {"name": "get_time", "description": "The time.", "input_schema": {"type": "object", "properties": {}}}
    thinking = {"type": "enabled", "budget_tokens": 1024}
    with trio.fail_after(BOUND):
        async with claude(edge) as client:
            for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
                for kind in (thinking, {"type": "adaptive"}):
                    with pytest.raises(anthropic.BadRequestError) as refused:
                        await client.messages.create(
                            model="m", max_tokens=2000, messages=USER, tools=[tool], tool_choice=choice, thinking=kind
                        )
                    error = refused.value.body["error"]
                    assert error["type"] == "invalid_request_error"
                    assert error["message"] == "Thinking may not be enabled when tool_choice forces tool use."
            assert upstream.records == []
            upstream.script_for("t", steps({"content": "Hi."}, usage=USAGE))
            message = await client.messages.create(
                model="m", max_tokens=2000, messages=USER, tools=[tool], tool_choice={"type": "auto"}, thinking=thinking
            )
    assert message.content[-1].text == "Hi." and len(upstream.records) == 1


async def test_messages_thinking_that_anthropic_takes_runs(setup):
    """What Anthropic takes runs: a budget of 1024 under max_tokens, adaptive, disabled, and a
    budget past max_tokens under the interleaved-thinking beta."""
    edge, upstream = setup
    ok = [
        ({"type": "enabled", "budget_tokens": 1024}, 2000, {}),
        ({"type": "adaptive"}, 2000, {}),
        ({"type": "disabled"}, 2000, {}),
        ({"type": "enabled", "budget_tokens": 4000}, 2000, {"anthropic-beta": "interleaved-thinking-2025-05-14"}),
    ]
    with trio.fail_after(BOUND):
        async with claude(edge) as client:
            for thinking, max_tokens, headers in ok:
                upstream.script_for("t", steps({"content": "Hi."}, usage=USAGE))
                message = await client.messages.create(
                    model="m", max_tokens=max_tokens, messages=USER, thinking=thinking, extra_headers=headers
                )
                assert message.content[0].text == "Hi."
    assert len(upstream.records) == len(ok)


async def test_any_path_under_messages_answers_anthropic_shaped(setup):
    """`/v1/messages/batches` (the SDK's Batches API) and any other path under /v1/messages: a 404
    in Anthropic's shape, any method, with the request id the SDK reads."""
    edge, _ = setup
    with trio.fail_after(BOUND):
        async with claude(edge) as client:
            with pytest.raises(anthropic.NotFoundError) as created:
                await client.messages.batches.create(
                    requests=[{"custom_id": "a", "params": {"model": "m", "max_tokens": 10, "messages": USER}}]
                )
            with pytest.raises(anthropic.NotFoundError) as listed:
                await client.messages.batches.list()
        async with http(edge) as raw:
            other = await raw.post("/v1/messages/anything/else", json={})
    for error in (created.value, listed.value):
        assert error.body["type"] == "error" and error.body["error"]["type"] == "not_found_error"
        assert error.request_id and error.request_id.startswith("req_")
    assert other.status_code == 404 and other.json()["error"]["type"] == "not_found_error"


async def test_file_document_is_not_called_a_pdf(setup):
    """A `document` with a `file` source (a file_id, no media type) is left out with a note that
    does not make up its type (it was labelled application/pdf)."""
    edge, upstream = setup
    upstream.script_for("t", steps({"content": "Noted."}, usage=USAGE))
    content = [{"type": "document", "source": {"type": "file", "file_id": "file_123"}}, {"type": "text", "text": "sum"}]
    with trio.fail_after(BOUND):
        async with claude(edge) as client:
            await client.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": content}])
    sent = str(upstream.records[0].body["messages"])
    assert "omitted" in sent and "uploaded file" in sent
    assert "application/pdf" not in sent and "PDF" not in sent


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("tool_stream", ["buffered", "live"])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "f"}}], ids=["required", "named"]
)
async def test_a_refusal_under_a_forced_tool_choice_reaches_the_client(nursery, upstream, tool_stream, choice):
    """A model that declines a forced tool call: its refusal was judged "text only" against
    `tool_choice`, retried (the key paid twice) and answered 502 `tool_validation_error`. It is
    the answer, as OpenAI's: `message.refusal` (streamed `delta.refusal`), one run upstream."""
    edge = await start_edge(nursery, edge_config(models=[{"name": "m", "tool_stream": tool_stream}]))
    await start_node(nursery, edge, [model("m", upstream, target="t")])
    refusing(upstream)
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            whole = await client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice=choice)
            async with client.chat.completions.stream(
                model="m", messages=USER, tools=TOOLS, tool_choice=choice
            ) as stream:
                final = await stream.get_final_completion()
    assert whole.choices[0].message.refusal == REFUSAL and not whole.choices[0].message.tool_calls
    assert final.choices[0].message.refusal == REFUSAL
    assert len(upstream.records) == 2  # one run each, no retry
