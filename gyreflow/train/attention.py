"""Segment attention: a micro-batch's tree-packed rows attended node by node, without an L x L mask.

A packed tree row (see :mod:`gyreflow.train.packing`) is cut into *segments*: maximal runs of tokens
in which each token's predecessor on its path is the token just before it. A segment's tokens attend
to its *context* (the tokens of its path before the segment, in any order: softmax does not care)
and causally to each other. That is exactly attention restricted to ancestors, at a cost of
``segment x (context + segment)`` per segment instead of ``L x L`` per row, and with no mask
materialised. A causal chain is one segment with no context; a micro-batch of chains is one causal
call over the whole batch.

The function is registered with transformers' ``AttentionInterface`` under :data:`NAME`; the
layout reaches it as the forward's ``segments`` keyword (transformers passes unknown keywords down
to the attention function). With no layout it is plain causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

NAME = "gyreflow_segments"
"""Name of the attention implementation in transformers' registry."""


@dataclass(frozen=True)
class RowLayout:
    """One row's segments, ready for the kernel (built once per micro-batch, used by every layer)."""

    sizes: tuple[int, ...]
    """Tokens of each segment, in order."""
    index: torch.Tensor  # (sum(spans),) int64: each segment's keys, its context then itself
    spans: tuple[int, ...]
    """Keys of each segment (its context and its own tokens)."""
    masks: tuple[torch.Tensor | None, ...]
    """``(1, 1, S, A + S)`` bool per segment with a context (all of it, then causal); None: causal."""

    @property
    def causal(self) -> bool:
        return len(self.sizes) <= 1 and all(m is None for m in self.masks)


@dataclass(frozen=True)
class SegmentLayout:
    """Who attends to whom in a padded micro-batch."""

    rows: tuple[RowLayout, ...]
    lengths: tuple[int, ...]
    """Unpadded length of each row."""

    @property
    def causal(self) -> bool:
        """Every row is a plain causal chain (one segment, no context)."""
        return all(r.causal for r in self.rows)


def row_segments(prev: np.ndarray) -> list[tuple[int, int, np.ndarray | None]]:
    """``(start, stop, context)`` segments of one row from ``prev`` (the index of the token before
    each token on its path, -1 at a root); a chain (``prev[i] == i - 1``) is one segment."""
    n = len(prev)
    breaks = np.flatnonzero(prev != np.arange(n) - 1)  # tokens whose predecessor is not the one before
    starts = np.unique(np.r_[0, breaks]) if n else np.zeros(0, np.int64)
    stops = np.r_[starts[1:], n]
    contexts: list[np.ndarray | None] = []
    for k, s in enumerate(starts):
        p = int(prev[s])
        if p < 0:
            contexts.append(None)
            continue
        if p >= s:
            raise ValueError(f"token {s} follows token {p}, which comes after it: not a pre-order tree layout")
        j = int(np.searchsorted(starts, p, side="right")) - 1  # the segment holding the predecessor
        head = contexts[j]
        own = np.arange(starts[j], p + 1, dtype=np.int64)
        contexts.append(own if head is None else np.concatenate([head, own]))
    return [(int(a), int(b), c) for a, b, c in zip(starts, stops, contexts)]


def layout(prevs: list[np.ndarray]) -> SegmentLayout:
    """The layout of a micro-batch whose row ``b`` has predecessors ``prevs[b]``."""
    masks: dict[tuple[int, int], torch.Tensor] = {}  # one per shape, shared by the segments that have it
    rows = []
    for prev in prevs:
        sizes, parts, spans, row_masks = [], [], [], []
        for start, stop, ctx in row_segments(np.asarray(prev, dtype=np.int64)):
            S, A = stop - start, 0 if ctx is None else len(ctx)
            sizes.append(S)
            parts += ([] if ctx is None else [ctx]) + [np.arange(start, stop, dtype=np.int64)]
            spans.append(A + S)
            if A and (S, A) not in masks:
                masks[S, A] = torch.ones(1, 1, S, A + S, dtype=torch.bool).tril_(A)
            row_masks.append(masks[S, A] if A else None)
        index = torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.int64)
        rows.append(RowLayout(tuple(sizes), index, tuple(spans), tuple(row_masks)))
    return SegmentLayout(tuple(rows), tuple(len(p) for p in prevs))


MASK_BYTES = 1 << 25
"""Largest attention mask built at once off the GPU (a piece's queries go in blocks within it)."""


@dataclass
class PastKV:
    """What a piece of a long path attends to beyond itself (see :mod:`gyreflow.train.pieces`): the
    keys and values of the tokens before it, per layer (``None``: nothing before it). The forward
    receives it as its ``segments`` keyword; each layer records the piece's own keys and values in
    :attr:`new`."""

    keys: list[torch.Tensor | None]  # (1, H_kv, P, D) per layer
    values: list[torch.Tensor | None]
    new: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, gqa: bool) -> torch.Tensor:
        """The piece's attention, (B, H, n, D) from ``query`` (B, H, n, D) and its own ``key``,
        ``value`` (B, H_kv, n, D), over the earlier tokens and causally over itself."""
        self.new[layer] = (key, value)
        past_k, past_v = self.keys[layer], self.values[layer]
        if past_k is None:
            return F.scaled_dot_product_attention(query, key, value, scale=scaling, is_causal=True, enable_gqa=gqa)
        P, n = past_k.shape[2], query.shape[2]
        k_all = torch.cat([past_k, key], dim=2)  # (B, H_kv, P + n, D)
        v_all = torch.cat([past_v, value], dim=2)
        if query.is_cuda:  # fused kernels take the lower-right causal mask without building it
            from torch.nn.attention.bias import causal_lower_right

            return F.scaled_dot_product_attention(query, k_all, v_all, attn_mask=causal_lower_right(n, P + n),
                                                  scale=scaling, enable_gqa=gqa)
        # Elsewhere a masked call materialises its (queries x keys) weights and keeps them for the
        # backward: queries go in blocks, each recomputed in the backward rather than kept.
        from torch.utils.checkpoint import checkpoint

        def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: int) -> torch.Tensor:
            # Query a + j (absolute P + a + j) sees keys 0 .. P + a + j: all of the past, causal within.
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril_(P + a)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scaling, enable_gqa=gqa)

        step = max(1, min(n, MASK_BYTES // (P + n)))
        outs = [checkpoint(block, query[:, :, a:a + step], k_all[:, :, :P + min(n, a + step)],
                           v_all[:, :, :P + min(n, a + step)], a, use_reentrant=False)
                for a in range(0, n, step)]
        return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      segments: SegmentLayout | PastKV | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention in transformers' calling convention: ``query`` (B, H, L, D), ``key``/``value``
    (B, H_kv, L, D); returns (B, L, H, D)."""
    if attention_mask is not None:
        raise ValueError(f"{NAME} attention takes its layout from `segments`, not an attention mask")
    gqa = key.shape[1] != query.shape[1]
    if isinstance(segments, PastKV):
        return segments.attend(module.layer_idx, query, key, value, scaling, gqa).transpose(1, 2).contiguous(), None
    if segments is None or segments.causal:
        # Right padding only: a real token never sees a pad after it.
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                             is_causal=True, enable_gqa=gqa)  # (B, H, L, D)
        return out.transpose(1, 2).contiguous(), None
    L = query.shape[2]
    rows = []
    # One split / gather per row, never a slice per segment: each slice of a full tensor would cost
    # a full-size zero gradient in the backward pass.
    for row, n, q_b, k_b, v_b in zip(segments.rows, segments.lengths, query.unbind(0), key.unbind(0), value.unbind(0)):
        qs = q_b.split([*row.sizes, L - n], dim=1)  # (H, S, D) each, then the pads
        ks = k_b.index_select(1, row.index).split(row.spans, dim=1)  # (H_kv, A + S, D) each
        vs = v_b.index_select(1, row.index).split(row.spans, dim=1)
        outs = []
        for q, k, v, mask in zip(qs, ks, vs, row.masks):
            # 4-D operands and mask: torch's fused CPU kernel takes those; 3-D ones fall back to the
            # unfused path (measured ~2x slower, forward and backward).
            outs.append(F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, dropout_p=dropout,
                                                       scale=scaling, is_causal=mask is None, enable_gqa=gqa)[0])
        if L > n:
            outs.append(torch.zeros_like(qs[-1]))  # pads attend to nothing
        rows.append(torch.cat(outs, dim=1))  # (H, L, D)
    return torch.stack(rows).transpose(1, 2).contiguous(), None  # (B, L, H, D)


def use_segment_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a transformers model to segment attention (idempotent); returns it."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(NAME, segment_attention)
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
    return model
