"""Key limits shared by many edges, through Redis (``state = "redis://…"``).

The request path never waits on Redis. Each edge *leases* slices of a key's
per-minute allowances and admits locally from them:

- ``rpm`` and ``tpm`` are token buckets in Redis (a Lua script refills by
  Redis's own clock, so edges' clocks do not matter). Every
  :data:`SYNC_S` an edge tops its local balance of each limit up to a slice
  (:data:`SLICE` of the per-minute limit, at least 1 request or 1 token of
  the largest reservation); a request takes from the balance, a refused one
  does not. A ``tpm`` request settles its reservation into the balance; a
  balance above two slices goes back to Redis. So an edge holds at most
  about two slices it has not used, and the key's admitted rate across
  edges stays within a few percent of its limit.
- ``daily_tokens``: each edge adds its tokens to a per-day counter and reads
  the total back; admission uses that total.
- ``max_concurrent``: each edge publishes its requests in flight per key
  (expiring with the edge); admission counts the other edges' too.

If Redis cannot be reached, the edge goes on with its own local limits (the
full per-minute allowances, this edge alone: bounded, and logged once, with
``iop_shared_state_up`` 0) and leases again when Redis is back.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import structlog
import trio

if TYPE_CHECKING:
    from edge.keys import Key, Keys

log = structlog.get_logger("iop.edge.state")

SYNC_S = 0.05
SLICE = 0.01  # of a key's per-minute allowance, leased at a time
EDGE_TTL_S = 10  # an edge's published in-flight counts expire after this silence

# KEYS[1]: the bucket; ARGV: capacity, refill per second, amount (> 0: take up to it; < 0: give back)
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
return got
"""


class SharedState:
    def __init__(self, url: str, keys: Keys, edge_id: str) -> None:
        import redis

        self._redis_error = redis.RedisError
        self.client = redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.bucket = self.client.register_script(_BUCKET)
        self.keys = keys
        keys.shared = True  # leases from the first round on
        keys.zero_levels()
        self.edge_id = edge_id
        self.up = False
        self.failures = 0
        self._reported: dict[tuple[str, int], int] = {}  # (key id, day) -> its day_used already added to Redis

    def _slices(self, key: Key) -> tuple[int, int]:
        """The requests and tokens an edge leases at a time: 1% of the per-minute
        allowance, at least one request, at least one large reservation (5,120 tokens)."""
        policy = key.policy
        return self._slice(policy.rpm), self._slice(policy.tpm, min(policy.tpm, 5120))

    def _slice(self, limit: int, floor: int = 1) -> int:
        return max(int(math.ceil(limit * SLICE)), floor)

    def _plan(self) -> list[tuple[Key, str, int, float]]:
        """(key, limit, amount, ...) to lease (> 0) or give back (< 0), in the trio thread."""
        plan: list[tuple[Key, str, int, float]] = []
        for key in list(self.keys.by_id.values()):
            policy = key.policy
            if policy.rpm:
                target = self._slices(key)[0]
                amount = target - int(key.req_level)
                if amount > 0 or key.req_level > 2 * target:
                    plan.append((key, "rpm", amount if amount > 0 else -int(key.req_level - target), policy.rpm))
            if policy.tpm:
                target = self._slices(key)[1]
                amount = target - int(key.tok_level)
                if amount > 0 or key.tok_level > 2 * target:
                    plan.append((key, "tpm", amount if amount > 0 else -int(key.tok_level - target), policy.tpm))
        return plan

    def _exchange(
        self, plan: list[tuple[Key, str, int, float]], counters: list[tuple[str, int, int, bool, bool]]
    ) -> tuple[list[int], dict[str, tuple[int, int]]]:
        """In a worker thread: the Redis round trip (one pipeline)."""
        pipe = self.client.pipeline(transaction=False)
        for key, limit, amount, per_minute in plan:
            self.bucket(
                keys=[f"iop:bucket:{key.id}:{limit}"], args=[per_minute, per_minute / 60.0, amount], client=pipe
            )
        for key_id, day, add, has_budget, has_concurrency in counters:
            if has_budget:
                day_key = f"iop:day:{key_id}:{day}"
                pipe.incrby(day_key, add)
                pipe.expire(day_key, 2 * 86400)
            if has_concurrency:
                flight_key = f"iop:flight:{key_id}"
                pipe.hgetall(flight_key)
        results = pipe.execute()
        granted = [int(r) for r in results[: len(plan)]]
        rest = results[len(plan) :]
        out: dict[str, tuple[int, int]] = {}
        i = 0
        for key_id, _, _, has_budget, has_concurrency in counters:
            day_total = others = 0
            if has_budget:
                day_total = int(rest[i])
                i += 2
            if has_concurrency:
                flights = rest[i]
                i += 1
                others = sum(int(v) for k, v in flights.items() if k.decode() != self.edge_id)
            out[key_id] = (day_total, others)
        return granted, out

    def _publish(self, flights: dict[str, int]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key_id, n in flights.items():
            flight_key = f"iop:flight:{key_id}"
            pipe.hset(flight_key, self.edge_id, n)
            pipe.expire(flight_key, EDGE_TTL_S)
        pipe.execute()

    async def round(self) -> None:
        """One lease round (raises the driver's error if Redis failed)."""
        plan = self._plan()
        counters = []
        flights = {}
        for key in list(self.keys.by_id.values()):
            policy = key.policy
            if policy.daily_tokens or policy.max_concurrent:
                key._today()
                add = key.day_used - self._reported.get((key.id, key.day), 0) if policy.daily_tokens else 0
                counters.append((key.id, key.day, add, bool(policy.daily_tokens), bool(policy.max_concurrent)))
            if policy.max_concurrent:
                flights[key.id] = key.in_flight
        if not plan and not counters:
            return
        if flights:
            await trio.to_thread.run_sync(self._publish, flights)
        granted, totals = await trio.to_thread.run_sync(self._exchange, plan, counters)
        for (key, limit, amount, _), got in zip(plan, granted, strict=True):
            if limit == "rpm":
                key.req_level += got if amount > 0 else amount
            else:
                key.tok_level += got if amount > 0 else amount
        for key_id, day, add, has_budget, _ in counters:
            key = self.keys.by_id.get(key_id)
            if key is None:
                continue
            day_total, others = totals[key_id]
            if has_budget and key.day == day:
                reported = self._reported[(key_id, day)] = self._reported.get((key_id, day), 0) + add
                for old in [k for k in self._reported if k[0] == key_id and k[1] != day]:
                    del self._reported[old]
                # Others' use too, so the budget holds across edges.
                key.day_others = max(day_total - reported, 0)
            key.others_in_flight = others

    async def run(self) -> None:
        while True:
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
            await trio.sleep(SYNC_S)

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
