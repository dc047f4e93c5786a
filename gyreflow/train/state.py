"""The state passed between a step's stages: a published weights version and the RL state.

Both are plain dataclasses of numpy arrays and JSON-like values (no torch objects beyond the
optimizer's own state dict), so Dask ships them between cells as it ships any task result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class PublishedWeights:
    """One weights version of a run, as engines and trainer replicas receive it."""

    version: int
    run: str
    """Name of the run: replicas of another run never share state with this one."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """The policy's Hugging Face config (``config.to_dict()``); empty for emulated stages."""
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    """Parameter name -> array; empty for emulated stages."""
    optim: Any = None
    """The :class:`~gyreflow.train.trainer.OptimConfig` a replica trains with."""


@dataclass(frozen=True)
class PolicyState:
    """The RL state a step updates: its weights and the optimizer state that goes with them."""

    published: PublishedWeights
    optimizer: dict | None = None
    """The torch optimizer's state dict; ``None``: a fresh optimizer."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """What the stage that made this state measured (SFT, or the step's update)."""

    @property
    def version(self) -> int:
        return self.published.version

    @property
    def run(self) -> str:
        return self.published.run
