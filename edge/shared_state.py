"""Key limits shared by many edges, through Redis (``state = "redis://…"``).

Each edge *leases* slices of a key's per-minute allowances and admits locally
from them, so a request the local balance covers never waits on Redis:

- ``rpm`` and ``tpm`` are token buckets in Redis (a Lua script refills by
  Redis's own clock, so edges' clocks do not matter). Every
  :data:`SYNC_S` an edge tops its local balance of each limit up to a slice
  (:data:`SLICE` of the per-minute limit, at least 1 request or 1 token of
  the largest reservation); a request takes from the balance, a refused one
  does not. A ``tpm`` request settles its reservation into the balance; a
  balance above two slices goes back to Redis. So an edge holds at most
  about two slices it has not used, and the key's admitted rate across
  edges stays within a few percent of its limit.
- A request the balance cannot cover (a burst) *borrows* what it lacks from
  the Redis bucket before it is refused: the requests waiting at one time
  borrow in one round trip, and each waits :data:`BORROW_S` at most (then it
  is refused as before; a client that leaves stops waiting at once).
- The bucket script returns the bucket's level too: the ``x-ratelimit-remaining-*``
  headers show that level as last seen (refilled since at the key's rate)
  plus this edge's balance.
- ``daily_tokens``: each edge adds its tokens to a per-day counter and reads
  the total back; admission uses that total. An *epoch* (``iop:epoch``, a
  random value set when Redis has none) tells a Redis that lost its data:
  an edge's first report of a key's day in an epoch adds all it knows of
  the day, or, if the counter exists already, all but what it restored from
  its ledger at start (another edge, or its own earlier life, added that).
- ``max_concurrent``: each edge publishes its requests in flight per key
  (expiring with the edge); admission counts the other edges' too.

If Redis cannot be reached, the edge goes on with its own local limits (the
full per-minute allowances, this edge alone: bounded, and logged once, with
``iop_shared_state_up`` 0) and leases again when Redis is back.
"""

from __future__ import annotations

import math
import secrets
import time
from typing import TYPE_CHECKING

import structlog
import trio

if TYPE_CHECKING:
    from edge.errors import APIError
    from edge.keys import Key, Keys

log = structlog.get_logger("iop.edge.state")

SYNC_S = 0.05
SLICE = 0.01  # of a key's per-minute allowance, leased at a time
EDGE_TTL_S = 10  # an edge's published in-flight counts expire after this silence
BORROW_S = 0.5  # a request its edge's balance cannot cover waits this long at most for Redis
DAY_TTL_S = 2 * 86400

# KEYS[1]: the bucket; ARGV: capacity, refill per second, amount (> 0: take up to it; < 0: give back).
# Returns what it took and the level after.
_BUCKET = """
local cap = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local want = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local b = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(b[1]) or cap
local ts = tonumber(b[2]) or now
level = math.min(cap, level + (now - ts) * rate)
local got = 0
if want > 0 then
  got = math.floor(math.min(want, level))
  if got < 0 then got = 0 end
  level = level - got
else
  level = math.min(cap, level - want)
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], 180)
return {got, tostring(level)}
"""

# KEYS[1]: the epoch, KEYS[2]: a key's day counter; ARGV: an epoch to set if Redis has none, the
# epoch this edge last reported the day in, what to add if it is still that one, else what to add
# if the counter exists, else what to add. Returns the epoch and the day's total.
_DAY = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
local epoch = redis.call('GET', KEYS[1])
local add = ARGV[5]
if epoch == ARGV[2] then
  add = ARGV[3]
elseif redis.call('EXISTS', KEYS[2]) == 1 then
  add = ARGV[4]
end
local total = redis.call('INCRBY', KEYS[2], add)
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[6]))
return {epoch, total}
"""

EPOCH_KEY = "iop:epoch"

# (key, limit, amount, per-minute limit): to take (amount > 0) from a bucket, or give back to it
BucketOp = tuple["Key", str, int, int]


class _Want:
    """What one request lacks, and what it got."""

    __slots__ = ("key", "requests", "tokens", "got", "gone")

    def __init__(self, key: Key, requests: int, tokens: int) -> None:
        self.key = key
        self.requests = requests
        self.tokens = tokens
        self.got = (0, 0)
        self.gone = False  # it stopped waiting: what comes goes to the key's balances


class _Borrowing:
    """What the requests waiting at one time lack, borrowed in one round trip."""

    __slots__ = ("wants", "done")

    def __init__(self) -> None:
        self.wants: list[_Want] = []
        self.done = trio.Event()


class SharedState:
    def __init__(self, url: str, keys: Keys, edge_id: str) -> None:
        import redis

        self._redis_error = redis.RedisError
        self.client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.bucket = self.client.register_script(_BUCKET)
        self.day = self.client.register_script(_DAY)
        self.keys = keys
        keys.shared = True  # leases from the first round on
        keys.zero_levels()
        self.edge_id = edge_id
        self.up = False
        self.failures = 0
        # (key id, day) -> (the epoch, its day_used added to Redis so far in that epoch)
        self._reported: dict[tuple[str, int], tuple[bytes, int]] = {}
        self._borrowing: _Borrowing | None = None  # filling, for the next round trip
        self._wake = trio.Event()

    def _slices(self, key: Key) -> tuple[int, int]:
        """The requests and tokens an edge leases at a time: 1% of the per-minute
        allowance, at least one request, and at least one large reservation (5,120
        tokens) or a tenth of the tpm if that is less: a slice of a small tpm was
        its whole minute, which the first edge held while the others refused
        (tpm 3,000, two edges: 12 of 20 requests admitted). A request a slice
        cannot cover borrows the rest (:meth:`cover`)."""
        policy = key.policy
        return self._slice(policy.rpm), self._slice(policy.tpm, min(5120, max(policy.tpm // 10, 1)))

    def _slice(self, limit: int, floor: int = 1) -> int:
        return max(int(math.ceil(limit * SLICE)), floor)

    def _plan(self) -> list[BucketOp]:
        """What to lease (> 0) or give back (< 0), in the trio thread."""
        plan: list[BucketOp] = []
        for key in list(self.keys.by_id.values()):
            policy = key.policy
            requests, tokens = self._slices(key)
            for limit, per_minute, level, target in (
                ("rpm", policy.rpm, key.req_level, requests),
                ("tpm", policy.tpm, key.tok_level, tokens),
            ):
                if not per_minute:
                    continue
                amount = target - int(level)
                if amount > 0:
                    plan.append((key, limit, amount, per_minute))
                elif level > 2 * target:
                    plan.append((key, limit, -int(level - target), per_minute))
        return plan

    def _buckets(self, pipe, plan: list[BucketOp]) -> None:
        for key, limit, amount, per_minute in plan:
            self.bucket(
                keys=[f"iop:bucket:{key.id}:{limit}"], args=[per_minute, per_minute / 60.0, amount], client=pipe
            )

    def _credit(self, plan: list[BucketOp], results: list) -> None:
        """In the trio thread: what the buckets gave (or took back) into the local
        balances, and each bucket's level as seen now (for the rate-limit headers)."""
        self._seen(plan, results)
        for (key, limit, amount, _), (got, _) in zip(plan, results, strict=True):
            change = int(got) if amount > 0 else amount
            if limit == "rpm":
                key.req_level += change
            else:
                key.tok_level += change

    def _seen(self, plan: list[BucketOp], results: list) -> None:
        now = time.monotonic()
        for (key, limit, _, _), (_, level) in zip(plan, results, strict=True):
            if limit == "rpm":
                key.req_seen = (float(level), now)
            else:
                key.tok_seen = (float(level), now)

    def _exchange(
        self, plan: list[BucketOp], counters: list[tuple[str, int, list, bool, bool]]
    ) -> tuple[list, dict[str, tuple[bytes, int, int]]]:
        """In a worker thread: the Redis round trip (one pipeline)."""
        pipe = self.client.pipeline(transaction=False)
        self._buckets(pipe, plan)
        for key_id, day, adds, has_budget, has_concurrency in counters:
            if has_budget:
                self.day(
                    keys=[EPOCH_KEY, f"iop:day:{key_id}:{day}"],
                    args=[secrets.token_hex(8), *adds, DAY_TTL_S],
                    client=pipe,
                )
            if has_concurrency:
                pipe.hgetall(f"iop:flight:{key_id}")
        results = pipe.execute()
        rest = results[len(plan) :]
        out: dict[str, tuple[bytes, int, int]] = {}
        i = 0
        for key_id, _, _, has_budget, has_concurrency in counters:
            epoch, day_total, others = b"", 0, 0
            if has_budget:
                epoch, day_total = rest[i][0], int(rest[i][1])
                i += 1
            if has_concurrency:
                flights = rest[i]
                i += 1
                others = sum(int(v) for k, v in flights.items() if k.decode() != self.edge_id)
            out[key_id] = (epoch, day_total, others)
        return results[: len(plan)], out

    def _publish(self, flights: dict[str, int]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key_id, n in flights.items():
            flight_key = f"iop:flight:{key_id}"
            pipe.hset(flight_key, self.edge_id, n)
            pipe.expire(flight_key, EDGE_TTL_S)
        pipe.execute()

    def _day_adds(self, key: Key) -> tuple[list, int]:
        """The day script's epoch and amounts for ``key`` (see _DAY), and the day_used they report."""
        used = key.day_used
        epoch, reported = self._reported.get((key.id, key.day), (b"", 0))
        return [epoch, used - reported, used - key.restored, used], used

    async def round(self) -> None:
        """One lease round (raises the driver's error if Redis failed)."""
        plan = self._plan()
        counters = []
        used: dict[str, int] = {}
        flights = {}
        for key in list(self.keys.by_id.values()):
            policy = key.policy
            if not policy.daily_tokens:
                key.day_others = 0  # (a budget removed: other edges' use is no longer followed)
            if policy.daily_tokens or policy.max_concurrent:
                key._today()
                adds: list = []
                if policy.daily_tokens:
                    adds, used[key.id] = self._day_adds(key)
                counters.append((key.id, key.day, adds, bool(policy.daily_tokens), bool(policy.max_concurrent)))
            if policy.max_concurrent:
                flights[key.id] = key.in_flight
        if not plan and not counters:
            return
        if flights:
            await trio.to_thread.run_sync(self._publish, flights)
        granted, totals = await trio.to_thread.run_sync(self._exchange, plan, counters)
        self._credit(plan, granted)
        for key_id, day, _, has_budget, _ in counters:
            key = self.keys.by_id.get(key_id)
            if key is None:
                continue
            epoch, day_total, others = totals[key_id]
            if has_budget:
                reported = used[key_id]
                self._reported[(key_id, day)] = (epoch, reported)
                for old in [k for k in self._reported if k[0] == key_id and k[1] != day]:
                    del self._reported[old]
                if key.day == day:
                    # Others' use too, so the budget holds across edges (Redis holds all of this edge's).
                    key.day_others = max(day_total - reported, 0)
            key.others_in_flight = others

    # -- borrowing: a request its edge's balance cannot cover ------------------------------

    async def cover(self, key: Key, refusal: APIError, prompt_estimate: int, max_tokens: int | None) -> bool:
        """``refusal`` (of ``key``'s request by this edge's balances): hold what the
        balances have of the request's need and borrow the rest from Redis, waiting
        :data:`BORROW_S` at most. True if the borrow was answered (admit the request
        once more: it finds both in the balances), False to refuse it as it is."""
        if getattr(refusal, "limit", None) not in ("rpm", "tpm") or not self.up or not self.keys.shared:
            return False
        need_requests, need_tokens = self.keys.needs(key, prompt_estimate, max_tokens)
        held_requests = min(max(key.req_level, 0.0), need_requests)
        held_tokens = min(max(key.tok_level, 0.0), need_tokens)
        key.req_level -= held_requests  # (so the requests admitted meanwhile do not take it)
        key.tok_level -= held_tokens
        try:
            with trio.move_on_after(BORROW_S):
                await self.borrow(key, math.ceil(need_requests - held_requests), math.ceil(need_tokens - held_tokens))
                return True
            return False
        finally:
            self._give(key, held_requests, held_tokens)

    async def borrow(self, key: Key, requests: int, tokens: int) -> None:
        """Take ``requests`` and ``tokens`` (or what there is of them) from ``key``'s
        buckets into this edge's balances, in one round trip with the other borrows
        waiting now. Callers bound the wait; what comes after one left goes to the
        balances. Nothing awaits between this return and the caller's admission, so
        what it borrowed is there for it."""
        borrowing = self._borrowing
        if borrowing is None:
            borrowing = self._borrowing = _Borrowing()
            self._wake.set()
        want = _Want(key, requests, tokens)
        borrowing.wants.append(want)
        try:
            await borrowing.done.wait()
        finally:
            want.gone = True
            self._give(key, *want.got)

    def _give(self, key: Key, requests: float, tokens: float) -> None:
        if self.keys.shared:  # (else Redis went down meanwhile: local limits; what it took refills there)
            key.req_level += requests
            key.tok_level += tokens

    async def _lend(self, borrowing: _Borrowing) -> None:
        asked: dict[tuple[str, str], list] = {}  # (key id, limit) -> [key, amount, per minute]
        for want in borrowing.wants:
            policy = want.key.policy
            for limit, amount, per_minute in (("rpm", want.requests, policy.rpm), ("tpm", want.tokens, policy.tpm)):
                if amount and per_minute:
                    asked.setdefault((want.key.id, limit), [want.key, 0, per_minute])[1] += amount
        plan: list[BucketOp] = [
            (key, limit, amount, per_minute) for (_, limit), (key, amount, per_minute) in asked.items()
        ]
        if not plan:
            return

        def take() -> list:
            pipe = self.client.pipeline(transaction=False)
            self._buckets(pipe, plan)
            return pipe.execute()

        try:
            results = await trio.to_thread.run_sync(take, abandon_on_cancel=True)
        except (self._redis_error, OSError) as e:  # the lease round finds Redis down, and says so
            log.debug("borrow failed", error=f"{type(e).__name__}: {str(e)[:200]}")
            return
        self._seen(plan, results)
        got = {(key.id, limit): int(n) for (key, limit, _, _), (n, _) in zip(plan, results, strict=True)}
        for want in borrowing.wants:  # in arrival order, each what it asked while there is some
            requests = min(want.requests, got.get((want.key.id, "rpm"), 0))
            tokens = min(want.tokens, got.get((want.key.id, "tpm"), 0))
            got[(want.key.id, "rpm")] = got.get((want.key.id, "rpm"), 0) - requests
            got[(want.key.id, "tpm")] = got.get((want.key.id, "tpm"), 0) - tokens
            if want.gone:
                self._give(want.key, requests, tokens)
            else:
                want.got = (requests, tokens)

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """A lease round every :data:`SYNC_S`; between rounds, the borrows as they come
        (one round trip for those waiting at once). One task: Redis sees one call at a time."""
        next_round = trio.current_time()
        while True:
            if trio.current_time() >= next_round:
                await self._round()
                next_round = trio.current_time() + SYNC_S
            borrowing, self._borrowing = self._borrowing, None
            if borrowing is not None:
                try:
                    await self._lend(borrowing)
                finally:
                    borrowing.done.set()
            with trio.move_on_at(next_round):
                await self._wake.wait()
            self._wake = trio.Event()

    async def _round(self) -> None:
        try:
            await self.round()
        except (self._redis_error, OSError) as e:
            self._down(e)
        else:
            if not self.up:
                self.up = True
                if not self.keys.shared:  # back from local limits: keep at most a slice, lease the rest
                    for key in list(self.keys.by_id.values()):
                        requests, tokens = self._slices(key)
                        key.req_level, key.tok_level = min(key.req_level, requests), min(key.tok_level, tokens)
                    self.keys.shared = True
                log.info("shared state up: leasing key limits from redis")

    def _down(self, error: BaseException) -> None:
        self.failures += 1
        if self.up or self.failures == 1:
            log.warning(
                "shared state unreachable: this edge limits keys on its own until it is back",
                error=f"{type(error).__name__}: {str(error)[:200]}",
            )
        self.up = False
        if self.keys.shared:
            self.keys.shared = False
            self.keys.local_levels()

    def close(self) -> None:
        self.client.close()
