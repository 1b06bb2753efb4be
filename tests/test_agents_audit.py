"""What the real agent CLIs (Claude Code, Codex; tests/agents.py runs them on loopback only) do with
the edge's errors and tool-call ids: a wrong key, an operator's cancel after the stream started
and tool calls still invalid after the edge's attempts each end the CLI's request after one try
(no retry that starts the work again); tool-call ids a model server repeats (``call_0`` every
turn, one id for two parallel calls) reach the client unique, on every API."""

from __future__ import annotations

import itertools
import os
import re

import anthropic
import msgspec
import pytest
import structlog
import trio

from edge.anthropic.codec import MessageStream
from edge.errors import APIError, no_node, queue_rejected
from scripts.upstream import native_call, steps
from tests.agents import quiet_env, require_agent, run_offline
from tests.conftest import BOUND, edge_config, eventually, http, model, sdk, settled, start_edge, start_node

ADMIN = "admin-secret"
USAGE = {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PARIS = '{"city": "Paris"}'


@pytest.fixture
async def setup(nursery, upstream):
    edge = await start_edge(nursery, edge_config(api_keys=["sk-edge"], admin_keys=[ADMIN], keepalive_s=0.5))
    node = await start_node(nursery, edge, [model("m", upstream, target="t", max_concurrency=4)])
    yield edge, upstream
    await settled(edge, node.agent)


# -- running the CLIs ------------------------------------------------------------------------


async def claude_code(edge, tmp_path, prompt: str, *extra: str, key: str = "sk-edge"):
    """`claude -p PROMPT --model m` against the edge (as tests/test_messages_api.py runs it)."""
    claude = require_agent("claude", "IOP_CLAUDE")
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    env = quiet_env(
        home,
        ANTHROPIC_BASE_URL=edge.url,
        ANTHROPIC_AUTH_TOKEN=key,
        ANTHROPIC_SMALL_FAST_MODEL="m",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    return await run_offline([claude, "-p", prompt, "--model", "m", *extra], port=edge.port, env=env, cwd=work)


async def codex(edge, tmp_path, prompt: str):
    """`codex exec PROMPT` with the README's `[model_providers.iop]` (as tests/test_responses_api.py)."""
    binary = require_agent("codex", "IOP_CODEX")
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    (home / ".codex" / "config.toml").write_text(
        f"""model = "m"
model_provider = "iop"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.iop]
name = "iop"
base_url = "{edge.url}/v1"
wire_api = "responses"
env_key = "IOP_API_KEY"
"""
    )
    env = quiet_env(home, CODEX_HOME=str(home / ".codex"), IOP_API_KEY="sk-edge", RUST_LOG="error")
    argv = [binary, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    return await run_offline([*argv, "-C", str(work), "--color", "never", prompt], port=edge.port, env=env, cwd=work)


def tooled(records) -> list:
    """The upstream requests of the agent's own loop (its tools attached), not its side requests."""
    return [r for r in records if r.body and r.body.get("tools")]


def first_tooled_hangs(upstream) -> None:
    """The agent's first tooled request streams a little and hangs (until cancelled); any later
    one, a retry of it, answers at once, so a retry shows as an answer and a second request."""
    seen = itertools.count()

    def script(body: dict) -> list:
        if body.get("tools") and next(seen) == 0:
            return [("chunk", {"content": "Working on it. "}), ("hang",)]
        return steps({"content": "Retried and answered."}, usage=USAGE)

    upstream.script_for("t", script)


async def cancel_once_streaming(edge) -> None:
    """Cancel the run in flight through the admin API once its stream has started."""

    def streaming() -> list[str]:
        return [rid for rid, run in edge.edge.runs.runs.items() if run.client is not None and run.client.started]

    await eventually(lambda: bool(streaming()), "a stream started")
    async with http(edge) as admin:
        for run_id in streaming():
            r = await admin.post(f"/v1/admin/runs/{run_id}/cancel", headers={"Authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 200


# -- 1. errors no retry can fix say x-should-retry: false ------------------------------------


async def test_errors_no_retry_can_fix_say_so_and_retryable_ones_do_not(setup):
    """401 (wrong key), 400, 404 (no such model) and 405 on every API route carry
    `x-should-retry: false`; a 429, 503 or 408 (retried on purpose) does not. (Past the edge's
    first seconds: then a node may still be linking, and its model's 404 says retry.)"""
    edge, _ = setup
    edge.edge.runs.started -= 3600
    good = {"Authorization": "Bearer sk-edge"}
    async with http(edge) as client:
        with trio.fail_after(BOUND):
            for path in ("/v1/messages", "/v1/chat/completions", "/v1/responses"):
                wrong = await client.post(path, json={"model": "m"}, headers={"x-api-key": "sk-wrong"})
                bad = await client.post(path, content=b"{not json", headers=good)
                missing = await client.post(
                    path,
                    json={
                        "model": "nope",
                        "max_tokens": 5,
                        "messages": [{"role": "user", "content": "hi"}],
                        "input": "hi",
                    },
                    headers=good,
                )
                verb = await client.get(path, headers=good)
                for r, status in ((wrong, 401), (bad, 400), (missing, 404), (verb, 405)):
                    assert r.status_code == status, (path, r.status_code, r.text)
                    assert r.headers.get("x-should-retry") == "false", (path, status)
            # Those the framework answers too: a wrong key on /v1/models, an unknown route.
            for r, status in (
                (await client.get("/v1/models", headers={"x-api-key": "sk-wrong"}), 401),
                (await client.get("/v1/nothing", headers=good), 404),
            ):
                assert r.status_code == status and r.headers.get("x-should-retry") == "false", (status, r.text)
            # Claude Code's HEAD / at every start: answered, not a 404 counted as a refusal.
            root = await client.head("/")
            assert root.status_code == 200
            assert "iop" in (await client.get("/")).text
    for retryable in (queue_rejected("m", "queue full", 1), no_node("m"), APIError(408, "slow body")):
        assert all(name != b"x-should-retry" for name, _ in retryable.headers), retryable.status


async def test_claude_code_with_a_wrong_key_stops_after_one_401(setup, tmp_path):
    """Claude Code retries a 401 unless told not to: it sent /v1/messages again for about
    3 minutes, silently. Now one 401 ends it, with the edge's words."""
    edge, upstream = setup
    with structlog.testing.capture_logs() as logs, trio.fail_after(60):
        done = await claude_code(edge, tmp_path, "Say hello.", key="sk-wrong")
    refused = [e for e in logs if e["event"] == "request" and e.get("api") == "messages"]
    assert done.returncode != 0
    assert "Invalid API key" in done.stdout + done.stderr, (done.stdout, done.stderr[-2000:])
    assert len(refused) == 1 and refused[0]["status"] == 401, refused
    assert not upstream.records


# -- 2. an operator's cancel after the stream started ----------------------------------------


def test_a_final_messages_error_follows_a_complete_block():
    """The codec: a final in-stream error closes the open block (or sends an empty text block
    when none began) before `event: error`; any other error is `event: error` alone."""
    enc = MessageStream("msg_1", "m")
    enc.start(1)
    enc.text("partial")
    final = enc.error("cancelled by an operator", "run_error", final=True)
    assert final.index(b"content_block_stop") < final.index(b"event: error")
    fresh = MessageStream("msg_2", "m")
    fresh.start(1)
    final = fresh.error("cancelled by an operator", "run_error", final=True)
    assert final.count(b"event: content_block_start") == 1 and final.index(b"content_block_stop") < final.index(
        b"event: error"
    )
    again = MessageStream("msg_3", "m")
    again.start(1)
    again.text("partial")
    assert again.error("the node was lost", "run_error").startswith(b"event: error")


async def test_claude_code_takes_an_operator_cancel_mid_stream_as_final(setup, tmp_path):
    """Cancelled after its stream started, Claude Code's turn ends with the cancel's words and
    the model server saw one request (before: `event: error` before any complete block, on
    which Claude Code sends the turn again unstreamed, and the cancelled work started again)."""
    edge, upstream = setup
    first_tooled_hangs(upstream)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            out: list = []

            async def run() -> None:
                out.append(await claude_code(edge, tmp_path, "Say hello."))

            nursery.start_soon(run)
            await cancel_once_streaming(edge)
    (done,) = out
    assert done.returncode != 0 and "Retried and answered" not in done.stdout
    assert "cancelled by an operator" in done.stdout + done.stderr, (done.stdout, done.stderr[-2000:])
    (asked,) = tooled(upstream.records)
    assert asked.aborted


async def test_codex_takes_an_operator_cancel_mid_stream_as_final(setup, tmp_path):
    """Cancelled after its stream started, `codex exec` stops with the cancel's words and the
    model server saw one request (before: `response.failed` with `server_error`, on which Codex
    reconnects up to 5 times, each attempt starting the work again)."""
    edge, upstream = setup
    first_tooled_hangs(upstream)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            out: list = []

            async def run() -> None:
                out.append(await codex(edge, tmp_path, "Say hello."))

            nursery.start_soon(run)
            await cancel_once_streaming(edge)
    (done,) = out
    assert done.returncode != 0 and "Retried and answered" not in done.stdout
    assert "cancelled by an operator" in done.stderr, (done.stdout, done.stderr[-2000:])
    (asked,) = upstream.records
    assert asked.aborted


async def test_a_mid_stream_cancel_on_the_sdks(setup):
    """The wire: Messages closes its open block before `event: error`; Responses ends with
    `response.failed` whose code is `invalid_prompt` (Codex's one code that is final and shows
    the message), the message the cancel's."""
    edge, upstream = setup
    auth = {"Authorization": "Bearer sk-edge"}
    bodies = {
        "/v1/messages": {
            "model": "m",
            "max_tokens": 50,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
        "/v1/responses": {"model": "m", "stream": True, "input": "hi"},
    }
    seen: dict[str, bytes] = {}
    async with http(edge, headers=auth) as client:
        for path, body in bodies.items():
            upstream.script_for("t", [("chunk", {"content": "partial "}), ("hang",)])
            with trio.fail_after(BOUND):
                async with client.stream("POST", path, json=body) as r, trio.open_nursery() as nursery:
                    assert r.status_code == 200
                    nursery.start_soon(cancel_once_streaming, edge)
                    seen[path] = b"".join([chunk async for chunk in r.aiter_bytes()])
    messages = seen["/v1/messages"]
    assert b"partial " in messages and messages.index(b"content_block_stop") < messages.index(b"event: error")
    failed = msgspec.json.decode(seen["/v1/responses"].split(b"event: response.failed\ndata: ")[1])
    assert failed["response"]["error"] == {"code": "invalid_prompt", "message": "cancelled by an operator"}


# -- 3. tool-call ids the model server repeats -----------------------------------------------


def calls(*ids: str) -> list[dict]:
    """The deltas of parallel get_weather calls with these upstream ids."""
    return [
        {
            "tool_calls": [
                {"index": i, "id": cid, "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}
            ]
        }
        for i, cid in enumerate(ids)
    ]


async def ids_sent(edge, api: str, history: bool, tools: bool = True) -> list[str]:
    """The call ids one whole response carries, on `api`, with or without a history that holds
    the id `call_0` (a call and its result), and with or without the request's tools."""
    ask = "What is the weather in Paris?"

    def given(**kw):
        return kw if tools else {}

    if api == "chat":
        messages = [{"role": "user", "content": ask}]
        if history:
            messages += [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}
                    ],
                },
                {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
            ]
        async with sdk(edge, api_key="sk-edge") as client:
            r = await client.chat.completions.create(model="m", messages=messages, **given(tools=[WEATHER]))
        return [c.id for c in r.choices[0].message.tool_calls or ()]
    if api == "responses":
        items: list = [{"role": "user", "content": ask}]
        if history:
            items += [
                {"type": "function_call", "call_id": "call_0", "name": "get_weather", "arguments": PARIS},
                {"type": "function_call_output", "call_id": "call_0", "output": "sunny"},
            ]
        tool = {"type": "function", **WEATHER["function"]}
        async with sdk(edge, api_key="sk-edge") as client:
            r = await client.responses.create(model="m", input=items, **given(tools=[tool]))
        return [item.call_id for item in r.output if item.type == "function_call"]
    messages = [{"role": "user", "content": ask}]
    if history:  # Claude Code sends back the ids the edge gave it: toolu_ + the upstream's
        messages += [
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_call_0", "name": "get_weather", "input": {"city": "Paris"}}
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_call_0", "content": "sunny"}]},
        ]
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    async with anthropic.AsyncAnthropic(base_url=edge.url, api_key="sk-edge", max_retries=0, timeout=BOUND) as client:
        async with client.messages.stream(model="m", max_tokens=50, messages=messages, **given(tools=[tool])) as stream:
            message = await stream.get_final_message()
    return [block.id.removeprefix("toolu_") for block in message.content if block.type == "tool_use"]


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_tool_call_ids_are_unique_across_turns_and_within_one(setup, api):
    """A model server that uses `call_0` every turn: the second turn's call (its history holds
    `call_0`) gets a fresh id, while an id the history does not hold (`call_9`) is kept, the
    request's tools given. Two parallel calls both with id `0`: the first keeps it, the
    second gets a fresh one."""
    edge, upstream = setup
    with trio.fail_after(BOUND):
        upstream.script_for("t", steps(*calls("call_0"), finish="tool_calls", usage=USAGE))
        assert await ids_sent(edge, api, history=False) == ["call_0"]
        upstream.script_for("t", steps(*calls("call_0", "call_9"), finish="tool_calls", usage=USAGE))
        repeated, kept = await ids_sent(edge, api, history=True)
        assert repeated != "call_0" and repeated.startswith("call_") and kept == "call_9"
        upstream.script_for("t", steps(*calls("0", "0"), finish="tool_calls", usage=USAGE))
        first, second = await ids_sent(edge, api, history=False)
        assert first == "0" and second not in ("0", "") and second.startswith("call_")
        # A model that calls a tool the request did not offer: no call reaches the client at all
        # (it had a fresh id; now it is dropped: test_messages_api).
        upstream.script_for("t", steps(*calls("call_0"), finish="tool_calls", usage=USAGE))
        assert await ids_sent(edge, api, history=True, tools=False) == []


async def test_messages_tool_use_ids_take_anthropic_s_pattern_and_stay_unique_across_turns(setup):
    """Kimi K2's ids (`functions.get_weather:0`, every turn): the Messages API's `tool_use` id is
    `toolu_` and the characters Anthropic's pattern takes (`^[a-zA-Z0-9_-]+$`: a client sending
    the history on to Anthropic got its 400), and the next turn's repeat of the same upstream id,
    its history holding the shown form, gets a fresh id. Chat shows the upstream's id as it is."""
    edge, upstream = setup
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    with trio.fail_after(BOUND):
        async with anthropic.AsyncAnthropic(
            base_url=edge.url, api_key="sk-edge", max_retries=0, timeout=BOUND
        ) as client:
            upstream.script_for("t", steps(*calls("functions.get_weather:0"), finish="tool_calls", usage=USAGE))
            first = await client.messages.create(model="m", max_tokens=50, messages=ask, tools=[tool])
            (use,) = [b for b in first.content if b.type == "tool_use"]
            history = [
                *ask,
                {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
            ]
            upstream.script_for("t", steps(*calls("functions.get_weather:0"), finish="tool_calls", usage=USAGE))
            async with client.messages.stream(model="m", max_tokens=50, messages=history, tools=[tool]) as stream:
                second = await stream.get_final_message()
        async with sdk(edge, api_key="sk-edge") as chat:
            upstream.script_for("t", steps(*calls("functions.get_weather:0"), finish="tool_calls", usage=USAGE))
            r = await chat.chat.completions.create(model="m", messages=ask, tools=[WEATHER])
    assert use.id == "toolu_functions_get_weather_0"
    (again,) = [b for b in second.content if b.type == "tool_use"]
    assert re.fullmatch(r"toolu_[a-zA-Z0-9_-]+", again.id) and again.id != use.id
    assert r.choices[0].message.tool_calls[0].id == "functions.get_weather:0"


async def test_claude_code_runs_every_call_of_a_server_that_repeats_ids(setup, tmp_path):
    """Claude Code against a model server whose every call is id `0`: two parallel Writes, then
    one more in the next turn. Every call runs (before, one of the parallel pair was lost and the
    later turn's came back as "[Tool use interrupted]"), and the history it sends back holds
    three distinct ids, each with its result."""
    edge, upstream = setup
    work = tmp_path / "work"

    def write(i: int, name: str) -> dict:
        args = msgspec.json.encode({"file_path": os.path.join(work, name), "content": f"{name}\n"}).decode()
        return {
            "tool_calls": [
                {"index": i, "id": "0", "type": "function", "function": {"name": "Write", "arguments": args}}
            ]
        }

    def script(body: dict) -> list:
        if not body.get("tools"):
            return steps({"content": "ok"}, usage=USAGE)
        results = sum(1 for m in body["messages"] if m["role"] == "tool")
        if results == 0:
            return steps(write(0, "a.txt"), write(1, "b.txt"), finish="tool_calls", usage=USAGE)
        if results == 2:
            return steps(write(0, "c.txt"), finish="tool_calls", usage=USAGE)
        return steps({"content": f"All done after {results} results."}, usage=USAGE)

    upstream.script_for("t", script)
    with trio.fail_after(90):
        done = await claude_code(edge, tmp_path, "Write a.txt, b.txt and c.txt.", "--permission-mode", "acceptEdits")
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    assert "All done after 3 results." in done.stdout
    assert sorted(p.name for p in work.iterdir()) == ["a.txt", "b.txt", "c.txt"]
    last = tooled(upstream.records)[-1].body["messages"]
    call_ids = [c["id"] for m in last if m["role"] == "assistant" for c in m.get("tool_calls") or ()]
    result_ids = [m["tool_call_id"] for m in last if m["role"] == "tool"]
    assert len(set(call_ids)) == 3 and sorted(result_ids) == sorted(call_ids)
    assert b"interrupted" not in msgspec.json.encode(last)


# -- 4. tool calls still invalid after the edge's attempts -----------------------------------


async def test_tool_validation_error_is_final_over_http(setup):
    """A whole response whose calls stay invalid is a 502 `tool_validation_error` with
    `x-should-retry: false`: a client's retry would only repeat the model's mistakes."""
    edge, upstream = setup
    upstream.script_for(
        "t", lambda body: steps(*native_call("c1", "get_weather", '{"town": "Paris"}'), finish="tool_calls")
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]}
    async with http(edge, headers={"Authorization": "Bearer sk-edge"}) as client:
        with trio.fail_after(BOUND):
            r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 502 and r.json()["error"]["type"] == "tool_validation_error"
    assert r.headers["x-should-retry"] == "false"
    assert len(upstream.records) == 2  # the edge's own attempts (max_tool_attempts)


def always_invalid(upstream, name_of) -> None:
    """Every tooled request gets a call of the agent's shell/Write tool with arguments its schema
    refuses; the side requests an answer."""

    def script(body: dict) -> list:
        tools = [t["function"]["name"] for t in body.get("tools") or ()]
        name = name_of(tools)
        if name is None:
            return steps({"content": "ok"}, usage=USAGE)
        return steps(*native_call("call_bad", name, '{"nope": 1}'), finish="tool_calls", usage=USAGE)

    upstream.script_for("t", script)


async def test_claude_code_stops_on_tool_validation_error(setup, tmp_path):
    """A model that keeps making invalid calls: one Claude Code request costs the edge's two
    attempts, then Claude Code stops with the reason (before: it sent the turn again unstreamed
    and retried the 502 ten times, 18 generations over 3 minutes)."""
    edge, upstream = setup
    always_invalid(upstream, lambda tools: "Write" if "Write" in tools else None)
    with trio.fail_after(60):
        done = await claude_code(edge, tmp_path, "Write hi to out.txt.", "--permission-mode", "acceptEdits")
    assert done.returncode != 0
    assert "do not match its schema" in done.stdout + done.stderr, (done.stdout, done.stderr[-2000:])
    assert len(tooled(upstream.records)) == 2


async def test_codex_stops_on_tool_validation_error(setup, tmp_path):
    """The same for `codex exec`: `response.failed` with `invalid_prompt` ends it after the edge's
    two attempts, with the reason (before: `server_error`, and Codex reconnected 5 times)."""
    edge, upstream = setup
    shells = ("exec_command", "shell", "shell_command")
    always_invalid(upstream, lambda tools: next((t for t in tools if t in shells), None))
    with trio.fail_after(60):
        done = await codex(edge, tmp_path, "Write hi to out.txt.")
    assert done.returncode != 0
    assert "do not match its schema" in done.stderr, (done.stdout, done.stderr[-2000:])
    assert len(tooled(upstream.records)) == 2


async def test_a_node_lost_mid_stream_is_still_retryable(setup):
    """Only final failures change: a run failing for another reason after the stream started
    keeps `server_error` on Responses (Codex reconnects) and a bare `event: error` on Messages."""
    edge, upstream = setup
    auth = {"Authorization": "Bearer sk-edge"}
    mid_error = [("chunk", {"content": "partial "}), ("raw", b'data: {"error": {"message": "boom"}}\n\n'), ("done",)]
    async with http(edge, headers=auth) as client:
        with trio.fail_after(BOUND):
            upstream.script_for("t", mid_error)
            r = await client.post("/v1/responses", json={"model": "m", "stream": True, "input": "hi"})
            assert b'"code":"server_error"' in r.content
            upstream.script_for("t", mid_error)
            body = {"model": "m", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            r = await client.post("/v1/messages", json=body)
            assert b"event: error" in r.content and b"content_block_stop" not in r.content
