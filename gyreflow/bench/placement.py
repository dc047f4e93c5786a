"""`gyreflow bench placement`: colocated vs async vs elastic, side by side, in one invocation.

Each mode runs on a fresh real Dask cluster (one worker process per cell, one for the executions)
with the real scheduler plugin, placement policy, router, migration and step graph
(:mod:`gyreflow.stepgraph`); only the compute inside engines and trainer tasks follows the
workload's cost model (:mod:`gyreflow.bench.stages`, :mod:`gyreflow.bench.emulated_engine`).
Emulated seconds are wall seconds times the workload's ``time_scale``.

Baselines are the strongest reasonable versions: ``async`` starts an execution as soon as an
engine has room (within the staleness bound), streams training like ``elastic`` and is run at
several rollout:trainer splits, of which the best is reported; ``colocated`` uses every cell for
both phases, on-policy (staleness 0).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from functools import partial

from distributed import Client

from gyreflow.bench.emulated_engine import emulated_engine_factory
from gyreflow.bench.stages import (
    emulated_execution,
    emulated_gradient,
    emulated_group,
    emulated_publish,
    emulated_tree,
    emulated_update,
    emulated_weights,
)
from gyreflow.bench.workload import Workload, lower_bound
from gyreflow.cluster.local import PoolSpec, cells_of, install, local_cluster
from gyreflow.cluster.pools import ROLLOUT, TRAINER
from gyreflow.stepgraph import Group, Stages, publish, submit_step

MODES = ("colocated", "async", "elastic")


def stages_for(workload: Workload) -> Stages:
    return Stages(execute=emulated_execution, tree=emulated_tree, advantages=emulated_group,
                  gradient=partial(emulated_gradient, workload=workload),
                  update=partial(emulated_update, workload=workload), weights=emulated_weights,
                  publish=emulated_publish)


def default_splits(cells: int) -> list[tuple[int, int]]:
    """rollout:trainer splits tried for ``async`` (training is about 30% of the work)."""
    return [(cells - k, k) for k in (1, 2, 3) if cells - k >= 1]


def run_mode(workload: Workload, mode: str, rollout: int, trainer: int, placement_options: dict | None = None,
             log=print, shares_per_group: int = 8) -> dict:
    """One mode on a fresh cluster; the figures of :func:`summarise`."""
    staleness = 0 if mode == "colocated" else workload.staleness
    slots = workload.executions_per_step * (staleness + 2)
    spec = PoolSpec(rollout=rollout, trainer=trainer, execution_slots=slots)
    with local_cluster(spec) as cluster, Client(cluster) as client:
        install(client, None, {"workload": workload}, mode, placement_options, engine_factory=emulated_engine_factory)
        stages = stages_for(workload)
        pools = cells_of(client)
        cells = pools[ROLLOUT] + pools[TRAINER]
        state = published = {"version": 0, "run": f"bench-{mode}"}
        publish(client, stages, published, cells, 0)
        t0 = time.time()
        in_flight: deque = deque()
        updates, executions = [], []

        def finish() -> None:
            sf = in_flight.popleft()
            updates.append(sf.update.result())
            publish(client, stages, sf.published, cells, updates[-1]["version"])
            log(f"  {mode}: step {sf.step} done at {(time.time() - t0) * workload.time_scale:,.0f} s emulated")

        for step in range(workload.steps):
            while in_flight and in_flight[0].step <= step - staleness - 1:
                finish()
            by_task: dict[int, list] = {}
            for ex in workload.executions(step):
                by_task.setdefault(ex.task, []).append((ex.execution_id, (ex, workload.time_scale)))
            groups = [Group(f"t{t}", specs) for t, specs in sorted(by_task.items())]
            sf = submit_step(client, step, groups, stages, state, published, shares_per_group=shares_per_group)
            in_flight.append(sf)
            executions.extend(sf.executions)
            state, published = sf.update, sf.published
        while in_flight:
            finish()
        wall = time.time() - t0
        client.sync(client.scheduler.gyreflow_placement, mode="async")  # no move while the cluster closes
        results = client.gather(executions)
        engines = client.run(lambda dask_worker: dask_worker.plugins["gyreflow-engine"].stats(), workers=cells)
        pools_state = client.sync(client.scheduler.gyreflow_pools)
        move_log = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins["gyreflow-pools"].move_log))
    return summarise(workload, mode, f"{rollout}:{trainer}", wall, updates, results, engines, pools_state, move_log)


def summarise(workload: Workload, mode: str, split: str, wall: float, updates: list[dict], results: list[dict],
              engines: dict, pools_state: dict, move_log: list[dict]) -> dict:
    scale = workload.time_scale
    cells = len(engines)
    engine_busy = sum(s.get("busy_s", 0.0) for s in engines.values())
    train_busy = sum((s["end"] - s["start"]) * scale for u in updates for s in u["metrics"]["shares"])
    train_busy += sum((u["metrics"]["update"]["end"] - u["metrics"]["update"]["start"]) * scale for u in updates)
    emulated = wall * scale
    # Move decision -> first trainer task executing on the moved cell.
    starts: dict[str, list[float]] = {}
    for u in updates:
        for s in u["metrics"]["shares"]:
            starts.setdefault(s["worker"], []).append(s["start"])
        starts.setdefault(u["metrics"]["update"]["worker"], []).append(u["metrics"]["update"]["start"])
    latencies = []
    for m in move_log:
        if m.get("to") == TRAINER and "error" not in m and not m.get("aborted"):
            later = [t for t in starts.get(m["cell"], []) if t >= m["decided"]]
            if later:
                latencies.append(min(later) - m["decided"])
    lags = [s.get("mean_resolve_lag_s", 0.0) for s in engines.values()]
    return {
        "mode": mode,
        "split": split,
        "wall_s": wall,
        "emulated_s": emulated,
        "utilization": (engine_busy + train_busy) / (cells * emulated) if emulated else 0.0,
        "moves": pools_state["moves"],
        "migrations": pools_state["migrations"],
        "migrated_bytes": pools_state["migrated_bytes"],
        "executions": len(results),
        "unique_executions": len({r["execution_id"] for r in results}),
        "tokens": int(sum(r["tokens"] for r in results)),
        "max_staleness": max(u["metrics"]["max_staleness"] for u in updates),
        "move_to_trainer_task_s": {"median": statistics.median(latencies) if latencies else None,
                                   "n": len(latencies), "max": max(latencies) if latencies else None},
        "engine_resolve_lag_emulated_s": statistics.mean(lags) if lags else 0.0,
    }


def run_bench(workload: Workload, splits: list[tuple[int, int]] | None = None, modes=MODES,
              elastic_options: dict | None = None, log=print) -> dict:
    """All modes on ``workload``; the figures and ratios of the placement benchmark."""
    cells = workload.cells
    out: dict = {"workload": workload.name, "cells": cells, "steps": workload.steps,
                 "time_scale": workload.time_scale, "emulated": True, "modes": {}}
    if "colocated" in modes:
        log(f"colocated ({cells} cells, on-policy) ...")
        out["modes"]["colocated"] = run_mode(workload, "colocated", cells, 0, log=log)
    if "async" in modes:
        tried = {}
        for r, t in splits or default_splits(cells):
            log(f"async {r}:{t} ...")
            tried[f"{r}:{t}"] = run_mode(workload, "async", r, t, log=log)
        best = min(tried.values(), key=lambda m: m["emulated_s"])
        out["modes"]["async"] = best | {"splits": {k: v["emulated_s"] for k, v in tried.items()}}
    if "elastic" in modes:
        log("elastic ...")
        out["modes"]["elastic"] = run_mode(workload, "elastic", cells - 1, 1, elastic_options, log=log)
    lb = lower_bound(workload, staleness=workload.staleness, cells=cells)
    out["lower_bound_s"] = lb["lower_bound_s"]
    out["lower_bound"] = {k: v for k, v in lb.items() if isinstance(v, (int, float))}
    m = out["modes"]
    ratios = {}
    if "elastic" in m:
        e = m["elastic"]["emulated_s"]
        if "async" in m:
            ratios["elastic_vs_async"] = m["async"]["emulated_s"] / e
        if "colocated" in m:
            ratios["elastic_vs_colocated"] = m["colocated"]["emulated_s"] / e
        ratios["elastic_vs_lower_bound"] = e / out["lower_bound_s"]
    out["ratios"] = ratios
    return out
