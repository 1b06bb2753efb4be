"""Throughput and added latency of edge+node, against the same upstream called directly.

    python scripts/bench.py [--concurrency 200] [--tokens 200] [--ttft-requests 300]

Starts an upstream (scripts/upstream.py), an edge and a node as separate
processes on loopback; the client is this process (trio + httpx). Prints:
- time to first content chunk at concurrency 1, direct and through the edge
  (p50/p90/p99), and the added p50;
- aggregate streamed chunks/s at --concurrency with --tokens-chunk streams,
  direct and through the edge, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import trio  # noqa: E402

from scripts.stack import Stack  # noqa: E402

MESSAGES = [{"role": "user", "content": "bench"}]


async def stream_one(client: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first content chunk, content chunks received)."""
    body = {"model": model, "messages": MESSAGES, "stream": True, "max_tokens": max_tokens}
    start = time.perf_counter()
    first = 0.0
    chunks = 0
    tail = b""
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for raw in r.aiter_raw():
            data = tail + raw
            n = data.count(b'"content":')
            if n and not first:
                first = time.perf_counter() - start
            chunks += n
            tail = data[-12:]
            chunks -= tail.count(b'"content":')  # counted again with the next read
    chunks += tail.count(b'"content":')
    return first, chunks


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def ttft(direct_url: str, edge_url: str, model: str, n: int) -> tuple[list[float], list[float]]:
    """Time to first content chunk, direct and through the edge, alternating
    request by request so that both see the same machine load."""
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(100):  # warm up connections and code paths on both sides
            await stream_one(client, direct_url, model, 1)
            await stream_one(client, edge_url, model, 1)
        direct, edge = [], []
        for _ in range(n):
            first, _ = await stream_one(client, direct_url, model, 4)
            direct.append(first * 1000)
            first, _ = await stream_one(client, edge_url, model, 4)
            edge.append(first * 1000)
        return direct, edge


async def throughput(url: str, model: str, concurrency: int, tokens: int) -> tuple[float, int]:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async with trio.open_nursery() as nursery:  # warm up
            for _ in range(min(concurrency, 50)):
                nursery.start_soon(stream_one, client, url, model, 4)
        total = 0

        async def one() -> None:
            nonlocal total
            _, chunks = await stream_one(client, url, model, tokens)
            total += chunks

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(one)
        elapsed = time.perf_counter() - start
    return total / elapsed, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--ttft-requests", type=int, default=300)
    args = parser.parse_args()

    with Stack() as stack:
        upstream = stack.upstream()
        edge = stack.edge(max_queue=1000)
        stack.node(
            edge,
            [
                {
                    "name": "bench",
                    "adapter": "openai",
                    "target": "bench",
                    "base_url": upstream,
                    "max_concurrency": args.concurrency + 16,
                }
            ],
        )
        direct_url = upstream + "/chat/completions"
        edge_url = edge + "/v1/chat/completions"

        direct_ttft, edge_ttft = trio.run(ttft, direct_url, edge_url, "bench", args.ttft_requests)
        direct_rate, direct_total = trio.run(throughput, direct_url, "bench", args.concurrency, args.tokens)
        edge_rate, edge_total = trio.run(throughput, edge_url, "bench", args.concurrency, args.tokens)

    expected = args.concurrency * args.tokens
    print(f"\nTime to first content chunk, concurrency 1, {args.ttft_requests} requests (ms)")
    print(f"{'path':<12}{'p50':>8}{'p90':>8}{'p99':>8}")
    for name, values in (("direct", direct_ttft), ("edge+node", edge_ttft)):
        print(f"{name:<12}{pct(values, 50):>8.2f}{pct(values, 90):>8.2f}{pct(values, 99):>8.2f}")
    print(f"added p50: {statistics.median(edge_ttft) - statistics.median(direct_ttft):.2f} ms")
    print(f"\nStreamed chunks/s, concurrency {args.concurrency}, {args.tokens}-chunk streams")
    print(f"{'path':<12}{'chunks/s':>10}{'chunks':>10}")
    print(f"{'direct':<12}{direct_rate:>10.0f}{direct_total:>10}")
    print(f"{'edge+node':<12}{edge_rate:>10.0f}{edge_total:>10}")
    print(f"ratio edge/direct: {edge_rate / direct_rate:.2f}")
    if direct_total != expected or edge_total != expected:
        print(f"WARNING: expected {expected} chunks per path", file=sys.stderr)


if __name__ == "__main__":
    main()
