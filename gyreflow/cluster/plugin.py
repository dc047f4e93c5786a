"""The gyreflow scheduler plugin: routes model calls to engines and keeps the pool picture.

Registered from the client (``client.register_plugin(PoolsPlugin())``). It answers two RPCs that
execution tasks call through the router: ``gyreflow_route`` and ``gyreflow_release``.
"""

from __future__ import annotations

import time

from distributed.diagnostics.plugin import SchedulerPlugin

from gyreflow.cluster.policy import RouteSnapshot, choose_engine
from gyreflow.cluster.pools import ROLLOUT, workers_by_pool


class PoolsPlugin(SchedulerPlugin):
    """Routes sessions to the engines of the rollout pool (sticky while the engine stays)."""

    name = "gyreflow-pools"

    def __init__(self) -> None:
        self.sessions: dict[str, str] = {}
        self.routed = 0
        self.scheduler = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers["gyreflow_route"] = self.route
        scheduler.handlers["gyreflow_release"] = self.release
        scheduler.handlers["gyreflow_pools"] = self.pools

    def _resources(self) -> dict[str, dict[str, float]]:
        return {addr: dict(ws.resources) for addr, ws in self.scheduler.workers.items()}

    def rollout_engines(self) -> tuple[str, ...]:
        return tuple(workers_by_pool(self._resources())[ROLLOUT])

    def route(self, session: str) -> dict:
        """The engine for ``session``'s next call; an error message if no engine is in the pool."""
        snap = RouteSnapshot(engines=self.rollout_engines(), sessions=self.sessions)
        try:
            engine = choose_engine(session, snap)
        except LookupError as err:
            return {"error": str(err)}
        self.sessions[session] = engine
        self.routed += 1
        return {"engine": engine}

    def release(self, session: str) -> None:
        """The session ended: forget its route."""
        self.sessions.pop(session, None)

    def pools(self) -> dict:
        """Workers by pool and live sessions per engine (for the CLI, tests and the dashboard)."""
        pools = workers_by_pool(self._resources())
        per_engine: dict[str, int] = {e: 0 for e in pools[ROLLOUT]}
        for e in self.sessions.values():
            per_engine[e] = per_engine.get(e, 0) + 1
        return {"pools": pools, "sessions": per_engine, "routed": self.routed, "time": time.time()}

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        # Sessions on a departed engine are re-routed at their next call.
        for s in [s for s, e in self.sessions.items() if e == worker]:
            del self.sessions[s]
