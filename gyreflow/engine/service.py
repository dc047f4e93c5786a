"""The engine on a cell: a WorkerPlugin that holds it for the worker's lifetime.

The engine is built when the first weights are published to the worker. It serves these RPCs
over Dask comms:

``gyreflow_generate(request)``
    Run one request. The reply is the result, ``{"reroute": True}`` when the cell does not serve
    the rollout pool now, or ``{"moved": address}`` when the request was migrated mid-way (the
    caller then collects it with ``gyreflow_resume`` there).
``gyreflow_drain(destinations)``
    Stop taking requests and migrate every live and waiting request, KV cache and sampler state
    included, to ``destinations``; sent worker to worker, so UCX clusters move the KV by RDMA.
``gyreflow_import(states)`` / ``gyreflow_resume(request_id)``
    The receiving side of a migration.
``gyreflow_engine_stats()``
    The engine's counters and occupancy.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Callable

import numpy as np
import torch
from distributed.diagnostics.plugin import WorkerPlugin

from gyreflow.engine.base import RequestExported
from gyreflow.engine.runner import EngineRunner
from gyreflow.engine.wire import msg_to_request, msg_to_state, result_to_msg, state_nbytes, state_to_msg

PLUGIN_NAME = "gyreflow-engine"

EngineFactory = Callable[..., object]
"""``factory(hf_config, weights, version, name, **engine_options) -> engine``."""


def torch_engine_factory(hf_config: dict, weights: dict[str, np.ndarray], version: int, name: str, **options):
    """A :class:`~gyreflow.engine.torch_engine.TorchEngine` for a Llama config and weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gyreflow.engine.torch_engine import TorchEngine

    engine = TorchEngine(LlamaForCausalLM(LlamaConfig(**hf_config)), name=name, version=version, **options)
    engine.load_weights(weights, version)
    return engine


class EngineService(WorkerPlugin):
    """Hosts one engine per worker and moves its requests to other cells on demand.

    Parameters
    ----------
    engine_options
        Keyword arguments of the engine (for the torch engine ``max_batch``, ``max_seq_len``,
        ``retain_slots``...).
    torch_threads
        Intra-op threads of this worker's torch (``None`` leaves torch's default).
    factory
        Builds the engine from the first published weights; the torch engine by default.
    accepting
        Whether the cell starts serving (a cell outside the rollout pool answers ``reroute``).
    """

    name = PLUGIN_NAME

    def __init__(self, engine_options: dict | None = None, torch_threads: int | None = None,
                 factory: EngineFactory = torch_engine_factory, accepting: bool = True):
        self.engine_options = dict(engine_options or {})
        self.torch_threads = torch_threads
        self.factory = factory
        self.accepting = accepting
        self.runner: EngineRunner | None = None
        self.worker = None
        self._ready: asyncio.Event | None = None
        self._moves: dict[str, asyncio.Future] = {}
        """request id -> where its migration took it, for the reply that waits on it here."""
        self._imported: dict[str, object] = {}
        self._session_of: dict[str, str | None] = {}
        self.evicted: set[str] = set()
        """Sessions whose next call must go elsewhere (the scheduler re-balanced them)."""
        self.migrated_out = 0
        self.migrated_in = 0

    async def setup(self, worker) -> None:
        self.worker = worker
        self._ready = asyncio.Event()
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        if "rollout" in worker.state.total_resources:  # a cell: it serves while in the rollout pool
            self.accepting = worker.state.total_resources["rollout"] > 0
        worker.handlers["gyreflow_generate"] = self.generate
        worker.handlers["gyreflow_engine_stats"] = self.stats
        worker.handlers["gyreflow_drain"] = self.drain
        worker.handlers["gyreflow_evict"] = self.evict
        worker.handlers["gyreflow_import"] = self.import_states
        worker.handlers["gyreflow_resume"] = self.resume

    def teardown(self, worker) -> None:
        if self.runner is not None:
            self.runner.stop()

    def load(self, hf_config: dict, weights: dict[str, np.ndarray], version: int) -> dict:
        """Install weights ``version`` (building the engine on first use); runs in a task thread."""
        if self.runner is None:
            engine = self.factory(hf_config, weights, version, self.worker.address, **self.engine_options)
            self.runner = EngineRunner(engine, name=f"engine-{self.worker.address}").start()
            self.worker.loop.add_callback(self._ready.set)
        else:
            self.runner.load_weights(weights, version)
        return {"engine": self.worker.address, "version": version}

    async def _wait_ready(self) -> str | None:
        if self.runner is None:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout=60)
            except asyncio.TimeoutError:
                return "engine has no weights yet"
        return None

    async def _outcome(self, rid: str, fut) -> dict:
        """The reply for a request whose engine future is ``fut``, following it if it moves."""
        while True:
            try:
                res = await asyncio.wrap_future(fut)
            except RequestExported:
                dest = await self._moves.pop(rid)
                if dest != self.worker.address:
                    return {"moved": dest}
                fut = self._imported.pop(rid)  # the migration failed; it went on here
                continue
            except Exception as err:
                return {"error": f"{type(err).__name__}: {err}"}
            return result_to_msg(res)

    async def generate(self, request: dict) -> dict:
        if not self.accepting:
            return {"reroute": True}
        if request.get("session") in self.evicted:
            self.evicted.discard(request["session"])
            return {"reroute": True}
        if (err := await self._wait_ready()) is not None:
            return {"error": err}
        try:
            req = msg_to_request(request)
            fut = self.runner.submit(req)
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}
        self._session_of[req.request_id] = req.session
        try:
            return await self._outcome(req.request_id, fut)
        finally:
            self._session_of.pop(req.request_id, None)

    async def resume(self, request_id: str) -> dict:
        """The outcome of a request this cell imported."""
        fut = self._imported.pop(request_id, None)
        if fut is None:
            return {"error": f"no imported request {request_id!r} on {self.worker.address}"}
        return await self._outcome(request_id, fut)

    async def import_states(self, states: list[dict]) -> dict:
        """Resume migrated requests here and tell the scheduler where they now live."""
        if (err := await self._wait_ready()) is not None:
            return {"error": err}
        ids = []
        for msg in states:
            state = msg_to_state(msg)
            self._imported[state.request_id] = self.runner.import_request(state)
            ids.append(state.request_id)
        self.migrated_in += len(ids)
        try:  # lets a caller find its request if the source dies before replying
            await self.worker.scheduler.gyreflow_imported(request_ids=ids, engine=self.worker.address)
        except Exception:  # no gyreflow scheduler plugin: only the reply can say where it went
            pass
        return {"imported": ids}

    async def drain(self, destinations: list[str], fail_after_send: bool = False) -> dict:
        """Stop serving and move every request in the engine to ``destinations`` (spread evenly).

        A destination that fails is skipped; requests nobody took are imported back here and the
        cell serves again, so nothing is lost. ``fail_after_send`` kills this worker's process once
        the destinations hold the requests but before anyone is told: the failure a migration must
        survive, used by the tests.
        """
        self.accepting = False
        if self.runner is None:
            return {"moved": {}, "kept": 0, "bytes": 0, "seconds": 0.0}
        out = await self._migrate(self.runner.engine.request_ids(), destinations, fail_after_send)
        if out["kept"]:
            self.accepting = True
        return out

    async def evict(self, sessions: list[str], destinations: list[str]) -> dict:
        """Send ``sessions`` elsewhere: their generations in flight migrate to ``destinations``,
        and their next call here is answered ``reroute`` (the scheduler re-balancing sessions)."""
        if self.runner is None:
            return {"moved": {}, "kept": 0, "bytes": 0, "seconds": 0.0}
        chosen = set(sessions)
        self.evicted.update(chosen)
        ids = [rid for rid, s in list(self._session_of.items()) if s in chosen]
        for rid in ids:  # they follow their generation instead
            self.evicted.discard(self._session_of.get(rid))
        return await self._migrate(ids, destinations)

    async def _migrate(self, ids: list[str], destinations: list[str], fail_after_send: bool = False) -> dict:
        """Export requests ``ids`` and import them on ``destinations`` (round robin). A
        destination that fails is skipped; requests nobody took go on here, so nothing is lost."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        # Created before the export, so each request's waiting reply can follow it.
        where = {rid: loop.create_future() for rid in ids}
        self._moves.update(where)

        def export_all() -> list:
            out = []
            for rid in ids:
                try:
                    out.append(self.runner.export_request(rid))
                except KeyError:  # finished meanwhile
                    pass
            return out

        states = await loop.run_in_executor(None, export_all)
        for rid in set(ids) - {st.request_id for st in states}:
            del self._moves[rid], where[rid]
        plan: dict[str, list] = {d: [] for d in destinations}
        for i, state in enumerate(states):
            if destinations:
                plan[destinations[i % len(destinations)]].append(state)
        moved: dict[str, str] = {}
        leftover = [] if destinations else list(states)

        async def send(dest: str, batch: list) -> None:
            try:
                out = await self.worker.rpc(dest).gyreflow_import(states=[state_to_msg(s) for s in batch])
                if "error" in out:
                    raise OSError(out["error"])
                for s in batch:
                    moved[s.request_id] = dest
            except OSError:
                leftover.extend(batch)

        await asyncio.gather(*(send(d, b) for d, b in plan.items() if b))
        if fail_after_send:
            os._exit(17)
        for s in leftover:  # nobody took them: they go on here
            self._imported[s.request_id] = self.runner.import_request(s)
            moved[s.request_id] = self.worker.address
        for rid, dest in moved.items():
            where[rid].set_result(dest)
        self.migrated_out += len(moved) - len(leftover)
        return {"moved": {r: d for r, d in moved.items() if d != self.worker.address}, "kept": len(leftover),
                "bytes": int(sum(state_nbytes(s) for s in states)), "seconds": time.perf_counter() - t0}

    def stats(self) -> dict:
        base = self.runner.stats() if self.runner is not None else {"live": 0, "waiting": 0}
        return base | {"accepting": self.accepting, "migrated_in": self.migrated_in, "migrated_out": self.migrated_out}
