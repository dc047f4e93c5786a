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

    def _backward(self, batches: list[MicroBatch], loss_of, denom: float) -> tuple[dict, int]:
        """Accumulate gradients of ``sum_mb loss_mb * n_mb / denom`` (``loss_of(mb) -> (token-mean
        loss, metrics)``); returns the metric sums weighted the same way and the trained tokens."""
        sums: dict[str, float] = {}
        total = 0
        for mb in batches:
            n = float(mb.n_trained)
            if n == 0:
                continue
            loss, metrics = loss_of(mb)
            (loss * (n / denom)).backward()
            total += int(n)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * n / denom
        return sums, total

    def rl_lr(self) -> float:
        """Learning rate of the next RL update: ``lr``, warmed up over the optimizer's first
        ``warmup_steps`` updates."""
        done = self.updates()
        warm = self.cfg.warmup_steps
        return self.cfg.lr * (min(1.0, (done + 1) / warm) if warm > 0 else 1.0)

    def updates(self) -> int:
        """Updates the optimizer has applied (its Adam step count)."""
        for state in self.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
        return 0

    def _set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def _step(self) -> float:
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        self.optimizer.step()
        self.model.eval()
        self.version += 1
        return norm if math.isfinite(norm) else float("nan")

    def _apply(self, batches: list[MicroBatch], loss_of) -> dict:
        """One optimizer step over ``batches``; ``loss_of(mb) -> (token-mean loss, metrics)``."""
        self.model.train()
        total = sum(float(mb.n_trained) for mb in batches)
        if total == 0:
            self.model.eval()
            return {"trained_tokens": 0}
        self.optimizer.zero_grad(set_to_none=True)
        # Each micro-batch weighs by its share of trained tokens: the step's loss is a token mean.
        sums, _ = self._backward(batches, loss_of, total)
        norm = self._step()
        padded = sum(mb.input_ids.numel() for mb in batches)
        return sums | {
            "grad_norm": norm,
            "trained_tokens": int(total),
            "padded_tokens": int(padded),
            "sequences": int(sum(mb.input_ids.shape[0] for mb in batches)),
        }

    def _rl_loss(self, loss: str, **loss_kwargs):
        loss_fn = LOSSES.get(loss)
        T = self.cfg.temperature

        def loss_of(mb: MicroBatch):
            lp, old, adv = mb.flat(token_logprobs(self.model, mb, T))  # (N,) each, one per sample
            return loss_fn(lp, old, adv, torch.ones_like(lp), **loss_kwargs)

        return loss_of

    @staticmethod
    def _oldest(samples: list[PathSample]) -> int | None:
        versions = [v for v in (s.trained_versions() for s in samples) if len(v)]
        return int(min(v.min() for v in versions)) if versions else None

    def gradients(self, samples: list[PathSample], loss: str = "ppo_clip", **loss_kwargs) -> dict:
        """One share of a step's gradient work, to be summed with the others by :meth:`apply_gradients`.

        Returns the *token-summed* gradient of the loss over ``samples`` (numpy, by parameter
        name), the trained tokens, token-summed metrics and the oldest trained version; the model
        and optimizer are left as they were.
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        batches = pack(samples, self.cfg.micro_batch_tokens)
        sums, tokens = self._backward(batches, self._rl_loss(loss, **loss_kwargs), 1.0)
        grads = {name: (p.grad.detach().numpy().copy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32))
                 for name, p in self.model.named_parameters()}
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        return {"grads": grads, "tokens": tokens, "sums": sums, "oldest": self._oldest(samples),
                "padded_tokens": int(sum(mb.input_ids.numel() for mb in batches)), "version": self.version}

    def apply_gradients(self, parts: list[dict]) -> dict:
        """The optimizer step of a step whose gradient work was split into ``parts``: the same
        update as :meth:`rl_step` on all their samples at once (a token mean over the step)."""
        for part in parts:
            if part["version"] != self.version:
                raise ValueError(f"a gradient share was computed at version {part['version']}, the trainer is at {self.version}")
        total = sum(p["tokens"] for p in parts)
        oldest = [p["oldest"] for p in parts if p["oldest"] is not None]
        if total == 0:
            # Nothing to learn (every advantage zero): an empty update. The version still
            # advances, so a version always counts the steps applied.
            self.version += 1
            return {"trained_tokens": 0, "max_staleness": 0, "version": self.version}
        for name, param in self.model.named_parameters():
            g = sum(p["grads"][name] for p in parts) / total
            param.grad = torch.from_numpy(np.ascontiguousarray(g, dtype=np.float32)).to(param.dtype)
        sums: dict[str, float] = {}
        for p in parts:
            for k, v in p["sums"].items():
                sums[k] = sums.get(k, 0.0) + v / total
        self.model.train()
        self._set_lr(lr := self.rl_lr())
        norm = self._step()
        return sums | {
            "lr": lr,
            "grad_norm": norm,
            "trained_tokens": int(total),
            "padded_tokens": int(sum(p["padded_tokens"] for p in parts)),
            "shares": len(parts),
            "max_staleness": int(self.version - 1 - min(oldest)) if oldest else 0,
            "version": self.version,
        }

    def rl_step(self, samples: list[PathSample], loss: str = "ppo_clip", **loss_kwargs) -> dict:
        """One policy-gradient step with the registered ``loss`` (importance ratio vs behaviour)."""
        oldest = self._oldest(samples)
        self._set_lr(lr := self.rl_lr())
        out = self._apply(pack(samples, self.cfg.micro_batch_tokens), self._rl_loss(loss, **loss_kwargs))
        if out["trained_tokens"] == 0:
            self.version += 1  # an empty update is still a step (see apply_gradients)
        # Staleness of the oldest trained token: versions behind the weights that were updated.
        out["max_staleness"] = int(self.version - 1 - oldest) if oldest is not None else 0
        out["version"] = self.version
        out["lr"] = lr
        return out

    def sft_step(self, samples: list[PathSample]) -> dict:
        """One supervised step: mean negative log-likelihood of the trained tokens."""

        def loss_of(mb: MicroBatch):
            lp, _, _ = mb.flat(token_logprobs(self.model, mb))  # (N,)
            nll = -lp.mean()
            return nll, {"nll": float(nll.detach())}

        out = self._apply(pack(samples, self.cfg.micro_batch_tokens), loss_of)
        out["version"] = self.version
        return out

    def weights(self) -> dict[str, np.ndarray]:
        return state_dict_numpy(self.model)
