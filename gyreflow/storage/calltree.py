"""An execution's calls as a token tree, and back: the layout of schema-2 execution groups.

Every call's sequence (prompt, then completion) is a root-to-node prefix of the execution's
prefix-sharing token tree (:func:`gyreflow.trajectory.tree.build_tree`), so the archive stores the
tree's tokens once and, per call, the node its sequence ends in and its two lengths. An agent whose
every prompt extends the previous call's sequence stores O(tokens) instead of O(calls x tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyreflow.trajectory.records import CallRecord, ExecutionResult
from gyreflow.trajectory.tree import build_tree

_EMPTY = np.zeros(0, np.int32)


@dataclass(frozen=True)
class CallTree:
    """The token tree of an execution's calls and where each call lies in it."""

    tokens: np.ndarray  # (U,) int32, node runs in pre-order
    node_offsets: np.ndarray  # (N + 1,) int64
    node_parent: np.ndarray  # (N,) int32, -1 under the root
    call_node: np.ndarray  # (n_calls,) int32, node holding the call's last token; -1 for an empty call
    call_prompt: np.ndarray  # (n_calls,) int64, prompt length
    call_completion: np.ndarray  # (n_calls,) int64, completion length

    @classmethod
    def of(cls, calls: list[CallRecord]) -> CallTree:
        """The tree of ``calls`` (in the given order)."""
        tree = build_tree(ExecutionResult("storage", "", 0, 0, "train", list(calls), 0.0, False, "done"))
        order = sorted(range(len(calls)), key=lambda k: calls[k].call_index)  # build_tree's (stable) order
        nodes = np.empty(len(calls), np.int32)
        nodes[order] = tree.call_node
        return cls(tree.tokens, tree.node_offsets, tree.node_parent, nodes,
                   np.array([len(c.prompt_ids) for c in calls], np.int64),
                   np.array([len(c.completion_ids) for c in calls], np.int64))

    def sequence(self, k: int) -> np.ndarray:
        """Call ``k``'s prompt and completion, concatenated, as the tree stores them.

        Raises
        ------
        ValueError
            If the stored arrays cannot hold the call (a damaged group).
        """
        node, path = int(self.call_node[k]), []
        n = len(self.node_parent)
        while node >= 0:
            if node >= n or len(path) > n:
                raise ValueError(f"call {k}: node {node} is not in the tree")
            path.append(node)
            node = int(self.node_parent[node])
        runs = [self.tokens[self.node_offsets[i] : self.node_offsets[i + 1]] for i in reversed(path)]
        seq = np.concatenate(runs) if runs else _EMPTY
        length = int(self.call_prompt[k] + self.call_completion[k])
        if len(seq) < length or (path and len(seq) - len(runs[-1]) >= length):
            raise ValueError(f"call {k}: {length} tokens do not end in node {int(self.call_node[k])}")
        return seq[:length]
