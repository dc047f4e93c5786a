"""The gyreflow scheduler plugin: routes model calls to engines and moves cells between pools.

Registered from the client (``client.register_plugin(PoolsPlugin(...))``). It is made of parts with
one concern each, like Dask's own scheduler extensions:

- :class:`~gyreflow.cluster.routes.RouteTable`: sessions -> engines (decisions in
  :mod:`gyreflow.cluster.routing`);
- :class:`~gyreflow.cluster.control.Controller`: the control loop (snapshot, policy, moves,
  session re-balancing, stall checks);
- :class:`~gyreflow.cluster.moves.Mover`: carries out moves, retirements and evictions;
- :mod:`gyreflow.cluster.stealing`: trainer tasks follow the trainer pool;
- :class:`~gyreflow.cluster.status.Books` and :class:`~gyreflow.cluster.status.PoolsStatus`: the
  books, and the one status object everything reads.

Its public surface is the RPCs below (tests, benchmarks, pipelines and the CLI use nothing else):

``gyreflow_route``, ``gyreflow_release``, ``gyreflow_locate``, ``gyreflow_imported``, ``gyreflow_where``
    Routing (:mod:`gyreflow.cluster.routes`).
``gyreflow_pools()``
    The :class:`~gyreflow.cluster.status.PoolsStatus` as a dict.
``gyreflow_placement(mode, options, timing, routing, deadlines)``
    Switch the placement mode (e.g. at the start of a pipeline) and the plugin's settings.
``gyreflow_move(cell, to, reason)``
    Apply one move now, as the control loop applies a policy's; returns its log entry.
``gyreflow_join(cell, role)`` / ``gyreflow_retire(cell)``
    A worker held out of the pools becomes a cell; a cell leaves the cluster without losing work.
``gyreflow_stalls()``
    Look for stalled executions now.
``gyreflow_fault(cell, point, times, delay_s)``
    Arm a fault point on a cell (:mod:`gyreflow.faults`; for stress tests).
"""

from __future__ import annotations

import time

from distributed.diagnostics.plugin import SchedulerPlugin

from gyreflow.cluster import dashboard
from gyreflow.cluster.clock import WALL, Clock
from gyreflow.cluster.control import Controller, Timing
from gyreflow.cluster.modes import mode as placement_mode
from gyreflow.cluster.moves import Deadlines, MoveFailed, Mover
from gyreflow.cluster.placement import Move
from gyreflow.cluster.pools import ROLLOUT, TRAINER, cell_roles, is_trainer_task, results_still_needed, trainer_tasks
from gyreflow.cluster.routes import RouteTable
from gyreflow.cluster.routing import RoutingOptions
from gyreflow.cluster.status import Books, PoolsStatus

PLUGIN_NAME = "gyreflow-pools"


class PoolsPlugin(SchedulerPlugin):
    """Routes sessions to rollout engines and moves cells by a placement mode's policy.

    Parameters
    ----------
    mode
        Placement mode (:mod:`gyreflow.cluster.modes`); a pipeline may change it with
        ``gyreflow_placement``.
    options
        Options of the mode's policy (times in seconds of ``clock``).
    clock
        The clock every time constant is read on: wall time by default; the placement benchmark
        gives its emulated clock.
    timing
        The control loop's time constants.
    history_len
        Samples and moves kept for the dashboard.
    routing
        Session routing and re-balancing.
    deadlines
        Longest waits (wall seconds) for a cell to answer a step of a move.
    """

    name = PLUGIN_NAME

    def __init__(self, mode: str = "async", options: dict | None = None, clock: Clock = WALL,
                 timing: Timing | None = None, history_len: int = 4000, routing: RoutingOptions | None = None,
                 deadlines: Deadlines | None = None) -> None:
        self.mode, self.options = mode, dict(options or {})
        policy = placement_mode(mode).make_policy(**self.options)
        self.clock, self.timing, self.routing = clock, timing or Timing(), routing or RoutingOptions()
        self.deadlines = deadlines or Deadlines()
        self.scheduler = None
        self.books = Books(history_len)
        self._policy = policy
        self._closing = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        self.routes = RouteTable(engines=lambda: self.mover.engines(), poke=lambda: self.controller.poke())
        self.mover = Mover(scheduler, self.routes, self.books, lambda: cell_roles(scheduler), self.clock,
                           self.timing.handover_s, self.deadlines)
        self.controller = Controller(scheduler, self._policy, self.routes, self.mover, self.books, self.clock, self.timing,
                                     self.routing)
        handlers = {
            "route": self.routes.route, "release": self.routes.release, "locate": self.locate,
            "imported": self.routes.imported, "where": self.routes.where, "ready": self.routes.ready, "pools": self.pools, "placement": self.placement, "move": self.move,
            "join": self.join, "retire": self.retire, "stalls": self.stalls, "fault": self.fault,
        }
        for name, fn in handlers.items():
            scheduler.handlers[f"gyreflow_{name}"] = fn
        self.routes.start()
        self.controller.start()
        dashboard.register(scheduler, self)

    async def close(self) -> None:
        self._closing = True
        dashboard.unregister(self.scheduler, self)
        self.controller.close()

    def add_worker(self, scheduler, worker: str) -> None:
        self.mover.since[worker] = self.clock.now()
        self.controller.poke()

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        self.routes.forget_engine(worker)  # its sessions are re-routed at their next call
        self.routes.forget_caller(worker)  # executions that ran there are re-run as new sessions
        self.routes.unready.discard(worker)
        self.routes.announced.discard(worker)
        self.mover.since.pop(worker, None)
        self.controller.idle_since.pop(worker, None)
        self.books.roles_changed(self.clock.now(), time.time(), {a: r for a, r in cell_roles(scheduler).items()
                                                                  if a != worker})

    def valid_workers_downscaling(self, scheduler, workers: list) -> list:
        """When the cluster manager shrinks the cluster (``cluster.adapt``), spare the cells that
        hold work now: a trainer cell with trainer tasks, a cell with gradient sums an update has
        not taken yet, a rollout cell serving sessions, a cell being moved. Roles are the plugin's; counts stay the cluster manager's."""
        busy = set(self.mover.moving) | set(self.routes.sessions.values())
        busy |= {addr for addr in cell_roles(scheduler) if trainer_tasks(scheduler.workers.get(addr))}
        busy |= {addr for addr, ws in scheduler.workers.items() if results_still_needed(ws)}
        return [ws for ws in workers if ws.address not in busy]

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if finish in ("processing", "no-worker", "memory", "erred") or start == "processing":
            ts = self.scheduler.tasks.get(key)
            if ts is not None and is_trainer_task(ts):
                self.controller.poke()

    # ------------------------------------------------------------------ RPCs

    def status(self) -> PoolsStatus:
        """The one status object (dashboard, metrics, reports and the ``gyreflow_pools`` RPC)."""
        roles = cell_roles(self.scheduler)
        load = {a: 0 for a, r in roles.items() if r == ROLLOUT}
        for e in self.routes.sessions.values():
            load[e] = load.get(e, 0) + 1
        waiting = sum(1 for ts in self.scheduler.unrunnable if is_trainer_task(ts))
        return PoolsStatus(
            time=self.clock.now(), wall=time.time(), mode=self.mode,
            pools={ROLLOUT: sorted(a for a, r in roles.items() if r == ROLLOUT),
                   TRAINER: sorted(a for a, r in roles.items() if r == TRAINER)},
            moving=sorted(self.mover.moving), sessions=load,
            train_tasks={a: len(trainer_tasks(self.scheduler.workers.get(a))) for a in roles},
            train_waiting=waiting, route_waiting=self.routes.waiting, routed=self.routes.routed,
            **{k: v for k, v in self.books.counters().items() if k != "routed"},
            move_log=list(self.books.move_log)[-50:], timeline=list(self.books.timeline),
            stalls=list(self.controller.stalls), history=list(self.books.history),
        )

    def pools(self, history: bool = False) -> dict:
        """The status as a dict (``history`` adds the dashboard's samples)."""
        out = self.status().to_dict()
        if not history:
            out["history"] = []
        return out

    def placement(self, mode: str, options: dict | None = None, timing: dict | None = None,
                  routing: dict | None = None, deadlines: dict | None = None) -> dict:
        """Switch the placement mode (e.g. at the start of a pipeline), the loop's timing, routing and
        the deadlines of moves."""
        try:
            policy = placement_mode(mode).make_policy(**(options or {}))
            if placement_mode(mode).moves_cells and self.scheduler.extensions.get("stealing") is None:
                # a cell leaving the trainer pool hands its queued trainer tasks over by stealing
                raise ValueError(f"placement {mode!r} moves cells, which needs Dask's work stealing: start the "
                                 "scheduler with distributed.scheduler.work-stealing: True")
            new_timing = Timing(**timing) if timing else self.timing
            new_routing = RoutingOptions(**routing) if routing else self.routing
            new_deadlines = Deadlines(**deadlines) if deadlines else self.deadlines
        except (ValueError, TypeError) as err:
            return {"error": str(err)}
        self.mode, self.options = mode, dict(options or {})
        self.timing = self.controller.timing = new_timing
        self.controller.arrivals.window_s = new_timing.rate_window_s
        self.mover.handover_s = new_timing.handover_s
        self.routing = self.controller.routing = new_routing
        self.deadlines = self.mover.deadlines = new_deadlines
        self.controller.policy = policy
        self.controller.poke()
        return {"mode": mode}

    def locate(self, request_id: str, engine: str | None = None) -> dict:
        """The cell that imported a migrated request, if any; with ``engine``, whether that worker
        is still in the cluster (``alive``)."""
        out = self.routes.locate(request_id)
        return out if engine is None else out | {"alive": engine in self.scheduler.workers}

    async def move(self, cell: str, to: str, reason: str = "asked") -> dict:
        """Apply one move now; its log entry."""
        if cell not in cell_roles(self.scheduler):
            return {"cell": cell, "to": to, "error": f"{cell} is not a cell of this cluster"}
        return await self.mover.apply(Move(cell, to, reason))

    async def join(self, cell: str, role: str) -> dict:
        """A worker held out of both pools takes ``role`` (it joins the cells)."""
        if cell not in self.scheduler.workers:
            return {"error": f"no worker {cell}"}
        try:
            out = await self.mover.set_role(cell, role)
        except MoveFailed as err:
            return {"error": str(err)}
        self.controller.home[cell] = role
        self.mover.since[cell] = self.clock.now()
        self.books.roles_changed(self.clock.now(), time.time(), cell_roles(self.scheduler))
        await self.routes.engines_changed()
        self.controller.poke()
        return out

    async def retire(self, cell: str) -> dict:
        """Take ``cell`` out of the cluster; its generations migrate first."""
        return await self.mover.retire(cell)

    async def stalls(self) -> list[dict]:
        return await self.controller.check_stalls()

    async def fault(self, cell: str, point: str, times: int = 1, delay_s: float = 0.0) -> dict:
        try:
            return await self.scheduler.rpc(cell).gyreflow_fault(point=point, times=times, delay_s=delay_s)
        except OSError as err:
            return {"error": f"{cell}: {err}"}
