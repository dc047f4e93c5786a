"""The scheduler's route table: which rollout engine serves each live execution (session), and where
migrations took its requests. Decisions come from :mod:`gyreflow.cluster.routing`; this keeps the
table and serves the routers' RPCs:

``gyreflow_route(session, engine=None, timeout, priority, caller)``
    The engine for the session's next call (``engine`` records where a migration took it).
``gyreflow_release(session)``
    The session ended, or must be routed afresh.
``gyreflow_locate(request_id)`` / ``gyreflow_imported(request_ids, engine)``
    Where a migrated request lives now (so a call survives its source cell dying).
``gyreflow_where(session)``
    The engine a session is routed to now.
``gyreflow_ready(engine)``
    An engine that had no weights has them now.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gyreflow.cluster.routing import RouteSnapshot, choose_engine


class RouteTable:
    """Sessions -> engines, with waiting for an engine when the rollout pool is empty.

    Parameters
    ----------
    engines
        The engines that take calls now (rollout cells not being moved), in a fixed order.
    poke
        Asks the control loop for a tick soon (routes changed, or calls wait for an engine).
    """

    def __init__(self, engines: Callable[[], tuple[str, ...]], poke: Callable[[], None]) -> None:
        self._engines = engines
        self.poke = poke
        self.unready: set[str] = set()
        """Rollout engines that answered they have no weights yet (until they announce ready)."""
        self.announced: set[str] = set()
        """Engines that announced they have weights (an engine keeps them until its worker goes):
        an "unready" answer of theirs that arrives after the announcement is stale."""
        self.sessions: dict[str, str] = {}
        """session -> engine address it is routed to."""
        self.priority: dict[str, float] = {}
        """session -> admission priority its router gave (its execution's start time)."""
        self.routed_at: dict[str, float] = {}
        """session -> wall time of its last route request (activity, for the stall detector)."""
        self.callers: dict[str, str] = {}
        """session -> address of the worker its router runs on (its sessions end if that worker goes)."""
        self.located: dict[str, str] = {}
        """request id -> cell that imported it in a migration (dropped when its session ends)."""
        self.waiting = 0
        self.routed = 0
        self._changed: asyncio.Condition | None = None

    def engines(self) -> tuple[str, ...]:
        """Engines that take calls now: rollout cells not being moved, with weights."""
        return tuple(e for e in self._engines() if e not in self.unready)

    def start(self) -> None:
        self._changed = asyncio.Condition()

    async def engines_changed(self) -> None:
        """Wake calls waiting for an engine (after a move, or a cell joined)."""
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    def load(self) -> dict[str, int]:
        """Engine -> sessions routed to it (engines that take calls, and any other holding one)."""
        out = {e: 0 for e in self.engines()}
        for e in self.sessions.values():
            out[e] = out.get(e, 0) + 1
        return out

    def on(self, engine: str) -> list[str]:
        """Sessions routed to ``engine``."""
        return [s for s, e in self.sessions.items() if e == engine]

    def forget_engine(self, engine: str) -> None:
        """Sessions on ``engine`` are re-routed at their next call (it left, or left the pool)."""
        for s in self.on(engine):
            del self.sessions[s]
        self.poke()

    def forget_caller(self, worker: str) -> list[str]:
        """Release the sessions whose routers ran on ``worker`` (it left: they will never release
        themselves, and would count as live executions for ever); the sessions released."""
        gone = [s for s, w in self.callers.items() if w == worker]
        for s in gone:
            self.release(s)
        return gone

    async def ready(self, engine: str) -> None:
        """``engine`` has weights now: route to it again."""
        self.announced.add(engine)
        if engine in self.unready:
            self.unready.discard(engine)
            await self.engines_changed()
            self.poke()

    def moved(self, where: dict[str, str]) -> None:
        """Requests (ids) now live on other engines after a migration."""
        self.located.update(where)

    # ------------------------------------------------------------------ RPCs

    async def route(self, session: str, engine: str | None = None, timeout: float = 600.0,
                    priority: float | None = None, caller: str | None = None) -> dict:
        """The engine for ``session``'s next call; waits (up to ``timeout`` wall s) while no engine
        takes calls, and counts as rollout demand meanwhile. ``caller``: the worker the session's
        router runs on."""
        self.routed_at[session] = time.time()
        if caller is not None:
            self.callers[session] = caller
        if priority is not None:
            self.priority[session] = priority
        if engine is not None:
            self.sessions[session] = engine
            return {"engine": engine}
        deadline = time.monotonic() + timeout
        self.waiting += 1
        try:
            while not self.engines():
                self.poke()
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait(), timeout=max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        return {"error": f"no engine in the rollout pool for {timeout:.0f}s"}
        finally:
            self.waiting -= 1
        chosen = choose_engine(session, RouteSnapshot(self.engines(), self.sessions))
        if self.sessions.get(session) != chosen:
            self.poke()
        self.sessions[session] = chosen
        self.routed += 1
        return {"engine": chosen}

    def release(self, session: str, unready: str | None = None) -> None:
        """Forget ``session``'s route and where migrations took its requests (ids ``<session>`` or
        ``<session>/...``; not those of a session ``<session>0``). ``unready``: the engine that sent
        it away has no weights yet."""
        if unready is not None and unready not in self.announced:
            self.unready.add(unready)
        if self.sessions.pop(session, None) is not None:
            self.poke()
        self.priority.pop(session, None)
        self.routed_at.pop(session, None)
        self.callers.pop(session, None)
        for rid in [r for r in self.located if r == session or r.startswith(f"{session}/")]:
            del self.located[rid]

    def where(self, session: str) -> dict:
        """The engine ``session`` is routed to now, if any."""
        return {"engine": self.sessions.get(session)}

    def locate(self, request_id: str) -> dict:
        """The cell that imported a migrated request, if any."""
        return {"engine": self.located.get(request_id)}

    def imported(self, request_ids: list[str], engine: str) -> None:
        for rid in request_ids:
            self.located[rid] = engine
