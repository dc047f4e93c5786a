"""Advantage estimators, registered in :data:`~gyreflow.algo.registry.ADVANTAGES`.

Every estimator maps one group (the executions of one task in one step) to advantages on the
nodes of the group's prefix tree (:class:`GroupTree`): the tree of every path of every execution,
merged by shared token prefix, so a node is a run of tokens that the same executions reached. An
execution's token takes the advantage of its node for that execution.

The group-relative estimators (``grpo``, ``dr_grpo``, ``rloo``) give an execution one advantage on
all of its nodes. ``tree`` credits each node by the rewards of the executions that reached it. A
group without a usable baseline (one execution, or all rewards equal) carries no relative signal,
so every estimator returns zeros for it rather than inventing one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyreflow.algo.registry import ADVANTAGES


@dataclass(frozen=True)
class GroupTree:
    """A group's prefix tree: which executions reached each node, and each node's parent."""

    rewards: np.ndarray  # (G,) float64
    node_parent: np.ndarray  # (K,) int64, a node before its children; -1 under the root
    through: np.ndarray  # (K, G) bool, execution g has a path through node k

    def __post_init__(self) -> None:
        G, K = len(self.rewards), len(self.node_parent)
        if self.through.shape != (K, G):
            raise ValueError(f"through must be (nodes, executions) = ({K}, {G}), got {self.through.shape}")
        if K and (np.any(self.node_parent >= np.arange(K)) or self.node_parent.min() < -1):
            raise ValueError("node_parent must point to an earlier node (-1: the root)")

    @classmethod
    def flat(cls, rewards: np.ndarray) -> GroupTree:
        """Executions that share no tokens: one node each, under the root."""
        r = _as_rewards(rewards)
        return cls(r, np.full(len(r), -1, np.int64), np.eye(len(r), dtype=np.bool_))

    def spread(self, per_execution: np.ndarray) -> np.ndarray:
        """``(K, G)``: execution ``g``'s advantage on every node it reached."""
        return self.through * np.asarray(per_execution, dtype=np.float64)[None, :]


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


def _centred(rewards: np.ndarray) -> np.ndarray:
    """``r - mean``, ``(G,)``; zeros when the group has no signal."""
    r = _as_rewards(rewards)
    return np.zeros_like(r) if _no_signal(r) else r - r.mean()


@ADVANTAGES.register("grpo")
def grpo(group: GroupTree, *, scale_by_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    """Group-relative advantages: ``(r - mean) / (std + eps)`` on every node of an execution.

    Parameters
    ----------
    group
        The group's prefix tree and rewards.
    scale_by_std
        Divide by the group's population standard deviation (``ddof=0``). ``False`` gives the
        mean-centred variant (as :func:`dr_grpo`).
    eps
        Added to the std so that nearly-equal rewards do not blow up.

    Returns
    -------
    np.ndarray
        ``(K, G)`` float64; zeros for a group of one or all-equal rewards.
    """
    centred = _centred(group.rewards)  # (G,)
    if scale_by_std and centred.any():
        centred = centred / (group.rewards.std() + eps)
    return group.spread(centred)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(group: GroupTree) -> np.ndarray:
    """Mean-centred advantages ``r - mean`` (Dr. GRPO: no std scaling).

    Not dividing by the std keeps easy and hard tasks (low-variance groups) from being
    up-weighted relative to the others. Returns ``(K, G)``.
    """
    return group.spread(_centred(group.rewards))


@ADVANTAGES.register("rloo")
def rloo(group: GroupTree) -> np.ndarray:
    """Leave-one-out baseline: ``r_i - mean_{j != i} r_j``.

    Equals ``G / (G - 1) * (r_i - mean)``; the baseline of each execution is independent of its
    own reward, so the estimator stays unbiased. Returns ``(K, G)``.
    """
    centred = _centred(group.rewards)  # (G,)
    g = len(centred)
    return group.spread(centred * (g / (g - 1)) if g > 1 else centred)


def node_level(fn):
    """Mark an estimator that reads the group tree's structure. The others give each execution one
    advantage, so a flat tree (:meth:`GroupTree.flat`) gives them the same result at no cost, and
    callers pass one."""
    fn.node_level = True
    return fn


@ADVANTAGES.register("tree")
@node_level
def tree(group: GroupTree) -> np.ndarray:
    """Node advantages from the group's prefix tree (global plus local, as TreeRL defines them).

    With ``V(k)`` the mean reward of the executions that reached node ``k`` (``V`` of the root:
    the group mean), node ``k`` gets ``(V(k) - V(root)) + (V(k) - V(parent))``, divided by the
    square root of the number of executions that reached it (each trains its own copy of the
    node's tokens). A node where executions part ways is credited with how much better the
    executions that took it did than those that reached its parent; below the point where an
    execution is alone the local term vanishes and the global one (``r - mean``) remains.

    Returns
    -------
    np.ndarray
        ``(K, G)`` float64: the node's advantage for every execution that reached it; zeros for a
        group of one or all-equal rewards.
    """
    r = _as_rewards(group.rewards)
    if _no_signal(r):
        return np.zeros(group.through.shape)
    reached = group.through.sum(axis=1)  # (K,)
    if np.any(reached == 0):
        raise ValueError("every node of a group tree must be reached by some execution")
    value = group.through @ r / reached  # (K,)
    root = r.mean()
    parent = np.where(group.node_parent >= 0, value[np.maximum(group.node_parent, 0)], root)  # (K,)
    node = ((value - root) + (value - parent)) / np.sqrt(reached)  # (K,)
    return group.through * node[:, None]
