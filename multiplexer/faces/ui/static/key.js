// What the dashboard's pages share: the key (session storage; a #key=... fragment, never sent to
// the server, is taken once), element lookup and HTML escaping. Loaded before each page's script.
"use strict";

const KEY = "multiplexer.key";
const $ = (sel) => document.querySelector(sel);
const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));

function takeFragmentKey() {
  const m = location.hash.match(/^#key=(.+)$/);
  if (m) {
    sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
    window.history.replaceState(null, "", location.pathname + location.search);
  }
}
