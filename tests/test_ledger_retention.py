"""`ledger_retention_days`: records of days past it are folded into per-day totals; every usage
answer (the admin API, a key's usage to date, `iop usage`) is what it was, the rows are not."""

from __future__ import annotations

import sqlite3
import sys
import threading
import time

import httpx
import trio

from edge import ledger
from edge.config import KeyConfig
from scripts.stack import write_toml
from tests.conftest import BOUND, edge_config, eventually, start_edge, start_node
from tests.servers import postgres, postgres_url  # noqa: F401  (fixtures)
from tests.test_keys import ADMIN, ADMIN_H, chat, client, sim

DAY = 86400
GROUPINGS = [[], ["key"], ["key", "model", "day"], ["node", "api", "day"], ["model"]]


def history(today: float, days_back: list[int], each: int) -> list[tuple]:
    """``each`` records on each of those days before ``today`` (a midnight): two keys, two models,
    two nodes, every fifth a 429, every seventh estimated, spread over the day."""
    rows = []
    for back in days_back:
        day = today - back * DAY
        for i in range(each):
            status, outcome = (429, "rejected_429") if i % 5 == 0 else (200, "complete")
            rows.append(
                (
                    day + (i * DAY) / each,
                    f"req_{back}_{i}",
                    ("alice", "bob", None)[i % 3],
                    ("qwen-a", "llama-b")[i % 2],
                    ("n1", "n2")[i % 4 // 2],
                    ("chat", "messages", "responses")[i % 3],
                    status,
                    outcome,
                    0 if status == 429 else 10 + i % 7,
                    0 if status == 429 else 3 + i % 11,
                    1 if i % 7 == 0 else 0,
                    5.0,
                    50.0,
                )
            )
    return rows


def answers(db, dialect) -> list:
    return [ledger.query_usage(db, dialect, None, None, g) for g in GROUPINGS]


async def test_days_past_the_retention_are_folded_and_every_usage_answer_stays(nursery, tmp_path):
    """A ledger with 45,000 records of days 10, 5 and 3 back, and of yesterday: an edge with
    `ledger_retention_days = 2` folds the three old days (in transactions of 5,000 records at
    most) at its start into per-day totals, keeps yesterday's and today's records, and answers
    every grouping, a key's usage to date and `iop usage` as before, today's requests added."""
    path = str(tmp_path / "ledger.sqlite3")
    today = (time.time() // DAY) * DAY
    db = ledger.connect(path)
    old = history(today, [10, 5, 3], 15_000)
    kept = history(today, [1], 300)
    db.executemany("INSERT INTO usage VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", old + kept)
    dialect = ledger.Dialect(False)
    before = answers(db, dialect)
    db.close()

    keys = [KeyConfig(id="alice", key="sk-alice"), KeyConfig(id="bob", key="sk-bob")]
    edge = await start_edge(nursery, edge_config(keys=keys, admin_keys=[ADMIN], ledger=path, ledger_retention_days=2))
    await start_node(nursery, edge, [sim("qwen-a")])
    with trio.fail_after(BOUND):
        await eventually(lambda: edge.edge.ledger.folded == len(old), "the old days folded")
        told = 0
        async with client(edge, "sk-alice") as c:
            for _ in range(2):
                r = await chat(c)
                assert r.status_code == 200
                told += r.json()["usage"]["total_tokens"]
        async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND, headers=ADMIN_H) as admin:
            now = []
            for g in GROUPINGS:
                r = await admin.get("/v1/admin/usage", params={"group_by": ",".join(g)} if g else {})
                assert r.status_code == 200, r.text
                now.append(r.json()["data"])
            listed = {k["id"]: k["usage"] for k in (await admin.get("/v1/admin/keys")).json()["data"]}
            # A range that holds a folded day's midnight counts that whole day; one from its noon, none of it.
            day5 = time.strftime("%Y-%m-%d", time.gmtime(today - 5 * DAY))
            day4 = time.strftime("%Y-%m-%d", time.gmtime(today - 4 * DAY))
            whole = (await admin.get("/v1/admin/usage", params={"from": day5, "to": day4})).json()["data"]
            noon = time.strftime("%Y-%m-%dT12:00:00Z", time.gmtime(today - 5 * DAY))
            after_noon = (await admin.get("/v1/admin/usage", params={"from": noon, "to": day4})).json()["data"]
    (total_before, by_key_before, *_) = before
    assert now[0][0]["requests"] == total_before[0]["requests"] + 2
    assert now[0][0]["total_tokens"] == total_before[0]["total_tokens"] + told
    alice_now = next(r for r in now[1] if r["key"] == "alice")
    alice_before = next(r for r in by_key_before if r["key"] == "alice")
    assert alice_now["requests"] == alice_before["requests"] + 2
    assert alice_now["total_tokens"] == alice_before["total_tokens"] + told
    assert [r for r in now[1] if r["key"] != "alice"] == [r for r in by_key_before if r["key"] != "alice"]
    # The old days' rows, to the field; today's are the only new ones.
    today_s = time.strftime("%Y-%m-%d", time.gmtime(today))
    for g, was, is_now in zip(GROUPINGS[2:4], before[2:4], now[2:4], strict=True):
        assert [r for r in is_now if r["day"] != today_s] == was, g
    assert [r for r in now[4] if r["model"] != "qwen-a"] == [r for r in before[4] if r["model"] != "qwen-a"]
    assert listed["alice"]["requests"] == alice_before["requests"] + 2
    assert listed["bob"]["requests"] == next(r for r in by_key_before if r["key"] == "bob")["requests"]
    assert whole[0]["requests"] == 15_000 and after_noon == []
    # The records are gone but for yesterday's and today's; a few rows per day stand for them.
    db = sqlite3.connect(path)
    try:
        assert db.execute("SELECT COUNT(*) FROM usage WHERE ts < ?", (today - DAY,)).fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM usage").fetchone()[0] == len(kept) + 2
        assert 0 < db.execute("SELECT COUNT(*) FROM usage_days").fetchone()[0] <= 3 * 3 * 2 * 2 * 3 * 3
    finally:
        db.close()
    # `iop usage` prints the same from the file.
    cfg = write_toml(tmp_path / "edge.toml", {"ledger": path})
    with trio.fail_after(60):
        out = await trio.run_process(
            [sys.executable, "-m", "iop.cli", "usage", "--config", str(cfg), "--group-by", "key", "--format", "json"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    assert httpx.Response(200, content=out.stdout).json() == now[1]


def test_edges_sharing_a_postgres_ledger_fold_each_record_once(postgres_url):  # noqa: F811
    """Four edges' folds of one PostgreSQL ledger at once, in small transactions: every record
    is folded once (the totals are what they were), none of today's or yesterday's."""
    today = (time.time() // DAY) * DAY
    db = ledger.connect(postgres_url)
    dialect = ledger.Dialect(True)
    db.execute("DELETE FROM usage")
    db.execute("DELETE FROM usage_days")
    rows = history(today, [9, 8, 3], 2_000) + history(today, [1, 0], 200)
    with db.cursor() as cur:
        cur.executemany(dialect.sql("INSERT INTO usage VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)"), rows)
    before = answers(db, dialect)
    folded: list[int] = []
    failed: list[str] = []
    start = threading.Barrier(4)

    def fold() -> None:
        conn = ledger.connect(postgres_url, schema=False)
        try:
            start.wait()
            n = 0
            while got := ledger.fold_oldest(conn, dialect, today - 2 * DAY, most=250):
                n += got
            folded.append(n)
        except Exception as e:
            failed.append(f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    threads = [threading.Thread(target=fold) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    try:
        assert failed == [] and sum(folded) == 6_000
        assert answers(db, dialect) == before
        assert db.execute("SELECT COUNT(*) FROM usage").fetchone()[0] == 400
    finally:
        db.execute("DELETE FROM usage")
        db.execute("DELETE FROM usage_days")
        db.close()


async def test_usage_is_answered_during_a_fold_under_steady_traffic(nursery, tmp_path, monkeypatch):
    """An edge turning retention on for a grown ledger folds it at its start while requests come
    steadily: /v1/admin/usage and the key list waited for the whole fold (10 s for 900,000
    records: a re-check), each flush of the records they wait for queued behind the fold's
    transactions on one connection, and the records kept coming. They are answered while the
    fold goes on, and what they say of the old days is what they said before it."""
    monkeypatch.setattr(ledger, "FOLD_ROWS", 300)
    path = str(tmp_path / "ledger.sqlite3")
    today = (time.time() // DAY) * DAY
    db = ledger.connect(path)
    old = history(today, [4, 3], 9_000)
    db.executemany("INSERT INTO usage VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", old)
    before = ledger.query_usage(db, ledger.Dialect(False), None, today, ["day"])
    db.close()
    keys = [KeyConfig(id="alice", key="sk-alice")]
    edge = await start_edge(nursery, edge_config(keys=keys, admin_keys=[ADMIN], ledger=path, ledger_retention_days=2))
    await start_node(nursery, edge, [sim("qwen-a")])
    seen = []
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as traffic:
            done = trio.Event()

            async def steady() -> None:  # (each request let finish: one cut leaves httpx's stream unclosed)
                async with client(edge, "sk-alice") as c:
                    while not done.is_set():
                        assert (await chat(c)).status_code == 200
                        await trio.sleep(0.02)

            traffic.start_soon(steady)
            await eventually(lambda: edge.edge.ledger.folded > 0, "the fold begun")
            async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND, headers=ADMIN_H) as admin:
                for _ in range(3):
                    r = await admin.get(
                        "/v1/admin/usage",
                        params={"group_by": "day", "to": time.strftime("%Y-%m-%d", time.gmtime(today))},
                    )
                    keys_listed = await admin.get("/v1/admin/keys")
                    seen.append((edge.edge.ledger.folded, r.status_code, r.json()["data"], keys_listed.status_code))
            done.set()
        await eventually(lambda: edge.edge.ledger.folded == len(old), "the fold done")
    assert [s[1:] for s in seen] == [(200, before, 200)] * 3
    assert seen[-1][0] < len(old), seen[-1][0]  # (answered with the fold still going on)


def test_a_fold_takes_its_most_records_however_many_share_one_time(tmp_path):
    """Records at one and the same time (a bulk import, a spool): a fold's transaction held
    the lock for all of them, a second a time in a re-check's ledger (keys made and usage asked
    meanwhile waited). Each transaction takes at most its share."""
    db = ledger.connect(str(tmp_path / "l.sqlite3"))
    today = (time.time() // DAY) * DAY
    rows = [(r[0] - r[0] % DAY, *r[1:]) for r in history(today, [5], 3_000)]  # (all at the day's midnight)
    db.executemany("INSERT INTO usage VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    dialect = ledger.Dialect(False)
    before = answers(db, dialect)
    assert [ledger.fold_oldest(db, dialect, today - 2 * DAY, most=1_000) for _ in range(4)] == [1000, 1000, 1000, 0]
    assert answers(db, dialect) == before
    db.close()
