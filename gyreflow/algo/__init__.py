"""Advantage estimators and losses: one registry each, one signature each.

Importing this package registers the built-in estimators (``grpo``, ``dr_grpo``, ``rloo``) and
losses (``ppo_clip``, ``reinforce``).
"""

from gyreflow.algo.registry import ADVANTAGES, LOSSES, AdvantageFn, LossFn, Registry
from gyreflow.algo import advantages as _advantages  # noqa: F401  (registers estimators)
from gyreflow.algo import losses as _losses  # noqa: F401  (registers losses)

__all__ = ["ADVANTAGES", "LOSSES", "AdvantageFn", "LossFn", "Registry"]
