"""Placement modes: one registry entry each, carrying all of the mode's behaviour.

A mode pairs its placement policy (:mod:`gyreflow.cluster.placement`) with what the rest of a run
needs to know: the split it starts from, the staleness it allows, whether trainer cells get every
weights version (they may roll out), and which cluster shapes it can work on. Pipelines, the
benchmark, the CLI and the config validation ask the mode; none of them branches on a mode's name.

``colocated``
    Every cell rolls out, then every cell trains, in turn (on-policy).
``async``
    The split the cluster starts with is kept; rollouts of step k+1 overlap training of step k.
``lend``
    The reactive switch peer systems ship: trainer cells serve rollout while they have no
    training work and are taken back when it arrives.
``elastic``
    Cells move between the pools at run time by predicted need.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gyreflow.registry import Registry
from gyreflow.cluster.placement import ColocatedPolicy, ElasticPolicy, LendPolicy, PlacementPolicy, StaticPolicy


@dataclass(frozen=True)
class PlacementMode:
    """A placement mode (``cluster.placement``)."""

    name: str
    policy: type
    """Dataclass of the mode's :class:`~gyreflow.cluster.placement.PlacementPolicy`; its fields are
    the mode's options."""
    summary: str
    on_policy: bool = False
    """Rollouts and training never overlap: staleness is 0 whatever the run asks."""
    trainers_roll_out: bool = True
    """Trainer cells may serve rollout, so they get every weights version too."""
    all_cells_roll_out: bool = False
    """The mode starts with every cell in the rollout pool."""
    moves_cells: bool = True
    """The mode moves cells at run time (a cluster where it never could is refused)."""
    min_trainer_cells: int = 0
    """Cells that must start in the trainer pool."""
    refills_pools: bool = False
    """The policy refills a pool that departing cells left short, from the other pool; otherwise
    cells keep the roles they started or joined with, and a pool that loses its last cell stays
    empty."""

    def make_policy(self, **options) -> PlacementPolicy:
        """The policy with ``options`` (unknown ones are refused with the allowed list)."""
        allowed = self.options()
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"placement {self.name!r} has no option {unknown[0]!r}; allowed: {', '.join(allowed) or 'none'}")
        return self.policy(**options)

    def options(self) -> list[str]:
        """Names of the mode's options."""
        return [f.name for f in dataclasses.fields(self.policy) if f.name != "name"]

    def options_from(self, source) -> dict:
        """The mode's options that ``source`` (e.g. the run's ``cluster`` config) has attributes for."""
        return {k: getattr(source, k) for k in self.options() if hasattr(source, k)}

    def staleness(self, requested: int) -> int:
        """The staleness bound a run of this mode trains under."""
        return 0 if self.on_policy else requested

    def start_split(self, rollout: int, trainer: int) -> tuple[int, int]:
        """The cells (rollout, trainer) to start with, from a configured split."""
        return (rollout + trainer, 0) if self.all_cells_roll_out else (rollout, trainer)

    def join_role(self, rollout: int, trainer: int, cells: int) -> list[bool]:
        """Roles for ``cells`` joining a cluster whose start split was ``rollout:trainer``: the split's
        proportion, in joining order (``True`` = trainer), spread evenly over the joiners."""
        if self.all_cells_roll_out or rollout + trainer == 0:
            return [False] * cells
        share = trainer / (rollout + trainer)
        # The k-th joiner is a trainer when the running count of trainers rounds up past it.
        return [round((k + 1) * share) > round(k * share) for k in range(cells)]

    def check(self, rollout: int, trainer: int, **options) -> str | None:
        """Why a cluster of ``rollout`` + ``trainer`` cells cannot run this mode (``None``: it can)."""
        policy = self.make_policy(**options)
        lo_r, lo_t = getattr(policy, "min_rollout", 0), getattr(policy, "min_trainer", 0)
        r, t = self.start_split(rollout, trainer)
        if r < 1:
            return f"placement {self.name!r} needs at least one rollout cell (cluster.rollout_workers >= 1)"
        if t < self.min_trainer_cells:
            return (f"placement {self.name!r} needs at least {self.min_trainer_cells} trainer cell(s) at the start "
                    f"(cluster.trainer_workers >= {self.min_trainer_cells})")
        if self.moves_cells and r + t <= lo_r + lo_t:
            return (f"placement {self.name!r} cannot move a cell on {r + t} cell(s): it keeps {lo_r} rollout and {lo_t} "
                    f"trainer cell(s); start at least {lo_r + lo_t + 1} cells (e.g. cluster.rollout_workers="
                    f"{lo_r + lo_t + 1 - t}) or use cluster.placement=async")
        return None


PLACEMENTS: Registry[PlacementMode] = Registry("placement mode")

for _mode in (
    PlacementMode("colocated", ColocatedPolicy, "every cell rolls out, then every cell trains (on-policy)",
                  on_policy=True, all_cells_roll_out=True, refills_pools=True),
    PlacementMode("async", StaticPolicy, "a fixed split; rollouts of step k+1 overlap training of step k",
                  trainers_roll_out=False, moves_cells=False, min_trainer_cells=1),
    PlacementMode("lend", LendPolicy, "trainer cells serve rollout while they have no training work",
                  min_trainer_cells=1),
    PlacementMode("elastic", ElasticPolicy, "cells move between the pools by predicted need", refills_pools=True),
):
    PLACEMENTS.register(_mode.name)(_mode)


def mode(name: str) -> PlacementMode:
    """The mode named ``name`` (``PLACEMENTS`` lists them)."""
    return PLACEMENTS.get(name)


def make_policy(name: str, **options) -> PlacementPolicy:
    """The policy of placement mode ``name``."""
    return mode(name).make_policy(**options)
