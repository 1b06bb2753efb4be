"""Placement across a fleet: prefix chains, the prefix index, rendezvous hashing, the load gap."""

from __future__ import annotations

import tracemalloc

import msgspec
import pytest
import trio

from edge.config import ConfigError, EdgeConfig
from edge.openai.request import prompt_prefix
from edge.openai.schema import ChatRequest
from edge.runs import NodeLink, RunService, Want
from edge.runs.placement import BLOCK_BYTES, MAX_HOLDERS, PrefixIndex, prefix_chain, prompt_chain, rendezvous
from proto import ModelInfo
from scripts.upstream import Upstream
from tests.conftest import BOUND, edge_config, eventually, http, model, settled, start_edge, start_node

SYSTEM = "You are a careful assistant. " * 70  # 2030 bytes: 8 blocks


def service(**kw) -> RunService:
    return RunService(EdgeConfig(**kw))


def link(node_id: str, capacity: int = 8) -> NodeLink:
    return NodeLink(node_id, [ModelInfo(name="m", adapter="sim", target="t", max_concurrency=capacity)])


def fleet(n: int, capacity: int = 8, **kw) -> tuple[RunService, list[NodeLink]]:
    runs = service(**kw)
    links = [link(f"node-{i}", capacity) for i in range(n)]
    for lk in links:
        runs.add_link(lk)
    return runs, links


def chain(*messages: tuple[str, str]) -> tuple[int, ...]:
    return prefix_chain("m", messages)


def test_a_growing_conversation_matches_its_head():
    """Every block of the earlier turns matches when the conversation grows by messages."""
    first = chain(("system", SYSTEM), ("user", "What is 2 + 2?"))
    grown = chain(("system", SYSTEM), ("user", "What is 2 + 2?"), ("assistant", "4"), ("user", "And 3 + 3?"))
    assert grown[: len(first)] == first and len(grown) == len(first) + 2
    index = PrefixIndex(1000)
    index.record(first, "a")
    assert index.match(grown, {"a", "b"}) == (len(first), {"a"})
    assert index.match(grown, {"b"}) == (0, set())  # only candidates count


def test_a_shared_system_prompt_with_different_tails_matches_the_system_blocks():
    """Different tails after the same system prompt match its blocks, and a long message
    that differs only at its end matches at least half of what it shares, in whole blocks
    (the index keeps the blocks at powers of two of each prompt, and its last)."""
    index = PrefixIndex(1000)
    index.record(chain(("system", SYSTEM), ("user", "x" * 9 * BLOCK_BYTES + "one")), "a")
    assert index.match(chain(("system", SYSTEM), ("user", "short")), {"a"})[0] == 8
    shared = 8 + 9  # blocks: the system prompt's, then the long message's whole ones
    depth = index.match(chain(("system", SYSTEM), ("user", "x" * 9 * BLOCK_BYTES + "two")), {"a"})[0]
    assert depth == 16 and shared / 2 <= depth <= shared
    assert index.match(chain(("system", "Another prompt."), ("user", "short")), {"a"})[0] == 0
    assert prefix_chain("other-model", [("system", SYSTEM)])[0] != chain(("system", SYSTEM))[0]


def test_the_chain_is_over_rendered_text_not_json_shape():
    """Text parts and a plain string give the same chain; tools come first; roles count."""

    def req(messages, **kw) -> ChatRequest:
        return msgspec.convert({"model": "m", "messages": messages, **kw}, ChatRequest)

    plain = prompt_prefix(req([{"role": "user", "content": "hello world"}]))
    parts = prompt_prefix(req([{"role": "user", "content": [{"type": "text", "text": "hello world"}]}]))
    assert plain == parts and len(plain[0]) == 1
    assert prompt_prefix(req([{"role": "system", "content": "hello world"}]))[0] != plain[0]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools, opening = prompt_prefix(req([{"role": "user", "content": "hello world"}], tools=[tool]))
    assert len(with_tools) == 2 and with_tools[1] != plain[0][0]
    assert opening == 1  # (the conversation's opening: its first user message's last block)


def test_the_index_is_capped_and_forgets_the_least_recent():
    """Never more than max_entries keys; a key recorded again survives keys recorded once
    since; the memory per key stays small."""
    index = PrefixIndex(100)
    hot = chain(("user", "hot"))
    for i in range(1000):
        index.record(chain(("user", f"cold {i}")), f"n{i % 3}")
        if i % 10 == 0:
            index.record(hot, "a")
        assert len(index) <= 100
    assert index.match(hot, {"a"}) == (1, {"a"})
    assert index.match(chain(("user", "cold 999")), {"n0"})[0] == 1
    assert index.match(chain(("user", "cold 0")), {"n0"})[0] == 0
    assert len(PrefixIndex(0)) == 0
    off = PrefixIndex(0)
    off.record(hot, "a")
    assert len(off) == 0

    n = 100_000
    tracemalloc.start()
    try:
        big = PrefixIndex(2 * n)
        before = tracemalloc.get_traced_memory()[0]
        for key in range(2**59, 2**59 + n, 2):  # (a chain of two: both kept)
            big.record((key, key + 1), "node-1")
        per_key = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert len(big) == n and per_key < 120, per_key


def test_long_conversations_in_rotation_each_find_their_last_turn_in_a_small_index():
    """The index keeps a few keys of each prompt (its blocks at powers of two and its last),
    not one per block: a key per 256 bytes kept about 3,000 conversations of 20 KB in the
    default 500,000 keys, and turns of conversations past those were placed cold."""
    index = PrefixIndex(10_000)
    nodes = [f"node-{i}" for i in range(4)]
    talks = [[("system", SYSTEM)] for _ in range(600)]
    sent = [0] * len(talks)  # blocks of each conversation's last turn
    for turn in range(3):
        for c, talk in enumerate(talks):
            talk.append(("user", f"conversation {c}, turn {turn}: " + "q" * 3000))
            ch = chain(*talk)
            if turn:
                assert index.match(ch, nodes) == (sent[c], {nodes[c % 4]}), (c, turn)
            index.record(ch, nodes[c % 4])
            sent[c] = len(ch)
            talk.append(("assistant", "a" * 3000))
    assert min(sent) >= 64  # (a last turn of 17 KB: with a key per block, 40,800 keys)
    assert len(index) <= 10 * len(talks)


def test_a_block_remembers_several_nodes_most_recent_first():
    """A prefix sent to several nodes matches on each of them (up to MAX_HOLDERS)."""
    index = PrefixIndex(1000)
    c = chain(("system", SYSTEM))
    for node in ("a", "b", "c"):
        index.record(c, node)
    assert index.match(c, {"a", "b", "c", "d"}) == (8, {"a", "b", "c"})
    assert index.holders(c[0]) == ("c", "b", "a")


def test_conversations_sharing_a_system_prompt_match_their_own_node_in_a_large_fleet():
    """Eight nodes, one system prompt every conversation starts with (an agent's tools and
    instructions). Its blocks list only the last MAX_HOLDERS nodes that got them, and the match
    stopped there: conversations on the other nodes matched only the system prompt, on another
    node (found from outside: 34% of turns stayed on their node, one node got no run). A
    conversation matches all of its prompt, on its own node."""
    index = PrefixIndex(100_000)
    nodes = [f"node-{i}" for i in range(8)]
    chains = [chain(("system", SYSTEM), ("user", f"conversation {c}: " + "x" * 3000)) for c in range(16)]
    for c, ch in enumerate(chains):
        index.record(ch, nodes[c % 8])
    for c, ch in enumerate(chains):
        assert index.match(ch, nodes) == (len(ch), {nodes[c % 8]})
    # A new conversation matches the system prompt on the nodes listed for it.
    depth, holders = index.match(chain(("system", SYSTEM), ("user", "new")), nodes)
    assert depth == 8 and holders == set(nodes[4:])


def test_relays_flooding_the_index_never_evict_the_edges_own_placements():
    """A node may relay (``placed``) keys it was never sent, within the link's rate: a flood of
    them emptied the whole index in 4 s, and every turn after it was placed cold (found from
    outside). Relays are kept apart, half as many: they evict each other only."""
    index = PrefixIndex(1000)
    mine = [chain(("system", f"prompt {i}"), ("user", "hi " * 100)) for i in range(20)]
    for i, ch in enumerate(mine):
        index.record(ch, f"node-{i % 4}")
    honest = chain(("system", "elsewhere"), ("user", "turn 1"))
    index.record(honest, "node-1", relayed=True)
    assert index.match(honest, {"node-1", "node-2"}) == (len(honest), {"node-1"})
    for key in range(2**59, 2**59 + 100_000, 2):  # the flood (a chain of two: both kept)
        index.record((key, key + 1), "node-9", relayed=True)
    for i, ch in enumerate(mine):
        assert index.match(ch, {f"node-{n}" for n in range(4)}) == (len(ch), {f"node-{i % 4}"})
    assert index.match(honest, {"node-1"}) == (0, set())  # (a relay: evicted by relays)
    assert len(index) <= 1000 + 500


def test_removing_a_node_moves_only_its_own_keys():
    """Rendezvous hashing: with one of 8 nodes removed, every key it did not own stays put,
    and keys spread over all nodes."""
    nodes = [f"node-{i}" for i in range(8)]
    keys = [f"session-{i}".encode() for i in range(2000)]
    owner = {k: rendezvous(k, nodes) for k in keys}
    counts = {n: sum(1 for o in owner.values() if o == n) for n in nodes}
    assert min(counts.values()) > 2000 / 8 / 2
    gone = "node-3"
    rest = [n for n in nodes if n != gone]
    for k in keys:
        after = rendezvous(k, rest)
        if owner[k] != gone:
            assert after == owner[k]
    assert rendezvous(keys[0], reversed(nodes)) == owner[keys[0]]  # order does not matter


async def test_two_edges_choose_the_same_node_for_a_cold_request(autojump_clock):
    """Two run services that share nothing but their links' node ids send the same cold
    request (by session, else by first prefix block) to the same node."""
    one, _ = fleet(8)
    two, _ = fleet(8)
    chosen: set[str] = set()
    for i in range(40):
        want = Want("m", prefix=chain(("system", f"prompt {i}"), ("user", "hi")))
        by_session = Want("m", session=f"conversation-{i}")
        for w in (want, by_session):
            a, b = await one.acquire(w), await two.acquire(w)
            assert a.link.node_id == b.link.node_id
            chosen.add(a.link.node_id)
            one.release(a)
            two.release(b)
    assert len(chosen) >= 6  # cold requests spread


async def test_two_edges_routing_by_session_send_a_new_session_to_the_same_node(autojump_clock):
    """routing = "session": each edge's first choice for a new session was random among the least
    loaded, so with two edges behind a load balancer a session's turns went to two nodes (39-51
    of 120 turns moved: an outside audit). Ties are broken by the session's id, as prefix routing
    breaks them: both edges choose one node, and new sessions still spread."""
    one, _ = fleet(8, routing="session")
    two, _ = fleet(8, routing="session")
    chosen: set[str] = set()
    for i in range(40):
        want = Want("m", session=f"conversation-{i}")
        a, b = await one.acquire(want), await two.acquire(want)
        assert a.link.node_id == b.link.node_id
        chosen.add(a.link.node_id)
        one.release(a)
        two.release(b)
    assert len(chosen) >= 6


async def test_the_longest_prefix_wins_over_rendezvous(autojump_clock):
    """A prompt that holds a conversation's turn past its opening (its next turn, here under a
    new session id) goes to the node that has it, not to the node its session hashes to; the
    placement hook says so."""
    runs, links = fleet(4)
    placed: list[tuple[str, int]] = []
    runs.on_placed.append(lambda how, blocks: placed.append((how, blocks)))
    turn = [("system", SYSTEM), ("user", "a")]
    prefix, opening = prompt_chain("m", turn)
    first = await runs.acquire(Want("m", session="u0", prefix=prefix, opening=opening))
    runs.release(first)
    assert placed == [("rendezvous", 0)]
    ids = [lk.node_id for lk in links]
    other = next(f"u{i}" for i in range(1, 100) if rendezvous(b"su%d" % i, ids) != first.link.node_id)
    prefix, opening = prompt_chain("m", [*turn, ("assistant", "b"), ("user", "c")])
    slot = await runs.acquire(Want("m", session=other, prefix=prefix, opening=opening))
    assert slot.link is first.link
    assert placed[-1] == ("prefix", 9)


async def next_turns_follow(runs: RunService, placed: dict[int, str]) -> None:
    """Each conversation i's next turn goes to the node its first went to (``placed[i]``)."""
    for i, node_id in placed.items():
        prefix, opening = prompt_chain(
            "m", [("system", SYSTEM), ("user", f"conversation {i}"), ("assistant", "ok"), ("user", "and then?")]
        )
        slot = await runs.acquire(Want("m", prefix=prefix, opening=opening))
        runs.release(slot)
        assert slot.link.node_id == node_id, i


def conversation(system: str, first: str) -> Want:
    prefix, opening = prompt_chain("m", [("system", system), ("user", first)])
    return Want("m", prefix=prefix, opening=opening)


async def test_new_conversations_on_a_system_prompt_the_fleet_shares_spread_over_every_node(autojump_clock):
    """Eight idle nodes; a system prompt the index lists for MAX_HOLDERS of them (every
    conversation of an agent starts with it). New conversations went to those listed only, and
    by its first block to one of them: the other nodes got none (found from outside). They go
    to any of the least loaded, by the conversation's opening, and each one's next turn
    follows it there."""
    runs, links = fleet(8)
    for i in range(MAX_HOLDERS):  # conversations placed on 4 nodes (as load spread them)
        runs.prefixes.record(conversation(SYSTEM, f"earlier {i}").prefix, links[i].node_id)
    placed = {}
    for i in range(40):
        want = conversation(SYSTEM, f"conversation {i}")
        slot = await runs.acquire(want)
        runs.release(slot)
        placed[i] = slot.link.node_id
    assert len(set(placed.values())) >= 7, placed
    await next_turns_follow(runs, placed)


async def test_new_conversations_on_a_system_prompt_one_node_got_spread_over_every_node(autojump_clock):
    """One node was sent a system prompt first: every new conversation that opened with it went
    there (the match of its head won), none was ever sent elsewhere, and in a fleet of 4 or
    fewer the block never counted as shared: all runs on one node, its prefix cache
    overflowing, three idle, a lower hit ratio than least_loaded's (an outside audit). A match
    no deeper than the conversation's opening (its first user message) is the fleet's: a new
    conversation goes to the least loaded by its opening; its next turns follow it."""
    runs, links = fleet(4)
    first = await runs.acquire(conversation(SYSTEM, "the first conversation"))
    runs.release(first)
    placed = {}
    for i in range(16):
        slot = await runs.acquire(conversation(SYSTEM, f"conversation {i}"))
        runs.release(slot)
        placed[i] = slot.link.node_id
    assert set(placed.values()) == {lk.node_id for lk in links}, placed
    await next_turns_follow(runs, placed)


def test_head_shares_decay_and_are_bounded():
    """A head's share is of the new conversations of late (a half-life), and at most max_heads
    heads are kept, the least recently seen forgotten."""
    from edge.runs.placement import HeadShares

    shares = HeadShares(half_life_s=10.0, max_heads=3)
    assert shares.share(1, 0.0) == 1.0  # (none counted yet: spread)
    for _ in range(3):
        shares.started(1, 0.0)
    shares.started(None, 0.0)  # a conversation that matched no head: not counted
    shares.started(2, 0.0)
    assert shares.share(1, 0.0) == 0.75 and shares.share(1, 0.0, counting=True) == 0.8
    for _ in range(3):
        shares.started(2, 10.0)  # ten seconds on: head 1's three count 1.5 of 5
    assert shares.share(1, 10.0) == pytest.approx(1.5 / 5) and shares.share(2, 10.0) == pytest.approx(3.5 / 5)
    for head in (3, 4):
        shares.started(head, 10.0)
    assert shares.share(1, 10.0) == 0.0 and shares.share(2, 10.0) > 0  # (head 1 forgotten first)


async def test_new_conversations_spread_by_their_heads_share_of_them(autojump_clock):
    """Eight agents' system prompts, eight conversations each, on four nodes: sent over every
    node, each node's prefix cache held all eight prompts (workload (a) of the fleet benchmark:
    a hit ratio of 82.6% against 88.8%). Each head spreads over as many nodes as its share of
    new conversations: after the first few, one agent's conversations stay on one or two nodes."""
    runs, links = fleet(4)
    nodes_of: dict[int, set[str]] = {}
    per_node = {lk.node_id: 0 for lk in links}
    for group in range(8):
        system = f"[agent {group}] " + SYSTEM
        for c in range(8):
            slot = await runs.acquire(conversation(system, f"conversation {group}.{c}"))
            runs.release(slot)
            nodes_of.setdefault(group, set()).add(slot.link.node_id)
            per_node[slot.link.node_id] += 1
    assert all(len(nodes_of[group]) <= 2 for group in range(2, 8)), nodes_of
    assert all(per_node.values()), per_node


async def test_a_conversation_moved_off_its_busy_node_is_not_counted_as_new(autojump_clock):
    """A conversation's next turn, its node past the load gap (or full), goes elsewhere; it was
    judged against the nodes within the gap only, so it counted as a new conversation of its head
    (swelling the head's share of them). Judged against every node, it is not counted."""
    runs, (one, two) = fleet(2, capacity=8)
    for other, name in ((two, "conversation 1"), (one, "elsewhere")):  # (both nodes hold the head)
        runs.set_draining(other, True)
        runs.release(await runs.acquire(conversation(SYSTEM, name)))
        runs.set_draining(other, False)
    runs.set_draining(two, True)
    held = [await runs.acquire(Want("m", prefix=chain(("user", f"other {i}")))) for i in range(3)]
    runs.set_draining(two, False)
    now = trio.current_time()
    before = runs.heads.counted(now)
    prefix, opening = prompt_chain(
        "m", [("system", SYSTEM), ("user", "conversation 1"), ("assistant", "ok"), ("user", "next")]
    )
    for full in (False, True):  # its node 3/8 busier (past the 0.25 gap), then full
        if full:
            runs.set_draining(two, True)
            held += [await runs.acquire(Want("m", prefix=chain(("user", f"more {i}")))) for i in range(5)]
            runs.set_draining(two, False)
            assert one.free_slots("m") == 0
        slot = await runs.acquire(Want("m", prefix=prefix, opening=opening))
        assert slot.link is two and runs.heads.counted(now) == before, full
        runs.release(slot)


async def test_under_overload_a_freed_slot_goes_to_a_waiter_whose_conversation_is_there(autojump_clock):
    """Every node full, a queue of waiters each past its prefix_wait_ms: the head took whichever
    node freed first, so conversations scattered as at random (200 conversations on 24 slots: 2
    stayed on their node, an outside audit). A slot freeing on a node goes to the first waiter
    whose conversation is there; those ahead of it give way at most MAX_PASSED times, then the
    queue is FIFO again."""
    from edge.runs.service import MAX_PASSED

    runs, links = fleet(3, capacity=1, max_queue=100)
    turns = {}
    for i, lk in enumerate(links):  # conversation i lives on node i
        first = conversation(SYSTEM, f"conversation {i}")
        runs.set_draining(links[(i + 1) % 3], True)
        runs.set_draining(links[(i + 2) % 3], True)
        slot = await runs.acquire(first)
        for other in links:
            runs.set_draining(other, False)
        assert slot.link is lk
        runs.release(slot)
        prefix, opening = prompt_chain(
            "m", [("system", SYSTEM), ("user", f"conversation {i}"), ("assistant", "ok"), ("user", "next")]
        )
        turns[i] = Want("m", prefix=prefix, opening=opening)
    held = {slot.link.node_id: slot for slot in [await runs.acquire(Want("m")) for _ in links]}  # every node full
    got: list[tuple[str, str]] = []

    async def ask(name: str, want: Want) -> None:
        slot = await runs.acquire(want)
        got.append((name, slot.link.node_id))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, "new", conversation(SYSTEM, "a new one"))  # no home: the head
        await trio.sleep(1)
        for i in (2, 0):
            nursery.start_soon(ask, f"turn {i}", turns[i])
            await trio.sleep(1)
        runs.release(held["node-0"])  # node-0 frees: conversation 0's turn takes it, past the head
        await trio.sleep(0.1)
        assert got == [("turn 0", "node-0")]
        runs.release(held["node-1"])  # node-1: no one's home; the head
        await trio.sleep(0.1)
        assert got[-1] == ("new", "node-1")
        runs.release(held["node-2"])
        await trio.sleep(0.1)
        assert got[-1] == ("turn 2", "node-2")
    # The head gives way MAX_PASSED times, then takes the next slot wherever it is.
    runs, links = fleet(2, capacity=1, max_queue=100)
    home = await runs.acquire(turns[0])
    runs.release(home)
    held = [await runs.acquire(Want("m")) for _ in links]
    order: list[str] = []

    async def wait(name: str, want: Want) -> None:
        slot = await runs.acquire(want)
        order.append(name)
        runs.release(slot) if name == "head" else held.append(slot)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "head", Want("m"))
        await trio.sleep(0.1)
        for n in range(MAX_PASSED + 2):
            nursery.start_soon(wait, f"home {n}", turns[0])
            await trio.sleep(0.1)
        for _ in range(MAX_PASSED + 1):
            runs.release(next(s for s in held if s.link is home.link and not s.released))
            await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert order[: MAX_PASSED + 1] == [*(f"home {n}" for n in range(MAX_PASSED)), "head"], order


async def test_a_session_node_past_the_load_gap_is_left_for_a_less_loaded_one(autojump_clock):
    """A session stays on its node while that node is within prefix_max_load_gap of the least
    loaded, its model server's own load counted: a node whose engine reported itself full kept
    every turn of its sessions while another sat idle (an outside audit). Past the gap the turn
    goes elsewhere, and the session follows it; with routing = "session" it stays."""
    from proto import EngineLoad

    for routing, stays in (("prefix", False), ("session", True)):
        runs, (one, two) = fleet(2, routing=routing)
        runs.set_draining(two, True)
        slot = await runs.acquire(Want("m", session="claude-code-user"))
        runs.release(slot)
        runs.set_draining(two, False)
        assert slot.link is one
        one.engine["m"] = EngineLoad(waiting=20, running=8, kv_cache_usage=0.99)
        again = await runs.acquire(Want("m", session="claude-code-user"))
        runs.release(again)
        assert (again.link is one) == stays, routing
        one.engine["m"] = EngineLoad(waiting=0, running=0)
        after = await runs.acquire(Want("m", session="claude-code-user"))
        assert after.link is again.link  # (the session went with it)


async def test_a_hot_prefix_does_not_pile_onto_one_node(autojump_clock):
    """Requests sharing a prefix stay on its node until that node is more than
    prefix_max_load_gap busier than the least loaded; then load wins."""
    runs, links = fleet(4, capacity=8, prefix_max_load_gap=0.25)
    want = Want("m", prefix=chain(("system", SYSTEM), ("user", "same question")))
    held = [await runs.acquire(want) for _ in range(3)]
    assert len({s.link.node_id for s in held}) == 1  # loads 1/8, 2/8, 3/8: the gap allows it
    for _ in range(25):
        held.append(await runs.acquire(want))
        loads = [lk.load("m") for lk in links]
        assert max(loads) - min(loads) <= 0.25 + 1 / 8
    for slot in held:
        runs.release(slot)
    assert runs.prefixes.match(want.prefix, {lk.node_id for lk in links})[0] == len(want.prefix)


async def _busy_prefix_holder(**kw) -> tuple[RunService, NodeLink, NodeLink, Want, list]:
    """Two nodes of 4 slots: the one holding the prompt's prefix full, the other 3/4 busy
    with other prompts (within the 0.25 load gap)."""
    runs, links = fleet(2, capacity=4, **kw)
    holder, other = links
    want = Want("m", prefix=chain(("system", SYSTEM), ("user", "the question")))
    runs.set_draining(other, True)
    held = [await runs.acquire(want) for _ in range(4)]
    runs.set_draining(other, False)
    runs.set_draining(holder, True)
    held += [await runs.acquire(Want("m", prefix=chain(("user", f"other {i}")))) for i in range(3)]
    runs.set_draining(holder, False)
    assert holder.in_flight["m"] == 4 and other.in_flight["m"] == 3
    return runs, holder, other, want, held


async def test_a_request_waits_briefly_for_the_busy_node_holding_its_prefix(autojump_clock):
    """With its prefix's node full but within the load gap, a request waits (up to
    prefix_wait_ms) for a slot there rather than taking the free node that would
    prefill it all again; meanwhile it counts as demand to that node only."""
    runs, holder, other, want, held = await _busy_prefix_holder(prefix_wait_ms=250)
    waits: list[bool] = []
    runs.on_prefix_wait.append(waits.append)
    got: list = []

    async def ask() -> None:
        got.append((await runs.acquire(want), trio.current_time()))

    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        nursery.start_soon(ask)
        await trio.sleep(0.1)
        assert not got and other.free_slots("m") == 1
        assert runs.waiting_for("m", holder.node_id) == 1 and runs.waiting_for("m", other.node_id) == 0
        runs.release(next(s for s in held if s.link is holder))
    (slot, at) = got[0]
    assert slot.link is holder and at - start == pytest.approx(0.1)
    assert runs.waiting_for("m", holder.node_id) == 0 and waits == [True]  # iop_prefix_waits_total{outcome="there"}


async def test_the_wait_for_a_prefix_node_is_bounded_and_can_be_switched_off(autojump_clock):
    """No slot frees there: after prefix_wait_ms the request takes the free node; with
    prefix_wait_ms = 0 it takes it at once. A waiter that is cancelled is no one's demand."""
    for wait_ms in (250, 0):
        runs, holder, other, want, _ = await _busy_prefix_holder(prefix_wait_ms=wait_ms)
        waits: list[bool] = []
        runs.on_prefix_wait.append(waits.append)
        start = trio.current_time()
        slot = await runs.acquire(want)
        assert slot.link is other and trio.current_time() - start == pytest.approx(wait_ms / 1000)
        assert runs.waiting_for("m", holder.node_id) == 0
        assert waits == ([False] if wait_ms else [])
    runs, holder, other, want, _ = await _busy_prefix_holder()
    with trio.move_on_after(0.05):
        await runs.acquire(want)
    assert runs.waiting_for("m", holder.node_id) == 0 and runs.queue_depth("m") == 0


async def test_a_new_conversation_waits_for_its_heads_busy_node_only_when_the_head_is_not_everyones(autojump_clock):
    """The busy node holds only the system prompt a new conversation opens with. When every new
    conversation opens with it (one agent), the conversation takes the free node at once: it
    waited prefix_wait_ms for the busy one, and so piled onto it. When it is one agent's of
    eight, it waits for its head's node as a prompt waits for its prefix's (up to
    prefix_wait_ms): spread over every node, eight agents' heads filled every cache."""
    runs, holder, other, _, _ = await _busy_prefix_holder(prefix_wait_ms=250)
    start = trio.current_time()
    slot = await runs.acquire(conversation(SYSTEM, "a new conversation"))
    assert slot.link is other and trio.current_time() == start
    runs, holder, other, _, _ = await _busy_prefix_holder(prefix_wait_ms=250)
    for agent in range(7):  # (each agent's second conversation matches its head)
        for c in range(2):
            runs.release(await runs.acquire(conversation(f"[agent {agent}] " + SYSTEM, f"c{c}")))
    start = trio.current_time()
    slot = await runs.acquire(conversation(SYSTEM, "a new conversation"))
    assert slot.link is other and trio.current_time() - start == pytest.approx(0.25)


async def test_requests_waiting_for_a_busy_node_cost_nothing_while_it_stays_busy(autojump_clock, monkeypatch):
    """200 requests wait for the busy node holding their (2,048-block) prefix: slots coming and
    going on the other node look at none of their prompts (no prefix matching per waiter on each
    wake, which made every slot change cost O(queue x prompt))."""
    runs, holder, other, want, held = await _busy_prefix_holder(prefix_wait_ms=250, max_queue=1000)
    long = Want("m", prefix=chain(("system", SYSTEM), ("user", "y" * 600_000)))
    runs.prefixes.record(long.prefix, holder.node_id)
    matches = 0
    match = runs.prefixes.match

    def counted(chain, candidates):
        nonlocal matches
        matches += 1
        return match(chain, candidates)

    async with trio.open_nursery() as nursery:
        for _ in range(200):
            nursery.start_soon(runs.acquire, long)
        await trio.sleep(0.01)
        assert runs.waiting_for("m", holder.node_id) == 200 and runs.waiting_for("m", other.node_id) == 0
        monkeypatch.setattr(runs.prefixes, "match", counted)
        for _ in range(20):
            runs.release(next(s for s in held if s.link is other and not s.released))
            held.append(await runs.acquire(Want("m")))  # no prefix: takes the freed slot
        assert matches == 0
        nursery.cancel_scope.cancel()


async def test_a_session_id_beats_the_prefix(autojump_clock):
    """A session placed on one node stays there even when another node holds its prompt's prefix."""
    runs, links = fleet(2)
    prompt = chain(("system", SYSTEM), ("user", "q"))
    holder = await runs.acquire(Want("m", prefix=prompt))
    runs.release(holder)
    other = next(lk for lk in links if lk is not holder.link)
    runs.set_draining(holder.link, True)
    placed = await runs.acquire(Want("m", session="s"))
    runs.release(placed)
    runs.set_draining(holder.link, False)
    assert placed.link is other
    slot = await runs.acquire(Want("m", session="s", prefix=prompt))
    assert slot.link is other


async def test_routing_policies_can_be_switched_off(autojump_clock):
    """routing = "least_loaded" ignores sessions and prefixes; "session" ignores prefixes."""
    prompt = chain(("system", SYSTEM))
    for routing in ("least_loaded", "session"):
        runs, links = fleet(2, capacity=2, routing=routing)
        session = None if routing == "session" else "s"
        held = [await runs.acquire(Want("m", session=session, prefix=prompt)) for _ in range(2)]
        assert {s.link.node_id for s in held} == {"node-0", "node-1"}
        assert len(runs.prefixes) == 0
    runs, _ = fleet(3, routing="random")
    assert (await runs.acquire(Want("m", prefix=prompt))).link.node_id.startswith("node-")


def test_placement_config_is_checked():
    """A load gap outside [0, 1] or a negative index size is a config error."""
    EdgeConfig(routing="prefix", prefix_max_load_gap=0.5, prefix_index_entries=0).check()
    with pytest.raises(ConfigError):
        EdgeConfig(prefix_max_load_gap=1.5).check()
    with pytest.raises(ConfigError):
        EdgeConfig(prefix_index_entries=-1).check()


async def test_two_edges_send_each_growing_conversation_to_one_node(nursery):
    """Three nodes linked to two edges; conversations without a session id, their turns sent
    alternately to either edge, each stay on one node, and different conversations spread."""
    ups = []
    for _ in range(3):
        up = Upstream()
        await nursery.start(up.serve)
        ups.append(up)
    edges = [await start_edge(nursery), await start_edge(nursery)]
    for i, up in enumerate(ups):
        await start_node(nursery, edges, [model("m", up, target="t", max_concurrency=4)], node_id=f"node-{i}")
    with trio.fail_after(BOUND):
        async with http(edges[0]) as first, http(edges[1]) as second:
            for c in range(12):
                messages = [{"role": "system", "content": f"Conversation {c}. " + SYSTEM}]
                for turn in range(4):
                    messages.append({"role": "user", "content": f"question {turn}"})
                    client = (first, second)[turn % 2]
                    r = await client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
                    assert r.status_code == 200
                    messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            metrics = (await first.get("/metrics")).text
    by_conversation: dict[str, set[int]] = {}
    for i, up in enumerate(ups):
        for record in up.records:
            by_conversation.setdefault(record.body["messages"][0]["content"], set()).add(i)
    assert len(by_conversation) == 12
    assert all(len(nodes) == 1 for nodes in by_conversation.values()), by_conversation
    assert len(set().union(*by_conversation.values())) > 1
    assert 'iop_placements_total{how="prefix"} 12.0' in metrics  # turns 3 and 4 matched on edge 1's index
    assert 'iop_placements_total{how="rendezvous"} 12.0' in metrics
    for edge in edges:
        await settled(edge)


async def _two_nodes_on_two_edges(nursery, *more_edges):
    """Two prefix-routing edges (and ``more_edges``), two nodes serving `m` linked to all: the
    nodes' upstreams, their ids, and the two edges."""
    ups = []
    for _ in range(2):
        up = Upstream()
        await nursery.start(up.serve)
        ups.append(up)
    a, b = await start_edge(nursery), await start_edge(nursery)
    ids = ["node-0", "node-1"]
    for node_id, up in zip(ids, ups, strict=True):
        await start_node(nursery, [a, b, *more_edges], [model("m", up, target="t", max_concurrency=4)], node_id=node_id)
    return ups, ids, a, b


async def test_a_turn_moved_at_one_edge_is_followed_by_the_other(nursery):
    """Two edges, two nodes. A conversation's first turn goes through edge A to node X; its
    second goes through edge B to node Y (B's session affinity tells it to). Y tells A where that turn
    went (a ``placed`` frame), so the third turn, through A and with no session id, goes to Y,
    which holds the whole conversation, not back to X, which holds only its first turn. An edge
    that does not route by prefix is told nothing."""
    plain = await start_edge(nursery, edge_config(routing="least_loaded"))
    ups, ids, a, b = await _two_nodes_on_two_edges(nursery, plain)

    def body(messages):
        return {"model": "m", "messages": messages, "max_tokens": 4}

    async def turn(client, messages, **kw) -> None:
        r = await client.post("/v1/chat/completions", json=body(messages), **kw)
        assert r.status_code == 200
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    with trio.fail_after(BOUND):
        async with http(a) as via_a, http(b) as via_b:
            await turn(via_a, messages)
            x = next(i for i, up in enumerate(ups) if up.records)
            y = 1 - x
            session = {"X-Session-Id": next(f"s{i}" for i in range(100) if rendezvous(b"ss%d" % i, ids) == ids[y])}
            await turn(via_b, [{"role": "user", "content": "another conversation"}], headers=session)
            messages.append({"role": "user", "content": "second question"})
            await turn(via_b, messages, headers=session)
            assert len(ups[y].records) == 2
            second, _ = prompt_prefix(msgspec.convert(body(messages[:-1]), ChatRequest))
            await eventually(lambda: a.edge.runs.prefixes.holders(second[-1]) == ids[y], what="A told of Y")
            messages.append({"role": "user", "content": "third question"})
            await turn(via_a, messages)
            metrics = (await via_a.get("/metrics")).text
    assert [len(up.records) for up in (ups[x], ups[y])] == [1, 3]
    assert ups[y].records[-1].body["messages"][-1]["content"] == "third question"
    assert 'iop_placements_total{how="prefix"} 1.0' in metrics
    assert len(plain.edge.runs.prefixes) == 0  # told nothing: it does not route by prefix
    for edge in (a, b, plain):
        await settled(edge)


async def test_a_session_two_edges_placed_apart_comes_together_on_the_node_with_its_last_turn(nursery):
    """Two edges, two nodes, one conversation with a session id. Its first turn goes through
    A to X; its second through B to Y, as X is full at B: each edge then holds the session on
    its own node, and every turn went to the node missing the one before, through A to X and
    through B to Y, for the conversation's life (an outside audit: 2-3 of 16 conversations,
    each turn on alternate nodes). A session's node yields to a node another edge sent a
    deeper part of this very prompt (a ``placed`` relay): the third turn, through A, goes to Y,
    and the session is Y's on both edges from then on."""
    ups, ids, a, b = await _two_nodes_on_two_edges(nursery)

    def script(body):
        if body["messages"][-1]["content"] == "hold":
            return [("chunk", {"content": "a"}), ("hang",)]
        return [("chunk", {"content": "fine"}), ("chunk", {}, "stop"), ("done",)]

    for up in ups:
        up.script_for("t", script)

    async def turn(client, messages, session) -> None:
        body = {"model": "m", "messages": messages, "max_tokens": 4}
        r = await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session})
        assert r.status_code == 200, r.text
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question " * 40}]
    with trio.fail_after(BOUND):
        async with http(a) as via_a, http(b) as via_b, trio.open_nursery() as holders:
            await turn(via_a, messages, "conv")
            x = next(i for i, up in enumerate(ups) if up.records)
            y = 1 - x
            # X full at B: requests of a session that lives on X, each held open.
            hog = next(f"h{i}" for i in range(100) if rendezvous(b"sh%d" % i, ids) == ids[x])
            await eventually(lambda: b.edge.runs.links[ids[x]].free_slots("m") == 2, what="B holds 2 of X")
            for _ in range(2):
                holders.start_soon(
                    lambda: via_b.post(
                        "/v1/chat/completions",
                        json={"model": "m", "messages": [{"role": "user", "content": "hold"}], "stream": True},
                        headers={"X-Session-Id": hog},
                    )
                )
            link_x = b.edge.runs.links[ids[x]]
            await eventually(lambda: link_x.free_slots("m") == 0 and len(ups[x].records) == 3, what="X full at B")
            messages.append({"role": "user", "content": "second question " * 40})
            await turn(via_b, messages, "conv")
            assert [r.body["messages"][-1]["content"][:6] for r in ups[y].records] == ["second"]
            holders.cancel_scope.cancel()
        second, _ = prompt_prefix(msgspec.convert({"model": "m", "messages": messages[:-1]}, ChatRequest))
        await eventually(lambda: a.edge.runs.prefixes.holders(second[-1]) == ids[y], what="A told of Y")
        async with http(a) as via_a, http(b) as via_b:
            messages.append({"role": "user", "content": "third question"})
            await turn(via_a, messages, "conv")
            messages.append({"role": "user", "content": "fourth question"})
            await turn(via_b, messages, "conv")
            messages.append({"role": "user", "content": "fifth question"})
            await turn(via_a, messages, "conv")
    asked = [r.body["messages"][-1]["content"] for r in ups[y].records]
    assert asked[-3:] == ["third question", "fourth question", "fifth question"], asked
    assert not [r for r in ups[x].records if r.body["messages"][-1]["content"].endswith("question")]
    for edge in (a, b):
        await settled(edge)


async def test_a_prompt_cache_key_keeps_its_requests_on_one_node(nursery):
    """`prompt_cache_key` (OpenAI's key for requests that share a prompt cache) is the session
    when there is no `X-Session-Id` or `user`, on chat and on Responses: ten unrelated prompts
    with one key, one at a time, all go to one node (without it they spread by their openings:
    all ten on one of two nodes, 2 times in 1,024)."""
    ups, ids, a, _ = await _two_nodes_on_two_edges(nursery)
    with trio.fail_after(BOUND):
        async with http(a) as client:
            for i in range(10):
                said = f"question {i}: " + "why " * (i + 1)
                if i % 2:
                    body = {"model": "m", "input": said, "prompt_cache_key": "team-cache", "max_output_tokens": 4}
                    r = await client.post("/v1/responses", json=body)
                else:
                    body = {"model": "m", "messages": [{"role": "user", "content": said}], "max_tokens": 4}
                    r = await client.post("/v1/chat/completions", json={**body, "prompt_cache_key": "team-cache"})
                assert r.status_code == 200, r.text
    assert sorted(len(up.records) for up in ups) == [0, 10]
    await settled(a)


async def test_a_moved_run_that_failed_while_it_waited_is_not_sent_on():
    """A run moved off a lost node waits for a slot; it fails meanwhile (its timeout, an
    operator's cancel) and, before its request's task has closed it, a slot frees: it was sent
    to that node, which ran it for no one (its cancel had gone to the node it left), and the
    slot was counted free while it ran. It stays unsent; the slot is free."""
    runs, (gone, busy) = fleet(2, capacity=1)
    with trio.fail_after(BOUND):
        first = await runs.acquire(Want("m"))
        second = await runs.acquire(Want("m"))
    moving = first if first.link is gone else second
    holding = second if moving is first else first
    run = runs.start(moving, msgspec.Raw(b"{}"), want=Want("m"), metadata={})
    runs.remove_link(gone)
    assert run.requeued is not None  # waiting for a slot on the busy node
    run.fail("cancelled by an operator", "cancelled")
    runs.release(holding)  # (the same tick: the run's task has not closed it yet)
    assert run.id not in busy.runs and busy.in_flight["m"] == 0
    assert run.requeued is None
