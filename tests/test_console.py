"""The operator console's data (edge/console.py), read the way the page reads
it: /v1/admin/events over HTTP, and the cancel a button sends. The page
itself, in a real browser: tests/test_console_browser.py."""

from __future__ import annotations

import contextlib
import time
import zlib
from functools import partial

import anthropic
import httpx
import msgspec
import openai
import pytest
import structlog
import trio

from edge.config import KeyConfig
from edge.console import accepts_gzip
from scripts.stack import Stack
from scripts.upstream import native_call, steps, text_script, words
from tests.conftest import BOUND, edge_config, eventually, http, model, start_edge, start_node
from tests.servers import postgres, postgres_url  # noqa: F401  (fixtures)

ADMIN = "admin-secret"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
STREAM = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class Events:
    """Reads /v1/admin/events in the background; keeps every event."""

    def __init__(self) -> None:
        self.snapshots: list[dict] = []
        self.usage: list[dict] = []
        self.changed = trio.Event()

    async def read(self, client, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with client.stream("GET", "/v1/admin/events", headers=AUTH) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            task_status.started()
            event = None
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    (self.snapshots if event == "snapshot" else self.usage).append(msgspec.json.decode(line[6:]))
                    self.changed.set()
                    self.changed = trio.Event()

    async def first_usage(self) -> dict:
        with trio.fail_after(BOUND):
            while not self.usage:
                await self.changed.wait()
        return self.usage[-1]

    async def until(self, predicate, what: str) -> dict:
        with trio.fail_after(BOUND):
            while True:
                if self.snapshots and predicate(self.snapshots[-1]):
                    return self.snapshots[-1]
                await self.changed.wait()


async def console_events(nursery, edge, admin, reading) -> Events:
    """A simulated model's node on ``edge``, and a console's events, read in ``reading`` with
    the ``admin`` client, once its first usage event is in."""
    await start_node(nursery, edge, [model("m")])  # the simulated model
    events = Events()
    await reading.start(events.read, admin)
    await events.first_usage()
    return events


async def stream(client, body: dict, out: list[str]) -> None:
    """A client stream: every data line into ``out``."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                out.append(line[6:])


async def test_events_need_an_admin_key(nursery):
    closed = await start_edge(nursery)  # no admin_keys: the admin API is off
    async with http(closed) as client:
        r = await client.get("/v1/admin/events", headers=AUTH)
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "admin_disabled"
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], api_keys=["client-key"]))
    async with http(edge) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer client-key"}):
            r = await client.get("/v1/admin/events", headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["type"] == "authentication_error"
        page = await client.get("/console")  # the page itself holds no data: it asks for the key
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for asset in ("console.js", "console.css"):
            assert (await client.get(f"/console/{asset}")).status_code == 200
        assert (await client.get("/console/../app.py")).status_code == 404
    assert not edge.edge.console._subscribers


async def test_a_stream_shows_up_grows_and_an_operator_cancel_aborts_it_upstream(nursery, upstream):
    upstream.script_for("m-target", lambda body: text_script(words(400), interval=0.05))
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=4)], node_id="node-a")
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=4)], node_id="node-b")
    events = Events()
    got: list[str] = []
    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        snap = await events.until(lambda s: len(s["nodes"]) == 2, "two nodes")
        assert [n["id"] for n in snap["nodes"]] == ["node-a", "node-b"]
        assert all(n["models"][0]["max_concurrency"] == 4 for n in snap["nodes"])
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as clients:
                clients.start_soon(stream, client, STREAM, got)
                snap = await events.until(lambda s: s["phases"]["streaming"] == 1, "a streaming run")
                (run,) = snap["runs"]
                assert run["model"] == "m" and run["api"] == "chat" and run["node"] in ("node-a", "node-b")
                first = run["tokens"]
                snap = await events.until(lambda s: s["runs"] and s["runs"][0]["tokens"] > first + 3, "tokens grow")
                assert snap["runs"][0]["id"] == run["id"]
                r = await admin.post(f"/v1/admin/runs/{run['id']}/cancel", headers=AUTH)
                assert r.status_code == 200 and r.json() == {"id": run["id"], "cancelled": True}
        # The client's stream ended with the operator's error, then [DONE]; the model server saw the abort.
        assert got[-1] == "[DONE]"
        assert "cancelled by an operator" in got[-2]
        (rec,) = upstream.records
        with trio.fail_after(BOUND):
            await rec.finished.wait()
        assert rec.aborted
        snap = await events.until(lambda s: not s["runs"] and s["errors"], "the run gone, its error listed")
        (error,) = snap["errors"]
        assert error["run_id"] == run["id"] and error["cause"] == "cancelled"
        again = await admin.post(f"/v1/admin/runs/{run['id']}/cancel", headers=AUTH)
        assert again.status_code == 404 and again.json()["error"]["code"] == "run_not_found"
        # The request counts in the hour's chart and today's totals.
        with trio.fail_after(BOUND):
            while not events.usage or not any(m[1] for m in events.usage[-1]["minutes"]):
                await events.changed.wait()
        usage = events.usage[-1]
        assert usage["source"] == "memory"
        assert sum(m[1] for m in usage["minutes"]) == 1
        assert usage["models"][0]["name"] == "m" and usage["models"][0]["requests"] == 1
        assert usage["models"][0]["completion_tokens"] >= first + 3
        reading.cancel_scope.cancel()
    await eventually(lambda: not edge.edge.console._subscribers, "the console's stream unsubscribed")


async def test_a_costly_snapshot_comes_less_often(nursery, monkeypatch):
    """A large fleet's snapshot (301 nodes of 41 models: 1.47 MB) made 4 times a second took
    the event loop from the requests (/healthz p99 19-26 -> 84-90 ms with one console open: an
    outside audit). Snapshots come less often as they cost more: at most 5% of the loop."""
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    console = edge.edge.console
    made = console.snapshot

    def costly():
        started = time.perf_counter()
        while time.perf_counter() - started < 0.05:  # (50 ms: one every second at most)
            pass
        return made()

    monkeypatch.setattr(console, "snapshot", costly)
    events = Events()
    async with http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        await events.until(lambda s: True, "a first snapshot")
        before = len(events.snapshots)
        await trio.sleep(2.5)
        came = len(events.snapshots) - before
        reading.cancel_scope.cancel()
    assert 1 <= came <= 4, came  # (8 before: one each 0.25 s after it was made)


async def test_tool_calls_still_invalid_are_listed_among_the_errors(nursery, upstream):
    """A request whose model called a tool it was not offered, on every attempt: the client got
    `invalid_tool_call`, /metrics counted `outcome="tool_validation"`, and the console's error
    list stayed empty (an outside audit). It lists it, without the model's arguments."""
    calls = [("chunk", {"content": '<tool_call>{"name": "launch", "arguments": {"secret": "xyz"}}</tool_call>'})]
    upstream.script_for("m-target", [*calls, ("chunk", {}, "stop"), ("done",)])
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    await start_node(nursery, edge, [model("m", upstream)], node_id="node-a")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    events = Events()
    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        with trio.fail_after(BOUND):
            r = await client.post("/v1/chat/completions", json={**STREAM, "stream": False, "tools": tools})
        assert r.status_code == 502 and r.json()["error"]["code"] == "invalid_tool_call", r.text
        snap = await events.until(lambda s: s["errors"], "the error listed")
        reading.cancel_scope.cancel()
    (error,) = snap["errors"]
    assert error["cause"] == "tool_validation" and error["node"] == "node-a" and error["model"] == "m", error
    assert "still invalid after 2 attempts" in error["message"] and "xyz" not in error["message"], error


async def test_a_model_servers_error_is_listed_without_what_would_turn_its_text_around(nursery, upstream):
    """A model server's 500 whose message holds a right-to-left override: the console's error
    list showed "</script>evil" as "</script>live" (an outside audit). It shows U+FFFD in its
    place, as the client's error does; the rest of the text is as the server wrote it."""
    said = "bad </script><img src=x onerror=alert(1)> \u202eevil\u202c done"
    upstream.script_for("m-target", [("status", 500, msgspec.json.encode({"error": {"message": said}}))])
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    await start_node(nursery, edge, [model("m", upstream)], node_id="node-a")
    events = Events()
    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        with trio.fail_after(BOUND):
            r = await client.post("/v1/chat/completions", json={**STREAM, "stream": False})
        assert r.status_code == 502, r.text
        snap = await events.until(lambda s: s["errors"], "the error listed")
        reading.cancel_scope.cancel()
    (error,) = snap["errors"]
    assert "<img src=x onerror=alert(1)> \ufffdevil\ufffd done" in error["message"], error
    assert "\u202e" not in r.json()["error"]["message"]


async def test_snapshots_stay_a_few_a_second_however_busy(nursery, upstream):
    """50 fast streams: the console gets ~4 snapshots a second, not one per event."""
    upstream.script_for("m-target", lambda body: text_script(words(200), interval=0.002))
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=64)])
    events = Events()
    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        await events.until(lambda s: s["nodes"], "the node")
        before = len(events.snapshots)
        t0 = trio.current_time()
        outs: list[list[str]] = [[] for _ in range(50)]
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as clients:
                for out in outs:
                    clients.start_soon(stream, client, STREAM, out)
        seconds = trio.current_time() - t0
        assert all(out[-1] == "[DONE]" for out in outs)
        sent = len(events.snapshots) - before
        reading.cancel_scope.cancel()
    assert sent <= 5 * seconds + 2, (sent, seconds)


async def test_429s_are_listed_with_their_model_and_code(nursery, upstream):
    upstream.script_for("m-target", [("hang",)])
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], max_queue=0))
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=1)])
    events = Events()
    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as clients:
                clients.start_soon(stream, client, STREAM, [])
                await events.until(lambda s: s["in_flight"] == 1, "the one slot taken")
                r = await client.post("/v1/chat/completions", json=STREAM)
                assert r.status_code == 429
                snap = await events.until(lambda s: s["rejected"], "the 429 listed")
                clients.cancel_scope.cancel()
        reading.cancel_scope.cancel()
    (rejected,) = snap["rejected"]
    assert rejected["model"] == "m" and rejected["code"] == r.json()["error"]["code"]
    assert rejected["message"] == r.json()["error"]["message"] and rejected["count"] == 1


async def test_a_runs_429_is_listed_with_its_code_and_words(nursery, upstream):
    """A 429 a run answers (a model server's rate limit; a key's budget cut mid-run) was listed
    with no code and no message, where admission's say which limit (an outside audit): the
    operator could not tell a budget from a provider's limit."""
    limited = b'{"error": {"message": "slow down", "type": "rate_limit_error"}}'
    upstream.script_for("m-target", [("status", 429, limited)])
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    await start_node(nursery, edge, [model("m", upstream)])
    events = Events()
    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        with trio.fail_after(BOUND):
            r = await client.post("/v1/chat/completions", json={**STREAM, "stream": False})
            assert r.status_code == 429, r.text
            snap = await events.until(lambda s: s["rejected"], "the 429 listed")
        reading.cancel_scope.cancel()
    (rejected,) = snap["rejected"]
    assert rejected["code"] == r.json()["error"]["code"] == "upstream_rate_limited", rejected
    assert rejected["message"] == r.json()["error"]["message"] and rejected["message"], rejected


class _StillClock:
    """``time`` for edge.keys with a monotonic clock that moves only when the test says: a
    refusal's "Try again in" is what the test makes it, however slowly the machine sends them."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


async def test_the_same_429_over_and_over_is_one_line_with_a_count(nursery, upstream, monkeypatch):
    """A key over its rpm, refused 5 times in a row, each saying a different "Try again in": one
    entry saying which limit, counted 5, with the latest wait."""
    clock = _StillClock()
    monkeypatch.setattr("edge.keys.time", clock)
    upstream.script_for("m-target", text_script(["ok"]))
    keys = [KeyConfig(id="bob", key="sk-bob", rpm=1)]
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], keys=keys))
    await start_node(nursery, edge, [model("m", upstream)])
    events = Events()
    bob = {"Authorization": "Bearer sk-bob"}
    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        assert (await client.post("/v1/chat/completions", json={**STREAM, "stream": False}, headers=bob)).is_success
        waits = set()
        for _ in range(5):
            clock.now += 1.5  # (a fifth of the 60 s an rpm of 1 refills in, over five refusals: none is let in)
            r = await client.post("/v1/chat/completions", json={**STREAM, "stream": False}, headers=bob)
            assert r.status_code == 429
            waits.add(r.json()["error"]["message"].partition("Try again in ")[2])
        snap = await events.until(lambda s: s["rejected"] and s["rejected"][-1]["count"] == 5, "five 429s counted")
        reading.cancel_scope.cancel()
    assert len(waits) == 5  # each refusal said a different wait
    (rejected,) = snap["rejected"]
    assert rejected["key"] == "bob" and rejected["code"] == "rate_limit_exceeded"
    assert "requests per minute" in rejected["message"], rejected
    assert rejected["message"] == r.json()["error"]["message"]  # the latest


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
async def test_an_operator_cancel_before_the_first_token_is_not_retried_by_the_sdk(nursery, upstream, sdk):
    """Both SDKs retry a 502 twice by default: a cancelled request must not come back.
    Cancelled before its first token it is a 499 with x-should-retry: false, and the model
    server saw exactly one request, aborted."""
    upstream.script_for("m-target", [("hang",)])
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    await start_node(nursery, edge, [model("m", upstream)])
    if sdk == "openai":
        client = openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="x", timeout=BOUND)  # default retries
        call = partial(client.chat.completions.create, model="m", messages=STREAM["messages"])
        status_error = openai.APIStatusError
    else:
        client = anthropic.AsyncAnthropic(base_url=edge.url, api_key="x", timeout=BOUND)
        call = partial(client.messages.create, model="m", max_tokens=16, messages=STREAM["messages"])
        status_error = anthropic.APIStatusError
    caught: list = []

    async def ask() -> None:
        try:
            await call()
        except status_error as e:
            caught.append(e)

    async with http(edge) as admin, client:
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as clients:
                clients.start_soon(ask)
                (rec,) = await upstream.wait_requests(1)
                (run_id,) = edge.edge.runs.runs
                assert (await admin.post(f"/v1/admin/runs/{run_id}/cancel", headers=AUTH)).status_code == 200
            await rec.finished.wait()
        await trio.sleep(1.0)  # the SDK's first retry would come within its 0.5-1 s backoff
    (e,) = caught
    assert e.status_code == 499 and e.response.headers["x-should-retry"] == "false"
    assert "cancelled by an operator" in str(e)
    assert len(upstream.records) == 1 and rec.aborted


async def test_a_queued_request_is_listed_with_its_key_and_can_be_cancelled(nursery, upstream):
    """Requests waiting for a slot are rows too (request id, key, API, phase queued); cancelling
    one takes it out of the queue with a 499 and leaves the run ahead of it alone; its access line
    says `cancelled`, as an operator's cancel of a run does (it said `rejected_499`)."""
    upstream.script_for("m-target", [("hang",)])
    keys = [KeyConfig(id="alice", key="sk-alice")]
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], keys=keys))
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=1)])
    events = Events()
    alice = {"Authorization": "Bearer sk-alice"}
    with structlog.testing.capture_logs() as logs:
        async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
            await reading.start(events.read, admin)
            with trio.fail_after(BOUND):
                async with trio.open_nursery() as clients:
                    clients.start_soon(partial(client.post, "/v1/chat/completions", json=STREAM, headers=alice))
                    await events.until(lambda s: s["in_flight"] == 1, "the one slot taken")
                    answer = []

                    async def wait_in_queue():
                        answer.append(
                            await client.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=alice)
                        )

                    clients.start_soon(wait_in_queue)
                    snap = await events.until(lambda s: s["phases"]["queued"] == 1, "the request queued")
                    (row,) = [r for r in snap["runs"] if r["phase"] == "queued"]
                    assert row["id"].startswith("req_") and row["key"] == "alice" and row["api"] == "responses"
                    r = await admin.post(f"/v1/admin/runs/{row['id']}/cancel", headers=AUTH)
                    assert r.status_code == 200
                    while not answer:
                        await trio.sleep(0.01)
                    snap = await events.until(lambda s: s["phases"]["queued"] == 0, "the queue empty")
                    assert snap["in_flight"] == 1  # the run ahead of it goes on
                    clients.cancel_scope.cancel()
            reading.cancel_scope.cancel()
    (r,) = answer
    assert r.status_code == 499 and r.headers["x-should-retry"] == "false"
    assert r.headers["x-request-id"] == row["id"]
    assert len(upstream.records) == 1  # it never reached the model server
    (line,) = [e for e in logs if e["event"] == "request" and e["request_id"] == row["id"]]
    assert line["cause"] == "cancelled" and line["status"] == 499


@pytest.mark.parametrize(
    ("ending", "stream"), [("cancel", False), ("cancel", True), ("timeout", False), ("timeout", True)]
)
async def test_an_operator_cancel_of_a_queued_tool_retry_is_final(upstream, ending, stream):
    """A request with tools whose first run called a tool it was not offered: its retry waits
    for the model's one slot, which a request queued meanwhile took, shown queued, and an
    operator cancels it. The client got a 502 with no code and no x-should-retry (in a stream,
    an error of no code), and the SDKs ran the request again, both attempts on the GPU (an
    outside audit). It is the cancel's 499 with x-should-retry: false, or in a stream its
    `cancelled_by_operator`; nothing runs again. Its queue timing out instead is the queue's
    429 with Retry-After, as a queued request's (it was that 502 too: a re-check); in a stream
    (keep-alives sent meanwhile), its error is that 429's type and code (it was a
    tool_validation_retry_error of no code). (The edge
    and the node are processes of their own, as in production: in one process the retry took
    the freed slot ahead of the queue.)"""

    def script(body: dict) -> list:
        if body["messages"][0]["content"] == "hold":
            return [("hang",)]
        return [("sleep", 1.0), *steps(*native_call("c1", "launch", "{}"), finish="tool_calls")]

    upstream.script_for("m-target", script)
    served = {
        "name": "m",
        "adapter": "openai",
        "target": "m-target",
        "base_url": upstream.base_url,
        "max_concurrency": 1,
    }
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    body = {**STREAM, "stream": stream, "tools": tools}
    hold = {**STREAM, "stream": False, "messages": [{"role": "user", "content": "hold"}]}
    answer: list = []
    with Stack() as processes:
        config = {"admin_keys": [ADMIN], "routing": "least_loaded"}
        if ending == "timeout":
            config["queue_timeout_ms"] = 2000  # (the hold waits out the first attempt's 1 s within it)
        url = await trio.to_thread.run_sync(partial(processes.edge, **config))
        await trio.to_thread.run_sync(partial(processes.node, url, [served], node_id="n1"))
        async with httpx.AsyncClient(base_url=url, timeout=BOUND) as client, trio.open_nursery() as clients:
            with trio.fail_after(BOUND):

                async def ask() -> None:
                    answer.append(await client.post("/v1/chat/completions", json=body))

                clients.start_soon(ask)
                await upstream.wait_requests(1)
                # Queued behind the first attempt, it takes the slot that attempt frees: the retry waits.
                # (The hold must be queued before the attempt ends, 1 s after it began; on a loaded CI
                # machine it was not, within 0.5 s, and the retry took the slot, the hold cancelled.)
                clients.start_soon(partial(client.post, "/v1/chat/completions", json=hold))
                while not [
                    r
                    for r in (await client.get("/v1/admin/runs", headers=AUTH)).json()["data"]
                    if r["phase"] == "queued"
                ]:
                    await trio.sleep(0.02)
                assert len(upstream.records) == 1, "the first attempt ended before the hold was queued"
                while True:
                    # (the upstream's count first: rows read before it, the hold's was still queued
                    # there when the upstream had it a moment later, about 1 run in 8; it was cancelled)
                    if len(upstream.records) == 2:
                        rows = (await client.get("/v1/admin/runs", headers=AUTH)).json()["data"]
                        queued = [row for row in rows if row["phase"] == "queued"]  # (the retry: the hold runs)
                        if queued:
                            break
                    await trio.sleep(0.02)
                (row,) = queued
                if ending == "cancel":
                    cancel = await client.post(f"/v1/admin/runs/{row['id']}/cancel", headers=AUTH)
                    assert cancel.status_code == 200
                while not answer:
                    await trio.sleep(0.01)
                await trio.sleep(0.5)  # (anything started again would reach the upstream meanwhile)
                clients.cancel_scope.cancel()
    (r,) = answer
    if ending == "timeout" and stream:
        assert r.status_code == 200
        error = msgspec.json.decode(r.content.split(b"data: ")[-2])["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_timeout", error
        assert error["message"].startswith("the retry could not start"), error
    elif ending == "timeout":
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        error = r.json()["error"]
        assert error["code"] == "queue_timeout" and error["message"].startswith("the retry could not start"), error
    elif stream:
        assert r.status_code == 200
        error = msgspec.json.decode(r.content.split(b"data: ")[-2])["error"]
        assert error["code"] == "cancelled_by_operator", error
    else:
        assert r.status_code == 499 and r.headers["x-should-retry"] == "false", r.text
        assert r.json()["error"]["code"] == "cancelled_by_operator"
    assert [rec.body["messages"][0]["content"] for rec in upstream.records] == ["hi", "hold"]  # (not the retry)


async def test_a_cancel_by_a_queued_rows_id_reaches_its_run_once_it_started(nursery, upstream):
    """A console row is up to a snapshot old: a request shown queued (its request id) may have
    its run by the time the cancel comes. That cancel ends the run (it was a 404 `run_not_found`
    and the request ran on); a run's row names its request id too."""
    upstream.script_for("m-target", [("hang",)])
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=1)])
    events = Events()
    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        with trio.fail_after(BOUND):
            answers: list = []

            async def ask() -> None:
                answers.append(await client.post("/v1/chat/completions", json={**STREAM, "stream": False}))

            async with trio.open_nursery() as clients:
                clients.start_soon(ask)
                snap = await events.until(lambda s: s["in_flight"] == 1, "the one slot taken")
                (first,) = snap["runs"]
                assert first["request_id"].startswith("req_") and first["id"] != first["request_id"]
                clients.start_soon(ask)
                snap = await events.until(lambda s: s["phases"]["queued"] == 1, "the second request queued")
                (queued,) = [r for r in snap["runs"] if r["phase"] == "queued"]
                assert (await admin.post(f"/v1/admin/runs/{first['id']}/cancel", headers=AUTH)).status_code == 200
                await eventually(lambda: len(upstream.records) == 2)  # the queued one has its run now
                r = await admin.post(f"/v1/admin/runs/{queued['id']}/cancel", headers=AUTH)
                assert r.status_code == 200, r.text
        reading.cancel_scope.cancel()
    assert sorted(a.status_code for a in answers) == [499, 499]
    assert all(rec.aborted for rec in upstream.records)


async def test_an_open_console_does_not_hold_the_edge_shutdown(nursery):
    """Draining with a console open: the console gets a last snapshot that says draining, its
    stream ends, and a new one is refused with 503."""
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], drain_grace_s=30))
    events = Events()
    async with http(edge) as admin:
        with trio.fail_after(5):  # far less than drain_grace_s
            async with trio.open_nursery() as reading:
                await reading.start(events.read, admin)
                await events.until(lambda s: True, "a first snapshot")
                await edge.edge.drain()
            # the stream ended by itself: the nursery is done
        assert events.snapshots[-1]["draining"] is True
        r = await admin.get("/v1/admin/events", headers=AUTH)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"


async def test_usage_today_comes_from_the_ledger_when_there_is_one(nursery, tmp_path):
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=str(tmp_path / "ledger.sqlite3")))
    await start_node(nursery, edge, [model("m")])  # the simulated model
    events = Events()
    async with http(edge) as client, http(edge) as admin:
        for _ in range(3):
            r = await client.post("/v1/chat/completions", json={**STREAM, "stream": False, "max_tokens": 5})
            assert r.status_code == 200
        for i in range(60):  # the ledger keeps the names clients make up: the console does not list them
            r = await client.post("/v1/chat/completions", json={**STREAM, "model": f"<b>junk-{i}</b>" + "x" * 500})
            assert r.status_code == 404
        async with trio.open_nursery() as reading:
            await reading.start(events.read, admin)
            with trio.fail_after(BOUND):
                while not events.usage:
                    await events.changed.wait()
            reading.cancel_scope.cancel()
    usage = events.usage[-1]
    assert usage["source"] == "ledger"
    m, other = usage["models"]
    assert m["name"] == "m" and m["requests"] == 3 and m["completion_tokens"] > 0
    assert other == {"name": "other", "requests": 60, "prompt_tokens": 0, "completion_tokens": 0}


async def test_a_model_whose_node_links_after_the_ledger_was_read_is_shown_by_name(nursery, tmp_path, monkeypatch):
    """An edge restarted on its SQLite ledger (read once a day), a console open before the model's
    node linked again: the model's requests today were labelled "other" as read, and stayed so
    until the next day's read (an outside audit). They are labelled as shown: once the node is
    linked, they are the model's."""
    import edge.console as console_module

    monkeypatch.setattr(console_module, "USAGE_EVERY_S", 0.3)
    ledger = str(tmp_path / "ledger.sqlite3")
    first = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=ledger))
    await start_node(nursery, first, [model("m")], node_id="before")
    async with http(first) as client:
        for _ in range(3):
            r = await client.post("/v1/chat/completions", json={**STREAM, "stream": False, "max_tokens": 5})
            assert r.status_code == 200

    def written() -> int:
        import sqlite3

        with contextlib.closing(sqlite3.connect(ledger)) as db:
            return db.execute("SELECT count(*) FROM usage").fetchone()[0]

    await eventually(lambda: written() == 3, "the ledger written")
    first.stop()
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=ledger))
    events = Events()
    async with http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        usage = await events.first_usage()
        assert [(m["name"], m["requests"]) for m in usage["models"]] == [("other", 3)], usage
        await start_node(nursery, edge, [model("m")], node_id="after")
        with trio.fail_after(BOUND):
            while not any(m["name"] == "m" for m in events.usage[-1]["models"]):
                await events.changed.wait()
        reading.cancel_scope.cancel()
    models = {m["name"]: m["requests"] for m in events.usage[-1]["models"] if m["requests"]}
    assert models == {"m": 3}, models


async def test_snapshots_keep_coming_while_the_ledger_is_read(nursery, tmp_path, monkeypatch):
    """A slow ledger read (a PostgreSQL day of 5 million rows took 1.5-2.2 s, found from outside)
    held every console's snapshots for its whole length, each time: the Fleet and Runs froze.
    The read is a task of its own: snapshots come every 0.25 s meanwhile, and its usage event,
    the ledger's, when it is done."""
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=str(tmp_path / "ledger.sqlite3")))
    await start_node(nursery, edge, [model("m")])
    usage_at = edge.edge.ledger.usage_at

    async def slow(*args, **kwargs):
        await trio.sleep(1.5)
        return await usage_at(*args, **kwargs)

    monkeypatch.setattr(edge.edge.ledger, "usage_at", slow)
    events = Events()
    async with http(edge) as admin:
        async with trio.open_nursery() as reading:
            await reading.start(events.read, admin)
            await trio.sleep(1.2)
            during = len(events.snapshots)
            usage = await events.first_usage()
            reading.cancel_scope.cancel()
    assert during >= 3, during  # (0 while the read held them)
    assert usage["source"] == "ledger"


async def test_ledger_totals_include_requests_since_the_ledger_was_read(nursery, tmp_path, monkeypatch):
    """The ledger is read every USAGE_EVERY_S; requests that end in between are in the next
    usage event (within about a second, like the chart), and once the ledger has them too
    they are not counted twice."""
    monkeypatch.setattr("edge.console.USAGE_EVERY_S", 3.0)
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=str(tmp_path / "ledger.sqlite3")))
    await start_node(nursery, edge, [model("m")])  # the simulated model
    body = {**STREAM, "stream": False, "max_tokens": 5}
    events = Events()

    def requests_of_m() -> int:
        usage = events.usage[-1]
        return sum(row["requests"] for row in usage["models"] if row["name"] == "m")

    async def until_requests(n: int, within: float) -> dict:
        with trio.fail_after(within):
            while not events.usage or requests_of_m() != n:
                await events.changed.wait()
        return events.usage[-1]

    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        assert await edge.edge.ledger.flush()
        await reading.start(events.read, admin)
        first = await until_requests(1, BOUND)  # the ledger, read as the console opened
        assert first["source"] == "ledger"
        for _ in range(2):
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        usage = await until_requests(3, 2.5)  # before the next ledger read
        assert usage["source"] == "ledger"
        assert usage["models"][0]["completion_tokens"] == 3 * first["models"][0]["completion_tokens"]
        assert await edge.edge.ledger.flush()  # the ledger has all three now
        with trio.fail_after(BOUND):  # the next event after the ledger is read again
            while events.usage[-1]["t"] < first["t"] + 3:
                await events.changed.wait()
        assert requests_of_m() == 3
        reading.cancel_scope.cancel()


async def ledger_reads(nursery, monkeypatch, ledger_target: str, delay: float = 0.0) -> list[float]:
    """The times of an edge's ledger reads of the day (each ``delay`` long) while a console is
    open for 2 s, reading ``usage`` every 0.1 s."""
    monkeypatch.setattr("edge.console.USAGE_EVERY_S", 0.1)
    monkeypatch.setattr("edge.console.LEDGER_SHARE", 0.05)
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=ledger_target))
    ledger = edge.edge.ledger
    reads: list[float] = []
    read = ledger.usage_at

    async def timed_read(*args):
        reads.append(trio.current_time())
        await trio.sleep(delay)
        return await read(*args)

    monkeypatch.setattr(ledger, "usage_at", timed_read)
    events = Events()
    async with http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        await events.first_usage()
        await trio.sleep(2.0)  # (twenty paces)
        reading.cancel_scope.cancel()
    return reads


async def test_a_slow_read_of_a_shared_ledger_puts_the_next_one_further_off(
    nursery,
    monkeypatch,
    postgres_url,  # noqa: F811
):
    """The console read the day's totals from the ledger every USAGE_EVERY_S however long the read
    took: a day of 1.6 million rows took 45% of a core with a console open (an outside soak). A
    read of a ledger the edges share that takes longer than LEDGER_SHARE of that pace puts the
    next one further off (a read of 0.2 s: the next after 4 s; 13 reads before)."""
    reads = await ledger_reads(nursery, monkeypatch, postgres_url, delay=0.2)
    assert len(reads) == 1, reads


async def test_a_ledger_only_this_edge_writes_is_read_once(nursery, tmp_path, monkeypatch):
    """SQLite: what the edge counts since the day's read is what it writes, so the console reads
    the day once, not at every pace (20 reads in 2 s here); what came since shows all the same
    (``test_requests_after_a_console_opened…``)."""
    reads = await ledger_reads(nursery, monkeypatch, str(tmp_path / "ledger.sqlite3"))
    assert len(reads) == 1, reads


async def test_requests_after_a_console_opened_on_a_fresh_edge_show_before_the_next_ledger_read(
    nursery, tmp_path, monkeypatch
):
    """A console opened before the edge's first request of the day (a fresh edge, or just
    after midnight UTC) read the ledger as of no day: the requests after that were left out
    of its key and model tables until the next read, while the chart showed them (an
    outside audit: 3 requests in the chart, none in the tables, for 5 s)."""
    monkeypatch.setattr("edge.console.USAGE_EVERY_S", 30.0)
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=str(tmp_path / "ledger.sqlite3")))
    body = {**STREAM, "stream": False, "max_tokens": 5}
    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        events = await console_events(nursery, edge, admin, reading)
        assert events.usage[-1]["source"] == "ledger" and events.usage[-1]["models"] == []
        for _ in range(3):
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        with trio.fail_after(5):  # the ledger is not read again for 30 s
            while not [row for row in events.usage[-1]["models"] if row["name"] == "m" and row["requests"] == 3]:
                await events.changed.wait()
        assert events.usage[-1]["source"] == "ledger"
        reading.cancel_scope.cancel()


async def test_requests_without_a_key_are_not_in_todays_tables_on_an_edge_with_keys(nursery, tmp_path, monkeypatch):
    """On an edge with keys, a request with no key (a 401) is no ledger record, but the console
    counted it in "today from the ledger" under "(no key)", for the rest of the day: anyone on
    the network could add rows there (an outside audit). The chart still counts it."""
    monkeypatch.setattr("edge.console.USAGE_EVERY_S", 30.0)
    edge = await start_edge(
        nursery,
        edge_config(keys=[KeyConfig(id="k", key="sk-k")], admin_keys=[ADMIN], ledger=str(tmp_path / "l.sqlite3")),
    )
    body = {**STREAM, "stream": False, "max_tokens": 5}
    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        events = await console_events(nursery, edge, admin, reading)
        for _ in range(5):
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 401
        for _ in range(2):
            r = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-k"})
            assert r.status_code == 200
        with trio.fail_after(5):
            while sum(minute[1] for minute in events.usage[-1]["minutes"]) < 7:
                await events.changed.wait()
        reading.cancel_scope.cancel()
    usage = events.usage[-1]
    assert [(row["name"], row["requests"]) for row in usage["keys"]] == [("k", 2)]
    assert [(row["name"], row["requests"]) for row in usage["models"]] == [("m", 2)]


async def test_at_most_16_consoles_then_a_clear_429(nursery):
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    async with http(edge) as admin, trio.open_nursery() as reading:
        readers = [Events() for _ in range(16)]
        for events in readers:
            await reading.start(events.read, admin)
        r = await admin.get("/v1/admin/events", headers=AUTH)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_consoles"
        assert r.json()["error"]["type"] == "rate_limit_error"  # as every 429 of the edge
        reading.cancel_scope.cancel()
    await eventually(lambda: not edge.edge.console._subscribers, "every console's stream unsubscribed")
    async with http(edge) as admin, admin.stream("GET", "/v1/admin/events", headers=AUTH) as r:
        assert r.status_code == 200  # the slots came back


async def test_consoles_that_stop_reading_lose_their_place(nursery, monkeypatch):
    """Sixteen feeds that never read (a dead tab behind a proxy, a stuck socket) held every
    console slot for as long as their sockets stayed open: each console got 429 meanwhile. A
    feed whose last events are still untaken after STALE_S is dropped; a real console gets in."""
    from edge import console as console_module

    monkeypatch.setattr(console_module, "STALE_S", 0.5)
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    # Models with long names make each snapshot about 100 KB: the stuck sockets fill at once.
    names = [f"model-{i:03d}-" + "n" * 240 for i in range(400)]
    await start_node(nursery, edge, [model(name, ttft_ms=0, tokens_per_s=0) for name in names])
    stuck = []
    request = f"GET /v1/admin/events HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {ADMIN}\r\n\r\n".encode()
    for _ in range(16):
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)  # reads nothing after the head
        await sock.connect(("127.0.0.1", edge.port))
        await sock.send(request)
        stuck.append(sock)
    await eventually(lambda: len(edge.edge.console._subscribers) == 16, "16 stuck consoles subscribed")
    try:
        with trio.fail_after(BOUND):
            async with http(edge) as admin:
                while True:
                    async with admin.stream("GET", "/v1/admin/events", headers=AUTH) as r:
                        if r.status_code == 200:
                            break
                        await r.aread()
                        assert r.json()["error"]["code"] == "too_many_consoles"
                    await trio.sleep(0.2)
    finally:
        for sock in stuck:
            sock.close()


@pytest.mark.parametrize(
    ("accept", "gzipped"),
    [
        ("gzip, deflate, br, zstd", True),
        ("GZIP", True),
        ("x-gzip", True),
        ("gzip;q=0.001", True),
        ("br", False),
        ("identity", False),
        ("", False),
        ("gzip;q=0", False),
        ("gzip; q=0.0", False),
        ("gzip;level=1;q=0", False),  # (q read as a parameter wherever it is: it was gzipped)
        ("gzip;q=nonsense", False),
    ],
)
def test_accept_encoding_takes_gzip_as_http_says(accept, gzipped):
    assert accepts_gzip(accept) is gzipped


async def test_a_console_reads_its_events_gzipped_each_as_it_is_sent(nursery):
    """A browser accepts gzip: the events come gzipped, each flushed whole as it is sent, at a
    small part of their size (a tab open under load read 95 KB/s, 340 MB an hour: an outside
    audit); a client that takes no gzip reads them plain."""
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    await start_node(nursery, edge, [model(f"model-{i:03d}-" + "n" * 40) for i in range(100)])
    async with http(edge) as admin:
        with trio.fail_after(BOUND):
            headers = {**AUTH, "accept-encoding": "gzip"}
            async with admin.stream("GET", "/v1/admin/events", headers=headers) as r:
                assert r.headers["content-encoding"] == "gzip" and r.headers["vary"] == "accept-encoding"
                gunzip, sent, text = zlib.decompressobj(31), 0, b""
                async for piece in r.aiter_raw():
                    sent += len(piece)
                    text += gunzip.decompress(piece)
                    if text.count(b"event: snapshot") >= 8 and text.endswith(b"\n\n"):
                        break
            headers = {**AUTH, "accept-encoding": "identity"}
            async with admin.stream("GET", "/v1/admin/events", headers=headers) as r:
                assert "content-encoding" not in r.headers
                plain = b""
                async for piece in r.aiter_raw():
                    plain += piece
                    if plain.count(b"event: snapshot") >= 1:
                        break
    snapshots = [
        msgspec.json.decode(block.split(b"data: ", 1)[1]) for block in text.split(b"\n\n") if b"snapshot" in block
    ]
    assert len(snapshots) >= 8 and all(len(s["nodes"][0]["models"]) == 100 for s in snapshots)
    assert sent * 10 < len(text), (sent, len(text))
    assert plain.startswith(b": iop console events\n\nevent: ")


async def test_a_passthrough_stream_shows_its_tokens_grow(nursery, upstream):
    """A tunnelled stream relays the provider's bytes, never a text event: its run showed
    0 tokens for as long as it streamed. Its tokens so far are the SSE events relayed."""
    upstream.script_for("raw-target", lambda body: text_script(words(400), interval=0.02))
    edge = await start_edge(
        nursery, edge_config(admin_keys=[ADMIN], models=[{"name": "raw", "response_mode": "passthrough"}])
    )
    await start_node(nursery, edge, [model("raw", upstream, target="raw-target", passthrough=True)])
    events = Events()
    got: list[str] = []
    async with http(edge) as client, http(edge) as admin, trio.open_nursery() as reading:
        await reading.start(events.read, admin)
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as clients:
                clients.start_soon(stream, client, {**STREAM, "model": "raw"}, got)
                snap = await events.until(lambda s: s["runs"] and s["runs"][0]["tokens"] > 5, "tokens grow")
                (run,) = snap["runs"]
                assert run["model"] == "raw" and run["phase"] == "streaming"
                clients.cancel_scope.cancel()
        reading.cancel_scope.cancel()


async def test_an_operators_cancel_before_a_responses_stream_starts_is_a_failed_stream(nursery, upstream):
    """Codex sends a request again on any HTTP error status, a 499 with x-should-retry: false too:
    an operator's cancel before its stream had started ran the turn again in full (an outside
    check with the real CLI). A streamed /v1/responses request cancelled while queued, or while
    its run waits for a first token, gets a 200 stream ending in `response.failed` with
    `invalid_prompt`, the code Codex stops on; the model server saw one request, aborted."""
    upstream.script_for("m-target", [("hang",)])
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], keepalive_s=30))
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=1)])
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    body = {"model": "m", "input": "hi", "stream": True, "tools": tools}
    answers: list = []
    async with http(edge) as client, http(edge) as admin:
        with trio.fail_after(BOUND):
            async with trio.open_nursery() as clients:

                async def ask() -> None:
                    answers.append(await client.post("/v1/responses", json=body))

                clients.start_soon(ask)
                (running,) = await upstream.wait_requests(1)
                clients.start_soon(ask)

                async def rows() -> list[dict]:
                    return (await admin.get("/v1/admin/runs", headers=AUTH)).json()["data"]

                while [row["phase"] for row in await rows()].count("queued") != 1:
                    await trio.sleep(0.01)
                ids = [row["id"] for row in await rows()]
                for run_id in sorted(ids, key=lambda i: not i.startswith("req_")):  # the queued one first
                    assert (await admin.post(f"/v1/admin/runs/{run_id}/cancel", headers=AUTH)).status_code == 200
            await running.finished.wait()
    assert len(answers) == 2 and len(upstream.records) == 1 and running.aborted
    for r in answers:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.split(b": ", 1)[1] for line in r.content.split(b"\n") if line.startswith(b"event: ")]
        assert events[0] == b"response.created" and events[-1] == b"response.failed", events
        last = msgspec.json.decode(r.content.strip().split(b"\n")[-1].removeprefix(b"data: "))
        assert last["response"]["error"]["code"] == "invalid_prompt"
        assert "cancelled by an operator" in last["response"]["error"]["message"]
