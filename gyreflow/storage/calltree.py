"""An execution's calls as a token tree, and back: how segments (and version-2 groups) store them.

Every call's sequence (prompt, then completion) is a root-to-node prefix of the execution's
prefix-sharing token tree (:func:`gyreflow.trajectory.tree.build_tree`), so the archive stores the
tree's tokens once and, per call, the node its sequence ends in and its two lengths. An agent whose
every prompt extends the previous call's sequence stores O(tokens) instead of O(calls x tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyreflow.trajectory.records import CallRecord, ExecutionResult
from gyreflow.trajectory.tree import TrajectoryTree, build_tree

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
    def of(cls, calls: list[CallRecord], tree: TrajectoryTree | None = None) -> CallTree:
        """The tree of ``calls`` (in the given order); ``tree``: their trajectory tree where one was
        built already (``build_tree`` of these calls), used unless it fails a check of each call's
        length, first and last token against it (then the tree is built again)."""
        if tree is not None and tree.call_node is not None and tree.n_calls == len(calls):
            given = cls._placed(calls, tree)
            if given._ends_match(calls):
                return given
        return cls._placed(calls, build_tree(ExecutionResult("storage", "", 0, 0, "train", list(calls), 0.0, False,
                                                             "done")))

    @classmethod
    def _placed(cls, calls: list[CallRecord], tree: TrajectoryTree) -> CallTree:
        order = sorted(range(len(calls)), key=lambda k: calls[k].call_index)  # build_tree's (stable) order
        nodes = np.empty(len(calls), np.int32)
        nodes[order] = tree.call_node
        return cls(tree.tokens, tree.node_offsets, tree.node_parent, nodes,
                   np.array([len(c.prompt_ids) for c in calls], np.int64),
                   np.array([len(c.completion_ids) for c in calls], np.int64))

    def _ends_match(self, calls: list[CallRecord]) -> bool:
        """Each call ends inside its node, on its own last token, and its path starts with its first
        token: what tells a tree of other calls (a wrong one handed in) at a cost of O(calls + nodes)."""
        n = len(self.node_parent)
        sizes = np.diff(self.node_offsets)  # (N,)
        depth = np.zeros(n, np.int64)  # (N,) path length before each node
        root = np.arange(n)  # (N,) first node of each node's path
        for i in range(n):  # pre-order: a parent comes first
            p = int(self.node_parent[i])
            if p >= 0:
                depth[i], root[i] = depth[p] + sizes[p], root[p]
        lengths = self.call_prompt + self.call_completion  # (C,)
        placed = self.call_node >= 0
        if np.any(lengths[~placed] != 0):
            return False
        node, length = self.call_node[placed], lengths[placed]
        if np.any(length <= depth[node]) or np.any(length > depth[node] + sizes[node]):
            return False
        seqs = [(c.prompt_ids, c.completion_ids) for c, keep in zip(calls, placed) if keep]
        first = np.array([p[0] if len(p) else q[0] for p, q in seqs], np.int64)
        last = np.array([q[-1] if len(q) else p[-1] for p, q in seqs], np.int64)
        return (np.array_equal(self.tokens[self.node_offsets[node] + length - depth[node] - 1], last)
                and np.array_equal(self.tokens[self.node_offsets[root[node]]], first))

    def sequences(self) -> list[np.ndarray]:
        """Every call's prompt and completion, concatenated, as the tree stores them: views of one
        token array per node that calls end in (an agent's calls mostly end in a few nodes).

        Raises
        ------
        ValueError
            If the stored arrays cannot hold a call (a damaged group).
        """
        paths: dict[int, tuple[np.ndarray, int]] = {}  # node -> (its path's tokens, where the node starts)
        out = []
        for k in range(len(self.call_node)):
            node = int(self.call_node[k])
            if node not in paths:
                paths[node] = self._path(k, node)
            seq, before = paths[node]
            length = int(self.call_prompt[k] + self.call_completion[k])
            if len(seq) < length or (node >= 0 and before >= length) or (node < 0 and length):
                raise ValueError(f"call {k}: {length} tokens do not end in node {node}")
            out.append(seq[:length])
        return out

    def _path(self, k: int, node: int) -> tuple[np.ndarray, int]:
        """The tokens from the root to the end of ``node`` and the length before ``node`` starts."""
        path, n = [], len(self.node_parent)
        while node >= 0:
            if node >= n or len(path) > n:
                raise ValueError(f"call {k}: node {node} is not in the tree")
            path.append(node)
            node = int(self.node_parent[node])
        if not path:
            return _EMPTY, 0
        path.reverse()
        start, before, end = (int(self.node_offsets[i]) for i in (path[0], path[-1], path[-1] + 1))
        if path[-1] - path[0] == len(path) - 1:
            # Each node the first child of the one before: the path lies contiguous in pre-order.
            return self.tokens[start:end], before - start
        seq = np.concatenate([self.tokens[self.node_offsets[i] : self.node_offsets[i + 1]] for i in path])
        return seq, len(seq) - (end - before)

