"""The usage ledger and the run-time key store: one SQLite file.

One record per API request (time, request id, key id, model, node, API,
status, outcome, prompt/completion tokens and whether they were estimated,
TTFT, duration). A request appends its record to a bounded in-memory buffer
and goes on; a writer task stores the buffer in batches, in a worker thread,
so a write never delays a request. A buffer that fills while the disk is
stuck drops its oldest records, counted in ``iop_ledger_dropped_total`` (at
:data:`MAX_PENDING` records that is about a minute of 1,500 requests/s).

Queries (``GET /v1/admin/usage``, ``iop usage``) group by any of key, model,
node, api and day (UTC). Run-time keys (``/v1/admin/keys``) are stored by id
with the SHA-256 of their secret and their policy; a revoked key is marked so.
"""

from __future__ import annotations

import collections
import os
import sqlite3
import time
from typing import Any

import msgspec
import structlog
import trio

log = structlog.get_logger("iop.edge.ledger")

MAX_PENDING = 100_000
BATCH = 2_000
FLUSH_EVERY_S = 0.5
GROUPS = ("key", "model", "node", "api", "day")

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    ts REAL NOT NULL,
    request_id TEXT NOT NULL,
    key TEXT,
    model TEXT,
    node TEXT,
    api TEXT,
    status INTEGER,
    outcome TEXT,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    estimated INTEGER NOT NULL DEFAULT 0,
    ttft_ms REAL,
    duration_ms REAL
);
CREATE INDEX IF NOT EXISTS usage_ts ON usage (ts);
CREATE INDEX IF NOT EXISTS usage_key_ts ON usage (key, ts);
CREATE TABLE IF NOT EXISTS keys (
    id TEXT PRIMARY KEY,
    sha256 TEXT NOT NULL UNIQUE,
    policy TEXT NOT NULL,
    created REAL NOT NULL,
    revoked REAL
);
"""

# (ts, request_id, key, model, node, api, status, outcome, prompt, completion, estimated, ttft_ms, duration_ms)
Record = tuple


class Ledger:
    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(keys)")}
        if "revoked" not in columns:  # a ledger made before keys could be revoked
            self._db.execute("ALTER TABLE keys ADD COLUMN revoked REAL")
        self._lock = trio.Lock()  # one thread at a time on the connection
        self._pending: collections.deque[Record] = collections.deque(maxlen=MAX_PENDING)
        self._wake = trio.Event()
        self.written = 0
        self.dropped = 0
        self.failures = 0

    # -- records -----------------------------------------------------------------

    def record(self, rec: Record) -> None:
        """Queue a record (never blocks; the oldest is dropped when full)."""
        if len(self._pending) == MAX_PENDING:
            self.dropped += 1
        self._pending.append(rec)
        if len(self._pending) >= BATCH:
            self._wake.set()

    def _write(self, batch: list[Record]) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT INTO usage VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", batch)

    async def flush(self) -> None:
        """Store everything queued so far."""
        async with self._lock:
            while self._pending:
                batch = [self._pending.popleft() for _ in range(min(BATCH, len(self._pending)))]
                try:
                    await trio.to_thread.run_sync(self._write, batch)
                except sqlite3.Error as e:
                    self.failures += 1
                    self._pending.extendleft(reversed(batch))  # kept, in order, for the next try
                    log.warning("ledger write failed; records kept for the next try", error=str(e))
                    return
                self.written += len(batch)

    async def run(self) -> None:
        """The writer: every :data:`FLUSH_EVERY_S`, or sooner when a batch is full.
        On the way out (shutdown) what is queued is stored, within 5 s."""
        try:
            while True:
                with trio.move_on_after(FLUSH_EVERY_S):
                    await self._wake.wait()
                self._wake = trio.Event()
                await self.flush()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await self.flush()

    # -- queries -----------------------------------------------------------------

    def today_usage(self) -> dict[str, int]:
        """Tokens per key since 00:00 UTC (daily budgets survive a restart)."""
        midnight = (time.time() // 86400) * 86400
        rows = self._db.execute(
            "SELECT key, SUM(prompt_tokens + completion_tokens) FROM usage WHERE ts >= ? GROUP BY key", (midnight,)
        ).fetchall()
        return {key: int(total or 0) for key, total in rows if key}

    async def usage(self, start: float | None, end: float | None, group_by: list[str]) -> list[dict[str, Any]]:
        await self.flush()
        async with self._lock:
            return await trio.to_thread.run_sync(query_usage, self._db, start, end, group_by)

    # -- run-time keys -------------------------------------------------------------

    def stored_keys(self) -> list[tuple[str, str, str, float]]:
        """The run-time keys not revoked."""
        return self._db.execute(
            "SELECT id, sha256, policy, created FROM keys WHERE revoked IS NULL ORDER BY id"
        ).fetchall()

    def had_keys(self) -> bool:
        """Some run-time key was ever made here (revoked ones count: the edge stays closed)."""
        return self._db.execute("SELECT 1 FROM keys LIMIT 1").fetchone() is not None

    async def put_key(self, key_id: str, sha256: str, policy: Any) -> None:
        data = msgspec.json.encode(policy).decode()

        def put() -> None:
            self._db.execute(
                "INSERT INTO keys VALUES (?,?,?,?,NULL) ON CONFLICT(id) DO UPDATE SET policy = excluded.policy,"
                " sha256 = excluded.sha256, revoked = NULL",
                (key_id, sha256, data, time.time()),
            )

        async with self._lock:
            await trio.to_thread.run_sync(put)

    async def revoke_key(self, key_id: str) -> None:
        """Kept, marked revoked: its id stays in the ledger's history, its secret works no more."""
        async with self._lock:
            await trio.to_thread.run_sync(
                lambda: self._db.execute("UPDATE keys SET revoked = ? WHERE id = ?", (time.time(), key_id))
            )

    async def key_totals(self) -> dict[str, tuple[int, int, int]]:
        """Per key: (requests, prompt tokens, completion tokens) to date."""
        await self.flush()

        def totals() -> dict[str, tuple[int, int, int]]:
            rows = self._db.execute(
                "SELECT key, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens) FROM usage GROUP BY key"
            ).fetchall()
            return {k: (n, int(p or 0), int(c or 0)) for k, n, p, c in rows if k}

        async with self._lock:
            return await trio.to_thread.run_sync(totals)

    def close(self) -> None:
        self._db.close()


def query_usage(db: sqlite3.Connection, start: float | None, end: float | None, group_by: list[str]) -> list[dict]:
    """Rows of requests and token sums between ``start`` and ``end`` (unix
    seconds, either open), grouped by ``group_by`` (members of :data:`GROUPS`)."""
    columns = {
        "key": "key",
        "model": "model",
        "node": "node",
        "api": "api",
        "day": "strftime('%Y-%m-%d', ts, 'unixepoch')",
    }
    selected = [f"{columns[g]} AS {g}" for g in group_by]
    where, args = [], []
    if start is not None:
        where.append("ts >= ?")
        args.append(start)
    if end is not None:
        where.append("ts < ?")
        args.append(end)
    sql = (
        "SELECT "
        + ", ".join(
            [
                *selected,
                "COUNT(*) AS requests",
                "SUM(CASE WHEN status >= 400 OR status = 499 OR outcome NOT IN ('complete') THEN 1 ELSE 0 END)",
                "SUM(prompt_tokens)",
                "SUM(completion_tokens)",
                "SUM(estimated)",
            ]
        )
        + " FROM usage"
        + (" WHERE " + " AND ".join(where) if where else "")
        + (" GROUP BY " + ", ".join(group_by) + " ORDER BY " + ", ".join(group_by) if group_by else "")
    )
    out = []
    for row in db.execute(sql, args).fetchall():
        n = len(group_by)
        item = dict(zip(group_by, row[:n], strict=True))
        requests, not_complete, prompt, completion, estimated = row[n:]
        if not requests:
            continue
        item.update(
            requests=requests,
            not_completed=int(not_complete or 0),
            prompt_tokens=int(prompt or 0),
            completion_tokens=int(completion or 0),
            total_tokens=int(prompt or 0) + int(completion or 0),
            estimated_requests=int(estimated or 0),
        )
        out.append(item)
    return out
