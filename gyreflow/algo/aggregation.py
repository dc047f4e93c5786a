"""How a step's loss averages its samples, registered in :data:`~gyreflow.algo.registry.AGGREGATIONS`.

Each function maps the number of samples of each execution of a step, ``(E,)``, to the weight of
one sample of each execution, ``(E,)``; the step's loss is ``sum(w * loss_sample) / sum(w)``.
"""

from __future__ import annotations

import numpy as np

from gyreflow.algo.registry import AGGREGATIONS


@AGGREGATIONS.register("execution_mean")
def execution_mean(samples: np.ndarray) -> np.ndarray:
    """Two-level averaging: a token mean within each execution, then a mean over executions, so a
    long execution weighs as much as a short one."""
    n = np.asarray(samples, dtype=np.float64)
    return np.where(n > 0, 1.0 / np.maximum(n, 1.0), 0.0)


@AGGREGATIONS.register("token_mean")
def token_mean(samples: np.ndarray) -> np.ndarray:
    """One mean over every sample of the step: a long execution weighs by its length."""
    return np.ones(len(samples), dtype=np.float64)
