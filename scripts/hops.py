"""Where the first token's time goes, hop by hop, without a tracer in the way.

    python scripts/hops.py [--requests 400]

Starts the upstream of scripts/upstream.py, an edge and a node (each its own
process, as scripts/bench.py does) and sends sequential streamed requests of 4
tokens, alternating with the same request sent to the upstream directly. In
the edge and the node, a ``sitecustomize`` written for the run wraps nine
functions on the way of a run's first bytes, each noting the monotonic clock
(the same clock in every process) and the process's CPU time when it is
called (or, for the frame's read, when it returns):

    edge   a request's bytes reach hypercorn's H11Protocol ......... request in
    edge   the run's frame goes to the node's socket ............... run out
    node   trio-websocket's reader has read the frame's bytes ..... frame read
    node   the frame is decoded ................................... run in
    node   the request is written to the model server ............. upstream out
    node   the first bytes of its answer are looked at ............ upstream in
    node   the first event frame is encoded for the edge .......... events out
    edge   the frame is read from the link ........................ events in
    edge   the response's head and first chunk go to the client ... response out

For each segment: its wall time (p50, p90) and, where both ends are in one
process, that process's CPU time over it. The wrappers add a few µs each;
``strace`` (an earlier way to get this) stretched the whole 2.3-fold.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time
from bisect import bisect_left, bisect_right
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from scripts.stack import ROOT, Stack  # noqa: E402

# (name, who): in the order a run's first bytes pass them
POINTS = [
    ("request in", "edge"),
    ("run out", "edge"),
    ("frame read", "node"),
    ("run in", "node"),
    ("upstream out", "node"),
    ("upstream in", "node"),
    ("events out", "node"),
    ("events in", "edge"),
    ("response out", "edge"),
]

SITECUSTOMIZE = """
import atexit, os, sys, time

if "iop.cli" in sys.orig_argv:
    _marks = []
    _wall, _cpu = time.perf_counter_ns, time.process_time_ns

    def _mark(name):
        if len(_marks) < 1_000_000:
            _marks.append((name, _wall(), _cpu()))

    def _dump():
        with open(os.path.join(os.environ["IOP_HOPS_DIR"], f"{os.getpid()}.txt"), "w") as f:
            f.writelines(f"{n}\\t{w}\\t{c}\\n" for n, w, c in _marks)

    atexit.register(_dump)

    def _before(owner, attr, name, when=None):
        fn = getattr(owner, attr)
        if hasattr(fn, "__code__") and fn.__code__.co_flags & 0x80:  # a coroutine function
            async def wrapped(*args, **kwargs):
                if when is None or when(*args, **kwargs):
                    _mark(name)
                return await fn(*args, **kwargs)
        else:
            def wrapped(*args, **kwargs):
                if when is None or when(*args, **kwargs):
                    _mark(name)
                return fn(*args, **kwargs)
        setattr(owner, attr, wrapped)

    from hypercorn.protocol import h11 as _h11
    from hypercorn.events import RawData as _RawData
    import edge.ws, edge.frame_limit, edge.openai.direct, node.agent, node.http1, trio

    _before(_h11.H11Protocol, "handle", "request in",
            lambda self, event: type(event) is _RawData and event.data[:5] == b"POST ")
    _before(edge.ws.DirectFrames, "write", "run out")
    if "node" in sys.orig_argv:  # (a read that carries a run's frame: not a demand's)
        _receive_some = trio.SocketStream.receive_some

        async def _read_marked(self, *args, **kwargs):
            data = await _receive_some(self, *args, **kwargs)
            if b"run_id" in data:
                _mark("frame read")
            return data

        trio.SocketStream.receive_some = _read_marked
    _before(node.agent, "decode_frame", "run in")
    _before(node.http1.Client, "_send", "upstream out")
    _before(node.http1, "_head_end", "upstream in", lambda buf: bool(buf))
    _before(node.agent, "encode_frame", "events out")
    _before(edge.frame_limit, "whole_messages", "events in")
    _before(edge.openai.direct.DirectBody, "head_and_chunk", "response out")
"""

BODY = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def first_content(client: httpx.Client, url: str) -> tuple[int, int]:
    """(sent, first content seen), monotonic ns."""
    first = 0
    sent = time.perf_counter_ns()
    with client.stream("POST", url, json=BODY) as r:
        for line in r.iter_lines():
            if not first and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter_ns()
    return sent, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sitecustomize.py").write_text(SITECUSTOMIZE)
        out = Path(tmp, "marks")
        out.mkdir()
        stack = Stack(ROOT)
        stack.env = {**stack.env, "PYTHONPATH": f"{tmp}{os.pathsep}{ROOT}", "IOP_HOPS_DIR": str(out)}
        times: list[tuple[int, int]] = []
        direct: list[float] = []
        with stack:
            upstream = stack.upstream(tokens=4)
            edge = stack.edge()
            stack.node(edge, [{"name": "m", "adapter": "openai", "base_url": upstream}], node_id="n")
            with httpx.Client(timeout=30) as client:
                for _ in range(100):  # warm up both ways
                    first_content(client, edge + "/v1/chat/completions")
                    first_content(client, upstream + "/chat/completions")
                for _ in range(args.requests):
                    sent, first = first_content(client, upstream + "/chat/completions")
                    direct.append((first - sent) / 1000)
                    times.append(first_content(client, edge + "/v1/chat/completions"))
        report(out, times, direct)


def report(out: Path, times: list[tuple[int, int]], direct: list[float]) -> None:
    marks: list[tuple[int, str, str, int]] = []  # (wall, name, pid, cpu)
    for path in glob.glob(str(out / "*.txt")):
        pid = Path(path).stem
        for line in open(path):
            name, wall, cpu = line.rstrip("\n").split("\t")
            marks.append((int(wall), name, pid, int(cpu)))
    marks.sort()
    walls = [m[0] for m in marks]
    names = [name for name, _ in POINTS]
    wall_of: dict[str, list[float]] = {name: [] for name in [*names, "client"]}
    cpu_of: dict[str, list[float]] = {}
    whole = []
    for sent, first in times:
        seen: dict[str, tuple[int, str, int]] = {}
        for wall, name, pid, cpu in marks[bisect_left(walls, sent) : bisect_right(walls, first)]:
            seen.setdefault(name, (wall, pid, cpu))
        if any(name not in seen for name in names):
            continue  # (a request whose marks are not all there: not counted)
        whole.append((first - sent) / 1000)
        prev: tuple[int, str, int] = (sent, "client", 0)
        for name in names:
            at = seen[name]
            wall_of[name].append((at[0] - prev[0]) / 1000)
            if at[1] == prev[1]:
                cpu_of.setdefault(name, []).append((at[2] - prev[2]) / 1000)
            prev = at
        wall_of["client"].append((first - prev[0]) / 1000)
    if not whole:
        sys.exit("no request carried every mark: has a wrapped function been renamed?")
    p50 = statistics.median
    print(f"{len(whole)} sequential streamed requests of 4 tokens; first content p50 {p50(whole):.0f} µs through")
    print(f"the edge, {p50(direct):.0f} µs from the upstream directly (added {p50(whole) - p50(direct):.0f} µs)\n")
    print(f"{'segment, ending when':34s} {'wall p50':>9s} {'p90':>7s} {'CPU p50':>9s}")
    prev_who = "client"
    for name, who in [*POINTS, ("first content read", "client")]:
        key = name if name in wall_of else "client"
        values = sorted(wall_of[key])
        cpu = cpu_of.get(name)
        label = f"{who}: {name}" if who == prev_who else f"{prev_who} -> {who}: {name}"
        cpu_text = f"{p50(cpu):9.0f}" if cpu else f"{'':9s}"
        print(f"{label:34s} {p50(values):9.0f} {values[int(len(values) * 0.9)]:7.0f} {cpu_text}")
        prev_who = who
    print("\nµs; a segment between two processes includes the wake-up of the second (and, first and")
    print("last, the bench client's own httpx work, which a direct request pays too).")


if __name__ == "__main__":
    main()
