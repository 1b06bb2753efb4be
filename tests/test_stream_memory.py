"""What an open stream keeps of its request on the edge: a coding agent's prompt can be
megabytes, a client SDK's headers a few KB, and every stream holds its share for as long as
it is open."""

from __future__ import annotations

import gc
import tracemalloc

import httpx
import trio

from scripts.upstream import words
from tests.conftest import BOUND, EdgeHandle, edge_config, eventually, model, start_edge, start_node

STREAMS = 4


def _edge_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """Memory allocated under the edge's own code (not the node's, which runs in this process too).
    Not the edge's hooks into hypercorn's and h11's own work (edge.connection): the one around h11's
    reading of each request put an edge frame under all h11 makes of it, held by hypercorn as
    before (1.2 KB a stream more, measured, with nothing more allocated)."""
    total = 0
    for stat in snapshot.statistics("traceback"):
        files = [frame.filename for frame in stat.traceback if not frame.filename.endswith("/edge/connection.py")]
        if any("/edge/" in f for f in files) and not any("/node/" in f for f in files):
            total += stat.size
    return total


async def _held_per_stream(edge: EdgeHandle, body: dict, headers: dict[str, str] | None = None) -> float:
    """Open STREAMS streams of ``body``; once each has its first bytes, what the edge's code
    holds (tracemalloc), per stream."""
    first_bytes = 0
    tracemalloc.start(25)
    try:
        before = _edge_bytes(tracemalloc.take_snapshot())
        # (tracing every allocation 25 frames deep makes the edge several times slower: 4 streams
        # of 2,000 messages took over 20 s on a machine loaded by other work)
        with trio.fail_after(3 * BOUND):
            async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND) as client, trio.open_nursery() as streams:

                async def one() -> None:
                    nonlocal first_bytes
                    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                        assert r.status_code == 200
                        async for _ in r.aiter_bytes():
                            first_bytes += 1
                            await trio.sleep_forever()

                for _ in range(STREAMS):
                    streams.start_soon(one)
                await eventually(lambda: first_bytes == STREAMS, "every stream's first bytes")
                held = _edge_bytes(tracemalloc.take_snapshot()) - before
                streams.cancel_scope.cancel()
    finally:
        tracemalloc.stop()
    return held / STREAMS


async def _hanging_edge(nursery, upstream) -> EdgeHandle:
    """An edge whose model sends one token, then nothing, until the client leaves."""
    upstream.script_for("m-target", [*(("chunk", {"content": t}) for t in words(1)), ("hang",)])
    # Pings far apart: tracing every allocation of megabytes of prompts can keep a slow machine
    # busy for longer than the tests' usual 3 s ping timeout, which is not what is measured here.
    edge = await start_edge(nursery, edge_config(ping_interval_s=BOUND))
    await start_node(nursery, edge, [model("m", upstream)])
    return edge


async def test_an_open_stream_keeps_one_copy_of_its_prompt_not_the_request_bytes(nursery, upstream):
    """Four streams with a 1 MB prompt each, open after their first token: the edge holds one
    copy of each prompt (the encoded run kept to fail over), not also the decoded request (a
    request without tools never needs it again) or the HTTP body it was read from."""
    prompt = 1_000_000
    edge = await _hanging_edge(nursery, upstream)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "y" * prompt}]}
    per_stream = await _held_per_stream(edge, body)
    # Its msgpack encoding, whose buffer msgspec allocates at 1.5x what it writes (traced as
    # allocated; only what is written is resident): 1.6x measured. With the decoded request
    # kept too, 2.6x; with the request's bytes as well, 3.6x.
    assert prompt < per_stream < 2 * prompt, per_stream


async def test_an_open_stream_keeps_none_of_its_request_headers(nursery, upstream):
    """Streams whose requests carry 50 headers of 1 KB each (a client SDK sends a dozen or
    more), open after their first token, hold about what streams without them hold: not
    those 50 KB each."""
    edge = await _hanging_edge(nursery, upstream)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    headers = {f"x-client-extra-{i}": f"{i:04d}" + "v" * 1020 for i in range(50)}
    plain = await _held_per_stream(edge, body)
    with_headers = await _held_per_stream(edge, body, headers)
    assert with_headers - plain < 10_000, (with_headers, plain)  # measured: <= 0; +51 KB with them kept


async def test_an_idle_stream_stays_under_20_kb_of_edge_memory(nursery, upstream):
    """What one open, quiet stream costs the edge decides how many a process holds (the hot-path
    issue asks 10,000 at 20 KB or less each): the objects allocated under the edge's code for a
    stream waiting on its next token, after a warm-up (first-use caches), stay under 20 KB.
    Measured 18-19 KB here; scripts/bench.py --idle-streams 10000 measures the RSS (19.6 KB).
    The first rounds after the warm-up vary (18-23 KB, on this code and the code before this
    stop's alike: caches still filling), so it is the least of three rounds; a cost every stream
    pays shows in each of them."""
    edge = await _hanging_edge(nursery, upstream)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    await _held_per_stream(edge, body)  # warm-up
    rounds = [await _held_per_stream(edge, body) for _ in range(3)]
    assert min(rounds) < 20_000, rounds


async def test_a_request_s_objects_are_freed_as_it_ends_not_by_the_cyclic_collector(nursery, upstream):
    """The server's disconnect hook held each request's exchange, and the exchange held the
    server's stream: a cycle, so every request's objects (its task, coroutine, queue, about 60)
    stayed until the cyclic collector ran (an outside soak saw the edge grow 5.5 MB per 1,000
    requests before its first full collection). With the collector off, 40 requests (streamed
    and not, one refused) leave no exchange behind."""
    from edge.openai.exchange import Exchange

    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", upstream)])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    gc.collect()
    gc.disable()
    try:
        with trio.fail_after(BOUND):
            async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND) as client:
                for i in range(40):
                    r = await client.post("/v1/chat/completions", json={**body, "stream": i % 2 == 0})
                    assert r.status_code == 200
                r = await client.post("/v1/chat/completions", json={**body, "model": "nope"})
                assert r.status_code == 404
            await trio.sleep(0.1)  # (the last request's task ends after its answer went)
            left = [o for o in gc.get_objects() if isinstance(o, Exchange)]
    finally:
        gc.enable()
    assert len(left) <= 1, f"{len(left)} exchanges of ended requests still held"


async def test_requests_refused_for_their_key_leave_nothing_behind(nursery):
    """A 401 raised one error object again and again (found as this stop's fixes were checked):
    each raise grew its traceback, which held every refused request's exchange for good; and a
    refusal kept in a local as it was raised made a cycle with its traceback, freed only by the
    cyclic collector. 60 refusals (wrong keys, none, a thinking budget past max_tokens) leave
    no exchange behind, the cyclic collector off."""
    from edge.openai.exchange import Exchange

    edge = await start_edge(nursery, edge_config(api_keys=["sk-right"]))
    gc.collect()
    gc.disable()
    try:
        with trio.fail_after(BOUND):
            async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND) as client:
                thinking = {"type": "enabled", "budget_tokens": 2048}  # (past max_tokens: refused)
                budget = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
                for i in range(60):
                    if i % 3 == 2:  # (the Messages API refuses the budget the same way)
                        headers = {"authorization": "Bearer sk-right"}
                        r = await client.post("/v1/messages", json={**budget, "thinking": thinking}, headers=headers)
                        assert r.status_code == 400, r.text
                        continue
                    headers = {"authorization": "Bearer sk-wrong"} if i % 3 else {}
                    r = await client.post("/v1/chat/completions", json={"model": "m"}, headers=headers)
                    assert r.status_code == 401
            await trio.sleep(0.1)
            left = [o for o in gc.get_objects() if isinstance(o, Exchange)]
    finally:
        gc.enable()
    assert len(left) <= 1, f"{len(left)} exchanges of refused requests still held"


async def test_an_open_stream_without_tools_keeps_no_decoded_request(nursery, upstream):
    """A request without tools sends every run the body encoded once: neither its decoded JSON
    nor its validated messages are kept for as long as the stream lasts. Streams of 2,000 short
    messages, as a long conversation has, held 1,047 KB each; now 207 KB (the encoded run)."""
    edge = await _hanging_edge(nursery, upstream)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(2_000)]
    body = {"model": "m", "stream": True, "messages": messages}
    per_stream = await _held_per_stream(edge, body)
    assert per_stream < 400_000, per_stream


async def test_an_open_passthrough_stream_keeps_one_copy_of_its_body(nursery, upstream):
    """A passthrough stream (its model's response_mode) held its request's bytes and its decoded
    request besides the body it sent for as long as it lasted: 30 open streams of 4 MB took
    534 MB against 417 (an outside re-audit). It holds the body it sent, as a chat stream holds
    its encoded run."""
    prompt = 1_000_000
    upstream.script_for("m-target", [("raw", b'data: {"choices": []}\n\n'), ("hang",)])
    edge = await start_edge(
        nursery, edge_config(ping_interval_s=BOUND, models=[{"name": "m", "response_mode": "passthrough"}])
    )
    await start_node(nursery, edge, [model("m", upstream, passthrough=True)])
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "y" * prompt}]}
    per_stream = await _held_per_stream(edge, body)
    assert prompt < per_stream < 2 * prompt, per_stream
