"""The sim model's prefix cache: a model of a real engine's KV cache reuse.

A real engine (vLLM's automatic prefix caching, SGLang's radix cache) keeps
the KV blocks of prompts it has prefilled and, when a new prompt starts with
the same tokens, skips prefilling them. This module models only what placement
can see of that: which leading blocks of a prompt are still cached, on this
node, for this model.

- The prompt is rendered the way a chat template would, in order: the tool
  definitions, then each message's role and text (with its tool calls). One
  token is four characters (the edge's estimate); a block is
  ``prefix_block_tokens`` tokens. Only whole blocks are cached.
- Block *i*'s key is a hash of the rendered prompt up to the end of block *i*
  (one running BLAKE2b), so a block matches only after the same prefix.
- The cache is an LRU of block keys bounded by ``prefix_cache_tokens``. A
  prompt is looked up and then inserted when it arrives (its prefill is
  modelled as done by its first token). Its blocks are touched last to first,
  so a prompt's head is the most recently used part: tails are evicted before
  the prefixes they depend on, as engines do.

Time to first token is then ``ttft_ms + uncached prompt tokens /
prefill_tokens_per_s``; prefill of concurrent requests does not contend (no
batching is modelled).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import msgspec

from node.adapters.sim_tools import _text

CHARS_PER_TOKEN = 4  # the edge's estimate

_encode = msgspec.json.Encoder().encode


def render(body: dict[str, Any]) -> bytes:
    """What a chat template would put before the model's answer, as UTF-8:
    tool definitions, then each message's role, text and tool calls, in order."""
    parts: list[bytes] = []
    tools = body.get("tools")
    if tools:
        parts.append(b"\x1etools\x1f" + _encode(tools))
    for message in body.get("messages") or ():
        if not isinstance(message, dict):
            continue
        parts.append(b"\x1e" + str(message.get("role") or "").encode() + b"\x1f")
        parts.append(_text(message.get("content")).encode("utf-8", "surrogatepass"))
        calls = message.get("tool_calls")
        if calls:
            parts.append(_encode(calls))
    return b"".join(parts)


def block_chain(rendered: bytes, block_tokens: int) -> list[bytes]:
    """The keys of the whole blocks of a rendered prompt, first to last."""
    size = block_tokens * CHARS_PER_TOKEN
    h = hashlib.blake2b(digest_size=16)
    keys = []
    for start in range(0, len(rendered) - size + 1, size):
        h.update(rendered[start : start + size])
        keys.append(h.copy().digest())
    return keys


def prompt_tokens(rendered: bytes) -> int:
    return max(1, len(rendered) // CHARS_PER_TOKEN)


class PrefixCache:
    """An LRU of prompt-prefix blocks holding at most ``capacity_tokens``
    tokens (whole blocks of ``block_tokens``)."""

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.evicted_tokens = 0

    @property
    def cached_tokens(self) -> int:
        return len(self.blocks) * self.block_tokens

    def admit(self, chain: list[bytes]) -> int:
        """Tokens of ``chain``'s leading blocks that were cached; the whole
        chain is cached afterwards (as much of it as fits, head first)."""
        hits = 0
        for key in chain:
            if key not in self.blocks:
                break
            hits += 1
        for key in reversed(chain[: self.capacity_blocks]):
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)
            self.evicted_tokens += self.block_tokens
        return hits * self.block_tokens
