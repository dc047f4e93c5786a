"""Pools are Dask worker resources. A cell is one worker; its role is the resource it holds."""

from __future__ import annotations

ROLLOUT = "rollout"
"""Resource of cells that host an inference engine."""
TRAINER = "trainer"
"""Resource of cells that hold a trainer."""
EXECUTION = "execution"
"""Resource of execution slots: one per concurrent agent loop."""


def pool_of(resources: dict[str, float]) -> str | None:
    """The pool a worker with ``resources`` serves, if any."""
    if resources.get(ROLLOUT, 0) > 0:
        return ROLLOUT
    if resources.get(TRAINER, 0) > 0:
        return TRAINER
    if resources.get(EXECUTION, 0) > 0:
        return EXECUTION
    return None


def workers_by_pool(worker_resources: dict[str, dict[str, float]]) -> dict[str, list[str]]:
    """Group worker addresses by pool, from ``{address: resources}``."""
    pools: dict[str, list[str]] = {ROLLOUT: [], TRAINER: [], EXECUTION: []}
    for addr, res in sorted(worker_resources.items()):
        for pool in (ROLLOUT, TRAINER, EXECUTION):
            if res.get(pool, 0) > 0:
                pools[pool].append(addr)
    return pools


def is_cell(resources: dict[str, float]) -> bool:
    """Whether a worker with ``resources`` is a cell: in a pool, or between pools while it moves."""
    return ROLLOUT in resources or TRAINER in resources


def role_of(resources: dict[str, float]) -> str | None:
    """The cell role of a worker with ``resources``: ``rollout``, ``trainer`` or ``None`` (not a
    cell now: an execution worker, or a cell held out of both pools)."""
    if resources.get(ROLLOUT, 0) > 0:
        return ROLLOUT
    if resources.get(TRAINER, 0) > 0:
        return TRAINER
    return None


def is_trainer_task(ts) -> bool:
    """Whether a scheduler ``TaskState`` needs the ``trainer`` resource."""
    return bool(ts.resource_restrictions) and TRAINER in ts.resource_restrictions


def trainer_tasks(ws) -> list:
    """Trainer tasks running on or queued for a scheduler ``WorkerState`` (``None``: none)."""
    return [ts for ts in ws.processing if is_trainer_task(ts)] if ws is not None else []


def results_still_needed(ws) -> list:
    """Results of trainer tasks held on a scheduler ``WorkerState`` that a trainer task still to
    run (or running) needs: a step's gradient shares before its update has taken their sums, which
    live on the cell that computed them (``None``: none)."""
    if ws is None:
        return []
    return [ts for ts in ws.has_what if is_trainer_task(ts)
            and any(d.state in ("waiting", "queued", "no-worker", "processing") and is_trainer_task(d)
                    for d in ts.dependents)]


def cell_roles(scheduler) -> dict[str, str]:
    """Cell address -> role, for the scheduler's workers that are in a pool now."""
    out = {}
    for addr, ws in list(scheduler.workers.items()):
        role = role_of(ws.resources)
        if role is not None:
            out[addr] = role
    return out
