"""Tool calling end to end: native, from text, validated and retried before the client sees it."""

from __future__ import annotations

import json
import time
from functools import partial

import httpx
import msgspec
import openai
import pytest
import structlog
import trio

from edge.openai import tools as tools_module
from edge.openai import turn as turn_module
from edge.openai.tools import ToolTextFilter
from tests.conftest import (
    BOUND,
    edge_config,
    eventually,
    http,
    model,
    sdk,
    settled,
    sse_events,
    start_edge,
    start_node,
)

MESSAGES = [{"role": "user", "content": "Weather in Paris and Rome?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


@pytest.fixture
async def tooled(nursery, upstream):
    edge = await start_edge(nursery, edge_config(models=[{"name": "live", "tool_stream": "live"}], keepalive_s=0.2))
    node = await start_node(
        nursery,
        edge,
        [
            model("native", upstream, target="t"),
            model("live", upstream, target="t"),
            model("textonly", upstream, target="t", native_tools=False),
        ],
    )
    yield edge, upstream
    await settled(edge, node.agent)


def native_call(index, call_id, name, *arg_parts):
    first = {
        "tool_calls": [{"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]
    }
    rest = [{"tool_calls": [{"index": index, "function": {"arguments": part}}]} for part in arg_parts]
    return [first, *rest]


CALL = "<tool_call>" + json.dumps({"name": "get_time", "arguments": {}}) + "</tool_call>"


def steps(*deltas, finish="stop"):
    return [*(("chunk", d) for d in deltas), ("chunk", {}, finish), ("done",)]


def text_call(name, args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


async def answer_of(edge, name: str, tools: list, stream: bool) -> tuple[str, str, list]:
    """The content, reasoning and tool calls a chat client gets, streamed or whole."""
    async with sdk(edge) as client:
        if not stream:
            message = (
                (await client.chat.completions.create(model=name, messages=MESSAGES, tools=tools)).choices[0].message
            )
            reasoning = (message.model_extra or {}).get("reasoning_content") or ""
            return message.content or "", reasoning, message.tool_calls or []
        chunks = [
            c.choices[0].delta
            async for c in await client.chat.completions.create(model=name, messages=MESSAGES, tools=tools, stream=True)
            if c.choices
        ]
    content = "".join(d.content or "" for d in chunks)
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in chunks)
    return content, reasoning, [call for d in chunks for call in d.tool_calls or ()]


@pytest.mark.parametrize("name", ["native", "live"])
async def test_text_ending_in_what_might_begin_a_call_is_kept_beside_native_calls(tooled, name):
    """Content that ends in a character a text call could begin with (``a < b{``), then a native
    call: its tail was cut as if it were call markup, in every mode (found from outside). Nothing
    follows it, so it is text: the content is whole, streamed or not."""
    edge, upstream = tooled
    upstream.script_for(
        "t", steps({"content": "Compare a < b{"}, *native_call(0, "call_a", "get_time", "{}"), finish="tool_calls")
    )
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            stream = await client.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS, stream=True)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            whole = await client.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS)
    assert streamed == whole.choices[0].message.content == "Compare a < b{"
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["get_time"]


@pytest.mark.parametrize(("name", "stream"), [("native", False), ("native", True), ("live", True)])
async def test_a_list_of_calls_in_one_block_is_each_of_them(tooled, name, stream):
    """Some models write a turn's parallel calls as a list in one block: it was read as one call
    with no name, retried and failed ("a tool call has no function name", an outside audit).
    Each is a call, in order; with `parallel_tool_calls: false` only the first; a list holding
    anything but calls is still unreadable."""
    edge, upstream = tooled
    listed = [{"name": "get_weather", "arguments": {"city": c}} for c in ("Paris", "Rome")]
    text = "Checking.<tool_call>" + json.dumps(listed) + "</tool_call>"
    upstream.script_for("t", steps(*({"content": text[i : i + 9]} for i in range(0, len(text), 9))))

    async def calls(**kw):
        async with sdk(edge) as client:
            if not stream:
                whole = await client.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS, **kw)
                return whole.choices[0].message.content, whole.choices[0].message.tool_calls
            got, content = {}, ""
            async for chunk in await client.chat.completions.create(
                model=name, messages=MESSAGES, tools=TOOLS, stream=True, **kw
            ):
                for call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
                    got.setdefault(call.index, []).append(call)
                content += chunk.choices[0].delta.content or "" if chunk.choices else ""
            return content, [parts[0] for _, parts in sorted(got.items())]

    with trio.fail_after(BOUND):
        content, both = await calls()
        _, first = await calls(parallel_tool_calls=False)
    assert content == "Checking."
    assert [json.loads(c.function.arguments)["city"] for c in both] == ["Paris", "Rome"]
    assert len({c.id for c in both}) == 2
    assert [json.loads(c.function.arguments)["city"] for c in first] == ["Paris"]
    assert len(upstream.records) == 2  # (no retry)
    bad = tools_module.parse_text_tool_calls('<tool_call>[{"name": "get_time"}, 3]</tool_call>')
    assert not bad.calls and bad.error == "a tool call has no function name"
    # A list past the 1,024 calls a turn may hold, under a bound of the calls wanted: those, no
    # error (it was "more than 1024 tool calls" and a retry; a re-check).
    many = "<tool_call>" + json.dumps([{"name": "get_time", "arguments": {}}] * 1025) + "</tool_call>"
    first_two = tools_module.parse_text_tool_calls(many, most=2)
    assert len(first_two.calls) == 2 and not first_two.error and first_two.dropped
    assert "more than 1024" in tools_module.parse_text_tool_calls(many).error


WRITE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
}


@pytest.mark.parametrize(("name", "stream"), [("native", False), ("native", True), ("live", True)])
@pytest.mark.parametrize("content", ["<s>old</s> new [INST] x <|im_end|>", 'OPEN = "<think>"'])
async def test_a_text_calls_arguments_keep_sentinels_and_think_tags(tooled, name, stream, content):
    """A call written as text whose argument holds what the edge filters out of content: a file
    with ``</s>`` and ``[INST]`` was written without them, and one with ``"<think>"`` was a 502
    (the call unreadable, and its retry the same: found from outside). A call's arguments are
    read from what the model wrote: the file is whole."""
    edge, upstream = tooled
    args = {"path": "f.txt", "content": content}
    text = "<tool_call>" + json.dumps({"name": "write_file", "arguments": args}) + "</tool_call>"
    upstream.script_for("t", steps(*({"content": text[i : i + 7]} for i in range(0, len(text), 7))))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            if stream:
                got = [
                    call
                    async for chunk in await client.chat.completions.create(
                        model=name, messages=MESSAGES, tools=[WRITE], stream=True
                    )
                    if chunk.choices
                    for call in chunk.choices[0].delta.tool_calls or ()
                ]
            else:
                whole = await client.chat.completions.create(model=name, messages=MESSAGES, tools=[WRITE])
                got = whole.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == [("write_file", args)]
    assert len(upstream.records) == 1  # (no retry)


@pytest.mark.parametrize(("name", "stream"), [("native", False), ("native", True), ("live", True)])
@pytest.mark.parametrize("file", ['END = "</tool_call>"\nOPEN = "<think>"\n', 'CLOSE = "</think>"\n'])
async def test_markup_inside_a_text_calls_arguments_is_the_arguments(tooled, name, stream, file):
    """A file whose text holds ``</tool_call>`` and ``<think>``, written by a call as text, with
    an answer after the call. ``</tool_call>`` inside the JSON ended the call there (unreadable,
    retried, a 502), ``<think>`` moved the rest of the call and the answer after it into
    reasoning, and a lone ``</think>`` the text before it (found from outside). Markup inside a
    call's JSON strings is the arguments."""
    edge, upstream = tooled
    args = {"path": "p.py", "content": file}
    text = "Writing it.\n<tool_call>" + json.dumps({"name": "write_file", "arguments": args}) + "</tool_call>\nSaved."
    upstream.script_for("t", steps(*({"content": text[i : i + 5]} for i in range(0, len(text), 5))))
    with trio.fail_after(BOUND):
        content, reasoning, calls = await answer_of(edge, name, [WRITE], stream)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("write_file", args)]
    assert content == "Writing it.\n\nSaved."
    assert reasoning == ""
    assert len(upstream.records) == 1  # (no retry)


@pytest.mark.parametrize(("name", "stream"), [("native", False), ("native", True), ("live", True)])
async def test_a_call_written_inside_think_is_reasoning_not_a_call(tooled, name, stream):
    """A model that drafts a call in its reasoning, then makes another: calls were read from the
    text as written, think block and all, and the drafted one was sent as a real call too, in
    every mode (with strict output too, the reasoning hidden and its call not: found from
    outside). Only the call in the answer is one."""
    edge, upstream = tooled
    draft = text_call("get_weather", {"city": "Paris"})
    text = "<think>Maybe " + draft + " would help.</think>The time, then.\n" + CALL
    upstream.script_for("t", steps(*({"content": text[i : i + 6]} for i in range(0, len(text), 6))))
    with trio.fail_after(BOUND):
        content, _, calls = await answer_of(edge, name, TOOLS, stream)
    assert content == "The time, then." + ("\n" if name == "live" else "")  # (live: sent before the call was known)
    assert [c.function.name for c in calls] == ["get_time"]


@pytest.mark.parametrize(("name", "stream"), [("native", False), ("native", True), ("live", True)])
@pytest.mark.parametrize("where", ["reasoning_content", "unclosed think"])
async def test_a_call_written_in_reasoning_with_no_answer_is_the_call(tooled, name, stream, where):
    """A model that calls before it closes its think block (or whose server's reasoning parser
    put all it wrote in the reasoning: Qwen3 on vLLM) writes no answer, only reasoning with the
    call in it. The reasoning-only fallback pasted that reasoning into the answer, markup and
    all, with `finish_reason: "stop"` and no call (an outside audit). It is the turn's call."""
    edge, upstream = tooled
    thought = "I should ask for the time. " + CALL
    if where == "reasoning_content":
        deltas = [{"reasoning_content": thought[i : i + 7]} for i in range(0, len(thought), 7)]
    else:
        text = "<think>" + thought
        deltas = [{"content": text[i : i + 7]} for i in range(0, len(text), 7)]
    upstream.script_for("t", steps(*deltas))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            if stream:
                async with client.chat.completions.stream(model=name, messages=MESSAGES, tools=TOOLS) as s:
                    answer = await s.get_final_completion()
            else:
                answer = await client.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS)
    (choice,) = answer.choices
    assert "<tool_call>" not in (choice.message.content or ""), choice.message.content
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()] == [("get_time", "{}")]
    assert len(upstream.records) == 1


async def test_an_unreadable_call_in_reasoning_with_no_answer_is_retried(tooled):
    """A reasoning-only turn whose call block cannot be read is an invalid turn: retried with a
    corrective message before the client sees anything, as one in the answer is."""
    edge, upstream = tooled
    bad = {"reasoning_content": 'Time. <tool_call>{"name": "get_time", "arguments": {</tool_call>'}

    def script(body):
        corrected = any("That is invalid" in str(m.get("content")) for m in body["messages"])
        return steps({"content": CALL} if corrected else bad)

    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            answer = await client.chat.completions.create(model="native", messages=MESSAGES, tools=TOOLS)
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [c.function.name for c in choice.message.tool_calls or ()] == ["get_time"]
    assert len(upstream.records) == 2


@pytest.mark.parametrize(
    ("text", "content", "sent_ahead", "calls"),
    [
        ("\nI'll check.\n" + CALL + "\n\nThen I'll summarize.\n", "I'll check.\n\n\nThen I'll summarize.", "\n", 1),
        ("\n\n" + CALL + "\nDone.", "Done.", "", 1),
        ("\n\nNo call here.\n", "\n\nNo call here.\n", "", 0),
    ],
)
async def test_a_live_tool_stream_keeps_the_whitespace_a_whole_answer_keeps(tooled, text, content, sent_ahead, calls):
    """Text, a call written as text, then more text: a live stream dropped the whitespace between
    the text before the call and the text after it (found from outside: 114 of 400 random
    answers differed from the whole answer in their whitespace), and sent the whitespace an
    answer that starts with a call started with, which a whole answer drops. That is held
    until text follows it. Only whitespace that went out with text, before a call was known,
    differs (a whole answer with a call strips it; one without keeps it, as the stream does)."""
    edge, upstream = tooled
    upstream.script_for("t", steps(*({"content": text[i : i + 4]} for i in range(0, len(text), 4))))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            whole = await client.chat.completions.create(model="live", messages=MESSAGES, tools=TOOLS)
            async with client.chat.completions.stream(model="live", messages=MESSAGES, tools=TOOLS) as stream:
                live = await stream.get_final_completion()
    assert whole.choices[0].message.content == content
    assert live.choices[0].message.content == sent_ahead + content
    assert len(live.choices[0].message.tool_calls or ()) == len(whole.choices[0].message.tool_calls or ()) == calls


async def test_native_parallel_tool_calls_reach_the_sdk(tooled):
    """Streamed native tool_calls deltas arrive as OpenAI tool calls with distinct indexes, ids and
    names, one call per chunk as OpenAI streams them (LlamaIndex read only a chunk's first call)."""
    edge, upstream = tooled
    upstream.script_for(
        "t",
        steps(
            *native_call(0, "call_a", "get_weather", '{"city": ', '"Paris"}'),
            *native_call(1, "call_b", "get_weather", '{"city": "Rome"}'),
            finish="tool_calls",
        ),
    )
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            stream = await client.chat.completions.create(model="native", messages=MESSAGES, tools=TOOLS, stream=True)
            chunks = [c async for c in stream]
            whole = await client.chat.completions.create(model="native", messages=MESSAGES, tools=TOOLS)
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0, 1]
    assert [len(c.choices[0].delta.tool_calls) for c in chunks if c.choices[0].delta.tool_calls] == [1, 1]
    assert [(d.id, d.type, d.function.name) for d in deltas] == [
        ("call_a", "function", "get_weather"),
        ("call_b", "function", "get_weather"),
    ]
    assert [json.loads(d.function.arguments) for d in deltas] == [{"city": "Paris"}, {"city": "Rome"}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    calls = whole.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert upstream.records[0].body["tools"] == TOOLS  # native: the tools go upstream as they are


async def test_native_calls_hide_call_markup_in_the_text(tooled):
    """Native calls and <tool_call> markup in the same turn: the native calls are the
    turn's; the markup never reaches the client (the seeds' rule), streamed or not."""
    edge, upstream = tooled
    upstream.script_for(
        "t",
        steps(
            {"content": "I will call. " + text_call("get_time", {})},
            *native_call(0, "call_a", "get_weather", '{"city": "Paris"}'),
            finish="tool_calls",
        ),
    )
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            stream = await client.chat.completions.create(model="native", messages=MESSAGES, tools=TOOLS, stream=True)
            chunks = [c async for c in stream]
            whole = await client.chat.completions.create(model="native", messages=MESSAGES, tools=TOOLS)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content == "I will call."
    names = [tc.function.name for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert names == [c.function.name for c in whole.choices[0].message.tool_calls] == ["get_weather"]


async def test_native_calls_without_index_are_told_apart(tooled):
    """A server that sends each call whole, several in one delta and with no index:
    each is its own call, and a later fragment with no index continues the last one."""
    edge, upstream = tooled
    whole_calls = [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{"}},
    ]
    upstream.script_for(
        "t", steps({"tool_calls": whole_calls}, {"tool_calls": [{"function": {"arguments": "}"}}]}, finish="tool_calls")
    )
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            whole = await client.chat.completions.create(model="native", messages=MESSAGES, tools=TOOLS)
    calls = whole.choices[0].message.tool_calls
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("call_a", "get_weather", {"city": "Paris"}),
        ("call_b", "get_time", {}),
    ]


async def test_tool_calls_written_as_text_become_real_calls(tooled):
    """<tool_call> markup in text becomes tool calls; text around stays content; no markup leaks."""
    edge, upstream = tooled
    text = "Let me check. " + text_call("get_weather", {"city": "Paris"}) + text_call("get_time", {})
    upstream.script_for("t", steps({"content": text}))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            whole = await client.chat.completions.create(model="native", messages=MESSAGES, tools=TOOLS)
    message = whole.choices[0].message
    assert message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c.id.startswith("call_") for c in message.tool_calls)
    assert whole.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "text",
    [
        "Wrap calls in a <tool_call> tag, or {{tool_call}} in the other form, like the docs say.",
        "Wrap calls like <tool_call></tool_call> tags.",
        "See <tool_call><name> here, or <tool_call> <b>bold</b>, or <tool_call><func",
    ],
)
@pytest.mark.parametrize("name", ["native", "live"])
async def test_prose_that_names_the_call_tag_is_text(tooled, name, text):
    """An answer that only names the tag ("wrap calls in a <tool_call> tag") was read as a call
    that is not JSON, retried and failed the request (an outside audit): a block is a call's only
    when its body begins as JSON does, or as Qwen3-Coder's `<function=`. An empty block, or one
    of other markup, was read as a call (the next audit). Whole and streamed, split where the
    body begins, one run, the text as written."""
    edge, upstream = tooled
    cut = text.index("<tool_call>") + len("<tool_call>") + 2
    with trio.fail_after(BOUND):
        for stream in (False, True):
            upstream.script_for("t", steps({"content": text[:cut]}, {"content": text[cut:]}))
            assert await answer_of(edge, name, TOOLS, stream) == (text, "", [])
    assert len(upstream.records) == 2  # (no retry)


async def test_a_live_stream_never_passes_on_a_think_tag_after_a_call(tooled):
    """A live stream of a model not known to open <think>: reasoning, a call written inside it,
    `</think>`, the answer. The call ended the watch for a stray `</think>`, which then went to
    the client as content (found from outside). The tag is dropped; the call, gone out before
    the tag said it was reasoning, stays one (the README says so)."""
    edge, upstream = tooled
    upstream.script_for(
        "t", steps({"content": "Thinking "}, {"content": CALL}, {"content": "</think>"}, {"content": "Answer"})
    )
    with trio.fail_after(BOUND):
        content, reasoning, calls = await answer_of(edge, "live", TOOLS, True)
    assert "think>" not in content and "tool_call" not in content, content
    assert content == "Thinking Answer" and [c.function.name for c in calls] == ["get_time"]


async def test_tool_call_tag_split_across_deltas(tooled):
    """A tag split across deltas (<tool_ca + ll>) is still a call, and no markup reaches the client."""
    edge, upstream = tooled
    call = text_call("get_weather", {"city": "Rome"})
    upstream.script_for(
        "t", steps({"content": "On it "}, {"content": call[:8]}, {"content": call[8:30]}, {"content": call[30:]})
    )
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "native", "messages": MESSAGES, "tools": TOOLS, "stream": True}
            )
    assert b"tool_call>" not in r.content and b"<tool_ca" not in r.content
    chunks = [msgspec.json.decode(e) for e in sse_events(r.content)[:-1]]
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome"})
    ]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "On it"


async def test_mustache_form_is_parsed(tooled):
    """The mustache form {{tool_call}}…{{/tool_call}} is a tool call too."""
    edge, upstream = tooled
    upstream.script_for("t", steps({"content": '{{tool_call}}{"name": "get_time", "arguments": {}}{{/tool_call}}'}))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            whole = await client.chat.completions.create(model="native", messages=MESSAGES, tools=TOOLS)
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["get_time"]


def bad_then_good(bad_args, good_args, name="get_weather"):
    def script(body):
        corrected = any("That is invalid" in str(m.get("content")) for m in body["messages"])
        args = good_args if corrected else bad_args
        return steps({"content": text_call(name if corrected else "get_weather", args)})

    return script


async def test_invalid_arguments_are_retried_with_a_corrective_message(tooled):
    """Arguments that break the schema are retried as a new run; the upstream saw exactly two
    requests, the second with the corrective message; the client sees only the valid call."""
    edge, upstream = tooled
    upstream.script_for("t", bad_then_good({"town": "Paris"}, {"city": "Paris"}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "native", "messages": MESSAGES, "tools": TOOLS, "stream": True}
            )
    chunks = [msgspec.json.decode(e) for e in sse_events(r.content)[:-1]]
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    assert len(upstream.records) == 2
    first, second = (rec.body["messages"] for rec in upstream.records)
    assert first == MESSAGES
    # One user turn with the client's last (two in a row failed the retry on templates that
    # need turns to alternate: Mistral, Gemma; an outside audit).
    assert [m["role"] for m in second] == [m["role"] for m in MESSAGES] == ["user"]
    assert second[-1]["content"].startswith(MESSAGES[-1]["content"] + "\n\nYour previous reply")
    assert "city" in second[-1]["content"] and "That is invalid" in second[-1]["content"]
    assert b"town" not in r.content


@pytest.mark.parametrize("name", ["native", "live"])
@pytest.mark.parametrize("stream", [False, True])
async def test_the_whole_calls_of_a_run_cut_by_max_tokens_are_checked(tooled, name, stream):
    """A run cut by max_tokens went out with its calls unchecked (an outside audit): a whole call
    to a tool the request does not have, under tool_choice none, reached the client, streamed
    and not. Its whole calls are checked as any (and retried: the client never sees them); a
    last call cut in its arguments is still the client's, with ``length``."""
    edge, upstream = tooled

    def script(body):
        if "That is invalid" in str(body["messages"][-1]):
            return steps({"content": "No tool needed."})
        return steps(*native_call(0, "c1", "rm_rf", '{"path": "/"}'), finish="length")

    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        content, _, calls = await answer_of_choice(edge, name, stream, tool_choice="none")
        assert (content, calls) == ("No tool needed.", []), (content, calls)
        assert len(upstream.records) == 2
        # A schema-breaking whole call before a cut one: retried too.
        upstream.records.clear()
        cut = [*native_call(0, "c1", "get_weather", '{"town": "Rome"}'), *native_call(1, "c2", "get_time", '{"a')]
        good = steps(*native_call(0, "c3", "get_weather", '{"city": "Rome"}'), finish="tool_calls")
        upstream.script_for("t", lambda body: good if "That is invalid" in str(body) else steps(*cut, finish="length"))
        content, _, calls = await answer_of_choice(edge, name, stream)
        assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Rome"}')]
        # Only the cut call (in its arguments, or right after its name): the client's, as it came.
        for cut_call, arguments in (('{"city": "Ro', '{"city": "Ro'), (None, "{}")):
            upstream.records.clear()
            parts = (cut_call,) if cut_call else ()
            upstream.script_for("t", steps(*native_call(0, "c4", "get_weather", *parts), finish="length"))
            content, _, calls = await answer_of_choice(edge, name, stream)
            assert [c.function.arguments for c in calls if c.function.arguments] == [arguments], calls
            assert len(upstream.records) == 1
        # parallel_tool_calls false holds for a cut run too (a re-check: two calls, whole answers).
        two = [*native_call(0, "c6", "get_time", "{}"), *native_call(1, "c7", "get_time", "{}")]
        upstream.script_for("t", steps(*two, finish="length"))
        content, _, calls = await answer_of_choice(edge, name, stream, parallel_tool_calls=False)
        assert len({c.id for c in calls if c.id}) == 1, calls


async def answer_of_choice(edge, name: str, stream: bool, **body) -> tuple[str, str, list]:
    """:func:`answer_of` with more of the request's fields."""
    async with sdk(edge) as client:
        if not stream:
            reply = await client.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS, **body)
            return reply.choices[0].message.content or "", "", reply.choices[0].message.tool_calls or []
        chunks = [
            c.choices[0].delta
            async for c in await client.chat.completions.create(
                model=name, messages=MESSAGES, tools=TOOLS, stream=True, **body
            )
            if c.choices
        ]
    content = "".join(d.content or "" for d in chunks)
    return content, "", [call for d in chunks for call in d.tool_calls or ()]


async def test_invalid_twice_is_a_tool_validation_error(tooled):
    """Still invalid after the last attempt: SSE error tool_validation_error; non-streaming 502 of that type.
    The failed stream logs its one summary line, as every stream does (it logged none)."""
    edge, upstream = tooled
    upstream.script_for("t", steps({"content": text_call("get_weather", {"city": 3})}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            with structlog.testing.capture_logs([structlog.contextvars.merge_contextvars]) as logs:
                r = await client.post(
                    "/v1/chat/completions",
                    json={"model": "native", "messages": MESSAGES, "tools": TOOLS, "stream": True},
                )
            summaries = [e for e in logs if e["event"] == "stream closed"]
            assert len(summaries) == 1 and summaries[0]["buffered"] and summaries[0]["run_id"], summaries
            events = sse_events(r.content)
            assert events[-1] == b"[DONE]"
            err = msgspec.json.decode(events[-2])["error"]
            assert err["type"] == "tool_validation_error" and "get_weather" in err["message"]
            assert err["code"] == "invalid_tool_call"  # (the Vercel AI SDK retried a null code)
            assert not any(b"tool_calls" in e for e in events)
            assert len(upstream.records) == 2
            r = await client.post(
                "/v1/chat/completions", json={"model": "native", "messages": MESSAGES, "tools": TOOLS}
            )
    assert r.status_code == 502
    assert r.json()["error"]["type"] == "tool_validation_error"
    assert len(upstream.records) == 4


TREE = {
    "type": "function",
    "function": {
        "name": "tree",
        "parameters": {
            "$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}},
            "$ref": "#/$defs/node",
        },
    },
}


def _tree(depth: int) -> dict:
    args: dict = {}
    for _ in range(depth):
        args = {"child": args}
    return args


async def test_arguments_too_deep_for_a_recursive_schema_are_said_so_not_a_loop(tooled):
    """A recursive schema (a tree through `$ref`) and arguments 400 levels deep: the check ran
    out of stack, and the error blamed the schema, "its schema loops on them", which it does
    not (found from outside). It names the arguments' depth; 100 levels pass."""
    edge, upstream = tooled
    upstream.script_for(
        "t",
        lambda body: steps(
            *native_call(0, "c", "tree", json.dumps(_tree(400 if len(upstream.records) <= 2 else 100))),
            finish="tool_calls",
        ),
    )
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            body = {"model": "native", "messages": MESSAGES, "tools": [TREE]}
            refused = await client.post("/v1/chat/completions", json=body)
            passed = await client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 502, refused.text
    message = refused.json()["error"]["message"]
    assert "nested too deeply" in message and "loops" not in message, message
    assert passed.status_code == 200, passed.text
    assert json.loads(passed.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == _tree(100)


async def test_unknown_function_name_is_invalid(tooled):
    """A call to a function the request does not offer is invalid (and retried)."""
    edge, upstream = tooled
    upstream.script_for("t", lambda body: steps({"content": text_call("launch_rockets", {})}))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(model="native", messages=MESSAGES, tools=TOOLS)
    assert caught.value.status_code == 502
    assert "launch_rockets" in caught.value.message
    assert "launch_rockets" in upstream.records[1].body["messages"][-1]["content"]


async def test_tool_choice_required_and_named(tooled):
    """tool_choice required rejects a text-only turn; a named function rejects calls to others."""
    edge, upstream = tooled
    upstream.script_for("t", steps({"content": "It is sunny."}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "native", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"},
            )
            assert r.status_code == 502 and "requires a call" in r.json()["error"]["message"]
            upstream.script_for("t", steps({"content": text_call("get_time", {})}))
            named = {"type": "function", "function": {"name": "get_weather"}}
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "native", "messages": MESSAGES, "tools": TOOLS, "tool_choice": named},
            )
            assert r.status_code == 502 and "requires `get_weather`" in r.json()["error"]["message"]
            upstream.script_for("t", steps({"content": text_call("get_weather", {"city": "Oslo"})}))
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "native", "messages": MESSAGES, "tools": TOOLS, "tool_choice": named},
            )
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


async def test_tool_choice_none_accepts_text(tooled):
    """tool_choice none: a text answer is fine and any call would be invalid."""
    edge, upstream = tooled
    upstream.script_for("t", steps({"content": "No tools needed."}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "native", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"},
            )
    assert r.json()["choices"][0]["message"]["content"] == "No tools needed."


async def test_model_without_native_tools_gets_tools_in_its_prompt(tooled):
    """native_tools = false: tools are described in a system prompt, earlier calls and results are
    rendered as text, and the text answer comes back as a real tool call."""
    edge, upstream = tooled
    upstream.script_for("t", steps({"content": text_call("get_weather", {"city": "Rome"})}))
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C sunny"},
    ]
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            whole = await client.chat.completions.create(model="textonly", messages=history, tools=TOOLS)
    (call,) = whole.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
    sent = upstream.records[0].body
    assert "tools" not in sent and "tool_choice" not in sent
    system = sent["messages"][0]
    assert system["role"] == "system" and "get_weather" in system["content"] and "<tool_call>" in system["content"]
    earlier = sent["messages"][2]
    assert earlier["role"] == "assistant" and earlier["content"].startswith("<tool_call>")
    assert json.loads(earlier["content"][len("<tool_call>") : -len("</tool_call>")]) == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert sent["messages"][3]["role"] == "user" and "18C sunny" in sent["messages"][3]["content"]


async def test_a_model_without_native_tools_reads_content_parts_as_text(tooled):
    """native_tools = false with content as arrays of parts (valid chat, and what Qwen Code sends):
    an assistant turn's text beside its calls was a 500 (a list joined as a string), a tool
    result's parts reached the model as escaped JSON, and a system message of parts stayed an
    array beside the edge's tool prompt as a second system message. Each is text now, a part a
    line as vLLM joins them (they were run together), a part without text named as left out."""
    edge, upstream = tooled
    upstream.script_for("t", steps({"content": "Done."}))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [
                {"type": "text", "text": "Line 1"},
                {"type": "text", "text": "Line 2"},
                {"type": "file", "file": {"file_id": "file-1"}},
            ],
        },
    ]
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            for stream in (False, True):
                answer = await client.chat.completions.create(
                    model="textonly", messages=history, tools=TOOLS, stream=stream
                )
                if stream:
                    answer = [chunk async for chunk in answer]
    assert len(upstream.records) == 2
    sent = upstream.records[0].body["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[0]["content"].startswith("You are terse.\n\n") and "<tools>" in sent[0]["content"]
    assert sent[2]["content"].startswith("Checking.\n<tool_call>")
    omitted = "[file omitted: a model without tool support is sent text only]"
    assert sent[3]["content"] == f"<tool_response>\nLine 1\nLine 2\n{omitted}\n</tool_response>"  # a part a line


async def test_a_model_without_native_tools_gets_results_in_a_row_as_one_user_turn(tooled):
    """native_tools = false: two tool results and the user's words after them (a string, or text
    parts as the Messages API converts Claude Code's turn), and a retry's correction after the
    user's message, are each one user turn: roles alternate, as the templates of Mistral's and
    Llama 2's models require (three user messages in a row were a 400 from vLLM there)."""
    edge, upstream = tooled
    calls = [
        {"id": f"call_{n}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{c}"}}'}}
        for n, c in ((1, "Oslo"), (2, "Rome"))
    ]
    history = [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sun"},
    ]
    words = [{"role": "user", "content": "And tomorrow?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "tomorrow?"}]}]
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            upstream.script_for("t", steps({"content": "Both done."}))
            for last in (words, parts):
                await client.chat.completions.create(model="textonly", messages=history + last, tools=TOOLS)
            upstream.script_for("t", bad_then_good({"town": "Oslo"}, {"city": "Oslo"}))
            await client.chat.completions.create(model="textonly", messages=MESSAGES, tools=TOOLS)
    said, in_parts, first, retry = (rec.body["messages"] for rec in upstream.records)
    assert [m["role"] for m in said] == ["system", "user", "assistant", "user"]
    results = "<tool_response>\nrain\n</tool_response>\n<tool_response>\nsun\n</tool_response>"
    assert said[3]["content"] == results + "\n\nAnd tomorrow?"
    assert in_parts[3]["content"] == results + "\n\nAnd\ntomorrow?"
    assert [m["role"] for m in first] == ["system", "user"] and [m["role"] for m in retry] == ["system", "user"]
    assert retry[1]["content"].startswith(first[1]["content"] + "\n\n") and "That is invalid" in retry[1]["content"]


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
async def test_tool_results_reach_the_model_in_the_order_of_its_calls(tooled, api):
    """Results sent back in the order the client's tools finished (Claude Code sent its Read's
    before its Bash's) reach the model in the order of its calls, on every API: a text-tools
    prompt shows results by position with no id, and so do chat templates that ignore the id,
    so the model read one call's output as the other's."""
    edge, upstream = tooled
    ids, outputs = ("c_a", "c_b", "c_c"), ("OUT-A", "OUT-B", "OUT-C")
    finished = (2, 0, 1)  # the order the results come back in
    ask = "Run all three."
    if api == "chat":
        calls = [{"id": i, "type": "function", "function": {"name": "get_time", "arguments": "{}"}} for i in ids]
        history = [
            {"role": "user", "content": ask},
            {"role": "assistant", "content": None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": ids[k], "content": outputs[k]} for k in finished),
        ]
        body, path = {"messages": history, "tools": TOOLS}, "/v1/chat/completions"
    elif api == "messages":
        uses = [{"type": "tool_use", "id": i, "name": "get_time", "input": {}} for i in ids]
        results = [{"type": "tool_result", "tool_use_id": ids[k], "content": outputs[k]} for k in finished]
        history = [{"role": "user", "content": ask}, {"role": "assistant", "content": uses}]
        history.append({"role": "user", "content": results})
        tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
        body, path = {"messages": history, "tools": tools, "max_tokens": 50}, "/v1/messages"
    else:
        items = [{"role": "user", "content": ask}]
        items += [{"type": "function_call", "call_id": i, "name": "get_time", "arguments": "{}"} for i in ids]
        items += [{"type": "function_call_output", "call_id": ids[k], "output": outputs[k]} for k in finished]
        tools = [{"type": "function", **t["function"]} for t in TOOLS]
        body, path = {"input": items, "tools": tools}, "/v1/responses"
    upstream.script_for("t", steps({"content": "Done."}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for name in ("native", "textonly"):
                response = await client.post(path, json={**body, "model": name})
                assert response.status_code == 200, response.text
    native, text = (rec.body["messages"] for rec in upstream.records)
    assert [m.get("tool_call_id") for m in native if m["role"] == "tool"] == list(ids)
    assert [m["content"] for m in native if m["role"] == "tool"] == list(outputs)
    shown = text[-1]["content"]
    assert [shown.index(out) for out in outputs] == sorted(shown.index(out) for out in outputs), shown


async def test_assistant_turns_in_a_row_are_one_turn_with_its_results_after_it(tooled):
    """Messages' consecutive assistant turns (a text turn after one of calls) and a Responses
    preamble message between two calls are one assistant message, as Anthropic merges turns of
    one role: its calls' results then follow it, in call order. The Messages history was a 400
    (a call "without a result immediately after"); the Responses one left the first call's
    result behind the second's."""
    edge, upstream = tooled
    tools = [{"name": "get_time", "input_schema": {"type": "object"}}]
    uses = [{"type": "tool_use", "id": "a", "name": "get_time", "input": {}}]
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": uses},
        {"role": "assistant", "content": [{"type": "text", "text": "more"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "OUT-A"}]},
    ]
    items = [
        {"role": "user", "content": "Time?"},
        {"type": "function_call", "call_id": "a", "name": "get_time", "arguments": "{}"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "mid"}]},
        {"type": "function_call", "call_id": "b", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "b", "output": "OUT-B"},
        {"type": "function_call_output", "call_id": "a", "output": "OUT-A"},
    ]
    upstream.script_for("t", steps({"content": "Done."}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            body = {"model": "native", "max_tokens": 50, "tools": tools, "messages": messages}
            m = await client.post("/v1/messages", json=body)
            tools_r = [{"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
            r = await client.post("/v1/responses", json={"model": "native", "input": items, "tools": tools_r})
    assert m.status_code == 200, m.text
    assert r.status_code == 200, r.text
    said, answered = (rec.body["messages"] for rec in upstream.records)
    assert [(x["role"], x.get("content"), [c["id"] for c in x.get("tool_calls", [])]) for x in said[1:]] == [
        ("assistant", "more", ["a"]),
        ("tool", "OUT-A", []),
    ]
    assert [x["role"] for x in answered] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in answered[1]["tool_calls"]] == ["a", "b"] and "mid" in str(answered[1]["content"])
    assert [x["content"] for x in answered[2:]] == ["OUT-A", "OUT-B"]


async def test_a_model_without_native_tools_gets_an_image_turn_joined_with_the_text_around_it(tooled):
    """native_tools = false: tool results, then the user's message with an image, then a retry's
    correction are one user turn of parts, in order (the image turn kept its own, and the
    correction was a third user turn in a row on the retry); a turn of two speakers' words
    carries no one name."""
    edge, upstream = tooled
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA="}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "user", "content": [{"type": "text", "text": "And this sky?"}, image]},
    ]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for("t", bad_then_good({"town": "Oslo"}, {"city": "Oslo"}))
            r = await client.post(
                "/v1/chat/completions", json={"model": "textonly", "messages": messages, "tools": TOOLS}
            )
            assert r.status_code == 200, r.text
            upstream.script_for("t", steps({"content": "Hi."}))
            # (A user message with no content is OpenAI's 400, and the edge's: it was joined to the next.)
            nothing = [{"role": "user", "content": None}, {"role": "user", "content": "hi"}]
            r = await client.post("/v1/chat/completions", json={"model": "textonly", "messages": nothing})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "messages[0].content")
            two = [
                {"role": "user", "name": "ann", "content": [image]},
                {"role": "user", "name": "bob", "content": "hi"},
            ]
            r = await client.post("/v1/chat/completions", json={"model": "textonly", "messages": two, "tools": TOOLS})
            assert r.status_code == 200, r.text
    first, retry, named = (rec.body["messages"] for rec in upstream.records)
    assert named[1]["content"] == [image, {"type": "text", "text": "hi"}] and "name" not in named[1]  # (not ann's)
    for sent in (first, retry):
        assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    turn = [{"type": "text", "text": "<tool_response>\nrain\n</tool_response>"}, *messages[3]["content"]]
    assert first[3]["content"] == turn
    assert retry[3]["content"][:3] == turn and "That is invalid" in retry[3]["content"][3]["text"]


async def test_a_model_without_native_tools_sees_a_tool_results_image_after_the_results(tooled):
    """native_tools = false: an image in a tool result was "[image omitted: a model without tool
    support is sent text only]" while the user's own images were sent (an outside audit). It now
    follows the results in the same user turn, after a line naming its call, as on the Messages
    and Responses APIs; the result's text says where it went."""
    edge, upstream = tooled
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA="}}
    messages = [
        {"role": "user", "content": "Screenshot?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "shot"}, image]},
        {"role": "user", "content": "What is on it?"},
    ]
    upstream.script_for("t", steps({"content": "A pixel."}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "textonly", "messages": messages, "tools": TOOLS}
            )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "A pixel.", r.text
    sent = upstream.records[0].body["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[3]["content"] == [
        {
            "type": "text",
            "text": "<tool_response>\nshot\n[image: in the user message after the tool results]\n</tool_response>"
            "\n\nWhat is on it?",
        },
        {"type": "text", "text": "[images of the tool result call_1]"},
        image,
    ]


async def test_many_tool_results_for_a_model_without_native_tools_are_joined_in_one_pass(tooled):
    """2,000 tool results of 3.5 KB in a row (7 MB, under the body limit) for a native_tools = false
    model: one user turn, joined once at its end (each result joined onto the turn so far copied
    it again: 1.8-5.9 s of a frozen edge for 8 MB, measured; 0.01 s now. The time varies too much
    between machines for an assertion here: the bound is the test's)."""
    edge, upstream = tooled
    upstream.script_for("t", steps({"content": "Done."}))
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "get_time", "arguments": "{}"}} for i in range(2000)
    ]
    history = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": f"c{i}", "content": "x" * 3500} for i in range(2000)),
    ]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "textonly", "messages": history, "tools": TOOLS}
            )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Done."
    sent = upstream.records[0].body["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[3]["content"].count("<tool_response>") == 2000


async def test_live_tool_stream_streams_text_and_validates_calls(tooled):
    """tool_stream = "live": content streams as it comes, the call arrives at the end; an invalid
    call after content was sent is an SSE tool_validation_error, with no retry (the upstream saw
    one request for each)."""
    edge, upstream = tooled
    upstream.script_for(
        "t",
        steps(
            {"content": "Checking "}, {"content": "now. <tool_"}, {"content": "call>" + text_call("get_time", {})[11:]}
        ),
    )
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "live", "messages": MESSAGES, "tools": TOOLS, "stream": True}
            )
            chunks = [msgspec.json.decode(e) for e in sse_events(r.content)[:-1]]
            contents = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"][0]["delta"].get("content")]
            assert "".join(contents) == "Checking now. "  # the text before the call, byte for byte
            calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
            assert [c["function"]["name"] for c in calls] == ["get_time"]
            upstream.script_for("t", steps({"content": "Sure "}, {"content": text_call("get_weather", {})}))
            r = await client.post(
                "/v1/chat/completions", json={"model": "live", "messages": MESSAGES, "tools": TOOLS, "stream": True}
            )
    events = sse_events(r.content)
    assert msgspec.json.decode(events[1])["choices"][0]["delta"]["content"] == "Sure "
    error = msgspec.json.decode(events[-2])["error"]
    # (the code's word "invalid" is what the Vercel AI SDK takes as final; it retried a null one)
    assert (error["type"], error["code"]) == ("tool_validation_error", "invalid_tool_call")
    assert len(upstream.records) == 2


def _invalid_then(valid_steps):
    """A script: an invalid call (no content before it) first; ``valid_steps`` for the retry."""

    def script(body):
        if "That is invalid" in str(body["messages"][-1]):
            return valid_steps
        return steps({"content": text_call("get_weather", {"town": "Paris"})})

    return script


async def test_a_live_tool_stream_retries_invalid_calls_before_any_content(tooled):
    """tool_stream = "live": a run whose call is invalid before any content went out (the role
    chunk alone) is retried on the same stream, as a buffered one is: the upstream saw the
    corrective message, the SDK gets the valid call in a stream of one id, and no error."""
    edge, upstream = tooled
    upstream.script_for("t", _invalid_then(steps({"content": text_call("get_weather", {"city": "Rome"})})))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            stream = await client.chat.completions.create(
                model="live", messages=MESSAGES, tools=TOOLS, stream=True, stream_options={"include_usage": True}
            )
            chunks = [c async for c in stream]
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    assert {c.id for c in chunks} == {chunks[0].id}
    assert [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role] == ["assistant"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].usage is not None
    assert len(upstream.records) == 2
    corrective = upstream.records[1].body["messages"][-1]
    assert corrective["role"] == "user" and "town" in corrective["content"]


async def test_a_live_retrys_reasoning_is_apart_from_the_reasoning_shown_before_it(tooled):
    """A live tool stream shows the first attempt's reasoning before its invalid call; the retry's
    reasoning followed it with nothing between ("plan Aplan B": an outside audit). It starts a
    paragraph of its own; a whole answer has the answering run's alone."""

    def script(body):
        if "That is invalid" in str(body["messages"][-1]):
            return steps({"reasoning_content": "plan B"}, {"content": text_call("get_weather", {"city": "Rome"})})
        return steps({"reasoning_content": "plan A"}, {"content": text_call("get_weather", {"town": "Rome"})})

    edge, upstream = tooled
    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        _, streamed, calls = await answer_of(edge, "live", TOOLS, stream=True)
        _, whole, _ = await answer_of(edge, "live", TOOLS, stream=False)
    assert (streamed, whole) == ("plan A\n\nplan B", "plan B")
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Rome"}]


async def test_a_live_tool_stream_out_of_attempts_or_failing_its_retry_is_an_sse_error(tooled):
    """Still invalid at the last attempt: tool_validation_error in the stream; the retry's run
    failing: tool_validation_retry_error. Neither sends a call."""
    edge, upstream = tooled
    body = {"model": "live", "messages": MESSAGES, "tools": TOOLS, "stream": True}
    still_invalid = steps({"content": text_call("get_weather", {"town": "Rome"})})
    failing = [("status", 500, b'{"error": {"message": "boom", "type": "server_error"}}')]
    for retry, want in ((still_invalid, "tool_validation_error"), (failing, "tool_validation_retry_error")):
        upstream.records.clear()
        upstream.script_for("t", _invalid_then(retry))
        with trio.fail_after(BOUND):
            async with http(edge) as client:
                r = await client.post("/v1/chat/completions", json=body)
        events = sse_events(r.content)
        assert msgspec.json.decode(events[-2])["error"]["type"] == want
        assert b"tool_calls" not in r.content
        assert len(upstream.records) == 2


async def test_leaving_during_a_live_tool_retry_aborts_it_upstream(tooled):
    """The client leaves while a live stream's retry runs: the retry's request is aborted at the
    model server, as the first run's would be."""
    edge, upstream = tooled
    upstream.script_for("t", _invalid_then([("chunk", {"content": "<tool_"}), ("hang",)]))
    body = {"model": "live", "messages": MESSAGES, "tools": TOOLS, "stream": True}
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as clients:

            async def client():
                async with http(edge) as c:
                    await c.post("/v1/chat/completions", json=body)

            clients.start_soon(client)
            retry = (await upstream.wait_requests(2))[1]
            clients.cancel_scope.cancel()
        await retry.finished.wait()
    assert retry.aborted


async def test_bad_tool_schema_is_a_400(tooled):
    """A tool whose parameters are not a valid JSON Schema is refused before any node is bothered."""
    edge, upstream = tooled
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "native", "messages": MESSAGES, "tools": [bad]}
            )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert upstream.records == []


def _fn(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


_DRAFT3 = "http://json-schema.org/draft-03/schema#"
_DRAFT4 = "http://json-schema.org/draft-04/schema#"


async def test_schemas_jsonschema_stumbles_on_are_400s_naming_the_tool_on_every_api(tooled):
    """What a dialect's metaschema lets through but jsonschema cannot check: a `$schema` that
    is not a string, draft-03 (any name is a type there), draft-04's `"$ref": 1` (no rule for
    it). Each was a 500 "Internal error in the edge" on all three APIs (an outside audit);
    each is a 400 naming the tool, before any node is bothered."""
    edge, upstream = tooled
    problems = [
        ({"$schema": 1, "type": "object"}, "`$schema` must be a string"),
        ({"$schema": ["a"], "type": "object"}, "`$schema` must be a string"),
        ({"$schema": _DRAFT3, "type": ["#"]}, "draft-03"),
        ({"$schema": _DRAFT4, "$ref": 1}, "cannot be checked"),
        ({"$schema": _DRAFT4, "$ref": {"$ref": "#"}}, "cannot be checked"),
        # a reference whose pointer walks into a list or a number (ValueError, TypeError: a 500)
        ({"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/required/a"}}}, "does not resolve"),
        ({"type": "object", "minimum": 5, "properties": {"a": {"$ref": "#/minimum/x"}}}, "does not resolve"),
    ]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for parameters, said in problems:
                for path, body in (
                    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [_fn("f", parameters)]}),
                    (
                        "/v1/responses",
                        {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": parameters}]},
                    ),
                    (
                        "/v1/messages",
                        {"max_tokens": 5, "messages": MESSAGES, "tools": [{"name": "f", "input_schema": parameters}]},
                    ),
                ):
                    r = await client.post(path, json={"model": "native", **body})
                    assert r.status_code == 400, (path, parameters, r.text)
                    message = r.json()["error"]["message"]
                    assert "`f`" in message and said in message, (path, message)
    assert upstream.records == []


async def test_a_call_jsonschema_stumbles_on_is_a_failed_check_not_a_500(tooled):
    """A draft-04 reference that is no string below the root, where an empty object does not
    reach it: the model's arguments do. Its check raised AttributeError (a 500 once the run
    ended); now the call fails its check, is retried with the reason, and the turn ends as a
    turn of invalid calls does."""
    edge, upstream = tooled
    parameters = {"$schema": _DRAFT4, "type": "object", "properties": {"a": {"$ref": 5}}}
    upstream.script_for("t", lambda body: steps(*native_call(0, "c", "f", '{"a": 1}'), finish="tool_calls"))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            body = {"model": "native", "messages": MESSAGES, "tools": [_fn("f", parameters)]}
            r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert "could not be checked: AttributeError" in message, message
    assert len(upstream.records) == 2  # (the retry, told why)
    assert "could not be checked" in upstream.records[1].body["messages"][-1]["content"]


async def test_a_tool_schema_that_takes_no_object_is_a_400(tooled):
    """A call's arguments are a JSON object: parameters of another type, `not: {}`, or a `false`
    schema taken in whole, failed every call, and each request spent its two attempts on the model server before a 502
    tool_validation_error that blamed the model (an outside audit). It is a 400 naming the
    tool; a schema that takes an object among other types is served."""
    edge, upstream = tooled

    def tool(parameters):
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    refused = [
        {"type": "string"},
        {"type": ["array", "null"]},
        {"not": {}},
        {"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}},
        {"allOf": [{"type": "integer"}]},
        {"const": 5},
        {"enum": [1, "x"]},
        {"anyOf": [{"type": "string"}, {"allOf": [{"type": "integer"}]}]},
        {"oneOf": [{"type": "string"}, {"type": "null"}]},
        # a `false` schema takes nothing (accepted, each call failed: a re-check)
        {"allOf": [True, False]},
        {"anyOf": [False, {"type": "string"}]},
        {"$ref": "#/$defs/no", "$defs": {"no": False}},
        {"anyOf": [False, {"$ref": "#/$defs/f"}], "$defs": {"f": False}},  # (through a branch: a re-check)
        {"anyOf": [False, {"allOf": [False]}]},
    ]
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            for parameters in refused:
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(
                        model="native", messages=MESSAGES, tools=[tool(parameters)], tool_choice="required"
                    )
                message = e.value.body["message"]
                assert e.value.body["param"] == "tools" and "`f`" in message, e.value.body
                # (said as is: it was wrapped in "it cannot be checked: SchemaProblem: ...")
                assert "takes no JSON object" in message and "cannot be checked" not in message, message
            assert upstream.records == []
            upstream.script_for("t", steps(*native_call(0, "call_a", "f", '{"a": 1}'), finish="tool_calls"))
            for parameters in (
                {"type": ["object", "null"]},
                {"if": {"maxProperties": 0}, "then": False},  # (the empty object alone is refused)
                {"anyOf": [False, {"type": "object"}]},
                # (draft-07: the keywords beside a $ref are not applied; it was refused: a re-check)
                {
                    "$schema": "http://json-schema.org/draft-07/schema#",
                    "$ref": "#/definitions/t",
                    "allOf": [False],
                    "definitions": {"t": {"type": "object"}},
                },
            ):
                served = await client.chat.completions.create(
                    model="native", messages=MESSAGES, tools=[tool(parameters)], tool_choice="required"
                )
                assert served.choices[0].message.tool_calls[0].function.name == "f"


async def test_tool_schema_references_never_fetch_and_unresolvable_ones_are_400(tooled, nursery):
    """`$ref` to http:// or file:// is never fetched; a reference that does not resolve, or loops, is a 400 naming the tool."""
    edge, upstream = tooled
    connections: list[trio.SocketStream] = []

    async def hold(stream: trio.SocketStream) -> None:
        connections.append(stream)
        await trio.sleep_forever()  # a host that never answers: a fetch would freeze the edge

    listeners = await nursery.start(partial(trio.serve_tcp, hold, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    refs = [f"http://127.0.0.1:{port}/schema.json", "file:///etc/passwd", "#/x", "#"]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for ref in refs:
                tool = {"type": "function", "function": {"name": "lookup", "parameters": {"$ref": ref}}}
                r = await client.post(
                    "/v1/chat/completions", json={"model": "native", "messages": MESSAGES, "tools": [tool]}
                )
                assert r.status_code == 400, (ref, r.text)
                error = r.json()["error"]
                assert error["param"] == "tools" and "`lookup`" in error["message"], error
            # A loop below the root, through references and allOf: found only when a model's
            # arguments reached it, after the turn's runs (a 502: an outside audit). A 400, no run.
            mutual = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}}
            for parameters in (
                {**mutual, "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]},
                {**mutual, "properties": {"x": {"items": {"anyOf": [{"$ref": "#/$defs/b"}]}}}},
            ):
                tool = {"type": "function", "function": {"name": "lookup", "parameters": parameters}}
                r = await client.post(
                    "/v1/chat/completions", json={"model": "native", "messages": MESSAGES, "tools": [tool]}
                )
                assert r.status_code == 400 and "loop without end" in r.json()["error"]["message"], r.text
            assert upstream.records == []
            local = {  # (a tree: its loop goes through properties and items, and ends with the instance)
                "type": "object",
                "properties": {"city": {"$ref": "#/$defs/city"}, "tree": {"$ref": "#/$defs/node"}},
                "$defs": {
                    "city": {"type": "string"},
                    "node": {"properties": {"children": {"items": {"$ref": "#/$defs/node"}}}},
                },
            }
            tool = {"type": "function", "function": {"name": "lookup", "parameters": local}}
            upstream.script_for("t", steps({"content": "fine"}))
            r = await client.post(
                "/v1/chat/completions", json={"model": "native", "messages": MESSAGES, "tools": [tool]}
            )
    assert r.status_code == 200, r.text
    assert connections == []


async def test_a_reference_inside_a_subschema_with_its_own_id_is_relative_to_that_id(tooled):
    """A reference below a subschema that names its own `$id` resolves against that id, as
    JSON Schema (and the check of a call's arguments) reads it. The edge looked every reference
    up from the root: a valid schema was refused ("does not resolve"), and a loop through such
    a subschema went unseen until a model's arguments reached it, the turn's runs spent (an
    outside audit). A `$ref` key inside a `default` value is data, not a reference: it was
    refused too."""
    edge, upstream = tooled
    nested = {
        "type": "object",
        "properties": {
            "city": {"$id": "https://example.com/city", "$defs": {"name": {"type": "string"}}, "$ref": "#/$defs/name"},
            "where": {"$ref": "https://example.com/city"},
            "opts": {
                "type": "object",
                "default": {"$ref": "not a reference"},
                "example": {"$ref": "nor this"},
                "x-meta": {"$ref": "nor an extension's"},
            },
        },
        "required": ["city"],
    }
    looped = {"type": "object", "properties": {"a": {"$id": "https://example.com/a", "allOf": [{"$ref": "#"}]}}}
    said = []

    def script(body):
        said.append(body["messages"][-1]["content"])
        city = 7 if len(said) == 1 else "Oslo"  # (the first call breaks the nested schema: retried)
        return steps({"content": text_call("lookup", {"city": city, "where": "here"})})

    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "native", "messages": MESSAGES, "tools": [_fn("lookup", nested)]},
            )
            assert r.status_code == 200, r.text
            calls = r.json()["choices"][0]["message"]["tool_calls"]
            assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo", "where": "here"}]
            assert len(said) == 2 and "7 is not of type 'string'" in said[1], said
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "native", "messages": MESSAGES, "tools": [_fn("lookup", looped)]},
            )
    assert r.status_code == 400 and "loop without end" in r.json()["error"]["message"], r.text
    assert len(upstream.records) == 2  # (the loop's request reached no node)


async def test_references_a_validator_never_applies_are_not_checked_and_applied_ones_are(tooled):
    """A `$ref` under a keyword JSON Schema does not know (an annotation), in a definition
    nothing references, or beside a draft-07 `$ref`, is never looked up by jsonschema, and the
    edge refused the schema when it did not resolve or looped (a 400 for a schema every client
    library accepts). They count only where a validator applies them: a reference into an
    annotation that does not resolve, or loops, is still refused before any run. A keyword of
    another dialect than the schema's is an annotation too."""
    edge, upstream = tooled
    accepted = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "x-note": "extensions were data already",
        "meta": {"$ref": "#/nowhere"},
        "loopy": {"allOf": [{"$ref": "#/loopy"}]},
        "$defs": {"unused": {"$ref": "#/nowhere/either"}},
    }
    draft7 = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {"s": {"type": "object", "properties": {"city": {"type": "string"}}}},
        "$ref": "#/definitions/s",
        "properties": {"city": {"$ref": "#/not/applied"}},
    }
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    others = [  # (another dialect's keywords are annotations: refused as loops or unresolved, a re-check)
        {"$schema": "http://json-schema.org/draft-07/schema#", **city, "$recursiveRef": "#"},
        {"$schema": "https://json-schema.org/draft/2019-09/schema", **city, "$dynamicRef": "#"},
        {"$schema": "http://json-schema.org/draft-07/schema#", **city, "prefixItems": [{"$ref": "#/nowhere"}]},
        {"$schema": "http://json-schema.org/draft-04/schema#", **city, "if": {"$ref": "#"}},
        # (then and else apply only beside an if: a second re-check)
        {"$schema": "http://json-schema.org/draft-07/schema#", **city, "then": {"$ref": "#"}},
        {"$schema": "http://json-schema.org/draft-07/schema#", **city, "else": {"$ref": "#/nowhere"}},
    ]
    refused = {
        "into a broken annotation": (
            {"type": "object", "properties": {"city": {"$ref": "#/meta"}}, "meta": {"$ref": "#/nowhere"}},
            "does not resolve",
        ),
        "into a looping annotation": (
            {"type": "object", "properties": {"city": {"$ref": "#/meta"}}, "meta": {"allOf": [{"$ref": "#/meta"}]}},
            "loop without end",
        ),
        "through draft-07 dependencies": (  # (accepted, then every call a 502: a second re-check)
            {"$schema": "http://json-schema.org/draft-07/schema#", **city, "dependencies": {"city": {"$ref": "#"}}},
            "loop without end",
        ),
        "into a broken definition": (
            {"type": "object", "properties": {"city": {"$ref": "#/$defs/d"}}, "$defs": {"d": {"$ref": "#/no"}}},
            "does not resolve",
        ),
    }
    said = []

    def script(body):
        said.append(body["messages"][-1]["content"])
        city = 7 if len(said) % 2 else "Oslo"  # (the first call of each request breaks the schema: retried)
        return steps({"content": text_call("lookup", {"city": city})})

    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for schema in (accepted, draft7, *others):
                r = await client.post(
                    "/v1/chat/completions",
                    json={"model": "native", "messages": MESSAGES, "tools": [_fn("lookup", schema)]},
                )
                assert r.status_code == 200, r.text
                calls = r.json()["choices"][0]["message"]["tool_calls"]
                assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}]
                assert "7 is not of type 'string'" in said[-1], said
            for what, (schema, message) in refused.items():
                r = await client.post(
                    "/v1/chat/completions",
                    json={"model": "native", "messages": MESSAGES, "tools": [_fn("lookup", schema)]},
                )
                assert r.status_code == 400 and message in r.json()["error"]["message"], (what, r.text)
    assert len(upstream.records) == 16  # (two runs each for the eight accepted; none for the refused)


async def test_retry_that_fails_is_a_tool_validation_retry_error(tooled):
    """When the retry run itself fails, the client gets tool_validation_retry_error."""
    edge, upstream = tooled

    def script(body):
        if any("That is invalid" in str(m.get("content")) for m in body["messages"]):
            return [("status", 500, b'{"error": {"message": "model crashed"}}')]
        return steps({"content": text_call("get_weather", {})})

    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "native", "messages": MESSAGES, "tools": TOOLS, "stream": True}
            )
    err = msgspec.json.decode(sse_events(r.content)[-2])["error"]
    assert err["type"] == "tool_validation_retry_error" and "model crashed" in err["message"]


async def test_keep_alive_flows_while_a_tool_stream_is_buffered(tooled):
    """A long tool-bearing generation is collected behind SSE keep-alive comments."""
    edge, upstream = tooled
    upstream.script_for("t", [("sleep", 0.7), *steps({"content": text_call("get_time", {})})])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "native", "messages": MESSAGES, "tools": TOOLS, "stream": True}
            )
    assert r.content.startswith(b": keep-alive\n\n: keep-alive\n\n")
    assert b'"get_time"' in r.content


async def test_retry_waiting_for_a_slot_keeps_the_stream_alive(nursery, upstream):
    """A tool retry that must queue for a node slot sends keep-alives while it waits (the stream has started)."""
    edge = await start_edge(nursery, edge_config(keepalive_s=0.2, queue_timeout_ms=10_000))
    await start_node(nursery, edge, [model("m", upstream, target="t", max_concurrency=1)])

    def script(body):
        text = str(body["messages"])
        if "hold the slot" in text:
            return [("sleep", 1.0), *steps({"content": "done"})]
        if "That is invalid" in text:
            return steps({"content": text_call("get_time", {})})
        return [
            ("sleep", 0.3),
            *steps({"content": text_call("get_time", {"x": 1, "y": []}).replace('"get_time"', '"nope"')}),
        ]

    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            result: list[httpx.Response] = []

            async def with_tools():
                result.append(
                    await client.post(
                        "/v1/chat/completions",
                        json={"model": "m", "messages": MESSAGES, "tools": TOOLS, "stream": True},
                    )
                )

            clients.start_soon(with_tools)
            await upstream.wait_requests(1)
            hold = [{"role": "user", "content": "hold the slot"}]
            clients.start_soon(partial(client.post, "/v1/chat/completions", json={"model": "m", "messages": hold}))
    raw = result[0].content
    assert b'"get_time"' in raw and b"error" not in raw
    assert raw.count(b": keep-alive\n\n") >= 4  # one while the first attempt ran, the rest while the retry queued
    assert [r.body["messages"][-1]["content"] for r in upstream.records][1] == "hold the slot"


@pytest.mark.parametrize("name", ["m", "live"])
async def test_a_client_gone_as_its_tool_retry_takes_a_slot_gives_the_slot_back(nursery, upstream, name):
    """The client's disconnect comes in the very instant its tool retry is handed a node's slot
    (found from outside: about 1 in 20-40 streamed tool clients leaving during retries held a slot
    for good, and a node of one slot then answered every request 429). The slot goes back, and the
    next request is served. Buffered and live tool streams."""
    edge = await start_edge(
        nursery, edge_config(models=[{"name": "live", "tool_stream": "live"}], keepalive_s=0.2, queue_timeout_ms=1000)
    )
    await start_node(
        nursery, edge, [model("m", upstream, target="t", max_concurrency=1), model("live", upstream, target="t")]
    )
    upstream.script_for("t", _invalid_then(steps({"content": text_call("get_time", {})})))
    runs = edge.edge.runs
    acquire = runs.acquire
    slots = []

    async def acquire_then_leave(want, client=None):
        slot = await acquire(want, client)
        slots.append(slot)
        if len(slots) == 2:  # the retry's: hypercorn hears the client's disconnect in this instant
            client._scope.cancel()
        return slot

    runs.acquire = acquire_then_leave
    body = {"model": name, "messages": MESSAGES, "tools": TOOLS, "stream": True}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            with pytest.raises(httpx.RemoteProtocolError):  # (the edge takes it as gone: it ends the stream)
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    await r.aread()
            assert len(slots) == 2, "the retry took a slot"
            await eventually(lambda: all(slot.released for slot in slots), what="both slots given back")
            runs.acquire = acquire
            upstream.script_for("t", steps({"content": "served"}))
            r = await client.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "served"
    assert runs.links["n1"].in_flight[name] == 0


async def test_a_tool_calls_end_without_a_call_is_stop(tooled):
    """A model server that ends with `tool_calls` but sent no call: the client sees `stop`, not a
    finish that promises calls it then does not find (SDK loops index `message.tool_calls`).
    Streamed (live and collected) and whole, with and without tools."""
    edge, upstream = tooled
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            for name, tools in (("native", TOOLS), ("live", TOOLS), ("native", None)):
                kw = {"tools": tools} if tools else {}
                upstream.script_for("t", steps({"content": "hi"}, finish="tool_calls"))
                whole = await client.chat.completions.create(model=name, messages=MESSAGES, **kw)
                upstream.script_for("t", steps({"content": "hi"}, finish="tool_calls"))
                chunks = [
                    c
                    async for c in await client.chat.completions.create(
                        model=name, messages=MESSAGES, stream=True, **kw
                    )
                ]
                finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                assert whole.choices[0].finish_reason == "stop" and whole.choices[0].message.tool_calls is None, name
                assert finishes == ["stop"], (name, finishes)


async def test_a_call_without_arguments_is_an_empty_object(tooled):
    """A native call of a function without parameters whose arguments came empty (or
    never came) reaches the SDK as "{}", streamed and whole: "" is no JSON."""
    edge, upstream = tooled
    bare = {"tool_calls": [{"index": 0, "id": "call_t", "type": "function", "function": {"name": "get_time"}}]}
    for first in (native_call(0, "call_t", "get_time")[0], bare):
        upstream.script_for("t", steps(first, finish="tool_calls"))
        with trio.fail_after(BOUND):
            async with sdk(edge) as client:
                whole = await client.chat.completions.create(model="native", messages=MESSAGES, tools=TOOLS)
                stream = await client.chat.completions.create(model="live", messages=MESSAGES, tools=TOOLS, stream=True)
                streamed = [tc for c in [c async for c in stream] for tc in c.choices[0].delta.tool_calls or ()]
        assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == {}
        assert [json.loads(tc.function.arguments) for tc in streamed] == [{}]


async def test_a_live_tool_stream_fails_on_any_unreadable_call_and_sends_one_call_if_asked(tooled):
    """tool_stream = "live" as buffered: a readable call followed by one that cannot be
    read is a tool_validation_error (the readable one was sent alone, as if it were all);
    parallel_tool_calls false returns the first call only."""
    edge, upstream = tooled
    broken = text_call("get_weather", {"city": "Paris"}) + "<tool_call>{not json</tool_call>"
    upstream.script_for("t", steps({"content": broken}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            body = {"model": "live", "messages": MESSAGES, "tools": TOOLS, "stream": True}
            r = await client.post("/v1/chat/completions", json=body)
            events = sse_events(r.content)
            assert msgspec.json.decode(events[-2])["error"]["type"] == "tool_validation_error"
            assert b"tool_calls" not in r.content
            upstream.script_for(
                "t",
                steps(
                    *native_call(0, "call_a", "get_weather", '{"city": "Paris"}'),
                    *native_call(1, "call_b", "get_weather", '{"city": "Rome"}'),
                    finish="tool_calls",
                ),
            )
            r = await client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False})
    calls = [
        tc
        for e in sse_events(r.content)[:-1]
        for c in msgspec.json.decode(e)["choices"]
        for tc in c["delta"].get("tool_calls", [])
    ]
    assert [c["id"] for c in calls] == ["call_a"]


@pytest.mark.parametrize("name", ["native", "live"])
@pytest.mark.parametrize("stream", [False, True])
async def test_one_call_asked_for_is_checked_alone(tooled, name, stream):
    """parallel_tool_calls false: the client gets the first call only, so a second call that is
    invalid is no reason to fail the turn. It was checked with the first: a valid first call
    and an invalid second were retried, then a tool_validation_error (an outside audit)."""
    edge, upstream = tooled
    script = steps(
        *native_call(0, "call_a", "get_weather", '{"city": "Paris"}'),
        *native_call(1, "call_b", "get_weather", '{"town": 1}'),
        finish="tool_calls",
    )
    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        content, _, calls = await answer_of_choice(edge, name, stream, parallel_tool_calls=False)
    assert [(call.id, json.loads(call.function.arguments)) for call in calls] == [("call_a", {"city": "Paris"})]
    assert len(upstream.records) == 1  # (no retry)


@pytest.mark.parametrize("name", ["textonly", "live"])
@pytest.mark.parametrize("stream", [False, True])
async def test_one_call_asked_for_in_text_is_read_alone(tooled, name, stream):
    """parallel_tool_calls false, calls written as text: a readable first call and an unreadable
    second failed the turn (a 502 after two runs; an outside re-check). The blocks after the
    first call are not read, and are not shown as content either."""
    edge, upstream = tooled
    text = "On it. " + text_call("get_weather", {"city": "Paris"}) + "<tool_call>{not json</tool_call> and more"
    upstream.script_for("t", steps({"content": text}))
    with trio.fail_after(BOUND):
        content, _, calls = await answer_of_choice(edge, name, stream, parallel_tool_calls=False)
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert "tool_call" not in content and "not json" not in content, content
    assert len(upstream.records) == 1  # (no retry)


@pytest.mark.parametrize("name", ["textonly", "live"])
@pytest.mark.parametrize("stream", [False, True])
async def test_one_call_asked_for_in_a_cut_off_answer_is_checked_whole(tooled, name, stream):
    """parallel_tool_calls false, a run cut off by max_tokens, calls written as text: an invalid
    first call followed by another is whole, and checked as any (only a cut-off last call's
    arguments go unchecked). The second was left unread, so the first was taken for the cut one:
    sent unchecked, where native calls were a tool_validation_error (an outside re-check)."""
    edge, upstream = tooled
    text = text_call("get_weather", {"city": 3}) + text_call("get_weather", {"city": "Paris"})
    upstream.script_for("t", steps({"content": text}, finish="length"))
    with trio.fail_after(BOUND):
        if stream:
            async with http(edge) as client:
                body = {"model": name, "messages": MESSAGES, "tools": TOOLS, "stream": True}
                r = await client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False})
            events = sse_events(r.content)
            err = msgspec.json.decode(events[-2])["error"]
            assert err["type"] == "tool_validation_error", events
            assert not any(b'"tool_calls"' in e for e in events)
        else:
            with pytest.raises(openai.APIStatusError) as failed:
                await answer_of_choice(edge, name, stream, parallel_tool_calls=False)
            assert failed.value.status_code == 502 and failed.value.type == "tool_validation_error"
    assert len(upstream.records) == 2  # (retried once, as for any invalid call)


async def test_a_live_stream_past_the_call_limit_sends_no_markup_as_text(tooled):
    """tool_stream = "live": text past the 1,024th call block, markup and all, went out as the
    answer's content before its tool_validation_error (476 blocks of 1,500: an outside audit);
    when buffered, none did. Now neither sends it."""
    from proto.frames import MAX_TOOL_CALLS

    edge, upstream = tooled
    upstream.script_for("t", steps({"content": text_call("get_time", {}) * (MAX_TOOL_CALLS + 1)}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for name in ("live", "native"):
                body = {"model": name, "messages": MESSAGES, "tools": TOOLS, "stream": True}
                r = await client.post("/v1/chat/completions", json=body)
                events = sse_events(r.content)
                assert msgspec.json.decode(events[-2])["error"]["type"] == "tool_validation_error", name
                assert b"tool_call>" not in r.content.replace(b"\\u003c", b"<"), name
                assert b"get_time" not in b"".join(events[:-2]), name


async def test_a_failed_retry_says_why_in_its_code_whole_or_streamed(nursery, upstream):
    """A tool call's retry that timed out was a 502 with code null when whole and
    `run_timed_out` in a stream: the code is the stream's in both (an outside audit)."""
    edge = await start_edge(nursery, edge_config(wait_timeout_s=1.0))
    node = await start_node(nursery, edge, [model("native", upstream, target="t")])
    invalid = steps(*native_call(0, "call_a", "get_weather", '{"town": 1}'), finish="tool_calls")
    codes = []
    answers = iter([invalid, [("sleep", 30)]] * 2)  # the retry answers nothing
    upstream.script_for("t", lambda body: list(next(answers)))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for stream in (False, True):
                body = {"model": "native", "messages": MESSAGES, "tools": TOOLS, "stream": stream}
                r = await client.post("/v1/chat/completions", json=body)
                error = r.json()["error"] if not stream else msgspec.json.decode(sse_events(r.content)[-2])["error"]
                codes.append((r.status_code, error["type"], error["code"]))
    await settled(edge, node.agent)
    assert codes == [(502, "tool_validation_retry_error", "run_timed_out")] + [
        (200, "tool_validation_retry_error", "run_timed_out")
    ]


def test_a_cut_off_answer_of_unreadable_calls_is_still_bounded_by_the_call_count():
    """Cut off by max_tokens, unreadable blocks were all forgiven as text (a re-check): the count
    of calls that bounds reading them never came, and 14.9 MB of them held the edge 4.6 s. Only
    the block the cut ended is forgiven; the others are errors, counted, and the answer is text."""
    from proto.frames import MAX_TOOL_CALLS

    text = '<tool_call>{"a</tool_call>' * (MAX_TOOL_CALLS + 10) + '<tool_call>{"name": "f'
    parsed = tools_module.parse_text_tool_calls(text, cut_off=True)
    assert parsed.error.endswith(f"and {MAX_TOOL_CALLS + 1 - tools_module.MAX_ERRORS_SAID} more") and not parsed.calls
    cut = tools_module.parse_text_tool_calls(
        'Sure. <tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"na', True
    )
    assert (cut.error, [c.function.name for c in cut.calls], cut.content) == ("", ["f"], 'Sure. <tool_call>{"na')


def test_the_live_filter_finds_a_call_after_text_that_lowercases_longer():
    """'İ' is two characters lowered: offsets from the lowered text cut the original in the
    wrong place, and a live tool stream sent the call's markup as content too."""
    held = ToolTextFilter()
    assert held.append("İstanbul, İzmir: <tool") == "İstanbul, İzmir: "
    assert held.append('_call>{"name": "get_time"}</tool_call>') == ""
    assert held.flush() == '<tool_call>{"name": "get_time"}</tool_call>'
    assert ToolTextFilter().append("İİ {{TOOL") == "İİ "


MIXED = [i if i % 2 else str(i) for i in range(20_000)]  # numbers beside strings: they do not sort


async def test_a_large_enum_of_mixed_values_is_checked_without_holding_the_edge(tooled):
    """The draft-04 metaschema asks every `enum` to have unique items, and jsonschema compared
    every pair when they did not sort: one request with a 20,000-value enum (159 KB) held the
    event loop 40-72 s and dropped every node link. It is one pass now."""
    edge, upstream = tooled
    upstream.script_for("t", steps({"content": "fine"}))
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "properties": {"a": {"enum": MIXED}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = {"model": "native", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "fine"


async def test_unique_items_of_a_models_arguments_are_checked_in_one_pass(tooled):
    """A schema asking `uniqueItems` of an array the model fills with 12,000 numbers and strings
    held the event loop 19 s while jsonschema compared every pair (the node declared the edge
    dead). The call is checked in one pass; a repeated item (1 and 1.0 are one JSON value) is
    still refused."""
    edge, upstream = tooled
    params = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    body = {"model": "native", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    distinct = json.dumps({"a": MIXED[:12_000]})
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            upstream.script_for("t", steps(*native_call(0, "c1", "f", distinct), finish="tool_calls"))
            ok = await client.post("/v1/chat/completions", json=body)
            upstream.script_for("t", steps(*native_call(0, "c1", "f", '{"a": [1, "x", 1.0]}'), finish="tool_calls"))
            repeated = await client.post("/v1/chat/completions", json={**body, "max_tokens": 50})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == distinct
    assert repeated.status_code == 502 and "non-unique" in repeated.json()["error"]["message"]


@pytest.mark.parametrize(
    ("depth", "said"),
    [(5_000, "nested too deeply"), (100_000, "more than 65536 JSON objects and arrays")],
)
async def test_tool_calls_nested_past_the_decoder_are_a_clear_error_not_a_500(tooled, depth, said):
    """JSON nested 100,000 deep raised RecursionError (not a DecodeError) in the edge: a 500
    when a text-only model wrote such a tool call, and when a client sent such arguments in
    its history to one. The model's is an unreadable call (retried, then tool_validation_error);
    the client's arguments go to the model as the client wrote them. (Nested 5,000 deep, past
    the decoder's 1,000 levels, within the 65,536 arrays a call may hold before it is decoded.)"""
    edge, upstream = tooled
    deep = "[" * depth + "]" * depth
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    upstream.script_for("t", steps({"content": '<tool_call>{"name": "f", "arguments": ' + deep + "}</tool_call>"}))
    asked = {"model": "textonly", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "done"},
    ]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            model_wrote = await client.post("/v1/chat/completions", json=asked)
            upstream.script_for("t", steps({"content": "fine"}))
            client_sent = await client.post("/v1/chat/completions", json={**asked, "messages": history})
    assert model_wrote.status_code == 502 and model_wrote.json()["error"]["type"] == "tool_validation_error"
    assert model_wrote.json()["error"]["code"] == "invalid_tool_call"
    assert said in model_wrote.json()["error"]["message"]
    assert client_sent.status_code == 200, client_sent.text
    assert any(deep in m["content"] for m in upstream.records[-1].body["messages"] if m["role"] == "assistant")


async def test_arguments_wrong_everywhere_are_refused_without_weighing_every_error(tooled):
    """A call whose 250,000 array items are each of the wrong type made jsonschema list every
    error for best_match to weigh, on the event loop (a node's 290 KB of such arguments: 20,001
    errors, 1.7-2 s a call). The first 64 are weighed: the call is refused at once, naming where.
    (A million items are more values than a call may hold: not decoded at all.)"""
    edge, upstream = tooled
    params = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    wrong = json.dumps({"a": ["x"] * 250_000})
    upstream.script_for("t", steps(*native_call(0, "c1", "f", wrong), finish="tool_calls"))
    body = {"model": "native", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 502 and r.json()["error"]["type"] == "tool_validation_error"
    assert "do not match its schema at a/" in r.json()["error"]["message"]


async def test_large_honest_arguments_are_checked_in_a_thread_and_reach_the_client(tooled):
    """A call of 3,000 rows (about 170 KB of arguments) is checked off the event loop, with time
    for it, live and buffered: the SDK gets the call (on the loop, within a moment's budget, it
    counted as not checkable and was retried away)."""
    edge, upstream = tooled
    row = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}}, "required": ["id"]}
    rows = {
        "type": "function",
        "function": {
            "name": "insert_rows",
            "parameters": {"type": "object", "properties": {"rows": {"type": "array", "items": row}}},
        },
    }
    arguments = json.dumps({"rows": [{"id": i, "name": f"row number {i}"} for i in range(3000)]})
    call = {
        "tool_calls": [
            {"index": 0, "id": "c1", "type": "function", "function": {"name": "insert_rows", "arguments": arguments}}
        ]
    }
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            for name in ("live", "native"):
                upstream.records.clear()
                upstream.script_for("t", steps(call, finish="tool_calls"))
                stream = await client.chat.completions.create(model=name, messages=MESSAGES, tools=[rows], stream=True)
                got = [tc for c in [c async for c in stream] if c.choices for tc in c.choices[0].delta.tool_calls or ()]
                assert [json.loads(tc.function.arguments)["rows"][2999]["id"] for tc in got] == [2999], name
                assert len(upstream.records) == 1, name  # no retry


async def test_tool_call_arguments_of_millions_of_values_are_not_decoded(tooled):
    """JSON of ``{"rows":[{},{},…]}`` (5 MB: 1.7 million objects) as a tool call's arguments,
    in a client's history or in what the model wrote: the edge decoded it (about 60 bytes an
    object on the event loop, 8 MB of it took 265 MB) to render the history for a
    native_tools = false model, and to read and check the model's call. Past 65,536 objects and
    arrays (or 262,144 values) such JSON is not decoded: the history keeps the arguments as the
    client wrote them, and the model's call is invalid, naming why, and asked again."""
    edge, upstream = tooled
    rows = '{"rows":[' + ",".join(["{}"] * 1_700_000) + "]}"
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": rows}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    huge = '<tool_call>{"name": "get_weather", "arguments": ' + rows + "}</tool_call>"

    def script(body):
        corrected = any("That is invalid" in str(m.get("content")) for m in body["messages"])
        return steps({"content": text_call("get_weather", {"city": "Oslo"}) if corrected else huge})

    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "textonly", "messages": history, "tools": TOOLS}
            )
    assert r.status_code == 200, r.text[:300]
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    first, retry = (rec.body["messages"] for rec in upstream.records)
    earlier = first[2]["content"]
    assert json.loads(earlier[len("<tool_call>") : -len("</tool_call>")])["arguments"] == rows  # as written
    said = str(retry[-1]["content"])
    assert "That is invalid" in said and "more than 65536 JSON objects and arrays" in said, said[:500]


async def test_a_history_call_without_a_name_is_a_400_and_a_failed_body_frees_its_slot(nursery, upstream, monkeypatch):
    """A history's tool call with no function name, to a native_tools = false model, was a 500
    (its prompt shows each call by name) that kept the node's slot for good: a model of
    max_concurrency 2 answered nothing but 429s after two such requests. It is a 400 naming the
    field, as OpenAI's API answers; and any failure while a run's body is built gives the slot back."""
    edge = await start_edge(nursery, edge_config(queue_timeout_ms=2000))
    node = await start_node(
        nursery, edge, [model("textonly", upstream, target="t", native_tools=False, max_concurrency=1)]
    )
    upstream.script_for("t", steps({"content": "Rain."}))
    nameless = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "q", "type": "function", "function": {"arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "q", "content": "rain"},
    ]
    good = {"model": "textonly", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for _ in range(3):
                r = await client.post("/v1/chat/completions", json={**good, "messages": nameless})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.name"

            def broken(request):
                raise RuntimeError("a bug while building the run's body")

            monkeypatch.setattr(turn_module, "text_tools_request", broken)
            for _ in range(2):
                assert (await client.post("/v1/chat/completions", json=good)).status_code == 500
            monkeypatch.undo()
            r = await client.post("/v1/chat/completions", json=good)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Rain.", r.text
    await settled(edge, node.agent)


async def test_a_long_history_past_the_json_bound_shows_its_newest_calls_as_objects(tooled):
    """A native_tools = false model reads the client's history of calls as JSON objects, all the
    calls within one bound together. Past it, the calls left are shown as the client wrote them
    (strings): those had been the newest, the ones the model's next step follows. Now the newest
    are decoded first and the oldest are left as written."""
    edge, upstream = tooled
    history: list[dict] = [{"role": "user", "content": "Weather?"}]
    for i in range(60):
        arguments = json.dumps({"city": f"c{i}", "rows": [{}] * 2000})  # 60 x 2,001 objects: past 65,536
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        history += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "rain"},
        ]
    upstream.script_for("t", steps({"content": "Rain all week."}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            body = {"model": "textonly", "messages": history, "tools": TOOLS}
            r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text[:300]
    shown = [
        json.loads(m["content"][len("<tool_call>") : -len("</tool_call>")])["arguments"]
        for m in upstream.records[0].body["messages"]
        if m["role"] == "assistant"
    ]
    assert len(shown) == 60
    decoded = [isinstance(a, dict) for a in shown]
    assert decoded == [False] * 28 + [True] * 32, decoded  # the newest 32 fit in 65,536
    assert shown[-1]["city"] == "c59" and json.loads(shown[0])["city"] == "c0"


async def test_a_turn_s_calls_share_one_json_bound_and_one_check_budget(tooled, monkeypatch):
    """Each call of a turn had its own bounds: 80 text calls of 64,001 arrays each (every one
    under the 65,536 a call may hold) were 5.1 million arrays decoded on the event loop; 1,024
    calls, each checked within its own 2 s, held the one check slot 254 s (each within its own
    10 ms on the loop: 2.5 s). The turn's calls now share them: past the JSON bound the turn's
    calls are invalid, naming it; past the check budget they are not checkable (retried, then
    tool_validation_error)."""
    edge, upstream = tooled
    arrays = "<tool_call>" + json.dumps({"name": "get_weather", "arguments": {"xs": [[]] * 30_000}}) + "</tool_call>"

    def split(body):
        corrected = any("That is invalid" in str(m.get("content")) for m in body["messages"])
        return steps({"content": text_call("get_weather", {"city": "Oslo"}) if corrected else arrays * 3})

    upstream.script_for("t", split)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            asked = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
            r = await client.post("/v1/chat/completions", json={**asked, "model": "textonly"})
            assert r.status_code == 200, r.text[:300]
            said = str(upstream.records[-1].body["messages"][-1]["content"])
            assert "the tool calls hold more than 65536 JSON objects and arrays" in said, said[-600:]

            # 60 calls, each checked in about 1.5 ms: within a (shortened) budget of 20 ms alone, not together
            monkeypatch.setattr(tools_module, "CHECK_BUDGET_S", 0.02)
            unique = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
            tools = [{"type": "function", "function": {"name": "f", "parameters": unique}}]
            args = json.dumps({"xs": [[i] for i in range(1000)]})
            calls = [d for i in range(60) for d in native_call(i, f"c{i}", "f", args)]
            upstream.script_for("t", steps(*calls, finish="tool_calls"))
            slow = await client.post(
                "/v1/chat/completions", json={**asked, "model": "native", "tools": tools, "tool_choice": "required"}
            )
    assert slow.status_code == 502 and slow.json()["error"]["type"] == "tool_validation_error", slow.text[:300]
    assert "checks take too long" in slow.json()["error"]["message"]


async def test_many_unreadable_text_calls_are_named_a_few_and_counted(tooled):
    """1,024 unreadable call blocks were a 158 KB tool_validation_error, the same sent back to
    the model in the retry's correction. The first four are named, the rest counted."""
    edge, upstream = tooled
    upstream.script_for("t", steps({"content": "<tool_call>{bad</tool_call>" * 1000}))
    body = {"model": "textonly", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 502 and r.json()["error"]["type"] == "tool_validation_error", r.text[:300]
    message = r.json()["error"]["message"]
    assert message.count("is not valid JSON") == 4 and "and 996 more" in message and len(message) < 1000, message
    correction = str(upstream.records[-1].body["messages"][-1]["content"])
    assert "and 996 more" in correction and len(correction) < 2000


async def test_a_pattern_after_a_long_honest_call_gets_its_own_pattern_budget(tooled):
    """The turn's shared budget is its checks' (2 s), not its patterns': a call of 1,500 UI
    actions, each a oneOf of 12 kinds (0.5 s of checks), then a call whose schema has a
    `pattern`, had the pattern refused as taking too long (0.25 s was gone). Each call's
    patterns get their 0.25 s, within what is left of the turn's checks."""
    edge, upstream = tooled
    kinds = ["click", "type", "scroll", "hover", "drag", "wait", "select", "press", "upload", "focus", "blur", "clear"]
    kind = {
        "type": "object",
        "additionalProperties": False,
        "required": ["kind", "target"],
        "properties": {"target": {"type": "string", "minLength": 1}, "x": {"type": "integer", "minimum": 0}},
    }
    variants = [{**kind, "properties": {**kind["properties"], "kind": {"const": k}}} for k in kinds]
    actions = {"type": "object", "properties": {"actions": {"type": "array", "items": {"oneOf": variants}}}}
    label = {"type": "object", "properties": {"label": {"type": "string", "pattern": "^[a-z]+$"}}}
    tools = [
        {"type": "function", "function": {"name": "run_actions", "parameters": actions}},
        {"type": "function", "function": {"name": "set_label", "parameters": label}},
    ]
    acts = json.dumps({"actions": [{"kind": kinds[i % 12], "target": f"#b{i}", "x": i} for i in range(1500)]})
    upstream.script_for(
        "t",
        steps(
            *native_call(0, "c1", "run_actions", acts),
            *native_call(1, "c2", "set_label", '{"label": "done"}'),
            finish="tool_calls",
        ),
    )
    body = {"model": "native", "messages": [{"role": "user", "content": "go"}], "tools": tools}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text[:300]
    assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == [
        "run_actions",
        "set_label",
    ]


async def test_a_long_native_tool_call_keeps_its_run_on_a_healthy_node(nursery, upstream):
    """A node sends a native tool call whole, at its end: a coding agent's long file write
    (30 s of arguments, no text first) looked like a run that had not started, and the edge
    moved it off a healthy node to start over elsewhere (an outside audit: 40 s instead of 30,
    three routings-around). The node says the run is alive while the call streams (a
    ``progress`` event a second): the run stays, and the call arrives whole."""
    parts = ['{"city": "' + "x" * 50] + ["y" * 50] * 12 + ['"}']
    script = [("chunk", native_call(0, "call_w", "get_weather")[0])]
    for part in parts:
        script += [("sleep", 0.25), ("chunk", {"tool_calls": [{"index": 0, "function": {"arguments": part}}]})]
    upstream.script_for("t", [*script, ("chunk", {}, "tool_calls"), ("done",)])
    # (1.5 s: the node's progress comes once a PROGRESS_S, 1 s; at 1.0 a late one counted as a stall once in CI)
    edge = await start_edge(nursery, edge_config(stall_after_s=1.5))
    await start_node(nursery, edge, [model("m", upstream, target="t")], "writer")
    body = {"model": "m", "messages": [{"role": "user", "content": "write it"}], "tools": TOOLS}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            answer: list = []
            async with trio.open_nursery() as turn:

                async def ask() -> None:
                    answer.append(await client.post("/v1/chat/completions", json=body))

                turn.start_soon(ask)
                await eventually(lambda: upstream.records, "the call streaming on the writer")
                await start_node(nursery, edge, [model("m", ttft_ms=5, tokens_per_s=0)], "peer")
            metrics = (await client.get("/metrics")).text
    r = answer[0]
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["arguments"] == "".join(parts)
    assert not upstream.records[0].aborted
    assert "iop_node_stalls_total 0.0" in metrics


# -- tool_stream = "live" on the Messages and Responses APIs ------------------------------------

ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)
]
RESPONSES_TOOLS = [
    {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
    for t in (WEATHER, TIME)
]


async def _first_text(edge, api: str) -> str:
    """The first text a streamed request with tools shows; then the client leaves."""
    if api == "messages":
        path, want = "/v1/messages", "text_delta"
        body = {"model": "live", "max_tokens": 100, "messages": MESSAGES, "tools": ANTHROPIC_TOOLS, "stream": True}
    else:
        path, want = "/v1/responses", "response.output_text.delta"
        body = {"model": "live", "input": MESSAGES, "tools": RESPONSES_TOOLS, "stream": True}
    first = None
    async with http(edge) as client, client.stream("POST", path, json=body) as r:
        with trio.CancelScope() as reading:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and want in line:
                    data = json.loads(line[6:])
                    first = data["delta"]["text"] if api == "messages" else data["delta"]
                    reading.cancel()  # (the generator ends with the cancel: the client leaves)
    assert first is not None, "the stream ended with no text"
    return first


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_a_live_tool_stream_shows_text_as_it_comes_on_messages_and_responses(tooled, api):
    """tool_stream = "live" holds on /v1/messages and /v1/responses as on chat: their streams with
    tools were collected whatever the setting (found from outside: Claude Code and Codex send tools
    with every request, and a minute-long answer showed nothing until its end). Here the model
    writes a sentence and then goes on thinking: the client reads the sentence meanwhile, and its
    leaving reaches the model server."""
    edge, upstream = tooled
    upstream.script_for("t", [("chunk", {"content": "Checking now. "}), ("hang",)])
    with trio.fail_after(BOUND):
        assert await _first_text(edge, api) == "Checking now. "
        await eventually(lambda: upstream.records and upstream.records[-1].aborted, "the model server saw the cancel")


async def _final_message(edge):
    """The anthropic SDK's final message of a streamed request with tools (``messages.stream``)."""
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=edge.url, api_key="unused", max_retries=0, timeout=BOUND)
    async with (
        client,
        client.messages.stream(model="live", max_tokens=100, messages=MESSAGES, tools=ANTHROPIC_TOOLS) as stream,
    ):
        return await stream.get_final_message()


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_a_live_retry_of_a_call_with_text_after_it_is_one_valid_stream(tooled, api):
    """The invalid attempt wrote text after its call (``<tool_call>...</tool_call> ok``): that text
    was encoded, then dropped with the attempt, and the API's encoder went on from it. The
    retry's Responses stream had a delta for an item never added (the openai SDK raised), its
    Messages stream a delta with no block start (the anthropic SDK raised), and "ok" stayed in
    the final response (found from outside). Both SDKs read one valid stream: the retry's text
    and call alone."""
    edge, upstream = tooled
    invalid = text_call("get_weather", {"town": "Paris"}) + " ok"
    valid = "Fine. " + text_call("get_weather", {"city": "Rome"})

    def script(body):
        text = valid if "That is invalid" in str(body["messages"][-1]) else invalid
        return steps(*({"content": text[i : i + 3]} for i in range(0, len(text), 3)))

    upstream.script_for("t", script)
    with trio.fail_after(BOUND):
        if api == "messages":
            final = await _final_message(edge)
            got = [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in final.content]
        else:
            async with (
                sdk(edge) as client,
                client.responses.stream(model="live", input=MESSAGES, tools=RESPONSES_TOOLS) as stream,
            ):
                final = await stream.get_final_response()
            got = [
                (o.type, o.content[0].text) if o.type == "message" else (o.type, o.name, json.loads(o.arguments))
                for o in final.output
            ]
    assert got[0] == ("text" if api == "messages" else "message", "Fine. ")
    assert got[1][1:] == ("get_weather", {"city": "Rome"}) and len(got) == 2
    assert len(upstream.records) == 2


@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_a_live_tool_stream_retries_invalid_calls_on_messages_and_responses(tooled, api):
    """An invalid call before any text is retried on the same stream, as on chat: the model
    server saw the corrective message, and the SDK's final message or response holds the valid
    call alone."""
    edge, upstream = tooled
    upstream.script_for("t", _invalid_then(steps({"content": text_call("get_weather", {"city": "Rome"})})))
    with trio.fail_after(BOUND):
        if api == "messages":
            final = await _final_message(edge)
            assert final.stop_reason == "tool_use"
            got = [(b.type, b.name, b.input) for b in final.content]
            assert got == [("tool_use", "get_weather", {"city": "Rome"})]
        else:
            async with sdk(edge) as client:
                stream = await client.responses.create(model="live", input=MESSAGES, tools=RESPONSES_TOOLS, stream=True)
                events = [e async for e in stream]
            assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
            final = events[-1].response
            assert final.status == "completed"
            calls = [(o.type, o.name, json.loads(o.arguments)) for o in final.output]
            assert calls == [("function_call", "get_weather", {"city": "Rome"})]
    assert len(upstream.records) == 2
    corrective = upstream.records[1].body["messages"][-1]
    assert corrective["role"] == "user" and "town" in corrective["content"]


def test_compiled_schemas_are_kept_within_a_budget_of_their_text(monkeypatch):
    """Compiled validators were kept 512 at most, whatever their size: a validator holds about
    12 times its schema's text, and 512 distinct 60 KB schemas (one key's minute of requests)
    held 385 MB (an outside soak). They are kept within CACHED_SCHEMA_BYTES of text in all,
    the least recently used going first; one in use stays compiled."""
    monkeypatch.setattr(tools_module, "_VALIDATORS", tools_module._Validators())
    monkeypatch.setattr(tools_module, "CACHED_SCHEMA_BYTES", 40_000)

    def schema(i: int) -> str:
        props = {f"p{i}_{j}": {"type": "string", "description": "x" * 80} for j in range(100)}
        return json.dumps({"type": "object", "properties": props})

    kept = tools_module._VALIDATORS
    first = tools_module._validator(schema(0))
    for i in range(1, 12):
        tools_module._validator(schema(i))
        assert tools_module._validator(schema(0)) is first  # (used each time: kept)
    assert kept._bytes <= 40_000 and len(kept._kept) < 12
    assert kept._bytes == sum(map(len, kept._kept))


def test_a_schema_of_many_subschemas_with_ids_compiles_in_linear_time():
    """Each subschema that names its own `$id` resolves its references against it; each lookup
    of an id the registry had not crawled read the whole schema again: 1,600 such subschemas
    (9,604 schema nodes) held the one compile slot, outside any time limit, 47 s (a re-check:
    another key's schema waited 40.8 s behind it). The schema is crawled once."""
    import time

    n = 1600
    defs = {
        f"d{i}": {
            "$id": f"http://o/x{i}",
            "properties": {"b": {"$ref": "#/$defs/y"}},
            "$defs": {"y": {"type": "integer"}},
        }
        for i in range(n)
    }
    schema = {"type": "object", "properties": {f"p{i}": {"$ref": f"#/$defs/d{i}"} for i in range(n)}, "$defs": defs}
    started = time.monotonic()
    validator = tools_module._build_validator(json.dumps(schema))
    took = time.monotonic() - started
    assert took < 10, took  # (here: 1.6 s; 47 s before)
    assert [e.message for e in validator.iter_errors({"p0": {"b": "x"}})] == ["'x' is not of type 'integer'"]


def test_a_loop_through_a_dynamic_reference_is_refused_and_a_dynamic_tree_is_not():
    """`$dynamicRef` goes, by the scope it is reached in, to a subschema of its anchor's name:
    looked up statically, a loop through one below the root went unseen, and each request spent
    its attempts on the model before a 502 "could not be checked" (a re-check). Any subschema of
    that anchor counts as a successor; a recursive tree through `items` is no loop."""
    looped = {
        "$id": "http://o/root",
        "type": "object",
        "required": ["p"],
        "properties": {"p": {"$ref": "w"}},
        "$defs": {
            "w": {"$id": "w", "$dynamicAnchor": "n", "allOf": [{"$ref": "inner"}]},
            "inner": {
                "$id": "inner",
                "$defs": {"a": {"$dynamicAnchor": "n", "type": "object"}},
                "allOf": [{"$dynamicRef": "#n"}],
            },
        },
    }
    with pytest.raises(tools_module.SchemaProblem, match="loop without end"):
        tools_module._build_validator(json.dumps(looped))
    tree = {
        "$id": "http://o/t",
        "$dynamicAnchor": "node",
        "type": "object",
        "properties": {"kids": {"type": "array", "items": {"$dynamicRef": "#node"}}},
    }
    validator = tools_module._build_validator(json.dumps(tree))
    assert [e.message for e in validator.iter_errors({"kids": [{"kids": [1]}]})] == ["1 is not of type 'object'"]
    # Data that looks like one (a schema shown in `examples`) is no loop (it was refused: a re-check).
    shown = {"$dynamicAnchor": "a", "$dynamicRef": "#a"}
    data = {"type": "object", "properties": {"s": {"type": "object", "examples": [shown], "default": shown}}}
    tools_module._build_validator(json.dumps(data))
    # Many references and anchors of one name: linear (each reference to each anchor was
    # quadratic, 24.7 s at 12,000 nodes: a re-check).
    many = {"$dynamicAnchor": "T", "type": "object", "$defs": {}}
    for i in range(6000):
        many["$defs"][f"a{i}"] = {"$dynamicAnchor": "T", "type": "object"}
        many["$defs"][f"r{i}"] = {"$dynamicRef": "#T"}
    started = time.monotonic()
    tools_module._build_validator(json.dumps(many))
    assert time.monotonic() - started < 10  # (here: 3.0 s; 24.7 s before)
