"""The state passed between a step's stages: a group's samples, a published weights version and
the RL state (gradient shares: :class:`~gyreflow.train.reduce.GradientShare`).

They are plain dataclasses of numpy arrays and JSON-like values (no torch objects beyond the
optimizer's own state dict), so Dask ships them between cells as it ships any task result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gyreflow.train.packing import PathSample


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


@dataclass(frozen=True)
class GroupSamples:
    """What a group's advantage stage hands its gradient shares: the samples to train."""

    samples: list[PathSample]
    """Paths (or packed trees) with their advantages and loss weights; empty when the group has
    no advantage signal."""
    rewards: list[float]
    """Per execution of the group, in order."""
    advantages: list[float]
    """Per execution: the mean advantage of its sampled tokens."""
