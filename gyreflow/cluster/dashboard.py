"""The gyreflow page of the Dask dashboard, and the pools' Prometheus metrics.

:class:`~gyreflow.cluster.plugin.PoolsPlugin` calls :func:`register` when it starts in a scheduler
and :func:`unregister` when it closes. :func:`register` adds, on the dashboard's own port:

``/gyreflow``
    A self-contained page (``dashboard.html``: inline script and SVG, nothing fetched from
    elsewhere) that polls ``state.json`` every second: cells by role over time, live executions
    per rollout cell, queued training work, moves and migrations with the latest moves, placement
    mode, idle cell-seconds.
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

import functools
import json
import logging
import math
import re
import threading
import weakref
from importlib import resources

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


@functools.cache
def page_html() -> str:
    """The page (``dashboard.html`` beside this module: inline script and SVG only)."""
    return resources.files(__package__).joinpath("dashboard.html").read_text(encoding="utf-8")


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
            self.write(page_html())

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
