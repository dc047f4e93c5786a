"""Pack trajectory-tree paths into padded micro-batches.

Each path is trained as one causal sequence. The loss mask keeps the tokens the policy sampled
and that this path owns, so a prefix shared by several paths is trained once; a token that several
calls sampled at the same context adds one loss term per further sample (``extra_*``), so the loss
equals that of training every call on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from gyreflow.model.chat import PAD_ID


@dataclass
class MicroBatch:
    """Padded sequences and their loss terms, one per sample: each trained target token, then each
    further sample of one (the same target, with that sample's own behaviour data)."""

    input_ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor  # (B, L) int64
    targets: torch.Tensor  # (B, L-1) int64, input_ids shifted left
    rows: torch.Tensor  # (N,) int64, sequence of each sample
    cols: torch.Tensor  # (N,) int64, its target position in the (B, L-1) arrays
    old_logprobs: torch.Tensor  # (N,) float32, behaviour log-prob of each sample
    advantages: torch.Tensor  # (N,) float32
    temperatures: torch.Tensor  # (N,) float32, temperature the sample was drawn at
    versions: torch.Tensor  # (N,) int64, weights version that drew it
    weights: torch.Tensor  # (N,) float32, weight of each sample in the step's loss

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def n_trained(self) -> int:
        """Loss terms: trained targets plus their further samples."""
        return len(self.rows)


@dataclass
class PathSample:
    """One sequence to train: a tree path with the advantage of its execution."""

    tokens: np.ndarray  # (L,) int32
    trained: np.ndarray  # (L,) bool, sampled & owned
    logprobs: np.ndarray  # (L,) float32
    versions: np.ndarray  # (L,) int32
    advantage: float
    temperatures: np.ndarray | None = None  # (L,) float32; None: all 1
    weight: float = 1.0
    """Weight of each of its samples in the step's loss (see :mod:`gyreflow.algo.aggregation`)."""
    extra_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (E,) trained positions sampled again
    extra_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (E,)
    extra_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # (E,)
    extra_temperatures: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (E,)

    @classmethod
    def of(cls, path, advantage: float, weight: float = 1.0) -> PathSample:
        """The sample that trains a :class:`~gyreflow.trajectory.tree.TreePath` with ``advantage``."""
        return cls(path.tokens, path.loss_mask, path.logprobs, path.versions, float(advantage), path.temperatures,
                   float(weight), path.extra_pos, path.extra_logprobs, path.extra_versions, path.extra_temperatures)

    @property
    def n_trained(self) -> int:
        """Loss terms: trained tokens plus their further samples."""
        return int(self.trained.sum()) + len(self.extra_pos)


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
    attn = np.zeros((B, L), np.int64)
    parts: list[tuple[np.ndarray, ...]] = []  # per sequence: rows, cols, old, adv, temperature, version, weight
    for b, s in enumerate(samples):
        n = len(s.tokens)
        ids[b, :n] = s.tokens
        attn[b, :n] = 1
        temps = np.ones(n, np.float32) if s.temperatures is None else s.temperatures
        # Position t predicts token t+1, so token p is the target at column p-1; position 0 has
        # no context and is never a target.
        pos = np.concatenate([np.flatnonzero(s.trained), s.extra_pos]).astype(np.int64)
        old = np.concatenate([s.logprobs[s.trained], s.extra_logprobs])
        t = np.concatenate([temps[s.trained], s.extra_temperatures])
        v = np.concatenate([s.versions[s.trained], s.extra_versions])
        keep = pos >= 1
        if min_version is not None:
            keep &= v >= min_version
        k = int(keep.sum())
        parts.append((np.full(k, b, np.int64), pos[keep] - 1, old[keep], np.full(k, s.advantage, np.float32), t[keep],
                      v[keep], np.full(k, s.weight, np.float32)))

    def cat(i: int, dtype) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([p[i] for p in parts]).astype(dtype))

    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        targets=torch.from_numpy(ids[:, 1:].copy()),
        rows=cat(0, np.int64),
        cols=cat(1, np.int64),
        old_logprobs=cat(2, np.float32),
        advantages=cat(3, np.float32),
        temperatures=cat(4, np.float32),
        versions=cat(5, np.int64),
        weights=cat(6, np.float32),
    )
