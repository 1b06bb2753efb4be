"""Where the edge's and the node's CPU goes: per request, per token, and the
floor of the HTTP server under the edge.

    python scripts/cost_model.py [--requests 2000] [--concurrency 200]

Three measurements, each from /proc (user and system CPU separately):

1. **The floor.** A bare ASGI app under hypercorn's trio worker (the server
   the edge runs on), answering the same POST with a streamed head, one
   chunk and the end, sequentially over one kept-alive connection: the CPU
   any app on this stack pays per request before doing anything.
2. **The edge and the node per request**, the same client and request shape
   (a 4-token stream, sequential, one connection), against the upstream of
   scripts/upstream.py.
3. **Per stream and per token under load**: --concurrency streams at a time
   of 40 tokens, then of 200, twice each, and the straight line
   CPU = per-stream + per-token x tokens fitted through the two, for the edge
   and the node. With it, the CPU per token of a 200-token stream splits into
   what every request costs and what every token costs. (The fit assumes
   tokens per chunk stay alike across the lengths; it prints them.) And how
   many cores each process used meanwhile: the bench's own client and
   upstream share the machine with the edge and the node.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import trio  # noqa: E402

from scripts import bench  # noqa: E402
from scripts.stack import ROOT, Stack, free_port, wait_http  # noqa: E402

# The floor's app: a chat completion's shape (a JSON body read whole, a
# text/event-stream head, one data chunk, then [DONE] as the end) and nothing else.
_BARE_APP = r"""
import sys, trio
from hypercorn.config import Config
from hypercorn.trio import serve

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"tok0 tok1 tok2 tok3 "}}]}\n\n'

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"] == "/healthz":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

config = Config()
config.bind = [sys.argv[1]]
config.accesslog = None
trio.run(serve, app, config)
"""


async def sequential(url: str, model: str, n: int) -> None:
    async with httpx.AsyncClient(timeout=60, headers=bench.HEADERS) as client:
        for _ in range(n):
            await bench.stream_one(client, url, model, 4)


def per_request(url: str, model: str, pids: list[int], n: int) -> list[tuple[float, float]]:
    """(user, system) µs per request of each of ``pids``, over ``n`` sequential 4-token streams."""
    trio.run(sequential, url, model, min(n, 200))  # warm: connections, code paths, caches
    before = [bench.cpu_split(p) for p in pids]
    trio.run(sequential, url, model, n)
    after = [bench.cpu_split(p) for p in pids]
    return [((a[0] - b[0]) / n * 1e6, (a[1] - b[1]) / n * 1e6) for a, b in zip(after, before, strict=True)]


def floor(n: int) -> tuple[float, float]:
    """(user, system) µs per request of the bare hypercorn app."""
    bind = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", _BARE_APP, bind], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_http(f"http://{bind}/healthz")
        return per_request(f"http://{bind}/v1/chat/completions", "bare", [proc.pid], n)[0]
    finally:
        proc.terminate()
        proc.wait()


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def under_load(url: str, pids: list[int], concurrency: int) -> tuple[dict[int, tuple[list[float], float]], list[float]]:
    """Stream length -> ([edge, node] CPU µs per stream, tokens per chunk);
    and the cores each of ``pids`` and this process (the client) used while
    the 200-token streams ran."""
    trio.run(bench.throughput, url, "bench", concurrency, 200, [], 1)  # warm
    totals: dict[int, list[float]] = {}
    cores = [0.0] * (len(pids) + 1)
    seconds = 0.0
    for _ in range(2):
        for tokens, each in ((40, 5), (200, 1)):
            mine = own_cpu()
            rate, got, spent, chunks = trio.run(bench.throughput, url, "bench", concurrency, tokens, pids, each)
            mine = own_cpu() - mine
            if not got:
                raise SystemExit(f"no tokens came back through {url}: nothing to measure")
            t = totals.setdefault(tokens, [0.0, 0.0, 0.0, 0.0])
            t[0] += spent[0]
            t[1] += spent[1]
            t[2] += got / tokens
            t[3] += chunks
            if tokens == 200:
                seconds += got / rate
                cores = [c + s for c, s in zip(cores, [*spent, mine], strict=True)]
    per_stream = {
        tokens: ([t[0] / t[2] * 1e6, t[1] / t[2] * 1e6], tokens * t[2] / max(t[3], 1)) for tokens, t in totals.items()
    }
    return per_stream, [c / seconds for c in cores]


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=at_least_one, default=2000, help="sequential requests per measurement")
    parser.add_argument("--concurrency", type=at_least_one, default=200)
    args = parser.parse_args()

    bare = floor(args.requests)
    with Stack(ROOT) as stack:
        upstream = stack.upstream()
        edge = stack.edge()
        node = stack.node(
            edge,
            [{"name": "bench", "adapter": "openai", "target": "bench", "base_url": upstream, "max_concurrency": 256}],
        )
        url = edge + "/v1/chat/completions"
        pids = [stack.edge_proc.pid, node.pid]
        seq = per_request(url, "bench", pids, args.requests)
        loaded, cores = under_load(url, [*pids, stack.upstream_proc.pid], args.concurrency)

    print(f"\nCPU per request, sequential 4-token streams, {args.requests} requests (µs, user + system)")
    for name, (user, system) in (("hypercorn, bare ASGI app", bare), ("edge", seq[0]), ("node", seq[1])):
        print(f"  {name:<26}{user + system:>7.0f}  ({user:.0f} + {system:.0f})")

    (short, (short_cpu, short_tpc)), (long, (long_cpu, long_tpc)) = sorted(loaded.items())
    print(f"\nUnder load, {args.concurrency} streams at a time (µs of CPU per stream)")
    print(f"  {'':<26}{f'{short} tokens':>12}{f'{long} tokens':>12}{'per stream':>12}{'per token':>11}{'at 200':>9}")
    fits = []
    for i, name in enumerate(("edge", "node")):
        per_token = (long_cpu[i] - short_cpu[i]) / (long - short)
        per_stream = short_cpu[i] - per_token * short
        fits.append((per_stream, per_token))
        at_200 = per_stream / 200 + per_token
        print(
            f"  {name:<26}{short_cpu[i]:>12.0f}{long_cpu[i]:>12.0f}{per_stream:>12.0f}{per_token:>11.2f}{at_200:>9.1f}"
        )
    print(f"  tokens per chunk: {short_tpc:.1f} at {short} tokens, {long_tpc:.1f} at {long}")
    edge_cores, node_cores, upstream_cores, client_cores = cores
    print(
        f"  cores in use meanwhile (of {os.cpu_count()}): edge {edge_cores:.2f}, node {node_cores:.2f},"
        f" upstream {upstream_cores:.2f}, the client (this process) {client_cores:.2f}"
    )
    print(verdict(fits, bare))


def verdict(fits: list[tuple[float, float]], bare: tuple[float, float]) -> str:
    """The closing line: edge + node CPU per token of a 200-token stream, and
    the per-request share of it, from the (per stream, per token) fits."""
    stream_share = sum(p for p, _ in fits) / 200
    total = stream_share + sum(t for _, t in fits)
    # /proc counts CPU in clock ticks (10 ms): a small run can measure no CPU
    # at all, or a fit below zero. Say so rather than divide by it.
    share = f"{stream_share / total:.0%}" if total > 0 else "too little CPU measured to split; run more requests"
    return (
        f"\nAt 200-token streams, edge + node: {total:.1f} µs per token, of which {stream_share:.1f} is"
        f" per-request work spread over the stream ({share});"
        f" the bare server's floor alone is {sum(bare) / 200:.1f} µs per token there."
    )


if __name__ == "__main__":
    main()
