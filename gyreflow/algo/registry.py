"""Name → function registries for advantage estimators, losses and loss aggregations.

Each registry holds functions of one signature, so callers dispatch by config string through
:meth:`Registry.get` and never branch on names themselves::

    from gyreflow.algo import ADVANTAGES, LOSSES, GroupTree

    adv = ADVANTAGES.get("grpo")(GroupTree.flat(rewards))  # (K, G)
    loss, metrics = LOSSES.get("ppo_clip")(logprobs, old_logprobs, advantages, mask, clip_eps=0.2)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from gyreflow.registry import Registry

if TYPE_CHECKING:  # annotations only: importing the registries does not load torch
    import torch

    from gyreflow.algo.advantages import GroupTree


class AdvantageFn(Protocol):
    """Advantages of one group: the executions of one task in one step."""

    def __call__(self, group: GroupTree, **kwargs: Any) -> np.ndarray:
        """Map the group's prefix tree (``K`` nodes, ``G`` executions and their rewards) to the
        advantage ``(K, G)`` float64 of each node for each execution that reached it (0 elsewhere).

        An estimator that reads the tree's structure is marked ``node_level``
        (:func:`~gyreflow.algo.advantages.node_level`); the others are handed a flat tree."""
        ...


class LossFn(Protocol):
    """A policy-gradient loss over flattened tokens."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Map per-token tensors ``(N,)`` to a scalar loss and float metrics."""
        ...


class AggregationFn(Protocol):
    """Per-sample loss weight of each execution of a step."""

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        """Map samples per execution ``(E,)`` to the weight of each of its samples ``(E,)``."""
        ...


ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation")
LOSSES: Registry[LossFn] = Registry("loss")
