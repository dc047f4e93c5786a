"""The gyreflow scheduler plugin: routes model calls to engines and moves cells between pools.

Registered from the client (``client.register_plugin(PoolsPlugin())``). Every ``interval`` seconds,
and at once when trainer work or executions come and go, it builds a
:class:`~gyreflow.cluster.placement.PoolSnapshot`, asks the run's placement policy for moves and
applies them:

rollout -> trainer
    The cell stops taking calls, its live generations migrate (KV cache and sampler state) to the
    other rollout cells, then ``Worker.set_resources`` makes it a trainer; trainer tasks waiting for
    a cell (``no-worker``) are scheduled and queued ones are stolen onto it.
trainer -> rollout
    Only a cell without trainer tasks; its engine takes calls again.

RPCs it serves (for routers, engines, pipelines and the CLI): ``gyreflow_route``,
``gyreflow_release``, ``gyreflow_locate``, ``gyreflow_imported``, ``gyreflow_placement``,
``gyreflow_pools``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from distributed.diagnostics.plugin import SchedulerPlugin

from gyreflow.cluster import dashboard
from gyreflow.cluster.placement import Cell, Move, PlacementPolicy, PoolSnapshot, make_policy
from gyreflow.cluster.policy import RouteSnapshot, choose_engine, rebalance_sessions
from gyreflow.cluster.pools import ROLLOUT, TRAINER

log = logging.getLogger(__name__)

PLUGIN_NAME = "gyreflow-pools"


def _trainer_task(ts) -> bool:
    return bool(ts.resource_restrictions) and TRAINER in ts.resource_restrictions


class PoolsPlugin(SchedulerPlugin):
    """Routes sessions to rollout engines and moves cells by a placement policy.

    Parameters
    ----------
    mode
        Placement mode (``async`` keeps the pools as started; see
        :mod:`gyreflow.cluster.placement`); a pipeline may change it with ``gyreflow_placement``.
    interval
        Seconds between policy ticks when nothing wakes the loop earlier.
    history_s
        Seconds between the samples kept for the dashboard.
    rebalance_s
        Seconds between re-balancings of sessions across the rollout engines.
    """

    name = PLUGIN_NAME

    def __init__(self, mode: str = "async", options: dict | None = None, interval: float = 0.05,
                 history_s: float = 0.25, history_len: int = 4000, rebalance_s: float = 0.25) -> None:
        self.mode, self.options = mode, dict(options or {})
        self.policy: PlacementPolicy = make_policy(mode, **self.options)
        self.interval, self.history_s, self.rebalance_s = interval, history_s, rebalance_s
        self.scheduler = None
        self.sessions: dict[str, str] = {}
        """session -> engine address it is routed to."""
        self.priority: dict[str, float] = {}
        """session -> admission priority its router gave (its execution's start time)."""
        self.rebalanced = 0
        self._last_rebalance = 0.0
        self.located: dict[str, str] = {}
        """request id -> cell that imported it in a migration (dropped when its session ends)."""
        self.since: dict[str, float] = {}
        self.idle_since: dict[str, float | None] = {}
        self.moving: dict[str, str] = {}
        """Cells whose move is being applied -> the role they are moving to."""
        self.route_waiting = 0
        self.routed = 0
        self.moves_total = 0
        self.migrations_total = 0
        self.migrated_bytes = 0
        self.idle_cell_seconds = 0.0
        self.move_log: deque[dict] = deque(maxlen=history_len)
        self.history: deque[dict] = deque(maxlen=history_len)
        self._wake: asyncio.Event | None = None
        self._engines_changed: asyncio.Condition | None = None
        self._loop_task: asyncio.Task | None = None
        self._move_tasks: set[asyncio.Task] = set()
        self._last_tick = self._last_sample = 0.0
        self._closing = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        for name in ("route", "release", "locate", "imported", "placement", "pools"):
            scheduler.handlers[f"gyreflow_{name}"] = getattr(self, name)
        self._wake = asyncio.Event()
        self._engines_changed = asyncio.Condition()
        now = time.time()
        for addr in scheduler.workers:
            self.since.setdefault(addr, now)
        self._last_tick = self._last_sample = now
        self._loop_task = asyncio.create_task(self._control_loop())
        dashboard.register(scheduler, self)

    async def close(self) -> None:
        self._closing = True
        dashboard.unregister(self.scheduler, self)
        for t in [self._loop_task, *self._move_tasks]:
            if t is not None:
                t.cancel()

    def add_worker(self, scheduler, worker: str) -> None:
        self.since[worker] = time.time()
        self.poke()

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        # Sessions on a departed engine are re-routed at their next call.
        for s in [s for s, e in self.sessions.items() if e == worker]:
            del self.sessions[s]
        self.since.pop(worker, None)
        self.idle_since.pop(worker, None)
        self.moving.pop(worker, None)
        self.poke()

    def valid_workers_downscaling(self, scheduler, workers: list) -> list:
        """When the cluster manager shrinks the cluster (``cluster.adapt``), spare the cells that
        hold work now: a trainer cell with trainer tasks, a rollout cell serving sessions, a cell
        being moved. Roles are the plugin's; counts stay the cluster manager's."""
        busy = set(self.moving) | set(self.sessions.values())
        busy |= {addr for addr in self.roles() if self._train_tasks(addr)}
        return [ws for ws in workers if ws.address not in busy]

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if finish in ("processing", "no-worker", "memory", "erred") or start == "processing":
            ts = self.scheduler.tasks.get(key)
            if ts is not None and _trainer_task(ts):
                self.poke()

    def poke(self) -> None:
        """Run a policy tick soon."""
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------ pools

    def roles(self) -> dict[str, str]:
        """Cell address -> role, for workers that hold a ``rollout`` or ``trainer`` resource."""
        out = {}
        for addr, ws in self.scheduler.workers.items():
            if ws.resources.get(ROLLOUT, 0) > 0:
                out[addr] = ROLLOUT
            elif ws.resources.get(TRAINER, 0) > 0:
                out[addr] = TRAINER
        return out

    def rollout_engines(self) -> tuple[str, ...]:
        return tuple(a for a, r in sorted(self.roles().items()) if r == ROLLOUT and a not in self.moving)

    def _train_tasks(self, addr: str) -> list:
        ws = self.scheduler.workers.get(addr)
        return [ts for ts in ws.processing if _trainer_task(ts)] if ws is not None else []

    def snapshot(self) -> PoolSnapshot:
        now = time.time()
        per_engine: dict[str, int] = {}
        for e in self.sessions.values():
            per_engine[e] = per_engine.get(e, 0) + 1
        cells = []
        for addr, role in sorted(self.roles().items()):
            n_train = len(self._train_tasks(addr))
            if role == TRAINER and n_train == 0:
                self.idle_since[addr] = self.idle_since.get(addr) or now
            else:
                self.idle_since[addr] = None
            cells.append(Cell(addr, self.moving.get(addr, role), sessions=per_engine.get(addr, 0) if role == ROLLOUT else 0,
                              train_tasks=n_train, since=self.since.get(addr, 0.0),
                              idle_since=self.idle_since[addr], moving=addr in self.moving))
        waiting = [ts for ts in self.scheduler.unrunnable if _trainer_task(ts)]
        ready = waiting + [ts for addr in self.roles() for ts in self._train_tasks(addr)]
        backlog = sum(self.scheduler._get_prefix_duration(ts.prefix) for ts in ready)
        return PoolSnapshot(time=now, cells=tuple(cells), train_waiting=len(waiting), route_waiting=self.route_waiting,
                            train_backlog_s=backlog)

    # ------------------------------------------------------------------ routing RPCs

    async def route(self, session: str, engine: str | None = None, timeout: float = 600.0,
                    priority: float | None = None) -> dict:
        """The engine for ``session``'s next call (``engine`` records where a migration took it).

        With no engine in the rollout pool the call waits for one (up to ``timeout`` s), and
        counts as rollout demand meanwhile.
        """
        if priority is not None:
            self.priority[session] = priority
        if engine is not None:
            self.sessions[session] = engine
            return {"engine": engine}
        deadline = time.monotonic() + timeout
        self.route_waiting += 1
        try:
            while not self.rollout_engines():
                self.poke()
                async with self._engines_changed:
                    try:
                        await asyncio.wait_for(self._engines_changed.wait(), timeout=max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        return {"error": f"no engine in the rollout pool for {timeout:.0f}s"}
        finally:
            self.route_waiting -= 1
        snap = RouteSnapshot(engines=self.rollout_engines(), sessions=self.sessions)
        chosen = choose_engine(session, snap)
        if self.sessions.get(session) != chosen:
            self.poke()
        self.sessions[session] = chosen
        self.routed += 1
        return {"engine": chosen}

    def release(self, session: str) -> None:
        """The session ended (or must be routed afresh): forget its route, and where migrations took
        its requests (ids ``<session>`` or ``<session>/...``; not those of a session ``<session>0``)."""
        if self.sessions.pop(session, None) is not None:
            self.poke()
        self.priority.pop(session, None)
        for rid in [r for r in self.located if r == session or r.startswith(f"{session}/")]:
            del self.located[rid]

    def locate(self, request_id: str) -> dict:
        """The cell that imported a migrated request, if any."""
        return {"engine": self.located.get(request_id)}

    def imported(self, request_ids: list[str], engine: str) -> None:
        for rid in request_ids:
            self.located[rid] = engine

    def placement(self, mode: str, options: dict | None = None) -> dict:
        """Switch the placement policy (e.g. at the start of a pipeline)."""
        try:
            policy = make_policy(mode, **(options or {}))
        except (ValueError, TypeError) as err:
            return {"error": str(err)}
        self.mode, self.options, self.policy = mode, dict(options or {}), policy
        self.poke()
        return {"mode": mode}

    def pools(self) -> dict:
        """Cells by role, live sessions per engine and the counters (for the CLI, tests, dashboard)."""
        return self.state()

    def state(self) -> dict:
        roles = self.roles()
        per_engine = {a: 0 for a, r in roles.items() if r == ROLLOUT}
        for e in self.sessions.values():
            per_engine[e] = per_engine.get(e, 0) + 1
        return {
            "time": time.time(),
            "mode": self.mode,
            "pools": {ROLLOUT: sorted(a for a, r in roles.items() if r == ROLLOUT),
                      TRAINER: sorted(a for a, r in roles.items() if r == TRAINER)},
            "moving": sorted(self.moving),
            "sessions": per_engine,
            "train_tasks": {a: len(self._train_tasks(a)) for a in roles},
            "routed": self.routed,
            "moves": self.moves_total,
            "migrations": self.migrations_total,
            "rebalanced_sessions": self.rebalanced,
            "migrated_bytes": self.migrated_bytes,
            "idle_cell_seconds": self.idle_cell_seconds,
            "move_log": list(self.move_log)[-50:],
        }

    # ------------------------------------------------------------------ the control loop

    async def _control_loop(self) -> None:
        while not self._closing:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                self.tick()
            except Exception:  # a bad tick must not stop placement for the rest of the run
                log.exception("gyreflow placement tick failed")

    def tick(self) -> list[Move]:
        """One decision: snapshot, policy, apply; also keeps the books for the dashboard."""
        snap = self.snapshot()
        self._account(snap)
        moves = [m for m in self.policy.decide(snap) if m.cell not in self.moving]
        for m in moves:
            self.moving[m.cell] = m.to
            task = asyncio.create_task(self.apply(m, decided=snap.time))
            self._move_tasks.add(task)
            task.add_done_callback(self._move_tasks.discard)
        self._rebalance_trainer_tasks()
        if not self.moving and snap.time - self._last_rebalance >= self.rebalance_s:
            self._last_rebalance = snap.time
            self._rebalance_sessions()
        return moves

    def _rebalance_sessions(self) -> None:
        """Move the youngest sessions of crowded engines to the emptiest (their generation in
        flight migrates; their next call goes there)."""
        plan = rebalance_sessions(RouteSnapshot(self.rollout_engines(), self.sessions), self.priority)
        by_pair: dict[tuple[str, str], list[str]] = {}
        for session, src, dst in plan:
            self.sessions[session] = dst
            by_pair.setdefault((src, dst), []).append(session)
        for (src, dst), sessions in by_pair.items():
            self.rebalanced += len(sessions)
            task = asyncio.create_task(self._evict(src, dst, sessions))
            self._move_tasks.add(task)
            task.add_done_callback(self._move_tasks.discard)

    async def _evict(self, src: str, dst: str, sessions: list[str]) -> None:
        try:
            out = await self.scheduler.rpc(src).gyreflow_evict(sessions=sessions, destinations=[dst])
        except OSError:  # the engine left; its sessions are re-routed at their next call anyway
            return
        for rid, d in out.get("moved", {}).items():
            self.located[rid] = d
        self.migrations_total += len(out.get("moved", {}))
        self.migrated_bytes += int(out.get("bytes", 0))

    def _account(self, snap: PoolSnapshot) -> None:
        dt = snap.time - self._last_tick
        self._last_tick = snap.time
        idle = sum(1 for c in snap.cells if (c.role == ROLLOUT and c.sessions == 0) or (c.role == TRAINER and c.train_tasks == 0))
        self.idle_cell_seconds += idle * dt
        if snap.time - self._last_sample >= self.history_s:
            self._last_sample = snap.time
            self.history.append({
                "time": snap.time,
                ROLLOUT: sum(c.role == ROLLOUT for c in snap.cells),
                TRAINER: sum(c.role == TRAINER for c in snap.cells),
                "sessions": {c.address: c.sessions for c in snap.cells if c.role == ROLLOUT},
                "train_queued": snap.train_work,
                "moves": self.moves_total,
                "migrations": self.migrations_total,
            })

    async def apply(self, move: Move, decided: float) -> dict:
        """Carry out one move; the cell stays out of routing and decisions meanwhile (also when
        the move comes from elsewhere than the control loop, e.g. a benchmark or a test)."""
        self.moving.setdefault(move.cell, move.to)
        entry = {"cell": move.cell, "to": move.to, "reason": move.reason, "decided": decided}
        try:
            if move.to == TRAINER:
                entry |= await self._to_trainer(move.cell)
            else:
                entry |= await self._to_rollout(move.cell)
        except Exception as err:  # the cell died or refused: it keeps (or loses) its role
            entry["error"] = f"{type(err).__name__}: {err}"
        finally:
            self.moving.pop(move.cell, None)
        entry["applied"] = time.time()
        self.since[move.cell] = entry["applied"]  # an aborted move also waits a dwell before the next try
        if "error" not in entry and not entry.get("aborted"):
            self.moves_total += 1
            self.idle_since[move.cell] = None
        self.move_log.append(entry)
        self.scheduler.log_event("gyreflow-moves", entry)
        if "error" not in entry and not entry.get("aborted"):
            self.poke()  # an aborted move is retried at the next regular tick, not in a tight loop
        async with self._engines_changed:
            self._engines_changed.notify_all()
        return entry

    async def _to_trainer(self, addr: str) -> dict:
        others = [a for a in self.rollout_engines() if a != addr]
        load = {a: 0 for a in others}
        for e in self.sessions.values():
            if e in load:
                load[e] += 1
        # Spread by spare room: a cell appears once per session it has fewer than the busiest.
        # With no other rollout cell, only a cell without generations can go (colocated).
        top = max(load.values(), default=0)
        destinations = [a for a in sorted(others, key=lambda a: load[a]) for _ in range(top - load[a] + 1)]
        t0 = time.time()
        drained = await self.scheduler.rpc(addr).gyreflow_drain(destinations=destinations)
        t1 = time.time()
        if drained.get("kept"):
            return {"aborted": f"{drained['kept']} generations could not move"
                    + ("" if others else " (no other rollout cell)")}
        for session in [s for s, e in self.sessions.items() if e == addr]:
            del self.sessions[session]  # re-routed at its next call (or where its generation went)
        for rid, dest in drained.get("moved", {}).items():
            self.located[rid] = dest
        self.migrations_total += len(drained.get("moved", {}))
        self.migrated_bytes += int(drained.get("bytes", 0))
        out = await self.scheduler.rpc(addr).gyreflow_set_role(role=TRAINER)
        if "error" in out:
            raise RuntimeError(out["error"])
        self._schedule_unrunnable(addr)
        self._rebalance_trainer_tasks()  # queued shares elsewhere come over now, not at the next tick
        return {"migrated": len(drained.get("moved", {})), "migration_s": drained.get("seconds", 0.0),
                "drain_s": t1 - t0, "role_s": time.time() - t1, "bytes": drained.get("bytes", 0)}

    async def _to_rollout(self, addr: str) -> dict:
        if self._train_tasks(addr):
            return {"aborted": "trainer tasks on the cell"}
        out = await self.scheduler.rpc(addr).gyreflow_set_role(role=ROLLOUT)
        if "error" in out:
            raise RuntimeError(out["error"])
        return {}

    def _schedule_unrunnable(self, addr: str) -> None:
        """Trainer tasks left in ``no-worker`` are not woken by new resources: schedule them."""
        ws = self.scheduler.workers.get(addr)
        if ws is None:
            return
        recs = self.scheduler.bulk_schedule_unrunnable_after_adding_worker(ws)
        if recs:
            self.scheduler.transitions(recs, stimulus_id=f"gyreflow-new-trainer-{time.time()}")

    def _rebalance_trainer_tasks(self) -> None:
        """Restricted tasks are assigned to a worker at once, so they can pile up on one trainer
        cell (or sit on a cell that left the pool); steal queued ones onto idle trainer cells."""
        stealing = self.scheduler.extensions.get("stealing")
        if stealing is None:
            return
        roles = self.roles()
        trainers = [a for a, r in roles.items() if r == TRAINER and a not in self.moving]
        load = {a: len(self._train_tasks(a)) for a in trainers}
        donors = []
        for addr in roles:
            ws = self.scheduler.workers[addr]
            # A worker runs its queue in priority order, so the first task is (or soon will be) the
            # one executing: a steal of it would be refused. Donate from the back of the queue.
            tasks = sorted(self._train_tasks(addr), key=lambda ts: ts.priority or ())
            keep = 0 if roles[addr] != TRAINER else 1
            queued = [ts for ts in tasks[keep:] if ts not in ws.executing]
            donors.extend(ts for ts in reversed(queued)
                          if not ts.worker_restrictions and ts not in stealing.in_flight)
        for ts in donors:
            thief = min(trainers, key=lambda a: load[a], default=None)
            victim = ts.processing_on
            if thief is None or victim is None or load[thief] >= 1 and victim.address in load and load[victim.address] <= load[thief] + 1:
                continue
            stealing.move_task_request(ts, victim, self.scheduler.workers[thief])
            load[thief] += 1
            if victim.address in load:
                load[victim.address] -= 1
