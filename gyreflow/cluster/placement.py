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

    name: str = "colocated"

    def decide(self, snap: PoolSnapshot) -> list[Move]:
        free = [c for c in snap.cells if not c.moving]
        if snap.sessions > 0:
            return [Move(c.address, ROLLOUT, "executions live") for c in free
                    if c.role == TRAINER and c.train_tasks == 0]
        if snap.train_work > 0:
            return [Move(c.address, TRAINER, "training ready, no execution live") for c in free if c.role == ROLLOUT]
        return []


@dataclass(frozen=True)
class ElasticPolicy:
    """``elastic``: as many trainer cells as there is ready training work, the rest roll out.

    Parameters
    ----------
    consolidate_batch
        Live executions one rollout cell should serve when cells are taken for training. Fewer
        per cell keeps each generation fast (decode is memory-bound, so a small batch runs faster
        per generation); more frees more cells.
    min_rollout, min_trainer
        Cells that always keep each role (a trainer cell ready for the first gradient task saves a
        move on the critical path).
    dwell_s
        A cell keeps a new role at least this long (no flapping).
    idle_s
        A trainer cell without a task for this long goes back to rollout when it is not needed.
    """

    consolidate_batch: int = 32
    min_rollout: int = 1
    min_trainer: int = 1
    dwell_s: float = 0.05
    idle_s: float = 0.02
    name: str = "elastic"

    def decide(self, snap: PoolSnapshot) -> list[Move]:
        rollout, trainer = snap.role(ROLLOUT), snap.role(TRAINER)
        n = len(snap.cells)
        need_rollout = max(self.min_rollout, math.ceil(snap.sessions / self.consolidate_batch))
        work = snap.train_work
        want_trainer = max(self.min_trainer, min(work, n - need_rollout))
        settled = [c for c in snap.cells if not c.moving and snap.time - c.since >= self.dwell_s]
        moves: list[Move] = []
        if want_trainer > len(trainer):
            # The cells with the fewest live executions go: the least to migrate.
            free = sorted((c for c in settled if c.role == ROLLOUT), key=lambda c: (c.sessions, c.address))
            room = len(rollout) - self.min_rollout
            for c in free[: max(0, min(want_trainer - len(trainer), room))]:
                moves.append(Move(c.address, TRAINER, f"{work} trainer tasks ready, {snap.sessions} executions live"))
        elif want_trainer < len(trainer):
            idle = sorted(
                (c for c in settled if c.role == TRAINER and c.train_tasks == 0 and c.idle_since is not None
                 and snap.time - c.idle_since >= self.idle_s),
                key=lambda c: c.address,
            )
            room = len(trainer) - self.min_trainer
            for c in idle[: max(0, min(len(trainer) - want_trainer, room))]:
                moves.append(Move(c.address, ROLLOUT, f"{work} trainer tasks for {len(trainer)} trainer cells"))
        return moves


PLACEMENTS.register("async")(StaticPolicy)
PLACEMENTS.register("colocated")(ColocatedPolicy)
PLACEMENTS.register("elastic")(ElasticPolicy)


def make_policy(mode: str, **options) -> PlacementPolicy:
    """The policy of placement ``mode`` (``PLACEMENTS`` names them)."""
    return PLACEMENTS.get(mode)(**options)
