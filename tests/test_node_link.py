"""The node's side of the link (issue 9): liveness is judged apart from
sending, so a frozen edge is noticed by a busy node and its upstream requests
closed; the reader never waits for a send; and every frame the node sends
stays under the edge's frame limit."""

from __future__ import annotations

import random
from types import SimpleNamespace

import msgspec
import trio
from trio_websocket import serve_websocket

from edge.config import MIN_FRAME_BYTES
from node.agent import NodeAgent, RunSink
from proto import (
    PROTOCOL_VERSION,
    CancelRun,
    Events,
    Grant,
    Ping,
    Placed,
    RunEvent,
    RunRequest,
    ToolCall,
    ToolCallFunction,
    Usage,
    Welcome,
    decode_frame,
    encode_frame,
)
from proto.frames import MAX_ANSWERED_ID, MAX_FREED, MAX_MODEL_NAME
from tests.conftest import (
    BOUND,
    edge_config,
    eventually,
    http,
    model,
    node_config,
    settled,
    sse_events,
    start_edge,
    start_node,
)

PING_S = 0.2
MISSES = 3
TIMEOUT = PING_S * MISSES  # the node's ping timeout against the fake edge
STREAM = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class CountedScript(list):
    """An upstream script that counts the steps the upstream has sent, so a
    test can see the upstream stall once the node stops reading from it."""

    def __init__(self, steps, sent: list[int]) -> None:
        super().__init__(steps)
        self.sent = sent

    def __iter__(self):
        for step in super().__iter__():
            self.sent[0] += 1
            yield step


class StuckEdge:
    """A fake edge on port 0 that welcomes the node, gives it ``runs`` runs,
    then never reads again (the TCP connection stays open), so the node's
    sends back up. It pings the node every PING_S / 2 until ``freeze()``.
    Later dials (after the node declared the link dead) are welcomed and left alone."""

    def __init__(self, runs: int) -> None:
        self.runs = [f"run{i}" for i in range(runs)]
        self.dials = 0
        self.pinging = True
        self.ws = None
        self.port = 0

    def freeze(self) -> None:
        self.pinging = False

    async def send(self, frame) -> None:
        await self.ws.send_message(encode_frame(frame))

    async def _handler(self, request) -> None:
        ws = await request.accept()
        await ws.get_message()  # hello
        self.dials += 1
        await ws.send_message(encode_frame(Welcome(edge_id="stuck", protocol=PROTOCOL_VERSION, ping_interval_s=PING_S)))
        if self.dials > 1:
            await trio.sleep_forever()
        self.ws = ws
        for run_id in self.runs:
            body = {"model": "m", "messages": [{"role": "user", "content": run_id}], "stream": True}
            await self.send(RunRequest(run_id=run_id, model="m", target="m-target", request=body, timeout_s=60))
        # From here on nothing is read: the node's frames pile up in the socket buffers.
        while self.pinging:
            await self.send(Ping(ts=trio.current_time()))
            await trio.sleep(PING_S / 2)
        await trio.sleep_forever()

    async def serve(self, nursery: trio.Nursery) -> str:
        # Large enough that the node's frames never trip the message limit here.
        server = await nursery.start(
            lambda task_status: serve_websocket(
                self._handler, "127.0.0.1", 0, None, max_message_size=64 << 20, task_status=task_status
            )
        )
        self.port = server.port
        return f"ws://127.0.0.1:{server.port}/v1/node/link"


async def stuck_node(nursery, upstream, runs: int):
    """A node linked to a StuckEdge, its runs streaming fast until the node's
    sender is blocked and the upstream has stalled behind it."""
    sent = [0]
    big = "x" * 8192
    upstream.script_for("m-target", lambda body: CountedScript([("chunk", {"content": big})] * 50_000, sent))
    edge = StuckEdge(runs)
    url = await edge.serve(nursery)
    agent = NodeAgent(
        node_config([url], [model("m", upstream, max_concurrency=runs)], ping_misses=MISSES, max_frame_bytes=256 * 1024)
    )
    nursery.start_soon(agent.serve)
    await upstream.wait_requests(runs)
    last, still_since = -1, trio.current_time()
    while trio.current_time() - still_since < 0.5:  # nothing more sent for 0.5 s: the upstream is stalled
        await trio.sleep(0.05)
        if sent[0] != last:
            last, still_since = sent[0], trio.current_time()
    assert all(not r.finished.is_set() for r in upstream.records)  # all still streaming, none ended
    return edge, agent, url


async def test_reader_reads_pings_and_cancel_while_the_sender_is_blocked(nursery, upstream):
    """With the edge not reading (the node's sends blocked), the node's reader still takes the
    edge's pings (the link stays up) and a CancelRun, which aborts that run's upstream request alone."""
    with trio.fail_after(BOUND):
        edge, agent, url = await stuck_node(nursery, upstream, runs=3)
        link = agent.links[url]
        by_run = {rec.body["messages"][0]["content"]: rec for rec in upstream.records}
        await edge.send(CancelRun(run_id="run0", reason="client gone"))
        with trio.fail_after(10 * TIMEOUT):
            await by_run["run0"].finished.wait()
        assert by_run["run0"].aborted
        await trio.sleep(2 * TIMEOUT)  # the edge keeps pinging: the link must not be declared dead
        assert agent.links.get(url) is link and edge.dials == 1
        assert not by_run["run1"].finished.is_set() and not by_run["run2"].finished.is_set()
    nursery.cancel_scope.cancel()


async def test_frozen_edge_is_declared_dead_and_every_upstream_request_closed(nursery, upstream):
    """A busy node whose sends are blocked on an edge that went silent declares the link dead
    (its watchdog never waits for a send) and every upstream request is aborted promptly."""
    runs = 6
    with trio.fail_after(BOUND):
        edge, agent, url = await stuck_node(nursery, upstream, runs=runs)
        edge.freeze()
        with trio.fail_after(10 * TIMEOUT):
            for rec in upstream.records:
                await rec.finished.wait()
            while edge.dials < 2:  # the node declared the link dead and dialled again
                await trio.sleep(0.01)
    assert all(rec.aborted for rec in upstream.records)
    assert len(upstream.records) == runs
    assert agent.counters.active_upstream == 0 and agent.counters.active_runs == 0
    nursery.cancel_scope.cancel()


# -- every frame under the limit ------------------------------------------------------------

SMALL_FRAME = 256 * 1024


def huge_deltas_script(seed: int) -> tuple[list, str]:
    """Deltas of 32 KiB, one over the frame limit, one of multi-byte text over it once encoded."""
    rng = random.Random(seed)
    pieces = [rng.choice("abcdefgh") * 32 * 1024 for _ in range(12)]
    pieces.insert(3, "L" * (SMALL_FRAME + 50_000))  # ASCII, alone larger than a frame
    pieces.insert(7, "é€😀" * 40_000)  # ~360 KB of UTF-8 in 120,000 characters
    steps = [("chunk", {"content": p}) for p in pieces] + [("chunk", {}, "stop"), ("done",)]
    return steps, "".join(pieces)


async def test_huge_deltas_are_split_and_the_link_stays(nursery, upstream):
    """Concurrent streams of 32 KiB deltas, some single deltas larger than a frame, with a 256 KiB
    frame limit on both sides: every stream completes with its exact text on the same link."""
    edge = await start_edge(nursery, edge_config(max_frame_bytes=SMALL_FRAME))
    node = await start_node(nursery, edge, [model("m", upstream, max_concurrency=8)], max_frame_bytes=SMALL_FRAME)
    edge_link = edge.edge.runs.links["n1"]
    await eventually(lambda: edge.link_url in node.agent.links, what="node has the welcome")
    node_link = node.agent.links[edge.link_url]
    scripts = {}

    def script(body):
        steps, text = huge_deltas_script(len(scripts))
        scripts[body["messages"][0]["content"]] = text
        return steps

    upstream.script_for("m-target", script)
    results: dict[str, str] = {}

    async def one(client, name: str) -> None:
        r = await client.post("/v1/chat/completions", json={**STREAM, "messages": [{"role": "user", "content": name}]})
        assert r.status_code == 200
        chunks = [msgspec.json.decode(e) for e in sse_events(r.content)[:-1]]
        assert all("error" not in c for c in chunks), chunks[-1]
        results[name] = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])

    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            for i in range(4):
                clients.start_soon(one, client, f"client{i}")
    assert results == scripts
    assert edge.edge.runs.links["n1"] is edge_link and not edge_link.closed
    assert node.agent.links[edge.link_url] is node_link
    await settled(edge, node.agent)


async def test_tool_calls_too_large_for_a_frame_fail_that_run_alone(nursery, upstream):
    """A complete event whose tool calls cannot fit one frame becomes that run's error
    ("run output too large to relay"); other runs and the link are untouched."""
    edge = await start_edge(nursery, edge_config(max_frame_bytes=SMALL_FRAME))
    models = [model("m", upstream, max_concurrency=4), model("big", upstream, max_concurrency=4)]
    node = await start_node(nursery, edge, models)  # the edge's limit (in its welcome) is the smaller one
    link = edge.edge.runs.links["n1"]
    arguments = '{"x": "' + "a" * (SMALL_FRAME + 1000) + '"}'
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    upstream.script_for("big-target", [("chunk", {"tool_calls": [call]}), ("chunk", {}, "tool_calls"), ("done",)])
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={**STREAM, "model": "big", "tools": tools})
            ok = await client.post("/v1/chat/completions", json={**STREAM, "stream": False, "max_tokens": 3})
    assert "run output too large to relay" in r.text
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    assert edge.edge.runs.links["n1"] is link and not link.closed
    await settled(edge, node.agent)


async def test_tunnel_body_is_split_under_the_frame_limit(nursery, upstream):
    """A passthrough response far larger than the frame limit arrives byte-identical;
    the node splits body reads that would not fit one frame."""
    limit = 64 * 1024  # httpx reads up to 64 KiB at once: some reads must be split
    edge = await start_edge(
        nursery, edge_config(max_frame_bytes=limit, models=[{"name": "raw", "response_mode": "passthrough"}])
    )
    node = await start_node(
        nursery, edge, [model("raw", upstream, target="raw-target", passthrough=True)], max_frame_bytes=limit
    )
    link = edge.edge.runs.links["n1"]
    whole = b'{"data": "' + bytes(random.Random(1).choices(b"abcdefghij", k=3_000_000)) + b'"}'
    upstream.script_for("raw-target", [("status", 200, whole)])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.post("/v1/chat/completions", json={"model": "raw", "messages": STREAM["messages"]})
    assert r.status_code == 200 and r.content == whole
    assert edge.edge.runs.links["n1"] is link and not link.closed
    await settled(edge, node.agent)


async def test_outbox_frames_stay_under_the_budget_with_any_text():
    """Unit: random ASCII and multi-byte deltas, tiny to several frames large, through RunSink and
    the outbox: every encoded frame is within the budget, and each run's text and seqs are intact."""
    from node.outbox import Outbox, frame_budget

    rng = random.Random(9)
    budget = frame_budget(64 * 1024, 0)
    outbox = Outbox(budget, max_events=1 << 20, max_bytes=1 << 40)  # no sender here: nothing may wait
    link = SimpleNamespace(outbox=outbox, _uncount=lambda run_id: None, progress_parts=0)
    sinks = {f"r{i}": RunSink(link, f"r{i}") for i in range(5)}
    texts = {run_id: [] for run_id in sinks}
    alphabet = ["a", "Z ", "é", "€", "😀", "\x00", "\u2028"]
    for _ in range(400):
        run_id = rng.choice(list(sinks))
        n = rng.choice([1, 10, 1000, 20_000, 70_000, 200_000])
        text = "".join(rng.choice(alphabet) for _ in range(min(n, 50))) * max(n // 50, 1)
        texts[run_id].append(text)
        await sinks[run_id].delta(text)
    big_call = ToolCall(id="c", function=ToolCallFunction(name="f", arguments="x" * budget))
    await sinks["r0"].complete("tool_calls", [big_call], Usage(prompt_tokens=1))
    await sinks["r1"].complete("stop", [ToolCall(id="c", function=ToolCallFunction(name="f", arguments="{}"))])
    frames = outbox.take()
    assert len(frames) > 1
    got: dict[str, list] = {run_id: [] for run_id in sinks}
    for frame in frames:
        data = encode_frame(frame)
        assert len(data) <= budget, (len(data), budget)
        for event in decode_frame(data).events:
            got[event.run_id].append(event)
    for run_id, events in got.items():
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert "".join(e.text for e in events if e.type == "delta") == "".join(texts[run_id])
    assert got["r0"][-1].type == "error" and got["r0"][-1].text == "run output too large to relay"
    assert got["r1"][-1].type == "complete" and got["r1"][-1].tool_calls[0].function.arguments == "{}"
    assert isinstance(frames[0], Events)


def test_deltas_joined_while_the_outbox_waits_are_at_most_64_an_event():
    """Unit: deltas queued while the sender has not taken the last one join it (one event), but
    at most JOINED_PARTS: the edge holds a run to its key's daily budget event by event, and a
    model server answering at once had thousands joined (a run 1,000 and more past the bound)."""
    from node.agent import JOINED_PARTS
    from node.outbox import Outbox

    outbox = Outbox(1 << 30, max_events=1 << 20, max_bytes=1 << 40)
    sink = RunSink(SimpleNamespace(outbox=outbox, progress_parts=0), "r1")
    for _ in range(200):
        sink.delta_nowait("ab", 1)
    events = [e for f in outbox.take() for e in f.events]
    assert [e.parts for e in events] == [JOINED_PARTS] * 3 + [8]
    assert "".join(e.text for e in events) == "ab" * 200


def test_an_outbox_batch_past_the_events_bound_goes_in_several_frames():
    """Unit: an edge refuses a frame of more than MAX_FRAME_EVENTS events (and closes the link),
    so a batch larger than that (a node configured with a large max_pending_events, its runs
    each adding one past it) goes in several frames, in order, each one the edge reads."""
    from node.outbox import Outbox
    from proto.frames import MAX_FRAME_EVENTS

    outbox = Outbox(1 << 30, max_events=1 << 20, max_bytes=1 << 40)
    count = MAX_FRAME_EVENTS + 10
    for i in range(count):
        outbox.event_nowait(RunEvent(run_id="r", seq=i + 1, type="delta", text="x"), 40)
    frames = outbox.take()
    assert [len(f.events) for f in frames] == [MAX_FRAME_EVENTS, 10]
    seqs = [e.seq for f in frames for e in decode_frame(encode_frame(f)).events]
    assert seqs == list(range(1, count + 1))


def test_an_outbox_batch_past_the_tool_calls_bound_goes_in_several_frames():
    """Unit: an edge refuses a frame of more than MAX_FRAME_TOOL_CALLS tool calls (a frame of
    empty calls took an edge to 1.85 GB), so runs that end together with many calls each go in
    several frames, in order, each one the edge reads, whatever their bytes."""
    from node.agent import tool_calls_bytes
    from node.outbox import Outbox
    from proto.frames import MAX_FRAME_TOOL_CALLS, MAX_TOOL_CALLS

    outbox = Outbox(1 << 30, max_events=1 << 20, max_bytes=1 << 40)
    calls = [ToolCall(id=f"c{i}", function=ToolCallFunction(name="f", arguments="{}")) for i in range(MAX_TOOL_CALLS)]
    for run in range(9):
        outbox.event_nowait(RunEvent(run_id=f"r{run}", seq=1, type="delta", text="x"), 40)
        event = RunEvent(run_id=f"r{run}", seq=2, type="complete", finish_reason="tool_calls", tool_calls=calls)
        outbox.event_nowait(event, 128 + tool_calls_bytes(calls))
    frames = [decode_frame(encode_frame(f)) for f in outbox.take()]
    per_frame = [sum(len(e.tool_calls or ()) for e in f.events) for f in frames]
    assert max(per_frame) <= MAX_FRAME_TOOL_CALLS and sum(per_frame) == 9 * MAX_TOOL_CALLS, per_frame
    assert [(e.run_id, e.seq) for f in frames for e in f.events] == [(f"r{r}", s) for r in range(9) for s in (1, 2)]


async def test_a_full_outbox_pauses_the_upstream_read_and_nothing_is_lost(upstream):
    """The openai adapter streaming 3,000 tokens (reasoning, then content) into a tiny outbox
    that a slow sender empties every 5 ms: the relay stops reading the model server whenever the
    outbox is full and resumes where it stopped; the text arrives whole and in order, seqs have
    no gap, and the run completes."""
    from node.adapters import Counters
    from node.adapters.openai import OpenAIAdapter
    from node.outbox import Outbox, frame_budget
    from scripts.upstream import text_script, words

    tokens, thoughts = words(2000), words(1000, "think")
    upstream.script_for("m-target", text_script(tokens, reasoning=thoughts))
    outbox = Outbox(frame_budget(64 * 1024, 0), max_events=4, max_bytes=512)
    link = SimpleNamespace(outbox=outbox, _uncount=lambda run_id: None, progress_parts=0)
    sink = RunSink(link, "r1")
    pauses = 0
    room = outbox.room

    async def counted_room() -> None:
        nonlocal pauses
        pauses += 1
        await room()

    outbox.room = counted_room  # type: ignore[method-assign]
    events = []

    async def slow_sender() -> None:
        while True:
            await outbox.wait()
            await trio.sleep(0.005)
            for frame in outbox.take():
                events.extend(frame.events)
            outbox.done()

    adapter = OpenAIAdapter(model("m", upstream), Counters())
    request = RunRequest(run_id="r1", model="m", target="m-target", timeout_s=60, request=dict(STREAM))
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_sender)
            await adapter.run(request, sink)
            await outbox.flushed()
            nursery.cancel_scope.cancel()
    await adapter.aclose()
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert "".join(e.text for e in events if e.type == "reasoning_delta") == "".join(thoughts)
    assert "".join(e.text for e in events if e.type == "delta") == "".join(tokens)
    assert events[-1].type == "complete" and events[-1].finish_reason == "stop"
    assert pauses > 0


def test_placed_hints_are_bounded_and_fit_the_frame_budget():
    """Unit: ``placed`` hints wait in a bounded queue (the oldest dropped), each fits the frame
    budget when encoded (a chain that would not is never queued), and go out with the next batch."""
    from node.outbox import MAX_HINTS, Outbox, frame_budget

    budget = frame_budget(8 * 1024, 0)
    outbox = Outbox(budget, max_events=16)
    for i in range(MAX_HINTS + 10):
        outbox.hint(Placed(model="m", prefix=[i, (1 << 60) - 1]))
    outbox.hint(Placed(model="m", prefix=[(1 << 60) - 1] * 2048))  # 18 KB encoded: over the budget
    frames = outbox.take()
    assert [f.prefix[0] for f in frames] == list(range(10, MAX_HINTS + 10))
    assert all(len(encode_frame(f)) <= budget for f in frames)
    most = (budget - 200) // 9
    outbox.hint(Placed(model="m", prefix=[(1 << 60) - 1] * most))
    (frame,) = outbox.take()
    assert len(encode_frame(frame)) <= budget
    assert outbox.take() == []


async def test_the_node_answers_each_cancel_that_names_its_model(nursery, upstream):
    """An edge counts a cancelled run's slot as taken until the node answers the cancel:
    the node answers every cancel naming a model it serves with that model's grant and the
    run in ``freed``: of a run it has, of one that has not arrived (cancels overtake runs),
    each once; and a cancel naming no model (an older edge), another model or a run id longer than
    any edge's, not at all. However many it answers at once, the grant fits the smallest frame
    an edge takes."""
    upstream.script_for("m-target", [("chunk", {"content": "a"}), ("hang",)])
    answers: list = []
    checked = trio.Event()

    async def handler(request) -> None:
        ws = await request.accept()
        hello = decode_frame(await ws.get_message())
        assert hello.answers_cancels
        await ws.send_message(encode_frame(Welcome(edge_id="e", protocol=PROTOCOL_VERSION, ping_interval_s=5.0)))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        await ws.send_message(
            encode_frame(RunRequest(run_id="r1", model="m", target="m-target", request=body, timeout_s=60))
        )
        await upstream.wait_requests(1)
        for cancel in (
            CancelRun(run_id="r1", model="m"),
            CancelRun(run_id="early", model="m"),
            CancelRun(run_id="old"),
            CancelRun(run_id="other", model="not-served"),
            CancelRun(run_id="x" * 100_000, model="m"),  # (no run of an edge's: not answered, nor kept for it)
            CancelRun(run_id="last", model="m"),
        ):
            await ws.send_message(encode_frame(cancel))
        while sum(len(a) for a in answers) < 3:
            frame = decode_frame(await ws.get_message())
            if isinstance(frame, Grant) and frame.freed:
                assert frame.model == "m" and frame.slots == 1
                answers.append(frame.freed)
        with trio.move_on_after(0.3):  # nothing more
            while True:
                frame = decode_frame(await ws.get_message())
                assert not (isinstance(frame, Grant) and frame.freed), frame
        checked.set()
        await trio.sleep_forever()

    server = await nursery.start(
        lambda task_status: serve_websocket(handler, "127.0.0.1", 0, None, task_status=task_status)
    )
    agent = NodeAgent(
        node_config([f"ws://127.0.0.1:{server.port}/v1/node/link"], [model("m", upstream, max_concurrency=1)])
    )
    nursery.start_soon(agent.serve)
    with trio.fail_after(BOUND):
        await checked.wait()
        await upstream.records[0].finished.wait()
    assert sorted(run for a in answers for run in a) == ["early", "last", "r1"]
    most = Grant(model="m" * MAX_MODEL_NAME, slots=2**31, seq=2**62, freed=["x" * MAX_ANSWERED_ID] * MAX_FREED)
    assert len(encode_frame(most)) <= MIN_FRAME_BYTES
    assert upstream.records[0].aborted
