"""Streamed and whole chat completions through edge -> node -> upstream."""

from __future__ import annotations

import anthropic
import hypothesis
import hypothesis.strategies as st
import msgspec
import openai
import pytest
import structlog
import trio

from node.adapters.openai import _Masked
from scripts.upstream import text_script, words
from tests.conftest import BOUND, http, model, sdk, settled, sse_events, start_edge, start_node, sync_sdk

MESSAGES = [{"role": "user", "content": "hello"}]


async def test_stream_arrives_whole_and_in_order(edge, node, upstream):
    """A streamed completion arrives whole and in order through the OpenAI SDK's own stream parser."""
    upstream.script_for(
        "m-target", text_script(words(50), usage={"prompt_tokens": 3, "completion_tokens": 50, "total_tokens": 53})
    )
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "".join(words(50))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "stop"
    # The upstream got the target model name and a streamed request.
    assert upstream.records[0].body["model"] == "m-target"
    assert upstream.records[0].body["stream"] is True
    await settled(edge, node.agent)


async def test_raw_stream_ends_with_done(edge, node, upstream):
    """The SSE body is `data:` chunks ending in `data: [DONE]`, with SSE headers."""
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 3}
            )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    events = sse_events(r.content)
    assert events[-1] == b"[DONE]"
    chunks = [msgspec.json.decode(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "tok0 tok1 tok2 "


async def test_non_streaming_completion(edge, node, upstream):
    """stream=false returns one chat.completion with the whole message, finish_reason and usage."""
    with trio.fail_after(BOUND):
        async with sdk(edge) as client:
            resp = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == "tok0 tok1 tok2 tok3 "
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == 4 and resp.usage.total_tokens == 9
    await settled(edge, node.agent)


async def test_sync_sdk_stream_and_whole(edge, node, upstream):
    """The synchronous OpenAI SDK works too, streamed and not."""

    def use_sync_client():
        with sync_sdk(edge) as client:
            whole = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            with client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, stream=True) as stream:
                streamed = "".join(c.choices[0].delta.content or "" for c in stream)
        return whole.choices[0].message.content, streamed

    with trio.fail_after(BOUND):
        whole, streamed = await trio.to_thread.run_sync(use_sync_client)
    assert whole == streamed == "tok0 tok1 "


async def test_models_lists_what_linked_nodes_serve(edge, node):
    """GET /v1/models lists the model groups some linked node serves now."""
    async with sdk(edge) as client:
        with trio.fail_after(BOUND):
            models = await client.models.list()
        assert [m.id for m in models.data] == ["m"]
        node.stop()
        with trio.fail_after(BOUND):
            while edge.edge.runs.links:
                await trio.sleep(0.01)
            models = await client.models.list()
        assert models.data == []


async def test_upstream_error_reaches_client(edge, node, upstream):
    """An upstream HTTP error before any event becomes an OpenAI error with the same status (a 4xx
    the request caused), for whole requests and streams alike (a stream commits only at its first
    event)."""
    upstream.script_for("m-target", [("status", 400, b'{"error": {"message": "bad temperature"}}')])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for stream in (False, True):
                r = await client.post(
                    "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": stream}
                )
                assert r.status_code == 400
                err = r.json()["error"]
                assert err["code"] == "upstream_rejected" and "bad temperature" in err["message"]
            # A status that is the node's own trouble, not the request's (a 407 from its proxy asks
            # the client for proxy credentials: an outside audit), is a 502.
            for status in (407, 431, 499):
                upstream.script_for("m-target", [("status", status, b'{"error": {"message": "not yours"}}')])
                r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
                assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error", (status, r.text)
    await settled(edge, node.agent)


_REFUSALS = {  # each model server's wording, verbatim but the numbers: (its words, prompt, max_tokens, limit)
    "vllm-0.9-messages": (
        "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens in the messages, Please reduce the length of the messages.",
        5000,
        0,
    ),
    "vllm-0.11-input": (
        "This model's maximum context length is 4096 tokens. However, your request has 5000 input tokens. Please reduce the length of the input messages.",
        5000,
        0,
    ),
    "vllm-0.11-max-tokens": (
        "'max_tokens' or 'max_completion_tokens' is too large: 1000. This model's maximum context length is 4096 tokens and your request has 3500 input tokens (1000 > 4096 - 3500).",
        3500,
        1000,
    ),
    "vllm-0.25": (
        "This model's maximum context length is 4096 tokens. However, you requested 1000 output tokens and your prompt contains at least 3500 input tokens, for a total of at least 4500 tokens. Please reduce the length of the input prompt or the number of requested output tokens.",
        3500,
        1000,
    ),
    "vllm-0.25-characters": (
        "This model's maximum context length is 4096 tokens. However, you requested 1000 output tokens and your prompt contains 90000 characters (more than 30768 characters, which is the upper bound for 3096 input tokens). Please reduce the length of the input prompt or the number of requested output tokens.",
        3097,
        1000,
    ),
    "sglang": (
        "Requested token count exceeds the model's maximum context length of 4096 tokens. You requested a total of 4500 tokens: 3500 tokens from the input messages and 1000 tokens for the completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
        3500,
        1000,
    ),
    "sglang-input": ("The input (5000 tokens) is longer than the model's context length (4096 tokens).", 5000, 0),
}


@pytest.mark.parametrize("server", list(_REFUSALS))
async def test_every_wording_of_a_context_refusal_gives_claude_code_its_numbers(edge, node, upstream, server):
    """vLLM's and SGLang's refusals of a request past the context, in every wording since vLLM
    0.9, are said in Anthropic's words with the numbers: Claude Code asks again with a
    ``max_tokens`` that fits, and compacts only for a prompt too long by itself. Only vLLM's
    oldest wording was read: in the others it got "prompt is too long", and ``claude -p`` ended
    on its first turn ("this conversation is a single exchange and cannot be compacted") where a
    smaller max_tokens fitted (an outside audit, with the real CLI)."""
    said, prompt, max_tokens = _REFUSALS[server]
    upstream.script_for(
        "m-target",
        [
            (
                "status",
                400,
                msgspec.json.encode({"object": "error", "type": "BadRequestError", "code": 400, "message": said}),
            )
        ],
    )
    with trio.fail_after(BOUND):
        async with anthropic.AsyncAnthropic(
            base_url=edge.url, api_key="unused", max_retries=0, timeout=BOUND
        ) as claude:
            with pytest.raises(anthropic.BadRequestError) as refused:
                await claude.messages.create(model="m", max_tokens=1000, messages=MESSAGES)
    error = refused.value.body["error"]
    if prompt >= 4096:
        assert error["message"] == f"prompt is too long: {prompt} tokens > 4096 maximum", error
    else:
        assert error["message"] == (
            f"input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > 4096, decrease input"
            " length or `max_tokens` and try again"
        ), error


async def test_a_model_servers_own_context_refusal_is_context_length_exceeded_in_every_api(edge, node, upstream):
    """A prompt the model server finds too long for its context (the edge's estimate let it
    through) was a 400 ``upstream_rejected``, so clients that act on ``context_length_exceeded``
    (a smaller request, a compaction) did not (an outside audit). vLLM's words carry the
    numbers, which the Messages API's own words need (Claude Code parses them); llama.cpp's
    do not. Any other 400 stays ``upstream_rejected``."""
    vllm = (
        b'{"object": "error", "type": "BadRequestError", "code": 400, "message": "This model\'s maximum context'
        b" length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, 1000 in the"
        b' completion). Please reduce the length of the messages or completion."}'
    )
    llama = b'{"error": {"code": 400, "type": "exceed_context_size_error", "message": "the request exceeds the available context size, try increasing it"}}'
    other = b'{"error": {"message": "bad temperature"}}'
    chat, messages, responses = {}, {}, {}
    with trio.fail_after(BOUND):
        async with (
            sdk(edge) as client,
            anthropic.AsyncAnthropic(base_url=edge.url, api_key="unused", max_retries=0, timeout=BOUND) as claude,
        ):
            for name, said in (("vllm", vllm), ("llama", llama), ("other", other)):
                upstream.script_for("m-target", [("status", 400, said)] * 3)
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="m", messages=MESSAGES)
                chat[name] = e.value.body
                with pytest.raises(anthropic.BadRequestError) as a:
                    await claude.messages.create(model="m", max_tokens=1000, messages=MESSAGES)
                messages[name] = a.value.body["error"]
                with pytest.raises(openai.BadRequestError) as r:
                    await client.responses.create(model="m", input="hi")
                responses[name] = r.value.body
            # TGI's 422 is the same 400; a 409 in those words is not a refusal of the prompt's length
            others = []
            for status, said in ((422, llama), (409, vllm)):
                upstream.script_for("m-target", [("status", status, said)])
                with pytest.raises(openai.APIStatusError) as e:
                    await client.chat.completions.create(model="m", messages=MESSAGES)
                others.append((e.value.status_code, e.value.body["code"]))
    assert others == [(400, "context_length_exceeded"), (409, "upstream_rejected")]
    assert chat["vllm"]["code"] == chat["llama"]["code"] == "context_length_exceeded"
    assert chat["vllm"]["param"] == "messages" and "maximum context length is 4096" in chat["vllm"]["message"]
    assert "exceeds the available context size" in chat["llama"]["message"]
    assert chat["other"]["code"] == "upstream_rejected"
    # Anthropic's words, as the edge's own refusal says them
    assert messages["vllm"] == {
        "type": "invalid_request_error",
        "message": "input length and `max_tokens` exceed context limit: 4000 + 1000 > 4096, decrease input length"
        " or `max_tokens` and try again",
    }
    assert messages["llama"]["message"].startswith("prompt is too long: ")
    assert not messages["other"]["message"].startswith("prompt is too long")
    assert responses["vllm"]["code"] == responses["llama"]["code"] == "context_length_exceeded"
    assert responses["vllm"]["param"] == "input" and "4096" in responses["vllm"]["message"]
    assert responses["other"]["code"] == "upstream_rejected"
    await settled(edge, node.agent)


async def test_a_model_server_refusing_the_nodes_key_is_a_502_that_quotes_nothing(edge, node, upstream):
    """An upstream 401/403 refused the node's credentials, not the client's: a 502
    upstream_auth_failed the SDK does not retry, and the provider's words (which can
    quote the node's key) stay in the edge's log. It was the provider's 401, verbatim."""
    said = b'{"error": {"message": "Incorrect API key provided: sk-proj-****WXYZ."}}'
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        for status in (401, 403):
            upstream.script_for("m-target", [("status", status, said)])
            async with http(edge) as client:
                for stream in (False, True):
                    body = {"model": "m", "messages": MESSAGES, "stream": stream}
                    r = await client.post("/v1/chat/completions", json=body)
                    assert r.status_code == 502 and r.headers["x-should-retry"] == "false"
                    err = r.json()["error"]
                    assert err["code"] == "upstream_auth_failed" and f"HTTP {status}" in err["message"]
                    assert b"WXYZ" not in r.content
    assert any("WXYZ" in e.get("error", "") for e in logs if e["log_level"] == "warning")
    await settled(edge, node.agent)


async def test_a_model_servers_error_never_carries_the_nodes_api_key(nursery, upstream):
    """A provider that quotes the key it refused, or any error text with the node's api_key in it (a
    status's body, an error event mid-stream, a body whose key the 4 KiB cut of its text would
    split, a passthrough error relayed as it came), reaches the edge with the key replaced: it was in
    the edge's log, the console's error list and the client's message (a cut left part of it)."""
    secret = "sk-node-Q7Z2SECRETKEY"
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("m", upstream, api_key=secret, passthrough=True)])
    said = msgspec.json.encode({"error": {"message": f"Incorrect API key provided: {secret}."}})
    scripts = [
        [("status", 401, said)],
        [("status", 500, said)],
        [("chunk", {"content": "partial "}), ("raw", b"data: " + said + b"\n\n")],
        [("status", 500, b"x" * 4090 + secret.encode() + b" was refused")],  # not JSON: its text, cut at 4096
        # Not JSON, 3 bytes a character, the key across the first bytes read (4,096 and the key's
        # length) or across an error event's 8,192 bytes: cut in bytes, then found by nothing.
        [("status", 400, b"12" + "€".encode() * 1365 + secret.encode() + b" refused")],
        [("chunk", {"content": "partial "}), ("raw", b"error: " + "€".encode() * 2725 + secret.encode() + b"\n\n")],
    ]
    bodies = []
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        async with http(edge) as client:
            for script in scripts:
                upstream.script_for("m-target", script)
                for stream in (False, True):
                    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
                    r = await client.post("/v1/chat/completions", json=body)
                    bodies.append(r.content)
            upstream.script_for("m-target", [("status", 500, said)])
            relayed = await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert upstream.records[0].headers["authorization"] == f"Bearer {secret}"  # (the key the node sends)
    assert all(secret[:6].encode() not in b for b in bodies)  # (not even the part before a cut)
    listed = [e.message for e in edge.edge.console.errors]  # the console's recent run errors
    assert len(listed) == 12 and not any(secret[:6] in m for m in listed), listed
    assert all(secret[:6] not in str(e) for e in logs)
    assert relayed.status_code == 500 and len(relayed.content) == len(said)
    assert relayed.json()["error"]["message"] == "Incorrect API key provided: " + "*" * len(secret) + "."
    warned = [e["error"] for e in logs if e["log_level"] == "warning" and "error" in e]
    assert any("Incorrect API key provided: [the node's api_key]." in w for w in warned), warned
    await settled(edge, node.agent)


async def test_a_placeholder_api_key_is_left_in_error_text(nursery, upstream):
    """A short api_key is a placeholder a local server ignores ("ollama", "EMPTY"), not a
    secret: an error text with the word in it reaches the client as the server wrote it."""
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("m", upstream, api_key="ollama")])
    said = msgspec.json.encode({"error": {"message": "model 'ollama/qwen3' not found, try pulling it first"}})
    upstream.script_for("m-target", [("status", 404, said)])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            )
    assert "model 'ollama/qwen3' not found" in r.json()["error"]["message"]
    await settled(edge, node.agent)


@hypothesis.given(
    before=st.binary(max_size=40), after=st.binary(max_size=40), cuts=st.lists(st.integers(0, 120), max_size=6)
)
def test_a_passthrough_error_body_is_masked_however_it_is_split(before, after, cuts):
    """The node's key in a relayed error body becomes as many `*`, wherever the reads split it, and
    every other byte is relayed as it came."""
    key = b"sk-node-Q7Z2SECRETKEY"
    body = before + key + after + key
    masked, out, at = _Masked(key.decode()), b"", 0
    for cut in sorted({*cuts, len(body)}):
        out += masked.feed(body[at:cut])
        at = max(at, cut)
    out += masked.held
    assert out == body.replace(key, b"*" * len(key))
