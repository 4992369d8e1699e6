// The request log: /ui/api/requests filtered and paged, one call's path drawn as a timeline.
// The key is the dashboard's (session storage), sent as a bearer header. No framework, no build.
"use strict";

let cursor = null;

function showLogin(message) {
  $("#main").hidden = true; $("#login").hidden = false;
  $("#login-error").textContent = message || "";
}
async function api(path) {
  const key = sessionStorage.getItem(KEY);
  const r = await fetch(path, {headers: {authorization: "Bearer " + key}, cache: "no-store"});
  let body = null;
  try { body = await r.json(); } catch (_) { /* the status says enough */ }
  if (r.status === 401) { sessionStorage.removeItem(KEY); showLogin(body?.error?.message || "refused"); return null; }
  if (!r.ok) { $("#problem").textContent = body?.error?.message || ("HTTP " + r.status); return null; }
  $("#problem").textContent = "";
  return body;
}
function query() {
  const params = new URLSearchParams();
  for (const el of $("#filters").elements) {
    if (el.name && el.value.trim()) params.set(el.name, el.value.trim());
  }
  return params;
}
const when = (at) => new Date(at * 1000).toISOString().replace("T", " ").slice(0, 23);
const dollars = (nano) => nano == null ? "–" : (nano / 1e9).toFixed(6);

function row(r) {
  const tr = document.createElement("tr");
  tr.dataset.id = r.id;
  tr.innerHTML = `<td>${esc(when(r.at))}</td><td>${esc(r.key ?? "–")}</td><td>${esc(r.route)}</td>
    <td>${esc(r.model ?? "–")}</td><td class="${r.status === "ok" ? "" : "bad"}" data-status>${esc(r.status === "ok" ? "ok" : r.code)}</td>
    <td>${esc(r.attempts)}${r.fallbacks ? " (" + esc(r.fallbacks) + " fell back)" : ""}</td>
    <td>${esc(r.input_tokens ?? "–")}/${esc(r.output_tokens ?? "–")}</td><td>${esc(dollars(r.cost))}</td>
    <td>${esc(Number(r.latency_ms).toFixed(2))}</td>`;
  tr.addEventListener("click", () => show(r.id, tr));
  return tr;
}
async function search(more) {
  const params = query();
  if (more && cursor) params.set("cursor", cursor);
  const body = await api("/ui/api/requests?" + params);
  if (body === null) return;
  const tbody = $("#rows tbody");
  if (!more) tbody.replaceChildren();
  for (const r of body.requests) tbody.append(row(r));
  cursor = body.next_cursor;
  $("#more").hidden = !cursor;
  // a page whose filters no one index holds stops after a bounded read: say how far it looked
  $("#more").textContent = body.searched_to == null ? "more"
    : `searched back to ${when(body.searched_to)}: search further`;
  $("#main").dataset.loaded = String(tbody.children.length);
}

function timeline(path) {
  const svg = $("#timeline");
  const events = path.timeline || [];
  const end = Math.max(...events.map((e) => e.at_ms), 0.001);
  const x = (ms) => 10 + (ms / end) * 560;
  const failed = events.some((e) => e.event === "failed");
  let out = `<rect class="${failed ? "fail" : "bar"}" x="10" y="22" width="${x(end) - 10}" height="8"></rect>`;
  events.forEach((e, i) => {
    out += `<circle cx="${x(e.at_ms)}" cy="26" r="5" class="${failed && e.event === "failed" ? "fail" : "bar"}"></circle>`;
    out += `<text x="${x(e.at_ms)}" y="${i % 2 ? 52 : 14}" text-anchor="middle" data-event="${esc(e.event)}">${esc(e.event)} ${esc(e.at_ms.toFixed(2))} ms</text>`;
  });
  svg.innerHTML = out;
}
async function show(id, tr) {
  const r = await api("/ui/api/requests/" + encodeURIComponent(id));
  if (r === null) return;
  for (const el of document.querySelectorAll("#rows tr.picked")) el.classList.remove("picked");
  if (tr) tr.classList.add("picked");
  $("#detail").hidden = false;
  $("#detail-id").textContent = String(r.id);
  const p = r.path || {};
  timeline(p);
  const attempts = (p.attempts || []).map((a) => `${esc(a.route)}: ${esc(a.outcome)}`).join(" → ") || "none";
  const fields = [
    ["request id", r.request_id], ["key", r.key], ["team", r.team], ["face", r.face],
    ["asked", `${r.method} (model ${r.model_asked ?? "–"})`], ["served", `${r.route} (model ${r.model ?? "–"})`],
    ["admission", p.admission ? `mode ${p.admission.mode ?? "–"}${p.admission.group ? ", group " + p.admission.group : ""}${p.admission.refused != null ? ", refused " + p.admission.refused : ""}` : "–"],
    ["lane", p.lane ?? "–"], ["batch", p.batch ? `${p.batch.shared ? "shared: " + p.batch.shared : "own execution"}${p.batch.share != null ? ", share " + p.batch.share.toFixed(3) : ""}` : "–"],
    ["attempts", attempts], ["error", r.error ?? "–"],
    ["tokens", `in ${r.input_tokens ?? "–"} (cached ${r.cached_tokens ?? "–"}), out ${r.output_tokens ?? "–"}`],
    ["cost / saved $", `${dollars(r.cost)} / ${dollars(r.saved)}`],
    ["latency", `${Number(r.latency_ms).toFixed(2)} ms${r.first_chunk_ms != null ? ", first chunk " + r.first_chunk_ms.toFixed(2) + " ms" : ""}`],
  ];
  $("#detail-body").innerHTML = "<dl>" + fields.map(([k, v]) => `<dt>${esc(k)}</dt><dd data-field="${esc(k)}">${esc(v ?? "–")}</dd>`).join("") + "</dl>";
}

$("#login").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = $("#key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY, key);
  $("#key").value = "";
  start();
});
$("#filters").addEventListener("submit", (e) => { e.preventDefault(); search(false); });
$("#more").addEventListener("click", () => search(true));

async function start() {
  if (!sessionStorage.getItem(KEY)) { showLogin(); return; }
  $("#login").hidden = true; $("#main").hidden = false;
  await search(false);
}
takeFragmentKey();
start();
