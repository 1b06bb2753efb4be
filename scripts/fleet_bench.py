"""Placement in a fleet: prefix-cache hit ratio, TTFT and node load per routing policy.

    python scripts/fleet_bench.py [--edges 1,2] [--policies random,least_loaded,session,prefix]
                                  [--conversations 64] [--turns 8] [--group 8] [--system-tokens 2000]
                                  [--independent 256] [--hot 32] [--prefix-wait-ms MS] [--think-ms 1000]

Everything runs in one process tree on this machine (scripts/stack.py): for
each routing policy and edge count, a fresh fleet of --nodes sim nodes (their
prefix cache on, see SIM below) linked to every edge, and this process as the
client (trio + httpx, streaming, requests spread round-robin over the edges,
no session ids). Workloads, each on its own model name so that caches and
slots are separate:

  a  multi-turn agent conversations: --conversations x --turns, growing
     context (each turn adds the sim's answer and a new user message), one
     ~--system-tokens system prompt per group of --group conversations;
     between turns an agent runs its tool: a pause of 0.5-1.5x --think-ms
     (1000; 0 sends the next turn at once, which keeps every node's prefill
     busy all the time: TTFT is then the prefill queue);
  b  --independent single-turn requests with no shared prefix;
  c  one hot group: --hot conversations x --turns sharing one system prompt,
     more than one node's slots (with the same pauses as a).

Per workload and policy it prints the prefix-cache hit ratio in prompt tokens
(from the nodes' "sim prefix cache" log lines, read when they stop), the
oracle hit ratio (one node with an unlimited cache, replaying the requests in
the order they were sent), time to the first content chunk as the client sees
it (p50/p99), and node load: runs on the busiest node over the mean, and the
most runs any node had at once. A policy this edge does not know (its config
has no such ``routing``) prints n/a. Each fleet's placements
(``iop_placements_total``) and prefix waits (``iop_prefix_waits_total``),
summed over its edges, go to stderr as it ends.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import msgspec  # noqa: E402
import trio  # noqa: E402

from node.adapters.sim_cache import block_chain, prompt_tokens, render  # noqa: E402
from scripts.stack import Stack  # noqa: E402

POLICIES = ("random", "least_loaded", "session", "prefix")
LABELS = {"random": "random", "least_loaded": "least-loaded", "session": "session/LL", "prefix": "prefix"}
# The simulated model (node.config.ModelConfig): see the README, "A fleet benchmark".
SIM = {
    "adapter": "sim",
    "ttft_ms": 30.0,  # scheduling and the first decode step
    "tokens_per_s": 200.0,  # decode
    "prefill_tokens_per_s": 5000.0,  # an ~8B model on one datacentre GPU
    "prefix_cache_tokens": 32_768,  # ~1/4 of workload a's working set: it fits only if conversations stay put
    "prefix_block_tokens": 64,
    "max_concurrency": 16,
}
MAX_TOKENS = 16
BLOCK = SIM["prefix_block_tokens"]
_WORDS = (
    "agent tool call result file patch test build error trace plan step review diff module "
    "function class request response stream token cache node edge queue latency budget"
).split()
_decode = msgspec.json.Decoder()


def available_policies() -> set[str]:
    """The routing values this checkout's edge accepts."""
    from edge.config import EdgeConfig

    hints = typing.get_type_hints(EdgeConfig)
    if "routing" not in hints:
        return {"session"}  # today's behaviour, whatever it is called
    return set(typing.get_args(hints["routing"]))


def text(rng: random.Random, tokens: int) -> str:
    words, chars = [], 0
    while chars < tokens * 4:
        words.append(rng.choice(_WORDS))
        chars += len(words[-1]) + 1
    return " ".join(words)


# -- the client ------------------------------------------------------------------------------------


@dataclass
class Result:
    ttft_ms: list[float] = field(default_factory=list)
    errors: int = 0
    trace: list[dict] = field(default_factory=list)  # request bodies, in the order sent
    wall_s: float = 0.0


class Client:
    def __init__(self, http: httpx.AsyncClient, edges: list[str], result: Result, think_s: float = 0.0) -> None:
        self.http = http
        self.edges = itertools.cycle(edges)
        self.result = result
        self.think_s = think_s

    async def ask(self, model: str, messages: list[dict]) -> str:
        """One streamed request; the answer's text ("" on an error)."""
        body = {"model": model, "messages": list(messages), "stream": True, "max_tokens": MAX_TOKENS}
        self.result.trace.append(body)
        start = time.perf_counter()
        first = 0.0
        parts: list[str] = []
        try:
            async with self.http.stream("POST", next(self.edges) + "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for choice in _decode.decode(line[6:]).get("choices") or ():
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            if not first:
                                first = time.perf_counter() - start
                            parts.append(content)
        except httpx.HTTPError:
            self.result.errors += 1
            return ""
        if first:
            self.result.ttft_ms.append(first * 1000)
        return "".join(parts)

    async def conversation(self, model: str, system: str, rng: random.Random, turns: int) -> None:
        messages = [{"role": "system", "content": system}]
        for turn in range(turns):
            if turn and self.think_s:  # the agent runs its tool: 0.5-1.5x the mean
                await trio.sleep(self.think_s * rng.uniform(0.5, 1.5))
            messages.append({"role": "user", "content": f"turn {turn}: " + text(rng, 150)})
            answer = await self.ask(model, messages)
            messages.append({"role": "assistant", "content": answer})


async def workload_a(client: Client, args) -> None:
    async with trio.open_nursery() as nursery:
        for c in range(args.conversations):
            group = c // args.group
            system = f"[group {group}] " + text(random.Random(f"system {group}"), args.system_tokens)
            nursery.start_soon(client.conversation, "a", system, random.Random(f"a {c}"), args.turns)


async def workload_b(client: Client, args) -> None:
    limit = trio.CapacityLimiter(args.conversations)

    async def one(i: int) -> None:
        async with limit:
            await client.ask("b", [{"role": "user", "content": f"[request {i}] " + text(random.Random(i), 1000)}])

    async with trio.open_nursery() as nursery:
        for i in range(args.independent):
            nursery.start_soon(one, i)


async def workload_c(client: Client, args) -> None:
    system = "[hot] " + text(random.Random("hot"), args.system_tokens)
    async with trio.open_nursery() as nursery:
        for c in range(args.hot):
            nursery.start_soon(client.conversation, "c", system, random.Random(f"c {c}"), args.turns)


WORKLOADS = {
    "a": ("multi-turn conversations, a shared system prompt per group", workload_a),
    "b": ("independent single-turn requests, no shared prefix", workload_b),
    "c": ("one hot conversation group", workload_c),
}


async def run_workloads(edges: list[str], args) -> dict[str, Result]:
    results: dict[str, Result] = {}
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        for name in args.workloads:
            results[name] = Result()
            start = time.perf_counter()
            await WORKLOADS[name][1](Client(http, edges, results[name], args.think_ms / 1000), args)
            results[name].wall_s = time.perf_counter() - start
    return results


# -- measuring -------------------------------------------------------------------------------------


def oracle(trace: list[dict]) -> float:
    """Hit ratio (prompt tokens) of one node with an unlimited cache, replaying ``trace``."""
    seen: set[bytes] = set()
    hit = total = 0
    for body in trace:
        rendered = render(body)
        chain = block_chain(rendered, BLOCK)
        n = next((i for i, key in enumerate(chain) if key not in seen), len(chain))
        hit += n * BLOCK
        total += prompt_tokens(rendered)
        seen.update(chain)
    return hit / total if total else 0.0


def cache_lines(log_file: Path) -> dict[str, dict]:
    """The node's last "sim prefix cache" line per model."""
    out: dict[str, dict] = {}
    for line in log_file.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("msg") == "sim prefix cache":
            out[entry["model"]] = entry
    return out


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def placements(edges: list[str]) -> dict[str, int]:
    """How the edges chose nodes (iop_placements_total by how, iop_prefix_waits_total by outcome),
    summed over edges and workloads."""
    out: dict[str, int] = {}
    for edge in edges:
        for line in httpx.get(edge + "/metrics", timeout=10).text.splitlines():
            if line.startswith(("iop_placements_total{", "iop_prefix_waits_total{")):
                how = line.split('="', 1)[1].split('"', 1)[0]
                if line.startswith("iop_prefix_waits"):
                    how = "waited, " + how
                out[how] = out.get(how, 0) + int(float(line.rsplit(" ", 1)[1]))
    return {how: n for how, n in out.items() if n}


def run_fleet(policy: str, n_edges: int, args) -> dict[str, dict]:
    """One fresh fleet: every workload, then the nodes' figures."""
    with Stack() as stack:
        extra = {"prefix_wait_ms": args.prefix_wait_ms} if args.prefix_wait_ms is not None else {}
        edges = [stack.edge(routing=policy, max_queue=4096, **extra) for _ in range(n_edges)]
        models = [{"name": name, **SIM} for name in args.workloads]
        logs = [stack.dir / f"node{i}.log" for i in range(args.nodes)]
        nodes = [stack.node(edges, models, node_id=f"node{i}", log_file=logs[i]) for i in range(args.nodes)]
        results = trio.run(run_workloads, edges, args)
        placed = placements(edges)
        for proc in nodes:
            stack.stop(proc)  # the node logs its final cache line as it stops
        per_node = [cache_lines(f) for f in logs]
    rows = {}
    for name, result in results.items():
        lines = [n.get(name, {}) for n in per_node]
        hit = sum(line.get("hit_tokens", 0) for line in lines)
        miss = sum(line.get("miss_tokens", 0) for line in lines)
        runs = [line.get("runs", 0) for line in lines]
        mean = sum(runs) / len(runs)
        rows[name] = {
            "hit": hit / (hit + miss) if hit + miss else float("nan"),
            "oracle": oracle(result.trace),
            "p50": pct(result.ttft_ms, 50),
            "p99": pct(result.ttft_ms, 99),
            "mean": sum(result.ttft_ms) / len(result.ttft_ms) if result.ttft_ms else float("nan"),
            "load": max(runs) / mean if mean else float("nan"),
            "peak": max(line.get("peak_active", 0) for line in lines),
            "runs": "/".join(str(r) for r in runs),
            "errors": result.errors,
            "wall": result.wall_s,
        }
    print(f"  placements ({policy}, {n_edges} edge(s), all workloads): {placed}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--edges", default="1,2", help="edge counts to run, comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workloads", default="abc")
    parser.add_argument("--conversations", type=int, default=64, help="workload a (and b's concurrency)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="conversations per system prompt (a)")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--independent", type=int, default=256, help="requests (b)")
    parser.add_argument("--prefix-wait-ms", type=float, help="the edges' prefix_wait_ms (default: theirs)")
    parser.add_argument(
        "--think-ms", type=float, default=1000.0, help="mean pause between a conversation's turns (a and c); 0: none"
    )
    parser.add_argument("--hot", type=int, default=32, help="conversations in the hot group (c)")
    args = parser.parse_args()
    args.workloads = [w for w in args.workloads if w in WORKLOADS]
    known = available_policies()
    table: dict[tuple[str, int], dict[str, dict] | None] = {}
    started = time.perf_counter()
    for n_edges in (int(n) for n in args.edges.split(",")):
        for policy in args.policies.split(","):
            if policy not in known:
                table[policy, n_edges] = None
                continue
            print(f"running: {policy}, {n_edges} edge(s)", file=sys.stderr, flush=True)
            table[policy, n_edges] = run_fleet(policy, n_edges, args)

    sim = ", ".join(f"{k}={v}" for k, v in SIM.items() if k != "adapter")
    print(f"\n{args.nodes} sim nodes ({sim}), max_tokens={MAX_TOKENS}; total {time.perf_counter() - started:.0f} s")
    header = (
        f"{'edges':>5} {'policy':<13}{'hit':>7}{'oracle':>8}{'p50 ms':>9}{'p99 ms':>9}{'mean':>7}"
        f"{'max/mean':>10}{'peak':>6}  {'runs per node':<18}{'err':>4}{'wall s':>8}"
    )
    for name in args.workloads:
        print(f"\n({name}) {WORKLOADS[name][0]}")
        print(header)
        for (policy, n_edges), rows in table.items():
            if rows is None:
                print(f"{n_edges:>5} {LABELS[policy]:<13}{'n/a':>7}")
                continue
            r = rows[name]
            print(
                f"{n_edges:>5} {LABELS[policy]:<13}{r['hit']:>7.1%}{r['oracle']:>8.1%}{r['p50']:>9.0f}{r['p99']:>9.0f}{r['mean']:>7.0f}"
                f"{r['load']:>10.2f}{r['peak']:>6}  {r['runs']:<18}{r['errors']:>4}{r['wall']:>8.1f}"
            )


if __name__ == "__main__":
    main()
