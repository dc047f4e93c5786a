"""Segment attention equals attention under the dense ancestor mask it replaces.

The reference is a second implementation: each token's allowed keys are found by walking its path
(``prev`` pointers) and handed to plain ``scaled_dot_product_attention`` as an L x L mask.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gyreflow.train.attention import layout, row_segments, segment_attention


def tree_prev() -> np.ndarray:
    """Pre-order packing of: root [0..3]; child a [4, 5] with grandchild [6, 7]; child b [8, 9];
    b's children [10] and [11, 12]."""
    prev = np.arange(13) - 1
    prev[8] = 3  # b follows the root
    prev[10] = 9
    prev[11] = 9  # b's second child
    return prev


def dense_mask(prev: np.ndarray, length: int) -> torch.Tensor:
    allowed = np.zeros((length, length), bool)
    np.fill_diagonal(allowed, True)  # padding attends to itself
    for i in range(len(prev)):
        allowed[i, i] = True
        j = int(prev[i])
        while j >= 0:
            allowed[i, j] = True
            j = int(prev[j])
    return torch.from_numpy(allowed)


def test_segments_of_a_tree_by_hand():
    got = [(a, b, None if c is None else c.tolist()) for a, b, c in row_segments(tree_prev())]
    # The root and the chain a -> grandchild are one causal run; b and its children branch.
    assert got == [(0, 8, None), (8, 11, [0, 1, 2, 3]), (11, 13, [0, 1, 2, 3, 8, 9])]
    assert [(a, b, c) for a, b, c in row_segments(np.arange(5) - 1)] == [(0, 5, None)]


def test_a_layout_that_is_not_pre_order_is_refused():
    prev = np.arange(6) - 1
    prev[2] = 4
    with pytest.raises(ValueError, match="token 2 follows token 4"):
        row_segments(prev)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_segment_attention_equals_the_dense_ancestor_mask(kv_heads):
    torch.manual_seed(0)
    prevs = [tree_prev(), np.arange(9) - 1, np.r_[-1, 0, 1, 0, 3]]  # a tree, a padded chain, a fork
    B, H, L, D = len(prevs), 4, 13, 8
    q = torch.randn(B, H, L, D, requires_grad=True)
    k = torch.randn(B, kv_heads, L, D, requires_grad=True)
    v = torch.randn(B, kv_heads, L, D, requires_grad=True)
    out, _ = segment_attention(None, q, k, v, None, scaling=0.3, segments=layout(prevs))  # (B, L, H, D)
    mask = torch.stack([dense_mask(p, L) for p in prevs])[:, None]  # (B, 1, L, L)
    rep = H // kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=mask, scale=0.3).transpose(1, 2)  # (B, L, H, D)
    real = torch.zeros(B, L, dtype=torch.bool)
    for b, p in enumerate(prevs):
        real[b, : len(p)] = True
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-6)
    w = torch.randn_like(out) * real[:, :, None, None]  # a loss on real tokens only
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_segment_attention_takes_no_mask():
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match="not an attention mask"):
        segment_attention(None, q, q, q, torch.ones(1, 1, 2, 2, dtype=torch.bool))
