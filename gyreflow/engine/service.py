"""The engine on a rollout cell: a WorkerPlugin that holds it for the worker's lifetime.

The engine is built when the first weights are published to the worker, and serves the
``gyreflow_generate`` RPC that routers call.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch
from distributed.diagnostics.plugin import WorkerPlugin
from transformers import LlamaConfig, LlamaForCausalLM

from gyreflow.engine.runner import EngineRunner
from gyreflow.engine.torch_engine import TorchEngine
from gyreflow.engine.wire import msg_to_request, result_to_msg

PLUGIN_NAME = "gyreflow-engine"


class EngineService(WorkerPlugin):
    """Hosts one engine per worker.

    Parameters
    ----------
    engine_options
        Keyword arguments of :class:`~gyreflow.engine.torch_engine.TorchEngine`
        (``max_batch``, ``max_seq_len``, ``retain_slots``...).
    torch_threads
        Intra-op threads of this worker's torch (``None`` leaves torch's default).
    """

    name = PLUGIN_NAME

    def __init__(self, engine_options: dict | None = None, torch_threads: int | None = None):
        self.engine_options = dict(engine_options or {})
        self.torch_threads = torch_threads
        self.runner: EngineRunner | None = None
        self.worker = None
        self._ready: asyncio.Event | None = None

    async def setup(self, worker) -> None:
        self.worker = worker
        self._ready = asyncio.Event()
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        worker.handlers["gyreflow_generate"] = self.generate
        worker.handlers["gyreflow_engine_stats"] = self.stats

    def teardown(self, worker) -> None:
        if self.runner is not None:
            self.runner.stop()

    def load(self, hf_config: dict, weights: dict[str, np.ndarray], version: int) -> dict:
        """Install weights ``version`` (building the engine on first use); runs in a task thread."""
        if self.runner is None:
            model = LlamaForCausalLM(LlamaConfig(**hf_config))
            engine = TorchEngine(model, name=self.worker.address, version=version, **self.engine_options)
            engine.load_weights(weights, version)
            self.runner = EngineRunner(engine, name=f"engine-{self.worker.address}").start()
            self.worker.loop.add_callback(self._ready.set)
        else:
            self.runner.load_weights(weights, version)
        return {"engine": self.worker.address, "version": version}

    async def generate(self, request: dict) -> dict:
        if self.runner is None:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout=60)
            except asyncio.TimeoutError:
                return {"error": "engine has no weights yet"}
        try:
            req = msg_to_request(request)
            res = await asyncio.wrap_future(self.runner.submit(req))
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}
        return result_to_msg(res)

    def stats(self) -> dict:
        return self.runner.stats() if self.runner is not None else {}
