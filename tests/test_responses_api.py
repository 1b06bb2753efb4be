"""``POST /v1/responses`` (the OpenAI Responses API, stateless) with the official SDK: whole and
streamed responses, function tools and their round trip, reasoning, length, the stateless 400,
hosted tool types left out, errors, and cancellation."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import trio

from edge.errors import APIError
from edge.openai.items import ResponseItems
from edge.openai.responses import decode_request
from scripts.upstream import native_call, steps, words
from tests.agents import quiet_env, require_agent, run_offline
from tests.conftest import BOUND, edge_config, http, model, sdk, settled, start_edge, start_node

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


@pytest.fixture
async def edge_up(nursery, upstream):
    edge = await start_edge(nursery, edge_config(keepalive_s=0.2))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    yield edge, upstream
    await settled(edge, node.agent)


def check_sequence(events) -> None:
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), numbers
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"


# -- whole and streamed -------------------------------------------------------------------


async def test_create_whole_response(edge_up):
    """A non-streamed request is one `response` object: id, status, output text, usage, model; the
    upstream gets the chat body (instructions and leading developer messages as one system message,
    max_output_tokens as max_tokens, a model server's own fields as they are: they were dropped)."""
    edge, upstream = edge_up
    upstream.script_for("t", steps({"content": "Hello "}, {"content": "there."}, usage=USAGE))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            r = await client.responses.create(
                model="m",
                instructions="Be brief.",
                input=[
                    {"role": "developer", "content": "No jokes."},
                    {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                ],
                max_output_tokens=50,
                store=True,
                metadata={"k": "v"},
                user="u1",
                # A model server's own fields go on as chat's do; chat's own shapes are not taken.
                extra_body={"top_k": 5, "chat_template_kwargs": {"enable_thinking": False}, "messages": [], "n": 3},
            )
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == "Hello there." and r.model == "m" and r.created_at > 0
    assert r.store is False  # nothing is stored
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (7, 3, 10)
    body = upstream.records[0].body
    assert body["messages"] == [
        {"role": "system", "content": "Be brief.\n\nNo jokes."},  # one system message, first
        {"role": "user", "content": "hi"},
    ]
    assert body["max_tokens"] == 50 and body["user"] == "u1"
    assert "include_reasoning" not in body and body["metadata"] == {"k": "v"} and body["store"] is True
    assert body["top_k"] == 5 and body["chat_template_kwargs"] == {"enable_thinking": False} and "n" not in body
    assert "input" not in body and "instructions" not in body


async def test_a_responses_metadata_reaches_the_model_server_only_with_store(edge_up):
    """A Response's `metadata` needs no `store`; chat's does: OpenAI's chat answers a 400 "The
    'metadata' parameter is only allowed when 'store' is enabled" without it, and the edge sent
    it bare (an outside audit). It goes on only beside an explicit `store: true`, which goes
    with it; it is echoed either way."""
    edge, upstream = edge_up
    upstream.script_for("t", steps({"content": "Hi."}, usage=USAGE))
    meta = {"team": "a"}
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            bare = await client.responses.create(model="m", input="hi", metadata=meta)
            unstored = await client.responses.create(model="m", input="hi", metadata=meta, store=False)
            stored = await client.responses.create(model="m", input="hi", metadata=meta, store=True)
            async with client.responses.stream(model="m", input="hi", metadata=meta) as stream:
                streamed = await stream.get_final_response()
    assert bare.metadata == unstored.metadata == stored.metadata == streamed.metadata == meta
    sent = [r.body for r in upstream.records]
    assert ["metadata" in b or "store" in b for b in sent[:2]] == [False, False]
    assert (sent[2]["metadata"], sent[2]["store"]) == (meta, True)
    assert "metadata" not in sent[3] and len(sent) == 4


async def test_the_response_echoes_the_request_s_cache_key_safety_id_tier_and_top_logprobs(edge_up):
    """`prompt_cache_key`, `safety_identifier`, `service_tier` and `top_logprobs` come back in the
    Response as sent, streamed (every snapshot) and whole; unsent, they are null (they were left
    out: an outside audit). The first three, `user` and `text.verbosity` reach the model server
    as chat sends them (the cache key went as `user`, or not at all beside a `user`, and the
    others were dropped while the response said the tier was served: an outside audit)."""
    edge, upstream = edge_up
    upstream.script_for("t", steps({"content": "Hi."}, usage=USAGE))
    sent = {"prompt_cache_key": "pck-1", "safety_identifier": "sid-1", "service_tier": "flex", "top_logprobs": 0}
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            whole = await client.responses.create(
                model="m", input="hi", user="end-user-7", text={"verbosity": "low"}, **sent
            )
            async with client.responses.stream(model="m", input="hi", **sent) as stream:
                snapshots = [e.response async for e in stream if hasattr(e, "response")]
            bare = await client.responses.create(model="m", input="hi")
        async with http(edge) as raw:
            wordy = await raw.post("/v1/responses", json={"model": "m", "input": "hi", "text": {"verbosity": "loud"}})
    assert len(snapshots) >= 3  # created, in_progress (again with each keep-alive), completed
    for r in (whole, *snapshots):
        assert {name: getattr(r, name) for name in sent} == sent
    assert all(getattr(bare, name) is None for name in sent)
    forwarded = upstream.records[0].body
    assert {k: forwarded.get(k) for k in ("user", "prompt_cache_key", "safety_identifier", "service_tier")} == {
        "user": "end-user-7",
        "prompt_cache_key": "pck-1",
        "safety_identifier": "sid-1",
        "service_tier": "flex",
    }
    assert forwarded["verbosity"] == "low" and "top_logprobs" not in forwarded and "text" not in forwarded
    assert wordy.status_code == 400 and wordy.json()["error"]["param"] == "text.verbosity"
    assert len(upstream.records) == 3


async def test_stream_helper_and_create_stream(edge_up):
    """`responses.stream(...)` and `create(stream=True)` consume the stream: typed events with
    increasing sequence numbers, text deltas, a final response with usage."""
    edge, upstream = edge_up
    upstream.script_for("t", steps({"content": "Hello "}, {"content": "there."}, usage=USAGE))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            async with client.responses.stream(model="m", input="hi") as stream:
                events = [e async for e in stream]
                final = await stream.get_final_response()
            raw = [e async for e in await client.responses.create(model="m", input="hi", stream=True)]
    for seen in (events, raw):
        check_sequence(seen)
        assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == "Hello there."
        assert seen[-1].type == "response.completed"
        assert seen[-1].response.usage.total_tokens == 10
    assert final.output_text == "Hello there." and final.status == "completed"
    types = [e.type for e in raw]
    assert types[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert upstream.records[0].body["messages"] == [{"role": "user", "content": "hi"}]


async def test_sse_lines_name_each_event(edge_up):
    """Each SSE event is `event: <type>` + `data: <json>` with the same type."""
    edge, upstream = edge_up
    upstream.script_for("t", steps({"content": "ok"}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    blocks = [b for b in r.text.split("\n\n") if b.strip() and not b.startswith(":")]
    for block in blocks:
        event, data = block.split("\n")
        assert event.removeprefix("event: ") == msgspec.json.decode(data.removeprefix("data: "))["type"]


# -- tools --------------------------------------------------------------------------------


async def test_function_call_round_trip(edge_up):
    """A native tool call is a `function_call` item (call_id, name, JSON arguments), streamed and
    whole; the next turn's `function_call` and `function_call_output` items reach the upstream as an
    assistant tool call and a tool message."""
    edge, upstream = edge_up
    upstream.script_for("t", steps(*native_call("call_1", "get_weather", '{"city": "Paris"}'), finish="tool_calls"))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            async with client.responses.stream(model="m", input="weather in Paris?", tools=[WEATHER]) as stream:
                events = [e async for e in stream]
                final = await stream.get_final_response()
            whole = await client.responses.create(model="m", input="weather in Paris?", tools=[WEATHER])
            upstream.script_for("t", steps({"content": "Sunny in Paris."}))
            second = await client.responses.create(
                model="m",
                tools=[WEATHER],
                input=[
                    {"role": "user", "content": "weather in Paris?"},
                    *[item.model_dump(exclude_none=True) for item in whole.output],
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                ],
            )
    check_sequence(events)
    for r in (final, whole):
        (call,) = [item for item in r.output if item.type == "function_call"]
        assert call.call_id == "call_1" and call.name == "get_weather"
        assert msgspec.json.decode(call.arguments) == {"city": "Paris"}
    assert "response.function_call_arguments.done" in [e.type for e in events]
    assert second.output_text == "Sunny in Paris."
    assert upstream.records[0].body["tools"][0]["function"]["name"] == "get_weather"
    messages = upstream.records[2].body["messages"]
    assert messages[1]["role"] == "assistant"
    assert messages[1]["tool_calls"][0]["id"] == "call_1"
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


async def test_a_call_id_used_twice_or_answered_twice_is_a_400(edge_up):
    """Two `function_call` items of one `call_id`, or two outputs for one call, were a 200: the
    model server got one assistant turn with two calls of that id and one tool message (an
    outside audit; the Messages route refuses the same). Both are 400s, and nothing goes upstream."""
    edge, upstream = edge_up
    user = {"role": "user", "content": "hi"}

    def call(arguments: str) -> dict:
        return {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": arguments}

    output = {"type": "function_call_output", "call_id": "c", "output": "r"}
    refused = []
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            for items in ([user, call("{}"), call('{"x": 1}'), output], [user, call("{}"), output, output]):
                with pytest.raises(openai.BadRequestError) as caught:
                    await client.responses.create(model="m", tools=[WEATHER], input=items)
                refused.append(caught.value.body["message"])
    assert refused == [
        "Duplicate function call with call_id c: each is used once.",
        "Duplicate function call output for call_id c: one output a call.",
    ]
    assert not upstream.records


async def test_hosted_tool_types_are_left_out(edge_up):
    """`web_search`, `namespace`, `file_search` and `custom` tools never fail a request or reject a
    call: only the function tools reach the upstream."""
    edge, upstream = edge_up
    upstream.script_for("t", steps(*native_call("call_9", "get_weather", '{"city": "Oslo"}'), finish="tool_calls"))
    tools = [
        {"type": "web_search"},
        {"type": "namespace", "name": "mcp", "tools": []},
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        {"type": "custom", "name": "apply_patch"},
        WEATHER,
    ]
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            r = await client.responses.create(model="m", input="hi", tools=tools, tool_choice="auto")
    (call,) = r.output
    assert call.type == "function_call" and call.call_id == "call_9"
    assert [t["function"]["name"] for t in upstream.records[0].body["tools"]] == ["get_weather"]


# -- reasoning, length, errors ------------------------------------------------------------


async def test_reasoning_shown_when_a_summary_is_asked(edge_up):
    """With `reasoning.summary`, the upstream's reasoning is a reasoning item (summary and reasoning
    text, streamed as deltas) before the message; without it, no reasoning item."""
    edge, upstream = edge_up
    script = steps({"reasoning_content": "let me "}, {"reasoning_content": "think"}, {"content": "Sunny."})
    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            async with client.responses.stream(model="m", input="hi", reasoning={"summary": "auto"}) as stream:
                events = [e async for e in stream]
                final = await stream.get_final_response()
            whole = await client.responses.create(
                model="m", input="hi", reasoning={"effort": "high", "summary": "auto"}
            )
            hidden = await client.responses.create(model="m", input="hi", reasoning={"effort": "low"})
            off = await client.responses.create(model="m", input="hi", reasoning={"summary": "none"})
    check_sequence(events)
    deltas = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert "".join(deltas) == "let me think"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "let me think"
    for r in (final, whole):
        reasoning, message = r.output
        assert reasoning.type == "reasoning" and reasoning.summary[0].text == "let me think"
        assert r.output_text == "Sunny."
    assert [item.type for item in hidden.output] == ["message"] and hidden.output_text == "Sunny."
    assert "reasoning" not in upstream.records[1].body  # the effort is ignored
    # the request's reasoning, echoed as asked ("none" was echoed as null)
    assert (whole.reasoning.effort, whole.reasoning.summary) == ("high", "auto")
    assert (hidden.reasoning.effort, hidden.reasoning.summary) == ("low", None)
    assert [item.type for item in off.output] == ["message"] and off.reasoning.summary == "none"


async def test_a_reasoning_only_answer_is_a_reasoning_item_alone_when_a_summary_is_asked(edge_up):
    """A run that ends with reasoning and no answer, with `reasoning.summary`: a reasoning item and
    no message repeating it (it showed twice, an outside audit). Without a summary, the message is
    the edge's notice; chat's reasoning-only answer still gets the reasoning as content (the seeds'
    rule: many chat clients never show `reasoning_content`)."""
    edge, upstream = edge_up
    upstream.script_for("t", steps({"reasoning_content": "let me "}, {"reasoning_content": "think"}))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            async with client.responses.stream(model="m", input="hi", reasoning={"summary": "auto"}) as stream:
                events = [e async for e in stream]
                streamed = await stream.get_final_response()
            whole = await client.responses.create(model="m", input="hi", reasoning={"summary": "auto"})
            hidden = await client.responses.create(model="m", input="hi")
            chat = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], extra_body={"include_reasoning": True}
            )
    check_sequence(events)
    for r in (streamed, whole):
        assert [item.type for item in r.output] == ["reasoning"], r.output
        assert r.output[0].summary[0].text == "let me think" and r.output_text == ""
    assert [item.type for item in hidden.output] == ["message"]
    assert hidden.output_text.startswith("The model produced only hidden reasoning and no answer")
    assert chat.choices[0].message.content == "let me think"


async def test_length_is_incomplete(edge_up):
    """A run cut off by max_output_tokens is `incomplete` with reason max_output_tokens, streamed
    (`response.incomplete`) and whole."""
    edge, upstream = edge_up
    upstream.script_for("t", steps({"content": "tok0 "}, {"content": "tok1 "}, finish="length"))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            whole = await client.responses.create(model="m", input="hi", max_output_tokens=2)
            events = [e async for e in await client.responses.create(model="m", input="hi", stream=True)]
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text == "tok0 tok1 "
    check_sequence(events)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


async def test_stateless_edge_rejects_previous_response_id(edge_up):
    """`previous_response_id` and `conversation` are a 400 saying the edge keeps no responses."""
    edge, _ = edge_up
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(model="m", input="hi", previous_response_id="resp_123")
            with pytest.raises(openai.BadRequestError) as conversation:
                await client.responses.create(model="m", input="hi", conversation="conv_1")
    assert "full conversation" in caught.value.message and "stateless" in caught.value.message
    assert caught.value.body["type"] == "invalid_request_error"
    assert conversation.value.body["param"] == "conversation"


async def test_item_references_resolve_for_the_key_that_made_them(nursery, upstream):
    """The output items of a response given with `store` on (the API's default) can be sent back as
    `item_reference`s by the same key, streamed or not, and the model sees them as they were; another
    key's reference, an item of a `store: false` response, or an unknown id is a 400
    `item_not_found` that says to send the item itself."""
    edge = await start_edge(nursery, edge_config(api_keys=["sk-a", "sk-b"]))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    call = native_call("call_9", "get_weather", '{"city": "Oslo"}')
    upstream.script_for(
        "t",
        lambda body: (
            steps({"content": "Let me look."}, *call, finish="tool_calls")
            if body.get("tools") and len(body["messages"]) == 1
            else steps({"content": "Noted."})
        ),
    )
    with trio.fail_after(BOUND):
        async with sdk(edge, api_key="sk-a") as a, sdk(edge, api_key="sk-b") as b:
            first = await a.responses.create(model="m", input="Weather in Oslo?", tools=[WEATHER])
            events = [e async for e in await a.responses.create(model="m", input="Hi", stream=True)]
            unkept = await a.responses.create(model="m", input="Hi", store=False)
            refs = [{"type": "item_reference", "id": item.id} for item in first.output]
            again = await a.responses.create(
                model="m",
                tools=[WEATHER],
                input=[
                    {"role": "user", "content": "Weather in Oslo?"},
                    *refs,
                    {"type": "function_call_output", "call_id": "call_9", "output": "rain"},
                    {"type": "item_reference", "id": events[-1].response.output[0].id},
                    {"role": "user", "content": "Thanks."},
                ],
            )
            refused = []
            for client, item_id in ((b, first.output[0].id), (a, unkept.output[0].id), (a, "msg_nope")):
                with pytest.raises(openai.BadRequestError) as caught:
                    await client.responses.create(model="m", input=[{"type": "item_reference", "id": item_id}])
                refused.append(caught.value)
    assert [item.type for item in first.output] == ["message", "function_call"]
    assert again.output_text == "Noted."
    assert upstream.records[3].body["messages"] == [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "rain"},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Thanks."},
    ]
    for error in refused:
        assert error.body["code"] == "item_not_found" and error.body["param"] == "input[0]"
        assert "Send the item itself" in error.message
    assert len(upstream.records) == 4  # the refused ones reached no model
    await settled(edge, node.agent)


async def test_references_expand_to_no_more_than_a_body_may_hold(nursery, upstream):
    """`item_reference`s to large kept items are a 413 `request_too_large` once the items
    they name pass `max_body_bytes` (not a body of copies that takes the edge's memory), and more
    input items than `max_messages` are a 400 before any reference is looked up; one item
    referenced twice is a 400 `duplicate_item`; the model sees none of them, and the edge answers
    the next request."""
    edge = await start_edge(nursery, edge_config(max_body_bytes=65_536, max_messages=50))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    upstream.script_for("t", steps({"content": "x" * 20_000}))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            bigs = [await client.responses.create(model="m", input="Write a lot.") for _ in range(4)]
            refs = [{"type": "item_reference", "id": big.output[0].id} for big in bigs]
            ref = refs[0]
            fits = await client.responses.create(model="m", input=[{"role": "user", "content": "a"}, ref])
            with pytest.raises(openai.BadRequestError) as twice:
                await client.responses.create(model="m", input=[{"role": "user", "content": "a"}, ref, ref])
            whole = bigs[0].output[0].model_dump(exclude_none=True)  # the item itself, and a reference to it
            with pytest.raises(openai.BadRequestError) as sent_and_referenced:
                await client.responses.create(model="m", input=[whole, ref])
            with pytest.raises(openai.BadRequestError) as referenced_and_sent:
                await client.responses.create(model="m", input=[ref, whole])
            with pytest.raises(openai.APIStatusError) as too_large:
                await client.responses.create(model="m", input=[{"role": "user", "content": "a"}, *refs])
            with pytest.raises(openai.BadRequestError) as too_many:
                await client.responses.create(model="m", input=[{"role": "user", "content": "a"}, *[ref] * 50])
            after = await client.responses.create(model="m", input="Hi")
    assert fits.status == "completed" and len(upstream.records[4].body["messages"]) == 2
    assert twice.value.body["code"] == "duplicate_item"  # (as OpenAI answers it)
    for either in (sent_and_referenced, referenced_and_sent):  # (it reached the model twice)
        assert either.value.body["code"] == "duplicate_item"
    assert too_large.value.status_code == 413 and too_large.value.body["code"] == "request_too_large"
    assert "65536 bytes" in too_large.value.message and too_large.value.body["param"] == "input"
    assert too_many.value.body["code"] == "too_many_messages"
    assert after.status == "completed" and len(upstream.records) == 6  # the refused reached no model
    await settled(edge, node.agent)


def test_one_key_cannot_push_out_every_other_keys_items():
    """When the kept items fill their budget, a key holding more than its share loses its own
    oldest items, not another key's."""
    kept = ResponseItems(max_bytes=4000, ttl_s=60.0)

    def item(n: int) -> dict:
        return {"id": f"msg_{n}", "type": "message", "role": "assistant", "content": "x" * 300}

    kept.keep("a", [item(n) for n in range(2)])  # under a quarter of the budget
    for n in range(2, 40):  # another key, ten times over the whole budget
        kept.keep("b", [item(n)])
    assert all(kept.get("a", f"msg_{n}") == item(n) for n in range(2))
    assert kept.get("b", "msg_39") == item(39) and kept.get("b", "msg_2") is None
    assert kept.size <= 4000


def test_kept_items_are_bounded_in_size_and_time():
    """The kept items stay under their byte budget (the least recently used leave first) and leave
    after their time."""
    now = [0.0]
    kept = ResponseItems(max_bytes=1300, ttl_s=60.0, clock=lambda: now[0])
    item = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "x" * 300}],
    }
    kept.keep("k", [item, {**item, "id": "msg_2"}])
    assert kept.get("k", "msg_1") == item and kept.get("j", "msg_1") is None
    kept.keep("k", [{**item, "id": "msg_3"}, {**item, "id": "msg_4"}])  # 4 of ~395 bytes: msg_2 leaves, not msg_1
    assert kept.size <= 1300 and kept.get("k", "msg_2") is None and kept.get("k", "msg_1") == item
    now[0] = 59.0
    assert kept.get("k", "msg_4") is not None  # used: another 60 s
    now[0] = 61.0
    assert kept.get("k", "msg_1") is None and kept.get("k", "msg_4") is not None
    # A reasoning item is never sent upstream again: its id is kept, not its text.
    kept.keep("k", [{"id": "rs_1", "type": "reasoning", "content": [{"type": "reasoning_text", "text": "y" * 5000}]}])
    assert kept.get("k", "rs_1") == {"id": "rs_1", "type": "reasoning"} and kept.size <= 1300


async def test_errors_before_and_after_the_stream_starts(nursery, upstream):
    """A run failing before its first event is an HTTP error in the OpenAI shape; one failing
    after the stream started ends it with `response.failed` carrying the error, and the text it
    streamed: its message `incomplete` in the failed response's output (the output was empty, and
    a client rebuilding the answer from it lost the text it had shown), with no `.done` events of
    its own before a failure Codex retries (it kept the cut-off text in its history, as the
    model's answer, and sent it back)."""
    edge = await start_edge(nursery, edge_config(wait_timeout_s=0.5))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    upstream.script_for("t", [("status", 500, b'{"error": {"message": "model crashed"}}')])
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            with pytest.raises(openai.APIStatusError) as caught:
                await client.responses.create(model="m", input="hi", stream=True)
            assert caught.value.status_code == 502
            upstream.script_for("t", [("chunk", {"content": "tok0 "}), ("hang",)])
            events = [e async for e in await client.responses.create(model="m", input="hi", stream=True)]
    check_sequence(events)
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.message == "run timed out"
    assert events[-1].response.error.code == "server_error"  # (Codex retries it)
    assert not [e for e in events if e.type.endswith(".done")]
    (message,) = events[-1].response.output
    assert message.status == "incomplete" and message.content[0].text == "tok0 "
    await settled(edge, node.agent)


async def test_invalid_tool_calls_fail_the_stream(edge_up):
    """Tool calls that fail validation on every attempt end a started stream with `response.failed`
    (and a whole response with a 502), after the retries the chat path makes."""
    edge, upstream = edge_up
    upstream.script_for("t", steps(*native_call("call_1", "nope", "{}"), finish="tool_calls"))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            events = [
                e async for e in await client.responses.create(model="m", input="hi", tools=[WEATHER], stream=True)
            ]
            with pytest.raises(openai.APIStatusError) as caught:
                await client.responses.create(model="m", input="hi", tools=[WEATHER])
    check_sequence(events)
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "invalid_prompt"  # OpenAI's
    assert "not one of the request's tools" in events[-1].response.error.message
    assert caught.value.status_code == 502
    assert len(upstream.records) == 4  # two attempts each


# -- cancellation -------------------------------------------------------------------------


async def read_then_leave(edge, upstream, *, deltas: int) -> list[dict]:
    """Stream, read text holding `deltas` of the upstream's deltas (after the opening events;
    the edge may join them), wait for the upstream to have the request, then close the connection."""
    seen: list[dict] = []
    body = {"model": "m", "input": "hi", "stream": True}
    async with http(edge) as client, client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        with trio.CancelScope() as reading:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                seen.append(msgspec.json.decode(line[6:]))
                text = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")
                if text.count("tok") >= deltas and len(seen) >= 2:
                    await upstream.wait_requests(1)
                    reading.cancel()
    return seen


@pytest.mark.parametrize("deltas", [0, 2], ids=["before_first_token", "mid_stream"])
async def test_client_gone_aborts_upstream(edge_up, deltas):
    """A client that leaves before the first token (after the keep-alive commit) or mid-stream
    cancels the run: the upstream sees its request aborted."""
    edge, upstream = edge_up
    upstream.script_for("t", [*(("chunk", {"content": t}) for t in words(deltas)), ("hang",)])
    with trio.fail_after(BOUND):
        seen = await read_then_leave(edge, upstream, deltas=deltas)
        (rec,) = await upstream.wait_requests(1)
        await rec.finished.wait()
    assert seen[0]["type"] == "response.created"
    assert rec.aborted


# -- the codec ----------------------------------------------------------------------------


def test_decode_maps_items_and_options():
    """The decoder, without I/O: items, tool choice, text format, reasoning, hosted tools."""
    d = decode_request(
        {
            "model": "m",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "input_image", "image_url": "data:image/png;base64,x"},
                    ],
                },
                {"type": "reasoning", "summary": []},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "b"}, {"type": "output_text", "text": "c"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [
                        {"type": "input_text", "text": "Temp: 18C."},
                        {"type": "input_text", "text": "Sky: sun."},
                    ],
                },
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_image", "image_url": "https://x/a.png"}],
                },
                {"type": "web_search_call", "id": "ws_1"},
            ],
            "tools": [{"type": "function", "name": "f"}, {"type": "web_search"}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}, "strict": True}},
            "reasoning": {"summary": "detailed"},
            "unknown_field": 1,
        }
    )
    chat = d.chat
    assert chat["messages"][0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,x"}},
    ]
    assert chat["messages"][1]["content"] == "b\nc"  # parts a line apart ("Temp: 18C.Sky: sun." before)
    assert [c["id"] for c in chat["messages"][1]["tool_calls"]] == ["c1", "c2"]
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "Temp: 18C.\nSky: sun."}
    assert chat["messages"][3]["content"] == "[image: in the user message after the tool results]"
    assert chat["messages"][4] == {  # (a chat tool message carries text only: a vision model sees it here)
        "role": "user",
        "content": [
            {"type": "text", "text": "[images of the tool result c2]"},
            {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
        ],
    }
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"]["name"] == "s"
    assert chat["include_reasoning"] is True and "unknown_field" not in chat
    assert d.ignored_tools == ["web_search"] and d.ignored_items == ["web_search_call"]


async def test_bad_input_is_a_400_naming_the_field(edge_up):
    """A malformed input item is a 400 in the OpenAI shape naming the Responses field."""
    edge, _ = edge_up
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/responses", json={"model": "m", "input": [{"role": "robot", "content": "x"}]})
            empty = await client.post("/v1/responses", json={"model": "m", "input": []})
            # an integer past 64 bits in a field the edge does not read (it was a 200: an outside audit)
            huge = await client.post("/v1/responses", json={"model": "m", "input": "hi", "zz": 2**64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0]"
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "integer_out_of_range", huge.text
    assert isinstance(r, httpx.Response)


async def test_values_openai_refuses_are_400s_naming_them(edge_up):
    """Each was a 200 (found from outside): a reasoning effort or summary of no known value (a
    summary of any value showed reasoning), a tool of no type (left out as a hosted tool), and
    an input item of no type and no role or of a type that is not a string (dropped from the
    prompt, the request served). A hosted tool's type, and an unknown item type, still pass."""
    edge, upstream = edge_up
    user = {"role": "user", "content": "hi"}
    refused = [
        ({"reasoning": {"effort": "banana"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "banana"}}, "reasoning.summary"),
        ({"reasoning": {"summary": 5}}, "reasoning.summary"),
        ({"tools": [{}]}, "tools[0].type"),
        ({"tools": [{"type": 7}]}, "tools[0].type"),
        ({"input": [{}, user]}, "input[0].type"),
        ({"input": [user, {"type": 7}]}, "input[1].type"),
        ({"input": [user, {"type": ["message"]}]}, "input[1].type"),
    ]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for body, param in refused:
                r = await client.post("/v1/responses", json={"model": "m", "input": [user], **body})
                assert r.status_code == 400, (body, r.text)
                assert r.json()["error"]["param"] == param, (body, r.text)
            assert not upstream.records
            fine = {
                "input": [user, {"type": "some_new_item"}],
                "tools": [{"type": "web_search"}],
                "reasoning": {"effort": "xhigh", "summary": "detailed"},
            }
            ok = await client.post("/v1/responses", json={"model": "m", **fine})
            # (every effort the openai SDK lists, "max" too: a re-check found it refused)
            efforts = [
                await client.post("/v1/responses", json={"model": "m", "input": [user], "reasoning": {"effort": e}})
                for e in ("none", "minimal", "low", "medium", "high", "xhigh", "max")
            ]
    assert ok.status_code == 200, ok.text
    assert [r.status_code for r in efforts] == [200] * 7, [r.text for r in efforts if r.status_code != 200]


# -- the real Codex CLI -------------------------------------------------------------------


def codex_script(body: dict) -> list:
    """A scripted model for Codex: asked to write out.txt, it reasons, then calls Codex's own shell
    tool; asked to add, it calls the MCP server's `add`; once a tool result is back it answers
    (with the result); anything else gets a greeting."""
    results = [m for m in body["messages"] if m["role"] == "tool"]
    if results:
        return steps({"content": f"All done: file written. Result {results[-1]['content']}."})
    user = [m for m in body["messages"] if m["role"] == "user"]
    tools = [t["function"]["name"] for t in body.get("tools") or ()]
    if user and "Add 2 and 3" in msgspec.json.encode(user[-1]).decode() and "mcp__demo__add" in tools:
        return steps(*native_call("call_mcp", "mcp__demo__add", '{"a": 2, "b": 3}'), finish="tool_calls")
    shell = next((name for name in tools if name in ("exec_command", "shell")), None)
    if not (user and "out.txt" in msgspec.json.encode(user[-1]).decode() and shell):
        return steps({"content": "Hello from "}, {"content": "the edge."})
    args = (
        {"cmd": "echo hi-from-iop > out.txt"}
        if shell == "exec_command"
        else {"command": ["bash", "-lc", "echo hi-from-iop > out.txt"]}
    )
    script = steps(
        {"reasoning_content": "I will write the file."},
        *native_call("call_codex", shell, msgspec.json.encode(args).decode()),
        finish="tool_calls",
    )
    if "Slowly" in msgspec.json.encode(user[-1]).decode():  # a model that thinks 2.5 s before its call
        script.insert(1, ("sleep", 2.5))
    return script


async def run_codex(edge_up, tmp_path, prompt: str, provider: str = "", config: str = "", top: str = "", script=None):
    """`codex exec` (the binary of tests/js, or IOP_CODEX) with the `[model_providers.iop]` entry of
    the README (wire_api = "responses") in a throwaway CODEX_HOME, analytics and update checks off,
    approvals and sandbox bypassed, inside `unshare -rn` (tests/agents.py): loopback only. ``top``:
    more top-level keys; ``script``: the model's (:func:`codex_script` if None)."""
    codex = require_agent("codex", "IOP_CODEX")
    edge, upstream = edge_up
    upstream.script_for("t", script or codex_script)
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    (home / ".codex" / "config.toml").write_text(
        f"""model = "m"
model_provider = "iop"
model_reasoning_summary = "auto"
check_for_update_on_startup = false
{top}
[analytics]
enabled = false

[model_providers.iop]
name = "iop"
base_url = "{edge.url}/v1"
wire_api = "responses"
env_key = "IOP_API_KEY"
{provider}{config}"""
    )
    env = quiet_env(home, CODEX_HOME=str(home / ".codex"), IOP_API_KEY="unused", RUST_LOG="error")
    argv = [codex, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    with trio.fail_after(45):
        done = await run_offline(
            [*argv, "-C", str(work), "--color", "never", prompt], port=edge.port, env=env, cwd=work
        )
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert upstream.records and all(r.body["model"] == "t" for r in upstream.records)
    return done, work, upstream


async def test_codex_cli_answers_through_the_edge(edge_up, tmp_path):
    """A plain prompt: `codex exec` prints the model's answer."""
    done, _, _ = await run_codex(edge_up, tmp_path, "Say hello.")
    assert "Hello from the edge." in done.stdout


async def test_codex_cli_runs_a_tool_through_the_edge(edge_up, tmp_path):
    """A tool round trip: Codex streams a reasoning summary and a function call to its own shell
    tool from the edge, runs the command (the file appears), sends its output back as
    `function_call_output` (a tool message upstream), and prints the final answer."""
    done, work, upstream = await run_codex(edge_up, tmp_path, "Write hi-from-iop to out.txt.")
    assert "All done: file written." in done.stdout
    assert "I will write the file." in done.stderr  # the reasoning summary, shown
    assert (work / "out.txt").read_text() == "hi-from-iop\n"
    second = upstream.records[-1].body["messages"]
    assert second[-2]["tool_calls"][0]["id"] == "call_codex"
    assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == "call_codex"


async def test_codex_waits_through_a_long_collected_turn(edge_up, tmp_path):
    """Codex's tools make its streams collected (validated before the client sees them), and its
    idle timer counts SSE events, not comments: the edge's keep-alive on /v1/responses is a
    `response.in_progress` event. With a 1 s idle timeout and no retries, a model that thinks
    2.5 s before its call still gets its tool run (before: "idle timeout waiting for SSE", and
    with the default 300 s, a turn that long failed after five retries of the whole generation)."""
    provider = "stream_idle_timeout_ms = 1000\nstream_max_retries = 0\n"
    done, work, upstream = await run_codex(edge_up, tmp_path, "Slowly write hi-from-iop to out.txt.", provider)
    assert "All done: file written." in done.stdout
    assert (work / "out.txt").read_text() == "hi-from-iop\n"
    assert len(upstream.records) == 2  # the call, then the answer: no retry


def filling_script(body: dict) -> list:
    """A model whose every turn runs Codex's shell on a command that prints 25 KB (about 6,000
    tokens), six times, then answers; asked for Codex's compaction, it gives a summary, and
    given it back, answers."""
    user = [m for m in body["messages"] if m["role"] == "user"]
    if "CONTEXT CHECKPOINT COMPACTION" in msgspec.json.encode(user[-1:]).decode():
        return steps({"content": "SUMMARY: outputs of words asked for; keep going."})
    if "SUMMARY: outputs of words" in msgspec.json.encode(user).decode():
        return steps({"content": "Filled after a compaction."})
    results = [m for m in body["messages"] if m["role"] == "tool"]
    tools = [t["function"]["name"] for t in body.get("tools") or ()]
    shell = next((name for name in tools if name in ("exec_command", "shell")), None)
    if len(results) >= 6 or shell is None:
        return steps({"content": f"Filled after {len(results)} outputs."})
    command = "python3 -c \"print('word ' * 5000)\""
    args = {"cmd": command} if shell == "exec_command" else {"command": ["bash", "-lc", command]}
    return steps(*native_call(f"call_{len(results)}", shell, msgspec.json.encode(args).decode()), finish="tool_calls")


async def test_codex_compacts_on_a_model_with_a_small_context(nursery, upstream, tmp_path):
    """A model served with a 24k context (the node's `context_window`): Codex does not read the
    window the edge lists in /v1/models, and with the README's config as it was, its session
    ended when its history outgrew it ("Codex ran out of room in the model's context window",
    on the edge's 400 `context_length_exceeded`: an outside audit). With `model_context_window`
    set as the README now says, Codex compacts its history and carries on to the answer."""
    edge = await start_edge(nursery, edge_config(keepalive_s=0.2))
    node = await start_node(nursery, edge, [model("m", upstream, target="t", context_window=24_000)])
    done, _, upstream = await run_codex(
        (edge, upstream), tmp_path, "FILL the context.", top="model_context_window = 24000\n", script=filling_script
    )
    assert "Filled after a compaction." in done.stdout, (done.stdout, done.stderr[-2000:])
    await settled(edge, node.agent)


async def test_keep_alives_are_in_progress_events(edge_up):
    """While a tool stream is collected, the keep-alive is an SSE comment (issue 11: "Keep-alives
    are SSE comments") and a `response.in_progress` event (sequence numbers continuous, which
    the SDK takes as it takes the first; Codex's idle timer counts only events)."""
    edge, upstream = edge_up
    call = steps(*native_call("c1", "get_weather", '{"city": "Oslo"}'), finish="tool_calls")
    upstream.script_for("t", [("sleep", 0.9), *call])
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            events = [
                e async for e in await client.responses.create(model="m", input="hi", tools=[WEATHER], stream=True)
            ]
    check_sequence(events)
    kinds = [e.type for e in events]
    assert kinds.count("response.in_progress") >= 3, kinds  # the opening's, then one each 0.2 s
    assert all(e.response.status == "in_progress" for e in events if e.type == "response.in_progress")
    assert events[-1].type == "response.completed" and events[-1].response.output[0].name == "get_weather"
    upstream.script_for("t", [("sleep", 0.5), *call])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            body = {"model": "m", "input": "hi", "tools": [WEATHER], "stream": True}
            raw = (await client.post("/v1/responses", json=body)).content
    assert raw.count(b": keep-alive\n\nevent: response.in_progress\n") >= 2, raw[:600]


def test_decode_moves_every_developer_message_first_and_checks_calls():
    """Developer messages anywhere join the one leading system message (chat templates take a
    system message only first: Codex sends one mid-conversation when its sandbox changes); a call
    without its output, or an output without its call, is a 400 as on OpenAI."""
    d = decode_request(
        {
            "model": "m",
            "instructions": "I",
            "input": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "developer", "content": "d"},
                {"role": "user", "content": "c"},
            ],
        }
    )
    assert d.chat["messages"] == [
        {"role": "system", "content": "I\n\nd"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c9", "output": "x"}
    for items, message in (
        ([{"role": "user", "content": "a"}, call], "No tool output found for function call c1."),
        ([{"role": "user", "content": "a"}, output], "No tool call found for function call output with call_id c9."),
    ):
        with pytest.raises(APIError) as caught:
            decode_request({"model": "m", "input": items})
        assert caught.value.message == message and caught.value.status == 400


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("tool_choice", "sometimes", "tool_choice"),
        ("tool_choice", {"type": "function"}, "tool_choice.name"),
        ("stream", "yes", "stream"),
        ("metadata", "str", "metadata"),
        ("parallel_tool_calls", "no", "parallel_tool_calls"),
        ("text", {"format": {"type": "bogus"}}, "text.format.type"),
        ("text", {"format": {"type": "json_schema", "schema": {"type": "object"}}}, "text.format.name"),
        ("text", {"format": {"type": "json_schema", "name": "a b", "schema": {}}}, "text.format.name"),
        ("text", {"format": {"type": "json_schema", "name": "x"}}, "text.format.schema"),
        ("text", {"format": {"type": "json_schema", "name": "x", "schema": "{}"}}, "text.format.schema"),
        ("reasoning", "high", "reasoning"),
        ("background", True, "background"),
        ("service_tier", "bogus", "service_tier"),
        ("prompt_cache_key", 123, "prompt_cache_key"),
        ("safety_identifier", ["x"], "safety_identifier"),
    ],
)
def test_decode_refuses_what_openai_refuses(field, value, param):
    """A field of the wrong type or value is a 400 naming it (these were ignored, echoed or
    forwarded as they came; `background` needs a stored response)."""
    with pytest.raises(APIError) as caught:
        decode_request({"model": "m", "input": "hi", "tools": [WEATHER], field: value})
    assert caught.value.status == 400 and caught.value.param == param


def test_a_json_schema_format_names_what_its_schema_lacks():
    """No schema is a missing parameter; one of another type is said as OpenAI says it."""
    text = {"format": {"type": "json_schema", "name": "x"}}
    for schema, message in (
        (None, "Missing required parameter: `text.format.schema`."),
        ([], "Invalid type for `text.format.schema`: expected an object, but got an array instead."),
        ("{}", "Invalid type for `text.format.schema`: expected an object, but got a string instead."),
    ):
        with pytest.raises(APIError) as caught:
            decode_request({"model": "m", "input": "hi", "text": {"format": {**text["format"], "schema": schema}}})
        assert (caught.value.message, caught.value.param) == (message, "text.format.schema")


async def test_one_call_when_parallel_calls_are_off(edge_up):
    """`parallel_tool_calls: false` means at most one call, as OpenAI promises: a model that makes
    two anyway returns the first."""
    edge, upstream = edge_up
    rome = '{"city": "Rome"}'
    second = {"index": 1, "id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": rome}}
    two = steps(*native_call("c1", "get_weather", '{"city": "Oslo"}'), {"tool_calls": [second]}, finish="tool_calls")
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            upstream.script_for("t", two)
            both = await client.responses.create(model="m", input="hi", tools=[WEATHER])
            upstream.script_for("t", two)
            one = await client.responses.create(model="m", input="hi", tools=[WEATHER], parallel_tool_calls=False)
    assert [item.call_id for item in both.output] == ["c1", "c2"]
    assert [item.call_id for item in one.output] == ["c1"]


async def test_an_empty_answer_is_one_empty_message_streamed_or_whole(edge_up):
    """A model that says nothing: the whole response had one empty message, the live stream
    none; both have the one empty message now."""
    edge, upstream = edge_up
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            upstream.script_for("t", steps())
            whole = await client.responses.create(model="m", input="hi")
            upstream.script_for("t", steps())
            events = [e async for e in await client.responses.create(model="m", input="hi", stream=True)]
    check_sequence(events)
    streamed = events[-1].response
    for response in (whole, streamed):
        assert [(item.type, item.content[0].text) for item in response.output] == [("message", "")]


async def test_codex_calls_an_mcp_servers_tool_through_the_edge(edge_up, tmp_path):
    """Codex sends an MCP server's tools as a `namespace` tool (`mcp__demo` with `add` inside),
    which the edge left out: the model never saw them. They reach it as `mcp__demo__add`; its
    call goes back as `namespace: mcp__demo, name: add`, Codex runs it on the server, and the
    result comes back as a tool message."""
    server = Path(__file__).with_name("mcp_add.py")
    extra = f'\n[mcp_servers.demo]\ncommand = "{sys.executable}"\nargs = ["{server}"]\n'
    done, _, upstream = await run_codex(edge_up, tmp_path, "Add 2 and 3 with the demo tool.", config=extra)
    first = upstream.records[0].body
    assert "mcp__demo__add" in [t["function"]["name"] for t in first["tools"]]
    second = upstream.records[-1].body["messages"]
    assert second[-2]["tool_calls"][0]["function"]["name"] == "mcp__demo__add"  # as it went out
    assert second[-1]["role"] == "tool" and second[-1]["content"].strip().endswith("5"), second[-1]
    assert "Result" in done.stdout


async def test_a_function_outputs_images_reach_the_model_after_the_outputs(edge_up):
    """A function output with an image: a chat tool message carries text only, so the image
    reached the model as "[image omitted]" (an outside audit). It now goes in a user message
    after the outputs, which the next user message joins; an image in a developer message,
    dropped without a word before, is a note in its text."""
    edge, upstream = edge_up
    url = "data:image/png;base64,iVBORw0KGgo="
    upstream.script_for("t", steps({"content": "A pixel."}))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            reply = await client.responses.create(
                model="m",
                input=[
                    {
                        "role": "developer",
                        "content": [{"type": "input_text", "text": "dev"}, {"type": "input_image", "image_url": url}],
                    },
                    {"role": "user", "content": "Look."},
                    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                    {
                        "type": "function_call_output",
                        "call_id": "c1",
                        "output": [
                            {"type": "input_text", "text": "shot"},
                            {"type": "input_image", "image_url": url, "detail": "low"},
                        ],
                    },
                    {"role": "user", "content": [{"type": "input_text", "text": "What is it?"}]},
                ],
                tools=[WEATHER],
            )
    assert reply.output_text == "A pixel."
    sent = upstream.records[-1].body["messages"]
    assert sent[0] == {"role": "system", "content": "dev\n[image omitted: a system message carries text only]"}
    assert sent[3] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": "shot\n[image: in the user message after the tool results]",
    }
    assert sent[4] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "[images of the tool result c1]"},
            {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
            {"type": "text", "text": "What is it?"},
        ],
    }
    assert len(sent) == 5


async def test_an_inline_input_file_reaches_the_model_as_chats_file_part(edge_up):
    """An `input_file` given inline (`file_data`: the Vercel AI SDK's PDF file part) was a 400
    on the Responses API while chat's `file` part and a Messages `document` were taken. It
    reaches the model server as chat's own `file` part; one by `file_id` is still a 400 (the
    edge keeps no files)."""
    edge, upstream = edge_up
    pdf = "data:application/pdf;base64,JVBERi0xLjQK"
    upstream.script_for("t", steps({"content": "A letter."}))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            reply = await client.responses.create(
                model="m",
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is it?"},
                            {"type": "input_file", "file_data": pdf, "filename": "a.pdf"},
                        ],
                    }
                ],
            )
            with pytest.raises(openai.BadRequestError, match="input_file"):
                await client.responses.create(
                    model="m",
                    input=[{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}],
                )
    assert reply.output_text == "A letter."
    assert upstream.records[-1].body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is it?"},
                {"type": "file", "file": {"file_data": pdf, "filename": "a.pdf"}},
            ],
        }
    ]
    assert len(upstream.records) == 1
