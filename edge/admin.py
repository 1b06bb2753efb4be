"""The admin API (admin keys only): the usage ledger and run-time keys.

- ``GET /v1/admin/usage?from=&to=&group_by=key,model,node,api,day&format=json|csv``:
  requests and tokens from the ledger; ``from``/``to`` are ISO dates or
  times (UTC unless they say) or unix seconds; ``to`` is exclusive.
- ``POST /v1/admin/keys`` ``{"id": ..., "models": [...], "rpm": ..., ...}``:
  a new key; its secret is in the answer, once (only its hash is stored).
- ``GET /v1/admin/keys``: every key's id, source, policy, in-flight count,
  today's tokens and usage to date.
- ``PATCH /v1/admin/keys/{id}``: change a run-time key's policy (the fields given).
- ``DELETE /v1/admin/keys/{id}``: revoke at once: new requests get 401, its
  streams in flight finish. A ledger that fails the write: 202, revoked here,
  stored when the ledger answers again.

Keys from the config file are listed but not changed here (409). A ledger
whose database fails the call (PostgreSQL down, SQLite locked or read-only):
503 ``ledger_unavailable``, nothing changed.
"""

from __future__ import annotations

import csv
import datetime
import io
import math
import re
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import trio
from quart import Response, request

from edge.auth import client_key_matches, client_token
from edge.errors import error_json, final_headers
from edge.keys import Key, Policy, new_secret, sha256_hex
from edge.ledger import GROUPS, LedgerUnavailable

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from edge.app import Edge

log = structlog.get_logger("iop.edge.admin")
_encode = msgspec.json.Encoder().encode
_ID = re.compile(r"[A-Za-z0-9._@-]{1,64}")
_MAX_KEYS = 10_000
USAGE_FORMATS = ("json", "csv")


# Admin answers hold what no cache or sniffing browser should keep (a new key's secret, usage).
_ADMIN_HEADERS = {"cache-control": "no-store", "x-content-type-options": "nosniff"}


def json_response(status: int, body: Any) -> Response:
    data = body if isinstance(body, bytes) else _encode(body)
    return Response(data, status, content_type="application/json", headers=_ADMIN_HEADERS)


def error_response(
    status: int, message: str, code: str, type: str = "invalid_request_error", param: str | None = None
) -> Response:
    response = json_response(status, error_json(message, type, param=param, code=code))
    response.headers.update(final_headers(status))
    return response


def parse_time(value: str | None, name: str) -> float | None:
    """Unix seconds from an ISO date/time (UTC unless it says) or a number; None if absent."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:  # (nan, inf and 1e999 are floats, and no time: every query of them was empty)
        if not math.isfinite(seconds):
            raise ValueError(f"{name}: an ISO date or time, or unix seconds (a finite number)")
        return seconds
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{name}: an ISO date or time, or unix seconds") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()


def parse_group_by(value: str | None, name: str = "group_by") -> list[str]:
    groups = [g.strip() for g in (value or "").split(",") if g.strip()]
    bad = [g for g in groups if g not in GROUPS]
    if bad or len(set(groups)) != len(groups):
        raise ValueError(f"{name}: a comma-separated list of {', '.join(GROUPS)}")
    return groups


def parse_format(value: str | None) -> str:
    if not value:
        return "json"
    if value not in USAGE_FORMATS:
        raise ValueError(f"format: {' or '.join(USAGE_FORMATS)}")
    return value


def usage_csv(rows: list[dict[str, Any]], groups: list[str]) -> bytes:
    out = io.StringIO()
    fields = [
        *groups,
        "requests",
        "not_completed",
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "estimated_requests",
    ]
    writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: _csv_cell(v) for k, v in row.items()} for row in rows)
    return out.getvalue().encode()


_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value: Any) -> Any:
    """A text cell that a spreadsheet would run as a formula (a client's model name
    such as ``=HYPERLINK(...)``), quoted with a leading ``'`` so it shows as text (OWASP)."""
    return "'" + value if isinstance(value, str) and value.startswith(_FORMULA) else value


def _key_view(key: Key, totals: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    requests, prompt, completion = totals.get(key.id, (0, 0, 0))
    return {
        "id": key.id,
        "source": key.source,
        "policy": key.policy,
        "in_flight": key.in_flight,
        "today_tokens": key.today_tokens(),  # with shared state and daily_tokens: across edges
        "usage": {
            "requests": requests,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


REVOKE_WAIT_S = 2.0  # a revocation waits this long for the ledger, then is stored later (Ledger.revoking)
REVOKE_PENDING = (
    "Revoked on this edge; the ledger could not store it now and will when it answers again. "
    "Other edges learn of it then (an edge restarted before then serves the key again)."
)


def admin_refusal(edge: Edge) -> Response | None:
    """The current request's refusal (403 with no admin_keys, 401 without one of them), or None."""
    admin_keys = edge.config.admin_keys
    if not admin_keys:
        return error_response(
            403, "The admin API needs admin_keys in the edge config.", "admin_disabled", "permission_error"
        )
    if not is_admin(request.headers, admin_keys):
        return error_response(401, admin_key_refused(request.headers), "invalid_api_key", "authentication_error")
    return None


def admin_key_refused(headers: Any) -> str:
    """The 401's message of a request without an admin key: it says how to send one when the
    Authorization header holds a key with no Bearer (a client route's 401 said so, the admin
    routes' did not: a newcomer's audit)."""
    authorization = headers.get("authorization")
    if authorization and client_token(authorization, headers.get("x-api-key")) is None:
        return (
            "Invalid or missing admin key: the Authorization header holds no Bearer key;"
            " send `Authorization: Bearer <admin key>` (or `x-api-key: <admin key>`)."
        )
    return "Invalid or missing admin key."


def is_admin(headers: Any, admin_keys: list[str]) -> bool:
    """The request's ``Authorization: Bearer`` or ``x-api-key`` names an admin key, read
    as a client's key is (``Bearer  X``, two spaces, was refused; a wrong Bearer and a
    right ``x-api-key`` were taken, where a client's route refuses them)."""
    return client_key_matches(headers.get("Authorization"), headers.get("x-api-key"), admin_keys)


def admin_routes(app: QuartTrio, edge: Edge) -> None:
    refused = partial(admin_refusal, edge)

    def refused_or_no_ledger() -> Response | None:
        problem = refused()
        if problem is None and edge.ledger is None:
            return error_response(
                409, 'The ledger is off (ledger = "off"): no usage records or run-time keys.', "ledger_off"
            )
        return problem

    @app.errorhandler(LedgerUnavailable)
    async def ledger_unavailable(e: LedgerUnavailable) -> Response:
        """The ledger's database failed the route's call: 503 with ``Retry-After``, as the
        edge's other 503s, one warning line (the ledger logs its own going down and coming back)."""
        log.warning("admin request failed: ledger unavailable", route=request.path[:100], error=str(e))
        response = error_response(
            503,
            "The ledger's database is unavailable right now; try again later.",
            "ledger_unavailable",
            "service_unavailable_error",
        )
        response.headers["retry-after"] = "1"
        return response

    @app.get("/v1/admin/usage")
    async def usage() -> Response:
        problem = refused_or_no_ledger()
        if problem is not None:
            return problem
        args = request.args
        try:
            start = parse_time(args.get("from"), "from")
            end = parse_time(args.get("to"), "to")
            groups = parse_group_by(args.get("group_by"))
            fmt = parse_format(args.get("format"))
        except ValueError as e:  # each says "<parameter>: what it takes"
            return error_response(400, str(e), "invalid_parameter", param=str(e).partition(":")[0])
        rows = await edge.ledger.usage(start, end, groups)
        if fmt == "csv":
            return Response(usage_csv(rows, groups), 200, content_type="text/csv; charset=utf-8")
        return json_response(200, {"object": "list", "group_by": groups, "data": rows})

    @app.get("/v1/admin/keys")
    async def list_keys() -> Response:
        problem = refused()
        if problem is not None:
            return problem
        totals = await edge.ledger.key_totals() if edge.ledger is not None else {}
        keys = sorted(edge.keys.by_id.values(), key=lambda k: k.id)
        return json_response(200, {"object": "list", "data": [_key_view(k, totals) for k in keys]})

    # A key's changes are made one at a time, each from the key as the one before left it: four
    # POSTs of one id at once were four 201s, three of whose secrets outlived its DELETE; a PATCH
    # reading the usage while a DELETE went through made the key live again; PATCHes of two
    # fields at once kept one (an outside attack).
    writing = trio.Lock()

    async def body_policy(base: Policy | None) -> tuple[dict[str, Any], Policy] | Response:
        try:
            data = await request.get_json(force=True, silent=False)
        except Exception:
            return error_response(400, "The body must be a JSON object.", "invalid_json")
        if not isinstance(data, dict):
            return error_response(400, "The body must be a JSON object.", "invalid_json")
        fields = {k: v for k, v in data.items() if k in Policy.__struct_fields__}
        unknown = set(data) - set(Policy.__struct_fields__) - {"id"}
        if unknown:
            return error_response(400, f"Unknown fields: {', '.join(sorted(unknown))[:200]}.", "unknown_parameter")
        merged = {**msgspec.structs.asdict(base), **fields} if base is not None else fields
        try:
            policy = msgspec.convert(merged, Policy)
        except msgspec.ValidationError as e:
            return error_response(400, f"Invalid policy: {e}", "invalid_parameter")
        problem = policy.check()
        if problem:
            return error_response(400, f"Invalid policy: {problem}", "invalid_parameter")
        return data, policy

    @app.post("/v1/admin/keys")
    async def create_key() -> Response:
        problem = refused_or_no_ledger()
        if problem is not None:
            return problem
        parsed = await body_policy(None)
        if isinstance(parsed, Response):
            return parsed
        data, policy = parsed
        key_id = data.get("id")
        if not isinstance(key_id, str) or not _ID.fullmatch(key_id):
            return error_response(
                400, "id: 1 to 64 letters, digits, '.', '_', '@' or '-'.", "invalid_parameter", param="id"
            )
        secret = new_secret()
        sha = sha256_hex(secret)
        async with writing:  # (four POSTs of one id at once were four 201s: below)
            known = edge.keys.by_id.get(key_id)
            if known is not None and known.source != "admin":
                return error_response(409, f"A key {key_id!r} exists.", "key_exists")
            if known is None and len(edge.keys.by_id) >= _MAX_KEYS:
                return error_response(409, f"At most {_MAX_KEYS} keys.", "too_many_keys")
            # The ledger decides whether a run-time id is live: another edge may have revoked
            # the key this one still holds until its next read of the table (its id was a 409
            # here for up to 2 s after the revoke: an outside audit).
            if not await edge.ledger.put_key(key_id, sha, policy):
                said = "" if known is not None else " (made on another edge)"
                return error_response(409, f"A key {key_id!r} exists{said}.", "key_exists")
            if known is not None:
                edge.retire(known)  # (revoked elsewhere: its requests in flight settle on it)
            edge.make_key(key_id, sha, policy)  # (an id revoked today goes on with its day's tokens)
        return json_response(201, {"id": key_id, "key": secret, "policy": policy})

    def run_time_key(key_id: str, verb: str) -> Key | Response:
        """The run-time key ``key_id`` (admin auth checked), or the refusal."""
        problem = refused()
        if problem is not None:
            return problem
        key = edge.keys.by_id.get(key_id)
        if key is None:
            return error_response(404, f"No key {key_id!r}.", "key_not_found")
        if key.source != "admin":
            return error_response(409, f"Key {key_id!r} comes from the config file; {verb} it there.", "key_in_config")
        return key

    @app.patch("/v1/admin/keys/<key_id>")
    async def change_key(key_id: str) -> Response:
        key = run_time_key(key_id, "change")
        if isinstance(key, Response):
            return key
        parsed = await body_policy(key.policy)
        if isinstance(parsed, Response):
            return parsed
        data, _ = parsed
        if data.get("id", key_id) != key_id:  # (it was ignored: a 200 that renamed nothing)
            return error_response(
                400,
                "A key's id cannot be changed: make a key with the new id, then remove this one.",
                "invalid_parameter",
            )
        # Its usage read first: a ledger that fails the read answers 503 with the key unchanged
        # (read after the change, a 503 came with the change made); and before the key's turn,
        # so that a long read of a key's usage holds no DELETE of any key.
        totals = await edge.ledger.key_totals(key_id)  # type: ignore[union-attr]
        async with writing:
            if edge.keys.by_id.get(key_id) is not key:  # revoked (or made again) meanwhile
                return error_response(404, f"No key {key_id!r}.", "key_not_found")
            merged = {**msgspec.structs.asdict(key.policy), **{k: v for k, v in data.items() if k != "id"}}
            policy = msgspec.convert(merged, Policy)  # (each field was checked above)
            problem = policy.check()
            if problem:  # (with another PATCH made since its body came in)
                return error_response(400, f"Invalid policy: {problem}", "invalid_parameter")
            if not await edge.ledger.change_key(key_id, key.sha256, policy):  # type: ignore[union-attr]
                # Revoked meanwhile on another edge sharing the ledger (an upsert made it live again).
                return error_response(404, f"No key {key_id!r}.", "key_not_found")
            edge.keys.change(key, policy)
        return json_response(200, _key_view(key, totals))

    @app.delete("/v1/admin/keys/<key_id>")
    async def revoke_key(key_id: str) -> Response:
        key = run_time_key(key_id, "remove")
        if isinstance(key, Response):
            return key
        # Revoked here at once; then stored. A ledger that fails the write (PostgreSQL down) leaves
        # it revoked here, and it is stored when the ledger answers again (Ledger.revoking): a 202.
        # (It was a 503 that changed nothing: a leaked key served on, here too, for the outage.)
        async with writing:
            if edge.keys.by_id.get(key_id) is not key:
                return error_response(404, f"No key {key_id!r}.", "key_not_found")
            edge.retire(key)
            ledger = edge.ledger
            assert ledger is not None  # (run-time keys need one)
            problem = ""
            try:
                # (a hung database held the admin API's writes 15 s behind this one: an outside re-check)
                with trio.move_on_after(REVOKE_WAIT_S) as waited:
                    await ledger.revoke_key(key_id, key.sha256)
                if waited.cancelled_caught:
                    problem = f"the database did not answer in {REVOKE_WAIT_S:g} s"
            except LedgerUnavailable as e:
                problem = str(e)
            if problem:
                ledger.revoking[key_id] = key.sha256
                log.warning("key revoked here; the ledger will store it when it answers", key=key_id, error=problem)
                return json_response(202, {"id": key_id, "deleted": True, "stored": False, "message": REVOKE_PENDING})
        return json_response(200, {"id": key_id, "deleted": True})
