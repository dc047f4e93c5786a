"""Carrying out moves: a cell changes pool, a cell leaves the cluster, sessions change engine.

rollout -> trainer
    The cell stops taking calls, its live and waiting generations migrate (KV cache and sampler
    state) to the other rollout cells, then ``Worker.set_resources`` makes it a trainer; trainer
    tasks waiting for a cell are scheduled and queued ones are stolen onto it.
trainer -> rollout
    The cell leaves the trainer pool (no trainer task starts there any more; the trainer cells
    steal those queued on it), the trainer task it runs finishes (``handover_s`` at most, or the
    cell stays a trainer), then its engine takes calls again.
retire
    A cell leaving the cluster (spot capacity reclaimed, a host drained): its generations migrate,
    it leaves both pools, the update that needs the gradient sums it holds takes them
    (``handover_s`` at most), then the scheduler retires the worker.

A move that fails at any point leaves the cell in a role it can serve (a drained cell that cannot
become a trainer takes calls again) and every generation where it was or where it went: the
engines never drop an exported generation (:mod:`gyreflow.engine.service`). A cell that does not
answer within its :class:`Deadlines` fails the move; the request it answers late changes nothing
(a role change carries a sequence number, and a cell applies none older than one it applied).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gyreflow.cluster.clock import Clock
from gyreflow.cluster.placement import Move
from gyreflow.cluster.pools import ROLLOUT, TRAINER, is_cell, results_still_needed, role_of, trainer_tasks
from gyreflow.cluster.routes import RouteTable
from gyreflow.cluster.stealing import schedule_unrunnable, spread_trainer_tasks
from gyreflow.cluster.status import Books
from gyreflow.engine.service import IMPORT_TIMEOUT_S, UNSEND_TIMEOUT_S

log = logging.getLogger(__name__)

RESTORE_TRIES = 3
"""Role changes tried to put a cell back after a failed move."""


class MoveFailed(RuntimeError):
    """A step of a move failed; the cell was put back in a role it can serve."""


@dataclass(frozen=True)
class Deadlines:
    """Longest waits, in wall seconds whatever the plugin's clock, for a cell to answer a step of a
    move: a cell whose event loop hangs must not hold its move open, nor the cell out of new moves."""

    answer_s: float = 60.0
    """A request a cell that answers serves in milliseconds: a role change, an activity report for
    the stall detector; added to ``handover_s`` for the wait on a trainer task."""
    migration_s: float = 2 * (IMPORT_TIMEOUT_S + UNSEND_TIMEOUT_S) + 60.0
    """A drain or an eviction: the cell's own sends give up after ``IMPORT_TIMEOUT_S`` (and their
    withdrawals after ``UNSEND_TIMEOUT_S``), and one may wait for another migration of the cell."""

    def __post_init__(self) -> None:
        for name in ("answer_s", "migration_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class Mover:
    """Applies moves for the scheduler plugin; every cell being moved is in :attr:`moving`.

    Parameters
    ----------
    scheduler
        The Dask scheduler.
    routes
        The route table (sessions of a drained cell are re-routed; migrated requests located).
    books
        Counters and the move log.
    roles
        Cell address -> role now (from the workers' resources).
    clock
        The plugin's clock (moves are stamped with it).
    handover_s
        Longest wait (clock seconds) for a trainer task to finish on a cell moving to rollout.
    deadlines
        Longest waits (wall seconds) for a cell to answer.
    """

    def __init__(self, scheduler, routes: RouteTable, books: Books, roles: Callable[[], dict[str, str]],
                 clock: Clock, handover_s: float = 600.0, deadlines: Deadlines | None = None) -> None:
        self.scheduler, self.routes, self.books, self.roles, self.clock = scheduler, routes, books, roles, clock
        self.handover_s = handover_s
        self.deadlines = deadlines or Deadlines()
        self._role_seq = 0
        self.moving: dict[str, str] = {}
        """Cell -> the role it is moving to (``"gone"`` for a retiring cell)."""
        self.since: dict[str, float] = {}
        """Cell -> clock time it took its role (or a move of it last ended)."""

    def engines(self) -> tuple[str, ...]:
        """Rollout cells that take calls now."""
        return tuple(a for a, r in sorted(self.roles().items()) if r == ROLLOUT and a not in self.moving)

    def trainers(self) -> list[str]:
        return [a for a, r in self.roles().items() if r == TRAINER and a not in self.moving]

    def spread(self) -> None:
        # Donors: every cell, those between pools too (a cell handing over, or leaving, keeps none).
        cells = {a: role_of(ws.resources) for a, ws in list(self.scheduler.workers.items()) if is_cell(ws.resources)}
        spread_trainer_tasks(self.scheduler, cells, self.trainers())

    def claim(self, cell: str, to: str) -> bool:
        """Mark ``cell`` as moving to ``to`` (out of routing and decisions) unless a move of it is
        under way; whether it was claimed."""
        if cell in self.moving:
            return False
        self.moving[cell] = to
        return True

    async def apply(self, move: Move, decided: float | None = None, claimed: bool = False) -> dict:
        """Carry out ``move`` (``claimed``: the caller claimed the cell for it); the log entry
        (``error`` or ``aborted`` when it did not happen)."""
        decided = self.clock.now() if decided is None else decided
        if not claimed and not self.claim(move.cell, move.to):
            return {"cell": move.cell, "to": move.to,
                    "aborted": f"a move of the cell to {self.moving[move.cell]} is under way"}
        entry = {"cell": move.cell, "to": move.to, "reason": move.reason, "decided": decided,
                 "decided_wall": time.time()}
        try:
            if self.roles().get(move.cell) == move.to:
                entry["aborted"] = f"the cell is a {move.to} cell already"
            elif move.to == TRAINER:
                entry |= await self._to_trainer(move.cell)
            elif move.to == ROLLOUT:
                entry |= await self._to_rollout(move.cell)
            else:
                entry["aborted"] = f"unknown role {move.to!r}"
        except Exception as err:  # a cell that died or refused keeps (or loses) its role; logged
            entry["error"] = f"{type(err).__name__}: {err}"
        finally:
            self.moving.pop(move.cell, None)
        entry["applied"] = self.clock.now()
        entry["applied_wall"] = time.time()
        self.since[move.cell] = entry["applied"]  # an aborted move also waits a dwell before the next try
        self.books.move(entry)
        self.books.roles_changed(entry["applied"], entry["applied_wall"], self.roles())
        self.scheduler.log_event("gyreflow-moves", entry)
        await self.routes.engines_changed()
        return entry

    def _destinations(self, addr: str) -> list[str]:
        """Engines to migrate ``addr``'s generations to, each once per session it has fewer than the
        busiest (spread by spare room)."""
        load = {a: 0 for a in self.routes.engines() if a != addr}
        for e in self.routes.sessions.values():
            if e in load:
                load[e] += 1
        top = max(load.values(), default=0)
        return [a for a in sorted(load, key=lambda a: load[a]) for _ in range(top - load[a] + 1)]

    async def drain(self, addr: str) -> dict:
        """Migrate every generation of ``addr`` to the other engines; the figures of the drain.

        Raises
        ------
        MoveFailed
            Some generations could not move (they go on at ``addr``, which takes calls again).
        """
        destinations = self._destinations(addr)
        t0 = time.time()
        out = await self._ask(addr, "gyreflow_drain", self.deadlines.migration_s, destinations=destinations)
        if "error" in out:
            raise MoveFailed(out["error"])
        self.routes.moved(out.get("moved", {}))
        self.books.migrated(len(out.get("moved", {})), int(out.get("bytes", 0)))
        if out.get("kept"):
            raise MoveFailed(f"{out['kept']} generations could not move"
                             + ("" if destinations else " (no other rollout cell)"))
        self.routes.forget_engine(addr)  # re-routed at their next call (or where their generation went)
        return {"migrated": len(out.get("moved", {})), "migration_s": out.get("seconds", 0.0),
                "drain_s": time.time() - t0, "bytes": out.get("bytes", 0)}

    async def _ask(self, addr: str, method: str, limit: float, **kwargs) -> dict:
        """``addr``'s answer to RPC ``method``; :class:`MoveFailed` if none comes within ``limit``
        wall seconds (the cell may still carry the request out: every request it serves is safe to
        carry out late)."""
        try:
            return await asyncio.wait_for(getattr(self.scheduler.rpc(addr), method)(**kwargs), limit)
        except TimeoutError:
            raise MoveFailed(f"{addr} did not answer {method} within {limit:.0f}s") from None

    async def set_role(self, addr: str, role: str | None) -> dict:
        """Make ``addr`` serve ``role`` (``None``: neither pool); the cell's answer.

        Raises
        ------
        MoveFailed
            The cell refused or did not answer within ``deadlines.answer_s``.
        """
        # Sequence numbers keep a late answer from undoing a later change (a restore after a timeout).
        self._role_seq = max(self._role_seq + 1, time.time_ns())
        out = await self._ask(addr, "gyreflow_set_role", self.deadlines.answer_s, role=role, seq=self._role_seq)
        if "error" in out:
            raise MoveFailed(out["error"])
        return out

    async def _undoable(self, addr: str, back: str, work) -> dict:
        """``await work()``; if it fails, ``addr`` goes back to role ``back`` (a :class:`MoveFailed`
        becomes an ``aborted`` entry, anything else is raised)."""
        try:
            return await work()
        except MoveFailed as err:
            await self._restore(addr, back)
            return {"aborted": str(err)}
        except BaseException:
            await self._restore(addr, back)
            raise

    async def _to_trainer(self, addr: str) -> dict:
        async def work() -> dict:
            out = await self.drain(addr)
            t1 = time.time()
            await self.set_role(addr, TRAINER)
            return out | {"role_s": time.time() - t1}

        out = await self._undoable(addr, ROLLOUT, work)
        if "aborted" in out:
            return out
        schedule_unrunnable(self.scheduler, addr)
        self.spread()  # queued shares elsewhere come over now, not at the next tick
        return out

    async def _to_rollout(self, addr: str) -> dict:
        if not trainer_tasks(self.scheduler.workers.get(addr)):
            await self.set_role(addr, ROLLOUT)
            return {}
        if not self.trainers():
            return {"aborted": "trainer tasks on the last trainer cell"}
        # Hand over: out of the trainer pool first, so that its queued tasks go to the others and
        # none starts here, then wait for the one it runs.
        t0 = time.time()

        async def work() -> dict:
            await self.set_role(addr, None)
            self.spread()
            wait = self.clock.to_wall(self.handover_s)
            out = await self._ask(addr, "gyreflow_training_done", wait + self.deadlines.answer_s, timeout=wait)
            if out.get("running"):
                raise MoveFailed(f"a trainer task still ran on the cell after {self.handover_s:.0f}s")
            return {}

        out = await self._undoable(addr, TRAINER, work)
        if "aborted" in out:
            return out
        await self.set_role(addr, ROLLOUT)
        return {"handover_s": self.clock.from_wall(time.time() - t0)}

    async def _restore(self, addr: str, role: str) -> None:
        """Put a cell whose move failed half-way back in ``role``, trying up to
        :data:`RESTORE_TRIES` times: a drained cell that was not told its role again keeps its
        rollout resources but takes no call."""
        for attempt in range(1, RESTORE_TRIES + 1):
            try:
                await self.set_role(addr, role)
                break
            except Exception:  # refused or unanswered; a cell that died is cleaned up by remove_worker
                if attempt == RESTORE_TRIES or addr not in self.scheduler.workers:
                    log.warning("gyreflow: cell %s could not serve as %s again after a failed move", addr, role,
                                exc_info=True)
                    break
        if role == TRAINER:
            schedule_unrunnable(self.scheduler, addr)

    async def retire(self, addr: str) -> dict:
        """Take ``addr`` out of the cluster without losing what it runs: its generations migrate,
        it leaves both pools (trainer tasks on it run again elsewhere), then Dask retires it."""
        decided = self.clock.now()
        limit = time.monotonic() + self.clock.to_wall(self.handover_s)
        while addr in self.moving and time.monotonic() < limit:  # a move of the cell under way ends first
            await asyncio.sleep(0.02)
        self.moving[addr] = "gone"
        was = self.roles().get(addr)
        entry = {"cell": addr, "to": "gone", "reason": "the cell leaves the cluster", "decided": decided}
        try:
            if was == ROLLOUT:
                entry |= await self.drain(addr)
            await self.set_role(addr, None)
            self.routes.forget_engine(addr)
            self.spread()  # its queued trainer tasks go to the trainer cells now
            entry |= await self._results_taken(addr)
            await self.scheduler.retire_workers(workers=[addr], close_workers=True, remove=True,
                                                stimulus_id=f"gyreflow-retire-{time.time()}")
        except Exception as err:
            entry["error"] = f"{type(err).__name__}: {err}"
            if was is not None and addr in self.scheduler.workers:
                # It stays: back in the pool it left (a drained engine takes calls again).
                await self._restore(addr, was)
        finally:
            self.moving.pop(addr, None)
        entry["applied"] = self.clock.now()
        self.books.move_log.append(entry)
        self.books.roles_changed(entry["applied"], time.time(), self.roles())
        await self.routes.engines_changed()
        return entry

    async def _results_taken(self, addr: str) -> dict:
        """Wait until no trainer task needs a result ``addr`` holds (``handover_s`` at most): Dask
        would copy the shares' small results elsewhere as it retires the cell, but their gradient
        sums stay in the cell's memory and would be lost with it."""
        t0 = time.time()
        limit = self.clock.to_wall(self.handover_s)
        while held := results_still_needed(self.scheduler.workers.get(addr)):
            if time.time() - t0 > limit:
                log.warning("gyreflow: cell %s leaves with %d results still needed after %.0fs", addr, len(held),
                            self.handover_s)
                return {"results_left": len(held)}
            await asyncio.sleep(0.02)
        waited = time.time() - t0
        return {"results_wait_s": self.clock.from_wall(waited)} if waited > 0.001 else {}

    async def evict(self, src: str, dst: str, sessions: list[str], count: int) -> None:
        """Move up to ``count`` of ``sessions`` (in order of preference) from engine ``src`` to ``dst``
        (session re-balancing): only those with a generation in flight, which goes with them; the
        others stay (their cached prefix is on ``src``)."""
        try:
            out = await self._ask(src, "gyreflow_evict", self.deadlines.migration_s, sessions=sessions,
                                  destinations=[dst], count=count)
        except OSError:  # the engine left; its sessions are re-routed at their next call anyway
            return
        except MoveFailed as err:  # what it moved late tells the scheduler itself (gyreflow_imported)
            log.warning("gyreflow: session re-balancing from %s: %s", src, err)
            return
        self.routes.moved(out.get("moved", {}))
        for session, dest in out.get("sessions", {}).items():
            if self.routes.sessions.get(session) == src:
                self.routes.sessions[session] = dest
        self.books.rebalanced_sessions += len(out.get("sessions", {}))
        self.books.migrated(len(out.get("moved", {})), int(out.get("bytes", 0)))
