"""Time from a client disconnect to the upstream seeing its request aborted, per phase.

    python scripts/cancel_probe.py [--rounds 50]
    python scripts/cancel_probe.py --edge http://127.0.0.1:8080 --upstream-port 8011

By default it starts an edge and a node as separate processes; the OpenAI-
compatible upstream runs inside this process, so the disconnect and the
abort are timed on one clock. With --edge, point a node of that edge at
``http://127.0.0.1:<upstream-port>/v1`` with models ``probe-hang``,
``probe-drip`` (targets of the same names) and ``probe-q`` (target
``probe-hang``, max_concurrency 1).

Phases:
  queued        waiting for a node slot; measured until the edge's queue is
                empty again (polling /v1/admin/runs, or /metrics of an edge
                given with --edge), since no upstream request exists
  first-token   streamed, the model has produced nothing yet (the stream
                committed at its first keep-alive: the edge this probe
                starts has keepalive_s = 0.2; an edge given with --edge,
                its own, each round waiting that long)
  mid-stream    streamed, after 5 content chunks
  non-stream    a stream=false request
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import trio  # noqa: E402

from scripts.stack import Stack  # noqa: E402
from scripts.upstream import Upstream, words  # noqa: E402

MESSAGES = [{"role": "user", "content": "probe"}]
BOUND = 30


def drip(body):
    return [step for t in words(100000) for step in (("chunk", {"content": t}), ("sleep", 0.01))]


async def phase_stream(edge: str, up: Upstream, model: str, after_chunks: int) -> float:
    """Stream; once the upstream has the request and `after_chunks` content
    chunks arrived, close the connection. Returns disconnect -> abort in ms."""
    n = len(up.records)
    body = {"model": model, "messages": MESSAGES, "stream": True}
    async with (
        httpx.AsyncClient(timeout=BOUND) as client,
        client.stream("POST", edge + "/v1/chat/completions", json=body) as r,
    ):
        seen = 0
        with trio.CancelScope() as reading:
            async for line in r.aiter_lines():
                if '"content"' in line:
                    seen += 1
                if line.startswith("data: {") and seen >= after_chunks:
                    await up.wait_requests(n + 1)
                    t0 = time.perf_counter()
                    reading.cancel()  # cancelling the read closes the connection
    rec = up.records[n]
    await rec.finished.wait()
    if not rec.aborted:
        raise RuntimeError("upstream request was not aborted")
    return (rec.aborted_at - t0) * 1000


async def phase_non_stream(edge: str, up: Upstream) -> float:
    n = len(up.records)
    async with trio.open_nursery() as nursery:

        async def client():
            async with httpx.AsyncClient(timeout=BOUND) as c:
                await c.post(edge + "/v1/chat/completions", json={"model": "probe-hang", "messages": MESSAGES})

        nursery.start_soon(client)
        await up.wait_requests(n + 1)
        t0 = time.perf_counter()
        nursery.cancel_scope.cancel()
    rec = up.records[n]
    await rec.finished.wait()
    if not rec.aborted:
        raise RuntimeError("upstream request was not aborted")
    return (rec.aborted_at - t0) * 1000


ADMIN = "probe-admin"  # the admin key of the edge the probe starts


async def queue_depth(client: httpx.AsyncClient, edge: str) -> float:
    """Requests waiting in the edge's queue: from /v1/admin/runs when the
    probe started the edge (a small answer), else from /metrics (a whole
    scrape, a few ms, which then counts in the measured time)."""
    r = await client.get(edge + "/v1/admin/runs", headers={"Authorization": f"Bearer {ADMIN}"})
    if r.status_code == 200:
        return float(r.json()["phases"]["queued"])
    text = (await client.get(edge + "/metrics")).text
    for line in text.splitlines():
        if line.startswith("iop_queue_depth "):
            return float(line.split()[1])
    raise RuntimeError("no iop_queue_depth in /metrics")


async def phase_queued(edge: str, up: Upstream) -> float:
    async with httpx.AsyncClient(timeout=BOUND) as metrics, trio.open_nursery() as nursery:
        n = len(up.records)

        async def holder():  # takes the only slot of probe-q
            async with httpx.AsyncClient(timeout=BOUND) as c:
                await c.post(edge + "/v1/chat/completions", json={"model": "probe-q", "messages": MESSAGES})

        nursery.start_soon(holder)
        await up.wait_requests(n + 1)
        waiting = trio.CancelScope()

        async def queued():
            with waiting:
                async with httpx.AsyncClient(timeout=BOUND) as c:
                    await c.post(edge + "/v1/chat/completions", json={"model": "probe-q", "messages": MESSAGES})

        nursery.start_soon(queued)
        while await queue_depth(metrics, edge) < 1:
            await trio.sleep(0.002)
        t0 = time.perf_counter()
        waiting.cancel()
        while await queue_depth(metrics, edge) > 0:
            pass
        elapsed = (time.perf_counter() - t0) * 1000
        nursery.cancel_scope.cancel()
    await up.records[n].finished.wait()
    return elapsed


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def probe(edge: str | None, upstream_port: int, rounds: int) -> dict[str, list[float]]:
    up = Upstream()
    up.script_for("probe-hang", [("hang",)])
    up.script_for("probe-drip", drip)
    results: dict[str, list[float]] = {"queued": [], "first-token": [], "mid-stream": [], "non-stream": []}
    async with trio.open_nursery() as nursery:
        await nursery.start(up.serve, upstream_port)
        with Stack() as stack:
            if edge is None:
                # keepalive_s: a stream before its first token commits (and the probe can leave it)
                # at its first keep-alive; at the default 10 s, 50 rounds took 9 minutes.
                edge = await trio.to_thread.run_sync(partial(stack.edge, admin_keys=[ADMIN], keepalive_s=0.2))
                base = up.base_url
                models = [
                    {
                        "name": "probe-hang",
                        "adapter": "openai",
                        "target": "probe-hang",
                        "base_url": base,
                        "max_concurrency": 8,
                    },
                    {
                        "name": "probe-drip",
                        "adapter": "openai",
                        "target": "probe-drip",
                        "base_url": base,
                        "max_concurrency": 8,
                    },
                    {
                        "name": "probe-q",
                        "adapter": "openai",
                        "target": "probe-hang",
                        "base_url": base,
                        "max_concurrency": 1,
                    },
                ]
                await trio.to_thread.run_sync(stack.node, edge, models)
            with trio.fail_after(rounds * 4 * BOUND):
                for done in range(1, rounds + 1):
                    results["queued"].append(await phase_queued(edge, up))
                    results["first-token"].append(await phase_stream(edge, up, "probe-hang", 0))
                    results["mid-stream"].append(await phase_stream(edge, up, "probe-drip", 5))
                    results["non-stream"].append(await phase_non_stream(edge, up))
                    print(f"\rround {done}/{rounds}", end="", file=sys.stderr, flush=True)
        nursery.cancel_scope.cancel()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--edge", default=None, help="a running edge (default: start one)")
    parser.add_argument("--upstream-port", type=int, default=0)
    args = parser.parse_args()
    results = trio.run(probe, args.edge, args.upstream_port, args.rounds)
    print(f"\nClient disconnect -> upstream sees the abort, {args.rounds} rounds per phase (ms)")
    print(f"{'phase':<14}{'p50':>8}{'p99':>8}{'max':>8}")
    for phase, values in results.items():
        print(f"{phase:<14}{pct(values, 50):>8.2f}{pct(values, 99):>8.2f}{max(values):>8.2f}")
    print("(queued: until the edge's queue is empty; the upstream never saw those requests)")


if __name__ == "__main__":
    main()
