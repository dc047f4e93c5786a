"""A group's executions merged into one prefix tree, the input of every advantage estimator.

Each root-to-leaf path of each execution's tree is inserted into one token trie; a node of that
trie is a run of tokens that the same executions reached. Executions sample independently, so a
run two of them share is two samples (each execution trains its own copy); the group tree only
says which executions reached which context, which is what node-level credit needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gyreflow.algo.advantages import GroupTree
from gyreflow.trajectory.records import CallRecord, ExecutionResult
from gyreflow.trajectory.tree import TrajectoryTree, build_tree

_NONE = np.zeros(0, np.int32)


def group_tree(trees: Sequence[TrajectoryTree]) -> tuple[GroupTree, list[np.ndarray]]:
    """The prefix tree of ``trees`` (one group's executions) and, per execution, the group node of
    each of its tree's tokens.

    Returns
    -------
    group
        :class:`~gyreflow.algo.advantages.GroupTree` with the executions' rewards.
    token_nodes
        One ``(U_g,)`` int64 array per execution: the group node of each of its tokens.
    """
    paths = [t.paths() for t in trees]
    calls = [CallRecord("group", i, str(i), "main", p.tokens, _NONE, _NONE, _NONE)
             for i, p in enumerate(p for ps in paths for p in ps)]
    merged = build_tree(ExecutionResult("group", "", 0, 0, "train", calls, 0.0, False, "done"))
    K = merged.n_nodes
    sizes = np.diff(merged.node_offsets)  # (K,)
    through = np.zeros((K, len(trees)), np.bool_)
    token_nodes, c = [], 0
    for g, (t, ps) in enumerate(zip(trees, paths)):
        nodes_of = np.full(t.unique_tokens, -1, np.int64)
        for p in ps:
            chain = _ancestors(merged.node_parent, int(merged.call_node[c]))  # root first
            c += 1
            through[chain, g] = True
            along = np.repeat(chain, sizes[chain])[: len(p.tokens)]  # (L,) group node of each position
            nodes_of[t.token_index(p.nodes)] = along
        token_nodes.append(nodes_of)
    return GroupTree(np.array([t.reward for t in trees], np.float64), merged.node_parent.astype(np.int64),
                     through), token_nodes


def _ancestors(parent: np.ndarray, node: int) -> np.ndarray:
    """``node`` and its ancestors, root first."""
    out = []
    while node >= 0:
        out.append(node)
        node = int(parent[node])
    return np.array(out[::-1], np.int64)
