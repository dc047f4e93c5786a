"""Prometheus metrics of the gyreflow pools, served by the scheduler's ``/metrics``.

Dask's ``/metrics`` serves ``prometheus_client``'s global registry, so one collector registered
there in the scheduler process shows up next to Dask's own metrics. Several schedulers can live in
one process (tests, notebooks): there is one module-level collector for all of them, which reads
every live :class:`~gyreflow.cluster.plugin.PoolsPlugin` and labels its samples with the address of
the plugin's scheduler.

Metrics (all labelled ``scheduler``):

==================================== ======= ===============================================
name                                 type    meaning
==================================== ======= ===============================================
``gyreflow_cells{pool}``             gauge   cells in the ``rollout`` / ``trainer`` pool
``gyreflow_cells_moving``            gauge   cells being moved between pools now
``gyreflow_live_executions{cell}``   gauge   live executions routed to a rollout cell
``gyreflow_trainer_tasks{cell}``     gauge   trainer tasks queued on or running on a cell
``gyreflow_trainer_tasks_waiting``   gauge   trainer tasks ready that no cell holds
``gyreflow_route_waiting``           gauge   model calls waiting for any rollout engine
``gyreflow_placement_mode{mode}``    gauge   1 for the current placement mode
``gyreflow_cell_moves_total``        counter cells moved between pools
``gyreflow_cell_moves_failed_total`` counter moves that failed or were aborted
``gyreflow_stalled_executions``      gauge   executions without progress past the stall limit
``gyreflow_migrations_total``        counter live generations migrated off leaving cells
``gyreflow_migrated_bytes_total``    counter bytes of KV cache and sampler state migrated
``gyreflow_idle_cell_seconds_total`` counter cell-seconds with nothing to do
``gyreflow_routed_total``            counter model calls routed to an engine
==================================== ======= ===============================================

Importing this module needs ``prometheus_client``; :mod:`gyreflow.cluster.dashboard` guards it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gyreflow.cluster.dashboard import running
from gyreflow.cluster.pools import ROLLOUT, TRAINER

log = logging.getLogger(__name__)

_lock = threading.Lock()
_plugins: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""scheduler -> the PoolsPlugin whose metrics it exports."""
_collector: PoolsCollector | None = None


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    """Empty metric families, by key; :meth:`PoolsCollector.collect` fills them."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    return {
        "cells": g("gyreflow_cells", "Cells in each pool.", labels=["scheduler", "pool"]),
        "moving": g("gyreflow_cells_moving", "Cells being moved between pools.", labels=["scheduler"]),
        "live": g("gyreflow_live_executions", "Live executions routed to a rollout cell.", labels=["scheduler", "cell"]),
        "train": g("gyreflow_trainer_tasks", "Trainer tasks queued or running on a cell.", labels=["scheduler", "cell"]),
        "train_waiting": g("gyreflow_trainer_tasks_waiting", "Trainer tasks ready to run that no cell holds.",
                           labels=["scheduler"]),
        "route_waiting": g("gyreflow_route_waiting", "Model calls waiting for any rollout engine.", labels=["scheduler"]),
        "mode": g("gyreflow_placement_mode", "1 for the current placement mode.", labels=["scheduler", "mode"]),
        "moves": c("gyreflow_cell_moves", "Cells moved between pools.", labels=["scheduler"]),
        "moves_failed": c("gyreflow_cell_moves_failed", "Moves that failed or were aborted (the cell kept a role it "
                          "can serve).", labels=["scheduler"]),
        "stalled": g("gyreflow_stalled_executions", "Executions without progress for longer than the stall limit.",
                     labels=["scheduler"]),
        "migrations": c("gyreflow_migrations", "Live generations migrated off cells leaving the rollout pool.",
                        labels=["scheduler"]),
        "migrated_bytes": c("gyreflow_migrated_bytes", "Bytes of KV cache and sampler state migrated.",
                            labels=["scheduler"]),
        "idle": c("gyreflow_idle_cell_seconds", "Cell-seconds with nothing to do (no execution or trainer task).",
                  labels=["scheduler"]),
        "routed": c("gyreflow_routed", "Model calls routed to an engine.", labels=["scheduler"]),
    }


def _address(scheduler) -> str:
    try:
        return str(scheduler.address)
    except Exception:  # not listening (yet, or any more)
        return f"scheduler-{id(scheduler):x}"


def _sample(families: dict, scheduler, plugin) -> None:
    """Add the samples of one plugin to ``families``."""
    # The collector may run on another scheduler's event loop thread (several schedulers in one
    # process): read everything first, retry if a dict changed under us, add only complete reads.
    for attempt in range(3):
        try:
            state = plugin.status()
            break
        except RuntimeError:  # "dictionary changed size during iteration"
            if attempt == 2:
                raise
    addr = _address(scheduler)
    for pool in (ROLLOUT, TRAINER):
        families["cells"].add_metric([addr, pool], len(state.pools.get(pool, ())))
    families["moving"].add_metric([addr], len(state.moving))
    for cell, n in sorted(state.sessions.items()):
        families["live"].add_metric([addr, cell], n)
    for cell, n in sorted(state.train_tasks.items()):
        families["train"].add_metric([addr, cell], n)
    families["train_waiting"].add_metric([addr], state.train_waiting)
    families["route_waiting"].add_metric([addr], state.route_waiting)
    families["mode"].add_metric([addr, state.mode], 1)
    families["moves"].add_metric([addr], state.moves)
    families["moves_failed"].add_metric([addr], state.moves_failed)
    families["migrations"].add_metric([addr], state.migrations)
    families["migrated_bytes"].add_metric([addr], state.migrated_bytes)
    families["idle"].add_metric([addr], state.idle_cell_seconds)
    families["routed"].add_metric([addr], state.routed)
    families["stalled"].add_metric([addr], len(state.stalls))


class PoolsCollector:
    """A ``prometheus_client`` collector of the pools of every registered plugin.

    Parameters
    ----------
    plugins
        Called at each scrape; returns ``(scheduler, plugin)`` pairs to report.
    """

    def __init__(self, plugins) -> None:
        self.plugins = plugins

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The metric families, without samples (the registry checks their names once)."""
        yield from _families().values()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The metric families with one set of samples per live plugin."""
        families = _families()
        for scheduler, plugin in self.plugins():
            if not running(scheduler, plugin):
                continue
            try:
                _sample(families, scheduler, plugin)
            except Exception:  # one broken plugin must not break the scheduler's /metrics
                log.debug("gyreflow metrics of %s skipped", _address(scheduler), exc_info=True)
        yield from families.values()


def live() -> list[tuple[object, object]]:
    """The ``(scheduler, plugin)`` pairs registered now."""
    with _lock:
        return list(_plugins.items())


def register(scheduler, plugin) -> None:
    """Export ``plugin``'s pools on ``/metrics``, labelled with ``scheduler``'s address.

    Parameters
    ----------
    scheduler
        The ``distributed.Scheduler`` the plugin runs in.
    plugin
        A :class:`~gyreflow.cluster.plugin.PoolsPlugin`; replaces any plugin registered before for
        the same scheduler. Registering again is harmless.
    """
    global _collector
    with _lock:
        _plugins[scheduler] = plugin
        if _collector is None:
            collector = PoolsCollector(live)
            REGISTRY.register(collector)
            _collector = collector


def unregister(scheduler, plugin) -> None:
    """Stop exporting ``plugin``; the collector leaves the registry when no plugin is left.

    Parameters
    ----------
    scheduler
        The scheduler given to :func:`register`.
    plugin
        The plugin given to :func:`register`; nothing happens if another one replaced it since.
    """
    global _collector
    with _lock:
        if scheduler is not None and _plugins.get(scheduler) is plugin:
            del _plugins[scheduler]
        if not _plugins and _collector is not None:
            try:
                REGISTRY.unregister(_collector)
            except KeyError:  # someone took it out already
                pass
            _collector = None

