"""Many edges: one PostgreSQL ledger and key store, key limits shared through Redis (real servers)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import trio

from edge import admin as admin_module
from edge import ledger as ledger_module
from edge import shared_state
from edge.config import KeyConfig
from node.agent import NodeAgent
from scripts.stack import free_port, write_toml
from tests.conftest import (
    BOUND,
    LOAD_BOUND,
    TOKEN,
    edge_config,
    eventually,
    http,
    model,
    node_config,
    start_edge,
    start_node,
)
from tests.servers import postgres, postgres_url, redis_server  # noqa: F401  (fixtures)
from tests.test_keys import ADMIN, ADMIN_H, MESSAGES, chat, client, sim


async def pg_edge(nursery, url: str):
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=url))
    await start_node(nursery, edge, [sim("qwen-a")], node_id=f"n-{edge.url[-5:]}")
    return edge


def admin(edge) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=edge.url, timeout=BOUND, headers=ADMIN_H)


async def test_two_edges_share_keys_and_one_ledger(nursery, postgres_url):  # noqa: F811
    a = await pg_edge(nursery, postgres_url)
    b = await pg_edge(nursery, postgres_url)
    with trio.fail_after(BOUND):
        async with admin(a) as admin_a:
            secret = (await admin_a.post("/v1/admin/keys", json={"id": "shared", "rpm": 1000})).json()["key"]
        await eventually(lambda: "shared" in b.edge.keys.by_id, "edge b learns the key")
        told = 0
        for edge in (a, b, a, b):
            async with client(edge, secret) as c:
                r = await chat(c)
                assert r.status_code == 200
                told += r.json()["usage"]["total_tokens"]
        async with admin(b) as admin_b:
            rows = (await admin_b.get("/v1/admin/usage", params={"group_by": "key,node"})).json()["data"]
            await a.edge.ledger.flush()
            rows = (await admin_b.get("/v1/admin/usage", params={"group_by": "key,node"})).json()["data"]
            assert sum(r["requests"] for r in rows if r["key"] == "shared") == 4
            assert sum(r["total_tokens"] for r in rows if r["key"] == "shared") == told
            assert len({r["node"] for r in rows if r["key"] == "shared"}) == 2  # both edges' nodes
            changed = await admin_b.patch("/v1/admin/keys/shared", json={"rpm": 999})  # (its usage read by key)
            assert changed.status_code == 200 and changed.json()["usage"]["requests"] == 4, changed.text
            assert (await admin_b.delete("/v1/admin/keys/shared")).status_code == 200
        await eventually(lambda: "shared" not in a.edge.keys.by_id, "edge a learns the revocation")
        async with client(a, secret) as c:
            assert (await chat(c)).status_code == 401


def test_edges_starting_together_on_an_empty_database_all_make_the_ledger(postgres_url):  # noqa: F811
    """Six edges' ledgers connecting at once to an empty PostgreSQL database: each makes (or finds)
    the schema; none fails (CREATE ... IF NOT EXISTS at once was a UniqueViolation for most of
    them, found from outside: the ledger was down until its retry)."""
    import threading

    from edge.ledger import connect

    failed: list[str] = []
    start = threading.Barrier(6)

    def one() -> None:
        start.wait()
        try:
            connect(postgres_url).close()
        except Exception as e:
            failed.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    assert failed == []


async def test_postgres_down_loses_no_record_and_fails_no_request(nursery, postgres, postgres_url):  # noqa: F811
    edge = await pg_edge(nursery, postgres_url)
    with trio.fail_after(BOUND * 2):
        async with admin(edge) as adm:
            secret = (await adm.post("/v1/admin/keys", json={"id": "k"})).json()["key"]
        async with client(edge, secret) as c:
            for _ in range(5):
                assert (await chat(c)).status_code == 200
            await edge.edge.ledger.flush()
            await trio.to_thread.run_sync(postgres.stop)
            for _ in range(20):  # the database is gone: requests go on, records wait
                assert (await chat(c)).status_code == 200
            # a request's record is queued as its handler ends, just after the client has the reply
            await eventually(lambda: edge.edge.ledger.pending == 20, "the 20 records queued")
            assert not await edge.edge.ledger.flush()
            assert edge.edge.ledger.pending == 20 and not edge.edge.ledger.available
            metrics = (await c.get("/metrics", headers=ADMIN_H)).text
            assert "iop_ledger_up 0.0" in metrics and "iop_ledger_pending 20.0" in metrics
            await trio.to_thread.run_sync(postgres.start)
            await eventually(lambda: edge.edge.ledger.pending == 0, "the buffered records written")
        async with admin(edge) as adm:
            (row,) = (await adm.get("/v1/admin/usage", params={"group_by": "key"})).json()["data"]
    assert row["key"] == "k" and row["requests"] == 25


async def test_after_a_postgres_restart_the_first_writes_are_not_refused(nursery, postgres, postgres_url):  # noqa: F811
    """PostgreSQL restarted while the edge was idle (a failover, maintenance): the first write on
    each of its connections failed ("terminating connection"), so a key made just after was a
    503 `ledger_unavailable`, and so was the usage asked after one request, for the batch of
    records written first (an outside audit, on every edge). The server ended those
    connections with nothing uncommitted: the edge writes again on a new one."""
    edge = await pg_edge(nursery, postgres_url)
    with trio.fail_after(BOUND * 2):
        async with admin(edge) as adm:
            secret = (await adm.post("/v1/admin/keys", json={"id": "before"})).json()["key"]
            async with client(edge, secret) as c:
                assert (await chat(c)).status_code == 200
            assert (await adm.get("/v1/admin/usage")).status_code == 200  # every connection made and used
            await trio.to_thread.run_sync(postgres.stop)
            await trio.to_thread.run_sync(postgres.start)
            failures = edge.edge.ledger.failures
            made = await adm.post("/v1/admin/keys", json={"id": "after"})
            assert made.status_code == 201, made.text
            async with client(edge, secret) as c:
                assert (await chat(c)).status_code == 200
            usage = await adm.get("/v1/admin/usage", params={"group_by": "key"})
            assert usage.status_code == 200, usage.text
            assert edge.edge.ledger.failures == failures
    assert {row["key"]: row["requests"] for row in usage.json()["data"]} == {"before": 2}


async def hammer(edges, secret: str, seconds: float, loops_per_edge: int = 4) -> list[tuple[float, int]]:
    """(time, status) of every request from ``loops_per_edge`` clients per edge, for ``seconds``.
    The time is the wall clock's, as Redis's bucket refills by it: a CI machine paused for 8 s
    (its monotonic clock stopped, its wall clock did not) saw the bucket's refill of those
    seconds admitted in a window the monotonic clock measured 8 s short (799 a minute on 600)."""
    results: list[tuple[float, int]] = []
    deadline = trio.current_time() + seconds

    async def loop(edge) -> None:
        async with client(edge, secret) as c:
            while trio.current_time() < deadline:
                r = await chat(c)
                results.append((time.time(), r.status_code))
                await trio.sleep(0.02)

    async with trio.open_nursery() as nursery:
        for edge in edges:
            for _ in range(loops_per_edge):
                nursery.start_soon(loop, edge)
    return results


async def redis_edge(nursery, url: str, tmp_path, name: str, rpm: int):
    edge = await start_edge(
        nursery,
        edge_config(
            keys=[KeyConfig(id="r", key="sk-r", rpm=rpm)],
            state=url,
            admin_keys=[ADMIN],
            ledger=str(tmp_path / f"{name}.sqlite3"),
        ),
    )
    await start_node(nursery, edge, [sim("qwen-a")], node_id=f"n-{name}")
    await eventually(lambda: edge.edge.shared.up, "leasing from redis")
    return edge


async def test_two_edges_sharing_redis_admit_a_keys_rate_within_5_percent(nursery, redis_server, tmp_path):  # noqa: F811
    """rpm 600 across two edges, both hammered for 30 s: once the bucket's initial minute is
    spent, the admitted rate is within 5% of 600 a minute, not 1,200."""
    rpm = 600
    a = await redis_edge(nursery, redis_server.url, tmp_path, "a", rpm)
    b = await redis_edge(nursery, redis_server.url, tmp_path, "b", rpm)
    start = time.time()
    results = await hammer([a, b], "sk-r", 30)
    end = time.time()
    assert {status for _, status in results} <= {200, 429}
    # The initial minute's allowance goes as fast as this machine serves it (each edge leases a
    # slice at a time: a few seconds, 10 on a loaded machine): it is spent once the requests
    # admitted reach it plus the refill so far, less what the two edges' leases may hold.
    admitted = sorted(t for t, status in results if status == 200)
    held = 2 * 2 * rpm // 100  # at most about two slices of 1% each, per edge
    spent = next((t for n, t in enumerate(admitted, 1) if n >= rpm + rpm / 60 * (t - start) - held), None)
    assert spent is not None and spent < end - 10, (spent, len(admitted))  # the initial minute's allowance
    steady = [t for t in admitted if t >= spent + 1]
    rate = len(steady) / (end - (spent + 1)) * 60
    print(f"\nadmitted across two edges: {rate:.0f} a minute (limit {rpm}), after {spent - start:.1f} s")
    assert abs(rate - rpm) <= 0.05 * rpm, rate


async def test_a_redis_restart_fails_no_request_and_loses_no_record(nursery, redis_server, tmp_path):  # noqa: F811
    a = await redis_edge(nursery, redis_server.url, tmp_path, "a", 6000)
    results: list[tuple[float, int]] = []

    async def outage() -> None:
        await trio.sleep(1.5)
        await trio.to_thread.run_sync(redis_server.stop)
        await eventually(lambda: not a.edge.shared.up, "the edge notices")
        await trio.sleep(1.0)
        await trio.to_thread.run_sync(redis_server.start)

    with trio.fail_after(BOUND * 2):
        async with trio.open_nursery() as nursery2:
            nursery2.start_soon(outage)
            results = await hammer([a], "sk-r", 5, loops_per_edge=2)
        await eventually(lambda: a.edge.shared.up, "leasing again")
        async with httpx.AsyncClient(base_url=a.url, timeout=BOUND) as c:
            assert "iop_shared_state_up 1.0" in (await c.get("/metrics", headers=ADMIN_H)).text
        await a.edge.ledger.flush()
    statuses = [status for _, status in results]
    assert statuses and set(statuses) == {200}, [(i, s) for i, s in enumerate(statuses) if s != 200][:10]
    (row,) = await a.edge.ledger.usage(None, None, ["key"])
    assert row["requests"] == len(results)


async def test_a_daily_budget_holds_across_edges(nursery, redis_server, tmp_path):  # noqa: F811
    """daily_tokens 20 shared by two edges: 9 tokens a request; two on edge a, then edge b
    knows the day's 18 (admits one more, crossing it) and refuses the next."""
    keys = [KeyConfig(id="d", key="sk-d", daily_tokens=20)]
    edges = []
    for name in ("a", "b"):
        edge = await start_edge(
            nursery, edge_config(keys=keys, state=redis_server.url, ledger=str(tmp_path / f"{name}.sqlite3"))
        )
        await start_node(nursery, edge, [sim("qwen-a")], node_id=f"n-{name}")
        edges.append(edge)
    a, b = edges
    with trio.fail_after(BOUND):
        async with client(a, "sk-d") as c:
            assert [(await chat(c)).status_code for _ in range(2)] == [200, 200]
        await eventually(lambda: b.edge.keys.by_id["d"].day_others == 18, "edge b sees edge a's use")
        await eventually(lambda: b.edge.keys.by_id["d"].others_pending == 0, "and no request of a's in flight")
        async with client(b, "sk-d") as c:
            assert (await chat(c)).status_code == 200
            r = await chat(c)
    assert r.status_code == 429 and r.json()["error"]["type"] == "insufficient_quota"


async def test_while_redis_is_down_an_edge_has_a_keys_whole_concurrency(nursery, redis_server, tmp_path):  # noqa: F811
    """max_concurrent 3 on two edges, two streams open on edge a; Redis dies, then the streams end:
    edge b admits 3 at once on its own (it kept a's last count and admitted 1 of 3), and says
    Redis is down for as long as it is (a round with nothing to write counted as Redis answering:
    it logged "up" and leased, wrongly, between its failures)."""
    keys = [KeyConfig(id="k", key="sk-k", max_concurrent=3)]
    edges = []
    for name in ("a", "b"):
        edge = await start_edge(
            nursery, edge_config(keys=keys, state=redis_server.url, ledger=str(tmp_path / f"{name}.sqlite3"))
        )
        slow = model("slow", ttft_ms=0, tokens_per_s=5, sim_tokens=1000)
        await start_node(nursery, edge, [sim("qwen-a"), slow], node_id=f"n-{name}")
        await eventually(lambda edge=edge: edge.edge.shared.up, "leasing from redis")
        edges.append(edge)
    a, b = edges
    with trio.fail_after(BOUND * 2):
        async with client(a, "sk-k") as c, trio.open_nursery() as streams:

            async def hold() -> None:
                body = {"model": "slow", "messages": MESSAGES, "stream": True}
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_bytes():
                        pass

            for _ in range(2):
                streams.start_soon(hold)
            await eventually(lambda: b.edge.keys.by_id["k"].others_in_flight == 2, "edge b sees a's two")
            await trio.to_thread.run_sync(redis_server.stop)
            await eventually(lambda: not (a.edge.shared.up or b.edge.shared.up), "both edges notice")
            streams.cancel_scope.cancel()
        ups = 0
        for _ in range(250):  # 2.5 s with Redis down
            ups += a.edge.shared.up + b.edge.shared.up
            await trio.sleep(0.01)
        assert ups == 0
        responses = await burst(b, "sk-k", 3)
        assert [r.status_code for r in responses] == [200] * 3, [r.text for r in responses]
        await trio.to_thread.run_sync(redis_server.start)
        await eventually(lambda: a.edge.shared.up and b.edge.shared.up, "leasing again")


async def two_edges(nursery, redis_url: str, tmp_path, keys: list[KeyConfig], models: list) -> list:
    """Edges a and b sharing the Redis at ``redis_url``, each with its own node of ``models``
    and its own SQLite ledger, both leasing."""
    edges = []
    for name in ("a", "b"):
        edge = await start_edge(
            nursery, edge_config(keys=keys, state=redis_url, ledger=str(tmp_path / f"{name}.sqlite3"))
        )
        await start_node(nursery, edge, models, node_id=f"n-{name}")
        await eventually(lambda edge=edge: edge.edge.shared.up, "leasing from redis")
        edges.append(edge)
    return edges


async def one_stream_on_each_of_two_edges(nursery, redis_url: str, tmp_path, budget: int, sim) -> list[int]:
    """One stream of ``sim`` on each of two edges sharing Redis, its key's ``daily_tokens`` the
    ``budget``: each ends with 429 insufficient_quota in the stream. What each edge charged."""
    keys = [KeyConfig(id="s", key="sk-s", daily_tokens=budget)]
    edges = await two_edges(nursery, redis_url, tmp_path, keys, [sim])
    bodies: list[str] = []

    async def one(edge) -> None:
        async with client(edge, "sk-s") as c:
            r = await chat(c, sim.name, stream=True)
            assert r.status_code == 200, r.text[:300]
            bodies.append(r.text)

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as n:
            for edge in edges:
                n.start_soon(one, edge)
        used = [edge.edge.keys.by_id["s"].day_used for edge in edges]
    print(f"two streams of {sim.name} cut at {sum(used)} tokens together ({used}) on a budget of {budget}")
    assert all('"code":"insufficient_quota"' in body for body in bodies), [body[-300:] for body in bodies]
    return used


async def test_streams_on_two_edges_are_cut_at_the_budget_they_pass_together(nursery, redis_server, tmp_path):  # noqa: F811
    """daily_tokens 10,000 and one stream on each of two edges, each of 9,000 tokens (3 s): each
    edge alone stays under the budget, together they pass it, and both are ended there (429
    insufficient_quota in the stream). Each edge counted only its own streams and the others'
    ended requests: such streams ran to 40,002 tokens on a budget of 30,000 (an outside audit)."""
    paced = model("long", ttft_ms=0, tokens_per_s=3000, sim_tokens=9000)
    used = await one_stream_on_each_of_two_edges(nursery, redis_server.url, tmp_path, 10_000, paced)
    # (18,000 before: each ran to its end. Now 10,298-10,299; 11,043-11,086 on a quiet machine before each
    # edge wrote its streams as its runs passed marks of the budget, 12,573 once in CI then; and 11,287-11,520
    # before each edge left the others a part and wrote its streams every 50 ms near the budget)
    assert 10_000 < sum(used) < 16_000, used


async def test_runs_of_a_model_answering_at_once_on_two_edges_are_cut_near_the_budget(nursery, redis_server, tmp_path):  # noqa: F811
    """A model server answering at once: one stream on each of two edges, 40,000 tokens each in
    about 0.1 s, on a budget of 30,000. Each edge read the other's streams at its rounds only
    (50-250 ms apart), so each ran about to the budget alone: 52,040-54,856 together. An edge's
    runs now have its streams written, and the others' read, as they pass each sixteenth of
    the budget: 31,944-33,480 on this machine (49,032-51,464 with the gauge alone)."""
    instant = model("instant", ttft_ms=0, tokens_per_s=0, sim_tokens=40_000)
    used = await one_stream_on_each_of_two_edges(nursery, redis_server.url, tmp_path, 30_000, instant)
    assert 30_000 < sum(used) < 42_000, used


async def test_what_another_edges_ended_request_streamed_counts_at_once(
    nursery,
    redis_server,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """A stream on edge b, and on edge a a request that streams 20,000 tokens and ends, on a
    budget of 30,000: b's stream is cut near 10,000. An edge whose request ends moves what it
    streamed from its field in Redis to the day's counter; b read the fields at its rounds, and
    the counter only every REFRESH_S (here 5 s, so that b's stream passes the budget first), so
    it lost a's 20,000 meanwhile: b ran alone to the budget (about 50,000 together; with the
    usual REFRESH_S, one run in 20 of the two-edge test above, 45,640)."""
    monkeypatch.setattr(shared_state, "REFRESH_S", 5.0)
    keys = [KeyConfig(id="s", key="sk-s", daily_tokens=30_000)]
    fast = model("fast", ttft_ms=0, tokens_per_s=20_000, sim_tokens=40_000)
    instant = model("instant", ttft_ms=0, tokens_per_s=0, sim_tokens=20_000)
    edges = await two_edges(nursery, redis_server.url, tmp_path, keys, [fast, instant])
    a, b = edges
    streamed_b = b.edge.keys.by_id["s"]
    bodies: list[str] = []

    async def long_on_b() -> None:
        async with client(b, "sk-s") as c:
            bodies.append((await chat(c, "fast", stream=True)).text)

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as n:
            n.start_soon(long_on_b)
            await eventually(lambda: streamed_b.gauge is not None and streamed_b.gauge.streamed > 1000, "b streams")
            async with client(a, "sk-s") as c:
                r = await chat(c, "instant")
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20_000, r.text[:300]
        used = [edge.edge.keys.by_id["s"].day_used for edge in edges]
    assert '"code":"insufficient_quota"' in bodies[0], bodies[0][-300:]
    assert 30_000 < sum(used) < 34_000, used


async def test_an_edge_whose_streams_ended_keeps_no_count_of_the_others_streams(nursery, redis_server, tmp_path):  # noqa: F811
    """A budget of 26,000: edge b streams 20,000 tokens; meanwhile edge a streams 300 and ends,
    its last write of its streams reading b's 8,000 or more. Once b's are in the day's 20,000,
    a's next request of 5,000 runs whole. a kept b's count from that write for good, and
    counted it beside the day's total it moved to: every later request there was cut at its
    first token, "used its daily budget", with a fifth of it left (a re-check)."""
    keys = [KeyConfig(id="s", key="sk-s", daily_tokens=26_000)]
    long = model("long", ttft_ms=0, tokens_per_s=10_000, sim_tokens=20_000)
    short = model("short", ttft_ms=0, tokens_per_s=2_000, sim_tokens=300)
    instant = model("instant", ttft_ms=0, tokens_per_s=0, sim_tokens=5_000)
    edges = await two_edges(nursery, redis_server.url, tmp_path, keys, [long, short, instant])
    a, b = edges
    on_a, on_b = a.edge.keys.by_id["s"], b.edge.keys.by_id["s"]
    with trio.fail_after(BOUND * 2):
        async with client(a, "sk-s") as ca, client(b, "sk-s") as cb, trio.open_nursery() as n:
            n.start_soon(functools.partial(chat, cb, "long", stream=True))
            await eventually(lambda: on_b.gauge is not None and on_b.gauge.streamed > 8_000, "b streams 8,000")
            assert (await chat(ca, "short", stream=True)).status_code == 200
        await eventually(lambda: on_a.day_others >= 20_000 and not on_a.live, "a reads b's day")
        async with client(a, "sk-s") as ca:
            r = await chat(ca, "instant", stream=True)
    assert "insufficient_quota" not in r.text, r.text[-300:]
    assert on_a.day_used > 5_000, on_a.day_used


async def test_a_budget_key_with_max_concurrent_is_never_refused_a_slot_it_has(nursery, redis_server, tmp_path):  # noqa: F811
    """max_concurrent 1,000 and a daily budget, four clients one request at a time each: never
    more than 4 in flight, so never refused. (Each request borrows its budget from Redis, and
    that round trip gave back the free slot it was counting on: 67 of 800 were refused.)"""
    keys = [KeyConfig(id="both", key="sk-both", max_concurrent=1000, daily_tokens=1_000_000_000)]
    edge = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    statuses: list[int] = []

    async def one_at_a_time() -> None:
        async with client(edge, "sk-both") as c:
            for _ in range(60):
                statuses.append((await chat(c, max_tokens=5)).status_code)

    with trio.fail_after(BOUND * 2):
        async with trio.open_nursery() as n:
            for _ in range(4):
                n.start_soon(one_at_a_time)
    assert statuses.count(200) == 240, [s for s in statuses if s != 200][:5]


async def test_a_budget_key_with_no_slot_free_is_refused_for_concurrency_not_an_unchecked_budget(
    nursery,
    redis_server,  # noqa: F811
    tmp_path,
):
    """max_concurrent 2 and a daily budget whose slice covers no request, 2 requests running and 4
    more sent: Redis grants each its budget but no slot, so each is the usual 429 for its
    concurrency. They waited out the budget's 2.5 s for a slot, then were refused for the budget
    that first refused them: a 503 `budget_unchecked` with Redis up (48 of 188 over three edges)."""
    keys = [KeyConfig(id="both2", key="sk-both2", max_concurrent=2, daily_tokens=100_000)]
    edge = await start_edge(
        nursery,
        edge_config(keys=keys, state=redis_server.url, admin_keys=[ADMIN], ledger=str(tmp_path / "l.sqlite3")),
    )
    slow = model("slow", ttft_ms=0, tokens_per_s=10, sim_tokens=30, sim_stops=True)  # 3 s each
    await start_node(nursery, edge, [slow], node_id="n-slow")
    await eventually(lambda: edge.edge.shared.up, "leasing from redis")
    key = edge.edge.keys.by_id["both2"]
    refused: list[httpx.Response] = []
    with trio.fail_after(BOUND * 2):
        async with client(edge, "sk-both2") as c, trio.open_nursery() as n:
            for _ in range(2):  # max_tokens 2,000: more than the budget's slice (1,000)
                n.start_soon(functools.partial(chat, c, "slow", max_tokens=2000))
            await eventually(lambda: key.in_flight == 2, "two running")
            async with trio.open_nursery() as more:
                for _ in range(4):
                    more.start_soon(_append, refused, chat(c, "slow", max_tokens=2000))
            assert key.in_flight == 2  # (still running: every refusal was for want of a slot)
    assert [(r.status_code, r.json()["error"]["code"]) for r in refused] == [(429, "rate_limit_exceeded")] * 4
    assert all("concurrent" in r.json()["error"]["message"] for r in refused), refused[0].text


async def test_a_burst_spread_over_two_edges_crosses_a_budget_by_one_request(nursery, redis_server, tmp_path):  # noqa: F811
    """daily_tokens 5,000 and 100 requests of max_tokens 100 at once, half on each edge: each
    request holds its reservation in Redis before it runs, so the two edges together admit
    while the day's reservations are below the budget, one request crossing it (each edge
    admitted as if alone before: 96 of 100 ran, twice the budget)."""
    keys = [KeyConfig(id="burst", key="sk-burst", daily_tokens=5000)]
    a = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    b = await shared_edge(nursery, redis_server.url, tmp_path, "b", keys)
    responses: list[httpx.Response] = []
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as n:
            for edge in (a, b):
                n.start_soon(lambda edge=edge: _into(responses, burst(edge, "sk-burst", 50, max_tokens=100)))
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    reservation = _prompt_estimate() + 100  # what each request holds of the budget while it runs
    # At most the one crossing it; a slice (1%) of slack each busy edge holds can leave one or two short.
    most = math.ceil(5000 / reservation)
    assert most - 2 <= len(admitted) <= most, (len(admitted), reservation)
    # Refused over budget, or (while the admitted hold it, unspent) to retry in a second; on a
    # machine too slow for Redis's answer within 2.5 s, a 503 to retry.
    codes = {"insufficient_quota", "rate_limit_exceeded", "budget_unchecked"}
    assert all(r.json()["error"]["code"] in codes for r in refused), [r.text for r in refused][:3]
    for r in refused:
        if r.json()["error"]["code"] == "rate_limit_exceeded":
            assert r.headers["retry-after"] == "1" and "x-should-retry" not in r.headers, r.headers
    await eventually(lambda: not (a.edge.keys.by_id["burst"].day_pending or b.edge.keys.by_id["burst"].day_pending))


async def _into(out: list, responses) -> None:
    out.extend(await responses)


def _prompt_estimate() -> int:
    """The prompt estimate of this module's chat request (as admission makes it)."""
    from edge.openai.request import estimate_input_tokens, parse_chat_request

    req, _ = parse_chat_request({"model": "qwen-a", "messages": MESSAGES}, max_messages=10, max_tools=10)
    return estimate_input_tokens(req)


def _edge_process(cfg: str, stderr_path) -> subprocess.Popen:
    """`iop edge --config cfg` with JSON logs, its stderr to a file."""
    with open(stderr_path, "w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "iop.cli", "edge", "--config", cfg],
            env={**os.environ, "IOP_LOG_FORMAT": "json"},
            stderr=stderr,
        )


async def _serving(c: httpx.AsyncClient) -> None:
    """Wait for the edge process to answer /healthz."""
    while True:
        try:
            if (await c.get("/healthz")).status_code == 200:
                return
        except httpx.TransportError:
            await trio.sleep(0.05)


def _end(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(BOUND)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def test_postgres_down_admin_routes_are_503_json_and_logs_stay_json(tmp_path, postgres, postgres_url):  # noqa: F811
    """`iop edge` with JSON logs and a PostgreSQL ledger, the server stopped: the usage query and
    making a key are 503 `ledger_unavailable` in the OpenAI shape (not Quart's HTML 500), each
    logged as one JSON line, and every line on stderr is JSON; with the server back, the key is made."""
    port = free_port()
    cfg = write_toml(
        tmp_path / "edge.toml",
        {"bind": f"127.0.0.1:{port}", "node_token": TOKEN, "admin_keys": [ADMIN], "ledger": postgres_url},
    )
    proc = _edge_process(cfg, tmp_path / "stderr")
    stopped = False
    try:
        with trio.fail_after(BOUND * 2):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=BOUND, headers=ADMIN_H) as adm:
                await _serving(adm)
                assert (await adm.get("/v1/admin/usage")).status_code == 200
                await trio.to_thread.run_sync(postgres.stop)
                stopped = True
                refused = [
                    await adm.get("/v1/admin/usage"),
                    await adm.post("/v1/admin/keys", json={"id": "k"}),
                    await adm.get("/v1/admin/keys"),  # its usage to date would be short: not a list of zeros
                ]
                await trio.to_thread.run_sync(postgres.start)
                stopped = False
                made = await adm.post("/v1/admin/keys", json={"id": "k"})
    finally:
        with trio.CancelScope(shield=True):
            if stopped:
                await trio.to_thread.run_sync(postgres.start)
            await trio.to_thread.run_sync(_end, proc)
    for r in refused:
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["code"] == "ledger_unavailable" and r.headers["retry-after"] == "1"
    assert made.status_code == 201
    lines = [line for line in (tmp_path / "stderr").read_text().splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line is JSON
    failed = [e for e in events if e["msg"] == "admin request failed: ledger unavailable"]
    assert [e["route"] for e in failed] == ["/v1/admin/usage", "/v1/admin/keys", "/v1/admin/keys"]
    assert all(e["level"] == "warning" and e["request_id"].startswith("req_") for e in failed)


async def test_an_edge_with_shared_state_stops_on_sigterm_logging_no_error(tmp_path, redis_server, postgres_url):  # noqa: F811
    """Every graceful stop of an edge with ``state`` set logged an error-level "Exception" with
    a traceback: the cancel of its shared-state task's nursery, as an exception group, which
    quart-trio logs as a background task's failure (an outside audit; rolling restarts put one
    on the line operators alert on). It leaves its Redis entries and exits 0, logging no error."""
    port = free_port()
    cfg = write_toml(
        tmp_path / "edge.toml",
        {
            "bind": f"127.0.0.1:{port}",
            "node_token": TOKEN,
            "admin_keys": [ADMIN],
            "ledger": postgres_url,
            "state": redis_server.url,
            "keys": [{"id": "k", "key": "sk-k", "rpm": 100}],
        },
    )
    proc = _edge_process(cfg, tmp_path / "stderr")
    try:
        with trio.fail_after(BOUND * 2):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=BOUND) as c:
                await _serving(c)
                # a key's request (no node: a 503 or a queue wait), so the edge writes its flights
                r = await c.post(
                    "/v1/chat/completions",
                    headers={"Authorization": "Bearer sk-k"},
                    json={"model": "qwen-a", "messages": MESSAGES},
                )
                assert r.status_code in (404, 429, 503), r.text
                await trio.sleep(0.3)  # a lease round or two
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_end, proc)
    assert proc.returncode == 0
    events = [json.loads(line) for line in (tmp_path / "stderr").read_text().splitlines() if line.strip()]
    assert any(e["msg"] == "request" for e in events)  # it logged, in JSON
    assert [e for e in events if e["level"] in ("error", "critical")] == []


async def shared_edge(nursery, url: str, tmp_path, name: str, keys: list[KeyConfig], ledger: str | None = None):
    """An edge with ``keys`` leasing from the Redis at ``url`` (its own SQLite ledger unless given one)."""
    edge = await start_edge(
        nursery,
        edge_config(keys=keys, state=url, admin_keys=[ADMIN], ledger=ledger or str(tmp_path / f"{name}.sqlite3")),
    )
    await start_node(nursery, edge, [sim("qwen-a")], node_id=f"n-{name}-{edge.url[-5:]}")
    await eventually(lambda: edge.edge.shared.up, "leasing from redis")
    return edge


async def burst(edge, secret: str, n: int, **body) -> list[httpx.Response]:
    """``n`` chat requests at once."""
    responses: list[httpx.Response] = []
    async with client(edge, secret) as c:

        async def one() -> None:
            responses.append(await chat(c, **body))

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
    return responses


async def test_a_burst_borrows_from_redis_what_the_edges_slice_lacks(
    nursery,
    redis_server,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """An edge holds a slice (1%) of a key's minute: a burst beyond it borrows from the Redis bucket
    instead of being refused (rpm 60: 30 at once; tpm 200,000: 3 reservations of 4,000+; rpm 60 with
    max_concurrent 4: 4 at once), and the key's limit still holds (rpm 20: 40 at once admit 20 and
    what refilled meanwhile; the rest are 429 as before)."""
    # What is tested is what a borrow brings, not how soon: a request waits BORROW_S (0.5 s) for
    # Redis, and one full-suite run on a loaded 2-core machine saw 29 of the 30 refused after it.
    monkeypatch.setattr(shared_state, "BORROW_S", 5.0)
    keys = [
        KeyConfig(id="burst", key="sk-burst", rpm=60),
        KeyConfig(id="big", key="sk-big", tpm=200_000),
        KeyConfig(id="alice2", key="sk-alice2", rpm=60, tpm=200_000, max_concurrent=4),
        KeyConfig(id="tight", key="sk-tight", rpm=20),
    ]
    edge = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    with trio.fail_after(BOUND * 2):
        for secret, n, body in (("sk-burst", 30, {}), ("sk-big", 3, {"max_tokens": 4000}), ("sk-alice2", 4, {})):
            responses = await burst(edge, secret, n, **body)
            refused = [r.text for r in responses if r.status_code != 200]
            assert len(responses) == n and not refused, (secret, refused[:3])
        start = trio.current_time()
        responses = await burst(edge, "sk-tight", 40)
        refilled = (trio.current_time() - start) * 20 / 60
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert 20 <= len(admitted) <= 20 + math.ceil(refilled) + 1, (len(admitted), refilled)
    assert refused and all(
        r.status_code == 429 and "20 requests per minute" in r.json()["error"]["message"] for r in refused
    )


async def test_a_fresh_edge_does_not_say_an_unread_bucket_is_empty(nursery, redis_server, tmp_path):  # noqa: F811
    """An edge just started beside another, its keys' shared buckets not yet read from Redis: a
    request refused before admission (a 400 for its body) of a key of rpm and tpm with
    max_concurrent or daily_tokens said `x-ratelimit-remaining-*: 0`, reset in a minute, until the key's first
    admitted request there (its balance alone; a client pacing on them paused a minute after
    every deploy: an outside audit). An unread bucket is taken as full, as the edge takes one
    when Redis goes away; once read, it is what Redis holds."""
    keys = [
        KeyConfig(id="c", key="sk-c", rpm=60, tpm=10_000, max_concurrent=2),
        KeyConfig(id="d", key="sk-d", rpm=60, tpm=10_000, daily_tokens=10**6),
    ]
    a = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    with trio.fail_after(BOUND):
        for secret in ("sk-c", "sk-d"):
            async with client(a, secret) as c:
                assert (await chat(c)).status_code == 200
        b = await shared_edge(nursery, redis_server.url, tmp_path, "b", keys)
        for secret in ("sk-c", "sk-d"):
            async with client(b, secret) as c:
                r = await c.post("/v1/chat/completions", json={"model": "qwen-a", "messages": []})
            assert r.status_code == 400, r.text
            said = {k: v for k, v in r.headers.items() if k.startswith("x-ratelimit-remaining")}
            assert 55 <= int(said["x-ratelimit-remaining-requests"]) <= 60, (secret, said)
            assert 5_000 <= int(said["x-ratelimit-remaining-tokens"]) <= 10_000, (secret, said)


async def test_ratelimit_headers_show_the_shared_bucket(nursery, redis_server, tmp_path):  # noqa: F811
    """With shared state, x-ratelimit-remaining-* is the Redis bucket's level plus this edge's
    balance (a fresh rpm 600 / tpm 100,000 key: about 599 and 99k after one request, not the
    edge's slice of 5 and 5,114), and the reset is computed from it."""
    keys = [KeyConfig(id="h", key="sk-h", rpm=600, tpm=100_000)]
    edge = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    with trio.fail_after(BOUND):
        async with client(edge, "sk-h") as c:
            r = await chat(c)
    assert r.status_code == 200
    assert 590 <= int(r.headers["x-ratelimit-remaining-requests"]) <= 600, r.headers
    assert 90_000 <= int(r.headers["x-ratelimit-remaining-tokens"]) <= 100_000, r.headers
    assert r.headers["x-ratelimit-reset-requests"].endswith("ms"), r.headers  # 1 request of 600 a minute: 0.1 s


def _redis_day(url: str, key_id: str) -> int | None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=1.0)
    try:
        value = client.get(f"iop:day:{key_id}:{int(time.time() // 86400)}")
    finally:
        client.close()
    return None if value is None else int(value)


async def redis_day(url: str, key_id: str) -> int | None:
    """A key's day counter in Redis now."""
    return await trio.to_thread.run_sync(_redis_day, url, key_id)


async def test_a_redis_restart_reconciles_daily_budgets(nursery, redis_server, tmp_path):  # noqa: F811
    """daily_tokens 100 spent through edge a (edge b refuses too); redis-server restarts empty: the
    edges add again what they know of the day, so both still refuse, and Redis holds the day's use."""
    keys = [KeyConfig(id="jo", key="sk-jo", daily_tokens=100, max_concurrent=1)]
    a = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    b = await shared_edge(nursery, redis_server.url, tmp_path, "b", keys)
    with trio.fail_after(BOUND * 3):
        async with client(a, "sk-jo") as c:
            for _ in range(30):
                if (await chat(c)).status_code != 200:
                    break
        spent = a.edge.keys.by_id["jo"].day_used
        assert spent >= 100
        await eventually(lambda: b.edge.keys.by_id["jo"].day_others == spent, "edge b sees edge a's use")
        async with client(b, "sk-jo") as c:
            assert (await chat(c)).status_code == 429
        await trio.to_thread.run_sync(redis_server.stop)
        await trio.to_thread.run_sync(redis_server.start)
        while (await redis_day(redis_server.url, "jo") or 0) < spent:  # both edges' rounds, in the new Redis
            await trio.sleep(0.05)
        assert await redis_day(redis_server.url, "jo") == spent
        await eventually(lambda: b.edge.keys.by_id["jo"].day_others == spent, "edge b sees edge a's use again")
        for edge in (a, b):
            async with client(edge, "sk-jo") as c:
                r = await chat(c)
            assert r.status_code == 429 and r.json()["error"]["type"] == "insufficient_quota", r.text


async def test_a_day_counter_redis_lost_is_rebuilt_from_the_shared_ledger(
    nursery,
    redis_server,  # noqa: F811
    postgres_url,  # noqa: F811
    tmp_path,
):
    """Two edges on one PostgreSQL ledger; use through both; edge b restarts; more use through
    both; redis-server restarts empty. The day's counter comes back as the ledger's total. The
    restarted edge had restored every edge's use from the shared ledger and added it again if it
    reported first in the new Redis (found from outside: +33% and +50%), or left its own earlier
    use out if not (-17%)."""
    keys = [KeyConfig(id="day", key="sk-day", daily_tokens=10**9)]
    a = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys, postgres_url)
    b = await shared_edge(nursery, redis_server.url, tmp_path, "b", keys, postgres_url)

    async def use(edge, n: int) -> None:
        async with client(edge, "sk-day") as c:
            for _ in range(n):
                assert (await chat(c)).status_code == 200

    async def ledger_total() -> int:
        await a.edge.ledger.flush()
        _, prompt, completion = (await a.edge.ledger.key_totals("day"))["day"]
        return prompt + completion

    with trio.fail_after(BOUND * 3):
        await use(a, 3)
        await use(b, 4)
        await b.edge.ledger.flush()
        b.scope.cancel()
        b = await shared_edge(nursery, redis_server.url, tmp_path, "b2", keys, postgres_url)
        await use(b, 2)
        await use(a, 1)
        await b.edge.ledger.flush()
        total = await ledger_total()
        await eventually(lambda: a.edge.keys.by_id["day"].today_tokens() == total, "edge a's view of the day")
        await trio.to_thread.run_sync(redis_server.stop)
        await trio.to_thread.run_sync(redis_server.start)
        await eventually(lambda: a.edge.shared.up and b.edge.shared.up, "both edges see redis back")
        while await redis_day(redis_server.url, "day") != total:
            await trio.sleep(0.05)
        await trio.sleep(1.5)  # (every edge has reported again since: REFRESH_S)
        assert await redis_day(redis_server.url, "day") == total
        for edge in (a, b):
            await eventually(
                lambda edge=edge: edge.edge.keys.by_id["day"].today_tokens() == total, "the day as rebuilt"
            )


async def test_a_day_counter_lost_soon_after_it_was_made_is_not_counted_twice(
    nursery,
    redis_server,  # noqa: F811
    postgres_url,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """Redis loses its data within FLOOR_DELAY_S of the day counter's making. The floor armed for
    that first counter landed on the new one before every edge had added its use again, and the
    late edge's use, in the ledger already, was counted twice (126 tokens for 90, once in CI).
    Here edge b adds its use again only after the first counter's floor is due: the counter is
    the day's use, not more."""
    monkeypatch.setattr(shared_state, "FLOOR_DELAY_S", 2.0)
    keys = [KeyConfig(id="day", key="sk-day", daily_tokens=10**9)]
    a = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys, postgres_url)
    b = await shared_edge(nursery, redis_server.url, tmp_path, "b", keys, postgres_url)
    gate = trio.Event()
    gate.set()
    b_round = b.edge.shared.round

    async def gated_round() -> None:
        await gate.wait()
        await b_round()

    b.edge.shared.round = gated_round
    with trio.fail_after(BOUND * 3):
        for edge, n in ((a, 2), (b, 3)):
            async with client(edge, "sk-day") as c:
                for _ in range(n):
                    assert (await chat(c)).status_code == 200
        for edge in (a, b):
            await edge.edge.ledger.flush()
        _, prompt, completion = (await a.edge.ledger.key_totals("day"))["day"]
        total = prompt + completion
        while await redis_day(redis_server.url, "day") != total:  # (both edges have added their use)
            await trio.sleep(0.05)
        made = trio.current_time()  # (the counter was made before this, at a's first add)
        gate = trio.Event()  # edge b goes quiet
        # (Redis is lost a second on: edge a makes the counter anew at once, and its floor comes
        # half a second after b has added its use again, as it would for an edge not frozen)
        await trio.sleep(1.0)
        await trio.to_thread.run_sync(redis_server.stop)
        await trio.to_thread.run_sync(redis_server.start)
        await eventually(lambda: a.edge.shared.up, "edge a sees redis back")
        while await redis_day(redis_server.url, "day") is None:  # (edge a made the counter anew)
            await trio.sleep(0.05)
        await trio.sleep(max(made + shared_state.FLOOR_DELAY_S + 0.5 - trio.current_time(), 0))
        gate.set()  # the first counter's floor was due: edge b adds its use again
        await trio.sleep(shared_state.FLOOR_DELAY_S + 1.5)  # (and the new counter's own floor comes)
        assert await redis_day(redis_server.url, "day") == total


async def test_an_edge_restart_adds_only_new_use_and_today_tokens_is_across_edges(nursery, redis_server, tmp_path):  # noqa: F811
    """An edge that restarts restores its day from its ledger and does not add it to Redis again
    (Redis holds it already); `today_tokens` in /v1/admin/keys is the day across edges for a key
    with daily_tokens, on any edge."""
    keys = [KeyConfig(id="d", key="sk-d", daily_tokens=1000)]
    ledger = str(tmp_path / "a.sqlite3")
    a = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys, ledger)
    b = await shared_edge(nursery, redis_server.url, tmp_path, "b", keys)
    with trio.fail_after(BOUND * 2):
        async with client(a, "sk-d") as c:
            spent = 0
            for _ in range(3):
                spent += (await chat(c)).json()["usage"]["total_tokens"]
        while await redis_day(redis_server.url, "d") != spent:
            await trio.sleep(0.05)
        await a.edge.ledger.flush()
        a.scope.cancel()
        again = await shared_edge(nursery, redis_server.url, tmp_path, "a2", keys, ledger)
        day = int(time.time() // 86400)
        await eventually(lambda: ("d", day) in again.edge.shared._reported, "the restarted edge reports its day")
        assert await redis_day(redis_server.url, "d") == spent
        # (what a's requests in flight had reserved, as b last read it, is gone: none runs now)
        await eventually(lambda: b.edge.keys.by_id["d"].others_pending == 0, "edge b sees no request in flight")
        async with client(b, "sk-d") as c:
            spent += (await chat(c)).json()["usage"]["total_tokens"]
        await eventually(lambda: again.edge.keys.by_id["d"].today_tokens() == spent, "edge a2 sees edge b's use")
        for edge in (again, b):
            async with admin(edge) as adm:
                (d,) = (await adm.get("/v1/admin/keys")).json()["data"]
            assert d["today_tokens"] == spent, (edge.url, d)
    assert await redis_day(redis_server.url, "d") == spent


async def test_a_small_tpm_is_shared_by_two_edges(nursery, redis_server, tmp_path):  # noqa: F811
    """A slice was at least 5,120 tokens: for a tpm of 3,000 one edge leased the whole
    minute and the other refused (12 of 20 admitted, found from outside). A slice is now
    at most a tenth of the tpm: 20 small requests, alternating between two edges, pass."""
    keys = [KeyConfig(id="tk", key="sk-tk", tpm=3000)]
    edges = [await shared_edge(nursery, redis_server.url, tmp_path, name, keys) for name in ("a", "b")]
    with trio.fail_after(BOUND * 2):
        statuses = []
        for i in range(20):
            async with client(edges[i % 2], "sk-tk") as c:
                statuses.append((await chat(c, max_tokens=100)).status_code)
            await trio.sleep(0.05)
    assert statuses == [200] * 20, statuses


async def test_a_burst_after_a_quiet_spell_gets_the_minute_not_the_minute_and_every_edges_slice(
    nursery,
    redis_server,  # noqa: F811
    tmp_path,
):
    """tpm 6,000 over two edges that admitted a request of the key each, then a quiet spell: the
    bucket refilled to its capacity while each edge held a slice (a tenth of the minute) outside
    it, and a 3 s burst over both got 7,446 tokens where the bucket allows about 6,300 (found from
    outside). The bucket refills up to its capacity less what the edges hold."""
    tpm = 6000
    keys = [KeyConfig(id="q", key="sk-q", tpm=tpm)]
    edges = [await shared_edge(nursery, redis_server.url, tmp_path, name, keys) for name in ("a", "b")]
    with trio.fail_after(BOUND * 3):
        for edge in edges:
            async with client(edge, "sk-q") as c:
                assert (await chat(c, max_tokens=50)).status_code == 200
        await eventually(lambda: all(e.edge.keys.by_id["q"].tok_level > 500 for e in edges), "both hold a slice")
        await trio.sleep(6)  # (the bucket refills what the two requests took: 100 tokens a second)
        used = 0
        start = trio.current_time()
        # At least 3 s, and until 1 s after the first refusal (20 s at most): on a machine busy with
        # other tests the burst had not spent the minute in 3 s (816 and 1,224 tokens, in CI), which
        # is no refusal of it.
        refused_at: float | None = None

        def going() -> bool:
            now = trio.current_time()
            if refused_at is None:
                return now - start < 20
            return now - start < 3 or now - refused_at < 1

        async def loop(edge) -> None:
            nonlocal used, refused_at
            async with client(edge, "sk-q") as c:
                while going():
                    r = await chat(c, max_tokens=50)
                    if r.status_code == 200:
                        used += r.json()["usage"]["total_tokens"]
                    else:
                        if refused_at is None:
                            refused_at = trio.current_time()
                        await trio.sleep(0.05)

        async with trio.open_nursery() as burst_nursery:
            for edge in edges:
                for _ in range(8):
                    burst_nursery.start_soon(loop, edge)
        refilled = (trio.current_time() - start) * tpm / 60
    print(f"\nadmitted in the burst: {used} tokens (the bucket: {tpm} + {refilled:.0f} refilled)")
    assert used <= 1.05 * tpm + refilled, used
    assert used >= 0.8 * tpm  # (the bucket's minute is there for the burst)


async def a_spent_minute(nursery, redis_server, tmp_path):  # noqa: F811
    """An edge on the Redis of ``redis_server`` whose key ``sk-spent`` (rpm 20) has just spent its minute."""
    keys = [KeyConfig(id="spent", key="sk-spent", rpm=20)]
    edge = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    # What the tests using this need is a minute spent, not a borrow answered in BORROW_S (0.5 s):
    # on a loaded CI machine 11 of the 25 waited 2 s and were refused (14 admitted), which is no
    # spent minute. The wait is raised for this burst only (what follows is judged as configured).
    borrow_s = shared_state.BORROW_S
    shared_state.BORROW_S = 10.0
    try:
        first = await burst(edge, "sk-spent", 25)
    finally:
        shared_state.BORROW_S = borrow_s
    assert sum(r.status_code == 200 for r in first) >= 20
    return edge


async def test_a_redis_stall_does_not_give_a_spent_key_a_fresh_minute(nursery, redis_server, tmp_path):  # noqa: F811
    """When Redis stops answering, each edge limits keys on its own: it starts from the
    shared bucket as it last saw it (refilled since), not from a full minute. (Found from
    outside: a key that had just spent its rpm 60 got 100 more across two edges in a
    2.5 s stall.)"""
    import os
    import signal

    with trio.fail_after(BOUND * 2):
        edge = await a_spent_minute(nursery, redis_server, tmp_path)
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            await eventually(lambda: not edge.edge.shared.up, "redis seen down")
            stalled = await burst(edge, "sk-spent", 20)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert sum(r.status_code == 200 for r in stalled) <= 3, [r.status_code for r in stalled]


async def test_an_idle_edge_back_from_a_redis_stall_gives_no_key_a_fresh_minute(nursery, redis_server, tmp_path):  # noqa: F811
    """Edge a spends a key's minute; edge b, on the same Redis, never has a request of it. Redis
    stalls until both limit on their own, then answers again. b had given the key a full local
    bucket (it had never seen the shared one) and, back, handed all of it to Redis: a second
    minute for a at once (an outside audit: 214 requests in 10 s on rpm 100, after any stall)."""
    import os
    import signal

    with trio.fail_after(BOUND * 2):
        a = await a_spent_minute(nursery, redis_server, tmp_path)
        b = await shared_edge(nursery, redis_server.url, tmp_path, "b", [KeyConfig(id="spent", key="sk-spent", rpm=20)])
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            await eventually(lambda: not (a.edge.shared.up or b.edge.shared.up), "redis seen down by both")
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        await eventually(lambda: a.edge.shared.up and b.edge.shared.up, "redis seen back by both")
        await trio.sleep(0.3)  # (a few lease rounds: what b gives back is in)
        again = await burst(a, "sk-spent", 20)
    assert sum(r.status_code == 200 for r in again) <= 3, [r.status_code for r in again]


@LOAD_BOUND  # (its requests admitted in a few seconds: 79 of a due 11.7 once, in a CI run, passing alone)
async def test_a_redis_that_answers_but_refuses_writes_leaves_limits_local(nursery, redis_server, tmp_path):  # noqa: F811
    """A Redis that answers a ping but refuses the scripts (a read-only replica after a failover,
    out of memory): the edge limits on its own, and stays so. It went back to the shared
    buckets on the ping, the round's scripts failed, and each failure made a new local bucket:
    every request admitted, 593 in a minute on rpm 60 (an outside re-check)."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    keys = [KeyConfig(id="fast", key="sk-fast", rpm=120)]
    with trio.fail_after(BOUND * 2):
        edge = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
        for _ in range(4):  # its minute, spent
            if any(r.status_code == 429 for r in await burst(edge, "sk-fast", 60)):
                break
        await trio.to_thread.run_sync(client.replicaof, "127.0.0.1", str(free_port()))
        try:
            await eventually(lambda: not edge.edge.shared.up, "the scripts seen refused")
            started = trio.current_time()
            admitted = 0
            for _ in range(10):  # (3 s: many rounds)
                admitted += sum(r.status_code == 200 for r in await burst(edge, "sk-fast", 10))
                await trio.sleep(0.3)
            due = (trio.current_time() - started + 2) * 2  # (2 a second, from when Redis was last seen)
        finally:
            await trio.to_thread.run_sync(client.replicaof, "NO", "ONE")
    assert admitted <= due + 2, (admitted, due)


async def test_what_an_edge_spent_while_redis_was_away_comes_out_of_the_shared_minute(nursery, redis_server, tmp_path):  # noqa: F811
    """A key made while Redis is stopped spends its minute from the edge's local bucket. Redis
    back, that minute came again at once: its bucket, which Redis never had, was made full (69
    requests in 22 s on rpm 30); so did a single edge's through a 60 s stall, as what it spent
    locally was never taken from Redis's bucket, which refilled meanwhile (an outside re-check).
    What an edge spent locally is now its debt to the shared bucket."""
    with trio.fail_after(BOUND * 2):
        edge = await shared_edge(nursery, redis_server.url, tmp_path, "a", [KeyConfig(id="other", key="sk-o")])
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            await eventually(lambda: not edge.edge.shared.up, "redis seen down")
            async with admin(edge) as adm:
                made = await adm.post("/v1/admin/keys", json={"id": "new", "rpm": 20})
            assert made.status_code == 201, made.text
            local = await burst(edge, made.json()["key"], 25)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        await eventually(lambda: edge.edge.shared.up, "redis seen back")
        await trio.sleep(0.3)  # (a few lease rounds)
        again = await burst(edge, made.json()["key"], 20)
    assert sum(r.status_code == 200 for r in local) >= 18  # its minute, from the local bucket
    assert sum(r.status_code == 200 for r in again) <= 3, [r.status_code for r in again]


async def test_tokens_reserved_while_redis_was_away_and_settled_after_are_no_fresh_minute(
    nursery,
    redis_server,  # noqa: F811
    tmp_path,
):
    """Edge a spends a key's tpm; edge b, which never had a request of it, admits a long request
    from its local bucket while Redis is stopped. Redis back, the request ends: the unused part
    of its reservation went to b's shared balance, and from there to Redis, a fresh minute for a
    (5 requests of 1,000 tokens admitted where 1 was due: an outside re-check)."""
    keys = [KeyConfig(id="t", key="sk-t", tpm=1200)]
    with trio.fail_after(BOUND * 2):
        a = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
        b = await shared_edge(nursery, redis_server.url, tmp_path, "b", keys)
        slow = model("slow", ttft_ms=0, tokens_per_s=10, sim_tokens=30, sim_stops=True)  # (3 s)
        await start_node(nursery, b, [slow], node_id="n-slow")
        async with client(a, "sk-t") as c:
            for _ in range(200):  # its minute, spent (about 20 tokens a request)
                if (await chat(c, max_tokens=8)).status_code == 429:
                    break
            else:
                raise AssertionError("the key's minute was never spent")
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            await eventually(lambda: not (a.edge.shared.up or b.edge.shared.up), "redis seen down by both")
            async with client(b, "sk-t") as c, trio.open_nursery() as slow:

                async def long_request() -> None:
                    r = await chat(c, "slow", max_tokens=1000)
                    assert r.status_code == 200, r.text

                slow.start_soon(long_request)
                await eventually(lambda: b.edge.keys.by_id["t"].in_flight == 1, "b's long request admitted")
                os.kill(redis_server.proc.pid, signal.SIGCONT)
                await eventually(lambda: a.edge.shared.up and b.edge.shared.up, "redis seen back by both")
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        await trio.sleep(0.3)  # (b's settled request: what a round gives back is in)
        after = await burst(a, "sk-t", 60, max_tokens=8)
    # (the bucket's refill meanwhile, 20 tokens a second for 5-7 s, is 5-7 of these requests; the
    # unused reservation given back was about 50)
    assert sum(r.status_code == 200 for r in after) <= 12, [r.status_code for r in after]


async def test_a_redis_that_lost_its_data_gives_no_spent_key_a_fresh_minute(nursery, redis_server, tmp_path):  # noqa: F811
    """Redis restarted without persistence (or FLUSHALL): a bucket it no longer has started
    full, so a key that had just spent its minute got a second one at once (rpm 60 over two
    edges: 123 requests in 2 s; 331 against 200 in 35 s around a restart, an outside audit).
    It starts where the edge last saw it, refilled since."""
    import redis

    with trio.fail_after(BOUND * 2):
        edge = await a_spent_minute(nursery, redis_server, tmp_path)
        await trio.to_thread.run_sync(lambda: redis.Redis.from_url(redis_server.url).flushall())
        await trio.sleep(0.3)  # (lease rounds meet the empty Redis)
        again = await burst(edge, "sk-spent", 20)
    assert sum(r.status_code == 200 for r in again) <= 3, [r.status_code for r in again]


async def test_a_redis_that_lost_its_data_gives_no_key_at_rest_a_fresh_day(nursery, redis_server, tmp_path):  # noqa: F811
    """Two edges, a budget of 20,000 a day: edge a spends 15,001 and its key rests there; then
    Redis loses its data (FLUSHALL), and edge b's clients ask 1,000 tokens at a time for 2 s.
    Edge a adds its day again within a round: b serves about the 5,000 left. It added it only
    when the key's next read found the counter gone, and a second after that: b, its own adds
    made anew, served 20,020 meanwhile (35,021 in all; a re-check)."""
    import redis

    keys = [KeyConfig(id="day", key="sk-day", daily_tokens=20_000)]
    big, small = (
        model("big", ttft_ms=0, tokens_per_s=0, sim_tokens=15_000),
        model("small", ttft_ms=0, tokens_per_s=0, sim_tokens=1000),
    )
    edges = await two_edges(nursery, redis_server.url, tmp_path, keys, [big, small])
    a, b = edges
    with trio.fail_after(BOUND * 2):
        async with client(a, "sk-day") as c:
            r = await chat(c, "big", max_tokens=15_000)
        assert r.status_code == 200, r.text[:300]
        spent = a.edge.keys.by_id["day"].day_used
        assert spent > 10_000, spent
        await eventually(lambda: "day" in a.edge.shared._resting, "the key at rest on edge a")
        await trio.to_thread.run_sync(redis.Redis.from_url(redis_server.url).flushall)
        served, refused = 0, []
        async with client(b, "sk-day") as c:
            with trio.move_on_after(2):  # (a refusal is b's view as of its last read: it reads again)
                while True:
                    r = await chat(c, "small", max_tokens=1000)
                    if r.status_code == 200:
                        served += r.json()["usage"]["total_tokens"]
                    else:
                        refused.append(r.json()["error"]["code"])
                        await trio.sleep(0.05)
    assert refused and set(refused) == {"insufficient_quota"}, refused[:5]
    assert spent + served < 20_000 + 2 * 1_100, (spent, served)


async def test_the_use_of_an_edge_frozen_across_a_redis_data_loss_holds_for_the_day(nursery, redis_server, tmp_path):  # noqa: F811
    """Edge b spends 15,001 of a budget of 20,000 a day, then freezes (its lease rounds stop)
    across a FLUSHALL; 2.5 s on, edge a's clients ask 1,000 tokens at a time: a serves about
    the 5,000 left. a held b's use as last read for 2 s only, and then served the whole budget
    again (20,167 more; a re-check): b never added its use to the new counter."""
    import redis

    keys = [KeyConfig(id="day", key="sk-day", daily_tokens=20_000)]
    big, small = (
        model("big", ttft_ms=0, tokens_per_s=0, sim_tokens=15_000),
        model("small", ttft_ms=0, tokens_per_s=0, sim_tokens=1000),
    )
    a, b = await two_edges(nursery, redis_server.url, tmp_path, keys, [big, small])
    thawed = trio.Event()
    b_round = b.edge.shared.round

    async def frozen_round() -> None:
        await thawed.wait()
        await b_round()

    with trio.fail_after(BOUND * 2):
        async with client(b, "sk-day") as c:
            assert (await chat(c, "big", max_tokens=15_000)).status_code == 200
        spent = b.edge.keys.by_id["day"].day_used
        await eventually(lambda: a.edge.keys.by_id["day"].day_others >= spent, "a reads b's use")
        b.edge.shared.round = frozen_round
        await trio.sleep(0.2)  # (b's round under way ends)
        await trio.to_thread.run_sync(redis.Redis.from_url(redis_server.url).flushall)
        await trio.sleep(2.5)
        served = 0
        async with client(a, "sk-day") as c:
            with trio.move_on_after(1.5):
                while True:
                    r = await chat(c, "small", max_tokens=1000)
                    if r.status_code == 200:
                        served += r.json()["usage"]["total_tokens"]
                    else:
                        await trio.sleep(0.05)
        thawed.set()
    assert spent + served < 20_000 + 2 * 1_100, (spent, served)


async def test_a_redis_data_loss_keeps_the_budget_other_edges_hold(nursery, redis_server, tmp_path):  # noqa: F811
    """A budget of 20,000: a stream on edge b holds all of it (its max_tokens); Redis loses its
    data, and 0.3 s on edge a is asked for 5,000: refused, as before the loss. b wrote its
    hold to Redis again only when its entry's second was up: a was granted meanwhile, and all
    the key's streams were then cut at the budget (a re-check)."""
    import redis

    keys = [KeyConfig(id="day", key="sk-day", daily_tokens=20_000)]
    slow = model("slow", ttft_ms=0, tokens_per_s=200, sim_tokens=20_000)
    a, b = await two_edges(nursery, redis_server.url, tmp_path, keys, [slow])
    on_a = a.edge.keys.by_id["day"]
    r = None
    with trio.fail_after(BOUND * 2):
        async with client(a, "sk-day") as ca, client(b, "sk-day") as cb, trio.open_nursery() as n:
            n.start_soon(functools.partial(chat, cb, "slow", stream=True, max_tokens=20_000))
            await eventually(lambda: b.edge.keys.by_id["day"].live, "b's stream runs")
            await trio.sleep(0.5)  # (its hold written, and read by a)
            await trio.to_thread.run_sync(redis.Redis.from_url(redis_server.url).flushall)
            await trio.sleep(0.3)
            with trio.move_on_after(5):  # (admitted, it runs for 25 s)
                r = await chat(ca, "slow", max_tokens=5_000)
            n.cancel_scope.cancel()
    assert r is not None, "a admitted it"
    assert (
        r.status_code == 429
        and "hold the rest" in r.json()["error"]["message"]
        and "this edge or others" in r.json()["error"]["message"]
    ), (r.status_code, r.text[:300])
    assert not on_a.day_used


async def test_a_redis_stall_is_no_spent_budget(nursery, redis_server, tmp_path):  # noqa: F811
    """A budget key barely used, Redis stopped (not yet seen down): a request whose budget the
    edge cannot get an answer for from Redis is a 503 to retry at once, and once Redis has failed
    a call the edge judges the budget by what it knows, as when Redis is down (each was refused
    "has used its daily budget", Retry-After until midnight)."""
    import os
    import signal

    keys = [KeyConfig(id="big", key="sk-big", daily_tokens=10_000_000)]
    edge = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    with trio.fail_after(BOUND * 2):
        async with client(edge, "sk-big") as c:
            assert (await chat(c)).status_code == 200
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            try:
                stalled = [await chat(c)]
                while stalled[-1].status_code != 200 and len(stalled) < 8:  # (a loaded machine: more than 3)
                    stalled.append(await chat(c))
            finally:
                os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert stalled[-1].status_code == 200, stalled[-1].text
    for r in stalled:
        assert r.status_code == 200 or (
            r.status_code == 503 and r.json()["error"]["code"] == "budget_unchecked" and r.headers["retry-after"] == "1"
        ), r.text


async def test_a_redis_stall_refuses_no_request_for_want_of_a_slot(nursery, redis_server, tmp_path):  # noqa: F811
    """A max_concurrent key with none in flight, Redis stopped (not yet seen down): a request
    whose slot borrow gets no answer is judged by this edge alone, as when Redis is down (each
    was refused "100 concurrent requests", 8 of 8, found from outside)."""
    import os
    import signal

    keys = [KeyConfig(id="wide", key="sk-wide", max_concurrent=100)]
    edge = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    with trio.fail_after(BOUND * 2):
        assert [r.status_code for r in await burst(edge, "sk-wide", 2)] == [200, 200]
        await eventually(lambda: edge.edge.keys.by_id["wide"].flight_held == 0, "its slots given back")
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            stalled = await burst(edge, "sk-wide", 8)  # (judged before Redis is known down, 1 s on)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
    assert [r.status_code for r in stalled] == [200] * 8, [r.text for r in stalled]


async def test_a_redis_stall_while_a_request_waits_for_a_slot_is_no_spent_budget(
    nursery,
    redis_server,  # noqa: F811
    tmp_path,
):
    """A budget key at its max_concurrent: a request waits for a slot (Redis answers: none free),
    then Redis stalls while it asks again. It is refused for want of a slot, to retry in a second
    (found from outside: "has used its daily budget", Retry-After until midnight, which the SDKs
    obey; a write to Redis not yet answered lowers what this edge holds of the budget)."""
    keys = [KeyConfig(id="busy", key="sk-busy", max_concurrent=1, daily_tokens=10**12)]
    edge = await start_edge(
        nursery,
        edge_config(keys=keys, state=redis_server.url, admin_keys=[ADMIN], ledger=str(tmp_path / "l.sqlite3")),
    )
    slow = model("slow", ttft_ms=0, tokens_per_s=10, sim_tokens=30, sim_stops=True)  # 3 s
    await start_node(nursery, edge, [slow], node_id="n-slow")
    await eventually(lambda: edge.edge.shared.up, "leasing from redis")
    shared = edge.edge.shared
    key = edge.edge.keys.by_id["busy"]
    borrow = shared.borrow
    answers: list[bool] = []

    async def borrow_then_stall(*args, **kw):
        want = await borrow(*args, **kw)
        answers.append(want.got_slot)
        if len(answers) == 1:  # none free: Redis stalls before the request asks again
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
        return want

    with trio.fail_after(BOUND * 2):
        async with client(edge, "sk-busy") as c, trio.open_nursery() as n:
            n.start_soon(functools.partial(chat, c, "slow", max_tokens=100))
            await eventually(lambda: key.in_flight == 1, "one running")
            shared.borrow = borrow_then_stall
            try:
                refused = await chat(c, "slow", max_tokens=100)
            finally:
                os.kill(redis_server.proc.pid, signal.SIGCONT)
                shared.borrow = borrow
    assert answers[0] is False  # (asked Redis for a slot: none free)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded", refused.text
    assert "concurrent" in refused.json()["error"]["message"] and refused.headers["retry-after"] == "1"


@LOAD_BOUND
async def test_max_concurrent_holds_across_edges_under_load(nursery, redis_server, tmp_path):  # noqa: F811
    """max_concurrent 2, two edges, five clients on each retrying at once on 429 for 3 s:
    every request runs on a slot its edge holds in Redis, so at no moment do more than 2
    run (before: each edge admitted on the other's count as last published, and ran the
    key at 4 about half the time). A dead edge's slots are dropped after EDGE_TTL_S."""
    import redis as redis_client

    from edge.shared_state import EDGE_TTL_S

    keys = [KeyConfig(id="cc", key="sk-cc", max_concurrent=2)]
    edges = []
    for name in ("a", "b"):
        edge = await start_edge(
            nursery, edge_config(keys=keys, state=redis_server.url, ledger=str(tmp_path / f"{name}.sqlite3"))
        )
        await start_node(nursery, edge, [model("slow", ttft_ms=0, tokens_per_s=100, sim_tokens=5)], node_id=f"n-{name}")
        await eventually(lambda edge=edge: edge.edge.shared.up)
        edges.append(edge)
    key_of = [edge.edge.keys.by_id["cc"] for edge in edges]
    # An edge that died holding one slot, 1 s past the silence after which its entry goes.
    r = redis_client.Redis.from_url(redis_server.url)
    seconds, micros = r.time()
    r.hset("iop:flight:cc", "dead-edge", f"1 0 {seconds + micros / 1e6 - EDGE_TTL_S - 1:.6f}")
    peak, served = 0, 0
    with trio.fail_after(BOUND):
        stop = trio.current_time() + 3

        async def hammer(edge) -> None:
            nonlocal served
            async with client(edge, "sk-cc") as c:
                while trio.current_time() < stop:
                    status = (await chat(c, "slow")).status_code
                    assert status in (200, 429)
                    served += status == 200
                    if status == 429:
                        await trio.sleep(0.01)

        async def watch() -> None:
            nonlocal peak
            while trio.current_time() < stop:
                peak = max(peak, sum(key.in_flight for key in key_of))
                await trio.sleep(0.002)

        async with trio.open_nursery() as load:
            load.start_soon(watch)
            for edge in edges:
                for _ in range(5):
                    load.start_soon(hammer, edge)
    assert peak == 2
    assert served >= 3 * 2 / 0.05 / 2  # (each request runs about 50 ms: at least half the slots' time used)
    assert b"dead-edge" not in r.hgetall("iop:flight:cc")
    r.close()


@LOAD_BOUND
async def test_a_key_with_room_admits_on_a_spare_slot_without_a_round_trip(nursery, redis_server, tmp_path):  # noqa: F811
    """A max_concurrent key this edge used in the last seconds keeps one spare slot in Redis while
    a quarter of its limit stays free after it, and a budget key a slice of its budget: the next
    request is admitted on them, with no round trip (each request of such keys waited on one, one
    client sending one request after another: +1.1 and +1.3 ms to its first token, measured from
    outside; `iop_shared_state_borrows_total` counts the requests that wait). A key with less
    room holds none: a max_concurrent 2 key borrows for (nearly) every request."""
    import redis as redis_client

    keys = [
        KeyConfig(id="wide", key="sk-wide", max_concurrent=100),
        KeyConfig(id="tight", key="sk-tight", max_concurrent=2),
        KeyConfig(id="budget", key="sk-budget", daily_tokens=10**9),
    ]
    edge = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    shared = edge.edge.shared

    async def borrows_for(secret: str, pause: float = 0.0, held=None) -> int:
        async with client(edge, secret) as c:
            if held is not None:  # (its first request borrows; the next round holds the spare or the slice)
                assert (await chat(c)).status_code == 200
                await eventually(held, "a spare slot or a slice of the budget held")
            before = shared.borrows
            for _ in range(20):
                assert (await chat(c)).status_code == 200
                await trio.sleep(pause)
        return shared.borrows - before

    by_id = edge.edge.keys.by_id
    with trio.fail_after(BOUND):
        # (requests apart by more than a round: none finds its forerunner's slot held, not yet given
        # back; in a row, most did, and the count of borrows was 6 to 20, by the machine's speed)
        tight = await borrows_for("sk-tight", 3 * shared_state.SYNC_S)
        # (counted from the round that held them: a loaded CI machine's first rounds came late, and
        # 10 requests in a row borrowed before the slice came)
        wide = await borrows_for("sk-wide", held=lambda: by_id["wide"].flight_spare)
        budget = await borrows_for("sk-budget", held=lambda: by_id["budget"].budget_sliced)
        async with http(edge) as c:
            scraped = (await c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})).text
    assert wide <= 5 and budget <= 5, (wide, budget)
    assert tight >= 18, tight
    assert f"iop_shared_state_borrows_total {float(shared.borrows)}" in scraped
    r = redis_client.Redis.from_url(redis_server.url)

    def held() -> dict[str, int]:
        return {key: int(r.hget(f"iop:flight:{key}", edge.edge.id).split()[0]) for key in ("wide", "tight")}

    # none in flight: wide's spare (its last request's slot goes at the next round), no spare for tight
    await eventually(lambda: held() == {"wide": 1, "tight": 0}, "the spare slot alone held")
    r.close()


async def test_a_spare_slot_goes_as_soon_as_another_edge_needs_it(nursery, redis_server, tmp_path):  # noqa: F811
    """Edge a serves one request of a max_concurrent 8 key and keeps a spare slot (there was room);
    at once 8 requests of the key come to edge b: all 8 run together. (A first version of the
    spare slot kept it while edge a asked for it, 2 s after its last request: the key ran at 7,
    and b's 8th request was refused after its 0.5 s wait, found from outside.)"""
    keys = [KeyConfig(id="k8", key="sk-k8", max_concurrent=8)]
    edges = []
    for name in ("a", "b"):
        edge = await start_edge(
            nursery, edge_config(keys=keys, state=redis_server.url, ledger=str(tmp_path / f"{name}.sqlite3"))
        )
        models = [sim("qwen-a"), model("slow", ttft_ms=0, tokens_per_s=5, sim_tokens=8, max_concurrency=16)]
        await start_node(nursery, edge, models, node_id=f"n-{name}")
        await eventually(lambda edge=edge: edge.edge.shared.up)
        edges.append(edge)
    a, b = edges
    with trio.fail_after(BOUND):
        async with client(a, "sk-k8") as c:
            assert (await chat(c)).status_code == 200
        await eventually(lambda: a.edge.keys.by_id["k8"].flight_spare, "edge a holding its spare slot")
        answers = await burst(b, "sk-k8", 8, model="slow")
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers if r.status_code != 200]


async def test_one_client_taking_turns_between_edges_is_never_refused(nursery, redis_server, tmp_path):  # noqa: F811
    """max_concurrent 1 and a daily budget (so reservations too), one client sending one
    request at a time to two edges in turn (a round-robin balancer): never more than one in
    flight, so never refused (48 of 100 were: the slot stayed with the other edge until its
    next round). An edge that stops takes its slots out of Redis at once."""
    import redis as redis_client

    keys = [KeyConfig(id="rr", key="sk-rr", max_concurrent=1, daily_tokens=10_000_000)]
    a = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    b = await shared_edge(nursery, redis_server.url, tmp_path, "b", keys)
    with trio.fail_after(BOUND):
        async with client(a, "sk-rr") as ca, client(b, "sk-rr") as cb:
            statuses = [(await chat(c, max_tokens=8)).status_code for _ in range(30) for c in (ca, cb)]
        assert statuses == [200] * 60
        r = redis_client.Redis.from_url(redis_server.url)
        assert a.edge.id.encode() in r.hgetall("iop:flight:rr")
        a.stop()
        await eventually(lambda: a.edge.id.encode() not in r.hgetall("iop:flight:rr"), "edge a's entry gone")
        r.close()


async def test_a_postgresql_that_answers_nothing_is_503_in_bounded_time(nursery, postgres, postgres_url, monkeypatch):  # noqa: F811
    """PostgreSQL stopped dead (SIGSTOP: its sockets open, no answer, no error): a revocation and a
    usage query waited for it for as long as it hung. The usage query is 503 `ledger_unavailable`
    once the ledger gives up the call (CALL_TIMEOUT_S, 1 s here); the revocation is a 202 at once
    (the key refused here; the ledger stores it when it answers: the others, queued behind it,
    find no key); other clients go on; once the server answers again the revocation is stored
    and the records kept are written."""
    from edge import ledger

    monkeypatch.setattr(ledger, "CALL_TIMEOUT_S", 1.0)
    edge = await pg_edge(nursery, postgres_url)
    paused: list[int] = []
    try:
        with trio.fail_after(BOUND * 2):
            async with admin(edge) as adm:
                secret = (await adm.post("/v1/admin/keys", json={"id": "k"})).json()["key"]
                other = (await adm.post("/v1/admin/keys", json={"id": "k2"})).json()["key"]
                async with client(edge, secret) as c:
                    assert (await chat(c)).status_code == 200
                    assert await edge.edge.ledger.flush()
                    paused = postgres.pause()
                    refused: list[httpx.Response] = []
                    with trio.fail_after(BOUND / 2):  # (queued, ten took 15 s each, plus their connects)
                        async with trio.open_nursery() as admins:
                            for _ in range(10):
                                admins.start_soon(lambda: _append(refused, adm.delete("/v1/admin/keys/k")))
                            admins.start_soon(lambda: _append(refused, adm.get("/v1/admin/usage")))
                    codes = sorted(r.status_code for r in refused)
                    assert codes == [202] + [404] * 9 + [503], [r.text for r in refused]
                    usage = next(r for r in refused if r.status_code == 503)
                    assert usage.json()["error"]["code"] == "ledger_unavailable"
                    assert (await chat(c)).status_code == 401  # revoked here at once
                    async with client(edge, other) as c2:
                        assert (await chat(c2)).status_code == 200  # another key served: its record kept
                    postgres.resume(paused)
                    paused = []
                    ledger_ = edge.edge.ledger
                    await eventually(lambda: not ledger_.revoking, "the revocation stored")
                    await eventually(lambda: ledger_.written == 2 and not ledger_.pending, "the records stored")
                    rows = (await adm.get("/v1/admin/usage", params={"group_by": "key"})).json()["data"]
        assert [(row["key"], row["requests"]) for row in rows] == [("k", 1), ("k2", 1)]  # the record kept: once
    finally:
        postgres.resume(paused)


async def test_a_key_id_live_on_another_edge_is_not_made_again(nursery, postgres_url):  # noqa: F811
    """A POST of an id another edge made a moment ago (before this edge read it) replaced that
    key's secret and policy, the first secret refused everywhere: it is a 409, the key as it was."""
    a = await pg_edge(nursery, postgres_url)
    b = await pg_edge(nursery, postgres_url)
    with trio.fail_after(BOUND):
        async with admin(a) as admin_a, admin(b) as admin_b:
            secret = (await admin_a.post("/v1/admin/keys", json={"id": "carol"})).json()["key"]
            again = await admin_b.post("/v1/admin/keys", json={"id": "carol", "rpm": 1000})
            if "carol" not in b.edge.keys.by_id:  # (not read yet by b: the ledger's answer)
                assert again.status_code == 409 and "another edge" in again.json()["error"]["message"], again.text
            await eventually(lambda: "carol" in b.edge.keys.by_id, "edge b reads the key")
        for edge in (a, b):
            async with client(edge, secret) as c:
                assert (await chat(c)).status_code == 200


@pytest.mark.parametrize("down", ["stopped", "paused"])
async def test_a_key_revoked_while_the_ledger_is_down_is_refused_at_once_and_stored_later(
    nursery,
    postgres,  # noqa: F811
    postgres_url,  # noqa: F811
    down,
):
    """PostgreSQL down (stopped, or SIGSTOPped: it answers nothing): revoking a (leaked) key is a
    202 within REVOKE_WAIT_S, and the key is refused here at once; the revocation is stored once
    the ledger answers (an edge started then refuses it too), and the key table read meanwhile
    does not bring it back. It was a 503 after 15 s, the key served on both edges for the outage,
    and stored anyway once the database woke (an outside audit); then a 202 after 15 s, the admin
    API's other writes held behind it (an outside re-check)."""
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=postgres_url))
    await start_node(nursery, edge, [sim("qwen-a")], node_id="n-a")
    stopped = False
    try:
        with trio.fail_after(BOUND * 2):
            async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND, headers=ADMIN_H) as adm:
                made = await adm.post("/v1/admin/keys", json={"id": "leak"})
                assert made.status_code == 201, made.text
                async with client(edge, made.json()["key"]) as c:
                    assert (await chat(c)).status_code == 200
                    if down == "stopped":
                        await trio.to_thread.run_sync(postgres.stop)
                    else:
                        paused = postgres.pause()
                    stopped = True
                    asked = trio.current_time()
                    gone = await adm.delete("/v1/admin/keys/leak")
                    took = trio.current_time() - asked
                    after = await chat(c)
                    if down == "stopped":
                        await trio.to_thread.run_sync(postgres.start)
                    else:
                        postgres.resume(paused)
                    stopped = False
                    await eventually(lambda: not edge.edge.ledger.revoking, "stored")
                    await trio.sleep(ledger_module.KEYS_REFRESH_S + 0.5)  # (a read of the key table since)
                    later = await chat(c)
                    second = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=postgres_url))
                    await start_node(nursery, second, [sim("qwen-a")], node_id="n-b")
                    async with client(second, made.json()["key"]) as c2:
                        elsewhere = await chat(c2)
    finally:
        if stopped and down == "stopped":
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(postgres.start)
        elif stopped:
            postgres.resume(paused)
    assert gone.status_code == 202 and gone.json()["stored"] is False, gone.text
    assert took < admin_module.REVOKE_WAIT_S + 3, took  # (15 s when the database hung)
    assert after.status_code == 401 and later.status_code == 401 and elsewhere.status_code == 401


async def test_a_key_id_revoked_on_another_edge_can_be_made_again_at_once(nursery, postgres_url):  # noqa: F811
    """A key revoked on one edge and made again on another at once (a secret rotated behind a
    load balancer) was a 409 "exists" for up to 2 s, until the second edge read the key table.
    The ledger says whether the id is live: a 201, the new secret works on both edges, the old
    on neither; an id live everywhere is still a 409."""
    a = await pg_edge(nursery, postgres_url)
    b = await pg_edge(nursery, postgres_url)
    with trio.fail_after(BOUND):
        async with admin(a) as admin_a, admin(b) as admin_b:
            old = (await admin_a.post("/v1/admin/keys", json={"id": "dave"})).json()["key"]
            await eventually(lambda: "dave" in b.edge.keys.by_id, "edge b reads the key")
            assert (await admin_b.post("/v1/admin/keys", json={"id": "dave"})).status_code == 409
            assert (await admin_a.delete("/v1/admin/keys/dave")).status_code == 200
            assert not b.edge.keys.by_id["dave"].revoked  # (b has not read the table since)
            made = await admin_b.post("/v1/admin/keys", json={"id": "dave", "rpm": 1000})
            assert made.status_code == 201, made.text
            new = made.json()["key"]
            await eventually(lambda: "dave" in a.edge.keys.by_id, "edge a reads the new key")
        for edge in (a, b):
            async with client(edge, new) as c:
                assert (await chat(c)).status_code == 200
            async with client(edge, old) as c:
                assert (await chat(c)).status_code == 401


async def _append(into: list, request) -> None:
    into.append(await request)


async def test_an_edge_started_while_its_ledger_cannot_be_read_asks_for_a_key(nursery, postgres, postgres_url):  # noqa: F811
    """An edge started while its PostgreSQL answered nothing served requests with no key for the
    whole outage (its keys unknown, it counted as open). It asks for a key until it has read the
    key table: then it is keyed as the table says (a ledger with no key: open)."""
    import psycopg

    first = await pg_edge(nursery, postgres_url)
    with trio.fail_after(BOUND * 2):
        async with admin(first) as adm:
            secret = (await adm.post("/v1/admin/keys", json={"id": "k"})).json()["key"]
        empty = postgres_url.rsplit("/", 1)[0] + f"/t{time.monotonic_ns()}"
        with psycopg.connect(postgres.url, autocommit=True) as db:
            db.execute(f"CREATE DATABASE {empty.rsplit('/', 1)[1]}")
        paused = postgres.pause()
        try:
            edges = [await pg_edge(nursery, url) for url in (postgres_url, empty)]  # (each waits out its connect)
            for edge in edges:
                async with client(edge, "sk-none") as c:
                    assert (await chat(c)).status_code == 401
        finally:
            postgres.resume(paused)
        keyed, opened = edges
        await eventually(lambda: not keyed.edge.keys.unread and not opened.edge.keys.unread, "the keys read")
        async with client(keyed, "sk-none") as c:
            assert (await chat(c)).status_code == 401
        async with client(keyed, secret) as c:
            assert (await chat(c)).status_code == 200
        async with client(opened, "sk-none") as c:
            assert (await chat(c)).status_code == 200


async def test_a_revocation_applies_while_this_edges_records_wait_on_a_locked_table(nursery, postgres_url):  # noqa: F811
    """Edge a's batch of records waits on a `usage` table locked by another session (a long
    report, a migration): a key revoked on edge b still stops working on a within a few
    seconds (one task did both: the revocation waited behind the batch, 7.5-15 s), and every
    request served is stored once the lock goes."""
    import psycopg

    a = await pg_edge(nursery, postgres_url)
    b = await pg_edge(nursery, postgres_url)
    locker = await trio.to_thread.run_sync(psycopg.connect, postgres_url)
    served = 0
    try:
        with trio.fail_after(BOUND * 2):
            async with admin(a) as admin_a, admin(b) as admin_b, client(a, "") as c:
                secret = (await admin_a.post("/v1/admin/keys", json={"id": "k"})).json()["key"]
                c.headers["authorization"] = f"Bearer {secret}"
                assert (await chat(c)).status_code == 200
                assert await a.edge.ledger.flush()
                await eventually(lambda: "k" in b.edge.keys.by_id, "edge b reads the key")
                await trio.to_thread.run_sync(locker.execute, "LOCK TABLE usage IN ACCESS EXCLUSIVE MODE")
                assert (await chat(c)).status_code == 200
                await eventually(lambda: a.edge.ledger._in_flight, "a's batch waits on the lock")
                assert (await admin_b.delete("/v1/admin/keys/k")).status_code == 200
                with trio.fail_after(8):  # (the refresh runs every 2 s; the batch waits 15 s before it is given up)
                    while (r := await chat(c)).status_code == 200:
                        served += 1
                        await trio.sleep(0.2)
                assert r.status_code == 401, r.text
                await trio.to_thread.run_sync(locker.rollback)
                ledger = a.edge.ledger
                await eventually(lambda: not ledger.pending, "the records stored")
                rows = (await admin_a.get("/v1/admin/usage", params={"group_by": "key"})).json()["data"]
    finally:
        await trio.to_thread.run_sync(locker.close)
    assert [(row["key"], row["requests"]) for row in rows] == [("k", 2 + served)]


async def test_a_request_that_finds_redis_gone_is_judged_by_the_edges_own_view(nursery, redis_server, tmp_path):  # noqa: F811
    """Redis dies between two requests of a key well under its rpm: the next request's borrow
    fails, and it is judged as with Redis down (this edge's view of the key's minute), not by
    the slice this edge held (it was a 429 with 54 of 60 left, until a lease round noticed)."""
    keys = [KeyConfig(id="k", key="sk-k", rpm=60)]
    edge = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    with trio.fail_after(BOUND * 2):
        async with client(edge, "sk-k") as c:
            for _ in range(5):
                assert (await chat(c)).status_code == 200
            await trio.to_thread.run_sync(redis_server.stop)
            key = edge.edge.keys.by_id["k"]
            if edge.edge.keys.shared:  # Redis not yet seen gone: the slice is used up (a lease round could
                key.req_level = 0.0  # have refilled it after the fifth request), so the request borrows
            r = await chat(c)
    assert r.status_code == 200, r.text
    assert not edge.edge.shared.up


async def test_the_first_usage_query_after_a_postgresql_restart_is_answered(nursery, postgres, postgres_url):  # noqa: F811
    """The reads' connection outlived a PostgreSQL restart: the first /v1/admin/usage after
    it was a 503 ledger_unavailable ("terminating connection"), the second a 200 (an outside
    audit). A read that fails on an old connection is tried again on a new one."""
    edge = await pg_edge(nursery, postgres_url)
    with trio.fail_after(BOUND * 2):
        async with admin(edge) as adm:
            assert (await adm.get("/v1/admin/usage")).status_code == 200  # (the reads' connection is made)
            await trio.to_thread.run_sync(postgres.stop)
            await trio.to_thread.run_sync(postgres.start)
            for path in ("/v1/admin/usage", "/v1/admin/keys"):
                r = await adm.get(path)
                assert r.status_code == 200, (path, r.text)


async def test_redis_gone_while_no_request_comes_is_seen(nursery, redis_server, tmp_path):  # noqa: F811
    """With only rpm/tpm keys and no traffic, a round had nothing to write and never asked
    Redis: iop_shared_state_up read 1 for as long as Redis was gone. It is asked every
    REFRESH_S now, and the metric reads 0 within seconds."""
    keys = [KeyConfig(id="k", key="sk-k", rpm=60, tpm=100_000)]
    edge = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)

    async def up(c: httpx.AsyncClient) -> str:
        metrics = (await c.get("/metrics")).text
        return next(line.split()[-1] for line in metrics.splitlines() if line.startswith("iop_shared_state_up"))

    with trio.fail_after(BOUND * 2):
        async with admin(edge) as adm:
            assert await up(adm) == "1.0"
            await trio.to_thread.run_sync(redis_server.stop)
            with trio.fail_after(8):  # (REFRESH_S is 1 s, a Redis call's timeout 1 s)
                while await up(adm) != "0.0":
                    await trio.sleep(0.1)


async def test_what_a_killed_edge_streamed_is_the_days_use_and_a_paused_ones_is_counted_once(
    nursery,
    redis_server,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """Two edges share a budget key; edge b is an `iop edge` process streaming for it. SIGKILLed
    mid-stream, b never reports the stream's end: what it had streamed (its last write to Redis)
    goes into the day's counter once its silence passes the edges' TTL (it was dropped, and
    never counted: an outside audit). SIGSTOPped past the TTL and continued instead, its stream
    is folded in the same way, and its own report at the end adds only the rest: the day's
    counter is the stream's usage, not that and the fold; and b does not count its own folded
    tokens as other edges' use (a re-check: its stream was cut at 805 of 900 tokens, under
    budget)."""
    import redis

    monkeypatch.setattr(shared_state, "EDGE_TTL_S", 2)  # (edge a's judgement of b's silence)
    # f: the paused stream (1,610 tokens) fits its budget, but not with its folded part twice
    keys = [KeyConfig(id="f", key="sk-f", daily_tokens=1_650), KeyConfig(id="g", key="sk-g", daily_tokens=10**6)]
    a = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    port = free_port()
    cfg = write_toml(
        tmp_path / "b.toml",
        {
            "bind": f"127.0.0.1:{port}",
            "node_token": TOKEN,
            "ledger": str(tmp_path / "b.sqlite3"),
            "state": redis_server.url,
            "keys": [{"id": k.id, "key": k.key, "daily_tokens": k.daily_tokens} for k in keys],
        },
    )
    proc = _edge_process(cfg, tmp_path / "b.stderr")
    store = redis.Redis.from_url(redis_server.url, decode_responses=True)
    day = a.edge.keys.by_id["f"].day
    streamed, folded, counter = f"iop:streamed:f:{day}", f"iop:folded:f:{day}", f"iop:day:f:{day}"
    bodies: list[str] = []

    def redis_int(name: str) -> int:
        return int(store.get(name) or 0)

    def b_streamed() -> int:
        fields = store.hgetall(streamed)
        return sum(int(v.split()[0]) for v in fields.values())

    try:
        with trio.fail_after(BOUND * 2):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=BOUND) as c:
                await _serving(c)
                long = model("long", ttft_ms=0, tokens_per_s=400, sim_tokens=1600)
                node = NodeAgent(node_config([f"ws://127.0.0.1:{port}/v1/node/link"], [long], "n-b", ping_misses=10))
                await nursery.start(node.serve)
                c.headers["Authorization"] = "Bearer sk-f"
                body = {
                    "model": "long",
                    "messages": MESSAGES,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                usage: list[int] = []

                async def stream() -> None:
                    with contextlib.suppress(httpx.RemoteProtocolError):  # (edge b killed)
                        await _stream()

                async def _stream() -> None:
                    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        assert r.status_code == 200, await r.aread()
                        async for line in r.aiter_lines():
                            bodies.append(line)
                            if line.startswith("data: {") and '"usage":{' in line:
                                usage.append(json.loads(line[6:])["usage"]["total_tokens"])

                await eventually(lambda: b_streamed() == 0, "edge b linked")  # (nothing streams yet)
                while (await c.get("/v1/models")).json()["data"] == []:
                    await trio.sleep(0.05)
                # Paused past the TTL: folded, then counted once.
                async with trio.open_nursery() as n:
                    n.start_soon(stream)
                    await eventually(lambda: b_streamed() >= 200, "edge b streams")
                    os.kill(proc.pid, signal.SIGSTOP)
                    try:
                        await eventually(lambda: store.hgetall(folded), "edge a folds b's stream in")
                        at_fold = int(next(iter(store.hgetall(folded).values())))
                        assert at_fold >= 200 and redis_int(counter) >= at_fold
                    finally:
                        os.kill(proc.pid, signal.SIGCONT)
                assert len(usage) == 1 and usage[0] > 1600, usage
                assert not [line for line in bodies if "insufficient_quota" in line]
                await eventually(lambda: redis_int(counter) >= usage[0], "edge b reports its stream")
                await trio.sleep(0.5)  # (a round or two more: nothing is added twice)
                assert redis_int(counter) == usage[0], (redis_int(counter), usage, at_fold)
                # Killed mid-stream: what it had streamed is the day's use (key g).
                streamed, counter = f"iop:streamed:g:{day}", f"iop:day:g:{day}"
                c.headers["Authorization"] = "Bearer sk-g"
                before = redis_int(counter)
                async with trio.open_nursery() as n:
                    n.start_soon(stream)
                    await eventually(lambda: b_streamed() >= 200, "edge b streams again")
                    proc.kill()
                    await trio.to_thread.run_sync(proc.wait)
                    last = b_streamed()  # (b's last write, there until a folds it)
                    n.cancel_scope.cancel()
                await eventually(lambda: not store.exists(streamed), "edge a folds b's stream in")
                assert redis_int(counter) == before + last, (redis_int(counter), before, last)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_end, proc)


async def test_keys_at_rest_are_read_in_one_script_not_written_every_second(nursery, redis_server, tmp_path):  # noqa: F811
    """300 keys with a daily budget and a concurrency limit, one of them used once, then all at
    rest: each was written by two scripts every second (500 idle keys cost 142,000 Redis
    commands in 10 s and 8% of a core on every edge, found from outside); now the edge reads
    them, many in one script. What another edge spends of one of them is still seen."""
    import redis

    keys = [KeyConfig(id=f"q{i}", key=f"sk-q{i}", daily_tokens=10**6, max_concurrent=4) for i in range(300)]
    a = await shared_edge(nursery, redis_server.url, tmp_path, "a", keys)
    b = await shared_edge(nursery, redis_server.url, tmp_path, "b", keys[:1])
    store = redis.Redis.from_url(redis_server.url)

    def scripts() -> int:
        return int(store.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    with trio.fail_after(BOUND * 2):
        async with client(a, "sk-q0") as c:
            assert (await chat(c)).status_code == 200
        await trio.sleep(shared_state.SLICE_FOR_S + 2 * shared_state.REFRESH_S)  # (its slice and spare go back)
        before, start = await trio.to_thread.run_sync(scripts), trio.current_time()
        await trio.sleep(3)
        calls = await trio.to_thread.run_sync(scripts) - before
        per_key_second = calls / len(keys) / (trio.current_time() - start)
        print(f"\nRedis script calls per key at rest and second: {per_key_second:.3f} (two edges)")
        assert per_key_second < 0.2, calls  # (it was 2 for edge a's keys alone)
        async with client(b, "sk-q0") as c:
            spent = (await chat(c)).json()["usage"]["total_tokens"]
        used = a.edge.keys.by_id["q0"].day_used
        await eventually(lambda: a.edge.keys.by_id["q0"].today_tokens() == used + spent, "edge a sees b's use")
        await eventually(lambda: a.edge.keys.by_id["q0"].others_pending == 0, "and no request of b's in flight")
