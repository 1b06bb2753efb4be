"""Chaos on loopback: kill, freeze and restart parts under load; check nothing leaks.

    python scripts/chaos.py [--requests 2000] [--only NAME[,NAME...]]

Every scenario is bounded in time and count and prints one row of a pass/fail
table. The upstream runs inside this process (so its count of open requests
is exact); the edge and the node are separate processes.

  kill-node       SIGKILL the node mid-stream: every client gets "node disconnected"
  freeze-node     SIGSTOP the node: the edge fails its runs within the ping timeout
  restart-edge    SIGKILL and restart the edge under load: the node relinks, requests succeed
  abort-clients   --requests requests, 30% of clients abort at random points: in-flight
                  counts return to zero on both sides, and the edge's memory does not grow
  oversized-frame a fake node declares a 2^40-byte frame, then sends endless 1 MiB fragments:
                  the edge cuts the link at its frame limit, its RSS stays flat, /healthz answers
  sigstop-edge    SIGSTOP the edge during 20 fast streams: the node closes every upstream request
                  within its ping timeout, though its sends are stuck
  oversized-batch 4 streams of 32 KiB deltas: the node's frames stay under the frame limit, every
                  stream completes whole and the link never drops
  poison-request, kill-one-of-two, ramp-5000: see scripts/chaos_load.py
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import trio  # noqa: E402

from iop import gc_policy  # noqa: E402
from scripts.chaos_load import LOAD_SCENARIOS  # noqa: E402
from scripts.hostile_link import endless_fragments, flood, huge_frame, open_link  # noqa: E402
from scripts.stack import TOKEN, Stack, free_port, wait_linked  # noqa: E402
from scripts.upstream import Upstream, text_script, words  # noqa: E402

MESSAGES = [{"role": "user", "content": "chaos"}]
PING_S = 0.5
MISSES = 3


def drip(body):
    n = int(body.get("max_tokens") or 400)
    return text_script(words(n), interval=0.01)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def metric(client: httpx.AsyncClient, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError(f"{name} not in /metrics")


async def stream_errors(edge: str, n: int, on_streaming) -> tuple[list[str], float]:
    """Start n streams; once all have content, call on_streaming(); return each stream's error and the time to the last."""
    errors: list[str] = []
    started = 0
    all_started = trio.Event()
    t_fault = 0.0
    t_last = 0.0

    async def one(client):
        nonlocal started, t_last
        async with client.stream(
            "POST", "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True}
        ) as r:
            counted = False
            async for line in r.aiter_lines():
                if not counted and '"content"' in line:
                    counted = True
                    started += 1
                    if started == n:
                        all_started.set()
                if line.startswith('data: {"error"'):
                    errors.append(line)
                    t_last = time.perf_counter()

    async with httpx.AsyncClient(base_url=edge, timeout=60, limits=httpx.Limits(max_connections=n + 4)) as client:
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one, client)
            await all_started.wait()
            t_fault = time.perf_counter()
            on_streaming()
    return errors, t_last - t_fault


async def kill_node(stack: Stack, up: Upstream, edge: str, node) -> tuple[bool, str]:
    errors, took = await stream_errors(edge, 10, lambda: node.send_signal(signal.SIGKILL))
    with trio.move_on_after(5):
        while up.active:
            await trio.sleep(0.01)
    ok = len(errors) == 10 and all("node disconnected" in e for e in errors) and up.active == 0
    return ok, f"{len(errors)}/10 got 'node disconnected' in {took * 1000:.0f} ms; upstream open requests {up.active}"


async def freeze_node(stack: Stack, up: Upstream, edge: str, node) -> tuple[bool, str]:
    errors, took = await stream_errors(edge, 10, lambda: node.send_signal(signal.SIGSTOP))
    node.send_signal(signal.SIGCONT)
    limit = PING_S * (MISSES + 1) + 0.5
    ok = len(errors) == 10 and all("node disconnected" in e for e in errors) and took <= limit
    return ok, f"{len(errors)}/10 failed after {took:.2f} s (ping timeout {PING_S * MISSES:.1f} s, limit {limit:.1f} s)"


async def restart_edge(stack: Stack, up: Upstream, edge: str, port: int, node_id: str) -> tuple[bool, str]:
    ok_before = ok_after = failed = 0

    async def load(client, stop: trio.Event):
        nonlocal ok_before, failed
        while not stop.is_set():
            try:
                r = await client.post(
                    "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 5}
                )
                ok_before += r.status_code == 200
            except httpx.HTTPError:
                failed += 1
                await trio.sleep(0.01)

    stop = trio.Event()
    async with httpx.AsyncClient(base_url=edge, timeout=10) as client, trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(load, client, stop)
        await trio.sleep(1.0)
        stack.edge_proc.send_signal(signal.SIGKILL)
        stack.edge_proc.wait()
        await trio.sleep(0.3)
        t0 = time.perf_counter()
        await trio.to_thread.run_sync(lambda: stack.edge(port=port, ping_interval_s=PING_S, ping_misses=MISSES))
        await trio.to_thread.run_sync(wait_linked, edge, node_id)
        relink = time.perf_counter() - t0
        stop.set()
    async with httpx.AsyncClient(base_url=edge, timeout=10) as client:
        for _ in range(20):
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 5})
            ok_after += r.status_code == 200
    ok = ok_after == 20 and ok_before > 0
    return (
        ok,
        f"relinked {relink:.2f} s after restart; {ok_before} ok under load, {failed} cut by the kill, {ok_after}/20 ok after",
    )


async def abort_clients(stack: Stack, up: Upstream, edge: str, requests: int) -> tuple[bool, str]:
    rng = random.Random(7)
    done = aborted = bad = 0

    async def one(client, abort_after: float | None):
        nonlocal done, aborted, bad
        body = {"model": "m", "messages": MESSAGES, "stream": rng.random() < 0.7, "max_tokens": rng.randint(1, 40)}
        with trio.move_on_after(abort_after if abort_after is not None else 60) as scope:
            r = await client.post("/v1/chat/completions", json=body)
            done += 1
            if r.status_code != 200:
                bad += 1
                print("bad:", r.status_code, r.text[:200], file=sys.stderr)
        aborted += scope.cancelled_caught

    async def batch(n: int):
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=edge, timeout=60, limits=limits) as client:
            sem = trio.Semaphore(50)

            async def guarded(abort_after):
                async with sem:
                    await one(client, abort_after)

            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(guarded, rng.uniform(0, 0.3) if rng.random() < 0.3 else None)

    await batch(200)  # warm up before the memory baseline
    pid = stack.edge_proc.pid
    before = rss_kb(pid)
    await batch(requests)
    async with httpx.AsyncClient(base_url=edge, timeout=10) as client:
        with trio.move_on_after(10):
            while await metric(client, "iop_runs_in_flight") or up.active:
                await trio.sleep(0.02)
        edge_in_flight = await metric(client, "iop_runs_in_flight")
        nodes = (await client.get("/v1/nodes")).json()["data"]
    node_in_flight = sum(n["in_flight"] for n in nodes)
    growth = (rss_kb(pid) - before) / 1024
    ok = edge_in_flight == 0 and node_in_flight == 0 and up.active == 0 and bad == 0 and growth < 30
    return ok, (
        f"{done} completed, {aborted} aborted, {bad} bad; in flight after: edge {edge_in_flight:.0f}, "
        f"node slots {node_in_flight}, upstream {up.active}; edge RSS +{growth:.1f} MiB"
    )


# name -> async (stack, upstream) -> (ok, detail); each starts its own edge and nodes.
STANDALONE: dict[str, Callable[[Stack, Upstream], Awaitable[tuple[bool, str]]]] = {}
STANDALONE.update(LOAD_SCENARIOS)  # poison-request, kill-one-of-two, ramp-5000 (scripts/chaos_load.py)


async def oversized_frame(stack: Stack, up: Upstream) -> tuple[bool, str]:
    """Two hostile shapes from a node with a valid token, each bounded at 15 s (the default
    ping timeout) and 1 GiB; the edge (default max_frame_bytes) must cut both early."""
    edge = await trio.to_thread.run_sync(stack.edge)
    port, pid = int(edge.rsplit(":", 1)[1]), stack.edge_proc.pid
    before = peak = rss_kb(pid)
    zeros = bytes(1 << 20)
    cuts: list[str] = []
    all_cut = True
    for i, (shape, chunks) in enumerate((("2^40 header", huge_frame(zeros)), ("fragments", endless_fragments(zeros)))):
        stream, frames = await open_link(port, TOKEN, node_id=f"oversized-{i}")
        async with stream, trio.open_nursery() as nursery:

            async def sample():
                nonlocal peak
                while True:
                    peak = max(peak, rss_kb(pid))
                    await trio.sleep(0.05)

            nursery.start_soon(sample)
            t0 = time.perf_counter()
            result = None
            with trio.move_on_after(15):
                result = await flood(stream, frames, chunks, 1 << 30)
            took = time.perf_counter() - t0
            nursery.cancel_scope.cancel()
        cut = result is not None and result.cut
        all_cut &= cut
        sent = f"{result.sent:,} bytes" if result else "15 s of data"
        code = result.close_code if result else None
        cuts.append(f"{shape}: {'cut' if cut else 'NOT cut'} after {sent} in {took:.2f} s (close {code})")
    peak = max(peak, rss_kb(pid))
    async with httpx.AsyncClient(base_url=edge, timeout=5) as client:
        healthy = (await client.get("/healthz")).status_code == 200
    growth = (peak - before) / 1024
    ok = all_cut and healthy and growth < 64
    rss = f"edge RSS {before / 1024:.0f} -> peak {peak / 1024:.0f} MiB (+{growth:.0f})"
    return ok, f"{'; '.join(cuts)}; {rss}; healthz {'ok' if healthy else 'FAILED'}"


STANDALONE["oversized-frame"] = oversized_frame


def endless_kib(body):
    """1 KiB deltas with no pause, far more than any scenario waits for."""
    return [("chunk", {"content": "x" * 1024})] * 200_000 + [("chunk", {}, "stop"), ("done",)]


async def sigstop_edge(stack: Stack, _: Upstream) -> tuple[bool, str]:
    """SIGSTOP the edge during 20 fast streams: the node's sends back up at once, yet its
    watchdog must declare the link dead within the ping timeout and close every upstream request."""
    n = 20
    up = Upstream(endless_kib)  # its own: `active` counts this scenario's requests only
    async with trio.open_nursery() as nursery:
        await nursery.start(up.serve, 0)
        edge = await trio.to_thread.run_sync(lambda: stack.edge(ping_interval_s=PING_S, ping_misses=MISSES))
        models = [{"name": "m", "adapter": "openai", "target": "m", "base_url": up.base_url, "max_concurrency": 64}]
        await trio.to_thread.run_sync(
            lambda: stack.node(edge, models, node_id="sigstop", ping_misses=MISSES, reconnect_min_s=0.1)
        )
        limit = PING_S * MISSES + 1.0  # the node's ping timeout, plus frames already on their way
        streaming = 0
        all_streaming = trio.Event()

        async def one(client):
            nonlocal streaming
            body = {"model": "m", "messages": MESSAGES, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                counted = False
                async for line in r.aiter_lines():
                    if not counted and '"content"' in line:
                        counted = True
                        streaming += 1
                        if streaming == n:
                            all_streaming.set()

        async with httpx.AsyncClient(base_url=edge, timeout=60, limits=httpx.Limits(max_connections=n + 4)) as client:
            async with trio.open_nursery() as clients:
                for _ in range(n):
                    clients.start_soon(one, client)
                with trio.fail_after(20):
                    await all_streaming.wait()
                await trio.sleep(1.0)  # full flow
                open_before = up.active
                stack.edge_proc.send_signal(signal.SIGSTOP)
                t0 = time.perf_counter()
                with trio.move_on_after(4 * limit):  # measured past the limit, then given up
                    while up.active:
                        await trio.sleep(0.005)
                took = time.perf_counter() - t0
                left = up.active
                stack.edge_proc.send_signal(signal.SIGCONT)
                clients.cancel_scope.cancel()
        t1 = time.perf_counter()
        relink = "did NOT relink within 15 s of SIGCONT"
        with trio.move_on_after(15):
            async with httpx.AsyncClient(base_url=edge, timeout=5) as client:
                while True:  # a new link: younger than the time since SIGCONT
                    nodes = (await client.get("/v1/nodes")).json()["data"]
                    since = time.perf_counter() - t1
                    if any(x["id"] == "sigstop" and x["linked_for_s"] < since for x in nodes):
                        relink = f"relinked {since:.2f} s after SIGCONT"
                        break
                    await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    ok = left == 0 and open_before == n and took <= limit and relink.startswith("relinked")
    closed = f"all {open_before} upstream requests closed" if not left else f"{left}/{open_before} still open"
    return (
        ok,
        f"{closed} {took:.2f} s after SIGSTOP (ping timeout {PING_S * MISSES:.1f} s, limit {limit:.1f} s); {relink}",
    )


STANDALONE["sigstop-edge"] = sigstop_edge

BIG_DELTA = "y" * (32 * 1024)


def big_deltas(body):
    return text_script([BIG_DELTA] * int(body.get("max_tokens") or 1))


async def oversized_batch(stack: Stack, _: Upstream) -> tuple[bool, str]:
    """4 clients stream 32 KiB deltas as fast as they can read: the node's batches must stay under
    the frame limit (the edge's and its own), so every stream completes whole on one unbroken link.
    Once with the default 16 MiB limit, once with 1 MiB on both sides (a batch outgrows it at once)."""
    rows = [await _batch_round(stack, frame_bytes) for frame_bytes in (16 << 20, 1 << 20)]
    return all(ok for ok, _ in rows), " | ".join(detail for _, detail in rows)


async def _batch_round(stack: Stack, frame_bytes: int) -> tuple[bool, str]:
    n, deltas = 4, 450  # 14 MiB per stream (a run may bring 16 MiB: edge.runs.run), 56 MiB in all
    up = Upstream(big_deltas)
    async with trio.open_nursery() as nursery:
        await nursery.start(up.serve, 0)
        edge = await trio.to_thread.run_sync(lambda: stack.edge(max_frame_bytes=frame_bytes))
        models = [{"name": "m", "adapter": "openai", "target": "m", "base_url": up.base_url, "max_concurrency": 8}]
        node = await trio.to_thread.run_sync(
            lambda: stack.node(edge, models, node_id="batch", max_frame_bytes=frame_bytes)
        )
        whole: list[bool] = []
        errors: list[str] = []
        linked: list[float | None] = []  # linked_for_s of node "batch" at each look (None: not linked)

        async def one(client):
            body = {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": deltas}
            parts: list[str] = []
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith('data: {"error"'):
                        errors.append(line[:200])
                    elif line.startswith("data: {"):
                        choices = json.loads(line[6:])["choices"]
                        if choices:
                            parts.append(choices[0]["delta"].get("content") or "")
            whole.append("".join(parts) == BIG_DELTA * deltas)

        async def look(client):
            nodes = (await client.get("/v1/nodes")).json()["data"]
            linked.append(next((x["linked_for_s"] for x in nodes if x["id"] == "batch"), None))

        async def watch(client):
            while True:
                await look(client)
                await trio.sleep(0.2)

        t0 = time.perf_counter()
        async with httpx.AsyncClient(base_url=edge, timeout=60) as client, trio.open_nursery() as clients:
            watching = trio.CancelScope()

            async def watched():
                with watching:
                    await watch(client)

            clients.start_soon(watched)
            with trio.fail_after(50):
                async with trio.open_nursery() as streams:
                    for _ in range(n):
                        streams.start_soon(one, client)
            watching.cancel()
            await look(client)  # after the last stream ended: a link lost at the end shows here
        took = time.perf_counter() - t0
        for proc in (node, stack.edge_proc):
            proc.kill()
            await trio.to_thread.run_sync(proc.wait)
        nursery.cancel_scope.cancel()
    ups = [x for x in linked if x is not None]
    never_dropped = len(ups) == len(linked) > 1 and all(a < b for a, b in zip(ups, ups[1:], strict=False))
    ok = sum(whole) == n and not errors and never_dropped
    mib = n * deltas * len(BIG_DELTA) / 2**20
    link = f"link up throughout ({ups[0]:.1f} -> {ups[-1]:.1f} s)" if never_dropped else f"link DROPPED: {linked}"
    return ok, (
        f"limit {frame_bytes / 2**20:g} MiB: {sum(whole)}/{n} streams whole ({mib:.0f} MiB of 32 KiB deltas "
        f"in {took:.1f} s); {link}; {len(errors)} errors {errors[:1]}"
    )


STANDALONE["oversized-batch"] = oversized_batch


async def main(requests: int, only: list[str] | None) -> int:
    up = Upstream(drip)
    rows: list[tuple[str, bool, str]] = []
    gc_policy.tune()  # this process holds thousands of clients: no multi-second full collections
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gc_policy.collect, trio.Event())
        await nursery.start(up.serve, 0)
        models = [{"name": "m", "adapter": "openai", "target": "m", "base_url": up.base_url, "max_concurrency": 64}]
        fast = {"reconnect_min_s": 0.1, "reconnect_max_s": 1.0}
        with Stack() as stack:
            port = free_port()
            edge = await trio.to_thread.run_sync(
                lambda: stack.edge(port=port, ping_interval_s=PING_S, ping_misses=MISSES)
            )
            scenarios = ["kill-node", "freeze-node", "restart-edge", "abort-clients"]
            for i, name in enumerate(scenarios):
                if only and name not in only:
                    continue
                node_id = f"chaos-{i}"
                node = await trio.to_thread.run_sync(
                    lambda node_id=node_id: stack.node(edge, models, node_id=node_id, **fast)
                )
                try:
                    with trio.fail_after(120):
                        if name == "kill-node":
                            ok, detail = await kill_node(stack, up, edge, node)
                        elif name == "freeze-node":
                            ok, detail = await freeze_node(stack, up, edge, node)
                        elif name == "restart-edge":
                            ok, detail = await restart_edge(stack, up, edge, port, node_id)
                        else:
                            ok, detail = await abort_clients(stack, up, edge, requests)
                except trio.TooSlowError:
                    ok, detail = False, "timed out after 120 s"
                rows.append((name, ok, detail))
                node.kill()
                node.wait()
        # Scenarios that build their own edge and nodes (own configs, their own faults).
        for name, scenario in STANDALONE.items():
            if only and name not in only:
                continue
            gc_policy.tune()  # what earlier scenarios left in this process: frozen, not rescanned under load
            with Stack() as stack:
                try:
                    with trio.fail_after(300):
                        ok, detail = await scenario(stack, up)
                except trio.TooSlowError:
                    ok, detail = False, "timed out after 300 s"
            rows.append((name, ok, detail))
        nursery.cancel_scope.cancel()
    print(f"\n{'scenario':<17}{'result':<8}detail")
    for name, ok, detail in rows:
        print(f"{name:<17}{'PASS' if ok else 'FAIL':<8}{detail}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--only", default=None, help="scenarios to run, comma-separated")
    args = parser.parse_args()
    sys.exit(trio.run(main, args.requests, args.only.split(",") if args.only else None))
