"""Parameters that change what an answer means are honoured or refused, never silently dropped:
log probabilities (refused on chat and Responses), Anthropic structured outputs (relayed as a
`response_format`), Responses `allowed_tools`, `prompt` and `max_tool_calls`, and a tool call
required with no tools (refused on chat and Messages)."""

from __future__ import annotations

import anthropic
import openai
import pytest
import trio
from pydantic import BaseModel

from scripts.upstream import steps
from tests.conftest import BOUND, edge_config, http, model, sdk, settled, start_edge, start_node

USER = [{"role": "user", "content": "hi"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
NOTHING = {"type": "object", "properties": {}}
RESPONSES_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": CITY},
    {"type": "function", "name": "get_time", "parameters": NOTHING},
]
CHAT_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": NOTHING}}


@pytest.fixture
async def edge_up(nursery, upstream):
    edge = await start_edge(nursery, edge_config())
    node = await start_node(nursery, edge, [model("m", upstream, target="t", max_concurrency=4)])
    yield edge, upstream
    await settled(edge, node.agent)


def two_calls():
    """An upstream answer with two native calls of get_time."""
    return steps(
        {
            "tool_calls": [
                {"index": 0, "id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            ]
        },
        {
            "tool_calls": [
                {"index": 1, "id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            ]
        },
        finish="tool_calls",
    )


def error_of(r) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


# -- log probabilities ------------------------------------------------------------------------


async def test_chat_logprobs_asked_for_are_a_400(edge_up):
    """`logprobs: true` or `top_logprobs` > 0 on chat is a 400 naming the field (the nodes relay no
    log probabilities, so `logprobs: null` would pass for an answer); false and 0 are served."""
    edge, upstream = edge_up
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model="m", messages=USER, logprobs=True, top_logprobs=1)
            with pytest.raises(openai.BadRequestError) as top_only:
                await client.chat.completions.create(model="m", messages=USER, top_logprobs=2, stream=True)
            served = await client.chat.completions.create(model="m", messages=USER, logprobs=False, top_logprobs=0)
    assert refused.value.body["param"] == "logprobs" and refused.value.body["code"] == "unsupported_parameter"
    assert "log probabilities" in refused.value.body["message"]
    assert top_only.value.body["param"] == "top_logprobs"
    assert served.choices[0].message.content
    assert len(upstream.records) == 1  # the refused ones never reached the model


async def test_chat_bodies_openai_refuses_are_a_400_naming_the_field(edge_up):
    """Bodies OpenAI's API (and vLLM's) refuse were served (an outside audit): a user message with no
    content, a tool result with no call id, `stream_options` on a whole answer, a `response_format`
    of an unknown type or a `json_schema` with no schema object. Each is a 400 naming the field;
    the forms model servers take are served (`json_object` with llama.cpp's `schema`, vLLM's
    `structural_tag`, an assistant turn of calls alone), and none of the refused reached the model."""
    edge, upstream = edge_up
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    refused = [
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [*USER, {"role": "system", "content": None}]}, "messages[1].content"),
        ({"messages": [*USER, {"role": "tool", "content": "12:00"}]}, "messages[1].tool_call_id"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
        ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
    ]
    served = [
        {"messages": USER, "response_format": {"type": "json_object", "schema": CITY}},
        {"messages": USER, "response_format": {"type": "structural_tag", "structures": []}},
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}},
        {
            "messages": [
                *USER,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
            ]
        },
        {"messages": USER, "stream_options": {"include_usage": True}, "stream": True},
    ]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for body, param in refused:
                r = await client.post("/v1/chat/completions", json={"model": "m", **body})
                assert error_of(r)["param"] == param, body
                if param == "response_format.type":  # (every type it takes: structural_tag was left out)
                    assert "json_schema or structural_tag" in error_of(r)["message"], r.text
            assert not upstream.records
            for body in served:
                r = await client.post("/v1/chat/completions", json={"model": "m", **body})
                assert r.status_code == 200, (body, r.text)
    assert len(upstream.records) == len(served)


async def test_chat_tool_results_must_answer_the_calls_before_them(edge_up):
    """A tool result after no call, a result for a call the message before did not make, and a
    call left without its result went to the model server as they came (a model shown a result
    for no call answers from a history it was never trained on; vLLM's templates refuse some in
    their own words). Each is now OpenAI's 400, with its message and the message it names; results
    in another order than their calls, and an id a megabyte long, are served or named short."""
    edge, upstream = edge_up

    def call(call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}

    def asked(*ids: str) -> dict:
        return {"role": "assistant", "content": None, "tool_calls": [call(i) for i in ids]}

    def result(call_id: str) -> dict:
        return {"role": "tool", "tool_call_id": call_id, "content": "12:00"}

    huge = "c" * 1_000_000
    refused = [
        ([*USER, result("c1")], "messages[1].role", "must be a response to a preceeding message with 'tool_calls'"),
        ([*USER, asked("c1"), result("c1"), *USER, result("c1")], "messages[4].role", "must be a response to a"),
        ([*USER, asked("c1"), result("c2")], "messages[2].tool_call_id", "'c2' not found in 'tool_calls'"),
        ([*USER, asked("c1", "c2"), result("c1"), *USER], "messages[1].role", "did not have response messages: 'c2'"),
        ([*USER, asked("c1")], "messages[1].role", "did not have response messages: 'c1'"),
        ([*USER, asked("c1"), result(huge)], "messages[2].tool_call_id", "'cccc"),
        ([*USER, asked("c1", "c2"), result("c1"), result("c1")], "messages[3].tool_call_id", "an earlier tool message"),
    ]
    served = [
        [*USER, asked("c1", "c2"), result("c2"), result("c1"), *USER],
        [*USER, asked("c1"), result("c1"), asked("c2"), result("c2")],
    ]
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            for messages, param, says in refused:
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="m", messages=messages)
                assert e.value.body["param"] == param and says in e.value.body["message"], (param, e.value.body)
                assert len(e.value.body["message"]) < 400
            assert not upstream.records
            for messages in served:
                answer = await client.chat.completions.create(model="m", messages=messages)
                assert answer.choices[0].message.content
    assert len(upstream.records) == len(served)


async def test_responses_logprobs_asked_for_are_a_400(edge_up):
    """On Responses, `include: ["message.output_text.logprobs"]` is a 400 naming `include`, and
    `top_logprobs` > 0 one naming `top_logprobs`; other includes and `top_logprobs: 0` are served."""
    edge, upstream = edge_up
    base = {"model": "m", "input": "hi"}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            included = await client.post("/v1/responses", json={**base, "include": ["message.output_text.logprobs"]})
            top = await client.post("/v1/responses", json={**base, "top_logprobs": 2})
            served = await client.post(
                "/v1/responses", json={**base, "include": ["reasoning.encrypted_content"], "top_logprobs": 0}
            )
    assert error_of(included)["param"] == "include" and error_of(included)["code"] == "unsupported_parameter"
    assert error_of(top)["param"] == "top_logprobs" and error_of(top)["code"] == "unsupported_parameter"
    assert served.status_code == 200 and served.json()["status"] == "completed"
    assert len(upstream.records) == 1


async def test_responses_metadata_values_and_unknown_input_items_are_named(edge_up):
    """`metadata` values are strings (as OpenAI's: `{"a": 1}` was a 200); an `input` of only item
    types the edge does not know is a 400 that names them (it said `input` was missing). An unknown
    item beside a message is left out, the request served."""
    edge, upstream = edge_up
    base = {"model": "m", "input": "hi"}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            number = await client.post("/v1/responses", json={**base, "metadata": {"user": "u", "a": 1}})
            unknown = await client.post("/v1/responses", json={"model": "m", "input": [{"type": "weird"}] * 2})
            beside = await client.post(
                "/v1/responses", json={"model": "m", "input": [{"type": "weird"}, {"role": "user", "content": "hi"}]}
            )
            served = await client.post("/v1/responses", json={**base, "metadata": {"user": "u"}})
            bounds = [  # (OpenAI's: 16 pairs, 64-character keys, 512-character values)
                await client.post("/v1/responses", json={**base, "metadata": metadata})
                for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513})
            ]
            typeless = await client.post("/v1/responses", json={"model": "m", "input": [{"content": "hi"}]})
    assert error_of(number) == {
        "message": "Invalid type for `metadata.a`: expected a string.",
        "type": "invalid_request_error",
        "param": "metadata.a",
        "code": None,
    }
    assert error_of(unknown)["param"] == "input"
    assert "unsupported item types: `weird`" in error_of(unknown)["message"]
    assert [error_of(r)["param"] for r in bounds] == ["metadata", "metadata", "metadata.k"]
    assert error_of(typeless)["param"] == "input[0].type"
    assert beside.status_code == 200 and served.status_code == 200
    assert len(upstream.records) == 2


async def test_chat_service_tier_cache_key_and_safety_id_are_checked_then_forwarded(edge_up):
    """`service_tier`, `prompt_cache_key` and `safety_identifier` on chat: a wrong value or type
    is a 400 naming the field, as OpenAI's (they were forwarded unchecked: an outside audit);
    good ones reach the model server as sent."""
    edge, upstream = edge_up
    base = {"model": "m", "messages": USER}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            tier = await client.post("/v1/chat/completions", json={**base, "service_tier": "bogus"})
            key = await client.post("/v1/chat/completions", json={**base, "prompt_cache_key": 123})
            safety = await client.post("/v1/chat/completions", json={**base, "safety_identifier": ["u"]})
        async with sdk(edge) as client:
            served = await client.chat.completions.create(
                model="m", messages=USER, service_tier="flex", prompt_cache_key="k1", safety_identifier="u-9"
            )
    assert error_of(tier)["param"] == "service_tier" and "bogus" in error_of(tier)["message"]
    assert error_of(key)["param"] == "prompt_cache_key"
    assert error_of(safety)["param"] == "safety_identifier"
    assert served.choices[0].message.content
    assert len(upstream.records) == 1
    sent = upstream.records[0].body
    assert (sent["service_tier"], sent["prompt_cache_key"], sent["safety_identifier"]) == ("flex", "k1", "u-9")


# -- Anthropic structured outputs ---------------------------------------------------------------


class Weather(BaseModel):
    city: str
    temp: int


async def test_messages_parse_output_format_reaches_the_model(edge_up):
    """`messages.parse(output_format=Model)` (`output_config.format`) reaches the model server as a
    json_schema `response_format`, and its answer parses; `output_config.effort` alone sends none."""
    edge, upstream = edge_up
    upstream.script_for("t", steps({"content": '{"city": "Paris", "temp": 18}'}))
    with trio.fail_after(BOUND):
        async with anthropic.AsyncAnthropic(base_url=edge.url, api_key="unused", max_retries=0) as client:
            parsed = await client.messages.parse(model="m", max_tokens=100, messages=USER, output_format=Weather)
            await client.messages.create(
                model="m", max_tokens=100, messages=USER, extra_body={"output_config": {"effort": "high"}}
            )
    assert parsed.parsed_output == Weather(city="Paris", temp=18)
    sent = upstream.records[0].body["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["name"]
    assert sent["json_schema"]["schema"]["properties"].keys() == {"city", "temp"}
    assert "response_format" not in upstream.records[1].body


async def test_messages_output_format_of_another_kind_is_a_400(edge_up):
    """An `output_config.format` that is not a json_schema with a schema is a 400 in Anthropic's shape."""
    edge, upstream = edge_up
    body = {"model": "m", "max_tokens": 10, "messages": USER, "output_config": {"format": {"type": "xml"}}}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/messages", json=body)
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "output_config.format" in r.json()["error"]["message"]
    assert not upstream.records


# -- Responses: allowed_tools, prompt, max_tool_calls -------------------------------------------


async def test_responses_allowed_tools_offers_only_those(edge_up):
    """`tool_choice: {"type": "allowed_tools", ...}` offers the model only the listed functions,
    mode `required` as a required call and `auto` as auto; a listed function not in `tools` is a 400."""
    edge, upstream = edge_up
    upstream.script_for("t", two_calls())
    only_time = [{"type": "function", "name": "get_time"}]
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            required = await client.responses.create(
                model="m",
                input="what time is it",
                tools=RESPONSES_TOOLS,
                tool_choice={"type": "allowed_tools", "mode": "required", "tools": only_time},
            )
            await client.responses.create(
                model="m",
                input="what time is it",
                tools=RESPONSES_TOOLS,
                tool_choice={"type": "allowed_tools", "mode": "auto", "tools": only_time},
            )
        async with http(edge) as client:
            choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "x"}]}
            unknown = await client.post(
                "/v1/responses", json={"model": "m", "input": "hi", "tools": RESPONSES_TOOLS, "tool_choice": choice}
            )
    assert [o.name for o in required.output if o.type == "function_call"] == ["get_time", "get_time"]
    first, second = (r.body for r in upstream.records[:2])
    assert [t["function"]["name"] for t in first["tools"]] == ["get_time"] and first["tool_choice"] == "required"
    assert [t["function"]["name"] for t in second["tools"]] == ["get_time"] and second["tool_choice"] == "auto"
    assert error_of(unknown)["param"] == "tool_choice.tools[0]"
    assert len(upstream.records) == 2


async def test_responses_stored_prompt_is_a_400(edge_up):
    """A stored `prompt` template is a 400 `stateless_edge` naming `prompt` (it was silently not applied)."""
    edge, upstream = edge_up
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model="m", input="hi", prompt={"id": "pmpt_123", "version": "2"})
    assert refused.value.body["param"] == "prompt" and refused.value.body["code"] == "stateless_edge"
    assert not upstream.records


async def test_responses_max_tool_calls_trims_the_calls(edge_up):
    """`max_tool_calls: 1` returns the first of the model's two calls, whole and streamed, and the
    response says `max_tool_calls: 1`; without it both come back. A value below 1 is a 400."""
    edge, upstream = edge_up
    upstream.script_for("t", two_calls())
    args = {"model": "m", "input": "what time is it", "tools": RESPONSES_TOOLS}
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            one = await client.responses.create(**args, max_tool_calls=1)
            streamed = [e async for e in await client.responses.create(**args, max_tool_calls=1, stream=True)]
            both = await client.responses.create(**args)
        async with http(edge) as client:
            zero = await client.post("/v1/responses", json={**args, "max_tool_calls": 0})
    assert [o.call_id for o in one.output if o.type == "function_call"] == ["c1"] and one.max_tool_calls == 1
    final = streamed[-1].response
    assert [o.call_id for o in final.output if o.type == "function_call"] == ["c1"]
    assert sum(e.type == "response.function_call_arguments.done" for e in streamed) == 1
    assert [o.call_id for o in both.output if o.type == "function_call"] == ["c1", "c2"]
    assert error_of(zero)["param"] == "max_tool_calls"


@pytest.mark.parametrize("written", ["native", "text"])
async def test_responses_max_tool_calls_checks_only_the_calls_returned(edge_up, written):
    """`max_tool_calls: 1`: a valid first call and an invalid second (native, or written as text)
    answer the first call, whole and streamed, at the first run. The second, never returned, was
    checked too: a retry, then a 502 `tool_validation_error` or `response.failed` (an outside audit)."""
    edge, upstream = edge_up
    if written == "native":
        script = steps(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ]
            },
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"town": 1}'},
                    }
                ]
            },
            finish="tool_calls",
        )
    else:
        good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        script = steps({"content": good + '<tool_call>{"name": "get_weather", "arguments": {"town": 1}}</tool_call>'})
    upstream.script_for("t", script)
    args = {"model": "m", "input": "weather?", "tools": RESPONSES_TOOLS, "max_tool_calls": 1}
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            whole = await client.responses.create(**args)
            streamed = [e async for e in await client.responses.create(**args, stream=True)]
    final = streamed[-1]
    assert final.type == "response.completed", final
    for response in (whole, final.response):
        calls = [(o.name, o.arguments) for o in response.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0][0] == "get_weather" and '"Paris"' in calls[0][1], calls
        assert "tool_call" not in response.output_text
    assert len(upstream.records) == 2  # one run each: no retry


# -- a tool call required with no tools -------------------------------------------------------


async def test_chat_tool_choice_without_tools_is_a_400(edge_up):
    """Chat `tool_choice: "required"` or a named function without `tools` is a 400 naming
    `tool_choice` (as OpenAI's); `auto` without tools, and `required` with them, are served."""
    edge, upstream = edge_up
    named = {"type": "function", "function": {"name": "get_time"}}
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            refused = []
            for choice in ("required", named):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="m", messages=USER, tool_choice=choice, tools=[])
                refused.append(e.value.body)
            auto = await client.chat.completions.create(model="m", messages=USER, tool_choice="auto")
            upstream.script_for("t", two_calls())
            called = await client.chat.completions.create(
                model="m", messages=USER, tool_choice="required", tools=[CHAT_TOOL]
            )
    assert [b["param"] for b in refused] == ["tool_choice", "tool_choice"]
    assert auto.choices[0].message.content and called.choices[0].message.tool_calls
    assert len(upstream.records) == 2


async def test_responses_tool_choice_without_function_tools_is_a_400(edge_up):
    """Responses `tool_choice: "required"` or a named function with no function tool (none at
    all, or only hosted ones the edge leaves out) is a 400 naming `tool_choice`, as on chat:
    it was a text answer."""
    edge, upstream = edge_up
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            refused = []
            for choice, tools in (("required", []), ({"type": "function", "name": "f"}, [{"type": "web_search"}])):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.responses.create(model="m", input="hi", tool_choice=choice, tools=tools)
                refused.append(e.value.body)
            auto = await client.responses.create(model="m", input="hi", tool_choice="auto")
    assert [b["param"] for b in refused] == ["tool_choice", "tool_choice"]
    assert auto.output_text and len(upstream.records) == 1


async def test_messages_tool_choice_without_tools_is_a_400(edge_up):
    """Messages `tool_choice` `any` or `tool` without `tools` is a 400 in Anthropic's shape naming
    `tool_choice`; `auto` without tools is served."""
    edge, upstream = edge_up
    with trio.fail_after(BOUND):
        async with anthropic.AsyncAnthropic(base_url=edge.url, api_key="unused", max_retries=0) as client:
            refused = []
            for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
                with pytest.raises(anthropic.BadRequestError) as e:
                    await client.messages.create(model="m", max_tokens=10, messages=USER, tool_choice=choice)
                refused.append(e.value.body)
            served = await client.messages.create(model="m", max_tokens=10, messages=USER, tool_choice={"type": "auto"})
    for body in refused:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("tool_choice")
    assert served.stop_reason in ("end_turn", "max_tokens")
    assert len(upstream.records) == 1
