"""The trainer: a policy replica and its optimizer; one call per RL step (or SFT step).

It lives on a trainer cell for the whole run (see :mod:`gyreflow.train.service`); tasks bring it
data, never a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gyreflow.algo.registry import LOSSES
from gyreflow.model.policy import state_dict_numpy
from gyreflow.train.packing import MicroBatch, PathSample, pack


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and batching of the trainer."""

    lr: float = 4e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    micro_batch_tokens: int = 16384
    """Padded tokens per forward/backward micro-batch (bounds activation memory)."""
    temperature: float = 1.0
    """Temperature the behaviour log-probs were taken at; training log-probs use the same."""


def token_logprobs(model, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of each next token under ``model``: (B, L-1)."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits  # (B, L, V)
    logits = logits[:, :-1].float() / temperature  # (B, L-1, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)  # (B, L-1)


class Trainer:
    """Owns the policy being trained, its optimizer and its weights version."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, version: int = 0):
        self.model, self.cfg, self.version = model, cfg, version
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def _apply(self, batches: list[MicroBatch], loss_of) -> dict:
        """One optimizer step over ``batches``; ``loss_of(mb) -> (token-mean loss, metrics)``."""
        self.model.train()
        total = sum(float(mb.loss_mask.sum()) for mb in batches)
        if total == 0:
            self.model.eval()
            return {"trained_tokens": 0}
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for mb in batches:
            n = float(mb.loss_mask.sum())
            if n == 0:
                continue
            loss, metrics = loss_of(mb)
            # Weight each micro-batch by its share of trained tokens: the step's loss is a token mean.
            (loss * (n / total)).backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * n / total
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.model.eval()
        self.version += 1
        padded = sum(mb.input_ids.numel() for mb in batches)
        return sums | {
            "grad_norm": float(norm) if math.isfinite(float(norm)) else float("nan"),
            "trained_tokens": int(total),
            "padded_tokens": int(padded),
            "sequences": int(sum(mb.input_ids.shape[0] for mb in batches)),
        }

    def rl_step(self, samples: list[PathSample], loss: str = "ppo_clip", **loss_kwargs) -> dict:
        """One policy-gradient step with the registered ``loss`` (importance ratio vs behaviour)."""
        loss_fn = LOSSES.get(loss)
        T = self.cfg.temperature

        def loss_of(mb: MicroBatch):
            lp = token_logprobs(self.model, mb, T)  # (B, L-1)
            m = mb.loss_mask.bool()
            return loss_fn(lp[m], mb.old_logprobs[m], mb.advantages[m], mb.loss_mask[m], **loss_kwargs)

        versions = [s.versions[s.trained] for s in samples if s.trained.any()]
        oldest = int(min(v.min() for v in versions)) if versions else self.version
        out = self._apply(pack(samples, self.cfg.micro_batch_tokens), loss_of)
        # Staleness of the oldest trained token: versions behind the weights that were updated.
        out["max_staleness"] = int(self.version - 1 - oldest) if versions else 0
        out["version"] = self.version
        return out

    def sft_step(self, samples: list[PathSample]) -> dict:
        """One supervised step: mean negative log-likelihood of the trained tokens."""

        def loss_of(mb: MicroBatch):
            lp = token_logprobs(self.model, mb)  # (B, L-1)
            m = mb.loss_mask
            nll = -(lp * m).sum() / m.sum()
            return nll, {"nll": float(nll.detach())}

        out = self._apply(pack(samples, self.cfg.micro_batch_tokens), loss_of)
        out["version"] = self.version
        return out

    def weights(self) -> dict[str, np.ndarray]:
        return state_dict_numpy(self.model)
