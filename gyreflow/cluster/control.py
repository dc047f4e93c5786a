"""The control loop: every tick (and at once when trainer work or executions come and go) it builds
a :class:`~gyreflow.cluster.placement.PoolSnapshot`, asks the placement policy for moves and hands
them to the :class:`~gyreflow.cluster.moves.Mover`; it also re-balances sessions across engines,
spreads queued trainer tasks and, every ``stall_check_s``, looks for stalled executions.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

from gyreflow.cluster.clock import Clock
from gyreflow.cluster.moves import Mover
from gyreflow.cluster.placement import Cell, Move, PlacementPolicy, PoolSnapshot
from gyreflow.cluster.pools import ROLLOUT, TRAINER, cell_roles, is_trainer_task, trainer_tasks
from gyreflow.cluster.routes import RouteTable
from gyreflow.cluster.routing import RouteSnapshot, RoutingOptions, rebalance_sessions
from gyreflow.cluster.stalls import EngineActivity, find_stalls
from gyreflow.cluster.status import Books

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timing:
    """The control loop's time constants, in seconds of the plugin's clock."""

    tick_s: float = 0.05
    """Longest time between two policy ticks (events wake the loop earlier)."""
    history_s: float = 0.25
    """Time between two samples kept for the dashboard."""
    rebalance_s: float = 0.25
    """Time between two re-balancings of sessions across engines."""
    stall_s: float = 300.0
    """An execution without progress this long is named as stalled."""
    stall_check_s: float = 10.0
    """Time between two looks for stalled executions."""
    handover_s: float = 600.0
    """Longest wait for a trainer task to finish on a cell moving to rollout (it stays a trainer)."""
    rate_window_s: float = 300.0
    """Time over which the rate of arriving training work is averaged (exponentially); it should span
    several steps, so that the rate is the steady need rather than a step's burst."""

    def __post_init__(self) -> None:
        for name in ("tick_s", "history_s", "rebalance_s", "stall_s", "stall_check_s", "handover_s", "rate_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class ArrivalRate:
    """Training work arriving, in cell-seconds per second, averaged exponentially over ``window_s``.

    A trainer task counts once, with its predicted duration, on the first update that sees it ready
    or running; a task that leaves and comes back (its cell died) counts again, as its work is redone.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.rate = 0.0
        self._seen: set = set()
        self._at: float | None = None

    def update(self, now: float, work: dict) -> float:
        """``work``: task key -> predicted seconds, for the trainer tasks ready or running at ``now``."""
        arrived = sum(s for k, s in work.items() if k not in self._seen)
        self._seen = set(work)
        if self._at is None:
            self._at = now
        dt = now - self._at
        if dt > 0:
            w = 1.0 - math.exp(-dt / self.window_s)
            self.rate += (arrived / dt - self.rate) * w
            self._at = now
        elif arrived:  # a second update at the same instant: the work counts, spread over no time
            self.rate += arrived / self.window_s
        return self.rate


class Controller:
    """Decides (by the policy) and starts moves; keeps the books for the dashboard."""

    def __init__(self, scheduler, policy: PlacementPolicy, routes: RouteTable, mover: Mover, books: Books,
                 clock: Clock, timing: Timing, routing: RoutingOptions | None = None) -> None:
        self.scheduler, self.policy, self.routes, self.mover, self.books = scheduler, policy, routes, mover, books
        self.clock, self.timing, self.routing = clock, timing, routing or RoutingOptions()
        self.home: dict[str, str] = {}
        """Cell -> the role it had when it joined."""
        self.idle_since: dict[str, float | None] = {}
        self.stalls: list[dict] = []
        self._reported: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._last_rebalance = float("-inf")
        self._last_stall_check = float("-inf")
        self._stall_check: asyncio.Task | None = None
        self._tokens: dict[str, int] = {}
        self.arrivals = ArrivalRate(timing.rate_window_s)
        self._closing = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._spawn(self._loop())

    def close(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()

    def poke(self) -> None:
        """Run a tick soon."""
        if self._wake is not None:
            self._wake.set()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _loop(self) -> None:
        while not self._closing:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.clock.to_wall(self.timing.tick_s))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                self.tick()
            except Exception:  # a bad tick must not stop placement for the rest of the run
                log.exception("gyreflow placement tick failed")

    # ------------------------------------------------------------------ state

    def roles(self) -> dict[str, str]:
        """Cell address -> role, for workers that hold a ``rollout`` or ``trainer`` resource."""
        out = cell_roles(self.scheduler)
        for addr, role in out.items():
            self.home.setdefault(addr, role)
        return out

    def snapshot(self) -> PoolSnapshot:
        now = self.clock.now()
        load = self.routes.load()
        roles = self.roles()
        for addr, to in list(self.mover.moving.items()):
            # A cell handing over is out of both pools until its running trainer task ends: it
            # counts in the pool it moves to, or the policy would take it for a cell that left.
            if addr not in roles and to in (ROLLOUT, TRAINER) and addr in self.scheduler.workers:
                roles[addr] = to
        cells = []
        for addr, role in sorted(roles.items()):
            ws = self.scheduler.workers.get(addr)
            n_train = len(trainer_tasks(ws))
            running = sum(1 for ts in ws.executing if is_trainer_task(ts)) if ws is not None else 0
            if role == TRAINER and n_train == 0:
                self.idle_since[addr] = self.idle_since.get(addr) or now
            else:
                self.idle_since[addr] = None
            self.mover.since.setdefault(addr, now)
            cells.append(Cell(addr, self.mover.moving.get(addr, role), sessions=load.get(addr, 0) if role == ROLLOUT else 0,
                              train_tasks=n_train, train_running=running, since=self.mover.since[addr], idle_since=self.idle_since[addr],
                              moving=addr in self.mover.moving, home=self.home.get(addr)))
        waiting = [ts for ts in self.scheduler.unrunnable if is_trainer_task(ts)]
        ready = waiting + [ts for c in cells for ts in trainer_tasks(self.scheduler.workers.get(c.address))]
        work = {ts.key: self.clock.from_wall(self.scheduler._get_prefix_duration(ts.prefix)) for ts in ready}
        return PoolSnapshot(time=now, cells=tuple(cells), train_waiting=len(waiting), route_waiting=self.routes.waiting,
                            train_backlog_s=sum(work.values()), train_rate=self.arrivals.update(now, work))

    # ------------------------------------------------------------------ the tick

    def tick(self) -> list[Move]:
        """One decision: snapshot, policy, start moves; books, re-balancing and stall checks."""
        snap = self.snapshot()
        idle = sum(1 for c in snap.cells if (c.role == ROLLOUT and c.sessions == 0) or (c.role == TRAINER and c.train_tasks == 0))
        self.books.account(snap.time, idle, {
            ROLLOUT: sum(c.role == ROLLOUT for c in snap.cells), TRAINER: sum(c.role == TRAINER for c in snap.cells),
            "sessions": {c.address: c.sessions for c in snap.cells if c.role == ROLLOUT}, "train_queued": snap.train_work,
        }, self.timing.history_s)
        self.books.roles_changed(snap.time, time.time(), self.roles())
        moves = [m for m in self.policy.decide(snap) if self.mover.claim(m.cell, m.to)]
        for m in moves:  # claimed: out of routing and decisions from now on
            self._spawn(self._apply(m, snap.time))
        self.mover.spread()
        if not self.mover.moving and snap.time - self._last_rebalance >= self.timing.rebalance_s:
            self._last_rebalance = snap.time
            self._rebalance_sessions()
        looking = self._stall_check is not None and not self._stall_check.done()
        if snap.time - self._last_stall_check >= self.timing.stall_check_s and not looking:
            # One look at a time: a blocked cell holds one up to answer_s.
            self._last_stall_check = snap.time
            self._stall_check = self._spawn(self.check_stalls())
        return moves

    async def _apply(self, move: Move, decided: float) -> None:
        entry = await self.mover.apply(move, decided, claimed=True)
        if not entry.get("error") and not entry.get("aborted"):
            self.idle_since[move.cell] = None
            self.poke()  # a failed move is retried at the next regular tick, not in a tight loop

    def _rebalance_sessions(self) -> None:
        """Move the youngest sessions with a generation in flight from crowded engines to the
        emptiest (the generation migrates; their next calls go there)."""
        snap = RouteSnapshot(self.routes.engines(), self.routes.sessions)
        count: dict[tuple[str, str], int] = {}
        for _, src, dst in rebalance_sessions(snap, self.routes.priority, self.routing.slack):
            count[(src, dst)] = count.get((src, dst), 0) + 1
        for (src, dst), n in count.items():
            # Any of the donor's sessions may go, youngest first: only those with a generation in
            # flight can move without losing their cached prefix, and the engine knows which they are.
            youngest = sorted(self.routes.on(src), key=lambda s: (-self.routes.priority.get(s, 0.0), s))
            self._spawn(self.mover.evict(src, dst, youngest, n))

    # ------------------------------------------------------------------ stalls

    async def check_stalls(self) -> list[dict]:
        """Ask every cell's engine what it holds; name the executions without progress."""
        cells = list(self.roles())

        async def ask(addr: str):
            try:
                return addr, await asyncio.wait_for(self.scheduler.rpc(addr).gyreflow_activity(),
                                                     timeout=self.mover.deadlines.answer_s)
            except Exception:  # blocked, gone, or no engine there
                return addr, None

        activities, unanswered = [], set()
        for addr, out in await asyncio.gather(*(ask(a) for a in cells)):
            if not out:
                unanswered.add(addr)
                continue
            advanced = out["tokens"] != self._tokens.get(addr)
            self._tokens[addr] = out["tokens"]
            activities.append(EngineActivity(addr, advanced, out["requests"], out["idle"]))
        now = time.time()
        live = {s: now - t for s, t in self.routes.routed_at.items()}
        stall_wall = self.clock.to_wall(self.timing.stall_s)
        silent = {s: e for s, e in self.routes.sessions.items() if e in unanswered}
        found = find_stalls(live, activities, stall_wall, self.routes.waiting > 0, silent)
        for s in found:
            s["seconds"] = self.clock.from_wall(s["seconds"])
            if s["execution"] not in self._reported:
                log.warning("gyreflow: execution %s has made no progress for %.0fs; it waits on %s",
                            s["execution"], s["seconds"], s["waits_on"])
                self.scheduler.log_event("gyreflow-stalls", s)
        self._reported = {s["execution"] for s in found}
        self.stalls = found
        return found
