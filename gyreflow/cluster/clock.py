"""The clock placement runs on: wall time in real runs, the workload's emulated clock in the benchmark.

Every time constant of the scheduler plugin and of the placement policies (ticks, dwell, idle,
backlog, stall limits) is in seconds of this clock, and every time the plugin stamps (a cell's
role since, a move's decision) is read from it. The benchmark gives the plugin the emulated clock,
so that what the policy decides depends on emulated time only, not on how fast the machine replays
it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Clock:
    """Seconds that pass ``scale`` times as fast as wall seconds, counted from wall time ``origin``.

    ``Clock()`` is wall time itself (``now()`` is ``time.time()``).

    Parameters
    ----------
    scale
        Clock seconds per wall second (a workload's ``time_scale``).
    origin
        Wall time (seconds since the epoch) at which the clock reads 0.
    """

    scale: float = 1.0
    origin: float = 0.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"a clock's scale must be positive, got {self.scale}")

    def now(self) -> float:
        """The clock's time."""
        return (time.time() - self.origin) * self.scale

    def at(self, wall: float) -> float:
        """The clock's reading at wall time ``wall`` (seconds since the epoch)."""
        return (wall - self.origin) * self.scale

    def to_wall(self, seconds: float) -> float:
        """Wall seconds that ``seconds`` of this clock take (for sleeps and timeouts)."""
        return seconds / self.scale

    def from_wall(self, wall_seconds: float) -> float:
        """Clock seconds in ``wall_seconds`` of wall time (e.g. Dask's task-duration estimates)."""
        return wall_seconds * self.scale


WALL = Clock()
"""Wall time."""
