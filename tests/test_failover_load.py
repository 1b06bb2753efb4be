"""A node whose model server fails every run, under load: the queue waits for the
working node instead of failing through the dead one."""

from __future__ import annotations

import math
from functools import partial

import httpx
import pytest
import trio

from edge.runs.run import RunTimers
from scripts.upstream import Upstream, text_script, words
from tests.conftest import BOUND, edge_config, eventually, http, model, settled, start_edge, start_node

SLOTS = 4


MESSAGES = [{"role": "user", "content": "hi"}]


async def new_upstream(nursery) -> Upstream:
    up = Upstream()
    await nursery.start(up.serve)
    return up


async def failing_model(nursery, failing: str):
    """A model whose server refuses connections (a closed port) or answers 500 at once."""
    if failing == "unreachable":
        return model("m", adapter="openai", target="t", base_url="http://127.0.0.1:9/v1", max_concurrency=SLOTS), None
    refusing = await new_upstream(nursery)
    refusing.default = lambda body: [("status", 500, b'{"error": {"message": "engine dead"}}')]
    return model("m", refusing, target="t", max_concurrency=SLOTS), refusing


async def post_all(edge, n: int) -> list[int]:
    statuses: list[int] = []
    with trio.fail_after(BOUND):
        async with http(edge, limits=httpx.Limits(max_connections=n + 4)) as client, trio.open_nursery() as clients:

            async def one(i: int) -> None:
                body = {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}], "stream": i % 2 == 0}
                r = await client.post("/v1/chat/completions", json=body)
                statuses.append(r.status_code)

            for i in range(n):
                clients.start_soon(one, i)
    return statuses


@pytest.mark.parametrize("failing", ["unreachable", "500"])
async def test_a_dead_model_server_under_load_does_not_fail_the_queue(nursery, failing):
    """Two nodes of 4 slots, 16 requests at once, one node's model server dead. Its runs
    fail at once, so it looked least loaded and took every slot it freed, again and again,
    before 3 failures routed it around and again when the pause ended: an audit saw all 40
    queued requests fail while the other node was seconds from free. Now a failing node gets
    one run at a time (a probe) while another node works, and a run it fails before any
    output moves to that node: the healthy one serves them all."""
    healthy = await new_upstream(nursery)
    healthy.script_for("t", lambda body: text_script(words(5), interval=0.04))
    edge = await start_edge(nursery, edge_config(max_queue=100))
    dead, refusing = await failing_model(nursery, failing)
    await start_node(nursery, edge, [dead], node_id="dead")
    await start_node(nursery, edge, [model("m", healthy, target="t", max_concurrency=SLOTS)], node_id="alive")
    statuses = await post_all(edge, 4 * SLOTS)
    assert statuses.count(200) >= 4 * SLOTS - 2, statuses
    assert len(healthy.records) >= statuses.count(200)
    assert healthy.max_active <= SLOTS
    if refusing is not None:
        # The first burst (its slots free at once) and then a probe at a time: not the whole queue.
        assert len(refusing.records) <= SLOTS + 4, len(refusing.records)
    await settled(edge)


async def test_a_failing_node_probe_after_its_pause_is_one_run(nursery):
    """After its pause a node that failed 3 runs in a row gets one run, not one per free slot
    (the audit: 18 queued requests sent to the dead node the moment its pause ended)."""
    healthy = await new_upstream(nursery)
    healthy.script_for("t", lambda body: text_script(words(40), interval=0.05))  # ~2 s: past the 1 s pause
    edge = await start_edge(nursery, edge_config(max_queue=100))
    dead, refusing = await failing_model(nursery, "500")
    await start_node(nursery, edge, [dead], node_id="dead")
    await start_node(nursery, edge, [model("m", healthy, target="t", max_concurrency=SLOTS)], node_id="alive")
    statuses = await post_all(edge, 4 * SLOTS)
    assert statuses.count(200) >= 4 * SLOTS - 2, statuses
    # 4 at once before any failed, then one at a time: at most a probe per pause besides.
    assert len(refusing.records) <= SLOTS + 4, len(refusing.records)
    await settled(edge)


async def test_a_lone_failing_node_still_answers_at_once_under_load(nursery):
    """With no working node for the model the failing one is still used, one run at a time
    or not: each request gets its error at once, none waits out the queue timeout."""
    edge = await start_edge(nursery, edge_config(models=[{"name": "m", "queue_timeout_ms": 8000}]))
    dead, _ = await failing_model(nursery, "unreachable")
    await start_node(nursery, edge, [dead], node_id="dead")
    start = trio.current_time()
    statuses = await post_all(edge, 4 * SLOTS)
    assert trio.current_time() - start < 5
    assert statuses.count(429) == 0 and len(statuses) == 4 * SLOTS, statuses
    await settled(edge)


async def slow_and_dead(nursery, first_token_s: float, slots: int, **config):
    """An edge with two nodes serving `m`: one whose server takes ``first_token_s`` to answer
    (``slots`` of it), one whose server refuses connections."""
    slow = await new_upstream(nursery)
    slow.script_for("t", lambda body: [("sleep", first_token_s), *text_script(words(3))])
    edge = await start_edge(nursery, edge_config(max_queue=100, **config))
    dead, _ = await failing_model(nursery, "unreachable")
    await start_node(nursery, edge, [model("m", slow, target="t", max_concurrency=slots)], node_id="slow")
    await start_node(nursery, edge, [dead], node_id="dead")
    return edge


async def test_a_dead_server_s_failures_do_not_make_a_slow_node_stalled(nursery):
    """A dead model server's 1 ms failures were counted as that node's time to first token, the
    peers' yardstick for a stall: a healthy node whose runs take a while to start (a long
    prompt) was judged stalled, its runs cancelled and moved to the dead node, where they
    failed (an outside re-audit). Failures say nothing of how fast runs start: the slow node
    keeps its runs and serves them."""
    edge = await slow_and_dead(nursery, 2.0, 2, stall_after_s=1)
    statuses = await post_all(edge, 6)
    assert statuses.count(200) >= 4, statuses  # (the first runs the dead node took fail, or move)
    assert not edge.edge.runs.links["slow"].stalled(trio.current_time())


async def test_a_moved_run_waits_no_longer_than_the_queue(nursery):
    """A run moved off a node that failed it at once waited for a slot with no bound but its
    silence (120 s), outside max_queue: the re-audit's waited 30 s for a 504. It waits as a
    queued request does and then gets the error it moved from."""
    edge = await slow_and_dead(nursery, 6.0, 1, queue_timeout_ms=1000, wait_timeout_s=60)
    started = trio.current_time()
    statuses = await post_all(edge, 4)
    assert trio.current_time() - started < 15, "a moved run waited past the queue's timeout"
    assert statuses.count(200) >= 1 and set(statuses) <= {200, 429, 502}, statuses


async def test_a_moved_run_never_goes_back_to_the_failing_node(nursery):
    """A run moved off a node that failed it waited in the moved queue, and when that node was
    next free (no probe out, its pause over) it was sent back there, failed again, and its
    client got the error it had moved from (an outside re-audit: every scenario, 2 of 150 to 5
    of 60 requests). It waits for a node that is not failing."""
    edge = await slow_and_dead(nursery, 0.4, 1, queue_timeout_ms=15_000)
    statuses: list[int] = []
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:

            async def one(i: int) -> None:
                body = {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}
                statuses.append((await client.post("/v1/chat/completions", json=body)).status_code)

            for i in range(8):
                clients.start_soon(one, i)
                await trio.sleep(0.3)
    assert statuses == [200] * 8, statuses


async def test_a_model_with_no_peer_is_never_judged_stalled(nursery):
    """A node's slow first token was judged against nodes serving other models: one long prompt
    on the only node of a model (2.5 s against a peer's milliseconds for another model) had
    the node routed around for all its models, and its free slots turned requests away with
    429 (an outside check of #9). A stall is judged against the model's own peers; here it
    has none, so the node keeps serving both its models."""
    fast, slow = await new_upstream(nursery), await new_upstream(nursery)
    slow.script_for("slow", lambda body: [("sleep", 2.5), *text_script(words(3))])
    edge = await start_edge(nursery, edge_config(stall_after_s=0.5, queue_timeout_ms=1000))
    await start_node(nursery, edge, [model("a", fast, target="t")], node_id="peer")
    await start_node(
        nursery, edge, [model("solo", slow, target="slow", max_concurrency=4), model("other", slow)], node_id="only"
    )
    statuses: dict[str, int] = {}
    with trio.fail_after(BOUND):
        async with http(edge) as client:

            async def ask(name: str, model_name: str) -> None:
                body = {"model": model_name, "messages": [{"role": "user", "content": name}]}
                statuses[name] = (await client.post("/v1/chat/completions", json=body)).status_code

            await ask("warm", "a")  # the peer's time to first event is known: milliseconds
            async with trio.open_nursery() as clients:
                clients.start_soon(ask, "long", "solo")
                await trio.sleep(1.5)  # three times stall_after_s, hundreds of times the peer's
                assert not edge.edge.runs.links["only"].stalled(trio.current_time())
                await ask("other", "other")
                await ask("solo", "solo")  # a free slot of the same model
    assert statuses == {"warm": 200, "long": 200, "other": 200, "solo": 200}, statuses


async def test_a_stall_of_one_model_leaves_the_node_s_other_models_served(nursery):
    """A node judged stalled for one model (its run of `shared` not starting while a peer starts
    them in milliseconds) was routed around for all its models: a request for `solo`, which only
    it serves, waited out the queue's timeout for a 429 (an outside re-audit). The stalled run
    moves to the peer; the node keeps serving `solo` at once."""
    fast, slow = await new_upstream(nursery), await new_upstream(nursery)
    slow.script_for("stuck", lambda body: [("sleep", 4.0), *text_script(words(3))])
    edge = await start_edge(nursery, edge_config(stall_after_s=0.5, queue_timeout_ms=2000, routing="least_loaded"))
    await start_node(nursery, edge, [model("shared", fast, target="t")], node_id="peer")
    statuses: dict[str, int] = {}
    with trio.fail_after(BOUND):
        async with http(edge) as client:

            async def ask(name: str, model_name: str, session: str = "") -> None:
                body = {"model": model_name, "messages": [{"role": "user", "content": name}]}
                headers = {"x-session-id": session} if session else {}
                r = await client.post("/v1/chat/completions", json=body, headers=headers)
                statuses[name] = r.status_code

            # The peer's time to first event is known: milliseconds. (Asked before `multi`
            # links: one sent there would hang 4 s, unjudged, and four took the test to 16 s.)
            for i in range(4):
                await ask(f"warm{i}", "shared")
            await start_node(
                nursery,
                edge,
                [model("shared", slow, target="stuck", max_concurrency=4), model("solo", slow, target="t")],
                node_id="multi",
            )
            async with trio.open_nursery() as clients:
                for i in range(2):  # least loaded: one of them goes to `multi`, whose server hangs
                    clients.start_soon(ask, f"slow{i}", "shared")
                await eventually(lambda: edge.edge.runs.links["multi"].stalled(trio.current_time(), "shared"))
                node = next(n for n in edge.edge.console.snapshot().nodes if n.id == "multi")  # the console says which
                assert {m.name: m.stalled for m in node.models} == {"shared": True, "solo": False}
                listed = {n["id"]: n for n in (await client.get("/v1/nodes")).json()["data"]}  # and /v1/nodes
                assert listed["multi"]["stalled"] is True and listed["peer"]["stalled"] is False
                shown = {m["name"]: (m["stalled"], m["failing"]) for m in listed["multi"]["models"]}
                assert shown == {"shared": (True, False), "solo": (False, False)}
                await ask("solo", "solo")  # a 429 once the queue's 2 s are out, if routed around
    links = edge.edge.runs.links
    assert not links["multi"].stalled(trio.current_time(), "solo")
    assert statuses["solo"] == 200, statuses
    assert statuses["slow0"] == statuses["slow1"] == 200, statuses


@pytest.mark.parametrize("gone", ["left", "draining"])
async def test_a_node_stalled_for_a_model_serves_it_once_its_peers_are_gone(nursery, gone):
    """A node judged stalled for `m` against a peer, whose runs of `m` moved there, stayed
    routed around for it after the peer left (or drained: a rolling restart): requests waited
    out the queue for a 429 while it, now the only node of `m`, answered again (outside
    re-audits). Judged against peers, it is unjudged once none is left to serve."""
    fast, flaky = await new_upstream(nursery), await new_upstream(nursery)
    fast.script_for("t", lambda body: [("sleep", 0.05), *text_script(words(3))])
    hung = 0

    def flaky_script(body):
        nonlocal hung
        hung += 1
        return [("sleep", 30.0)] if hung <= 2 else text_script(words(3))

    flaky.script_for("t", flaky_script)
    edge = await start_edge(nursery, edge_config(stall_after_s=0.5, queue_timeout_ms=2000, routing="least_loaded"))
    peer = await start_node(nursery, edge, [model("m", fast, target="t", max_concurrency=1)], node_id="peer")
    statuses: list[int] = []
    with trio.fail_after(BOUND):
        async with http(edge) as client:

            async def ask() -> None:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                statuses.append((await client.post("/v1/chat/completions", json=body)).status_code)

            await ask()  # the peer's time to first event is known
            await start_node(nursery, edge, [model("m", flaky, target="t", max_concurrency=4)], node_id="flaky")
            async with trio.open_nursery() as clients:
                for _ in range(3):  # the peer takes one at a time: the flaky node gets some, and hangs
                    clients.start_soon(ask)
            assert edge.edge.runs.links["flaky"].stalled(trio.current_time(), "m")
            if gone == "left":
                peer.stop()
                await eventually(lambda: "peer" not in edge.edge.runs.links)
            else:
                await peer.agent.drain()
                await eventually(lambda: edge.edge.runs.links["peer"].draining)
            await ask()
    assert statuses == [200] * 5, statuses


@pytest.mark.parametrize("tools", [False, True])
async def test_a_collected_run_silent_on_a_stalled_node_runs_again_on_its_peer(nursery, tools):
    """A non-streamed run (or a tool call's, streamed or not: collected) whose node's model server
    stops mid-answer, while a peer is idle: its client had seen nothing of it, and it waited out
    `wait_timeout_s` for a 504 (an outside audit: 120 s by default, for every request of a coding
    agent). Once the node is judged stalled the run ends there (its model server sees the
    cancel) and runs again, once, on the peer: the client gets the peer's whole answer."""
    stuck, fast = await new_upstream(nursery), await new_upstream(nursery)
    stuck.script_for("t", [("chunk", {"content": "half an ans"}), ("hang",)])
    fast.script_for("t", lambda body: text_script(words(3)))
    edge = await start_edge(nursery, edge_config(stall_after_s=0.5, wait_timeout_s=60))
    first = await start_node(nursery, edge, [model("m", stuck, target="t")], node_id="stuck")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if tools:
        body |= {"stream": True, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            answer: list[httpx.Response] = []

            async def ask() -> None:
                answer.append(await client.post("/v1/chat/completions", json=body))

            clients.start_soon(ask)
            await stuck.wait_requests(1)
            peer = await start_node(nursery, edge, [model("m", fast, target="t")], node_id="peer")
        await eventually(lambda: stuck.records[0].aborted, "the stalled node's model server saw the cancel")
    (r,) = answer
    assert r.status_code == 200, r.text
    text = r.text if tools else r.json()["choices"][0]["message"]["content"]
    assert "tok0" in text and "half" not in text
    assert len(fast.records) == 1
    await settled(edge, first.agent, peer.agent)


async def _lost_and_busy(nursery, busy_script, **config):
    """An edge (least loaded) and two nodes of `m`, one slot each: "doomed", whose model server
    is silent, and "busy", whose answers ``busy_script`` makes. The upstreams, the edge and
    the doomed node."""
    lost, busy = await new_upstream(nursery), await new_upstream(nursery)
    lost.script_for("t", [("hang",)])
    busy.script_for("t", busy_script)
    edge = await start_edge(nursery, edge_config(routing="least_loaded", **config))
    doomed = await start_node(nursery, edge, [model("m", lost, target="t", max_concurrency=1)], node_id="doomed")
    await start_node(nursery, edge, [model("m", busy, target="t", max_concurrency=1)], node_id="busy")
    return lost, busy, edge, doomed


async def _one_on_each(client, clients, lost: Upstream, busy: Upstream) -> list[httpx.Response]:
    """Two requests, one on each node: the list their answers go to as they come."""
    answers: list[httpx.Response] = []

    async def ask() -> None:
        answers.append(await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}))

    clients.start_soon(ask)
    clients.start_soon(ask)
    await lost.wait_requests(1)
    await busy.wait_requests(1)
    return answers


async def test_a_run_moved_off_a_lost_node_waits_within_the_queue_timeout(nursery):
    """A run not yet started on a node that is lost moves; with every other node busy it waits
    for a slot. It waited out `wait_timeout_s` (120 s by default) and then told its client its
    run had timed out, though it never started (an outside chaos audit), where a request queued
    beside it got its answer within the queue's timeout. It waits as long as a queued request,
    and then its client is told its node was lost (a 502 the SDKs retry)."""
    busy_script = [("chunk", {"content": "working"}), ("hang",)]
    lost, busy, edge, doomed = await _lost_and_busy(nursery, busy_script, queue_timeout_ms=1500, wait_timeout_s=60)
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            answers = await _one_on_each(client, clients, lost, busy)
            doomed.stop()
            stopped = trio.current_time()
            await eventually(lambda: len(answers) == 1, "the moved run's answer")
            waited = trio.current_time() - stopped
            clients.cancel_scope.cancel()  # (the other is on the busy node for good)
    assert waited < 2 * 1.5, waited  # (its turn once: not queued again as a collected run lost)
    (r,) = answers
    assert r.status_code == 502 and r.json()["error"]["code"] == "node_disconnected", r.text
    assert "no other node had room" in r.json()["error"]["message"]


async def test_a_moved_run_s_silence_is_counted_from_where_it_was_sent_last(nursery):
    """A run silent on a node that is lost moves; it waits for a slot, then is sent to another
    node. Its silence was counted from its first sending: with `wait_timeout_s` 1, it was a 504
    "timed out" while it waited ahead of the queue (an outside re-check). The wait is bounded
    by the queue's timeout, and its silence counts from where it was sent last: it is answered."""

    def busy_script(body):  # a first answer that takes 2.1 s, its pieces 0.3 s apart; then quick ones
        if len(busy.records) > 1:
            return text_script(["moved ", "fine"])
        return [*[("chunk", {"content": "work"}), ("sleep", 0.3)] * 7, ("chunk", {}, "stop"), ("done",)]

    lost, busy, edge, doomed = await _lost_and_busy(nursery, busy_script, queue_timeout_ms=8000, wait_timeout_s=1.0)
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            answers = await _one_on_each(client, clients, lost, busy)
            await trio.sleep(0.6)  # (silent there, within wait_timeout_s)
            doomed.stop()
    texts = sorted(r.json()["choices"][0]["message"]["content"] for r in answers if r.status_code == 200)
    assert texts == ["moved fine", "work" * 7], [r.text for r in answers]
    assert len(busy.records) == 2 and lost.records[0].aborted
    await settled(edge)


async def test_a_moved_run_silent_where_it_was_sent_last_times_out_there(nursery):
    """The other side of the test above: a moved run that waited for a slot, then is silent on
    its new node, is a 504 `wait_timeout_s` after it was sent there. It was timed out only at
    its wait's deadline, `queue_timeout_ms` after the move (an outside re-check: 30 s, the
    silence limit 4 s), its timer still set for then."""

    def busy_script(body):  # a first answer that takes 2.1 s, its pieces 0.3 s apart; then silence
        if len(busy.records) > 1:
            return [("hang",)]
        return [*[("chunk", {"content": "work"}), ("sleep", 0.3)] * 7, ("chunk", {}, "stop"), ("done",)]

    lost, busy, edge, doomed = await _lost_and_busy(nursery, busy_script, queue_timeout_ms=15000, wait_timeout_s=1.0)
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            answers = await _one_on_each(client, clients, lost, busy)
            await trio.sleep(0.3)
            doomed.stop()
            await busy.wait_requests(2)
            sent_again = trio.current_time()
            await eventually(lambda: len(answers) == 2, "both answered")
            took = trio.current_time() - sent_again
    timed_out = [r for r in answers if r.status_code == 504]
    assert len(timed_out) == 1 and timed_out[0].json()["error"]["code"] == "run_timed_out", [r.text for r in answers]
    assert took < 5, took  # (1 s of silence there, give or take the machine: 13 s more before)
    await settled(edge)


class _Timed:
    """A run as the timers see it: due at ``due``; ``then`` runs when it fails."""

    def __init__(self, due: float, then=None, alive: bool = False) -> None:
        self.at, self.then, self.timer, self.failed = due, then, None, False
        self.held_error, self.requeued, self.move_until = None, None, math.inf
        self.alive = alive  # its events keep coming: due for a keep-alive, never timed out

    def due(self) -> float:
        return self.at

    def timed_out(self, now: float) -> bool:
        return self.at <= now and not self.alive

    def fail(self, *_) -> None:
        self.failed = True
        if self.then is not None:
            self.then()

    def idle_due(self, now: float) -> None:
        self.at = now + 500


async def test_timers_rescheduled_while_they_fire_keep_their_order(nursery, autojump_clock):
    """A run's timer rescheduled from inside another's timeout (a timed-out run frees its slot,
    and a moved run waiting for one is sent with its timer set again) could compact the heap
    the timer task was walking: that task went on with the old list, and runs due in 5 s had
    not timed out after 6 (a review). The heap is compacted in place."""
    timers = RunTimers()
    now = trio.current_time()
    idle = [_Timed(now + 1000 + i) for i in range(2000)]
    moved = _Timed(now + 2000)
    soon = [_Timed(now + 5 + i / 100) for i in range(5)]

    def dispatch_moved() -> None:
        moved.at = now + 300
        timers.reschedule(moved)

    first = _Timed(now + 0.1, dispatch_moved)
    alive = [_Timed(now + 0.1, alive=True) for _ in range(3)]  # (re-armed in the same pass)
    for run in (*idle, moved, *soon, first, *alive):
        timers.add(run)
    for run in idle[:1024]:
        timers.discard(run)  # (closed runs' entries, emptied: the next discard compacts)
    nursery.start_soon(timers.run)
    await trio.sleep(6)
    assert first.failed and all(run.failed for run in soon) and not moved.failed
    heap = timers._heap
    assert all(heap[(i - 1) // 2][:2] <= heap[i][:2] for i in range(1, len(heap)))


async def _three_warm_nodes(nursery, up: Upstream, **config):
    """An edge (stall_after_s 0.5) and three nodes of `m` on ``up``, each with a time to first
    event of milliseconds on short prompts."""
    edge = await start_edge(nursery, edge_config(stall_after_s=0.5, routing="least_loaded", **config))
    for name in ("a", "b", "c"):
        await start_node(nursery, edge, [model("m", up, target="t", max_concurrency=4)], node_id=name)
    async with http(edge) as client, trio.open_nursery() as clients:
        for i in range(6):  # (at once: least loaded sends two to each)
            body = {"model": "m", "messages": [{"role": "user", "content": f"warm {i}"}]}
            clients.start_soon(partial(client.post, "/v1/chat/completions", json=body))
    await eventually(lambda: all("m" in lk.ttft_of for lk in edge.edge.runs.links.values()), "each started one")
    return edge


async def test_a_long_prompt_is_given_its_prefill_before_its_node_is_judged(nursery):
    """A node was judged not to start runs when one waited 10 times the peers' typical time to
    first event, whatever its prompt: a 100,000-token prompt on an idle node was moved at 10 s
    and started over on another (an outside audit). The wait scales with how much longer than
    the peers' typical prompt it is: it starts where it was sent, once."""
    up = await new_upstream(nursery)
    long_prompt = "word " * 20_000
    up.script_for("t", lambda body: text_script(words(3), ttft=2.0 if len(str(body)) > 50_000 else 0.02))
    edge = await _three_warm_nodes(nursery, up)
    before = len(up.records)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": long_prompt}]}
            r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    long_runs = up.records[before:]
    assert len(long_runs) == 1 and not long_runs[0].aborted  # (it was started over: 2, the first aborted)
    now = trio.current_time()
    assert not any(lk.stalled(now, "m") for lk in edge.edge.runs.links.values())


async def test_a_run_moved_for_not_starting_is_no_evidence_against_its_next_node(nursery):
    """A request slow to start anywhere (a short one here: what the edge cannot tell from a
    stall) is moved off its node, as a stall; on the next node it was judged again, and two
    healthy nodes of three were routed around for one request (an outside audit). A run moved
    for not starting judges no other node: one is routed around, the request is answered."""
    up = await new_upstream(nursery)
    up.script_for("t", lambda body: text_script(words(3), ttft=2.0 if "slow" in str(body) else 0.02))
    edge = await _three_warm_nodes(nursery, up)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "slow"}]}
            r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    now = trio.current_time()
    assert sum(lk.stalled(now, "m") for lk in edge.edge.runs.links.values()) == 1


async def test_a_long_prompt_on_a_dead_node_does_not_shield_it(nursery):
    """A run's wait for its first event was scaled by the longest prompt waiting on its node,
    with no bound: one long prompt on a node whose model server took requests and never
    answered kept it from being judged, and the short requests beside it waited out
    `wait_timeout_s` while a peer stood idle (a re-check; a client could do it at will). Each
    run is judged by its own wait, at most half `wait_timeout_s`: the short ones move."""
    good, dead = await new_upstream(nursery), await new_upstream(nursery)
    good.script_for("t", lambda body: text_script(words(3), ttft=0.6 if "busy" in str(body) else 0.01))
    dead.script_for("t", [("hang",)])
    edge = await start_edge(nursery, edge_config(stall_after_s=0.5, wait_timeout_s=20, routing="least_loaded"))
    await start_node(nursery, edge, [model("m", good, target="t", max_concurrency=1)], node_id="good")
    statuses: dict[str, int] = {}
    with trio.fail_after(BOUND):
        async with http(edge) as client:

            async def ask(name: str, content: str) -> None:
                body = {"model": "m", "messages": [{"role": "user", "content": content}]}
                statuses[name] = (await client.post("/v1/chat/completions", json=body)).status_code

            for i in range(3):  # the good node's time to first event: milliseconds
                await ask(f"warm{i}", f"warm {i}")
            await start_node(nursery, edge, [model("m", dead, target="t", max_concurrency=4)], node_id="dead")
            async with trio.open_nursery() as clients:
                clients.start_soon(ask, "busy", "busy")  # the good node's one slot, for 0.6 s
                await good.wait_requests(4)
                clients.start_soon(ask, "long", "word " * 20_000)
                await dead.wait_requests(1)
                for i in range(2):
                    clients.start_soon(ask, f"short{i}", f"short {i}")
                await eventually(lambda: edge.edge.runs.links["dead"].stalled(trio.current_time(), "m"))
    assert statuses["short0"] == statuses["short1"] == 200, statuses
    assert all(rec.aborted for rec in dead.records), [rec.aborted for rec in dead.records]


async def test_a_short_prompt_on_a_dead_node_is_judged_by_its_own_length(nursery):
    """The peers' time to a first event came from their long prompts (prefills of seconds), and
    a short prompt on a dead node waited ten times that: past `wait_timeout_s`, it timed out
    where it was, a peer idle (a re-check). A run's wait is ten times the peers' time for a
    prompt of its length, at most half `wait_timeout_s`: it moves, and is answered."""
    good, dead = await new_upstream(nursery), await new_upstream(nursery)
    good.script_for(
        "t",
        lambda body: (
            text_script(words(3), ttft=0.6)
            if len(str(body)) > 10_000
            else text_script(words(5), interval=0.3 if "busy" in str(body) else 0.0)
        ),
    )
    dead.script_for("t", [("hang",)])
    edge = await start_edge(nursery, edge_config(stall_after_s=0.5, wait_timeout_s=4, routing="least_loaded"))
    await start_node(nursery, edge, [model("m", good, target="t", max_concurrency=1)], node_id="good")
    answers: list[httpx.Response] = []
    with trio.fail_after(BOUND):
        async with http(edge) as client:

            async def ask(content: str) -> None:
                body = {"model": "m", "messages": [{"role": "user", "content": content}]}
                answers.append(await client.post("/v1/chat/completions", json=body))

            for i in range(2):  # the good node's time to first event: 0.6 s, on long prompts
                await ask(f"{i} " + "word " * 5000)
            await start_node(nursery, edge, [model("m", dead, target="t", max_concurrency=4)], node_id="dead")
            async with trio.open_nursery() as clients:
                # The good node's one slot, for 1.5 s: a token each 0.3 s (each 0.5 s, stall_after_s,
                # it was judged stalled now and then on a loaded machine, moved to the dead node).
                clients.start_soon(ask, "busy")
                await good.wait_requests(3)
                clients.start_soon(ask, "hi")  # to the dead node: the good one is full
                await dead.wait_requests(1)
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert all(rec.aborted for rec in dead.records)
