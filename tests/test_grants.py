"""Capacity shared across edges: a node splits each model's max_concurrency between
the edges it links to as grants that follow their demand (node.grants, proto v2)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from collections import deque

import httpx
import pytest
import trio

from edge.config import EdgeConfig
from edge.link import _report_demand
from edge.runs import NodeLink, RunService, Want
from node.agent import NodeAgent
from node.grants import GrantBook
from proto import (
    PROTOCOL_VERSION,
    CancelRun,
    Demand,
    Grant,
    Hello,
    ModelInfo,
    RunRequest,
    Welcome,
    decode_frame,
    encode_frame,
)
from scripts.stack import free_port
from scripts.upstream import Upstream, text_script, words
from tests.conftest import (
    BOUND,
    TOKEN,
    edge_config,
    eventually,
    http,
    model,
    node_config,
    settled,
    start_edge,
    start_node,
    write_toml,
)
from tests.test_link import closed_by_edge, fake_node

MESSAGES = [{"role": "user", "content": "hi"}]


def grants_of(book: GrantBook) -> dict:
    return {edge: share.grant for edge, share in book.shares.items()}


def send(book: GrantBook) -> dict:
    """Rebalance; the grants each edge was sent."""
    return {edge: grant.slots for edge, grant in book.rebalance()}


# -- the accounting, sans I/O ------------------------------------------------------------


def test_one_edge_gets_the_whole_capacity():
    """A lone edge is granted all of max_concurrency, demand or not."""
    book = GrantBook("m", 4)
    book.add("a")
    assert send(book) == {"a": 4}
    book.report("a", 0, 0, 1)
    assert send(book) == {} and grants_of(book) == {"a": 4}


def test_idle_capacity_is_split_and_demand_moves_it_once_acknowledged():
    """Two idle edges split the capacity; when one waits, the other's idle grant moves to it,
    but only after the shrunk edge acknowledged the shrink (its runs may be on the wire)."""
    book = GrantBook("m", 4)
    book.add("a")
    send(book)
    book.add("b")
    assert send(book) == {"a": 2}  # a shrinks first; b gets nothing while a may still be using 4
    book.report("a", 0, 0, 2)  # a has applied grant 2
    assert send(book) == {"b": 2}
    book.report("b", 0, 0, 1)
    book.report("a", 2, 8, 2)  # a is busy and has 8 waiting
    assert send(book) == {"b": 0}
    assert grants_of(book)["a"] == 2 and book.held() == 4  # b's old grant still held
    book.report("b", 0, 0, 2)  # ack
    assert send(book) == {"a": 4}
    assert book.held() == 4


def test_an_idle_edge_keeps_its_even_share_while_the_others_run_within_theirs():
    """3 slots, 3 edges, one of them running a run: nobody waits, so nobody's grant moves. The
    spare slots went to the edges in link order on top of their demand: the running edge 2,
    the next 1, the edge linked last none, and until its share came back (after the other's
    run ended and its shrink was acknowledged, 16-120 ms) that edge saw the node full and sent
    a repeat of a prompt the node held elsewhere: an edge restarted (linked last everywhere)
    split every repeated first prompt off its peers' node (an outside audit). Spare capacity
    now evens the edges' grants out, each at least its demand."""
    book = GrantBook("m", 3)
    for edge in ("b", "c", "a"):
        book.add(edge)
    send(book)
    for edge in ("b", "c", "a"):
        book.report(edge, 0, 0, book.shares[edge].seq)
    send(book)
    assert grants_of(book) == {"b": 1, "c": 1, "a": 1}
    assert book.start("b")
    book.report("b", 1, 0, book.shares["b"].seq)
    assert send(book) == {}  # (within its share: nothing moves)
    book.report("b", 1, 2, book.shares["b"].seq)  # now it waits: the idle shares go to it
    assert send(book) == {"c": 0, "a": 0}
    book = GrantBook("m", 8)  # past the even level, a slot each to the edges at it, in link order
    for edge in ("b", "c", "a"):
        book.add(edge)
    send(book)
    for edge in ("b", "c", "a"):
        book.report(edge, 0, 0, book.shares[edge].seq)
    book.report("b", 5, 0, book.shares["b"].seq)
    send(book)
    for edge in ("b", "c", "a"):
        book.report(edge, *((5, 0) if edge == "b" else (0, 0)), book.shares[edge].seq)
    send(book)
    assert grants_of(book) == {"b": 5, "c": 2, "a": 1}


def test_grant_never_drops_below_running_runs():
    """An edge's grant never drops below the runs it has running on the node: it shrinks as they end."""
    book = GrantBook("m", 4)
    book.add("a")
    book.add("b")
    send(book)
    book.report("a", 0, 0, 1)
    send(book)
    book.report("b", 0, 0, 1)
    send(book)
    for _ in range(4):  # a waits; b acknowledges every grant it gets
        book.report("a", 0, 5, book.shares["a"].seq)
        book.report("b", 0, 0, book.shares["b"].seq)
        send(book)
    assert grants_of(book) == {"a": 4, "b": 0}
    for _ in range(4):
        assert book.start("a")
    assert not book.start("a")  # beyond the grant: refused
    book.report("a", 4, 10, book.shares["a"].seq)
    book.report("b", 0, 10, book.shares["b"].seq)  # b now waits too
    send(book)
    assert grants_of(book) == {"a": 4, "b": 0}
    book.end("a")
    send(book)
    book.report("a", 3, 10, book.shares["a"].seq)
    send(book)
    assert grants_of(book)["a"] == 3 and grants_of(book)["b"] == 1  # the freed slot went to the waiting edge
    assert book.shares["a"].grant >= book.shares["a"].active


def test_edges_with_equal_demand_get_equal_service_when_the_capacity_does_not_split_evenly():
    """Two edges, both always with runs waiting, and a third with none, on a 3-slot node (runs of 100 ms, frames
    delivered at once and in the node's order: a run's end frees its grant before the edge
    hears of it; 20 s on a virtual clock): each gets half the runs. The slot a fair
    split leaves over went to the older link for good, so the first edge ran 2:1 (every
    node it linked to first gave it the odd slot)."""
    now = [0.0]
    book = GrantBook("m", 3, clock=lambda: now[0])
    edges = {n: {"grant": 0, "seq": 0, "ends": []} for n in ("first", "second")}
    done = dict.fromkeys(edges, 0)
    for n in edges:
        book.add(n)
    book.add("idle")  # linked, no demand for the model (its turns fell to the next edge: 2 in 3)
    book.report("idle", 0, 0, 0)

    def exchange():
        for _ in range(10):  # until the grants settle
            grants = book.rebalance()
            if not grants:
                return
            for n, grant in grants:
                if n == "idle":
                    book.report(n, 0, 0, grant.seq)
                    continue
                edges[n]["grant"], edges[n]["seq"] = grant.slots, grant.seq
            for n, e in edges.items():
                book.report(n, len(e["ends"]), 100, e["seq"])

    for _ in range(2000):
        now[0] += 0.01
        for n, e in edges.items():
            for end in [end for end in e["ends"] if end <= now[0]]:
                e["ends"].remove(end)
                book.end(n)
                exchange()  # the node rebalances as the run ends; then the edge hears of the end
                done[n] += 1
            while len(e["ends"]) < e["grant"]:
                assert book.start(n)
                e["ends"].append(now[0] + 0.1)
            book.report(n, len(e["ends"]), 100, e["seq"])
        exchange()
        assert book.held() <= 3
    assert sum(done.values()) >= 0.9 * 20 * 3 / 0.1
    assert 0.45 <= done["first"] / sum(done.values()) <= 0.55, done


def test_a_silent_edges_idle_grant_goes_to_the_waiting_edge_without_its_ack():
    """An edge holding idle grant while another waits, that stops answering (a SIGSTOP), is
    lapsed: its grant drops to its running runs with no acknowledgement, the waiting edge gets
    the rest at once, and the silent edge gets nothing more (not even its even share of what
    no one asks for) until it is heard from; then its demand counts again."""
    book = GrantBook("m", 6)
    for edge in ("a", "b"):
        book.add(edge)
    send(book)
    book.report("a", 0, 0, book.shares["a"].seq)
    book.report("b", 0, 0, book.shares["b"].seq)
    send(book)
    assert grants_of(book) == {"a": 3, "b": 3}
    assert book.start("a")  # a runs one, holds 2 idle
    for _ in range(3):
        assert book.start("b")
    book.report("a", 1, 0, book.shares["a"].seq)
    book.report("b", 3, 5, book.shares["b"].seq)  # b waits
    assert book.contended("a") and not book.contended("b")
    assert send(book) == {"a": 1}  # a shrink: b grows once a acknowledges it, and a does not answer
    assert grants_of(book)["b"] == 3
    book.lapse("a")
    assert send(book) == {"b": 5}  # a keeps its running run's slot; b gets the rest now
    assert book.held() == 6 and not book.contended("a")
    book.end("a")
    book.report("b", 5, 3, book.shares["b"].seq)
    assert send(book) == {"a": 0, "b": 6}
    book.report("b", 6, 0, book.shares["b"].seq)
    assert send(book) == {}  # nothing to a lapsed edge, even what b does not ask for
    book.revive("a")
    book.report("a", 0, 2, book.shares["a"].seq)  # a wakes, acknowledges, has 2 waiting
    book.report("b", 6, 4, book.shares["b"].seq)
    grants = send(book)
    assert grants == {"b": 4}  # b shrinks first (a's demand is 2): a grows once b acknowledges
    assert book.held() <= 6


def test_random_traffic_never_exceeds_capacity_and_never_refuses_a_run():
    """Three edges obeying their grants, frames in flight both ways in order, random demand,
    runs ending and cancelled: the sum held never exceeds capacity, no run is refused, every
    request is served in the end, and each edge's grant is at least its running runs."""
    rng = random.Random(12)
    capacity = 5
    book = GrantBook("m", capacity)
    names = ["a", "b", "c"]
    edges = {n: {"grant": 0, "seq": 0, "in_flight": set(), "waiting": 0, "up": deque(), "down": deque()} for n in names}
    running: dict[str, set[int]] = {n: set() for n in names}
    cancelled_early: set[int] = set()
    next_id = [0]
    served = [0]
    asked = 0

    def node_rebalance():
        for edge, grant in book.rebalance():
            edges[edge]["down"].append(("grant", grant))

    def edge_dispatch(n):
        e = edges[n]
        while e["waiting"] and len(e["in_flight"]) < e["grant"]:
            e["waiting"] -= 1
            next_id[0] += 1
            e["in_flight"].add(next_id[0])
            e["up"].append(("run", next_id[0]))

    def edge_report(n):
        e = edges[n]
        e["up"].append(("demand", len(e["in_flight"]), e["waiting"], e["seq"]))

    for n in names:
        book.add(n)
    node_rebalance()
    for step in range(20_000):
        n = rng.choice(names)
        e = edges[n]
        action = rng.random()
        if step < 15_000 and action < 0.15:
            e["waiting"] += rng.randint(1, 3)
            asked += 1
            edge_report(n)
        elif action < 0.35 and e["down"]:  # a frame reaches the edge
            kind, value = e["down"].popleft()
            if kind == "grant" and value.seq > e["seq"]:
                e["grant"], e["seq"] = value.slots, value.seq
            elif kind == "end" and value in e["in_flight"]:
                e["in_flight"].discard(value)
                served[0] += 1
            edge_dispatch(n)
            edge_report(n)
        elif action < 0.6 and e["up"]:  # a frame reaches the node
            frame = e["up"].popleft()
            if frame[0] == "run":
                if frame[1] in cancelled_early:
                    cancelled_early.discard(frame[1])
                else:
                    assert book.start(n), "a run within the edge's grant was refused"
                    running[n].add(frame[1])
            elif frame[0] == "cancel":
                if frame[1] in running[n]:
                    running[n].discard(frame[1])
                    book.end(n)
                else:
                    cancelled_early.add(frame[1])
            else:
                book.report(n, frame[1], frame[2], frame[3])
            node_rebalance()
        elif action < 0.8 and running[n]:  # a run ends on the node
            run = rng.choice(sorted(running[n]))
            running[n].discard(run)
            book.end(n)
            e["down"].append(("end", run))
            node_rebalance()
        elif action < 0.83 and e["in_flight"]:  # the client left: the edge cancels
            run = rng.choice(sorted(e["in_flight"]))
            e["in_flight"].discard(run)
            served[0] += 1
            e["up"].append(("cancel", run))
            edge_dispatch(n)
            edge_report(n)
        assert book.held() <= capacity
        assert sum(len(r) for r in running.values()) <= capacity
        assert all(s.grant >= s.active for s in book.shares.values())
    # Let everything drain: runs end, frames arrive, until nothing is left.
    for _ in range(100_000):
        busy = False
        for n in names:
            e = edges[n]
            if running[n]:
                run = running[n].pop()
                book.end(n)
                e["down"].append(("end", run))
                node_rebalance()
                busy = True
            if e["up"]:
                frame = e["up"].popleft()
                if frame[0] == "run":
                    assert book.start(n)
                    running[n].add(frame[1])
                elif frame[0] == "demand":
                    book.report(n, frame[1], frame[2], frame[3])
                node_rebalance()
                busy = True
            if e["down"]:
                kind, value = e["down"].popleft()
                if kind == "grant" and value.seq > e["seq"]:
                    e["grant"], e["seq"] = value.slots, value.seq
                elif kind == "end" and value in e["in_flight"]:
                    e["in_flight"].discard(value)
                    served[0] += 1
                edge_dispatch(n)
                edge_report(n)
                busy = True
            assert book.held() <= capacity
        if not busy:
            break
    assert all(edges[n]["waiting"] == 0 and not edges[n]["in_flight"] for n in names), "a request was never served"


# -- end to end ------------------------------------------------------------------------


async def two_edges_one_node(nursery, upstream: Upstream, capacity: int = 4, **edge_kw):
    first = await start_edge(nursery, edge_config(**edge_kw))
    second = await start_edge(nursery, edge_config(**edge_kw))
    node = await start_node(nursery, [first, second], [model("m", upstream, target="t", max_concurrency=capacity)])
    return first, second, node


def grant(edge) -> int:
    link = edge.edge.runs.links.get("n1")
    return link.grants["m"] if link is not None else -1


async def test_two_edges_share_one_nodes_capacity_and_queue_at_the_edges(nursery, upstream):
    """20 concurrent streams over two edges to one node of max_concurrency 4: the upstream
    never sees more than 4 at once, no run ever waits inside the node (its slot semaphore is
    never contended), requests queue at the edges, and every one is answered."""
    upstream.script_for("t", lambda body: text_script(words(8), interval=0.02))
    first, second, node = await two_edges_one_node(nursery, upstream, max_queue=100)
    depth = [0, 0]
    statuses: list[int] = []
    with trio.fail_after(BOUND):
        async with (
            http(first, limits=httpx.Limits(max_connections=30)) as c1,
            http(second, limits=httpx.Limits(max_connections=30)) as c2,
            trio.open_nursery() as watch,
        ):

            async def sample():
                while True:
                    depth[0] = max(depth[0], first.edge.runs.queue_depth("m"))
                    depth[1] = max(depth[1], second.edge.runs.queue_depth("m"))
                    assert grant(first) + grant(second) <= 4
                    await trio.sleep(0.002)

            watch.start_soon(sample)

            async def one(client):
                r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True})
                statuses.append(r.status_code)
                assert r.content.endswith(b"data: [DONE]\n\n") and b"tok7" in r.content

            async with trio.open_nursery() as clients:
                for i in range(20):
                    clients.start_soon(one, c1 if i % 2 else c2)
            watch.cancel_scope.cancel()
    assert statuses == [200] * 20
    assert upstream.max_active == 4  # used to the full, never beyond
    assert node.agent.slot_waits == 0
    assert depth[0] > 0 and depth[1] > 0  # the waiting happened at the edges
    assert len(upstream.records) == 20
    await settled(first, node.agent)
    await settled(second, node.agent)


async def test_a_full_edge_queue_is_429_while_the_node_stays_within_capacity(nursery, upstream):
    """With max_queue 2 on each edge, 20 concurrent requests over two edges: those beyond grants
    and queues are 429 queue_full, the rest complete, and the node never queues a run."""
    upstream.script_for("t", lambda body: text_script(words(8), interval=0.03))
    first, second, node = await two_edges_one_node(nursery, upstream, max_queue=2)
    results: list[httpx.Response] = []
    with trio.fail_after(BOUND):
        async with (
            http(first, limits=httpx.Limits(max_connections=30)) as c1,
            http(second, limits=httpx.Limits(max_connections=30)) as c2,
            trio.open_nursery() as clients,
        ):

            async def one(client):
                r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True})
                results.append(r)

            for i in range(20):
                clients.start_soon(one, c1 if i % 2 else c2)
    codes = sorted(r.status_code for r in results)
    assert len(codes) == 20 and set(codes) == {200, 429}, codes
    assert all(r.json()["error"]["code"] == "queue_full" for r in results if r.status_code == 429)
    assert codes.count(200) <= 4 + 2 * 2 + 4  # grants, both queues, and what the grants' moves let through
    assert upstream.max_active <= 4 and node.agent.slot_waits == 0
    await settled(first, node.agent)
    await settled(second, node.agent)


async def test_a_burst_at_one_edge_waits_for_the_grant_another_edge_leaves_idle(nursery, upstream):
    """Two edges, one node of 4 slots, max_queue 0: idle, each edge holds 2. A burst of 4 at one
    edge was 2 answers and 2 429 queue_full while the other edge's 2 slots sat idle (an outside
    audit). Slots granted to other edges count toward the queue's bound, so the burst waits the
    few ms the idle grant takes to move, and all 4 are answered; a fifth, past what the fleet
    has, is still refused at once."""
    upstream.script_for("t", lambda body: text_script(words(4), interval=0.05))
    first, second, node = await two_edges_one_node(nursery, upstream, max_queue=0)
    await eventually(lambda: grant(first) == grant(second) == 2)
    results: list[httpx.Response] = []
    with trio.fail_after(BOUND):
        async with http(first, limits=httpx.Limits(max_connections=10)) as client, trio.open_nursery() as clients:

            async def one():
                results.append(await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}))

            for _ in range(4):
                clients.start_soon(one)
            await upstream.wait_requests(4)
            await one()  # (all 4 slots busy here: nothing left to wait for)
    codes = [r.status_code for r in results]
    assert sorted(codes) == [200, 200, 200, 200, 429], [r.text for r in results]
    assert codes[0] == 429 and results[0].json()["error"]["code"] == "queue_full"
    assert upstream.max_active == 4 and node.agent.slot_waits == 0
    await settled(first, node.agent)
    await settled(second, node.agent)


async def test_a_node_grants_no_edge_for_requests_it_cannot_run(nursery, upstream):
    """Two edges, a small node (4 slots, a context window of 2,000) and a large one (2 slots,
    100,000). Long prompts queued at one edge, which only the large node can run, counted in
    the demand it reported to the small node: the small node granted that edge 2 of its 4
    slots, idle, while the other edge's short requests queued (an outside audit: 16 requests
    took 12.3 s against 6.2 s). The demand counts what the node may run: all 4 go to the
    edge whose requests fit."""
    upstream.script_for("t", [("hang",)])
    upstream.script_for("big", [("hang",)])
    first = await start_edge(nursery, edge_config(max_queue=100))
    second = await start_edge(nursery, edge_config(max_queue=100))
    small = model("m", upstream, target="t", max_concurrency=4, context_window=2000)
    await start_node(nursery, [first, second], [small])
    large = model("m", upstream, target="big", max_concurrency=2, context_window=100_000)
    await start_node(nursery, [first, second], [large], node_id="n2")
    await eventually(lambda: "n2" in first.edge.runs.links and "n2" in second.edge.runs.links)
    long_prompt = [{"role": "user", "content": "word " * 5000}]  # (about 6,000 tokens: the large node only)
    with trio.fail_after(BOUND):
        async with (
            http(first, limits=httpx.Limits(max_connections=10)) as c1,
            http(second, limits=httpx.Limits(max_connections=10)) as c2,
            trio.open_nursery() as clients,
        ):
            for _ in range(4):
                clients.start_soon(
                    lambda: c1.post("/v1/chat/completions", json={"model": "m", "messages": long_prompt})
                )
            await eventually(lambda: first.edge.runs.queue_depth("m") == 2 and upstream.active == 2)
            for _ in range(4):
                clients.start_soon(lambda: c2.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}))
            await eventually(lambda: upstream.active == 6)  # (before: 4, the small node's grant split 2 and 2)
            assert grant(second) == 4 and grant(first) == 0
            assert first.edge.runs.queue_depth("m") == 2
            clients.cancel_scope.cancel()


async def test_a_single_edge_keeps_the_full_capacity(nursery, upstream):
    """One edge and one node: the edge's grant is the node's whole max_concurrency, used at once."""
    upstream.script_for("t", [("hang",)])
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("m", upstream, target="t", max_concurrency=4)])
    await eventually(lambda: grant(edge) == 4)
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            for _ in range(4):
                clients.start_soon(
                    lambda: client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
                )
            await upstream.wait_requests(4)
            assert edge.edge.runs.queue_depth("m") == 0
            clients.cancel_scope.cancel()
    assert node.agent.slot_waits == 0
    await settled(edge, node.agent)


async def test_demand_moves_grant_between_edges_within_100_ms(nursery, upstream):
    """Idle, two edges split the node's capacity; a burst on one edge takes the other's idle
    grant: the burst runs 4 at once within 100 ms of the demand change (held to 100 ms on the
    virtual clock below; here, on a real and maybe loaded machine, where four requests through
    the edge, the node and the model server take tens of ms themselves, to a looser bound)."""
    upstream.script_for("t", [("hang",)])
    first, second, node = await two_edges_one_node(nursery, upstream)
    await eventually(lambda: grant(first) == 2 and grant(second) == 2)
    with trio.fail_after(BOUND):
        async with http(first) as client, trio.open_nursery() as clients:
            # From the burst, not from seeing it queued: the rebalance can finish before a poll sees the queue.
            burst_at = trio.current_time()
            for _ in range(4):
                clients.start_soon(
                    lambda: client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
                )
            await eventually(lambda: upstream.active == 4)
            settled_in = trio.current_time() - burst_at
            assert grant(first) == 4 and grant(second) == 0
            clients.cancel_scope.cancel()
    print(f"rebalanced in {settled_in * 1000:.1f} ms")
    assert settled_in < 0.5  # measured 25-90 ms on a loaded 2-core machine
    assert node.agent.slot_waits == 0
    await eventually(lambda: grant(first) == 2 and grant(second) == 2)  # idle again: split again


async def test_a_stopped_edges_idle_grant_goes_to_the_edge_that_waits(nursery, upstream, tmp_path):
    """Two edges (one an `iop edge` process), one node of 4 slots: idle, each holds 2. The
    process is stopped (SIGSTOP, as a VM pause), and 4 requests come to the other edge: they
    run 4 at once within a few seconds (the node pings the silent edge, then takes back its
    idle grant), not after the 15 s it takes to judge the link dead (a 6-slot node ran 3 for
    9 s while another edge queued: outside audits). The upstream never runs more than 4, and
    the stopped edge, continued, is linked still and given grant again."""
    upstream.script_for("t", [("hang",)])
    port = free_port()
    cfg = write_toml(tmp_path / "edge.toml", {"bind": f"127.0.0.1:{port}", "node_token": TOKEN})
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "iop.cli", "edge", "--config", cfg], stderr=subprocess.DEVNULL
    )
    stopped = False
    try:
        second = await start_edge(nursery)
        urls = [f"ws://127.0.0.1:{port}/v1/node/link", second.link_url]
        agent = NodeAgent(node_config(urls, [model("m", upstream, target="t", max_concurrency=4)]))
        node_scope = trio.CancelScope()

        async def run_node(task_status=trio.TASK_STATUS_IGNORED):
            with node_scope:
                await agent.serve(task_status=task_status)

        await nursery.start(run_node)
        book = agent.grants["m"]

        def grants() -> list[int]:
            return sorted(share.grant for share in book.shares.values())

        with trio.fail_after(BOUND * 2):
            await eventually(lambda: len(book.shares) == 2 and grants() == [2, 2], "both edges linked, 2 each")
            os.kill(proc.pid, signal.SIGSTOP)
            stopped = True
            async with http(second) as client, trio.open_nursery() as clients:
                asked = trio.current_time()
                for _ in range(4):
                    clients.start_soon(
                        lambda: client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
                    )
                await eventually(lambda: upstream.active == 4, "all four run")
                took = trio.current_time() - asked
                os.kill(proc.pid, signal.SIGCONT)
                stopped = False
                clients.cancel_scope.cancel()
            await eventually(lambda: not any(share.lapsed for share in book.shares.values()), "heard from again")
            await eventually(lambda: grants() == [2, 2], "idle again: split again")
        print(f"the stopped edge's grant moved in {took:.2f} s")
        assert took < 8, took  # (2.0-3.0 s: GRANT_SILENCE_S and a probe; 15 s and more before)
        assert upstream.max_active == 4
        assert len(agent.links) == 2  # (the stopped edge's link was never judged dead)
        node_scope.cancel()
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        with trio.CancelScope(shield=True), trio.move_on_after(BOUND):
            await proc.wait()


async def test_protocol_1_node_is_refused_with_a_reason(edge):
    """A node speaking protocol 1 (no grants) is closed with 4002 and says which versions differ."""

    async def old(ws):
        info = ModelInfo(name="m", adapter="sim", target="t", max_concurrency=2)
        await ws.send_message(encode_frame(Hello(node_id="old", protocol=1, models=[info])))
        return await closed_by_edge(ws)

    with trio.fail_after(BOUND):
        closed = await fake_node(edge, old)
    assert closed.reason.code == 4002
    assert closed.reason.reason == f"protocol version mismatch: edge speaks {PROTOCOL_VERSION}, node speaks 1"


async def test_fake_node_gets_no_run_before_its_first_grant(nursery):
    """The edge sends a node nothing beyond its grant: before the first grant a request waits."""
    edge = await start_edge(nursery, edge_config(queue_timeout_ms=300))

    async def ungranted(ws):
        info = ModelInfo(name="m", adapter="sim", target="t", max_concurrency=2)
        await ws.send_message(encode_frame(Hello(node_id="g", protocol=PROTOCOL_VERSION, models=[info])))
        assert isinstance(decode_frame(await ws.get_message()), Welcome)
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
        await ws.send_message(encode_frame(Grant(model="m", slots=2, seq=1)))
        await eventually(lambda: edge.edge.runs.links["g"].free_slots("m") == 2)
        return r

    with trio.fail_after(BOUND):
        r = await fake_node(edge, ungranted, node_id="g")
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"


# -- the real edge side (RunService, NodeLink, the demand reporter) on a virtual clock ------

LATENCY_S = 0.002  # one way, each link


class Wire:
    """One edge's RunService and NodeLink wired to a GrantBook (the node's side) through
    ordered frames delayed by LATENCY_S each way. Runs hold their node slot ``hold`` seconds."""

    def __init__(self, book: GrantBook, name: str, wires: dict, running: dict) -> None:
        self.name = name
        self.book = book
        self.service = RunService(EdgeConfig(max_queue=1000, queue_timeout_ms=600_000))
        self.link = NodeLink("n", [ModelInfo(name="m", adapter="sim", target="t", max_concurrency=book.capacity)], {})
        self.service.add_link(self.link)
        self.wires = wires
        self.running = running  # the node's runs, all edges: run id -> edge name
        self.ends: dict[str, trio.Event] = {}
        self.hold: dict[str, float] = {}
        self.up_send, self.up_recv = trio.open_memory_channel(1000)
        self.down_send, self.down_recv = trio.open_memory_channel(1000)
        book.add(name)

    def node_rebalance(self) -> None:
        for edge, grant in self.book.rebalance():
            self.wires[edge].down_send.send_nowait((trio.current_time() + LATENCY_S, grant))

    async def serve(self, nursery) -> None:
        nursery.start_soon(_report_demand, self.link, self.service)
        nursery.start_soon(self._edge_to_wire)
        nursery.start_soon(self._wire_to_node, nursery)
        nursery.start_soon(self._wire_to_edge)

    async def _edge_to_wire(self) -> None:
        while True:
            frame = await self.link.next_frame()
            await self.up_send.send((trio.current_time() + LATENCY_S, frame))

    async def _wire_to_node(self, nursery) -> None:
        async for due, frame in self.up_recv:
            await trio.sleep_until(due)
            if isinstance(frame, Demand):
                self.book.report(self.name, frame.in_flight, frame.waiting, frame.seq)
            elif isinstance(frame, RunRequest):
                assert self.book.start(self.name), "a run within the edge's grant was refused"
                self.running[frame.run_id] = self.name
                assert len(self.running) <= self.book.capacity
                nursery.start_soon(self._run_on_node, frame.run_id)
            self.node_rebalance()

    async def _run_on_node(self, run_id: str) -> None:
        await trio.sleep(self.hold.pop(run_id))
        del self.running[run_id]
        self.book.end(self.name)
        self.node_rebalance()
        self.down_send.send_nowait((trio.current_time() + LATENCY_S, run_id))

    async def _wire_to_edge(self) -> None:
        async for due, item in self.down_recv:
            await trio.sleep_until(due)
            if isinstance(item, Grant):
                self.service.set_grant(self.link, item.model, item.slots, item.seq)
            else:
                self.ends.pop(item).set()

    async def request(self, run_id: str, hold: float) -> None:
        slot = await self.service.acquire(Want("m"))
        self.ends[run_id], self.hold[run_id] = trio.Event(), hold
        self.link.send_nowait(RunRequest(run_id=run_id, model="m", target="t", request={}, timeout_s=60))
        await self.ends[run_id].wait()
        self.service.release(slot)


async def wired(nursery, capacity: int, names: list[str]) -> tuple[GrantBook, dict[str, Wire]]:
    book = GrantBook("m", capacity)
    wires: dict[str, Wire] = {}
    running: dict[str, str] = {}
    for name in names:
        wires[name] = Wire(book, name, wires, running)
        wires[name].node_rebalance()
    for wire in wires.values():
        await wire.serve(nursery)
    return book, wires


async def test_virtual_clock_one_edge_holds_everything(nursery, autojump_clock):
    """On a virtual clock, through the edge's real reporter: a lone edge is granted the whole
    capacity and runs that many at once."""
    book, wires = await wired(nursery, 4, ["a"])
    await trio.sleep(0.05)
    assert wires["a"].link.grants["m"] == 4
    async with trio.open_nursery() as clients:
        for i in range(4):
            clients.start_soon(wires["a"].request, f"r{i}", 1.0)
        await trio.sleep(0.01)  # one round trip is all it takes
        assert book.shares["a"].active == 4
        assert wires["a"].service.queue_depth("m") == 0


async def test_virtual_clock_demand_moves_grant_within_100_ms(nursery, autojump_clock):
    """On a virtual clock with 2 ms links: two idle edges hold 2 + 2; a burst on one takes the
    other's idle grant and runs 4 at once well within 100 ms; when it has gone, it is split again."""
    book, wires = await wired(nursery, 4, ["a", "b"])
    await trio.sleep(0.1)
    assert (wires["a"].link.grants["m"], wires["b"].link.grants["m"]) == (2, 2)
    async with trio.open_nursery() as clients:
        start = trio.current_time()
        for i in range(6):
            clients.start_soon(wires["a"].request, f"r{i}", 1.0)
        while book.shares["a"].active < 4:
            await trio.sleep(0.001)
        moved_in = trio.current_time() - start
        print(f"virtual clock: rebalanced in {moved_in * 1000:.1f} ms")
        assert moved_in < 0.1, moved_in
        assert book.held() <= 4
    await trio.sleep(0.1)
    assert (wires["a"].link.grants["m"], wires["b"].link.grants["m"]) == (2, 2)


async def test_virtual_clock_random_load_stays_within_capacity(nursery, autojump_clock):
    """On a virtual clock, three edges with random bursts of runs of random length: the node never
    holds more than capacity (grants plus unacknowledged ones), never refuses a run, every grant
    covers its running runs, and every request is served."""
    rng = random.Random(7)
    book, wires = await wired(nursery, 5, ["a", "b", "c"])
    served = [0]

    async def watch():
        while True:
            assert book.held() <= 5
            assert all(s.grant >= s.active for s in book.shares.values())
            await trio.sleep(0.001)

    async def one(wire, run_id, hold):
        await wire.request(run_id, hold)
        served[0] += 1

    async with trio.open_nursery() as watcher:
        watcher.start_soon(watch)
        async with trio.open_nursery() as clients:
            for i in range(300):
                wire = wires[rng.choice("abc")]
                clients.start_soon(one, wire, f"r{i}", rng.uniform(0.001, 0.2))
                await trio.sleep(rng.expovariate(100))
        watcher.cancel_scope.cancel()
    assert served[0] == 300


async def test_a_run_still_closing_its_upstream_does_not_cost_the_next_run(nursery, upstream):
    """After a run's last event its adapter may still be closing the upstream response: the next run
    the edge sends on that slot is served (the grant is given back with the last event), never refused."""
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("m", upstream, max_concurrency=1)])
    upstream.script_for("m-target", [("chunk", {"content": "hi"}), ("chunk", {}, "stop"), ("done",), ("sleep", 0.3)])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for _ in range(4):
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == "hi"
    assert node.agent.beyond_grant == 0


async def test_a_run_queued_behind_a_cancelled_one_is_not_counted_as_a_slot_wait(nursery, upstream):
    """A client leaving frees its slot on the edge at once, and the next queued run goes to the
    node while the cancelled one still unwinds there (its upstream request closing): that short
    wait is expected. The node counted and logged it as a grant violation ("run waits for a
    slot on the node": 25 warnings in a 12-minute outside soak with clients leaving at capacity)."""
    upstream.script_for("t", [("chunk", {"content": "a"}), ("hang",)])
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("m", upstream, target="t", max_concurrency=1)])
    await eventually(lambda: grant(edge) == 1)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for round_ in range(12):
                async with trio.open_nursery() as clients:

                    async def leaving():
                        async with client.stream(
                            "POST", "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True}
                        ) as r:
                            seen = b""
                            with trio.CancelScope() as reading:
                                async for data in r.aiter_raw():
                                    seen += data
                                    if b'"a"' in seen:  # the client leaves mid-stream; the queued one goes on
                                        reading.cancel()

                    clients.start_soon(leaving)
                    await upstream.wait_requests(2 * round_ + 1)
                    clients.start_soon(
                        lambda: client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
                    )
                    await upstream.wait_requests(2 * round_ + 2)
                    clients.cancel_scope.cancel()
    assert upstream.max_active <= 1 and node.agent.slot_waits == 0
    await settled(edge, node.agent)


def _said(body: dict) -> str:
    return body["messages"][0]["content"]


@pytest.mark.parametrize("ends", ["client leaves", "wait timeout"])
async def test_a_slot_the_edge_cancels_goes_by_the_nodes_grants_not_to_its_own_queue(nursery, upstream, ends):
    """Two edges, one node of 2 slots. One edge has 16 requests for it, each run cancelled
    0.3 s in (its client leaves, or the edge's wait_timeout_s cuts it); then the other edge gets 2. A run the edge cancels freed its slot
    at the edge at once, and its own queue sent the next run before the node's grants moved:
    the node, still holding the larger grant as unacknowledged, ran it, and the other edge's
    fair share never came while the first edge's queue lasted (18.1 s against 4.7 s when the
    runs ended by themselves: an outside re-check). The slot of a cancelled run now goes
    back when the node answers the cancel, with its grant as it stands after it."""

    def script(body):
        if _said(body).startswith("b"):
            return text_script(words(3))
        return [("chunk", {"content": "a"}), ("hang",)]

    upstream.script_for("t", script)
    timeout = {"wait_timeout_s": 0.3} if ends == "wait timeout" else {}
    first, second, node = await two_edges_one_node(nursery, upstream, capacity=2, max_queue=100, **timeout)
    await eventually(lambda: grant(first) == grant(second) == 1)
    a_seen = []  # how many of the first edge's requests had reached the model server as each of the other's did
    with trio.fail_after(BOUND * 2):
        async with (
            http(first, limits=httpx.Limits(max_connections=20)) as c1,
            http(second) as c2,
            trio.open_nursery() as clients,
        ):

            async def leaving(i):
                body = {"model": "m", "messages": [{"role": "user", "content": f"a{i}"}], "stream": True}
                async with c1.stream("POST", "/v1/chat/completions", json=body) as r:
                    seen = b""
                    async for data in r.aiter_raw():
                        seen += data
                        if b'"a"' in seen and not timeout:  # its run has started: 0.3 s later, its client leaves
                            await trio.sleep(0.3)
                            return
                assert b"timed out" in seen or not timeout, seen

            async def other(i):
                body = {"model": "m", "messages": [{"role": "user", "content": f"b{i}"}]}
                r = await c2.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                a_seen.append(sum(1 for rec in upstream.records if _said(rec.body).startswith("a")))

            for i in range(16):
                clients.start_soon(leaving, i)
            await eventually(lambda: first.edge.runs.queue_depth("m") >= 12 and upstream.active == 2)
            for i in range(2):
                clients.start_soon(other, i)
    print(f"the other edge's 2 requests were served after {a_seen} of the first edge's 16 reached the model server")
    assert len(a_seen) == 2
    # The first edge's first two runs are cancelled 0.3 s in: by the grants' fair split, the
    # other edge's requests run on one of their slots (2-3 of the first edge's had reached the
    # model server by then), not after the first edge's queue (5-16 before).
    assert max(a_seen) <= 4, a_seen
    assert upstream.max_active <= 2 and node.agent.slot_waits == 0
    await settled(first, node.agent)
    await settled(second, node.agent)


async def test_a_cancelled_runs_slot_waits_for_the_nodes_answer_and_only_for_it(nursery):
    """A node whose hello says it answers cancels: the slot of a run its client left stays
    taken at the edge until the node's grant names the run in ``freed`` (then the queued
    request goes at once). A ``freed`` naming runs the edge did not cancel frees nothing."""
    edge = await start_edge(nursery)

    async def answering(ws):
        info = ModelInfo(name="m", adapter="sim", target="t", max_concurrency=1)
        await ws.send_message(
            encode_frame(Hello(node_id="a", protocol=PROTOCOL_VERSION, models=[info], answers_cancels=True))
        )
        assert isinstance(decode_frame(await ws.get_message()), Welcome)
        await ws.send_message(encode_frame(Grant(model="m", slots=1, seq=1)))

        async def next_of(kind):
            while not isinstance(frame := decode_frame(await ws.get_message()), kind):
                pass
            return frame

        async with http(edge) as client, trio.open_nursery() as clients:
            leaving = trio.CancelScope()

            async def first():
                with leaving:
                    await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})

            clients.start_soon(first)
            run = await next_of(RunRequest)
            clients.start_soon(lambda: client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}))
            await eventually(lambda: edge.edge.runs.queue_depth("m") == 1)
            leaving.cancel()
            cancel = await next_of(CancelRun)
            assert (cancel.run_id, cancel.model) == (run.run_id, "m")
            await ws.send_message(encode_frame(Grant(model="m", slots=1, seq=1, freed=["not-a-run", "x" * 200])))
            with trio.move_on_after(0.3) as waited:
                await next_of(RunRequest)
            assert waited.cancelled_caught  # (still taken: no run was sent)
            assert edge.edge.runs.queue_depth("m") == 1
            answered = trio.current_time()
            await ws.send_message(encode_frame(Grant(model="m", slots=1, seq=1, freed=[run.run_id])))
            second = await next_of(RunRequest)
            took = trio.current_time() - answered
            assert second.run_id != run.run_id
            # A freed that names the running run frees nothing either: a third request waits.
            await ws.send_message(encode_frame(Grant(model="m", slots=1, seq=1, freed=[second.run_id])))
            clients.start_soon(lambda: client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}))
            await eventually(lambda: edge.edge.runs.queue_depth("m") == 1)
            assert edge.edge.runs.links["a"].in_flight["m"] == 1
            clients.cancel_scope.cancel()
        return took

    with trio.fail_after(BOUND):
        took = await fake_node(edge, answering, node_id="a")
    print(f"the queued request went {took * 1000:.1f} ms after the node's answer")


async def test_edges_send_a_repeated_prompt_to_one_node_while_grants_split_it(nursery):
    """Two edges, two nodes of 2 slots. The same one-message prompt, sent in turn through
    each edge, one at a time: every time it goes to the node that holds it. A run in flight
    on a node moved the idle edge's grant there to 0 (spare slots went in link order), so the
    next edge saw that node full and sent the prompt to the other one, each edge keeping to
    its own from then on (an outside audit: 6 of 6 repeats split)."""
    ups = []
    for _ in range(2):
        up = Upstream()
        await nursery.start(up.serve)
        up.script_for("t", lambda body: text_script(words(2), interval=0.01))
        ups.append(up)
    first, second = await start_edge(nursery), await start_edge(nursery)
    for i, up in enumerate(ups):
        await start_node(nursery, [first, second], [model("m", up, target="t", max_concurrency=2)], node_id=f"n{i}")
    for edge in (first, second):
        await eventually(lambda edge=edge: all(lk.grants["m"] == 1 for lk in edge.edge.runs.links.values()))
    with trio.fail_after(BOUND * 2):
        async with http(first) as c1, http(second) as c2:
            for p in range(3):
                body = {"model": "m", "messages": [{"role": "user", "content": f"prompt {p}: " + "say it " * 20}]}
                for client in (c1, c2, c1, c2):
                    r = await client.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    await trio.sleep(0.005)  # (as a client's next request: within the grants' round trips)
    where = [
        [
            i
            for i, up in enumerate(ups)
            for rec in up.records
            if rec.body["messages"][0]["content"].startswith(f"prompt {p}:")
        ]
        for p in range(3)
    ]
    assert all(len(set(nodes)) == 1 and len(nodes) == 4 for nodes in where), where
