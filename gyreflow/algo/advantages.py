"""Group advantage estimators, registered in :data:`~gyreflow.algo.registry.ADVANTAGES`.

Every estimator maps the rewards of one group (the executions of one task in one step) to one
advantage per execution. A group without a usable baseline (one execution, or all rewards equal)
carries no relative signal, so every estimator returns zeros for it rather than inventing one.
"""

from __future__ import annotations

import numpy as np

from gyreflow.algo.registry import ADVANTAGES


def _as_rewards(rewards: np.ndarray) -> np.ndarray:
    """Validate rewards as a finite 1-D float64 array."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D (G,), got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {r}")
    return r


def _no_signal(r: np.ndarray) -> bool:
    """True when the group cannot tell better from worse executions."""
    return len(r) < 2 or bool(np.all(r == r[0]))


@ADVANTAGES.register("grpo")
def grpo(rewards: np.ndarray, *, scale_by_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    """Group-relative advantages: ``(r - mean) / (std + eps)``.

    Parameters
    ----------
    rewards
        ``(G,)`` rewards of one group.
    scale_by_std
        Divide by the group's population standard deviation (``ddof=0``). ``False`` gives the
        mean-centred variant (as :func:`dr_grpo`).
    eps
        Added to the std so that nearly-equal rewards do not blow up.

    Returns
    -------
    np.ndarray
        ``(G,)`` float64; zeros for a group of one or all-equal rewards.
    """
    centred = dr_grpo(rewards)  # (G,), zeros when the group has no signal
    if scale_by_std and centred.any():
        centred = centred / (_as_rewards(rewards).std() + eps)
    return centred


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards: np.ndarray) -> np.ndarray:
    """Mean-centred advantages ``r - mean`` (Dr. GRPO: no std scaling).

    Not dividing by the std keeps easy and hard tasks (low-variance groups) from being
    up-weighted relative to the others.

    Returns
    -------
    np.ndarray
        ``(G,)`` float64; zeros for a group of one or all-equal rewards.
    """
    r = _as_rewards(rewards)
    if _no_signal(r):
        return np.zeros_like(r)
    return r - r.mean()


@ADVANTAGES.register("rloo")
def rloo(rewards: np.ndarray) -> np.ndarray:
    """Leave-one-out baseline: ``r_i - mean_{j != i} r_j``.

    Equals ``G / (G - 1) * (r_i - mean)``; the baseline of each execution is independent of its
    own reward, so the estimator stays unbiased.

    Returns
    -------
    np.ndarray
        ``(G,)`` float64; zeros for a group of one or all-equal rewards.
    """
    centred = dr_grpo(rewards)  # (G,)
    g = len(centred)
    return centred * (g / (g - 1)) if g > 1 else centred
