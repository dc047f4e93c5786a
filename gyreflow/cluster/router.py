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
        self.engine: str | None = None
        """The session's engine; asked of the scheduler once, and again only when it fails."""

    async def _generate(self, msg: dict) -> dict:
        last = None
        for _ in range(self.attempts):
            if self.engine is None:
                route = await self.worker.scheduler.gyreflow_route(session=self.session)
                if "error" in route:
                    raise RouteError(route["error"])
                self.engine = route["engine"]
            try:
                out = await self.worker.rpc(self.engine).gyreflow_generate(request=msg)
            except OSError as err:  # the engine's worker went away: route again
                last = err
                await self.worker.scheduler.gyreflow_release(session=self.session)
                self.engine = None
                continue
            if "error" in out:
                raise RouteError(f"engine {self.engine}: {out['error']}")
            return out
        raise RouteError(f"no engine answered after {self.attempts} attempts: {last}")

    def __call__(self, request: GenerationRequest) -> GenerationResult:
        return msg_to_result(sync(self.worker.loop, self._generate, request_to_msg(request)))

    def close(self) -> None:
        sync(self.worker.loop, self.worker.scheduler.gyreflow_release, session=self.session)
