"""`gyreflow bench placement`: every placement mode on one workload, interleaved and repeated.

Each run is a fresh real Dask cluster (one worker process per cell, one for the executions) with
the real scheduler plugin, placement policy, router, migration and step graph
(:mod:`gyreflow.stepgraph`); only the compute inside engines and trainer tasks follows the
workload's cost model (:mod:`gyreflow.bench.stages`, :mod:`gyreflow.bench.emulated_engine`). The
plugin runs on the workload's emulated clock, with its time constants in units of the workload
(:func:`placement_timing`), so that what it decides does not depend on ``time_scale``. Cells of
the workload's timeline are started with the cluster, held out of both pools until they join, and
retired (generations migrated first) when they leave.

Arms (``--modes``):

``colocated``
    every cell rolls out, then every cell trains, on-policy. Its first step is also what a user
    measures to choose a split.
``async_user``
    ``async`` at the split a user would choose from that first step: rollout took ``R`` s and
    training ``T`` s, both on all cells, so ``round(cells * T / (R + T))`` trainer cells (at least
    one each way).
``async_oracle``
    ``async`` at the best of the splits tried (1 to ``cells // 2`` trainer cells), in hindsight: the
    first repeat runs them all, later repeats the best two of the first.
``lend``
    the reactive switch peers ship, at the user's split.
``elastic``
    gyreflow's elastic placement, started at the user's split.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import deque
from dataclasses import asdict
from functools import partial

from distributed import Client

from gyreflow.bench.bounds import batched_bound, lower_bound
from gyreflow.bench.report import git_revision, spread
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
from gyreflow.bench.workload import Workload, WorkloadError, cell_name
from gyreflow.cluster.clock import Clock
from gyreflow.cluster.control import Timing
from gyreflow.cluster.local import PoolSpec, install, local_cluster, workers_info
from gyreflow.cluster.modes import mode as placement_mode
from gyreflow.cluster.pools import ROLLOUT, TRAINER
from gyreflow.cluster.routing import RoutingOptions
from gyreflow.stepgraph import Group, Stages, publish, submit_step
from gyreflow.train.state import PolicyState, PublishedWeights

ARMS = ("colocated", "async_user", "async_oracle", "lend", "elastic")
ARM_MODE = {"colocated": "colocated", "async_user": "async", "async_oracle": "async", "lend": "lend",
            "elastic": "elastic"}
BASELINES = {"elastic_vs_async_user": "async_user", "elastic_vs_async_oracle": "async_oracle",
             "elastic_vs_colocated": "colocated", "elastic_vs_lend": "lend"}


def stages_for(workload: Workload) -> Stages:
    return Stages(execute=emulated_execution, tree=emulated_tree, advantages=emulated_group,
                  gradient=partial(emulated_gradient, workload=workload),
                  update=partial(emulated_update, workload=workload), weights=emulated_weights,
                  publish=emulated_publish)


MAX_CELLS = 64
"""Most cells a benchmark run may ever have: each is a worker process of its own."""
MIN_TICK_WALL_S = 0.01
"""The plugin ticks at most this often in wall seconds, however short the workload's calls."""


def call_s(workload: Workload) -> float:
    """The workload's unit of time: one model call at a full batch (emulated seconds), the shortest
    over the schedule's steps."""
    per_call = min(workload.at(k).tokens_per_call for k in range(workload.steps))
    return per_call * workload.iteration_s(workload.cost.max_batch)


def placement_timing(workload: Workload) -> tuple[Timing, dict]:
    """The plugin's timing and the policies' time options, in units of :func:`call_s` (the tick no
    shorter than :data:`MIN_TICK_WALL_S` of wall time, which a machine must keep up with)."""
    u = call_s(workload)
    timing = Timing(tick_s=max(u / 4, MIN_TICK_WALL_S * workload.time_scale), history_s=u / 2, rebalance_s=u, stall_s=200 * u, stall_check_s=8 * u,
                    handover_s=50 * u, rate_window_s=200 * u)
    return timing, {"dwell_s": 2 * u, "idle_s": 2 * u, "drain_s": 4 * u}


def default_splits(cells: int) -> list[tuple[int, int]]:
    """rollout:trainer splits tried for the oracle: 1 to ``cells // 2`` trainer cells."""
    return [(cells - k, k) for k in range(1, cells // 2 + 1) if cells - k >= 1]


def user_split(cells: int, rollout_s: float, train_s: float) -> tuple[int, int]:
    """The split a user picks from a first step whose rollout took ``rollout_s`` and training
    ``train_s`` on all ``cells``: the trainer share of that work, rounded, one cell at least each way."""
    trainer = min(cells - 1, max(1, round(cells * train_s / (rollout_s + train_s))))
    return cells - trainer, trainer


def arm_problem(workload: Workload, mode_name: str, split: tuple[int, int]) -> str | None:
    """Why placement ``mode_name`` started at ``split`` cannot run ``workload`` (``None``: it can):
    the mode's own check, then its pools along the workload's cell timeline."""
    m = placement_mode(mode_name)
    why = m.check(*split)
    if why:
        return why
    r, t = m.start_split(*split)
    roles = {cell_name(i): TRAINER if i >= r else ROLLOUT for i in range(r + t)}  # local_cluster's order
    joins = iter(m.join_role(r, t, sum(e.join for e in workload.timeline)))
    policy = m.make_policy()
    least = max(1, getattr(policy, "min_rollout", 0) + getattr(policy, "min_trainer", 0))
    n = workload.cells
    for i, e in enumerate(workload.timeline):
        for _ in range(e.join):
            roles[cell_name(n)] = TRAINER if next(joins) else ROLLOUT
            n += 1
        for name in e.leave:
            roles.pop(name, None)
        where = f"timeline[{i}] (at {e.at:g} s)"
        if m.refills_pools:
            if len(roles) < least:
                return f"{where} leaves {len(roles)} cell(s); placement {m.name!r} needs {least}"
            continue
        for role in (ROLLOUT, TRAINER)[: 2 if t else 1]:
            if role not in roles.values():
                return (f"{where} takes the last {role} cell; placement {m.name!r} keeps the roles cells start "
                        f"or join with (rollout cells first: {', '.join(cell_name(k) for k in range(r))} start "
                        "in rollout): have other cells leave, or run it at another split")
    return None


def _cpu_seconds() -> float:
    """CPU seconds used so far by this process and every process it started (the cluster)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # ended meanwhile
            pass
    return total


# ---------------------------------------------------------------------------------------- one run


class _Run:
    """One arm on a fresh cluster: the step loop, the cell timeline, and what was measured."""

    def __init__(self, workload: Workload, mode_name: str, split: tuple[int, int], log, options: dict | None,
                 shares_per_group: int, execution_workers: int = 1) -> None:
        self.execution_workers = execution_workers
        self.routing = RoutingOptions()
        self.w, self.mode, self.log = workload, placement_mode(mode_name), log
        self.mode_name = mode_name
        self.split = self.mode.start_split(*split)
        self.staleness = self.mode.staleness(workload.staleness)
        self.options = options
        self.shares_per_group = shares_per_group
        self.departed_stats: dict[str, dict] = {}

    def run(self) -> dict:
        w = self.w
        r, t = self.split
        held = w.max_cells - w.cells
        slots = max(w.at(k).executions_per_step for k in range(w.steps)) * (self.staleness + 2)
        spec = PoolSpec(rollout=r, trainer=t, held=held, execution_slots=slots, execution_workers=self.execution_workers)
        timing, options = placement_timing(w)
        options = {k: v for k, v in options.items() if k in self.mode.options()} | (self.options or {})
        with local_cluster(spec) as cluster, Client(cluster) as client:
            client.wait_for_workers(w.max_cells + self.execution_workers)
            self.clock = Clock(scale=w.time_scale, origin=time.time())
            install(client, None, {"workload": w}, self.mode_name, options, engine_factory=emulated_engine_factory,
                    clock=self.clock, timing=timing, routing=self.routing)
            self.client, self.stages = client, stages_for(w)
            info = workers_info(client)
            self.names = {v["name"]: a for a, v in info.items()}
            published = PublishedWeights(0, f"bench-{self.mode_name}")
            state = PolicyState(published)
            self._publish(published, 0)
            self.t0 = time.time()
            cpu0 = _cpu_seconds()
            events = threading.Thread(target=self._timeline, daemon=True, name="bench-timeline")
            events.start()
            in_flight: deque = deque()
            updates, executions = [], []
            for step in range(w.steps):
                while in_flight and in_flight[0].step <= step - self.staleness - 1:
                    updates.append(self._finish(in_flight.popleft()))
                by_task: dict[int, list] = {}
                for ex in w.executions(step):
                    by_task.setdefault(ex.task, []).append((ex.execution_id, (ex, w.time_scale)))
                groups = [Group(f"t{t}", specs) for t, specs in sorted(by_task.items())]
                sf = submit_step(client, step, groups, self.stages, state, published, shares_per_group=self.shares_per_group)
                in_flight.append(sf)
                executions.extend(sf.executions)
                state, published = sf.update, sf.published
            while in_flight:
                updates.append(self._finish(in_flight.popleft()))
            wall = time.time() - self.t0
            self.cpu_load = (_cpu_seconds() - cpu0) / (wall * (os.cpu_count() or 1)) if wall > 0 else 0.0
            self._stop = True
            events.join(timeout=60)
            client.sync(client.scheduler.gyreflow_placement, mode="async")  # no move while the cluster closes
            results = client.gather(executions)
            engines = client.run(lambda dask_worker: dask_worker.plugins["gyreflow-engine"].stats(),
                                 workers=[a for n, a in self._live_cells().items()])
            status = client.sync(client.scheduler.gyreflow_pools)
        return self._summary(wall, updates, results, engines | self.departed_stats, status)

    def _live_cells(self) -> dict[str, str]:
        info = workers_info(self.client)
        return {v["name"]: a for a, v in info.items() if str(v["name"]).startswith("cell-")}

    def _publish(self, published, version: int) -> None:
        """The weights version to every cell that may serve rollout now or later (held cells too)."""
        info = workers_info(self.client)
        targets = [a for a, v in info.items() if str(v["name"]).startswith("cell-")
                   and (self.mode.trainers_roll_out or v.get("resources", {}).get(TRAINER, 0) == 0)]
        publish(self.client, self.stages, published, targets, version)  # skips a cell that leaves meanwhile

    def _finish(self, sf) -> dict:
        update = sf.update.result()
        self._publish(sf.published, update.version)
        end = (time.time() - self.t0) * self.w.time_scale
        self.log(f"  {self.mode_name} {self.split[0]}:{self.split[1]}: step {sf.step} done at {end:,.0f} s emulated")
        return {"version": update.version, "metrics": update.metrics, "done_emulated": end}

    _stop = False

    def _timeline(self) -> None:
        """Join and retire cells at the workload's emulated times."""
        w = self.w
        roles = self.mode.join_role(*self.split, sum(e.join for e in w.timeline))
        joined = w.cells
        for event in w.timeline:
            while not self._stop and (time.time() - self.t0) * w.time_scale < event.at:
                time.sleep(min(0.05, max(0.0, event.at / w.time_scale - (time.time() - self.t0))))
            if self._stop:
                return
            for _ in range(event.join):
                role = TRAINER if roles[joined - w.cells] else ROLLOUT
                out = self.client.sync(self.client.scheduler.gyreflow_join, cell=self.names[cell_name(joined)], role=role)
                if "error" in out:
                    self.log(f"  join of {cell_name(joined)} failed: {out['error']}")
                joined += 1
            for name in event.leave:  # what a leaving cell did counts: a last look before it goes
                addr = self.names[name]
                self.departed_stats[name] = self.client.run(
                    lambda dask_worker: dask_worker.plugins["gyreflow-engine"].stats(), workers=[addr])[addr]
                out = self.client.sync(self.client.scheduler.gyreflow_retire, cell=addr)
                if "error" in out:
                    self.log(f"  retirement of {name} failed: {out['error']}")

    def _summary(self, wall: float, updates: list[dict], results: list[dict], engines: dict, status: dict) -> dict:
        w, scale = self.w, self.w.time_scale
        emulated = wall * scale
        engine_busy = sum(s.get("busy_s", 0.0) for s in engines.values())
        shares = [s for u in updates for s in u["metrics"]["shares"]]
        train_busy = sum((s["end"] - s["start"]) * scale for s in shares)
        train_busy += sum((u["metrics"]["update"]["end"] - u["metrics"]["update"]["start"]) * scale for u in updates)
        origin = self.clock.at(self.t0)  # plugin clock reading at the run's start
        first = [r for r in results if r["execution_id"].startswith("s0-")]
        rollout_s = (max(r["end"] for r in first) - self.t0) * scale
        train_s = (updates[0]["metrics"]["update"]["end"] - self.t0) * scale - rollout_s
        return {
            "mode": self.mode_name,
            "split": f"{self.split[0]}:{self.split[1]}",
            "wall_s": wall,
            "cpu_load": self.cpu_load,
            "emulated_s": emulated,
            "utilization": (engine_busy + train_busy) / w.cell_seconds(emulated) if emulated else 0.0,
            "moves": status["moves"],
            "moves_failed": status["moves_failed"],
            "migrations": status["migrations"],
            "migrated_bytes": status["migrated_bytes"],
            "executions": len(results),
            "unique_executions": len({r["execution_id"] for r in results}),
            "tokens": int(sum(r["tokens"] for r in results)),
            "max_staleness": max(u["metrics"]["max_staleness"] for u in updates),
            "step_end_s": [u["done_emulated"] for u in updates],
            "first_step": {"rollout_s": rollout_s, "train_s": max(0.0, train_s)},
            "cells": [{"time": e["time"] - origin, ROLLOUT: e[ROLLOUT], TRAINER: e[TRAINER]} for e in status["timeline"]],
            "cell_moves": [{"cell": m["cell"], "to": m["to"], "time": m["applied"] - origin,
                            **({"failed": m.get("error") or m.get("aborted")} if m.get("error") or m.get("aborted") else {})}
                           for m in status["move_log"]],
            "stalls": status["stalls"],
            "lost_calls": int(sum(r.get("lost", 0) for r in results)),
            # an execution's calls' wall time in Dask's messages, x scale; what its tool waits did not give back
            "messaging_per_execution_s": scale * statistics.mean(r["messaging_s"] for r in results),
            "messaging_kept_per_execution_s": scale * statistics.mean(r["messaging_s"] - r["repaid_s"] for r in results),
            "prefill_tokens": int(sum(s.get("prefill_tokens", 0) for s in engines.values())),
            "engine_resolve_lag_emulated_s": statistics.mean([s.get("mean_resolve_lag_s", 0.0) for s in engines.values()] or [0.0]),
            "longest": self._longest(results),
        }

    def _longest(self, results: list[dict]) -> list[dict]:
        """Per step, its longest execution (by its duration alone on a cell): when it started and how
        long it took in this run, against alone. Its stretch is what keeps a run above the bound."""
        w, scale = self.w, self.w.time_scale
        alone = {e.execution_id: w.min_execution_s(e) for k in range(w.steps) for e in w.executions(k)}
        longest: dict[int, dict] = {}
        for r in results:
            best = longest.get(r["step"])
            if best is None or alone[r["execution_id"]] > alone[best["execution_id"]]:
                longest[r["step"]] = r
        out = []
        for k, r in sorted(longest.items()):
            a, took = alone[r["execution_id"]], (r["end"] - r["start"]) * scale
            out.append({"step": k, "start_s": (r["start"] - self.t0) * scale, "took_s": took, "alone_s": a,
                        "stretch": took / a if a > 0 else float("nan")})
        return out


def run_arm(workload: Workload, mode_name: str, split: tuple[int, int], log=print, options: dict | None = None,
            shares_per_group: int = 8, execution_workers: int = 1) -> dict:
    """One placement mode at one start split on a fresh cluster; the run's figures."""
    return _Run(workload, mode_name, split, log, options, shares_per_group, execution_workers).run()


# ---------------------------------------------------------------------------------------- the benchmark


def run_bench(workload: Workload, repeats: int = 1, arms=ARMS, splits: list[tuple[int, int]] | None = None,
              log=print, execution_workers: int = 2) -> dict:
    """Every arm on ``workload``, interleaved, ``repeats`` times; figures, spreads and ratios."""
    cells = workload.cells
    candidates = splits or default_splits(cells)
    if workload.max_cells > MAX_CELLS:
        raise WorkloadError(f"{workload.name}: field {'timeline' if workload.timeline else 'cells'!r} gives the run "
                            f"{workload.max_cells} cells; the benchmark runs at most {MAX_CELLS} (one worker process each)")

    def refuse(arm: str, split: tuple[int, int], timeline: bool = True) -> None:
        why = (arm_problem(workload, ARM_MODE[arm], split) if timeline
               else placement_mode(ARM_MODE[arm]).check(*split))
        if why:
            raise WorkloadError(f"{workload.name}: arm {arm!r} at {split[0]}:{split[1]} cannot run: {why}")

    # Everything that can be refused is, before the first run: the user's split is known only after
    # the calibration, so its arms are checked here without the timeline, and with it once it is known.
    if "colocated" in arms:
        refuse("colocated", (cells, 0))
    if "async_oracle" in arms:
        if not candidates:
            raise WorkloadError(f"{workload.name}: no split to try for 'async_oracle' on {cells} cell(s)")
        for split in candidates:
            refuse("async_oracle", split)
    user_arms = [a for a in ("async_user", "lend", "elastic") if a in arms]
    for arm in user_arms:
        refuse(arm, user_split(cells, 1.0, 1.0), timeline=False)
    runs: list[dict] = []
    calibration: dict | None = None
    best_two: list[tuple[int, int]] | None = None
    for rep in range(repeats):
        log(f"repeat {rep + 1}/{repeats}")
        done: dict[tuple[str, tuple[int, int]], dict] = {}

        def once(arm: str, split: tuple[int, int]) -> dict:
            mode_name = ARM_MODE[arm]
            key = (mode_name, split)
            if key not in done:
                log(f"{arm} ({mode_name} {split[0]}:{split[1]}) ...")
                done[key] = run_arm(workload, mode_name, split, log, execution_workers=execution_workers)
            out = done[key] | {"repeat": rep, "arm": arm}
            runs.append(out)
            return out

        if "colocated" in arms:
            first_step = once("colocated", (cells, 0))["first_step"]
            if calibration is None and not _cells_change_before(workload, first_step["rollout_s"] + first_step["train_s"]):
                calibration = first_step
        if calibration is None and user_arms:
            # the user's first step: one step on all cells, rollouts then training
            log("calibration: the first step, colocated ...")
            first = run_arm(_one_step(workload), "colocated", (cells, 0), log, execution_workers=execution_workers)
            calibration = first["first_step"]
        user = user_split(cells, calibration["rollout_s"], calibration["train_s"]) if calibration else None
        if rep == 0:
            for arm in user_arms:
                refuse(arm, user)
        if "async_user" in arms:
            once("async_user", user)
        if "async_oracle" in arms:
            tried = candidates if best_two is None else best_two
            for split in tried:
                once("async_oracle", split)
            if best_two is None:
                first = [x for x in runs if x["repeat"] == rep and x["arm"] == "async_oracle"]
                best_two = [tuple(int(v) for v in x["split"].split(":")) for x in sorted(first, key=lambda x: x["emulated_s"])[:2]]
        if "lend" in arms:
            once("lend", user)
        if "elastic" in arms:
            once("elastic", user)
    out = summarise(workload, runs, repeats, candidates, calibration, log)
    out["options"]["execution_workers"] = execution_workers
    return out


def _cells_change_before(workload: Workload, t: float) -> bool:
    """Whether the cell timeline changes the cluster before emulated time ``t`` (a first step that
    saw it is not the one a user measures)."""
    return bool(workload.timeline) and workload.timeline[0].at < t


def _one_step(workload: Workload) -> Workload:
    import dataclasses

    return dataclasses.replace(workload, steps=1, schedule=tuple(c for c in workload.schedule if c.from_step < 1),
                               timeline=())


def summarise(workload: Workload, runs: list[dict], repeats: int, candidates, calibration: dict | None, log=print) -> dict:
    """Spreads of every arm, the oracle split, both bounds, and each ratio's spread."""
    lb = lower_bound(workload)
    bb = batched_bound(workload)
    out: dict = {"workload": workload.name, "workload_spec": workload.to_dict(), "git": git_revision(),
                 "repeats": repeats, "cells": workload.cells, "steps": workload.steps,
                 "time_scale": workload.time_scale, "emulated": True,
                 "options": {"timing": asdict(placement_timing(workload)[0]), "policy": placement_timing(workload)[1],
                             "splits_tried": [f"{r}:{t}" for r, t in candidates]},
                 "first_step": calibration, "runs": runs, "modes": {}}
    by_arm: dict[str, dict[int, dict]] = {}
    for x in runs:
        if x["arm"] != "async_oracle":
            by_arm.setdefault(x["arm"], {})[x["repeat"]] = x
    oracle = [x for x in runs if x["arm"] == "async_oracle"]
    if oracle:
        per_split: dict[str, list[dict]] = {}
        for x in oracle:
            per_split.setdefault(x["split"], []).append(x)
        full = {s: xs for s, xs in per_split.items() if len(xs) == repeats} or per_split
        best = min(full, key=lambda s: statistics.mean(x["emulated_s"] for x in full[s]))
        by_arm["async_oracle"] = {x["repeat"]: x for x in full[best]}
        out["oracle_split"] = best
        out["oracle_splits"] = {s: spread([x["emulated_s"] for x in xs]) for s, xs in sorted(per_split.items())}
    for arm, reps in by_arm.items():
        xs = list(reps.values())
        out["modes"][arm] = {"split": xs[0]["split"], "mode": xs[0]["mode"],
                             **{k: spread([x[k] for x in xs]) for k in ("emulated_s", "wall_s", "utilization", "moves",
                                                                         "migrations", "cpu_load",
                                                                         "messaging_per_execution_s",
                                                                         "messaging_kept_per_execution_s")},
                             "max_staleness": max(x["max_staleness"] for x in xs),
                             "longest_stretch": spread([statistics.mean(y["stretch"] for y in x["longest"]) for x in xs
                                                         if x.get("longest")] or [float("nan")]),
                             "executions": xs[0]["executions"], "unique_executions": min(x["unique_executions"] for x in xs),
                             "tokens": xs[0]["tokens"]}
    out["lower_bound_s"] = lb["lower_bound_s"]
    out["lower_bound"] = {k: v for k, v in lb.items() if isinstance(v, (int, float))}
    out["batched_bound_s"] = bb["batched_bound_s"]
    ratios = {}
    if "elastic" in by_arm:
        el = by_arm["elastic"]
        for name, arm in BASELINES.items():
            if arm in by_arm:
                common = sorted(set(el) & set(by_arm[arm]))
                ratios[name] = spread([by_arm[arm][r]["emulated_s"] / el[r]["emulated_s"] for r in common])
        ratios["elastic_vs_lower_bound"] = spread([x["emulated_s"] / lb["lower_bound_s"] for x in el.values()])
        ratios["elastic_vs_batched_bound"] = spread([x["emulated_s"] / bb["batched_bound_s"] for x in el.values()])
    out["ratios"] = ratios
    return out
