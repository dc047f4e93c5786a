"""A path longer than a micro-batch, trained in pieces with the gradient of the whole path.

Activation memory grows with the tokens forwarded at once; a path of an execution that ran to a
million tokens does not fit one forward. :func:`backward_in_pieces` cuts a one-row causal micro-batch
into pieces of at most ``size`` tokens:

1. without a graph, each piece but the last is forwarded attending to the keys and values of the
   pieces before it, which are kept (per layer; the KV cache of the path, not its activations);
2. from the last piece back to the first, each piece is forwarded again with a graph, the earlier
   keys and values entering as leaves, and one backward takes the piece's loss plus the gradient
   that later pieces sent to its own keys and values; the leaves' gradients are added to what the
   earlier pieces will send.

The loss must be a sum over tokens (the registry's losses are, given ``loss_denominator``), so the
pieces' losses add up to the whole. The cost is about one more forward per piece; the memory is the
path's keys and values, twice (their gradients), plus one piece's activations.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gyreflow.train.attention import PastKV, use_segment_attention
from gyreflow.train.packing import MicroBatch


def fits_whole(mb: MicroBatch, size: int) -> bool:
    """Whether ``mb`` trains in one forward: at most ``size`` tokens, or not one causal row."""
    return mb.input_ids.shape[1] <= size or mb.input_ids.shape[0] != 1 or not mb.segments.causal


def piece(mb: MicroBatch, start: int, stop: int, past: PastKV) -> MicroBatch:
    """Tokens ``start:stop`` of the one-row ``mb``, with the loss terms predicted from them."""
    sel = (mb.cols >= start) & (mb.cols < stop)  # (N,)
    return replace(mb, input_ids=mb.input_ids[:, start:stop], position_ids=mb.position_ids[:, start:stop],
                   segments=past, rows=mb.rows[sel], cols=mb.cols[sel] - start, target_ids=mb.target_ids[sel],
                   old_logprobs=mb.old_logprobs[sel], advantages=mb.advantages[sel],
                   temperatures=mb.temperatures[sel], versions=mb.versions[sel], weights=mb.weights[sel])


def backward_in_pieces(model: torch.nn.Module, mb: MicroBatch, size: int, loss_of, denom: float) -> dict:
    """Accumulate into ``model``'s gradients those of ``loss_of(mb) * w / denom`` (``w`` the weight
    of ``mb``'s samples), forwarding at most ``size`` tokens at a time; returns the metrics of
    ``loss_of`` weighted the same way. ``loss_of(piece) -> (weighted mean loss, metrics)``."""
    use_segment_attention(model)
    L = mb.input_ids.shape[1]
    cuts = [(s, min(L, s + size)) for s in range(0, L, size)]
    n_layers = model.config.num_hidden_layers
    kept = cuts[-1][0]  # tokens whose keys and values later pieces attend to
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def forward(p: MicroBatch) -> None:
        model(input_ids=p.input_ids, position_ids=p.position_ids, segments=p.segments, use_cache=False)

    with torch.no_grad():
        for s, e in cuts[:-1]:
            past = PastKV([k[:, :, :s] for k in keys] or [None] * n_layers,
                          [v[:, :, :s] for v in values] or [None] * n_layers)
            forward(piece(mb, s, e, past))
            for layer in range(n_layers):
                k, v = past.new[layer]
                if len(keys) <= layer:
                    keys.append(k.new_empty(k.shape[:2] + (kept, k.shape[3])))
                    values.append(v.new_empty(v.shape[:2] + (kept, v.shape[3])))
                keys[layer][:, :, s:e] = k
                values[layer][:, :, s:e] = v
    grad_k = [torch.zeros_like(k) for k in keys]
    grad_v = [torch.zeros_like(v) for v in values]
    sums: dict[str, float] = {}
    for s, e in reversed(cuts):
        leaves_k = [k[:, :, :s].detach().requires_grad_(True) for k in keys] if s else [None] * n_layers
        leaves_v = [v[:, :, :s].detach().requires_grad_(True) for v in values] if s else [None] * n_layers
        p = piece(mb, s, e, PastKV(leaves_k, leaves_v))
        w = float(p.weights.sum())
        if p.n_trained and w > 0:
            loss, metrics = loss_of(p)
            total = loss * (w / denom)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(torch.as_tensor(v).detach()) * w / denom
        else:
            forward(p)
            total = None
        if e <= kept:  # later pieces attended to this one: their gradient on its keys and values
            for layer, (k, v) in p.segments.new.items():
                sent = (k * grad_k[layer][:, :, s:e]).sum() + (v * grad_v[layer][:, :, s:e]).sum()
                total = sent if total is None else total + sent
        if total is not None:
            total.backward()
        if s and total is not None:
            for layer in range(n_layers):
                grad_k[layer][:, :, :s] += leaves_k[layer].grad
                grad_v[layer][:, :, :s] += leaves_v[layer].grad
    return sums
