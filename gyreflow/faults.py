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
"""

from __future__ import annotations

import asyncio
import threading

POINTS = ("before_export", "after_export", "during_import", "after_import", "set_role")


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
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
        with self._lock:
            if times > 0:
                self._armed[point] = (int(times), float(delay_s))
            else:
                self._armed.pop(point, None)

    async def trip(self, point: str) -> None:
        """Raise :class:`InjectedFault` (or pause) if ``point`` is armed."""
        if not self._armed:
            return
        with self._lock:
            left, delay = self._armed.get(point, (0, 0.0))
            if left <= 0:
                return
            if left == 1:
                del self._armed[point]
            else:
                self._armed[point] = (left - 1, delay)
            self.tripped[point] = self.tripped.get(point, 0) + 1
        if delay > 0:
            await asyncio.sleep(delay)
            return
        raise InjectedFault(f"fault injected at {point}")


FAULTS = Faults()
"""This process's fault points."""
