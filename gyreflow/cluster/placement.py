"""Placement policies: pure functions of a pool snapshot that return cell moves.

The scheduler plugin (:mod:`gyreflow.cluster.plugin`) builds a :class:`PoolSnapshot` on every
tick, asks the run's policy for :class:`Move` suggestions and applies them; the policy itself never
acts, so every decision can be tested on crafted snapshots, and the same code decides for real and
emulated cells alike (as the active memory manager's policies do in Dask).

Modes (config ``cluster.placement``), one registry entry each:

``colocated``
    Every cell rolls out, then every cell trains, in turn.
``async``
    A fixed split: no cell ever moves.
``elastic``
    Cells move at run time: when the tail of the executions leaves rollout cells with little to
    do and training work is ready, the live executions are consolidated onto fewer cells and the
    freed cells train; when training work runs out they roll out again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gyreflow.algo.registry import Registry
from gyreflow.cluster.pools import ROLLOUT, TRAINER


@dataclass(frozen=True)
class Cell:
    """One cell as a policy sees it."""

    address: str
    role: str
    """``rollout`` or ``trainer``."""
    sessions: int = 0
    """Live executions whose model calls this cell's engine serves (0 for a trainer cell)."""
    train_tasks: int = 0
    """Trainer tasks on the cell, running or queued."""
    since: float = 0.0
    """When the cell took its role (plugin clock, seconds)."""
    idle_since: float | None = None
    """For a trainer cell: since when it has had no trainer task (``None`` while it has one)."""
    moving: bool = False
    """A move of this cell is being applied (``role`` is the one it moves to); policies leave it
    alone."""


@dataclass(frozen=True)
class PoolSnapshot:
    """The state a placement decision is a function of."""

    time: float
    cells: tuple[Cell, ...]
    train_waiting: int = 0
    """Trainer tasks ready to run that no cell holds (``no-worker``)."""
    route_waiting: int = 0
    """Executions waiting for any engine (the rollout pool is empty)."""
    train_backlog_s: float = 0.0
    """Predicted seconds of the trainer tasks ready or running (from Dask's duration estimates)."""

    def role(self, role: str) -> list[Cell]:
        return [c for c in self.cells if c.role == role]

    @property
    def sessions(self) -> int:
        return sum(c.sessions for c in self.cells) + self.route_waiting

    @property
    def train_work(self) -> int:
        """Trainer tasks ready or running: the training work there is now."""
        return sum(c.train_tasks for c in self.cells) + self.train_waiting


@dataclass(frozen=True)
class Move:
    """A suggestion: ``cell`` should serve ``to``."""

    cell: str
    to: str
    reason: str = ""


class PlacementPolicy(Protocol):
    """Decides moves; never acts."""

    name: str

    def decide(self, snap: PoolSnapshot) -> list[Move]:
        """Moves to apply now (possibly none)."""
        ...


PLACEMENTS: Registry[Callable[..., PlacementPolicy]] = Registry("placement mode")


@dataclass(frozen=True)
class StaticPolicy:
    """``async``: the split the cluster started with, kept for the whole run."""

    name: str = "async"

    def decide(self, snap: PoolSnapshot) -> list[Move]:
        return []


@dataclass(frozen=True)
class ColocatedPolicy:
    """``colocated``: all cells roll out while any execution lives, then all train.

    A cell leaves training only once its trainer tasks are done; a cell leaves rollout only when
    no execution is live anywhere (an execution between two calls still counts).
    """

    dwell_s: float = 0.05
    name: str = "colocated"

    def decide(self, snap: PoolSnapshot) -> list[Move]:
        free = [c for c in snap.cells if not c.moving and snap.time - c.since >= self.dwell_s]
        if snap.sessions > 0:
            return [Move(c.address, ROLLOUT, "executions live") for c in free
                    if c.role == TRAINER and c.train_tasks == 0]
        if snap.train_work > 0:
            return [Move(c.address, TRAINER, "training ready, no execution live") for c in free if c.role == ROLLOUT]
        return []


@dataclass(frozen=True)
class ElasticPolicy:
    """``elastic``: rollout cells for the live executions, every other cell for the ready training.

    Rollout needs ``ceil(executions / consolidate_batch)`` cells. When training work is ready, cells
    beyond that need move to the trainer pool, as many as the backlog can keep busy for
    ``drain_s`` (each move costs a migration, so a short burst of work does not take a cell). A
    trainer cell goes back as soon as rollout lacks capacity, or after ``idle_s`` without work
    when rollout cells are crowded (more than ``spread_batch`` executions each: spreading them
    makes every generation faster, decode being memory-bound).

    Parameters
    ----------
    consolidate_batch
        Live executions one rollout cell may hold when cells are taken for training.
    drain_s
        The backlog a cell taken for training should have at least (seconds of work per cell).
    spread_batch
        Executions per rollout cell above which an idle trainer cell returns to rollout.
    min_rollout, min_trainer
        Cells that always keep each role (a trainer cell ready for the first gradient share saves
        a move on the critical path).
    dwell_s
        A cell keeps a new role at least this long (no flapping).
    idle_s
        A trainer cell without work this long may return to rollout.
    """

    consolidate_batch: int = 32
    drain_s: float = 1.0
    spread_batch: int = 8
    min_rollout: int = 1
    min_trainer: int = 1
    dwell_s: float = 0.25
    idle_s: float = 1.0
    rollout_first: bool = True
    name: str = "elastic"

    def decide(self, snap: PoolSnapshot) -> list[Move]:
        rollout, trainer = snap.role(ROLLOUT), snap.role(TRAINER)
        n = len(snap.cells)
        sessions = snap.sessions
        need_rollout = min(n - self.min_trainer, max(self.min_rollout, math.ceil(sessions / self.consolidate_batch)))
        settled = [c for c in snap.cells if not c.moving and snap.time - c.since >= self.dwell_s]
        idle = sorted((c for c in settled if c.role == TRAINER and c.train_tasks == 0), key=lambda c: c.address)
        spare_trainers = len(trainer) - self.min_trainer
        if need_rollout > len(rollout):
            k = min(need_rollout - len(rollout), spare_trainers)
            return [Move(c.address, ROLLOUT, f"{sessions} executions need {need_rollout} rollout cells")
                    for c in idle[: max(0, k)]]
        if snap.train_work > 0:
            floor = need_rollout if self.rollout_first else self.min_rollout
            want = min(n - floor, max(self.min_trainer, math.ceil(snap.train_backlog_s / self.drain_s)))
            if want > len(trainer):
                # The cells with the fewest live executions go: the least to migrate.
                free = sorted((c for c in settled if c.role == ROLLOUT), key=lambda c: (c.sessions, c.address))
                k = min(want - len(trainer), len(rollout) - floor)
                return [Move(c.address, TRAINER, f"{snap.train_backlog_s:.1f}s of training ready for "
                             f"{len(trainer)} trainer cells, {sessions} executions live") for c in free[: max(0, k)]]
            return []
        crowded = rollout and sessions / len(rollout) > self.spread_batch
        long_idle = [c for c in idle if c.idle_since is not None and snap.time - c.idle_since >= self.idle_s]
        if crowded and long_idle and spare_trainers > 0:
            return [Move(long_idle[0].address, ROLLOUT, f"no training ready; {sessions} executions on "
                                                        f"{len(rollout)} rollout cells")]
        return []


PLACEMENTS.register("async")(StaticPolicy)
PLACEMENTS.register("colocated")(ColocatedPolicy)
PLACEMENTS.register("elastic")(ElasticPolicy)


def make_policy(mode: str, **options) -> PlacementPolicy:
    """The policy of placement ``mode`` (``PLACEMENTS`` names them)."""
    return PLACEMENTS.get(mode)(**options)
