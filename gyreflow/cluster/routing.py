"""Placement decisions as pure functions of a snapshot; the scheduler plugin applies them.

Deciding apart from acting keeps every decision testable on crafted snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoutingOptions:
    """How sessions are spread over the rollout engines."""

    max_batch: int = 32
    """Generations one engine runs at once."""
    lane_batch: int = 0
    """Sessions per tail lane (:class:`Lanes`); 0: no lanes, sessions spread evenly."""


@dataclass(frozen=True)
class RouteSnapshot:
    """What routing sees: the engines now in the rollout pool and the sessions each serves."""

    engines: tuple[str, ...]
    sessions: dict[str, str] = field(default_factory=dict)
    """session -> engine address it was routed to."""


def choose_engine(session: str, snap: RouteSnapshot, lanes: "Lanes | None" = None) -> str:
    """Engine for the next call of ``session``.

    A session stays on its engine while that engine is in the rollout pool (its KV cache there
    holds the session's prefix); otherwise it goes to the engine serving the fewest sessions: among
    the lanes if it is one of the oldest (:class:`Lanes`), among the others if not.
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
    pool = snap.engines
    if lanes is not None and lanes.engines:
        mine = [e for e in snap.engines if (e in lanes.engines) == (session in lanes.old)]
        pool = mine or pool
    return min(pool, key=lambda e: (load[e], e))


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


@dataclass(frozen=True)
class Lanes:
    """Tail lanes: rollout engines kept for the oldest executions, at a small batch each.

    A generation decodes faster in a small batch (an iteration costs ``a + b*k``), and the oldest
    executions are the likeliest to be the ones a step waits for. Lanes are made only of spare
    capacity: the other executions still fit on the other engines at a full batch.
    """

    engines: tuple[str, ...] = ()
    old: frozenset[str] = frozenset()
    """Sessions that belong on a lane."""


def plan_lanes(snap: RouteSnapshot, priority: dict[str, float], max_batch: int, lane_batch: int) -> Lanes:
    """The lanes for ``snap``: ``L = floor((R*B - S) / (B - t))`` engines (at most ``R - 1``) for the
    ``L*t`` oldest sessions, ``R`` engines, ``S`` sessions, ``B = max_batch``, ``t = lane_batch``;
    the engines that already hold the most of them (the fewest moves)."""
    members = {e: [] for e in snap.engines}
    for s, e in snap.sessions.items():
        if e in members:
            members[e].append(s)
    n_engines, n_sessions = len(members), sum(len(m) for m in members.values())
    if lane_batch <= 0 or lane_batch >= max_batch or n_engines < 2:
        return Lanes()
    n_lanes = min(n_engines - 1, (n_engines * max_batch - n_sessions) // (max_batch - lane_batch))
    if n_lanes <= 0:
        return Lanes()
    oldest = sorted((s for m in members.values() for s in m), key=lambda s: (priority.get(s, 0.0), s))
    old = frozenset(oldest[: n_lanes * lane_batch])
    ranked = sorted(members, key=lambda e: (-sum(s in old for s in members[e]), len(members[e]), e))
    return Lanes(tuple(sorted(ranked[:n_lanes])), old)


def lane_moves(snap: RouteSnapshot, lanes: Lanes, max_batch: int, lane_batch: int) -> list[tuple[str, str, str]]:
    """Moves ``(session, from, to)`` that bring old sessions onto lanes (at most ``lane_batch`` each)
    and young ones off them (onto the least loaded other engine, below ``max_batch``)."""
    if not lanes.engines:
        return []
    load = {e: 0 for e in snap.engines}
    for s, e in snap.sessions.items():
        if e in load:
            load[e] += 1
    others = [e for e in snap.engines if e not in lanes.engines]
    moves = []
    for s, e in sorted(snap.sessions.items()):
        if e not in load:
            continue
        if s in lanes.old and e not in lanes.engines:
            dst = min(lanes.engines, key=lambda x: (load[x], x))
            if load[dst] < lane_batch:
                moves.append((s, e, dst))
                load[dst] += 1
                load[e] -= 1
        elif s not in lanes.old and e in lanes.engines and others:
            dst = min(others, key=lambda x: (load[x], x))
            if load[dst] < max_batch:
                moves.append((s, e, dst))
                load[dst] += 1
                load[e] -= 1
    return moves
