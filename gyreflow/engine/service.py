"""The engine on a cell: a WorkerPlugin that holds it for the worker's lifetime.

The engine is built when the first weights are published to the worker. It serves these RPCs
over Dask comms:

``gyreflow_generate(request)``
    Run one request. The reply is the result, ``{"reroute": True}`` when the cell does not serve
    the rollout pool now (``"unready"`` too when it has no weights yet: routing avoids it until it
    announces ``gyreflow_ready``), or ``{"moved": address}`` when the request was migrated mid-way
    (the caller then collects it with ``gyreflow_resume`` there).
``gyreflow_drain(destinations)``
    Stop taking requests and migrate every live and waiting request, KV cache and sampler state
    included, to ``destinations``; sent worker to worker, so UCX clusters move the KV by RDMA.
``gyreflow_import(states)`` / ``gyreflow_resume(request_id)``
    The receiving side of a migration.
``gyreflow_engine_stats()``
    The engine's counters and occupancy.
``gyreflow_activity()`` / ``gyreflow_request_status(request_id)``
    Requests and their states, for the stall detector and for callers checking on a long call.
``gyreflow_abort(request_id)``
    Drop a request its caller gave up on.

A request message that names ``stream_to`` (the caller's worker) has its tokens sent there as
they are sampled, on this engine and on any engine it migrates to (:mod:`gyreflow.engine.streams`).

A migration never loses a request: whatever fails, each exported request ends up on a destination
that confirmed it or back in this engine (:meth:`EngineService._migrate`).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Callable

import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin

from gyreflow.engine.base import RequestExported
from gyreflow.engine.runner import EngineRunner
from gyreflow.engine.streams import TokenSender
from gyreflow.engine.wire import msg_to_request, msg_to_state, result_to_msg, state_nbytes, state_to_msg
from gyreflow.faults import FAULTS

PLUGIN_NAME = "gyreflow-engine"
IMPORT_TIMEOUT_S = 300.0
"""Longest wait for a destination to take a batch of migrated generations; past it they are
withdrawn from it and resume here."""
UNSEND_TIMEOUT_S = 30.0
"""Longest wait for a destination to withdraw a batch whose import reply was lost."""

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
        ``retain_sessions``...).
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
        self._moves: dict[str, asyncio.Future] = {}
        """request id -> where its migration took it, for the reply that waits on it here."""
        self._imported: dict[str, object] = {}
        self._session_of: dict[str, str | None] = {}
        self._state: dict[str, tuple[str | None, str, float]] = {}
        """request id -> (session, state, wall time it took that state)."""
        self._seen: dict[str, float] = {}
        """session -> wall time of its last event here."""
        self._stream_to: dict[str, str] = {}
        """request id -> the worker its tokens are streamed to, for the requests here that stream."""
        self._migrating: asyncio.Lock | None = None
        self.migrated_out = 0
        self.migrated_in = 0

    async def setup(self, worker) -> None:
        self.worker = worker
        self._migrating = asyncio.Lock()
        if self.torch_threads:
            import torch  # here, not at the top: a cell of an emulated engine never loads torch

            torch.set_num_threads(self.torch_threads)
        if "rollout" in worker.state.total_resources:  # a cell: it serves while in the rollout pool
            self.accepting = worker.state.total_resources["rollout"] > 0
        worker.handlers["gyreflow_generate"] = self.generate
        worker.handlers["gyreflow_engine_stats"] = self.stats
        worker.handlers["gyreflow_drain"] = self.drain
        worker.handlers["gyreflow_evict"] = self.evict
        worker.handlers["gyreflow_import"] = self.import_states
        worker.handlers["gyreflow_resume"] = self.resume
        worker.handlers["gyreflow_activity"] = self.activity
        worker.handlers["gyreflow_request_status"] = self.request_status
        worker.handlers["gyreflow_abort"] = self.abort

    def teardown(self, worker) -> None:
        if self.runner is not None:
            self.runner.stop()

    def load(self, hf_config: dict, weights: dict[str, np.ndarray], version: int) -> dict:
        """Install weights ``version`` (building the engine on first use); runs in a task thread."""
        if self.runner is None:
            engine = self.factory(hf_config, weights, version, self.worker.address, **self.engine_options)
            self.runner = EngineRunner(engine, name=f"engine-{self.worker.address}").start()
            self.worker.loop.add_callback(self._announce)
        else:
            self.runner.load_weights(weights, version)
        return {"engine": self.worker.address, "version": version}

    async def _announce(self) -> None:
        """Tell the scheduler this engine can serve now (it was routed around while it had no weights)."""
        try:
            await self.worker.scheduler.gyreflow_ready(engine=self.worker.address)
        except Exception:  # no gyreflow scheduler plugin
            pass

    def _note(self, rid: str, session: str | None, state: str | None) -> None:
        """Where request ``rid`` stands here (``None``: it left), for stall reports."""
        now = time.time()
        if state is None:
            self._state.pop(rid, None)
        else:
            self._state[rid] = (session, state, now)
        if session is not None:
            self._seen[session] = now

    async def _outcome(self, rid: str, fut, session: str | None) -> dict:
        """The reply for a request whose engine future is ``fut``, following it if it moves."""
        try:
            while True:
                self._note(rid, session, "in engine")
                try:
                    res = await asyncio.wrap_future(fut)
                except RequestExported:
                    self._note(rid, session, "exported")
                    dest = await self._moves.pop(rid)
                    if isinstance(dest, Exception):
                        return {"error": f"{type(dest).__name__}: {dest}"}
                    if dest != self.worker.address:
                        return {"moved": dest}
                    fut = self._imported.pop(rid)  # the migration failed; it went on here
                    continue
                except Exception as err:
                    return {"error": f"{type(err).__name__}: {err}"}
                return result_to_msg(res)
        finally:
            self._note(rid, session, None)

    async def generate(self, request: dict) -> dict:
        if not self.accepting:
            return {"reroute": True}
        if self.runner is None:  # no weights yet: the call goes elsewhere, and so do the next ones
            return {"reroute": True, "unready": True}
        try:
            req = msg_to_request(request)
            req.on_token = self._sender(req.request_id, request.get("stream_to"), 0)
            fut = self.runner.submit(req)
        except ValueError as err:  # the request itself is wrong: another engine would refuse it too
            self._stream_to.pop(request.get("request_id"), None)
            return {"error": f"{type(err).__name__}: {err}", "refused": True}
        except Exception as err:
            self._stream_to.pop(request.get("request_id"), None)
            return {"error": f"{type(err).__name__}: {err}"}
        self._session_of[req.request_id] = req.session
        try:
            return await self._outcome(req.request_id, fut, req.session)
        finally:
            self._session_of.pop(req.request_id, None)
            self._stream_to.pop(req.request_id, None)

    async def resume(self, request_id: str) -> dict:
        """The outcome of a request this cell imported."""
        fut = self._imported.pop(request_id, None)
        if fut is None:
            return {"error": f"no imported request {request_id!r} on {self.worker.address}"}
        session = self._state.get(request_id, (None,))[0]
        try:
            return await self._outcome(request_id, fut, session)
        finally:
            self._stream_to.pop(request_id, None)

    def _sender(self, request_id: str, dest: str | None, offset: int):
        """The ``on_token`` of a request whose tokens go to ``dest`` (``None``: it does not stream)."""
        if not dest:
            return None
        self._stream_to[request_id] = dest
        return TokenSender(self.worker, dest, request_id, offset).push

    async def import_states(self, states: list[dict]) -> dict:
        """Resume migrated requests here, all or none, and tell the scheduler where they now live.

        Refused while this cell does not take calls (it is draining, or not in the rollout pool):
        the sender keeps them.
        """
        if not self.accepting:
            return {"error": f"{self.worker.address} takes no generations now (not serving the rollout pool)"}
        if self.runner is None:
            return {"error": f"{self.worker.address} has no weights yet"}
        done: list[str] = []
        try:
            for msg in states:
                state = msg_to_state(msg)
                on_token = self._sender(state.request_id, msg.get("stream_to"), len(state.completion_ids))
                self._imported[state.request_id] = self.runner.import_request(state, on_token=on_token)
                done.append(state.request_id)
                self._note(state.request_id, state.session, "imported")
                await FAULTS.trip("during_import")
                if not self.accepting:  # it started draining meanwhile: what it took so far would be stranded
                    raise RuntimeError(f"{self.worker.address} started draining during the import")
        except Exception as err:
            for rid in done:  # roll back: the sender keeps every one of them
                self._imported.pop(rid, None)
                self._stream_to.pop(rid, None)
                self._note(rid, None, None)
                try:
                    self.runner.export_request(rid)
                except KeyError:
                    pass
            return {"error": f"import failed: {type(err).__name__}: {err}"}
        self.migrated_in += len(done)
        try:  # lets a caller find its request if the source dies before replying
            await self.worker.scheduler.gyreflow_imported(request_ids=done, engine=self.worker.address)
        except Exception:  # no gyreflow scheduler plugin: only the reply can say where it went
            pass
        return {"imported": done}

    async def drain(self, destinations: list[str], fail_after_send: bool = False) -> dict:
        """Stop serving and move every request in the engine to ``destinations`` (spread evenly).

        A destination that fails is skipped; requests nobody took go on here and the cell serves
        again, so nothing is lost. ``fail_after_send`` kills this worker's process once the
        destinations hold the requests but before anyone is told: the failure a migration must
        survive, used by the tests.
        """
        self.accepting = False
        if self.runner is None:
            return {"moved": {}, "kept": 0, "bytes": 0, "seconds": 0.0}
        try:
            out = await self._migrate(lambda: self.runner.engine.request_ids(), destinations, fail_after_send)
        except Exception:
            self.accepting = True
            raise
        left = len(self.runner.engine.request_ids())  # nothing may stay behind on a cell that stops serving
        if out["kept"] or out.get("error") or left:
            self.accepting = True
        return out | {"kept": max(out["kept"], left)}

    async def evict(self, sessions: list[str], destinations: list[str], count: int | None = None) -> dict:
        """Send up to ``count`` of ``sessions`` (in that order of preference) elsewhere, the scheduler
        re-balancing them: only sessions with a generation in flight, which migrates with its KV
        cache, and their next calls follow it. A session between two calls stays: moving it would
        only lose its cached prefix."""
        if self.runner is None:
            return {"moved": {}, "sessions": {}, "kept": 0, "bytes": 0, "seconds": 0.0}

        def which() -> list[str]:
            live = {s: rid for rid, s in list(self._session_of.items()) if s is not None}
            return [live[s] for s in sessions if s in live][:count]

        out = await self._migrate(which, destinations)
        return out | {"sessions": {self._session_of.get(rid): d for rid, d in out["moved"].items()
                                   if self._session_of.get(rid) is not None}}

    async def _migrate(self, which: Callable[[], list[str]], destinations: list[str],
                       fail_after_send: bool = False) -> dict:
        """Export the requests ``which()`` names and import them on ``destinations`` (round robin).

        One migration at a time on a cell. Whatever fails (an export, a destination, a fault),
        every exported request ends up either on a destination that confirmed it or back in this
        engine, and the reply waiting for it is told which: none is left nowhere.
        """
        async with self._migrating:
            t0 = time.perf_counter()
            loop = asyncio.get_running_loop()
            ids = [rid for rid in which() if rid not in self._moves]
            # Created before the export, so each request's waiting reply can follow it.
            where = {rid: loop.create_future() for rid in ids}
            self._moves.update(where)
            states: list = []
            moved: dict[str, str] = {}
            error = None

            def export_all() -> None:  # into ``states`` as it goes: a failure half-way loses none
                for rid in ids:
                    try:
                        states.append(self.runner.export_request(rid))
                    except KeyError:  # finished meanwhile
                        pass

            try:
                await FAULTS.trip("before_export")
                await loop.run_in_executor(None, export_all)
                await FAULTS.trip("after_export")
                plan: dict[str, list] = {d: [] for d in destinations}
                for i, state in enumerate(states):
                    if destinations:
                        plan[destinations[i % len(destinations)]].append(state)

                async def send(dest: str, batch: list) -> None:
                    try:
                        out = await asyncio.wait_for(
                            self.worker.rpc(dest).gyreflow_import(states=[self._state_msg(s) for s in batch]),
                            IMPORT_TIMEOUT_S)
                    except Exception:  # it may have taken them before the line failed: they must not run twice
                        await self._unsend(dest, [s.request_id for s in batch])
                        return
                    if "error" not in out:
                        for s in batch:
                            moved[s.request_id] = dest

                await asyncio.gather(*(send(d, b) for d, b in plan.items() if b))
                if fail_after_send:
                    os._exit(17)
                await FAULTS.trip("after_import")
            except Exception as err:
                error = f"{type(err).__name__}: {err}"
            finally:
                kept = self._keep([s for s in states if s.request_id not in moved])
                exported = {s.request_id for s in states}
                for rid, fut in where.items():
                    if rid not in exported:  # never left (finished meanwhile, or the export failed first)
                        self._moves.pop(rid, None)
                    elif not fut.done():
                        fut.set_result(moved.get(rid, kept.get(rid, self.worker.address)))
            self.migrated_out += len(moved)
            out = {"moved": moved, "kept": len(kept), "bytes": int(sum(state_nbytes(s) for s in states)),
                   "seconds": time.perf_counter() - t0}
            return out | ({"error": error} if error else {})

    def _state_msg(self, state) -> dict:
        msg = state_to_msg(state)
        if state.request_id in self._stream_to:
            msg["stream_to"] = self._stream_to[state.request_id]
        return msg

    async def _unsend(self, dest: str, request_ids: list[str]) -> None:
        """Withdraw requests from ``dest`` after an import whose reply was lost (best effort: a
        destination that cannot be reached cannot run them either)."""
        for rid in request_ids:
            try:
                await asyncio.wait_for(self.worker.rpc(dest).gyreflow_abort(request_id=rid), UNSEND_TIMEOUT_S)
            except Exception:
                return

    def _keep(self, states: list) -> dict:
        """Import ``states`` back into this engine (nobody took them); request id -> this address,
        or the exception if even that failed (the reply then says so)."""
        out: dict = {}
        for s in states:
            try:
                on_token = self._sender(s.request_id, self._stream_to.get(s.request_id), len(s.completion_ids))
                self._imported[s.request_id] = self.runner.import_request(s, on_token=on_token)
                out[s.request_id] = self.worker.address
            except Exception as err:
                out[s.request_id] = err
        return out

    def activity(self) -> dict:
        """What this engine holds, for the scheduler's stall detector: tokens generated so far,
        each request's state and age, and the seconds since each session's last event here."""
        now = time.time()
        tokens = int(self.runner.stats().get("tokens_generated", 0)) if self.runner is not None else 0
        return {"tokens": tokens,
                "requests": {rid: {"session": s, "state": st, "age": now - t} for rid, (s, st, t) in self._state.items()},
                "idle": {s: now - t for s, t in self._seen.items()}}

    def request_status(self, request_id: str) -> dict:
        """Where one request stands here: ``in engine``, ``exported``, ``imported`` or ``unknown``."""
        s = self._state.get(request_id)
        return {"state": "unknown"} if s is None else {"state": s[1], "age": time.time() - s[2]}

    def abort(self, request_id: str) -> dict:
        """Drop a request its caller gave up on (it is run again elsewhere)."""
        self._imported.pop(request_id, None)
        self._stream_to.pop(request_id, None)
        self._note(request_id, None, None)
        if self.runner is not None:
            try:
                self.runner.export_request(request_id)
            except KeyError:
                return {"aborted": False}
        return {"aborted": True}

    def stats(self) -> dict:
        base = self.runner.stats() if self.runner is not None else {"live": 0, "waiting": 0}
        return base | {"accepting": self.accepting, "migrated_in": self.migrated_in, "migrated_out": self.migrated_out}
