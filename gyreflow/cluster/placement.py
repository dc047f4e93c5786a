"""Placement policies: pure functions of a pool snapshot that return cell moves.

The scheduler plugin (:mod:`gyreflow.cluster.plugin`) builds a :class:`PoolSnapshot` on every
tick, asks the run's policy for :class:`Move` suggestions and applies them; the policy itself never
acts, so every decision can be tested on crafted snapshots, and the same code decides for real and
emulated cells alike (as the active memory manager's policies do in Dask).

Times in a snapshot and every time constant of a policy are seconds of the plugin's clock
(:mod:`gyreflow.cluster.clock`). The placement modes that pair a policy with the rest of a mode's
behaviour are in :mod:`gyreflow.cluster.modes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

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
    train_running: int = 0
    """Trainer tasks running on the cell (as of the worker's last heartbeat)."""
    since: float = 0.0
    """When the cell took its role (plugin clock, seconds)."""
    idle_since: float | None = None
    """For a trainer cell: since when it has had no trainer task (``None`` while it has one)."""
    moving: bool = False
    """A move of this cell is being applied (``role`` is the one it moves to); policies leave it
    alone."""
    home: str | None = None
    """The role the cell had when it joined (``lend`` gives lent cells back to it)."""


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
    train_rate: float = 0.0
    """Training work arriving, in trainer cell-seconds per second (smoothed over the recent past):
    the trainer cells that keep up with it."""

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
    no execution is live anywhere (an execution between two calls still counts), so the phases
    cannot flap and need no dwell time.
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
class LendPolicy:
    """``lend``: the reactive switch peer systems ship. Cells whose home is the trainer pool serve
    rollout while there is no training work, and are all taken back as soon as there is; cells
    whose home is rollout never train.

    Parameters
    ----------
    idle_s
        A home trainer cell without work this long is lent to rollout (while executions live).
    dwell_s
        A cell keeps a new role at least this long.
    """

    idle_s: float = 1.0
    dwell_s: float = 0.25
    name: str = "lend"

    def decide(self, snap: PoolSnapshot) -> list[Move]:
        settled = [c for c in snap.cells if not c.moving and c.home == TRAINER and snap.time - c.since >= self.dwell_s]
        if snap.train_work > 0:
            return [Move(c.address, TRAINER, "training work arrived: lent cell taken back")
                    for c in settled if c.role == ROLLOUT]
        if snap.sessions > 0:
            return [Move(c.address, ROLLOUT, "no training work: lent to rollout") for c in settled
                    if c.role == TRAINER and c.train_tasks == 0 and c.idle_since is not None
                    and snap.time - c.idle_since >= self.idle_s]
        return []


@dataclass(frozen=True)
class ElasticPolicy:
    """``elastic``: rollout cells for the live executions, the rest for the training work.

    Rollout needs ``ceil(executions / consolidate_batch)`` cells to hold every live execution in a
    batch. Training needs ``rate * (1 + headroom) + backlog / drain_s`` cells: enough to keep up with
    the training work arriving (``train_rate``, measured) and to clear what is ready within
    ``drain_s``. Decisions, in order:

    1. Executions wait for a batch slot (more than ``consolidate_batch`` per rollout cell): trainer
       cells roll out, least training on them first (their queued tasks go to the others), but for as many
       as keep up with the arriving work (``ceil(rate * (1 + headroom))``, ``min_trainer``
       at least) and as the training need rounds to.
    2. Training short of cells by more than half a cell: rollout cells beyond the rollout need move
       to the trainer pool, fewest live executions first (the least to migrate); busy rollout cells
       too, as far as the rate of arriving work alone needs them and the ready work keeps them busy
       for ``dwell_s`` (training must keep up, and a move must be worth its migrations).
    3. No training work at all: idle trainer cells beyond those the arriving work keeps busy roll
       out while any rollout cell serves more than one execution (a generation alone on a cell decodes fastest, and the last executions
       of a step are the ones it waits for).
    4. Idle trainer cells beyond the training need roll out when rollout is crowded (more than
       ``spread_batch`` executions per cell).

    Before all of these, a pool that departing cells left below ``min_rollout`` / ``min_trainer``
    is refilled from the other pool.

    A cell keeps a new role ``dwell_s`` at least, and a trainer cell rolls out only after
    ``idle_s`` without work.

    Parameters
    ----------
    consolidate_batch
        Live executions one rollout cell holds when cells are taken for training.
    drain_s
        Time in which the ready training work should be cleared.
    headroom
        Trainer capacity kept above the measured rate of training work.
    spread_batch
        Executions per rollout cell above which an idle trainer cell beyond the need rolls out.
    min_rollout, min_trainer
        Cells that always keep each role.
    dwell_s
        A cell keeps a new role at least this long (no flapping).
    idle_s
        A trainer cell without work this long may roll out.
    """

    consolidate_batch: int = 8
    drain_s: float = 1.0
    headroom: float = 0.1
    spread_batch: int = 8
    min_rollout: int = 1
    min_trainer: int = 1
    dwell_s: float = 0.25
    idle_s: float = 1.0
    name: str = "elastic"

    def need(self, snap: PoolSnapshot) -> float:
        """Trainer cells the training work needs now (fractional)."""
        return snap.train_rate * (1 + self.headroom) + snap.train_backlog_s / self.drain_s

    def decide(self, snap: PoolSnapshot) -> list[Move]:
        rollout, trainer = snap.role(ROLLOUT), snap.role(TRAINER)
        sessions = snap.sessions
        need, keep_up = self.need(snap), snap.train_rate * (1 + self.headroom)
        rollout_need = max(self.min_rollout, math.ceil(sessions / self.consolidate_batch))
        settled = [c for c in snap.cells if not c.moving and snap.time - c.since >= self.dwell_s]
        # Trainer cells that may roll out, least training on them first: a move hands their queued
        # tasks to the other trainer cells and waits for the one running.
        free_t = sorted((c for c in settled if c.role == TRAINER), key=lambda c: (c.train_running, c.train_tasks, c.address))
        idle = [c for c in free_t if c.train_tasks == 0 and c.idle_since is not None
                and snap.time - c.idle_since >= self.idle_s]
        keep = max(self.min_trainer, math.ceil(keep_up))  # trainer cells that keep up with the arriving work
        # 0. A pool below its minimum (cells left the cluster): the other pool gives cells beyond its own.
        still = [c for c in snap.cells if not c.moving]
        if len(rollout) < self.min_rollout and len(trainer) > self.min_trainer:
            give = sorted((c for c in still if c.role == TRAINER), key=lambda c: (c.train_running, c.train_tasks, c.address))
            k = min(self.min_rollout - len(rollout), len(trainer) - self.min_trainer)
            return [Move(c.address, ROLLOUT, f"{len(rollout)} rollout cells, below the {self.min_rollout} kept")
                    for c in give[:k]]
        if len(trainer) < self.min_trainer and len(rollout) > self.min_rollout:
            give = sorted((c for c in still if c.role == ROLLOUT), key=lambda c: (c.sessions, c.address))
            k = min(self.min_trainer - len(trainer), len(rollout) - self.min_rollout)
            return [Move(c.address, TRAINER, f"{len(trainer)} trainer cells, below the {self.min_trainer} kept")
                    for c in give[:k]]
        # 1. Executions wait for a batch slot: trainer cells roll out, but for those the arriving
        #    work keeps busy on average and those the ready work needs.
        if sessions > len(rollout) * self.consolidate_batch and free_t:
            k = min(len(free_t), len(trainer) - max(keep, math.ceil(need - 0.5)))
            if k > 0:
                return [Move(c.address, ROLLOUT, f"{sessions} executions wait for batch slots on {len(rollout)} "
                                                 f"rollout cells") for c in free_t[:k]]
        # 2. Training short of cells: spare rollout cells first; busy ones as far as the arriving
        #    rate needs them and the ready work keeps them busy for a dwell time.
        if snap.train_work > 0 and need > len(trainer) + 0.5:
            spare = len(rollout) - rollout_need
            forced = min(math.ceil(keep_up), math.floor(snap.train_backlog_s / self.dwell_s) if self.dwell_s > 0
                         else len(snap.cells)) - len(trainer)
            k = min(math.ceil(need - len(trainer) - 0.5), max(spare, forced), len(rollout) - self.min_rollout)
            free = sorted((c for c in settled if c.role == ROLLOUT), key=lambda c: (c.sessions, c.address))
            return [Move(c.address, TRAINER, f"training needs {need:.1f} cells ({snap.train_backlog_s:.0f}s ready, "
                                             f"{snap.train_rate:.2f} cell-s/s arriving), {len(trainer)} train; "
                                             f"{sessions} executions need {rollout_need} rollout cells")
                    for c in free[: max(0, k)]]
        # 3. No training work: idle trainer cells spread the executions (a generation alone on a
        #    cell decodes fastest, and the last ones of a step are the ones it waits for).
        if idle and snap.train_work == 0 and sessions > len(rollout) and len(trainer) > keep:
            k = min(len(idle), len(trainer) - keep, sessions - len(rollout))
            return [Move(c.address, ROLLOUT, f"no training work; {sessions} executions on {len(rollout)} rollout "
                                             f"cells") for c in idle[:k]]
        # 4. Idle trainer cells beyond the need spread crowded rollout.
        spare_t = len(trainer) - max(self.min_trainer, math.ceil(need)) if need <= len(trainer) - 1 else 0
        if idle and spare_t > 0 and sessions > len(rollout) * self.spread_batch:
            return [Move(c.address, ROLLOUT, f"training needs {need:.1f} cells, {len(trainer)} train; {sessions} "
                                             f"executions on {len(rollout)} rollout cells") for c in idle[:spare_t]]
        return []
