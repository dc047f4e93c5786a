"""Pack trajectory-tree paths into padded micro-batches.

Each path is trained as one causal sequence. The loss mask keeps the tokens the policy sampled
and that this path owns, so a prefix shared by several paths is trained once.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def n_tokens(self) -> int:
        return int(self.attention_mask.sum())


@dataclass
class PathSample:
    """One sequence to train: a tree path with the advantage of its execution."""

    tokens: np.ndarray  # (L,) int32
    trained: np.ndarray  # (L,) bool, sampled & owned
    logprobs: np.ndarray  # (L,) float32
    versions: np.ndarray  # (L,) int32
    advantage: float


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
    for b, s in enumerate(samples):
        n = len(s.tokens)
        ids[b, :n] = s.tokens
        attn[b, :n] = 1
        mask[b, :n] = s.trained
        old[b, :n] = s.logprobs
        adv[b, :n] = s.advantage
        ver[b, :n] = s.versions
    # Position t predicts token t+1: the per-token arrays are indexed by the predicted token.
    return MicroBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        targets=torch.from_numpy(ids[:, 1:].copy()),
        loss_mask=torch.from_numpy(mask[:, 1:].copy()),
        old_logprobs=torch.from_numpy(old[:, 1:].copy()),
        advantages=torch.from_numpy(adv[:, 1:].copy()),
        versions=torch.from_numpy(ver[:, 1:].copy()),
    )
