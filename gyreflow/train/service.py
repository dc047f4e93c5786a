"""The trainer on a trainer cell: a WorkerPlugin that holds it for the worker's lifetime."""

from __future__ import annotations

import numpy as np
import torch
from distributed.diagnostics.plugin import WorkerPlugin
from transformers import LlamaConfig, LlamaForCausalLM

from gyreflow.model.policy import load_state_dict_numpy
from gyreflow.train.trainer import OptimConfig, Trainer

PLUGIN_NAME = "gyreflow-trainer"


class TrainerService(WorkerPlugin):
    """Holds one :class:`~gyreflow.train.trainer.Trainer`, created by :meth:`init` from a task."""

    name = PLUGIN_NAME

    def __init__(self, torch_threads: int | None = None):
        self.torch_threads = torch_threads
        self.trainer: Trainer | None = None

    async def setup(self, worker) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)

    def init(self, hf_config: dict, weights: dict[str, np.ndarray], optim: OptimConfig, version: int) -> None:
        model = LlamaForCausalLM(LlamaConfig(**hf_config))
        load_state_dict_numpy(model, weights)
        model.eval()
        self.trainer = Trainer(model, optim, version=version)

    def require(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError("this trainer cell has no trainer: run the init task first")
        return self.trainer
