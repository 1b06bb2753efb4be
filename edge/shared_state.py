"""Key limits shared by many edges, through Redis (``state = "redis://…"``).

Each edge *leases* slices of a key's per-minute allowances and admits locally
from them, so a request the local balance covers never waits on Redis:

- ``rpm`` and ``tpm`` are token buckets in Redis (a Lua script refills by
  Redis's own clock, so edges' clocks do not matter). Every
  :data:`SYNC_S` an edge tops its local balance of each limit up to a slice
  (:data:`SLICE` of the per-minute limit, at least 1 request or 1 token of
  the largest reservation); a request takes from the balance, a refused one
  does not. A ``tpm`` request settles its reservation into the balance; a
  balance above two slices goes back to Redis. Each call says what the edge
  holds, and the bucket refills only up to its capacity less what the edges
  hold: bucket and balances never add up to more than the minute, so the
  key's admitted rate across edges stays within a few percent of its limit,
  a burst after a quiet spell too. A key the edge admitted nothing of for
  :data:`LEASE_FOR_S` holds nothing (its balance goes back); one it did says
  what it holds every :data:`REFRESH_S` (a silent edge's holding is dropped
  after :data:`EDGE_TTL_S`).
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
- ``daily_tokens`` also counts what requests in flight may still use: a
  request runs on budget its edge holds in Redis, in its entry of the key's
  flights (below): its requests' reservations and its use not yet added to
  the day's counter. A request the holding does not cover asks for its
  reservation in the borrow round trip below, and the flights script grants
  the asks, in order, while the day's total and every edge's holdings are
  below the budget (the request that crosses it finishes). A request's
  reservation goes back as it ends. An edge that admitted a request of the
  key in the last :data:`SLICE_FOR_S` also holds a slice (1% of the budget)
  while two are left, and admits on it without a round trip (+0.2 ms p50
  against a key without limits, +1.3 ms with a round trip each); near the
  budget's end the slices other busy edges hold can refuse a request a
  little early, never let one cross it. (Before, each edge admitted on the
  others' reservations as last read, up to a second old for a quiet key: a
  burst of 200 spread over two edges within 14-72 ms ran 588,392 tokens on a
  100,000 budget, each edge admitting as if alone.)
- ``daily_tokens`` is also held as requests stream: every
  :data:`STREAMED_S` while it has requests of a budget key in flight, an
  edge writes what they have streamed so far (``iop:streamed:<key>:<day>``,
  its field going when they end) and reads the other edges' sum back, which
  the budget's cut of the runs in flight (``Keys.cut_over_budget``) counts
  with its own (one stream on each of two edges, each of ``max_tokens``
  20,000 on a budget of 30,000, ran to 40,002 tokens: each edge counted
  only its own streams and the others' ended requests). An edge killed
  mid-stream reports no end: once its field is :data:`EDGE_TTL_S` old, the
  flights script adds it to the day's counter, and notes it as folded for
  that edge (``iop:folded:<key>:<day>``), which an edge that was only
  paused subtracts from what it adds (and writes) when back.
- ``max_concurrent``: a request runs on a *slot* its edge holds in Redis.
  Each edge's entry in the key's flights hash (``iop:flight:<key>``: slots
  held, budget reserved, when) is written by a script that grows it only as
  far as the other edges' entries leave of the limit, so the edges together
  never hold more than ``max_concurrent``. A request that finds no free
  slot borrows one (the borrow round trip below); every :data:`SYNC_S` an
  edge gives back the slots no request uses, but one *spare* slot while it
  admitted a request of the key in the last :data:`SLICE_FOR_S` and a
  quarter of the limit (and 2) stay free after it, to admit the next
  request on without a round trip (asked for again at every round, so it
  goes within 50 ms once the others leave less room; a request's end then
  waits for that round to give its slot back). An entry silent for
  :data:`EDGE_TTL_S` (its edge died) is dropped by the next script that
  reads it. (Before: each edge published its count every 50 ms and
  admitted on the others' last seen: two edges ran a max_concurrent 2 key
  at 4 half the time under load, and a dead edge's count stayed as long as
  any other edge wrote the hash.)

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

from edge.keys import local_level, recovered
from edge.ledger import LedgerUnavailable

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from edge.errors import APIError
    from edge.keys import Key, Keys

log = structlog.get_logger("iop.edge.state")

SYNC_S = 0.05
SLICE = 0.01  # of a key's per-minute allowance, leased at a time
EDGE_TTL_S = 10  # an edge's published in-flight counts expire after this silence
BORROW_S = 0.5  # a request its edge's balance cannot cover waits this long at most for Redis
REDIS_TIMEOUT_S = 1.0  # a Redis call failing after this long: Redis is down
# ...and a request asking for its budget waits until Redis answered or failed (a stall is judged as
# down, by the edge alone; giving up sooner refused it "over budget" until midnight, and judging
# alone on a slow answer let a burst over two edges cross a budget by six requests).
BUDGET_WAIT_S = BORROW_S + 2 * REDIS_TIMEOUT_S  # (the lease round under way may fail first)
SLOT_RETRY_S = 0.01  # a request finding no free slot in Redis asks again this often, within BORROW_S
REFRESH_S = 1.0  # a key nothing changed for on this edge is written and read again this often
SLICE_FOR_S = 2.0  # an edge holds a slice of a key's budget this long after it admitted a request of it
LEASE_FOR_S = 60.0  # ...and slices of its rpm and tpm (counted in the buckets) this long
STREAMED_S = 0.25  # what a budget key's requests in flight streamed is written (and the others' read) this often,
# and every round (SYNC_S) once a quarter of its budget or less is left (Key.near): two edges' streams of 3,000
# tokens a second crossed a budget of 10,000 together by 1,300-1,500 tokens
# ...and as its runs pass their marks (Keys.hold_to_budget) while other edges have requests of it in flight, in a
# round of its own at most this often: two edges' runs of a model server answering at once, 40,000 tokens each in
# about 0.1 s, crossed a budget of 30,000 together by 22,000-25,000 tokens between rounds
HURRY_S = 0.01
DAY_TTL_S = 2 * 86400
FLOOR_DELAY_S = 2 * REFRESH_S + 0.5  # a new day counter's floor waits for every edge's first report
FLOOR_WAIT_S = 20.0  # a day counter's floor: the ledger's read (its calls give up after 15 s) and Redis's write
FLOOR_RETRY_S = 1.0

# What each script below begins with: Redis's clock, in seconds.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# KEYS[1]: the bucket; ARGV: capacity, refill per second, amount (> 0: take up to it; < 0: give back;
# 0: only say what this edge holds), the level of a bucket Redis does not have (lost with its data: this
# edge's last view of it, refilled since, not a fresh minute; a new key's: its capacity), this edge's id,
# what it holds of the key's allowance now (its balance), the seconds after which a silent edge's holding
# is dropped. The bucket refills up to its capacity less what the edges hold (their fields `o:<edge>`:
# "held when"): what they hold and the bucket's level never add up to more than the minute (an edge's
# slice was outside it, and a burst after a quiet spell got the full bucket and every edge's slice:
# +18% on a tpm 6,000 key over two edges). Returns what it took and the level after.
_BUCKET = (
    _NOW
    + """
local cap = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local want = tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(b[1]) or tonumber(ARGV[4]) or cap
local ts = tonumber(b[2]) or now
local me = 'o:' .. ARGV[5]
local mine = math.max(tonumber(ARGV[6]), 0)
local ttl = tonumber(ARGV[7])
local others = 0
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local name = fields[i]
  if string.sub(name, 1, 2) == 'o:' and name ~= me then
    local held, at = string.match(fields[i + 1], '^(%d+) ([%d.]+)$')
    if held == nil or now - tonumber(at) > ttl then
      redis.call('HDEL', KEYS[1], name)
    else
      others = others + tonumber(held)
    end
  end
end
level = math.min(math.max(cap - others - mine, 0), level + (now - ts) * rate)
local got = 0
if want > 0 then
  got = math.floor(math.min(want, level))
  if got < 0 then got = 0 end
  level = level - got
  mine = mine + got
elseif want < 0 then
  level = math.min(math.max(cap - others, 0), level - want)
  mine = math.max(mine + want, 0)
end
if mine > 0 then
  redis.call('HSET', KEYS[1], me, string.format('%d %.6f', mine, now))
else
  redis.call('HDEL', KEYS[1], me)
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], 180)
return {got, tostring(level)}
"""
)

# A Lua function both scripts below begin with: an edge silent for ttl died, and what its requests in
# flight had streamed (its field in a key's streams today) is the day's use: it never reported their
# ends. Added to the day's counter and noted as folded for it, should it come back and report them.
_FOLD = """
local function fold(day, streams, folded, me, now, ttl)
  local fields = redis.call('HGETALL', streams)
  if #fields == 0 then
    return
  end
  local dttl = redis.call('TTL', day)
  for i = 1, #fields, 2 do
    if fields[i] ~= me then
      local n, at = string.match(fields[i + 1], '^(%d+) ([%d.]+)$')
      if n == nil or now - tonumber(at) > ttl then
        redis.call('HDEL', streams, fields[i])
        if n ~= nil and tonumber(n) > 0 and dttl > 0 then
          redis.call('INCRBY', day, n)
          redis.call('HINCRBY', folded, fields[i], n)
          redis.call('EXPIRE', folded, dttl)
        end
      end
    end
  end
end
"""

# KEYS[1]: a key's flights (edge id -> "slots held, budget held, when"), KEYS[2]: the key's day counter,
# KEYS[3] and KEYS[4]: its streams today and what was folded of them (see _STREAMED);
# ARGV: this edge's id, the slots it wants to hold (more than it holds: only as many as the others leave
# of the limit), the limit (0: none), the budget it holds on (its requests' reservations and its use not
# yet in the day's counter), the seconds after which a silent edge's entry is dropped, the daily budget
# (0: none), a slice of the budget (0: none), a spare slot asked (1) or not (0), then the amounts
# requests waiting on this edge ask of the budget: each is granted, in order, while the day's total and
# every edge's holdings are below the budget (the one that crosses it too). Then the edge holds the slice
# more, to admit on without a round trip, while two are left; and one spare slot besides the slots it
# wants, for the same, while a quarter of the limit (and 2) stay free after it. Returns the slots it
# holds now, the others' slots, the others' budget held, the budget it holds now, how many of the asks
# were granted, and the day's total.
_FLIGHT = (
    _FOLD
    + _NOW
    + """
local ttl = tonumber(ARGV[5])
local entries = redis.call('HGETALL', KEYS[1])
local mine, others, reserved = 0, 0, 0
for i = 1, #entries, 2 do
  local held, pending, at = string.match(entries[i + 1], '^(%d+) (%d+) ([%d.]+)$')
  if entries[i] == ARGV[1] then
    mine = tonumber(held) or 0
  elseif held == nil or now - tonumber(at) > ttl then
    redis.call('HDEL', KEYS[1], entries[i])
  else
    others = others + tonumber(held)
    reserved = reserved + tonumber(pending)
  end
end
local want = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
if limit > 0 and want > mine then
  want = math.max(mine, math.min(want, limit - others))
end
local need = tonumber(ARGV[2])
local room = limit - others - need - 1
if limit > 0 and tonumber(ARGV[8]) > 0 and want >= need and room >= math.max(2, math.floor(limit / 4)) then
  want = need + 1
end
local hold = tonumber(ARGV[4])
local budget = tonumber(ARGV[6])
if budget > 0 then
  fold(KEYS[2], KEYS[3], KEYS[4], ARGV[1], now, ttl)
end
local day = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local granted = 0
for i = 9, #ARGV do
  if budget > 0 and day + reserved + hold < budget then
    hold = hold + tonumber(ARGV[i])
    granted = granted + 1
  else
    break
  end
end
local slice = tonumber(ARGV[7])
if budget > 0 and slice > 0 and day + reserved + hold + 2 * slice <= budget then
  hold = hold + slice
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d %d %.6f', want, hold, now))
redis.call('EXPIRE', KEYS[1], ttl)
return {want, others, reserved, hold, granted, day}
"""
)

# KEYS[1]: a key's streams today (edge id -> "tokens when"), KEYS[2]: what the flights script folded
# of them into the day's counter, per edge, KEYS[3]: the day's counter, KEYS[4]: the epoch; ARGV: this
# edge's id, what its requests of the key in flight have streamed so far (0: none now, and its field
# goes), the seconds after which a silent edge's field is not counted, the hash's TTL. Returns the
# other edges' sum, and, read at the same moment, the day's total (-1: none), the epoch and what of
# this edge's streams is folded in (as _DAY returns it): an edge whose requests end moves what they
# streamed from its field to the day's counter, and the others, reading only the fields, lost it until
# their day script ran again (up to REFRESH_S: a stream ran alone to the budget, 30,340 tokens beside
# the other edge's 15,300 on a budget of 30,000). A silent edge's field stays for the flights script,
# which folds it into the day's counter (an edge killed mid-stream: its tokens were never counted);
# what was folded of this edge's (it was only slow) is not written again.
_STREAMED = (
    _NOW
    + """
local ttl = tonumber(ARGV[3])
local entries = redis.call('HGETALL', KEYS[1])
local others = 0
for i = 1, #entries, 2 do
  if entries[i] ~= ARGV[1] then
    local n, at = string.match(entries[i + 1], '^(%d+) ([%d.]+)$')
    if n == nil then
      redis.call('HDEL', KEYS[1], entries[i])
    elseif now - tonumber(at) <= ttl then
      others = others + tonumber(n)
    end
  end
end
local mine = tonumber(ARGV[2]) - tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if tonumber(ARGV[2]) > 0 and mine > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], string.format('%d %.6f', mine, now))
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
local total = redis.call('GET', KEYS[3]) or '-1'
return {others, total, redis.call('GET', KEYS[4]) or '', tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')}
"""
)

# KEYS[1]: the epoch, KEYS[2]: a key's day counter; ARGV: an epoch to set if Redis has none, the
# epoch this edge last reported the day in, what to add if it is still that one, else what to add
# if the counter exists, else what to add, the counter's TTL, this edge's id; KEYS[3]: what the
# flights script folded into the counter of edges' streams (see _STREAMED). Returns the epoch, the
# day's total, whether the counter existed before, and what of this edge's streams is folded in and
# not yet counted by its adds (in the total, and not the other edges' use).
_DAY = """
redis.call('SET', KEYS[1], ARGV[1], 'NX')
local epoch = redis.call('GET', KEYS[1])
local existed = redis.call('EXISTS', KEYS[2])
local add = tonumber(ARGV[5])
if epoch == ARGV[2] then
  add = tonumber(ARGV[3])
elseif existed == 1 then
  add = tonumber(ARGV[4])
end
local folded = tonumber(redis.call('HGET', KEYS[3], ARGV[7]) or '0')
local add0 = add
if folded > 0 and add > 0 then
  -- (this edge was silent long enough for its streams to be folded in: that much of them is in)
  local counted = math.min(folded, add)
  add = add - counted
  redis.call('HINCRBY', KEYS[3], ARGV[7], -counted)
end
local total = redis.call('INCRBY', KEYS[2], add)
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[6]))
return {epoch, total, existed, folded - math.min(folded, math.max(add0, 0))}
"""

# KEYS[1]: a key's day counter, KEYS[2]: the epoch; ARGV: the day's total in the shared ledger, the
# counter's TTL, the epoch the counter was found missing in. Raises the counter to the ledger's
# total (a lower bound of the day's use: every row is use), unless Redis lost its data since: the
# counter is then another, whose own floor its maker raises once every edge has added to it
# (-1: left as it is).
_FLOOR = """
if redis.call('GET', KEYS[2]) ~= ARGV[3] then
  return -1
end
local total = tonumber(redis.call('GET', KEYS[1]) or '0')
local floor = tonumber(ARGV[1])
if floor > total then
  redis.call('SET', KEYS[1], floor, 'EX', tonumber(ARGV[2]))
  return floor
end
return total
"""

# KEYS[1]: the epoch, then per key at rest on this edge (it holds nothing in Redis and has nothing to
# add): its flights, its day counter, its streams today and what was folded of them (see _FLIGHT);
# ARGV: this edge's id, the seconds after which a silent edge's entry is not counted, then per key the
# epoch its day was last reported in ('': a key without a daily budget). Writes nothing of this edge's;
# a silent edge's streams are folded into the day's counter, as _FLIGHT does. Returns per key the other
# edges' slots and budget held, the day's total (-1: no budget, or Redis lost its data since: the day
# script adds this edge's use again) and what of this edge's streams is folded in, as _DAY does. (A key
# at rest was written by both scripts every REFRESH_S: 500 idle budget keys cost 142,000 Redis commands
# in 10 s and 8% of a core on every edge.)
_QUIET = (
    _FOLD
    + _NOW
    + """
local ttl = tonumber(ARGV[2])
local epoch = redis.call('GET', KEYS[1])
local out = {}
for k = 0, #ARGV - 3 do
  local others, reserved = 0, 0
  local entries = redis.call('HGETALL', KEYS[2 + 4 * k])
  for i = 1, #entries, 2 do
    if entries[i] ~= ARGV[1] then
      local held, pending, at = string.match(entries[i + 1], '^(%d+) (%d+) ([%d.]+)$')
      if held ~= nil and now - tonumber(at) <= ttl then
        others = others + tonumber(held)
        reserved = reserved + tonumber(pending)
      end
    end
  end
  local total, folded = -1, 0
  local day, streams, gone = KEYS[3 + 4 * k], KEYS[4 + 4 * k], KEYS[5 + 4 * k]
  if ARGV[3 + k] ~= '' then
    fold(day, streams, gone, ARGV[1], now, ttl)
    local v = redis.call('GET', day)
    if v and epoch == ARGV[3 + k] then
      total = tonumber(v)
      folded = tonumber(redis.call('HGET', gone, ARGV[1]) or '0')
    end
  end
  out[#out + 1] = others
  out[#out + 1] = reserved
  out[#out + 1] = total
  out[#out + 1] = folded
end
return out
"""
)
QUIET_BATCH = 256  # keys at rest read in one script call

EPOCH_KEY = "iop:epoch"

# (key, limit, amount, per-minute limit): to take (amount > 0) from a bucket, or give back to it
BucketOp = tuple["Key", str, int, int]
# (slots, max_concurrent, budget held, daily_tokens, day, a slice of the budget to hold besides, a spare
# slot asked: 1 or 0): a key's flights as this edge writes them
FlightArgs = tuple[int, int, int, int, int, int, int]


def _budget_room(key: Key) -> int:
    """Of the budget ``key`` holds in Redis, what no request of this edge uses or was promised."""
    return key.budget_held - key.day_pending - key.budget_promised - key.unreported()


class _Want:
    """What one request lacks, and what it got."""

    __slots__ = (
        "key",
        "requests",
        "tokens",
        "slot",
        "budget",
        "got",
        "got_slot",
        "got_budget",
        "gone",
        "answered",
        "failed",
    )

    def __init__(self, key: Key, requests: int, tokens: int, slot: bool, budget: int = 0) -> None:
        self.key = key
        self.requests = requests
        self.tokens = tokens
        self.slot = slot  # it needs one of the key's max_concurrent slots
        self.budget = budget  # what it needs to hold of the key's daily budget
        self.got = (0, 0)
        self.got_slot = False  # promised to it (Key.flight_promised) until it stops waiting
        self.got_budget = False  # its budget promised to it (Key.budget_promised), likewise
        self.gone = False  # it stopped waiting: what comes goes to the key's balances
        self.answered = False  # Redis answered the round trip it was in
        self.failed = False  # ...or failed it (the edge then judges its budget alone)


class _Borrowing:
    """What the requests waiting at one time lack, borrowed in one round trip."""

    __slots__ = ("wants", "done")

    def __init__(self) -> None:
        self.wants: list[_Want] = []
        self.done = trio.Event()


class SharedState:
    def __init__(
        self, url: str, keys: Keys, edge_id: str, day_totals: Callable[[float], Awaitable[dict[str, int]]] | None = None
    ) -> None:
        """``day_totals``: with a ledger every edge shares (PostgreSQL), its tokens per key
        since a time (``Ledger.day_totals``), to rebuild a day counter Redis lost."""
        import redis

        self._redis_error = redis.RedisError
        self.client = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)
        self.bucket = self.client.register_script(_BUCKET)
        self.day = self.client.register_script(_DAY)
        self.flight = self.client.register_script(_FLIGHT)
        self.floor = self.client.register_script(_FLOOR)
        self.streams = self.client.register_script(_STREAMED)
        self.quiet = self.client.register_script(_QUIET)
        self.day_totals = day_totals
        # (key id, day, epoch the counter was made in): counters to raise to the ledger's totals, and when
        self._floors_wanted: dict[tuple[str, int, bytes], float] = {}
        self._floors_wake = trio.Event()
        self.keys = keys
        keys.shared = True  # leases from the first round on
        keys.zero_levels()
        self.edge_id = edge_id
        self.up = False
        self._forgive = False  # the next round forgives what a key still owes (edge.keys.Keys.forgive)
        self.failures = 0
        self.borrows = 0  # requests that waited on a round trip (iop_shared_state_borrows_total)
        self._heard = 0.0  # time.monotonic() of Redis's last answer to a round
        # (key id, day) -> (the epoch, its day_used added to Redis so far in that epoch)
        self._reported: dict[tuple[str, int], tuple[bytes, int]] = {}
        self._reported_day: dict[str, int] = {}  # key id -> the day of its one entry in _reported
        self._borrowing: _Borrowing | None = None  # filling, for the next round trip
        self._wake = trio.Event()
        # key id -> the flights arguments last written, and when (time.monotonic): a key is
        # written again when they change, else every REFRESH_S (the rounds' cost was per key)
        self._written: dict[str, tuple[tuple[int, int, int], float]] = {}
        self._streamed_at: dict[str, float] = {}  # budget keys whose streams this edge wrote (a field to drop), when
        self._settled: dict[str, Key] = {}  # keys whose requests ended: their slots go back now
        self._hurried: set[str] = set()  # budget keys whose streams go to Redis in a round now (HURRY_S)
        self._recheck: set[str] = set()  # keys whose day Redis lost: the day script adds it again, next round
        self._epoch: bytes | None = None  # Redis's epoch as last read (each round, while keys have budgets)
        self._others_floor: dict[str, tuple[int, int]] = {}  # key id -> (day_others, its day): see _others
        # key id -> (when it was read, the key, its policy, admitted_at, day_used) of a key at rest: passed
        # over by the rounds until REFRESH_S after that read, unless one of these changed (2,000 keys at
        # rest, looked at every round, were 7% of a core)
        self._resting: dict[str, tuple[float, Key, object, float, int]] = {}
        keys.on_settle = self._on_settle
        keys.on_mark = self._on_mark

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

    def _plan(self, recovering: bool = False) -> list[BucketOp]:
        """What to lease (> 0) or give back (< 0), in the trio thread; and (0) what a key
        admitted on lately holds, said again every :data:`REFRESH_S` (a silent edge's
        holding is dropped after :data:`EDGE_TTL_S`). A key this edge admitted nothing of
        for :data:`LEASE_FOR_S` holds nothing: its balance goes back."""
        plan: list[BucketOp] = []
        now = time.monotonic()
        for key in list(self.keys.by_id.values()):
            policy = key.policy
            if not (policy.rpm or policy.tpm):
                continue
            active = key.in_flight or now - key.admitted_at < LEASE_FOR_S
            requests, tokens = self._slices(key) if active else (0, 0)
            stale = now - key.said_at >= REFRESH_S
            req_level, tok_level = recovered(key) if recovering else (key.req_level, key.tok_level)
            for limit, per_minute, level, target in (
                ("rpm", policy.rpm, req_level, requests),
                ("tpm", policy.tpm, tok_level, tokens),
            ):
                if not per_minute:
                    continue
                amount = target - int(level)
                if amount > 0:
                    plan.append((key, limit, amount, per_minute))
                elif level > 2 * target or (not active and level >= 1):
                    plan.append((key, limit, -int(level - target), per_minute))
                elif (active and stale) or recovering:  # (recovering: the round's scripts must go through)
                    plan.append((key, limit, 0, per_minute))
        return plan

    def _buckets(self, pipe, plan: list[BucketOp]) -> None:
        now = time.monotonic()
        for key, limit, amount, per_minute in plan:
            # A bucket Redis lost (a restart without persistence, FLUSHALL) starts where this edge last
            # saw it, refilled since: from full, a key that had spent its minute got a second one at
            # once (rpm 60: 123 requests in 2 s; 331 against 200 in 35 s around a restart).
            level = local_level(per_minute, 0.0, key.req_seen if limit == "rpm" else key.tok_seen, now)
            # (what it holds: a local bucket's level is no holding, what it recovered is)
            levels = (key.req_level, key.tok_level) if self.keys.shared else recovered(key)
            held = levels[0] if limit == "rpm" else levels[1]
            self.bucket(
                keys=[f"iop:bucket:{key.id}:{limit}"],
                args=[per_minute, per_minute / 60.0, amount, f"{level:.3f}", self.edge_id, int(held), EDGE_TTL_S],
                client=pipe,
            )
            key.said_at = now

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
        self,
        plan: list[BucketOp],
        counters: list[tuple[str, int, list | None, FlightArgs | None]],
        streams: list[tuple[str, int, int]] | tuple[()] = (),
        quiet: list[tuple[str, int, bytes]] | tuple[()] = (),
    ) -> tuple[
        list,
        dict[str, tuple[tuple[bytes, int, int, int] | None, list | None]],
        list[tuple[int, int, bytes, int]],
        list[int],
        bytes | None,
    ]:
        """In a worker thread: the Redis round trip (one pipeline). ``counters``: per
        key, its day's script arguments and its flights' (None: not this time);
        ``streams``: (key id, day, tokens its requests in flight streamed) to write,
        each answered with the other edges' sum, the day's total, the epoch and what of
        this edge's streams is folded in (the third list returned); ``quiet``:
        (key id, day, the epoch its day was reported in) of keys at rest, read (see
        _QUIET: four numbers a key, the last list returned); then Redis's epoch, read first."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(EPOCH_KEY)
        for i in range(0, len(quiet), QUIET_BATCH):
            batch = quiet[i : i + QUIET_BATCH]
            keys = [EPOCH_KEY]
            for key_id, day, _ in batch:
                keys += (
                    f"iop:flight:{key_id}",
                    f"iop:day:{key_id}:{day}",
                    f"iop:streamed:{key_id}:{day}",
                    f"iop:folded:{key_id}:{day}",
                )
            self.quiet(keys=keys, args=[self.edge_id, EDGE_TTL_S, *(epoch for _, _, epoch in batch)], client=pipe)
        self._buckets(pipe, plan)
        for key_id, day, adds, flight in counters:
            if adds is not None:
                self.day(
                    keys=[EPOCH_KEY, f"iop:day:{key_id}:{day}", f"iop:folded:{key_id}:{day}"],
                    args=[secrets.token_hex(8), *adds, DAY_TTL_S, self.edge_id],
                    client=pipe,
                )
            if flight is not None:
                self._flight(pipe, key_id, flight)
        for key_id, day, streamed in streams:
            self.streams(
                keys=[
                    f"iop:streamed:{key_id}:{day}",
                    f"iop:folded:{key_id}:{day}",
                    f"iop:day:{key_id}:{day}",
                    EPOCH_KEY,
                ],
                args=[self.edge_id, streamed, EDGE_TTL_S, DAY_TTL_S],
                client=pipe,
            )
        epoch, *results = pipe.execute()
        batches = -(-len(quiet) // QUIET_BATCH)
        read = [int(v) for batch in results[:batches] for v in batch]
        results = results[batches:]
        others = [
            (int(n), int(total), epoch, int(folded))
            for n, total, epoch, folded in (results[len(results) - len(streams) :] if streams else ())
        ]
        rest = results[len(plan) :]
        out: dict[str, tuple[tuple[bytes, int, int, int] | None, list | None]] = {}
        i = 0
        for key_id, _, adds, flight in counters:
            day_result = flown = None
            if adds is not None:
                day_result = (rest[i][0], int(rest[i][1]), int(rest[i][2]), int(rest[i][3]))
                i += 1
            if flight is not None:
                flown = rest[i]
                i += 1
            out[key_id] = (day_result, flown)
        return results[: len(plan)], out, others, read, epoch

    def _flight(self, pipe, key_id: str, args: FlightArgs, asks: list[int] | tuple[()] = ()) -> None:
        """Queue the flights script for ``key_id`` (see _FLIGHT) on ``pipe``."""
        slots, limit, hold, budget, day, slice_, spare = args
        self.flight(
            keys=[
                f"iop:flight:{key_id}",
                f"iop:day:{key_id}:{day}",
                f"iop:streamed:{key_id}:{day}",
                f"iop:folded:{key_id}:{day}",
            ],
            args=[self.edge_id, slots, limit, hold, EDGE_TTL_S, budget, slice_, spare, *asks],
            client=pipe,
        )

    def _flown(self, key: Key, args: FlightArgs, result: list) -> int:
        """In the trio thread: the flights script's answer for ``key`` (written with
        ``args``); how many of the budget asks it granted."""
        self._written[key.id] = (args, time.monotonic())
        held, others, reserved, hold, granted, _ = (int(v) for v in result)
        policy = key.policy
        key.flight_held = held if policy.max_concurrent else 0
        key.flight_spare = bool(args[6]) and held > args[0]
        key.others_in_flight = others
        key.others_pending = reserved if policy.daily_tokens else 0
        key.budget_held = hold if policy.daily_tokens else 0
        key.budget_sliced = bool(args[5]) and hold > args[2]
        return granted

    def _flight_args(self, key: Key) -> FlightArgs:
        """What ``key`` holds on in Redis: the slots its requests use or were
        promised, and of the budget its requests' reservations, what was promised
        and its use not yet in the day's counter (the rest is given back, at once
        here); its limits, its day, and while it admitted a request in the last
        :data:`SLICE_FOR_S` a slice of the budget (1%) and a spare slot for the
        script to add while there is ample room, to admit the next ones on without a
        round trip (an idle edge holds neither: a slot's round trip was +1.7 ms to
        a first token)."""
        policy = key.policy
        slots = hold = slice_ = spare = 0
        active = key.in_flight or time.monotonic() - key.admitted_at < SLICE_FOR_S
        if policy.max_concurrent:
            slots = key.in_flight + key.flight_promised
            spare = 1 if active else 0
        if policy.daily_tokens:
            key._today()
            hold = key.day_pending + key.budget_promised + key.unreported()
            if active:
                slice_ = self._slice(policy.daily_tokens)
        return slots, policy.max_concurrent, hold, policy.daily_tokens, key.day, slice_, spare

    @staticmethod
    def _writing(key: Key, args: FlightArgs) -> None:
        """``args`` are being written for ``key``: until the script answers, it admits on no
        more than they hold on (not on a spare slot or a budget slice the script may not
        grant again). Only then: lowered at every round, written or not, a key's budget
        slice was gone until its next write (a round trip for each request, as with none)."""
        key.flight_held = min(key.flight_held, args[0])
        key.budget_held = min(key.budget_held, args[2])

    def _day_adds(self, key: Key) -> tuple[list, int]:
        """The day script's epoch and amounts for ``key`` (see _DAY), and the day_used they report."""
        used = key.day_used
        epoch, reported = self._reported.get((key.id, key.day), (b"", 0))
        own = used - key.restored
        # A shared ledger: what this edge restored at start is every edge's use, which the others
        # add too (a counter made anew after Redis lost its data was 33-50% over): only its own use
        # goes in, and the ledger's total is the counter's floor (_floors).
        return [epoch, used - reported, own, own if self.day_totals is not None else used], used

    async def round(self) -> None:
        """One lease round (raises the driver's error if Redis failed)."""
        # Back from local limits only once this round went through, each key's balance then
        # what it recovered (edge.keys.recovered), which the plan leases against and gives back
        # from: never a local bucket's level. (A ping first: a Redis that answered it and refused
        # the scripts, read-only, out of memory, switched limits off, each round a new local bucket.)
        recovering = not self.keys.shared
        plan = self._plan(recovering)
        counters = []
        streams: list[tuple[Key, int, int]] = []
        used: dict[str, int] = {}
        now = time.monotonic()
        hurried, self._hurried = self._hurried, set()
        quiet: list[tuple[Key, FlightArgs, bytes]] = []  # keys at rest, to read (not write) now
        budgets = False  # (some key has a daily budget: Redis's epoch is read every round)
        for key in list(self.keys.by_id.values()):
            policy = key.policy
            if not policy.daily_tokens:
                # (a budget removed: other edges' use is no longer followed)
                key.day_others = key.others_pending = key.others_streamed = 0
            if not policy.max_concurrent:
                key.others_in_flight = 0
            if not (policy.daily_tokens or policy.max_concurrent):
                continue
            budgets = budgets or bool(policy.daily_tokens)
            rest = self._resting.get(key.id)
            if (
                rest is not None
                and now - rest[0] < REFRESH_S
                and rest[1] is key
                and rest[2] is policy
                and rest[3] == key.admitted_at
                and rest[4] == key.day_used
                and not key.in_flight
            ):
                continue  # (at rest, read within REFRESH_S, and nothing changed since)
            self._resting.pop(key.id, None)
            # What nothing changed for on this edge is written and read every REFRESH_S, not every
            # round: 2,000 idle budget keys took 83% of a core and made a request wait 172 ms.
            key._today()
            flight = self._flight_args(key)
            written = self._written.get(key.id)
            stale = written is None or now - written[1] >= REFRESH_S
            adds = None
            reported = None
            if policy.daily_tokens:
                day_adds, day_used = self._day_adds(key)
                reported = self._reported.get((key.id, key.day))
                if stale or reported is None or day_adds[1] or key.id in self._recheck:
                    adds, used[key.id] = day_adds, day_used
            if (
                written is not None
                and written[0] == flight
                and not (flight[0] or flight[2] or flight[5] or flight[6] or key.in_flight or key.live)
                and (reported is not None or not policy.daily_tokens)
                and not (policy.daily_tokens and day_adds[1])
                and key.id not in self._recheck
            ):
                # At rest: Redis holds nothing of it for this edge (its zeros are written) and there
                # is nothing to add: what the others hold and the day's total are read, in one
                # script for many keys, every REFRESH_S; nothing is written. (A request of it
                # borrows, and so writes, before it runs: at rest there is no slice or spare.)
                if stale:
                    quiet.append((key, flight, reported[0] if reported is not None else b""))
                elif key.id not in self._streamed_at:  # (else its field goes first: see below)
                    self._resting[key.id] = (written[1], key, policy, key.admitted_at, key.day_used)
                adds = None
                flight = None
            elif not stale and written is not None and written[0] == flight and not key.flight_spare:
                # (nothing new to say, and what others said was read within REFRESH_S; a spare slot
                # is asked for again every round, so it goes as soon as others leave too little room)
                flight = None
            else:
                self._writing(key, flight)
            if adds is not None or flight is not None:
                counters.append((key.id, key.day, adds, flight))
                if adds is not None:
                    self._recheck.discard(key.id)
            if policy.daily_tokens and (key.live or key.id in self._streamed_at):
                at = self._streamed_at.get(key.id)
                if at is None or now - at >= (SYNC_S if key.near else STREAMED_S) or not key.live or key.id in hurried:
                    streams.append((key, key.day, key.gauge.streamed if key.gauge is not None else 0))
        if not plan and not counters and not streams and not quiet:
            # Nothing to write: Redis must still answer before it counts as back, and is asked
            # every REFRESH_S while up (with only rpm/tpm keys at rest, iop_shared_state_up read 1
            # for as long as Redis was gone, until a request found it so); its epoch every round
            # while keys have budgets (see _saw_epoch).
            if budgets:
                self._saw_epoch(await trio.to_thread.run_sync(self.client.get, EPOCH_KEY))
                self._heard = time.monotonic()
            elif not self.up or now - self._heard >= REFRESH_S:
                await trio.to_thread.run_sync(self.client.ping)
                self._heard = time.monotonic()
            if recovering:  # (no key has an rpm or tpm: nothing to recover)
                self.keys.shared_levels()
            return
        written = [(key.id, day, streamed) for key, day, streamed in streams]
        reads = [(key.id, flight[4], epoch) for key, flight, epoch in quiet]
        granted, totals, others, read, current = await trio.to_thread.run_sync(
            self._exchange, plan, counters, written, reads
        )
        self._heard = time.monotonic()
        self._saw_epoch(current)
        for i, (key, flight, epoch) in enumerate(quiet):
            self._rested(key, flight, epoch, read[4 * i : 4 * i + 4])
        if recovering:
            # What each key recovered, as of now: a round sent before Redis stalled comes back when
            # it does, its plan made before the outage's spending. What Redis's bucket does not pay
            # of a debt in the next round, planned on it, is forgiven then (Keys.forgive).
            self.keys.shared_levels()
        self._credit(plan, granted)
        if self._forgive:
            self._forgive = False
            self.keys.forgive()
        self._forgive = recovering
        for key_id, day, _, flight in counters:
            key = self.keys.by_id.get(key_id)
            if key is None:
                continue
            day_result, flown = totals[key_id]
            if day_result is not None:
                epoch, day_total, existed, folded = day_result
                if not existed and self.day_totals is not None:
                    self._floors_wanted.setdefault((key_id, day, epoch), trio.current_time() + FLOOR_DELAY_S)
                    self._floors_wake.set()
                reported = used[key_id]
                was = self._reported.get((key_id, day))
                if was is not None and was[0] and was[0] != epoch and key.day == day:
                    # (Redis lost its data: the others' use, as last read, holds for the day: live
                    # edges add theirs again within a round, but not one paused or gone meanwhile)
                    floor = self._others_floor.get(key_id)
                    held = floor[0] if floor is not None and floor[1] == day else 0
                    self._others_floor[key_id] = (max(key.day_others, held), day)
                self._reported[(key_id, day)] = (epoch, reported)
                before = self._reported_day.get(key_id)
                if before is not None and before != day:  # (one day a key: a scan of all was O(keys) a key)
                    self._reported.pop((key_id, before), None)
                self._reported_day[key_id] = day
                if key.day == day:
                    key.day_reported = reported
                    # Others' use too, so the budget holds across edges (Redis holds all of this edge's).
                    # (less this edge's own streams folded in while it was paused: they are in its
                    # streams in flight; counted twice, they cut its own stream early: a re-check)
                    self._others(key, day_total - reported - folded)
            if flown is not None and flight is not None:
                self._flown(key, flight, flown)
        for (key, day, streamed), (theirs, total, epoch, folded) in zip(streams, others, strict=True):
            if streamed:
                self._streamed_at[key.id] = self._heard
            else:  # (its field is gone: nothing more to write until it streams again)
                self._streamed_at.pop(key.id, None)
            if key.day != day:
                key.others_streamed = 0
                continue
            # (read as its own field goes: kept, it was the others' count then for good, and the
            # next run here counted it twice, with the day's total it moved to; the run was cut at
            # its first token, the budget a third unspent: a re-check)
            key.others_streamed = theirs if key.live else 0
            reported = self._reported.get((key.id, day))
            if key.id not in used and reported is not None and reported[0] == epoch and total >= 0:
                # (the day's total as the fields were read: what the others' ended requests streamed;
                # a key whose day script ran in this round has it from there, with its adds in)
                self._others(key, total - reported[1] - folded)
            if key.live:  # (its runs check again at what is left now: at once, if the others crossed it)
                self.keys.hold_to_budget(key)

    def _saw_epoch(self, epoch: bytes | None) -> None:
        """Redis's epoch as read now: one other than the last (Redis lost its data, and with
        it every key's day counter) has every budget key's day added again in the next round,
        at rest or not. Keys at rest learned of it at their next read, up to REFRESH_S on, and
        added their day only REFRESH_S after that: meanwhile another edge was granted budgets
        against a counter without their use, and a key of 20,000 tokens a day served 35,021
        (a re-check). Every key's flights entry is written again in that round too: the others'
        reservations were missing until an entry's REFRESH_S was up, and a request the held
        budget left no room for was granted, the key's streams on every edge then cut (the
        next re-check)."""
        if epoch != self._epoch and self._epoch is not None:
            self._resting.clear()
            self._written.clear()
            self._recheck.update(key.id for key in self.keys.by_id.values() if key.policy.daily_tokens)
        self._epoch = epoch

    def _rested(self, key: Key, flight: FlightArgs, epoch: bytes, read: list[int]) -> None:
        """In the trio thread: what the quiet script read of ``key``, at rest (written as
        ``flight``, its day reported in ``epoch``)."""
        others, reserved, total, folded = read
        self._written[key.id] = (flight, self._heard)
        policy = key.policy
        key.others_in_flight = others if policy.max_concurrent else 0
        if not policy.daily_tokens or key.day != flight[4]:
            return
        key.others_pending = reserved
        if total < 0:
            self._recheck.add(key.id)  # (the next round's day script adds what this edge knows again)
            return
        reported = self._reported.get((key.id, key.day))
        if reported is not None and reported[0] == epoch:
            self._others(key, total - reported[1] - folded)

    def _others(self, key: Key, others: int) -> None:
        """``key``'s other edges' use today, as read now; once Redis lost its data, no less
        that day than it was read before (:meth:`_saw_epoch`). Use only grows in a day, so this
        counts nothing twice. An edge that added its own use to the new counter first read the
        others' as none, and admitted on it (a budget of 20,000 served 10,010 more in the round
        before the others had added theirs again), and an edge paused across the loss never
        adds its use again until it is back (with a floor of 2 s, another 20,167 were served)."""
        floor = self._others_floor.get(key.id)
        if floor is not None:
            if floor[1] == key.day:
                others = max(others, floor[0])
            else:
                del self._others_floor[key.id]
        key.day_others = max(others, 0)

    def _on_settle(self, key: Key) -> None:
        """A request of ``key`` ended: its slot and its reservation go back to Redis in the
        loop's next turn, not its next round (a client taking turns between two edges found
        the other edge's slot held for up to 50 ms after its last request, and was refused).
        A key whose edge holds a spare slot and a slice of its budget (for what it has:
        there was room) waits for the round: each write holds the edge to what it writes
        until Redis answers, and a client's next request, there meanwhile, waited on a round
        trip (+1.3 ms to its first token, where the slice or the spare should admit it)."""
        policy = key.policy
        # (a slot a key's other edges may want now, with more than half of its limit in use when
        # last read, goes back at once: a burst's waiting requests were refused, the limit unfilled)
        spare = key.flight_spare and key.others_in_flight + key.in_flight < policy.max_concurrent // 2
        if (spare or not policy.max_concurrent) and (key.budget_sliced or not policy.daily_tokens):
            return
        if self.up and self.keys.shared:
            self._settled[key.id] = key
            self._wake.set()

    def _on_mark(self, key: Key) -> None:
        """``key``'s runs passed a mark of its budget (a sixteenth of it; near it, each half of
        what is left) with other edges' requests of it in flight: what they streamed goes to
        Redis, and what the others' streamed comes back, in a round within :data:`HURRY_S`,
        not at the next round."""
        if self.up and self.keys.shared and key.id not in self._hurried:
            self._hurried.add(key.id)
            self._wake.set()

    async def _give_back(self) -> None:
        settled, self._settled = self._settled, {}
        sent = {key_id: (key, self._flight_args(key)) for key_id, key in settled.items()}
        for key, args in sent.values():
            self._writing(key, args)

        def write() -> list:
            pipe = self.client.pipeline(transaction=False)
            for key_id, (_, args) in sent.items():
                self._flight(pipe, key_id, args)
            return pipe.execute()

        results = await trio.to_thread.run_sync(write)
        for (key, args), flown in zip(sent.values(), results, strict=True):
            self._flown(key, args, flown)

    # -- borrowing: a request its edge's balance cannot cover ------------------------------

    async def cover(self, key: Key, refusal: APIError, prompt_estimate: int, max_tokens: int | None) -> bool | None:
        """``refusal`` (of ``key``'s request by this edge's balances): hold what the
        balances have of the request's need and borrow the rest from Redis, waiting
        :data:`BORROW_S` at most (:data:`BUDGET_WAIT_S` for budget). True if the borrow
        was answered (admit the request once more: it finds both in the balances),
        False if not (refuse it as it is), None if Redis failed the budget's round
        trip, or failed or never answered a slot's (the caller judges the request by
        this edge alone, as when Redis is down)."""
        limit = getattr(refusal, "limit", None)
        if limit not in ("rpm", "tpm", "slot", "reserved") or not self.up or not self.keys.shared:
            return False
        need_requests, need_tokens, need_slot = self.keys.needs(key, prompt_estimate, max_tokens)
        day_need = self.keys.day_need(prompt_estimate, max_tokens) if key.policy.daily_tokens else 0
        held_requests = min(max(key.req_level, 0.0), need_requests)
        held_tokens = min(max(key.tok_level, 0.0), need_tokens)
        key.req_level -= held_requests  # (so the requests admitted meanwhile do not take it)
        key.tok_level -= held_tokens
        requests, tokens = math.ceil(need_requests - held_requests), math.ceil(need_tokens - held_tokens)
        self.borrows += 1
        promised = 0  # of the budget, what this request keeps promised to itself while it waits for a slot
        # A free slot this edge holds is kept for it while it borrows the rest (the round trip
        # writes the key's flights, which gives back every slot no request uses or was promised:
        # 67 of 800 requests of a budget key were refused a slot with 4 of 1,000 in flight).
        slot_kept = 1 if key.policy.max_concurrent and not need_slot else 0
        key.flight_promised += slot_kept
        answered = False  # a slot's borrow came back (none free) at least once
        # A slot is waited for BORROW_S at most, a budget's answer for longer (BUDGET_WAIT_S): a key
        # with both limits waited out the budget's 2.5 s for a slot, then its refusal, the budget's,
        # was a 503 `budget_unchecked` with its budget answered (48 of 188 over three edges).
        slot_until = trio.current_time() + BORROW_S
        try:
            with trio.move_on_after(BUDGET_WAIT_S if day_need and _budget_room(key) < day_need else BORROW_S):
                while True:
                    if day_need and not promised and _budget_room(key) >= day_need:
                        promised = day_need  # (else the next write to Redis gives it back meanwhile)
                        key.budget_promised += promised
                    budget = day_need if day_need and not promised else 0
                    want = await self.borrow(key, requests, tokens, need_slot > 0, budget)
                    if budget:
                        if not want.got_budget:  # refused over budget, once more; or Redis did not answer
                            return None if want.failed else want.answered
                        promised = budget  # (borrow gave its promise back: this request keeps it)
                        key.budget_promised += promised
                    if want.failed:  # (Redis failed it: judged by this edge's own view, now Redis is down)
                        return None
                    if not need_slot or want.got_slot:
                        return True
                    answered = True
                    if trio.current_time() + SLOT_RETRY_S > slot_until:
                        break
                    # None free: a request on another edge may end any moment (its slot comes back
                    # as it does): ask again, within BORROW_S, before refusing.
                    requests = tokens = 0  # (what was borrowed is in the balances)
                    await trio.sleep(SLOT_RETRY_S)
            # No answer at all (a Redis that hangs, not yet known down): not "none free" (a key
            # of max_concurrent 100 with none in flight was refused 8 of 8 that way).
            if need_slot and not answered:
                return None
            # Answered, none free: admitted once more, the request is refused for what it still
            # lacks (a slot: the usual 429), not for the budget that refused it first.
            return answered and bool(day_need)
        finally:
            key.budget_promised -= promised  # (free for its admission, next, with no await between)
            key.flight_promised -= slot_kept
            self._give(key, held_requests, held_tokens)

    async def borrow(self, key: Key, requests: int, tokens: int, slot: bool = False, budget: int = 0) -> _Want:
        """Take ``requests`` and ``tokens`` (or what there is of them) from ``key``'s
        buckets into this edge's balances, a concurrency ``slot`` if asked (and the
        other edges leave one), and ``budget`` of the daily budget (if the day and
        every edge's holdings leave it), in one round trip with the other borrows
        waiting now. Callers bound the wait; what comes after one left goes to the
        balances (a slot or budget: to the next request, or back at the next round).
        Nothing awaits between this return and the caller's admission, so what it
        borrowed is there for it."""
        borrowing = self._borrowing
        if borrowing is None:
            borrowing = self._borrowing = _Borrowing()
            self._wake.set()
        want = _Want(key, requests, tokens, slot, budget)
        borrowing.wants.append(want)
        try:
            await borrowing.done.wait()
        finally:
            want.gone = True
            self._give(key, *want.got)
            # Free now, for this request's admission (next, with no await between):
            if want.got_slot:
                key.flight_promised -= 1
            if want.got_budget:
                key.budget_promised -= want.budget
        return want

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
        flights: dict[str, list] = {}  # key id -> [key, slots held before, flights args, budget asks]
        for want in borrowing.wants:
            wants_slot = want.slot and want.key.policy.max_concurrent
            wants_budget = want.budget and want.key.policy.daily_tokens
            if wants_slot or wants_budget:
                entry = flights.get(want.key.id)
                if entry is None:
                    args = self._flight_args(want.key)  # (first: it gives back the slots no request holds)
                    self._writing(want.key, args)
                    entry = flights[want.key.id] = [want.key, want.key.flight_held, args, []]
                if wants_slot:
                    slots, *rest = entry[2]
                    entry[2] = (slots + 1, *rest)
                if wants_budget:
                    entry[3].append(want.budget)
        if not plan and not flights:
            return

        def take() -> list:
            pipe = self.client.pipeline(transaction=False)
            self._buckets(pipe, plan)
            for key_id, (_, _, args, asks) in flights.items():
                self._flight(pipe, key_id, args, asks)
            return pipe.execute()

        try:
            results = await trio.to_thread.run_sync(take, abandon_on_cancel=True)
        except (self._redis_error, OSError) as e:
            # Down from now on (the next round's answer brings it back): the requests waiting are
            # judged by this edge's own view, as with Redis down, not by the slice it holds (a key
            # with 54 of rpm 60 left was refused when Redis died, until the next round said so).
            self._down(e)
            for want in borrowing.wants:
                want.failed = True
            return
        for want in borrowing.wants:
            want.answered = True
        free: dict[str, int] = {}
        granted: dict[str, int] = {}
        for (key, before, args, _), flown in zip(flights.values(), results[len(plan) :], strict=True):
            granted[key.id] = self._flown(key, args, flown)
            free[key.id] = key.flight_held - before
        for want in borrowing.wants:  # slots in arrival order, while there are some; budget as granted
            if want.slot and free.get(want.key.id, 0) > 0 and not want.gone:
                free[want.key.id] -= 1
                want.got_slot = True
                want.key.flight_promised += 1
            if want.budget and want.key.policy.daily_tokens and granted.get(want.key.id, 0) > 0:
                granted[want.key.id] -= 1  # (the script granted the asks in this order)
                if not want.gone:  # (else the next write gives it back)
                    want.got_budget = True
                    want.key.budget_promised += want.budget
        results = results[: len(plan)]
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
        """The lease rounds and, with a shared ledger, the day counters' floors."""
        async with trio.open_nursery() as nursery:
            if self.day_totals is not None:
                nursery.start_soon(self._floors)
            await self._leases()

    async def _floors(self) -> None:
        """A day counter this edge found missing (made by its add: Redis lost its data, or the
        day began) is raised to the shared ledger's total of the day, read after the edge's own
        queued records are stored: the use of edges gone since (a restarted edge's earlier
        life) is in no live edge's count. Every row is use, so the floor raises no counter past
        the day's use; use in other edges' queues then (0.5 s of records) can be left out. Until
        the floor, :data:`FLOOR_DELAY_S`, the counter holds the live edges' use alone."""
        while True:
            await self._floors_wake.wait()
            self._floors_wake = trio.Event()
            while self._floors_wanted:
                # Each FLOOR_DELAY_S after its counter was found missing: after every live edge
                # added its own use to it (each reports a key's day every REFRESH_S at least).
                # Raised before one did, that one's use, in the ledger already, was counted twice
                # (126 tokens for 90): so was a counter made anew within FLOOR_DELAY_S of an
                # earlier one, by that one's floor (now: the epoch differs, see _FLOOR) or with it.
                now = trio.current_time()
                first = min(self._floors_wanted.values())
                if first > now:
                    await trio.sleep_until(first)
                    continue
                wanted = {floor for floor, due in self._floors_wanted.items() if due <= now}
                for floor in wanted:
                    del self._floors_wanted[floor]
                await self._raise_due(wanted)

    async def _raise_due(self, wanted: set[tuple[str, int, bytes]]) -> None:
        today = int(time.time() // 86400)
        wanted = {(key_id, day, epoch) for key_id, day, epoch in wanted if day == today}
        if not wanted:
            return
        try:
            with trio.fail_after(FLOOR_WAIT_S):
                totals = await self.day_totals(today * 86400.0)
                floors = [(key_id, day, totals.get(key_id, 0), epoch) for key_id, day, epoch in wanted]
                await trio.to_thread.run_sync(self._raise_floors, floors, abandon_on_cancel=True)
        except (LedgerUnavailable, trio.TooSlowError, self._redis_error, OSError) as e:  # (asked again, later)
            log.warning("a day counter's floor from the ledger failed", error=f"{type(e).__name__}: {str(e)[:200]}")
            retry = trio.current_time() + FLOOR_RETRY_S
            for floor in wanted:
                self._floors_wanted.setdefault(floor, retry)
            return
        log.info("day counters raised to the ledger's totals", keys=len(floors))

    def _raise_floors(self, floors: list[tuple[str, int, int, bytes]]) -> None:
        """In a worker thread: each key's day counter raised to at least its ledger total
        (if Redis has not lost its data since the counter was made)."""
        pipe = self.client.pipeline(transaction=False)
        for key_id, day, total, epoch in floors:
            self.floor(keys=[f"iop:day:{key_id}:{day}", EPOCH_KEY], args=[total, DAY_TTL_S, epoch], client=pipe)
        pipe.execute()

    async def _leases(self) -> None:
        """A lease round every :data:`SYNC_S`; between rounds, the borrows as they come
        (one round trip for those waiting at once). One task: Redis sees one call at a time."""
        next_round = hurry_at = trio.current_time()
        try:
            while True:
                now = trio.current_time()
                if now >= next_round or (self._hurried and now >= hurry_at):
                    await self._round()
                    done = trio.current_time()
                    next_round, hurry_at = done + SYNC_S, done + HURRY_S
                if self._settled:
                    try:
                        await self._give_back()
                    except (self._redis_error, OSError) as e:  # (the next round writes them, or says Redis is down)
                        log.debug("giving back slots failed", error=f"{type(e).__name__}: {str(e)[:200]}")
                borrowing, self._borrowing = self._borrowing, None
                if borrowing is not None:
                    try:
                        await self._lend(borrowing)
                    finally:
                        borrowing.done.set()
                if self._settled or self._borrowing is not None:  # (came meanwhile)
                    continue
                with trio.move_on_at(min(next_round, hurry_at) if self._hurried else next_round):
                    await self._wake.wait()
                self._wake = trio.Event()
        finally:
            # Leaving (the edge stops): its slots and reservations go now, not when its entries
            # go silent (10 s in which other edges refused a key after every rolling restart).
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await trio.to_thread.run_sync(self._leave, abandon_on_cancel=True)

    def _leave(self) -> None:
        """In a worker thread: this edge's entries out of every key's flights."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for key_id in list(self._written):
                pipe.hdel(f"iop:flight:{key_id}", self.edge_id)
            pipe.execute()
        except (self._redis_error, OSError):
            pass  # (they go silent, and are dropped after EDGE_TTL_S)

    async def _round(self) -> None:
        try:
            await self.round()
        except (self._redis_error, OSError) as e:
            self._down(e)
        else:
            if not self.up:
                self.up = True
                log.info("shared state up: leasing key limits from redis")

    def _down(self, error: BaseException) -> None:
        self.failures += 1
        if self.up or self.failures == 1:
            log.warning(
                "shared state unreachable: this edge limits keys on its own until it is back",
                error=f"{type(error).__name__}: {str(error)[:200]}",
            )
        self.up = False
        self._forgive = False
        if self.keys.shared:
            self.keys.shared = False
            self.keys.local_levels()

    def close(self) -> None:
        self.client.close()
