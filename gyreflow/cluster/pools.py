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
