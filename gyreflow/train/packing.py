"""Pack training sequences into padded micro-batches.

A :class:`PathSample` is one sequence to train: either one root-to-leaf path of a trajectory tree
(a causal chain), or several paths of one execution packed as a tree (tree-shared compute: each
node's tokens are forwarded once, attention is restricted to the token's ancestors, positions are
depths). Its loss terms are the trained tokens (sampled, and owned by it so a shared prefix trains
once) and their further samples (``extra_*``: a token that several calls sampled at one context adds
one term per sample), so the loss equals that of training every call on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from gyreflow.model.chat import PAD_ID
from gyreflow.train.attention import SegmentLayout, layout


@dataclass
class MicroBatch:
    """Padded sequences and their loss terms, one per sample: each trained token, then each further
    sample of one (the same token, with that sample's own behaviour data)."""

    input_ids: torch.Tensor  # (B, L) int64
    segments: SegmentLayout
    """Which tokens attend to which (see :mod:`gyreflow.train.attention`)."""
    position_ids: torch.Tensor  # (B, L) int64
    rows: torch.Tensor  # (N,) int64, sequence of each sample
    cols: torch.Tensor  # (N,) int64, position whose logits predict the sample (the token before it)
    target_ids: torch.Tensor  # (N,) int64, the sampled token
    old_logprobs: torch.Tensor  # (N,) float32, behaviour log-prob of each sample
    advantages: torch.Tensor  # (N,) float32
    temperatures: torch.Tensor  # (N,) float32, temperature the sample was drawn at
    versions: torch.Tensor  # (N,) int64, weights version that drew it
    weights: torch.Tensor  # (N,) float32, weight of each sample in the step's loss

    @property
    def n_trained(self) -> int:
        """Loss terms: trained tokens plus their further samples."""
        return len(self.rows)


@dataclass
class PathSample:
    """One sequence to train, with the advantage of its execution (see the module docstring)."""

    tokens: np.ndarray  # (L,) int32
    trained: np.ndarray  # (L,) bool, sampled & owned
    logprobs: np.ndarray  # (L,) float32
    versions: np.ndarray  # (L,) int32
    advantage: float | np.ndarray
    """The execution's advantage, or ``(L,)`` float one per token (node-level estimators)."""
    temperatures: np.ndarray | None = None  # (L,) float32; None: all 1
    weight: float = 1.0
    """Weight of each of its samples in the step's loss (see :mod:`gyreflow.algo.aggregation`)."""
    extra_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (E,) trained positions sampled again
    extra_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (E,)
    extra_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # (E,)
    extra_temperatures: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (E,)
    # A tree layout (None: a causal chain): each token's position (its depth) and the index of the
    # token before it on its path (-1 for a root); nodes are in pre-order, so prev[i] < i.
    positions: np.ndarray | None = None  # (L,) int64
    prev: np.ndarray | None = None  # (L,) int64

    @classmethod
    def of(cls, path, advantage: float | np.ndarray, weight: float = 1.0) -> PathSample:
        """The sample that trains a :class:`~gyreflow.trajectory.tree.TreePath` with ``advantage``
        (one, or ``(L,)`` along the path)."""
        return cls(path.tokens, path.loss_mask, path.logprobs, path.versions, _advantage(advantage), path.temperatures,
                   float(weight), path.extra_pos, path.extra_logprobs, path.extra_versions, path.extra_temperatures)

    @classmethod
    def of_tree(cls, tree, leaves, advantage: float | np.ndarray, weight: float = 1.0) -> PathSample:
        """The sample that trains the paths to ``leaves`` of a tree at once, each node forwarded once;
        ``advantage`` is one, or ``(U,)`` over the tree's tokens."""
        p = tree.packed(leaves)
        adv = advantage if np.isscalar(advantage) else np.asarray(advantage)[p["index"]]
        return cls(p["tokens"], p["trained"], p["logprobs"], p["versions"], _advantage(adv), p["temperatures"],
                   float(weight), p["extra_pos"], p["extra_logprobs"], p["extra_versions"], p["extra_temperatures"],
                   p["positions"], p["prev"])

    @property
    def is_tree(self) -> bool:
        return self.prev is not None

    @property
    def n_trained(self) -> int:
        """Loss terms: trained tokens plus their further samples."""
        return int(self.trained.sum()) + len(self.extra_pos)

    def head(self, n: int) -> PathSample:
        """The chain's first ``n`` tokens as a sample (a causal prefix trains the same way)."""
        if self.is_tree:
            raise ValueError("a tree-shaped sample has no prefix sample: take whole trees")
        keep = self.extra_pos < n
        return replace(self, tokens=self.tokens[:n], trained=self.trained[:n], logprobs=self.logprobs[:n],
                       versions=self.versions[:n],
                       advantage=self.advantage if np.isscalar(self.advantage) else self.advantage[:n],
                       temperatures=None if self.temperatures is None else self.temperatures[:n],
                       extra_pos=self.extra_pos[keep], extra_logprobs=self.extra_logprobs[keep],
                       extra_versions=self.extra_versions[keep], extra_temperatures=self.extra_temperatures[keep])


def probe_of(samples: list[PathSample], max_tokens: int) -> list[PathSample]:
    """Samples to measure an update on, at most ``max_tokens`` tokens forwarded: whole samples in
    order while they fit; a chain longer than what is left is cut to its first tokens, a tree that
    does not fit is skipped. When nothing fits (only larger trees), the smallest sample whole."""
    out, left = [], max_tokens
    for s in samples:
        if left <= 0:
            break
        if len(s.tokens) <= left:
            out.append(s)
            left -= len(s.tokens)
        elif not s.is_tree:
            out.append(s.head(left))
            left = 0
    out = [s for s in out if s.n_trained]
    trained = [s for s in samples if s.n_trained]
    if not out and trained and max_tokens > 0:
        out = [min(trained, key=lambda s: len(s.tokens))]
    return out


def _advantage(advantage: float | np.ndarray) -> float | np.ndarray:
    return float(advantage) if np.isscalar(advantage) else np.asarray(advantage, np.float32)


def pack(samples: list[PathSample], max_tokens: int, min_version: int | None = None) -> list[MicroBatch]:
    """Group samples (longest first) into micro-batches of at most ``max_tokens`` padded tokens;
    samples drawn by a weights version below ``min_version`` are left out (masked as too stale)."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens))
    batches, current = [], []
    for i in order:
        width = len(samples[current[0]].tokens) if current else len(samples[i].tokens)
        if current and width * (len(current) + 1) > max_tokens:
            batches.append(_collate([samples[j] for j in current], min_version))
            current = []
        current.append(i)
    if current:
        batches.append(_collate([samples[j] for j in current], min_version))
    return batches


def _collate(samples: list[PathSample], min_version: int | None = None) -> MicroBatch:
    B, L = len(samples), max(len(s.tokens) for s in samples)
    ids = np.full((B, L), PAD_ID, np.int64)
    positions = np.zeros((B, L), np.int64)
    prevs = []
    parts: list[tuple[np.ndarray, ...]] = []  # per sequence: rows, cols, targets, old, adv, temperature, version, weight
    for b, s in enumerate(samples):
        n = len(s.tokens)
        ids[b, :n] = s.tokens
        positions[b, :n] = np.arange(n) if s.positions is None else s.positions
        prev = np.arange(n, dtype=np.int64) - 1 if s.prev is None else s.prev.astype(np.int64)
        prevs.append(prev)
        temps = np.ones(n, np.float32) if s.temperatures is None else s.temperatures
        pos = np.concatenate([np.flatnonzero(s.trained), s.extra_pos]).astype(np.int64)
        old = np.concatenate([s.logprobs[s.trained], s.extra_logprobs])
        t = np.concatenate([temps[s.trained], s.extra_temperatures])
        v = np.concatenate([s.versions[s.trained], s.extra_versions])
        adv = np.broadcast_to(np.float32(s.advantage), (n,)) if np.isscalar(s.advantage) else s.advantage
        keep = prev[pos] >= 0  # a token with nothing before it is never predicted
        if min_version is not None:
            keep &= v >= min_version
        k = int(keep.sum())
        parts.append((np.full(k, b, np.int64), prev[pos][keep], s.tokens[pos][keep].astype(np.int64), old[keep],
                      adv[pos][keep], t[keep], v[keep], np.full(k, s.weight, np.float32)))

    def cat(i: int, dtype) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([p[i] for p in parts]).astype(dtype))

    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        segments=layout(prevs),
        position_ids=torch.from_numpy(positions),
        rows=cat(0, np.int64),
        cols=cat(1, np.int64),
        target_ids=cat(2, np.int64),
        old_logprobs=cat(3, np.float32),
        advantages=cat(4, np.float32),
        temperatures=cat(5, np.float32),
        versions=cat(6, np.int64),
        weights=cat(7, np.float32),
    )
