"""A node holding a valid token cannot cost the edge unbounded CPU or memory: a flood of
events for no run closes its link, events with no output are no progress, and nodes that
link again and again with new model names do not grow /metrics."""

from __future__ import annotations

import os
import re

import httpx
import structlog
import trio
from trio_websocket import ConnectionClosed

from edge.metrics import MAX_MODEL_LABELS
from edge.runs.link import STRAY_EVENTS
from proto import (
    PROTOCOL_VERSION,
    CancelRun,
    Events,
    Grant,
    Hello,
    ModelInfo,
    Ping,
    Pong,
    RunEvent,
    RunRequest,
    decode_frame,
    encode_frame,
)
from proto.wsframes import binary_head, xor_mask
from scripts.hostile_link import BINARY, flood, frame_header
from scripts.hostile_link import open_link as open_raw_link
from tests.conftest import BOUND, TOKEN, edge_config, eventually, http, model, settled, start_edge, start_node
from tests.test_link_safety import hello, open_link

ASK = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def masked_frame(message: bytes) -> bytes:
    """``message`` as a node's websocket sends it: one final binary frame, masked."""
    key = os.urandom(4)
    return binary_head(len(message), masked=True) + key + xor_mask(message, key)


def raw_frame(frame) -> bytes:
    payload = encode_frame(frame)
    return frame_header(BINARY, len(payload)) + payload


async def serving(edge) -> int:
    async with http(edge) as client:
        return (await client.post("/v1/chat/completions", json=ASK)).status_code


# -- finding 1: events for runs the edge does not have ------------------------------------


async def test_a_flood_of_events_for_no_run_closes_that_link_and_the_edge_serves_on(nursery):
    """A node sending frames of events for run ids the edge never sent cost the edge ~0.25 us
    each, 2 million a second, for as long as it liked. Past STRAY_EVENTS in 10 s its link is
    closed (1008, the reason named, a warning logged); the edge serves other nodes' clients."""
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m")])
    events = [RunEvent(run_id=f"never-sent-{i}", seq=1, type="delta", text="x") for i in range(1000)]
    data = raw_frame(Events(events=events))
    budget = 200 * len(data)  # 200,000 events: 20 times what it may send

    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        stream, frames = await open_raw_link(edge.port, TOKEN)
        async with stream:
            result = await flood(stream, frames, iter(lambda: data, None), budget)
        assert result.cut and result.sent < budget, result
        assert result.close_code == 1008, result
        await eventually(lambda: "hostile" not in edge.edge.runs.links, what="the flooding link gone")
        assert await serving(edge) == 200
    flooded = [e for e in logs if e["event"].startswith("node flooded its link")]
    assert flooded and flooded[0]["node_id"] == "hostile" and f"over {STRAY_EVENTS} events" in flooded[0]["error"]


async def test_late_events_for_200_cancelled_streams_keep_the_link(nursery):
    """200 streams cancelled at once by their clients, on a node that lags: it still sends 60
    deltas for each (12,000 events for runs the edge has ended, past STRAY_EVENTS). Those are
    what a cancel leaves on the wire, not a flood: the link stays."""
    edge = await start_edge(nursery)
    streams = 200
    ids: list[str] = []

    async with trio.open_nursery() as inner:
        stream, ws = await open_link(edge, "lagging", nursery=inner)
        async with stream:
            with trio.fail_after(BOUND):
                await hello(ws, "lagging", capacity=256)
                link = edge.edge.runs.links["lagging"]
                started = trio.Semaphore(0)

                async def client(client: httpx.AsyncClient) -> None:
                    async with client.stream("POST", "/v1/chat/completions", json={**ASK, "stream": True}) as r:
                        async for _ in r.aiter_bytes():
                            started.release()
                            await trio.sleep_forever()

                limits = httpx.Limits(max_connections=streams + 8)
                async with http(edge, limits=limits) as c, trio.open_nursery() as clients:
                    for _ in range(streams):
                        clients.start_soon(client, c)
                    while len(ids) < streams:
                        frame = decode_frame(await ws.get_message())
                        if isinstance(frame, RunRequest):
                            ids.append(frame.run_id)
                        elif isinstance(frame, Ping):  # (as a node does: 200 requests on a loaded machine
                            await ws.send_message(encode_frame(Pong(ts=frame.ts)))  # took past its 3 s)
                    first = [RunEvent(run_id=run_id, seq=1, type="delta", text="a") for run_id in ids]
                    await ws.send_message(encode_frame(Events(events=first)))
                    for _ in range(streams):
                        await started.acquire()
                    clients.cancel_scope.cancel()  # every client leaves at once
                cancelled = set()
                while len(cancelled) < streams:
                    frame = decode_frame(await ws.get_message())
                    if isinstance(frame, CancelRun):
                        cancelled.add(frame.run_id)
                    elif isinstance(frame, Ping):
                        await ws.send_message(encode_frame(Pong(ts=frame.ts)))
                for seq in range(2, 62):
                    late = [RunEvent(run_id=run_id, seq=seq, type="delta", text="b") for run_id in ids]
                    await ws.send_message(encode_frame(Events(events=late)))
                await ws.send_message(encode_frame(Ping(ts=7.0)))
                while not isinstance(frame := decode_frame(await ws.get_message()), Pong) or frame.ts != 7.0:
                    if isinstance(frame, Ping):  # (every late event was read before this pong came)
                        await ws.send_message(encode_frame(Pong(ts=frame.ts)))
                assert edge.edge.runs.links.get("lagging") is link
        inner.cancel_scope.cancel()


async def streams_left_at_once(edge, streams: int) -> None:
    """Open ``streams`` long streams; once each has its first bytes, every client leaves at once."""
    started = trio.Semaphore(0)

    async def client(client: httpx.AsyncClient) -> None:
        body = {**ASK, "stream": True, "max_tokens": 100_000}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                started.release()
                await trio.sleep_forever()

    async with http(edge, limits=httpx.Limits(max_connections=streams + 8)) as c, trio.open_nursery() as clients:
        for _ in range(streams):
            clients.start_soon(client, c)
        for _ in range(streams):
            await started.acquire()
        await trio.sleep(0.2)
        clients.cancel_scope.cancel()


async def test_200_streams_of_a_real_node_cancelled_at_once_keep_its_link(nursery):
    """The same with a real node: 200 streams of 200 tokens a second, every client gone at
    once; the node's link is the one it had, and it serves the next request."""
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("m", tokens_per_s=200.0, max_concurrency=256)])
    link = edge.edge.runs.links["n1"]
    streams = 200
    with trio.fail_after(BOUND):
        await streams_left_at_once(edge, streams)
        await settled(edge, node.agent)
        await trio.sleep(0.5)  # what was on the wire has come
        assert edge.edge.runs.links.get("n1") is link
        assert await serving(edge) == 200


async def test_streams_whose_events_never_stop_coming_are_cancelled_when_their_clients_leave(nursery):
    """200 streams whose node had their next events there each time the edge looked never
    waited for one, and once their clients had left, each write went through the server's
    shielded send: their requests never saw the cancel their clients' departure made, and the
    runs went on, generating for no one, for as long as the node sent (35 to 141 of 200
    still going 8 s later, in 4 runs of 4). The node is told to cancel every one, and they
    are released."""
    edge = await start_edge(nursery)
    streams = 200
    async with trio.open_nursery() as inner:
        stream, ws = await open_link(edge, "fast", nursery=inner)
        async with stream:
            with trio.fail_after(BOUND):
                await hello(ws, "fast", capacity=streams)
                runs: list[str] = []
                cancelled: set[str] = set()
                all_asked, all_cancelled = trio.Event(), trio.Event()

                async def read() -> None:
                    # (Pings go unanswered: the events keep the link alive, and generate() is
                    # the only writer to the socket.)
                    while True:
                        frame = decode_frame(await ws.get_message())
                        if isinstance(frame, RunRequest):
                            runs.append(frame.run_id)
                            if len(runs) == streams:
                                all_asked.set()
                        elif isinstance(frame, CancelRun):
                            cancelled.add(frame.run_id)
                            if len(cancelled) == streams:
                                all_cancelled.set()

                async def generate() -> None:
                    # A token for every run in one frame, written straight to the socket, then
                    # two passes through the scheduler, as a websocket write takes (in step with
                    # the edge's writes: one pass or three did not keep a run's events there).
                    await all_asked.wait()
                    for seq in range(1, 1_000_000):
                        events = [
                            RunEvent(run_id=r, seq=seq, type="delta", text="tok ") for r in runs if r not in cancelled
                        ]
                        if not events:
                            return
                        data = masked_frame(encode_frame(Events(events=events)))
                        try:
                            sent = os.write(stream.socket.fileno(), data)
                        except BlockingIOError:
                            sent = 0
                        if sent < len(data):
                            await stream.send_all(data[sent:])
                        for _ in range(2):
                            await trio.lowlevel.checkpoint()

                inner.start_soon(read)
                inner.start_soon(generate)
                await streams_left_at_once(edge, streams)
                await all_cancelled.wait()
            inner.cancel_scope.cancel()
    await eventually(lambda: edge.edge.runs.in_flight == 0, what="the runs released")


# -- finding 2: events with no output are no progress --------------------------------------


async def test_empty_deltas_do_not_keep_a_run_alive(nursery):
    """A node answering a run with an empty delta every 0.1 s kept it open until its whole-run
    deadline (30 minutes by default), the client waiting for nothing. Empty deltas are no
    progress: after wait_timeout_s of them the run fails with an OpenAI-shaped error, and the
    node is told to cancel it."""
    edge = await start_edge(nursery, edge_config(wait_timeout_s=1.0, run_timeout_s=600.0))

    async with trio.open_nursery() as inner:
        stream, ws = await open_link(edge, "empty", nursery=inner)
        async with stream:
            with trio.fail_after(BOUND):
                await hello(ws, "empty")
                cancelled = trio.Event()

                async def node() -> None:
                    run_id = None
                    seq = 0
                    while True:
                        with trio.move_on_after(0.1):
                            frame = decode_frame(await ws.get_message())
                            if isinstance(frame, RunRequest):
                                run_id = frame.run_id
                            elif isinstance(frame, Ping):
                                await ws.send_message(encode_frame(Pong(ts=frame.ts)))
                            elif isinstance(frame, CancelRun) and frame.run_id == run_id:
                                cancelled.set()
                                return
                        if run_id is not None:
                            seq += 1
                            event = RunEvent(run_id=run_id, seq=seq, type="delta")
                            await ws.send_message(encode_frame(Events(events=[event])))

                inner.start_soon(node)
                start = trio.current_time()
                async with http(edge) as client:
                    r = await client.post("/v1/chat/completions", json=ASK)
                waited = trio.current_time() - start
                await cancelled.wait()
            inner.cancel_scope.cancel()
    assert r.status_code >= 500, r.text
    error = r.json()["error"]
    assert error["message"] == "run timed out" and error["type"], error
    assert waited < 10, waited


async def test_a_node_answering_every_run_with_an_empty_delta_is_routed_around(nursery):
    """A node that answers every run at once with an empty delta, then nothing, had each run
    count as started: the stall watch left it alone and its runs hung until wait_timeout_s.
    An empty delta is no start: its runs move to the node that serves, and complete."""
    edge = await start_edge(nursery, edge_config(stall_after_s=0.5, wait_timeout_s=600.0, routing="least_loaded"))
    await start_node(nursery, edge, [model("m", max_concurrency=8)])
    assert await serving(edge) == 200  # the honest node's time to first event is known

    async with trio.open_nursery() as inner:
        stream, ws = await open_link(edge, "empty", nursery=inner)
        async with stream:
            with trio.fail_after(BOUND):
                await hello(ws, "empty", capacity=8)
                sent: list[str] = []

                async def node() -> None:
                    while True:
                        frame = decode_frame(await ws.get_message())
                        if isinstance(frame, RunRequest):
                            sent.append(frame.run_id)
                            event = RunEvent(run_id=frame.run_id, seq=1, type="delta")
                            await ws.send_message(encode_frame(Events(events=[event])))
                        elif isinstance(frame, Ping):
                            await ws.send_message(encode_frame(Pong(ts=frame.ts)))

                inner.start_soon(node)
                statuses: list[int] = []

                async def ask() -> None:
                    statuses.append(await serving(edge))

                async with trio.open_nursery() as clients:
                    for _ in range(6):
                        clients.start_soon(ask)
            inner.cancel_scope.cancel()
    assert sent, "no run went to the node that sends empty deltas"
    assert statuses == [200] * 6


# -- finding 3: model names in /metrics ----------------------------------------------------


async def test_nodes_relinking_with_new_model_names_do_not_grow_metrics(nursery):
    """A node that links again and again, each time with new model names (a client asking
    for each), added series to /metrics for every name, for the edge's life. A configured
    model and MAX_MODEL_LABELS advertised names keep labels of their own; the rest are counted
    under "other". But a model a node links with later takes the label of one no node serves
    any more (the oldest), whose series go: the first names held the labels for the edge's life,
    and every model linked after them was "other" (an outside audit)."""
    edge = await start_edge(nursery, edge_config(models=[{"name": "configured"}]))
    rounds, per_round = 3, 150
    with trio.fail_after(BOUND * 2):
        for round_ in range(rounds):
            names = [f"r{round_}-{i}" for i in range(per_round)]
            models = [ModelInfo(name=name, adapter="sim", target="t", max_concurrency=1) for name in names]

            async def link_once(models=models) -> None:
                async with trio.open_nursery() as inner:
                    stream, ws = await open_link(edge, "renamer", nursery=inner)
                    async with stream:
                        await ws.send_message(
                            encode_frame(Hello(node_id="renamer", protocol=PROTOCOL_VERSION, models=models))
                        )
                        await ws.get_message()  # welcome
                        await ws.send_message(encode_frame(Grant(model=models[0].name, slots=1, seq=1)))
                        await eventually(lambda: "renamer" in edge.edge.runs.links, what="renamer linked")
                        try:
                            await ws.aclose()
                        except ConnectionClosed:
                            pass
                    inner.cancel_scope.cancel()
                await eventually(lambda: "renamer" not in edge.edge.runs.links, what="renamer gone")

            await link_once()
        async with http(edge) as client:
            for round_ in range(rounds):
                for i in range(per_round):
                    r = await client.post("/v1/chat/completions", json={**ASK, "model": f"r{round_}-{i}"})
                    assert r.status_code == 503, r.text  # known, no node linked
            await client.post("/v1/chat/completions", json={**ASK, "model": "configured"})
            text = (await client.get("/metrics")).text
    labels = set(re.findall(r'iop_requests_total\{api="chat",model="([^"]+)"', text))
    assert "configured" in labels and "other" in labels
    assert len(labels - {"configured", "other"}) == MAX_MODEL_LABELS
    assert "r0-0" in labels  # the first names keep theirs
    assert (
        f'iop_requests_total{{api="chat",model="other",outcome="rejected_503"}} {rounds * per_round - MAX_MODEL_LABELS}.0'
        in text
    )
    node = await start_node(nursery, edge, [model("fresh")], node_id="later")
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            assert (await client.post("/v1/chat/completions", json={**ASK, "model": "fresh"})).status_code == 200
            text = (await client.get("/metrics")).text
    labels = set(re.findall(r'iop_requests_total\{api="chat",model="([^"]+)"', text))
    assert "fresh" in labels and "r0-0" not in labels and "r0-1" in labels
    assert len(labels - {"configured", "other"}) == MAX_MODEL_LABELS
    assert 'iop_runs_ended_total{api="chat",cause="complete",model="fresh"} 1.0' in text
    await settled(edge, node.agent)


async def test_a_node_of_many_models_costs_one_short_line_and_no_wake_per_model(nursery, monkeypatch):
    """A node of 1,024 models of 256 characters logged a 265 KB "node linked" line at each link
    (a relinking node: 11.8 MB of log a second), and one flipping its draining flag woke all
    1,024 models at each flip (0.9 ms of the edge's CPU a frame, thousands a second; an
    outside attack). The line names the first models and the count; a flip wakes only the
    models someone waits for (none here), and repeated grants wake no demand reporter."""
    from proto import Load

    edge = await start_edge(nursery)
    service = edge.edge.runs
    woken: list[str] = []
    wake = service._wake
    monkeypatch.setattr(service, "_wake", lambda model: (woken.append(model), wake(model)))
    names = [f"{i:04d}" + "m" * 252 for i in range(1024)]
    infos = [ModelInfo(name=name, adapter="sim", target="t", max_concurrency=1) for name in names]
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        stream, ws = await open_link(edge, "many", nursery=nursery)
        await ws.send_message(encode_frame(Hello(node_id="many", protocol=PROTOCOL_VERSION, models=infos)))
        await ws.get_message()  # welcome
        for i in range(200):
            await ws.send_message(encode_frame(Load(in_flight={}, draining=i % 2 == 0)))
            await ws.send_message(encode_frame(Grant(model=names[0], slots=1, seq=1)))
        await ws.send_message(encode_frame(Ping(ts=1.0)))
        while not isinstance(decode_frame(await ws.get_message()), Pong):
            pass
    linked = [e for e in logs if e["event"] == "node linked"]
    assert len(linked) == 1 and linked[0]["model_count"] == 1024
    assert linked[0]["models"] == names[:16]
    assert woken == []  # nobody waits for any of its models
    await stream.aclose()
