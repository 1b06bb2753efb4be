"""Client keys with policy: which models, how fast, how much.

A key is found by the SHA-256 of the secret a client sends (``Authorization:
Bearer`` or ``x-api-key``); only hashes are stored. Keys come from the
config (``[[keys]]``, and plain ``api_keys``, which have no limits) and from
the admin API (``/v1/admin/keys``, kept in the ledger's database).

Limits, checked in memory (with shared state, edge.shared_state, the rpm/tpm
levels are balances leased from Redis, and a request they cannot cover
borrows the rest from Redis, a bounded wait, before it is refused):

- ``models``: glob patterns; a model no pattern matches is 404
  ``model_not_found`` for that key and absent from its ``/v1/models``;
- ``rpm``: a token bucket of ``rpm`` requests refilled continuously over a
  minute;
- ``tpm``: a token bucket of ``tpm`` tokens. A request is admitted on its
  *reservation*: the prompt estimate (characters / 4, as for placement) plus
  its ``max_tokens`` (or :data:`DEFAULT_OUTPUT_RESERVE` when it sets none),
  at most :data:`MAX_OUTPUT_RESERVE` of output, and never more than ``tpm``.
  When the request ends the bucket is settled with what it really used
  (prompt + completion tokens of the response's usage; a request that
  produced nothing gives its reservation back);
- ``max_concurrent``: requests in flight;
- ``daily_tokens``: tokens used since 00:00 UTC (restored from the ledger at
  start). A request is admitted while the day's use, plus what the requests
  in flight may still use (each its prompt estimate plus its ``max_tokens``,
  or :data:`DEFAULT_OUTPUT_RESERVE`), is below the budget (a burst of 50 at
  once on a 200-token budget ran 42, 420 times the budget, before in-flight
  requests counted); the runs in flight end once what they streamed takes
  the day past it (:meth:`Keys.cut_over_budget`). Every key counts
  its day's tokens, budget or not (``today_tokens`` in ``/v1/admin/keys``).

Over ``rpm``, ``tpm`` or ``max_concurrent``: 429 ``rate_limit_exceeded`` with
``Retry-After``; over budget: 429 ``insufficient_quota``. Every response to a
key with ``rpm``/``tpm`` carries OpenAI's ``x-ratelimit-*`` headers.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import re
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import trio

from edge.auth import client_token
from edge.errors import NO_RETRY, APIError, model_not_found
from proto.frames import MAX_MODEL_NAME

if TYPE_CHECKING:
    from edge.config import EdgeConfig, KeyConfig
    from edge.runs.run import Run

DEFAULT_OUTPUT_RESERVE = 1024  # tokens reserved for a request that sets no max_tokens
# How often the runs in flight of keys with a daily budget are held against it (Keys.cut_over_budget).
BUDGET_CHECK_S = 0.5
OVER_BUDGET = "insufficient_quota"  # the cause of a run ended by it (Run.fail)
MAX_OUTPUT_RESERVE = 4096  # output tokens reserved at most
NO_BUDGET_MARK = 1 << 62  # a Gauge's mark when no daily budget holds its key (Keys.hold_to_budget)
# Tokens past a daily budget at which its runs in flight end as their output comes (Keys.hold_to_budget);
# within it, at the next BUDGET_CHECK_S (a request admitted below the budget crosses it by a short answer).
BUDGET_SLACK = 256
SECRET_PREFIX = "sk-iop-"


def insufficient_quota(message: str) -> APIError:
    """A key's daily budget is spent, before its request ran or while it ran: 429
    ``insufficient_quota`` with ``Retry-After`` until 00:00 UTC and ``x-should-retry: false``.
    The Anthropic SDK waits out any Retry-After (it slept 13.7 h, silent, until midnight: an
    outside audit) unless told not to retry; the one cut while it ran had no Retry-After."""
    now = time.time()
    midnight = (now // 86400 + 1) * 86400 - now
    headers = [(b"retry-after", str(max(int(math.ceil(midnight)), 1)).encode()), NO_RETRY]
    return APIError(429, message, "insufficient_quota", code="insufficient_quota", headers=headers)


def sha256_hex(secret: str | bytes) -> str:
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).hexdigest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


class Policy(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a key may do; 0 = unlimited."""

    models: list[str] = msgspec.field(default_factory=lambda: ["*"])
    rpm: int = 0
    tpm: int = 0
    max_concurrent: int = 0
    daily_tokens: int = 0

    def check(self) -> str | None:
        """A problem with this policy, or None."""
        for name in ("rpm", "tpm", "max_concurrent", "daily_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0 or value > 10**15:
                return f"{name}: must be an integer between 0 and 10^15"
        if not self.models or len(self.models) > 256 or any(not p or len(p) > 256 for p in self.models):
            return "models: 1 to 256 patterns of 1 to 256 characters"
        return None


def _bucket_take(level: float, at: float, now: float, capacity: int, amount: float) -> tuple[float, bool]:
    """Refill ``level`` (per minute, up to ``capacity``) to ``now``; take ``amount`` if there."""
    level = min(capacity, level + (now - at) * capacity / 60.0)
    if level >= amount:
        return level - amount, True
    return level, False


RETRY_HINT = " Try again in "  # ends a refusal's message, before its wait (the console groups without it)


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(int(seconds * 1000), 0)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest}s"


class Key:
    """One key's policy and its live counters."""

    __slots__ = (
        "id",
        "sha256",
        "policy",
        "source",
        "_patterns",
        "_allowed",
        "req_level",
        "req_at",
        "tok_level",
        "tok_at",
        "in_flight",
        "day",
        "day_used",
        "revoked",
        "requests",
        "prompt_tokens",
        "completion_tokens",
        "limited",
        "day_others",
        "others_in_flight",
        "restored",
        "req_seen",
        "tok_seen",
        "req_kept",
        "tok_kept",
        "req_spent",
        "tok_spent",
        "tok_forgiven",
        "day_pending",
        "others_pending",
        "others_streamed",
        "flight_held",
        "flight_promised",
        "flight_spare",
        "budget_held",
        "budget_promised",
        "budget_sliced",
        "admitted_at",
        "said_at",
        "day_reported",
        "live",
        "gauge",
        "near",
    )

    def __init__(self, id: str, sha256: str, policy: Policy, source: str) -> None:
        self.id = id
        self.sha256 = sha256
        self.source = source  # "config", "api_keys" or "admin"
        self.in_flight = 0
        self.day = 0
        self.day_used = 0
        self.revoked = False
        self.requests = 0  # counted for /metrics (iop_key_*)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.limited: dict[str, int] = {}  # refusals by limit: rpm, tpm, concurrency, budget
        self.day_others = 0  # shared state: other edges' tokens today
        self.others_in_flight = 0  # shared state: other edges' requests in flight
        self.day_pending = 0  # daily_tokens: what this edge's requests in flight reserved of the budget
        self.others_pending = 0  # shared state: the other edges' day_pending
        self.others_streamed = 0  # shared state, daily_tokens: what the other edges' requests in flight streamed
        # shared state, max_concurrent: the slots this edge holds in Redis (at least its in-flight
        # requests), and of the free ones those borrowed for requests about to take them
        self.flight_held = 0
        self.flight_promised = 0
        self.flight_spare = False  # of flight_held, one is a spare slot (edge.shared_state), as last written
        # shared state, daily_tokens: the budget this edge holds in Redis (its requests' reservations
        # and its use not yet added to the day's counter), and of it what borrows hold for requests
        # about to take it; and of day_used what this edge has added to the day's counter
        self.budget_held = 0
        self.budget_promised = 0
        self.budget_sliced = False  # of budget_held, a slice is spare (edge.shared_state), as last written
        self.admitted_at = -math.inf  # (monotonic) its last request admitted here
        self.said_at = -math.inf  # shared state: when its buckets were last told what this edge holds
        self.day_reported = 0
        self.restored = 0  # of day_used: loaded from the ledger at start
        self.live: set[Lease] = set()  # daily_tokens: this edge's requests in flight (Keys.cut_over_budget)
        self.gauge: Gauge | None = None  # daily_tokens: what they streamed (Keys.hold_to_budget)
        self.near = False  # daily_tokens: a quarter of the budget or less left, as last held (hold_to_budget)
        # Shared state gone: what this edge held of the shared buckets when it went local, and what
        # it has spent of its local buckets since (Keys.local_levels, Keys.shared_levels).
        self.req_kept = self.tok_kept = 0.0
        self.req_spent = self.tok_spent = 0.0
        self.tok_forgiven = 0.0  # of a debt forgiven when Redis came back: unused reservations in it
        self.set_policy(policy)

    def set_policy(self, policy: Policy) -> None:
        """A new key's policy, or a change: a limit the key had keeps what is
        left of its minute (at most the new limit), so a change, or a PATCH
        that changes nothing, is never a fresh minute; a new limit starts full."""
        now = time.monotonic()
        old = self.policy if hasattr(self, "policy") else None
        self.policy = policy
        self._patterns = (
            None if "*" in policy.models else re.compile("|".join(fnmatch.translate(p) for p in policy.models))
        )
        self._allowed: dict[str, bool] = {}
        if old is None:
            self.req_level, self.req_at = float(policy.rpm), now
            self.tok_level, self.tok_at = float(policy.tpm), now
        else:
            self.req_level, self.req_at = _carried(old.rpm, self.req_level, self.req_at, policy.rpm, now), now
            self.tok_level, self.tok_at = _carried(old.tpm, self.tok_level, self.tok_at, policy.tpm, now), now
        # shared state: the Redis bucket's level and when it was seen (monotonic), or None
        self.req_seen: tuple[float, float] | None = None
        self.tok_seen: tuple[float, float] | None = None

    def may_use(self, model: str) -> bool:
        if self._patterns is None:
            return True
        if len(model) > MAX_MODEL_NAME:  # no node serves it: not matched, and never kept (a client's
            return False  # 1 MB names, each kept here, took an edge to 530 MB: an outside soak)
        allowed = self._allowed.get(model)
        if allowed is None:
            allowed = self._patterns.fullmatch(model) is not None
            if len(self._allowed) < 4096:
                self._allowed[model] = allowed
        return allowed

    def _today(self) -> None:
        day = int(time.time() // 86400)
        if day != self.day:
            self.day, self.day_used, self.day_others, self.restored, self.day_reported = day, 0, 0, 0, 0
            self.others_streamed = 0  # (yesterday's streams: in yesterday's count)

    def unreported(self) -> int:
        """Shared state: of today's tokens, those not yet added to Redis's day counter
        (what was restored from the ledger at start counts as there)."""
        return max(self.day_used - max(self.day_reported, self.restored), 0)

    def today_tokens(self) -> int:
        """Tokens today: this edge's, plus the other edges' where shared state follows them
        (keys with ``daily_tokens``; ``day_others`` is 0 otherwise)."""
        self._today()
        return self.day_used + self.day_others


class Gauge:
    """A daily-budget key's output in flight on this edge, held to the budget as it comes
    (:meth:`Keys.hold_to_budget`): ``streamed``, what its requests in flight streamed in all
    (each with what it counted before its current run: :meth:`Lease.streamed`), kept as they
    stream; past ``mark``, the next output of any of them has ``check`` hold them to the budget
    again. (Each run had a room of its own, an equal part of what was left, and every check
    summed every request in flight: near the budget, where the parts are a token or none, every
    output of every run summed them all, and 1,900 requests in flight of one key cost the edge
    0.79 s of its loop, growing as their square: an outside audit.)"""

    __slots__ = ("streamed", "mark", "check")

    def __init__(self, check: Callable[[], object]) -> None:
        self.streamed = 0
        self.mark = -1  # (the first output is checked)
        self.check = check


class Lease:
    """A request admitted for a key: settled (once) when it ends."""

    __slots__ = ("key", "reserved", "budget", "settled", "run", "before", "gauge")

    def __init__(self, key: Key, reserved: int, budget: int) -> None:
        self.key = key
        self.reserved = reserved  # of tpm
        self.budget = budget  # of daily_tokens, while in flight
        self.settled = False
        self.run: Run | None = None  # the request's run now (follow)
        self.before = 0  # its prompt estimate, and what its earlier runs used (a tool call's retry)
        self.gauge: Gauge | None = None  # daily_tokens: its key's

    def follow(self, run: Run, before: int) -> None:
        """The request's run is ``run`` now; ``before``: its prompt estimate and what its
        earlier runs used. A key's daily budget counts the tokens it streams as they come
        (its :class:`Gauge`); a new run's first output has the budget checked."""
        gauge = self.gauge
        if gauge is not None:
            self._off(gauge)
            gauge.streamed += before
            run.gauge = gauge
            gauge.mark = -1
        self.run, self.before = run, before

    def streamed(self) -> int:
        """Its tokens so far: ``before``, the deltas its run streamed, and the pieces of a tool
        call its node said it read (a 3,000-token file write in a tool call was not counted)."""
        run = self.run
        return self.before + (run.deltas_seen + run.progress_parts if run is not None else 0)

    def leave(self) -> None:
        """Settled: it streams no more into its key's gauge."""
        if self.gauge is not None:
            self._off(self.gauge)
            self.gauge = None

    def _off(self, gauge: Gauge) -> None:
        """What it streamed out of ``gauge``, and its run no longer counted in it."""
        gauge.streamed -= self.streamed()
        if self.run is not None:
            self.run.gauge = None


class Keys:
    """Every key this edge knows, by hash. The edge is ``open`` (no key asked
    for) only while it has never had one: revoking every key does not open it."""

    def __init__(self, config: EdgeConfig) -> None:
        self.by_hash: dict[str, Key] = {}
        self.by_id: dict[str, Key] = {}
        self.ever = False  # some key was configured or made (also: the ledger holds one, revoked or not)
        self.unread = False  # the ledger's keys could not be read yet: a key is asked for meanwhile
        # Shared state (edge.shared_state): rpm/tpm levels are leased balances, not refilled here.
        self.shared = False
        self.budgeted: set[Key] = set()  # keys with a daily budget and requests in flight here
        self.on_settle: Callable[[Key], None] | None = None  # (shared state) a request of a key ended
        self.on_mark: Callable[[Key], None] | None = None  # (shared state) its runs passed a mark of its budget
        for i, secret in enumerate(config.api_keys):
            sha = sha256_hex(secret)
            self.add(Key(f"api_keys[{i}]", sha, Policy(), "api_keys"))
        for kc in config.keys:
            self.add(Key(kc.id, kc.key_sha256.lower() or sha256_hex(kc.key), policy_of(kc), "config"))

    def change(self, key: Key, policy: Policy) -> None:
        """A new policy for ``key``, at once; with shared state its balances start
        from leases again (not a full minute on every edge)."""
        key.set_policy(policy)
        if self.shared:
            key.req_level = key.tok_level = 0.0
        if policy.daily_tokens and key.live and key.gauge is not None:
            # (its requests in flight of a budget are held to the new one at their next output: a
            # budget lowered held them to the old one until the 0.5 s check, and one taken away and
            # given back never held them again; requests admitted with no budget are not held)
            self.budgeted.add(key)
            key.gauge.mark = -1

    def add(self, key: Key) -> None:
        if self.shared:  # its balances are leased, not a full minute on every edge
            key.req_level = key.tok_level = 0.0
        replaced = self.by_id.get(key.id)
        if replaced is not None and replaced is not key:  # (its secret must go with it: none could revoke it)
            self.by_hash.pop(replaced.sha256, None)
        self.by_hash[key.sha256] = key
        self.by_id[key.id] = key
        self.ever = True

    def revoke(self, key: Key) -> None:
        key.revoked = True
        self.by_hash.pop(key.sha256, None)
        self.by_id.pop(key.id, None)

    def zero_levels(self) -> None:
        for key in self.by_id.values():
            key.req_level = key.tok_level = 0.0

    def local_levels(self) -> None:
        """Local buckets (shared state unreachable: this edge limits on its own), from
        the shared bucket as last seen (refilled since) plus this edge's balance, or
        full if it was never seen: not a fresh minute for a key that had just spent
        its own (a Redis stall then gave it edges x its limit)."""
        now = time.monotonic()
        for key in self.by_id.values():
            policy = key.policy
            # The other edges' requests are not followed now: a key's whole concurrency here (their
            # last count kept refused a request with none left in flight anywhere).
            key.others_in_flight = key.others_pending = key.others_streamed = 0
            key.req_kept, key.tok_kept = key.req_level, key.tok_level  # (a debt too: a stall forgave it)
            key.req_spent = key.tok_spent = 0.0
            key.req_level = local_level(policy.rpm, key.req_level, key.req_seen, now)
            key.tok_level = local_level(policy.tpm, key.tok_level, key.tok_seen, now)
            key.req_at = key.tok_at = now

    def shared_levels(self) -> None:
        """Back to the shared buckets from local ones, once a round with Redis went through
        (:meth:`edge.shared_state.SharedState.round`): each key's balance is :func:`recovered`."""
        for key in self.by_id.values():
            key.req_level, key.tok_level = recovered(key)
        self.shared = True

    def forgive(self) -> None:
        """After the round that came back (its leases credited): what a key still owes is
        forgiven. Redis's bucket paid what it held, and a key is back at its rate with an
        empty bucket at worst (a debt paid from the refill alone, split among the edges
        that lease it, kept a key of two edges refused on one for 100 s after a 60 s stall:
        an outside re-check). What is forgiven of tokens was reserved: the unused part of
        those reservations, settled later, does not come back (:meth:`settle`)."""
        for key in self.by_id.values():
            if key.req_level < 0:
                key.req_level = 0.0
            if key.tok_level < 0:
                key.tok_forgiven = -key.tok_level
                key.tok_level = 0.0

    @property
    def open(self) -> bool:
        return not (self.ever or self.unread)

    def authenticate(self, authorization: bytes | None, x_api_key: bytes | None) -> Key | None:
        token = client_token(authorization, x_api_key)
        if token is None:
            return None
        return self.by_hash.get(sha256_hex(token))

    # -- admission -------------------------------------------------------------

    def admit(self, key: Key, model: str, prompt_estimate: int, max_tokens: int | None, alone: bool = False) -> Lease:
        """Admit a request of ``key`` for ``model``, or raise the APIError
        (404, 429) that refuses it. The caller settles the lease at the end.
        ``alone``: with shared state, a budget or a slot this edge could not ask
        Redis for (it failed, or did not answer) is judged by what this edge knows."""
        if not key.may_use(model):
            raise model_not_found(model)
        policy = key.policy
        now = time.monotonic()
        reserved = self.reservation(key, prompt_estimate, max_tokens)
        budget = 0
        shared = self.shared
        if policy.daily_tokens:
            key._today()
            if key.day_used + key.day_others + key.day_pending >= policy.daily_tokens:
                raise self._budget_refusal(key, "budget")
            budget = self.day_need(prompt_estimate, max_tokens)
            holding = key.day_pending + key.budget_promised + key.unreported() + budget
            if shared and not alone and holding > key.budget_held:
                # Held in Redis first (borrowed, edge.shared_state): a script grants it while the
                # day's total and every edge's holdings are below the budget, so a burst spread
                # over edges crosses it by one request, not by one per edge and lease round.
                raise self._budget_refusal(key, "reserved")
        if policy.max_concurrent:
            if shared and not alone:  # on a slot this edge holds in Redis (none free: it borrows one)
                if key.in_flight + key.flight_promised >= key.flight_held:
                    raise self._limited(key, _in_flight(policy.max_concurrent), 1.0, "slot")
            elif key.in_flight >= policy.max_concurrent:  # (this edge alone, as with Redis down)
                raise self._limited(key, _in_flight(policy.max_concurrent), 1.0, "concurrency")
        if policy.rpm:
            self.take_request(key, now)
        if policy.tpm:
            if shared:
                level, ok = key.tok_level, key.tok_level >= reserved
                if ok:
                    key.tok_level -= reserved
            else:
                level, ok = _bucket_take(key.tok_level, key.tok_at, now, policy.tpm, reserved)
                key.tok_level, key.tok_at = level, now
                if ok:
                    key.tok_spent += reserved
            if not ok:
                if policy.rpm:
                    key.req_level += 1  # the request was not made
                    if not shared:
                        key.req_spent -= 1
                wait = (reserved - level) * 60 / policy.tpm
                raise self._limited(key, f"{policy.tpm} tokens per minute", wait, "tpm")
        key.in_flight += 1
        key.day_pending += budget
        key.admitted_at = now
        lease = Lease(key, reserved if policy.tpm else 0, budget)
        if policy.daily_tokens:
            key.live.add(lease)
            self.budgeted.add(key)
            if key.gauge is None:
                key.gauge = Gauge(lambda: self.hold_to_budget(key))
            lease.gauge = key.gauge
        return lease

    def cut_over_budget(self) -> int:
        """End the runs in flight of every key whose day's tokens, with what its requests
        in flight have streamed so far, passed its daily budget: 429 ``insufficient_quota``
        (in a stream, its error). Admission holds a budget only to the requests' reservations
        (their ``max_tokens``, 1,024 when they set none): 20 requests with no ``max_tokens``
        on a budget of 5,000 spent 15,025 tokens, one of ``max_tokens`` 20,000 spent 20,005
        (an outside audit). Returns how many runs were ended."""
        ended = 0
        for key in list(self.budgeted):
            ended += self.hold_to_budget(key, 0)
        return ended

    def hold_to_budget(self, key: Key, slack: int = BUDGET_SLACK) -> int:
        """:meth:`cut_over_budget` for ``key`` alone, its runs ended once they take the day
        ``slack`` tokens past the budget. Else its runs in flight may stream what is left to
        that point before this is called again (its gauge's ``mark``): they are held to the
        budget as their output comes, not only every :data:`BUDGET_CHECK_S` (one request on
        a fast model server spent 10 to 33 times a budget of 3,000 in less; an outside audit).
        Constant time, but for the cut."""
        budget = key.policy.daily_tokens
        gauge = key.gauge
        if not budget or not key.live or gauge is None:  # (a PATCH took the budget away)
            self.budgeted.discard(key)
            if gauge is not None:
                gauge.mark = NO_BUDGET_MARK
            return 0
        key._today()
        left = budget + slack - key.day_used - key.day_others - key.others_streamed - gauge.streamed
        to_near = left - slack - (budget >> 2)
        key.near = to_near < 0  # (edge.shared_state writes its streams more often then)
        if left >= 0:
            # (with shared state, the other edges' runs take a part too: what they streamed is
            # known as of their last write, and a part as large as the whole let two edges' runs
            # cross a budget together by what each streamed meanwhile; this edge's runs check
            # again at half of what is left, and at a quarter of the budget left)
            others = key.others_streamed or key.others_pending
            step = left >> 1 if others else left
            if not key.near:
                step = min(step, to_near)
            if self.on_mark is not None:  # (shared state: the others' streams are read as the runs pass
                # a sixteenth of the budget, and each half of what is left near it)
                step = min(step, budget >> 4)
                if slack and gauge.mark >= 0 and (others or key.near):  # (not a new run's first output)
                    self.on_mark(key)
            gauge.mark = gauge.streamed + step
            return 0
        message = self._over_budget(key, "budget").message
        ended = 0
        for lease in list(key.live):  # (a run's end gives its slot to the next: nothing here may change)
            run = lease.run
            if run is not None and not run.finished:
                run.fail(message, OVER_BUDGET)
                ended += 1
        return ended

    async def watch_budgets(self) -> None:
        """:meth:`cut_over_budget`, every :data:`BUDGET_CHECK_S` (runs with the app)."""
        while True:
            await trio.sleep(BUDGET_CHECK_S)
            if self.budgeted:
                self.cut_over_budget()

    def take_request(self, key: Key, now: float | None = None) -> None:
        """One request of ``key``'s ``rpm`` (it has one), or raise the 429. Alone, for a
        request that generates nothing (Messages' ``count_tokens``)."""
        rpm = key.policy.rpm
        if self.shared:
            level, ok = key.req_level, key.req_level >= 1
            if ok:
                key.req_level -= 1
        else:
            now = time.monotonic() if now is None else now
            level, ok = _bucket_take(key.req_level, key.req_at, now, rpm, 1)
            key.req_level, key.req_at = level, now
            if ok:
                key.req_spent += 1
        if not ok:
            raise self._limited(key, f"{rpm} requests per minute", (1 - level) * 60 / rpm, "rpm")

    def reservation(self, key: Key, prompt_estimate: int, max_tokens: int | None) -> int:
        """The tokens a request is admitted on (see the module docstring)."""
        reserved = prompt_estimate + min(max_tokens or DEFAULT_OUTPUT_RESERVE, MAX_OUTPUT_RESERVE)
        return min(reserved, key.policy.tpm) if key.policy.tpm else reserved

    @staticmethod
    def day_need(prompt_estimate: int, max_tokens: int | None) -> int:
        """What a request reserves of a daily budget while in flight."""
        return prompt_estimate + (max_tokens or DEFAULT_OUTPUT_RESERVE)

    def needs(self, key: Key, prompt_estimate: int, max_tokens: int | None) -> tuple[int, int, int]:
        """The requests, tokens and concurrency slots (shared state) admitting
        this request takes from ``key``'s rpm, tpm and max_concurrent."""
        policy = key.policy
        tokens = self.reservation(key, prompt_estimate, max_tokens) if policy.tpm else 0
        slots = 1 if policy.max_concurrent and key.in_flight + key.flight_promised >= key.flight_held else 0
        return (1 if policy.rpm else 0), tokens, slots

    def _over_budget(self, key: Key, limit: str) -> APIError:
        error = insufficient_quota(
            f"Key {key.id!r} has used its daily budget of {key.policy.daily_tokens} tokens; it resets at 00:00 UTC."
        )
        error.limit = limit  # type: ignore[attr-defined]  # for the metrics, and edge.shared_state
        return error

    def _budget_refusal(self, key: Key, limit: str) -> APIError:
        """A request the daily budget has no room for: spent (``insufficient_quota``, until
        midnight), or only held by the key's requests in flight, whose reservations come
        back as they end (a 429 to retry in a second: with 6 of 5,000 tokens used and five
        requests in flight, it was "has used its daily budget" with ``x-should-retry:
        false`` until midnight; found from outside)."""
        used = key.day_used + key.day_others
        if used >= key.policy.daily_tokens:
            return self._over_budget(key, limit)
        what = f"its requests in flight hold the rest of its daily budget of {key.policy.daily_tokens} tokens"
        if limit == "reserved":  # (held in Redis: by requests on any edge, or set aside there for them)
            what += ", on this edge or others (an edge sets a slice aside for a key it served in the last seconds)"
        return self._limited(key, f"{what} ({used} used so far)", 1.0, limit)

    def _limited(self, key: Key, what: str, retry_after: float, limit: str) -> APIError:
        error = APIError(
            429,
            f"Rate limit reached for key {key.id!r}: {what}.{RETRY_HINT}{_duration(retry_after)}.",
            "rate_limit_exceeded",
            code="rate_limit_exceeded",
            headers=[(b"retry-after", str(max(int(math.ceil(retry_after)), 1)).encode()), *self.headers(key)],
        )
        error.limit = limit  # type: ignore[attr-defined]  # for the metrics
        return error

    def settle(self, lease: Lease, used: int) -> None:
        """The request ended having used ``used`` tokens (prompt + completion)."""
        if lease.settled:
            return
        lease.settled = True
        key = lease.key
        key.in_flight -= 1
        gauge = lease.gauge
        if gauge is not None:
            lease.leave()
            # (what it streamed moves to the day's use below: the runs still in flight are checked
            # at their next output, or they had that room again, until the 0.5 s check: six
            # staggered streams on a budget of 10,000 ran to 30,036; an outside re-check)
            gauge.mark = -1
            key.live.discard(lease)
            if not key.live:
                self.budgeted.discard(key)
        key.day_pending -= lease.budget
        if self.on_settle is not None and (key.policy.max_concurrent or key.policy.daily_tokens):
            self.on_settle(key)  # (shared state: its slot and reservation go back now, not next round)
        policy = key.policy
        if policy.tpm:
            unused = lease.reserved - used
            if unused > 0 and key.tok_forgiven:  # (a reservation forgiven as a debt: no balance now)
                taken = min(unused, key.tok_forgiven)
                key.tok_forgiven -= taken
                unused -= taken
            if self.shared:
                key.tok_level += unused  # may go below 0: a debt the next leases pay
            else:
                now = time.monotonic()
                level = min(policy.tpm, key.tok_level + (now - key.tok_at) * policy.tpm / 60.0)
                key.tok_level, key.tok_at = min(policy.tpm, level + unused), now
                key.tok_spent -= unused
        key._today()
        key.day_used += used  # every key's (today_tokens), not only a budget's

    def headers(self, key: Key) -> list[tuple[bytes, bytes]]:
        """OpenAI's ``x-ratelimit-*`` headers for ``key`` (none without rpm/tpm)."""
        policy = key.policy
        now = time.monotonic()
        out: list[tuple[bytes, bytes]] = []
        for limit, level, at, seen, unit in (
            (policy.rpm, key.req_level, key.req_at, key.req_seen, b"requests"),
            (policy.tpm, key.tok_level, key.tok_at, key.tok_seen, b"tokens"),
        ):
            if not limit:
                continue
            if not self.shared:
                level = min(limit, level + (now - at) * limit / 60.0)
            else:  # the Redis bucket as last seen, refilled since, plus this edge's balance; full if never
                # read (an edge just started said 0 left, reset in a minute: an outside audit)
                bucket = limit if seen is None else seen[0] + (now - seen[1]) * limit / 60.0
                level = min(limit, min(limit, bucket) + level)
            out += [
                (b"x-ratelimit-limit-" + unit, str(limit).encode()),
                (b"x-ratelimit-remaining-" + unit, str(max(int(level), 0)).encode()),
                (b"x-ratelimit-reset-" + unit, _duration((limit - level) * 60 / limit).encode()),
            ]
        return out


def _carried(old_limit: int, level: float, at: float, new_limit: int, now: float) -> float:
    """A local bucket's level under a changed limit (:meth:`Key.set_policy`)."""
    if not old_limit or not new_limit:
        return float(new_limit)
    return min(float(new_limit), level + (now - at) * old_limit / 60.0, float(old_limit))


def local_level(limit: int, balance: float, seen: tuple[float, float] | None, now: float) -> float:
    """A limit's local bucket when shared state goes away: the shared bucket as last
    seen, refilled since, plus this edge's balance (less, if it is a debt); full if it
    was never seen."""
    if seen is None:
        return float(limit)
    bucket, seen_at = seen
    return min(float(limit), bucket + (now - seen_at) * limit / 60.0 + balance)


def recovered(key: Key) -> tuple[float, float]:
    """``key``'s balances (rpm, tpm) when Redis answers again: what this edge held of the
    shared buckets when it went local, less what it spent of its local buckets since,
    owed when negative (its next leases pay it from Redis's bucket), at most one minute
    either way. The rest of a local bucket was never Redis's: an edge that had never seen a
    key's bucket made it a full one and handed it all to Redis when it came back (a second
    minute for the edge that had just spent the key's), and what an edge spent locally was
    never taken from Redis's bucket, which refilled for the whole outage (a second minute
    after a 60 s stall, to a single edge: outside re-checks). A debt is one minute at most:
    past it, the stall's refill was spent, not owed (a key refused for 110 s after a 140 s
    stall). Tokens reserved locally and settled later are spent here, and their unused
    part comes back as any settlement's."""
    policy = key.policy
    rpm, tpm = float(policy.rpm), float(policy.tpm)
    return (
        max(min(key.req_kept - key.req_spent, rpm), -rpm),
        max(min(key.tok_kept - key.tok_spent, tpm), -tpm),
    )


def policy_of(kc: KeyConfig) -> Policy:
    return Policy(
        models=list(kc.models),
        rpm=kc.rpm,
        tpm=kc.tpm,
        max_concurrent=kc.max_concurrent,
        daily_tokens=kc.daily_tokens,
    )


def _in_flight(n: int) -> str:
    return f"{n} concurrent request{'' if n == 1 else 's'}"
