"""The sim model's prefix cache (node.adapters.sim_cache): hits, LRU eviction,
time to first token, and no change at all when it is off."""

from __future__ import annotations

import pytest
import structlog
import trio

from iop.configfile import ConfigError
from node.adapters import Counters
from node.adapters.sim import SimAdapter
from node.adapters.sim_cache import PrefixCache, block_chain, prompt_tokens, render
from node.config import ModelConfig
from proto import RunRequest, ToolCall, Usage
from tests.conftest import model, node_config, sdk, start_edge, start_node

SYSTEM = "You are a careful agent. " * 80  # 2000 characters: 500 tokens, 7 whole blocks of 64


class RecordingSink:
    """Records when the first delta came and the usage reported."""

    def __init__(self) -> None:
        self.started = False
        self.ended = False
        self.first_at: float | None = None
        self.text = ""
        self.usage: Usage | None = None

    async def delta(self, text: str) -> None:
        if self.first_at is None:
            self.first_at = trio.current_time()
        self.started = True
        self.text += text

    async def reasoning(self, text: str) -> None:
        self.started = True

    async def complete(self, finish_reason: str, tool_calls: list[ToolCall] | None = None, usage=None, stop="") -> None:
        self.ended = True
        self.usage = usage

    async def error(self, message: str, status: int = 0) -> None:
        raise AssertionError(message)


def sim(**kw) -> tuple[SimAdapter, Counters]:
    kw.setdefault("ttft_ms", 100.0)
    kw.setdefault("tokens_per_s", 0.0)
    counters = Counters()
    return SimAdapter(ModelConfig(name="m", adapter="sim", **kw), counters), counters


async def ask(adapter: SimAdapter, messages: list[dict]) -> tuple[float, RecordingSink]:
    """(seconds to the first token, the sink)."""
    sink = RecordingSink()
    start = trio.current_time()
    body = {"model": "m", "messages": messages, "max_tokens": 8}
    await adapter.run(RunRequest(run_id="r", model="m", target="m", request=body, timeout_s=60), sink)
    assert sink.first_at is not None
    return sink.first_at - start, sink


def cacheable(messages: list[dict], block: int = 64) -> int:
    """Tokens of the whole blocks of a prompt."""
    return len(block_chain(render({"messages": messages}), block)) * block


async def test_growing_conversation_hits_its_earlier_turns(autojump_clock):
    """Each turn of a conversation finds every whole block of the turn before it cached."""
    adapter, counters = sim(prefix_cache_tokens=100_000)
    messages = [{"role": "system", "content": SYSTEM}]
    hits = []
    for turn in range(5):
        expected = cacheable(messages[:-1]) if turn else 0  # the whole blocks of the last turn's prompt
        messages.append({"role": "user", "content": f"question {turn}: " + "detail " * 40})
        before = counters.prefix_hit_tokens
        _, sink = await ask(adapter, messages)
        hits.append(counters.prefix_hit_tokens - before)
        assert hits[-1] >= expected
        assert sink.usage is not None
        assert sink.usage.prompt_tokens == prompt_tokens(render({"messages": messages}))
        messages.append({"role": "assistant", "content": sink.text})
    assert hits[0] == 0
    assert hits == sorted(hits) and hits[-1] > hits[1] > 0
    total = sum(prompt_tokens(render({"messages": messages[: 2 * t + 2]})) for t in range(5))
    assert counters.prefix_hit_tokens + counters.prefix_miss_tokens == total
    assert adapter.hit_tokens == counters.prefix_hit_tokens


async def test_another_conversation_hits_only_the_shared_system_prompt(autojump_clock):
    """Two conversations with one system prompt share its whole blocks, no more."""
    adapter, counters = sim(prefix_cache_tokens=100_000)
    system = {"role": "system", "content": SYSTEM}
    await ask(adapter, [system, {"role": "user", "content": "first " * 50}])
    before = counters.prefix_hit_tokens
    await ask(adapter, [system, {"role": "user", "content": "second " * 50}])
    assert counters.prefix_hit_tokens - before == 7 * 64  # the 7 whole blocks inside the system prompt


def test_lru_evicts_the_least_recently_used_prompt_at_capacity():
    """At capacity the least recently used blocks go; a prompt used since stays."""
    cache = PrefixCache(capacity_tokens=4 * 64, block_tokens=64)
    a, b, c = ([bytes([n, i]) for i in range(2)] for n in range(3))
    assert cache.admit(a) == 0
    assert cache.admit(b) == 0
    assert cache.admit(a) == 128  # a is now the most recent
    assert cache.admit(c) == 0  # evicts b, the least recently used
    assert cache.cached_tokens == 256
    assert cache.evicted_tokens == 128
    assert cache.admit(a) == 128
    assert cache.admit(b) == 0


def test_lru_evicts_a_prompts_tail_before_its_head():
    """A prompt's head is used more recently than its tail: what is evicted leaves a usable prefix."""
    cache = PrefixCache(capacity_tokens=4 * 64, block_tokens=64)
    long = [bytes([1, i]) for i in range(4)]
    cache.admit(long)
    cache.admit([bytes([2, 0])])  # one block more than fits: long's last block goes
    assert cache.admit(long[:3]) == 3 * 64
    assert cache.admit([bytes([3, i]) for i in range(8)]) == 0  # longer than the cache: its head is kept
    assert cache.cached_tokens == 256


async def test_time_to_first_token_is_base_plus_uncached_prefill(autojump_clock):
    """TTFT = ttft_ms + uncached prompt tokens / prefill_tokens_per_s."""
    adapter, _ = sim(prefix_cache_tokens=100_000, prefill_tokens_per_s=1000.0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello " * 100}]
    total = prompt_tokens(render({"messages": messages}))
    ttft, sink = await ask(adapter, messages)
    assert ttft == pytest.approx(0.1 + total / 1000)
    assert sink.usage.cached_tokens == 0
    ttft, sink = await ask(adapter, messages)  # all whole blocks cached now
    assert ttft == pytest.approx(0.1 + (total - cacheable(messages)) / 1000)
    assert total - cacheable(messages) < 64
    assert sink.usage.cached_tokens == cacheable(messages)  # reported as OpenAI's cached_tokens


async def test_concurrent_prefills_share_the_models_rate(autojump_clock):
    """prefill_shared: a second uncached prompt arriving with the first waits for it
    (one GPU's prefill throughput); without it, each prefills at the full rate."""
    for shared in (True, False):
        adapter, _ = sim(prefix_cache_tokens=100_000, prefill_tokens_per_s=1000.0, prefill_shared=shared)
        prompts = [[{"role": "user", "content": f"{name} " * 400}] for name in ("first", "second")]
        sizes = [prompt_tokens(render({"messages": m})) for m in prompts]
        ttfts: list[float] = []

        async def one(adapter, messages, ttfts):
            ttfts.append((await ask(adapter, messages))[0])

        async with trio.open_nursery() as nursery:
            for messages in prompts:
                nursery.start_soon(one, adapter, messages, ttfts)
                await trio.lowlevel.checkpoint()
        expected = [0.1 + sizes[0] / 1000, 0.1 + (sizes[0] + sizes[1]) / 1000 if shared else 0.1 + sizes[1] / 1000]
        assert sorted(ttfts) == pytest.approx(sorted(expected)), shared


async def test_off_by_default_keeps_the_sim_as_it_was(autojump_clock):
    """With no prefix_cache_tokens: no cache, TTFT is ttft_ms whatever the prompt, usage as before."""
    assert ModelConfig(name="m", adapter="sim").prefix_cache_tokens == 0
    adapter, counters = sim()
    assert adapter.cache is None
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello " * 100}]
    for _ in range(2):
        ttft, sink = await ask(adapter, messages)
        assert ttft == pytest.approx(0.1)
        assert sink.usage is not None and sink.usage.prompt_tokens == len("hello " * 100) // 4
    assert counters.prefix_hit_tokens == counters.prefix_miss_tokens == 0
    with structlog.testing.capture_logs() as logs:
        await adapter.aclose()
    assert logs == []


@pytest.mark.parametrize(
    "bad", [{"prefix_cache_tokens": -1}, {"prefill_tokens_per_s": -1.0}, {"prefix_block_tokens": 0}]
)
def test_config_refuses_a_negative_cache(bad):
    """The node refuses to start with a negative cache size or prefill rate, or an empty block."""
    config = node_config(["ws://127.0.0.1:1/v1/node/link"], [model("m", **bad)])
    with pytest.raises(ConfigError, match="models\\[0\\]"):
        config.check()


async def test_node_counts_and_logs_cache_hits(nursery):
    """Through an edge and a node: the node's counters count the hits, and it
    logs one summary line per model when it stops."""
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("m", ttft_ms=1, tokens_per_s=0, prefix_cache_tokens=10_000)])
    client = sdk(edge)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    with trio.fail_after(20):
        for _ in range(2):
            reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    assert reply.usage is not None and reply.usage.prompt_tokens == prompt_tokens(render({"messages": messages}))
    counters = node.agent.counters
    assert counters.prefix_hit_tokens == 7 * 64
    assert counters.prefix_hit_tokens + counters.prefix_miss_tokens == 2 * reply.usage.prompt_tokens
    with structlog.testing.capture_logs() as logs:
        await node.agent.adapters["m"].aclose()
    assert [(e["event"], e["model"], e["runs"], e["hit_tokens"]) for e in logs] == [("sim prefix cache", "m", 2, 448)]
    await client.close()
