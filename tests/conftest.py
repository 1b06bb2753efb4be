"""Real servers on loopback, port 0: the upstream test server, the edge
(hypercorn, trio worker) and nodes (in-process agents or `iop node` processes)."""

from __future__ import annotations

import os
import secrets
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import msgspec
import openai
import pytest
import trio

from edge.app import Edge, create_app, edge_of
from edge.config import EdgeConfig, ModelPolicy
from edge.serve import serve_edge
from iop import logs
from node.agent import NodeAgent
from node.config import ModelConfig, NodeConfig
from scripts.upstream import Upstream

TOKEN = "test-token"
BOUND = 20  # seconds: the absolute limit for any one wait in a test
# A test whose assertion is a share of the machine (requests served in a few seconds, a link read
# at a bounded rate while others flood): run again, up to twice, when it fails. `make test` runs
# two workers on two cores, with servers of other tests beside them, and each of these has failed
# a full run now and then while passing alone; a real fault fails all three tries.
LOAD_BOUND = pytest.mark.flaky(reruns=2, reruns_delay=1)

logs.configure("info", json=False, cache=False)  # uncached: tests capture logs


async def eventually(predicate: Callable[[], bool], what: str = "condition") -> None:
    """Wait (bounded by BOUND) until ``predicate()`` holds."""
    with trio.fail_after(BOUND):
        while not predicate():
            await trio.sleep(0.005)


class Peak:
    """The most ``read()`` gave, sampled each millisecond while :meth:`watch` runs."""

    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read
        self.most = 0

    async def watch(self) -> None:
        while True:
            self.most = max(self.most, self.read())
            await trio.sleep(0.001)


async def raw_post(edge: EdgeHandle, path: str, body: bytes, rcvbuf: int) -> trio.SocketStream:
    """POST ``body`` (JSON) to ``path`` on a socket of a small receive buffer, nothing read yet:
    a client that reads at its own pace (or not at all)."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", int(edge.url.rsplit(":", 1)[1])))
    stream = trio.SocketStream(sock)
    head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" % path.encode()
    await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)
    return stream


@dataclass
class EdgeHandle:
    app: object
    edge: Edge
    url: str  # http://127.0.0.1:PORT
    scope: trio.CancelScope

    @property
    def link_url(self) -> str:
        return self.url.replace("http", "ws", 1) + "/v1/node/link"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stop(self) -> None:
        self.scope.cancel()


@dataclass
class NodeHandle:
    agent: NodeAgent
    scope: trio.CancelScope
    config: NodeConfig = field(repr=False)

    def stop(self) -> None:
        self.scope.cancel()


def edge_config(**overrides) -> EdgeConfig:
    # No ledger unless a test asks for one (tests/test_keys.py): every edge would share ./iop-state.
    base = dict(bind="127.0.0.1:0", node_token=TOKEN, ping_interval_s=1.0, keepalive_s=5.0, ledger="off")
    # Nor ./iop-state for a spool of records a ledger could not store at its stop: another test's edge would store them.
    base["state_dir"] = os.path.join(tempfile.gettempdir(), f"iop-state-{secrets.token_hex(6)}")  # (made if needed)
    base.update(overrides)
    models = base.pop("models", [])
    return EdgeConfig(**base, models=[m if isinstance(m, ModelPolicy) else ModelPolicy(**m) for m in models])


async def start_edge(
    nursery: trio.Nursery, config: EdgeConfig | None = None, *, bind: str = "127.0.0.1:0"
) -> EdgeHandle:
    app = create_app(config or edge_config())
    scope = trio.CancelScope()

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        with scope:
            await serve_edge(app, bind, task_status=task_status)

    url = await nursery.start(run)
    return EdgeHandle(app, edge_of(app), url, scope)


def model(name: str = "m", upstream: Upstream | None = None, **kw) -> ModelConfig:
    if upstream is not None:
        kw.setdefault("adapter", "openai")
        kw.setdefault("base_url", upstream.base_url)
        kw.setdefault("target", f"{name}-target")
    else:
        kw.setdefault("adapter", "sim")
    return ModelConfig(name=name, **kw)


def node_config(edges: list[str], models: list[ModelConfig], node_id: str = "n1", **kw) -> NodeConfig:
    kw.setdefault("token", TOKEN)
    kw.setdefault("reconnect_min_s", 0.05)
    kw.setdefault("reconnect_max_s", 0.5)
    return NodeConfig(node_id=node_id, edges=edges, models=models, **kw)


async def start_node(
    nursery: trio.Nursery, edge: EdgeHandle | list[EdgeHandle], models: list[ModelConfig], node_id: str = "n1", **kw
) -> NodeHandle:
    edges = edge if isinstance(edge, list) else [edge]
    config = node_config([e.link_url for e in edges], models, node_id, **kw)
    agent = NodeAgent(config)
    scope = trio.CancelScope()

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        with scope:
            await agent.serve(task_status=task_status)

    await nursery.start(run)
    for e in edges:
        await eventually(lambda e=e: _granted(e, node_id), what="node linked and its first grants in")
    return NodeHandle(agent, scope, config)


def _granted(edge: EdgeHandle, node_id: str) -> bool:
    """The node is linked to ``edge`` and its first grant of every model has arrived."""
    link = edge.edge.runs.links.get(node_id)
    return link is not None and all(seq > 0 for seq in link.grant_seq.values())


def write_toml(path, data: dict) -> str:
    lines: list[str] = []
    tables: list[tuple[str, dict]] = []
    for key, value in data.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            tables.extend((key, v) for v in value)
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, table in tables:
        lines.append(f"\n[[{key}]]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in table.items())
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _toml_value(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float) and value != value:
        return "nan"  # JSON has no NaN; TOML does
    return msgspec.json.encode(value).decode()


async def start_node_process(
    nursery: trio.Nursery, tmp_path, edge: EdgeHandle, models: list[dict], node_id: str = "p1"
):
    """An `iop node` OS process (for SIGKILL / SIGSTOP tests)."""
    cfg = write_toml(
        tmp_path / f"{node_id}.toml",
        {
            "node_id": node_id,
            "edges": [edge.link_url],
            "token": TOKEN,
            "reconnect_min_s": 0.05,
            "reconnect_max_s": 0.5,
            "models": models,
        },
    )
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "iop.cli", "--log-level", "warning", "node", "--config", cfg],
        env={**os.environ, "IOP_LOG_FORMAT": "console"},
    )
    nursery.start_soon(_reap, proc)
    await eventually(lambda: node_id in edge.edge.runs.links, what="node process linked")
    return proc


async def _reap(proc) -> None:
    try:
        await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await proc.wait()


@pytest.fixture
async def upstream(nursery):
    up = Upstream()
    await nursery.start(up.serve)
    return up


@pytest.fixture
async def edge(nursery):
    return await start_edge(nursery)


@pytest.fixture
async def node(nursery, edge, upstream):
    return await start_node(nursery, edge, [model("m", upstream, max_concurrency=4)])


def sdk(edge: EdgeHandle, **kw) -> openai.AsyncOpenAI:
    kw.setdefault("api_key", "unused")
    return openai.AsyncOpenAI(base_url=edge.url + "/v1", max_retries=0, timeout=BOUND, **kw)


def sync_sdk(edge: EdgeHandle, **kw) -> openai.OpenAI:
    kw.setdefault("api_key", "unused")
    return openai.OpenAI(base_url=edge.url + "/v1", max_retries=0, timeout=BOUND, **kw)


def http(edge: EdgeHandle, **kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=edge.url, timeout=BOUND, **kw)


async def settled(edge: EdgeHandle, *agents: NodeAgent) -> None:
    """Nothing left running: the edge's runs and every node's upstream requests."""
    # (a run cancelled here holds its node slot until the node answers the cancel: a moment later)
    await eventually(
        lambda: (
            edge.edge.runs.in_flight == 0
            and all(a.counters.active_upstream == 0 for a in agents)
            and not any(link.cancelling for link in edge.edge.runs.links.values())
        ),
        what="in-flight counts back to zero",
    )
    for link in edge.edge.runs.links.values():
        assert all(v == 0 for v in link.in_flight.values()), link.in_flight


def requests_counted(edge, api: str = "chat") -> dict[str, float]:
    """``iop_requests_total`` of ``api``'s requests, by outcome (those counted)."""
    return {
        sample.labels["outcome"]: sample.value
        for metric in edge.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "iop_requests_total" and sample.labels.get("api") == api and sample.value
    }


def sse_events(raw: bytes) -> list[bytes]:
    return [block[6:] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]


class CountingOS:
    """``os`` with its reads counted, and the ones that found nothing (EAGAIN):
    monkeypatch a module's ``os`` with it."""

    def __init__(self) -> None:
        self.reads = 0
        self.empty = 0

    def __getattr__(self, name):
        return getattr(os, name)

    def read(self, fd: int, size: int) -> bytes:
        self.reads += 1
        try:
            return os.read(fd, size)
        except BlockingIOError:
            self.empty += 1
            raise
