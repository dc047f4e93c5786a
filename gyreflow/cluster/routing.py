"""Placement decisions as pure functions of a snapshot; the scheduler plugin applies them.

Deciding apart from acting keeps every decision testable on crafted snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoutingOptions:
    """How sessions are spread over the rollout engines."""

    slack: int = 2
    """Sessions an engine may serve above its fair share before its youngest move to the
    emptiest engines (see :func:`rebalance_sessions`)."""

    def __post_init__(self) -> None:
        if self.slack < 0:
            raise ValueError(f"slack must not be negative, got {self.slack}")


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


def rebalance_sessions(snap: RouteSnapshot, priority: dict[str, float], slack: int = 2) -> list[tuple[str, str, str]]:
    """Sessions to move so that no engine serves more than ``slack`` above its fair share:
    ``(session, from_engine, to_engine)``, the youngest sessions (highest ``priority``) of the
    crowded engines to the emptiest ones.

    Sessions stick to their engine, so without this an engine that joins the rollout pool takes
    only new sessions, while one that served alone meanwhile stays crowded.
    """
    if len(snap.engines) < 2:
        return []
    members: dict[str, list[str]] = {e: [] for e in snap.engines}
    for s, e in snap.sessions.items():
        if e in members:
            members[e].append(s)
    total = sum(len(m) for m in members.values())
    target = -(-total // len(snap.engines))
    load = {e: len(m) for e, m in members.items()}
    moves = []
    for donor in sorted(members, key=lambda e: (-load[e], e)):
        if load[donor] <= target + slack:
            break
        for s in sorted(members[donor], key=lambda s: (-priority.get(s, 0.0), s)):
            if load[donor] <= target:
                break
            receiver = min(members, key=lambda e: (load[e], e))
            if load[receiver] >= target:
                break
            moves.append((s, donor, receiver))
            load[donor] -= 1
            load[receiver] += 1
    return moves

