"""Engine load: nodes sample their model servers' Prometheus metrics, edges
show them (/v1/nodes, /metrics) and place runs by them."""

from __future__ import annotations

import trio

from node.engine import parse
from proto import EngineLoad
from scripts.upstream import Upstream
from tests.conftest import BOUND, edge_config, eventually, http, model, start_edge, start_node

MESSAGES = [{"role": "user", "content": "hi"}]

VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m-target"} %s
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m-target"} %s
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m-target"} %s
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m-target"} 12345.0
"""


def test_known_servers_metrics_are_read():
    assert parse(VLLM % (3, 5, 0.25)) == EngineLoad(waiting=3, running=5, kv_cache_usage=0.25)
    sglang = "sglang:num_queue_reqs 2\nsglang:num_running_reqs 7\nsglang:token_usage 0.5\n"
    assert parse(sglang) == EngineLoad(waiting=2, running=7, kv_cache_usage=0.5)
    llama = "llamacpp:requests_deferred 1\nllamacpp:requests_processing 4\nllamacpp:kv_cache_usage_ratio 0.75\n"
    assert parse(llama) == EngineLoad(waiting=1, running=4, kv_cache_usage=0.75)
    assert parse("other_metric 1\n") == EngineLoad()
    # As the exposition format has it: timestamps, labels holding spaces and braces, a series per
    # engine summed, NaN and unreadable values passed over, longer names that start with a known one.
    page = (
        'vllm:num_requests_waiting{engine="0",note="a } b"} 2 1700000000000\n'
        'vllm:num_requests_waiting{engine="1"} 3\n'
        'vllm:num_requests_waiting{engine="2"} NaN\n'
        "vllm:num_requests_waiting_by_reason 40\n"
        'vllm:num_requests_running{engine="0"} x\n'
        'vllm:num_requests_running{engine="1"} 1e1\n'
        "vllm:prefix_cache_hits_total 30\nvllm:prefix_cache_queries_total 120\n"
        "# vllm:kv_cache_usage_perc 0.9\n"
    )
    assert parse(page) == EngineLoad(waiting=5, running=10, prefix_cache_hit_rate=0.25)
    # Lines end at \n only: a label value may hold U+2028 (str.splitlines made its text a sample).
    # An OpenMetrics exemplar after a value is not the value; a line may start with spaces.
    page = (
        'vllm:lora_requests_info{adapters="x\u2028vllm:num_requests_waiting 1e9\u2028"} 1\n'
        'vllm:num_requests_waiting{model_name="m"} 2\r\n'
        '  vllm:num_requests_running 4 # {trace_id="a"} 99\n'
        'vllm:prefix_cache_hits_total{m="a"} 50 # {trace_id="x"} 1.0\n'
        "vllm:prefix_cache_queries_total 100\n"
    )
    assert parse(page) == EngineLoad(waiting=2, running=4, prefix_cache_hit_rate=0.5)


async def test_a_metrics_page_of_endless_labels_costs_the_node_nothing_else(nursery):
    """A model server's metrics page of one sample with 100,000 labels (1.1 MB, within the node's
    4 MB) kept the node's event loop busy for seconds at each scrape (its parser's cost grew with
    the square of the labels): its links timed out again and again, and a healthy model of the
    same node failed 17 requests of 20 (an outside audit). Only known names' lines are read now,
    in a worker thread, and a line past 16 KiB is passed over: the rest of the page is read, the
    node serves its other model, its link stays up."""
    labels = ",".join(f'l{i}="v"' for i in range(100_000))
    page = f"vllm:num_requests_waiting{{{labels}}} 7\nvllm:num_requests_running 3\n"
    hostile = await new_upstream(nursery, page)
    healthy = await new_upstream(nursery)
    healthy.default = lambda body: [("chunk", {"content": "ok"}), ("chunk", {}, "stop"), ("done",)]
    edge = await start_edge(nursery)
    metrics_url = hostile.base_url[:-3] + "/metrics"
    await start_node(
        nursery,
        edge,
        [model("bad", hostile, metrics_url=metrics_url, metrics_interval_s=0.1), model("good", healthy)],
    )
    with trio.fail_after(BOUND):
        while (await nodes_view(edge)).get("n1", {}).get("engine", {}).get("running") != 3.0:
            await trio.sleep(0.05)
        assert (await nodes_view(edge))["n1"]["engine"].get("waiting") is None
        scrapes, link = hostile.metrics_scrapes, edge.edge.runs.links["n1"]
        async with http(edge) as client:
            for _ in range(20):
                r = await client.post("/v1/chat/completions", json={"model": "good", "messages": MESSAGES})
                assert r.status_code == 200, r.text
                await trio.sleep(0.05)
        assert hostile.metrics_scrapes > scrapes  # (scraped all along)
        assert edge.edge.runs.links["n1"] is link and not link.closed  # (the same link all along)


async def new_upstream(nursery, metrics: str = "") -> Upstream:
    up = Upstream()
    up.metrics = metrics
    await nursery.start(up.serve)
    return up


async def nodes_view(edge) -> dict:
    async with http(edge) as client:
        r = await client.get("/v1/nodes")
    return {n["id"]: n["models"][0] for n in r.json()["data"]}


async def test_engine_load_reaches_nodes_listing_and_metrics(nursery):
    """A node with a metrics_url reports its server's queue, running count and KV cache use;
    a change is seen within an interval; a server that stops answering is 'no longer known'."""
    up = await new_upstream(nursery, VLLM % (3, 5, 0.25))
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [model("m", up, metrics_url=up.base_url[:-3] + "/metrics", metrics_interval_s=0.1)])
    with trio.fail_after(BOUND):
        while (await nodes_view(edge)).get("n1", {}).get("engine") != {
            "waiting": 3.0,
            "running": 5.0,
            "kv_cache_usage": 0.25,
        }:
            await trio.sleep(0.05)
        async with http(edge) as client:
            text = (await client.get("/metrics")).text
        assert 'iop_engine_requests_waiting{model="m",node="n1"} 3.0' in text
        assert 'iop_engine_requests_running{model="m",node="n1"} 5.0' in text
        assert 'iop_engine_kv_cache_usage{model="m",node="n1"} 0.25' in text
        up.metrics = VLLM % (9, 5, 0.25)
        while (await nodes_view(edge))["n1"].get("engine", {}).get("waiting") != 9.0:
            await trio.sleep(0.05)
        up.metrics = ""  # now 404
        while "engine" in (await nodes_view(edge))["n1"]:
            await trio.sleep(0.05)
        async with http(edge) as client:
            assert "iop_engine_requests_waiting{" not in (await client.get("/metrics")).text


async def test_a_metrics_page_of_two_models_gives_each_its_own_load(nursery):
    """One server's page with series of two models (`model_name`): the node's model reads those
    of its target only. All were summed: the other model's 50 waiting and 9 running were this
    one's, and placement took the node for 12 times as busy as it was (an outside audit). A page
    with none of its target's (a server named otherwise) is read whole, as before."""
    other = (VLLM % (50, 9, 0.5)).replace("m-target", "other")
    up = await new_upstream(nursery, VLLM % (1, 2, 0.25) + other)
    edge = await start_edge(nursery)
    metrics = up.base_url[:-3] + "/metrics"
    await start_node(nursery, edge, [model("m", up, metrics_url=metrics, metrics_interval_s=0.1)])
    mine = {"waiting": 1.0, "running": 2.0, "kv_cache_usage": 0.25}
    with trio.fail_after(BOUND):
        while (await nodes_view(edge)).get("n1", {}).get("engine") != mine:
            await trio.sleep(0.05)
    assert parse(VLLM % (1, 2, 0.25) + other, "elsewhere") == EngineLoad(waiting=51.0, running=11.0, kv_cache_usage=0.5)
    assert parse('vllm:num_requests_waiting{model_name="a\\"b"} 4\nvllm:num_requests_waiting 7', 'a"b').waiting == 4.0
    page = 'vllm:num_requests_running{served_model_name="m"} 100\nvllm:num_requests_running{engine="0", model_name = "m"} 1'
    assert parse(page, "m").running == 1.0  # (its label only, however spaced)


async def test_placement_avoids_a_node_whose_engine_is_queueing(nursery):
    """Two idle nodes as this edge sees them; one's model server reports a queue of 40
    (other clients are using it). Every request goes to the other node; once the queue
    is gone, both take requests again."""
    busy_up = await new_upstream(nursery, VLLM % (40, 8, 0.5))
    free_up = await new_upstream(nursery, VLLM % (0, 0, 0.1))
    edge = await start_edge(nursery, edge_config(routing="least_loaded"))

    def sampled(up):
        return model("m", up, max_concurrency=8, metrics_url=up.base_url[:-3] + "/metrics", metrics_interval_s=0.1)

    await start_node(nursery, edge, [sampled(busy_up)], node_id="busy")
    await start_node(nursery, edge, [sampled(free_up)], node_id="free")
    with trio.fail_after(BOUND):
        while not all("engine" in m for m in (await nodes_view(edge)).values()):
            await trio.sleep(0.05)
        async with http(edge) as client:
            for _ in range(20):
                r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
                assert r.status_code == 200
        assert (len(busy_up.records), len(free_up.records)) == (0, 20)
        busy_up.metrics = VLLM % (0, 0, 0.1)
        await eventually(lambda: edge.edge.runs.links["busy"].engine["m"].waiting == 0)
        async with http(edge) as client:
            for _ in range(40):
                await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert len(busy_up.records) > 0 and len(free_up.records) > 20  # ties broken at random


async def test_a_full_kv_cache_makes_a_node_look_busier(nursery):
    """No queue yet, but one server's KV cache is 98% full: new requests go to the other."""
    full_up = await new_upstream(nursery, VLLM % (0, 2, 0.98))
    free_up = await new_upstream(nursery, VLLM % (0, 2, 0.30))
    edge = await start_edge(nursery, edge_config(routing="least_loaded"))
    for node_id, up in (("full", full_up), ("roomy", free_up)):
        await start_node(
            nursery,
            edge,
            [model("m", up, max_concurrency=8, metrics_url=up.base_url[:-3] + "/metrics", metrics_interval_s=0.1)],
            node_id=node_id,
        )
    with trio.fail_after(BOUND):
        while not all("engine" in m for m in (await nodes_view(edge)).values()):
            await trio.sleep(0.05)
        async with http(edge) as client:
            for _ in range(10):
                await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert (len(full_up.records), len(free_up.records)) == (0, 10)


def test_prefix_cache_hit_rates_are_read():
    """vLLM's prefix-cache counters (hits over queried prompt tokens), older vLLM's and
    SGLang's hit-rate gauges."""
    v1 = (
        'vllm:prefix_cache_queries_total{engine="0"} 2000.0\nvllm:prefix_cache_hits_total{engine="0"} 1500.0\n'
        'vllm:prefix_cache_queries_total{engine="1"} 2000.0\nvllm:prefix_cache_hits_total{engine="1"} 500.0\n'
    )
    assert parse(v1) == EngineLoad(prefix_cache_hit_rate=0.5)
    assert parse("vllm:gpu_prefix_cache_hit_rate 0.8\n") == EngineLoad(prefix_cache_hit_rate=0.8)
    assert parse("sglang:cache_hit_rate 1.5\nsglang:num_queue_reqs 1\n") == EngineLoad(
        waiting=1, prefix_cache_hit_rate=1.0
    )


async def test_a_sim_models_prefix_cache_hits_reach_the_edges_metrics(nursery):
    """The sim's prefix cache reports its hit rate as a model server's metrics would:
    /v1/nodes and iop_engine_prefix_cache_hit_rate on the edge (issue 12: its cache hits
    are visible in the node's metrics)."""
    edge = await start_edge(nursery)
    sim = model("m", ttft_ms=0, tokens_per_s=0, prefix_cache_tokens=4096, metrics_interval_s=0.05)
    await start_node(nursery, edge, [sim])
    prompt = [{"role": "user", "content": "a long shared prompt " * 200}]
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            for _ in range(2):
                r = await client.post("/v1/chat/completions", json={"model": "m", "messages": prompt, "max_tokens": 2})
                assert r.status_code == 200
            while not (rate := (await nodes_view(edge))["n1"].get("engine", {}).get("prefix_cache_hit_rate")):
                await trio.sleep(0.05)
            text = (await client.get("/metrics")).text
    assert 0.3 < rate < 0.6  # the second request found the first's blocks
    assert f'iop_engine_prefix_cache_hit_rate{{model="m",node="n1"}} {rate}' in text
    assert "iop_engine_requests_running{" not in text  # the sim reports no load: placement is unchanged
