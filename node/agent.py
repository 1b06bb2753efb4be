"""The node agent: one link per edge URL, each redialled for ever.

Per link: the reader (this task) starts a task per run in the link's
nursery; the sender packs every run event produced since its last send into
one ``events`` frame; the pinger declares a silent edge dead. When a link
ends for any reason its nursery is cancelled, which cancels every run on it
and so closes their upstream requests.

    NodeError
      LinkRefused     the edge refused the link (token, version, duplicate id)
      LinkDead        the edge went silent past the ping timeout
"""

from __future__ import annotations

import random
import ssl
import urllib.parse
from functools import partial

import msgspec
import structlog
import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError, wrap_client_stream

from iop import __version__
from iop.exceptions import first_leaf
from node.adapters import Adapter, Counters, make_adapter
from node.config import NodeConfig
from proto import (
    PROTOCOL_VERSION,
    CancelRun,
    Events,
    Hello,
    Load,
    ModelInfo,
    Ping,
    Pong,
    RunEvent,
    RunRequest,
    ToolCall,
    TunnelFrame,
    TunnelRequest,
    Usage,
    Welcome,
    decode_frame,
    encode_frame,
)
from proto.frames import COMPLETE, DELTA, ERROR, REASONING_DELTA

log = structlog.get_logger("iop.node")


class NodeError(Exception):
    pass


class LinkRefused(NodeError):
    pass


class LinkDead(NodeError):
    pass


class RunSink:
    """Where an adapter reports one run's output (see :mod:`node.adapters`)."""

    __slots__ = ("_link", "_run_id", "_seq", "ended")

    def __init__(self, link: EdgeLink, run_id: str) -> None:
        self._link = link
        self._run_id = run_id
        self._seq = 0
        self.ended = False

    @property
    def started(self) -> bool:
        """Some event has been reported."""
        return self._seq > 0

    def _event(self, kind: str, **fields) -> RunEvent:
        self._seq += 1
        return RunEvent(run_id=self._run_id, seq=self._seq, type=kind, **fields)

    async def delta(self, text: str) -> None:
        await self._link.emit(self._event(DELTA, text=text))

    async def reasoning(self, text: str) -> None:
        await self._link.emit(self._event(REASONING_DELTA, text=text))

    async def complete(
        self, finish_reason: str, tool_calls: list[ToolCall] | None = None, usage: Usage | None = None
    ) -> None:
        if not self.ended:
            self.ended = True
            await self._link.emit(
                self._event(COMPLETE, finish_reason=finish_reason, tool_calls=tool_calls, usage=usage)
            )

    async def error(self, message: str, status: int = 0) -> None:
        if not self.ended:
            self.ended = True
            await self._link.emit(self._event(ERROR, text=message, status=status))


class EdgeLink:
    """One live websocket to one edge."""

    def __init__(self, agent: NodeAgent, url: str, ws, welcome: Welcome) -> None:
        self.agent = agent
        self.url = url
        self.ws = ws
        self.ping_interval = welcome.ping_interval_s
        self.edge_id = welcome.edge_id
        self.runs: dict[str, trio.CancelScope] = {}
        self.last_rx = trio.current_time()
        self._pending: list[RunEvent] = []
        self._has_pending = trio.lowlevel.ParkingLot()
        self._drained = trio.lowlevel.ParkingLot()
        self._sending = False
        self._max_pending = agent.config.max_pending_events

    async def emit(self, event: RunEvent) -> None:
        self._pending.append(event)
        self._has_pending.unpark_all()
        while len(self._pending) >= self._max_pending:
            await self._drained.park()

    async def send(self, frame) -> None:
        await self.ws.send_message(encode_frame(frame))

    async def serve(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_events)
                nursery.start_soon(self._ping)
                await self._read(nursery)
        finally:
            if self.runs:
                log.info("link lost: runs cancelled", edge=self.url, runs=len(self.runs))

    async def _send_events(self) -> None:
        while True:
            while not self._pending:
                await self._has_pending.park()
            batch, self._pending = self._pending, []
            self._drained.unpark_all()
            self._sending = True
            try:
                await self.ws.send_message(encode_frame(Events(events=batch)))
            finally:
                self._sending = False
                self._drained.unpark_all()

    async def flushed(self) -> None:
        """Return once every event emitted so far has been sent."""
        while self._pending or self._sending:
            await self._drained.park()

    async def _ping(self) -> None:
        timeout = self.ping_interval * max(self.agent.config.ping_misses, 1)
        while True:
            await trio.sleep(self.ping_interval)
            if trio.current_time() - self.last_rx > timeout:
                raise LinkDead(f"no frame from the edge for {timeout:g} s")
            await self.send(Ping(ts=trio.current_time()))

    async def _read(self, nursery: trio.Nursery) -> None:
        while True:
            data = await self.ws.get_message()
            self.last_rx = trio.current_time()
            try:
                frame = decode_frame(data)
            except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
                raise NodeError(f"undecodable frame from the edge: {e}") from None
            match frame:
                case RunRequest() | TunnelRequest():
                    self._start(frame, nursery)
                case CancelRun(run_id=run_id):
                    scope = self.runs.get(run_id)
                    if scope is not None:
                        scope.cancel()
                case Ping(ts=ts):
                    await self.send(Pong(ts=ts))
                case Pong():
                    pass
                case _:
                    log.warning("unexpected frame from the edge", frame=type(frame).__name__)

    def _start(self, request: RunRequest | TunnelRequest, nursery: trio.Nursery) -> None:
        if request.run_id in self.runs:
            return
        scope = self.runs[request.run_id] = trio.CancelScope()
        adapter = self.agent.adapters.get(request.model)
        if isinstance(request, RunRequest):
            sink: RunSink | TunnelSink = RunSink(self, request.run_id)
            refusal = None if adapter is not None else f"this node does not serve model {request.model!r}"
            work = partial(adapter.run, request, sink) if adapter is not None else None
        else:
            sink = TunnelSink(self, request.run_id)
            allowed = adapter is not None and self.agent.passthrough[request.model] and hasattr(adapter, "tunnel")
            refusal = None if allowed else f"this node does not allow passthrough for model {request.model!r}"
            work = partial(adapter.tunnel, request, sink) if allowed else None
        nursery.start_soon(self._serve_one, request, scope, sink, work, refusal)

    async def _serve_one(self, request, scope: trio.CancelScope, sink, work, refusal: str | None) -> None:
        """One run or tunnel: in its own cancel scope (CancelRun), within the
        model's capacity on this node, bounded by the run's deadline."""
        agent = self.agent
        agent.counters.active_runs += 1
        try:
            with scope:
                if refusal is not None:
                    await sink.error(refusal)
                    return
                async with agent.slots[request.model]:
                    with trio.move_on_after(max(request.timeout_s, 0)) as deadline:
                        try:
                            await work()
                        except Exception as e:  # a bug in an adapter; trio.Cancelled is not an Exception
                            log.exception("adapter failed", run_id=request.run_id)
                            await sink.error(f"node adapter failed: {type(e).__name__}: {e}")
                    if deadline.cancelled_caught:
                        await sink.error("run deadline exceeded on the node")
                    elif not sink.ended:
                        await sink.error("adapter ended without a result")
        finally:
            agent.counters.active_runs -= 1
            agent.counters.run_ended.unpark_all()
            self.runs.pop(request.run_id, None)


class TunnelSink:
    """Where an adapter sends one tunnelled response, frame by frame, in order."""

    __slots__ = ("_link", "_run_id", "_seq", "started", "ended")

    def __init__(self, link: EdgeLink, run_id: str) -> None:
        self._link = link
        self._run_id = run_id
        self._seq = 0
        self.started = False
        self.ended = False

    async def _send(self, kind: str, **fields) -> None:
        self._seq += 1
        await self._link.send(TunnelFrame(run_id=self._run_id, seq=self._seq, kind=kind, **fields))

    async def start(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.started = True
        await self._send("response_start", status=status, headers=headers)

    async def body(self, data: bytes) -> None:
        await self._send("body", body=data)

    async def end(self) -> None:
        if not self.ended:
            self.ended = True
            await self._send("end")

    async def error(self, message: str) -> None:
        if not self.ended:
            self.ended = True
            await self._send("error", error=message)


class NodeAgent:
    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.counters = Counters()
        self.adapters: dict[str, Adapter] = {
            m.name: make_adapter(
                m,
                self.counters,
                connect_timeout_s=config.upstream_connect_timeout_s,
                read_timeout_s=config.upstream_read_timeout_s,
            )
            for m in config.models
        }
        # Capacity is the node's own: shared by every edge it links to.
        self.slots = {m.name: trio.Semaphore(m.max_concurrency) for m in config.models}
        self.passthrough = {m.name: m.passthrough for m in config.models}
        self.links: dict[str, EdgeLink] = {}
        self.draining = False
        self.models = [
            ModelInfo(
                name=m.name,
                adapter=m.adapter,
                target=m.target or m.name,
                max_concurrency=m.max_concurrency,
                context_window=m.context_window,
                native_tools=m.native_tools,
                passthrough=m.passthrough,
            )
            for m in config.models
        ]

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for url in self.config.edges:
                    nursery.start_soon(self._dial_forever, url)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                for adapter in self.adapters.values():
                    await adapter.aclose()

    async def drain(self) -> None:
        """Take no new runs (each edge is told), finish the running ones within
        ``drain_grace_s``; the caller then cancels :meth:`serve`."""
        self.draining = True
        for link in list(self.links.values()):
            with trio.move_on_after(1):
                try:
                    await link.send(Load(in_flight={}, draining=True))
                except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # that link is gone: its edge has nothing to drain
        log.info("draining", runs=self.counters.active_runs, grace_s=self.config.drain_grace_s)
        with trio.move_on_after(self.config.drain_grace_s):
            while self.counters.active_runs:
                await self.counters.run_ended.park()
        with trio.move_on_after(2):  # the last events of those runs are still on their way out
            for link in list(self.links.values()):
                await link.flushed()

    async def _dial_forever(self, url: str) -> None:
        cfg = self.config
        backoff = cfg.reconnect_min_s
        while True:
            linked_at = trio.current_time()
            try:
                await self._link_once(url)
            except Exception as exc:  # trio.Cancelled is a BaseException: never caught here
                e = first_leaf(exc)
                if isinstance(e, ConnectionRejected):
                    body = (e.body or b"").decode("utf-8", "replace")[:200]
                    log.error("edge refused the link", edge=url, status=e.status_code, body=body)
                elif isinstance(e, ConnectionClosed):
                    reason = e.reason
                    log.warning(
                        "link closed",
                        edge=url,
                        code=getattr(reason, "code", None),
                        reason=getattr(reason, "reason", None),
                    )
                elif isinstance(e, (OSError, HandshakeError, NodeError, trio.TooSlowError, trio.BrokenResourceError)):
                    log.warning("link failed", edge=url, error=f"{type(e).__name__}: {e}")
                else:
                    log.error("link crashed", edge=url, exc_info=exc)
            if trio.current_time() - linked_at > 30:
                backoff = cfg.reconnect_min_s
            delay = backoff * random.uniform(0.5, 1.0)  # jitter: relinking nodes do not stampede
            log.info("redialling edge", edge=url, in_s=round(delay, 2))
            await trio.sleep(delay)
            backoff = min(backoff * 2, cfg.reconnect_max_s)

    async def _link_once(self, url: str) -> None:
        cfg = self.config
        headers = [(b"Authorization", f"Bearer {cfg.token}".encode()), (b"X-Iop-Node-Id", cfg.node_id.encode())]
        host, port, host_header, resource, secure = _parse_ws_url(url)
        # The TCP stream is ours to close: trio-websocket leaves it open when
        # the edge rejects the upgrade (a wrong token), which would leak a
        # socket per redial.
        with trio.fail_after(cfg.connect_timeout_s):
            if secure:
                context = ssl.create_default_context(cafile=cfg.ca_file or None)
                stream = await trio.open_ssl_over_tcp_stream(host, port, ssl_context=context, https_compatible=True)
            else:
                stream = await trio.open_tcp_stream(host, port)
        try:
            async with trio.open_nursery() as ws_nursery:
                with trio.fail_after(cfg.connect_timeout_s):
                    ws = await wrap_client_stream(
                        ws_nursery,
                        stream,
                        host_header,
                        resource,
                        extra_headers=headers,
                        max_message_size=cfg.max_frame_bytes,
                    )
                try:
                    await self._speak(url, ws)
                finally:
                    # A polite close handshake, briefly: the edge may be gone too.
                    with trio.CancelScope(shield=True), trio.move_on_after(0.25):
                        await ws.aclose()
                    ws_nursery.cancel_scope.cancel()
        finally:
            await trio.aclose_forcefully(stream)

    async def _speak(self, url: str, ws) -> None:
        cfg = self.config
        await ws.send_message(
            encode_frame(
                Hello(node_id=cfg.node_id, protocol=PROTOCOL_VERSION, models=self.models, software=f"iop {__version__}")
            )
        )
        with trio.fail_after(cfg.hello_timeout_s):
            data = await ws.get_message()
        try:
            welcome = decode_frame(data)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
            raise LinkRefused("the edge answered the hello with an undecodable frame") from None
        if not isinstance(welcome, Welcome):
            raise LinkRefused(f"expected welcome, got {type(welcome).__name__}")
        link = EdgeLink(self, url, ws, welcome)
        self.links[url] = link
        log.info("linked", edge=url, edge_id=welcome.edge_id)
        try:
            await link.serve()
        finally:
            self.links.pop(url, None)


def _parse_ws_url(url: str) -> tuple[str, int, str, str, bool]:
    parts = urllib.parse.urlsplit(url)
    secure = parts.scheme == "wss"
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if secure else 80)
    host_header = host if port in (80, 443) else f"{host}:{port}"
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return host, port, host_header, resource, secure


__all__ = ["NodeAgent"]
