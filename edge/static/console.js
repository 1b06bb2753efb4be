// The iop operator console: one server-sent event stream (/v1/admin/events),
// read with fetch so the admin key travels in a header, never in a URL.
// Every value from the edge is written with textContent (model names, keys
// and error messages are data, not markup).
"use strict";

const KEY = "iop.adminKey";
const $ = (id) => document.getElementById(id);
// Snapshots come every 0.25 s: with nothing from the edge for this long (it hangs, or the
// connection is half open behind a proxy), what is shown is stale: said so, and dialled again.
const STALE_MS = 3000;
let controller = null;
let retryTimer = null;
let heardAt = 0; // Date.now() of the stream's last bytes

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value !== undefined && value !== null) node.setAttribute(name, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(child === null || child === undefined ? "" : String(child)));
  }
  return node;
}

function fmtAge(s) {
  if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
  if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
  if (s < 86400) return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  return Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
}

function fmtNum(n) {
  return Number(n || 0).toLocaleString("en-US");
}

function fmtTime(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

function setStatus(text, kind) {
  const pill = $("status");
  put(pill, "", text);
  put(pill, "class", "pill " + kind);
}

function showLogin(message) {
  setNotice("");
  if (controller) controller.abort();
  controller = null;
  clearTimeout(retryTimer);
  $("console").hidden = true;
  $("login").hidden = false;
  $("signout").hidden = true;
  $("login-error").textContent = message || "";
  setStatus("signed out", "off");
  $("key").focus();
}

// A table or list the operator is selecting text in is left as it is until the selection
// ends (rebuilt 4 times a second, no run id or error line could be copied).
function selecting(node) {
  const selection = document.getSelection();
  return Boolean(selection && !selection.isCollapsed && selection.rangeCount && node.contains(selection.getRangeAt(0).commonAncestorContainer));
}

// What each element was last given, by attribute ("": its text): a value is written only
// when it differs from that, never read back from the page, so an unchanged cell costs
// the browser no layout.
const shown = new WeakMap();

function put(node, name, value) {
  let was = shown.get(node);
  if (was === undefined) shown.set(node, (was = {}));
  const text = value === null || value === undefined ? "" : String(value);
  if (was[name] === text) return;
  was[name] = text;
  if (name === "") node.textContent = text;
  else node.setAttribute(name, text);
}

// A table's rows are kept by a stable key (a node's id, a run's id, a model, a key id): on
// each snapshot a row is made for a new key and removed for a gone one, rows are moved only
// if their order changed, and fill() writes through put(). Rebuilt whole 4 times a second,
// 512 nodes and 200 runs kept the browser's main thread busy 85% of the time (an outside audit).
const keyedRows = new WeakMap(); // tbody -> Map of key -> row ({ tr, ... }), in the order shown

function syncRows(tbody, items, keyOf, make, fill) {
  if (selecting(tbody)) return;
  const before = keyedRows.get(tbody) || new Map();
  const after = new Map();
  for (const item of items) {
    const base = String(keyOf(item));
    let key = base;
    for (let n = 2; after.has(key); n++) key = base + "\u0000" + n; // (the same key twice: two rows)
    const row = before.get(key) || make(item);
    fill(row, item);
    after.set(key, row);
  }
  for (const [key, row] of before) if (!after.has(key)) row.tr.remove();
  let at = tbody.firstElementChild;
  for (const row of after.values()) {
    if (row.tr === at) at = at.nextElementSibling;
    else tbody.insertBefore(row.tr, at);
  }
  keyedRows.set(tbody, after);
}

// A cell that names its column (data-label): on a phone each row is a card
// of "label: value" lines instead of a table wider than the screen.
function td(label, attrs, ...children) {
  return el("td", { ...attrs, "data-label": label }, ...children);
}

// -- snapshot -----------------------------------------------------------------

function nodeRow() {
  const row = { tr: el("tr"), titles: null, tags: [] };
  row.name = td("node", { class: "title name" });
  row.models = td("models", { class: "models" });
  row.inFlight = td("in flight", { class: "num in-flight" });
  row.state = td("state");
  row.linked = td("linked", { class: "num" });
  row.ttft = td("TTFT", { class: "num" });
  row.engine = td("engine", { class: "engine" });
  row.tr.append(row.name, row.models, row.inFlight, row.state, row.linked, row.ttft, row.engine);
  return row;
}

function fillNode(row, n) {
  put(row.tr, "data-node-id", n.id);
  put(row.name, "title", n.id);
  put(row.name, "", n.id);
  const titles = n.models.map((m) => `${m.name} (${m.adapter})`);
  if (row.titles !== titles.join("\n")) {
    row.titles = titles.join("\n");
    row.tags = titles.map((title) => el("span", { class: "tag", title }));
    row.models.replaceChildren(...row.tags);
  }
  n.models.forEach((m, i) => put(row.tags[i], "", `${m.name} ${m.in_flight} / ${m.grant} / ${m.max_concurrency}`));
  const engine = n.models
    .filter((m) => m.engine)
    .map((m) => {
      const e = m.engine;
      const parts = [];
      if (e.running !== null && e.running !== undefined) parts.push(`run ${e.running}`);
      if (e.waiting !== null && e.waiting !== undefined) parts.push(`wait ${e.waiting}`);
      if (e.kv_cache_usage !== null && e.kv_cache_usage !== undefined) parts.push(`KV ${Math.round(e.kv_cache_usage * 100)}%`);
      if (e.prefix_cache_hit_rate !== null && e.prefix_cache_hit_rate !== undefined) parts.push(`cache hits ${Math.round(e.prefix_cache_hit_rate * 100)}%`);
      return `${m.name}: ${parts.join(", ")}`;
    })
    .join("; ");
  // A node stalled for some of its models serves the others: it says which.
  const stalled = n.models.filter((m) => m.stalled).map((m) => m.name);
  const state = n.draining ? "draining" : stalled.length && stalled.length === n.models.length ? "stalled" : "serving";
  put(row.inFlight, "", n.in_flight);
  put(row.state, "class", "state-" + state);
  let said = state === "serving" && stalled.length ? `serving; stalled: ${stalled.join(", ")}` : state;
  // Its frames wait unread for their part of the edge's time: it looks healthy otherwise.
  if (n.throttled) said += `; throttled (${n.throttled_s.toFixed(1)} s waited)`;
  put(row.state, "", said);
  // (Ages come computed by the edge, on its clock: a cell changes when its text does.)
  put(row.linked, "", fmtAge(n.linked_for_s));
  put(row.ttft, "", n.ttft_ms === null ? "–" : n.ttft_ms.toFixed(1) + " ms");
  put(row.engine, "", engine || "–");
}

function renderNodes(nodes) {
  syncRows($("nodes").tBodies[0], nodes, (n) => n.id, nodeRow, fillNode);
  $("no-nodes").hidden = nodes.length > 0;
}

// Two clicks on one run's button: rows move as runs start and end, and one click aimed at a
// run could land on the next one's.
function cancelButton(runId) {
  const button = el("button", { type: "button", class: "cancel", "data-cancel": runId, title: "cancel run " + runId }, "cancel");
  let armed = null;
  button.addEventListener("click", async () => {
    if (armed === null) {
      button.textContent = "confirm?";
      button.classList.add("armed");
      armed = setTimeout(() => {
        armed = null;
        button.textContent = "cancel";
        button.classList.remove("armed");
      }, 4000);
      return;
    }
    clearTimeout(armed);
    button.classList.remove("armed");
    button.disabled = true;
    button.textContent = "cancelling";
    try {
      const r = await fetch(`/v1/admin/runs/${encodeURIComponent(runId)}/cancel`, {
        method: "POST",
        headers: { Authorization: "Bearer " + sessionStorage.getItem(KEY) },
      });
      button.textContent = r.ok ? "cancelled" : r.status === 404 ? "ended" : "failed";
    } catch (e) {
      button.textContent = "failed";
    }
  });
  return button;
}

// A run's row is kept by its id, and its cancel button with it ("confirm?" across snapshots).
function runRow(r) {
  const row = { tr: el("tr") };
  row.id = td("run", { class: "title name run-id" });
  row.model = td("model", { class: "name" });
  row.node = td("node", { class: "name" });
  row.api = td("API");
  row.key = td("key", { class: "name" });
  row.age = td("age", { class: "num" });
  row.tokens = td("tokens", { class: "num tokens" });
  row.phase = td("phase");
  const action = td("", { class: "action" });
  if (r.id !== null) action.append(cancelButton(r.id));
  row.tr.append(row.id, row.model, row.node, row.api, row.key, row.age, row.tokens, row.phase, action);
  return row;
}

function fillRun(row, r) {
  put(row.tr, "data-run-id", r.id);
  put(row.tr, "data-phase", r.phase);
  put(row.id, "title", r.id);
  put(row.id, "", r.id || "–");
  put(row.model, "title", r.model);
  put(row.model, "", r.model);
  put(row.node, "title", r.node);
  put(row.node, "", r.node || "–");
  put(row.api, "", r.api || "–");
  put(row.key, "title", r.key);
  put(row.key, "", r.key || "–");
  put(row.age, "", fmtAge(r.age_s));
  put(row.tokens, "", fmtNum(r.tokens));
  put(row.phase, "class", "phase phase-" + r.phase);
  put(row.phase, "", r.phase);
}

function renderRuns(snap) {
  syncRows($("runs-table").tBodies[0], snap.runs, (r) => (r.id === null ? "" : "run " + r.id), runRow, fillRun);
  const total = Object.values(snap.phases).reduce((a, b) => a + b, 0);
  put($("runs-count"), "", snap.runs.length < total ? `(${snap.runs.length} oldest of ${total})` : "");
  $("no-runs").hidden = snap.runs.length > 0;
}

function renderEvents(list, emptyId, items, line) {
  const seen = JSON.stringify(items);
  if (list.dataset.seen === seen || selecting(list)) return; // (unchanged, or being selected)
  list.dataset.seen = seen;
  const nodes = items
    .slice()
    .reverse()
    .map((item) => el("li", {}, el("span", { class: "when" }, fmtTime(item.t)), line(item)));
  list.replaceChildren(...nodes);
  $(emptyId).hidden = items.length > 0;
}

function queueRow() {
  const row = { tr: el("tr"), model: el("td", { class: "name" }), depth: el("td", { class: "num" }) };
  row.tr.append(row.model, row.depth);
  return row;
}

function fillQueue(row, [model, depth]) {
  put(row.tr, "data-model", model);
  put(row.model, "title", model);
  put(row.model, "", model);
  put(row.depth, "", fmtNum(depth));
}

function renderSnapshot(snap) {
  if ($("console").classList.contains("stale")) $("console").classList.remove("stale");
  setStatus("live", "live");
  put($("edge-id"), "", `edge ${snap.edge_id} · up ${fmtAge(snap.uptime_s)}${snap.draining ? " · draining" : ""}`);
  put($("s-in-flight"), "", fmtNum(snap.in_flight));
  put($("s-streaming"), "", fmtNum(snap.phases.streaming));
  put($("s-waiting"), "", fmtNum(snap.phases.waiting));
  put($("s-queued"), "", fmtNum(snap.queued));
  put($("s-nodes"), "", fmtNum(snap.nodes.length));
  renderNodes(snap.nodes);
  renderRuns(snap);
  const queues = Object.entries(snap.queues);
  syncRows($("queue-table").tBodies[0], queues, ([model]) => model, queueRow, fillQueue);
  $("no-queues").hidden = queues.length > 0;
  renderEvents(
    $("rejected"),
    "no-rejected",
    snap.rejected,
    (r) => `${r.count > 1 ? r.count + "× " : ""}${r.model}${r.key ? " · key " + r.key : ""} · ${r.code || "429"}${r.message ? ": " + r.message : ""}`,
  );
  renderEvents($("errors"), "no-errors", snap.errors, (e) => `${e.cause} · ${e.model} on ${e.node} · run ${e.run_id} · ${e.message}`);
}

// -- usage --------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";

function renderChart(minutes) {
  const svg = $("chart");
  const width = 600;
  const height = 160;
  const slot = width / minutes.length;
  const totals = minutes.map((m) => m[2] + m[3]);
  const max = Math.max(1, ...totals);
  const bars = [];
  minutes.forEach((m, i) => {
    const [minute, requests, prompt, completion] = m;
    const x = i * slot + 1;
    const hp = (prompt / max) * (height - 10);
    const hc = (completion / max) * (height - 10);
    const title = document.createElementNS(SVG, "title");
    title.textContent = `${fmtTime(minute * 60)}: ${fmtNum(requests)} requests, ${fmtNum(prompt)} prompt + ${fmtNum(completion)} completion tokens`;
    const group = document.createElementNS(SVG, "g");
    group.setAttribute("data-minute", minute);
    group.setAttribute("data-tokens", prompt + completion);
    group.setAttribute("data-requests", requests);
    for (const [cls, h, y] of [
      ["prompt", hp, height - hp],
      ["completion", hc, height - hp - hc],
    ]) {
      if (h <= 0) continue;
      const rect = document.createElementNS(SVG, "rect");
      rect.setAttribute("class", cls);
      rect.setAttribute("x", x.toFixed(1));
      rect.setAttribute("y", y.toFixed(1));
      rect.setAttribute("width", Math.max(1, slot - 2).toFixed(1));
      rect.setAttribute("height", Math.max(1, h).toFixed(1));
      group.append(rect);
    }
    group.append(title);
    bars.push(group);
  });
  svg.replaceChildren(...bars);
  $("chart-max").textContent = totals.some((t) => t > 0)
    ? `max ${fmtNum(max)} tokens/min (dark: prompt, light: completion)`
    : "no tokens in the last hour";
  $("s-tpm").textContent = fmtNum(totals[totals.length - 1]);
}

function usageRow() {
  const row = { tr: el("tr"), name: el("td", { class: "name" }) };
  row.requests = el("td", { class: "num" });
  row.prompt = el("td", { class: "num" });
  row.completion = el("td", { class: "num" });
  row.tr.append(row.name, row.requests, row.prompt, row.completion);
  return row;
}

function renderUsageRows(table, rows, none) {
  const fill = (row, r) => {
    put(row.tr, "data-name", r.name);
    put(row.name, "title", r.name === null ? none : r.name);
    put(row.name, "", r.name === null ? none : r.name);
    put(row.requests, "", fmtNum(r.requests));
    put(row.prompt, "", fmtNum(r.prompt_tokens));
    put(row.completion, "", fmtNum(r.completion_tokens));
  };
  syncRows(table.tBodies[0], rows, (r) => (r.name === null ? "" : "name " + r.name), usageRow, fill);
}

function renderUsage(usage) {
  put($("usage-source"), "", usage.source === "ledger" ? "(today from the ledger)" : "(today, since this edge started)");
  renderChart(usage.minutes);
  renderUsageRows($("usage-keys"), usage.keys, "(no key)");
  renderUsageRows($("usage-models"), usage.models, "–");
  $("no-usage-keys").hidden = usage.keys.length > 0;
  $("no-usage-models").hidden = usage.models.length > 0;
}

// -- the stream ------------------------------------------------------------------

function dispatch(block) {
  let event = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  if (!data.length) return;
  const payload = JSON.parse(data.join("\n"));
  if (event === "snapshot") renderSnapshot(payload);
  else if (event === "usage") renderUsage(payload);
}

async function connect() {
  const key = sessionStorage.getItem(KEY);
  if (!key) return showLogin("");
  if (channel && !leading) return; // (another tab reads the stream: see "tabs" below)
  if (controller) controller.abort();
  controller = new AbortController();
  const mine = controller;
  setStatus("connecting", "retry");
  let response;
  const unanswered = setTimeout(() => {
    mine.stale = true; // (an edge that hangs answers nothing: dial again)
    mine.abort();
  }, STALE_MS);
  try {
    response = await fetch("/v1/admin/events", {
      headers: { Authorization: "Bearer " + key, Accept: "text/event-stream" },
      cache: "no-store",
      signal: mine.signal,
    });
  } catch (e) {
    return retry(mine);
  } finally {
    clearTimeout(unanswered);
  }
  if (response.status === 401 || response.status === 403) {
    leave();
    sessionStorage.removeItem(KEY);
    let message = "That key was refused.";
    try {
      message = (await response.json()).error.message || message;
    } catch (e) {}
    return showLogin(message);
  }
  if (!response.ok) {
    let message = `The edge answered ${response.status}.`;
    try {
      message = (await response.json()).error.message || message;
    } catch (e) {}
    setNotice(message + " Trying again.");
    return retry(mine, response.status === 429 ? 5000 : 1000);
  }
  setNotice("");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let live = false; // (live at the first event, not at the answer's head: a proxy holding the body showed "live")
  heardAt = Date.now();
  const watchdog = setInterval(() => {
    if (Date.now() - heardAt <= STALE_MS) return;
    clearInterval(watchdog);
    mine.stale = true; // (aborted for silence, not signed out: dial again)
    mine.abort();
  }, 500);
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      heardAt = Date.now();
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!live && /^(event|data):/m.test(block)) {
          live = true;
          showConsole();
          setStatus("live", "live");
          put($("status"), "title", "this tab reads the edge's events, for the console's other tabs in this browser too");
        }
        dispatch(block);
        if (channel && group) channel.postMessage({ t: "ev", group, id: tab.id, born: tab.born, block });
      }
    }
  } catch (e) {
    // aborted (signed out, or silent for STALE_MS) or the connection dropped
  }
  clearInterval(watchdog);
  retry(mine);
}

function retry(mine, delay = 1000) {
  if (controller !== mine || (mine.signal.aborted && !mine.stale)) return;
  // What is on screen is as of the last event: greyed until a snapshot comes.
  $("console").classList.add("stale");
  setStatus(mine.stale ? "stale · reconnecting" : "reconnecting", "retry");
  retryTimer = setTimeout(connect, delay);
}

function showConsole() {
  $("login").hidden = true;
  $("console").hidden = false;
  $("signout").hidden = false;
}

// -- tabs: one stream for a browser's console tabs -------------------------------------
// A console held an HTTP/1.1 connection for good, and Chromium opens at most 6 to a host: with
// 6 tabs open, a cancel (and a 7th tab) waited for a connection that never came (found from
// outside). The tabs signed in with one key elect one, the oldest, to read the stream; it
// passes each event to the others over a BroadcastChannel. Each says it is there every second
// (and with each event it passes on); one not heard from for PEER_MS is gone, and the next
// oldest reads the stream.
const PEER_MS = 3000;
const ELECT_MS = 300; // a tab signing in waits this long for the others to say they are there
const tab = { id: Math.random().toString(36).slice(2) + Date.now().toString(36), born: Date.now() };
const channel = typeof BroadcastChannel === "function" ? new BroadcastChannel("iop-console") : null;
const peers = new Map(); // id -> { born, seen }: the other tabs of this key
let group = null; // this tab's key, hashed (null: signed out or not yet joined)
let leading = false;
let sharedAt = 0; // Date.now() of the last event the reading tab passed on
let electTimer = null;

function hashOf(text) {
  // FNV-1a: which tabs share a key, not a secret (the key never goes on the channel)
  let h = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) {
    h ^= text.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h.toString(16);
}

function older(a, b) {
  return a.born < b.born || (a.born === b.born && a.id < b.id);
}

function say(t) {
  if (channel && group) channel.postMessage({ t, group, id: tab.id, born: tab.born });
}

function join() {
  const key = sessionStorage.getItem(KEY);
  if (!key) return showLogin("");
  if (!channel) return connect();
  group = hashOf(key);
  say("who");
  clearTimeout(electTimer);
  electTimer = setTimeout(elect, ELECT_MS);
}

function leave() {
  say("bye");
  group = null;
  leading = false;
  peers.clear();
  clearTimeout(electTimer);
}

function elect() {
  if (!group) return;
  const now = Date.now();
  let first = tab;
  for (const [id, peer] of peers) {
    if (now - peer.seen > PEER_MS) peers.delete(id);
    else if (older({ id, born: peer.born }, first)) first = { id, born: peer.born };
  }
  if (first === tab && !leading) {
    leading = true;
    connect();
  } else if (first !== tab && leading) {
    leading = false; // (an older tab reads the stream: this one's goes)
    const mine = controller;
    controller = null;
    clearTimeout(retryTimer);
    if (mine) mine.abort();
  }
  if (!leading && now - sharedAt > STALE_MS) {
    $("console").classList.add("stale");
    setStatus("stale · waiting for the tab that reads the edge", "retry");
  }
}

if (channel) {
  channel.onmessage = (event) => {
    const m = event.data;
    if (!group || !m || m.group !== group || m.id === tab.id) return;
    if (m.t === "bye") {
      peers.delete(m.id);
      return elect();
    }
    peers.set(m.id, { born: m.born, seen: Date.now() });
    if (m.t === "who") say("here");
    else if (m.t === "ev" && !leading) {
      sharedAt = Date.now();
      showConsole();
      dispatch(m.block);
      put($("status"), "title", "read by another console tab of this browser");
    } else if (m.t === "ev" && older(m, tab)) elect(); // (two read it: the younger stops)
  };
  setInterval(() => {
    say("here");
    elect();
  }, 1000);
  window.addEventListener("pagehide", () => say("bye"));
}

function setNotice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

$("login-fields").disabled = false; // (off until this script holds the form: see console.html)
$("needs-script").hidden = true;
$("login-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key").value.trim();
  if (!key) return;
  if (/[^\x21-\x7e]/.test(key)) {
    $("login-error").textContent = "An admin key is printable ASCII without spaces (it travels in a header).";
    return;
  }
  sessionStorage.setItem(KEY, key);
  $("key").value = "";
  $("login-error").textContent = "";
  join();
});

$("signout").addEventListener("click", () => {
  leave();
  sessionStorage.removeItem(KEY);
  showLogin("");
});

if (sessionStorage.getItem(KEY)) join();
else showLogin("");
