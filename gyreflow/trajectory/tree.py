"""Prefix-sharing trajectory trees: an execution's call records merged by shared token prefix.

Each call contributes one sequence, ``prompt_ids + completion_ids``. Completion tokens are
*sampled*: they carry a behaviour log-prob and a weights version and can be trained. Prompt
tokens are context only. The sequences are inserted into a compressed token trie (a node is a run
of tokens with a single continuation):

- a sequence that is a prefix of what is already there adds no tokens;
- a sequence that continues a leaf extends that leaf in place;
- otherwise the sequence branches off at its longest common prefix with the trie.

A token is sampled if any call sampled it at that position after that prefix; the first call to
sample it provides its log-prob and version. This matters because an agent's completion reappears
verbatim as prompt text in its next call, where it must stay trainable. Every further call that
sampled the same token after the same prefix (a looping agent after compaction, best-of-n, sub-agents
on one prompt) is kept as an *extra sample* of that token, with its own log-prob and version: the
loss counts a token once per sample, exactly as training every call on its own would.

In the usual agent loop each prompt is the previous prompt + completion + a tool message, so the
tree is a single chain and the whole execution trains as one sequence. Context compaction, retries
and sub-agents make it branch. Every root-to-leaf path is a :class:`TreePath`; each node's tokens
are *owned* by exactly one path so that a shared prefix is trained once (loss mask =
``sampled & owned``).

The tree's canonical form is flat arrays in depth-first pre-order (see
:meth:`TrajectoryTree.to_arrays`), which is also what the archive stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gyreflow.trajectory.records import CallRecord, ExecutionResult

_ARRAY_DTYPES: dict[str, type] = {
    "tokens": np.int32,
    "sampled": np.bool_,
    "logprobs": np.float32,
    "versions": np.int32,
    "node_offsets": np.int64,
    "node_parent": np.int32,
    "node_role": np.int32,
    "node_call": np.int32,
}
_EXTRA_DTYPES: dict[str, type] = {
    "extra_index": np.int64,
    "extra_logprobs": np.float32,
    "extra_versions": np.int32,
}


_EMPTY_I64 = np.zeros(0, np.int64)
_EMPTY_F32 = np.zeros(0, np.float32)
_EMPTY_I32 = np.zeros(0, np.int32)


@dataclass
class TreePath:
    """One root-to-leaf path of a :class:`TrajectoryTree`; all arrays have length ``L``."""

    tokens: np.ndarray  # (L,) int32
    sampled: np.ndarray  # (L,) bool, produced by the model (trainable)
    logprobs: np.ndarray  # (L,) float32, behaviour log-prob; 0 where not sampled
    versions: np.ndarray  # (L,) int32, weights version; -1 where not sampled
    owned: np.ndarray  # (L,) bool, trained by this path (each node is owned by one path)
    nodes: np.ndarray  # (K,) int32, pre-order node indices from root to leaf
    leaf: int
    """Index of the leaf among the tree's leaves (pre-order)."""
    role: str
    """Role of the call whose sequence ends at this leaf (the last one to extend it)."""
    call_index: int
    """``call_index`` of that call."""
    # Further samples of owned tokens (see the module docstring): position in the path, behaviour
    # log-prob, weights version; a position appears once per extra sample.
    extra_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (E,) int64
    extra_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (E,) float32
    extra_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # (E,) int32

    @property
    def loss_mask(self) -> np.ndarray:
        """``(L,)`` bool: tokens this path trains, ``sampled & owned``."""
        return self.sampled & self.owned

    @property
    def n_trained(self) -> int:
        """Samples this path trains: one per trained token plus its extra samples."""
        return int(self.loss_mask.sum()) + len(self.extra_pos)

    def __len__(self) -> int:
        return len(self.tokens)


class _Node:
    """A mutable trie node used while building: a run of tokens in growable buffers."""

    __slots__ = ("tokens", "sampled", "logprobs", "versions", "n", "children", "role", "call", "extras")

    def __init__(
        self,
        tokens: np.ndarray,
        sampled: np.ndarray,
        logprobs: np.ndarray,
        versions: np.ndarray,
        role: str,
        call: int,
    ) -> None:
        self.tokens = tokens.copy()
        self.sampled = sampled.copy()
        self.logprobs = logprobs.copy()
        self.versions = versions.copy()
        self.n = len(tokens)
        # Insertion-ordered: pre-order follows creation order, which keeps the layout stable.
        self.children: dict[int, _Node] = {}
        self.role = role
        self.call = call
        # Further samples of tokens already sampled here: (position in the node, log-prob, version).
        self.extras: list[tuple[int, float, int]] = []

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = self.n
        return self.tokens[:n], self.sampled[:n], self.logprobs[:n], self.versions[:n]

    def extend(
        self, tokens: np.ndarray, sampled: np.ndarray, logprobs: np.ndarray, versions: np.ndarray
    ) -> None:
        """Append a run; capacity doubles so a long chain of calls costs amortised O(tokens)."""
        need = self.n + len(tokens)
        if need > len(self.tokens):
            cap = max(need, 2 * len(self.tokens))
            for name in ("tokens", "sampled", "logprobs", "versions"):
                old = getattr(self, name)
                new = np.empty(cap, dtype=old.dtype)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)
        s = slice(self.n, need)
        self.tokens[s] = tokens
        self.sampled[s] = sampled
        self.logprobs[s] = logprobs
        self.versions[s] = versions
        self.n = need

    def mark_sampled(
        self, k: int, sampled: np.ndarray, logprobs: np.ndarray, versions: np.ndarray
    ) -> None:
        """Mark the first ``k`` tokens sampled where the incoming call sampled them.

        Tokens already sampled keep their log-prob and version (first sampler wins); the incoming
        call's samples of them become extra samples.
        """
        if not sampled.any():
            return
        again = np.flatnonzero(sampled & self.sampled[:k])  # (r,)
        self.extras.extend((int(i), float(logprobs[i]), int(versions[i])) for i in again)
        new = sampled & ~self.sampled[:k]  # (k,)
        if new.any():
            self.sampled[:k] |= new
            self.logprobs[:k][new] = logprobs[new]
            self.versions[:k][new] = versions[new]

    def split(self, k: int) -> None:
        """Cut after ``k`` tokens; the rest becomes this node's only child."""
        t, s, lp, v = self.arrays()
        tail = _Node(t[k:], s[k:], lp[k:], v[k:], self.role, self.call)
        tail.children = self.children
        tail.extras = [(i - k, x, y) for i, x, y in self.extras if i >= k]
        self.extras = [e for e in self.extras if e[0] < k]
        # Copy the head too, so a long node's buffer is not kept alive at full capacity.
        self.tokens, self.sampled = t[:k].copy(), s[:k].copy()
        self.logprobs, self.versions = lp[:k].copy(), v[:k].copy()
        self.n = k
        self.children = {int(tail.tokens[0]): tail}


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two equal-length arrays."""
    neq = a != b
    i = int(np.argmax(neq))
    return i if neq[i] else len(a)


def _call_arrays(call: CallRecord) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A call's sequence and per-token sampled flag, log-prob and version."""
    p, c = len(call.prompt_ids), len(call.completion_ids)
    tokens = np.concatenate([call.prompt_ids, call.completion_ids]).astype(np.int32)
    sampled = np.zeros(p + c, dtype=np.bool_)
    sampled[p:] = True
    logprobs = np.zeros(p + c, dtype=np.float32)
    logprobs[p:] = call.logprobs
    versions = np.full(p + c, -1, dtype=np.int32)
    versions[p:] = call.versions
    return tokens, sampled, logprobs, versions


class _TrieBuilder:
    """Inserts call sequences into a compressed trie."""

    def __init__(self) -> None:
        self.root: dict[int, _Node] = {}

    def insert(self, call: CallRecord) -> None:
        seq, sampled, logprobs, versions = _call_arrays(call)
        total = len(seq)
        children, parent, pos = self.root, None, 0
        while pos < total:
            child = children.get(int(seq[pos]))
            rest = slice(pos, total)
            if child is None:
                if parent is not None and not parent.children:
                    # Continues a leaf: grow it rather than hang a single child under it.
                    parent.extend(seq[rest], sampled[rest], logprobs[rest], versions[rest])
                    parent.role, parent.call = call.role, call.call_index
                else:
                    node = _Node(
                        seq[rest], sampled[rest], logprobs[rest], versions[rest],
                        call.role, call.call_index,
                    )
                    children[int(seq[pos])] = node
                return
            m = min(child.n, total - pos)
            run = slice(pos, pos + m)
            k = _lcp(child.tokens[:m], seq[run])
            hit = slice(pos, pos + k)
            child.mark_sampled(k, sampled[hit], logprobs[hit], versions[hit])
            if k < child.n:
                if pos + k < total:
                    # Diverges inside the node: branch at the longest common prefix.
                    child.split(k)
                    branch = slice(pos + k, total)
                    child.children[int(seq[pos + k])] = _Node(
                        seq[branch], sampled[branch], logprobs[branch], versions[branch],
                        call.role, call.call_index,
                    )
                return  # else: a prefix of what is there, nothing new
            children, parent, pos = child.children, child, pos + k


@dataclass(eq=False)  # array fields: identity, not element-wise, equality
class TrajectoryTree:
    """An execution's call records as a prefix-sharing token tree, in flat pre-order arrays.

    Nodes are numbered in depth-first pre-order (a parent before its children, siblings in
    creation order); node ``i`` holds the tokens ``[node_offsets[i], node_offsets[i + 1])`` of the
    token arrays. Build one with :func:`build_tree`.
    """

    execution_id: str
    task_id: str
    reward: float
    total_tokens: int
    """Sum over calls of ``len(prompt) + len(completion)``: what training every call apart costs."""
    n_calls: int
    tokens: np.ndarray  # (U,) int32, node runs concatenated in pre-order
    sampled: np.ndarray  # (U,) bool
    logprobs: np.ndarray  # (U,) float32, 0 where not sampled
    versions: np.ndarray  # (U,) int32, -1 where not sampled
    node_offsets: np.ndarray  # (n_nodes + 1,) int64
    node_parent: np.ndarray  # (n_nodes,) int32, -1 under the (token-less) root
    node_role: np.ndarray  # (n_nodes,) int32 index into ``roles``
    node_call: np.ndarray  # (n_nodes,) int32, call_index of the call that created/last extended it
    roles: list[str]
    # Further samples of sampled tokens: token index (ascending), behaviour log-prob, version.
    extra_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (E,) int64
    extra_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (E,) float32
    extra_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # (E,) int32

    def __post_init__(self) -> None:
        n = len(self.node_parent)
        u = len(self.tokens)
        if any(len(a) != u for a in (self.sampled, self.logprobs, self.versions)):
            raise ValueError("token arrays differ in length")
        if len(self.node_offsets) != n + 1 or len(self.node_role) != n or len(self.node_call) != n:
            raise ValueError("node arrays do not match the node count")
        if self.node_offsets[0] != 0 or self.node_offsets[-1] != u:
            raise ValueError("node_offsets must span the token arrays")
        if n and (np.any(np.diff(self.node_offsets) <= 0)):
            raise ValueError("every node must hold at least one token")
        if n and (np.any(self.node_parent >= np.arange(n)) or self.node_parent.min() < -1):
            raise ValueError("node_parent must point to an earlier node (pre-order)")
        if n and (self.node_role.min() < 0 or self.node_role.max() >= len(self.roles)):
            raise ValueError("node_role out of range of roles")
        e = len(self.extra_index)
        if len(self.extra_logprobs) != e or len(self.extra_versions) != e:
            raise ValueError("extra sample arrays differ in length")
        if e and (np.any(np.diff(self.extra_index) < 0) or self.extra_index[0] < 0 or self.extra_index[-1] >= u):
            raise ValueError("extra_index must be ascending token indices")
        if e and not self.sampled[self.extra_index].all():
            raise ValueError("an extra sample points to a token that is not sampled")
        has_child = np.zeros(n, dtype=np.bool_)
        parents = self.node_parent[self.node_parent >= 0]
        has_child[parents] = True
        self._leaves = np.flatnonzero(~has_child).astype(np.int32)  # (n_leaves,)

    # ------------------------------------------------------------------------------ sizes

    @property
    def n_nodes(self) -> int:
        return len(self.node_parent)

    @property
    def n_leaves(self) -> int:
        return len(self._leaves)

    @property
    def unique_tokens(self) -> int:
        """Tokens stored in the trie: what training the tree costs."""
        return len(self.tokens)

    @property
    def n_samples(self) -> int:
        """Sampled tokens counted once per call that sampled them: what the loss averages over."""
        return int(self.sampled.sum()) + len(self.extra_index)

    def sample_counts(self) -> np.ndarray:
        """``(U,)`` int32: how many calls sampled each token (0 for context)."""
        counts = self.sampled.astype(np.int32)
        np.add.at(counts, self.extra_index, 1)
        return counts

    @property
    def leaves(self) -> np.ndarray:
        """``(n_leaves,)`` int32 node index of each leaf, in pre-order."""
        return self._leaves

    # ------------------------------------------------------------------------------ paths

    def _node_path(self, node: int) -> list[int]:
        """Node indices from the root down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = int(self.node_parent[node])
        return out[::-1]

    def _owners(self, leaves: Sequence[int]) -> np.ndarray:
        """``(n_nodes,)`` position in ``leaves`` of each node's owner, -1 if no path covers it."""
        owner = np.full(self.n_nodes, -1, dtype=np.int64)
        for pos, leaf in enumerate(leaves):
            node = int(self._leaves[leaf])
            # An owned node's ancestors are owned by the same earlier path: stop there.
            while node >= 0 and owner[node] < 0:
                owner[node] = pos
                node = int(self.node_parent[node])
        return owner

    def paths(self, leaves: Sequence[int] | None = None) -> list[TreePath]:
        """Root-to-leaf paths, with ownership assigned among the paths returned.

        Parameters
        ----------
        leaves
            Which leaves (indices into :attr:`leaves`), in priority order; default all, in
            pre-order. Each node is owned by the first returned path that covers it, so a
            subset (bounded sampling) still trains every node it covers exactly once.

        Returns
        -------
        list[TreePath]
            One per requested leaf, in the order requested.
        """
        order = list(range(self.n_leaves)) if leaves is None else [int(x) for x in leaves]
        if len(set(order)) != len(order) or any(not 0 <= x < self.n_leaves for x in order):
            raise ValueError(
                f"leaves must be distinct indices in [0, {self.n_leaves}), got {order}"
            )
        owner = self._owners(order)
        out = []
        for pos, leaf in enumerate(order):
            nodes = self._node_path(int(self._leaves[leaf]))
            spans = [slice(self.node_offsets[i], self.node_offsets[i + 1]) for i in nodes]
            owned = [np.full(s.stop - s.start, owner[i] == pos) for i, s in zip(nodes, spans)]
            extra_pos, extra_lp, extra_v = [], [], []
            at = 0  # position of the span's first token in the path
            for i, sp in zip(nodes, spans):
                if owner[i] == pos:
                    a, b = np.searchsorted(self.extra_index, [sp.start, sp.stop])
                    extra_pos.append(self.extra_index[a:b] - sp.start + at)
                    extra_lp.append(self.extra_logprobs[a:b])
                    extra_v.append(self.extra_versions[a:b])
                at += sp.stop - sp.start
            leaf_node = nodes[-1]
            out.append(
                TreePath(
                    tokens=np.concatenate([self.tokens[s] for s in spans]),
                    sampled=np.concatenate([self.sampled[s] for s in spans]),
                    logprobs=np.concatenate([self.logprobs[s] for s in spans]),
                    versions=np.concatenate([self.versions[s] for s in spans]),
                    owned=np.concatenate(owned),
                    nodes=np.asarray(nodes, dtype=np.int32),
                    leaf=leaf,
                    role=self.roles[int(self.node_role[leaf_node])],
                    call_index=int(self.node_call[leaf_node]),
                    extra_pos=np.concatenate(extra_pos).astype(np.int64) if extra_pos else _EMPTY_I64,
                    extra_logprobs=np.concatenate(extra_lp).astype(np.float32) if extra_lp else _EMPTY_F32,
                    extra_versions=np.concatenate(extra_v).astype(np.int32) if extra_v else _EMPTY_I32,
                )
            )
        return out

    # --------------------------------------------------------------------------- archive

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict]:
        """Arrays and JSON-able metadata, for archiving without pickles.

        Returns
        -------
        arrays
            ``tokens``, ``sampled``, ``logprobs``, ``versions`` (U,); ``node_offsets``
            (n_nodes + 1,); ``node_parent``, ``node_role``, ``node_call`` (n_nodes,);
            ``extra_index``, ``extra_logprobs``, ``extra_versions`` (E,).
        meta
            ``execution_id``, ``task_id``, ``reward``, ``total_tokens``, ``n_calls``, ``roles``.
        """
        arrays = {
            name: np.asarray(getattr(self, name), dtype=dt)
            for name, dt in (_ARRAY_DTYPES | _EXTRA_DTYPES).items()
        }
        meta = {
            "execution_id": self.execution_id,
            "task_id": self.task_id,
            "reward": float(self.reward),
            "total_tokens": int(self.total_tokens),
            "n_calls": int(self.n_calls),
            "roles": list(self.roles),
        }
        return arrays, meta

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], meta: dict) -> TrajectoryTree:
        """Inverse of :meth:`to_arrays`; validates the structure. Trees without extra-sample arrays
        (written before they existed) read as having none."""
        missing = set(_ARRAY_DTYPES) - set(arrays)
        if missing:
            raise ValueError(f"missing tree arrays: {sorted(missing)}")
        cast = {name: np.asarray(arrays[name], dtype=dt) for name, dt in _ARRAY_DTYPES.items()}
        cast |= {name: np.asarray(arrays.get(name, np.zeros(0, dt)), dtype=dt) for name, dt in _EXTRA_DTYPES.items()}
        return cls(
            execution_id=str(meta["execution_id"]),
            task_id=str(meta["task_id"]),
            reward=float(meta["reward"]),
            total_tokens=int(meta["total_tokens"]),
            n_calls=int(meta["n_calls"]),
            roles=[str(r) for r in meta["roles"]],
            **cast,
        )


def _flatten(root: dict[int, _Node]) -> dict[str, np.ndarray | list[str]]:
    """Pre-order flat arrays of a built trie."""
    roles: dict[str, int] = {}
    runs: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    parent: list[int] = []
    role: list[int] = []
    call: list[int] = []
    extras: list[tuple[int, float, int]] = []
    at = 0
    # Iterative DFS: a chain of hundreds of branches must not hit the recursion limit.
    stack: list[tuple[_Node, int]] = [(n, -1) for n in reversed(root.values())]
    while stack:
        node, par = stack.pop()
        idx = len(parent)
        runs.append(node.arrays())
        extras.extend((at + i, lp, v) for i, lp, v in node.extras)
        at += node.n
        parent.append(par)
        role.append(roles.setdefault(node.role, len(roles)))
        call.append(node.call)
        stack.extend((c, idx) for c in reversed(node.children.values()))
    lengths = np.array([len(r[0]) for r in runs], dtype=np.int64)
    offsets = np.zeros(len(runs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    def cat(i: int, dtype: type) -> np.ndarray:
        return np.concatenate([r[i] for r in runs]) if runs else np.zeros(0, dtype=dtype)

    extras.sort(key=lambda e: e[0])  # stable: samples of one token stay in call order

    return {
        "tokens": cat(0, np.int32),
        "sampled": cat(1, np.bool_),
        "logprobs": cat(2, np.float32),
        "versions": cat(3, np.int32),
        "node_offsets": offsets,
        "node_parent": np.asarray(parent, dtype=np.int32),
        "node_role": np.asarray(role, dtype=np.int32),
        "node_call": np.asarray(call, dtype=np.int32),
        "roles": list(roles),
        "extra_index": np.asarray([e[0] for e in extras], dtype=np.int64),
        "extra_logprobs": np.asarray([e[1] for e in extras], dtype=np.float32),
        "extra_versions": np.asarray([e[2] for e in extras], dtype=np.int32),
    }


def build_tree(result: ExecutionResult) -> TrajectoryTree:
    """Merge an execution's call records into a :class:`TrajectoryTree`.

    Calls are inserted in ``call_index`` order (stable for ties), so the first sampler of a
    token, and the node layout, do not depend on the order records arrived in.
    """
    builder = _TrieBuilder()
    calls = sorted(result.calls, key=lambda c: c.call_index)
    for call in calls:
        builder.insert(call)
    flat = _flatten(builder.root)
    return TrajectoryTree(
        execution_id=result.execution_id,
        task_id=result.task_id,
        reward=float(result.reward),
        total_tokens=int(sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)),
        n_calls=len(calls),
        **flat,
    )
