"""The trainer's settings: read by the run configuration, which loads no torch
(:mod:`gyreflow.train.trainer` applies them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and batching of the trainer."""

    lr: float = 1e-3
    """AdamW learning rate of the RL updates."""
    warmup_steps: int = 3
    """RL updates over which the learning rate rises linearly to ``lr`` (0: none). A fresh Adam
    moves every parameter by the full ``lr`` on its first update, which can wreck a warm-started
    policy."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    micro_batch_tokens: int = 16384
    """Padded tokens per forward/backward micro-batch (bounds activation memory); a path longer than
    this trains in pieces of this many tokens, with the same gradient (:mod:`gyreflow.train.pieces`)."""
