"""Production surface: keys and tokens, limits, health, metrics, deployment, drain, scale-out."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import h11
import httpx
import msgspec
import openai
import pytest
import structlog
import trio
import trustme

from edge.config import load_edge_config
from edge.errors import APIError
from edge.runs import Want
from iop.configfile import ConfigError
from proto import PROTOCOL_VERSION, Hello, ModelInfo, encode_frame
from scripts.upstream import text_script, words
from tests.conftest import (
    BOUND,
    TOKEN,
    edge_config,
    eventually,
    http,
    model,
    sdk,
    settled,
    start_edge,
    start_node,
    write_toml,
)
from tests.test_link import closed_by_edge, fake_node

MESSAGES = [{"role": "user", "content": "hi"}]
BODY = {"model": "m", "messages": MESSAGES, "max_tokens": 2}


async def test_api_keys_guard_every_v1_route_but_the_node_link(nursery, upstream):
    """With api_keys set, /v1/* needs a valid bearer key (401 in the OpenAI shape otherwise, saying
    whether none came, a wrong one, or a header with no Bearer key); the node link and /healthz do not. /metrics, whose series
    name every key and model, is an admin key's: with no admin_keys, a 403 to a client key (it
    was open: anyone read every key's usage)."""
    edge = await start_edge(nursery, edge_config(api_keys=["sk-one", "sk-two"]))
    await start_node(nursery, edge, [model("m", upstream)])  # links with its node token
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            # (Each says which it was, and how to send a key: a newcomer was told "invalid or missing".)
            for headers, said in (
                ({}, "Missing API key: send one as `Authorization: Bearer <key>`"),
                ({"Authorization": "Bearer sk-wrong"}, "Invalid API key"),
                ({"Authorization": "Basic sk-one"}, "The Authorization header holds no Bearer key"),
                ({"Authorization": "sk-one"}, "The Authorization header holds no Bearer key: send `Authorization: B"),
            ):
                for method, path in (
                    ("POST", "/v1/chat/completions"),
                    ("GET", "/v1/models"),
                    ("POST", "/v1/embeddings"),
                ):
                    r = await client.request(method, path, json=BODY, headers=headers)
                    assert r.status_code == 401, (path, headers)
                    assert r.json()["error"]["type"] == "authentication_error"
                    assert r.json()["error"]["message"].startswith(said), (path, r.text)
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/metrics")).status_code == 401
            r = await client.get("/metrics", headers={"Authorization": "Bearer sk-one"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled", r.text
        async with sdk(edge, api_key="sk-two") as client:
            reply = await client.chat.completions.create(**BODY)
            assert reply.choices[0].message.content == "tok0 tok1 "
        async with sdk(edge, api_key="sk-nope") as client:
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()


def test_api_keys_file_is_read_and_checked(tmp_path):
    """api_keys_file adds keys from a file; an unreadable file fails at start naming the key."""
    keys = tmp_path / "keys.txt"
    keys.write_text("# clients\nsk-a\n\nsk-b  # team b\n")
    cfg = write_toml(tmp_path / "edge.toml", {"api_keys": ["sk-inline"], "api_keys_file": str(keys)})
    assert load_edge_config(cfg).api_keys == ["sk-inline", "sk-a", "sk-b"]
    bad = write_toml(tmp_path / "bad.toml", {"api_keys_file": str(tmp_path / "missing.txt")})
    with pytest.raises(ConfigError, match="api_keys_file: cannot read"):
        load_edge_config(bad)


async def test_open_edge_on_a_public_address_warns(nursery):
    """An edge configured for a non-loopback address with no api_keys logs a loud warning at start."""
    with structlog.testing.capture_logs() as logs:
        await start_edge(nursery, edge_config(bind="0.0.0.0:8080"))  # served on loopback all the same
    assert any("EDGE IS OPEN" in e["event"] and e["log_level"] == "warning" for e in logs)


async def test_behind_trusted_proxies_the_access_line_names_the_client(nursery, upstream, tmp_path):
    """Behind nginx every client's peer is the proxy: with ``trusted_proxies`` the access
    line's ``client`` is the rightmost X-Forwarded-For address not itself trusted (what the
    client put on the left is not believed); without it, or from a peer not trusted, the
    header is ignored. An open edge behind proxies warns as an open edge on a public address."""
    with structlog.testing.capture_logs() as logs:
        edge = await start_edge(nursery, edge_config(trusted_proxies=["127.0.0.1", "198.51.100.0/24"]))
    assert any("EDGE IS OPEN: behind trusted_proxies" in e["event"] for e in logs)
    plain = await start_edge(nursery, edge_config())
    await start_node(nursery, [edge, plain], [model("m", upstream)])
    sent = [
        ("203.0.113.7", "203.0.113.7"),
        ("6.6.6.6, 203.0.113.7, 198.51.100.9", "203.0.113.7"),  # the client's own claim (left) is passed over
        ("203.0.113.7, not-an-address", "127.0.0.1"),  # a hop that is no address: the proxy is the client
        (None, "127.0.0.1"),
    ]
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        for target in (edge, plain):
            async with http(target) as client:
                for forwarded, _ in sent:
                    headers = {"x-forwarded-for": forwarded} if forwarded else {}
                    r = await client.post("/v1/chat/completions", json=BODY, headers=headers)
                    assert r.status_code == 200, r.text
                    assert (await client.get("/v1/models", headers=headers)).status_code == 200
            lines = 2 * len(sent) * (1 + (target is plain))
            await eventually(lambda lines=lines: sum(e["event"] == "request" for e in logs) == lines)
    lines = [e["client"] for e in logs if e["event"] == "request"]
    behind = [client for _, client in sent]
    assert lines[: 2 * len(sent)] == [c for c in behind for _ in range(2)], lines
    assert lines[2 * len(sent) :] == ["127.0.0.1"] * 2 * len(sent), lines
    with pytest.raises(ConfigError, match="trusted_proxies: 'nginx' is not an IP address or network"):
        load_edge_config(write_toml(tmp_path / "edge.toml", {"trusted_proxies": ["10.0.0.0/8", "nginx"]}))


async def test_an_open_edge_bound_public_by_the_command_line_warns(tmp_path):
    """`iop edge --bind 0.0.0.0:P` and hypercorn's own `--bind` with no api_keys: the
    warning comes (at start, or at the first API request under hypercorn, which tells
    the app no address); both said nothing before."""
    from scripts.stack import free_port

    cfg = write_toml(tmp_path / "edge.toml", {"node_token": TOKEN})
    hypercorn = os.path.join(os.path.dirname(sys.executable), "hypercorn")
    for name, argv in (
        ("iop", [sys.executable, "-m", "iop.cli", "edge", "--config", cfg, "--bind"]),
        # (--worker-cl: an abbreviation hypercorn's parser takes; it was refused as not trio)
        ("hypercorn", [hypercorn, "--worker-cl", "trio", "edge.app:create_app()", "--bind"]),
    ):
        port = free_port()
        log = tmp_path / f"{name}.log"
        proc = _spawn([*argv, f"0.0.0.0:{port}"], {"IOP_EDGE_CONFIG": str(cfg)}, stderr=log)
        try:
            with trio.fail_after(BOUND):
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=BOUND) as client:
                    while True:
                        try:
                            r = await client.post("/v1/chat/completions", json=BODY)
                            break
                        except httpx.HTTPError:
                            await trio.sleep(0.05)
                    assert r.status_code == 503  # (no node)
                    while "EDGE IS OPEN" not in log.read_text():
                        await trio.sleep(0.05)
        finally:
            _stop(proc)
        assert log.read_text().count("EDGE IS OPEN") == 1, name


@pytest.mark.parametrize(
    ("binds", "public"),
    [
        (["127.0.0.1"], None),  # a host alone: hypercorn listens on its port 8000 (it was read as public)
        (["localhost"], None),
        (["LOCALHOST:8080", "localhost.:8080", "[::ffff:127.0.0.1]:8080"], None),  # (were read as public)
        (["[::1]:8080", "unix:/run/iop.sock", "fd://3"], None),
        (["127.0.0.1:8080", "0.0.0.0"], "0.0.0.0"),
        (["[::]:8080"], "[::]:8080"),
    ],
)
def test_the_open_edge_warning_reads_hypercorns_binds_as_hypercorn_does(binds, public):
    """Which of hypercorn's --bind addresses is public, for the `EDGE IS OPEN` warning."""
    from edge.app import _public_bind

    assert _public_bind(binds) == public


async def test_per_node_tokens_are_checked_at_the_upgrade(nursery, upstream):
    """node_tokens gives each node id its own token; the shared one does not open it."""
    edge = await start_edge(nursery, edge_config(node_token="", node_tokens={"n1": "n1-secret"}))
    node = await start_node(nursery, edge, [model("m", upstream)], token="n1-secret")
    assert "n1" in edge.edge.runs.links
    node.stop()
    await eventually(lambda: not edge.edge.runs.links)
    from node.agent import NodeAgent
    from tests.conftest import node_config

    intruder = NodeAgent(node_config([edge.link_url], [model("m")], node_id="n1", token=TOKEN))
    with trio.move_on_after(0.5):
        await intruder.serve()
    assert not edge.edge.runs.links


async def test_oversized_frame_closes_only_that_link(nursery, upstream):
    """A frame over max_frame_bytes closes the sending node's link; the edge keeps serving."""
    edge = await start_edge(nursery, edge_config(max_frame_bytes=64 * 1024))  # (the least a config may set)
    await start_node(nursery, edge, [model("m", upstream)])

    async def big(ws):
        models = [ModelInfo(name="m", adapter="sim", target="t")]
        await ws.send_message(encode_frame(Hello(node_id="big", protocol=PROTOCOL_VERSION, models=models)))
        await ws.get_message()
        await ws.send_message(b"\x00" * 100_000)
        return await closed_by_edge(ws)

    with trio.fail_after(BOUND):
        closed = await fake_node(edge, big, node_id="big")
        assert closed.reason.code == 1009
        async with http(edge) as client:
            assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200


async def test_health_and_readiness(nursery, upstream):
    """/healthz is 200 while the process lives; /readyz is 503 until a node links, and while draining."""
    edge = await start_edge(nursery)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            assert (await client.get("/healthz")).json() == {"status": "ok"}
            assert (await client.get("/readyz")).status_code == 503
            node = await start_node(nursery, edge, [model("m", upstream)])
            assert (await client.get("/readyz")).status_code == 200
            nursery.start_soon(node.agent.drain)  # the only node drains: no new run can start
            await eventually(lambda: edge.edge.runs.links["n1"].draining, "the edge sees the node draining")
            r = await client.get("/readyz")
            assert r.status_code == 503 and r.json() == {"status": "every node draining"}
            edge.edge.draining = True
            assert (await client.get("/readyz")).status_code == 503
            r = await client.post("/v1/chat/completions", json=BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            assert r.headers["retry-after"] == "1"


async def test_metrics_count_requests_runs_and_cancels(nursery, upstream):
    """/metrics reports requests by API, model and outcome, in-flight runs, linked nodes, latency
    histograms, cancels by cause and tokens by model."""
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("m", upstream)])
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            await client.post("/v1/chat/completions", json={**BODY, "stream": True})
            await client.post("/v1/chat/completions", json={**BODY, "model": "nope"})
            await client.post("/v1/messages", json={**BODY, "stream": True})
            await client.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2})
            upstream.script_for("m-target", [("hang",)])
            async with trio.open_nursery() as clients:

                async def leave():
                    await client.post("/v1/chat/completions", json=BODY)

                clients.start_soon(leave)
                await upstream.wait_requests(4)
                running = (await client.get("/metrics")).text
                clients.cancel_scope.cancel()
            await settled(edge, node.agent)
            text = (await client.get("/metrics")).text
    assert 'iop_requests_total{api="chat",model="m",outcome="complete"} 1.0' in text
    assert 'iop_requests_total{api="chat",model="other",outcome="rejected_404"} 1.0' in text  # unknown names share one
    assert 'iop_requests_total{api="messages",model="m",outcome="complete"} 1.0' in text  # the front door, labelled
    assert 'iop_requests_total{api="responses",model="m",outcome="complete"} 1.0' in text
    assert 'iop_runs_ended_total{api="messages",cause="complete",model="m"} 1.0' in text
    assert 'iop_run_cancels_total{api="chat",cause="client_gone"} 1.0' in text
    assert "iop_runs_in_flight 0.0" in text and "iop_nodes_linked 1.0" in text
    # Tokens per model (only per key before: an outside audit), as the access lines count them.
    for api in ("chat", "messages", "responses"):
        for kind in ("prompt", "completion"):
            (line,) = [
                x for x in text.splitlines() if x.startswith(f'iop_tokens_total{{api="{api}",kind="{kind}",model="m"}}')
            ]
            assert float(line.split()[-1]) > 0, line
    # Per model too (as vLLM's num_requests_running/waiting), the totals unlabelled as before.
    assert 'iop_model_runs_in_flight{model="m"} 1.0' in running and "iop_runs_in_flight 1.0" in running
    assert 'iop_model_runs_in_flight{model="m"} 0.0' in text and 'iop_model_queue_depth{model="m"} 0.0' in text
    assert 'iop_time_to_first_token_seconds_count{api="chat",model="m"}' in text
    assert 'iop_time_to_first_token_seconds_count{api="responses",model="m"}' in text
    # Every run's histograms and counters say which API it came through (Messages and Responses too).
    for api in ("chat", "messages", "responses"):
        assert f'iop_queue_time_seconds_count{{api="{api}",model="m"}}' in text
        assert f'iop_e2e_request_latency_seconds_count{{api="{api}",model="m"}}' in text
    assert 'iop_inter_token_latency_seconds_count{api="messages",model="m"}' in text


async def test_a_large_scrape_leaves_the_event_loop_running(nursery, upstream):
    """With many model series (768 label sets here, as 256 models through three APIs), a scrape
    of /metrics ran on the event loop whole: 0.5 s in which nothing else moved, as often as
    anyone asked (an outside audit). Its counters and histograms are written out in a worker
    thread now: the loop runs meanwhile, and the answer holds every series the registry has."""
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", upstream)])
    metrics = edge.edge.metrics
    for i in range(256):
        for api in ("chat", "messages", "responses"):
            for histogram in (metrics.ttft, metrics.tpot, metrics.run_duration, metrics.queue_time):
                histogram.labels(api, f"model-{i}").observe(0.2)
    ticks = 0
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 200
            async with trio.open_nursery() as ticking:

                async def tick():
                    nonlocal ticks
                    while True:
                        await trio.lowlevel.checkpoint()
                        ticks += 1

                ticking.start_soon(tick)
                await trio.sleep(0.01)
                before = ticks
                scraped = await client.get("/metrics")
                during = ticks - before
                ticking.cancel_scope.cancel()
    assert scraped.status_code == 200
    assert during > 100, during  # (the loop ran on while the scrape was written: 2 ticks when it did not)

    def families(text: str) -> set[str]:
        return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}

    whole = metrics.render().decode()
    assert families(scraped.text) == families(whole) and len(families(whole)) > 30
    assert 'iop_time_to_first_token_seconds_count{api="responses",model="model-255"} 1.0' in scraped.text
    assert 'iop_requests_total{api="chat",model="m",outcome="complete"} 1.0' in scraped.text
    assert "iop_nodes_linked 1.0" in scraped.text


async def test_queue_time_counts_every_wait_however_it_ended(nursery, upstream):
    """`iop_queue_time_seconds` observes every wait for a slot: one that got it, ones the queue's
    timeout ended (429) and one whose client left. Only the request that got its slot was observed,
    so while requests timed out in the queue its p99 read near 0."""
    edge = await start_edge(nursery, edge_config(models=[{"name": "m", "queue_timeout_ms": 300}]))
    node = await start_node(nursery, edge, [model("m", upstream, max_concurrency=1)])
    upstream.script_for("m-target", [("hang",)])
    statuses = []
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:

            async def ask():
                statuses.append((await client.post("/v1/chat/completions", json=BODY)).status_code)

            holder = trio.CancelScope()

            async def hold():
                with holder:
                    await client.post("/v1/chat/completions", json=BODY)

            clients.start_soon(hold)
            await upstream.wait_requests(1)
            async with trio.open_nursery() as waiting:
                waiting.start_soon(ask)
                waiting.start_soon(ask)
            leaving = trio.CancelScope()

            async def leave():
                with leaving:
                    await client.post("/v1/chat/completions", json=BODY)

            clients.start_soon(leave)
            while edge.edge.runs.queue_depth() < 1:
                await trio.sleep(0.01)
            await trio.sleep(0.1)
            leaving.cancel()
            while edge.edge.runs.queue_depth():
                await trio.sleep(0.01)
            holder.cancel()
        await settled(edge, node.agent)
        async with http(edge) as client:
            text = (await client.get("/metrics")).text
    assert statuses == [429, 429]
    count = re.search(r'iop_queue_time_seconds_count\{api="chat",model="m"\} (\S+)', text)
    total = re.search(r'iop_queue_time_seconds_sum\{api="chat",model="m"\} (\S+)', text)
    assert count is not None and total is not None, text
    assert float(count.group(1)) == 4.0  # the holder (0 s), two timeouts (0.3 s each), the one that left
    assert float(total.group(1)) >= 0.6 + 0.09


async def test_a_refusal_is_counted_as_one_when_its_client_closes_as_it_arrives(nursery):
    """A client that closes its connection as the 405 or 404 arrives: counted rejected_405 or
    rejected_404, never "unknown" (the close cancelled the send, and the outcome was said after
    it: 2 to 22 of 80 such requests were "unknown", in the ledger too)."""
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", ttft_ms=0)])

    async def once(request: bytes) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", edge.port)
        await stream.send_all(request)
        got = await stream.receive_some(65536)
        assert got.startswith(b"HTTP/1.1 4"), got
        await stream.aclose()

    get = b"GET /v1/chat/completions HTTP/1.1\r\nhost: x\r\n\r\n"
    body = b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}'
    post = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    post += b"content-length: %d\r\n\r\n%s" % (len(body), body)
    with trio.fail_after(BOUND):
        for _ in range(40):
            await once(get)
            await once(post)
        await trio.sleep(0.2)  # (the last requests' access records)
        async with http(edge) as client:
            text = (await client.get("/metrics")).text
    assert 'iop_requests_total{api="chat",model="other",outcome="rejected_405"} 40.0' in text, text
    assert 'iop_requests_total{api="chat",model="other",outcome="rejected_404"} 40.0' in text
    assert 'outcome="unknown"' not in text


def _spawn(args: list[str], env: dict[str, str], stderr: Path | int | None = None, **popen) -> subprocess.Popen:
    # Its own process group: hypercorn's CLI runs its worker in a child process.
    if stderr is None or isinstance(stderr, int):  # (an int: subprocess.PIPE and the like)
        popen.setdefault("stderr", stderr)
        return subprocess.Popen(args, env={**os.environ, **env}, start_new_session=True, **popen)
    with open(stderr, "w") as err:
        return subprocess.Popen(args, env={**os.environ, **env}, stderr=err, start_new_session=True, **popen)


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=BOUND)


async def _ready(url: str, path: str = "/readyz", **kw) -> None:
    async with httpx.AsyncClient(timeout=2, **kw) as client:
        with trio.fail_after(BOUND):
            while True:
                try:
                    if (await client.get(url + path)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.05)


async def test_a_log_reader_that_goes_away_stops_no_edge_and_no_node(tmp_path, upstream):
    """`iop edge` and `iop node` with stderr into a pipe whose reader goes away (a log shipper
    or `tee` restarting): the next log line raised BrokenPipeError, the connection's guard
    logged it and raised again, and the edge exited 1, cutting every stream and node link; the
    node exited at its next warning (an outside audit). Lines stderr does not take are dropped:
    both go on serving, and SIGTERM still drains them to a clean exit."""
    from scripts.stack import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    edge_cfg = write_toml(tmp_path / "edge.toml", {"bind": f"127.0.0.1:{port}", "node_token": TOKEN})
    node_cfg = write_toml(
        tmp_path / "node.toml",
        {
            "node_id": "n1",
            "edges": [f"ws://127.0.0.1:{port}/v1/node/link"],
            "token": TOKEN,
            "models": [{"name": "m", "adapter": "openai", "base_url": upstream.base_url, "target": "t"}],
        },
    )
    env = {"IOP_LOG_FORMAT": "json", "IOP_LOG_LEVEL": "info"}
    python = [sys.executable, "-m", "iop"]
    edge = _spawn([*python, "edge", "--config", str(edge_cfg)], env, subprocess.PIPE, stdout=subprocess.DEVNULL)
    node = _spawn([*python, "node", "--config", str(node_cfg)], env, subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        await _ready(url)
        edge.stderr.close()  # (the readers go away)
        node.stderr.close()
        upstream.script_for("t", [("status", 500, b'{"error": {"message": "boom"}}')])  # (the node warns)
        async with httpx.AsyncClient(base_url=url, timeout=BOUND) as client:
            with trio.fail_after(BOUND):
                for _ in range(3):
                    assert (await client.post("/v1/chat/completions", json=BODY)).status_code == 502
                upstream.script_for("t", text_script(words(2)))
                r = await client.post("/v1/chat/completions", json=BODY)
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "tok0 tok1 "
                assert (await client.get("/healthz")).status_code == 200
        assert edge.poll() is None and node.poll() is None
        for proc in (node, edge):
            proc.send_signal(signal.SIGTERM)
            assert await trio.to_thread.run_sync(proc.wait, BOUND) == 0
    finally:
        _stop(node)
        _stop(edge)


async def test_console_log_lines_escape_control_characters(tmp_path):
    """With console log lines (IOP_LOG_FORMAT=console, or stderr a terminal), a request's path
    and a link attempt's node id reached the operator's terminal raw: escape sequences that
    clear the screen, hide the rest of a line or draw a fake one, from any client, no key
    needed (an outside audit). They are escaped (`\\x1b`), as JSON lines escape them."""
    from scripts.stack import free_port

    port = free_port()
    cfg = write_toml(tmp_path / "edge.toml", {"bind": f"127.0.0.1:{port}", "node_token": TOKEN})
    log = tmp_path / "edge.log"
    proc = _spawn([sys.executable, "-m", "iop", "edge", "--config", str(cfg)], {"IOP_LOG_FORMAT": "console"}, log)
    try:
        await _ready(f"http://127.0.0.1:{port}", "/healthz")
        with trio.fail_after(BOUND):
            for raw in (
                b"GET /%1b[2J%1b]0;owned%07FAKE%1b[8m HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
                b"GET /v1/node/link HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                b"Authorization: Bearer wrong\r\nX-Iop-Node-Id: \x1b[2K\x1b[31mEVIL\x1b[8m\r\n\r\n",
            ):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(raw)
                assert await stream.receive_some(4096)
                await stream.aclose()
            while b"FAKE" not in log.read_bytes() or b"EVIL" not in log.read_bytes():
                await trio.sleep(0.05)
    finally:
        _stop(proc)
    written = log.read_bytes()
    assert b"\x1b" not in written and b"\x07" not in written, written[-600:]


@pytest.mark.parametrize("fmt", ["console", "json"])
async def test_the_log_level_holds_for_hypercorns_own_lines(tmp_path, fmt):
    """`IOP_LOG_LEVEL=warning` leaves out hypercorn's INFO lines ("Running on ...") in either
    format; with console lines (the default on a terminal) hypercorn's own handler wrote them
    whatever the level (an outside audit). At `info` the line is there."""
    from scripts.stack import free_port

    lines = {}
    for level in ("warning", "info"):
        port = free_port()
        cfg = write_toml(tmp_path / f"{level}.toml", {"bind": f"127.0.0.1:{port}", "node_token": TOKEN})
        log = tmp_path / f"{level}.log"
        env = {"IOP_LOG_FORMAT": fmt, "IOP_LOG_LEVEL": level}
        proc = _spawn([sys.executable, "-m", "iop", "edge", "--config", str(cfg)], env, log)
        try:
            await _ready(f"http://127.0.0.1:{port}", "/healthz")
        finally:
            _stop(proc)
        lines[level] = log.read_text()
    assert "Running on" not in lines["warning"], lines["warning"]
    assert "Running on" in lines["info"], lines["info"]


async def test_edge_runs_under_hypercorns_own_cli(nursery, tmp_path, upstream):
    """`hypercorn --worker-class trio 'edge.app:create_app()'` with IOP_EDGE_CONFIG serves the edge."""
    from scripts.stack import free_port

    port = free_port()
    cfg = write_toml(tmp_path / "edge.toml", {"node_token": TOKEN, "wait_timeout_s": 30})
    hypercorn = os.path.join(os.path.dirname(sys.executable), "hypercorn")
    proc = _spawn(
        [hypercorn, "--worker-class", "trio", "--bind", f"127.0.0.1:{port}", "edge.app:create_app()"],
        {"IOP_EDGE_CONFIG": cfg},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        with trio.fail_after(BOUND):
            while True:
                try:
                    async with httpx.AsyncClient() as c:
                        if (await c.get(url + "/healthz")).status_code == 200:
                            break
                except httpx.HTTPError:
                    await trio.sleep(0.05)
        from tests.conftest import EdgeHandle

        handle = EdgeHandle(None, None, url, trio.CancelScope())
        from node.agent import NodeAgent
        from tests.conftest import node_config

        agent = NodeAgent(node_config([handle.link_url], [model("m", upstream)]))
        nursery.start_soon(agent.serve)
        await _ready(url)
        with trio.fail_after(BOUND):
            async with httpx.AsyncClient(base_url=url, timeout=BOUND) as client:
                r = await client.post("/v1/chat/completions", json=BODY)
        assert r.json()["choices"][0]["message"]["content"] == "tok0 tok1 "
    finally:
        _stop(proc)


def test_a_bad_config_under_hypercorns_cli_is_one_line(tmp_path):
    """Under hypercorn's CLI a config the edge cannot use stops its worker with the one line
    `iop edge` prints (naming the file and the key), not a traceback. (Each case is a process of
    its own; they run at once.)"""
    from concurrent.futures import ThreadPoolExecutor

    from scripts.stack import free_port

    bad, good = tmp_path / "bad.toml", tmp_path / "edge.toml"
    bad.write_text('node_token = "t"\nwait_timeout_s = "soon"\n')
    good.write_text('node_token = "t"\n')
    (tmp_path / "hypercorn.toml").write_text('worker_class = "trio"\nworkers = 2\n')
    hypercorn = os.path.join(os.path.dirname(sys.executable), "hypercorn")
    python_m = [sys.executable, "-m", "hypercorn"]
    one_worker = "iop: the edge is one hypercorn worker: start hypercorn with --workers 1"
    cases = [  # (command, config, the one line it must print)
        ([hypercorn, "--worker-class", "trio"], bad, f"iop: {bad}: wait_timeout_s: expected `float`, got `str`"),
        (
            [hypercorn, "--worker-class", "trio"],
            tmp_path / "missing.toml",
            f"iop: {tmp_path / 'missing.toml'}: cannot read: No such file or directory",
        ),
        # Without --worker-class trio it started, then answered every request 500 with an empty body.
        ([hypercorn], good, "iop: the edge runs on trio: start hypercorn with --worker-class trio"),
        # With two workers each was an edge of its own: a node linked to one, a request reached the
        # other (503), and a drain's idle worker ended first, then hypercorn cut the other's streams.
        # As hypercorn reads its command line: -w=2, a --config file, `python -m hypercorn`; with no
        # worker (0), hypercorn passed it no signal and SIGTERM killed it undrained.
        ([hypercorn, "-k", "trio", "--workers", "2"], good, one_worker),
        ([hypercorn, "-k", "trio", "-w=2"], good, one_worker),
        ([hypercorn, "--config", str(tmp_path / "hypercorn.toml")], good, one_worker),
        ([*python_m, "-k", "trio", "-w", "3"], good, one_worker),
        ([hypercorn, "-k", "trio", "-w", "0"], good, one_worker),
        # A log setting `iop edge` refuses: under hypercorn's CLI the edge started on info, saying
        # nothing (an outside audit).
        (
            [hypercorn, "-k", "trio"],
            good,
            "iop: IOP_LOG_LEVEL: 'warn' is not one of debug, info, warning, error",
            {"IOP_LOG_LEVEL": "warn"},
        ),
    ]

    def said(case) -> tuple[str, ...]:
        command, config, _, *env = case
        proc = subprocess.run(
            [*command, "--bind", f"127.0.0.1:{free_port()}", "edge.app:create_app()"],
            env={**os.environ, "IOP_EDGE_CONFIG": str(config), **(env[0] if env else {})},
            capture_output=True,
            text=True,
            timeout=BOUND,
        )
        assert "Traceback" not in proc.stderr, proc.stderr
        return tuple(dict.fromkeys(line for line in proc.stderr.splitlines() if line.strip()))

    with ThreadPoolExecutor(len(cases)) as pool:
        lines = list(pool.map(said, cases))
    # (several workers each print the line: once, as a set)
    assert lines == [(case[2],) for case in cases]


async def test_tls_edge_and_wss_node(nursery, tmp_path, upstream):
    """The edge serves HTTPS with a certfile/keyfile and nodes link over wss:// trusting a CA file."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile, cafile = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    ca.cert_pem.write_to_path(str(cafile))
    from edge.app import create_app, edge_of
    from edge.serve import serve_edge
    from node.agent import NodeAgent
    from tests.conftest import node_config

    app = create_app(edge_config())
    url = await nursery.start(
        lambda task_status: serve_edge(
            app, "127.0.0.1:0", certfile=str(certfile), keyfile=str(keyfile), task_status=task_status
        )
    )
    assert url.startswith("https://")
    link = url.replace("https", "wss", 1) + "/v1/node/link"
    # Not trusting the edge's CA: the node says why at once (it logged "TooSlowError: " after
    # its connect timeout), and never links.
    lost = NodeAgent(node_config([link], [model("m", upstream)], node_id="lost", connect_timeout_s=60))

    async def untrusting(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await lost.serve()

    with structlog.testing.capture_logs() as logs:
        serving = await nursery.start(untrusting)
        await eventually(lambda: any(e["event"] == "link failed" for e in logs), "the node logged why")
        serving.cancel()
    (failed, *_) = [e for e in logs if e["event"] == "link failed"]
    assert "TLS with the edge failed" in failed["error"] and "CERTIFICATE_VERIFY_FAILED" in failed["error"]
    agent = NodeAgent(node_config([link], [model("m", upstream)], ca_file=str(cafile)))
    nursery.start_soon(agent.serve)
    await eventually(lambda: "n1" in edge_of(app).runs.links)
    with trio.fail_after(BOUND):
        async with httpx.AsyncClient(
            base_url=url, verify=ssl.create_default_context(cafile=str(cafile)), timeout=BOUND
        ) as client:
            r = await client.post("/v1/chat/completions", json=BODY)
    assert r.json()["choices"][0]["message"]["content"] == "tok0 tok1 "


async def _edge_process_with_a_node(nursery, tmp_path, upstream, *, drain_grace_s: float, hypercorn: bool = False):
    """A real `iop edge` process (its own signals), or hypercorn's CLI serving the edge, and an
    in-process node serving `m` from ``upstream``, the edge ready: the process and the edge's
    URL (the caller stops it)."""
    from node.agent import NodeAgent
    from scripts.stack import free_port
    from tests.conftest import node_config

    port = free_port()
    config = {"bind": f"127.0.0.1:{port}", "node_token": TOKEN, "drain_grace_s": drain_grace_s}
    cfg = write_toml(tmp_path / "edge.toml", config)
    if hypercorn:
        cli = os.path.join(os.path.dirname(sys.executable), "hypercorn")
        argv = [cli, "--worker-class", "trio", "--bind", f"127.0.0.1:{port}", "edge.app:create_app()"]
        proc = _spawn(argv, {"IOP_LOG_FORMAT": "json", "IOP_EDGE_CONFIG": cfg})
    else:
        proc = _spawn([sys.executable, "-m", "iop.cli", "edge", "--config", cfg], {"IOP_LOG_FORMAT": "json"})
    try:
        agent = NodeAgent(node_config([f"ws://127.0.0.1:{port}/v1/node/link"], [model("m", upstream)]))
        nursery.start_soon(agent.serve)
        await _ready(f"http://127.0.0.1:{port}")
    except BaseException:
        _stop(proc)
        raise
    return proc, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def _streaming_then_sigterm(
    url: str, upstream, proc: subprocess.Popen, group: bool = False, signum: int = signal.SIGTERM
):
    """A stream open through the edge process at ``url``, its upstream request seen, then
    SIGTERM (or ``signum``) to the process (``group``: to its process group, as systemd stops a
    service): the stream's response, for the caller to read."""
    async with (
        httpx.AsyncClient(base_url=url, timeout=BOUND) as client,
        client.stream("POST", "/v1/chat/completions", json={**BODY, "max_tokens": None, "stream": True}) as r,
    ):
        await upstream.wait_requests(1)
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        yield r


@pytest.mark.parametrize(
    "cli", ["iop edge", "iop edge, group", "hypercorn", "hypercorn, group", "iop edge, hup", "iop edge, hup, group"]
)
async def test_sigterm_drains_the_edge(nursery, tmp_path, upstream, cli):
    """SIGTERM to `iop edge`, or to hypercorn's CLI serving the edge, or to either's process
    group (systemd's stop): new requests get 503, the in-flight stream (4 s, past hypercorn's
    3 s graceful timeout) finishes, then the process exits 0. (Under hypercorn's CLI the stream
    was cut after 3 s, mid-body, with no error; signalled as a group, its worker died at once.)
    SIGHUP (a closed terminal: to the group) drains the same: it killed `iop edge` at once, its
    streams cut and unbilled (an outside audit)."""
    signum = signal.SIGHUP if "hup" in cli else signal.SIGTERM

    upstream.script_for("m-target", lambda body: text_script(words(80), interval=0.05))
    hypercorn = cli.startswith("hypercorn")
    proc, url = await _edge_process_with_a_node(nursery, tmp_path, upstream, drain_grace_s=10, hypercorn=hypercorn)
    try:
        with trio.fail_after(BOUND):
            async with _streaming_then_sigterm(url, upstream, proc, group=cli.endswith("group"), signum=signum) as r:
                async with httpx.AsyncClient(base_url=url, timeout=BOUND) as other:
                    # The edge notices the signal within moments (hypercorn's worker polls its
                    # parent's every 0.1 s): /readyz says so first, then a new request is a 503.
                    while (await other.get("/readyz")).status_code != 503:
                        await trio.sleep(0.02)
                    late = await other.post("/v1/chat/completions", json=BODY)
                assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
                body = await r.aread()
            assert body.endswith(b"data: [DONE]\n\n") and b"tok79" in body and b"error" not in body
            await trio.to_thread.run_sync(proc.wait, BOUND)
        assert proc.returncode == 0
    finally:
        _stop(proc)


async def test_sigterm_ends_within_the_grace_with_a_client_that_reads_nothing_and_a_body_never_sent(
    nursery, tmp_path, upstream
):
    """A client that stopped reading a long stream held the edge's exit until its write timed
    out (`write_timeout_s`, 60 s: 62.8 s after SIGTERM with a grace of 8), and a request whose
    body never finished held it a second grace, then got hypercorn's bare 500. At the end of
    the drain the edge closes what is still open: it exits within moments of its grace."""
    upstream.script_for("m-target", lambda body: text_script(words(400_000), interval=0))
    proc, url = await _edge_process_with_a_node(nursery, tmp_path, upstream, drain_grace_s=1)
    host, port = url.removeprefix("http://").split(":")
    try:
        with trio.fail_after(BOUND):
            stuck = trio.socket.socket()
            stuck.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
            await stuck.connect((host, int(port)))
            body = msgspec.json.encode({**BODY, "max_tokens": None, "stream": True})
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            await stuck.send(head + b"content-length: %d\r\n\r\n" % len(body) + body)  # and reads nothing
            await upstream.wait_requests(1)
            unsent = trio.socket.socket()
            await unsent.connect((host, int(port)))
            await unsent.send(head + b"content-length: 1000\r\n\r\n{")  # and the rest never comes
            await trio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            await trio.to_thread.run_sync(proc.wait, BOUND)  # (before: 60 s and more)
        assert proc.returncode == 0
        stuck.close()
        unsent.close()
    finally:
        _stop(proc)


async def test_two_edges_one_node(nursery, upstream):
    """A node given two edge URLs links to both, and either edge serves requests."""
    first, second = await start_edge(nursery), await start_edge(nursery)
    await start_node(nursery, [first, second], [model("m", upstream)])
    with trio.fail_after(BOUND):
        for edge in (first, second):
            async with http(edge) as client:
                r = await client.post("/v1/chat/completions", json=BODY)
                assert r.json()["choices"][0]["message"]["content"] == "tok0 tok1 "
    assert len(upstream.records) == 2


_B_SHA256 = hashlib.sha256(b"sk-b").hexdigest().upper()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"keys": [{"id": "b", "key": "sk-b"}, {"id": "c", "key": "sk-b"}]}, 'keys: "c" has the same secret as "b"'),
        (
            {"keys": [{"id": "b", "key": "sk-b"}, {"id": "c", "key_sha256": _B_SHA256}]},
            'keys: "c" has the same secret as "b"',
        ),
        (
            {"keys": [{"id": "b", "key_sha256": _B_SHA256}, {"id": "c", "key_sha256": _B_SHA256.lower()}]},
            'keys: "c" has the same secret as "b"',
        ),
        (
            {"api_keys": ["sk-a", "sk-b"], "keys": [{"id": "b", "key": "sk-b"}]},
            'keys: "b" has the same secret as api_keys[1]',
        ),
        (
            {"api_keys_file": "KEYS", "keys": [{"id": "b", "key": "sk-b"}]},
            'keys: "b" has the same secret as api_keys_file line 2',
        ),
    ],
)
def test_a_secret_given_twice_is_one_line(tmp_path, config, expected):
    """Two [[keys]] entries with one secret (as key or key_sha256, any case), or a plain api_keys /
    api_keys_file key that is a [[keys]] entry's: `iop edge` stops with one line naming both
    entries, never the secret (the last entry won, and the other could never be used)."""
    keys = tmp_path / "keys.txt"
    keys.write_text("# clients\nsk-b\n")
    if config.get("api_keys_file") == "KEYS":
        config = {**config, "api_keys_file": str(keys)}
    cfg = write_toml(tmp_path / "edge.toml", {"bind": "127.0.0.1:0", "node_token": TOKEN, **config})
    result = subprocess.run(
        [sys.executable, "-m", "iop.cli", "edge", "--config", cfg], capture_output=True, text=True, timeout=BOUND
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"iop: {cfg}: {expected}"]
    assert "sk-b" not in result.stderr and _B_SHA256 not in result.stderr.upper()


def test_plain_keys_given_twice_are_one_key(tmp_path):
    """The same plain key inline and in api_keys_file is no conflict: neither has a policy."""
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-a\n")
    cfg = write_toml(tmp_path / "edge.toml", {"api_keys": ["sk-a"], "api_keys_file": str(keys)})
    assert load_edge_config(cfg).api_keys == ["sk-a", "sk-a"]


async def test_a_drain_ends_queued_requests_at_once(nursery, upstream):
    """Queued requests, when the edge starts to drain, got slots as running streams ended and
    went to the model server, only to be cut when the grace ran out ("node disconnected",
    shutdown later than the grace). They end with the 503 `draining` a new request gets, at
    once; the running stream finishes; the model server saw only it."""
    upstream.script_for("m-target", lambda body: text_script(words(15), interval=0.05))
    edge = await start_edge(nursery, edge_config(drain_grace_s=10))
    node = await start_node(nursery, edge, [model("m", upstream, max_concurrency=1)])
    queued: list[httpx.Response] = []
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:

            async def wait_in_queue() -> None:
                queued.append(await client.post("/v1/chat/completions", json=BODY))

            async with client.stream(
                "POST", "/v1/chat/completions", json={**BODY, "max_tokens": None, "stream": True}
            ) as r:
                await upstream.wait_requests(1)
                for _ in range(2):
                    clients.start_soon(wait_in_queue)
                await eventually(lambda: len(edge.edge.runs.queued()) == 2, "two requests queued")
                clients.start_soon(edge.edge.drain)
                await eventually(lambda: len(queued) == 2, "the queued requests answered")
                assert not r.is_closed  # before the stream ended
                with pytest.raises(APIError) as late:  # a request whose body came in after the signal
                    await edge.edge.runs.acquire(Want("m"))
                assert late.value.code == "draining"
                body = await r.aread()
    assert [q.status_code for q in queued] == [503, 503]
    assert all(q.json()["error"]["code"] == "draining" for q in queued)
    assert body.endswith(b"data: [DONE]\n\n") and b"tok14" in body
    assert len(upstream.records) == 1
    await settled(edge, node.agent)


async def test_a_whole_answer_cut_by_the_end_of_a_drain_says_when_to_retry(nursery, upstream):
    """A non-streamed request still running when the drain's grace ends is a 503 `draining`
    with `Retry-After: 1`, as a request refused during the drain is (README, Errors); it had
    no `Retry-After` (an outside audit), on chat, on Messages and on the tunnel alike (a
    passthrough request's was a 502 `provider_tunnel_error`)."""
    upstream.script_for("m-target", lambda body: text_script(words(200), interval=0.05))
    upstream.script_for("p-target", [("hang",)])
    edge = await start_edge(nursery, edge_config(drain_grace_s=0.5))
    node = await start_node(nursery, edge, [model("m", upstream), model("p", upstream, passthrough=True)])
    answers: list[httpx.Response] = []
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:

            async def ask(path: str, body: dict) -> None:
                answers.append(await client.post(path, json=body))

            clients.start_soon(ask, "/v1/chat/completions", {**BODY, "max_tokens": None})
            clients.start_soon(ask, "/v1/messages", {**BODY, "max_tokens": 1000})
            clients.start_soon(ask, "/v1/completions", {"model": "p", "prompt": "hi"})
            await upstream.wait_requests(3)
            await edge.edge.drain()
    assert len(answers) == 3
    for r in answers:
        assert r.status_code == 503 and r.headers["retry-after"] == "1", (r.status_code, r.headers, r.text)
        assert "The edge is shutting down." in r.text  # (the words of a request refused during the drain)
    chat, tunnel, messages = sorted(answers, key=lambda r: str(r.url))
    assert chat.json()["error"]["code"] == "draining" and tunnel.json()["error"]["code"] == "draining"
    assert messages.json()["type"] == "error"
    await settled(edge, node.agent)


async def test_a_drained_edge_takes_no_node_link_again(nursery, upstream):
    """Its drain over, the edge closes its node links with 1001; a node dialled back at once and
    was linked again, only to be cut with 1011 as the edge exited (an outside audit). A link
    dialled after the drain closed them is refused (503 `draining`), and the node says so."""
    edge = await start_edge(nursery, edge_config(drain_grace_s=0.1))
    node = await start_node(nursery, edge, [model("m", upstream)])
    with structlog.testing.capture_logs() as logs, trio.fail_after(BOUND):
        await edge.edge.drain()
        assert not edge.edge.runs.links
        await eventually(
            lambda: any(e["event"] == "edge refused the link" and '"draining"' in e["body"] for e in logs),
            "the node's redial refused",
        )
        await trio.sleep(0.5)
    assert not edge.edge.runs.links and not node.agent.links


async def test_a_drain_under_a_stream_of_refused_requests_ends_with_its_runs(nursery, upstream):
    """A drain waits for the answers still being written, not only for the runs, but not for
    the requests it refuses (503 `draining`): with clients sending without pause, it ends as
    its one stream ends, well within its grace of 60 s (the test's bound is 15 s)."""
    upstream.script_for("m-target", lambda body: text_script(words(15), interval=0.05))
    edge = await start_edge(nursery, edge_config(drain_grace_s=60))
    node = await start_node(nursery, edge, [model("m", upstream)])
    refused: list[int] = []
    with trio.fail_after(BOUND):
        async with http(edge) as client, trio.open_nursery() as clients:
            drained = trio.Event()

            async def keep_asking() -> None:
                while not drained.is_set():
                    refused.append((await client.post("/v1/chat/completions", json=BODY)).status_code)

            async with client.stream(
                "POST", "/v1/chat/completions", json={**BODY, "max_tokens": None, "stream": True}
            ) as r:
                await upstream.wait_requests(1)
                edge.edge.draining = True  # (as the drain's first step: the askers are refused from now)
                for _ in range(32):
                    clients.start_soon(keep_asking)
                with trio.fail_after(15):
                    await edge.edge.drain()
                drained.set()  # (the askers stop after their answer in hand: none cut mid-request)
                body = await r.aread()
    assert body.endswith(b"data: [DONE]\n\n") and b"tok14" in body
    assert refused and set(refused) == {503}
    await settled(edge, node.agent)


async def test_the_same_signal_twice_at_once_is_one(nursery, tmp_path, upstream):
    """`timeout` sends SIGTERM to its child and then to its process group: the edge got it twice
    and ended its drain's grace at once. The same signal again within 0.5 s is the same one: the
    stream in flight finishes whole."""
    upstream.script_for("m-target", lambda body: text_script(words(20), interval=0.05))
    proc, url = await _edge_process_with_a_node(nursery, tmp_path, upstream, drain_grace_s=60)
    try:
        with trio.fail_after(BOUND):
            async with _streaming_then_sigterm(url, upstream, proc) as r:
                proc.send_signal(signal.SIGTERM)
                body = await r.aread()
            assert body.endswith(b"data: [DONE]\n\n") and b"tok19" in body and b"shutting down" not in body
            await trio.to_thread.run_sync(proc.wait, BOUND)
        assert proc.returncode == 0
    finally:
        _stop(proc)


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
async def test_a_second_signal_ends_the_drain_at_once(nursery, tmp_path, upstream, second):
    """A second SIGINT during a drain was ignored (the drain ran its whole grace; with a stuck
    stream Ctrl-C never stopped the edge) and a second SIGTERM killed it with no SSE error and no
    [DONE]. Now a second signal ends the grace at once: the stream gets the edge's error and
    [DONE], and the process exits 0, long before the 60 s grace. A second SIGTERM 0.35 s after
    the first was taken for the first sent twice (as `timeout` sends it, to its child and then
    to the group: microseconds apart) and ignored (an outside audit): that window is 0.1 s."""
    upstream.script_for("m-target", lambda body: text_script(words(400), interval=0.1))  # 40 s
    proc, url = await _edge_process_with_a_node(nursery, tmp_path, upstream, drain_grace_s=60)
    try:
        with trio.fail_after(BOUND):
            async with _streaming_then_sigterm(url, upstream, proc) as r:
                async with httpx.AsyncClient(base_url=url, timeout=BOUND) as other:
                    while (await other.get("/readyz")).status_code != 503:  # draining
                        await trio.sleep(0.02)
                await trio.sleep(0.25)
                proc.send_signal(second)
                body = await r.aread()
            assert body.endswith(b"data: [DONE]\n\n") and b"shutting down" in body
            await trio.to_thread.run_sync(proc.wait, BOUND)
        assert proc.returncode == 0
    finally:
        _stop(proc)


async def test_a_drain_lets_a_slow_reader_take_its_whole_answer_within_the_grace(nursery, upstream):
    """The run of a large non-streamed answer ended at once, but its client was still reading
    it (200 KB/s): the drain's close of what was "stuck" cut it 1 s after SIGTERM with a third
    of its bytes. A client still taking its answer has what is left of the grace."""
    upstream.script_for("m-target", lambda body: text_script(words(60_000), interval=0))
    edge = await start_edge(nursery, edge_config(drain_grace_s=15))
    await start_node(nursery, edge, [model("m", upstream)])
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    body = msgspec.json.encode({**BODY, "max_tokens": None})
    conn = h11.Connection(h11.CLIENT)
    answer, drained = b"", False
    with trio.fail_after(BOUND):
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 8192)
        await sock.connect((host, int(port)))
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        await sock.send(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        async with trio.open_nursery() as draining:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await sock.recv(16384))
                    await trio.sleep(0.05)  # about 300 KB/s
                elif isinstance(event, h11.Data):
                    answer += event.data
                    if not drained:
                        drained = True
                        draining.start_soon(edge.edge.drain)
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
        sock.close()
    assert len(json.loads(answer)["choices"][0]["message"]["content"]) > 400_000


@pytest.mark.parametrize("cli", ["iop edge", "hypercorn"])
async def test_the_edge_takes_as_many_connections_as_its_hard_limit_allows(nursery, tmp_path, cli):
    """Started with a soft limit of 256 open files (systemd starts services with 1,024), the edge
    raises it to the hard limit and answers 400 clients at once: it stopped accepting at about
    the soft limit ("Too many open files"), and those past it got no answer at all."""
    import resource

    from scripts.stack import free_port

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"a hard limit of {hard} open files leaves nothing to raise to")
    port = free_port()
    cfg = write_toml(tmp_path / "edge.toml", {"bind": f"127.0.0.1:{port}", "node_token": TOKEN})
    if cli == "hypercorn":
        hypercorn = os.path.join(os.path.dirname(sys.executable), "hypercorn")
        argv = [hypercorn, "-k", "trio", "--bind", f"127.0.0.1:{port}", "edge.app:create_app()"]
    else:
        argv = [sys.executable, "-m", "iop.cli", "edge", "--config", cfg]
    soft_256 = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # noqa: E731
    proc = _spawn(argv, {"IOP_EDGE_CONFIG": cfg}, preexec_fn=soft_256)
    try:
        await _ready(f"http://127.0.0.1:{port}", "/healthz")
        with trio.fail_after(BOUND):
            socks = []
            try:
                for _ in range(400):  # all open at once
                    sock = await trio.open_tcp_stream("127.0.0.1", port)
                    socks.append(sock)
                    await sock.send_all(b"GET /healthz HTTP/1.1\r\nhost: edge\r\n\r\n")
                answered = 0
                for sock in socks:
                    if (await sock.receive_some(4096)).startswith(b"HTTP/1.1 200"):
                        answered += 1
            finally:
                for sock in socks:
                    await sock.aclose()
        assert answered == 400
    finally:
        _stop(proc)


async def test_out_of_descriptors_the_edge_logs_one_json_line_a_second_and_recovers(nursery, tmp_path):
    """At its hard limit of open files, trio's listener retries accept every 0.1 s: it wrote a
    plain-text traceback of nine lines each time (ten a second, for as long as it lasted). Now a
    JSON line at most once a second; and once clients leave, the edge answers again."""
    import json
    import resource

    from scripts.stack import free_port

    port = free_port()
    cfg = write_toml(tmp_path / "edge.toml", {"bind": f"127.0.0.1:{port}", "node_token": TOKEN})
    log = tmp_path / "edge.log"
    limit_64 = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))  # noqa: E731
    argv = [sys.executable, "-m", "iop.cli", "edge", "--config", cfg]
    proc = _spawn(argv, {"IOP_LOG_FORMAT": "json"}, stderr=log, preexec_fn=limit_64)
    try:
        await _ready(f"http://127.0.0.1:{port}", "/healthz")
        socks = []
        with trio.fail_after(BOUND):
            try:
                for _ in range(120):  # past the limit: the rest wait in the backlog
                    socks.append(await trio.open_tcp_stream("127.0.0.1", port))
                await trio.sleep(2.5)
            finally:
                for sock in socks:
                    await sock.aclose()
            await _ready(f"http://127.0.0.1:{port}", "/healthz")
    finally:
        _stop(proc)
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    assert all(line.startswith("{") for line in lines), lines[:20]
    accepts = [json.loads(line) for line in lines if "accept returned" in line]
    assert 1 <= len(accepts) <= 4 and accepts[0]["logger"] == "trio.serve_listeners", accepts
