"""Policy-gradient losses, registered in :data:`~gyreflow.algo.registry.LOSSES`.

Every loss takes flattened per-token tensors of one batch, all ``(N,)``:

- ``logprobs``: log-probs of the sampled tokens under the current policy (carry the gradient);
- ``old_logprobs``: behaviour log-probs recorded when the tokens were sampled;
- ``advantages``: the advantage of the execution each token belongs to, broadcast per token;
- ``mask``: 1.0 on tokens to train (sampled and owned by this path), 0.0 elsewhere.

Normalisation: the loss is a token-mean, ``sum(per_token * mask) / denominator``. By default the
denominator is ``mask.sum()`` of this batch. When one optimizer step accumulates gradients over
several micro-batches or gradient tasks, pass the step's total trained-token count as
``loss_denominator`` so that every token has the same weight whichever micro-batch it landed in
(a per-micro-batch mean would up-weight tokens of short micro-batches). Sequence-level means are
deliberately not used: they down-weight the tokens of long executions, which are the point here.

Masked-out tokens are excluded before any arithmetic (their ratio is forced to 1), so garbage
log-probs on prompt or padding tokens can never produce ``inf``/``nan``.
"""

from __future__ import annotations

import torch

from gyreflow.algo.registry import LOSSES


def _check(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    """Require four 1-D tensors of one length."""
    shapes = {t.shape for t in (logprobs, old_logprobs, advantages, mask)}
    if len(shapes) != 1 or logprobs.dim() != 1:
        raise ValueError(
            "logprobs, old_logprobs, advantages and mask must all be (N,); got "
            f"{[tuple(t.shape) for t in (logprobs, old_logprobs, advantages, mask)]}"
        )


def _denominator(mask: torch.Tensor, loss_denominator: float | None) -> torch.Tensor:
    """Token count to divide by; at least 1 so an empty batch gives loss 0, not nan."""
    if loss_denominator is not None:
        if loss_denominator <= 0:
            raise ValueError(f"loss_denominator must be > 0, got {loss_denominator}")
        return torch.as_tensor(float(loss_denominator), dtype=mask.dtype, device=mask.device)
    return mask.sum().clamp_min(1.0)


def _masked_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """``logprobs - old_logprobs`` on kept tokens, 0 elsewhere (ratio 1, zero gradient)."""
    diff = logprobs - old_logprobs.detach()  # (N,)
    return torch.where(keep, diff, torch.zeros_like(diff))


@torch.no_grad()
def _ratio_metrics(log_ratio: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    """Ratio statistics and the k3 KL estimate ``E[(r - 1) - log r]`` over kept tokens."""
    if not bool(keep.any()):
        return {"approx_kl": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0, "n_tokens": 0.0}
    lr = log_ratio[keep]  # (K,)
    ratio = lr.exp()
    return {
        # k3 is non-negative and unbiased for KL(behaviour || current) under behaviour samples.
        "approx_kl": float(((ratio - 1.0) - lr).mean()),
        "ratio_mean": float(ratio.mean()),
        "ratio_max": float(ratio.max()),
        "n_tokens": float(keep.sum()),
    }


@LOSSES.register("ppo_clip")
def ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate, token-mean over ``mask``.

    ``loss = -sum(min(r * A, clip(r, 1 - clip_eps, 1 + clip_eps_high) * A) * mask) / denom``
    with importance ratio ``r = exp(logprobs - old_logprobs)`` against the behaviour policy.

    Parameters
    ----------
    logprobs, old_logprobs, advantages, mask
        ``(N,)`` each; see the module docstring. Only ``logprobs`` carries gradient.
    clip_eps
        Lower clip range (and upper one unless ``clip_eps_high`` is given).
    clip_eps_high
        Upper clip range; a larger value ("clip higher") leaves more room for raising the
        probability of unlikely good tokens.
    clip_ratio_c
        Dual clip (> 1): for a negative advantage the objective is at least ``clip_ratio_c * A``,
        so a stale token whose ratio has grown large cannot push an unbounded update.
    loss_denominator
        Token count to divide by; default ``mask.sum()`` (see the module docstring).

    Returns
    -------
    loss
        Scalar tensor.
    metrics
        ``clip_frac`` (fraction of trained tokens whose clipped term is the active one, i.e.
        that get no gradient), ``approx_kl``, ``ratio_mean``, ``ratio_max``, ``n_tokens``.
    """
    _check(logprobs, old_logprobs, advantages, mask)
    eps_low = clip_eps
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    keep = mask > 0  # (N,) bool
    adv = advantages.detach()  # (N,)
    log_ratio = _masked_log_ratio(logprobs, old_logprobs, keep)  # (N,)
    ratio = log_ratio.exp()  # (N,)
    unclipped = ratio * adv  # (N,)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv  # (N,)
    per_token = -torch.minimum(unclipped, clipped)  # (N,)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        per_token = torch.where(adv < 0, torch.minimum(per_token, -clip_ratio_c * adv), per_token)  # (N,)
    per_token = torch.where(keep, per_token, torch.zeros_like(per_token))  # (N,)
    # mask may carry fractional token weights, hence the product after where().
    loss = (per_token * mask).sum() / _denominator(mask, loss_denominator)

    metrics = _ratio_metrics(log_ratio, keep)
    with torch.no_grad():
        is_clipped = (clipped < unclipped) & keep  # (N,) the min picks the flat branch
        metrics["clip_frac"] = float(is_clipped.sum()) / max(metrics["n_tokens"], 1.0)
    return loss, metrics


@LOSSES.register("reinforce")
def reinforce(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain REINFORCE: ``-sum(A * logprobs * mask) / denom``, no importance ratio.

    Correct only on-policy (behaviour == current policy; runs with staleness > 0 are refused);
    ``old_logprobs`` are used for the ratio metrics alone, which show how off-policy the batch
    actually was. The clip parameters are accepted for the shared signature and ignored.

    Returns
    -------
    loss
        Scalar tensor.
    metrics
        ``approx_kl``, ``ratio_mean``, ``ratio_max``, ``n_tokens``, and ``clip_frac`` = 0.
    """
    del clip_eps, clip_eps_high, clip_ratio_c  # shared signature; REINFORCE does not clip
    _check(logprobs, old_logprobs, advantages, mask)
    keep = mask > 0  # (N,) bool
    # where(), not multiplication, so a masked-out -inf log-prob cannot turn into nan.
    logp = torch.where(keep, logprobs, torch.zeros_like(logprobs))  # (N,)
    per_token = -advantages.detach() * logp  # (N,)
    loss = (per_token * mask).sum() / _denominator(mask, loss_denominator)
    metrics = _ratio_metrics(_masked_log_ratio(logprobs.detach(), old_logprobs, keep), keep)
    metrics["clip_frac"] = 0.0
    return loss, metrics


reinforce.on_policy_only = True  # type: ignore[attr-defined]  # read by the config validator
