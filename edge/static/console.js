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
  pill.textContent = text;
  pill.className = "pill " + kind;
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

function replaceRows(tbody, rows) {
  if (!selecting(tbody)) tbody.replaceChildren(...rows);
}

// A cell that names its column (data-label): on a phone each row is a card
// of "label: value" lines instead of a table wider than the screen.
function td(label, attrs, ...children) {
  return el("td", { ...attrs, "data-label": label }, ...children);
}

// -- snapshot -----------------------------------------------------------------

function renderNodes(nodes) {
  const rows = nodes.map((n) => {
    const models = td("models", { class: "models" });
    for (const m of n.models) {
      models.append(el("span", { class: "tag", title: `${m.name} (${m.adapter})` }, `${m.name} ${m.in_flight} / ${m.grant} / ${m.max_concurrency}`));
    }
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
    const stateText = state === "serving" && stalled.length ? `serving; stalled: ${stalled.join(", ")}` : state;
    return el(
      "tr",
      { "data-node-id": n.id },
      td("node", { class: "title name", title: n.id }, n.id),
      models,
      td("in flight", { class: "num in-flight" }, n.in_flight),
      td("state", { class: "state-" + state }, stateText),
      td("linked", { class: "num" }, fmtAge(n.linked_for_s)),
      td("TTFT", { class: "num" }, n.ttft_ms === null ? "–" : n.ttft_ms.toFixed(1) + " ms"),
      td("engine", { class: "engine" }, engine || "–"),
    );
  });
  replaceRows($("nodes").tBodies[0], rows);
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

let pendingCancels = new Map(); // run (or queued request) id -> its button, kept across snapshots

function renderRuns(snap) {
  const rows = snap.runs.map((r) => {
    let action = "";
    if (r.id !== null) {
      action = pendingCancels.get(r.id) || cancelButton(r.id);
      pendingCancels.set(r.id, action);
    }
    return el(
      "tr",
      { "data-run-id": r.id || "", "data-phase": r.phase },
      td("run", { title: r.id || "", class: "title name run-id" }, r.id || "–"),
      td("model", { class: "name", title: r.model }, r.model),
      td("node", { class: "name", title: r.node || "" }, r.node || "–"),
      td("API", {}, r.api || "–"),
      td("key", { class: "name", title: r.key || "" }, r.key || "–"),
      td("age", { class: "num" }, fmtAge(r.age_s)),
      td("tokens", { class: "num tokens" }, fmtNum(r.tokens)),
      td("phase", { class: "phase phase-" + r.phase }, r.phase),
      td("", { class: "action" }, action),
    );
  });
  const listed = new Set(snap.runs.map((r) => r.id));
  for (const id of pendingCancels.keys()) if (!listed.has(id)) pendingCancels.delete(id);
  replaceRows($("runs-table").tBodies[0], rows);
  const total = Object.values(snap.phases).reduce((a, b) => a + b, 0);
  $("runs-count").textContent = snap.runs.length < total ? `(${snap.runs.length} oldest of ${total})` : "";
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

function renderSnapshot(snap) {
  $("console").classList.remove("stale");
  setStatus("live", "live");
  $("edge-id").textContent = `edge ${snap.edge_id} · up ${fmtAge(snap.uptime_s)}${snap.draining ? " · draining" : ""}`;
  $("s-in-flight").textContent = fmtNum(snap.in_flight);
  $("s-streaming").textContent = fmtNum(snap.phases.streaming);
  $("s-waiting").textContent = fmtNum(snap.phases.waiting);
  $("s-queued").textContent = fmtNum(snap.queued);
  $("s-nodes").textContent = fmtNum(snap.nodes.length);
  renderNodes(snap.nodes);
  renderRuns(snap);
  const queues = Object.entries(snap.queues).map(([model, depth]) =>
    el("tr", { "data-model": model }, el("td", { class: "name", title: model }, model), el("td", { class: "num" }, fmtNum(depth))),
  );
  replaceRows($("queue-table").tBodies[0], queues);
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

function usageRows(rows, none) {
  return rows.map((r) =>
    el(
      "tr",
      { "data-name": r.name === null ? "" : r.name },
      el("td", { class: "name", title: r.name === null ? none : r.name }, r.name === null ? none : r.name),
      el("td", { class: "num" }, fmtNum(r.requests)),
      el("td", { class: "num" }, fmtNum(r.prompt_tokens)),
      el("td", { class: "num" }, fmtNum(r.completion_tokens)),
    ),
  );
}

function renderUsage(usage) {
  $("usage-source").textContent = usage.source === "ledger" ? "(today from the ledger)" : "(today, since this edge started)";
  renderChart(usage.minutes);
  replaceRows($("usage-keys").tBodies[0], usageRows(usage.keys, "(no key)"));
  replaceRows($("usage-models").tBodies[0], usageRows(usage.models, "–"));
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
  $("login").hidden = true;
  $("console").hidden = false;
  $("signout").hidden = false;
  setStatus("live", "live");
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
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
        dispatch(block);
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

function setNotice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

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
  connect();
});

$("signout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  showLogin("");
});

if (sessionStorage.getItem(KEY)) connect();
else showLogin("");
