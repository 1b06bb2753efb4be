"""The usage ledger and the run-time key store: SQLite (one edge) or PostgreSQL (many).

One record per API request (time, request id, key id, model, node, API,
status, outcome, prompt/completion tokens and whether they were estimated,
TTFT, duration). A request appends its record to a bounded in-memory buffer
and goes on; a writer task stores the buffer in batches, in a worker thread,
so a write never delays a request. A database that cannot be reached (a
PostgreSQL restart, a full disk) keeps the records in the buffer; they are
written when it is back. A buffer that fills meanwhile drops its oldest
records, counted in ``iop_ledger_dropped_total`` (:data:`MAX_PENDING`
records: about a minute at 1,500 requests/s). Records an edge still holds
when it stops are spooled to its ``state_dir`` and stored by the next edge
that starts there (:mod:`edge.ledger_spool`).

Queries (``GET /v1/admin/usage``, ``iop usage``) group by any of key, model,
node, api and day (UTC). With ``ledger_retention_days``, the records of older
days are folded into per-day totals (``usage_days``), which queries sum with
them. Run-time keys (``/v1/admin/keys``) are stored by id with the SHA-256 of
their secret and their policy; a revoked key is marked so. With PostgreSQL
every edge sees the keys any edge made or revoked (each reads the table
every :data:`KEYS_REFRESH_S`).

A call the database fails (either driver's error, in the worker thread)
raises :class:`LedgerUnavailable`, the driver's error as its ``__cause__``;
the admin API answers it with 503 ``ledger_unavailable``. So does a call it
leaves unanswered for :data:`CALL_TIMEOUT_S` (a server stopped, a network
path that drops packets): the call's thread is left to finish with its
connection, and the next call opens another. Records, keys and queries
each have their own connection: a revocation never waits behind a long
usage query or a batch of records.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import structlog
import trio

from edge import ledger_spool

T = TypeVar("T")
log = structlog.get_logger("iop.edge.ledger")

MAX_PENDING = 100_000
BATCH = 2_000
FLUSH_EVERY_S = 0.5
KEYS_REFRESH_S = 2.0
CALL_TIMEOUT_S = 15.0  # (PostgreSQL's statement_timeout is 10 s: this is for a server that answers nothing)
LAST_FLUSH_S = 5.0  # how long the stopping edge's writer tries to store what it holds (then: spooled)
SQLITE_BUSY_S = 5.0  # how long a write waits for another process's lock on the file (sqlite3's default)
GROUPS = ("key", "model", "node", "api", "day")

_COLUMNS = (
    "ts {real} NOT NULL, request_id TEXT NOT NULL, key TEXT, model TEXT, node TEXT, api TEXT, "
    "status INTEGER, outcome TEXT, prompt_tokens BIGINT NOT NULL DEFAULT 0, "
    "completion_tokens BIGINT NOT NULL DEFAULT 0, estimated INTEGER NOT NULL DEFAULT 0, "
    "ttft_ms {real}, duration_ms {real}"
)
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS usage (" + _COLUMNS + ")",
    "CREATE INDEX IF NOT EXISTS usage_ts ON usage (ts)",
    "CREATE INDEX IF NOT EXISTS usage_key_ts ON usage (key, ts)",
    "CREATE TABLE IF NOT EXISTS keys (id TEXT PRIMARY KEY, sha256 TEXT NOT NULL UNIQUE, policy TEXT NOT NULL, "
    "created {real} NOT NULL, revoked {real})",
    # Days past ``ledger_retention_days``, folded (:meth:`Ledger.fold_old_days`): a row per day (its
    # midnight, UTC, as ts) and key, model, node and API, with what its records summed to.
    "CREATE TABLE IF NOT EXISTS usage_days (ts {real} NOT NULL, key TEXT, model TEXT, node TEXT, api TEXT, "
    "requests BIGINT NOT NULL, not_completed BIGINT NOT NULL, prompt_tokens BIGINT NOT NULL, "
    "completion_tokens BIGINT NOT NULL, estimated BIGINT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS usage_days_ts ON usage_days (ts)",
)

# A request that did not complete (a token count, outcome "counted", is a request that completed too).
_NOT_COMPLETED = "CASE WHEN status >= 400 OR outcome NOT IN ('complete', 'counted') THEN 1 ELSE 0 END"
# A record, as a folded day's row reads (the usage queries sum both tables alike).
_AS_DAYS = (
    f"SELECT ts, key, model, node, api, 1 AS requests, {_NOT_COMPLETED} AS not_completed, prompt_tokens, "
    "completion_tokens, estimated FROM usage"
)
_DAYS = (
    "SELECT ts, key, model, node, api, requests, not_completed, prompt_tokens, completion_tokens, estimated "
    "FROM usage_days"
)
_FOLD_LOCK = 0x696F71  # the advisory lock a day is folded under (PostgreSQL: edges sharing a ledger)
FOLD_EVERY_S = 3600.0  # how often the ledger looks for days past the retention to fold
FOLD_ROWS = 5_000  # records folded a transaction at most (about 0.1 s of SQLite's write lock)
FOLD_PAUSE_S = 0.1  # between two of a fold's transactions
DAY_S = 86400

# The keys not revoked: what every refresh reads (revoked rows are kept for the
# ledger's history; read every 2 s, a million of them took 73% of a core).
_LIVE_KEYS_INDEX = "CREATE INDEX IF NOT EXISTS keys_live ON keys (id) WHERE revoked IS NULL"

_SCHEMA_LOCK = 0x696F70  # "iop": the advisory lock the schema is made under (PostgreSQL)

# (ts, request_id, key, model, node, api, status, outcome, prompt, completion, estimated, ttft_ms, duration_ms)
Record = tuple


class LedgerUnavailable(Exception):
    """The ledger's database failed a call (unreachable, locked, read-only, full);
    ``__cause__`` is the driver's error. Records stay queued and are retried."""


class LedgerGaveUp(LedgerUnavailable):
    """The database left a call unanswered for :data:`CALL_TIMEOUT_S`: the call
    goes on in its thread, and may yet be done."""


def is_postgres(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


class Dialect:
    """What differs between SQLite and PostgreSQL here."""

    def __init__(self, postgres: bool) -> None:
        self.postgres = postgres
        self.p = "%s" if postgres else "?"
        self.real = "DOUBLE PRECISION" if postgres else "REAL"
        self.day = (
            "to_char(to_timestamp(ts) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
            if postgres
            else "strftime('%Y-%m-%d', ts, 'unixepoch')"
        )

    def sql(self, text: str) -> str:
        return text.replace("?", self.p)


def connect(target: str, schema: bool = True) -> Any:
    """A connection to the ledger ``target`` (a SQLite path or a PostgreSQL URL), its schema
    made unless ``schema`` is false (made already: a table gone since is not made again empty)."""
    if is_postgres(target):
        import psycopg

        # A server that stops answering must not hold the writer for ever: statements
        # and dead connections time out (keepalives), and the records wait.
        db = psycopg.connect(
            target,
            autocommit=True,
            connect_timeout=3,
            options="-c statement_timeout=10000",
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=3,
        )
        # Edges starting together on an empty database: IF NOT EXISTS is no guard against a
        # concurrent CREATE there (UniqueViolation, and the ledger down until its retry). One
        # at a time, under a lock held until the transaction ends.
        if not schema:
            return db
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for statement in _SCHEMA:
                db.execute(statement.format(real=Dialect(True).real))
            db.execute(_LIVE_KEYS_INDEX)
        return db
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    db = sqlite3.connect(target, timeout=SQLITE_BUSY_S, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    if not schema:
        return db
    for statement in _SCHEMA:
        db.execute(statement.format(real=Dialect(False).real))
    columns = {row[1] for row in db.execute("PRAGMA table_info(keys)")}
    if "revoked" not in columns:  # a ledger made before keys could be revoked
        db.execute("ALTER TABLE keys ADD COLUMN revoked REAL")
    db.execute(_LIVE_KEYS_INDEX)
    return db


def _server_ended(error: BaseException) -> bool:
    """The server ended the connection (shut down or restarted: SQLSTATE 57P01, 57P02),
    before or in a call, which it did not commit then: tried again on a new connection."""
    return getattr(error, "sqlstate", None) in ("57P01", "57P02")


def _errors() -> tuple[type[BaseException], ...]:
    """What a ledger call may raise: the drivers' errors in the worker thread,
    and LedgerUnavailable made of them (edge/console.py catches ``ledger._errors``)."""
    try:
        import psycopg

        return (sqlite3.Error, psycopg.Error, OSError, LedgerUnavailable)
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return (sqlite3.Error, OSError, LedgerUnavailable)


class _Line:
    """One connection to the database, one call at a time. A call takes the
    connection into its thread and gives it back when it ends; a call given up
    keeps it, and its thread closes it (:class:`_Call`)."""

    __slots__ = ("name", "db", "lock")

    def __init__(self, name: str) -> None:
        self.name = name
        self.db: Any = None  # None: the next call connects
        self.lock = trio.Lock()


class _Call:
    """One call in its worker thread: what it runs on, and whether the edge
    gave up waiting. Of a call given up, ``orphan(done)`` is told once, by
    whichever of the thread and the edge last knows how it ended (under
    ``guard``): the edge if the thread never started it or had just ended
    it, else the thread when it ends."""

    __slots__ = ("fn", "db", "orphan", "guard", "given_up", "started", "ended", "done", "read")

    def __init__(
        self, fn: Callable[[Any], Any], db: Any, orphan: Callable[[bool], None] | None, read: bool = False
    ) -> None:
        self.fn = fn
        self.db = db
        self.orphan = orphan
        self.read = read  # it only reads: a connection the server dropped since its last call is made again
        self.guard = threading.Lock()
        self.given_up = False
        self.started = False
        self.ended = False
        self.done = False


class Ledger:
    def __init__(self, target: str, spool_dir: str, retention_days: int = 0) -> None:
        self.target = target
        self.retention_days = retention_days  # records of days older are folded (0: kept each)
        self.folded = 0
        self.spool_dir = spool_dir  # where records it cannot store at its stop wait (the edge's state_dir)
        self.dialect = Dialect(is_postgres(target))
        self.where = "postgresql" if self.dialect.postgres else target
        self._errors = _errors()
        self._records, self._keys, self._reads = _Line("records"), _Line("keys"), _Line("reads")
        # Folding days past the retention has its own: the records' flushes go on between its
        # transactions (on one connection, an admin call waited for a whole fold: 10 s, a re-check).
        self._folds = _Line("folds")
        # Threads of calls given up may hang on with a server that answers nothing: the ledger's
        # own, so they never take the ones trio lends everyone else.
        self._threads = trio.CapacityLimiter(8)
        self._schema_made = False  # by a first connection (the next ones only connect)
        self._flushing = trio.Lock()  # one flush at a time: records stay in order, and a flush sees all
        # MAX_PENDING live records, and as many read from spool files (``_replay``: a room of their
        # own, where live ones pushed them out as the buffer filled: 2 of 100,000 lost, a re-check)
        self._pending: collections.deque[Record] = collections.deque(maxlen=2 * MAX_PENDING)
        self._put_back = 0  # records put back ahead of the queue (a spool's, a batch not stored), ever
        self._wake = trio.Event()
        self.written = 0
        self.dropped = 0
        self.failures = 0
        self.available = True
        # The edge's: applies the key table (:func:`_live_keys`).
        self.on_keys: Callable[[list[tuple], bool], None] | None = None
        # Keys revoked on this edge while the database failed the write (id -> the revoked secret's
        # sha256): stored at the next refresh it answers; until then the key table's row of it is
        # not taken as live (edge.admin: a leaked key served on for a PostgreSQL outage).
        self.revoking: dict[str, str] = {}
        # The edge's: whether it is open (no keys). A keyed edge's request without a key was
        # refused before any work (401, 405...): not recorded, or anyone could grow the database.
        self.open: Callable[[], bool] = lambda: True
        # The edge's: whether it holds no key yet (a refresh then asks if the table holds any).
        self.unkeyed: Callable[[], bool] = lambda: True
        # Batches being written (or given up and not yet ended), by id: spooled at the stop if still out.
        self._writing: dict[int, list[Record]] = {}
        self._batch_ended = trio.Event()  # set as a batch given up ends (:meth:`_last_flush` waits)
        # Request ids of the records read from spool files and not stored yet; the files claimed.
        self._replay: set[str] = set()
        self._claimed: list[ledger_spool.Claimed] = []
        self._look = True  # spool files may wait: at start, and after each replay
        self.hung = False  # a call was given up and none has been done since
        try:
            self._keys.db = connect(target)
            self._schema_made = True
        except self._errors as e:
            if not self.dialect.postgres:
                raise  # a local file that cannot be opened is a configuration error
            self._unavailable(e)

    def _unavailable(self, error: BaseException) -> None:
        self.failures += 1
        if self.available:
            self.available = False
            log.warning(
                "ledger unavailable; records kept and written when it is back",
                ledger=self.where,
                error=f"{type(error).__name__}: {str(error)[:200]}",
            )

    def _run(self, call: _Call) -> Any:
        """``call.fn(connection)`` in this (worker) thread; connects if needed."""
        with call.guard:
            if call.given_up:  # (the edge gave up before it started, and said so)
                raise LedgerGaveUp("given up before it started")
            call.started = True
        try:
            fresh = call.db is None
            if fresh:
                call.db = connect(self.target, schema=not self._schema_made)
                self._schema_made = True
            try:
                result = call.fn(call.db)
            except self._errors as e:
                if fresh or not self.dialect.postgres or not (call.read or _server_ended(e)):
                    raise
                # A PostgreSQL restarted since the connection's last call: the first read after it
                # failed ("terminating connection", a 503 for /v1/admin/usage; an outside audit),
                # and so did the first write (a key made, a batch of records: a 503 on every edge
                # after each restart, a re-audit), which the server ended uncommitted.
                _close(call.db, self._errors)
                call.db = None
                call.db = connect(self.target, schema=False)
                result = call.fn(call.db)
            call.done = True
        finally:
            with call.guard:
                call.ended = True
                orphan = call.given_up
            if orphan:  # the edge gave up waiting: the connection was this thread's alone
                _close(call.db, self._errors)
                if call.orphan is not None:
                    call.orphan(call.done)
        self.hung = False
        if not self.available:
            self.available = True
            log.info("ledger available again", ledger=self.where, pending=len(self._pending))
        return result

    async def _call(
        self,
        fn: Callable[[Any], Any],
        line: _Line | None = None,
        orphan: Callable[[bool], None] | None = None,
        *,
        probe: bool = False,
        read: bool = False,
    ) -> Any:
        """Run ``fn`` on ``line``'s connection (the keys' by default) in a worker
        thread; LedgerUnavailable if the database fails it, LedgerGaveUp if it
        leaves it unanswered for :data:`CALL_TIMEOUT_S`, its wait for the
        connection included (then, or if cancelled, ``orphan(done)`` says
        how it ended: once, in its thread when it ends, or at once if it
        never ran). While the database hangs (a call
        given up, none done since), only a ``probe`` (the writer's and the key
        refresh's calls) tries it: others fail at once (ten DELETEs against a
        stopped server queued 15 s each). A ``read`` (it changes nothing) that fails on a
        PostgreSQL connection made before is tried once more on a new one."""
        if not probe:
            self._fail_if_hung()
        line = line or self._keys
        deadline = trio.current_time() + CALL_TIMEOUT_S
        got = False
        try:
            with trio.move_on_at(deadline):
                await line.lock.acquire()
                got = True
        except BaseException:  # cancelled waiting: nothing ran
            if orphan is not None:
                orphan(False)
            raise
        if not got:
            if orphan is not None:
                orphan(False)
            self.hung = True
            self._unavailable(TimeoutError(f"no turn on the connection in {CALL_TIMEOUT_S:g} s ({line.name})"))
            raise LedgerGaveUp(f"the database did not answer in {CALL_TIMEOUT_S:g} s ({line.name})")
        try:
            call = _Call(fn, line.db, orphan, read)
            line.db = None  # the call's until it ends
            try:
                with trio.move_on_at(deadline):
                    result = await trio.to_thread.run_sync(
                        self._run, call, abandon_on_cancel=True, limiter=self._threads
                    )
                    line.db = call.db
                    return result
            except self._errors as e:
                if not self.dialect.postgres:  # (a locked SQLite file: the connection is sound)
                    line.db = call.db
                else:
                    _close(call.db, self._errors)
                self._unavailable(e)
                raise LedgerUnavailable(f"{type(e).__name__}: {str(e)[:200]}") from e
            except BaseException:  # cancelled: the call goes on in its thread, with its connection
                self._give_up(call)
                raise
            self._give_up(call)
            self.hung = True
            error = TimeoutError(f"the database did not answer in {CALL_TIMEOUT_S:g} s ({line.name})")
            self._unavailable(error)
            raise LedgerGaveUp(str(error))
        finally:
            line.lock.release()

    def _give_up(self, call: _Call) -> None:
        with call.guard:  # (held by the thread only for a few assignments)
            call.given_up = True
            ran = call.started
            ended = call.ended
        if ran and not ended:  # its thread tells how it ended, and closes the connection
            return
        if call.orphan is not None:  # never started (waiting for a thread), or just ended
            call.orphan(call.done)
        _close(call.db, self._errors)  # the connection is nobody's now

    def _fail_if_hung(self) -> None:
        if self.hung:  # (before waiting for a batch of records the writer may be stuck on)
            raise LedgerUnavailable("the database left the last call unanswered (it is tried again every 2 s)")

    # -- records -----------------------------------------------------------------

    def record(self, rec: Record) -> None:
        """Queue a record (never blocks; the oldest is dropped when full). A request
        with no key on an edge that has keys (refused: no key or a wrong one) is not
        one: 20 clients without a key wrote 264 rows a second (its access line says it)."""
        if rec[2] is None and not self.open():
            return
        pending, replay = self._pending, self._replay
        if len(pending) - len(replay) >= MAX_PENDING:
            self.dropped += 1
            oldest = 0
            while replay and oldest < len(pending) and pending[oldest][1] in replay:
                oldest += 1  # (the spooled ones lead: the oldest live record is after them)
            if oldest < len(pending):
                del pending[oldest]
        pending.append(_storable(rec))
        if len(self._pending) >= BATCH:
            self._wake.set()

    @property
    def pending(self) -> int:
        """Records not stored yet: queued, or in a batch being written."""
        return len(self._pending) + self._in_flight

    @property
    def _in_flight(self) -> int:
        """Records in batches being written (or given up and not yet ended)."""
        return sum(map(len, list(self._writing.values())))  # (a copy: a given-up batch's thread may end meanwhile)

    async def flush(self) -> bool:
        """Store everything queued so far; False if the database failed (records kept)."""
        try:
            await self.store_pending()
        except LedgerUnavailable:
            return False
        return True

    async def store_pending(self) -> None:
        """Store everything queued so far, or raise LedgerUnavailable (the records kept).
        Flushes take turns, so one that returns has seen every earlier record stored. Not
        the records queued meanwhile: under steady traffic it stored on while any came."""
        async with self._flushing:
            await self._flush(len(self._pending))

    async def _flush(self, most: int | None = None) -> None:
        """Store the queue's first ``most`` records (None: until it is empty), and those put
        back ahead of them meanwhile."""
        insert = self.dialect.sql("INSERT INTO usage VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)")
        token = trio.lowlevel.current_trio_token()
        put_back = self._put_back
        while self._pending:
            n = min(BATCH, len(self._pending))
            if most is not None:
                most += self._put_back - put_back
                put_back = self._put_back
                if most <= 0:
                    return
                n = min(n, most)
                most -= n
            batch = [self._pending.popleft() for _ in range(n)]
            spooled = [r for r in batch if r[1] in self._replay] if self._replay else []

            def write(db: Any, batch: list[Record] = batch, spooled: list[Record] = spooled) -> None:
                if self.dialect.postgres:
                    with db.transaction(), db.cursor() as cur:
                        cur.executemany(insert, _unstored(cur, self.dialect, batch, spooled))
                else:
                    with db:
                        db.execute("BEGIN")
                        db.executemany(insert, _unstored(db, self.dialect, batch, spooled))

            def ended(done: bool, batch: list[Record] = batch) -> None:
                """A write given up (a database that answers nothing), in its thread when it
                ends: stored, or queued again (never twice, nor lost while the edge runs)."""
                if done:
                    self._stored(batch)
                else:
                    self._pending.extendleft(reversed(batch))
                    self._put_back += len(batch)
                self._writing.pop(id(batch), None)
                with contextlib.suppress(trio.RunFinishedError):  # (a thread that outlived the edge)
                    token.run_sync_soon(self._batch_ended.set)

            self._writing[id(batch)] = batch
            try:
                await self._call(write, self._records, ended, probe=True)
            except LedgerGaveUp:
                raise  # (the batch is its thread's: ``ended`` says what became of it)
            except LedgerUnavailable:
                del self._writing[id(batch)]
                self._pending.extendleft(reversed(batch))  # kept, in order, for the next try
                self._put_back += len(batch)
                raise
            # (cancelled, ``ended`` says it too: a batch queued again here as well was stored twice)
            del self._writing[id(batch)]
            self._stored(batch)

    def _stored(self, batch: list[Record]) -> None:
        self.written += len(batch)
        if self._replay:
            for rec in batch:
                self._replay.discard(rec[1])

    async def run(self) -> None:
        """The writer: every :data:`FLUSH_EVERY_S`, or sooner when a batch is
        full; first, the records of spool files waiting (:meth:`_claim_spooled`).
        On the way out (shutdown) what is queued is stored, within
        :data:`LAST_FLUSH_S`, and what is not is spooled (:meth:`_spool`).
        (The key table is read by :meth:`refresh_keys`, a task of its own: a
        batch of records stuck on a locked table held another edge's
        revocation back 7.5 s when one task did both.)"""
        try:
            while True:
                if self._look:
                    await self._claim_spooled()
                with trio.move_on_after(FLUSH_EVERY_S):
                    await self._wake.wait()
                self._wake = trio.Event()
                await self.flush()
                if self._claimed and not self._replay:
                    self._replayed()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(LAST_FLUSH_S):
                await self._last_flush()
            self._spool()
            self.close()

    async def _last_flush(self) -> None:
        """Store what is queued, and let batches given up end: the writer cancelled mid-write
        (the edge stopping) left its batch to its thread, stored a moment later, or queued
        again to be stored now. (Spooled while the thread stored it, a record was in the
        ledger and the spool both, and a normal stop warned of a database that failed.)"""
        while await self.flush() and self._writing:
            ended = self._batch_ended = trio.Event()
            if self._writing:
                await ended.wait()

    async def _claim_spooled(self) -> None:
        """Queue the records of the spool files waiting in ``spool_dir`` (ahead of the
        queue: they are older), as many files as the buffer has room for."""
        self._look = False
        room = MAX_PENDING - len(self._replay)
        # Shielded: what it claims must reach the buffer (a local read of at most MAX_PENDING records).
        with trio.CancelScope(shield=True):
            claimed, records = await trio.to_thread.run_sync(ledger_spool.claim, self.spool_dir, room)
        self._claimed += claimed
        records = [_storable(r) for r in records if r[1] not in self._replay]
        over = len(self._pending) + len(records) - self._pending.maxlen  # (records queued while it read)
        if over > 0:
            self.dropped += over
            log.error("spooled ledger records dropped: the buffer is full", records=over)
            records = records[over:]
        self._pending.extendleft(reversed(records))
        self._put_back += len(records)
        self._replay.update(r[1] for r in records)
        if claimed:
            log.info(
                "spooled ledger records queued; written with the next flush",
                records=len(records),
                files=[c.path for c in claimed],
                ledger=self.where,
            )

    def _replayed(self) -> None:
        """Every record of the claimed spool files is stored: the files go, and any left
        (no room for them then) are claimed next."""
        for claimed in self._claimed:
            claimed.remove()
        log.info("spooled ledger records written", files=len(self._claimed), ledger=self.where)
        self._claimed = []
        self._look = True

    def _spool(self) -> None:
        """At the stop, after the last flush: what it could not store (queued, or in a batch
        given up) goes to a spool file for the next edge; if that fails too, it is lost,
        logged and counted in ``iop_ledger_dropped_total``. (It exited holding them: 20 of
        20 lost, silently, the log saying they were kept: an outside audit.)"""
        records = [r for batch in list(self._writing.values()) for r in batch] + list(self._pending)
        if not records:
            if self._claimed:
                self._replayed()
            return
        try:  # (files of MAX_PENDING records at most: each fits the next edge's room for them)
            paths = [
                ledger_spool.write(self.spool_dir, records[i : i + MAX_PENDING])
                for i in range(0, len(records), MAX_PENDING)
            ]
        except OSError as e:
            # Those read from spool files still claimed stay in them, for the next edge.
            lost = sum(1 for r in records if r[1] not in self._replay)
            self.dropped += lost
            log.error(
                "ledger records lost: the database failed the last flush and the spool could not be written",
                records=lost,
                spool=self.spool_dir,
                error=str(e),
                ledger=self.where,
            )
            for claimed in self._claimed:
                claimed.release()
            self._claimed = []
            return
        log.warning(
            "ledger records spooled: the database failed the last flush; the next edge on this state_dir stores them",
            records=len(records),
            path=paths[0] if len(paths) == 1 else paths,
            ledger=self.where,
        )
        for claimed in self._claimed:  # (their records not stored are in the new file)
            claimed.remove()
        self._claimed = []

    async def fold_old_days(self, now: float | None = None) -> int:
        """Fold the records of every day before the last ``retention_days`` and today (UTC)
        into per-day totals (:func:`fold_oldest`); the number folded. Today's are never
        folded: an edge starting reads its keys' daily budgets from them."""
        if not self.retention_days:
            return 0
        before = ((time.time() if now is None else now) // DAY_S - self.retention_days) * DAY_S
        folded = 0
        while True:
            n = await self._call(lambda db: fold_oldest(db, self.dialect, before), self._folds, probe=True)
            if not n:
                break
            folded += n
            self.folded += n
            # (SQLite's other writers, waiting on its lock in sleeps of up to 100 ms, get their turn:
            # a key made waited 0.5-1.2 s while the fold took the lock again at once, a re-check)
            await trio.sleep(FOLD_PAUSE_S)
        if folded:
            log.info("ledger records past the retention folded into daily totals", records=folded, before=before)
        return folded

    async def fold_forever(self) -> None:
        """:meth:`fold_old_days` at start and every :data:`FOLD_EVERY_S` (a minute after
        a database that failed it)."""
        while True:
            try:
                await self.fold_old_days()
            except LedgerUnavailable:
                await trio.sleep(60.0)
                continue
            await trio.sleep(FOLD_EVERY_S)

    async def refresh_keys(self) -> None:
        """The key table, every :data:`KEYS_REFRESH_S`, for the edge (``on_keys``)."""
        while True:
            await trio.sleep(KEYS_REFRESH_S)
            if self.on_keys is None:
                continue
            ask_any = self.unkeyed()  # (an edge with no key yet: is there one, revoked or not?)
            try:
                for key_id, sha in list(self.revoking.items()):
                    await self.revoke_key(key_id, sha, probe=True)
                    if self.revoking.get(key_id) == sha:
                        del self.revoking[key_id]
                        log.info("a key revoked while the ledger failed is stored revoked now", key=key_id)
                rows, stored = await self._call(functools.partial(_live_keys, ask_any=ask_any), probe=True)
            except LedgerUnavailable:
                continue
            if self.revoking:
                rows = [row for row in rows if self.revoking.get(row[0]) != row[1]]
            self.on_keys(rows, stored)

    def close(self) -> None:
        for line in (self._records, self._keys, self._reads, self._folds):
            db, line.db = line.db, None
            _close(db, self._errors)

    # -- queries -----------------------------------------------------------------

    def startup_state(self) -> tuple[list[tuple], bool, dict[str, int]] | None:
        """The stored keys not revoked, whether any key is stored (revoked
        ones too), and today's tokens per key, read once at start; None if
        the database cannot be read."""
        db = self._keys.db
        if db is None:
            return None
        midnight = (time.time() // 86400) * 86400
        try:
            keys, stored = _live_keys(db, True)
            today = self._tokens_since(db, midnight)
        except self._errors as e:
            self._unavailable(e)
            return None
        return keys, stored, today

    def _tokens_since(self, db: Any, since: float) -> dict[str, int]:
        # (today's records: never folded, whatever the retention)
        sql = "SELECT key, SUM(prompt_tokens + completion_tokens) FROM usage WHERE ts >= ? GROUP BY key"
        rows = db.execute(self.dialect.sql(sql), (since,)).fetchall()
        return {key: int(total or 0) for key, total in rows if key}

    async def day_totals(self, since: float) -> dict[str, int]:
        """Tokens per key since ``since`` (a midnight), every record queued so far included;
        LedgerUnavailable rather than short totals."""
        self._fail_if_hung()
        await self.store_pending()
        return await self._call(lambda db: self._tokens_since(db, since), self._reads, read=True)

    async def usage(self, start: float | None, end: float | None, group_by: list[str]) -> list[dict[str, Any]]:
        """Usage rows (:func:`query_usage`), every record queued so far included: a
        database that cannot store them raises LedgerUnavailable rather than answer short."""
        self._fail_if_hung()
        await self.store_pending()
        return await self._call(lambda db: query_usage(db, self.dialect, start, end, group_by), self._reads, read=True)

    async def usage_at(self, start: float, groupings: list[list[str]], at: Callable[[], T]) -> tuple[list, T]:
        """Usage rows since ``start`` grouped each way of ``groupings``, and ``at()``, called once
        every record queued so far is stored: none is stored until the rows are read, so they hold
        exactly the records queued before ``at()`` (what its caller counted since, it adds)."""
        self._fail_if_hung()
        async with self._flushing:
            await self._flush()
            mark = at()
            rows = await self._call(
                lambda db: [query_usage(db, self.dialect, start, None, g) for g in groupings], self._reads, read=True
            )
        return rows, mark

    async def key_totals(self, key_id: str | None = None) -> dict[str, tuple[int, int, int]]:
        """Per key (every key, or ``key_id``'s alone, read by its index): (requests, prompt
        tokens, completion tokens) to date, every record queued so far included;
        LedgerUnavailable rather than short totals."""
        self._fail_if_hung()
        await self.store_pending()
        where, args = (self.dialect.sql(" WHERE key = ?"), (key_id,)) if key_id is not None else ("", ())
        sql = (
            "SELECT key, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens) "
            f"FROM ({_AS_DAYS}{where} UNION ALL {_DAYS}{where}) AS u GROUP BY key"
        )

        def totals(db: Any) -> dict[str, tuple[int, int, int]]:
            rows = db.execute(sql, args * 2).fetchall()
            return {k: (int(n), int(p or 0), int(c or 0)) for k, n, p, c in rows if k}

        return await self._call(totals, self._reads, read=True)

    # -- run-time keys -------------------------------------------------------------

    async def put_key(self, key_id: str, sha256: str, policy: Any) -> bool:
        data = msgspec.json.encode(policy).decode()
        sql = self.dialect.sql(
            "INSERT INTO keys VALUES (?,?,?,?,NULL) ON CONFLICT(id) DO UPDATE SET policy = excluded.policy,"
            " sha256 = excluded.sha256, revoked = NULL WHERE keys.revoked IS NOT NULL"
        )
        # (False: another edge made a live key of this id since this one last read the table)
        return await self._call(lambda db: db.execute(sql, (key_id, sha256, data, time.time())).rowcount > 0)

    async def change_key(self, key_id: str, sha256: str, policy: Any) -> bool:
        """Store a key's new policy; False if the key is revoked or gone (another request, or
        another edge, revoked it meanwhile: an upsert made it live again)."""
        data = msgspec.json.encode(policy).decode()
        sql = self.dialect.sql("UPDATE keys SET policy = ?, sha256 = ? WHERE id = ? AND revoked IS NULL")
        return await self._call(lambda db: db.execute(sql, (data, sha256, key_id)).rowcount > 0)

    async def revoke_key(self, key_id: str, sha256: str, probe: bool = False) -> None:
        """Kept, marked revoked: its id stays in the ledger's history, its secret works no more.
        Only the row of that secret: an id made again since (a new secret) stays live."""
        sql = self.dialect.sql("UPDATE keys SET revoked = ? WHERE id = ? AND sha256 = ? AND revoked IS NULL")
        await self._call(lambda db: db.execute(sql, (time.time(), key_id, sha256)), probe=probe)


def _storable(rec: Record) -> Record:
    """PostgreSQL's text holds no NUL: one record with a client's model name "a\\x00b" failed
    every batch after it, for good (the ledger "unavailable", records piling up)."""
    if any(isinstance(v, str) and "\x00" in v for v in rec):
        return tuple(v.replace("\x00", "\ufffd") if isinstance(v, str) else v for v in rec)
    return rec


def _unstored(db: Any, dialect: Dialect, batch: list[Record], spooled: list[Record]) -> list[Record]:
    """``batch`` less those of its records read from a spool file (``spooled``) that the
    table holds: an edge that died storing a claimed file's records left the file, and
    the next claims it again. The table has no key on ``request_id`` (a unique index
    would be built at start on every ledger, and checked on every insert): they are
    looked up by id between their first and last times (the ts index), 500 a query."""
    if not spooled:
        return batch
    low, high = min(r[0] for r in spooled), max(r[0] for r in spooled)
    found: set[str] = set()
    for i in range(0, len(spooled), 500):
        ids = [r[1] for r in spooled[i : i + 500]]
        sql = f"SELECT request_id FROM usage WHERE ts >= ? AND ts <= ? AND request_id IN ({','.join('?' * len(ids))})"
        found.update(row[0] for row in db.execute(dialect.sql(sql), (low, high, *ids)).fetchall())
    return [r for r in batch if r[1] not in found] if found else batch


def _close(db: Any, errors: tuple[type[BaseException], ...]) -> None:
    if db is not None:
        try:
            db.close()
        except errors:
            pass


def _live_keys(db: Any, ask_any: bool) -> tuple[list[tuple], bool]:
    """(id, sha256, policy JSON) of every stored key not revoked, and, if
    ``ask_any``, whether the table holds any key, revoked or not (else
    whether it holds a live one)."""
    rows = db.execute("SELECT id, sha256, policy FROM keys WHERE revoked IS NULL ORDER BY id").fetchall()
    stored = bool(rows) or (ask_any and db.execute("SELECT 1 FROM keys LIMIT 1").fetchone() is not None)
    return rows, stored


def has_folded_days(db: Any, dialect: Dialect) -> bool:
    """Whether the ledger has the table of folded days (a ledger made before it, read by
    ``iop usage`` read-only, has not)."""
    if dialect.postgres:
        return db.execute("SELECT to_regclass('usage_days') IS NOT NULL").fetchone()[0]
    return db.execute("SELECT 1 FROM sqlite_master WHERE name = 'usage_days'").fetchone() is not None


def query_usage(
    db: Any, dialect: Dialect, start: float | None, end: float | None, group_by: list[str]
) -> list[dict[str, Any]]:
    """Rows of requests and token sums between ``start`` and ``end`` (unix
    seconds, either open), grouped by ``group_by`` (members of :data:`GROUPS`).
    A folded day (past ``ledger_retention_days``) counts whole, if its midnight is in range."""
    columns = {"key": "key", "model": "model", "node": "node", "api": "api", "day": dialect.day}
    selected = [f"{columns[g]} AS {g}" for g in group_by]
    where, args = [], []
    if start is not None:
        where.append(f"ts >= {dialect.p}")
        args.append(start)
    if end is not None:
        where.append(f"ts < {dialect.p}")
        args.append(end)
    where_sql = " WHERE " + " AND ".join(where) if where else ""
    # (the range in each part, so each uses its own ts index)
    parts = [_AS_DAYS + where_sql] + ([_DAYS + where_sql] if has_folded_days(db, dialect) else [])
    sql = (
        "SELECT "
        + ", ".join(
            [
                *selected,
                "SUM(requests)",
                "SUM(not_completed)",
                "SUM(prompt_tokens)",
                "SUM(completion_tokens)",
                "SUM(estimated)",
            ]
        )
        + " FROM ("
        + " UNION ALL ".join(parts)
        + ") AS u"
        + (" GROUP BY " + ", ".join(group_by) + " ORDER BY " + ", ".join(group_by) if group_by else "")
    )
    out = []
    for row in db.execute(sql, args * len(parts)).fetchall():
        n = len(group_by)
        item = dict(zip(group_by, row[:n], strict=True))
        requests, not_complete, prompt, completion, estimated = row[n:]
        if not requests:
            continue
        item.update(
            requests=int(requests),
            not_completed=int(not_complete or 0),
            prompt_tokens=int(prompt or 0),
            completion_tokens=int(completion or 0),
            total_tokens=int(prompt or 0) + int(completion or 0),
            estimated_requests=int(estimated or 0),
        )
        out.append(item)
    return out


def fold_oldest(db: Any, dialect: Dialect, before: float, most: int = FOLD_ROWS) -> int:
    """Fold the oldest records, if older than ``before`` (a UTC midnight), into their day's rows of
    ``usage_days``: at most ``most`` of those of the oldest record's day, in one transaction (held
    briefly, however many a day holds, however many share a time); the number folded (0: none is
    that old). Edges sharing a PostgreSQL ledger fold under one lock, each seeing what the one
    before folded."""
    row = db.execute("SELECT MIN(ts) FROM usage").fetchone()
    if row is None or row[0] is None or row[0] >= before:
        return 0
    day = (float(row[0]) // DAY_S) * DAY_S
    span = (day, min(day + DAY_S, before), most)
    sums = f"COUNT(*), SUM({_NOT_COMPLETED}), SUM(prompt_tokens), SUM(completion_tokens), SUM(estimated)"
    if dialect.postgres:
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_FOLD_LOCK,))
            folded = db.execute(
                "WITH picked AS (SELECT ctid FROM usage WHERE ts >= %s AND ts < %s ORDER BY ts LIMIT %s), "
                "gone AS (DELETE FROM usage WHERE ctid IN (SELECT ctid FROM picked) RETURNING *), "
                f"added AS (INSERT INTO usage_days SELECT %s, key, model, node, api, {sums} FROM gone "
                "GROUP BY key, model, node, api RETURNING requests) SELECT COALESCE(SUM(requests), 0) FROM added",
                (*span, day),
            ).fetchone()[0]
        return int(folded)
    with db:
        db.execute("BEGIN IMMEDIATE")  # (the write lock first: another edge on the file folds after it)
        db.execute("CREATE TEMP TABLE IF NOT EXISTS folding (id INTEGER PRIMARY KEY)")
        db.execute("DELETE FROM folding")
        db.execute("INSERT INTO folding SELECT rowid FROM usage WHERE ts >= ? AND ts < ? ORDER BY ts LIMIT ?", span)
        picked = "rowid IN (SELECT id FROM folding)"
        db.execute(
            f"INSERT INTO usage_days SELECT ?, key, model, node, api, {sums} FROM usage WHERE {picked} "
            "GROUP BY key, model, node, api",
            (day,),
        )
        folded = db.execute(f"DELETE FROM usage WHERE {picked}").rowcount
    # The pages it changed are copied back from the log here, not by the next commit of a record
    # or a key (SQLite's automatic checkpoint).
    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
    return folded
