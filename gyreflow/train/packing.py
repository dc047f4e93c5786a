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
    input_ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor  # (B, L) int64
    targets: torch.Tensor  # (B, L-1) int64, input_ids shifted left
    loss_mask: torch.Tensor  # (B, L-1) float32, 1 where the target token is trained
    old_logprobs: torch.Tensor  # (B, L-1) float32, behaviour log-probs of the targets
    advantages: torch.Tensor  # (B, L-1) float32
    versions: torch.Tensor  # (B, L-1) int64, -1 where not sampled
    extra_rows: torch.Tensor  # (E,) int64, row of each further sample of a trained target
    extra_cols: torch.Tensor  # (E,) int64, its column in the (B, L-1) arrays
    extra_old_logprobs: torch.Tensor  # (E,) float32
    extra_advantages: torch.Tensor  # (E,) float32
    extra_versions: torch.Tensor  # (E,) int64

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def n_trained(self) -> int:
        """Loss terms: trained targets plus their further samples."""
        return int(self.loss_mask.sum()) + len(self.extra_rows)

    def flat(self, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-sample ``(logprobs, old_logprobs, advantages)``, each ``(n_trained,)``, from the
        ``(B, L-1)`` log-probs of the targets: trained targets, then further samples."""
        m = self.loss_mask.bool()
        lp = torch.cat([logprobs[m], logprobs[self.extra_rows, self.extra_cols]])  # (N,)
        old = torch.cat([self.old_logprobs[m], self.extra_old_logprobs])  # (N,)
        adv = torch.cat([self.advantages[m], self.extra_advantages])  # (N,)
        return lp, old, adv


@dataclass
class PathSample:
    """One sequence to train: a tree path with the advantage of its execution."""

    tokens: np.ndarray  # (L,) int32
    trained: np.ndarray  # (L,) bool, sampled & owned
    logprobs: np.ndarray  # (L,) float32
    versions: np.ndarray  # (L,) int32
    advantage: float
    extra_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (E,) trained positions sampled again
    extra_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (E,)
    extra_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # (E,)

    @classmethod
    def of(cls, path, advantage: float) -> PathSample:
        """The sample that trains a :class:`~gyreflow.trajectory.tree.TreePath` with ``advantage``."""
        return cls(path.tokens, path.loss_mask, path.logprobs, path.versions, float(advantage),
                   path.extra_pos, path.extra_logprobs, path.extra_versions)

    @property
    def n_trained(self) -> int:
        """Loss terms: trained tokens plus their further samples."""
        return int(self.trained.sum()) + len(self.extra_pos)

    def trained_versions(self) -> np.ndarray:
        """Weights version of every loss term."""
        return np.concatenate([self.versions[self.trained], self.extra_versions])


def pack(samples: list[PathSample], max_tokens: int) -> list[MicroBatch]:
    """Group samples (longest first) into micro-batches of at most ``max_tokens`` padded tokens."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens))
    batches, current = [], []
    for i in order:
        width = len(samples[current[0]].tokens) if current else len(samples[i].tokens)
        if current and width * (len(current) + 1) > max_tokens:
            batches.append(_collate([samples[j] for j in current]))
            current = []
        current.append(i)
    if current:
        batches.append(_collate([samples[j] for j in current]))
    return batches


def _collate(samples: list[PathSample]) -> MicroBatch:
    B, L = len(samples), max(len(s.tokens) for s in samples)
    ids = np.full((B, L), PAD_ID, np.int64)
    attn = np.zeros((B, L), np.int64)
    mask = np.zeros((B, L), np.float32)
    old = np.zeros((B, L), np.float32)
    adv = np.zeros((B, L), np.float32)
    ver = np.full((B, L), -1, np.int64)
    rows, cols, e_old, e_adv, e_ver = [], [], [], [], []
    for b, s in enumerate(samples):
        n = len(s.tokens)
        ids[b, :n] = s.tokens
        attn[b, :n] = 1
        mask[b, :n] = s.trained
        old[b, :n] = s.logprobs
        adv[b, :n] = s.advantage
        ver[b, :n] = s.versions
        keep = s.extra_pos >= 1  # position 0 has no context and is never a target
        rows.append(np.full(int(keep.sum()), b, np.int64))
        cols.append(s.extra_pos[keep].astype(np.int64) - 1)
        e_old.append(s.extra_logprobs[keep])
        e_adv.append(np.full(int(keep.sum()), s.advantage, np.float32))
        e_ver.append(s.extra_versions[keep].astype(np.int64))
    # Position t predicts token t+1: the per-token arrays are indexed by the predicted token.
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        targets=torch.from_numpy(ids[:, 1:].copy()),
        loss_mask=torch.from_numpy(mask[:, 1:].copy()),
        old_logprobs=torch.from_numpy(old[:, 1:].copy()),
        advantages=torch.from_numpy(adv[:, 1:].copy()),
        versions=torch.from_numpy(ver[:, 1:].copy()),
        extra_rows=torch.from_numpy(np.concatenate(rows)),
        extra_cols=torch.from_numpy(np.concatenate(cols)),
        extra_old_logprobs=torch.from_numpy(np.concatenate(e_old).astype(np.float32)),
        extra_advantages=torch.from_numpy(np.concatenate(e_adv)),
        extra_versions=torch.from_numpy(np.concatenate(e_ver)),
    )
