"""Placement decisions as pure functions of a snapshot; the scheduler plugin applies them.

Deciding apart from acting keeps every decision testable on crafted snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RouteSnapshot:
    """What routing sees: the engines now in the rollout pool and the sessions each serves."""

    engines: tuple[str, ...]
    sessions: dict[str, str] = field(default_factory=dict)
    """session -> engine address it was routed to."""


def choose_engine(session: str, snap: RouteSnapshot) -> str:
    """Engine for the next call of ``session``.

    A session stays on its engine while that engine is in the rollout pool (its KV cache there
    holds the session's prefix); otherwise it goes to the engine serving the fewest sessions.
    """
    if not snap.engines:
        raise LookupError("no engine in the rollout pool")
    current = snap.sessions.get(session)
    if current in snap.engines:
        return current
    load = {e: 0 for e in snap.engines}
    for s, e in snap.sessions.items():
        if e in load and s != session:
            load[e] += 1
    return min(snap.engines, key=lambda e: (load[e], e))
