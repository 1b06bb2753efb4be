"""POST /v1/messages (the Anthropic Messages API), with the official anthropic SDK as the client:
text, thinking and tool-use streams, whole messages, a tool round trip, count_tokens, x-api-key,
errors in Anthropic's shape, and cancellation reaching the upstream."""

from __future__ import annotations

import os

import anthropic
import msgspec
import openai
import pytest
import structlog
import trio

from edge.anthropic.codec import MessageStream, chat_body, error_body, session_id, stream_error
from edge.errors import APIError
from edge.openai.schema import UsageOut
from proto import ToolCall
from proto.frames import ToolCallFunction
from scripts.upstream import native_call, steps, words
from tests.agents import quiet_env, require_agent, run_offline
from tests.conftest import BOUND, edge_config, eventually, http, model, settled, start_edge, start_node

USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
F_TOOL = {"name": "f", "input_schema": {"type": "object"}}
USAGE = {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}


def client_for(edge, **kw) -> anthropic.AsyncAnthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.AsyncAnthropic(base_url=edge.url, max_retries=0, timeout=BOUND, **kw)


@pytest.fixture
async def setup(nursery, upstream):
    edge = await start_edge(nursery, edge_config())
    node = await start_node(nursery, edge, [model("m", upstream, target="t", max_concurrency=4)])
    yield edge, upstream
    await settled(edge, node.agent)


# -- the codec, without I/O -------------------------------------------------------------


@pytest.mark.parametrize(
    ("system", "sent"),
    [
        # Claude Code's billing line, alone in its block: no system message is left to send
        ([{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.1c0; cc_entrypoint=cli;"}], None),
        ("x-anthropic-billing-header: cc_version=2.1.197.1c0;\n\nBe brief.", "Be brief."),
        # the same written with CRLF, a space or tab at its end, or no ";" after its last field
        ("x-anthropic-billing-header: cc_version=2.1.197.1c0; a=b;\r\nBe brief.", "Be brief."),
        ("x-anthropic-billing-header: cc_version=2.1.197.1c0; \t\nBe brief.", "Be brief."),
        ("x-anthropic-billing-header: cc_version=2.1.197.1c0; cc_entrypoint=cli\nBe brief.", "Be brief."),
        # a line that starts so but is not the header's fields is the client's system text, kept
        ("x-anthropic-billing-header: cc_version=1; Be brief.", "x-anthropic-billing-header: cc_version=1; Be brief."),
        # and so is one that is not first
        (
            [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "x-anthropic-billing-header: a=1;"}],
            "Be brief.\n\nx-anthropic-billing-header: a=1;",
        ),
    ],
    ids=[
        "block-alone",
        "string-first-line",
        "crlf",
        "trailing-blank",
        "no-last-semicolon",
        "not-the-header",
        "not-first",
    ],
)
def test_decoder_leaves_out_only_claude_codes_billing_line(system, sent):
    body, _ = chat_body(
        {"model": "m", "max_tokens": 10, "system": system, "messages": [{"role": "user", "content": "hi"}]}
    )
    if sent is None:
        assert body["messages"][0]["role"] == "user"
    else:
        assert body["messages"][0] == {"role": "system", "content": sent}


def test_decoder_maps_claude_code_requests_to_chat():
    """System text (string, blocks, and role=system entries; Claude Code's billing line left out),
    images, tool_use / tool_result
    history, thinking history, tools (server tools left out), tool_choice, stop_sequences,
    top_k, metadata.user_id and unknown top-level fields."""
    raw = {
        "model": "m",
        "max_tokens": 100,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.1c0; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "system", "content": "Extra system text."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA="}},
                    {"type": "image", "source": {"type": "url", "url": "https://example.invalid/a.png"}},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                    {"type": "text", "text": "and tomorrow?"},
                ],
            },
        ],
        "tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},  # (any or tool: not with thinking)
        "stop_sequences": ["END"],
        "top_k": 20,
        "temperature": 0.5,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "metadata": {"user_id": "session-1"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": []},
        "stream": True,
    }
    body, server = chat_body(raw)
    assert server == ["web_search"]
    assert body["messages"] == [
        {"role": "system", "content": "You are Claude Code.\n\nExtra system text."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA="}},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "[tool error] boom"},
        {"role": "user", "content": [{"type": "text", "text": "and tomorrow?"}]},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": WEATHER["description"],
            },
        }
    ]
    assert body["tool_choice"] == "auto" and body["parallel_tool_calls"] is False
    assert body["stop"] == ["END"] and body["top_k"] == 20 and body["temperature"] == 0.5
    assert body["include_reasoning"] is True and body["stream"] is True
    assert "user" not in body and session_id(raw) == "session-1"  # (the session, not sent upstream)
    assert "output_config" not in body and "context_management" not in body
    named, _ = chat_body({**raw, "tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": None})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert named["include_reasoning"] is False
    anyone, _ = chat_body({**raw, "tool_choice": {"type": "any"}, "thinking": None})
    assert anyone["tool_choice"] == "required"


def test_decoder_rejects_what_it_cannot_read():
    """A wrong shape is a 400 that names the place."""
    for raw, where in [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]"),
        ({"model": "m", "messages": USER, "tools": [{"name": "f"}]}, "tools[0]"),
        ({"model": "m", "messages": USER, "tools": [WEATHER], "tool_choice": {"type": "x"}}, "tool_choice"),
    ]:
        with pytest.raises(APIError) as caught:
            chat_body(raw)
        assert caught.value.status == 400 and where in caught.value.message


def test_stream_encoder_blocks_and_errors():
    """Thinking and text pieces share a block until the kind changes; a thinking block ends with
    its signature (empty: as Anthropic's always do); a tool call is one whole block; the end
    closes the open block; errors have Anthropic's shape and type by status."""
    enc = MessageStream("msg_1", "m")
    raw = b"".join(
        [
            enc.start(7),
            enc.thinking("a"),
            enc.thinking("b"),
            enc.text("c"),
            enc.tool_use(ToolCall(id="call_9", function=ToolCallFunction(name="f", arguments='{"x":1}'))),
            enc.finish("tool_calls", UsageOut(7, 3, 10)),
        ]
    )
    events = [block.split(b"\n", 1) for block in raw.strip().split(b"\n\n")]
    names = [e[0].removeprefix(b"event: ").decode() for e in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    data = [msgspec.json.decode(e[1].removeprefix(b"data: ")) for e in events]
    assert data[4] == {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": ""}}
    assert data[9]["content_block"] == {"type": "tool_use", "id": "toolu_call_9", "name": "f", "input": {}}
    assert data[12]["delta"]["stop_reason"] == "tool_use" and data[12]["usage"]["output_tokens"] == 3
    assert msgspec.json.decode(error_body(APIError(429, "slow down"))) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    assert msgspec.json.decode(error_body(APIError(504, "late")))["error"]["type"] == "timeout_error"
    assert msgspec.json.decode(error_body(APIError(502, "bad")))["error"]["type"] == "api_error"
    assert stream_error("gone", "run_error").startswith(b"event: error\ndata: ")


# -- the SDK against a real edge ---------------------------------------------------------


async def test_messages_create_returns_a_text_message(setup):
    """messages.create: one message with a text block, end_turn and the upstream's usage; the upstream
    gets the system text first, stop_sequences as stop, top_k and max_tokens."""
    edge, upstream = setup
    upstream.script_for("t", steps({"content": "Hello "}, {"content": "world"}, usage=USAGE))
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            message = await client.messages.create(
                model="m",
                max_tokens=64,
                system="Be brief.",
                messages=USER,
                stop_sequences=["END"],
                extra_body={"top_k": 5},
            )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == "Hello world"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (30, 3)
    sent = upstream.records[0].body
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert sent["stop"] == ["END"] and sent["top_k"] == 5 and sent["max_tokens"] == 64


async def test_messages_stream_text(setup):
    """messages.stream: message_start, one text block, message_delta and message_stop, parsed by the SDK."""
    edge, upstream = setup
    upstream.script_for("t", steps({"content": "Hello "}, {"content": "world"}, usage=USAGE))
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            async with client.messages.stream(model="m", max_tokens=64, messages=USER) as stream:
                types = [event.type async for event in stream]
                final = await stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert "content_block_start" in types and "message_delta" in types
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == "Hello world"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3 and final.usage.input_tokens == 30


async def test_messages_stream_with_thinking(setup):
    """thinking enabled: the upstream's reasoning_content is a thinking block before the text;
    without `thinking` the reasoning stays hidden."""
    edge, upstream = setup
    upstream.script_for(
        "t", steps({"reasoning_content": "let me "}, {"reasoning_content": "think"}, {"content": "It is sunny."})
    )
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            async with client.messages.stream(
                model="m", max_tokens=2048, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024}
            ) as stream:
                events = [e async for e in stream]
                final = await stream.get_final_message()
            async with client.messages.stream(model="m", max_tokens=2048, messages=USER) as stream:
                hidden = await stream.get_final_message()
    assert "".join(e.thinking for e in events if e.type == "thinking") == "let me think"
    assert [e.signature for e in events if e.type == "signature"] == [""]  # (before the block's stop)
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "let me think" and final.content[1].text == "It is sunny."
    assert [b.type for b in hidden.content] == ["text"] and hidden.content[0].text == "It is sunny."


async def test_a_reasoning_only_answer_is_a_thinking_block_alone_when_thinking_is_shown(setup):
    """A run that ends with reasoning and no answer, `thinking` on: the reasoning is its thinking
    block, and no text block repeats it (as Anthropic answers a max_tokens reached while thinking;
    it showed twice, an outside audit). With thinking hidden the text is the edge's notice."""
    edge, upstream = setup
    for finish in ("stop", "length"):
        upstream.script_for("t", steps({"reasoning_content": "let me "}, {"reasoning_content": "think"}, finish=finish))
        with trio.fail_after(BOUND):
            async with client_for(edge) as client:
                thinking = {"type": "enabled", "budget_tokens": 1024}
                async with client.messages.stream(
                    model="m", max_tokens=2048, messages=USER, thinking=thinking
                ) as stream:
                    streamed = await stream.get_final_message()
                whole = await client.messages.create(model="m", max_tokens=2048, messages=USER, thinking=thinking)
                hidden = await client.messages.create(model="m", max_tokens=2048, messages=USER)
        for message in (streamed, whole):
            assert [b.type for b in message.content] == ["thinking"], message.content
            assert message.content[0].thinking == "let me think"
            assert message.stop_reason == ("end_turn" if finish == "stop" else "max_tokens")
        assert [b.type for b in hidden.content] == ["text"]
        assert hidden.content[0].text.startswith("The model produced only hidden reasoning and no answer")


async def test_messages_stream_with_tool_use(setup):
    """A native tool call from the upstream is a tool_use block (toolu_ id, parsed input) and
    stop_reason tool_use, streamed (buffered and validated) and whole."""
    edge, upstream = setup
    upstream.script_for("t", steps(*native_call("call_1", "get_weather", '{"city": "Paris"}'), finish="tool_calls"))
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            async with client.messages.stream(model="m", max_tokens=256, messages=USER, tools=[WEATHER]) as stream:
                final = await stream.get_final_message()
            whole = await client.messages.create(model="m", max_tokens=256, messages=USER, tools=[WEATHER])
    for message in (final, whole):
        (block,) = message.content
        assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
        assert block.id == "toolu_call_1"
        assert message.stop_reason == "tool_use"
    sent = upstream.records[0].body
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert sent["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]


async def test_a_call_of_a_tool_no_request_offered_never_reaches_the_client(setup):
    """A model server that returns a native tool call when the request declared no tools: the
    call is dropped on all three APIs, streamed and whole, and the answer ends as text does
    (a model server's unasked ``rm_rf`` reached clients as a call: an outside audit). The
    text before it is kept."""
    edge, upstream = setup
    call = steps({"content": "Sure."}, *native_call("call_9", "rm_rf", '{"path": "/"}'), finish="tool_calls")
    upstream.script_for("t", call)
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            async with client.messages.stream(model="m", max_tokens=64, messages=USER) as stream:
                streamed = await stream.get_final_message()
            whole = await client.messages.create(model="m", max_tokens=64, messages=USER)
        for message in (streamed, whole):
            assert [(b.type, b.text) for b in message.content] == [("text", "Sure.")]
            assert message.stop_reason == "end_turn"
        async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as oai:
            chunks = [c async for c in await oai.chat.completions.create(model="m", messages=USER, stream=True)]
            assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Sure."
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
            completion = await oai.chat.completions.create(model="m", messages=USER)
            choice = completion.choices[0]
            assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("Sure.", None, "stop")
            response = await oai.responses.create(model="m", input="hi")
            assert [item.type for item in response.output] == ["message"] and response.output_text == "Sure."
            async with oai.responses.stream(model="m", input="hi") as stream:
                events = [event.type async for event in stream]
            assert "response.function_call_arguments.done" not in events and events[-1] == "response.completed"
    assert len(upstream.records) == 6 and not any(r.body.get("tools") for r in upstream.records)
    # Hidden reasoning and a dropped call, no text: the notice names the end the client gets.
    thought = steps({"reasoning_content": "hmm"}, *native_call("call_9", "rm_rf", "{}"), finish="tool_calls")
    upstream.script_for("t", thought)
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            async with client.messages.stream(model="m", max_tokens=64, messages=USER) as stream:
                said = (await stream.get_final_message()).content[0].text
        async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0) as oai:
            async with oai.responses.stream(model="m", input="hi") as stream:
                answered = (await stream.get_final_response()).output_text
            # OpenAI's deprecated `functions`, forwarded as sent: the calls of their answer are kept.
            upstream.script_for("t", call)
            legacy = await oai.chat.completions.create(
                model="m", messages=USER, functions=[{"name": "rm_rf", "parameters": {"type": "object"}}]
            )
    for notice in (said, answered):
        assert notice.startswith("The model produced only hidden reasoning") and "finish_reason: stop" in notice
    assert legacy.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in legacy.choices[0].message.tool_calls] == ["rm_rf"]
    assert upstream.records[-1].body["functions"][0]["name"] == "rm_rf"


async def test_tool_round_trip(setup):
    """Turn one asks for a tool; turn two sends the tool_use back with a tool_result: the upstream
    gets the assistant's tool_calls and a tool message with the same id, and the answer is text."""
    edge, upstream = setup
    replies = iter(
        [
            steps(
                {"content": "Checking."}, *native_call("call_7", "get_weather", '{"city":"Oslo"}'), finish="tool_calls"
            ),
            steps({"content": "Snowing in Oslo."}),
        ]
    )
    upstream.script_for("t", lambda body: next(replies))
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            first = await client.messages.create(model="m", max_tokens=256, messages=USER, tools=[WEATHER])
            assert [b.type for b in first.content] == ["text", "tool_use"]
            use = first.content[1]
            history = [
                *USER,
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "snow"}]}
                    ],
                },
            ]
            async with client.messages.stream(model="m", max_tokens=256, messages=history, tools=[WEATHER]) as stream:
                second = await stream.get_final_message()
    assert second.content[0].text == "Snowing in Oslo." and second.stop_reason == "end_turn"
    sent = upstream.records[1].body["messages"]
    assert sent[1]["role"] == "assistant" and sent[1]["content"] == "Checking."
    assert sent[1]["tool_calls"][0]["id"] == use.id
    assert msgspec.json.decode(sent[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert sent[2] == {"role": "tool", "tool_call_id": use.id, "content": "snow"}


async def test_a_tool_results_images_reach_the_model_after_the_results(setup):
    """A tool result with an image (Claude Code's Read of a screenshot): a chat tool message
    carries text only, so the image went nowhere ("[image omitted]", an outside audit). The
    image now reaches the model server in a user message right after the results, named
    by its result, before the user's own words; a file-id image is a note, not a 400."""
    edge, upstream = setup
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    uploaded = {"type": "image", "source": {"type": "file", "file_id": "file_1"}}
    calls = [{"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {}} for i in (1, 2)]
    history = [
        *USER,
        {"role": "assistant", "content": calls},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a"}, shot]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [uploaded]},
                {"type": "text", "text": "What do you see?"},
            ],
        },
    ]
    upstream.script_for("t", steps({"content": "A pixel."}))
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            reply = await client.messages.create(model="m", max_tokens=64, messages=history, tools=[WEATHER])
    assert reply.content[0].text == "A pixel."
    sent = upstream.records[-1].body["messages"]
    assert sent[2] == {
        "role": "tool",
        "tool_call_id": "toolu_1",
        "content": "a\n[image: in the user message after the tool results]",
    }
    assert sent[3] == {
        "role": "tool",
        "tool_call_id": "toolu_2",
        "content": "[image omitted: this edge passes no uploaded files to the model]",
    }
    assert sent[4] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "[images of the tool result toolu_1]"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
            {"type": "text", "text": "What do you see?"},
        ],
    }
    assert len(sent) == 5


async def test_consecutive_user_turns_reach_the_model_server_as_one(setup):
    """Anthropic merges consecutive turns of one role; the edge merged assistant turns only, and
    two user turns in a row went upstream apart, which a chat template that wants the roles to
    alternate (Gemma's) refuses: a 400 for a request Anthropic answers (an outside audit)."""
    edge, upstream = setup
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    history = [
        {"role": "user", "content": "Here is a file."},
        {"role": "user", "content": [{"type": "text", "text": "Summarise it."}, shot]},
        {"role": "assistant", "content": "A pixel."},
        {"role": "user", "content": "More."},
        {"role": "user", "content": "Again."},
    ]
    upstream.script_for("t", steps({"content": "Still a pixel."}))
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            reply = await client.messages.create(model="m", max_tokens=64, messages=history)
    assert reply.content[0].text == "Still a pixel."
    assert upstream.records[-1].body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Here is a file."},
                {"type": "text", "text": "Summarise it."},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
            ],
        },
        {"role": "assistant", "content": "A pixel."},
        {"role": "user", "content": "More.\n\nAgain."},
    ]


async def test_an_image_of_a_type_anthropic_refuses_is_a_400(setup):
    """A base64 image whose media_type is none of Anthropic's four (or is missing) is a 400,
    as Anthropic answers it: "text/html" and "image/bmp" went on as data URLs (an outside audit)."""
    edge, upstream = setup
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            for media in ("text/html", "image/bmp", None):
                source = {"type": "base64", "data": "AAA=", **({"media_type": media} if media else {})}
                content = [{"type": "text", "text": "x"}, {"type": "image", "source": source}]
                with pytest.raises(anthropic.BadRequestError, match="image/jpeg, image/png, image/gif, image/webp"):
                    await client.messages.create(
                        model="m", max_tokens=8, messages=[{"role": "user", "content": content}]
                    )
    assert upstream.records == []


async def test_count_tokens(setup):
    """count_tokens answers the edge's estimate (characters / 4 + 4 per message) without a run."""
    edge, upstream = setup
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            count = await client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x" * 400}])
    assert count.input_tokens == 100 + 4
    assert upstream.records == []
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            with pytest.raises(anthropic.NotFoundError):  # as a message to that model would be
                await client.messages.count_tokens(model="nope", messages=USER)


async def test_x_api_key_auth(nursery, upstream):
    """With api_keys set, the SDK's x-api-key is accepted on /v1/messages and /v1/models; a wrong key
    is an AuthenticationError; Authorization: Bearer still works."""
    edge = await start_edge(nursery, edge_config(api_keys=["sk-edge"]))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    upstream.script_for("t", steps({"content": "ok"}))
    with trio.fail_after(BOUND):
        async with client_for(edge, api_key="sk-edge") as client:
            message = await client.messages.create(model="m", max_tokens=8, messages=USER)
            assert message.content[0].text == "ok"
        async with client_for(edge, api_key="wrong") as client:
            with pytest.raises(anthropic.AuthenticationError) as caught:
                await client.messages.create(model="m", max_tokens=8, messages=USER)
        assert caught.value.body["error"]["type"] == "authentication_error"
        async with http(edge) as c:
            assert (await c.get("/v1/models", headers={"x-api-key": "sk-edge"})).status_code == 200
            r = await c.post(
                "/v1/messages",
                json={"model": "m", "max_tokens": 8, "messages": USER},
                headers={"authorization": "Bearer sk-edge"},
            )
            assert r.status_code == 200
    await settled(edge, node.agent)


async def test_errors_have_anthropic_types(setup):
    """An unknown model is NotFoundError (not_found_error); a bad request BadRequestError
    (invalid_request_error); an upstream 500 before the first event a 502 api_error."""
    edge, upstream = setup
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            with pytest.raises(anthropic.NotFoundError) as caught:
                await client.messages.create(model="nope", max_tokens=8, messages=USER)
            assert caught.value.body == {
                "type": "error",
                "error": {"type": "not_found_error", "message": caught.value.body["error"]["message"]},
            }
            with pytest.raises(anthropic.BadRequestError) as bad:
                await client.messages.create(model="m", max_tokens=8, messages=[{"role": "tool", "content": "x"}])
            assert bad.value.body["error"]["type"] == "invalid_request_error"
            upstream.script_for("t", [("status", 500, b'{"error": {"message": "model crashed"}}')])
            with pytest.raises(anthropic.InternalServerError) as crashed:
                async with client.messages.stream(model="m", max_tokens=8, messages=USER) as stream:
                    await stream.get_final_message()
            assert crashed.value.status_code == 502 and crashed.value.body["error"]["type"] == "api_error"
            assert "model crashed" in crashed.value.body["error"]["message"]


async def test_claude_code_shaped_request_over_http(setup):
    """What Claude Code sends: ?beta=true, anthropic-version / anthropic-beta headers, system blocks with
    cache_control, a system entry in messages, a server tool, unknown top-level fields. The server tool
    is left out (and logged); the access line says api=messages."""
    edge, upstream = setup
    upstream.script_for("t", steps({"content": "done"}))
    body = {
        "model": "m",
        "max_tokens": 32,
        "stream": True,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "system", "content": "env"}, *USER],
        "tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "metadata": {"user_id": "user_abc_session_1"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}
    with trio.fail_after(BOUND), structlog.testing.capture_logs() as logs:
        async with http(edge) as c:
            r = await c.post("/v1/messages?beta=true", json=body, headers=headers)
        await eventually(lambda: any(e["event"] == "request" for e in logs))
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    assert b"event: message_stop" in r.content and b'"text":"done"' in r.content
    sent = upstream.records[0].body
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather"]
    assert sent["messages"][0] == {"role": "system", "content": "You are Claude Code.\n\nenv"}
    assert "user" not in sent  # (metadata.user_id: the session, not the model server's)
    assert any(e["event"] == "server tools left out" and e["tools"] == ["web_search"] for e in logs)
    (line,) = [e for e in logs if e["event"] == "request"]
    assert line["api"] == "messages" and line["status"] == 200 and line["route"] == "/v1/messages"


async def test_a_tool_choice_naming_a_server_tool_is_auto(setup):
    """`tool_choice` naming a server tool that `tools` lists beside model tools: the server tool is
    left out, so the choice is `auto` (it was a 400 saying the tool was not in `tools`); naming a
    model tool still forces it."""
    edge, upstream = setup
    call = steps(*native_call("call_1", "get_weather", '{"city": "Paris"}'), finish="tool_calls")
    upstream.script_for(
        "t", lambda body: call if isinstance(body.get("tool_choice"), dict) else steps({"content": "ok"})
    )
    tools = [WEATHER, {"type": "web_search_20250305", "name": "web_search"}]
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            for name in ("web_search", "get_weather"):
                await client.messages.create(
                    model="m", max_tokens=8, messages=USER, tools=tools, tool_choice={"type": "tool", "name": name}
                )
    choices = [record.body["tool_choice"] for record in upstream.records]
    assert choices == ["auto", {"type": "function", "function": {"name": "get_weather"}}]


async def test_error_after_the_stream_started_is_an_error_event(nursery, upstream):
    """A run that fails after its first event ends the stream with `event: error`; the SDK raises
    it. A run timed out is Anthropic's `timeout_error`, in the stream as in its 504 (both said
    `api_error`)."""
    edge = await start_edge(nursery, edge_config(wait_timeout_s=0.5, keepalive_s=10))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    upstream.script_for("t", [("chunk", {"content": "partial "}), ("hang",)])
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            with pytest.raises(anthropic.APIStatusError) as caught:
                async with client.messages.stream(model="m", max_tokens=8, messages=USER) as stream:
                    await stream.get_final_message()
            upstream.script_for("t", [("hang",)])
            with pytest.raises(anthropic.APIStatusError) as whole:
                await client.messages.create(model="m", max_tokens=8, messages=USER)
    assert caught.value.body == {"type": "error", "error": {"type": "timeout_error", "message": "run timed out"}}
    assert whole.value.status_code == 504 and whole.value.body["error"]["type"] == "timeout_error"
    await settled(edge, node.agent)


# -- cancellation ---------------------------------------------------------------------------
# These read with httpx, not the SDK: the SDK, left mid-stream under trio, leaves its own (and
# httpx2's) async generators suspended, which trio reports at garbage collection.

STREAM = {"model": "m", "max_tokens": 8, "messages": USER, "stream": True}


async def read_then_leave(edge, upstream, *, texts: int) -> list[dict]:
    """Stream, read events until text holding `texts` of the upstream's deltas (0: message_start
    and a ping; the edge may join deltas) has arrived
    and the upstream has the request, then close the connection."""
    seen: list[dict] = []
    async with http(edge) as client, client.stream("POST", "/v1/messages", json=STREAM) as r:
        assert r.status_code == 200
        with trio.CancelScope() as reading:
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                seen.append(msgspec.json.decode(line[6:]))
                text = "".join(e["delta"].get("text", "") for e in seen if e["type"] == "content_block_delta")
                if text.count("tok") >= texts and (texts or seen[-1]["type"] == "ping"):
                    await upstream.wait_requests(1)
                    reading.cancel()  # closes the connection: the client is gone
    return seen


async def test_client_gone_before_first_token_aborts_upstream(nursery, upstream):
    """The client leaves after message_start and a ping (the model has produced nothing): the
    upstream sees its request aborted."""
    edge = await start_edge(nursery, edge_config(keepalive_s=0.2))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    upstream.script_for("t", [("hang",)])
    with trio.fail_after(BOUND):
        seen = await read_then_leave(edge, upstream, texts=0)
        (rec,) = await upstream.wait_requests(1)
        await rec.finished.wait()
    assert [e["type"] for e in seen] == ["message_start", "ping"]
    assert rec.aborted
    await settled(edge, node.agent)


async def test_client_gone_mid_stream_aborts_upstream(setup):
    """The client leaves after two text deltas while the model is still generating."""
    edge, upstream = setup
    upstream.script_for("t", [*(("chunk", {"content": t}) for t in words(3)), ("hang",)])
    with trio.fail_after(BOUND):
        seen = await read_then_leave(edge, upstream, texts=2)
        (rec,) = await upstream.wait_requests(1)
        await rec.finished.wait()
    texts = [e["delta"]["text"] for e in seen if e["type"] == "content_block_delta"]
    assert "".join(texts).startswith("tok0 tok1 ")
    assert rec.aborted


# -- the real Claude Code CLI ----------------------------------------------------------------


def claude_script(body: dict, work: str) -> list:
    """A scripted model for Claude Code: asked to write out.txt (and given its Write tool), it calls
    Write on work/out.txt; once the tool result is back it answers; anything else gets a greeting."""
    if any(m["role"] == "tool" for m in body["messages"]):
        return steps({"content": "All done: out.txt written."}, usage=USAGE)
    asks = msgspec.json.encode([m for m in body["messages"] if m["role"] == "user"]).decode()
    tools = {t["function"]["name"] for t in body.get("tools") or ()}
    if "out.txt" in asks and "Write" in tools:
        args = {"file_path": os.path.join(work, "out.txt"), "content": "hi-from-iop\n"}
        return steps(*native_call("toolu_iop1", "Write", msgspec.json.encode(args).decode()), finish="tool_calls")
    return steps({"content": "Hello from "}, {"content": "the edge."}, usage=USAGE)


async def run_claude(nursery, upstream, tmp_path, prompt: str, *extra: str, context_window: int = 0):
    """`claude -p PROMPT --model m` (the binary of tests/js, or IOP_CLAUDE) pointed at an edge with
    ANTHROPIC_BASE_URL and ANTHROPIC_AUTH_TOKEN, in a throwaway HOME with telemetry and updates off,
    inside `unshare -rn` (tests/agents.py): nothing here may leave loopback."""
    claude = require_agent("claude", "IOP_CLAUDE")
    edge = await start_edge(nursery, edge_config(api_keys=["sk-edge"]))
    served = model("m", upstream, target="t", max_concurrency=4, context_window=context_window)
    node = await start_node(nursery, edge, [served])
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    upstream.script_for("t", lambda body: claude_script(body, str(work)))
    env = quiet_env(
        home,
        ANTHROPIC_BASE_URL=edge.url,
        ANTHROPIC_AUTH_TOKEN="sk-edge",
        ANTHROPIC_SMALL_FAST_MODEL="m",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    with trio.fail_after(45):
        done = await run_offline([claude, "-p", prompt, "--model", "m", *extra], port=edge.port, env=env, cwd=work)
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert upstream.records and all(r.body["model"] == "t" for r in upstream.records)
    await settled(edge, node.agent)
    return done, work


async def test_claude_code_cli_answers_through_the_edge(nursery, upstream, tmp_path):
    """A plain prompt: `claude -p` prints the model's answer."""
    done, _ = await run_claude(nursery, upstream, tmp_path, "Say hello.")
    assert "Hello from the edge." in done.stdout
    # Its billing line (three hex digits from the session's first message) is not the prompt's
    # start: sessions share their prompt's prefix, for the model server's cache and prefix routing.
    systems = [r.body["messages"][0]["content"] for r in upstream.records]
    assert systems and all(s.startswith("You are") and "x-anthropic-billing-header" not in s for s in systems)


async def test_claude_code_cli_writes_a_file_through_the_edge(nursery, upstream, tmp_path):
    """A tool round trip: the model calls Claude Code's own Write tool (a streamed tool_use block),
    Claude Code writes the file (`--permission-mode acceptEdits`) and sends a tool_result back,
    which reaches the upstream as a tool message; the final answer is printed."""
    done, work = await run_claude(
        nursery, upstream, tmp_path, "Write hi-from-iop to out.txt.", "--permission-mode", "acceptEdits"
    )
    assert "All done: out.txt written." in done.stdout
    assert (work / "out.txt").read_text() == "hi-from-iop\n"
    last = next(r.body["messages"] for r in reversed(upstream.records) if r.body.get("tools"))
    assert last[-2]["tool_calls"][0]["id"] == "toolu_iop1" and last[-2]["tool_calls"][0]["function"]["name"] == "Write"
    assert last[-1]["role"] == "tool" and last[-1]["tool_call_id"] == "toolu_iop1"


async def test_claude_code_fits_itself_to_a_smaller_context(nursery, upstream, tmp_path):
    """A model served with a 40k context: Claude Code's first request (its prompt, about 19k tokens
    by the edge's estimate, plus max_tokens 32,000) does not fit. The 400 says so in Anthropic's
    words, which Claude Code reads: it asks again with a max_tokens that fits, and answers (it
    exited on the edge's own wording, and needed CLAUDE_CODE_MAX_OUTPUT_TOKENS)."""
    done, _ = await run_claude(nursery, upstream, tmp_path, "Say hello.", context_window=40_000)
    assert "Hello from the edge." in done.stdout
    asked = [r.body.get("max_tokens") for r in upstream.records]
    assert asked and all(m is not None and m < 32_000 for m in asked)


async def test_claude_code_cli_answers_from_the_demo_model(nursery, tmp_path):
    """The README's first steps, then Claude Code: `iop demo`'s simulated model takes Claude
    Code's request (its ~19k-token system prompt and tools plus max_tokens 32,000 fit the
    model's context) and answers in a few dozen tokens, not 32,000 of them."""
    from iop.cli import DEMO_MODEL, demo_model
    from node.adapters.sim import sim_tokens

    claude = require_agent("claude", "IOP_CLAUDE")
    edge = await start_edge(nursery, edge_config())
    node = await start_node(nursery, edge, [demo_model()])
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = quiet_env(
        home,
        ANTHROPIC_BASE_URL=edge.url,
        ANTHROPIC_AUTH_TOKEN="unused",
        ANTHROPIC_SMALL_FAST_MODEL=DEMO_MODEL,
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    with structlog.testing.capture_logs() as logs, trio.fail_after(60):
        done = await run_offline([claude, "-p", "Say hello.", "--model", DEMO_MODEL], port=edge.port, env=env, cwd=work)
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    words_said = done.stdout.split()
    assert 10 <= len(words_said) <= 64 and set(words_said) <= set("".join(sim_tokens("x", 4096)).split())
    asked = [e for e in logs if e["event"] == "request" and e.get("api") == "messages"]
    assert asked and all(e["status"] == 200 for e in asked)
    await settled(edge, node.agent)


async def test_a_matched_stop_sequence_is_stop_reason_stop_sequence(setup):
    """A model server that says which stop string ended the run (vLLM's `stop_reason`,
    SGLang's `matched_stop`) gives `stop_reason: "stop_sequence"` and that `stop_sequence`,
    streamed and whole, when it is one of the request's stop_sequences; any other stop
    (an end-of-turn token, a token id) stays `end_turn`."""
    edge, upstream = setup

    def ended_by(matched) -> list:
        key = "matched_stop" if isinstance(matched, int) else "stop_reason"
        last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", key: matched}]}
        head = {"choices": [{"index": 0, "delta": {"content": "one two"}, "finish_reason": None}]}
        return [("raw", b"data: " + msgspec.json.encode(c) + b"\n\n") for c in (head, last)] + [("done",)]

    async with client_for(edge) as client:
        with trio.fail_after(BOUND):
            for matched, expected in (("END", ("stop_sequence", "END")), ("<|im_end|>", ("end_turn", None))):
                upstream.script_for("t", ended_by(matched))
                whole = await client.messages.create(
                    model="m", max_tokens=50, messages=USER, stop_sequences=["END", "STOP"]
                )
                async with client.messages.stream(
                    model="m", max_tokens=50, messages=USER, stop_sequences=["END", "STOP"]
                ) as stream:
                    streamed = await stream.get_final_message()
                assert (whole.stop_reason, whole.stop_sequence) == expected
                assert (streamed.stop_reason, streamed.stop_sequence) == expected
                assert whole.content[0].text == streamed.content[0].text == "one two"
            upstream.script_for("t", ended_by(7))  # a token id: no sequence to name
            whole = await client.messages.create(model="m", max_tokens=50, messages=USER, stop_sequences=["END"])
            assert (whole.stop_reason, whole.stop_sequence) == ("end_turn", None)
    assert upstream.records[0].body["stop"] == ["END", "STOP"]


async def test_the_demo_model_stops_at_a_stop_sequence_and_counts_its_prompt(nursery):
    """`iop demo`'s sim stops at a request's stop sequence as a model server does (the text
    before it, then `stop_sequence` naming it) and counts the whole prompt in its usage,
    so a Messages stream's input_tokens agree at its start and its end within the estimate's
    own slack (a 40,000-character system prompt counted 4 tokens before)."""
    from iop.cli import DEMO_MODEL, demo_model
    from node.adapters.sim import sim_tokens

    edge = await start_edge(nursery, edge_config())
    node = await start_node(nursery, edge, [demo_model()])
    answer = "".join(sim_tokens("Hello", 64))
    stop = answer.split()[5]  # a word the answer holds
    async with client_for(edge) as client:
        with trio.fail_after(BOUND):
            whole = await client.messages.create(
                model=DEMO_MODEL,
                max_tokens=1024,
                messages=[{"role": "user", "content": "Hello"}],
                stop_sequences=[stop],
            )
            async with client.messages.stream(
                model=DEMO_MODEL,
                max_tokens=1024,
                system="s" * 40_000,
                messages=[{"role": "user", "content": "Hello"}],
            ) as stream:
                first = None
                async for event in stream:
                    if event.type == "message_start":
                        first = event.message.usage.input_tokens
                final = await stream.get_final_message()
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", stop)
    assert whole.content[0].text == answer[: answer.index(stop)]
    assert first is not None and abs(final.usage.input_tokens - first) <= 0.05 * first  # both about 10,000
    await settled(edge, node.agent)


# -- what an outside audit found (documents, tool_use ends, required fields) ------------------

PDF = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0xLjQK"}


async def test_documents_reach_the_model_as_text(setup):
    """`document` blocks (Claude Code reads a PDF as one, then sends it in every later request of
    the session) were a 400: a text document is inlined after its title, a PDF is a note that it
    was left out, a search_result in a tool result is its title, source and text."""
    edge, upstream = setup
    upstream.script_for("t", steps({"content": "ok"}))
    messages = [
        {"role": "user", "content": "read it"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_r", "name": "Read", "input": {}}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_r",
                    "content": [
                        {"type": "document", "source": PDF, "title": "spec.pdf"},
                        {
                            "type": "search_result",
                            "source": "https://example.invalid/a",
                            "title": "A",
                            "content": [{"type": "text", "text": "alpha"}],
                        },
                    ],
                },
                {
                    "type": "document",
                    "source": {"type": "text", "media_type": "text/plain", "data": "line one"},
                    "title": "notes",
                },
            ],
        },
    ]
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            message = await client.messages.create(model="m", max_tokens=64, messages=messages)
    assert message.content[0].text == "ok"
    sent = upstream.records[0].body["messages"]
    assert sent[2]["role"] == "tool" and sent[2]["content"] == (
        "[document spec.pdf (application/pdf) omitted: this edge passes no PDF documents to the model]\n"
        "[search result: A https://example.invalid/a]\nalpha"
    )
    assert sent[3] == {"role": "user", "content": [{"type": "text", "text": "[document: notes]\nline one"}]}


async def test_a_tool_use_end_without_a_call_is_end_turn(setup):
    """A model server that says `tool_calls` but sends no call: `stop_reason: "tool_use"` with no
    tool_use block broke the usual loop (`next(b for b in content if b.type == "tool_use")`)."""
    edge, upstream = setup
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            for tools in ([], [WEATHER]):
                upstream.script_for("t", steps({"content": "hi"}, finish="tool_calls"))
                whole = await client.messages.create(model="m", max_tokens=64, messages=USER, tools=tools)
                upstream.script_for("t", steps({"content": "hi"}, finish="tool_calls"))
                async with client.messages.stream(model="m", max_tokens=64, messages=USER, tools=tools) as stream:
                    streamed = await stream.get_final_message()
                for message in (whole, streamed):
                    assert [b.type for b in message.content] == ["text"], tools
                    assert message.stop_reason == "end_turn", tools


async def test_one_tool_use_when_parallel_use_is_off(setup):
    """`disable_parallel_tool_use: true` means at most one tool_use block, as Anthropic documents."""
    edge, upstream = setup
    second = {"index": 1, "id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    second["function"]["arguments"] = '{"city": "Rome"}'
    script = steps(*native_call("c1", "get_weather", '{"city": "Oslo"}'), {"tool_calls": [second]}, finish="tool_calls")
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            upstream.script_for("t", script)
            both = await client.messages.create(model="m", max_tokens=64, messages=USER, tools=[WEATHER])
            upstream.script_for("t", script)
            one = await client.messages.create(
                model="m",
                max_tokens=64,
                messages=USER,
                tools=[WEATHER],
                tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            )
    assert [b.input["city"] for b in both.content] == ["Oslo", "Rome"]
    assert [b.input["city"] for b in one.content] == ["Oslo"]


async def test_missing_max_tokens_and_orphan_results_are_400s(setup):
    """As Anthropic's API: `max_tokens` is required (count_tokens takes none), a tool_result
    must answer a tool_use (an orphan tool message fails chat templates upstream), a tool_use
    but the last turn's must be answered in the next turn, and its `input` is an object (each
    of those two went upstream: calls followed by a user's words, arguments of `"notobj"`)."""
    edge, upstream = setup
    orphan = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]}]

    def use(call_id, given):
        return {"type": "tool_use", "id": call_id, "name": "get_weather", "input": given}

    answered = [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}]
    unanswered = [
        [
            *USER,
            {"role": "assistant", "content": [use("toolu_1", {"city": "x"})]},
            {"role": "user", "content": "again"},
        ],
        [
            *USER,
            {"role": "assistant", "content": [use("toolu_1", {}), use("toolu_2", {})]},
            {"role": "user", "content": answered},
        ],
    ]
    not_objects = [
        [*USER, {"role": "assistant", "content": [use("toolu_1", given)]}, {"role": "user", "content": answered}]
        for given in ("notobj", [1, 2], 7, 0)
    ]
    fine = [
        [
            *USER,
            {"role": "assistant", "content": [use("toolu_1", {"city": "x"})]},
            {"role": "user", "content": answered},
        ],
        [*USER, {"role": "assistant", "content": [use("toolu_1", {"city": "x"})]}],  # a last turn's call: a prefill
    ]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/messages", json={"model": "m", "messages": USER})
            counted = await client.post("/v1/messages/count_tokens", json={"model": "m", "messages": USER})
            o = await client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": orphan})
            for messages in unanswered:
                u = await client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": messages})
                assert u.status_code == 400, u.text
                assert "without `tool_result` blocks immediately after" in u.json()["error"]["message"]
                assert ("toolu_2" in u.json()["error"]["message"]) == (len(messages[1]["content"]) == 2)
            for j, messages in enumerate(not_objects):
                n = await client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": messages})
                assert n.status_code == 400, n.text
                assert n.json()["error"]["message"] == (
                    "Invalid value for `messages[1].content[0].input`: expected an object."
                ), j
            assert not upstream.records
            for messages in fine:
                upstream.script_for("t", steps({"content": "ok"}))
                ok = await client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": messages})
                assert ok.status_code == 200, ok.text
    assert len(upstream.records) == 2
    upstream.records.clear()
    assert r.status_code == 400 and r.json()["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: Field required",
    }
    assert counted.status_code == 200
    assert o.status_code == 400 and "unexpected `tool_use_id`" in o.json()["error"]["message"]
    assert not upstream.records


async def test_duplicate_tool_use_ids_and_results_are_400s(setup):
    """As Anthropic's API: a `tool_use` id used twice in the history, or one call answered by two
    `tool_result` blocks of a turn, is a 400 naming the block (an outside audit: two calls `t1` and
    one result were a 200, and the model server got `tool_calls` [t1, t1] and one tool message)."""
    edge, upstream = setup

    def use(call_id):
        return {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": "x"}}

    def result(call_id):
        return {"type": "tool_result", "tool_use_id": call_id, "content": "r"}

    def turns(*calls_then_results):
        out = [*USER]
        for calls, results in calls_then_results:
            out += [{"role": "assistant", "content": calls}, {"role": "user", "content": results}]
        return out

    refused = [
        (
            turns(([use("t1"), use("t1")], [result("t1")])),
            "Invalid value for `messages[1].content[1].id`: `tool_use` ids must be unique; "
            "t1 is also the id of `messages[1].content[0]`.",
        ),
        (
            turns(([use("t1")], [result("t1")]), ([use("t1")], [result("t1")])),
            "Invalid value for `messages[3].content[0].id`: `tool_use` ids must be unique; "
            "t1 is also the id of `messages[1].content[0]`.",
        ),
        (
            turns(([use("t1"), use("t2")], [result("t1"), result("t1"), result("t2")])),
            "Invalid value for `messages[2].content[1]`: each `tool_use` must have a single result. "
            "Found multiple `tool_result` blocks with id: t1.",
        ),
        # (it went on as a success: the model was told a failed tool worked)
        (
            turns(([use("t1")], [{**result("t1"), "is_error": "yes"}])),
            "Invalid value for `messages[2].content[0].is_error`: expected a boolean.",
        ),
        # (a user turn of only a thinking block was dropped: "expected `array` of length >= 1")
        (
            [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}],
            "Invalid value for `messages[0].content[0].type`: a user turn takes no `thinking` blocks.",
        ),
    ]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for messages, said in refused:
                r = await client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": messages})
                assert r.status_code == 400, r.text
                assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": said}}
            assert not upstream.records
            upstream.script_for("t", steps({"content": "ok"}))
            fine = turns(([use("t1"), use("t2")], [result("t1"), result("t2")]))
            ok = await client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": fine})
    assert ok.status_code == 200, ok.text
    sent = upstream.records[0].body["messages"]
    assert [c["id"] for c in sent[1]["tool_calls"]] == ["t1", "t2"]
    assert [m["tool_call_id"] for m in sent[2:]] == ["t1", "t2"]


async def test_a_result_answers_a_call_of_the_turn_before_it_once(setup):
    """As Anthropic's API, which merges user messages in a row into one turn: a `tool_result` answers
    a `tool_use` of the assistant turn just before its own, once. An outside audit's two 200s: a call
    answered again in the next user message (the model server got two tool messages for it), and a
    call of an earlier turn answered after an assistant's text (a tool message after no calls at all).
    Claude Code's histories stay 200s, one tool message per call, in order."""
    edge, upstream = setup

    def use(call_id):
        return {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": "x"}}

    def result(call_id):
        return {"type": "tool_result", "tool_use_id": call_id, "content": f"r-{call_id}"}

    text = {"type": "text", "text": "and?"}
    asked = [
        *USER,
        {"role": "assistant", "content": [use("toolu_1")]},
        {"role": "user", "content": [result("toolu_1")]},
    ]
    twice = "each `tool_use` must have a single result. Found multiple `tool_result` blocks with id: toolu_1."
    unexpected = (
        "unexpected `tool_use_id` found in `tool_result` blocks: toolu_1. "
        "Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
    )
    refused = [
        ([*asked, {"role": "user", "content": [result("toolu_1"), text]}], "messages[3].content[0]", twice),
        (
            [*asked, {"role": "user", "content": "ok"}, {"role": "user", "content": [text, result("toolu_1")]}],
            "messages[4].content[1]",
            twice,
        ),
        (
            [*asked, {"role": "assistant", "content": "Done."}, {"role": "user", "content": [result("toolu_1")]}],
            "messages[4].content[0]",
            unexpected,
        ),
        (
            [
                *asked,
                {"role": "assistant", "content": [{"type": "text", "text": "Done."}, use("toolu_2")]},
                {"role": "user", "content": [result("toolu_2"), result("toolu_1")]},
            ],
            "messages[4].content[1]",
            unexpected,
        ),
        ([{"role": "user", "content": [result("toolu_1")]}], "messages[0].content[0]", unexpected),
    ]
    thinking = {"type": "thinking", "thinking": "two cities", "signature": "sig"}
    fine = [
        (  # Claude Code's loop: parallel calls answered in one message with words after, then more turns
            [
                *USER,
                {"role": "assistant", "content": [thinking, {"type": "text", "text": "Checking."}, use("a"), use("b")]},
                {"role": "user", "content": [result("a"), result("b"), text]},
                {"role": "assistant", "content": [thinking, use("c")]},
                {"role": "user", "content": [result("c")]},
                {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
                {"role": "user", "content": "thanks"},
            ],
            ["user", "assistant a b", "tool a", "tool b", "user", "assistant c", "tool c", "assistant", "user"],
        ),
        (  # one turn's calls answered in two user messages in a row
            [
                *USER,
                {"role": "assistant", "content": [use("a"), use("b")]},
                {"role": "user", "content": [result("a")]},
                {"role": "user", "content": [result("b"), text]},
            ],
            ["user", "assistant a b", "tool a", "tool b", "user"],
        ),
        (  # calls in two assistant messages in a row (one turn), an empty assistant turn after the results
            [
                *USER,
                {"role": "assistant", "content": [use("a")]},
                {"role": "assistant", "content": [thinking, use("b")]},
                {"role": "user", "content": [result("a"), result("b")]},
                {"role": "assistant", "content": []},
                {"role": "user", "content": "again"},
            ],
            ["user", "assistant a b", "tool a", "tool b", "assistant", "user"],
        ),
    ]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for messages, where, said in refused:
                r = await client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": messages})
                assert r.status_code == 400, r.text
                message = f"Invalid value for `{where}`: {said}"
                assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
        assert not upstream.records
        async with client_for(edge) as client:
            for messages, _ in fine:
                upstream.script_for("t", steps({"content": "ok"}))
                ok = await client.messages.create(model="m", max_tokens=8, system=[], messages=messages)
                assert ok.content[0].text == "ok"
    for record, (_, expected) in zip(upstream.records, fine, strict=True):
        sent = [
            " ".join([m["role"], *(c["id"] for c in m.get("tool_calls") or ()), m.get("tool_call_id", "")]).strip()
            for m in record.body["messages"]
        ]
        assert sent == expected
        assert all(m["content"] == f"r-{m['tool_call_id']}" for m in record.body["messages"] if m["role"] == "tool")


async def test_an_empty_user_message_is_a_400_naming_its_content(setup):
    """As Anthropic's API: a user message with empty content (`[]` or `""`) is a 400 naming
    `messages[i].content` (an outside audit: a lone `[]` was a 400 naming `messages`, and after
    other messages it was dropped). What stays a 200: `system: []` (Anthropic takes it), an empty
    last assistant message (a prefill), and an empty assistant turn before the last message (the
    edge's own answer when the model said nothing, which a client sends back)."""
    edge, upstream = setup
    said = "a user message must have non-empty content."
    refused = [
        ([{"role": "user", "content": []}], "messages[0].content"),
        ([*USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": []}], "messages[2].content"),
        ([{"role": "user", "content": ""}], "messages[0].content"),
    ]
    fine = [
        {"system": [], "messages": USER},
        {"messages": [*USER, {"role": "assistant", "content": []}]},
        {"messages": [*USER, {"role": "assistant", "content": []}, {"role": "user", "content": "again"}]},
    ]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for messages, where in refused:
                r = await client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": messages})
                assert r.status_code == 400, r.text
                assert r.json() == {
                    "type": "error",
                    "error": {"type": "invalid_request_error", "message": f"Invalid value for `{where}`: {said}"},
                }
            assert not upstream.records
            for body in fine:
                upstream.script_for("t", steps({"content": "ok"}))
                ok = await client.post("/v1/messages", json={"model": "m", "max_tokens": 8, **body})
                assert ok.status_code == 200, ok.text
    assert len(upstream.records) == len(fine)


async def test_a_system_prompt_without_a_message_is_a_400(setup):
    """As Anthropic's API: a request needs a user or assistant message; a `system` (or system
    entries in `messages`) alone went on as a chat of one system message (found from outside),
    which many chat templates fail on."""
    edge, upstream = setup
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for body in (
                {"system": "You are terse.", "messages": []},
                {"messages": [{"role": "system", "content": "You are terse."}]},
            ):
                r = await client.post("/v1/messages", json={"model": "m", "max_tokens": 8, **body})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["type"] == "invalid_request_error"
                assert "at least one user or assistant message" in r.json()["error"]["message"], r.text
    assert not upstream.records


async def test_metadata_user_id_keeps_its_session_on_one_node_but_never_reaches_the_model(nursery, upstream):
    """`metadata.user_id` is the session: a Claude Code session's requests, each of its own prompt,
    land on one node of three; it is not sent upstream (an outside audit: Claude Code's, a JSON
    string of its device id, account uuid and session id, reached the model server as `user`)."""
    edge = await start_edge(nursery, edge_config())
    nodes = [
        await start_node(nursery, edge, [model("m", upstream, target=f"t{k}", max_concurrency=4)], node_id=f"n{k}")
        for k in range(3)
    ]
    user_id = '{"device_id":"dev-5e1f","account_uuid":"acct-77aa","session_id":"sess-9c0d"}'
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            for k in range(8):  # (other openings: without the session, prefix routing spreads them)
                prompt = [{"role": "user", "content": f"question {k}: " + "why " * (20 * k)}]
                await client.messages.create(model="m", max_tokens=4, messages=prompt, metadata={"user_id": user_id})
    assert len(upstream.records) == 8
    assert len({r.body["model"] for r in upstream.records}) == 1
    assert not [r for r in upstream.records if "user" in r.body or b"dev-5e1f" in r.raw_body]
    await settled(edge, *(n.agent for n in nodes))


async def test_the_sdk_tool_runner_loops_through_the_edge(setup):
    """The anthropic SDK's `beta.messages.tool_runner` threads its turns: after the first it sends
    only the new tool_result with `thread: {"type": "continue"}`, which an edge that stores
    nothing refused as an orphan tool_result (400). Such a request is `thread_not_found` (404, in
    `error.details`): the SDK sends the whole conversation again and the loop ends."""
    edge, upstream = setup

    def script(body: dict) -> list:
        if any(m["role"] == "tool" for m in body["messages"]):
            return steps({"content": "It is sunny."})
        return steps(*native_call("call_w", "get_weather", '{"city": "Paris"}'), finish="tool_calls")

    upstream.script_for("t", script)

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        return "18C"

    def loop() -> list:
        with anthropic.Anthropic(base_url=edge.url, api_key="unused", max_retries=0, timeout=BOUND) as client:
            runner = client.beta.messages.tool_runner(model="m", max_tokens=256, tools=[get_weather], messages=USER)
            return list(runner)

    with trio.fail_after(BOUND):
        messages = await trio.to_thread.run_sync(loop)
    assert [m.stop_reason for m in messages] == ["tool_use", "end_turn"]
    assert messages[-1].content[0].text == "It is sunny."
    last = upstream.records[-1].body["messages"]
    assert last[-1] == {"role": "tool", "tool_call_id": "toolu_call_w", "content": "18C"}


@pytest.mark.parametrize(
    ("path", "tool"),
    [
        ("/v1/messages", {"name": "f", "input_schema": {"type": "object"}}),
        ("/v1/messages/count_tokens", {"name": "f", "input_schema": {"type": "object"}}),
        ("/v1/responses", {"type": "function", "name": "f", "parameters": {"type": "object"}}),
        ("/v1/chat/completions", {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
    ],
)
async def test_too_many_tools_are_refused_before_any_is_read(nursery, upstream, monkeypatch, path, tool):
    """More than `max_tools` tools is a 400 `too_many_tools` on every route, counted as the client
    sent them before any is translated: 100,000 tools in one 5.5 MB body held the loop 0.7-1.0 s
    on the Messages API (translated, then converted, then counted), 0.3 s on the others."""
    from edge.anthropic import messages as messages_module
    from edge.openai import responses_route

    def never(*_a, **_k):
        raise AssertionError("the body was translated before its tools were counted")

    monkeypatch.setattr(messages_module, "chat_body", never)
    monkeypatch.setattr(responses_route, "decode_request", never)
    edge = await start_edge(nursery, edge_config(max_tools=4))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    input_key = "input" if path == "/v1/responses" else "messages"
    body = {"model": "m", "max_tokens": 10, input_key: USER, "tools": [tool] * 5}
    with trio.fail_after(BOUND):
        async with http(edge) as raw:
            r = await raw.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "Too many tools: 5 (at most 4)" in error["message"]
    assert error.get("code", "too_many_tools") == "too_many_tools"  # (Anthropic's errors carry no code)
    await settled(edge, node.agent)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/chat/completions"])
@pytest.mark.parametrize("too_many", ["tools", "messages"])
async def test_a_large_body_is_counted_before_it_is_decoded(nursery, upstream, monkeypatch, path, too_many):
    """A body past 64 KiB with more tools or messages than the edge takes is refused before it
    is decoded into Python objects: 100,000 tools in 5.5 MB held the loop 171-226 ms decoded,
    then refused. The 400 is the one a small body gets."""
    from edge.openai import request

    def never(*_a, **_k):
        raise AssertionError("the body was decoded before its lists were counted")

    monkeypatch.setattr(request, "decoder_for", never)  # (a body decoded whole, or in pieces)
    monkeypatch.setattr(request, "in_one_go", lambda _text: False)  # (as a body of many objects is)
    edge = await start_edge(nursery, edge_config(max_tools=4, max_messages=8))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    pad = "x" * 70_000  # (past the size counted first)
    if path == "/v1/responses":
        tool, items_key = {"type": "function", "name": "f", "parameters": {"type": "object"}}, "input"
    elif path == "/v1/chat/completions":
        tool, items_key = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}, "messages"
    else:
        tool, items_key = {"name": "f", "input_schema": {"type": "object"}}, "messages"
    turns = [{"role": "user", "content": pad}] + [{"role": "user", "content": "hi"}] * (
        9 if too_many == "messages" else 0
    )
    body = {"model": "m", "max_tokens": 10, items_key: turns, "tools": [tool] * (5 if too_many == "tools" else 1)}
    with trio.fail_after(BOUND):
        async with http(edge) as raw:
            r = await raw.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if too_many == "tools":
        assert "Too many tools: 5 (at most 4)" in error["message"]
    else:
        assert "Too many messages: 10 (at most 8)" in error["message"]
        assert error.get("param", items_key) == items_key
    await settled(edge, node.agent)


async def test_passthrough_chat_holds_the_edges_counts(nursery, upstream):
    """A model relayed as the provider answers (`response_mode = "passthrough"`) still takes at
    most `max_tools` tools and `max_messages` messages, whatever the body's size."""
    edge = await start_edge(
        nursery, edge_config(max_tools=4, max_messages=8, models=[{"name": "m", "response_mode": "passthrough"}])
    )
    node = await start_node(nursery, edge, [model("m", upstream, target="t", passthrough=True)])
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with trio.fail_after(BOUND):
        async with http(edge) as raw:
            ok = await raw.post("/v1/chat/completions", json={"model": "m", "messages": USER, "tools": [tool]})
            r = await raw.post("/v1/chat/completions", json={"model": "m", "messages": USER, "tools": [tool] * 5})
    assert ok.status_code == 200, ok.text
    assert r.status_code == 400, r.text
    assert "Too many tools: 5 (at most 4)" in r.json()["error"]["message"]
    assert len(upstream.records) == 1  # (the refused one never reached the provider)
    await settled(edge, node.agent)


async def test_many_tool_results_count_as_the_client_sent_them(nursery, upstream):
    """`max_messages` counted chat messages after conversion, where each tool_result is one: a
    Claude Code session with 8 parallel tool calls a round hit "Too many messages: 2054 (at most
    2048)" at 572 messages of its own, and could not even /compact. The Messages API (and
    Responses) count the client's own messages; past the limit it is still a 400."""
    edge = await start_edge(nursery, edge_config(max_messages=30))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    upstream.script_for("t", steps({"content": "ok"}))
    rounds = []
    for r in range(7):  # 1 + 7 x 2 = 15 messages of the client's; 1 + 7 x 9 = 64 in chat
        uses = [{"type": "tool_use", "id": f"toolu_{r}_{i}", "name": "Bash", "input": {}} for i in range(8)]
        results = [{"type": "tool_result", "tool_use_id": u["id"], "content": "ok"} for u in uses]
        rounds += [{"role": "assistant", "content": uses}, {"role": "user", "content": results}]
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            message = await client.messages.create(model="m", max_tokens=16, messages=[*USER, *rounds])
            with pytest.raises(anthropic.BadRequestError) as caught:
                await client.messages.create(model="m", max_tokens=16, messages=[*USER, *rounds, *rounds, *rounds])
    assert message.content[0].text == "ok"
    assert "Too many messages: 43 (at most 30)" in str(caught.value)
    await settled(edge, node.agent)


async def test_a_tool_call_cut_off_by_max_tokens_keeps_what_it_holds(setup):
    """A call cut off mid-way (finish `length`) was `"input": {}` in the whole answer, while its
    stream carried the fragment: now the input is what the fragment holds, finished values
    only, as Anthropic's SDK reads the same call streamed."""
    edge, upstream = setup
    upstream.script_for(
        "t", steps(*native_call("call_1", "f", '{"city": "Paris", "days": [1, 2], "u'), finish="length")
    )
    tools = [F_TOOL]
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            whole = await client.messages.create(model="m", max_tokens=50, messages=USER, tools=tools)
            async with client.messages.stream(model="m", max_tokens=50, messages=USER, tools=tools) as stream:
                streamed = await stream.get_final_message()
    assert whole.stop_reason == streamed.stop_reason == "max_tokens"
    assert [(b.type, b.input) for b in whole.content] == [("tool_use", {"city": "Paris", "days": [1, 2]})]
    assert [b.input for b in streamed.content] == [b.input for b in whole.content]


async def test_a_tool_call_nested_past_the_decoder_is_a_clear_error_not_a_500(setup):
    """A model's tool call whose arguments nest 100,000 deep raised RecursionError (not a
    DecodeError) while the edge made its `input`: a 500 on the Messages API. Such arguments
    fail the call's check, as other unreadable ones do (a request without tools has the call
    dropped before anything reads it)."""
    edge, upstream = setup
    deep = "[" * 100_000 + "]" * 100_000
    upstream.script_for("t", steps(*native_call("call_1", "f", deep), finish="tool_calls"))
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            with pytest.raises(anthropic.APIStatusError) as caught:
                await client.messages.create(model="m", max_tokens=50, messages=USER, tools=[F_TOOL])
            untooled = await client.messages.create(model="m", max_tokens=50, messages=USER)
    assert caught.value.status_code == 502 and "arguments hold more than" in str(caught.value), caught.value
    assert untooled.stop_reason == "end_turn"


async def test_the_anthropic_sdk_lists_and_retrieves_models(setup):
    """`models.list()` and `models.retrieve()` of the Anthropic SDK read the edge's models whole
    (`type`, `display_name`, `created_at`, the page's `first_id`/`last_id`): they came with
    OpenAI's fields only, and a model picker on the SDK showed no names."""
    edge, _ = setup
    with trio.fail_after(BOUND):
        async with client_for(edge, api_key="unused") as client:
            page = await client.models.list()
            listed = [m async for m in page]
            one = await client.models.retrieve("m")
        async with http(edge) as raw:
            openai_shape = (await raw.get("/v1/models")).json()
    assert [(m.id, m.type, m.display_name) for m in listed] == [("m", "model", "m")]
    assert page.first_id == "m" and page.last_id == "m" and page.has_more is False
    assert one.id == "m" and one.display_name == "m" and one.type == "model"
    assert abs(one.created_at.timestamp() - openai_shape["data"][0]["created"]) < 1
    assert openai_shape["object"] == "list" and openai_shape["data"][0]["object"] == "model"  # OpenAI's, still
    # Validated as the SDK's type, not built leniently: anthropic 2.17 requires `lifecycle`, and a
    # picker keeping the `active` models kept none while it was missing.
    strict = anthropic.types.ModelInfo.model_validate(openai_shape["data"][0])
    assert one.lifecycle == strict.lifecycle == "active"
    assert one.max_input_tokens is None  # the node advertised no context window


async def test_a_model_lists_the_largest_context_window_its_nodes_advertise(nursery, upstream):
    """`max_input_tokens` (Anthropic's field) is the largest `context_window` of the nodes serving
    the model: the most a request of it can hold on some node."""
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("w", upstream, context_window=8192)], node_id="n1")
    await start_node(nursery, edge, [model("w", upstream, context_window=32768)], node_id="n2")
    with trio.fail_after(BOUND):
        async with client_for(edge, api_key="unused") as client:
            one = await client.models.retrieve("w")
    assert one.max_input_tokens == 32768 and one.lifecycle == "active"


async def test_the_anthropic_sdk_pages_through_models(nursery, upstream):
    """Anthropic's `limit`, `after_id` and `before_id` page the models as its SDK asks (they were
    ignored: every page was every model); with no `limit`, every model on one page, as OpenAI
    lists them; a bad `limit` is a 400."""
    edge = await start_edge(nursery)
    names = ["a", "b", "c", "d", "e"]
    node = await start_node(nursery, edge, [model(n, upstream, target="t") for n in names])
    with trio.fail_after(BOUND):
        async with client_for(edge, api_key="unused") as client:
            first = await client.models.list(limit=2)
            every = [m.id async for m in first]  # the SDK follows has_more / last_id
            back = await client.models.list(limit=2, before_id="d")
            with pytest.raises(anthropic.BadRequestError) as bad:
                await client.models.list(limit=0)
            with pytest.raises(anthropic.NotFoundError) as missing:
                await client.models.retrieve("z")
        async with http(edge) as raw:
            whole = (await raw.get("/v1/models")).json()
            openai_missing = (await raw.get("/v1/models/z")).json()
    assert [m.id for m in first.data] == ["a", "b"] and first.has_more and first.last_id == "b"
    assert every == names
    assert [m.id for m in back.data] == ["b", "c"] and back.has_more and back.first_id == "b"
    # Errors in Anthropic's shape to its SDK, as /v1/messages answers them (they were OpenAI's)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert bad.value.body["error"]["message"].startswith("Invalid value for `limit`")
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    assert openai_missing["error"]["code"] == "model_not_found"  # OpenAI's to everyone else
    assert [m["id"] for m in whole["data"]] == names and whole["has_more"] is False
    await settled(edge, node.agent)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_written_in_thinking_with_no_answer_is_a_tool_use(setup, stream):
    """Claude Code on a model that calls before it closes its think block (all it wrote in
    `reasoning_content`): the turn ended `end_turn` with only a thinking block, the call lost. It
    is a `tool_use` block, with `stop_reason: "tool_use"`."""
    edge, upstream = setup
    thought = 'Check Paris. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    upstream.script_for("t", steps(*({"reasoning_content": thought[i : i + 9]} for i in range(0, len(thought), 9))))
    body = {"model": "m", "max_tokens": 256, "messages": USER, "tools": [WEATHER]}
    with trio.fail_after(BOUND):
        async with client_for(edge) as client:
            if stream:
                async with client.messages.stream(**body) as s:
                    message = await s.get_final_message()
            else:
                message = await client.messages.create(**body)
    uses = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert uses == [("get_weather", {"city": "Paris"})], message.content
    assert message.stop_reason == "tool_use"
    assert not any(b.type == "text" and "<tool_call>" in b.text for b in message.content)
