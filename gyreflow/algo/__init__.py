"""Advantage estimators, losses and loss aggregations: one registry each, one signature each.

Importing this package registers the built-in estimators (``grpo``, ``dr_grpo``, ``rloo``, ``tree``),
losses (``ppo_clip``, ``reinforce``) and aggregations (``execution_mean``, ``token_mean``).
"""

from gyreflow.algo.registry import ADVANTAGES, AGGREGATIONS, LOSSES, AdvantageFn, AggregationFn, LossFn, Registry
from gyreflow.algo.advantages import GroupTree  # (importing it registers the estimators)
from gyreflow.algo import aggregation as _aggregation  # noqa: F401  (registers aggregations)
from gyreflow.algo import losses as _losses  # noqa: F401  (registers losses)

__all__ = ["ADVANTAGES", "AGGREGATIONS", "LOSSES", "AdvantageFn", "AggregationFn", "GroupTree", "LossFn", "Registry"]
