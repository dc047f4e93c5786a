"""The trainer: a policy replica and its optimizer; one call per RL step (or SFT step).

It lives on a trainer cell for the whole run (see :mod:`gyreflow.train.service`); tasks bring it
data, never a model.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gyreflow.algo.registry import LOSSES
from gyreflow.model.policy import state_dict_numpy
from gyreflow.train.attention import use_segment_attention
from gyreflow.train.config import OptimConfig
from gyreflow.train.packing import MicroBatch, PathSample, pack
from gyreflow.train.pieces import backward_in_pieces, fits_whole
from gyreflow.train.reduce import GradientShare


MAX_HALVINGS = 10
"""Halvings of an update whose KL exceeds its bound before the update is dropped."""


def sample_logprobs(model, mb: MicroBatch) -> torch.Tensor:
    """Log-prob of each of the micro-batch's samples under ``model``, at the temperature it was
    drawn at: (N,)."""
    logits = use_segment_attention(model)(input_ids=mb.input_ids, position_ids=mb.position_ids,
                                          segments=mb.segments, use_cache=False).logits  # (B, L, V)
    z = logits[mb.rows, mb.cols].float() / mb.temperatures[:, None]  # (N, V)
    return torch.log_softmax(z, dim=-1).gather(-1, mb.target_ids[:, None]).squeeze(-1)  # (N,)


class Trainer:
    """Owns the policy being trained, its optimizer and its weights version."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, version: int = 0):
        self.model, self.cfg, self.version = model, cfg, version
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def _backward(self, batches: list[MicroBatch], loss_of, denom: float) -> tuple[dict, int, float]:
        """Accumulate gradients of ``sum_mb loss_mb * w_mb / denom`` (``loss_of(mb) -> (weighted
        mean loss, metrics)``, ``w_mb`` the micro-batch's sample weight); returns the metric sums
        weighted the same way, the trained samples and their weight."""
        sums: dict[str, float] = {}
        total, mass = 0, 0.0
        for mb in batches:
            w = float(mb.weights.sum())
            if mb.n_trained == 0 or w == 0:
                continue
            if fits_whole(mb, self.cfg.micro_batch_tokens):
                loss, metrics = loss_of(mb)
                (loss * (w / denom)).backward()
                metrics = {k: float(v) * w / denom for k, v in metrics.items()}
            else:  # one path longer than a micro-batch
                metrics = backward_in_pieces(self.model, mb, self.cfg.micro_batch_tokens, loss_of, denom)
            total += mb.n_trained
            mass += w
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        return sums, total, mass

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

    def _probe_logprobs(self, probe: list[MicroBatch]) -> list[torch.Tensor]:
        self.model.eval()
        with torch.no_grad():
            return [sample_logprobs(self.model, mb) for mb in probe]  # (N,) each

    def _kl_from(self, probe: list[MicroBatch], before: list[torch.Tensor]) -> float:
        """Mean KL(before || now) per probe token (the k3 estimator; the tokens were drawn by
        weights close to ``before``)."""
        num, den = 0.0, 0
        for now, old in zip(self._probe_logprobs(probe), before):
            d = now - old  # (N,) log(p_now / p_before)
            num += float((torch.expm1(d) - d).sum())
            den += len(d)
        return num / den if den else 0.0

    def _bounded_step(self, probe: list[MicroBatch], max_kl: float) -> dict:
        """The optimizer step, shrunk until the policy moves at most ``max_kl`` (mean per-token KL
        on ``probe``) from where it was: the step is halved up to ``MAX_HALVINGS`` times, then
        dropped. Adam's moments advance as for the whole step; only its size is cut."""
        if max_kl <= 0 or not any(mb.n_trained for mb in probe):
            return {"grad_norm": self._step()}
        before = self._probe_logprobs(probe)
        start = [p.detach().clone() for p in self.model.parameters()]
        norm = self._step()
        kl = proposed = self._kl_from(probe, before)
        scale = 1.0
        while kl > max_kl and scale > 0:
            scale = scale / 2 if scale > 2.0 ** -MAX_HALVINGS else 0.0
            with torch.no_grad():
                for p, p0 in zip(self.model.parameters(), start):
                    # p0 + scale * step, from the halved step before it
                    p.copy_(p0 + (p - p0) * 0.5) if scale else p.copy_(p0)
            kl = self._kl_from(probe, before)
        return {"grad_norm": norm, "update_kl": kl, "update_kl_proposed": proposed, "update_scale": scale}

    def _apply(self, batches: list[MicroBatch], loss_of) -> dict:
        """One optimizer step over ``batches``; ``loss_of(mb) -> (token-mean loss, metrics)``."""
        self.model.train()
        total = sum(mb.n_trained for mb in batches)
        mass = sum(float(mb.weights.sum()) for mb in batches)
        if total == 0 or mass == 0:
            self.model.eval()
            return {"trained_tokens": 0}
        self.optimizer.zero_grad(set_to_none=True)
        # Each micro-batch weighs by its share of the sample weight: the step's loss is
        # sum(w * loss) / sum(w) over every sample, whichever micro-batch it landed in.
        sums, _, _ = self._backward(batches, loss_of, mass)
        norm = self._step()
        padded = sum(mb.input_ids.numel() for mb in batches)
        return sums | {
            "grad_norm": norm,
            "trained_tokens": int(total),
            "padded_tokens": int(padded),
            "sequences": int(sum(mb.input_ids.shape[0] for mb in batches)),
        }

    def _rl_loss(self, loss: str, is_cap: float = 0.0, **loss_kwargs):
        loss_fn = LOSSES.get(loss)

        def loss_of(mb: MicroBatch):
            lp = sample_logprobs(self.model, mb)  # (N,)
            old, weights = mb.old_logprobs, mb.weights
            if is_cap:
                # Truncated importance sampling: a sample this very version drew is scored on the
                # trainer's own log-prob, times min(pi_trainer / pi_engine, is_cap), so a numeric
                # mismatch between engine and trainer cannot blow the update up.
                fresh = mb.versions == self.version  # (N,)
                w_is = torch.exp(lp.detach() - old).clamp(max=is_cap)  # (N,)
                old = torch.where(fresh, lp.detach(), old)
                weights = torch.where(fresh, weights * w_is, weights)
            loss_value, metrics = loss_fn(lp, old, mb.advantages, weights, loss_denominator=float(mb.weights.sum()),
                                          **loss_kwargs)
            return loss_value, metrics

        return loss_of

    @staticmethod
    def _oldest(batches: list[MicroBatch]) -> int | None:
        """Oldest weights version of a trained sample (stale samples left out by packing are not)."""
        versions = [int(mb.versions.min()) for mb in batches if mb.n_trained]
        return min(versions) if versions else None

    def gradients(self, samples: list[PathSample], loss: str = "ppo_clip", max_staleness: int | None = None,
                  is_cap: float = 0.0, **loss_kwargs) -> dict:
        """One share of a step's gradient work, to be summed with the others by :meth:`apply_gradients`.

        Returns the *weight-summed* gradient of the loss over ``samples`` (numpy, by parameter
        name), the trained samples (``tokens``) and their weight, weight-summed metrics and the
        oldest trained version; the model and optimizer are left as they were.
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        batches = pack(samples, self.cfg.micro_batch_tokens, self._min_version(max_staleness))
        sums, tokens, mass = self._backward(batches, self._rl_loss(loss, is_cap, **loss_kwargs), 1.0)
        grads = {name: (p.grad.detach().numpy().copy() if p.grad is not None else np.zeros(tuple(p.shape), np.float32))
                 for name, p in self.model.named_parameters()}
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        return GradientShare(grads, tokens, mass, sums, self._oldest(batches),
                             sum(s.n_trained for s in samples) - sum(mb.n_trained for mb in batches),
                             int(sum(mb.input_ids.numel() for mb in batches)), self.version)

    def apply_gradients(self, parts: list[GradientShare], max_kl: float = 0.0,
                        probe: list[PathSample] | None = None) -> dict:
        """The optimizer step of a step whose gradient work was split into ``parts``: the same
        update as :meth:`rl_step` on all their samples at once (a token mean over the step).

        With ``max_kl`` > 0, the step is shrunk until it moves the policy at most that far (mean
        per-token KL over the trained tokens of ``probe``; see :meth:`_bounded_step`)."""
        for part in parts:
            if part.grads is None:
                raise ValueError("a gradient share without its gradient: take its cell's sum (gyreflow.train.reduce)")
            if part.version != self.version:
                raise ValueError(f"a gradient share was computed at version {part.version}, the trainer is at "
                                 f"{self.version}")
        total = sum(p.tokens for p in parts)
        mass = sum(p.weight for p in parts)
        oldest = [p.oldest for p in parts if p.oldest is not None]
        if total == 0 or mass == 0:
            # Nothing to learn (every advantage zero): an empty update. The version still
            # advances, so a version always counts the steps applied.
            self.version += 1
            return {"trained_tokens": 0, "max_staleness": 0, "version": self.version}
        for name, param in self.model.named_parameters():
            g = sum(p.grads[name] for p in parts) / mass
            param.grad = torch.from_numpy(np.ascontiguousarray(g, dtype=np.float32)).to(param.dtype)
        sums: dict[str, float] = {}
        for p in parts:
            for k, v in p.sums.items():
                sums[k] = sums.get(k, 0.0) + v / mass
        self.model.train()
        self._set_lr(lr := self.rl_lr())
        moved = self._bounded_step(pack(probe or [], self.cfg.micro_batch_tokens), max_kl)
        return sums | moved | {
            "lr": lr,
            "trained_tokens": int(total),
            "padded_tokens": int(sum(p.padded_tokens for p in parts)),
            "shares": int(sum(p.count for p in parts)),
            "stale_masked": int(sum(p.stale_masked for p in parts)),
            "max_staleness": int(self.version - 1 - min(oldest)) if oldest else 0,
            "version": self.version,
        }

    def _min_version(self, max_staleness: int | None) -> int | None:
        """Oldest weights version a trained sample may come from (``None``: no bound)."""
        return None if max_staleness is None else self.version - max_staleness

    def rl_step(self, samples: list[PathSample], loss: str = "ppo_clip", max_staleness: int | None = None,
                is_cap: float = 0.0, **loss_kwargs) -> dict:
        """One policy-gradient step with the registered ``loss`` (importance ratio vs behaviour)."""
        batches = pack(samples, self.cfg.micro_batch_tokens, self._min_version(max_staleness))
        oldest = self._oldest(batches)
        self._set_lr(lr := self.rl_lr())
        out = self._apply(batches, self._rl_loss(loss, is_cap, **loss_kwargs))
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
            nll = -sample_logprobs(self.model, mb).mean()
            return nll, {"nll": float(nll.detach())}

        out = self._apply(pack(samples, self.cfg.micro_batch_tokens), loss_of)
        out["version"] = self.version
        return out

    def weights(self) -> dict[str, np.ndarray]:
        return state_dict_numpy(self.model)
