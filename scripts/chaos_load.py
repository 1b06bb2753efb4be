"""Chaos under load (issue 9): scenarios that need many streams at once.

  poison-request    a poison request (an integer >= 2**64, and a body of floats that outgrows a frame)
                    every second into steady load on two nodes: each is a 4xx, no stream is lost,
                    no link drops
  kill-one-of-two   SIGKILL one of two nodes while 2,400 runs wait for their first token: every
                    run that had not started completes on the other node
  ramp-5000         ramp to 5,000 concurrent streams through the openai adapter: no link closed,
                    new requests still answered quickly (p99 reported)

Each starts its own edge and nodes (scripts/stack.py) against the chaos run's
in-process upstream, and is bounded in time and count.
"""

from __future__ import annotations

import math
import signal
import sys
import time

import httpx
import trio

from scripts.stack import Stack
from scripts.upstream import Upstream, text_script, words

MESSAGES = [{"role": "user", "content": "chaos"}]
UNBOUNDED = httpx.Limits(max_connections=None, max_keepalive_connections=None)


def openai_model(up: Upstream, target: str, capacity: int) -> dict:
    return {"name": "m", "adapter": "openai", "target": target, "base_url": up.base_url, "max_concurrency": capacity}


async def nodes_linked(client: httpx.AsyncClient) -> dict[str, float]:
    """node id -> seconds linked (a relink shows as a smaller number)."""
    return {n["id"]: n["linked_for_s"] for n in (await client.get("/v1/nodes")).json()["data"]}


class Streams:
    """Counts what many SSE streams ended with."""

    def __init__(self) -> None:
        self.started = 0
        self.first_token = 0
        self.done = 0
        self.errors: list[str] = []
        self.cut = 0  # of the errors, those after the stream's first token (e.g. its node died under it)
        self.open = 0

    async def one(self, client: httpx.AsyncClient, body: dict) -> None:
        self.started += 1
        self.open += 1
        got_token = False
        try:
            async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    self.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:120]!r}")
                    return
                async for line in r.aiter_lines():
                    if not got_token and '"content"' in line:
                        got_token = True
                        self.first_token += 1
                    elif line.startswith('data: {"error"'):
                        self.errors.append(line[:160])
                        self.cut += got_token
                    elif line == "data: [DONE]":
                        if got_token:
                            self.done += 1
                        return
            self.errors.append("stream ended without [DONE]")
        except httpx.HTTPError as e:
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self.open -= 1

    async def raw(self, host: str, port: int, request: bytes) -> None:
        """Like :meth:`one`, over a bare socket: the ramp's 5,000 streams then
        cost this process (on the same 2 cores as the edge) little more than
        the reads (httpx and its line splitting took 100-200 ms scheduler
        batches here). Markers are found in the raw chunked bytes; the tail
        of each read is kept, so one split across reads is still found."""
        self.started += 1
        self.open += 1
        got_token = False
        try:
            async with await trio.open_tcp_stream(host, port) as sock:
                await sock.send_all(request)
                seen = b""
                while True:
                    data = await sock.receive_some(65536)
                    if not data:
                        self.errors.append("stream ended without [DONE]")
                        return
                    if not seen and not data.startswith(b"HTTP/1.1 200"):
                        self.errors.append(data[:120].decode(errors="replace"))
                        return
                    seen = seen[-32:] + data
                    if not got_token and b'"content"' in seen:
                        got_token = True
                        self.first_token += 1
                    if b'data: {"error"' in seen:
                        self.errors.append(seen[seen.index(b'data: {"error"') :][:160].decode(errors="replace"))
                        self.cut += got_token
                        return
                    if b"data: [DONE]" in seen:
                        self.done += got_token
                        return
        except OSError as e:
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self.open -= 1


def summary(errors: list[str]) -> str:
    kinds: dict[str, int] = {}
    for e in errors:
        kinds[e[:60]] = kinds.get(e[:60], 0) + 1
    return "; ".join(f"{n}x {k}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:3])


PROBES = 300  # new requests while the streams are held: p99 is then the 297th, not one probe's luck
_PROBE = """
import sys, time, httpx
with httpx.Client(base_url=sys.argv[1], timeout=30) as client:
    for _ in range(int(sys.argv[2])):
        t = time.perf_counter()
        r = client.post("/v1/chat/completions", json={"model": "probe", "messages": [{"role": "user", "content": "p"}], "max_tokens": 1})
        print(f"{r.status_code}:{(time.perf_counter() - t) * 1000:.2f}:{time.time():.3f}", flush=True)
        t = time.perf_counter()
        r = client.get("/healthz")
        print(f"healthz:{(time.perf_counter() - t) * 1000:.2f}", flush=True)
        time.sleep(0.02)
"""


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least ``q`` of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


async def poison_request(stack: Stack, up: Upstream) -> tuple[bool, str]:
    up.script_for("poison-t", lambda body: text_script(words(30), interval=0.02))
    edge = await trio.to_thread.run_sync(lambda: stack.edge(ping_interval_s=0.5, ping_misses=3))
    for node_id in ("p-a", "p-b"):
        await trio.to_thread.run_sync(lambda n=node_id: stack.node(edge, [openai_model(up, "poison-t", 64)], n))
    streams = Streams()
    poison_status: list[int] = []
    floats = [0.5] * 2_000_000  # ~8 MB of JSON, ~18 MB once msgpack-encoded: over the 16 MiB frame limit
    async with httpx.AsyncClient(base_url=edge, timeout=60, limits=UNBOUNDED) as client:
        before = await nodes_linked(client)
        stop = trio.Event()

        async def load() -> None:
            while not stop.is_set():
                await streams.one(client, {"model": "m", "messages": MESSAGES})

        async def poison() -> None:
            for i in range(10):
                body = {"model": "m", "messages": MESSAGES, "seed": 2**64}
                if i % 2:
                    body = {"model": "m", "messages": MESSAGES, "numbers": floats}
                poison_status.append((await client.post("/v1/chat/completions", json=body)).status_code)
                await trio.sleep(1)
            stop.set()

        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(load)
            nursery.start_soon(poison)
        after = await nodes_linked(client)
    relinked = [n for n in before if n not in after or after[n] < before[n]]
    ok = all(400 <= s < 500 for s in poison_status) and not streams.errors and not relinked and streams.done > 0
    return ok, (
        f"poison answers {sorted(set(poison_status))} x{len(poison_status)}; {streams.done} streams completed, "
        f"{len(streams.errors)} lost {summary(streams.errors)}; links dropped: {len(relinked)}"
    )


async def kill_one_of_two(stack: Stack, up: Upstream, per_node: int = 1200) -> tuple[bool, str]:
    # Every run waits 3 s for its first token, then streams 5 tokens.
    up.script_for("storm-t", lambda body: text_script(words(5), ttft=3.0, interval=0.01))
    edge = await trio.to_thread.run_sync(lambda: stack.edge(max_node_concurrency=per_node, max_queue=0))
    procs = {}
    for node_id in ("s-a", "s-b"):
        procs[node_id] = await trio.to_thread.run_sync(
            lambda n=node_id: stack.node(edge, [openai_model(up, "storm-t", per_node)], n)
        )
    streams = Streams()
    total = 2 * per_node
    base = len(up.records)
    async with httpx.AsyncClient(base_url=edge, timeout=120, limits=UNBOUNDED) as client:
        async with trio.open_nursery() as nursery:
            for i in range(total):
                nursery.start_soon(streams.one, client, {"model": "m", "messages": MESSAGES})
                if i % 100 == 99:
                    await trio.sleep(0.05)
            with trio.fail_after(60):
                while len(up.records) - base < total:
                    await trio.sleep(0.05)
            waiting = total - streams.first_token
            procs["s-a"].send_signal(signal.SIGKILL)
            killed_at = time.perf_counter()
        took = time.perf_counter() - killed_at
        linked = await nodes_linked(client)
    # A stream that had started on s-a is cut (an error after its first token): only those may fail.
    started = total - waiting
    unstarted_lost = len(streams.errors) - streams.cut
    ok = streams.done == total and not unstarted_lost and streams.cut <= started and "s-b" in linked
    return ok, (
        f"{waiting} runs waiting for a first token when node s-a was killed; {streams.done}/{total} completed "
        f"({took:.1f} s after the kill); {unstarted_lost} lost that had not started; "
        f"{streams.cut} of the {started} started before the kill cut by it {summary(streams.errors)}"
    )


async def ramp_5000(stack: Stack, up: Upstream, total: int = 5000) -> tuple[bool, str]:
    # The model servers are processes of their own here (this process holds the
    # 5,000 clients): held streams get a token every 2 s for 60 s (so all are held
    # while the probes run), probes one token at once.
    held_up = await trio.to_thread.run_sync(lambda: stack.upstream(interval_ms=2000))
    probe_up = await trio.to_thread.run_sync(lambda: stack.upstream())
    edge = await trio.to_thread.run_sync(lambda: stack.edge(max_node_concurrency=8192, max_queue=0))
    models = [
        {"name": "m", "adapter": "openai", "target": "held", "base_url": held_up, "max_concurrency": total + 500},
        {"name": "probe", "adapter": "openai", "target": "probe", "base_url": probe_up, "max_concurrency": 64},
    ]
    await trio.to_thread.run_sync(lambda: stack.node(edge, models, "r-a"))
    streams = Streams()
    latencies: list[float] = []
    health: list[float] = []  # the edge alone (/healthz), to tell its delay from the node's
    host, port = edge.removeprefix("http://").rsplit(":", 1)
    body = b'{"model":"m","messages":[{"role":"user","content":"chaos"}],"max_tokens":30,"stream":true}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (
            host.encode(),
            len(body),
            body,
        )
    )
    async with httpx.AsyncClient(base_url=edge, timeout=30) as client:
        before = await nodes_linked(client)
        async with trio.open_nursery() as nursery:
            t0 = time.perf_counter()
            for i in range(total):
                nursery.start_soon(streams.raw, host, int(port), request)
                if i % 50 == 49:
                    await trio.sleep(0.05)  # ~1,000 new streams a second
            with trio.fail_after(90):
                while streams.first_token + len(streams.errors) < total:
                    await trio.sleep(0.1)
            ramp = time.perf_counter() - t0
            held = streams.open
            # Probes from a process of their own, so this busy one does not delay them.
            probe = await trio.run_process(
                [sys.executable, "-c", _PROBE, edge, str(PROBES)], capture_stdout=True, check=False
            )
            for line in probe.stdout.decode().split():
                status, ms = line.split(":")[:2]
                if status == "healthz":
                    health.append(float(ms))
                    continue
                latencies.append(float(ms))
                if status != "200":
                    streams.errors.append(f"probe HTTP {status}")
        after = await nodes_linked(client)
    relinked = [n for n in before if n not in after or after[n] < before[n]]
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    ok = streams.done == total and not streams.errors and not relinked and p99 < 100
    return ok, (
        f"{held} streams held after a {ramp:.1f} s ramp; {streams.done}/{total} completed, "
        f"{len(streams.errors)} lost {summary(streams.errors)}; links dropped: {len(relinked)}; "
        f"new requests meanwhile p50 {p50:.1f} ms, p99 {p99:.1f} ms ({sum(v > 100 for v in latencies)} over 100 ms); /healthz p99 {percentile(health, 0.99):.1f} ms"
    )


LOAD_SCENARIOS = {
    "poison-request": poison_request,
    "kill-one-of-two": kill_one_of_two,
    "ramp-5000": ramp_5000,
}
