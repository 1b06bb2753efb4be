"""The node's configuration."""

from __future__ import annotations

import os
import ssl
import urllib.parse
from typing import Literal

import msgspec

from iop.configfile import BEARER_VALUE, ConfigError, load
from node.http1 import InvalidURL, Origin
from proto.frames import MAX_MODEL_NAME, MAX_MODELS, MAX_NODE_ID, name_problem

MIN_FRAME_BYTES = 64 * 1024


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str  # the model group clients ask for
    adapter: Literal["openai", "sim"]
    target: str = ""  # the upstream's model name (default: name)
    base_url: str = ""  # openai: e.g. http://127.0.0.1:8000/v1
    api_key: str = ""
    max_concurrency: int = 4
    context_window: int = 0
    native_tools: bool = True
    passthrough: bool = False  # allow raw tunnelled requests (passthrough mode)
    # sim: deterministic text at a set pace
    ttft_ms: float = 50.0
    tokens_per_s: float = 50.0  # 0: as fast as possible
    sim_tokens: int = 64  # tokens when the request sets no max_tokens
    # true: sim_tokens is the answer's own length, as a model's (finish "stop"); a request's max_tokens
    # only cuts it shorter ("length"); usage counts the whole prompt (characters / 4). false: a
    # request's max_tokens sets the length, and the prompt counted is the last user message (benchmarks).
    sim_stops: bool = False
    # sim: a prefix cache (node.adapters.sim_cache), a model of a real engine's; 0: none
    prefix_cache_tokens: int = 0  # LRU capacity in prompt tokens
    prefix_block_tokens: int = 64  # cached in whole blocks of this many tokens (4 characters a token)
    prefill_tokens_per_s: float = 5000.0  # uncached prompt tokens add to ttft_ms at this rate; 0: no cost
    prefill_shared: bool = True  # the rate is the model's, not each request's: a prefill waits for those ahead
    # The model server's Prometheus metrics (vLLM, SGLang, llama.cpp: e.g. http://127.0.0.1:8000/metrics),
    # sampled every metrics_interval_s and reported to the edges as its load (node.engine); "": none.
    metrics_url: str = ""
    metrics_interval_s: float = 1.0


class NodeConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    node_id: str
    edges: list[str]
    token: str = ""
    # A CA bundle (PEM) to trust: for wss:// edges instead of the system's, for https model servers besides certifi's.
    ca_file: str = ""
    models: list[ModelConfig] = msgspec.field(default_factory=list)
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    relink_max_s: float = 2.0  # after losing a link that was up, redial at least this often...
    relink_window_s: float = 60.0  # ...for this long (an edge restart), then back off up to reconnect_max_s
    connect_timeout_s: float = 10.0
    hello_timeout_s: float = 10.0
    ping_misses: int = 3
    upstream_connect_timeout_s: float = 10.0
    upstream_read_timeout_s: float = 600.0  # the edge's wait timeout normally fires first
    max_pending_events: int = 4096  # per link, before run tasks wait for the sender
    max_frame_bytes: int = 16 * 1024 * 1024  # frames are also kept under the edge's own limit (welcome)
    drain_grace_s: float = 30.0

    def check(self) -> None:
        problem = name_problem(self.node_id, MAX_NODE_ID)
        if problem:
            raise ConfigError(f"node_id: {problem}")
        if not self.edges:
            raise ConfigError("edges: give at least one edge URL (ws://HOST:PORT/v1/node/link)")
        for i, url in enumerate(self.edges):
            if url in self.edges[:i]:  # a second link of one node id is refused, and redialled for ever
                raise ConfigError(f"edges[{i}]: {url!r} is listed twice")
            if not url.startswith(("ws://", "wss://")):
                raise ConfigError(f"edges[{i}]: expected a ws:// or wss:// URL, got {url!r}")
            try:
                parts = urllib.parse.urlsplit(url)
                parts.port  # noqa: B018 (raises on a port past 65535)
            except ValueError as e:
                raise ConfigError(f"edges[{i}]: {e}") from None
            if not parts.hostname:
                raise ConfigError(f"edges[{i}]: no host in {url!r}")
        if not self.models:
            raise ConfigError("models: the node serves no model; add a [[models]] entry")
        if len(self.models) > MAX_MODELS:
            raise ConfigError(f"models: at most {MAX_MODELS} on one node")
        seen: set[str] = set()
        for i, m in enumerate(self.models):
            problem = name_problem(m.name, MAX_MODEL_NAME)
            if problem:
                raise ConfigError(f"models[{i}].name: {problem}")
            if m.name in seen:
                raise ConfigError(f"models[{i}].name: duplicate model {m.name!r}")
            seen.add(m.name)
            if m.max_concurrency < 1:
                raise ConfigError(f"models[{i}].max_concurrency: must be at least 1")
            if m.adapter == "openai":
                try:
                    origin = Origin(m.base_url)
                except InvalidURL:
                    raise ConfigError(f"models[{i}].base_url: the openai adapter needs an http(s) base_url") from None
                # (a base_url copied from the edge's: each request went round edge, node, edge until
                # the queue timed out, 30 s, with a 429 "at capacity" that named no cause)
                for j, edge_url in enumerate(self.edges):
                    if _same_place(origin, edge_url):
                        raise ConfigError(
                            f"models[{i}].base_url: is edges[{j}], this node's own edge; give the model server's URL"
                        )
            if m.metrics_url:
                try:
                    Origin(m.metrics_url)
                except InvalidURL:
                    raise ConfigError(f"models[{i}].metrics_url: not an http(s) URL") from None
                if m.metrics_interval_s < 0.05:
                    raise ConfigError(f"models[{i}].metrics_interval_s: must be at least 0.05")
            if m.context_window < 0 or m.sim_tokens < 0:
                raise ConfigError(f"models[{i}]: context_window and sim_tokens must not be negative")
            if m.tokens_per_s < 0 or m.ttft_ms < 0:
                raise ConfigError(f"models[{i}]: ttft_ms and tokens_per_s must not be negative")
            if m.prefix_cache_tokens < 0 or m.prefill_tokens_per_s < 0:
                raise ConfigError(f"models[{i}]: prefix_cache_tokens and prefill_tokens_per_s must not be negative")
            if m.prefix_block_tokens < 1:
                raise ConfigError(f"models[{i}].prefix_block_tokens: must be at least 1")
            if m.api_key and not BEARER_VALUE.fullmatch(m.api_key):
                raise ConfigError(f"models[{i}].api_key: must be printable ASCII with no spaces around it")
        if self.reconnect_min_s <= 0 or self.reconnect_max_s < self.reconnect_min_s:
            raise ConfigError("reconnect_min_s: must be > 0 and <= reconnect_max_s")
        if self.relink_max_s <= 0:
            raise ConfigError("relink_max_s: must be > 0")
        if self.relink_window_s < 0:  # (it said relink_max_s: an outside audit)
            raise ConfigError("relink_window_s: must not be negative")
        if not self.upstream_read_timeout_s > 0:
            raise ConfigError("upstream_read_timeout_s: must be greater than 0 (inf: never)")
        if self.ping_misses < 1:
            raise ConfigError("ping_misses: must be at least 1")
        for key in ("connect_timeout_s", "hello_timeout_s", "upstream_connect_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key}: must be greater than 0")
        if not self.drain_grace_s >= 0:
            raise ConfigError("drain_grace_s: must not be negative")
        if self.ca_file and not os.path.isfile(self.ca_file):
            raise ConfigError(f"ca_file: no file at {self.ca_file}")
        if self.ca_file:
            try:  # (else every wss:// dial failed, for ever, naming no key)
                ssl.create_default_context(cafile=self.ca_file)
            except (ssl.SSLError, OSError, ValueError) as e:
                raise ConfigError(f"ca_file: {self.ca_file} holds no PEM certificate ({e})") from None
        if self.max_pending_events < 1:
            raise ConfigError("max_pending_events: must be at least 1")
        if self.max_frame_bytes < MIN_FRAME_BYTES:
            raise ConfigError(f"max_frame_bytes: must be at least {MIN_FRAME_BYTES}")
        # The value is never part of the message: config errors are printed.
        if not self.token:
            raise ConfigError("token: missing; the node needs the edge's node token")
        if not BEARER_VALUE.fullmatch(self.token):
            raise ConfigError("token: must be printable ASCII with no spaces around it")


def load_node_config(path: str) -> NodeConfig:
    return load(path, NodeConfig)


_LOOPBACK_NAMES = {"localhost": "127.0.0.1", "::1": "127.0.0.1", "0.0.0.0": "127.0.0.1"}


def _same_place(origin: Origin, edge_url: str) -> bool:
    """Whether an upstream's base URL is the API of the edge at ``edge_url`` (checked already:
    a ws:// or wss:// URL with a host): its host and port, and the path its link's is under
    (one gateway may route /iop/ to an edge and /vllm/ to a model server: a re-check)."""
    parts = urllib.parse.urlsplit(edge_url)
    port = parts.port or (443 if parts.scheme == "wss" else 80)
    host = (parts.hostname or "").lower()
    mine = origin.host.lower()
    api = parts.path.rstrip("/").removesuffix("/node/link")
    return (
        port == origin.port
        and _LOOPBACK_NAMES.get(host, host) == _LOOPBACK_NAMES.get(mine, mine)
        and api == origin.path
    )
