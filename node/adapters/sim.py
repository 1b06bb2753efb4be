"""A simulated model: deterministic text at a configured pace, no GPU.

Given ``tools`` it calls them too, deterministically, with arguments valid
for their schemas (the rule is in :mod:`node.adapters.sim_tools`).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import trio

from node.adapters import Counters, Sink
from node.adapters.sim_tools import tool_call_for, tool_results_text
from node.config import ModelConfig
from proto import RunRequest, Usage

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


def sim_tokens(prompt: str, count: int) -> Iterator[str]:
    """The same prompt always gives the same tokens, made one at a time (a
    huge ``count`` costs time, never memory)."""
    seed = zlib.crc32(prompt.encode())
    for i in range(count):
        seed = (seed * 1103515245 + 12345) & 0x7FFFFFFF
        word = _WORDS[seed % len(_WORDS)]
        yield word if i == 0 else " " + word


class SimAdapter:
    def __init__(self, model: ModelConfig, counters: Counters) -> None:
        self.model = model
        self.counters = counters

    async def run(self, request: RunRequest, sink: Sink) -> None:
        body = request.request
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        limited = isinstance(limit, int) and limit > 0
        count = int(limit) if limited else self.model.sim_tokens
        prompt = _last_user_text(body)
        call = tool_call_for(body)
        said = tool_results_text(body) if call is None else None
        tokens: Iterator[str]
        if call is not None:  # no text, one native call
            tokens = iter(())
            count = max(1, len(call.function.arguments) // 4)
            finish = "tool_calls"
        elif said is not None:  # after tool results: what they said
            words = [w if i == 0 else " " + w for i, w in enumerate(said.split(" "))]
            finish = "length" if limited and len(words) > count else "stop"
            count = min(count, len(words)) if limited else len(words)
            tokens = iter(words[:count])
        else:
            tokens = sim_tokens(prompt, count)
            finish = "length" if limited else "stop"
        self.counters.active_upstream += 1
        try:
            start = trio.current_time() + self.model.ttft_ms / 1000
            await trio.sleep_until(start)
            tps = self.model.tokens_per_s
            for i, token in enumerate(tokens):
                if tps > 0 and i:
                    await trio.sleep_until(start + i / tps)
                elif i % 64 == 0:
                    await trio.lowlevel.checkpoint()
                await sink.delta(token)
        finally:
            self.counters.active_upstream -= 1
        prompt_tokens = max(1, len(prompt) // 4)
        await sink.complete(
            finish,
            tool_calls=[call] if call is not None else None,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=count, total_tokens=prompt_tokens + count),
        )

    async def aclose(self) -> None:
        pass
