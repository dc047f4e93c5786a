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

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

NAME = "gyreflow_segments"
"""Name of the attention implementation in transformers' registry."""


@dataclass(frozen=True)
class Segment:
    """Tokens ``start:stop`` of row ``row`` attend to ``context`` and causally to each other."""

    row: int
    start: int
    stop: int
    context: torch.Tensor | None  # (A,) int64 positions in the row; None: no context


@dataclass(frozen=True)
class SegmentLayout:
    """Who attends to whom in a padded micro-batch; each row's segments cover its tokens in order."""

    segments: tuple[Segment, ...]
    lengths: tuple[int, ...]
    """Unpadded length of each row."""

    @property
    def causal(self) -> bool:
        """Every row is a plain causal chain (one segment, no context)."""
        return all(s.context is None for s in self.segments) and len(self.segments) == len(self.lengths)


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
    segments = []
    for b, prev in enumerate(prevs):
        for start, stop, ctx in row_segments(np.asarray(prev, dtype=np.int64)):
            segments.append(Segment(b, start, stop, None if ctx is None else torch.from_numpy(ctx)))
    return SegmentLayout(tuple(segments), tuple(len(p) for p in prevs))


def segment_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      segments: SegmentLayout | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention in transformers' calling convention: ``query`` (B, H, L, D), ``key``/``value``
    (B, H_kv, L, D); returns (B, L, H, D)."""
    if attention_mask is not None:
        raise ValueError(f"{NAME} attention takes its layout from `segments`, not an attention mask")
    gqa = key.shape[1] != query.shape[1]
    if segments is None or segments.causal:
        # Right padding only: a real token never sees a pad after it.
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                             is_causal=True, enable_gqa=gqa)  # (B, H, L, D)
        return out.transpose(1, 2).contiguous(), None
    B, H, L, D = query.shape
    by_row: list[list[Segment]] = [[] for _ in range(B)]
    for seg in segments.segments:
        by_row[seg.row].append(seg)
    rows = []
    # One split / gather per row, never a slice per segment: each slice of a full tensor would cost
    # a full-size zero gradient in the backward pass.
    for b, (q_b, k_b, v_b) in enumerate(zip(query.unbind(0), key.unbind(0), value.unbind(0))):
        segs, n = by_row[b], segments.lengths[b]
        qs = q_b.split([s.stop - s.start for s in segs] + [L - n], dim=1)  # (H, S, D) each, then the pads
        own = [torch.arange(s.start, s.stop) for s in segs]
        index = torch.cat([t for s, o in zip(segs, own) for t in ((o,) if s.context is None else (s.context, o))])
        spans = [len(o) + (0 if s.context is None else len(s.context)) for s, o in zip(segs, own)]
        ks = k_b[:, index].split(spans, dim=1)  # (H_kv, A + S, D) each
        vs = v_b[:, index].split(spans, dim=1)
        outs = []
        for seg, q, k, v in zip(segs, qs, ks, vs):
            # 4-D operands and mask: torch's fused CPU kernel takes those; 3-D ones fall back to the
            # unfused path (measured ~2x slower, forward and backward).
            S, A = q.shape[1], k.shape[1] - q.shape[1]
            mask = None if A == 0 else torch.ones(1, 1, S, A + S, dtype=torch.bool).tril_(A)  # context, then causal
            outs.append(F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, dropout_p=dropout,
                                                       scale=scaling, is_causal=A == 0, enable_gqa=gqa)[0])
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
