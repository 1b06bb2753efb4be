"""The ledger's spool: records an edge could not store when it stopped are kept in its
state_dir and stored by the next edge (PostgreSQL down at a SIGTERM, a SQLite file locked)."""

from __future__ import annotations

import glob
import json
import os
import sqlite3
import threading
import time

import httpx
import structlog
import trio

from edge import ledger, ledger_spool
from edge.config import KeyConfig
from node.agent import NodeAgent
from scripts.stack import free_port, write_toml
from tests.conftest import BOUND, TOKEN, edge_config, eventually, node_config, start_edge, start_node
from tests.servers import postgres, postgres_url  # noqa: F401  (fixtures)
from tests.test_keys import ADMIN, ADMIN_H, chat, client, sim
from tests.test_keys_shared import _edge_process, _end, _serving


def spool_files(state) -> list[str]:
    return sorted(glob.glob(os.path.join(state, "ledger-spool-*")))


def a_record(i: int) -> tuple:
    return (time.time() - 100 + i, f"req_{i:024x}", "k", "qwen-a", "n1", "chat", 200, "complete", 5, 8, 0, 1.5, 2.5)


def lines_of(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        return f.read().splitlines(keepends=True)


def claimed_and_damaged(spooled: str) -> None:
    """The spool file as its edge left it (claimed), a line of it damaged and its last cut short."""
    lines = lines_of(spooled)
    lines.insert(5, b'{"not": "a record"}\n')
    os.rename(spooled, spooled + ".claimed")
    with open(spooled + ".claimed", "wb") as f:
        f.write(b"".join(lines) + lines[9][:40])


def rows(path) -> tuple[int, int]:
    """(rows, distinct request ids) of a SQLite ledger's usage table."""
    with sqlite3.connect(path) as db:
        return db.execute("SELECT COUNT(*), COUNT(DISTINCT request_id) FROM usage").fetchone()


async def test_an_edge_stopped_while_postgresql_is_down_leaves_its_records_to_the_next(
    tmp_path,
    postgres,  # noqa: F811
    postgres_url,  # noqa: F811
):
    """The audit's case: PostgreSQL stopped, 20 requests served by `iop edge`, the edge SIGTERMed,
    PostgreSQL started, another edge started on the same state_dir: the 20 records are in the
    ledger, once each, and the spool file is gone. (The edge exited holding them: 0 of the 20
    stored, its log saying they were kept, iop_ledger_dropped_total not counting them.)"""
    import psycopg

    state = tmp_path / "state"

    def config(name: str) -> tuple[int, str]:
        port = free_port()
        cfg = {
            "bind": f"127.0.0.1:{port}",
            "node_token": TOKEN,
            "admin_keys": [ADMIN],
            "ledger": postgres_url,
            "state_dir": str(state),
            "keys": [{"id": "k", "key": "sk-k"}],
        }
        return port, write_toml(tmp_path / f"{name}.toml", cfg)

    def stored() -> tuple[int, int]:
        with psycopg.connect(postgres_url) as db:
            return db.execute("SELECT COUNT(*), COUNT(DISTINCT request_id) FROM usage WHERE key = 'k'").fetchone()

    port, cfg = config("a")
    first = _edge_process(cfg, tmp_path / "a.stderr")
    stopped = False
    try:
        with trio.fail_after(BOUND * 3):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=BOUND) as c:
                await _serving(c)
                c.headers["Authorization"] = "Bearer sk-k"
                node = NodeAgent(node_config([f"ws://127.0.0.1:{port}/v1/node/link"], [sim("qwen-a")], "n-a"))
                async with trio.open_nursery() as linked:
                    await linked.start(node.serve)
                    while (await c.get("/v1/models")).json()["data"] == []:
                        await trio.sleep(0.05)
                    await trio.to_thread.run_sync(postgres.stop)
                    stopped = True
                    for _ in range(20):
                        assert (await chat(c)).status_code == 200
                    while "iop_ledger_pending 20.0" not in (await c.get("/metrics", headers=ADMIN_H)).text:
                        await trio.sleep(0.05)
                    await trio.to_thread.run_sync(_end, first)
                    linked.cancel_scope.cancel()
            assert first.returncode == 0
            (spooled,) = spool_files(state)
            assert len(lines_of(spooled)) == 20
            await trio.to_thread.run_sync(postgres.start)
            stopped = False
            assert await trio.to_thread.run_sync(stored) == (0, 0)
            port, cfg = config("b")
            second = _edge_process(cfg, tmp_path / "b.stderr")
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=BOUND) as c:
                    await _serving(c)
                    while spool_files(state) or await trio.to_thread.run_sync(stored) != (20, 20):
                        await trio.sleep(0.05)
                    await trio.sleep(1.0)  # (two flushes more: nothing is stored twice)
                    assert await trio.to_thread.run_sync(stored) == (20, 20)
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(_end, second)
    finally:
        with trio.CancelScope(shield=True):
            if stopped:
                await trio.to_thread.run_sync(postgres.start)
            await trio.to_thread.run_sync(_end, first)
    events = [json.loads(line) for line in (tmp_path / "a.stderr").read_text().splitlines() if line.strip()]
    (warned,) = [e for e in events if e["msg"].startswith("ledger records spooled")]
    assert warned["level"] == "warning" and warned["records"] == 20 and warned["path"] == spooled
    assert not [e for e in events if e["level"] in ("error", "critical")]
    events = [json.loads(line) for line in (tmp_path / "b.stderr").read_text().splitlines() if line.strip()]
    (queued,) = [e for e in events if e["msg"].startswith("spooled ledger records queued")]
    assert queued["records"] == 20 and queued["files"] == [spooled + ".claimed"]
    assert [e["files"] for e in events if e["msg"] == "spooled ledger records written"] == [1]


async def _serve_and_stop(
    cfg, requests: int, holder: sqlite3.Connection, let_go_s: float | None = None
) -> ledger.Ledger:
    """An edge of ``cfg`` serving ``requests`` requests while ``holder`` holds its SQLite
    ledger's write lock, then stopped (its last flush and spool done); its ledger. The lock
    is let go ``let_go_s`` into the stop, or once the edge has stopped."""

    async def let_go() -> None:
        await trio.sleep(let_go_s)
        holder.execute("ROLLBACK")

    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as n:
            edge = await start_edge(n, cfg)
            await start_node(n, edge, [sim("qwen-a")])
            holder.execute("BEGIN IMMEDIATE")
            async with client(edge, "sk-k") as c:
                for _ in range(requests):
                    assert (await chat(c)).status_code == 200
            await eventually(lambda: edge.edge.ledger.pending == requests, "the records queued")
            if let_go_s is not None:
                await eventually(lambda: edge.edge.ledger._in_flight, "the writer's batch waits on the lock")
                outer.start_soon(let_go)
            n.cancel_scope.cancel()
    if let_go_s is None:
        # (a batch given up at the stop is spooled; its thread fails on the lock, never storing it)
        await eventually(lambda: not edge.edge.ledger._in_flight, "every write's thread ended")
        holder.execute("ROLLBACK")
    return edge.edge.ledger


async def test_a_sqlite_ledger_locked_at_the_stop_leaves_its_records_to_the_next_edge(tmp_path, monkeypatch):
    """Another process holds the SQLite ledger's write lock as the edge stops: its last flush
    is given up (its write waiting for the lock longer than the stop allows, 5 s each by
    default), and its 10 records are spooled (they were lost); the next edge stores them, once."""
    monkeypatch.setattr(ledger, "SQLITE_BUSY_S", 1.0)
    monkeypatch.setattr(ledger, "LAST_FLUSH_S", 0.5)
    path, state = tmp_path / "l.sqlite3", tmp_path / "state"
    cfg = edge_config(keys=[KeyConfig(id="k", key="sk-k")], ledger=str(path), state_dir=str(state))
    ledger.connect(str(path)).close()
    holder = sqlite3.connect(path, isolation_level=None)
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND * 2):
        stopped = await _serve_and_stop(cfg, 10, holder)
        assert stopped.dropped == 0 and rows(path) == (0, 0)
        (spooled,) = spool_files(state)
        async with trio.open_nursery() as n:
            await start_edge(n, cfg)
            await eventually(lambda: not spool_files(state) and rows(path) == (10, 10), "the records stored")
            n.cancel_scope.cancel()
    holder.close()
    (warned,) = [e for e in logs if e["event"].startswith("ledger records spooled")]
    assert warned["log_level"] == "warning" and warned["records"] == 10 and warned["path"] == spooled


async def test_a_batch_its_thread_stores_as_the_edge_stops_is_not_spooled(tmp_path, monkeypatch):
    """The edge stops while its writer's batch waits on the SQLite lock (another process's, let
    go 0.3 s later): its thread stores the batch during the stop, and nothing is spooled or
    warned of. (Spooled as its thread stored it, a record was in the ledger and a spool file
    both, and a normal stop warned of a database that failed.)"""
    monkeypatch.setattr(ledger, "SQLITE_BUSY_S", 3.0)
    path, state = tmp_path / "l.sqlite3", tmp_path / "state"
    cfg = edge_config(keys=[KeyConfig(id="k", key="sk-k")], ledger=str(path), state_dir=str(state))
    ledger.connect(str(path)).close()
    holder = sqlite3.connect(path, isolation_level=None)
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        stopped = await _serve_and_stop(cfg, 5, holder, let_go_s=0.3)
    holder.close()
    assert rows(path) == (5, 5) and stopped.pending == 0 and not spool_files(state)
    assert not [e for e in logs if "spool" in e["event"] or e["log_level"] == "error"]


async def test_records_neither_the_ledger_nor_the_spool_can_take_are_counted_lost(tmp_path, monkeypatch):
    """The ledger locked at the stop and the state_dir not a directory: the records are lost,
    and said so: an error naming how many, and iop_ledger_dropped_total counts them."""
    monkeypatch.setattr(ledger, "SQLITE_BUSY_S", 1.0)
    path, state = tmp_path / "l.sqlite3", tmp_path / "a-file"
    state.write_text("")
    cfg = edge_config(keys=[KeyConfig(id="k", key="sk-k")], ledger=str(path), state_dir=str(state))
    ledger.connect(str(path)).close()
    holder = sqlite3.connect(path, isolation_level=None)
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND * 2):
        stopped = await _serve_and_stop(cfg, 7, holder)
    holder.close()
    assert stopped.dropped == 7
    (lost,) = [e for e in logs if e["event"].startswith("ledger records lost")]
    assert lost["log_level"] == "error" and lost["records"] == 7 and lost["spool"] == str(state)


async def test_a_spool_file_an_edge_died_storing_is_stored_once_its_damaged_lines_skipped(nursery, tmp_path):
    """A claimed spool file its edge died storing (10 of its 30 records stored), one of its
    lines damaged and its last cut short: the next edge starts, stores the other 20 (each
    record once), warns of the 2 lines, and removes the file."""
    path, state = tmp_path / "l.sqlite3", tmp_path / "state"
    records = [a_record(i) for i in range(30)]
    claimed_and_damaged(ledger_spool.write(str(state), records))
    db = ledger.connect(str(path))
    db.executemany("INSERT INTO usage VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", records[:10])
    db.close()
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        await start_edge(nursery, edge_config(ledger=str(path), state_dir=str(state)))
        await eventually(lambda: not spool_files(state) and rows(path) == (30, 30), "the records stored")
    (warned,) = [e for e in logs if e["event"].startswith("spool file: lines that are not records")]
    assert warned["log_level"] == "warning" and warned["lines"] == 2
    with sqlite3.connect(path) as db:
        assert sorted(db.execute("SELECT * FROM usage").fetchall()) == sorted(records)


def test_edges_sharing_a_state_dir_claim_each_spool_file_once(tmp_path):
    """Four edges claiming the same 12 spool files at once: each file is claimed by one (and
    renamed so), each record read once in all; a file claimed stays its edge's until released,
    and one released (its edge died) is claimed again."""
    state = str(tmp_path)
    for f in range(12):
        ledger_spool.write(state, [a_record(f * 10 + i) for i in range(10)])
    start = threading.Barrier(4)
    got: list[tuple[list[ledger_spool.Claimed], list[tuple]]] = []

    def one() -> None:
        start.wait()
        got.append(ledger_spool.claim(state, 1000))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND)
    ids = [r[1] for _, records in got for r in records]
    assert len(ids) == 120 and len(set(ids)) == 120
    claimed = [c for files, _ in got for c in files]
    assert len(claimed) == 12 and all(c.path.endswith(".jsonl.claimed") for c in claimed)
    assert ledger_spool.claim(state, 1000) == ([], [])  # (all held)
    claimed[0].release()
    (again,), records = ledger_spool.claim(state, 1000)
    assert again.path == claimed[0].path and len(records) == 10
    for c in [again, *claimed[1:]]:
        c.remove()
    assert os.listdir(state) == []


async def test_spool_files_beyond_the_buffer_wait_until_it_has_room(nursery, tmp_path, monkeypatch):
    """Spool files hold more records than the buffer (10 here) takes: the first is queued and
    stored, then the next; none is dropped."""
    monkeypatch.setattr(ledger, "MAX_PENDING", 10)
    path, state = tmp_path / "l.sqlite3", tmp_path / "state"
    for f in range(2):
        ledger_spool.write(str(state), [a_record(f * 8 + i) for i in range(8)])
    with trio.fail_after(BOUND):
        edge = await start_edge(nursery, edge_config(ledger=str(path), state_dir=str(state)))
        await eventually(lambda: not spool_files(state) and rows(path) == (16, 16), "both files stored")
    assert edge.edge.ledger.dropped == 0


async def test_live_records_never_push_out_spooled_ones(tmp_path, monkeypatch):
    """A spool file filled the buffer (MAX_PENDING, 10 here) as the edge started, and each
    record of a request served meanwhile pushed out the oldest, a spooled one: 2 of 100,000
    lost, counted but not logged (a re-check). Spooled records have a room of their own:
    each is stored, and past the live records' room the oldest live one goes."""
    monkeypatch.setattr(ledger, "MAX_PENDING", 10)
    path, state = tmp_path / "l.sqlite3", tmp_path / "state"
    ledger_spool.write(str(state), [a_record(i) for i in range(10)])
    book = ledger.Ledger(str(path), str(state))
    with trio.fail_after(BOUND):
        await book._claim_spooled()
        for i in range(100, 115):  # served while they wait
            book.record(a_record(i))
        assert await book.flush()
    with sqlite3.connect(path) as db:
        stored = {row[0] for row in db.execute("SELECT request_id FROM usage")}
    assert {a_record(i)[1] for i in range(10)} <= stored  # every spooled one
    assert {a_record(i)[1] for i in range(105, 115)} <= stored and len(stored) == 20, sorted(stored)
    assert book.dropped == 5
    book._replayed()  # (as its writer does: the stored file goes)
    assert not spool_files(state)
    book.close()


async def test_a_spool_file_too_large_for_the_buffer_does_not_block_the_next(nursery, tmp_path, monkeypatch):
    """A spool file of more records than the buffer takes (made by hand: an edge writes them
    at most MAX_PENDING a file) blocked every newer file for the edge's life (a re-check)."""
    monkeypatch.setattr(ledger, "MAX_PENDING", 10)
    path, state = tmp_path / "l.sqlite3", tmp_path / "state"
    ledger_spool.write(str(state), [a_record(i) for i in range(15)])
    ledger_spool.write(str(state), [a_record(100 + i) for i in range(5)])
    with trio.fail_after(BOUND):
        await start_edge(nursery, edge_config(ledger=str(path), state_dir=str(state)))
        await eventually(lambda: rows(path) == (5, 5), "the newer file stored")


async def test_a_spooled_line_no_column_holds_is_skipped(nursery, tmp_path):
    """A damaged spool line of 2**64 tokens (or a time past any) decoded, and every batch it was
    in failed for good, the ledger unavailable: it is a line that is not a record."""
    path, state = tmp_path / "l.sqlite3", tmp_path / "state"
    written = ledger_spool.write(str(state), [a_record(0), a_record(1)])
    damaged = (
        b'[1.0,"req_x",null,null,null,null,200,null,18446744073709551616,2,0,null,null]\n'
        b'[1e400,"req_y",null,null,null,null,200,null,1,2,0,null,null]\n'
    )
    await trio.Path(written).write_bytes(await trio.Path(written).read_bytes() + damaged)
    with trio.fail_after(BOUND):
        await start_edge(nursery, edge_config(ledger=str(path), state_dir=str(state)))
        await eventually(lambda: not spool_files(state) and rows(path) == (2, 2), "the two records stored")
