"""Real JavaScript clients against a real edge: openai-node and the Vercel AI SDK, each scenario a
script under tests/js/ run with Node.js (it prints one JSON result). The packages are pinned in
tests/js/package-lock.json and installed by `make test` (npm ci). Without node or the installed
packages the tests fail under CI and are skipped elsewhere."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import trio

from node.adapters.sim import sim_tokens
from tests.conftest import model, settled, start_edge, start_node

JS = Path(__file__).parent / "js"
PACKAGES = ("openai", "ai", "@ai-sdk/openai-compatible", "@ai-sdk/openai")
JS_BOUND = 60  # seconds for one script, Node start-up and retries included (they take ~1 s)
CRASH = [("status", 500, b'{"error": {"message": "model crashed"}}')]


def _missing() -> str | None:
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "node and npm must be installed (Node.js 20 or newer) to run the JavaScript client tests"
    absent = [p for p in PACKAGES if not (JS / "node_modules" / p / "package.json").is_file()]
    if absent:
        return f"tests/js/node_modules lacks {', '.join(absent)}: run `make test` (npm ci --prefix tests/js)"
    return None


@pytest.fixture(autouse=True)
def _node_and_packages():
    problem = _missing()
    if problem is not None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(problem, pytrace=False)
        pytest.skip(problem)


@pytest.fixture
async def js_edge(nursery, upstream):
    """An edge with the sim model "m" and "up", served by the scripted upstream (target "t")."""
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("m"), model("up", upstream, target="t")])
    yield edge, upstream
    await settled(edge, node.agent)


async def run_js(script: str, edge) -> dict:
    """Run tests/js/SCRIPT against the edge; its JSON result (a failure shows its stdout and stderr)."""
    with trio.fail_after(JS_BOUND):
        done = await trio.run_process(
            [shutil.which("node"), str(JS / script), edge.url + "/v1"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**os.environ, "NO_COLOR": "1"},
        )
    out, err = done.stdout.decode(), done.stderr.decode()
    if done.returncode != 0:
        pytest.fail(f"{script} exited {done.returncode}\nstdout: {out}\nstderr: {err}", pytrace=False)
    return json.loads(out.strip().splitlines()[-1])


def steps(*deltas, finish="stop"):
    return [*(("chunk", d) for d in deltas), ("chunk", {}, finish), ("done",)]


async def test_openai_node_retrieves_a_model_and_gets_not_found(js_edge):
    """openai-node's models.retrieve("m") returns the model card; an unknown id throws NotFoundError (404)."""
    edge, _ = js_edge
    result = await run_js("openai_models.mjs", edge)
    card = result["card"]
    assert card["id"] == "m" and card["object"] == "model"
    missing = result["missing"]
    assert missing is not None, "retrieving an unknown model did not throw"
    assert missing["notFound"] and missing["name"] == "NotFoundError" and missing["status"] == 404


async def test_openai_node_streams_text_and_usage(js_edge):
    """openai-node's stream: true yields the model's text; with include_usage the last chunk holds usage numbers."""
    edge, _ = js_edge
    result = await run_js("openai_stream.mjs", edge)
    expected = "".join(sim_tokens("hello there", 8))
    plain, counted = result["plain"], result["usage"]
    for run in (plain, counted):
        assert run["text"] == expected
        assert run["finish"] == ["length"]  # max_tokens 8 ended it
    assert plain["withUsage"] == 0
    assert counted["withUsage"] == 1 and counted["last"]["choices"] == 0
    usage = counted["last"]["usage"]
    assert all(isinstance(usage[k], int) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


async def test_openai_node_sees_an_upstream_failure_as_502_and_retries_it(js_edge):
    """openai-node gets an APIError with status 502 (not an error inside a 200 stream) when the upstream
    fails before its first token, and with maxRetries: 1 its retry gets the answer."""
    edge, upstream = js_edge
    seen: list[int] = []

    def fails_twice(body):  # the script's first request, then its retried one and the retry
        seen.append(1)
        return CRASH if len(seen) <= 2 else steps({"content": "second "}, {"content": "time"})

    upstream.script_for("t", fails_twice)
    result = await run_js("openai_upstream_error.mjs", edge)
    assert result["text"] is None, f"the failure arrived inside a 200 stream: {result}"
    error = result["error"]
    assert error["apiError"] and error["status"] == 502, error
    assert "model crashed" in error["message"]
    assert result["retriedError"] is None and result["retried"] == "second time", result
    assert len(upstream.records) == 3


async def test_ai_sdk_stream_text_with_tools_gets_reasoning(js_edge):
    """The AI SDK's streamText with a tool attached gets the model's reasoning (reasoningText and
    reasoning-delta parts), then its text."""
    edge, upstream = js_edge
    upstream.script_for(
        "t", steps({"reasoning_content": "let me "}, {"reasoning_content": "think"}, {"content": "It is sunny."})
    )
    result = await run_js("ai_stream_reasoning.mjs", edge)
    assert result["errors"] == [] and result["text"] == "It is sunny.", result
    assert result["streamedReasoning"] == "let me think", result
    assert result["reasoningText"] == "let me think"
    assert result["types"].index("reasoning-delta") < result["types"].index("text-delta")
    assert result["finishReason"] == "stop"
    tools = upstream.records[0].body["tools"]
    assert [t["function"]["name"] for t in tools] == ["get_weather"]
    assert tools[0]["function"]["parameters"]["required"] == ["city"]


async def test_ai_sdk_generate_text_gets_a_parsed_tool_call(js_edge):
    """The AI SDK's generateText gets the model's tool call with its arguments parsed, and runs the tool."""
    edge, upstream = js_edge
    opened = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    call = [
        {"tool_calls": [opened]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris", '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"unit": "c"}'}}]},
    ]
    upstream.script_for("t", steps(*call, finish="tool_calls"))
    result = await run_js("ai_generate_tool_call.mjs", edge)
    assert result["toolCalls"] == [
        {"toolCallId": "call_1", "toolName": "get_weather", "input": {"city": "Paris", "unit": "c"}}
    ]
    assert result["executed"] == [{"city": "Paris", "unit": "c"}]
    assert result["toolResults"] == [{"toolName": "get_weather", "output": {"forecast": "sunny"}}]
    assert result["finishReason"] == "tool-calls"


async def test_ai_sdk_default_openai_provider_keeps_a_conversation_by_item_references(js_edge):
    """@ai-sdk/openai's default provider (the Responses API, `store` on) sends its earlier output back
    as `item_reference`s: a second turn, and a tool loop whose model writes text before its call,
    work (each was a 400 `stateless_edge`), and the model sees the referenced text."""
    edge, upstream = js_edge

    def answer(body):
        messages = body["messages"]
        if body.get("tools"):
            if messages[-1]["role"] == "tool":
                return steps({"content": "It is sunny in Paris."})
            call = {"index": 0, "id": "call_w", "type": "function"}
            call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
            return steps({"content": "Let me check."}, {"tool_calls": [call]}, finish="tool_calls")
        return steps({"content": "Hello there."} if len(messages) == 1 else {"content": "Hello again."})

    upstream.script_for("t", answer)
    result = await run_js("ai_responses_turns.mjs", edge)
    assert result["first"] == "Hello there." and result["second"] == "Hello again.", result
    second = upstream.records[1].body["messages"]
    assert [(m["role"], m["content"]) for m in second] == [
        ("user", "Say hello."),
        ("assistant", "Hello there."),
        ("user", "Once more."),
    ]
    assert result["loop"] == {
        "text": "It is sunny in Paris.",
        "steps": 2,
        "executed": ["Paris"],
        "finishReason": "stop",
    }, result
    looped = upstream.records[-1].body["messages"]
    assert looped[1]["content"] == "Let me check." and looped[1]["tool_calls"][0]["id"] == "call_w"
    assert looped[2] == {"role": "tool", "tool_call_id": "call_w", "content": "sunny in Paris"}


async def test_openai_node_responses_stream_helper_accumulates_reasoning(js_edge):
    """openai-node's `responses.stream()` accumulates a shown reasoning item (its `reasoning_text`
    part comes with `response.content_part.added`: without, the helper threw "missing content")."""
    edge, upstream = js_edge
    upstream.script_for(
        "t", steps({"reasoning_content": "let me "}, {"reasoning_content": "think"}, {"content": "Done."})
    )
    result = await run_js("openai_responses_reasoning.mjs", edge)
    assert result["reasoning"] == "let me think" and result["status"] == "completed", result
    assert result["output"] == [
        {"type": "reasoning", "content": [["reasoning_text", "let me think"]]},
        {"type": "message", "content": [["output_text", "Done."]]},
    ]
