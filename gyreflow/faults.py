"""Faults injected on purpose, at the points where a move could lose work (for the stress tests).

Each worker process has one :data:`FAULTS`; the cell service serves ``gyreflow_fault(point, times,
delay_s)`` to arm it from the scheduler or a test. A code path awaits :meth:`Faults.trip` at its
point; an armed point raises :class:`InjectedFault` there (``times`` times), or with ``delay_s``
only pauses that long (to hold a move half-way while a test looks at it); an unarmed one costs a
dict lookup.

Points
------
``before_export``
    A migration fails before it exports anything (source cell).
``after_export``
    It fails with the generations exported and not yet sent (source cell).
``during_import``
    The destination fails after importing part of what it was sent.
``after_import``
    The source fails after the destinations took the generations, before it answers.
``set_role``
    A cell fails to change its role.
``engine_step``
    Not a move point: each armed pass delays one step of the cell's engine by ``delay_s`` (a slow
    engine, to hold generations live while a test acts on them); without a delay the step fails
    and the runner logs it.
"""

from __future__ import annotations

import asyncio
import threading
import time

POINTS = ("before_export", "after_export", "during_import", "after_import", "set_role")
"""The points of a move (what the stress tests inject)."""
ALL_POINTS = (*POINTS, "engine_step")


class InjectedFault(RuntimeError):
    """Raised at an armed fault point."""


class Faults:
    """Armed fault points of this process."""

    def __init__(self) -> None:
        self._armed: dict[str, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self.tripped: dict[str, int] = {}

    def count(self) -> dict[str, int]:
        """How often each point has fired in this process."""
        with self._lock:
            return dict(self.tripped)

    def arm(self, point: str, times: int = 1, delay_s: float = 0.0) -> None:
        """Fail (or, with ``delay_s``, pause) the next ``times`` passes through ``point`` (0 disarms it)."""
        if point not in ALL_POINTS:
            raise ValueError(f"unknown fault point {point!r}; known: {', '.join(ALL_POINTS)}")
        with self._lock:
            if times > 0:
                self._armed[point] = (int(times), float(delay_s))
            else:
                self._armed.pop(point, None)

    def _take(self, point: str) -> float | None:
        """Count one pass through an armed ``point``: its delay, or ``None`` if it is not armed."""
        if not self._armed:
            return None
        with self._lock:
            left, delay = self._armed.get(point, (0, 0.0))
            if left <= 0:
                return None
            if left == 1:
                del self._armed[point]
            else:
                self._armed[point] = (left - 1, delay)
            self.tripped[point] = self.tripped.get(point, 0) + 1
        return delay

    async def trip(self, point: str) -> None:
        """Raise :class:`InjectedFault` (or pause) if ``point`` is armed."""
        delay = self._take(point)
        if delay is None:
            return
        if delay > 0:
            await asyncio.sleep(delay)
            return
        raise InjectedFault(f"fault injected at {point}")

    def trip_sync(self, point: str) -> None:
        """:meth:`trip` for a thread that is not an event loop (it blocks while it pauses)."""
        delay = self._take(point)
        if delay is None:
            return
        if delay > 0:
            time.sleep(delay)
            return
        raise InjectedFault(f"fault injected at {point}")


FAULTS = Faults()
"""This process's fault points."""
