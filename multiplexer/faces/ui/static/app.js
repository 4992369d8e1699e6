// The dashboard: one fetch() stream of /ui/api/stream (Server-Sent Events; fetch, because
// EventSource cannot send the bearer header), rendered panel by panel. No framework, no build.
"use strict";

const WINDOW_S = 120;     // the charts' span
const RATE_SPAN_S = 2;    // rates over the last two seconds of snapshots
const num = (v, d = 0) => v == null ? "–" : Number(v).toFixed(d);
const v = (name, text, cls = "") => `<span data-v="${esc(name)}" class="${cls}">${esc(text)}</span>`;
const sum = (o) => Object.values(o || {}).reduce((a, b) => a + b, 0);

// -- the key (key.js takes a #key=... fragment), else the login form -----------------------------
function showLogin(message) {
  $("#main").hidden = true; $("#logout").hidden = true; $("#login").hidden = false;
  $("#login-error").textContent = message || "";
  $("#key").focus();
}
$("#login").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = $("#key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY, key);
  $("#key").value = "";
  connect();
});
$("#logout").addEventListener("click", () => { sessionStorage.removeItem(KEY); stop(); showLogin(); });

// -- the stream ---------------------------------------------------------------------------------
let aborter = null;
function stop() { if (aborter) aborter.abort(); aborter = null; setConn("off", "not connected"); }
function setConn(state, text) { $("#conn").className = "dot " + state; $("#status").textContent = text; }

async function connect() {
  stop();
  const key = sessionStorage.getItem(KEY);
  if (!key) { showLogin(); return; }
  const mine = aborter = new AbortController();
  setConn("wait", "connecting");
  let retry = 1000;
  while (aborter === mine) {
    try {
      const r = await fetch("/ui/api/stream", {headers: {authorization: "Bearer " + key}, signal: mine.signal, cache: "no-store"});
      if (r.status === 401 || r.status === 404) {
        let why = r.status === 401 ? "refused: not a valid key" : "the dashboard's API is off";
        try { why = (await r.json()).error.message; } catch (_) { /* the status says enough */ }
        sessionStorage.removeItem(KEY); aborter = null; setConn("off", "refused"); showLogin(why); return;
      }
      if (!r.ok) throw new Error("HTTP " + r.status);
      $("#login").hidden = true; $("#main").hidden = false; $("#logout").hidden = false;
      setConn("on", "live"); retry = 1000;
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += value;
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const frame = buf.slice(0, cut); buf = buf.slice(cut + 2);
          const data = frame.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (data) render(JSON.parse(data));
        }
      }
    } catch (e) {
      if (aborter !== mine) return;
    }
    setConn("wait", "reconnecting");
    await new Promise((ok) => setTimeout(ok, retry));
    retry = Math.min(retry * 2, 10000);
  }
}

// -- rates from consecutive snapshots -----------------------------------------------------------
const past = [];  // {at, calls, upstream, errors, routes: {name: calls}, lanes: {name: items}, tokens: {model: n}}
function remember(s) {
  const p = s.panels, r = p.routes;
  const h = {at: s.at, routes: {}, tokens: {}};
  if (r) {
    h.calls = r.totals.calls; h.upstream = r.totals.upstream_requests; h.errors = sum(r.totals.errors);
    for (const x of r.routes) h.routes[x.route] = x.ok + sum(x.errors);
    h.queued = r.lanes.reduce((a, l) => a + l.queued, 0);
    h.inflight = r.lanes.reduce((a, l) => a + l.in_flight, 0);
  }
  for (const pr of (p.local && p.local.providers) || []) {
    for (const [m, x] of Object.entries(pr.models || {})) h.tokens[pr.provider + "/" + m] = x.real_tokens;
  }
  past.push(h);
  while (past.length && past[0].at < s.at - WINDOW_S) past.shift();
}
function rate(get) {
  const last = past[past.length - 1];
  let first = null;
  for (const h of past) if (h.at >= last.at - RATE_SPAN_S - 0.01) { first = h; break; }
  if (!first || first === last || last.at === first.at) return null;
  const a = get(first), b = get(last);
  if (a == null || b == null) return null;
  return Math.max(0, (b - a) / (last.at - first.at));
}

// -- charts (uPlot) -----------------------------------------------------------------------------
let rateChart = null, queueChart = null;
function chart(el, series) {
  const width = Math.max(300, el.clientWidth || 600);
  return new uPlot({
    width, height: 150, legend: {live: false},
    scales: {x: {time: true}},
    axes: [{stroke: "#8591a0", grid: {stroke: "#262c35"}}, {stroke: "#8591a0", grid: {stroke: "#262c35"}, size: 45}],
    series: [{}, ...series.map(([label, stroke]) => ({label, stroke, width: 1.5, points: {show: false}}))],
  }, [[], ...series.map(() => [])], el);
}
function drawCharts() {
  if (!past.length || past[past.length - 1].calls === undefined) return;
  if (!rateChart) {
    rateChart = chart($("#chart-rate"), [["calls/s", "#58a6ff"], ["upstream req/s", "#d2a8ff"]]);
    queueChart = chart($("#chart-queue"), [["queued", "#d29922"], ["in flight", "#3fb950"]]);
  }
  const xs = [], calls = [], ups = [], qs = [], fl = [];
  for (let i = 1; i < past.length; i++) {
    const a = past[i - 1], b = past[i], dt = b.at - a.at;
    if (dt <= 0) continue;
    xs.push(b.at); calls.push((b.calls - a.calls) / dt); ups.push((b.upstream - a.upstream) / dt);
    qs.push(b.queued); fl.push(b.inflight);
  }
  rateChart.setData([xs, calls, ups]);
  queueChart.setData([xs, qs, fl]);
}

// -- panels -------------------------------------------------------------------------------------
const table = (heads, rows) => `<table><tr>${heads.map((h) => `<th>${h}</th>`).join("")}</tr>${rows.join("")}</table>`;
const empty = (text) => `<div class="empty">${esc(text)}</div>`;
function body(name, html) { const el = $(`#panel-${name} .body`); if (el) { el.innerHTML = html; widths(el); } }
// the page's Content-Security-Policy refuses style attributes in markup: bars carry their width
// as data-w, set through the DOM
function widths(el) { for (const bar of el.querySelectorAll("[data-w]")) bar.style.width = bar.dataset.w; }
function show(name, on) { const el = $(`#panel-${name}`); if (el) el.hidden = !on; }

function hist(buckets) {
  const rows = buckets.filter(([, n]) => n > 0);
  if (!rows.length) return `<span class="dim">–</span>`;
  const max = Math.max(...rows.map(([, n]) => n)), w = 16;
  const bars = rows.map(([le, n], i) => {
    const h = Math.max(1, Math.round(22 * n / max));
    return `<rect x="${i * w}" y="${24 - h}" width="${w - 2}" height="${h}"><title>≤${esc(le)}: ${n} batches</title></rect>` +
      `<text x="${i * w}" y="33">${esc(le)}</text>`;
  }).join("");
  return `<svg class="hist" width="${rows.length * w}" height="34">${bars}</svg>`;
}
function useBar(used, limit) {
  if (!limit) return `<span class="dim">no limit</span>`;
  const share = Math.min(1, Math.max(0, used / limit));
  const cls = share >= 0.95 ? "full" : share >= 0.7 ? "hot" : "";
  return `<div class="bar" title="${num(used, 1)} of ${num(limit)}"><i class="use ${cls}" data-w="${(share * 100).toFixed(1)}%"></i></div>`;
}
function progress(c, total) {
  const t = Math.max(total, 1), w = (n) => (100 * n / t).toFixed(1) + "%";
  return `<div class="bar"><i class="done" data-w="${w(c.done)}"></i><i class="failed" data-w="${w(c.failed)}"></i><i class="running" data-w="${w(c.running)}"></i></div>`;
}
const codes = (o) => Object.entries(o || {}).map(([k, n]) => `<span class="bad">${esc(k)}</span>×${n}`).join(" ") || `<span class="dim">0</span>`;
const status = (s) => `<span class="${s === "up" ? "ok" : s === "failing" ? "bad" : "warn"}">${esc(s)}</span>`;

function liveRatio() {
  const calls = rate((h) => h.calls), ups = rate((h) => h.upstream);
  return calls && ups ? num(calls / ups, 2) : "–";
}
function kpis(p) {
  const r = p.routes;
  const items = [
    ["calls/s", num(rate((h) => h.calls), 1)],
    ["upstream req/s", num(rate((h) => h.upstream), 1)],
    ["calls per upstream request: since start, now",
     v("ratio", r.totals.ratio == null ? "–" : num(r.totals.ratio, 2)) + `<span class="dim"> · ${liveRatio()}</span>`],
    ["errors/s", num(rate((h) => h.errors), 2)],
    ["calls", v("calls", r.totals.calls)],
    ["upstream requests", v("upstream_requests", r.totals.upstream_requests)],
    ["queued", v("queued", r.lanes.reduce((a, l) => a + l.queued, 0))],
    ["in flight", v("in_flight", r.lanes.reduce((a, l) => a + l.in_flight, 0))],
  ];
  $("#kpis").innerHTML = items.map(([l, n]) => `<div class="kpi"><div class="n">${n}</div><div class="l">${l}</div></div>`).join("");
}

function routesPanel(r) {
  const routes = r.routes.map((x) => `<tr><td>${esc(x.route)}</td><td>${num(rate((h) => h.routes[x.route]), 1)}</td>` +
    `<td>${v(`route.${x.route}.ok`, x.ok)}</td><td>${codes(x.errors)}</td><td>${v(`route.${x.route}.in_flight`, x.in_flight)}</td>` +
    `<td>${v(`route.${x.route}.p50_ms`, num(x.latency.p50_ms, 2))}</td><td>${v(`route.${x.route}.p99_ms`, num(x.latency.p99_ms, 2))}</td></tr>`);
  const lanes = r.lanes.map((l) => `<tr><td>${esc(l.lane)}</td><td>${v(`lane.${l.lane}.queued`, l.queued)}</td>` +
    `<td>${v(`lane.${l.lane}.in_flight`, l.in_flight)}</td><td>${v(`lane.${l.lane}.batches`, l.batches)}</td><td>${v(`lane.${l.lane}.items`, l.items)}</td>` +
    `<td>${l.batches ? num(l.items / l.batches, 1) : "–"}</td><td class="l">${hist(l.batch_sizes)}</td>` +
    `<td class="l">${l.held_by ? `<span class="warn">${esc(l.held_by)}</span>` : ""}${codes(l.rejections).replace(/^<span class="dim">0<\/span>$/, "")}</td></tr>`);
  const provs = r.providers.map((x) => {
    const calls = r.lanes.filter((l) => l.provider === x.provider).reduce((a, l) => a + l.items, 0);
    return `<tr><td>${esc(x.provider)}</td><td>${v(`provider.${x.provider}.upstream_requests`, x.upstream_requests)}</td>` +
      `<td>${x.upstream_batches}</td><td>${x.upstream_requests ? num(calls / x.upstream_requests, 2) : "–"}</td><td>${x.retries}</td><td>${codes(x.errors)}</td></tr>`;
  });
  body("routes", `<div class="charts halves">` +
    `<div>${table(["route", "calls/s", "ok", "errors by code", "in flight", "p50 ms", "p99 ms"], routes)}` +
    `<div class="dim">latency: since start, from the histogram in /metrics</div></div>` +
    `<div>${table(["lane", "queued", "in flight", "batches", "items", "items/batch", "batch sizes", "held / refused"], lanes)}` +
    `<h3>providers</h3>${table(["provider", "upstream req", "batches", "items/req", "retries", "errors"], provs)}</div></div>`);
}

function limitsPanel(l) {
  const rows = l.providers.map((x) => {
    const b = (k) => x[k] ? `${useBar(x[k].used, x[k].limit)}<span class="dim">${num(x[k].used)}/${num(x[k].limit)}${x[k].learned ? " learned" : ""}</span>` : `<span class="dim">–</span>`;
    const c = x.concurrency || {};
    const held = Object.entries(x.held || {}).map(([lane, lim]) => `${esc(lane)}: <span class="warn">${esc(lim)}</span>`).join(" ");
    return `<tr><td>${esc(x.provider)}${x.shared ? ` <span class="dim">shared</span>` : ""}</td><td class="l">${b("rpm")}</td><td class="l">${b("tpm")}</td>` +
      `<td class="l">${c.limit ? useBar(c.in_flight, c.limit) : ""}${v(`limit.${x.provider}.in_flight`, c.in_flight ?? 0)}<span class="dim">/${c.limit ?? "∞"}</span></td>` +
      `<td>${x.paused_s ? `<span class="bad">${num(x.paused_s, 1)}s</span>` : ""}${held}${x.waiting ? ` (${x.waiting} waiting)` : ""}</td><td>${codes(x.rejections).replace(/^<span class="dim">0<\/span>$/, "")}</td></tr>`;
  });
  body("limits", table(["provider", "rpm", "tpm", "concurrency", "waits", "refused"], rows));
}

function jobsPanel(j, admin) {
  if (!j.configured) return body("jobs", empty(j.detail));
  const head = admin ? `<div>${v("jobs.open", j.open)} open · items: pending ${j.items.pending ?? 0}, running ${j.items.running ?? 0}, done ${j.items.done ?? 0}, failed ${j.items.failed ?? 0} · MCP tasks listed ${j.mcp_tasks}</div>` : "";
  const rows = j.jobs.map((x) => `<tr><td>${esc(x.job_id)}</td><td class="l">${esc(x.source)}</td><td class="l">${esc(x.state)}</td>` +
    `<td class="l">${progress(x.counts, x.total)}</td><td>${x.counts.done}/${x.counts.failed}/${x.counts.pending + x.counts.running}</td>` +
    `<td class="l">${x.batches.map((b) => `${esc(b.provider)}:${esc(b.remote_status || b.state)}`).join(" ")}</td></tr>`);
  body("jobs", head + (rows.length ? table(["job", "source", "state", "progress", "done/failed/pending", "remote batches"], rows) : empty("no open jobs")));
}

// A pinned tool whose definition changed: its id, each changed field (approved -> now) on hover,
// and the command that approves it.
function quarantined(held) {
  return (held || []).map((q) => {
    const diff = Object.entries(q.diff || {}).map(([f, d]) => `${f}: ${JSON.stringify(d.approved)} -> ${JSON.stringify(d.now)}`).join("\n");
    return `<span title="${esc(diff + "\napprove: multiplexer tools approve " + q.id)}">${esc(q.id)} (${esc(Object.keys(q.diff || {}).join(", "))})</span>`;
  }).join("<br>");
}

function mcpPanel(m) {
  if (!m.configured) return body("mcp", empty(m.detail));
  const rows = m.upstreams.map((u) => `<tr><td>${esc(u.provider)}</td><td>${status(u.status)}</td><td class="l">${esc(u.era || "–")}</td>` +
    `<td class="l">${esc(u.transport || "")}</td><td>${v(`mcp.${u.provider}.tools`, u.tools ?? 0)}</td><td>${u.connects ?? 0}</td><td>${u.disconnects}</td>` +
    `<td class="err">${esc(u.error || "")}</td><td class="l err">${quarantined(u.quarantined)}</td></tr>`);
  body("mcp", table(["upstream", "status", "era", "transport", "tools", "connects", "drops", "last error", "quarantined tools"], rows));
}

function localPanel(l) {
  if (!l.configured) return body("local", empty(l.detail));
  const rows = [];
  for (const p of l.providers) {
    const models = Object.entries(p.models || {});
    if (!models.length) rows.push(`<tr><td>${esc(p.provider)}</td><td>${status(p.status)}</td><td class="err" colspan="6">${esc(p.detail || p.error || "")}</td></tr>`);
    for (const [name, m] of models) {
      rows.push(`<tr><td>${esc(p.provider)}/${esc(name)}</td><td>${status(m.stage === "ready" ? "up" : m.error ? "failing" : m.stage)}</td>` +
        `<td class="l">${esc(m.device || "–")} ${esc(m.dtype || "")}</td><td>${m.max_rows}×${m.max_tokens}</td>` +
        `<td>${num(rate((h) => h.tokens[p.provider + "/" + name]), 0)}</td><td>${v(`local.${name}.batches`, m.batches)}</td>` +
        `<td>${num(100 * m.padding_share, 1)}%</td><td>${p.oom_splits}</td></tr>`);
    }
  }
  body("local", table(["model", "status", "device", "budget rows×tokens", "tokens/s", "batches", "padding", "OOM splits"], rows));
}

function statePanel(s) {
  const st = s.state, store = s.store;
  const deg = Object.entries(st.degraded || {}).map(([k, n]) => `${esc(k)} ${n}`).join(", ");
  const rows = [`<tr><td>shared state</td><td class="l">${esc(st.mode)}</td><td>${st.reachable ? status("up") : status("failing")}</td><td>${v("state.replicas", st.replicas)}</td><td class="err">${esc(st.error || "")}${deg ? " local decisions: " + deg : ""}</td></tr>`];
  if (store) rows.push(`<tr><td>job store</td><td class="l">${esc(store.mode)}</td><td>${store.reachable ? status("up") : status("failing")}</td><td></td><td class="err">${esc(store.error || "")}</td></tr>`);
  body("state", table(["part", "mode", "reachable", "replicas", ""], rows));
}

function spendPanel(m) {
  const usd = (x) => "$" + num(x, 6);
  const how = Object.entries(m.saved_by || {}).map(([k, x]) => `${esc(k)} ${usd(x)}`).join(", ");
  const share = (x) => x == null ? "-" : num(100 * x, 1) + "%";
  const rows = m.routes.map((r) => `<tr><td>${esc(r.route)}</td><td>${v(`spend.${r.route}.cost`, usd(r.cost_usd))}</td>` +
    `<td>${usd(r.saved_usd)}</td><td>${r.unknown_cost_calls}</td>` +
    `<td>${v(`spend.${r.route}.cache_read`, share(r.cache_read_share))}</td></tr>`);
  const st = m.stored || {days: [], keys: []};
  const keys = st.keys.map((k) => `<tr><td>${keyLabel(k.key, k.key_name)}</td><td>${v(`spend.key.${k.key ?? ""}.cost`, usd(k.cost_usd))}</td>` +
    `<td>${usd(k.saved_usd)}</td><td>${k.calls}</td></tr>`);
  body("spend", `<div>${v("spend.cost", usd(m.cost_usd))} spent · ${v("spend.saved", usd(m.saved_usd))} saved` +
    `${how ? " (" + how + ")" : ""} · ${m.unknown_cost_calls} calls of unknown cost (since start)</div>` +
    (rows.length ? table(["route", "cost", "saved", "unknown cost", "cache read"], rows) : empty("no calls answered yet")) +
    `<div class="dim">by day, from ${esc(st.since || "")} (written spend)</div>` + dayBars(st.days, usd) +
    `<div class="dim">by key, ${esc(st.month || "")}</div>` +
    (keys.length ? table(["key", "cost", "saved", "calls"], keys) : empty("nothing written this month yet")));
}
// a key by its name, its id beside it where the two differ (a config key's name is its id)
function keyLabel(id, name) {
  if (id == null) return "(no key)";
  return name && name !== id ? `${esc(name)} <span class="dim">${esc(id)}</span>` : esc(id);
}
function dayBars(days, usd) {
  if (!days.length) return empty("nothing written yet");
  const max = Math.max(...days.map((d) => d.cost_usd + d.saved_usd), 1e-12), w = 22;
  const bars = days.map((d, i) => {
    const hc = Math.round(26 * d.cost_usd / max), hs = Math.round(26 * d.saved_usd / max);
    return `<rect x="${i * w}" y="${28 - hc}" width="${w - 4}" height="${hc}"><title>${esc(d.day)}: ${usd(d.cost_usd)} spent</title></rect>` +
      `<rect class="saved" x="${i * w}" y="${28 - hc - hs}" width="${w - 4}" height="${hs}"><title>${esc(d.day)}: ${usd(d.saved_usd)} saved</title></rect>` +
      `<text x="${i * w}" y="38">${esc(d.day.slice(8))}</text>`;
  }).join("");
  return `<svg class="hist" width="${days.length * w}" height="40" data-v="spend.days">${bars}</svg>`;
}

function ownSpendPanel(m) {
  const usd = (x) => "$" + num(x, 6);
  const line = (label, t, k) => `<div>${label}: ${v(`spend.own.${k}.cost`, usd(t.cost_usd))} spent · ` +
    `${v(`spend.own.${k}.saved`, usd(t.saved_usd))} saved · ${v(`spend.own.${k}.calls`, t.calls)} calls` +
    `${t.unknown_cost_calls ? ` · <span class="warn">${t.unknown_cost_calls} of unknown cost</span>` : ""}</div>`;
  const caps = m.budgets.map((b) => `<tr><td class="l">${esc(b.period)}</td><td class="l">${useBar(b.spent_usd, b.budget_usd)}</td>` +
    `<td>${v(`spend.own.budget.${b.period}`, usd(b.spent_usd))}<span class="dim"> of $${esc(b.budget_usd)}</span></td>` +
    `<td>${b.used == null ? "–" : num(100 * b.used, 1) + "%"}</td>` +
    `<td class="dim">${b.reset_at ? "resets " + new Date(b.reset_at * 1000).toLocaleString() : "never resets"}</td></tr>`);
  const rows = m.routes.map((r) => `<tr><td>${esc(r.route)}</td><td class="l">${esc(r.model || "–")}</td>` +
    `<td>${usd(r.today.cost_usd)}</td><td>${usd(r.this_month.cost_usd)}</td><td>${usd(r.this_month.saved_usd)}</td>` +
    `<td>${r.this_month.calls}</td><td>${r.this_month.unknown_cost_calls}</td></tr>`);
  body("spend", line(`today ${esc(m.day)}`, m.today, "today") + line(`month ${esc(m.month)}`, m.this_month, "month") +
    (caps.length ? table(["budget", "use", "spent", "share", ""], caps) : "") +
    (rows.length ? table(["route", "model", "today", "month", "saved (month)", "calls", "unknown cost"], rows)
                 : empty("no priced calls this month")));
}

function breakersPanel(b) {
  const st = (x) => x === "closed" ? `<span class="ok">closed</span>` : x === "open" ? `<span class="bad">open</span>` : `<span class="warn">${esc(x)}</span>`;
  const rows = Object.entries(b.breakers).map(([e, x]) => `<tr><td>${esc(e)}</td><td>${st(x)}</td></tr>`);
  const fb = b.fallbacks.map((f) => `<tr><td>${esc(f.from)} → ${esc(f.to)}</td><td class="l">${esc(f.reason)}</td><td>${f.calls}</td></tr>`);
  body("breakers", (rows.length ? table(["endpoint", "breaker"], rows) : empty("no breaker has seen a call yet")) +
    `<h3>fallbacks taken</h3>` + (fb.length ? table(["from → to", "reason", "calls"], fb) : empty("none yet")));
}

function cachePanel(c) {
  const rows = c.routes.map((r) => `<tr><td>${esc(r.route)}</td><td>${v(`cache.${r.route}.rate`, num(100 * r.hit_rate, 1) + "%")}</td>` +
    `<td>${r.hits}</td><td>${r.lookups}</td><td>$${num(r.saved_usd, 6)}</td><td>${v(`cache.${r.route}.entries`, r.entries)}</td>` +
    `<td>${r.wrong_hits ? `<span class="warn">${r.wrong_hits}</span>` : 0}</td></tr>`);
  body("cache", rows.length ? table(["route", "hit rate", "hits", "lookups", "saved", "index size", "wrong hits"], rows)
                            : empty("no cached route has been called yet"));
}

function render(s) {
  remember(s);
  const p = s.panels, admin = s.view === "admin";
  document.body.dataset.tick = s.tick;
  const who = s.key_name && s.key_name !== s.identity ? `${s.key_name} (${s.identity})` : s.identity;
  $("#who").textContent = (admin ? "admin" : "key " + who) + " · v" + s.version;
  for (const name of ["routes", "limits", "mcp", "local", "state", "breakers", "cache", "spend", "jobs"]) show(name, name in p);
  $("#kpis").hidden = !p.routes;
  document.querySelectorAll(".charts").forEach((el) => { if (el.parentElement === $("#main")) el.hidden = !p.routes; });
  $("#panel-spend").classList.toggle("span2", !admin);  // a key's own: by route and model, wider
  const renderers = {routes: routesPanel, limits: limitsPanel, jobs: (j) => jobsPanel(j, admin), mcp: mcpPanel,
                     local: localPanel, state: statePanel, spend: admin ? spendPanel : ownSpendPanel,
                     breakers: breakersPanel, cache: cachePanel};
  for (const [name, panel] of Object.entries(p)) {
    if (panel.error) body(name, `<div class="err">this panel failed: ${esc(panel.error)}</div>`);
    else if (panel.configured === false) body(name, empty(panel.detail));
    else if (renderers[name]) renderers[name](panel);
  }
  if (p.routes && !p.routes.error) { kpis(p); drawCharts(); }
  $("#status").textContent = "live · " + new Date(s.at * 1000).toLocaleTimeString();
}

window.addEventListener("resize", () => {
  for (const [c, el] of [[rateChart, "#chart-rate"], [queueChart, "#chart-queue"]]) if (c) c.setSize({width: $(el).clientWidth, height: 150});
});
takeFragmentKey();
connect();
