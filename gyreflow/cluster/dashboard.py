"""The gyreflow page of the Dask dashboard, and the pools' Prometheus metrics.

:class:`~gyreflow.cluster.plugin.PoolsPlugin` calls :func:`register` when it starts in a scheduler
and :func:`unregister` when it closes. :func:`register` adds, on the dashboard's own port:

``/gyreflow``
    A self-contained page (inline script and SVG, nothing fetched from elsewhere) that polls
    ``state.json`` every second: cells by role over time, live executions per rollout cell, queued
    training work, moves and migrations with the latest moves, placement mode, idle cell-seconds.
    It is listed in the dashboard's "More..." menu and links back to ``/status``.
``/gyreflow/state.json``
    ``PoolsPlugin.status()`` (:class:`~gyreflow.cluster.status.PoolsStatus`) as JSON; ``?since=T``
    keeps only the history samples after time ``T`` (plugin clock).
``/metrics``
    Dask's own endpoint; the ``gyreflow_*`` metrics of :mod:`gyreflow.cluster.metrics` join it.

Nothing here may break the scheduler: without bokeh there is no menu entry, without
``prometheus_client`` no metrics, and any failure is logged and ignored.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import weakref

log = logging.getLogger(__name__)

PAGE = "gyreflow"
"""Path of the page, under the dashboard's prefix."""

_lock = threading.Lock()
_plugins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""scheduler -> the PoolsPlugin its pages show."""
_served: weakref.WeakSet = weakref.WeakSet()
"""Schedulers whose HTTP application has the gyreflow handlers (they cannot be removed)."""


# ---------------------------------------------------------------------- public


def register(scheduler, plugin) -> None:
    """Serve ``plugin``'s page and metrics from ``scheduler``'s dashboard.

    Registering again (or a new plugin for the same scheduler) is harmless: the handlers are added
    once per scheduler and always show the plugin registered last.

    Parameters
    ----------
    scheduler
        The ``distributed.Scheduler`` the plugin started in.
    plugin
        The :class:`~gyreflow.cluster.plugin.PoolsPlugin`.
    """
    if scheduler is None:
        return
    with _lock:
        _plugins[scheduler] = plugin
        fresh = scheduler not in _served
        if fresh:
            _served.add(scheduler)
    if fresh:
        try:
            _add_handlers(scheduler)
        except Exception:
            log.warning("gyreflow dashboard page not added", exc_info=True)
        try:
            _add_menu_entry(scheduler)
        except Exception:
            log.debug("gyreflow page not added to the dashboard menu", exc_info=True)
    try:
        from gyreflow.cluster import metrics
    except ImportError:  # prometheus_client is optional
        return
    try:
        metrics.register(scheduler, plugin)
    except Exception:
        log.warning("gyreflow metrics not registered", exc_info=True)


def unregister(scheduler, plugin) -> None:
    """Stop showing ``plugin``: its page answers "not running", its metrics leave ``/metrics``.

    Parameters
    ----------
    scheduler
        The scheduler given to :func:`register` (``None`` does nothing).
    plugin
        The plugin given to :func:`register`; nothing happens if another one replaced it since.
    """
    if scheduler is None:
        return
    with _lock:
        if _plugins.get(scheduler) is plugin:
            del _plugins[scheduler]
    try:
        from gyreflow.cluster import metrics
    except ImportError:
        return
    try:
        metrics.unregister(scheduler, plugin)
    except Exception:
        log.warning("gyreflow metrics not unregistered", exc_info=True)


def dashboard_link(client) -> str | None:
    """The URL of the gyreflow page for ``client``'s cluster, or ``None`` without a dashboard.

    Parameters
    ----------
    client
        A ``distributed.Client``.
    """
    try:
        link = client.dashboard_link
    except Exception:
        return None
    if not link:
        return None
    head, sep, query = str(link).partition("?")
    head = re.sub(r"/status$", "", head.rstrip("/"))
    return f"{head}/{PAGE}{sep}{query}"


def running(scheduler, plugin) -> bool:
    """Whether ``plugin`` is still one of ``scheduler``'s plugins and has not been closed.

    ``Client.unregister_scheduler_plugin`` removes a plugin without closing it, so both count.
    """
    if getattr(plugin, "_closing", False) or getattr(plugin, "scheduler", None) is None:
        return False
    return any(p is plugin for p in list(getattr(scheduler, "plugins", {}).values()))


def state(scheduler, since: float | None = None) -> dict:
    """What ``/gyreflow/state.json`` serves for ``scheduler``.

    Parameters
    ----------
    scheduler
        A scheduler given to :func:`register`.
    since
        Only the history samples after this time (plugin clock seconds).

    Raises
    ------
    LookupError
        No running plugin is registered for ``scheduler``.
    """
    plugin = _plugins.get(scheduler)
    if plugin is None or not running(scheduler, plugin):
        raise LookupError("the gyreflow pools plugin is not running in this scheduler")
    out = plugin.status().to_dict()
    if since is not None:
        out["history"] = [h for h in out["history"] if h.get("time", 0.0) > since]
    return out


# ---------------------------------------------------------------------- HTTP


def _json_default(obj):
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    return str(obj)


def _finite(obj):
    """JSON has no NaN or infinity: they become ``null``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _prefix(scheduler) -> str:
    """The dashboard's path prefix (``/`` unless the scheduler was started with one)."""
    app = scheduler.http_application
    for rule in getattr(app.default_router, "rules", []):
        router = getattr(rule, "target", None)
        for inner in getattr(router, "rules", []):
            pattern = getattr(getattr(inner.matcher, "regex", None), "pattern", "")
            m = re.fullmatch(r"(/.*?)(?:health|metrics)\$?", pattern)
            if m:
                return m.group(1)
    return "/"


def _handlers(scheduler) -> list:
    from tornado import web

    class PageHandler(web.RequestHandler):
        def get(self) -> None:
            self.set_header("Content-Type", "text/html; charset=utf-8")
            self.set_header("Cache-Control", "no-store")
            self.write(_PAGE_HTML)

    class StateHandler(web.RequestHandler):
        def get(self) -> None:
            self.set_header("Content-Type", "application/json")
            self.set_header("Cache-Control", "no-store")
            since = self.get_argument("since", None)
            try:
                body = state(scheduler, float(since) if since else None)
            except ValueError:
                self.set_status(400)
                body = {"error": f"since={since!r} is not a number"}
            except LookupError as err:
                self.set_status(503)
                body = {"error": str(err)}
            except Exception as err:  # the plugin is mid-change: say so, keep serving
                log.debug("gyreflow state failed", exc_info=True)
                self.set_status(500)
                body = {"error": f"{type(err).__name__}: {err}"}
            self.write(json.dumps(_finite(body), default=_json_default))

    prefix = _prefix(scheduler)
    base = prefix.rstrip("/") + "/" + PAGE
    return [(base + "/?", PageHandler), (base + r"/state\.json", StateHandler)]


def _add_handlers(scheduler) -> None:
    app = getattr(scheduler, "http_application", None)
    if app is None:
        log.info("the scheduler has no HTTP server: no gyreflow page")
        return
    # A weak reference in the handlers would be cleaner, but the application belongs to the
    # scheduler, so the cycle dies with it.
    app.add_handlers(r".*", _handlers(scheduler))


def _add_menu_entry(scheduler) -> None:
    """List the page in the "More..." menu of the Bokeh dashboard pages, if they are served."""
    app = getattr(scheduler, "http_application", None)
    if app is None or not any(type(a).__name__ == "DaskBokehTornado" for a in getattr(app, "applications", [])):
        return
    from distributed.dashboard.scheduler import template_variables

    # Memoized per scheduler: the very dict whose "plots" list the pages render.
    plots = template_variables(scheduler).get("plots")
    if isinstance(plots, list) and not any(p.get("url") == PAGE for p in plots):
        plots.append({"url": PAGE, "name": "Gyreflow Pools"})
        plots.sort(key=lambda d: d["name"])


# ---------------------------------------------------------------------- the page

_PAGE_HTML = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gyreflow pools</title>
<style>
  :root { --rollout: #2f6fb0; --trainer: #e07b22; --moves: #6a3d9a; --migr: #2a9d5b; --work: #c0392b;
          --fg: #222; --muted: #777; --grid: #e6e6e6; --bg: #fafafa; --card: #fff; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg); background: var(--bg); }
  header { display: flex; align-items: center; gap: 16px; padding: 10px 20px; background: #fff; border-bottom: 1px solid #ddd; }
  header h1 { font-size: 18px; margin: 0; font-weight: 600; }
  header a { color: var(--rollout); text-decoration: none; }
  header a:hover { text-decoration: underline; }
  header .status { margin-left: auto; color: var(--muted); font-size: 12px; }
  header .status.err { color: var(--work); }
  main { padding: 16px 20px; max-width: 1500px; margin: 0 auto; }
  .cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap: 10px; margin-bottom: 16px; }
  .card { background: var(--card); border: 1px solid #e2e2e2; border-radius: 6px; padding: 8px 12px; }
  .card .k { color: var(--muted); font-size: 12px; }
  .card .v { font-size: 22px; font-weight: 600; font-variant-numeric: tabular-nums; }
  .grid { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 14px; }
  .panel { background: var(--card); border: 1px solid #e2e2e2; border-radius: 6px; padding: 10px 12px; }
  .panel h2 { font-size: 14px; margin: 0 0 6px; font-weight: 600; }
  .panel .legend { font-size: 12px; color: var(--muted); margin-bottom: 4px; }
  .legend span { display: inline-block; margin-right: 12px; }
  .legend i { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 4px; vertical-align: -1px; }
  svg { display: block; width: 100%; height: 200px; }
  svg text { font-size: 11px; fill: var(--muted); }
  table { width: 100%; border-collapse: collapse; font-size: 12px; font-variant-numeric: tabular-nums; }
  th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #eee; white-space: nowrap; }
  td.reason { white-space: normal; }
  th { color: var(--muted); font-weight: 500; }
  .to-rollout { color: var(--rollout); font-weight: 600; }
  .to-trainer { color: var(--trainer); font-weight: 600; }
  .bad { color: var(--work); }
  .wide { grid-column: 1 / -1; }
  select { font: inherit; }
  .empty { color: var(--muted); padding: 20px 0; text-align: center; }
</style>
</head>
<body>
<header>
  <h1>gyreflow pools</h1>
  <a id="dask-link" href="status">&larr; Dask dashboard</a>
  <label>window
    <select id="window">
      <option value="120">2 min</option>
      <option value="600" selected>10 min</option>
      <option value="0">all</option>
    </select>
  </label>
  <span class="status" id="status">connecting&hellip;</span>
</header>
<main>
  <div class="cards" id="cards"></div>
  <div class="grid">
    <div class="panel">
      <h2>Cells by role</h2>
      <div class="legend"><span><i style="background:var(--rollout)"></i>rollout</span><span><i style="background:var(--trainer)"></i>trainer</span></div>
      <svg id="chart-cells"></svg>
    </div>
    <div class="panel">
      <h2>Live executions per rollout cell (now)</h2>
      <div class="legend"><span><i style="background:var(--rollout)"></i>live executions</span><span><i style="background:var(--trainer)"></i>cell is moving</span></div>
      <svg id="chart-sessions-now"></svg>
    </div>
    <div class="panel">
      <h2>Live executions (all rollout cells)</h2>
      <div class="legend"><span><i style="background:var(--rollout)"></i>live executions</span></div>
      <svg id="chart-sessions"></svg>
    </div>
    <div class="panel">
      <h2>Queued training work</h2>
      <div class="legend"><span><i style="background:var(--work)"></i>trainer tasks ready or running</span></div>
      <svg id="chart-work"></svg>
    </div>
    <div class="panel">
      <h2>Moves and migrations (cumulative)</h2>
      <div class="legend"><span><i style="background:var(--moves)"></i>cell moves</span><span><i style="background:var(--migr)"></i>migrated generations</span></div>
      <svg id="chart-moves"></svg>
    </div>
    <div class="panel">
      <h2>Latest moves</h2>
      <div style="max-height: 230px; overflow: auto;"><table id="moves"></table></div>
    </div>
  </div>
</main>
<script>
"use strict";
// Paths relative to this page, so that a dashboard prefix or a proxy in front keeps working.
const BASE = location.pathname.replace(/\/gyreflow\/?$/, "");
const STATE_URL = BASE + "/gyreflow/state.json";
document.getElementById("dask-link").href = BASE + "/status";

const COLORS = { rollout: "#2f6fb0", trainer: "#e07b22", moves: "#6a3d9a", migr: "#2a9d5b", work: "#c0392b" };
const MAX_SAMPLES = 20000;
let history = [];
let lastTime = null;

function esc(s) {
  return String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function fmtNum(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "\u2013";
  if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(1) + "M";
  if (Math.abs(x) >= 1e4) return (x / 1e3).toFixed(1) + "k";
  return digits === undefined ? String(Math.round(x * 100) / 100) : x.toFixed(digits);
}
function fmtBytes(b) {
  if (!b) return "0 B";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return b.toFixed(i ? 1 : 0) + " " + u[i];
}
function fmtSeconds(s) {
  if (s === null || s === undefined) return "\u2013";
  if (s < 1) return (s * 1000).toFixed(0) + " ms";
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}
function fmtClock(t) {
  return new Date(t * 1000).toLocaleTimeString([], {hour12: false});
}
function shortAddr(a) { return String(a).replace(/^[a-z]+:\/\//, ""); }

function niceStep(range, n) {
  const raw = range / Math.max(1, n);
  const p = Math.pow(10, Math.floor(Math.log10(raw)));
  const f = raw / p;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
}

function svgSize(svg) {
  const r = svg.getBoundingClientRect();
  return [Math.max(200, Math.round(r.width)), Math.max(100, Math.round(r.height))];
}

// A time-series chart: series = [{color, values: [[t, v], ...]}]; stacked areas or lines.
function timeChart(svg, series, opts) {
  opts = opts || {};
  const [W, H] = svgSize(svg);
  const m = {l: 44, r: 10, t: 8, b: 22};
  const w = W - m.l - m.r, h = H - m.t - m.b;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const all = series.flatMap(s => s.values);
  if (!all.length) { svg.innerHTML = `<text x="${W / 2}" y="${H / 2}" text-anchor="middle">no samples yet</text>`; return; }
  let t0 = Math.min(...all.map(p => p[0])), t1 = Math.max(...all.map(p => p[0]));
  if (t1 - t0 < 1) t1 = t0 + 1;
  let ymax;
  if (opts.stacked) {
    const n = series[0].values.length;
    ymax = 0;
    for (let i = 0; i < n; i++) ymax = Math.max(ymax, series.reduce((a, s) => a + (s.values[i] ? s.values[i][1] : 0), 0));
  } else {
    ymax = Math.max(...all.map(p => p[1]));
  }
  ymax = Math.max(opts.minMax || 1, ymax);
  const ystep = opts.integer ? Math.max(1, Math.ceil(niceStep(ymax, 4))) : niceStep(ymax, 4);
  ymax = Math.ceil(ymax / ystep) * ystep;
  const X = t => m.l + (t - t0) / (t1 - t0) * w;
  const Y = v => m.t + h - v / ymax * h;
  let out = "";
  for (let v = 0; v <= ymax + 1e-9; v += ystep) {
    out += `<line x1="${m.l}" x2="${m.l + w}" y1="${Y(v)}" y2="${Y(v)}" stroke="#e6e6e6"/>`;
    out += `<text x="${m.l - 6}" y="${Y(v) + 4}" text-anchor="end">${fmtNum(v)}</text>`;
  }
  const xstep = niceStep(t1 - t0, 5);
  for (let t = Math.ceil(t0 / xstep) * xstep; t <= t1; t += xstep) {
    out += `<line x1="${X(t)}" x2="${X(t)}" y1="${m.t + h}" y2="${m.t + h + 4}" stroke="#999"/>`;
    out += `<text x="${X(t)}" y="${H - 6}" text-anchor="middle">${fmtClock(t)}</text>`;
  }
  out += `<line x1="${m.l}" x2="${m.l + w}" y1="${m.t + h}" y2="${m.t + h}" stroke="#999"/>`;
  if (opts.stacked) {
    const n = series[0].values.length;
    const base = new Array(n).fill(0);
    for (const s of series) {
      const top = s.values.map((p, i) => base[i] + p[1]);
      const up = s.values.map((p, i) => `${X(p[0]).toFixed(1)},${Y(top[i]).toFixed(1)}`);
      const down = s.values.map((p, i) => `${X(p[0]).toFixed(1)},${Y(base[i]).toFixed(1)}`).reverse();
      out += `<polygon points="${up.concat(down).join(" ")}" fill="${s.color}" fill-opacity="0.75" stroke="${s.color}" stroke-width="1"/>`;
      top.forEach((v, i) => { base[i] = v; });
    }
  } else {
    for (const s of series) {
      if (!s.values.length) continue;
      const pts = s.values.map(p => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ");
      if (opts.fill) {
        const first = s.values[0][0], last = s.values[s.values.length - 1][0];
        out += `<polygon points="${X(first)},${Y(0)} ${pts} ${X(last)},${Y(0)}" fill="${s.color}" fill-opacity="0.15" stroke="none"/>`;
      }
      out += `<polyline points="${pts}" fill="none" stroke="${s.color}" stroke-width="1.8" stroke-linejoin="round"/>`;
    }
  }
  svg.innerHTML = out;
}

// Bars of live executions per rollout cell, now.
function barChart(svg, bars) {
  const [W, H] = svgSize(svg);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  if (!bars.length) { svg.innerHTML = `<text x="${W / 2}" y="${H / 2}" text-anchor="middle">no rollout cell</text>`; return; }
  const m = {l: 44, r: 10, t: 8, b: 34};
  const w = W - m.l - m.r, h = H - m.t - m.b;
  let ymax = Math.max(1, ...bars.map(b => b.value));
  const ystep = Math.max(1, Math.ceil(niceStep(ymax, 4)));
  ymax = Math.ceil(ymax / ystep) * ystep;
  const Y = v => m.t + h - v / ymax * h;
  const bw = w / bars.length;
  let out = "";
  for (let v = 0; v <= ymax; v += ystep) {
    out += `<line x1="${m.l}" x2="${m.l + w}" y1="${Y(v)}" y2="${Y(v)}" stroke="#e6e6e6"/>`;
    out += `<text x="${m.l - 6}" y="${Y(v) + 4}" text-anchor="end">${v}</text>`;
  }
  bars.forEach((b, i) => {
    const x = m.l + i * bw + bw * 0.15, bwi = bw * 0.7;
    out += `<rect x="${x}" y="${Y(b.value)}" width="${bwi}" height="${Y(0) - Y(b.value)}" fill="${b.color}"><title>${esc(b.label)}: ${b.value}</title></rect>`;
    out += `<text x="${x + bwi / 2}" y="${Y(b.value) - 3}" text-anchor="middle" style="fill:#222">${b.value}</text>`;
    const label = bars.length > 12 ? String(i) : shortAddr(b.label);
    out += `<text x="${x + bwi / 2}" y="${H - 18}" text-anchor="middle">${esc(label)}</text>`;
    if (b.moving) out += `<text x="${x + bwi / 2}" y="${H - 5}" text-anchor="middle" style="fill:${COLORS.trainer}">moving</text>`;
  });
  out += `<line x1="${m.l}" x2="${m.l + w}" y1="${Y(0)}" y2="${Y(0)}" stroke="#999"/>`;
  svg.innerHTML = out;
}

function card(k, v, title) {
  return `<div class="card" title="${esc(title || "")}"><div class="k">${esc(k)}</div><div class="v">${v}</div></div>`;
}

function renderCards(s) {
  const pools = s.pools || {};
  const live = Object.values(s.sessions || {}).reduce((a, b) => a + b, 0);
  const train = Object.values(s.train_tasks || {}).reduce((a, b) => a + b, 0);
  document.getElementById("cards").innerHTML = [
    card("placement mode", esc(s.mode), "how cells are placed: async, colocated or elastic"),
    card("rollout cells", `<span style="color:var(--rollout)">${(pools.rollout || []).length}</span>`),
    card("trainer cells", `<span style="color:var(--trainer)">${(pools.trainer || []).length}</span>`),
    card("moving now", (s.moving || []).length),
    card("live executions", live, "executions routed to a rollout cell"),
    card("trainer tasks", train, "queued or running on trainer cells"),
    card("cell moves", fmtNum(s.moves)),
    card("migrations", fmtNum(s.migrations), fmtBytes(s.migrated_bytes) + " migrated"),
    card("migrated", fmtBytes(s.migrated_bytes)),
    card("idle cell-seconds", fmtNum(s.idle_cell_seconds, 1), "cell-seconds with nothing to do"),
    card("model calls routed", fmtNum(s.routed)),
    card("stalled executions", `<span class="${(s.stalls || []).length ? "bad" : ""}">${(s.stalls || []).length}</span>`,
         (s.stalls || []).map(x => `${x.execution}: ${x.waits_on}`).join("\n") || "none"),
  ].join("");
}

function renderMoves(log) {
  const el = document.getElementById("moves");
  if (!log || !log.length) { el.innerHTML = `<tr><td class="empty">no move yet</td></tr>`; return; }
  let rows = `<tr><th>applied</th><th>cell</th><th>to</th><th>latency</th><th>migrated</th><th>outcome</th><th>reason</th></tr>`;
  for (const e of log.slice().reverse()) {
    const latency = (e.applied != null && e.decided != null) ? e.applied - e.decided : null;
    let migrated = "";
    if (e.migrated) migrated = `${e.migrated} in ${fmtSeconds(e.migration_s || 0)}, ${fmtBytes(e.bytes || 0)}`;
    const outcome = e.error ? `<span class="bad" title="${esc(e.error)}">error</span>`
      : e.aborted ? `<span class="bad" title="${esc(e.aborted)}">aborted</span>` : "ok";
    rows += `<tr><td>${e.applied_wall ? fmtClock(e.applied_wall) : "\u2013"}</td><td>${esc(shortAddr(e.cell))}</td>` +
      `<td class="to-${esc(e.to)}">${esc(e.to)}</td><td>${fmtSeconds(latency)}</td><td>${migrated}</td>` +
      `<td>${outcome}</td><td class="reason">${esc(e.reason || "")}</td></tr>`;
  }
  el.innerHTML = rows;
}

function render(s) {
  renderCards(s);
  renderMoves(s.move_log);
  const win = Number(document.getElementById("window").value);
  const hs = win > 0 ? history.filter(h => h.time >= s.time - win) : history;
  timeChart(document.getElementById("chart-cells"), [
    {color: COLORS.rollout, values: hs.map(h => [h.time, h.rollout || 0])},
    {color: COLORS.trainer, values: hs.map(h => [h.time, h.trainer || 0])},
  ], {stacked: true, integer: true});
  timeChart(document.getElementById("chart-sessions"), [
    {color: COLORS.rollout, values: hs.map(h => [h.time, Object.values(h.sessions || {}).reduce((a, b) => a + b, 0)])},
  ], {integer: true, fill: true});
  timeChart(document.getElementById("chart-work"), [
    {color: COLORS.work, values: hs.map(h => [h.time, h.train_queued || 0])},
  ], {integer: true, fill: true});
  timeChart(document.getElementById("chart-moves"), [
    {color: COLORS.moves, values: hs.map(h => [h.time, h.moves || 0])},
    {color: COLORS.migr, values: hs.map(h => [h.time, h.migrations || 0])},
  ], {integer: true});
  const moving = new Set(s.moving || []);
  barChart(document.getElementById("chart-sessions-now"),
    Object.entries(s.sessions || {}).sort().map(([a, n]) => ({label: a, value: n, moving: moving.has(a), color: moving.has(a) ? COLORS.trainer : COLORS.rollout})));
}

let last = null;
async function poll() {
  const status = document.getElementById("status");
  try {
    const url = lastTime === null ? STATE_URL : STATE_URL + "?since=" + encodeURIComponent(lastTime);
    const r = await fetch(url, {cache: "no-store"});
    const s = await r.json();
    if (!r.ok) throw new Error(s.error || ("HTTP " + r.status));
    const hist = s.history || [];
    history = lastTime === null ? hist : history.concat(hist);
    if (history.length > MAX_SAMPLES) history = history.slice(history.length - MAX_SAMPLES);
    if (history.length) lastTime = history[history.length - 1].time;
    last = s;
    render(s);
    status.className = "status";
    status.textContent = "updated " + fmtClock(s.wall);
  } catch (err) {
    status.className = "status err";
    status.textContent = "no data: " + err.message;
    lastTime = null;
  }
}
document.getElementById("window").addEventListener("change", () => { if (last) render(last); });
window.addEventListener("resize", () => { if (last) render(last); });
poll();
setInterval(poll, 1000);
</script>
</body>
</html>
"""
