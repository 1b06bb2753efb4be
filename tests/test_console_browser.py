"""The operator console in a real headless Chromium (Debian's ``chromium``,
driven by Playwright for Python with the system browser; ``make test``
installs both): log in, watch two nodes, a stream, a cancel, a node killed,
the usage chart; rows kept across snapshots, only changed cells written. A
screenshot of each state goes to ``artifacts/console/`` (``$IOP_ARTIFACTS``
overrides the folder)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from edge.config import KeyConfig
from scripts.upstream import text_script, words
from tests.conftest import BOUND, edge_config, eventually, http, model, start_edge, start_node, start_node_process

ADMIN = "admin-secret-for-the-browser"
STREAM = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
CHROMIUM = os.environ.get("IOP_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = Path(os.environ.get("IOP_ARTIFACTS", "artifacts")) / "console"

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # pragma: no cover - make test installs it
    sync_playwright = None

if sync_playwright is None or CHROMIUM is None:
    if os.environ.get("CI"):
        raise RuntimeError("the console tests need playwright (pip) and chromium (apt): make test installs them")
    pytest.skip("playwright or chromium missing (make test installs them)", allow_module_level=True)


def open_console(browser, edge) -> tuple:
    """A desktop-sized page on the edge's console, and the list its page errors go to."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(edge.url + "/console")
    return page, errors


async def in_chromium(browse: Callable[[Any], None]) -> None:
    """``browse(browser)`` in a worker thread, a headless Chromium launched for it and closed after."""

    def run() -> None:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            try:
                browse(browser)
            finally:
                browser.close()

    with trio.fail_after(120):
        await trio.to_thread.run_sync(run)


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def tokens_shown(page) -> int:
    cell = page.locator("#runs-table tbody tr[data-phase=streaming] .tokens")
    return int(cell.text_content().replace(",", ""))


async def start_stream(nursery, edge, out: list[str]) -> None:
    """A client's stream, its lines into ``out``, started once its run is in flight."""

    async def stream() -> None:
        async with http(edge) as client, client.stream("POST", "/v1/chat/completions", json=STREAM) as r:
            async for line in r.aiter_lines():
                if line:
                    out.append(line)

    nursery.start_soon(stream)
    await eventually(lambda: bool(edge.edge.runs.runs), "the run")


async def saw_the_abort(upstream) -> bool:
    """Whether the model server saw its one request aborted."""
    with trio.fail_after(BOUND):
        (rec,) = await upstream.wait_requests(1)
        await rec.finished.wait()
    return rec.aborted


async def test_the_console_in_a_browser(nursery, upstream, tmp_path):
    upstream.script_for("m-target", lambda body: text_script(words(600), interval=0.05))
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN], ping_interval_s=0.5, ping_misses=2))
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=4)], node_id="node-a")
    killable = await start_node_process(
        nursery,
        tmp_path,
        edge,
        [{"name": "m", "adapter": "openai", "base_url": upstream.base_url, "target": "m-target", "max_concurrency": 4}],
        node_id="node-b",
    )
    stream_out: list[str] = []
    start_stream_and_wait_for_its_run = partial(start_stream, nursery, edge, stream_out)
    upstream_saw_the_abort = partial(saw_the_abort, upstream)

    def browse(browser) -> None:
        page, errors = open_console(browser, edge)

        # A wrong key is refused, and not kept.
        page.fill("#key", "not-the-key")
        page.click("#login-form button[type=submit]")
        expect(page.locator("#login-error")).to_contain_text("Invalid or missing admin key", timeout=5000)
        expect(page.locator("#console")).to_be_hidden()
        assert page.evaluate("sessionStorage.getItem('iop.adminKey')") is None
        shot(page, "01-wrong-key-refused")

        # The right one opens the console; both nodes are there.
        page.fill("#key", ADMIN)
        page.click("#login-form button[type=submit]")
        expect(page.locator("#status")).to_have_text("live", timeout=5000)
        nodes = page.locator("#nodes tbody tr")
        expect(nodes).to_have_count(2, timeout=5000)
        expect(page.locator("#nodes tbody tr[data-node-id=node-a]")).to_contain_text("m 0 / ")
        expect(page.locator("#nodes tbody tr[data-node-id=node-b]")).to_be_visible()
        shot(page, "02-fleet-two-nodes")

        # A client's stream appears within a second of its run, and its token count grows.
        trio.from_thread.run(start_stream_and_wait_for_its_run)
        row = page.locator("#runs-table tbody tr[data-run-id]:not([data-run-id=''])")
        expect(row).to_have_count(1, timeout=1000)
        expect(page.locator("#runs-table tbody tr[data-phase=streaming]")).to_have_count(1, timeout=5000)
        first = tokens_shown(page)
        deadline = time.monotonic() + BOUND
        while tokens_shown(page) <= first + 5:
            assert time.monotonic() < deadline, "the token count did not grow"
            page.wait_for_timeout(100)
        shot(page, "03-run-streaming")
        # A model name cut to its cell is whole on hover, as node ids and key ids are.
        expect(row.locator("td[data-label=model]")).to_have_attribute("title", "m")
        tag = page.locator("#nodes tbody tr[data-node-id=node-a] .tag").first
        expect(tag).to_have_attribute("title", "m (openai)")

        # The run's id can be selected and copied: the table is not rebuilt under a
        # selection (4 times a second, it was gone within 400 ms: found from outside).
        run_id = row.get_attribute("data-run-id")
        row.locator("td.run-id").evaluate(
            "(td) => { const r = document.createRange(); r.selectNodeContents(td);"
            " const s = document.getSelection(); s.removeAllRanges(); s.addRange(r); }"
        )
        page.wait_for_timeout(1000)
        assert page.evaluate("document.getSelection().toString()") == run_id
        page.evaluate("document.getSelection().removeAllRanges()")

        # Cancel takes two clicks on the run's button (rows move as runs come and go):
        # the run ends, the model server sees the abort, the error is listed with its run.
        button = row.locator("button.cancel")
        button.click()
        expect(button).to_have_text("confirm?")
        assert edge.edge.runs.runs, "one click cancelled the run"
        button.click()
        assert trio.from_thread.run(upstream_saw_the_abort)
        expect(row).to_have_count(0, timeout=5000)
        expect(page.locator("#errors li")).to_contain_text("cancelled", timeout=5000)
        expect(page.locator("#errors li")).to_contain_text(f"run {run_id}")
        shot(page, "04-run-cancelled")

        # An edge that says nothing for 3 s (it hangs, or the connection is half open) is
        # shown stale and dialled again; it showed "live" with frozen figures for good.
        # (Here the page's clock jumps 10 s at every reading, so that whatever the stream
        # brings, it looks silent that long; then it runs true again.)
        page.evaluate("window.trueNow = Date.now; let jumps = 0; Date.now = () => trueNow() + 10000 * ++jumps")
        expect(page.locator("#status")).to_have_text("stale · reconnecting", timeout=3000)
        expect(page.locator("#console")).to_have_class("stale")
        page.evaluate("Date.now = trueNow")
        expect(page.locator("#status")).to_have_text("live", timeout=5000)
        expect(page.locator("#console")).not_to_have_class("stale")

        # A node killed (SIGKILL) leaves the fleet within the ping timeout (1 s here).
        killable.kill()
        expect(page.locator("#nodes tbody tr[data-node-id=node-b]")).to_have_count(0, timeout=3000)
        expect(nodes).to_have_count(1)
        shot(page, "05-node-killed")

        # The usage chart has the request just made (sent within a second of its end).
        page.wait_for_function(
            "() => [...document.querySelectorAll('#chart g')].reduce((n, g) => n + Number(g.dataset.requests), 0) >= 1",
            timeout=5000,
        )
        expect(page.locator("#usage-models tbody tr[data-name=m]")).to_be_visible()
        shot(page, "06-usage")

        # A phone-sized screen: nothing wider than the screen; a node is a card whose
        # every field (state, TTFT, engine...) is on screen, no sideways scrolling.
        page.set_viewport_size({"width": 390, "height": 844})
        page.wait_for_timeout(300)
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
        assert page.evaluate(
            "[...document.querySelectorAll('#nodes td, #runs-table td')]"
            ".every((td) => td.getBoundingClientRect().right <= window.innerWidth)"
        )
        fleet = page.locator("#fleet .scroll")
        assert fleet.evaluate("(s) => s.scrollWidth <= s.clientWidth + 1")
        expect(page.locator("#nodes tbody tr[data-node-id=node-a] td[data-label=state]")).to_contain_text("serving")
        # A model server's load is a line per model: the card's whole width, so its label
        # stays one word ("engi / ne" in a half-width cell, found from outside).
        assert page.locator("#nodes tbody tr[data-node-id=node-a]").evaluate(
            "(tr) => tr.querySelector('td.engine').getBoundingClientRect().width"
            " >= 0.9 * tr.getBoundingClientRect().width"
        )
        shot(page, "07-phone")
        assert not errors, errors

    await in_chromium(browse)
    assert stream_out[-1] == "data: [DONE]"
    assert any("cancelled by an operator" in line for line in stream_out)


# Rows and cells of the fleet and runs tables, found by script (a node id may hold markup).
NODE_ROW = "(id) => [...document.querySelectorAll('#nodes tbody tr')].find((tr) => tr.dataset.nodeId === id)"
WATCH = """() => {
  const seen = (window.seen = { rows: 0, cells: 0 });
  const b = document.querySelector('#nodes tbody tr[data-node-id=node-b]');
  const run = document.querySelector('#runs-table tbody tr[data-phase=streaming]');
  b.kept = 'node-b'; run.kept = 'run'; run.querySelector('.tokens').kept = 'tokens';
  document.querySelector('#nodes tbody tr[data-node-id=node-a]').kept = 'node-a';
  // Rows added, removed or moved; and cells whose text or attributes did not change, written.
  const rows = new MutationObserver((m) => (seen.rows += m.length));
  for (const t of ['#nodes', '#runs-table']) rows.observe(document.querySelector(t + ' tbody'), { childList: true });
  const cells = new MutationObserver((m) => (seen.cells += m.length));
  for (const td of [...b.querySelectorAll('td[data-label=node], td[data-label=state], td[data-label=TTFT]'),
                    ...run.querySelectorAll('td[data-label=run], td[data-label=model], td[data-label=key]')])
    cells.observe(td, { childList: true, characterData: true, attributes: true, subtree: true });
  window.stopWatching = () => { rows.disconnect(); cells.disconnect(); };
}"""


async def test_a_snapshot_changes_only_the_rows_and_cells_that_changed(nursery, upstream):
    """512 nodes and 200 runs rebuilt whole 4 times a second kept the browser's main thread busy
    85% of the time (an outside audit): a row stays the same element while its node or run is
    listed, a cell is written only when its text changes, a node that leaves loses its row and
    one that links gains one, in order, its id shown as text."""
    upstream.script_for("m-target", lambda body: text_script(words(600), interval=0.05))
    edge = await start_edge(
        nursery,
        edge_config(
            admin_keys=[ADMIN], keys=[KeyConfig(id="<i>alice</i>", key="sk-alice")], ping_interval_s=0.5, ping_misses=2
        ),
    )
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=4)], node_id="node-a")
    await start_node(nursery, edge, [model("s")], node_id="node-b")
    leaving = await start_node(nursery, edge, [model("s")], node_id="node-c")
    stream_out: list[str] = []

    async def client_stream() -> None:
        headers = {"Authorization": "Bearer sk-alice"}
        async with (
            http(edge) as client,
            client.stream("POST", "/v1/chat/completions", json=STREAM, headers=headers) as r,
        ):
            async for line in r.aiter_lines():
                if line:
                    stream_out.append(line)

    async def start_stream() -> None:
        nursery.start_soon(client_stream)
        await eventually(lambda: bool(edge.edge.runs.runs), "a run")

    async def link_markup_node() -> None:
        await start_node(nursery, edge, [model("s")], node_id="<b>node-d</b>")

    def browse(browser) -> None:
        page, errors = open_console(browser, edge)
        page.fill("#key", ADMIN)
        page.click("#login-form button[type=submit]")
        nodes = page.locator("#nodes tbody tr")
        expect(nodes).to_have_count(3, timeout=5000)
        trio.from_thread.run(start_stream)
        run = page.locator("#runs-table tbody tr[data-phase=streaming]")
        expect(run).to_have_count(1, timeout=5000)
        expect(run.locator("td[data-label=key]")).to_have_text("<i>alice</i>")

        # Over a second of snapshots (4 of them) with the run streaming: the same row
        # elements, no row added, removed or moved, the unchanged cells never written;
        # the token count and the link ages do change.
        page.evaluate(WATCH)
        first = tokens_shown(page)
        linked = page.locator("#nodes tbody tr[data-node-id=node-b] td[data-label=linked]").text_content()
        page.wait_for_timeout(1200)
        assert tokens_shown(page) > first, "the token count did not change"
        assert page.locator("#nodes tbody tr[data-node-id=node-b] td[data-label=linked]").text_content() != linked
        page.evaluate("window.stopWatching()")
        assert page.evaluate("window.seen") == {"rows": 0, "cells": 0}
        kept = "(tr) => tr.kept"
        assert page.locator("#nodes tbody tr[data-node-id=node-a]").evaluate(kept) == "node-a"
        assert page.locator("#nodes tbody tr[data-node-id=node-b]").evaluate(kept) == "node-b"
        assert run.evaluate(kept) == "run"
        assert run.locator(".tokens").evaluate("(td) => td.kept") == "tokens"

        # A node that leaves loses its row; the others keep theirs.
        trio.from_thread.run_sync(leaving.stop)
        expect(page.locator("#nodes tbody tr[data-node-id=node-c]")).to_have_count(0, timeout=5000)
        expect(nodes).to_have_count(2)
        # One that links gains one, in the edge's order (by id: "<" sorts first), its id as text.
        trio.from_thread.run(link_markup_node)
        expect(nodes).to_have_count(3, timeout=5000)
        ids = page.eval_on_selector_all("#nodes tbody tr", "(trs) => trs.map((tr) => tr.dataset.nodeId)")
        assert ids == ["<b>node-d</b>", "node-a", "node-b"]
        added = page.evaluate_handle(NODE_ROW, "<b>node-d</b>")
        assert added.evaluate("(tr) => tr.querySelector('td[data-label=node]').textContent") == "<b>node-d</b>"
        assert page.locator("#nodes tbody b, #runs-table tbody i").count() == 0
        assert page.evaluate_handle(NODE_ROW, "node-a").evaluate(kept) == "node-a"
        assert page.evaluate_handle(NODE_ROW, "node-b").evaluate(kept) == "node-b"
        assert run.evaluate(kept) == "run"

        # The cancel button is the run's across snapshots: armed, it stays "confirm?"
        # while the table is updated under it; the second click ends the run.
        button = run.locator("button.cancel")
        button.click()
        page.wait_for_timeout(600)
        expect(button).to_have_text("confirm?")
        button.click()
        expect(page.locator("#runs-table tbody tr")).to_have_count(0, timeout=5000)
        expect(page.locator("#no-runs")).to_be_visible()
        shot(page, "08-rows-kept")
        assert not errors, errors

    await in_chromium(browse)
    assert any("cancelled by an operator" in line for line in stream_out)


async def test_the_key_never_goes_into_the_pages_url(nursery):
    """The login form works only once console.js holds it, and its key's input has no name: a
    form the browser submitted itself (the script slow to come, blocked or broken) put
    `?key=<admin key>` in the page's URL, its history and a proxy's log (an outside audit)."""
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))

    def browse(browser) -> None:
        page = browser.new_page()
        page.route("**/console/console.js", lambda route: route.abort())
        page.goto(edge.url + "/console")
        expect(page.locator("#key")).to_be_disabled()
        expect(page.locator("#needs-script")).to_be_visible()  # (it says why: the form was silently dead)
        # A script that broke after it turned the form on: the browser's own submit.
        page.evaluate("document.getElementById('login-fields').disabled = false")
        page.fill("#key", ADMIN)
        with page.expect_navigation():
            page.press("#key", "Enter")
        assert ADMIN not in page.url and ADMIN not in page.evaluate("location.href + history.length")
        page.close()
        page, errors = open_console(browser, edge)  # with its script: the form on, no such line
        expect(page.locator("#key")).to_be_enabled()
        expect(page.locator("#needs-script")).to_be_hidden()
        assert not errors
        page.close()

    await in_chromium(browse)


async def test_seven_console_tabs_of_one_browser_share_one_stream_and_cancel(nursery, upstream):
    """Each console tab held an HTTP/1.1 connection for good, and Chromium opens at most 6 to a
    host: with 6 tabs open in one browser a cancel never left it (the run went on to its end)
    and a 7th tab could not load (found from outside). The tabs of one key now elect one to
    read the edge's events and pass them on: 7 tabs are one console at the edge, each shows
    the fleet live, the 7th's cancel ends the run, and when the reading tab closes another
    takes over."""
    upstream.script_for("m-target", lambda body: text_script(words(600), interval=0.05))
    edge = await start_edge(nursery, edge_config(admin_keys=[ADMIN]))
    await start_node(nursery, edge, [model("m", upstream, max_concurrency=4)], node_id="node-a")
    console = edge.edge.console
    stream_out: list[str] = []

    def browse(browser) -> None:
        context = browser.new_context(viewport={"width": 1280, "height": 900})  # (one profile: one pool)
        pages = []
        errors: list[str] = []
        for _ in range(7):
            page = context.new_page()
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(edge.url + "/console", timeout=5000)
            page.fill("#key", ADMIN)
            page.click("#login-form button[type=submit]")
            expect(page.locator("#status")).to_have_text("live", timeout=5000)
            pages.append(page)
        for page in pages:
            expect(page.locator("#nodes tbody tr[data-node-id=node-a]")).to_be_visible(timeout=5000)
        assert len(console._subscribers) == 1, len(console._subscribers)

        trio.from_thread.run(start_stream, nursery, edge, stream_out)
        last = pages[-1]
        row = last.locator("#runs-table tbody tr[data-run-id]:not([data-run-id=''])")
        expect(row).to_have_count(1, timeout=5000)
        button = row.locator("button.cancel")
        button.click()
        button.click()
        expect(button).to_have_text("cancelled", timeout=5000)
        assert trio.from_thread.run(saw_the_abort, upstream)

        # The reading tab (the first) closes: another reads, and the rest stay live.
        pages[0].close()
        pages[1].wait_for_timeout(1500)
        for page in pages[1:]:
            expect(page.locator("#status")).to_have_text("live", timeout=5000)
            expect(page.locator("#nodes tbody tr[data-node-id=node-a]")).to_be_visible()
        assert len(console._subscribers) == 1, len(console._subscribers)
        assert not errors, errors

    await in_chromium(browse)
    assert any("cancelled by an operator" in line for line in stream_out)
