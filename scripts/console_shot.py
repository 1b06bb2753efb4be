"""A screenshot of the operator console under load, for the README.

    python scripts/console_shot.py [--out docs/console.png] [--streams 200]

Starts an upstream (a token every 50 ms), an edge with two client keys and an
admin key, and two nodes (processes of their own, scripts/stack.py); holds
--streams streams from two keys (one key over its concurrency limit, so the
console lists 429s), finishes 40 short requests (another model, a fast upstream) for the usage chart, then
opens /console in headless Chromium (Debian's, via Playwright) and saves the
page.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import trio  # noqa: E402

from scripts.stack import ROOT, Stack  # noqa: E402

ADMIN = "sk-console-admin"
KEYS = [
    {"id": "alice", "key": "sk-alice", "rpm": 100_000},
    {"id": "bob", "key": "sk-bob", "max_concurrent": 30},
]
UNBOUNDED = httpx.Limits(max_connections=None, max_keepalive_connections=None)


async def load(edge: str, streams: int, ready: trio.Event) -> None:
    async def one(key: str, model: str, stream: bool) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "stream": stream}
        if model == "mini":
            body["max_tokens"] = 50
        headers = {"Authorization": f"Bearer {key}"}
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                async for _ in r.aiter_bytes():
                    pass
        except httpx.HTTPError:
            pass

    async with httpx.AsyncClient(base_url=edge, timeout=120, limits=UNBOUNDED) as client:
        async with trio.open_nursery() as nursery:
            for i in range(40):  # finished requests: the usage chart and today's totals
                nursery.start_soon(one, "sk-alice" if i % 3 else "sk-bob", "mini", i % 2 == 0)
            for i in range(streams):
                alice = i % 4 != 0
                nursery.start_soon(one, "sk-alice" if alice else "sk-bob", "llama" if alice else "qwen", True)
                await trio.sleep(0.005)
            await trio.sleep(2)
            ready.set()


def browse(edge: str, out: Path, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(edge + "/console")
        page.fill("#key", ADMIN)
        page.click("#login-form button[type=submit]")
        page.wait_for_selector("#runs-table tbody tr[data-phase=streaming]")
        page.wait_for_timeout(1500)
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
        browser.close()


async def main(out: Path, streams: int, chromium: str) -> None:
    with Stack() as stack:
        upstream = stack.upstream(interval_ms=50, tokens=600)
        fast = stack.upstream()  # as many tokens as max_tokens asks, at once
        edge = stack.edge(admin_keys=[ADMIN], keys=KEYS, max_queue=50)
        for node_id, models in (("gpu-a", ["llama", "mini"]), ("gpu-b", ["llama", "qwen"])):
            stack.node(
                edge,
                [
                    {
                        "name": m,
                        "adapter": "openai",
                        "target": m,
                        "base_url": fast if m == "mini" else upstream,
                        "max_concurrency": 128,
                    }
                    for m in models
                ],
                node_id,
            )
        ready = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load, edge, streams, ready)
            await ready.wait()
            await trio.to_thread.run_sync(browse, edge, out, chromium)
            nursery.cancel_scope.cancel()
    print(f"saved {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs/console.png")
    parser.add_argument("--streams", type=int, default=200)
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("chromium not found (Debian: apt-get install chromium)")
    trio.run(main, args.out, args.streams, chromium)
