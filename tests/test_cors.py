"""Browsers calling the client API from another origin (``cors_origins``): the preflight and the
answers' headers over raw HTTP, then a web page in a real headless Chromium (Debian's
``chromium``, driven by Playwright, as the console's tests) that streams a chat completion with a
key, aborts one (the model server sees it), and is refused where its origin is not listed."""

from __future__ import annotations

import os
import shutil

import httpx
import msgspec
import pytest
import trio

from edge.config import EdgeConfig
from iop.configfile import ConfigError
from scripts.upstream import text_script, words
from tests.conftest import BOUND, edge_config, http, model, settled, start_edge, start_node

APP = "https://app.example"
KEY = "sk-browser"
CHROMIUM = os.environ.get("IOP_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture
async def cors_edge(nursery, upstream):
    edge = await start_edge(nursery, edge_config(cors_origins=[APP], api_keys=[KEY], admin_keys=["adm"]))
    node = await start_node(nursery, edge, [model("m", upstream)])
    yield edge, upstream
    await settled(edge, node.agent)


async def test_the_preflight_and_every_answer_name_an_allowed_origin(cors_edge):
    """A listed origin's preflight is a 204 that allows POST and the headers it asked for; its
    answers (a stream, an error, the model list) carry Access-Control-Allow-Origin and expose the
    request id and rate-limit headers. Another origin, the admin API and /metrics get none."""
    edge, upstream = cors_edge
    upstream.script_for("m-target", text_script(words(3)))
    auth = {"Authorization": f"Bearer {KEY}", "Origin": APP}
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            preflight = await client.options(
                "/v1/chat/completions",
                headers={
                    "Origin": APP,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
                },
            )
            streamed = await client.post("/v1/chat/completions", json=BODY, headers=auth)
            refused = await client.post("/v1/chat/completions", json=BODY, headers={"Origin": APP})
            models = await client.get("/v1/models", headers=auth)
            other = await client.post(
                "/v1/chat/completions", json=BODY, headers={**auth, "Origin": "https://evil.example"}
            )
            other_preflight = await client.options(
                "/v1/chat/completions",
                headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
            )
            admin = await client.get("/v1/admin/keys", headers={"Authorization": "Bearer adm", "Origin": APP})
            metrics = await client.get("/metrics", headers={"Authorization": "Bearer adm", "Origin": APP})
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == APP
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
    assert "Origin" in preflight.headers["vary"] and "x-request-id" in preflight.headers
    for answer, status in ((streamed, 200), (refused, 401), (models, 200)):
        assert answer.status_code == status
        assert answer.headers["access-control-allow-origin"] == APP
        assert answer.headers["access-control-expose-headers"] == "*" and answer.headers["vary"] == "Origin"
    assert "data: [DONE]" in streamed.text
    # (an origin not listed: a page's simple POST is refused before it runs; see below)
    assert other.status_code == 403 and other.json()["error"]["code"] == "cross_origin_request"
    assert "access-control-allow-origin" not in other.headers
    # (a preflight carries no key: refused as any keyless request is, before its method is judged)
    assert other_preflight.status_code == 401 and "access-control-allow-origin" not in other_preflight.headers
    assert admin.status_code == 200 and "access-control-allow-origin" not in admin.headers
    assert metrics.status_code == 200 and "access-control-allow-origin" not in metrics.headers


async def test_no_cross_origin_answers_unless_configured(nursery):
    """Without `cors_origins` an edge says nothing to browsers (a page anywhere could otherwise
    use a local, keyless edge through its visitor's browser); a malformed origin stops the edge."""
    edge = await start_edge(nursery)
    with trio.fail_after(BOUND):
        async with http(edge) as client:
            r = await client.options(
                "/v1/chat/completions", headers={"Origin": APP, "Access-Control-Request-Method": "POST"}
            )
            models = await client.get("/v1/models", headers={"Origin": APP})
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    assert "access-control-allow-origin" not in models.headers
    for bad in ("app.example", "https://app.example/", "https://app.example/path", ""):
        with pytest.raises(ConfigError, match=r"cors_origins\[0\]"):
            EdgeConfig(cors_origins=[bad]).check()
    for bad in ("https://app.example", "app.example:8080", "", "a..b"):
        with pytest.raises(ConfigError, match=r"allowed_hosts\[0\]"):
            EdgeConfig(allowed_hosts=[bad]).check()
    EdgeConfig(allowed_hosts=["app.example", "GPU-box.", "*"]).check()


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="chromium missing (make test installs it)")
async def test_a_web_page_on_another_origin_streams_and_aborts_in_chromium(nursery, upstream):
    """A page served from another origin (another port) streams a chat completion with its key
    through fetch (preflight and all), and its AbortController's abort reaches the model server;
    a page whose origin is not listed cannot read the answer."""
    from playwright.sync_api import sync_playwright

    page_port = await nursery.start(_serve_a_page)
    page_origin = f"http://127.0.0.1:{page_port}"
    edge = await start_edge(nursery, edge_config(cors_origins=[page_origin], api_keys=[KEY]))
    closed = await start_edge(nursery, edge_config(cors_origins=[APP], api_keys=[KEY]))
    node = await start_node(nursery, [edge, closed], [model("m", upstream)])
    scripts = iter([text_script(words(5)), text_script(words(500), interval=0.05)])
    upstream.script_for("m-target", lambda body: next(scripts))

    def browse() -> dict:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page()
                page.goto(page_origin + "/")
                return page.evaluate(_PAGE_SCRIPT, {"edge": edge.url, "closed": closed.url, "key": KEY, "body": BODY})
            finally:
                browser.close()

    with trio.fail_after(BOUND):
        seen = await trio.to_thread.run_sync(browse)
        assert seen["text"] == "".join(words(5)) and seen["requestId"].startswith("req_"), seen
        assert seen["aborted"] == "AbortError" and seen["partial"], seen
        assert seen["refused"] == "TypeError", seen  # the browser would not let the page read it
        (_, slow, *_) = await upstream.wait_requests(2)
        await slow.finished.wait()
    assert slow.aborted
    await settled(edge, node.agent)


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="chromium missing (make test installs it)")
async def test_a_keyless_edge_runs_nothing_for_a_web_page_on_another_site(nursery, upstream):
    """An edge with no keys (the demo's) and no `cors_origins`: a page on another origin can POST
    to it with no preflight, as an HTML form of `enctype="text/plain"` whose field makes a JSON
    body, or a `no-cors` fetch of a text/plain body. It could not read the answers, but each ran
    on the model server (found from outside). Now each is a 403 `cross_origin_request` before any
    run, in a real Chromium; curl's and the SDKs' requests, which carry no Origin, and a page of
    the edge's own origin are served."""
    from playwright.sync_api import sync_playwright

    page_port = await nursery.start(_serve_a_page)
    edge = await start_edge(nursery)
    node = await start_node(nursery, edge, [model("m", upstream)])
    upstream.script_for("m-target", lambda body: text_script(words(3)))
    whole = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def browse() -> dict:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{page_port}/")
                foreign = page.evaluate(_ANOTHER_SITE, {"edge": edge.url, "body": whole})
                page.goto(edge.url + "/healthz")  # (a page of the edge's own origin)
                own = page.evaluate(_OWN_ORIGIN, {"body": whole})
                return {"foreign": foreign, "own": own}
            finally:
                browser.close()

    with trio.fail_after(BOUND):
        seen = await trio.to_thread.run_sync(browse)
        assert seen["foreign"] == {"form": "loaded", "fetch": "opaque"}, seen
        assert seen["own"] == [200, None], seen
        assert len(upstream.records) == 1  # the own origin's: neither the form's nor the fetch's
        async with http(edge) as client:
            refused = await client.post(
                "/v1/chat/completions", content=msgspec.json.encode(whole), headers={"Origin": "https://evil.example"}
            )
            curl = await client.post("/v1/chat/completions", json=whole)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "cross_origin_request", refused.text
    assert "https://evil.example" in refused.json()["error"]["message"]
    assert curl.status_code == 200 and len(upstream.records) == 2
    await settled(edge, node.agent)


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"), reason="chromium missing (make test installs it)")
async def test_a_keyless_edge_answers_no_page_at_a_name_rebound_to_it(nursery, upstream):
    """DNS rebinding: a page of `evil.test`, its name then resolved to the edge's address (here
    Chromium's own host map), is of the edge's origin for the browser, and read a keyless
    edge's answers (a re-check). A keyless edge answers a page's calls at localhost or an IP
    address, or at a name `allowed_hosts` lists: elsewhere a 403 `host_not_allowed`, before
    anything runs. curl's and the SDKs' requests, which carry no Origin, are served at any name."""
    from playwright.sync_api import sync_playwright

    edge = await start_edge(nursery)
    listed = await start_edge(nursery, edge_config(allowed_hosts=["Evil.Test."]))  # (any case, a root dot)
    node = await start_node(nursery, [edge, listed], [model("m", upstream)])
    upstream.script_for("m-target", lambda body: text_script(words(3)))
    whole = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def browse() -> list:
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP evil.test 127.0.0.1"],
            )
            try:
                page = browser.new_page()
                seen = []
                for url in (
                    f"http://evil.test:{edge.port}",
                    f"http://localhost:{edge.port}",
                    f"http://evil.test:{listed.port}",
                ):
                    page.goto(url + "/healthz")
                    seen.append(page.evaluate(_OWN_ORIGIN, {"body": whole}))
                return seen
            finally:
                browser.close()

    with trio.fail_after(BOUND):
        seen = await trio.to_thread.run_sync(browse)
        async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND, headers={"host": "evil.test"}) as client:
            curl = await client.post("/v1/chat/completions", json=whole)
    assert [status for status, _ in seen] == [403, 200, 200], seen
    assert seen[0][1] == "host_not_allowed", seen
    assert curl.status_code == 200
    assert len(upstream.records) == 3  # (localhost's, the listed name's, curl's)
    await settled(edge, node.agent)


# A page on another site: a form posted into a frame, and a no-cors fetch, each a JSON body as text.
_ANOTHER_SITE = """
async ({edge, body}) => {
  const out = {};
  const frame = document.createElement("iframe");
  frame.name = "sink";
  document.body.appendChild(frame);
  const form = document.createElement("form");
  form.method = "POST";
  form.enctype = "text/plain";
  form.action = `${edge}/v1/chat/completions`;
  form.target = "sink";
  const field = document.createElement("input");
  const text = JSON.stringify({...body, x: ""});
  field.name = text.slice(0, -2);  // ... "x":"  then  =  then the value  "}
  field.value = '"}';
  form.appendChild(field);
  document.body.appendChild(form);
  const loaded = new Promise((resolve) => { frame.onload = () => resolve("loaded"); });
  form.submit();
  out.form = await loaded;
  const r = await fetch(`${edge}/v1/chat/completions`,
    {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"}, body: JSON.stringify(body)});
  out.fetch = r.type;
  return out;
}
"""

# A page of the edge's own origin: its fetch's status, and its error's code.
_OWN_ORIGIN = """
async ({body}) => {
  const r = await fetch("/v1/chat/completions",
    {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  const answer = await r.json();
  return [r.status, answer.error ? answer.error.code : null];
}
"""


# The page's part: three fetches from its own origin.
_PAGE_SCRIPT = """
async ({edge, closed, key, body}) => {
  const headers = {"Authorization": `Bearer ${key}`, "Content-Type": "application/json"};
  const out = {};
  const r = await fetch(`${edge}/v1/chat/completions`, {method: "POST", headers, body: JSON.stringify(body)});
  out.requestId = r.headers.get("x-request-id");
  let text = "";
  for (const line of (await r.text()).split("\\n")) {
    if (line.startsWith("data: {")) text += JSON.parse(line.slice(6)).choices[0]?.delta?.content ?? "";
  }
  out.text = text;
  const abort = new AbortController();
  try {
    const slow = await fetch(`${edge}/v1/chat/completions`,
      {method: "POST", headers, body: JSON.stringify(body), signal: abort.signal});
    const reader = slow.body.getReader();
    out.partial = new TextDecoder().decode((await reader.read()).value);
    abort.abort();
    await reader.read();
  } catch (e) { out.aborted = e.name; }
  try {
    await fetch(`${closed}/v1/chat/completions`, {method: "POST", headers, body: JSON.stringify(body)});
    out.refused = "read";
  } catch (e) { out.refused = e.name; }
  return out;
}
"""


async def _serve_a_page(task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A web server on its own port (so its own origin) whose every answer is an empty page."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    page = b"<!doctype html><title>app</title>"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"

    async def answer(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(65536)
            await stream.send_all(head % len(page) + page)

    await trio.serve_listeners(answer, listeners)
