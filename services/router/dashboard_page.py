"""The page GET /dashboard serves: one HTML document with its CSS and JS inline (nothing fetched but
/dashboard/data, so it works offline). A Python string, not package data: it ships in the wheel with
the router package, and the build config (and with it `make serve`'s install stamp) stays as it is.

Every tile carries data-tile (key), data-value (raw number, empty without data), data-status (ok,
breach, no_data, info), data-threshold, data-op and data-count; <body> carries data-polls (answers so
far) and data-window (the seconds the latest answer's percentiles and rates cover).
"""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>pdserve SLA dashboard</title>
<style>
  :root { --ok: #1a7f37; --breach: #cf222e; --none: #8c959f; --info: #0969da; --bg: #f6f8fa; --fg: #1f2328; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; background: var(--bg);
         color: var(--fg); }
  header { padding: 14px 24px 10px; background: #fff; border-bottom: 1px solid #d0d7de; }
  h1 { margin: 0; font-size: 20px; }
  h1 small { font-weight: normal; color: #57606a; font-size: 14px; margin-left: 8px; }
  #meta { color: #57606a; margin-top: 4px; }
  #banner { display: none; margin-top: 8px; padding: 6px 10px; border-radius: 6px; background: #ffebe9;
            color: var(--breach); }
  body.stale #banner { display: block; }
  body.stale main { opacity: 0.55; }
  main { padding: 6px 24px 24px; }
  h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .06em; color: #57606a; margin: 16px 0 8px; }
  .grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(190px, 1fr)); gap: 10px; }
  .tile { background: #fff; border: 1px solid #d0d7de; border-left: 6px solid var(--none); border-radius: 8px;
          padding: 10px 12px; min-height: 96px; }
  .tile[data-status="ok"] { border-left-color: var(--ok); }
  .tile[data-status="breach"] { border-left-color: var(--breach); background: #fff8f7; }
  .tile[data-status="info"] { border-left-color: var(--info); }
  .head { display: flex; justify-content: space-between; align-items: center; gap: 6px; }
  .label { font-weight: 600; }
  .badge { font-size: 11px; font-weight: 700; padding: 1px 7px; border-radius: 10px; color: #fff;
           background: var(--none); white-space: nowrap; }
  .tile[data-status="ok"] .badge { background: var(--ok); }
  .tile[data-status="breach"] .badge { background: var(--breach); }
  .tile[data-status="info"] .badge { background: var(--info); }
  .value { font-size: 28px; font-weight: 650; margin: 4px 0 2px; font-variant-numeric: tabular-nums; }
  .tile[data-status="no_data"] .value { color: var(--none); }
  .limit, .detail, .note { color: #57606a; font-size: 12px; }
  .note { margin-top: 4px; font-style: italic; }
  footer { padding: 0 24px 20px; color: #57606a; font-size: 12px; }
</style>
</head>
<body data-polls="0">
<header>
  <h1>pdserve <small>SLA dashboard</small></h1>
  <div id="meta">waiting for the router ...</div>
  <div id="banner"></div>
</header>
<main id="sections"></main>
<footer id="legend"></footer>
<script>
"use strict";
const SECTIONS = [
  ["Latency", ["ttft_", "tpot_", "e2e_"]],
  ["Traffic and SLOs", ["output_tokens", "request_rate", "error_rate", "fallback_rate", "slo_attainment"]],
  ["Queues, KV cache and health", ["queue_depth:", "kv_usage:", "health:"]],
];
const BADGE = { ok: "OK", breach: "BREACH", no_data: "NO DATA", info: "RATE" };
const OPS = { "<=": "\u2264", "<": "<", ">=": "\u2265" };
const DATA_URL = location.pathname.replace(/\/+$/, "") + "/data";
let polls = 0, lastOk = null, refreshMs = 1000;

function fmt(value, unit) {
  if (value === null || value === undefined) return "\u2013";
  if (unit === "s") return value < 1 ? (value * 1000).toFixed(value < 0.01 ? 1 : 0) + " ms" : value.toFixed(2) + " s";
  if (unit === "ratio") return (value * 100).toFixed(1) + " %";
  if (unit === "per_s") return value.toFixed(value < 10 ? 2 : 1) + " /s";
  return String(Math.round(value));
}

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function tileNode(t) {
  const node = el("div", "tile");
  node.dataset.tile = t.key;
  node.dataset.value = t.value === null ? "" : String(t.value);
  node.dataset.status = t.status;
  node.dataset.threshold = t.threshold === null ? "" : String(t.threshold);
  node.dataset.op = t.op;
  node.dataset.count = t.count === null ? "" : String(t.count);
  const head = el("div", "head");
  head.append(el("span", "label", t.label), el("span", "badge", BADGE[t.status] || t.status));
  node.append(head, el("div", "value", fmt(t.value, t.unit)));
  let limit = t.threshold === null ? "no threshold" : "SLA " + OPS[t.op] + " " + fmt(t.threshold, t.unit);
  const n = t.count === null ? null : Math.round(t.count);
  if (n !== null && t.count_of) limit += " \u00b7 " + n + " " + (n === 1 ? t.count_of.replace(/s$/, "") : t.count_of);
  node.append(el("div", "limit", limit));
  const parts = Object.entries(t.detail || {}).map(([k, v]) => k.slice(0, 10) + ": " + fmt(v, t.unit));
  if (parts.length) node.append(el("div", "detail", parts.join(" \u00b7 ")));
  if (t.note) node.append(el("div", "note", t.note));
  return node;
}

function render(data) {
  const main = document.getElementById("sections");
  const used = new Set();
  const blocks = SECTIONS.map(([title, prefixes]) => {
    const grid = el("div", "grid");
    for (const t of data.tiles) {
      if (!used.has(t.key) && prefixes.some((p) => t.key.startsWith(p))) { grid.append(tileNode(t)); used.add(t.key); }
    }
    const section = el("section");
    section.append(el("h2", "", title), grid);
    return section;
  });
  main.replaceChildren(...blocks);
  const w = data.window;
  document.body.dataset.window = String(w.seconds);
  const span = w.seconds > 0 ? "the last " + w.seconds.toFixed(0) + " s (up to " + w.max_seconds + " s)" : "none yet";
  document.getElementById("meta").textContent = data.model + " \u00b7 " + data.mode + " \u00b7 percentiles and rates over "
    + span + " \u00b7 SLO attainment over " + w.slo_window_s + " s \u00b7 updated "
    + new Date(data.generated_at * 1000).toLocaleTimeString();
  document.getElementById("legend").textContent = "Latency percentiles and rates: increase of the router's histograms "
    + "and counters since the oldest reading it kept within the window (one a second while this page polls). "
    + "Queue depth, KV usage and live replicas: now (worker snapshots refreshed every few seconds). "
    + "OK / BREACH against the router's SLA thresholds; NO DATA when nothing was measured; RATE: no threshold.";
}

async function poll() {
  try {
    const resp = await fetch(DATA_URL, { cache: "no-store" });
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const data = await resp.json();
    render(data);
    refreshMs = Math.max(500, 1000 * (data.refresh_s || 1));
    lastOk = new Date();
    document.body.dataset.polls = String(++polls);
    document.body.classList.remove("stale");
  } catch (err) {
    document.body.classList.add("stale");
    document.getElementById("banner").textContent = "router unreachable (" + err.message + ")"
      + (lastOk ? "; tiles show its answer of " + lastOk.toLocaleTimeString() : "");
  }
  setTimeout(poll, refreshMs);
}
poll();
</script>
</body>
</html>
"""
