"""The router as an execution sees it: each model call asks the scheduler for an engine, then
sends the request to that engine's worker over Dask comms (TCP, or UCX where the cluster uses it).

A call survives the pools changing under it. A cell that left the rollout pool answers
``reroute`` and the call goes to the engine the scheduler names next; a generation migrated
mid-way is collected where it went (``moved``); and if the cell died while migrating it, the
scheduler knows which cell imported it (``gyreflow_locate``), so it resumes from its last migrated
token. Only a generation that never left a dead cell is sent again, with its own seed.

No call waits without bound: while a call is out, the router asks its engine every ``probe_s``
where the request stands. An engine whose worker cannot be reached or has left the cluster, or that
no longer knows the request, counts as lost: the call is sent again elsewhere. An engine that is
only slow to answer is waited for, so no call runs twice.

A request with an ``on_token`` gets its tokens as the engine samples them, wherever it runs
(:mod:`gyreflow.engine.streams`), on this worker's event loop.
"""

from __future__ import annotations

import asyncio
import time

from distributed import get_worker
from distributed.utils import sync

from gyreflow.engine.base import GenerationRequest, GenerationResult
from gyreflow.engine.streams import token_sink
from gyreflow.engine.wire import msg_to_result, request_to_msg

REROUTES_AT_ONCE = 3
"""Calls one request may be sent back (engine moving, or without weights) before the router waits
between tries, doubling from 20 ms up to :data:`REROUTE_BACKOFF_MAX_S`."""
REROUTE_BACKOFF_MAX_S = 0.5


class RouteError(RuntimeError):
    """No engine could serve the call."""


class RequestRefused(ValueError):
    """The engine refused the request itself (a prompt longer than it holds, bad parameters)."""


class LostRequest(OSError):
    """The engine holding a call stopped answering for it."""


class Router:
    """Callable ``GenerationRequest -> GenerationResult`` for use inside a Dask task.

    Parameters
    ----------
    session
        The execution's id; its calls stick to one engine (and its KV cache) while it serves.
    attempts
        Engine failures (a dead worker, not a re-route or a migration) tolerated per call.
    priority
        Admission priority of the session's calls at the engines (lower first); by default the
        execution's start time, so older executions go first.

    probe_s
        Wall seconds between two checks on a call that is still out.
    """

    def __init__(self, session: str, attempts: int = 3, priority: float | None = None, probe_s: float = 20.0):
        self.session = session
        self.attempts = attempts
        self.probe_s = probe_s
        self.priority = time.time() if priority is None else float(priority)
        self.worker = get_worker()
        self.engine: str | None = None
        """The session's engine; asked of the scheduler once, and again when it stops serving."""
        self.reroutes = 0
        self.migrations = 0
        self.lost = 0
        """Calls sent again (or collected elsewhere) because their engine failed or lost them."""

    async def _route(self) -> str:
        route = await self.worker.scheduler.gyreflow_route(session=self.session, priority=self.priority,
                                                            caller=self.worker.address)
        if "error" in route:
            raise RouteError(route["error"])
        return route["engine"]

    async def agenerate_msg(self, msg: dict) -> dict:
        """Serve one request message; the reply message of the engine that finished it."""
        msg = {**msg, "priority": self.priority}
        failures, last, sent_back = 0, None, 0
        pending: tuple[str, str] | None = None  # (engine, request id) of a migrated generation
        while True:
            if pending is None and self.engine is None:
                self.engine = await self._route()
            try:
                if pending is not None:
                    out = await self._watched(pending[0], msg["request_id"],
                                              self.worker.rpc(pending[0]).gyreflow_resume(request_id=pending[1]))
                else:
                    out = await self._watched(self.engine, msg["request_id"],
                                              self.worker.rpc(self.engine).gyreflow_generate(request=msg))
            except OSError as err:  # the engine's worker went away, or lost the request
                failures, last = failures + 1, err
                self.lost += 1
                if failures > self.attempts:
                    raise RouteError(f"no engine answered after {self.attempts} attempts: {last}") from None
                where = await self.worker.scheduler.gyreflow_locate(request_id=msg["request_id"])
                if where.get("engine") and (pending is None or where["engine"] != pending[0]):
                    pending = (where["engine"], msg["request_id"])  # it was migrated before the loss
                    self.engine = where["engine"]
                else:
                    pending = None
                    await self.worker.scheduler.gyreflow_release(session=self.session)
                    self.engine = None
                continue
            if out.get("reroute"):
                self.reroutes += 1
                sent_back += 1
                await self.worker.scheduler.gyreflow_release(session=self.session,
                                                             unready=self.engine if out.get("unready") else None)
                self.engine = None
                if sent_back > REROUTES_AT_ONCE:  # the table still names engines that send calls back
                    await asyncio.sleep(min(REROUTE_BACKOFF_MAX_S, 0.01 * 2 ** (sent_back - REROUTES_AT_ONCE)))
                continue
            if "moved" in out:
                self.migrations += 1
                pending = (out["moved"], msg["request_id"])
                self.engine = out["moved"]  # the session's KV went with it
                await self.worker.scheduler.gyreflow_route(session=self.session, engine=self.engine)
                continue
            if out.get("refused"):
                raise RequestRefused(f"engine {pending[0] if pending else self.engine}: {out['error']}")
            if "error" in out:
                raise RouteError(f"engine {pending[0] if pending else self.engine}: {out['error']}")
            return out

    async def _watched(self, engine: str, request_id: str, call) -> dict:
        """Await ``call`` (an RPC to ``engine`` for ``request_id``), checking on it every ``probe_s``.

        Raises
        ------
        LostRequest
            The engine stopped answering, or twice in a row did not know the request.
        """
        task = asyncio.ensure_future(call)
        unknown = 0
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.probe_s)
                if done:
                    return task.result()
                try:
                    status = await asyncio.wait_for(
                        self.worker.rpc(engine).gyreflow_request_status(request_id=request_id), timeout=self.probe_s)
                except asyncio.TimeoutError:
                    # A slow engine is not a dead one: sending the call again would run it twice.
                    # Only the scheduler's word that the worker left makes it lost.
                    if (await self.worker.scheduler.gyreflow_locate(request_id=request_id, engine=engine))["alive"]:
                        unknown = 0
                        continue
                    raise LostRequest(f"engine {engine} left the cluster holding {request_id}") from None
                except OSError:
                    raise LostRequest(f"engine {engine} stopped answering for {request_id}") from None
                unknown = unknown + 1 if status.get("state") == "unknown" else 0
                if unknown >= 2:
                    try:  # it may still be running there unseen: nobody will collect it
                        await asyncio.wait_for(self.worker.rpc(engine).gyreflow_abort(request_id=request_id), self.probe_s)
                    except (OSError, asyncio.TimeoutError):
                        pass
                    raise LostRequest(f"engine {engine} lost request {request_id}")
        finally:
            if not task.done():
                task.cancel()

    async def agenerate(self, request: GenerationRequest) -> GenerationResult:
        """Serve one request from a coroutine (an ``async def`` Dask task)."""
        msg = request_to_msg(request)
        if request.on_token is None:
            return msg_to_result(await self.agenerate_msg(msg))
        with token_sink(self.worker, request.request_id, request.on_token) as here:
            return msg_to_result(await self.agenerate_msg(msg | {"stream_to": here}))

    def __call__(self, request: GenerationRequest) -> GenerationResult:
        return sync(self.worker.loop, self.agenerate, request)

    async def aclose(self) -> None:
        await self.worker.scheduler.gyreflow_release(session=self.session)

    def close(self) -> None:
        sync(self.worker.loop, self.aclose)
