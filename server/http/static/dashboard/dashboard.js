// mlx-lane dashboard: polls /stats, fills every [data-stat] element, charts the last minutes with uPlot.
// No build step, no dependencies beyond the vendored uPlot. Each element shows one /stats value; its raw value is
// kept in data-value so tests can compare the page with /stats exactly.
"use strict";

(function () {
  const KEY_STORE = "mlx-lane-api-key";
  const WINDOW_S = 300; // chart history: the last 5 minutes
  const params = new URLSearchParams(location.search);
  const intervalMs = Math.max(250, 1000 * (parseFloat(params.get("interval")) || 1));
  const COLORS = { a: "#e4572e", b: "#2e86ab", c: "#7a9e0f" };

  const state = { charts: {}, polls: 0, last: null, series: { t: [], tok: [], ttft: [], wait: [], run: [], queue: [] } };
  window.mlxLaneDashboard = state; // read by the browser tests

  const $ = (id) => document.getElementById(id);

  function get(obj, path) {
    return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
  }

  function fmt(v, kind) {
    if (v === undefined || v === null) return "-";
    switch (kind) {
      case "int": return Math.round(v).toLocaleString("en-US");
      case "num": return (+v).toFixed(2);
      case "pct": return (100 * v).toFixed(1) + "%";
      case "s": return v < 1 ? (1000 * v).toFixed(0) + " ms" : (+v).toFixed(2) + " s";
      case "bytes": {
        const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0; let x = +v;
        while (x >= 1024 && i < u.length - 1) { x /= 1024; i++; }
        return (i ? x.toFixed(1) : x.toFixed(0)) + " " + u[i];
      }
      case "duration": {
        const s = Math.floor(v); const h = Math.floor(s / 3600); const m = Math.floor((s % 3600) / 60);
        return h ? h + "h " + m + "m" : m ? m + "m " + (s % 60) + "s" : s + "s";
      }
      case "onoff": return v ? "on" : "off";
      case "short": return String(v).split(" (")[0]; // "OpenBLAS (preloaded: /usr/lib/...)" -> "OpenBLAS"
      default: return String(v);
    }
  }

  function fill(stats) {
    for (const el of document.querySelectorAll("[data-stat]")) {
      const v = get(stats, el.dataset.stat);
      el.dataset.value = JSON.stringify(v === undefined ? null : v);
      el.textContent = fmt(v, el.dataset.fmt);
      if (el.dataset.fmt === "short") el.title = String(v);
    }
    for (const el of document.querySelectorAll("[data-meter]")) {
      const [num, den] = el.dataset.meter.split("/");
      const d = get(stats, den);
      el.value = d ? Math.min(1, (get(stats, num) || 0) / d) : 0;
    }
    const ssdOn = !!get(stats, "ssd_cache.enabled");
    document.querySelector("table.ssd").hidden = !ssdOn;
    document.querySelector("table.spec").hidden = !get(stats, "speculative.enabled");
    const cost = get(stats, "ssd_cache.cost_model");
    $("cost-reason").textContent = ssdOn && cost
      ? `restore when reading the KV (${cost.read_mb_s} MB/s${cost.read_measured ? ", measured" : ", prior"}) beats ` +
        `recomputing it (${cost.prefill_tok_s} tok/s${cost.prefill_measured ? ", measured" : ", prior"}); mode ${cost.mode}`
      : "";
    fillModels(get(stats, "models") || {});
    const byStatus = get(stats, "http.by_status") || {};
    const errs = Object.entries(byStatus).filter(([code]) => +code >= 400);
    $("errors").textContent = errs.length ? errs.map(([c, n]) => `${c}: ${n}`).join(", ") : "none";
    $("errors").dataset.value = JSON.stringify(Object.fromEntries(errs));
  }

  function fillModels(models) {
    // the on-demand models (--model NAME=PATH, --models-dir); names are text, never markup
    const names = Object.keys(models);
    for (const el of document.querySelectorAll(".models")) el.hidden = !names.length;
    const rows = names.map((name) => {
      const m = models[name];
      const cells = [name, m.state + (m.pinned ? " (pinned)" : ""), fmt(m.bytes, "bytes"), fmt(m.loads, "int"),
        fmt(m.requests, "int"), fmt(m.cached_tokens, "int"), m.idle_s == null ? "-" : fmt(m.idle_s, "num")];
      const tr = document.createElement("tr");
      tr.dataset.model = name;
      tr.dataset.state = m.state;
      for (const c of cells) {
        const td = document.createElement("td");
        td.textContent = c;
        tr.appendChild(td);
      }
      return tr;
    });
    $("models").replaceChildren(...rows);
  }

  function rate(now, prev, path) {
    if (!prev) return null;
    const dt = get(now, "lane.uptime_s") - get(prev, "lane.uptime_s");
    return dt > 0 ? (get(now, path) - get(prev, path)) / dt : null;
  }

  function record(stats) {
    const s = state.series;
    const prev = state.last;
    const served = (x) => get(x, "lane.requests_served") + get(x, "lane.requests_failed");
    const reqRate = prev ? (served(stats) - served(prev)) / Math.max(1e-6, get(stats, "lane.uptime_s") - get(prev, "lane.uptime_s")) : null;
    $("req-rate").textContent = reqRate === null ? "-" : reqRate.toFixed(2);
    s.t.push(Date.now() / 1000);
    s.tok.push(rate(stats, prev, "lane.completion_tokens"));
    s.ttft.push(get(stats, "lane.ttft_s.last"));
    s.wait.push(get(stats, "lane.queue_wait_s.last"));
    s.run.push(get(stats, "lane.running"));
    s.queue.push(get(stats, "lane.queue_depth"));
    const cut = s.t[s.t.length - 1] - WINDOW_S;
    while (s.t.length && s.t[0] < cut) for (const k in s) s[k].shift();
    state.last = stats;
  }

  function makeChart(el, labels) {
    const opts = {
      width: Math.max(240, el.clientWidth || 320), height: 160,
      legend: { show: true, live: false }, cursor: { drag: { x: false, y: false } },
      scales: { x: { time: true }, y: { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } },
      series: [{}, ...labels.map(([label, color]) => ({ label, stroke: color, width: 2, spanGaps: true, points: { show: true, size: 4, fill: color } }))],
      axes: [{}, { size: 50 }],
    };
    return new uPlot(opts, [[], ...labels.map(() => [])], el);
  }

  function draw() {
    const s = state.series;
    if (!state.charts.tokens) {
      state.charts.tokens = makeChart($("chart-tokens"), [["tok/s", COLORS.a]]);
      state.charts.latency = makeChart($("chart-latency"), [["TTFT", COLORS.a], ["queue wait", COLORS.b]]);
      state.charts.lane = makeChart($("chart-lane"), [["running", COLORS.a], ["queued", COLORS.c]]);
    }
    state.charts.tokens.setData([s.t, s.tok]);
    state.charts.latency.setData([s.t, s.ttft, s.wait]);
    state.charts.lane.setData([s.t, s.run, s.queue]);
  }

  function setConn(kind, text) {
    const el = $("conn");
    el.dataset.state = kind;
    el.textContent = text;
  }

  function lock(message) {
    sessionStorage.removeItem(KEY_STORE);
    $("dashboard").hidden = true;
    $("lock").hidden = false;
    $("lock-error").hidden = !message;
    $("lock-error").textContent = message || "";
    setConn("locked", "locked");
    $("lock-key").focus();
  }

  let timer = null;

  async function poll() {
    timer = null;
    if (document.hidden) return; // visibilitychange restarts it: a background tab costs the server nothing
    const key = sessionStorage.getItem(KEY_STORE);
    const headers = key ? { Authorization: "Bearer " + key } : {};
    try {
      const r = await fetch("/stats", { headers, cache: "no-store", signal: AbortSignal.timeout(10000) });
      if (r.status === 401) { lock(key ? "That key was not accepted." : ""); return; }
      if (!r.ok) throw new Error("HTTP " + r.status);
      const stats = await r.json();
      $("lock").hidden = true;
      $("dashboard").hidden = false;
      fill(stats);
      record(stats);
      draw();
      state.polls++;
      setConn("ok", "live");
    } catch (e) {
      setConn("down", "unreachable");
    }
    schedule();
  }

  function schedule() {
    if (timer === null) timer = setTimeout(poll, intervalMs);
  }

  async function start() {
    $("interval").textContent = intervalMs / 1000;
    $("lock-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY_STORE, $("lock-key").value);
      $("lock-key").value = "";
      if (timer !== null) { clearTimeout(timer); timer = null; }
      poll();
    });
    window.addEventListener("resize", () => {
      for (const u of Object.values(state.charts)) u.setSize({ width: Math.max(240, u.root.parentNode.clientWidth), height: 160 });
    });
    document.addEventListener("visibilitychange", () => { if (!document.hidden && timer === null) poll(); });
    try {
      const health = await (await fetch("/health", { cache: "no-store" })).json();
      if (health.api_key_required && !sessionStorage.getItem(KEY_STORE)) { lock(""); return; }
    } catch (e) {
      setConn("down", "unreachable");
    }
    poll();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
