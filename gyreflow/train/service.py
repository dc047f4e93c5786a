"""The trainer on a cell: a WorkerPlugin that keeps a policy replica for the worker's lifetime.

Any trainer cell can take any share of a step: it loads a weights version once (the first task of
that version on the cell pays it) and keeps it for the next tasks. The optimizer state travels with
the step's update, so the cell that applies the next update need not be the one that applied the
last (cells join and leave the trainer pool at run time).
"""

from __future__ import annotations

import copy
import threading
from typing import TYPE_CHECKING

import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin

from gyreflow.train.reduce import CellSums, share_to_msg
from gyreflow.train.state import PolicyState, PublishedWeights

if TYPE_CHECKING:
    from gyreflow.train.trainer import OptimConfig, Trainer

# torch, transformers and the trainer are imported where they are used: a worker registers this
# plugin at start-up, and cells whose training is emulated (the placement benchmark) never load them.

PLUGIN_NAME = "gyreflow-trainer"


class TrainerService(WorkerPlugin):
    """Holds one :class:`~gyreflow.train.trainer.Trainer` replica per cell."""

    name = PLUGIN_NAME

    def __init__(self, torch_threads: int | None = None):
        self.torch_threads = torch_threads
        self.trainer: Trainer | None = None
        self.run: str | None = None
        self.optimizer_of: tuple[str, int] | None = None
        """(run, version) whose optimizer state the replica's optimizer holds."""
        self.loads = 0
        self.sums: CellSums | None = None
        """This cell's running gradient sums, one per step (see :mod:`gyreflow.train.reduce`);
        made on the worker (a plugin travels pickled)."""
        self.lock: threading.Lock | None = None
        """Held by a task while it uses the replica: one share or update at a time, whatever
        the cell's thread count and resources (made on the worker)."""

    async def setup(self, worker) -> None:
        if self.torch_threads:
            import torch

            torch.set_num_threads(self.torch_threads)
        self.sums = CellSums()
        self.lock = threading.Lock()
        worker.handlers["gyreflow_grad_take"] = self.take_sum

    def take_sum(self, run: str, version: int, keys: list[str]) -> dict:
        """RPC: this cell's gradient sum of the shares ``keys`` (see :meth:`CellSums.take`), as a message."""
        try:
            share = self.sums.take(run, version, keys)
        except KeyError as err:
            return {"error": str(err.args[0])}
        return share_to_msg(share)

    def init(self, hf_config: dict, weights: dict[str, np.ndarray], optim: OptimConfig, version: int) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        from gyreflow.model.policy import load_state_dict_numpy
        from gyreflow.train.trainer import Trainer

        model = LlamaForCausalLM(LlamaConfig(**hf_config))
        load_state_dict_numpy(model, weights)
        model.eval()
        self.trainer = Trainer(model, optim, version=version)
        self.run, self.optimizer_of = None, None

    def require(self) -> Trainer:
        if self.trainer is None:
            raise RuntimeError("this trainer cell has no trainer: run the init task first")
        return self.trainer

    def at(self, published: PublishedWeights) -> Trainer:
        """The replica at ``published`` weights, loading them only when the cell does not hold that
        version of that run yet."""
        from transformers import LlamaConfig

        from gyreflow.model.policy import load_state_dict_numpy

        key = (published.run, published.version)
        if self.trainer is None or (self.run, self.trainer.version) != key:
            if self.trainer is None or self.trainer.model.config.to_dict() != LlamaConfig(**published.hf_config).to_dict():
                self.init(published.hf_config, published.weights, published.optim, published.version)
            else:
                load_state_dict_numpy(self.trainer.model, published.weights)
                self.trainer.version = published.version
            self.run = published.run
            self.loads += 1
        return self.trainer

    def resume(self, state: PolicyState) -> Trainer:
        """The replica at ``state`` with the optimizer state that goes with it."""
        import torch

        trainer = self.at(state.published)
        if self.optimizer_of != (state.run, state.version):
            trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=trainer.cfg.lr,
                                                  weight_decay=trainer.cfg.weight_decay)
            if state.optimizer is not None:
                # load_state_dict keeps the given tensors: copy them, so the update does not
                # change the state Dask holds for others.
                trainer.optimizer.load_state_dict(copy.deepcopy(state.optimizer))
        return trainer

    def applied(self) -> None:
        """The replica's optimizer now holds the state after its current version."""
        self.optimizer_of = (self.run, self.trainer.version)
