"""Throughput, CPU per token, added latency and idle-stream memory of edge+node.

    python scripts/bench.py [--concurrency 200] [--tokens 200] [--ttft-requests 300]
                            [--idle-streams 10000] [--baseline REV [--interleave]] [--keys] [--console]
                            [--rounds N] [--streams-each N]

Starts one upstream (scripts/upstream.py) and, for the current checkout (and,
with --baseline, for a git worktree of REV, side by side in the same run), an
edge and a node as separate processes on loopback; the client is this process
(trio + httpx for first content, raw sockets in an epoll loop for the throughput
phase unless --client httpx, raw sockets for the idle streams). Prints, per revision:
- time to first content chunk at concurrency 1, direct and through the edge
  (p50/p90/p99, requests alternating between the two), and the added p50;
- aggregate streamed tokens/s at --concurrency with --tokens-token streams,
  direct and through the edge, and the CPU time the edge and the node each
  spent per streamed token (from /proc, over the measured interval), and the
  kernel's part of it (its system calls);
- with --idle-streams N: N streams that got their first token and then wait,
  the edge's resident memory per stream, and the latency of new requests
  (p50/p99) served while they are open.

With --console, the current code is measured twice more, with admin keys
set: once alone and once with an operator console attached (a process of its
own reading /v1/admin/events for the whole run, as a browser would).

Tokens are counted in the text the client received, so an edge that puts
several tokens in one chunk is measured on what it delivers, not on chunks.
The chunks it sent for them are reported too (chunks/s: the client's
content chunks over the same interval; the direct upstream sends one a token,
so its chunks/s is its tokens/s).

With --rounds N, the whole measurement runs N times, the revisions taking
turns (the baseline first in every other round), each round on fresh
processes; the report gives each figure's median over the rounds and, for CPU
per token and tokens/s, the range. One round's figures vary by about +-25% on
this 2-core machine, and the machine drifts over minutes: the same code
measured as "current" and as a HEAD worktree differed by 7% in edge CPU per
token over 3 rounds, and two 3-round runs of the same comparison ten minutes
apart disagreed on its sign.

With --interleave (and --baseline), both revisions are up at once and
measured in --rounds short slices that take turns (TTFT requests split
between them; each slice one throughput phase), so drift falls on both
alike; the idle streams are measured once each at the end. This is the
comparison to trust: --interleave --rounds 6 --streams-each 2.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import msgspec  # noqa: E402
import trio  # noqa: E402

from scripts.stack import ROOT, Stack, free_port  # noqa: E402

MESSAGES = [{"role": "user", "content": "bench"}]
TOKEN = b"tok"  # every token the bench upstream sends is "tok<i> "
TICKS = os.sysconf("SC_CLK_TCK")


CHUNKS = {"n": 0}  # content chunks received (to report tokens per chunk)
HEADERS: dict[str, str] = {}  # sent with every request (the --keys variant's client key)
BENCH_KEY = {"id": "bench", "key": "sk-bench", "rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6}
BENCH_ADMIN = "sk-bench-admin"
# The --console variant's console: reads the event stream until killed, then says how much it got.
_CONSOLE = """
import signal, sys, httpx
events = [0, 0, 0]
def done(*_):
    print(f"{events[0]} {events[1]} {events[2]}", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
with httpx.stream("GET", sys.argv[1] + "/v1/admin/events", headers={"Authorization": "Bearer " + sys.argv[2]}, timeout=None) as r:
    for line in r.iter_lines():
        if line.startswith("event:"):
            events[0] += 1
        events[1] += len(line) + 1
        events[2] = max(events[2], len(line))
"""


async def stream_one(client: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first content, tokens received)."""
    body = {"model": model, "messages": MESSAGES, "stream": True, "max_tokens": max_tokens}
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    tail = b""
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for raw in r.aiter_raw():
            data = tail + raw
            n = data.count(TOKEN)
            CHUNKS["n"] += raw.count(b'"content":"')
            if n and not first:
                first = time.perf_counter() - start
            tokens += n
            tail = data[-2:]
            tokens -= tail.count(TOKEN)  # counted again with the next read
    tokens += tail.count(TOKEN)
    return first, tokens


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def cpu_split(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def ttft(direct_url: str, edge_url: str, model: str, n: int) -> tuple[list[float], list[float]]:
    """Time to first content, direct and through the edge, alternating request
    by request so that both see the same machine load."""
    async with httpx.AsyncClient(timeout=60, headers=HEADERS) as client:
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


async def throughput(
    url: str, model: str, concurrency: int, tokens: int, pids: list[int], each: int = 1
) -> tuple[float, int, list[float]]:
    """(tokens/s, tokens received, CPU seconds each of ``pids`` spent
    meanwhile, content chunks received)."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=HEADERS) as client:
        async with trio.open_nursery() as nursery:  # warm up
            for _ in range(min(concurrency, 50)):
                nursery.start_soon(stream_one, client, url, model, 4)
        total = 0

        async def one() -> None:
            nonlocal total
            for _ in range(each):
                _, n = await stream_one(client, url, model, tokens)
                total += n

        cpu0 = [cpu_seconds(p) for p in pids]
        CHUNKS["n"] = 0
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(one)
        elapsed = time.perf_counter() - start
        cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
    return total / elapsed, total, cpu, CHUNKS["n"]


def lean_throughput(
    url: str, model: str, concurrency: int, tokens: int, pids: list[int], each: int = 1
) -> tuple[float, int, list[float], int]:
    """:func:`throughput` with a client that costs little: ``concurrency``
    kept-alive sockets in one epoll loop, the request's bytes made once, and
    per read only a count of the tokens and a look at the last 7 bytes for the
    chunked body's end (SSE data holds no CRLF, so ``\\r\\n0\\r\\n\\r\\n`` is
    the end and nothing else). httpx spends 37-42 µs of CPU per token here, more
    than the edge and the node together, and on 2 cores it is what tokens/s
    measured (--client httpx keeps it, for comparison)."""
    host, _, rest = url.removeprefix("http://").partition(":")
    port, _, path = rest.partition("/")
    extra = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in HEADERS.items())

    def request_for(max_tokens: int) -> bytes:
        body = msgspec.json.encode({"model": model, "messages": MESSAGES, "stream": True, "max_tokens": max_tokens})
        head = b"POST /%s HTTP/1.1\r\nhost: %s:%s\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n"
        return head % (path.encode(), host.encode(), port.encode(), extra, len(body)) + body

    end = b"\r\n0\r\n\r\n"
    sel = selectors.EpollSelector()
    socks = []
    for _ in range(concurrency):
        s = socket.create_connection((host, int(port)))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        socks.append(s)
    # per socket: [streams left, tail of the last read (tokens), last 7 bytes, first read of a response]
    state: dict[int, list] = {}
    totals = [0, 0]  # tokens, content chunks
    request = b""

    def start(s: socket.socket, streams: int) -> None:
        state[s.fileno()] = [streams, b"", b"", True]
        s.sendall(request)  # a few hundred bytes into an empty socket buffer

    def run(streams: int) -> None:
        nonlocal request
        for s in socks:
            start(s, streams)
            sel.register(s, selectors.EVENT_READ, s)
        open_ = len(socks)
        while open_:
            for key, _ in sel.select():
                s = key.data
                st = state[s.fileno()]
                data = s.recv(262144)
                if not data:
                    raise ConnectionError("the server closed a kept-alive connection")
                if st[3]:
                    if not data.startswith(b"HTTP/1.1 200"):
                        raise ConnectionError(data[:200].decode(errors="replace"))
                    st[3] = False
                joined = st[1] + data
                n = joined.count(TOKEN)
                st[1] = joined[-2:]
                totals[0] += n - st[1].count(TOKEN)
                totals[1] += data.count(b'"content":"')
                last = (st[2] + data)[-7:]
                if last == end:
                    totals[0] += st[1].count(TOKEN)
                    if st[0] > 1:
                        start(s, st[0] - 1)
                    else:
                        sel.unregister(s)
                        open_ -= 1
                else:
                    st[2] = last

    try:
        request = request_for(4)
        run(1)  # warm up: a short stream on each connection
        request = request_for(tokens)
        totals[:] = [0, 0]
        cpu0 = [cpu_seconds(p) for p in pids]
        t0 = time.perf_counter()
        run(each)
        elapsed = time.perf_counter() - t0
        cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
    finally:
        for s in socks:
            s.close()
    return totals[0] / elapsed, totals[0], cpu, totals[1]


async def idle_streams(
    edge: str, model: str, n: int, probe_model: str, probes: int, edge_pid: int
) -> tuple[float, list[float], int]:
    """Open ``n`` streams that each get their first token and then wait. Returns
    (edge RSS bytes per stream, latencies in ms of ``probes`` new requests
    made while they are open, streams that got their first token)."""
    host, port = edge.removeprefix("http://").split(":")
    body = b'{"model":"%s","messages":[{"role":"user","content":"idle"}],"stream":true,"max_tokens":2}' % model.encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
        % (
            edge.encode(),
            b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in HEADERS.items()),
            len(body),
            body,
        )
    )
    opened = 0
    held: list[trio.SocketStream] = []
    limit = trio.CapacityLimiter(200)

    async def open_one() -> None:
        nonlocal opened
        async with limit:
            for attempt in range(5):
                try:
                    s = await trio.open_tcp_stream(host, int(port))
                    break
                except OSError:
                    await trio.sleep(0.2 * (attempt + 1))
            else:
                return
            await s.send_all(request)
            data = b""
            while TOKEN not in data:
                chunk = await s.receive_some(65536)
                if not chunk:
                    await s.aclose()
                    return
                data += chunk
            held.append(s)
            opened += 1

    await trio.sleep(1)
    base = rss_bytes(edge_pid)
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(open_one)
    await trio.sleep(2)
    per_stream = (rss_bytes(edge_pid) - base) / max(opened, 1)
    latencies = []
    async with httpx.AsyncClient(timeout=60, headers=HEADERS) as client:
        for _ in range(probes):
            start = time.perf_counter()
            await stream_one(client, edge + "/v1/chat/completions", probe_model, 4)
            latencies.append((time.perf_counter() - start) * 1000)
    for s in held:
        await s.aclose()
    return per_stream, latencies, opened


@contextlib.contextmanager
def profiled(out: Path | None, pids: dict[str, int]):
    """With ``out``: py-spy samples each of ``pids`` meanwhile, into
    ``out/<name>.txt`` (collapsed stacks), summarised by :func:`flame_summary`."""
    if out is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    spies = [
        subprocess.Popen(
            [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--format",
                "raw",
                "--rate",
                "250",
                "-o",
                str(out / f"{name}.txt"),
                "-p",
                str(pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    ]
    time.sleep(1)  # attached
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            spy.wait(30)
        for name in pids:
            print(flame_summary(out / f"{name}.txt", name))


def flame_summary(path: Path, name: str, top: int = 12) -> str:
    """The functions holding the most samples, inclusive and by themselves."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines() if path.exists() else ():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = [
            f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")" for f in stack.split(";")
        ]
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    lines = [f"\n{name}: {total} samples; top inclusive / own (% of samples)"]
    for (f1, n1), (f2, n2) in zip(inclusive.most_common(top), own.most_common(top), strict=False):
        lines.append(f"  {100 * n1 / max(total, 1):5.1f} {f1[:60]:<60} {100 * n2 / max(total, 1):5.1f} {f2[:60]}")
    return "\n".join(lines)


@dataclass
class Result:
    name: str
    direct_ttft: list[float] = field(default_factory=list)
    edge_ttft: list[float] = field(default_factory=list)
    direct_rate: float = 0.0
    edge_rate: float = 0.0
    edge_tokens: int = 0
    edge_chunks: int = 0
    cpu_edge_us: float = 0.0
    cpu_node_us: float = 0.0
    sys_us: tuple[float, float] = (0.0, 0.0)  # the kernel's part of that CPU per token (edge, node)
    idle_kb: float = 0.0
    idle_opened: int = 0
    idle_latency: list[float] = field(default_factory=list)
    console: str = ""  # with a console attached: what it received
    rounds: list[Result] = field(default_factory=list)  # with --rounds: each round's figures


def merged(rounds: list[Result]) -> Result:
    """One revision's rounds as one result: the medians (TTFT samples pooled)."""
    med = statistics.median
    first = rounds[0]
    idle = [r for r in rounds if r.idle_opened] or rounds[:1]  # --interleave measures it once
    return Result(
        first.name,
        [t for r in rounds for t in r.direct_ttft],
        [t for r in rounds for t in r.edge_ttft],
        med(r.direct_rate for r in rounds),
        med(r.edge_rate for r in rounds),
        first.edge_tokens,
        round(med(r.edge_chunks for r in rounds)),
        med(r.cpu_edge_us for r in rounds),
        med(r.cpu_node_us for r in rounds),
        (med(r.sys_us[0] for r in rounds), med(r.sys_us[1] for r in rounds)),
        med(r.idle_kb for r in idle),
        idle[0].idle_opened,
        [t for r in idle for t in r.idle_latency],
        first.console,
        rounds,
    )


def start_redis(stack: Stack) -> str | None:
    """A redis-server on loopback for the --keys variant with shared state (None: not installed)."""
    exe = shutil.which("redis-server")
    if exe is None:
        print("redis-server not found: skipping the shared-state variant", file=sys.stderr)
        return None
    port = free_port()
    stack._spawn([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
    time.sleep(0.5)
    return f"redis://127.0.0.1:{port}/0"


def worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="iop-bench-")) / rev.replace("/", "_")
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True, capture_output=True)
    return path


@dataclass
class Live:
    """One revision's edge and node, up."""

    name: str
    stack: Stack
    edge: str
    pids: list[int]
    watcher: subprocess.Popen | None


@contextlib.contextmanager
def revision(name: str, root: Path, upstream: str, idle_upstream: str, args, extra=None, console: bool = False):
    """``extra``: more edge config (the --keys variant); ``console``: a console attached throughout."""
    with Stack(root) as stack:
        wanted = {"max_queue": 1000, "backlog": 4096, "max_node_concurrency": args.idle_streams + 1000, **(extra or {})}
        known = (root / "edge/config.py").read_text()  # an older revision may not have every key
        edge = stack.edge(**{k: v for k, v in wanted.items() if k in known})
        node = stack.node(
            edge,
            [
                {
                    "name": "bench",
                    "adapter": "openai",
                    "target": "bench",
                    "base_url": upstream,
                    "max_concurrency": args.concurrency + 16,
                },
                {
                    "name": "idle",
                    "adapter": "openai",
                    "target": "idle",
                    "base_url": idle_upstream,
                    "max_concurrency": args.idle_streams + 100,
                },
            ],
            node_id=f"bench-{name}",
        )
        watcher = None
        if console:
            watcher = subprocess.Popen(
                [sys.executable, "-c", _CONSOLE, edge, BENCH_ADMIN], stdout=subprocess.PIPE, text=True
            )
        yield Live(name, stack, edge, [stack.edge_proc.pid, node.pid], watcher)


def measure(live: Live, upstream: str, args, ttft_requests: int) -> Result:
    """TTFT and one throughput phase of ``live``, as a Result."""
    result = Result(live.name)
    direct_url = upstream + "/chat/completions"
    edge_url = live.edge + "/v1/chat/completions"
    result.direct_ttft, result.edge_ttft = trio.run(ttft, direct_url, edge_url, "bench", ttft_requests)
    if args.client == "lean":
        rate = lean_throughput
    else:

        def rate(*a):
            return trio.run(throughput, *a)

    result.direct_rate, _, _, _ = rate(direct_url, "bench", args.concurrency, args.tokens, [], args.streams_each)
    with profiled(args.profile and args.profile / live.name, {"edge": live.pids[0], "node": live.pids[1]}):
        kernel0 = [cpu_split(p)[1] for p in live.pids]
        result.edge_rate, result.edge_tokens, cpu, result.edge_chunks = rate(
            edge_url, "bench", args.concurrency, args.tokens, live.pids, args.streams_each
        )
    result.cpu_edge_us = cpu[0] / max(result.edge_tokens, 1) * 1e6
    result.cpu_node_us = cpu[1] / max(result.edge_tokens, 1) * 1e6
    edge_sys, node_sys = (cpu_split(p)[1] - k for p, k in zip(live.pids, kernel0, strict=True))
    result.sys_us = (edge_sys / max(result.edge_tokens, 1) * 1e6, node_sys / max(result.edge_tokens, 1) * 1e6)
    return result


def measure_idle(live: Live, result: Result, args) -> None:
    if args.idle_streams:
        per_stream, result.idle_latency, result.idle_opened = trio.run(
            idle_streams, live.edge, "idle", args.idle_streams, "bench", 200, live.pids[0]
        )
        result.idle_kb = per_stream / 1024


def run_revision(
    name: str, root: Path, upstream: str, idle_upstream: str, args, extra: dict | None = None, console: bool = False
) -> Result:
    """One revision on fresh processes: everything, then its idle streams."""
    HEADERS.clear()
    if extra and "keys" in extra:
        HEADERS["Authorization"] = f"Bearer {BENCH_KEY['key']}"
    with revision(name, root, upstream, idle_upstream, args, extra, console) as live:
        result = measure(live, upstream, args, args.ttft_requests)
        measure_idle(live, result, args)
        if live.watcher is not None:
            live.watcher.terminate()
            events, size, largest = (live.watcher.communicate(timeout=10)[0].split() or ["0", "0", "0"])[:3]
            result.console = f"{events} events, {int(size) / 1024:.0f} KiB, the largest {int(largest) / 1024:.1f} KiB"
    return result


def interleaved(tree: Path, upstream: str, idle_upstream: str, args) -> dict[str, list[Result]]:
    """--interleave: both revisions up at once, measured in --rounds slices
    that take turns (current, baseline, baseline, current, ...), so that the
    machine's drift during the run falls on both alike; then each one's idle
    streams."""
    rounds: dict[str, list[Result]] = {}
    per_slice = max(args.ttft_requests // max(args.rounds, 1), 20)
    HEADERS.clear()
    with contextlib.ExitStack() as up:
        lives = [
            up.enter_context(revision("current", ROOT, upstream, idle_upstream, args)),
            up.enter_context(revision(args.baseline[:12], tree, upstream, idle_upstream, args)),
        ]
        for round_no in range(max(args.rounds, 1)):
            for live in lives if round_no % 2 == 0 else lives[::-1]:
                rounds.setdefault(live.name, []).append(measure(live, upstream, args, per_slice))
        for live in lives:
            measure_idle(live, rounds[live.name][-1], args)
    return rounds


def report(results: list[Result], args) -> None:
    expected = args.concurrency * args.tokens * args.streams_each
    print(f"\nTime to first content, concurrency 1, {args.ttft_requests} requests (ms)")
    print(f"{'revision':<14}{'path':<12}{'p50':>8}{'p90':>8}{'p99':>8}{'added p50':>11}")
    for r in results:
        added = statistics.median(r.edge_ttft) - statistics.median(r.direct_ttft)
        for path, values in (("direct", r.direct_ttft), ("edge+node", r.edge_ttft)):
            extra = f"{added:>11.2f}" if path == "edge+node" else ""
            print(f"{r.name:<14}{path:<12}{pct(values, 50):>8.2f}{pct(values, 90):>8.2f}{pct(values, 99):>8.2f}{extra}")
    print(f"\nStreamed tokens, concurrency {args.concurrency}, {args.tokens}-token streams")
    print(
        f"{'revision':<14}{'direct/s':>10}{'edge/s':>10}{'ratio':>7}{'edge µs/tok':>13}{'node µs/tok':>13}{'sum':>7}{'tok/chunk':>11}"
        f"{'chunks/s':>10}"
    )
    for r in results:
        print(
            f"{r.name:<14}{r.direct_rate:>10.0f}{r.edge_rate:>10.0f}{r.edge_rate / r.direct_rate:>7.2f}"
            f"{r.cpu_edge_us:>13.1f}{r.cpu_node_us:>13.1f}{r.cpu_edge_us + r.cpu_node_us:>7.1f}"
            f"{r.edge_tokens / max(r.edge_chunks, 1):>11.2f}"
            f"{r.edge_rate * r.edge_chunks / max(r.edge_tokens, 1):>10.0f}"
        )
        print(f"{'':<14}of which in the kernel (system calls): edge {r.sys_us[0]:.1f}, node {r.sys_us[1]:.1f} µs/tok")
        if len(r.rounds) > 1:
            print(
                f"{'':<14}{len(r.rounds)} rounds: edge/s {min(x.edge_rate for x in r.rounds):.0f}-"
                f"{max(x.edge_rate for x in r.rounds):.0f}, edge µs/tok {min(x.cpu_edge_us for x in r.rounds):.1f}-"
                f"{max(x.cpu_edge_us for x in r.rounds):.1f}, node µs/tok {min(x.cpu_node_us for x in r.rounds):.1f}-"
                f"{max(x.cpu_node_us for x in r.rounds):.1f}"
            )
        if r.edge_tokens != expected:
            print(f"WARNING: {r.name}: {r.edge_tokens} tokens, expected {expected}", file=sys.stderr)
    if len(results) >= 2:
        print(f"tokens/s {results[0].name} / {results[1].name}: {results[0].edge_rate / results[1].edge_rate:.2f}")
    for r in results:
        if r.console:
            print(f"{r.name}: the console received {r.console}")
    if args.idle_streams:
        print(f"\nIdle streams ({args.idle_streams} asked), edge memory and new requests meanwhile")
        print(f"{'revision':<14}{'open':>7}{'KB/stream':>11}{'new p50 ms':>12}{'new p99 ms':>12}")
        for r in results:
            print(
                f"{r.name:<14}{r.idle_opened:>7}{r.idle_kb:>11.1f}{pct(r.idle_latency, 50):>12.2f}{pct(r.idle_latency, 99):>12.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--ttft-requests", type=int, default=300)
    parser.add_argument(
        "--streams-each",
        type=int,
        default=1,
        help="streams each of the --concurrency clients runs, one after another, in the throughput phase "
        "(1: about 1.5 s; more: a longer phase, less noise in the CPU per token)",
    )
    parser.add_argument(
        "--interval-ms",
        type=float,
        default=0.0,
        help="the upstream's pause between tokens; at 0 a 200-token stream ends in a few ms and far fewer "
        "than --concurrency streams are open at once (measured: 8-13 of 200), so per-request costs dominate",
    )
    parser.add_argument(
        "--client",
        choices=("lean", "httpx"),
        default="lean",
        help="the throughput phase's client: lean (raw sockets in an epoll loop, a few µs per read) or httpx "
        "(trio + httpx, as the SDKs are; about 40 µs of CPU per token, the machine's largest user)",
    )
    parser.add_argument("--idle-streams", type=int, default=0, help="e.g. 10000; 0 skips the idle-stream phase")
    parser.add_argument("--baseline", metavar="REV", help="also measure this git revision, side by side")
    parser.add_argument("--profile", type=Path, metavar="DIR", help="py-spy the throughput phase into DIR")
    parser.add_argument(
        "--keys",
        action="store_true",
        help="also measure the current code with a keyed client (rpm/tpm limits, SQLite ledger; then also "
        "limits shared through a redis-server it starts) against no keys and the ledger off",
    )
    parser.add_argument(
        "--console",
        action="store_true",
        help="also measure the current code with admin keys set, without and with a console attached",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="run everything N times, revisions taking turns; report medians"
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="with --baseline: both revisions up at once, measured in --rounds slices taking turns "
        "(TTFT requests split between the slices); idle streams once each at the end",
    )
    args = parser.parse_args()
    if args.interleave and (not args.baseline or args.keys or args.console):
        parser.error("--interleave compares the current code with --baseline (without --keys or --console)")

    with Stack() as upstreams:
        upstream = upstreams.upstream(interval_ms=args.interval_ms)
        idle_upstream = upstreams.upstream(tokens=2, interval_ms=3_600_000)
        plain = {"ledger": "off"} if args.keys else None
        redis_url = start_redis(upstreams) if args.keys else None
        tree = worktree(args.baseline) if args.baseline else None
        rounds: dict[str, list[Result]] = {}
        try:
            if args.interleave:
                rounds = interleaved(tree, upstream, idle_upstream, args)
            for round_no in range(0 if args.interleave else max(args.rounds, 1)):
                # The baseline goes first in every other round, so that neither revision always
                # meets the machine in the same state (the node's CPU per token, identical code in
                # both, measured 6-16% apart with the current code always first).
                if tree is not None and round_no % 2 == 1:
                    result = run_revision(args.baseline[:12], tree, upstream, idle_upstream, args)
                    rounds.setdefault(result.name, []).append(result)
                results = [run_revision("current", ROOT, upstream, idle_upstream, args, plain)]
                if args.keys:
                    keyed = {"keys": [BENCH_KEY]}
                    results.append(run_revision("current+keys", ROOT, upstream, idle_upstream, args, keyed))
                    if redis_url:
                        shared = {"keys": [BENCH_KEY], "state": redis_url}
                        results.append(run_revision("+keys+redis", ROOT, upstream, idle_upstream, args, shared))
                if args.console:
                    admin = {"admin_keys": [BENCH_ADMIN]}
                    results.append(run_revision("+admin", ROOT, upstream, idle_upstream, args, admin))
                    results.append(run_revision("+console", ROOT, upstream, idle_upstream, args, admin, console=True))
                if tree is not None and round_no % 2 == 0:
                    results.append(run_revision(args.baseline[:12], tree, upstream, idle_upstream, args))
                for result in results:
                    rounds.setdefault(result.name, []).append(result)
        finally:
            if tree is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    report([merged(r) for r in rounds.values()], args)


if __name__ == "__main__":
    main()
