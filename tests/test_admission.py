"""Admission in the run service, on a virtual clock: slots, FIFO queue, timeouts."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from edge.config import EdgeConfig, ModelPolicy
from edge.errors import APIError
from edge.runs import NodeLink, RunService, Want
from proto import ModelInfo


def service(**kw) -> RunService:
    return RunService(EdgeConfig(**kw))


def link(node_id: str, capacity: int, context_window: int = 0) -> NodeLink:
    return NodeLink(
        node_id,
        [ModelInfo(name="m", adapter="sim", target="t", max_concurrency=capacity, context_window=context_window)],
    )


async def test_queue_is_fifo_and_slots_are_counted_exactly(autojump_clock):
    """Waiters get freed slots in arrival order; in-flight never exceeds capacity."""
    runs = service(max_queue=10, queue_timeout_ms=60_000)
    node = link("a", 2)
    runs.add_link(node)
    held = [await runs.acquire(Want("m")), await runs.acquire(Want("m"))]
    assert node.in_flight["m"] == 2
    order: list[int] = []
    async with trio.open_nursery() as nursery:

        async def waiter(i: int) -> None:
            slot = await runs.acquire(Want("m"))
            order.append(i)
            await trio.sleep(1 + i / 10)  # distinct hold times: one release at a time
            runs.release(slot)

        for i in range(5):
            nursery.start_soon(waiter, i)
            await trio.sleep(0.001)
        assert runs.queue_depth("m") == 5
        for slot in held:
            runs.release(slot)
            await trio.sleep(0.01)
    assert order == [0, 1, 2, 3, 4]
    assert node.in_flight["m"] == 0


async def test_queue_timeout_and_cancel_give_back_everything(autojump_clock):
    """A waiter that times out gets 429; one that is cancelled leaves the queue; no slot leaks."""
    runs = service(models=[ModelPolicy(name="m", max_queue=2, queue_timeout_ms=5000)])
    node = link("a", 1)
    runs.add_link(node)
    slot = await runs.acquire(Want("m"))
    with pytest.raises(APIError) as timed_out:
        await runs.acquire(Want("m"))
    assert timed_out.value.status == 429 and timed_out.value.code == "queue_timeout"
    assert trio.current_time() == pytest.approx(5.0)
    with trio.move_on_after(1):
        await runs.acquire(Want("m"))
    assert runs.queue_depth("m") == 0
    runs.release(slot)
    assert node.in_flight["m"] == 0


async def test_a_waiter_that_fits_nowhere_free_does_not_block_one_that_does(autojump_clock):
    """The head of the queue needs a big context; a small request behind it still gets the free small node."""
    runs = service(queue_timeout_ms=60_000)
    big, small = link("big", 1, 100_000), link("small", 1, 1000)
    runs.add_link(big)
    runs.add_link(small)
    held_big = await runs.acquire(Want("m", min_context=50_000))
    held_small = await runs.acquire(Want("m", min_context=10))
    got: list[str] = []
    async with trio.open_nursery() as nursery:

        async def ask(want: Want) -> None:
            slot = await runs.acquire(want)
            got.append(slot.link.node_id)

        nursery.start_soon(ask, Want("m", min_context=50_000))
        await trio.sleep(0.001)
        nursery.start_soon(ask, Want("m", min_context=10))
        await trio.sleep(0.001)
        runs.release(held_small)
        await trio.sleep(0.001)
        assert got == ["small"]
        runs.release(held_big)
    assert got == ["small", "big"]


async def test_context_and_unknown_models_are_refused_at_once(autojump_clock):
    """Unknown model 404, too-long context 400 context_length_exceeded, before any wait."""
    runs = service()
    runs.add_link(link("a", 1, 1000))
    with pytest.raises(APIError) as unknown:
        await runs.acquire(Want("nope"))
    assert unknown.value.status == 404
    with pytest.raises(APIError) as too_long:
        await runs.acquire(Want("m", min_context=5000))
    assert too_long.value.code == "context_length_exceeded"
    assert trio.current_time() == 0


async def test_a_new_request_takes_a_free_slot_the_queue_head_cannot_use(autojump_clock):
    """With a waiter at the head that fits no free node, a new request that fits a free node
    is served at once instead of queueing behind it."""
    runs = service(queue_timeout_ms=60_000)
    big, small = link("big", 1, 100_000), link("small", 1, 1000)
    runs.add_link(big)
    runs.add_link(small)
    await runs.acquire(Want("m", min_context=50_000))  # big is now busy
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runs.acquire, Want("m", min_context=50_000))  # waits for big
        await trio.sleep(0.001)
        start = trio.current_time()
        slot = await runs.acquire(Want("m", min_context=10))
        assert slot.link is small and trio.current_time() == start
        nursery.cancel_scope.cancel()


async def test_names_nodes_once_advertised_are_remembered_within_a_bound():
    """A model a node advertised is known after it leaves (503 no node, not 404, and a metrics
    label), but only the last KNOWN_MODELS of them: a node linking again and again with 3,500
    new names a time grew the edge 15 MB a link, for good."""
    from edge.runs import service as service_module

    runs = service(models=[ModelPolicy(name="configured")])
    for round_ in range(20):
        infos = [ModelInfo(name=f"r{round_}-m{i}", adapter="sim", target="t") for i in range(1000)]
        node = NodeLink(f"n{round_}", infos)
        runs.add_link(node)
        runs.remove_link(node)
    assert len(runs._known) == service_module.KNOWN_MODELS
    assert runs.is_known("r19-m999") and not runs.is_known("r0-m0")  # the most recent kept
    assert runs.is_known("configured")  # configured ones always
    with pytest.raises(APIError) as caught:
        await runs.acquire(Want("r19-m5"))
    assert caught.value.status == 503  # known, no node: not a 404
