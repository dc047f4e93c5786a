"""The router as an execution sees it: each model call asks the scheduler for an engine, then
sends the request to that engine's worker over Dask comms (TCP, or UCX where the cluster uses it).
"""

from __future__ import annotations

from distributed import get_worker
from distributed.utils import sync

from gyreflow.engine.base import GenerationRequest, GenerationResult
from gyreflow.engine.wire import msg_to_result, request_to_msg


class RouteError(RuntimeError):
    """No engine could serve the call."""


class Router:
    """Callable ``GenerationRequest -> GenerationResult`` for use inside a Dask task."""

    def __init__(self, session: str, attempts: int = 3):
        self.session = session
        self.attempts = attempts
        self.worker = get_worker()

    async def _generate(self, msg: dict) -> dict:
        last = None
        for _ in range(self.attempts):
            route = await self.worker.scheduler.gyreflow_route(session=self.session)
            if "error" in route:
                raise RouteError(route["error"])
            try:
                out = await self.worker.rpc(route["engine"]).gyreflow_generate(request=msg)
            except OSError as err:  # the engine's worker went away: route again
                last = err
                await self.worker.scheduler.gyreflow_release(session=self.session)
                continue
            if "error" in out:
                raise RouteError(f"engine {route['engine']}: {out['error']}")
            return out
        raise RouteError(f"no engine answered after {self.attempts} attempts: {last}")

    def __call__(self, request: GenerationRequest) -> GenerationResult:
        return msg_to_result(sync(self.worker.loop, self._generate, request_to_msg(request)))

    def close(self) -> None:
        sync(self.worker.loop, self.worker.scheduler.gyreflow_release, session=self.session)
