"""The edge's configuration: one object holds every limit and timeout."""

from __future__ import annotations

import fnmatch
import functools
import os
import re
from typing import Literal

import msgspec

from edge.cors import host_problem, origin_problem
from edge.forwarded import parse_networks
from edge.keys import sha256_hex
from iop.configfile import BEARER_VALUE, ConfigError, convert, load
from proto.frames import name_problem

MIN_FRAME_BYTES = 64 * 1024
# The least each of these may be: below, every link drops at once (ping), every connection
# is closed unanswered (write), no node links (hello), or a stream is all keep-alives (keepalive).
TIMING_FLOORS = {"ping_interval_s": 0.1, "hello_timeout_s": 0.1, "write_timeout_s": 0.1, "keepalive_s": 0.05}
MAX_TOOL_ATTEMPTS = 10  # runs one tool request may take (2^63 made one request run for ever)
MAX_RETENTION_DAYS = 36_500  # ledger_retention_days: a hundred years


class ModelPolicy(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Per-model policy, an ``[[models]]`` entry; a model with none gets defaults."""

    name: str
    max_queue: int | None = None  # None: the edge-wide default
    queue_timeout_ms: int | None = None
    strict_output: bool = False
    stream_buffer: bool = False
    xml_completion_tool: str = ""
    sentinels: list[str] = msgspec.field(default_factory=list)
    # false: only `sentinels` are removed, not the built-in list (whose `</s>`, `[INST]`, `<eos>`
    # are also words of answers about markup or chat templates)
    default_sentinels: bool = True
    reasoning_field: Literal["reasoning_content", "reasoning"] = "reasoning_content"
    # "auto": <think>…</think> in content becomes reasoning; "open": the chat
    # template already consumed <think>, content starts as reasoning; "off".
    think_tags: Literal["auto", "open", "off"] = "auto"
    tool_stream: Literal["buffered", "live"] = "buffered"
    max_tool_attempts: int | None = None
    response_mode: Literal["normal", "passthrough"] = "normal"


class KeyConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A client key with policy (edge.keys); 0 = unlimited."""

    id: str  # shown in logs, metrics and the ledger; never the secret
    key: str = ""  # the secret, or:
    key_sha256: str = ""  # its SHA-256, hex (only the hash needs to be stored)
    models: list[str] = msgspec.field(default_factory=lambda: ["*"])  # glob patterns
    rpm: int = 0  # requests per minute
    tpm: int = 0  # tokens per minute (prompt + completion)
    max_concurrent: int = 0  # requests in flight
    daily_tokens: int = 0  # tokens per UTC day


DEFAULT_POLICY = ModelPolicy(name="*")  # a model with no [[models]] entry


MAX_H2_STREAMS = 10_000  # streams one HTTP/2 connection may have open, at most


class EdgeConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    bind: str = "127.0.0.1:8080"
    backlog: int = 4096  # listen queue for connection bursts (hypercorn's default is 100; Linux caps it at somaxconn)
    # Node authentication: one shared token, or one per node id.
    node_token: str = ""
    node_tokens: dict[str, str] = msgspec.field(default_factory=dict)
    # The models each node id may serve (glob patterns); "*": every node id without an entry of
    # its own. No entry: any model. A node's other models are left out of its link.
    node_models: dict[str, list[str]] = msgspec.field(default_factory=dict)
    # Client authentication (empty: open).
    api_keys: list[str] = msgspec.field(default_factory=list)
    api_keys_file: str = ""  # one key per line; '#' starts a comment
    admin_keys: list[str] = msgspec.field(default_factory=list)
    admin_keys_file: str = ""
    keys: list[KeyConfig] = msgspec.field(default_factory=list)  # keys with policy (README "Keys")
    # Where the edge keeps its state: the usage ledger and run-time keys, and the records its
    # ledger could not store when it stopped (ledger-spool-*.jsonl: edge.ledger_spool).
    state_dir: str = "iop-state"
    ledger: str = ""  # "": <state_dir>/ledger.sqlite3; a file path; "postgresql://…" (shared by edges); "off"
    # Records of days before the last N and today (UTC) are folded into per-day totals (0: each kept).
    ledger_retention_days: int = 0
    state: str = ""  # "redis://host:port/db": key limits shared by every edge using it (edge.shared_state)
    # TLS (also --certfile/--keyfile on the command line).
    certfile: str = ""
    keyfile: str = ""
    # Run timing.
    wait_timeout_s: float = 120.0  # longest silence between two run events
    run_timeout_s: float = 1800.0  # whole run
    # Admission.
    max_queue: int = 64  # per model
    queue_timeout_ms: int = 30_000
    # Streams.
    keepalive_s: float = 10.0
    max_buffered_events: int = 8192  # per run, before a non-reading client's run is cancelled
    # All runs' events waiting for their clients, in bytes: past it, the runs of clients furthest
    # behind (more than 1/4096 of it waiting, 64 KiB at least) are cancelled as slow clients.
    max_buffered_bytes: int = 256 * 1024 * 1024
    # HTTP/2 streams a client connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS;
    # hypercorn's default 100 let 300 connections hold 30,000 requests: an outside audit)
    h2_max_streams: int = 32
    write_timeout_s: float = 60.0  # a client or node that takes no bytes of a write (64 KiB of a larger one)
    #                                this long loses its connection (nginx's send_timeout)
    max_tool_attempts: int = 2
    # Link.
    ping_interval_s: float = 5.0
    ping_misses: int = 3  # a peer silent for this many intervals is dead
    hello_timeout_s: float = 5.0
    max_frame_bytes: int = 16 * 1024 * 1024
    max_node_concurrency: int = 4096  # per node and model: a larger advertised capacity is capped to this
    # A node that links beside a peer serving its model, or that is routed around, gets this many runs of
    # the model at first, and one more for each that completes there, up to its capacity; 0: all at once
    ramp_slots: int = 16
    stall_after_s: float = 10.0  # a node whose runs of a model wait this long (and 10x that model's TTFT on its peers)
    #                              for a first event, or go silent this long after it, is routed around, and its
    #                              unstarted runs of the model move to other nodes
    # Placement (README "Many nodes"): "prefix" (session, then the node holding the longest
    # prompt prefix, then rendezvous hashing), "session" (session, then least loaded),
    # "least_loaded", "random".
    routing: Literal["prefix", "session", "least_loaded", "random"] = "prefix"
    prefix_index_entries: int = (
        500_000  # prefix blocks remembered (80-150 bytes each), and half as many relayed; 0: none
    )
    prefix_max_load_gap: float = 0.25  # a prefix or rendezvous choice may be this much busier (fraction of
    #                                    capacity) than the least loaded node; beyond it load wins
    prefix_wait_ms: float = 250.0  # a request whose prefix is on a node with no free slot (but not beyond the
    #                                load gap) waits this long for one there before it goes elsewhere; 0: never
    # Requests.
    max_body_bytes: int = 8 * 1024 * 1024
    max_large_requests: int = 64  # requests with a body of 1 MiB or more in flight at once; past it, a 503
    max_messages: int = 2048
    max_tools: int = 256
    body_timeout_s: float = 60.0  # to receive a whole request body; a slower one is a 408
    # Bytes a second a request body must average once it has taken BODY_RATE_GRACE_S (edge.openai.
    # exchange); a slower one is a 408 (0: none; one byte every 20 s held a descriptor for 60 s).
    min_body_rate: int = 240
    max_output_tokens: int = 131072  # the largest max_tokens / max_completion_tokens a request may ask for
    trace_requests: bool = True  # a request's metadata iop_trace_stream turns on its per-chunk trace lines
    cors_origins: list[str] = msgspec.field(default_factory=list)  # browser origins that may call /v1/ ("*": any)
    # host names a keyless edge answers browsers' own-origin calls at, beside localhost and IP addresses ("*": any)
    allowed_hosts: list[str] = msgspec.field(default_factory=list)
    # Reverse proxies (addresses or networks) whose X-Forwarded-For names the client (edge.forwarded).
    trusted_proxies: list[str] = msgspec.field(default_factory=list)
    # Shutdown.
    drain_grace_s: float = 30.0
    models: list[ModelPolicy] = msgspec.field(default_factory=list)

    def check(self) -> None:
        for key in (
            "wait_timeout_s",
            "run_timeout_s",
            "ping_interval_s",
            "hello_timeout_s",
            "keepalive_s",
            "stall_after_s",
            "write_timeout_s",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be greater than 0")
        for key in ("max_queue", "max_tools", "drain_grace_s", "queue_timeout_ms", "ramp_slots"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}: must not be negative")
        if self.max_messages < 1:  # 0: no request
            raise ConfigError("max_messages: must be at least 1")
        if self.ping_misses < 2:  # 1: a pong a moment late dropped every healthy link
            raise ConfigError("ping_misses: must be at least 2")
        for key in (
            "max_body_bytes",
            "max_large_requests",
            "max_frame_bytes",
            "max_buffered_events",
            "max_buffered_bytes",
            "h2_max_streams",
            "max_node_concurrency",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be greater than 0")
        if self.h2_max_streams > MAX_H2_STREAMS:  # (an HTTP/2 setting is 32 bits: past it no connection opened)
            raise ConfigError(f"h2_max_streams: at most {MAX_H2_STREAMS}")
        if self.max_frame_bytes < MIN_FRAME_BYTES:  # a node keeps its frames under 64 KiB at least
            raise ConfigError(f"max_frame_bytes: at least {MIN_FRAME_BYTES} (no node could link under it)")
        for key in ("api_keys", "admin_keys"):
            if any(not k for k in getattr(self, key)):
                raise ConfigError(f"{key}: an empty key (no client could send it)")
        # A node sends its token as a bearer header, and `iop node` takes only such a value.
        tokens = [("node_token", self.node_token)] if self.node_token else []
        tokens += [(f"node_tokens.{node}", t) for node, t in self.node_tokens.items()]
        for key, token in tokens:
            if not BEARER_VALUE.fullmatch(token):
                raise ConfigError(f"{key}: printable ASCII with no spaces around it, not empty (no node could send it)")
        for node, patterns in self.node_models.items():
            if not patterns or len(patterns) > 256 or any(not p or len(p) > 256 for p in patterns):
                raise ConfigError(f"node_models.{node}: 1 to 256 patterns of 1 to 256 characters")
        for key, least in TIMING_FLOORS.items():
            if getattr(self, key) < least:
                raise ConfigError(f"{key}: at least {least}")
        if self.max_tool_attempts > MAX_TOOL_ATTEMPTS:
            raise ConfigError(f"max_tool_attempts: at most {MAX_TOOL_ATTEMPTS}")
        if self.prefix_index_entries < 0:
            raise ConfigError("prefix_index_entries: must not be negative")
        if not 0 <= self.prefix_max_load_gap <= 1:
            raise ConfigError("prefix_max_load_gap: must be between 0 and 1")
        if not 0 <= self.prefix_wait_ms <= 60_000:
            raise ConfigError("prefix_wait_ms: must be between 0 and 60000")
        if not 0 < self.backlog <= 65535:
            raise ConfigError("backlog: between 1 and 65535")
        if self.body_timeout_s <= 0:
            raise ConfigError("body_timeout_s: must be greater than 0")
        if self.min_body_rate < 0:
            raise ConfigError("min_body_rate: must not be negative")
        if self.max_output_tokens < 1:
            raise ConfigError("max_output_tokens: must be at least 1")
        for i, origin in enumerate(self.cors_origins):
            problem = origin_problem(origin)
            if problem is not None:
                raise ConfigError(f"cors_origins[{i}]: {problem}")
        for i, host in enumerate(self.allowed_hosts):
            problem = host_problem(host)
            if problem is not None:
                raise ConfigError(f"allowed_hosts[{i}]: {problem}")
        if len(self.trusted_proxies) > 256:
            raise ConfigError("trusted_proxies: at most 256 addresses or networks")
        try:
            parse_networks(self.trusted_proxies)
        except ValueError as e:
            raise ConfigError(f"trusted_proxies: {e}") from None
        if bool(self.certfile) != bool(self.keyfile):
            raise ConfigError("certfile: TLS needs both certfile and keyfile")
        if self.max_tool_attempts < 1:
            raise ConfigError("max_tool_attempts: must be at least 1")
        try:
            check_bind(self.bind)
        except ConfigError as e:
            raise ConfigError(f"bind: {e}") from None
        ids: set[str] = set()
        for i, k in enumerate(self.keys):
            if name_problem(k.id, 64) or k.id in ids:  # shown in the console, logs and metrics
                raise ConfigError(f"keys[{i}].id: 1 to 64 characters of printable ASCII, no space, unique")
            ids.add(k.id)
            if k.id.startswith("api_keys["):  # (the plain keys' ids: one would take the other's place)
                raise ConfigError(f"keys[{i}].id: {k.id!r} is reserved (api_keys[N] names the plain api_keys)")
            if bool(k.key) == bool(k.key_sha256):
                raise ConfigError(f"keys[{i}]: give key or key_sha256 (one of them)")
            if k.key_sha256 and not re.fullmatch(r"[0-9a-fA-F]{64}", k.key_sha256):
                raise ConfigError(f"keys[{i}].key_sha256: 64 hex digits")
            for name in ("rpm", "tpm", "max_concurrent", "daily_tokens"):
                if getattr(k, name) < 0:
                    raise ConfigError(f"keys[{i}].{name}: must not be negative")
            if not k.models:
                raise ConfigError(f'keys[{i}].models: at least one pattern ("*": all)')
        if self.state and not self.state.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError('state: a redis:// URL, or "" (limits per edge)')
        scheme = self.ledger.partition("://")[0] if "://" in self.ledger else ""
        if scheme not in ("", "sqlite", "postgres", "postgresql") or (
            scheme == "sqlite" and not self.ledger.startswith("sqlite:///")  # (sqlite://x.db made a directory)
        ):
            raise ConfigError('ledger: a SQLite path (or sqlite:///path), a postgresql:// URL, "" or "off"')
        if not 0 <= self.ledger_retention_days <= MAX_RETENTION_DAYS:
            raise ConfigError(f"ledger_retention_days: 0 (every record kept) to {MAX_RETENTION_DAYS}")
        seen: set[str] = set()
        for i, m in enumerate(self.models):
            if m.name in seen:
                raise ConfigError(f"models[{i}].name: duplicate model {m.name!r}")
            seen.add(m.name)
            for name in ("max_queue", "queue_timeout_ms"):
                value = getattr(m, name)
                if value is not None and value < 0:
                    raise ConfigError(f"models[{i}].{name}: must not be negative")
            # (a special token is a few characters: one of 500 made every request to its model a 500)
            if len(m.sentinels) > 256 or any(not 0 < len(t) <= 64 for t in m.sentinels):
                raise ConfigError(f"models[{i}].sentinels: at most 256, each 1 to 64 characters")
            if m.max_tool_attempts is not None and not 1 <= m.max_tool_attempts <= MAX_TOOL_ATTEMPTS:
                raise ConfigError(f"models[{i}].max_tool_attempts: between 1 and {MAX_TOOL_ATTEMPTS}")
            # (both were accepted and did nothing without it: a forgotten strict_output went unseen)
            for name in ("stream_buffer", "xml_completion_tool"):
                if getattr(m, name) and not m.strict_output:
                    raise ConfigError(f"models[{i}].{name}: takes effect only with strict_output = true")

    @property
    def ledger_target(self) -> str | None:
        """The ledger's SQLite file or PostgreSQL URL; None: off."""
        if self.ledger.lower() == "off":
            return None
        return self.ledger.removeprefix("sqlite:///") or os.path.join(self.state_dir, "ledger.sqlite3")

    def load_key_files(self) -> EdgeConfig:
        """A copy with the keys of api_keys_file / admin_keys_file merged in;
        ConfigError if a ``[[keys]]`` entry's secret is another client key's."""
        extra: dict[str, list[str]] = {}
        plain = [(f"api_keys[{i}]", k) for i, k in enumerate(self.api_keys)]  # (name, secret)
        for key in ("api_keys", "admin_keys"):
            path = getattr(self, f"{key}_file")
            if not path:
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    lines = [(n, line.split("#", 1)[0].strip()) for n, line in enumerate(f, 1)]
            except OSError as e:
                raise ConfigError(f"{key}_file: cannot read {path}: {e.strerror}") from e
            except UnicodeDecodeError as e:
                raise ConfigError(f"{key}_file: {path} is not UTF-8 text (byte {e.start})") from e
            keys = [(n, k) for n, k in lines if k]
            if key == "api_keys":
                plain += [(f"api_keys_file line {n}", k) for n, k in keys]
            extra[key] = [*getattr(self, key), *(k for _, k in keys)]
            if not extra[key]:
                raise ConfigError(f"{key}_file: {path} holds no key")
        check_secrets(plain, self.keys)
        return msgspec.structs.replace(self, **extra) if extra else self

    def node_may_serve(self, node_id: str) -> re.Pattern[str] | None:
        """What models ``node_id`` may serve (``node_models``): a pattern, or None for any. Its
        own entry; else the first key that is a glob matching it (``"gpu-*"``: an operator who
        wrote one meant the gpu nodes, which a key read as an id alone let serve anything); else
        ``"*"``'s."""
        patterns = self.node_models.get(node_id)
        if patterns is None:
            patterns = next(
                (
                    listed
                    for key, listed in self.node_models.items()
                    if key != "*" and _GLOB.search(key) and fnmatch.fnmatchcase(node_id, key)
                ),
                self.node_models.get("*"),
            )
        if patterns is None or "*" in patterns:
            return None
        return _models_pattern(tuple(patterns))

    def policy(self, model: str) -> ModelPolicy:
        """The model's ``[[models]]`` entry, or the defaults: one shared
        instance (named ``*``), not one per request that every stream holds."""
        for m in self.models:
            if m.name == model:
                return m
        return DEFAULT_POLICY

    @property
    def ping_timeout_s(self) -> float:
        return self.ping_interval_s * max(self.ping_misses, 1)


_GLOB = re.compile(r"[*?\[]")


@functools.lru_cache(maxsize=64)
def _models_pattern(patterns: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(fnmatch.translate(p) for p in patterns))


def check_secrets(plain: list[tuple[str, str]], keys: list[KeyConfig]) -> None:
    """ConfigError if a ``[[keys]]`` entry has the secret (compared by SHA-256, as
    edge.keys finds a key) of another entry or of a plain key (``plain``: name and
    secret): the last would win, and the other entry could never be used, or a plain
    key would quietly get that entry's limits. The line names both, never the secret.
    Plain keys given twice are one key, as before."""
    seen = {sha256_hex(secret): name for name, secret in plain}
    for k in keys:
        digest = k.key_sha256.lower() or sha256_hex(k.key)
        name = msgspec.json.encode(k.id).decode()  # "id", as TOML writes it
        other = seen.get(digest)
        if other is not None:
            raise ConfigError(f"keys: {name} has the same secret as {other}")
        seen[digest] = name


def check_bind(bind: str) -> None:
    """A ``HOST:PORT`` the edge can listen on (port 0: any free port); else ConfigError, one line."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit():
        raise ConfigError(f"expected HOST:PORT, got {bind!r}")
    if host.startswith("[") != host.endswith("]"):
        raise ConfigError(f"unbalanced brackets around the host in {bind!r} (IPv6: [::1]:8080)")
    if int(port) > 65535:
        raise ConfigError(f"port must be 0-65535, got {bind!r}")


def load_edge_config(path: str | None) -> EdgeConfig:
    """Load from ``path``, else from ``$IOP_EDGE_CONFIG``, else defaults."""
    path = path or os.environ.get("IOP_EDGE_CONFIG") or None
    config = convert({}, EdgeConfig) if path is None else load(path, EdgeConfig)
    try:
        return config.load_key_files()
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
