"""A cell's side of a role change: a WorkerPlugin the scheduler plugin calls over Dask comms.

The role is the worker's resources (``rollout`` or ``trainer`` set to 1, the other to 0), changed
only through ``Worker.set_resources`` so that worker and scheduler agree (calling the scheduler's
``add_resources`` alone breaks the worker). The engine on the cell stops or resumes taking
requests with the role.
"""

from __future__ import annotations

import asyncio
import time

from distributed.diagnostics.plugin import WorkerPlugin
from distributed.worker_state_machine import UnpauseEvent

from gyreflow.cluster.allocator import tune_allocator
from gyreflow.cluster.pools import ROLLOUT, TRAINER
from gyreflow.engine.service import PLUGIN_NAME as ENGINE_PLUGIN
from gyreflow.faults import FAULTS, InjectedFault

PLUGIN_NAME = "gyreflow-cell"


class CellService(WorkerPlugin):
    """Serves ``gyreflow_set_role(role)`` and ``gyreflow_training_done(timeout)`` on every worker
    that can be a cell, and ``gyreflow_fault(point, times)`` (:mod:`gyreflow.faults`)."""

    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.worker = None
        self.changes = 0
        self._changing: asyncio.Lock | None = None
        self._seq = -1

    async def setup(self, worker) -> None:
        self.worker = worker
        self._changing = asyncio.Lock()
        tune_allocator()
        worker.handlers["gyreflow_set_role"] = self.set_role
        worker.handlers["gyreflow_fault"] = self.fault
        worker.handlers["gyreflow_training_done"] = self.training_done

    def fault(self, point: str, times: int = 1, delay_s: float = 0.0) -> dict:
        """Arm fault ``point`` of this worker for the next ``times`` passes (tests); 0 disarms it.
        The reply says how often each point has fired here (``tripped``)."""
        try:
            FAULTS.arm(point, times, delay_s)
        except ValueError as err:
            return {"error": str(err)}
        return {"armed": point, "times": times, "tripped": FAULTS.count()}

    def trainer_tasks_running(self) -> int:
        return sum(1 for ts in self.worker.state.executing
                   if ts.resource_restrictions and TRAINER in ts.resource_restrictions)

    async def training_done(self, timeout: float) -> dict:
        """Wait until no trainer task runs here, ``timeout`` wall seconds at most; how many still run."""
        deadline = time.monotonic() + timeout
        while (running := self.trainer_tasks_running()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return {"running": running}

    async def set_role(self, role: str | None, seq: int | None = None) -> dict:
        """Serve ``role`` from now on (``None``: neither pool, the cell is held out); returns the
        time the change took. A change numbered ``seq`` is refused once one with a higher number was
        applied (the scheduler gave up on it and sent another)."""
        if role not in (ROLLOUT, TRAINER, None):
            return {"error": f"unknown role {role!r}; a cell is {ROLLOUT!r} or {TRAINER!r} (or None: held out)"}
        t0 = time.perf_counter()
        try:
            await FAULTS.trip("set_role")
        except InjectedFault as err:
            return {"error": f"role change to {role!r} failed: {err}"}
        async with self._changing:  # one change at a time, so that the newest is the one that holds
            if seq is not None:
                if seq <= self._seq:
                    return {"error": f"role change to {role!r} is older than one applied already "
                                     f"(number {seq} <= {self._seq})"}
                self._seq = seq
            return await self._change(role, t0)

    async def _change(self, role: str | None, t0: float) -> dict:
        engine = self.worker.plugins.get(ENGINE_PLUGIN)
        accepting = engine.accepting if engine is not None else None
        if engine is not None and role != ROLLOUT:
            engine.accepting = False
        try:
            await self.worker.set_resources(**{ROLLOUT: float(role == ROLLOUT), TRAINER: float(role == TRAINER)})
        except (OSError, RuntimeError) as err:  # the scheduler went away (the cluster is closing)
            if engine is not None:  # the role did not change: neither does what the engine takes
                engine.accepting = accepting
            return {"error": f"role change to {role!r} failed: {type(err).__name__}: {err}"}
        if engine is not None and role == ROLLOUT:
            engine.accepting = True
        # set_resources changes the worker's counts without a state-machine event, so tasks already
        # queued here for the new resource would wait for the next unrelated event: kick the loop.
        if self.worker.state.running:
            self.worker.handle_stimulus(UnpauseEvent(stimulus_id=f"gyreflow-role-{role}-{time.time()}"))
        self.changes += 1
        return {"role": role, "seconds": time.perf_counter() - t0}
