"""Trainer tasks follow the trainer pool: woken when a cell joins it, spread over its cells.

Dask sends a resource-restricted task to a worker as soon as one has the resource, so queued
trainer tasks can pile up on one trainer cell (or stay on a cell that left the pool), and tasks
that found no trainer at all sit in ``no-worker`` even after a cell gains the resource
(``shared/notes/dask-pools.md``, traps 2 and 3). Both are fixed here with Dask's own machinery:
``bulk_schedule_unrunnable_after_adding_worker`` and the work-stealing extension.
"""

from __future__ import annotations

import time

from gyreflow.cluster.pools import trainer_tasks


def schedule_unrunnable(scheduler, addr: str) -> None:
    """Schedule trainer tasks left in ``no-worker`` now that ``addr`` holds the resource."""
    ws = scheduler.workers.get(addr)
    if ws is None:
        return
    recs = scheduler.bulk_schedule_unrunnable_after_adding_worker(ws)
    if recs:
        scheduler.transitions(recs, stimulus_id=f"gyreflow-new-trainer-{time.time()}")


def spread_trainer_tasks(scheduler, roles: dict[str, str | None], trainers: list[str]) -> int:
    """Steal queued trainer tasks onto the least loaded of ``trainers``; the number of steals asked.

    Donors are the cells in ``roles`` (address -> role, ``None`` between pools) holding trainer
    tasks: a trainer cell keeps its first task (it runs, or soon will: a worker runs its queue in
    priority order, and a steal of it would be refused), a cell that left the trainer pool keeps
    none. Steals take from the back of each queue.
    """
    stealing = scheduler.extensions.get("stealing")
    if stealing is None or not trainers:
        return 0
    load = {a: len(trainer_tasks(scheduler.workers.get(a))) for a in trainers}
    donors = []
    for addr in roles:
        ws = scheduler.workers.get(addr)
        if ws is None:
            continue
        tasks = sorted(trainer_tasks(ws), key=lambda ts: ts.priority or ())
        keep = 1 if addr in load else 0
        queued = [ts for ts in tasks[keep:] if ts not in ws.executing]
        donors.extend(ts for ts in reversed(queued) if not ts.worker_restrictions and ts not in stealing.in_flight)
    asked = 0
    for ts in donors:
        thief = min(trainers, key=lambda a: load[a])
        victim = ts.processing_on
        if victim is None or victim.address == thief:
            continue
        # Between two trainer cells, steal only what evens them out.
        if victim.address in load and load[victim.address] <= load[thief] + 1:
            continue
        stealing.move_task_request(ts, victim, scheduler.workers[thief])
        load[thief] += 1
        if victim.address in load:
            load[victim.address] -= 1
        asked += 1
    return asked
