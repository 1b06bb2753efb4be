"""A simulated model: deterministic text at a configured pace, no GPU.

Given ``tools`` it calls them too, deterministically, with arguments valid
for their schemas (the rule is in :mod:`node.adapters.sim_tools`); given a
JSON ``response_format`` it answers JSON (of the schema, if one is given).

With ``prefix_cache_tokens`` set it models a prefix cache
(:mod:`node.adapters.sim_cache`): the first token waits ``ttft_ms`` plus the
uncached prompt tokens at ``prefill_tokens_per_s``, and usage counts the
whole rendered prompt (without the cache: the last user message). With
``prefill_shared`` (the default) that rate is the model's: prefills run one
after another, first come first served, as on one GPU whose prefill
throughput concurrent requests share; a prefill waits for those ahead. Hits and
misses add to the
node's :class:`~node.adapters.Counters` and are logged per model, one line
every :data:`SUMMARY_EVERY` runs and one when the node stops.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from typing import Any

import msgspec
import structlog
import trio

from node.adapters import Counters, Sink
from node.adapters.sim_cache import PrefixCache, block_chain, prompt_tokens, render
from node.adapters.sim_tools import structured_text, tool_call_for, tool_results_text
from node.config import ModelConfig
from proto import RunRequest, Usage

log = structlog.get_logger("iop.node")

SUMMARY_EVERY = 100  # runs between two "sim prefix cache" log lines, per model

_WORDS = (
    "the edge streams every token the node produces while the model keeps thinking about "
    "structured concurrency cancellation and prompt caches across many small requests"
).split()


def _last_user_text(request: dict[str, Any]) -> str:
    for message in reversed(request.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                texts = (p.get("text") for p in content if isinstance(p, dict))
                return " ".join(t for t in texts if isinstance(t, str))
    return ""


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    """The request's stop strings (``stop``: a string or a list of them)."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    return tuple(s for s in stops[:16] if isinstance(s, str) and s)


def sim_tokens(prompt: str, count: int) -> Iterator[str]:
    """The same prompt always gives the same tokens, made one at a time (a
    huge ``count`` costs time, never memory)."""
    seed = zlib.crc32(prompt.encode())
    for i in range(count):
        seed = (seed * 1103515245 + 12345) & 0x7FFFFFFF
        word = _WORDS[seed % len(_WORDS)]
        yield word if i == 0 else " " + word


class _StopScan:
    """Stop strings found in text fed a piece at a time, each with the state of its
    Knuth-Morris-Pratt matcher: how much of its start the text so far ends with. That
    much is held back (:attr:`longest_start`): a model server returns no part of a stop
    string, and one may span two tokens. Each character costs a step per stop string,
    however long they are, and each matcher's table grows only as far as its state has
    (a table built whole for a stop string of 8 MB took the node's loop 0.8 s and 300 MB)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.failure: list[list[int]] = [[0] for _ in stops]
        self.state = [0] * len(stops)

    def feed(self, piece: str) -> int | None:
        """Where in ``piece`` the first stop string found ends; None: none ends in it."""
        for at, ch in enumerate(piece):
            for n, stop in enumerate(self.stops):
                k, fail = self.state[n], self.failure[n]
                while k and stop[k] != ch:
                    k = fail[k - 1]
                if stop[k] == ch:
                    k += 1
                if k == len(stop):
                    return at + 1
                if k > len(fail):  # (a step further than ever: its fallback, from those before it)
                    _extend(fail, stop)
                self.state[n] = k
        return None

    @property
    def longest_start(self) -> int:
        """The length of the longest end of the text so far that a stop string starts with."""
        return max(self.state)


def _extend(table: list[int], stop: str) -> None:
    """Add the next entry of ``stop``'s failure table: for its prefix one longer than
    ``table`` covers, the longest proper prefix that is also its suffix."""
    i = len(table)
    k = table[i - 1]
    while k and stop[i] != stop[k]:
        k = table[k - 1]
    table.append(k + 1 if stop[i] == stop[k] else k)


class SimAdapter:
    def __init__(self, model: ModelConfig, counters: Counters) -> None:
        self.model = model
        self.counters = counters
        on = model.prefix_cache_tokens > 0
        self.cache = PrefixCache(model.prefix_cache_tokens, model.prefix_block_tokens) if on else None
        self.runs = 0
        self.hit_tokens = 0  # this model's, as counted in counters.prefix_hit_tokens
        self.miss_tokens = 0
        self.active = 0
        self.peak_active = 0
        self._prefill_free = -math.inf  # (prefill_shared) when the prefills already admitted are done

    def _prefill(self, body: dict[str, Any]) -> tuple[float, int, int]:
        """With the cache on: (prefill seconds, prompt tokens, of them cached),
        and the cache counted and updated."""
        assert self.cache is not None
        rendered = render(body)
        total = prompt_tokens(rendered)
        hit = min(self.cache.admit(block_chain(rendered, self.model.prefix_block_tokens)), total)
        miss = total - hit
        self.runs += 1
        self.hit_tokens += hit
        self.miss_tokens += miss
        self.counters.prefix_hit_tokens += hit
        self.counters.prefix_miss_tokens += miss
        if self.runs % SUMMARY_EVERY == 0:
            self.log_summary()
        rate = self.model.prefill_tokens_per_s
        seconds = miss / rate if rate > 0 else 0.0
        if self.model.prefill_shared:  # one GPU's prefill throughput, first come first served
            now = trio.current_time()
            self._prefill_free = max(now, self._prefill_free) + seconds
            seconds = self._prefill_free - now
        return seconds, total, hit

    def log_summary(self) -> None:
        if self.cache is None:
            return
        prompt = self.hit_tokens + self.miss_tokens
        log.info(
            "sim prefix cache",
            model=self.model.name,
            runs=self.runs,
            hit_tokens=self.hit_tokens,
            miss_tokens=self.miss_tokens,
            hit_ratio=round(self.hit_tokens / prompt, 4) if prompt else 0.0,
            cached_tokens=self.cache.cached_tokens,
            evicted_tokens=self.cache.evicted_tokens,
            peak_active=self.peak_active,
        )

    async def run(self, request: RunRequest, sink: Sink) -> None:
        body = request.request
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        limited = isinstance(limit, int) and limit > 0
        count = int(limit) if limited else self.model.sim_tokens
        if limited and self.model.sim_stops and count > self.model.sim_tokens:
            count, limited = self.model.sim_tokens, False  # its own answer ends before max_tokens
        prompt = _last_user_text(body)
        call = tool_call_for(body)
        words: list[str] | None = None  # a whole answer: JSON asked for, or what tool results said
        if call is None and (structured := structured_text(body)) is not None:
            words = [structured[i : i + 4] for i in range(0, len(structured), 4)]  # a tokenizer's 4 characters
        elif call is None and (said := tool_results_text(body)) is not None:
            words = [w if i == 0 else " " + w for i, w in enumerate(said.split(" "))]
        tokens: Iterator[str]
        if call is not None:  # no text, one native call
            tokens = iter(())
            need = max(1, len(call.function.arguments) // 4)
            if limited and need > count:  # cut, as a model server cuts a call: its arguments so far
                cut = msgspec.structs.replace(call.function, arguments=call.function.arguments[: count * 4])
                call = msgspec.structs.replace(call, function=cut)
                finish = "length"
            else:
                count, finish = need, "tool_calls"
        elif words is not None:
            finish = "length" if limited and len(words) > count else "stop"
            count = min(count, len(words)) if limited else len(words)
            tokens = iter(words[:count])
        else:
            tokens = sim_tokens(prompt, count)
            finish = "length" if limited else "stop"
        prefill_s, cache_prompt_tokens, cached = self._prefill(body) if self.cache is not None else (0.0, 0, None)
        matched = ""
        self.counters.active_upstream += 1
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            start = trio.current_time() + self.model.ttft_ms / 1000 + prefill_s
            await trio.sleep_until(start)
            tps = self.model.tokens_per_s
            stop_strings = _stops(body) if call is None else ()
            stops = _StopScan(stop_strings) if stop_strings else None
            held = ""  # text not sent yet: it may be the start of a stop string
            for i, token in enumerate(tokens):
                if tps > 0 and i:
                    await trio.sleep_until(start + i / tps)
                elif i % 64 == 0:
                    await trio.lowlevel.checkpoint()
                if stops is None:
                    await sink.delta(token)
                    continue
                text = held + token
                end = stops.feed(token)
                if end is not None:  # as a model server stops: the text before the stop string, and which it was
                    text = text[: len(held) + end]
                    at, matched = min((text.find(stop), stop) for stop in stops.stops if stop in text)
                    if at:
                        await sink.delta(text[:at])
                    held, count, finish = "", i + 1, "stop"
                    break
                keep = stops.longest_start
                if len(text) > keep:
                    await sink.delta(text[: len(text) - keep])
                held = text[len(text) - keep :]
            if held:  # the end of the answer: no stop string after all
                await sink.delta(held)
        finally:
            self.counters.active_upstream -= 1
            self.active -= 1
        if cache_prompt_tokens:
            prompt_count = cache_prompt_tokens
        elif self.model.sim_stops:  # as a model: the whole prompt (Claude Code's 19k tokens, not its last words)
            prompt_count = prompt_tokens(render(body))
        else:
            prompt_count = max(1, len(prompt) // 4)
        await sink.complete(
            finish,
            tool_calls=[call] if call is not None else None,
            stop=matched,
            usage=Usage(
                prompt_tokens=prompt_count,
                completion_tokens=count,
                total_tokens=prompt_count + count,
                cached_tokens=cached,
            ),
        )

    async def aclose(self) -> None:
        if self.runs % SUMMARY_EVERY:  # runs since the last line
            self.log_summary()
