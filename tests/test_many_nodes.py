"""Many nodes: capacity, queueing, affinity, context classes, failover, drain, passthrough."""

from __future__ import annotations

import contextlib
import json
import signal
from functools import partial

import httpx
import msgspec
import openai
import pytest
import structlog
import trio

from scripts.upstream import Upstream, default_script, text_script, words
from tests.conftest import (
    BOUND,
    Peak,
    edge_config,
    eventually,
    http,
    model,
    raw_post,
    requests_counted,
    sdk,
    settled,
    sse_events,
    start_edge,
    start_node,
    start_node_process,
)

MESSAGES = [{"role": "user", "content": "hi"}]
STREAMED = {"model": "m", "messages": MESSAGES, "stream": True}


async def new_upstream(nursery) -> Upstream:
    up = Upstream()
    await nursery.start(up.serve)
    return up


async def test_capacity_is_never_exceeded_under_50_concurrent_requests(nursery):
    """50 concurrent requests over two nodes (capacity 3 and 5): every one is answered, and no
    upstream ever sees more concurrent requests than its node's max_concurrency."""
    ups = [await new_upstream(nursery), await new_upstream(nursery)]
    for up in ups:
        up.script_for("t", lambda body: text_script(words(5), interval=0.01))
    edge = await start_edge(nursery, edge_config(max_queue=100))
    await start_node(nursery, edge, [model("m", ups[0], target="t", max_concurrency=3)], node_id="a")
    await start_node(nursery, edge, [model("m", ups[1], target="t", max_concurrency=5)], node_id="b")
    statuses: list[int] = []
    with trio.fail_after(BOUND):
        async with http(edge, limits=httpx.Limits(max_connections=60)) as client, trio.open_nursery() as clients:

            async def one():
                r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True})
                statuses.append(r.status_code)
                assert r.content.endswith(b"data: [DONE]\n\n") and b"tok4" in r.content

            for _ in range(50):
                clients.start_soon(one)
    assert statuses == [200] * 50
    assert ups[0].max_active <= 3 and ups[1].max_active <= 5
    assert len(ups[0].records) + len(ups[1].records) == 50
    assert ups[0].max_active == 3 and ups[1].max_active == 5  # both were used to the full
    await settled(edge)


async def test_full_queue_and_queue_timeout_are_429_with_retry_after(nursery, upstream):
    """A full queue and a timed-out wait answer 429 with Retry-After; a client that leaves frees its place."""
    upstream.script_for("t", [("hang",)])
    edge = await start_edge(nursery, edge_config(models=[{"name": "m", "max_queue": 1, "queue_timeout_ms": 1500}]))
    await start_node(nursery, edge, [model("m", upstream, target="t", max_concurrency=1)])
    body = {"model": "m", "messages": MESSAGES}
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            clients.start_soon(partial(client.post, "/v1/chat/completions", json=body))  # takes the only slot
            await upstream.wait_requests(1)
            results: list[httpx.Response] = []

            async def queued():
                results.append(await client.post("/v1/chat/completions", json=body))

            clients.start_soon(queued)
            await eventually(lambda: edge.edge.runs.queue_depth("m") == 1)
            metrics = (await client.get("/metrics")).text  # (the queue of each model, as an operator graphs it)
            assert 'iop_model_queue_depth{model="m"} 1.0' in metrics and "iop_queue_depth 1.0" in metrics
            full = await client.post("/v1/chat/completions", json=body)
            assert full.status_code == 429
            assert full.json()["error"]["code"] == "queue_full" and int(full.headers["retry-after"]) >= 1
            await eventually(lambda: results)
            timed_out = results[0]
            assert timed_out.status_code == 429
            assert timed_out.json()["error"]["code"] == "queue_timeout" and "retry-after" in timed_out.headers
            clients.cancel_scope.cancel()
    assert len(upstream.records) == 1
    await settled(edge)


async def test_a_model_no_request_waits_for_keeps_no_queue(nursery, upstream):
    """Every model name ever requested kept a queue (an empty one) for the edge's life: a node
    naming 1,024 new models each time it linked, one request to each, grew the edge 2.3 KB a name
    for good, and /metrics walked them all (an outside audit). A queue lives while a request waits
    in it, whether that one is served after waiting, times out or leaves."""
    upstream.script_for("t", [("hang",)])
    edge = await start_edge(nursery, edge_config(models=[{"name": "q", "queue_timeout_ms": 1000}]))
    sims = [model(f"m{i}", ttft_ms=0, tokens_per_s=0) for i in range(50)]
    await start_node(nursery, edge, [*sims, model("q", upstream, target="t", max_concurrency=1)])
    runs = edge.edge.runs
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            for i in range(50):
                r = await client.post("/v1/chat/completions", json={"model": f"m{i}", "messages": MESSAGES})
                assert r.status_code == 200
            body = {"model": "q", "messages": MESSAGES}
            clients.start_soon(partial(client.post, "/v1/chat/completions", json=body))  # the only slot
            await upstream.wait_requests(1)
            timed_out = await client.post("/v1/chat/completions", json=body)  # waits 1 s, then 429
            with trio.move_on_after(0.3):  # a client that leaves while queued
                await client.post("/v1/chat/completions", json=body)
            clients.cancel_scope.cancel()
    assert timed_out.status_code == 429 and timed_out.json()["error"]["code"] == "queue_timeout"
    await eventually(lambda: not runs.runs)
    assert (dict(runs._queues), dict(runs._moved), dict(runs._preferring)) == ({}, {}, {})
    await settled(edge)


async def test_session_affinity_holds_across_20_requests(nursery):
    """The same X-Session-Id (or `user`) keeps going to the same node while it has capacity."""
    ups = [await new_upstream(nursery), await new_upstream(nursery)]
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", ups[0], target="t", max_concurrency=4)], node_id="a")
    await start_node(nursery, edge, [model("m", ups[1], target="t", max_concurrency=4)], node_id="b")
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for _ in range(20):
                r = await client.post(
                    "/v1/chat/completions",
                    json={"model": "m", "messages": MESSAGES, "max_tokens": 1},
                    headers={"X-Session-Id": "conversation-1"},
                )
                assert r.status_code == 200
            counts = sorted([len(ups[0].records), len(ups[1].records)])
            assert counts == [0, 20]
            for _ in range(20):
                await client.post(
                    "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 1, "user": "alice"}
                )
    by_user = [sum(1 for r in up.records if r.body.get("user") == "alice") for up in ups]
    assert sorted(by_user) == [0, 20]
    await settled(edge)


async def test_a_sessions_overlapping_requests_stay_on_its_node_while_it_has_capacity(nursery):
    """Under prefix routing (the default) a session left its node for the least loaded one once
    its node ran 2 of 4 (the load gap): 4 overlapping requests of one session went 2 and 2 (an
    outside audit of issue #5, "the same node while it has capacity"). They stay while the node
    has a free slot and its load is below full; a fifth, the node full, goes to the other, and
    the session stays on its node (the requests after a spill followed it: an outside re-check)."""
    ups = [await new_upstream(nursery), await new_upstream(nursery)]
    for up in ups:
        up.script_for("t", [("hang",)])
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", ups[0], target="t", max_concurrency=4)], node_id="a")
    await start_node(nursery, edge, [model("m", ups[1], target="t", max_concurrency=4)], node_id="b")
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            for n in range(5):
                clients.start_soon(
                    partial(client.post, "/v1/chat/completions", json=body, headers={"X-Session-Id": "S1"})
                )
                await eventually(lambda n=n: len(ups[0].records) + len(ups[1].records) == n + 1)
            counts = sorted([len(ups[0].records), len(ups[1].records)])
            home = ups[0] if len(ups[0].records) == 4 else ups[1]
            clients.cancel_scope.cancel()
        await eventually(lambda: ups[0].active == ups[1].active == 0 and edge.edge.runs.queue_depth() == 0)
        async with http(edge) as client, trio.open_nursery() as clients:
            clients.start_soon(partial(client.post, "/v1/chat/completions", json=body, headers={"X-Session-Id": "S1"}))
            await eventually(lambda: len(ups[0].records) + len(ups[1].records) == 6)
            clients.cancel_scope.cancel()
    assert counts == [1, 4]
    assert len(home.records) == 5


async def test_prompt_too_long_for_every_node_is_context_length_exceeded(nursery, upstream):
    """The edge estimates input tokens and refuses, before any node is bothered, a request no
    node's context_window can hold; a fitting request goes to a node that can, with or without
    max_tokens (without, it went to any node: a long prompt to the small one). While the one node
    that could hold it is away, such a request is a 503 to retry (it was the final 400)."""
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", upstream, target="small", context_window=200)], node_id="small")
    big = await start_node(nursery, edge, [model("m", upstream, target="big", context_window=2000)], node_id="big")
    long_prompt = [{"role": "user", "content": "word " * 1000}]  # ~1250 tokens by the estimate
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post(
                "/v1/chat/completions", json={"model": "m", "messages": long_prompt, "max_tokens": 1000}
            )
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "context_length_exceeded"
            assert upstream.records == []
            for _ in range(3):
                r = await client.post(
                    "/v1/chat/completions", json={"model": "m", "messages": long_prompt, "max_tokens": 10}
                )
                assert r.status_code == 200
            # Without max_tokens (the SDKs send none) the prompt alone must fit: the big node
            # serves it, and a prompt no node can hold is refused the same way.
            for _ in range(3):
                r = await client.post("/v1/chat/completions", json={"model": "m", "messages": long_prompt})
                assert r.status_code == 200
            huge = [{"role": "user", "content": "word " * 2000}]  # ~2500 tokens
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": huge})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert (
                "maximum context length is 2000 tokens. However, your messages resulted in"
                in r.json()["error"]["message"]
            )
            r = await client.post("/v1/responses", json={"model": "m", "input": huge[0]["content"]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert r.json()["error"]["param"] == "input"  # in the Responses API's words
            assert "However, your input resulted in" in r.json()["error"]["message"]
            body = {"model": "m", "input": long_prompt[0]["content"], "max_output_tokens": 1000}
            r = await client.post("/v1/responses", json=body)
            assert r.status_code == 400 and "in the input, 1000 in max_output_tokens" in r.json()["error"]["message"]
            # The big node gone for a moment (a restart): a prompt only it could hold is a 503 to
            # retry, not a final 400 telling the client its conversation is too long.
            big.scope.cancel()
            await eventually(lambda: "big" not in edge.edge.runs.links, what="the big node unlinked")
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": long_prompt})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_node_available"
            assert r.headers["retry-after"] == "1"
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": huge})  # fits none
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert len(upstream.records) == 6
    assert {rec.body["model"] for rec in upstream.records} == {"big"}


async def test_node_killed_before_its_first_event_loses_no_request(nursery, tmp_path):
    """A run whose node dies before producing anything is sent to another node, transparently."""
    slow, fine = await new_upstream(nursery), await new_upstream(nursery)
    slow.script_for("t", [("hang",)])
    edge = await start_edge(nursery)
    proc = await start_node_process(
        nursery,
        tmp_path,
        edge,
        [{"name": "m", "adapter": "openai", "target": "t", "base_url": slow.base_url}],
        node_id="doomed",
    )
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            result: list[httpx.Response] = []

            async def ask():
                result.append(
                    await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True})
                )

            clients.start_soon(ask)
            await slow.wait_requests(1)
            await start_node(nursery, edge, [model("m", fine, target="t")], node_id="survivor")
            proc.send_signal(signal.SIGKILL)
    r = result[0]
    assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
    assert b"error" not in r.content
    assert b"tok0" in r.content and len(fine.records) == 1
    (line,) = [e for e in logs if e["event"] == "request"]
    assert line["node_id"] == "survivor" and line["stream"] is True  # the node that answered
    await settled(edge)


async def tunnelled(edge, provider: Upstream, stream: bool, meanwhile) -> httpx.Response:
    """A passthrough `/v1/completions` request, and ``meanwhile()`` once its provider has it
    (and, streamed, once the edge has the head the provider sends at once): its answer."""
    result: list[httpx.Response] = []
    async with http(edge) as client, trio.open_nursery() as clients:

        async def ask():
            body = {"model": "m", "prompt": "hi", "stream": stream}
            result.append(await client.post("/v1/completions", json=body))

        clients.start_soon(ask)
        await provider.wait_requests(1)
        if stream:
            await eventually(
                lambda: any(run.first_event_at is not None for run in edge.edge.runs.runs.values()),
                "the provider's head at the edge",
            )
        await meanwhile()
    (answer,) = result
    return answer


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tunnelled_request_whose_node_dies_first_moves_too(nursery, tmp_path, stream):
    """A passthrough request (here /v1/completions) whose node dies before answering
    moves to another node, as a chat run does (it was a 502 node_disconnected), its
    body's model the new node's target (it kept the dead node's). Its "run moved" line names
    the request (logged from the link's task, it had only the run id), its access line the
    node that answered, and `iop_runs_moved_total` counts it. Streamed, its dead
    provider's head already at the edge: that head is not the client's (it went out at once,
    and the stream was cut: an outside re-audit)."""
    slow, fine = await new_upstream(nursery), await new_upstream(nursery)
    slow.script_for("t", [("hang",)])
    fine.script_for("t2", [("status", 200, b'{"ok": "survivor"}')])
    edge = await start_edge(nursery)
    proc = await start_node_process(
        nursery,
        tmp_path,
        edge,
        [{"name": "m", "adapter": "openai", "target": "t", "base_url": slow.base_url, "passthrough": True}],
        node_id="doomed",
    )

    async def lose_the_node():
        await start_node(nursery, edge, [model("m", fine, target="t2", passthrough=True)], node_id="survivor")
        proc.send_signal(signal.SIGKILL)

    with trio.fail_after(BOUND), structlog.testing.capture_logs() as logs:
        r = await tunnelled(edge, slow, stream, lose_the_node)
    assert r.status_code == 200 and r.json() == {"ok": "survivor"}
    assert [(rec.body["model"], rec.body["prompt"]) for rec in fine.records] == [("t2", "hi")]
    assert "text/event-stream" not in r.headers.get("content-type", "")  # (the dead provider's head)
    moved = [e for e in logs if e["event"] == "run moved"]
    assert [e["request_id"] for e in moved] == [r.headers["x-request-id"]], moved
    (line,) = [e for e in logs if e["event"] == "request"]
    assert line["node_id"] == "survivor"  # the node that answered (it named the dead one: an outside re-audit)
    # And counted (a failover showed nowhere in /metrics: an outside audit).
    async with http(edge) as client:
        metrics = (await client.get("/metrics")).text
    assert 'iop_runs_moved_total{model="m",why="node_lost"} 1.0' in metrics
    await settled(edge)


async def test_a_run_moved_off_a_lost_node_is_queued_not_in_flight(nursery, tmp_path, upstream):
    """A run moved off a lost node, waiting for a slot on its peer, was counted in both
    `iop_runs_in_flight` and `iop_queue_depth` (2 runs open on nodes read as 4 in flight and 2
    queued: an outside audit). It is queued: in flight are the runs on nodes."""
    hanging = await new_upstream(nursery)
    hanging.script_for("t", [("hang",)])
    upstream.script_for("t", lambda body: text_script(words(200), interval=0.05))
    edge = await start_edge(nursery, edge_config(routing="least_loaded"))
    await start_node(nursery, edge, [model("m", upstream, target="t", max_concurrency=1)], node_id="busy")
    proc = await start_node_process(
        nursery,
        tmp_path,
        edge,
        [{"name": "m", "adapter": "openai", "target": "t", "base_url": hanging.base_url}],
        node_id="doomed",
    )
    runs = edge.edge.runs
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            for sent in range(1, 3):  # one on each node
                clients.start_soon(
                    partial(client.post, "/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
                )
                await eventually(lambda sent=sent: len(runs.runs) == sent, "it is sent")
            await upstream.wait_requests(1)
            await hanging.wait_requests(1)
            proc.kill()
            await eventually(lambda: runs.queue_depth("m") == 1, "the lost node's run waits for the busy one")
            text = (await client.get("/metrics")).text
            shown = {view.phase: view.node for view in edge.edge.console.run_views()[0]}
            clients.cancel_scope.cancel()
    assert "\niop_runs_in_flight 1.0\n" in text and "\niop_queue_depth 1.0\n" in text, text
    assert 'iop_model_runs_in_flight{model="m"} 1.0' in text and 'iop_model_queue_depth{model="m"} 1.0' in text
    # The console and /v1/admin/runs show it queued on no node (it named the node it left: an outside audit).
    assert shown == {"streaming": "busy", "queued": None} or shown == {"buffered": "busy", "queued": None}, shown
    await settled(edge)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tunnelled_request_whose_only_node_dies_first_is_a_503_to_retry(nursery, upstream, stream):
    """A passthrough request whose node is lost before answering, with no other node serving
    the model, is the same 503 `no_node_available` with `Retry-After: 1` as a chat run's (it
    was a 502 `provider_tunnel_error`); streamed too, its provider's head already sent (the
    head went to the client at once, and the stream was cut with no body: an outside re-audit)."""
    upstream.script_for("t", [("hang",)])
    edge = await start_edge(nursery, edge_config(keepalive_s=10))  # (the default: past LOST_GRACE_S)
    node = await start_node(nursery, edge, [model("m", upstream, target="t", passthrough=True)])

    async def lose_the_node():
        node.stop()

    with trio.fail_after(BOUND):
        r = await tunnelled(edge, upstream, stream, lose_the_node)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "no_node_available"
    assert "lost before it answered" in r.json()["error"]["message"]  # (as a chat run's: one wording)
    await settled(edge)


@contextlib.asynccontextmanager
async def draining_with_a_stream(nursery, client, edge, upstream, node, node_id: str):
    """``node`` drains (``drain()`` in the background) while a stream of ``client``'s holds it
    linked: entered once the edge sees it draining; the stream is closed on exit."""
    async with client.stream(
        "POST", "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True}
    ) as held:
        assert held.status_code == 200
        await upstream.wait_requests(1)
        nursery.start_soon(node.agent.drain)
        await eventually(lambda: edge.edge.runs.links[node_id].draining, "the edge sees the node draining")
        yield held


async def test_a_run_whose_node_dies_first_beside_a_draining_peer_is_a_503_at_once(nursery):
    """The node running a request is lost before its first event while the only other node of
    its model drains (a restart, still finishing a stream): no node will take the run, so it is
    the 503 `no_node_available` with `Retry-After: 1` at once. It waited for the draining node
    to leave, then failed with a 502 `node_disconnected` (an outside re-audit: 5.9 s)."""
    busy, silent = await new_upstream(nursery), await new_upstream(nursery)
    busy.script_for("t", lambda body: text_script(words(400), interval=0.05))
    silent.script_for("t", [("hang",)])
    edge = await start_edge(nursery)
    draining = await start_node(nursery, edge, [model("m", busy, target="t")], node_id="draining")
    with trio.fail_after(BOUND):
        async with http(edge) as client, draining_with_a_stream(nursery, client, edge, busy, draining, "draining"):
            lost = await start_node(nursery, edge, [model("m", silent, target="t")], node_id="lost")
            answers: list[httpx.Response] = []
            async with trio.open_nursery() as clients:

                async def ask():
                    answers.append(await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}))

                clients.start_soon(ask)
                await silent.wait_requests(1)
                lost.stop()
            assert "draining" in edge.edge.runs.links  # (answered while it still drains)
    (r,) = answers
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "no_node_available"
    assert "no linked node takes new runs of `m`" in r.json()["error"]["message"]


async def test_a_committed_streams_run_lost_with_no_node_left_says_so_in_the_stream(nursery, upstream):
    """A stream committed by its keep-alives whose run is lost before its first token, with no
    node left serving the model: its in-stream error said "node disconnected", a `run_error`,
    with the code `no_node_available` (an outside chaos audit), where the same loss before the
    stream committed is a 503 that says the node was lost and none takes the model. The stream
    says what the 503 says, in its type and words."""
    upstream.script_for("t", [("hang",)])
    edge = await start_edge(nursery, edge_config(keepalive_s=0.1))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    with trio.fail_after(BOUND):
        async with (
            http(edge) as client,
            client.stream("POST", "/v1/chat/completions", json=STREAMED) as r,
        ):
            assert r.status_code == 200  # (committed: its keep-alives go out)
            await upstream.wait_requests(1)
            node.stop()
            body = await r.aread()
    (error,) = [json.loads(e)["error"] for e in sse_events(body) if e.startswith(b'{"error"')]
    assert error["type"] == "service_unavailable_error" and error["code"] == "no_node_available", error
    assert "lost before it answered" in error["message"]


async def test_a_tunnelled_stream_s_head_waits_for_its_body_keepalive_s_at_most(nursery, upstream):
    """The edge holds a passthrough stream's head for its body's first bytes (so that a lost node
    can be moved off), but a provider that sends its head and then nothing for long (a long
    prefill) has its head reach the client after `keepalive_s`: a client or proxy limiting the
    time to a response's head is not left waiting for the first token (an outside re-audit)."""
    upstream.script_for("t", [("hang",)])  # (its head goes out at once, then nothing)
    edge = await start_edge(nursery, edge_config(keepalive_s=0.2))
    node = await start_node(nursery, edge, [model("m", upstream, target="t", passthrough=True)])
    with trio.fail_after(BOUND):
        async with (
            http(edge) as client,
            client.stream("POST", "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}) as r,
        ):
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert edge.edge.runs.in_flight == 1  # (the head came while the provider still said nothing)
    await settled(edge, node.agent)


async def test_drain_finishes_in_flight_runs_then_leaves(nursery, tmp_path, upstream):
    """SIGTERM to a node: it takes no new runs, finishes its in-flight stream, then unlinks."""
    upstream.script_for("t", lambda body: text_script(words(20), interval=0.05))
    edge = await start_edge(nursery, edge_config(queue_timeout_ms=2_000))
    proc = await start_node_process(
        nursery,
        tmp_path,
        edge,
        [{"name": "m", "adapter": "openai", "target": "t", "base_url": upstream.base_url}],
        node_id="d",
    )
    with trio.fail_after(BOUND):
        async with (
            http(edge) as client,
            client.stream("POST", "/v1/chat/completions", json=STREAMED) as r,
        ):
            await upstream.wait_requests(1)
            proc.send_signal(signal.SIGTERM)
            await eventually(lambda: "d" not in edge.edge.runs.links or edge.edge.runs.links["d"].draining)
            async with trio.open_nursery() as n:  # one more, queued until the node leaves
                late: list[httpx.Response] = []

                async def ask_late() -> None:
                    late.append(await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}))

                n.start_soon(ask_late)
                body = await r.aread()
        # (no node came back within its queue timeout: see the restart's test below)
        assert late[0].status_code == 503 and "drained and left" in late[0].json()["error"]["message"], late[0].text
        assert body.endswith(b"data: [DONE]\n\n") and b"tok19" in body and b"error" not in body
        await eventually(lambda: "d" not in edge.edge.runs.links)
        await proc.wait()
    assert proc.returncode == 0
    assert not upstream.records[0].aborted


async def _only_node(nursery, tmp_path, upstream, queue_timeout_ms: int):
    """An edge, and the one node of `m` (an `iop node` process "d" of one slot), whose model
    server streams 10 tokens in half a second: the edge, the node's spec and its process."""
    upstream.script_for("t", lambda body: text_script(words(10), interval=0.05))
    edge = await start_edge(nursery, edge_config(queue_timeout_ms=queue_timeout_ms))
    spec = [{"name": "m", "adapter": "openai", "target": "t", "base_url": upstream.base_url, "max_concurrency": 1}]
    return edge, spec, await start_node_process(nursery, tmp_path, edge, spec, node_id="d")


async def _ask(client: httpx.AsyncClient, answers: list[httpx.Response]) -> None:
    answers.append(await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}))


@pytest.mark.parametrize("how", ["drained", "killed"])
async def test_a_restart_of_a_models_only_node_keeps_its_queue(nursery, tmp_path, upstream, how):
    """SIGTERM to the only node of a model, then the same node started again (`systemctl
    restart`): its id links again only once the old process has left, and at that moment
    every request queued for the model was a 503 (5 of 5 in an outside audit), and so was one
    sent in the gap. They wait within their queue timeout, and the restarted node serves
    them all. So when it was lost (killed, or its link closed by an edge that had stood
    still), though it linked again 12 ms later (an outside audit): queued requests wait on,
    and new ones for LOST_GRACE_S; its running one is lost."""
    edge, spec, proc = await _only_node(nursery, tmp_path, upstream, 20_000)
    answers: list[httpx.Response] = []
    runs = edge.edge.runs
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            ask = partial(_ask, client, answers)

            for _ in range(4):
                clients.start_soon(ask)
            await eventually(lambda: runs.queue_depth("m") == 3, "one running, three queued")
            await upstream.wait_requests(1)
            if how == "drained":
                proc.send_signal(signal.SIGTERM)
            else:
                proc.kill()
            await proc.wait()
            await eventually(lambda: "d" not in runs.links, "the link is gone")
            depth = runs.queue_depth("m")  # (killed: 4 when its running run moved to wait too, unstarted)
            assert depth == 3 if how == "drained" else depth >= 3, depth
            clients.start_soon(ask)  # one in the gap
            await eventually(lambda: runs.queue_depth("m") == depth + 1, "it waits too")
            await start_node_process(nursery, tmp_path, edge, spec, node_id="d")
    statuses = [r.status_code for r in answers]
    assert len(statuses) == 5 and statuses.count(200) >= (5 if how == "drained" else 4), [r.text for r in answers]


async def test_a_request_the_node_back_cannot_take_ends_when_it_links(nursery, tmp_path, upstream):
    """A request waiting for a lost node, which links again with a context too small for it,
    waited out its queue timeout for a 429 "at capacity" (a request sent then was a 503 at
    once: a re-check). It ends when the node links, with the 503 that says why."""
    upstream.script_for("t", lambda body: text_script(words(3)))
    edge = await start_edge(nursery, edge_config(queue_timeout_ms=60_000))
    spec = {"name": "m", "adapter": "openai", "target": "t", "base_url": upstream.base_url}
    proc = await start_node_process(nursery, tmp_path, edge, [{**spec, "context_window": 100_000}], node_id="d")
    runs = edge.edge.runs
    with trio.fail_after(BOUND):
        proc.kill()
        await proc.wait()
        await eventually(lambda: "d" not in runs.links, "the link is lost")
        async with http(edge) as client, trio.open_nursery() as clients:
            answers: list[httpx.Response] = []

            async def ask() -> None:
                body = {"model": "m", "messages": [{"role": "user", "content": "word " * 3000}]}
                answers.append(await client.post("/v1/chat/completions", json=body))

            clients.start_soon(ask)
            await eventually(lambda: runs.queue_depth("m") == 1, "it waits for the node")
            await start_node_process(nursery, tmp_path, edge, [{**spec, "context_window": 1000}], node_id="d")
    (answer,) = answers
    assert answer.status_code == 503 and "the nodes linked now cannot" in answer.text, answer.text


@pytest.mark.parametrize(("queue_timeout_ms", "said"), [(60_000, "5 s"), (1_500, "1.5 s")])
async def test_a_lost_node_that_does_not_come_back_ends_its_queue_after_a_grace(
    nursery, tmp_path, upstream, queue_timeout_ms, said
):
    """Waiting for a lost node to link again is bounded by LOST_GRACE_S (5 s), not the queue
    timeout: a node that crashed for good leaves its queue a 503 that says so. A queue timeout
    under it bounds the wait, and the 503 says that time (it said 5 s after 1.5: an outside
    audit)."""
    edge, spec, proc = await _only_node(nursery, tmp_path, upstream, queue_timeout_ms)
    answers: list[httpx.Response] = []
    runs = edge.edge.runs
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            ask = partial(_ask, client, answers)

            for _ in range(3):
                clients.start_soon(ask)
            await eventually(lambda: runs.queue_depth("m") == 2, "one running, two queued")
            proc.kill()
            await proc.wait()
    # (the running one: its node's loss, a 502, or, collected and moved to wait too, the 503)
    assert sorted(r.status_code for r in answers) in ([502, 503, 503], [503, 503, 503]), [r.text for r in answers]
    assert sum(f"was lost; none linked within {said}." in r.text for r in answers) >= 2, [r.text for r in answers]


@pytest.fixture
async def tunnel(nursery, upstream):
    edge = await start_edge(nursery, edge_config(models=[{"name": "raw", "response_mode": "passthrough"}]))
    node = await start_node(
        nursery,
        edge,
        [
            model("raw", upstream, target="raw-target", passthrough=True),
            model("emb", upstream, target="emb-target", passthrough=True),
        ],
    )
    yield edge, upstream
    await settled(edge, node.agent)


SSE_BYTES = [
    b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"raw-target","choices":[{"index":0,"delta":{"content":"He"},"finish_reason":null}]}\n\n',
    b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"raw-target","choices":[{"index":0,"delta":{"content":"llo"},"finish_reason":"stop"}],"x_provider":"kept"}\n\n',
    b"data: [DONE]\n\n",
]


async def test_passthrough_is_byte_identical(tunnel):
    """Passthrough relays the provider's status, headers and body bytes unchanged, streamed or not;
    only `model` is rewritten in the request. A stream says `x-accel-buffering: no`, as the edge's own do."""
    edge, upstream = tunnel
    whole = b'{"id": "x",  "weird_spacing": true, "choices": []}'
    with trio.fail_after(BOUND):
        async with http(edge) as client, httpx.AsyncClient(timeout=BOUND) as direct:
            upstream.script_for("raw-target", [("raw", b) for b in SSE_BYTES])
            body = {"model": "raw", "messages": MESSAGES, "stream": True, "vendor_knob": 7}
            via_edge = await client.post("/v1/chat/completions", json=body)
            straight = await direct.post(upstream.base_url + "/chat/completions", json={**body, "model": "raw-target"})
            assert via_edge.content == straight.content == b"".join(SSE_BYTES)
            assert via_edge.headers["content-type"] == straight.headers["content-type"]
            assert via_edge.headers["x-accel-buffering"] == "no"  # nginx in front passes it on as it comes
            assert upstream.records[0].body == {**body, "model": "raw-target"}

            upstream.script_for("raw-target", [("status", 200, whole)])
            via_edge = await client.post("/v1/chat/completions", json={"model": "raw", "messages": MESSAGES})
            assert via_edge.content == whole and "x-accel-buffering" not in via_edge.headers
            upstream.script_for("raw-target", [("status", 429, b'{"error": {"message": "slow down"}}')])
            via_edge = await client.post("/v1/chat/completions", json={"model": "raw", "messages": MESSAGES})
            assert via_edge.status_code == 429 and via_edge.content == b'{"error": {"message": "slow down"}}'

            upstream.script_for(
                "emb-target", [("status", 200, b'{"object": "text_completion", "choices": [{"text": "!"}]}')]
            )
            legacy = {"model": "emb", "prompt": "Say hi", "max_tokens": 3}
            via_edge = await client.post("/v1/completions", json=legacy)
            straight = await direct.post(upstream.base_url + "/completions", json={**legacy, "model": "emb-target"})
            assert via_edge.status_code == 200 and via_edge.content == straight.content
            assert upstream.records[-1].path == "/v1/completions"

            # The request's values go as sent, byte for byte: numbers are not rounded to floats.
            exact = b'{"model": "emb", "prompt": "hi", "temperature": 0.70, "x_extra": 1.0000000000000000001}'
            await client.post("/v1/completions", content=exact, headers={"content-type": "application/json"})
            sent = upstream.records[-1].raw_body
            assert b'"temperature":0.70' in sent and b'"x_extra":1.0000000000000000001' in sent, sent
            assert sent.startswith(b'{"model":"emb-target",'), sent

            emb = {"model": "emb", "input": ["a", "b"]}
            via_edge = await client.post("/v1/embeddings", json=emb)
            straight = await direct.post(upstream.base_url + "/embeddings", json={**emb, "model": "emb-target"})
    assert via_edge.status_code == 200 and via_edge.content == straight.content
    assert len(msgspec.json.decode(via_edge.content)["data"]) == 2


async def test_a_passthrough_answer_far_ahead_of_a_slow_client_is_held_on_its_node(tunnel):
    """A passthrough answer more than 32 MiB ahead of a client that reads slower than its
    provider writes was cut, the client given a truncated body (tunnels had no backpressure
    from the edge to the node). Past 4 MiB waiting, the edge holds the tunnel on its node,
    which stops reading its provider until 1 MiB or less waits: the client reads it all,
    the edge holding a few MiB of it at most (5.8 MB of 72, where it held 32.8 MB)."""
    edge, upstream = tunnel
    big = b'{"object": "text_completion", "choices": [{"text": "' + b"0.125," * 12_000_000 + b'"}]}'  # 72 MB
    upstream.script_for("emb-target", [("status", 200, big)])
    most = Peak(lambda: edge.edge.runs.buffered.bytes)
    got = bytearray()
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as inner:
            inner.start_soon(most.watch)
            stream = await raw_post(edge, "/v1/completions", b'{"model": "emb", "prompt": "a"}', 65536)
            while data := await stream.receive_some(65536):
                got += data
                if got.endswith(b"\r\n0\r\n\r\n"):
                    break
                await trio.sleep(0.002)  # (30 MB a second at most: slower than the node sends)
            inner.cancel_scope.cancel()
    await stream.aclose()
    assert got.startswith(b"HTTP/1.1 200"), bytes(got[:300])
    rest, answer = memoryview(got)[got.index(b"\r\n\r\n") + 4 :], bytearray()
    while True:  # (the edge's chunked body)
        line_end = bytes(rest[:20]).index(b"\r\n")
        size = int(bytes(rest[:line_end]), 16)
        if not size:
            break
        answer += rest[line_end + 2 : line_end + 2 + size]
        rest = rest[line_end + 4 + size :]
    assert answer == big, (len(answer), len(big))
    assert most.most < 12 * 1024 * 1024, most.most


async def test_a_passthrough_answer_far_ahead_of_a_slow_client_of_a_node_that_cannot_hold_is_the_clients(tunnel):
    """A node that takes no `hold` frames (one from before them) relays its provider's answer
    as fast as it comes; past 32 MiB waiting for a client that reads, slowly, the run is cut.
    It was labelled `output_too_large`, the node's fault ("the node sent more than ... events
    faster than the edge could send them"), where the client is the one behind: it is a slow
    client's cut."""
    edge, upstream = tunnel
    big = b'{"object": "text_completion", "choices": [{"text": "' + b"0.125," * 12_000_000 + b'"}]}'  # 72 MB
    upstream.script_for("emb-target", [("status", 200, big)])
    for link in edge.edge.runs.links.values():
        link.holds_tunnels = False  # (as a node's hello from before holds says)
    got = 0
    with trio.fail_after(BOUND):
        stream = await raw_post(edge, "/v1/completions", b'{"model": "emb", "prompt": "a"}', 65536)
        while data := await stream.receive_some(65536):
            got += len(data)
            await trio.sleep(0.01)  # (6 MB a second at most: far slower than the node sends)
        await stream.aclose()
    assert got < len(big)
    await eventually(lambda: requests_counted(edge.edge, "completions"), "the request counted")
    assert requests_counted(edge.edge, "completions") == {"slow_client": 1}


async def test_passthrough_returns_the_providers_request_id(tunnel):
    """The provider's x-request-id comes back as x-upstream-request-id, beside the edge's own."""
    edge, upstream = tunnel
    body = b'{"object": "list", "data": []}'
    upstream.script_for(
        "emb-target",
        [
            (
                "response",
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-request-id: provider-42\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body),
            )
        ],
    )
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/completions", json={"model": "emb", "prompt": "hi"})
    assert r.status_code == 200 and r.content == body
    assert r.headers["x-upstream-request-id"] == "provider-42"
    assert r.headers["x-request-id"].startswith("req_")


async def test_passthrough_never_relays_a_refusal_of_the_nodes_key(tunnel):
    """A provider's 401/403 refused the node's key and can quote it: through the tunnel
    too it is a 502 upstream_auth_failed that quotes nothing (it was relayed word for word)."""
    edge, upstream = tunnel
    said = b'{"error": {"message": "Incorrect API key provided: sk-proj-****WXYZ."}}'
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for status in (401, 403):
                upstream.script_for("emb-target", [("status", status, said)])
                r = await client.post("/v1/completions", json={"model": "emb", "prompt": "hi"})
                assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_auth_failed"
                assert b"WXYZ" not in r.content and r.headers["x-should-retry"] == "false"


async def test_passthrough_cancels_on_disconnect(tunnel):
    """A passthrough client that leaves mid-stream gets the tunnel cancelled: the upstream sees the abort."""
    edge, upstream = tunnel
    upstream.script_for("raw-target", [("raw", SSE_BYTES[0]), ("hang",)])
    with trio.fail_after(BOUND):
        async with (
            http(edge) as client,
            client.stream(
                "POST", "/v1/chat/completions", json={"model": "raw", "messages": MESSAGES, "stream": True}
            ) as r,
        ):
            with trio.CancelScope() as reading:
                async for _ in r.aiter_raw():
                    reading.cancel()
        (rec,) = await upstream.wait_requests(1)
        await rec.finished.wait()
    assert rec.aborted


async def test_passthrough_error_before_response_is_502(nursery):
    """A provider that cannot be reached: 502 provider_tunnel_error, its type and its code (the
    code was null: the openai SDK's `e.code` said nothing); a node that does not allow
    passthrough for the model is never asked."""
    edge = await start_edge(nursery, edge_config(models=[{"name": "raw", "response_mode": "passthrough"}]))
    await start_node(
        nursery, edge, [model("raw", adapter="openai", target="t", base_url="http://127.0.0.1:9/v1", passthrough=True)]
    )
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "raw", "messages": MESSAGES})
        async with sdk(edge) as client:
            with pytest.raises(openai.InternalServerError) as failed:
                await client.with_options(max_retries=0).completions.create(model="raw", prompt="hi")
    assert r.status_code == 502 and r.json()["error"]["type"] == "provider_tunnel_error"
    assert r.json()["error"]["code"] == "provider_tunnel_error"
    assert failed.value.status_code == 502 and failed.value.code == "provider_tunnel_error"
    await settled(edge)


async def test_a_route_no_node_allows_for_a_model_is_a_400_the_sdk_does_not_retry(nursery):
    """/v1/embeddings (a tunnelled route) for a model no linked node allows passthrough
    for (the demo's iop-sim): a setting, not an outage. It was a 503 no_node_available,
    which the SDK retried twice."""
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("chat-only", ttft_ms=0, tokens_per_s=0)])
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="k", max_retries=2) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.embeddings.create(model="chat-only", input="hi")
    assert refused.value.code == "passthrough_not_allowed" and "passthrough" in refused.value.message
    assert len([e for e in logs if e["event"] == "request"]) == 1  # asked once
    await settled(edge)


async def test_a_chat_model_relayed_by_the_edge_but_not_allowed_by_its_node_says_so(nursery):
    """`response_mode = "passthrough"` on the edge, a node without `passthrough = true`: chat is a
    400 `passthrough_not_allowed` naming both settings. It said the model "is served for chat
    here, not for this route", on the chat route (an outside audit)."""
    edge = await start_edge(nursery, edge_config(models=[{"name": "raw", "response_mode": "passthrough"}]))
    await start_node(nursery, edge, [model("raw", ttft_ms=0, tokens_per_s=0)])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "raw", "messages": MESSAGES})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "passthrough_not_allowed", r.text
    assert "`passthrough = true`" in error["message"] and "`response_mode`" in error["message"], error
    assert "served for chat" not in error["message"]
    await settled(edge)


@pytest.mark.parametrize("failing", ["unreachable", "401", "429"])
async def test_a_node_whose_model_server_is_down_is_routed_around(nursery, upstream, failing):
    """Two nodes, one whose model server refuses every connection (or the node's key, or
    is saturated): it failed each run at once, so it always looked least loaded and drew
    about half the traffic (31 of 40 requests failed in an audit). After 3 such failures
    in a row it is routed around for the model (1 s, doubling while it keeps failing);
    alone, it still answers at once."""
    edge = await start_edge(nursery)
    if failing == "unreachable":
        dead = model("m", adapter="openai", target="t", base_url="http://127.0.0.1:9/v1")
    else:
        refusing = await new_upstream(nursery)
        refusing.default = lambda body: [("status", int(failing), b'{"error": {"message": "no"}}')]
        dead = model("m", refusing, target="t")
    await start_node(nursery, edge, [dead], node_id="dead")
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            alone = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
            assert alone.status_code in (502, 429)
            await start_node(nursery, edge, [model("m", upstream, target="t")], node_id="alive")
            statuses = []
            for i in range(40):
                body = {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}]}
                statuses.append((await client.post("/v1/chat/completions", json=body)).status_code)
    assert statuses.count(200) >= 36, statuses  # (the failures: before it is routed around, and probes)
    await settled(edge)


async def test_a_node_whose_model_server_refuses_every_request_is_routed_around(nursery, upstream):
    """Two nodes, one whose model server answers every request 400 (vLLM's context error: its
    max_model_len smaller than its node says, or a template that refuses). It looked the least
    loaded (it frees its slots at once) and drew most of the traffic: 96 of 120 requests failed
    with one such node among three (an outside audit). A run refused at once with a 4xx moves,
    once, to a node with a free slot; answered there, the refusal was its node's: after 3 in a
    row it is routed around. A request every node refuses is the client's 400, once."""
    refusing = await new_upstream(nursery)
    too_long = b'{"error": {"message": "This model\'s maximum context length is 10 tokens."}}'
    refusing.default = lambda body: [("status", 400, too_long)]
    upstream.default = lambda body: (
        [("status", 422, b'{"error": {"message": "bad request"}}')]
        if "bad" in str(body["messages"])
        else default_script(body)
    )
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", refusing, target="t")], node_id="refusing")
    await start_node(nursery, edge, [model("m", upstream, target="t")], node_id="alive")
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            statuses = []
            for i in range(40):
                body = {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}]}
                statuses.append((await client.post("/v1/chat/completions", json=body)).status_code)
            bad = await client.post(
                "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "bad"}]}
            )
    assert statuses == [200] * 40, statuses
    assert len(refusing.records) <= 10, len(refusing.records)  # (3, then probes once a second)
    assert bad.status_code == 422 and "bad request" in bad.json()["error"]["message"], bad.text
    await settled(edge)


async def test_a_node_whose_provider_fails_passthrough_requests_is_routed_around(nursery, upstream):
    """A passthrough answer's head of the node's fault (a 503) counted as served: a node whose
    provider failed every request was never routed around (15 of 20 /v1/completions failed in a
    re-check), and its errors undid the routing-around chat had learned. It counts as a failure."""
    failing = await new_upstream(nursery)
    failing.default = lambda body: [("status", 503, b'{"error": {"message": "overloaded"}}')]
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", failing, target="t", passthrough=True)], node_id="failing")
    await start_node(nursery, edge, [model("m", upstream, target="t", passthrough=True)], node_id="alive")
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            statuses = []
            for i in range(20):
                body = {"model": "m", "prompt": f"question {i}", "max_tokens": 4}
                statuses.append((await client.post("/v1/completions", json=body)).status_code)
    assert statuses.count(200) >= 17, statuses  # (the failures: before it is routed around, and probes)
    await settled(edge)


async def test_a_node_that_refuses_only_some_requests_is_routed_around_a_second_at_a_time(nursery, upstream):
    """Refusals another node answered count against a node, but it may refuse only some requests
    (a smaller max_model_len than its peers', its context_window not said): one client's long
    prompts in a row had it routed around for all requests, the backoff doubling to 30 s (a
    re-check). Such refusals route it around 1 s at a time, never longer; its own failures
    (5xx, unreachable) still double."""
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", upstream, target="t")], node_id="small")
    link = edge.edge.runs.links["small"]
    now = trio.current_time()
    refused = [link.failed_at_once("m", now + 1.5 * i, refused=True) for i in range(12)]
    assert max(refused) == 1.0 and refused.count(1.0) >= 4, refused
    link.served("m")
    failed = [link.failed_at_once("m", now + 100 + 40 * i) for i in range(8)]
    assert [b for b in failed if b] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0], failed
    await settled(edge)


async def test_the_model_list_follows_nodes_as_they_come_and_go(nursery, upstream):
    """/v1/models is kept between requests (16 nodes of 1,020 models each made an 11 MB list in
    180 ms a request: an outside audit), and is new as soon as a node links or leaves."""
    edge = await start_edge(nursery)
    with trio.fail_after(BOUND):
        async with http(edge) as client:

            async def listed() -> list[str]:
                return [m["id"] for m in (await client.get("/v1/models")).json()["data"]]

            assert await listed() == []
            a = await start_node(nursery, edge, [model("m1", upstream)], node_id="a")
            assert await listed() == ["m1"] and await listed() == ["m1"]
            await start_node(nursery, edge, [model("m2", upstream)], node_id="b")
            assert await listed() == ["m1", "m2"]
            a.scope.cancel()
            await eventually(lambda: "a" not in edge.edge.runs.links, "node a gone")
            assert await listed() == ["m2"]
            paged = (await client.get("/v1/models", params={"limit": "1"})).json()
            assert [m["id"] for m in paged["data"]] == ["m2"] and await listed() == ["m2"]


async def test_models_and_nodes_listing(nursery, upstream):
    """/v1/models lists each model once with its nodes; /v1/nodes (admin key) shows capacity and in-flight."""
    edge = await start_edge(nursery, edge_config(admin_keys=["admin-secret"]))
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=2), model("x", upstream)], node_id="a")
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=3)], node_id="b")
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            models = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["nodes"]) for m in models] == [("m", ["a", "b"]), ("x", ["a"])]
            assert (await client.get("/v1/nodes")).status_code == 401
            nodes = (await client.get("/v1/nodes", headers={"Authorization": "Bearer admin-secret"})).json()["data"]
    assert [n["id"] for n in nodes] == ["a", "b"]
    assert {m["name"]: m["max_concurrency"] for m in nodes[0]["models"]} == {"m": 2, "x": 4}
    assert nodes[1]["in_flight"] == 0 and nodes[1]["linked_for_s"] >= 0


async def test_passthrough_does_not_impose_the_chat_schema(tunnel):
    """A provider-specific body the chat schema would refuse still reaches the provider as sent."""
    edge, upstream = tunnel
    upstream.script_for("raw-target", [("status", 200, b'{"ok": true}')])
    odd = {"model": "raw", "messages": [{"role": "narrator", "content": [{"type": "audio", "id": 1}]}], "n": 3}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json=odd)
    assert r.status_code == 200 and r.content == b'{"ok": true}'
    assert upstream.records[0].body == {**odd, "model": "raw-target"}


async def test_passthrough_charges_keys_what_the_provider_said(nursery, upstream, tmp_path):
    """A keyed request through the tunnel (/v1/completions, /v1/embeddings, a passthrough
    chat model) is charged the provider's `usage` (a whole body's, or a stream's last
    chunk's), or an estimate marked as one: its daily budget holds, and the ledger has
    the counts. (Found from outside: every tunnelled request was charged 0.)"""
    from edge.config import KeyConfig

    edge = await start_edge(
        nursery,
        edge_config(
            models=[{"name": "raw", "response_mode": "passthrough"}],
            keys=[KeyConfig(id="fay", key="sk-fay", daily_tokens=100)],
            admin_keys=["sk-admin"],
            ledger=str(tmp_path / "ledger.sqlite3"),
        ),
    )
    node = await start_node(
        nursery,
        edge,
        [
            model("raw", upstream, target="raw-target", passthrough=True),
            model("emb", upstream, target="emb-target", passthrough=True),
        ],
    )
    whole = b'{"object": "text_completion", "choices": [{"text": "hi"}], "usage": {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}}'
    stream = [
        b'data: {"choices":[{"index":0,"delta":{"content":"He"}}],"usage":null}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":20,"total_tokens":27}}\n\n',
        b"data: [DONE]\n\n",
    ]
    with trio.fail_after(BOUND):
        async with http(edge, headers={"authorization": "Bearer sk-fay"}) as client:
            upstream.script_for("emb-target", [("status", 200, whole)])
            r = await client.post("/v1/completions", json={"model": "emb", "prompt": "Say hi", "max_tokens": 10})
            assert r.status_code == 200 and r.content == whole
            upstream.script_for("raw-target", [("raw", b) for b in stream])
            body = {"model": "raw", "messages": MESSAGES, "stream": True}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.content == b"".join(stream)
            r = await client.post("/v1/embeddings", json={"model": "emb", "input": "x" * 400})  # no usage: estimated
            assert r.status_code == 200
            fay = edge.edge.keys.by_id["fay"]
            await eventually(lambda: fay.day_used == 15 + 27 + 100, what="the estimate charged")
            r = await client.post("/v1/completions", json={"model": "emb", "prompt": "again", "max_tokens": 10})
            assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
            assert await edge.edge.ledger.flush()
            usage = await client.get("/v1/admin/usage?group_by=api", headers={"authorization": "Bearer sk-admin"})
    rows = {row["api"]: row for row in usage.json()["data"]}
    assert (rows["completions"]["prompt_tokens"], rows["completions"]["completion_tokens"]) == (5, 10)
    assert (rows["chat"]["prompt_tokens"], rows["chat"]["completion_tokens"]) == (7, 20)
    assert rows["embeddings"]["total_tokens"] == 100 and rows["embeddings"]["estimated_requests"] == 1
    await settled(edge, node.agent)


async def test_passthrough_keeps_the_edges_bounds(tunnel):
    """The tunnel relays the body as sent, but the edge's bounds hold: max_tokens past
    max_output_tokens, an integer past 64 bits: 400s as on chat, before any node."""
    edge, upstream = tunnel
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/completions", json={"model": "emb", "prompt": "x", "max_tokens": 2**63 - 1})
            assert r.status_code == 400 and r.json()["error"]["code"] == "integer_above_max_value"
            r = await client.post("/v1/completions", json={"model": "emb", "prompt": "x", "seed": 2**64})
            assert r.status_code == 400 and r.json()["error"]["code"] == "integer_out_of_range"
            r = await client.post("/v1/embeddings", json={"model": "emb", "input": [[1, -(2**63) - 1]]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input"
            # A model that is no string is named as such, as on chat (it was "missing": an outside audit)
            for value, said in ((5, "expected `str`, got `int`"), (None, "Missing"), ("", "Missing")):
                r = await client.post("/v1/completions", json={"model": value, "prompt": "x"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
                assert said in r.json()["error"]["message"], r.text
    assert not upstream.records


@pytest.mark.parametrize(
    "completion",
    [b"18446744073709551616", b"NaN", b"-5000", b"1.5e300", b'"x"', b"null", b"{" * 20000 + b"}" * 20000],
)
async def test_a_providers_usage_that_is_no_count_is_not_charged(nursery, upstream, tmp_path, completion):
    """A provider's `usage` through the tunnel whose count is no token count (past 2^64,
    NaN, negative, a float, a string, null, nested deeper than JSON can be read) is not
    charged as it stands: the request is charged the estimate, the key's day and the
    ledger stay sane. (Found from outside: 2^64 killed the ledger's writer; NaN jammed it;
    -5000 gave a budget back; 1.5e300 locked the key out for the day.)"""
    from edge.config import KeyConfig

    edge = await start_edge(
        nursery,
        edge_config(keys=[KeyConfig(id="fay", key="sk-fay", daily_tokens=100_000)], ledger=str(tmp_path / "l.sqlite3")),
    )
    node = await start_node(nursery, edge, [model("emb", upstream, target="emb-target", passthrough=True)])
    body = b'{"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 5, "completion_tokens": ' + completion + b"}}"
    upstream.script_for("emb-target", [("status", 200, body)])
    with trio.fail_after(BOUND):
        async with http(edge, headers={"authorization": "Bearer sk-fay"}) as client:
            r = await client.post("/v1/completions", json={"model": "emb", "prompt": "x" * 40, "max_tokens": 5})
            assert r.status_code == 200 and r.content == body
            fay = edge.edge.keys.by_id["fay"]
            await eventually(lambda: fay.day_used > 0, what="the request charged")
            assert await edge.edge.ledger.flush()
    assert fay.day_used == 10  # the estimate: 40 characters of prompt / 4, and "hi" / 4 (0) of completion
    assert edge.edge.ledger.written == 1
    await settled(edge, node.agent)


async def test_a_request_timed_out_while_every_node_drains_is_a_503_that_says_so(nursery, upstream):
    """A request queued while the only node serving its model drains (a restart) and its queue
    timeout passes: it was a 429 "at capacity" with 3 of 20 slots busy. It is a 503
    `no_node_available` that says every node is draining, with Retry-After."""
    upstream.script_for("t", lambda body: text_script(words(200), interval=0.05))
    edge = await start_edge(nursery, edge_config(queue_timeout_ms=500))
    node = await start_node(nursery, edge, [model("m", upstream, target="t", max_concurrency=20)])
    with trio.fail_after(BOUND):
        async with http(edge) as client, draining_with_a_stream(nursery, client, edge, upstream, node, "n1"):
            late = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
    error = late.json()["error"]
    assert error["code"] == "no_node_available" and "draining" in error["message"], error


async def test_a_held_tunnel_read_slowly_is_not_timed_out(nursery, upstream):
    """A held tunnel's silence is its client's: each batch its writer takes ends it. Batches of
    256 KiB took a client reading 100 KB a second longer than `wait_timeout_s` (1 s here), and
    it was cut as timed out (a re-check, at 40 KB a second under 5 s); held, a writer takes 64 KiB."""
    edge = await start_edge(nursery, edge_config(wait_timeout_s=1.0))
    node = await start_node(nursery, edge, [model("emb", upstream, target="emb-target", passthrough=True)])
    big = b'{"object": "text_completion", "choices": [{"text": "' + b"0.125," * 1_500_000 + b'"}]}'  # 9 MB
    upstream.script_for("emb-target", [("status", 200, big)])
    got = bytearray()
    with trio.fail_after(BOUND):
        stream = await raw_post(edge, "/v1/completions", b'{"model": "emb", "prompt": "a"}', 16384)
        await eventually(lambda: any(run.held for run in edge.edge.runs.runs.values()), "it is held")
        slow_until = trio.current_time() + 3.0
        while data := await stream.receive_some(16384):
            got += data
            if got.endswith(b"\r\n0\r\n\r\n"):
                break
            if trio.current_time() < slow_until:
                await trio.sleep(len(data) / 100_000)  # (100 KB a second, for 3 s)
    await stream.aclose()
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"\r\n0\r\n\r\n"), bytes(got[-300:])
    assert b'"error"' not in got[-2000:]
    await settled(edge, node.agent)


@pytest.mark.parametrize("keepalive_s", [None, 0.1])
async def test_a_collected_run_lost_with_its_models_only_node_is_told_none_linked(nursery, upstream, keepalive_s):
    """A whole (non-streamed) answer whose model's only node is lost mid-run is run again on a
    node linked within LOST_GRACE_S; none linked, its client was told "node disconnected", a
    502, where a request queued beside it was the 503 that says the last node was lost and none
    linked within 5 s (which the SDKs retry the same way, and which says what to do). It gets
    that 503 too."""
    upstream.script_for("t", [("chunk", {"content": "half"}), ("hang",)])
    keepalive = {} if keepalive_s is None else {"keepalive_s": keepalive_s}  # (committed: its head went out)
    edge = await start_edge(nursery, edge_config(queue_timeout_ms=30_000, **keepalive))
    node = await start_node(nursery, edge, [model("m", upstream, target="t")])
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            answers: list[httpx.Response] = []
            clients.start_soon(_ask, client, answers)
            await upstream.wait_requests(1)
            runs = edge.edge.runs.runs
            await eventually(lambda: any(run.events_seen for run in runs.values()), "its first token came")
            node.stop()
    (r,) = answers
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_node_available", r.text
    assert "was lost; none linked within 5 s" in r.json()["error"]["message"], r.text


async def test_a_run_its_only_node_lost_before_its_first_token_waits_for_it_as_the_queue_does(
    nursery, tmp_path, upstream
):
    """A run sent to its model's only node, which is killed before its first token: the requests
    queued behind it waited LOST_GRACE_S for the node to link again and were served by it, but
    it was a 503 at once (an outside re-check). It waits with them, and the node back serves it."""
    upstream.script_for("t", lambda body: [("sleep", 0.5), *text_script(words(3))])
    edge = await start_edge(nursery, edge_config(queue_timeout_ms=20_000))
    spec = [{"name": "m", "adapter": "openai", "target": "t", "base_url": upstream.base_url, "max_concurrency": 1}]
    proc = await start_node_process(nursery, tmp_path, edge, spec, node_id="d")
    answers: list[httpx.Response] = []
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            clients.start_soon(_ask, client, answers)
            await upstream.wait_requests(1)
            proc.kill()
            await proc.wait()
            await eventually(lambda: "d" not in edge.edge.runs.links, "the link is lost")
            await start_node_process(nursery, tmp_path, edge, spec, node_id="d")
    (r,) = answers
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 ", r.text
    assert len(upstream.records) == 2 and upstream.records[0].aborted


async def test_a_node_back_without_a_model_ends_the_waits_for_it(nursery, tmp_path, upstream):
    """The only node of `m` is lost, and a request for `m` waits for it (LOST_GRACE_S); the node
    links again serving other models only. The request waited out the grace for a 503 that said
    no node had linked (an outside re-check): it ends when the node links, saying why."""
    upstream.script_for("t", lambda body: text_script(words(3)))
    edge = await start_edge(nursery, edge_config(queue_timeout_ms=20_000))
    other = {"name": "o", "adapter": "openai", "target": "t", "base_url": upstream.base_url}
    spec = [{**other, "name": "m"}, other]
    proc = await start_node_process(nursery, tmp_path, edge, spec, node_id="d")
    runs = edge.edge.runs
    answers: list[httpx.Response] = []
    with trio.fail_after(BOUND):
        proc.kill()
        await proc.wait()
        await eventually(lambda: "d" not in runs.links, "the link is lost")
        async with http(edge) as client, trio.open_nursery() as clients:
            clients.start_soon(_ask, client, answers)
            await eventually(lambda: runs.queue_depth("m") == 1, "it waits for the node")
            await start_node_process(nursery, tmp_path, edge, [other], node_id="d")
    (answer,) = answers
    assert answer.status_code == 503 and "linked again without it" in answer.json()["error"]["message"], answer.text


async def test_a_model_whose_node_links_second_after_an_edge_start_is_retried_not_final(nursery, monkeypatch):
    """An edge just started, one node linked, the node serving `b` not yet (a rolling restart:
    it redials within relink_max_s): a request for `b` was a final 404 (`x-should-retry: false`)
    that the SDKs and Claude Code do not retry, while /readyz said ready (an outside audit: 1 to
    7 requests of each restart). In the edge's first seconds the 404 tells the SDKs to retry
    (`x-should-retry: true`, Retry-After 1), and the OpenAI SDK's retry is served once the node
    links; past them, a name no node serves is a final 404 again."""
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("a")], node_id="na")
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "b", "messages": MESSAGES})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert (r.headers["x-should-retry"], r.headers["retry-after"]) == ("true", "1")
        assert "just started" in r.json()["error"]["message"]
        async with http(edge) as client:  # (and the model's card: a final 404, an outside re-check)
            r = await client.get("/v1/models/b")
        assert r.status_code == 404 and r.headers["x-should-retry"] == "true"

        async def link_b_later() -> None:
            await trio.sleep(0.3)
            await start_node(nursery, edge, [model("b")], node_id="nb")

        nursery.start_soon(link_b_later)
        async with openai.AsyncOpenAI(base_url=edge.url + "/v1", api_key="x", max_retries=2) as sdk:
            answer = await sdk.chat.completions.create(model="b", messages=MESSAGES)
        assert answer.choices[0].message.content
        monkeypatch.setattr(edge.edge.runs, "started", edge.edge.runs.started - 3600)
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "c", "messages": MESSAGES})
            card = await client.get("/v1/models/c")
    assert r.status_code == 404 and r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers
    assert card.status_code == 404 and card.headers["x-should-retry"] == "false"
