"""Output shaping end to end: reasoning, think tags, sentinels, fallbacks,
strict output, usage, keep-alive and trace, through edge -> node -> upstream."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import structlog
import trio

from edge.openai import trace
from edge.openai.shaping import hidden_reasoning_notice, wrap_in_completion_tool
from edge.openai.tools import ToolTextFilter
from tests.conftest import BOUND, edge_config, eventually, http, model, sdk, settled, sse_events, start_edge, start_node

MESSAGES = [{"role": "user", "content": "hi"}]
POLICIES = [
    {"name": "plain"},
    {"name": "r1"},  # auto, like plain: learned from a whole answer (test_auto_learns_...)
    {"name": "r1tools", "tool_stream": "live"},
    {"name": "rfield", "reasoning_field": "reasoning"},
    {"name": "opened", "think_tags": "open"},
    {"name": "custom", "sentinels": ["<|custom|>"]},
    {"name": "ownonly", "sentinels": ["<|custom|>"], "default_sentinels": False},
    {"name": "strict", "strict_output": True},
    {"name": "strictbuf", "strict_output": True, "stream_buffer": True},
    {"name": "xmltool", "strict_output": True, "stream_buffer": True, "xml_completion_tool": "attempt_completion"},
    {"name": "xmllive", "strict_output": True, "xml_completion_tool": "attempt_completion"},  # no stream_buffer
]


@pytest.fixture
async def shaped(nursery, upstream):
    edge = await start_edge(nursery, edge_config(models=POLICIES, keepalive_s=0.2))
    node = await start_node(nursery, edge, [model(p["name"], upstream, target="t") for p in POLICIES])
    yield edge, upstream
    await settled(edge, node.agent)


def script(*deltas, finish="stop", usage=None, pause=0.0):
    steps = []
    if pause:
        steps.append(("sleep", pause))
    steps += [("chunk", d) for d in deltas]
    steps.append(("chunk", {}, finish))
    if usage:
        steps.append(("usage", usage))
    steps.append(("done",))
    return steps


async def stream_raw(edge, **body) -> tuple[list[dict], bytes]:
    async with http(edge) as client:
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True, **body})
    assert r.status_code == 200
    events = sse_events(r.content)
    assert events[-1] == b"[DONE]"
    return [msgspec.json.decode(e) for e in events[:-1]], r.content


def data_lines(raw: bytes) -> list[dict]:
    """A Responses or Messages stream's events (``event:`` then ``data:`` lines)."""
    return [msgspec.json.decode(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


def joined(chunks: list[dict], field: str) -> str:
    return "".join(c["choices"][0]["delta"].get(field) or "" for c in chunks if c["choices"])


async def both_ways(shaped, client, name: str, steps: list, **body) -> tuple[tuple[str, str], tuple[str, str]]:
    """``steps`` answered to a stream, then to a whole request, of model ``name``: each one's
    (content, reasoning)."""
    edge, upstream = shaped
    upstream.script_for("t", steps)
    chunks, _ = await stream_raw(edge, model=name, **body)
    upstream.script_for("t", steps)
    r = await client.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES, **body})
    message = r.json()["choices"][0]["message"]
    assert not message.get("tool_calls") and not any(
        c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"]
    )
    streamed = (joined(chunks, "content"), joined(chunks, "reasoning_content"))
    return streamed, (message["content"], message.get("reasoning_content") or "")


async def test_reasoning_is_streamed_as_reasoning_content(shaped):
    """Upstream reasoning (either field name) reaches the SDK as delta.reasoning_content."""
    edge, upstream = shaped
    upstream.script_for("t", script({"reasoning_content": "think "}, {"reasoning": "more"}, {"content": "answer"}))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            stream = await client.chat.completions.create(model="plain", messages=MESSAGES, stream=True)
            chunks = [c async for c in stream]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert reasoning == "think more"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "answer"


async def test_reasoning_that_ends_in_what_might_begin_a_sentinel_comes_before_the_answer(shaped):
    """Reasoning ending in a character a sentinel could begin with (``x[``, ``a <``): the filter
    held it to the end of the run, so it came after the answer (a second thinking block on
    /v1/messages, a second reasoning item on /v1/responses: found from outside). No sentinel
    spans reasoning and content: it goes out as the answer begins, as a whole answer has it."""
    edge, upstream = shaped
    upstream.script_for(
        "t",
        script(
            {"reasoning_content": "Check if a <"},
            {"reasoning_content": " b, then x["},
            {"content": "Answer."},
            {"content": " Done."},
            pause=0,
        ),
    )
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            stream = await client.chat.completions.create(model="plain", messages=MESSAGES, stream=True)
            kinds = [
                (kind, text)
                async for c in stream
                if c.choices
                for kind, text in (
                    ("reasoning", getattr(c.choices[0].delta, "reasoning_content", None)),
                    ("content", c.choices[0].delta.content),
                )
                if text
            ]
    first_content = next(i for i, (kind, _) in enumerate(kinds) if kind == "content")
    assert all(kind == "content" for kind, _ in kinds[first_content:]), kinds
    assert "".join(t for k, t in kinds if k == "reasoning") == "Check if a < b, then x["


async def test_reasoning_field_name_is_configurable(shaped):
    """reasoning_field = "reasoning" renames the delta field, stream and whole."""
    edge, upstream = shaped
    upstream.script_for("t", script({"reasoning_content": "r"}, {"content": "c"}))
    with trio.fail_after(BOUND):
        chunks, _ = await stream_raw(edge, model="rfield")
        async with http(edge) as client:
            whole = (await client.post("/v1/chat/completions", json={"model": "rfield", "messages": MESSAGES})).json()
    assert joined(chunks, "reasoning") == "r" and joined(chunks, "reasoning_content") == ""
    assert whole["choices"][0]["message"]["reasoning"] == "r"


@pytest.mark.parametrize("off", [{"include_reasoning": False}, {"reasoning": {"exclude": True}}])
async def test_request_can_turn_reasoning_off(shaped, off):
    """include_reasoning: false or reasoning.exclude hides reasoning, streamed and whole."""
    edge, upstream = shaped
    upstream.script_for("t", script({"reasoning_content": "secret"}, {"content": "answer"}))
    with trio.fail_after(BOUND):
        chunks, raw = await stream_raw(edge, model="plain", **off)
        async with http(edge) as client:
            whole = (
                await client.post("/v1/chat/completions", json={"model": "plain", "messages": MESSAGES, **off})
            ).json()
    assert b"secret" not in raw
    assert joined(chunks, "content") == "answer"
    assert "reasoning_content" not in whole["choices"][0]["message"]
    assert "include_reasoning" not in upstream.records[0].body  # edge-only keys are not forwarded


async def test_think_tags_split_across_deltas_become_reasoning(shaped):
    """<think>…</think> in content moves to reasoning even when the tags are split across deltas."""
    edge, upstream = shaped
    upstream.script_for(
        "t", script({"content": "<thi"}, {"content": "nk>plan"}, {"content": " more</th"}, {"content": "ink>Answer"})
    )
    with trio.fail_after(BOUND):
        chunks, _ = await stream_raw(edge, model="plain")
        async with http(edge) as client:
            whole = (await client.post("/v1/chat/completions", json={"model": "plain", "messages": MESSAGES})).json()
    assert joined(chunks, "content") == "Answer"
    assert joined(chunks, "reasoning_content") == "plan more"
    assert whole["choices"][0]["message"]["content"] == "Answer"
    assert whole["choices"][0]["message"]["reasoning_content"] == "plan more"


async def test_think_tags_past_1024_leave_the_rest_as_content(shaped):
    """One delta of `<think>x</think>y` 100,000 times was a chunk for every x and y: 200,000
    chunks (7 MiB of it: 192 MB to the client, 847 MB of edge memory, other streams stalled
    1.9 s). Past 1,024 tags the rest of the answer is content as the model wrote it."""
    edge, upstream = shaped
    text = "<think>x</think>y" * 100_000
    upstream.script_for("t", script({"content": "Hi " + text}))
    with trio.fail_after(BOUND):
        chunks, raw = await stream_raw(edge, model="plain")
        async with http(edge) as client:
            whole = (await client.post("/v1/chat/completions", json={"model": "plain", "messages": MESSAGES})).json()
    rest = text[17 * 512 :]  # after 512 pairs of tags
    for content, reasoning in (
        (joined(chunks, "content"), joined(chunks, "reasoning_content")),
        (whole["choices"][0]["message"]["content"], whole["choices"][0]["message"]["reasoning_content"]),
    ):
        assert reasoning == "x" * 512 and content == "Hi " + "y" * 512 + rest
    assert len(chunks) < 1100 and len(raw) < 3 * len(text), (len(chunks), len(raw))


async def test_reasoning_and_content_switching_past_1024_times_shows_the_rest_as_content_only(shaped):
    """A model server alternating `reasoning_content` and `content`, a chunk each, made an output
    item per switch on the Responses API (40,000 items: 83 MB to the client, 70 MB of edge
    memory from 2.1 MB) and a content block on the Messages API. Past 1,024 switches the rest
    of the answer's reasoning is not shown; its content all is, on every API."""
    edge, upstream = shaped
    pairs = 3000
    alternating = script(*[{"reasoning_content": "r", "content": None}, {"content": "c"}] * pairs)
    with trio.fail_after(BOUND):
        upstream.script_for("t", alternating)
        chunks, _ = await stream_raw(edge, model="plain")
        assert joined(chunks, "content") == "c" * pairs
        assert joined(chunks, "reasoning_content") == "r" * 512
        async with http(edge) as client:
            upstream.script_for("t", alternating)
            body = {"model": "plain", "input": "hi", "stream": True, "reasoning": {"summary": "auto"}}
            raw = (await client.post("/v1/responses", json=body)).content
            events = data_lines(raw)
            done = events[-1]["response"]
            assert done["status"] == "completed"
            items = done["output"]
            assert len(items) == 1024
            assert "".join(i["content"][0]["text"] for i in items if i["type"] == "message") == "c" * pairs
            assert "".join(i["summary"][0]["text"] for i in items if i["type"] == "reasoning") == "r" * 512
            upstream.script_for("t", alternating)
            thinking = {"type": "enabled", "budget_tokens": 1024}
            body = {"model": "plain", "max_tokens": 2048, "messages": MESSAGES, "stream": True, "thinking": thinking}
            events = data_lines((await client.post("/v1/messages", json=body)).content)
            assert sum(e["type"] == "content_block_start" for e in events) == 1024
            deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
            assert "".join(d.get("text", "") for d in deltas) == "c" * pairs
            assert "".join(d.get("thinking", "") for d in deltas) == "r" * 512
            # Content of whitespace alone: the reasoning not shown does not come back as the answer.
            upstream.script_for("t", script(*[{"reasoning_content": "r", "content": None}, {"content": " "}] * pairs))
            chunks, _ = await stream_raw(edge, model="plain")
            assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == (" " * pairs, "r" * 512)
            # A whole answer has one of each, all its text.
            upstream.script_for("t", alternating)
            whole = (await client.post("/v1/chat/completions", json={"model": "plain", "messages": MESSAGES})).json()
    message = whole["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("c" * pairs, "r" * pairs)


async def test_template_consumed_open_tag(shaped):
    """Content that starts inside reasoning and only shows </think>: think_tags="open" streams it
    as reasoning; a non-streaming answer repairs it even in "auto"."""
    edge, upstream = shaped
    upstream.script_for("t", script({"content": "plan</thi"}, {"content": "nk>Answer"}))
    with trio.fail_after(BOUND):
        chunks, _ = await stream_raw(edge, model="opened")
        async with http(edge) as client:
            whole = (await client.post("/v1/chat/completions", json={"model": "plain", "messages": MESSAGES})).json()
    assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == ("Answer", "plan")
    message = whole["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("Answer", "plan")
    # "open", and the model writes <think> itself after all: the tag is not reasoning text
    upstream.script_for("t", script({"content": "<thi"}, {"content": "nk>plan</think>Answer"}))
    with trio.fail_after(BOUND):
        chunks, _ = await stream_raw(edge, model="opened")
    assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == ("Answer", "plan")


async def test_open_think_tags_with_reasoning_in_its_own_field_keep_the_answer(shaped):
    """think_tags "open" behind a model server that parts the reasoning itself (vLLM with a
    reasoning parser): the answer was taken for reasoning too, streamed and whole ("planAnswer"
    in both fields; with the reasoning hidden, only the notice: an outside audit). Reasoning in
    its own field first: the content is the answer."""
    edge, upstream = shaped
    upstream.script_for("t", script({"reasoning_content": "plan"}, {"content": "Answer"}))
    with trio.fail_after(BOUND):
        chunks, _ = await stream_raw(edge, model="opened")
        hidden, _ = await stream_raw(edge, model="opened", include_reasoning=False)
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "opened", "messages": MESSAGES})
    assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == ("Answer", "plan")
    assert (joined(hidden, "content"), joined(hidden, "reasoning_content")) == ("Answer", "")
    message = r.json()["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("Answer", "plan")
    # Content first (a lone newline, as some servers send; or text), then the field's reasoning:
    # the answer from there is the answer (the stream had both fields "preplanAnswer").
    for head, shown in (("\n", ("Answer", "plan")), ("pre", ("Answer", "preplan"))):
        upstream.script_for("t", script({"content": head}, {"reasoning_content": "plan"}, {"content": "Answer"}))
        with trio.fail_after(BOUND):
            chunks, _ = await stream_raw(edge, model="opened")
        assert (joined(chunks, "content"), joined(chunks, "reasoning_content").strip()) == shown, head


async def test_content_before_the_servers_own_reasoning_reads_the_same_streamed_and_whole(shaped):
    """Content, then reasoning in the model server's own field, then more content (found from
    outside): a model whose template opens <think> (learned) streamed it all as reasoning, cut
    by max_tokens ("let me thinkSure. The answer is 42"), where the whole answer had the
    content as the answer; with think_tags "open", the whole answer had the first content as
    the answer, where the stream had it as reasoning. Each now reads alike both ways."""
    edge, upstream = shaped
    fielded = [{"content": "Sure. "}, {"reasoning_content": "let me think"}, {"content": "The answer is 42"}]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            learn = script({"content": "plan</think>Answer"})  # (r1 learns: its template opens <think>)
            upstream.script_for("t", learn)
            await client.post("/v1/chat/completions", json={"model": "r1", "messages": MESSAGES})
            for name, finish, want in (
                ("r1", "length", ("Sure. The answer is 42", "let me think")),
                ("opened", "stop", ("The answer is 42", "Sure. let me think")),
            ):
                upstream.script_for("t", script(*fielded, finish=finish))
                chunks, _ = await stream_raw(edge, model=name)
                upstream.script_for("t", script(*fielded, finish=finish))
                r = await client.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES})
                message = r.json()["choices"][0]["message"]
                assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == want, name
                assert (message["content"], message["reasoning_content"]) == want, name
            # ... and a </think> after the server's own reasoning is read alike too (the whole answer
            # read the tags of all its content as its head: a re-check found them apart), as written:
            # the server parts reasoning itself (it was a boundary: the text before it that a stream
            # had not passed on yet was reasoning, so what a client saw hung on the deltas' split).
            tagged = [
                {"content": "<x>\n"},
                {"reasoning_content": "plan"},
                {"content": "<thi"},
                {"content": "</think>ok"},
            ]
            streamed, whole = await both_ways(shaped, client, "r1", script(*tagged))
            assert streamed == whole == ("<x>\n<thi</think>ok", "plan")


async def test_open_think_tags_keep_a_close_tag_after_the_servers_own_reasoning_alike(shaped):
    """think_tags "open", the model server parting the reasoning itself, then content with a
    `</think>` of no tag before it: the whole answer keeps the tag as written; the stream dropped
    it, with the content before it not yet passed on given as reasoning (a differential run: 109
    of 1,500 random streams per configuration read apart). Both now keep it."""
    edge, upstream = shaped
    tagged = [{"reasoning_content": "plan"}, {"content": "a <b"}, {"content": "</think> c"}]
    with trio.fail_after(BOUND):
        upstream.script_for("t", script(*tagged))
        chunks, _ = await stream_raw(edge, model="opened")
        upstream.script_for("t", script(*tagged))
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "opened", "messages": MESSAGES})
    message = r.json()["choices"][0]["message"]
    streamed = (joined(chunks, "content"), joined(chunks, "reasoning_content"))
    assert streamed == (message["content"], message["reasoning_content"]) == ("a <b</think> c", "plan")


async def test_a_close_tag_after_the_servers_own_reasoning_reads_alike_however_the_deltas_split(shaped):
    """think_tags "auto", reasoning in the model server's own field, then content with a
    `</think>` of no tag before it: a whole answer took the text before the tag for reasoning
    (hidden from a strict model's client), a stream only the part of it in the tag's delta, so a
    strict client saw "Private plan. " or not by where the deltas split (an outside audit).
    The server parts reasoning itself: the content is the answer, the tag as written."""
    edge, upstream = shaped
    first = {"reasoning_content": "R"}
    splits = (
        [first, {"content": "Private plan. "}, {"content": "</think>Answer"}],
        [first, {"content": "Private plan. </think>Answer"}],
    )
    seen = set()
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for name in ("plain", "strict", "strictbuf"):
                for deltas in splits:
                    streamed, whole = await both_ways(shaped, client, name, script(*deltas))
                    assert streamed == whole, (name, deltas)
                    seen.add((name, whole[0]))
    assert seen == {(name, "Private plan. </think>Answer") for name in ("plain", "strict", "strictbuf")}


async def test_a_strict_models_content_before_the_servers_own_reasoning_reads_alike(shaped):
    """A strict model's content, then reasoning in the model server's own field, then more:
    the stream held the first content as the head of reasoning a template opens, and once the
    edge had learned the model's template opens <think>, a run cut by max_tokens dropped it as
    reasoning: an empty answer streamed, "Head text more" whole (an outside audit). The server
    parts reasoning itself: it is the answer both ways, learned or not, cut or not, and a
    </think> after the server's reasoning is kept as written."""
    edge, upstream = shaped
    head = [{"content": "Head text "}, {"reasoning_content": "R"}]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for learned in (False, True):
                if learned:  # (a whole answer with a </think> first: its template opens <think>)
                    upstream.script_for("t", script({"content": "x</think>y"}))
                    await client.post("/v1/chat/completions", json={"model": "strict", "messages": MESSAGES})
                for finish in ("length", "stop"):
                    for rest, want in (("more", "Head text more"), ("</think>more", "Head text </think>more")):
                        steps = script(*head, {"content": rest}, finish=finish)
                        streamed, whole = await both_ways(shaped, client, "strict", steps)
                        assert streamed == whole == (want, ""), (learned, finish, rest)


async def test_reasoning_in_think_tags_then_the_servers_own_keeps_its_order_streamed_and_whole(shaped):
    """Content with think tags, then reasoning in the model server's own field: a whole answer
    split the tags at its end, so their reasoning came after the server's ("RA" whole, "AR"
    streamed; an outside audit). Both now read in the order it came."""
    edge, upstream = shaped
    cases = (
        ([{"content": "<think>A</think>B"}, {"reasoning_content": "R"}, {"content": "C"}], ("BC", "AR")),
        ([{"reasoning_content": "R"}, {"content": "<think>A</think>B"}, {"reasoning_content": "S"}], ("B", "RAS")),
        ([{"content": "<think>A"}, {"reasoning_content": "R"}, {"content": "</think>B"}], ("B", "AR")),
        ([{"content": "x<think>A"}, {"reasoning_content": "R"}, {"content": "</think>B"}], ("xB", "AR")),
    )
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for deltas, want in cases:
                streamed, whole = await both_ways(shaped, client, "plain", script(*deltas))
                assert streamed == whole == want, deltas
            # think_tags "open" too (the server's reasoning first: the content is the answer's)
            deltas = [{"reasoning_content": "R"}, {"content": "<think>A</think>B"}, {"reasoning_content": "S"}]
            streamed, whole = await both_ways(shaped, client, "opened", script(*deltas))
            assert streamed == whole == ("B", "RAS")


async def test_a_call_written_before_the_templates_close_tag_stays_reasoning_when_the_server_reasons_too(shaped):
    """A request with tools, content that writes a call (or names the tag) before the `</think>`
    a template opened, then reasoning in the server's own field: the whole answer split its
    content at that reasoning, reading call blocks as the answer's, so a strict model's client
    got "Secret plan, Answer" and the call made (a re-check of that split). What comes before
    that first </think> is reasoning, call blocks too, as at the end of a whole answer."""
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with trio.fail_after(BOUND):
        async with http(shaped[0]) as client:
            for name in ("strict", "strictbuf"):
                for head in (f"Secret plan, {call} more", "Secret plan: use a <tool_call> tag, more"):
                    steps = script({"content": head + "</think>Answer"}, {"reasoning_content": "R"})
                    streamed, whole = await both_ways(shaped, client, name, steps, tools=tools)
                    assert streamed == whole == ("Answer", ""), (name, head)


async def test_auto_learns_a_template_that_opens_think(shaped):
    """think_tags "auto" (the default), a template that opens <think> (DeepSeek-R1, Qwen3
    thinking): the first answer that shows </think> before any <think> teaches the edge, and
    the model's next live streams hold their head until it shows </think> (reasoning, then
    live content), on every API."""
    edge, upstream = shaped
    r1 = script({"content": "plan</thi"}, {"content": "nk>Answer"})
    upstream.script_for("t", r1)
    with trio.fail_after(BOUND):
        first, _ = await stream_raw(edge, model="plain")  # its text went out before the </think>
        assert "Answer" in joined(first, "content")
        upstream.script_for("t", r1)
        chunks, _ = await stream_raw(edge, model="plain")
        assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == ("Answer", "plan")
        # A whole answer teaches too: r1's first live stream is already right.
        async with http(edge) as client:
            whole = (await client.post("/v1/chat/completions", json={"model": "r1", "messages": MESSAGES})).json()
            assert whole["choices"][0]["message"]["content"] == "Answer"
            upstream.script_for("t", r1)
            chunks, _ = await stream_raw(edge, model="r1")
            assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == ("Answer", "plan")
            # The Messages API's stream: a thinking block, then the text.
            upstream.script_for("t", r1)
            thinking = {"type": "enabled", "budget_tokens": 1024}
            body = {"model": "r1", "max_tokens": 2048, "messages": MESSAGES, "stream": True, "thinking": thinking}
            events = data_lines((await client.post("/v1/messages", json=body)).content)
            deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
            assert "".join(d.get("thinking", "") for d in deltas) == "plan"
            assert "".join(d.get("text", "") for d in deltas) == "Answer"
        # A model server that parts reasoning itself (another node's, with a reasoning parser): as sent.
        upstream.script_for("t", script({"reasoning_content": "plan"}, {"content": "Answer"}))
        chunks, _ = await stream_raw(edge, model="r1")
    assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == ("Answer", "plan")


def sent_then(steps: list) -> list:
    """``steps`` after a delta "Sent. " that the client has before them (never joined to them)."""
    return [("chunk", {"content": "Sent. "}), ("sleep", 0.3), *steps]


async def test_a_live_streams_first_close_tag_is_never_content(shaped):
    """A model whose template opens <think>, streamed before the edge has learned it (its first
    answer after a start, or after an answer without thinking unlearned it): the </think> went
    out as content, and the text before it in the same delta too (an outside audit: "Reasoning
    here.</think>answer" as content). The tag is dropped and what was not sent yet is reasoning;
    what was sent stays content (a live stream cannot take it back)."""
    edge, upstream = shaped
    cases = [
        (script({"content": "</thi"}, {"content": "nk>Answer"}), ("Answer", "")),
        (script({"content": "plan</think>Answer"}), ("Answer", "plan")),
        (script({"content": "plan</th"}, {"content": "ink>Answer"}), ("Answer", "plan")),  # (held till known)
        (sent_then(script({"content": "plan</think>Answer"})), ("Sent. Answer", "plan")),
    ]
    with trio.fail_after(BOUND):
        for steps, expected in cases:
            upstream.script_for("t", steps)
            chunks, _ = await stream_raw(edge, model="plain", include_reasoning=True)
            assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == expected
            upstream.script_for("t", script({"content": "No thinking."}))  # (learned: unlearned by this)
            chunks, _ = await stream_raw(edge, model="plain")
            assert joined(chunks, "content") == "No thinking."
        # An answer that writes </think> itself, after its reasoning's: the answer's, on the model's
        # first stream, once it is learned, and on a strict model (whose held head ends at the first).
        # (The second was taken for the first: the answer before it dropped, found by a re-check.)
        quoting = script({"content": "plan</think>"}, {"content": "Answer: write "}, {"content": "</think> to close."})
        for name, reasoning in (("plain", "plan"), ("plain", "plan"), ("strict", "")):
            upstream.script_for("t", quoting)
            chunks, _ = await stream_raw(edge, model=name, include_reasoning=True)
            assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == (
                "Answer: write </think> to close.",
                reasoning,
            ), name


async def test_a_model_learned_wrong_loses_no_text_and_is_unlearned(shaped):
    """One client's answer that only quotes </think> teaches the edge wrong (an outside re-audit).
    Other clients' streams of that model then lose nothing and get nothing twice, however they end
    (cut off by max_tokens, a live tool call, a refusal; reasoning shown or hidden): their text
    comes as content, at the end (a run that fails: its held text as reasoning, if shown, then the
    error; one cut by max_tokens before a </think>: reasoning, as the learned template says, so
    shown as reasoning and copied into the answer, or hidden with the notice). An answer that ends (stop) with no </think> unlearns the model, and its streams are
    live again."""
    edge, upstream = shaped
    poison = script({"content": "Say x </think> y"})
    hello = ({"content": "Hello "}, {"content": "world"})
    with trio.fail_after(BOUND):
        for name in ("r1", "r1tools"):
            upstream.script_for("t", poison)
            await stream_raw(edge, model=name)
        for shown in (False, True):
            # (cut by length with no </think>: reasoning, by the template learned; shown, it is not
            # lost: copied into the answer, as any reasoning-only run's)
            upstream.script_for("t", script(*hello, finish="length"))
            chunks, _ = await stream_raw(edge, model="r1", include_reasoning=shown)
            said = ("Hello world", "Hello world") if shown else (hidden_reasoning_notice("length"), "")
            assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == said
            upstream.script_for("t", script({"content": "Sorry. "}, {"refusal": "I cannot help."}))
            chunks, _ = await stream_raw(edge, model="r1", include_reasoning=shown)
            assert joined(chunks, "content") == "Sorry. " and joined(chunks, "refusal") == "I cannot help."
            call = {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f"}}]}
            args = {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
            upstream.script_for("t", script({"content": "Checking. "}, call, args, finish="tool_calls"))
            tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            chunks, _ = await stream_raw(edge, model="r1tools", include_reasoning=shown, tools=tools)
            assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == ("Checking. ", "")
            assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # A run that fails while its head is held: the held text as reasoning (it may be), then the error.
        for shown in (False, True):
            upstream.script_for("t", [*(("chunk", d) for d in hello), ("raw", b"data: {not json}\n\n"), ("done",)])
            async with http(edge) as client:
                r = await client.post(
                    "/v1/chat/completions",
                    json={"model": "r1", "messages": MESSAGES, "stream": True, "include_reasoning": shown},
                )
            events = sse_events(r.content)
            chunks = [msgspec.json.decode(e) for e in events[:-1]]
            assert "error" in chunks[-1] and not joined(chunks[:-1], "content")
            assert joined(chunks[:-1], "reasoning_content") == ("Hello world" if shown else "")
        upstream.script_for("t", script(*hello))  # stop, no </think>: the content, once; r1 unlearned
        chunks, _ = await stream_raw(edge, model="r1", include_reasoning=True)
        assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == ("Hello world", "")
        upstream.script_for("t", [("chunk", {"content": "Live "}), ("sleep", 0.3), *script({"content": "text."})])
        chunks, raw = await stream_raw(edge, model="r1")
    assert joined(chunks, "content") == "Live text." and not joined(chunks, "reasoning_content")
    assert raw.index(b"Live ") < raw.index(b": keep-alive")  # streamed before the pause, not at the end


async def test_reasoning_cut_by_max_tokens_is_never_content_once_the_template_is_learned(shaped):
    """A model whose template opens <think> (learned), cut by max_tokens before its </think>:
    its chain of thought went out as content, live and whole (an outside audit): a strict
    model's client read it all, an XML-completion model's got it wrapped as the task's
    result, and a client that turned reasoning off read it too. It is reasoning: never shown
    by a strict model, the hidden-reasoning notice for a client that turned it off."""
    edge, upstream = shaped
    secret = ({"content": "I must never reveal "}, {"content": "the key sk-123 so"})
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for name in ("plain", "strict", "xmltool"):  # (a whole answer teaches the edge)
                upstream.script_for("t", script({"content": "plan</think>Answer"}))
                r = await client.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES})
                said = r.json()["choices"][0]["message"]["content"]
                assert "Answer" in said and "plan" not in said, said
            for name, body in (("strict", {}), ("xmltool", {}), ("plain", {"include_reasoning": False})):
                upstream.script_for("t", script(*secret, finish="length"))
                chunks, raw = await stream_raw(edge, model=name, **body)
                assert b"sk-123" not in raw and b"never reveal" not in raw, (name, raw)
                assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                upstream.script_for("t", script(*secret, finish="length"))
                whole = await client.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES, **body})
                assert b"sk-123" not in whole.content, (name, whole.text)
                said = whole.json()["choices"][0]["message"]
                notice = "" if name == "strict" else hidden_reasoning_notice("length")
                if name == "xmltool":
                    notice = ""  # (strict: no fallback, so nothing to wrap)
                assert (said.get("content") or "") == notice, (name, said)
            assert joined(chunks, "content") == hidden_reasoning_notice("length")  # (plain, hidden, live)
            # A model server that parts reasoning itself: its content is the answer, cut or not
            # (it was taken for reasoning when collected: a re-check).
            parted = script({"reasoning_content": "Let me think."}, {"content": "The answer is: thi"}, finish="length")
            upstream.script_for("t", parted)
            whole = await client.post("/v1/chat/completions", json={"model": "plain", "messages": MESSAGES})
            said = whole.json()["choices"][0]["message"]
            assert (said["content"], said["reasoning_content"]) == ("The answer is: thi", "Let me think."), said
            # A <think> inside a call block is no think tag: cut, all of it is reasoning, and the call
            # written in it is no call (it went out as content, the call made: a re-check).
            tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            call = '<tool_call>{"name": "f", "arguments": {"x": "<think>"}}</tool_call>'
            upstream.script_for("t", script({"content": "secret sk-123 " + call + " and then I sh"}, finish="length"))
            body = {"model": "strict", "messages": MESSAGES, "tools": tools}
            whole = await client.post("/v1/chat/completions", json=body)
            assert b"sk-123" not in whole.content and not whole.json()["choices"][0]["message"].get("tool_calls")
            # A model only ever collected is unlearned by an answer that stops with no think tag, as a
            # live stream's is (it stayed learned wrong, its cut answers hidden: a re-check).
            upstream.script_for("t", script({"content": "Just an answer."}))
            await client.post("/v1/chat/completions", json={"model": "xmltool", "messages": MESSAGES})
            upstream.script_for("t", script({"content": "Cut short by"}, finish="length"))
            cut = await client.post("/v1/chat/completions", json={"model": "xmltool", "messages": MESSAGES})
            assert "Cut short by" in cut.json()["choices"][0]["message"]["content"], cut.text


async def test_a_held_head_is_read_by_its_first_think_tag_as_a_whole_answer_is(shaped):
    """A live stream whose head is held (strict output; a model learned to open <think>) looked
    only for a </think> (an outside audit): text before a later <think> was reasoning, dropped on
    a strict model and shown with the literal tag on a learned one, and a </think> inside a text
    tool call's arguments cut the call in two (no call reached the client). The head is read by
    its first think tag outside call blocks now, as a whole answer always was."""
    edge, upstream = shaped
    intro = script({"content": "Intro text. "}, {"content": "<think>r"}, {"content": "</think>Answer"})
    write = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}
    call = '<tool_call>{"name": "write_file", "arguments": {"content": "close with </think> here"}}</tool_call>'
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for name in ("r1", "r1tools"):  # (a whole answer teaches the edge the template opens <think>)
                upstream.script_for("t", script({"content": "plan</think>Answer"}))
                await client.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES})
            for name, expected in (("strict", ("Intro text. Answer", "")), ("r1", ("Intro text. Answer", "r"))):
                upstream.script_for("t", intro)
                chunks, _ = await stream_raw(edge, model=name, include_reasoning=True)
                assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == expected, name
                upstream.script_for("t", intro)
                body = {"model": name, "messages": MESSAGES, "include_reasoning": True}
                message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
                assert (message["content"], message.get("reasoning_content") or "") == expected, name
            upstream.script_for("t", script(*({"content": call[i : i + 7]} for i in range(0, len(call), 7))))
            chunks, _ = await stream_raw(edge, model="r1tools", tools=[write])
    calls = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert (joined(chunks, "content"), joined(chunks, "reasoning_content")) == ("", "")
    assert calls[0]["function"]["name"] == "write_file"
    arguments = json.loads("".join(d["function"].get("arguments") or "" for d in calls))
    assert arguments == {"content": "close with </think> here"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # A re-check: reasoning that names the call tag in prose went out as content on a strict model
    # (the tag was taken for a block that ran past the </think>); and think tags in a call block
    # inside the template's reasoning split a whole answer apart from its stream.
    prose = "I should emit <tool_call> with it.\n</think>\n\n" + call
    quoted = '<tool_call>{"name": "f", "arguments": {"x": "a</think>b<think>c"}}</tool_call>why?</think>ans'
    for name, text, expected in (
        ("strict", prose, ("", "", ["write_file"])),
        ("r1tools", quoted, ("ans", quoted[: quoted.rindex("</think>")], [])),
    ):
        steps = script(*({"content": text[i : i + 5]} for i in range(0, len(text), 5)))
        with trio.fail_after(BOUND):
            upstream.script_for("t", steps)
            chunks, _ = await stream_raw(edge, model=name, tools=[write], include_reasoning=True)
            upstream.script_for("t", steps)
            async with http(edge) as client:
                body = {"model": name, "messages": MESSAGES, "tools": [write], "include_reasoning": True}
                message = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        streamed = [
            d["function"]["name"]
            for c in chunks
            if c["choices"]
            for d in c["choices"][0]["delta"].get("tool_calls") or ()
            if d.get("function", {}).get("name")
        ]
        assert (joined(chunks, "content"), joined(chunks, "reasoning_content"), streamed) == expected, name
        whole = [c["function"]["name"] for c in message.get("tool_calls") or ()]
        assert (message["content"] or "", message.get("reasoning_content") or "", whole) == expected, name


async def test_sentinels_split_across_deltas_are_removed(shaped):
    """Leaked special tokens vanish from content and reasoning, split or not, defaults and configured."""
    edge, upstream = shaped
    upstream.script_for(
        "t",
        script(
            {"reasoning_content": "r<|eot"},
            {"reasoning_content": "_id|>"},
            {"content": "Hello<|im_"},
            {"content": "end|> x<|cus"},
            {"content": "tom|>"},
        ),
    )
    with trio.fail_after(BOUND):
        chunks, _ = await stream_raw(edge, model="custom")
    assert joined(chunks, "content") == "Hello x"
    assert joined(chunks, "reasoning_content") == "r"


async def test_deepseeks_and_mistrals_control_tokens_are_removed(shaped):
    """DeepSeek's turn and tool-call tokens and Mistral's [TOOL_CALLS] (what a model server
    without a tool parser leaves in the text) are leaked special tokens as the README says:
    removed, split or not, streamed and whole. Only DeepSeek's sentence tokens and Mistral's
    [INST] were (an outside audit)."""
    edge, upstream = shaped
    said = (
        "Hi<｜Assistant｜>there<｜User｜>. <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜> [TOOL_CALLS][] [AVAILABLE_TOOLS][/AVAILABLE_TOOLS]"
    )
    expected = "Hithere. functionf [] "
    cut = said.index("sep") + 1  # (inside a token)
    steps = script({"content": said[:cut]}, {"content": said[cut:]})
    with trio.fail_after(BOUND):
        upstream.script_for("t", steps)
        chunks, _ = await stream_raw(edge, model="custom")
        upstream.script_for("t", steps)
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "custom", "messages": MESSAGES})
    assert joined(chunks, "content") == expected
    assert r.json()["choices"][0]["message"]["content"] == expected


async def test_a_model_without_the_default_sentinels_keeps_their_words(shaped):
    """The built-in sentinels apply to every model, and an answer about HTML or chat templates
    lost its `</s>` and `[INST]` (an outside audit): `default_sentinels = false` removes only
    the model's own, streamed and whole."""
    edge, upstream = shaped
    said = "Price: <s>$20</s> now; wrap turns in [INST] and [/INST]; Gemma ends with <eos>."
    steps = script({"content": said[:20]}, {"content": said[20:] + "<|cus"}, {"content": "tom|>"})
    with trio.fail_after(BOUND):
        for name, expected in (
            ("custom", "Price: <s>$20 now; wrap turns in  and ; Gemma ends with ."),
            ("ownonly", said),
        ):
            upstream.script_for("t", steps)
            chunks, _ = await stream_raw(edge, model=name)
            assert joined(chunks, "content") == expected, name
            upstream.script_for("t", steps)
            async with http(edge) as client:
                r = await client.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES})
            assert r.json()["choices"][0]["message"]["content"] == expected, name


async def test_reasoning_only_run_gets_fallback_content(shaped):
    """A run with reasoning but no content gets a fallback: the reasoning itself when it is
    included, else a notice naming the finish reason; strict gets none."""
    edge, upstream = shaped
    upstream.script_for("t", script({"reasoning_content": "only thoughts"}, finish="length"))
    with trio.fail_after(BOUND):
        shown, _ = await stream_raw(edge, model="plain")
        hidden, _ = await stream_raw(edge, model="plain", include_reasoning=False)
        strict, _ = await stream_raw(edge, model="strict")
        async with http(edge) as client:
            whole = (
                await client.post(
                    "/v1/chat/completions", json={"model": "plain", "messages": MESSAGES, "include_reasoning": False}
                )
            ).json()
    assert joined(shown, "content") == "only thoughts"
    notice = joined(hidden, "content")
    assert "hidden reasoning" in notice and "length" in notice
    assert whole["choices"][0]["message"]["content"] == notice
    assert whole["choices"][0]["finish_reason"] == "length"
    assert joined(strict, "content") == "" and joined(strict, "reasoning_content") == ""
    assert strict[-1]["choices"][0]["finish_reason"] == "length"


async def test_whitespace_answer_with_hidden_reasoning_reads_the_same_streamed_and_whole(shaped):
    """A model that thinks, then answers only "\\n\\n": the stream has already shown the
    whitespace when the notice comes, so the whole answer keeps it too (the whole answer
    was the notice alone: an outside audit)."""
    edge, upstream = shaped
    upstream.script_for("t", script({"reasoning_content": "thoughts"}, {"content": "\n\n"}))
    with trio.fail_after(BOUND):
        streamed, _ = await stream_raw(edge, model="plain", include_reasoning=False)
        async with http(edge) as client:
            whole = (
                await client.post(
                    "/v1/chat/completions", json={"model": "plain", "messages": MESSAGES, "include_reasoning": False}
                )
            ).json()
    text = joined(streamed, "content")
    assert text.startswith("\n\nThe model produced only hidden reasoning")
    assert whole["choices"][0]["message"]["content"] == text


async def test_strict_without_buffer_streams_content_live_and_hides_reasoning(shaped):
    """strict_output alone: reasoning never leaves the edge; content still streams delta by
    delta (the model pauses between them, so no layer joins them)."""
    edge, upstream = shaped
    steps = [("chunk", {"reasoning_content": "secret"})]
    for text in "abc":
        steps += [("chunk", {"content": text}), ("sleep", 0.05)]
    upstream.script_for("t", [*steps, ("chunk", {}, "stop"), ("done",)])
    with trio.fail_after(BOUND):
        chunks, raw = await stream_raw(edge, model="strict")
    assert b"secret" not in raw
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:4]] == ["a", "b", "c"]


async def test_strict_buffered_stream_is_role_content_finish_done(shaped):
    """strict + stream_buffer: the whole run is collected, then role, one content chunk,
    finish and [DONE]; keep-alive comments flow while it is collected."""
    edge, upstream = shaped
    upstream.script_for("t", script({"reasoning_content": "secret"}, {"content": "a"}, {"content": "b"}, pause=0.7))
    with trio.fail_after(BOUND):
        chunks, raw = await stream_raw(edge, model="strictbuf")
    assert [list(c["choices"][0]["delta"]) for c in chunks] == [["role"], ["content"], []]
    assert chunks[1]["choices"][0]["delta"]["content"] == "ab"
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"
    assert b"secret" not in raw
    assert raw.startswith(b": keep-alive\n\n")


async def test_xml_completion_tool_wraps_plain_text_only(shaped):
    """Plain text is wrapped in the completion tool; text that already holds an XML tool use is left as is."""
    edge, upstream = shaped
    upstream.script_for("t", script({"content": "All done."}))
    with trio.fail_after(BOUND):
        chunks, _ = await stream_raw(edge, model="xmltool")
    assert joined(chunks, "content") == "<attempt_completion>\n<result>\nAll done.\n</result>\n</attempt_completion>"
    tool_use = "<read_file>\n<path>a.py</path>\n</read_file>"
    upstream.script_for("t", script({"content": tool_use}))
    with trio.fail_after(BOUND):
        chunks, _ = await stream_raw(edge, model="xmltool")
        async with http(edge) as client:
            whole = (await client.post("/v1/chat/completions", json={"model": "xmltool", "messages": MESSAGES})).json()
    assert joined(chunks, "content") == tool_use
    assert whole["choices"][0]["message"]["content"] == tool_use


async def test_xml_completion_tool_leaves_an_empty_answer_unwrapped(shaped):
    """A run with hidden reasoning alone (cut off at its length) has no text to wrap: an empty
    completion would tell an XML-tool agent that its task is done, with an empty result."""
    edge, upstream = shaped
    upstream.script_for("t", script({"reasoning_content": "thinking..."}, finish="length"))
    with trio.fail_after(BOUND):
        chunks, raw = await stream_raw(edge, model="xmltool")
        async with http(edge) as client:
            whole = (await client.post("/v1/chat/completions", json={"model": "xmltool", "messages": MESSAGES})).json()
    assert b"attempt_completion" not in raw and b"thinking" not in raw
    assert joined(chunks, "content") == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not whole["choices"][0]["message"]["content"]
    assert whole["choices"][0]["finish_reason"] == "length"


async def test_xml_completion_tool_wraps_a_stream_without_stream_buffer_too(shaped):
    """The wrap needs the whole text: a strict model with xml_completion_tool and no
    stream_buffer still streams it wrapped, the same as its whole responses."""
    edge, upstream = shaped
    upstream.script_for("t", script({"content": "All "}, {"content": "done."}))
    with trio.fail_after(BOUND):
        chunks, _ = await stream_raw(edge, model="xmllive")
        async with http(edge) as client:
            whole = (await client.post("/v1/chat/completions", json={"model": "xmllive", "messages": MESSAGES})).json()
    wrapped = "<attempt_completion>\n<result>\nAll done.\n</result>\n</attempt_completion>"
    assert joined(chunks, "content") == wrapped
    assert whole["choices"][0]["message"]["content"] == wrapped


async def test_usage_chunk_and_usage_on_whole_responses(shaped):
    """include_usage adds a usage chunk (choices: []) after the finish chunk; whole responses carry usage;
    without upstream usage, the counts are the edge's estimate, always integers, and the usage says
    so (`"estimated": true`, on every API: it read as the model server's count)."""
    edge, upstream = shaped
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    upstream.script_for("t", script({"content": "a"}, {"content": "b"}, usage=usage))
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            stream = await client.chat.completions.create(
                model="plain", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
            )
            chunks = [c async for c in stream]
            whole = await client.chat.completions.create(model="plain", messages=MESSAGES)
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])
    assert whole.usage.prompt_tokens == 7 and whole.usage.completion_tokens == 2
    assert "estimated" not in whole.usage.model_dump() and "estimated" not in chunks[-1].usage.model_dump()
    upstream.script_for("t", script({"content": "a"}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            whole = (await client.post("/v1/chat/completions", json={"model": "plain", "messages": MESSAGES})).json()
            streamed = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "plain",
                    "messages": MESSAGES,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
            messages = (
                await client.post("/v1/messages", json={"model": "plain", "max_tokens": 64, "messages": MESSAGES})
            ).json()
            responses = (await client.post("/v1/responses", json={"model": "plain", "input": "hi"})).json()
    assert whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5, "estimated": True}
    last = [line for line in streamed.text.splitlines() if line.startswith("data: {")][-1]
    assert json.loads(last[6:])["usage"]["estimated"] is True
    assert messages["usage"]["estimated"] is True and messages["usage"]["output_tokens"] == 1
    assert responses["usage"]["estimated"] is True and responses["usage"]["output_tokens"] == 1


async def test_keep_alive_while_waiting_for_the_first_token(shaped):
    """A live stream whose model is slow to start gets SSE keep-alive comments, then the answer."""
    edge, upstream = shaped
    upstream.script_for("t", script({"content": "late"}, pause=0.7))
    with trio.fail_after(BOUND):
        chunks, raw = await stream_raw(edge, model="plain")
    assert raw.count(b": keep-alive\n\n") >= 2
    assert joined(chunks, "content") == "late"


async def test_keep_alive_in_a_pause_mid_stream_and_none_while_text_flows(shaped):
    """A model that pauses mid-answer gets keep-alives during the pause (the
    run's timers wake the stream: it holds no timer of its own); text that
    keeps arriving faster than keepalive_s gets none."""
    edge, upstream = shaped
    pause = [("chunk", {"content": "a"}), ("sleep", 0.7), *script({"content": "b"})]
    steady = [step for t in "cdefghijklmnopqrstuvw" for step in (("chunk", {"content": t}), ("sleep", 0.02))]
    upstream.script_for("t", pause)
    with trio.fail_after(BOUND):
        chunks, raw = await stream_raw(edge, model="plain")
        assert joined(chunks, "content") == "ab"
        tail = raw.partition(b'"content":"a"')[2]
        assert tail.split(b'"content":"b"')[0].count(b": keep-alive\n\n") >= 2
        upstream.script_for("t", [*steady, *script()])
        chunks, raw = await stream_raw(edge, model="plain")
    assert joined(chunks, "content") == "cdefghijklmnopqrstuvw"
    # Over 420 ms of text, two keepalive_s periods, deltas 20 ms apart leave no
    # gap of 200 ms. Before the first, and between the last and the end, a slow
    # machine may legitimately send one (a loaded run of the suite did).
    flowing = raw.partition(b'"content":"c"')[2].partition(b'"content":"w"')[0]
    assert flowing and b": keep-alive" not in flowing


async def test_trace_logs_each_chunk_and_a_summary(shaped):
    """Run metadata iop_trace_stream logs every emitted chunk (with filtering noted) and one summary."""
    edge, upstream = shaped
    upstream.script_for(  # a pause between the deltas: no layer joins them
        "t", [("chunk", {"content": "a<|im_end|>"}), ("sleep", 0.05), *script({"content": "b"})]
    )
    with structlog.testing.capture_logs([structlog.contextvars.merge_contextvars]) as logs, trio.fail_after(BOUND):
        await stream_raw(edge, model="plain", metadata={"iop_trace_stream": "1"})
        await stream_raw(edge, model="plain")
        await eventually(lambda: sum(e["event"] == "stream closed" for e in logs) == 2)
    chunks = [e for e in logs if e["event"] == "chat completion stream output chunk"]
    assert [(e["seq"], e["type"], e["delta_len"]) for e in chunks] == [
        (1, "content", 1),
        (2, "content", 1),
        (3, "finish", 0),
    ]
    assert chunks[0]["run_id"] == chunks[-1]["run_id"]
    assert [e["source_len"] for e in logs if e["event"] == "chat completion stream output filtered"] == [11]
    summaries = [e for e in logs if e["event"] == "stream closed"]
    assert len(summaries) == 2 and summaries[0]["content_len"] == 2


async def test_a_buffered_streams_summary_counts_the_reasoning_it_hid(shaped):
    """The summary line of a buffered stream whose reasoning is hidden (strict output, or a
    client that turned it off) said `reasoning_len=0` where a live one said what the model
    produced (an outside audit): it counts the reasoning produced, shown or not."""
    edge, upstream = shaped
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        for name, body in (("strictbuf", {}), ("strict", {}), ("plain", {"include_reasoning": False})):
            upstream.script_for("t", script({"reasoning_content": "0123456789"}, {"content": "ans"}))
            chunks, _ = await stream_raw(edge, model=name, **body)
            assert joined(chunks, "content") == "ans"
        await eventually(lambda: sum(e["event"] == "stream closed" for e in logs) == 3)
    summaries = [e for e in logs if e["event"] == "stream closed"]
    assert [(e["content_len"], e["reasoning_len"]) for e in summaries] == [(3, 10)] * 3, summaries


async def test_a_clients_trace_is_bounded_and_an_operator_can_refuse_it(nursery, upstream, monkeypatch):
    """A client's `iop_trace_stream` writes at most MAX_TRACED_CHUNKS lines, then one that says
    the trace stopped (a stream of 131,072 tokens wrote 131,072 lines, about 30 MB, for any client),
    deltas the filters removed counted too (they were not); with `trace_requests = false` the
    metadata traces nothing."""
    monkeypatch.setattr(trace, "MAX_TRACED_CHUNKS", 5)
    deltas = [("chunk", {"content": f"w{i} "}) if i % 2 else ("sleep", 0.002) for i in range(40)]
    upstream.script_for("t", [*deltas, *script()])
    lines = []
    for allowed in (True, False):
        edge = await start_edge(nursery, edge_config(trace_requests=allowed))
        node = await start_node(nursery, edge, [model("plain", upstream, target="t")])
        with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
            chunks, _ = await stream_raw(edge, model="plain", metadata={"iop_trace_stream": "1"})
            await eventually(lambda: any(e["event"] == "stream closed" for e in logs))
        assert joined(chunks, "content") == "".join(f"w{i} " for i in range(1, 40, 2))
        lines.append([e["event"] for e in logs if e["event"].startswith("chat completion stream")])
        await settled(edge, node.agent)
    assert lines[0] == ["chat completion stream output chunk"] * 5 + ["chat completion stream trace stopped"]
    assert lines[1] == []
    upstream.script_for("t", [*(("chunk", {"content": "<|im_end|>"}) for _ in range(20)), *script({"content": "a"})])
    edge = await start_edge(nursery, edge_config())
    node = await start_node(nursery, edge, [model("plain", upstream, target="t")])
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        chunks, _ = await stream_raw(edge, model="plain", metadata={"iop_trace_stream": "1"})
        await eventually(lambda: any(e["event"] == "stream closed" for e in logs))
    assert joined(chunks, "content") == "a"
    traced = [e["event"] for e in logs if e["event"].startswith("chat completion stream")]
    assert len(traced) == 6 and traced[-1] == "chat completion stream trace stopped"
    await settled(edge, node.agent)


async def test_outputs_that_rescan_themselves_are_shaped_in_one_pass(shaped):
    """Outputs a client can prompt a model into, each shaped in time linear in its
    length: 30,000 unclosed `<a_b>` tags on an xml_completion_tool model (17 s of a
    frozen edge before), 40,000 think blocks in a whole response (12 s), and, live
    with tools, a call followed by 50,000 deltas (8 s). The edge answers others
    meanwhile, and the text is the same."""
    edge, upstream = shaped
    tags = "<a_b>" * 30_000
    upstream.script_for("t", script({"content": tags}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            t0 = trio.current_time()
            whole = (await client.post("/v1/chat/completions", json={"model": "xmltool", "messages": MESSAGES})).json()
            wrapped_in = trio.current_time() - t0
        assert whole["choices"][0]["message"]["content"] == wrap_in_completion_tool(tags, "attempt_completion")
        upstream.script_for("t", script({"content": "<think>x</think>y" * 40_000}))
        async with http(edge) as client:
            t0 = trio.current_time()
            whole = (await client.post("/v1/chat/completions", json={"model": "plain", "messages": MESSAGES})).json()
            split_in = trio.current_time() - t0
        message = whole["choices"][0]["message"]  # (past 1,024 tags the rest is content as written)
        rest = "<think>x</think>y" * (40_000 - 512)
        assert message["content"] == "y" * 512 + rest and message["reasoning_content"] == "x" * 512
    assert wrapped_in < 5 and split_in < 5  # (seconds: 0.14 and 0.4 measured, 17 and 12 before)
    held = ToolTextFilter()
    assert held.append("text <tool_call>{") == "text "
    t0 = time.perf_counter()
    for _ in range(50_000):
        assert held.append("ab") == ""
    assert time.perf_counter() - t0 < 5  # (0.01 s measured, 8 s before)
    assert held.flush() == "<tool_call>{" + "ab" * 50_000


async def test_a_strict_live_stream_never_shows_reasoning_a_template_opened(shaped):
    """Strict output, streamed live, a template that consumed <think>: the content
    starts inside reasoning and only shows </think>. The head is held until the
    </think> (or a leading <think>, or the end), so the reasoning never leaves the
    edge (it was streamed as content before); a whole response says the same."""
    edge, upstream = shaped
    upstream.script_for(
        "t",
        script(
            {"content": "I must not reveal the "},
            {"content": "key</th"},
            {"content": "ink>\n\nHel"},
            {"content": "lo!"},
        ),
    )
    with trio.fail_after(BOUND):
        chunks, raw = await stream_raw(edge, model="strict")
        async with http(edge) as client:
            whole = (await client.post("/v1/chat/completions", json={"model": "strict", "messages": MESSAGES})).json()
    assert joined(chunks, "content") == whole["choices"][0]["message"]["content"] == "\n\nHello!"
    assert b"reveal" not in raw
    # While the head is held the client hears keep-alives (keepalive_s 0.2): events came, none showed.
    steps = [("chunk", {"content": "thinking "}), ("sleep", 0.1)] * 12  # (each sooner than keepalive_s)
    upstream.script_for("t", [*steps, ("chunk", {"content": "</think>Hi"}), ("chunk", {}, "stop"), ("done",)])
    with trio.fail_after(BOUND):
        chunks, raw = await stream_raw(edge, model="strict")
    assert joined(chunks, "content") == "Hi" and raw.count(b": keep-alive") >= 3
    # An answer that names <think> itself, after the template-opened reasoning: still hidden whole.
    upstream.script_for("t", script({"content": "SECRET plan</think>Strip <think> blocks."}))
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for name in ("strict", "strictbuf", "plain"):
                body = {"model": name, "messages": MESSAGES}
                whole = (await client.post("/v1/chat/completions", json=body)).json()
                assert "SECRET" not in whole["choices"][0]["message"]["content"], name
    # Opened by the model itself, or never: the same text as before.
    for deltas, content in (
        (({"content": "<think>sec"}, {"content": "ret</think>Hi"}, {"content": " there"}), "Hi there"),
        (({"content": "Just "}, {"content": "text."}), "Just text."),
    ):
        upstream.script_for("t", script(*deltas))
        with trio.fail_after(BOUND):
            chunks, raw = await stream_raw(edge, model="strict")
        assert joined(chunks, "content") == content and b"secret" not in raw
