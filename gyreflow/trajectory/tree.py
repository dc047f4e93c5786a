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
from gyreflow.trajectory.roles import canonical, infer_roles, priority

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
# Arrays a tree may lack (written before they existed): no extra samples, temperature 1.
_OPTIONAL_DTYPES: dict[str, type] = {
    "temperatures": np.float32,
    "extra_index": np.int64,
    "extra_logprobs": np.float32,
    "extra_versions": np.int32,
    "extra_temperatures": np.float32,
    "call_node": np.int32,
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
    extra_temperatures: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (E,) float32
    temperatures: np.ndarray | None = None  # (L,) float32, sampling temperature (1 where not sampled)

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


# One token as the builder holds it: the id and, where a call sampled it, that sample's data.
_TOKEN = np.dtype([("token", np.int32), ("sampled", np.bool_), ("logprob", np.float32), ("version", np.int32),
                   ("temperature", np.float32)])
_SAMPLE_FIELDS = ("logprob", "version", "temperature")


class _Node:
    """A mutable trie node used while building: a run of tokens in a growable record buffer."""

    __slots__ = ("buf", "n", "children", "role", "call", "extras", "ends")

    def __init__(self, run: np.ndarray, role: str, call: int) -> None:
        self.buf = run.copy()  # (n,) _TOKEN
        self.n = len(run)
        # Insertion-ordered: pre-order follows creation order, which keeps the layout stable.
        self.children: dict[int, _Node] = {}
        self.role = role
        self.call = call
        # Further samples of tokens already sampled here: (position in the node, the sample's record).
        self.extras: list[tuple[int, np.void]] = []
        # Calls whose sequence ends here: (the call's position in insertion order, tokens of this node up to its end).
        self.ends: list[tuple[int, int]] = []

    @property
    def run(self) -> np.ndarray:
        return self.buf[: self.n]

    def extend(self, run: np.ndarray) -> None:
        """Append a run; capacity doubles so a long chain of calls costs amortised O(tokens)."""
        need = self.n + len(run)
        if need > len(self.buf):
            new = np.empty(max(need, 2 * len(self.buf)), dtype=_TOKEN)
            new[: self.n] = self.buf[: self.n]
            self.buf = new
        self.buf[self.n : need] = run
        self.n = need

    def mark_sampled(self, run: np.ndarray) -> None:
        """Mark the first ``len(run)`` tokens sampled where the incoming call sampled them.

        Tokens already sampled keep their first sampler's data; the incoming call's samples of
        them become extra samples.
        """
        sampled = run["sampled"]
        if not sampled.any():
            return
        have = self.buf["sampled"][: len(run)]
        self.extras.extend((int(i), run[i].copy()) for i in np.flatnonzero(sampled & have))
        new = np.flatnonzero(sampled & ~have)
        self.buf[new] = run[new]

    def split(self, k: int) -> None:
        """Cut after ``k`` tokens; the rest becomes this node's only child."""
        tail = _Node(self.run[k:], self.role, self.call)
        tail.children = self.children
        tail.extras = [(i - k, r) for i, r in self.extras if i >= k]
        self.extras = [e for e in self.extras if e[0] < k]
        tail.ends = [(c, o - k) for c, o in self.ends if o > k]
        self.ends = [e for e in self.ends if e[1] <= k]
        # Copy the head too, so a long node's buffer is not kept alive at full capacity.
        self.buf = self.run[:k].copy()
        self.n = k
        self.children = {int(tail.buf["token"][0]): tail}


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two equal-length arrays."""
    neq = a != b
    i = int(np.argmax(neq))
    return i if neq[i] else len(a)


def _call_run(call: CallRecord, start: int = 0) -> np.ndarray:
    """A call's sequence from ``start`` on as token records: completion tokens are samples when the
    call's settings let the trainer score them (:attr:`CallRecord.trained_as_sample`), context
    otherwise."""
    p, c = len(call.prompt_ids), len(call.completion_ids)
    cut = min(start, p)
    run = np.zeros(p + c - start, dtype=_TOKEN)
    run["token"][: p - cut], run["token"][p - cut :] = call.prompt_ids[cut:], call.completion_ids[start - cut :]
    run["version"] = -1
    run["temperature"] = 1.0
    if call.trained_as_sample:
        done = start - cut  # completion tokens before ``start``
        run["sampled"][p - cut :] = True
        run["logprob"][p - cut :] = call.logprobs[done:]
        run["version"][p - cut :] = call.versions[done:]
        run["temperature"][p - cut :] = call.temperature
    return run


class _TrieBuilder:
    """Inserts call sequences into a compressed trie."""

    def __init__(self) -> None:
        self.root: dict[int, _Node] = {}
        self.calls = 0
        # The last call's sequence when it ended at the end of a node: an agent's next prompt
        # usually extends it, and then the descent starts there instead of at the root.
        self._tail: tuple[_Node, np.ndarray] | None = None
        self._sequence = _EMPTY_I32  # the call being inserted, prompt then completion

    def _ended(self, node: _Node | None, offset: int) -> None:
        if node is not None:
            node.ends.append((self.calls, offset))
        self._tail = (node, self._sequence) if node is not None and offset == node.n else None
        self.calls += 1

    def insert(self, call: CallRecord, role: str) -> None:
        self._sequence = np.concatenate([call.prompt_ids, call.completion_ids])
        children, parent, base = self.root, None, 0
        if self._tail is not None:
            node, prev = self._tail
            # Only over prompt tokens: they mark nothing sampled, so skipping them changes nothing.
            if len(prev) <= len(call.prompt_ids) and np.array_equal(call.prompt_ids[: len(prev)], prev):
                children, parent, base = node.children, node, len(prev)
        seq = _call_run(call, base)  # records of the sequence from ``base`` on; positions below are relative
        tokens = seq["token"]
        total, pos = len(seq), 0
        while pos < total:
            child = children.get(int(tokens[pos]))
            if child is None:
                if parent is not None and not parent.children:
                    # Continues a leaf: grow it rather than hang a single child under it.
                    parent.extend(seq[pos:])
                    parent.role, parent.call = role, call.call_index
                    return self._ended(parent, parent.n)
                node = children[int(tokens[pos])] = _Node(seq[pos:], role, call.call_index)
                return self._ended(node, node.n)
            m = min(child.n, total - pos)
            k = _lcp(child.buf["token"][:m], tokens[pos : pos + m])
            child.mark_sampled(seq[pos : pos + k])
            if k < child.n:
                if pos + k < total:
                    # Diverges inside the node: branch at the longest common prefix.
                    child.split(k)
                    node = child.children[int(tokens[pos + k])] = _Node(seq[pos + k :], role, call.call_index)
                    return self._ended(node, node.n)
                return self._ended(child, k)  # a prefix of what is there, nothing new
            children, parent, pos = child.children, child, pos + k
        self._ended(parent, 0 if parent is None else parent.n)


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
    extra_temperatures: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (E,) float32
    temperatures: np.ndarray | None = None  # (U,) float32, sampling temperature; 1 where not sampled
    call_node: np.ndarray | None = None  # (n_calls,) int32, node holding each call's last token (-1: empty call)
    """In ``call_index`` order; None for a tree read back from arrays that predate it."""
    dropped: bool = False
    """The execution is a placeholder for one the system failed (see :mod:`~gyreflow.trajectory.records`)."""

    def __post_init__(self) -> None:
        n = len(self.node_parent)
        u = len(self.tokens)
        if self.temperatures is None:
            self.temperatures = np.ones(u, np.float32)
        if any(len(a) != u for a in (self.sampled, self.logprobs, self.versions, self.temperatures)):
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
        if self.call_node is not None and (
            len(self.call_node) != self.n_calls or len(self.call_node) and
            (self.call_node.min() < -1 or self.call_node.max() >= n)
        ):
            raise ValueError("call_node must hold one node (or -1) per call")
        e = len(self.extra_index)
        if any(len(a) != e for a in (self.extra_logprobs, self.extra_versions, self.extra_temperatures)):
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

    def token_index(self, nodes: Sequence[int]) -> np.ndarray:
        """``(L,)`` int64 indices into the token arrays of the runs of ``nodes``, in order (a
        :class:`TreePath`'s ``nodes`` give its tokens' places in the tree)."""
        runs = [np.arange(self.node_offsets[n], self.node_offsets[n + 1]) for n in nodes]
        return np.concatenate(runs) if runs else np.zeros(0, np.int64)

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
            extra_pos, extra_lp, extra_v, extra_t = [], [], [], []
            at = 0  # position of the span's first token in the path
            for i, sp in zip(nodes, spans):
                if owner[i] == pos:
                    a, b = np.searchsorted(self.extra_index, [sp.start, sp.stop])
                    extra_pos.append(self.extra_index[a:b] - sp.start + at)
                    extra_lp.append(self.extra_logprobs[a:b])
                    extra_v.append(self.extra_versions[a:b])
                    extra_t.append(self.extra_temperatures[a:b])
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
                    extra_temperatures=np.concatenate(extra_t).astype(np.float32) if extra_t else _EMPTY_F32,
                    temperatures=np.concatenate([self.temperatures[s] for s in spans]),
                )
            )
        return out

    def packed(self, leaves: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """The paths to ``leaves`` (default all) as one tree-shaped sequence, each node once.

        Nodes are in pre-order; every sampled token of them trains once (each is owned by exactly
        one of the paths), with its extra samples. Returns the arrays of a tree-layout
        :class:`~gyreflow.train.packing.PathSample`: ``tokens``, ``trained``, ``logprobs``,
        ``versions``, ``temperatures``, ``positions`` (depth), ``prev`` (the token before each one
        on its path, -1 at a root), ``index`` (each token's place in the tree's token arrays) and
        the ``extra_*`` arrays.
        """
        order = list(range(self.n_leaves)) if leaves is None else [int(x) for x in leaves]
        covered = sorted({n for leaf in order for n in self._node_path(int(self._leaves[leaf]))})  # pre-order
        local = {n: i for i, n in enumerate(covered)}
        K = len(covered)
        spans = [slice(int(self.node_offsets[n]), int(self.node_offsets[n + 1])) for n in covered]
        sizes = np.array([sp.stop - sp.start for sp in spans], dtype=np.int64)
        start = np.concatenate([[0], np.cumsum(sizes)])[:-1]  # (K,) first index of each node in the pack
        depth = np.zeros(K, dtype=np.int64)  # (K,) depth of each node's first token
        prev_first = np.full(K, -1, dtype=np.int64)  # (K,) the token before each node's first one
        for i, n in enumerate(covered):
            p = int(self.node_parent[n])
            if p >= 0:
                j = local[p]
                depth[i] = depth[j] + sizes[j]
                prev_first[i] = start[j] + sizes[j] - 1
        idx = np.concatenate([np.arange(sp.start, sp.stop) for sp in spans]) if K else np.zeros(0, np.int64)
        node_of = np.repeat(np.arange(K, dtype=np.int32), sizes)
        within = np.arange(len(idx)) - start[node_of]  # offset of each token in its node
        prev = np.where(within == 0, prev_first[node_of], np.arange(len(idx)) - 1)
        pos_in_pack = np.full(len(self.tokens), -1, dtype=np.int64)
        pos_in_pack[idx] = np.arange(len(idx))
        e = np.flatnonzero(pos_in_pack[self.extra_index] >= 0) if len(self.extra_index) else np.zeros(0, np.int64)
        return {
            "tokens": self.tokens[idx], "trained": self.sampled[idx].copy(), "logprobs": self.logprobs[idx],
            "versions": self.versions[idx], "temperatures": self.temperatures[idx],
            "positions": depth[node_of] + within, "prev": prev, "index": idx,
            "extra_pos": pos_in_pack[self.extra_index[e]], "extra_logprobs": self.extra_logprobs[e],
            "extra_versions": self.extra_versions[e], "extra_temperatures": self.extra_temperatures[e],
        }

    def sample_paths(self, j_max: int, seed: int) -> list[int]:
        """Leaves of the paths to train, at most ``j_max`` of them (0: every leaf, in pre-order).

        Bounded sampling takes paths one at a time: among the role classes (by
        :func:`~gyreflow.trajectory.roles.priority`) the highest that still has a path with
        samples no chosen path trains yet, a leaf of that class drawn in proportion to that count.
        Pass the result to :meth:`paths`, which gives each node to the first chosen path covering
        it, so shared tokens train once. Deterministic given ``seed``.
        """
        if j_max < 0:
            raise ValueError(f"j_max must be >= 0, got {j_max}")
        if j_max == 0 or self.n_leaves == 0:
            return list(range(self.n_leaves))
        node_samples = np.add.reduceat(self.sample_counts(), self.node_offsets[:-1]) if self.n_nodes else np.zeros(0)
        nodes = [self._node_path(int(leaf)) for leaf in self._leaves]
        klass = np.array([priority(self.roles[int(self.node_role[leaf])]) for leaf in self._leaves])  # (n_leaves,)
        taken = np.zeros(self.n_nodes, dtype=np.bool_)
        chosen: list[int] = []
        rng = np.random.default_rng(seed)
        while len(chosen) < j_max:
            left = np.array([node_samples[ns][~taken[ns]].sum() for ns in nodes], dtype=np.float64)  # (n_leaves,)
            left[chosen] = 0
            if not (left > 0).any():
                break
            top = np.flatnonzero((left > 0) & (klass == klass[left > 0].min()))
            pick = int(rng.choice(top, p=left[top] / left[top].sum()))
            chosen.append(pick)
            taken[nodes[pick]] = True
        return chosen

    # --------------------------------------------------------------------------- archive

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict]:
        """Arrays and JSON-able metadata, for archiving without pickles.

        Returns
        -------
        arrays
            ``tokens``, ``sampled``, ``logprobs``, ``versions`` (U,); ``node_offsets``
            (n_nodes + 1,); ``node_parent``, ``node_role``, ``node_call`` (n_nodes,);
            ``extra_index``, ``extra_logprobs``, ``extra_versions`` (E,); ``call_node`` (n_calls,).
        meta
            ``execution_id``, ``task_id``, ``reward``, ``total_tokens``, ``n_calls``, ``roles``.
        """
        arrays = {
            name: np.asarray(getattr(self, name), dtype=dt)
            for name, dt in (_ARRAY_DTYPES | _OPTIONAL_DTYPES).items()
            if getattr(self, name) is not None
        }
        meta = {
            "execution_id": self.execution_id,
            "task_id": self.task_id,
            "reward": float(self.reward),
            "total_tokens": int(self.total_tokens),
            "n_calls": int(self.n_calls),
            "roles": list(self.roles),
            "dropped": bool(self.dropped),
        }
        return arrays, meta

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], meta: dict) -> TrajectoryTree:
        """Inverse of :meth:`to_arrays`; validates the structure. Trees without the optional arrays
        (written before they existed) read as having no extra samples, all at temperature 1."""
        missing = set(_ARRAY_DTYPES) - set(arrays)
        if missing:
            raise ValueError(f"missing tree arrays: {sorted(missing)}")
        cast = {name: np.asarray(arrays[name], dtype=dt) for name, dt in _ARRAY_DTYPES.items()}
        cast |= {name: np.asarray(arrays[name], dtype=dt) for name, dt in _OPTIONAL_DTYPES.items() if name in arrays}
        return cls(
            execution_id=str(meta["execution_id"]),
            task_id=str(meta["task_id"]),
            reward=float(meta["reward"]),
            total_tokens=int(meta["total_tokens"]),
            n_calls=int(meta["n_calls"]),
            roles=[str(r) for r in meta["roles"]],
            dropped=bool(meta.get("dropped", False)),
            **cast,
        )


def _flatten(builder: _TrieBuilder) -> dict[str, np.ndarray | list[str]]:
    """Pre-order flat arrays of a built trie."""
    root = builder.root
    call_node = np.full(builder.calls, -1, np.int32)
    roles: dict[str, int] = {}
    runs: list[np.ndarray] = []
    parent: list[int] = []
    role: list[int] = []
    call: list[int] = []
    extra_at: list[int] = []
    extra: list[np.void] = []
    at = 0
    # Iterative DFS: a chain of hundreds of branches must not hit the recursion limit.
    stack: list[tuple[_Node, int]] = [(n, -1) for n in reversed(root.values())]
    while stack:
        node, par = stack.pop()
        idx = len(parent)
        runs.append(node.run)
        for i, r in node.extras:
            extra_at.append(at + i)
            extra.append(r)
        at += node.n
        parent.append(par)
        role.append(roles.setdefault(node.role, len(roles)))
        call.append(node.call)
        for c, _ in node.ends:
            call_node[c] = idx
        stack.extend((c, idx) for c in reversed(node.children.values()))
    flat = np.concatenate(runs) if runs else np.zeros(0, dtype=_TOKEN)
    offsets = np.zeros(len(runs) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in runs], out=offsets[1:])
    order = np.argsort(np.asarray(extra_at, dtype=np.int64), kind="stable")  # samples of a token stay in call order
    extras = np.array(extra, dtype=_TOKEN)[order] if extra else np.zeros(0, dtype=_TOKEN)
    return {
        "tokens": flat["token"].copy(),
        "sampled": flat["sampled"].copy(),
        "logprobs": flat["logprob"].copy(),
        "versions": flat["version"].copy(),
        "temperatures": flat["temperature"].copy(),
        "node_offsets": offsets,
        "node_parent": np.asarray(parent, dtype=np.int32),
        "node_role": np.asarray(role, dtype=np.int32),
        "node_call": np.asarray(call, dtype=np.int32),
        "call_node": call_node,
        "roles": list(roles),
        "extra_index": np.asarray(extra_at, dtype=np.int64)[order],
        "extra_logprobs": extras["logprob"].copy(),
        "extra_versions": extras["version"].copy(),
        "extra_temperatures": extras["temperature"].copy(),
    }


def _trie(calls: list[CallRecord], roles: list[str]) -> dict[str, np.ndarray | list[str]]:
    builder = _TrieBuilder()
    for call, role in zip(calls, roles):
        builder.insert(call, role)
    return _flatten(builder)


def build_tree(result: ExecutionResult) -> TrajectoryTree:
    """Merge an execution's call records into a :class:`TrajectoryTree`.

    Calls are inserted in ``call_index`` order (stable for ties), so the first sampler of a
    token, and the node layout, do not depend on the order records arrived in. Calls that name no
    role get one by the rule of :mod:`gyreflow.trajectory.roles`.
    """
    calls = sorted(result.calls, key=lambda c: c.call_index)
    flat = _trie(calls, [canonical(c.role) for c in calls])
    if any(not c.role for c in calls):
        parents = set(flat["node_parent"].tolist())
        leaf_calls = {int(flat["node_call"][i]) for i in range(len(flat["node_parent"])) if i not in parents}
        flat = _trie(calls, infer_roles(calls, [c.call_index in leaf_calls for c in calls]))
    return TrajectoryTree(
        execution_id=result.execution_id,
        task_id=result.task_id,
        reward=float(result.reward),
        total_tokens=int(sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)),
        n_calls=len(calls),
        dropped=result.dropped,
        **flat,
    )
