// clora-feedback operator console. Plain JavaScript, no dependencies, no build step.
// Every value from the server reaches the page through textContent or an SVG attribute,
// never parsed as HTML: prompts and outputs render as text, whatever they contain.
"use strict";

const API = "/console/api";
const PAGE_SIZE = 25;
const state = {
  csrf: null, open: false, showText: false, view: null, agent: null,
  query: { q: "", sort: "name", order: "asc", offset: 0 },
  seq: 0, source: null, reloadTimer: null, connectedOnce: false, lastId: null,
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined && v !== false) node.setAttribute(k, String(v));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

class ApiError extends Error {
  constructor(status, body) {
    super((body && body.error && body.error.message) || `HTTP ${status}`);
    this.status = status;
    this.code = body && body.error ? body.error.code : null;
  }
}

async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  if (method !== "GET" && state.csrf) headers["X-CSRF-Token"] = state.csrf;
  const response = await fetch(API + path, {
    method, headers, credentials: "same-origin", cache: "no-store",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  let payload = null;
  try { payload = await response.json(); } catch (_) { payload = null; }
  if (!response.ok) throw new ApiError(response.status, payload);
  return payload;
}

function fmtNum(value, digits = 2) {
  return value === null || value === undefined || Number.isNaN(value) ? "–" : Number(value).toFixed(digits);
}
function fmtTime(t) {
  return t ? new Date(t * 1000).toLocaleString() : "–";
}
function ago(t) {
  if (!t) return "–";
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  if (s < 129600) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}
function say(text, isError) {
  const box = $("message");
  box.textContent = text || "";
  box.className = isError ? "error" : "note";
}
function failed(err) {
  if (err instanceof ApiError && err.status === 401) { showLogin(); return; }
  say(err.message || String(err), true);
}

function show(view) {
  for (const id of ["login-view", "agents-view", "agent-view"]) $(id).hidden = id !== view;
  state.view = view;
}

// -- login ------------------------------------------------------------------------------

function showLogin(message) {
  state.csrf = null;
  stopLive();
  show("login-view");
  $("logout").hidden = true;
  $("login-error").textContent = message || "";
  $("login-key").focus();
}

async function boot() {
  try {
    const session = await api("GET", "/session");
    started(session);
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) showLogin();
    else say(err.message, true);
  }
}

function started(session) {
  state.csrf = session.csrf_token;
  state.open = session.open;
  state.showText = session.show_text;
  $("logout").hidden = session.open;
  startLive();
  route();
}

$("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const input = $("login-key");
  const key = input.value;
  input.value = ""; // the key leaves the page at once: never kept, never in a URL
  try {
    started(await api("POST", "/login", { key }));
  } catch (err) {
    $("login-error").textContent = err.status === 403
      ? "That key is an agent's key; the console needs the admin key."
      : err.status === 401 ? "Wrong key." : err.message;
    input.focus();
  }
});

$("logout").addEventListener("click", async () => {
  try { await api("POST", "/logout"); } catch (_) { /* gone already */ }
  showLogin("Logged out.");
});

// -- routing ----------------------------------------------------------------------------

function route() {
  if (!state.csrf) return;
  say("");
  const match = location.hash.match(/^#\/agent\/(.+)$/);
  if (match) {
    state.agent = decodeURIComponent(match[1]);
    show("agent-view");
    loadAgent();
  } else {
    state.agent = null;
    show("agents-view");
    loadAgents();
  }
}
window.addEventListener("hashchange", route);

function reloadSoon() {
  clearTimeout(state.reloadTimer);
  state.reloadTimer = setTimeout(() => {
    if (state.view === "agents-view") loadAgents();
    else if (state.view === "agent-view") loadAgent();
  }, 250);
}

// -- agents page ------------------------------------------------------------------------

async function loadAgents() {
  const seq = ++state.seq;
  const q = state.query;
  const params = new URLSearchParams({
    q: q.q, sort: q.sort, order: q.order, offset: String(q.offset), limit: String(PAGE_SIZE),
  });
  try {
    const page = await api("GET", `/agents?${params}`);
    if (seq === state.seq) renderAgents(page);
  } catch (err) { failed(err); }
}

function sparkline(values) {
  if (!values.length) return el("span", { class: "note" }, "no feedback yet");
  const w = 120, h = 28, lo = Math.min(0, ...values), hi = Math.max(1, ...values);
  const x = (i) => (values.length === 1 ? w / 2 : (i / (values.length - 1)) * (w - 4) + 2);
  const y = (v) => h - 2 - ((v - lo) / (hi - lo || 1)) * (h - 4);
  const box = svg("svg", { class: "spark", viewBox: `0 0 ${w} ${h}`, width: w, height: h,
    role: "img", "aria-label": `last ${values.length} rewards, latest ${fmtNum(values[values.length - 1])}` });
  box.append(svg("polyline", { points: values.map((v, i) => `${x(i)},${y(v)}`).join(" ") }));
  if (values.length === 1) box.append(svg("circle", { cx: x(0), cy: y(values[0]), r: 2, fill: "#0969da" }));
  return box;
}

function feedbackText(f) {
  const parts = [`${f.joined} joined`];
  if (f.parked) parts.push(`${f.parked} waiting`);
  if (f.dead) parts.push(`${f.dead} dead`);
  return f.joined || f.parked || f.dead ? parts.join(" · ") : "no feedback yet";
}

function perMin(value) {
  return `${fmtNum(value)}/min`;
}

function rateCell(rate, total, cls) {
  // The rate over the last 5 minutes; the total since the start below it.
  return el("td", { class: `num ${cls}` }, perMin(rate), el("br"), el("small", { class: "note" }, total));
}

function recentReward(row) {
  if (row.reward_recent === null) return el("span", { class: "note" }, "–");
  return el("span", { title: `mean of ${row.reward_judged} judged samples in the last ${Math.round(row.window_s / 60)} minutes` },
    fmtNum(row.reward_recent));
}

function renderAgents(page) {
  const body = $("agents-table").tBodies[0];
  body.replaceChildren();
  for (const row of page.data) {
    const link = el("a", { href: `#/agent/${encodeURIComponent(row.agent)}` }, row.agent);
    const serving = row.active_version === null
      ? (row.num_versions ? "base model (unloaded)" : "base model") : `v${row.active_version}`;
    body.append(el("tr", { "data-agent": row.agent },
      el("th", { scope: "row" }, link),
      el("td", { class: "serving" }, serving),
      el("td", null, row.pinned ? el("span", { class: "badge pinned" }, "pinned") : "no"),
      el("td", { class: "num" }, row.num_versions),
      el("td", null, sparkline(row.rewards)),
      el("td", { class: "num reward-recent" }, recentReward(row)),
      rateCell(row.requests_per_min, `${row.requests} total`, "requests"),
      rateCell(row.feedback_per_min, feedbackText(row.feedback), "feedback"),
      el("td", { class: "num" }, fmtNum(row.staleness)),
      el("td", null, ago(row.last_step_at)),
      el("td", { class: "replica" }, row.replica ?? "–"),
    ));
  }
  $("agents-empty").hidden = page.total > 0;
  $("agents-table").hidden = page.total === 0;
  const first = page.total ? page.offset + 1 : 0;
  const last = page.offset + page.data.length;
  $("agents-range").textContent = `${first}–${last} of ${page.total}`;
  $("agents-prev").disabled = page.offset === 0;
  $("agents-next").disabled = last >= page.total;
}

let searchTimer = null;
$("agents-search").addEventListener("input", () => {
  clearTimeout(searchTimer);
  searchTimer = setTimeout(() => {
    state.query.q = $("agents-search").value;
    state.query.offset = 0;
    loadAgents();
  }, 200);
});
$("agents-controls").addEventListener("submit", (e) => e.preventDefault());
$("agents-sort").addEventListener("change", () => {
  state.query.sort = $("agents-sort").value; state.query.offset = 0; loadAgents();
});
$("agents-order").addEventListener("change", () => {
  state.query.order = $("agents-order").value; state.query.offset = 0; loadAgents();
});
$("agents-prev").addEventListener("click", () => {
  state.query.offset = Math.max(0, state.query.offset - PAGE_SIZE); loadAgents();
});
$("agents-next").addEventListener("click", () => {
  state.query.offset += PAGE_SIZE; loadAgents();
});

// -- one agent --------------------------------------------------------------------------

async function loadAgent() {
  const seq = ++state.seq;
  const name = state.agent;
  try {
    const path = `/agents/${encodeURIComponent(name)}`;
    const [detail, trajectories] = await Promise.all([
      api("GET", path), api("GET", `${path}/trajectories?limit=20`),
    ]);
    if (seq !== state.seq) return;
    renderAgent(detail);
    renderTrajectories(trajectories);
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) {
      $("agent-title").textContent = name;
      say(`No agent named ${name}.`, true);
    } else failed(err);
  }
}

function summaryItem(label, value) {
  return el("div", null, el("dt", null, label), el("dd", null, value));
}

function renderAgent(d) {
  $("agent-title").textContent = `Agent ${d.agent}`;
  document.title = `${d.agent} · clora-feedback console`;
  const serving = d.active_version === null ? "base model" : `v${d.active_version}`;
  const mean = d.rewards.length ? d.rewards.reduce((a, p) => a + p.reward, 0) / d.rewards.length : null;
  $("agent-summary").replaceChildren(
    summaryItem("Serving", el("span", { id: "serving-version" }, serving)),
    summaryItem("Pinned", el("span", { id: "pinned-state" }, d.pinned ? "pinned: training frozen" : "no")),
    summaryItem("Versions", d.num_versions),
    summaryItem("Requests", el("span", { id: "requests-rate" }, `${perMin(d.requests_per_min)} (5 min) · ${d.requests} total`)),
    summaryItem("Feedback", el("span", { id: "feedback-rate" }, `${perMin(d.feedback_per_min)} (5 min) · ${feedbackText(d.feedback)}`)),
    summaryItem("Reward (5 min)", el("span", { id: "reward-recent" }, recentReward(d))),
    summaryItem("Mean reward (shown)", mean === null ? "no feedback yet" : fmtNum(mean)),
    summaryItem("Engine replica", el("span", { id: "replica" }, d.replica ?? "–")),
  );
  const pin = $("pin-button");
  pin.textContent = d.pinned ? "Unpin (let training publish)" : "Pin (freeze training)";
  pin.disabled = d.num_versions === 0 && d.active_version === null && !d.pinned && d.latest_version === null;
  pin.onclick = () => togglePin(d);
  drawChart(d);
  renderVersions(d);
}

function renderVersions(d) {
  const body = $("versions-table").tBodies[0];
  body.replaceChildren();
  for (const v of d.versions.slice().reverse()) {
    let action = "";
    if (v.status !== "active") {
      const verb = d.active_version !== null && v.version > d.active_version ? "Switch to" : "Roll back to";
      action = el("button", { type: "button", class: "rollback", "data-version": v.version,
        "aria-label": `${verb} version ${v.version}` }, `${verb} v${v.version}`);
      action.addEventListener("click", () => rollback(d, v.version));
    }
    const state_ = el("span", { class: `badge ${v.status}`, title: v.rolled_back_reason || "" },
      v.status.replace("_", " "));
    const share = v.release === "canary" && v.release_share ? ` ${Math.round(v.release_share * 100)}%` : "";
    const release = v.release === null || v.release === undefined ? "–"
      : el("span", { class: `badge release-${v.release}`, title: v.release_reason || "" }, `${v.release}${share}`);
    body.append(el("tr", { "data-version": v.version },
      el("th", { scope: "row" }, `v${v.version}`),
      el("td", null, state_),
      el("td", null, release),
      el("td", null, v.parent === null ? "–" : `v${v.parent}`),
      el("td", { class: "num" }, v.step),
      el("td", { class: "num" }, fmtNum(v.loss, 4)),
      el("td", { class: "num" }, fmtNum(v.reward_mean)),
      el("td", { class: "num" }, v.samples ?? "–"),
      el("td", { class: "num" }, fmtNum(v.staleness_mean)),
      el("td", null, fmtTime(v.created_at)),
      el("td", null, action),
    ));
  }
  $("versions-empty").hidden = d.versions.length > 0;
  $("versions-table").hidden = d.versions.length === 0;
}

function movingAverage(values, window) {
  const out = [];
  let sum = 0;
  for (let i = 0; i < values.length; i++) {
    sum += values[i];
    if (i >= window) sum -= values[i - window];
    out.push(sum / Math.min(i + 1, window));
  }
  return out;
}

function drawChart(d) {
  const box = $("reward-chart");
  box.replaceChildren();
  const points = d.rewards;
  if (!points.length) {
    box.append(el("p", { class: "empty" },
      "No feedback yet: rewards appear here once feedback about this agent's completions arrives."));
    $("chart-caption").textContent = "";
    return;
  }
  const W = 900, H = 280, L = 44, R = 16, T = 22, B = 34;
  const times = points.map((p) => p.t);
  const marks = d.timeline.filter((e) => e.t);
  let t0 = Math.min(...times), t1 = Math.max(...times);
  for (const m of marks) if (m.t >= t0 - (t1 - t0) * 0.1 && m.t <= t1 + 60) { t0 = Math.min(t0, m.t); t1 = Math.max(t1, m.t); }
  if (t1 - t0 < 1) { t0 -= 30; t1 += 30; }
  const rewards = points.map((p) => p.reward);
  const lo = Math.min(0, ...rewards), hi = Math.max(1, ...rewards);
  const x = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
  const y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "xMidYMid meet" });
  for (const v of [lo, (lo + hi) / 2, hi]) {
    chart.append(svg("line", { class: "grid-line", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
    chart.append(svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, fmtNum(v)));
  }
  chart.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  for (let k = 0; k <= 4; k++) {
    const t = t0 + ((t1 - t0) * k) / 4;
    const anchor = k === 0 ? "start" : k === 4 ? "end" : "middle";
    chart.append(svg("line", { class: "axis", x1: x(t), x2: x(t), y1: H - B, y2: H - B + 4 }));
    chart.append(svg("text", { x: x(t), y: H - 12, "text-anchor": anchor }, new Date(t * 1000).toLocaleTimeString()));
  }
  for (const m of marks) {
    if (m.t < t0 || m.t > t1) continue;
    const rb = m.kind === "rollback";
    const label = rb ? (m.version ? `rollback → v${m.version}` : "rollback") : `v${m.version}`;
    const line = svg("line", { class: rb ? "rb marker" : "ver marker", x1: x(m.t), x2: x(m.t), y1: T - 8, y2: H - B,
      "data-kind": m.kind, "data-version": m.version ?? "" });
    line.append(svg("title", {}, `${label} at ${fmtTime(m.t)}${m.reason ? ": " + m.reason : ""}`));
    chart.append(line);
    const nearEnd = x(m.t) > W - R - 110;
    chart.append(svg("text", { class: rb ? "rb-label" : "ver-label", x: x(m.t) + (nearEnd ? -4 : 3),
      y: rb ? T + 6 : T - 10, "text-anchor": nearEnd ? "end" : "start" }, label));
  }
  const avg = movingAverage(rewards, 10);
  for (const [i, p] of points.entries()) {
    const dot = svg("circle", { class: "pt", cx: x(p.t), cy: y(p.reward), r: 3.5, "data-version": p.version });
    dot.append(svg("title", {}, `reward ${fmtNum(p.reward)} · served by ${p.version ? "v" + p.version : "base"} · ${fmtTime(p.t)}`));
    chart.append(dot);
    void i;
  }
  chart.append(svg("polyline", { class: "avg", points: points.map((p, i) => `${x(p.t)},${y(avg[i])}`).join(" ") }));
  box.append(chart);
  $("chart-caption").replaceChildren(el("span", { class: "legend" },
    el("span", null, `● ${points.length} rewards (one per judged sample, by the time it was served)`),
    el("span", null, "— moving average of 10"),
    el("span", null, "| green: version published"),
    el("span", null, "┆ red: rollback")));
}

function renderTrajectories(page) {
  const body = $("trajectories-table").tBodies[0];
  body.replaceChildren();
  const textCols = document.querySelectorAll("#trajectories-table .text-col");
  for (const th of textCols) th.hidden = !page.show_text;
  $("trajectories-note").textContent = page.show_text
    ? "Newest first. Text is shown as sent and generated (as plain text)."
    : "Newest first. Prompt and output text are hidden: set console.show_text to show them.";
  for (const t of page.data) {
    const feedback = t.feedback.length
      ? t.feedback.map((f) => `${f.kind} ${fmtNum(f.value)}`).join(", ") : "no feedback yet";
    const row = el("tr", { "data-id": t.id },
      el("td", null, fmtTime(t.created_at)),
      el("td", null, t.adapter_version ? `v${t.adapter_version}` : "base"),
      el("td", null, feedback));
    if (page.show_text) {
      row.append(el("td", { class: "text prompt" }, t.prompt ?? ""));
      row.append(el("td", { class: "text output" }, t.output ?? ""));
    }
    body.append(row);
  }
  $("trajectories-empty").hidden = page.data.length > 0;
  $("trajectories-table").hidden = page.data.length === 0;
}

// -- actions (each confirmed, naming what changes) ------------------------------------

function confirmAction(title, text, ok) {
  const dialog = $("confirm");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  $("confirm-ok").textContent = ok;
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.returnValue = "";
    dialog.showModal();
    $("confirm-cancel").focus();
  });
}

async function rollback(d, version) {
  const from = d.active_version === null ? "the base model" : `version ${d.active_version}`;
  const later = d.versions.filter((v) => v.version > version && v.status !== "rolled_back").map((v) => `v${v.version}`);
  const text = `Agent ${d.agent} will serve version ${version} instead of ${from}, from its next request.` +
    (later.length ? ` ${later.join(", ")} will be marked rolled back (kept, and can be activated again).` : "");
  if (!(await confirmAction(`Roll back ${d.agent}?`, text, `Serve v${version}`))) return;
  try {
    const result = await api("POST", `/agents/${encodeURIComponent(d.agent)}/rollback`, { version });
    say(`Agent ${d.agent} now serves version ${result.active_version}.`);
  } catch (err) { failed(err); }
  loadAgent();
}

async function togglePin(d) {
  const pin = !d.pinned;
  const text = pin
    ? `Training of ${d.agent} stops publishing new versions until it is unpinned; ${d.active_version ? "v" + d.active_version : "the base model"} keeps serving.`
    : `The trainer may publish new versions of ${d.agent} from its feedback again; each new version serves once published.`;
  if (!(await confirmAction(pin ? `Pin ${d.agent}?` : `Unpin ${d.agent}?`, text, pin ? "Pin" : "Unpin"))) return;
  try {
    await api("POST", `/agents/${encodeURIComponent(d.agent)}/${pin ? "pin" : "unpin"}`);
    say(pin ? `Agent ${d.agent} is pinned.` : `Agent ${d.agent} is unpinned.`);
  } catch (err) { failed(err); }
  loadAgent();
}

// -- live updates -----------------------------------------------------------------------

function liveStatus(text, on) {
  $("live").textContent = text;
  $("live").className = on ? "live on" : "live";
}

function stopLive() {
  if (state.source) state.source.close();
  state.source = null;
  liveStatus("offline", false);
}

function startLive() {
  stopLive();
  const resume = state.lastId ? `?last_event_id=${encodeURIComponent(state.lastId)}` : "";
  const source = new EventSource(`${API}/events${resume}`);
  state.source = source;
  let failures = 0;
  const seen = (e) => { if (e.lastEventId) state.lastId = e.lastEventId; };
  source.addEventListener("ready", (e) => {
    seen(e);
    failures = 0;
    liveStatus("live", true);
    // A reconnect after changes: reread what the page shows (nothing changed: keep it).
    if (state.connectedOnce && !JSON.parse(e.data).resumed) reloadSoon();
    state.connectedOnce = true;
  });
  source.addEventListener("agents", (e) => {
    seen(e);
    const changed = JSON.parse(e.data).changed.map((a) => a.agent);
    if (state.view === "agents-view" || changed.includes(state.agent)) reloadSoon();
  });
  source.addEventListener("feedback", (e) => { seen(e); reloadSoon(); });
  source.onerror = () => {
    // Each response ends after a few seconds and EventSource reconnects at once: one
    // error is routine. A second in a row means the server is away: back off, retry.
    failures += 1;
    if (source.readyState !== EventSource.CLOSED && failures < 2) return;
    liveStatus("reconnecting…", false);
    source.close();
    setTimeout(async () => {
      if (state.source !== source) return;
      try { await api("GET", "/session"); startLive(); } catch (err) {
        if (err instanceof ApiError && err.status === 401) failed(err);
        else { state.source = null; setTimeout(() => { if (state.csrf) startLive(); }, 3000); }
      }
    }, 3000);
  };
}

boot();
