"""A functional Llama forward pass over a paged KV cache, and per-row sampling.

The engine keeps its own copy of the policy's weights (q/k/v and gate/up fused, so a layer is
four matmuls) and runs this forward for prefill chunks and decode iterations alike: every row of a
batch is one request, identified by its block table, with its own start position and number of new
tokens. Numerics follow Hugging Face's ``LlamaForCausalLM`` (float32 RMSNorm, rotary embedding
with the config's rope scaling, grouped-query attention, SwiGLU MLP, tied ``lm_head``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from gyreflow.engine.kvcache import KVBlocks


STATIC_ROPE_TYPES = ("linear", "llama3", "yarn")
"""Rope scalings whose angles do not depend on the sequence length (what one table can hold)."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama model, read from its Hugging Face config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_inv_freq: tuple[float, ...]
    """Rotary frequencies (Dh/2), as Hugging Face computes them for the config's rope type."""
    rope_scaling: float
    """Factor on cos and sin (1 except for yarn-style scaling)."""
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float32) / head_dim
            inv_freq, scaling = 1.0 / (theta**exponents), 1.0  # (Dh/2,)
        elif rope_type in STATIC_ROPE_TYPES:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        else:
            raise NotImplementedError(f"rope type {rope_type!r} is not supported by the torch engine "
                                      f"(supported: default, {', '.join(STATIC_ROPE_TYPES)})")
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=theta,
            rope_inv_freq=tuple(float(x) for x in inv_freq.float()),
            rope_scaling=float(scaling),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # (D,)
    qkv: torch.Tensor  # ((Hq + 2 Hkv) Dh, D)
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # (D, Hq Dh)
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor  # (D,)
    gate_up: torch.Tensor  # (2 I, D)
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # (D, I)
    down_bias: torch.Tensor | None


@dataclass
class ModelWeights:
    embed: torch.Tensor  # (V, D)
    layers: list[LayerWeights]
    norm: torch.Tensor  # (D,)
    lm_head: torch.Tensor  # (V, D), the embedding itself when tied


def weight_names(spec: ModelSpec) -> list[str]:
    """The state-dict keys a full weight set must contain."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names += [
            p + "input_layernorm.weight",
            p + "post_attention_layernorm.weight",
            p + "self_attn.q_proj.weight",
            p + "self_attn.k_proj.weight",
            p + "self_attn.v_proj.weight",
            p + "self_attn.o_proj.weight",
            p + "mlp.gate_proj.weight",
            p + "mlp.up_proj.weight",
            p + "mlp.down_proj.weight",
        ]
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def build_weights(
    state: Mapping[str, np.ndarray | torch.Tensor],
    spec: ModelSpec,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> ModelWeights:
    """Device tensors for the forward pass from a Hugging Face state dict.

    Parameters
    ----------
    state
        ``model.state_dict()`` or its numpy copy (:func:`gyreflow.model.policy.state_dict_numpy`).
    spec
        The model's shape; every key of :func:`weight_names` must be present with a matching shape.
    device, dtype
        Where and in what precision the weights live.

    Raises
    ------
    KeyError
        A required weight is missing.
    ValueError
        A weight has the wrong shape.
    """
    missing = [k for k in weight_names(spec) if k not in state]
    if missing:
        raise KeyError(f"weights lack {missing[:3]}{'...' if len(missing) > 3 else ''}")

    def get(name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        v = state[name]
        t = v.detach() if isinstance(v, torch.Tensor) else torch.from_numpy(np.asarray(v))
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=device, dtype=dtype)

    def opt(name: str) -> torch.Tensor | None:
        return get(name) if name in state else None

    def fused_bias(names: list[str], sizes: list[int]) -> torch.Tensor | None:
        # A fused matmul needs a bias for every part once any part has one.
        parts = [opt(n) for n in names]
        if all(p is None for p in parts):
            return None
        return torch.cat([p if p is not None else torch.zeros(s, device=device, dtype=dtype) for p, s in zip(parts, sizes)])

    d, dh, hq, hkv, inter = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(
            LayerWeights(
                attn_norm=get(p + "input_layernorm.weight", (d,)),
                qkv=torch.cat(
                    [
                        get(a + "q_proj.weight", (hq * dh, d)),
                        get(a + "k_proj.weight", (hkv * dh, d)),
                        get(a + "v_proj.weight", (hkv * dh, d)),
                    ]
                ).contiguous(),
                qkv_bias=fused_bias([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"], [hq * dh, hkv * dh, hkv * dh]),
                o=get(a + "o_proj.weight", (d, hq * dh)).contiguous(),
                o_bias=opt(a + "o_proj.bias"),
                mlp_norm=get(p + "post_attention_layernorm.weight", (d,)),
                gate_up=torch.cat([get(m + "gate_proj.weight", (inter, d)), get(m + "up_proj.weight", (inter, d))]).contiguous(),
                gate_up_bias=fused_bias([m + "gate_proj.bias", m + "up_proj.bias"], [inter, inter]),
                down=get(m + "down_proj.weight", (d, inter)).contiguous(),
                down_bias=opt(m + "down_proj.bias"),
            )
        )
    embed = get("model.embed_tokens.weight", (spec.vocab_size, d)).contiguous()
    lm_head = embed if spec.tie_word_embeddings else get("lm_head.weight", (spec.vocab_size, d)).contiguous()
    return ModelWeights(embed=embed, layers=layers, norm=get("model.norm.weight", (d,)), lm_head=lm_head)


def rope_tables(spec: ModelSpec, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of the model's rotary embedding for positions ``0 .. max_len - 1``.

    Computed in float32 exactly as Hugging Face does (one product per angle, then the rope type's
    attention scaling), so positions match bit for bit.
    """
    inv_freq = torch.tensor(spec.rope_inv_freq, dtype=torch.float32)  # (Dh/2,)
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # (M, Dh/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (M, Dh)
    return (emb.cos() * spec.rope_scaling).to(device), (emb.sin() * spec.rope_scaling).to(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # same formula, one fused op
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, T, H, Dh) by per-position ``cos``/``sin`` (B, T, 1, Dh)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


MASK_ELEMENTS = 1 << 24
"""Largest additive attention mask (B G T Tk elements) one forward builds; callers group rows so
that prefill batches stay under it (a single row needs no mask)."""


def _read_keys(pool: torch.Tensor, tables: torch.Tensor, t_keys: int, rows: slice | None) -> torch.Tensor:
    """The first ``t_keys`` positions of each row's block table: (B, Tk, Hkv, Dh)."""
    if rows is not None:
        return pool[rows, :t_keys]  # one block per row, consecutive: a view
    bs = pool.shape[1]
    nb = -(-t_keys // bs)
    if nb == 1:
        return pool[:, :t_keys].index_select(0, tables[:, 0])
    b = tables.shape[0]
    # index_select copies whole blocks several times faster than advanced indexing does.
    blocks = pool.index_select(0, tables[:, :nb].reshape(-1))  # (B nb, BS, Hkv, Dh)
    return blocks.view(b, nb * bs, *pool.shape[2:])[:, :t_keys]  # (B, Tk, Hkv, Dh)


def _causal_chunk(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, start: int, gqa: bool) -> torch.Tensor:
    """Attention of one row's (1, Hq, T, Dh) queries at positions ``start ..`` over its keys
    ``0 .. start + T - 1`` (1, Hkv, Tk, Dh): all earlier keys, and the chunk's own causally.

    On CPU the two parts run unmasked and causal through the flash kernel and merge by their
    log-sum-exps: a bottom-right causal mask there takes the unfused path, several times slower
    on a long prompt.
    """
    T = q.shape[2]
    if start == 0:
        return F.scaled_dot_product_attention(q, keys, vals, is_causal=T > 1, enable_gqa=gqa)
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if q.device.type != "cpu" or flash is None:
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=causal_lower_right(T, start + T), enable_gqa=gqa)
    if gqa:
        g = q.shape[1] // keys.shape[1]
        keys, vals = keys.repeat_interleave(g, dim=1), vals.repeat_interleave(g, dim=1)  # (1, Hq, Tk, Dh)
    past, past_lse = flash(q, keys[:, :, :start], vals[:, :, :start], 0.0, False)[:2]  # (1, Hq, T, Dh), (1, Hq, T)
    own, own_lse = flash(q, keys[:, :, start:], vals[:, :, start:], 0.0, True)[:2]
    w = torch.sigmoid(past_lse - own_lse).unsqueeze(-1).to(q.dtype)  # share of the earlier keys
    return past * w + own * (1 - w)


def _attend_rows(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, tables: torch.Tensor,
                 spans: list[tuple[int, int]], gqa: bool) -> torch.Tensor:
    """Decode attention row by row: (B, Hq, Dh) queries, each over its own keys.

    ``spans[b]`` is (flat offset of row b's first key, its number of keys), with offset -1 when
    its blocks are not one consecutive run (they are gathered). A consecutive run is read through
    a view: with long contexts, a gather of every row's keys costs more than a call per row.
    """
    hkv, dh = pk.shape[2], pk.shape[3]
    fk, fv = pk.view(-1, hkv, dh), pv.view(-1, hkv, dh)  # (NB BS, Hkv, Dh)
    bs = pk.shape[1]
    out = []
    for b, (offset, n) in enumerate(spans):
        if offset >= 0:
            k, v = fk[offset : offset + n], fv[offset : offset + n]  # (n, Hkv, Dh), views
        else:
            idx = tables[b, : -(-n // bs)]
            k = pk.index_select(0, idx).view(-1, hkv, dh)[:n]
            v = pv.index_select(0, idx).view(-1, hkv, dh)[:n]
        out.append(F.scaled_dot_product_attention(q[b, :, None, None].transpose(0, 1), k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], enable_gqa=gqa))  # (1, Hq, 1, Dh)
    return torch.cat(out).view(len(spans), -1)  # (B, Hq Dh)


def _attend_batch(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, bias, flat, start: int, B: int, T: int,
                  spec: ModelSpec) -> torch.Tensor:
    """Attention of packed (N, Hq, Dh) queries over (B, Hkv, Tk, Dh) keys: one fused call; a
    single row with no mask (see :func:`_causal_chunk`). Returns (N, Hq Dh)."""
    hq, hkv, dh, g = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.group
    if B == 1:
        qh = q.view(1, T, hq, dh).transpose(1, 2)  # (1, Hq, T, Dh)
        attn = _causal_chunk(qh, keys, vals, start, g > 1)  # (1, Hq, T, Dh)
        return attn.transpose(1, 2).reshape(T, hq * dh)  # (T, Hq Dh)
    if flat is not None:
        q = q.new_zeros((B * T, hq, dh)).index_copy_(0, flat, q)  # (B T, Hq, Dh), padding zero
    # Query head h reads kv head h // g, as Hugging Face's repeat_kv lays them out.
    qg = q.view(B, T, hq, dh).permute(0, 2, 1, 3).reshape(B, hkv, g * T, dh)  # (B, Hkv, G T, Dh)
    attn = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=bias)  # (B, Hkv, G T, Dh)
    attn = attn.view(B, hq, T, dh).permute(0, 2, 1, 3).reshape(B * T, hq * dh)  # (B T, Hq Dh)
    return attn if flat is None else attn[flat]  # (N, Hq Dh)


def forward(
    w: ModelWeights,
    spec: ModelSpec,
    kv: KVBlocks,
    rope: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    tokens: torch.Tensor,
    starts: torch.Tensor,
    n_new: torch.Tensor | None = None,
    t_keys: int | None = None,
    rows: slice | None = None,
    spans: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Run new tokens of a batch of requests through the model; return next-token logits.

    Real tokens are packed into one (N, D) stream for the embedding, norms and matmuls, so right
    padding costs nothing there; attention reads each row's keys through its block table, one
    fused ``scaled_dot_product_attention`` per layer (a single row needs no mask tensor, so a long
    prompt's chunk costs no (T, Tk) mask).

    Parameters
    ----------
    w, spec, kv, rope
        Weights, shape, KV blocks and :func:`rope_tables` of the model.
    tables
        (B, nb) int64 block table of each row, covering ``t_keys`` positions (a shorter row's
        table padded with any of its own blocks).
    tokens
        (B, T) int64 new tokens, right-padded where a row has fewer than T.
    starts
        (B,) int64 position of each row's first new token (= tokens already cached).
    n_new
        (B,) int64 number of real tokens per row; ``None`` means all T.
    t_keys
        ``max(starts + n_new)`` when the caller knows it (saves a device sync).
    rows
        When every row's table is one block and the blocks are consecutive, their slice (keys
        are then read through a view, with no gather).
    spans
        Decode only (T = 1): attend row by row, reading consecutive blocks through views (see
        :func:`_attend_rows`).

    Returns
    -------
    torch.Tensor
        (B, V) float32 logits after each row's last real token. The new tokens' keys and values
        are written into their blocks.
    """
    B, T = tokens.shape
    dev = tokens.device
    hq, hkv, dh, g = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.group
    bs = kv.block_size
    t_idx = torch.arange(T, device=dev)
    qpos = starts[:, None] + t_idx[None, :]  # (B, T)
    if t_keys is None:
        t_keys = int(starts.max().item()) + T if n_new is None else int((starts + n_new).max().item())

    # Packed stream: flat[i] is the (row * T + column) of real token i, rows in order.
    packed = n_new is not None and T > 1 and B > 1
    row_ids = torch.arange(B, device=dev)[:, None].expand(B, T).reshape(-1)  # (B T,)
    if packed:
        flat = (t_idx[None, :] < n_new[:, None]).view(-1).nonzero().squeeze(1)  # (N,)
        tok_pos = qpos.reshape(-1)[flat]  # (N,)
        tok_row = row_ids[flat]
        h = w.embed[tokens.reshape(-1)[flat]]  # (N, D)
    else:
        flat = None
        tok_pos = qpos.reshape(-1)  # (B T,)
        tok_row = row_ids
        h = w.embed[tokens.reshape(-1)]  # (B T, D)
    n_tok = h.shape[0]
    # Where each new token's key and value go: its block's offset in the flattened pool.
    dest = tables[tok_row, tok_pos // bs] * bs + tok_pos % bs  # (N,)

    cos_t, sin_t = rope
    cos = cos_t[tok_pos].unsqueeze(1)  # (N, 1, Dh)
    sin = sin_t[tok_pos].unsqueeze(1)
    single = B == 1
    start = t_keys - T if single else 0
    if single or spans is not None:
        bias = None  # a single row's keys are exactly positions 0 .. start + T - 1: see _causal_chunk
    else:
        # Additive mask, shared by all layers: key j is visible to the query at position p iff
        # j <= p (causal and length mask in one). Query rows are laid out (G, T) per kv head.
        key_pos = torch.arange(t_keys, device=dev)
        bias = torch.zeros((B, 1, T, t_keys), device=dev, dtype=w.embed.dtype)
        bias.masked_fill_((key_pos[None, None, :] > qpos[:, :, None]).view(B, 1, T, t_keys), float("-inf"))  # (B, 1, T, Tk)
        if g > 1:
            bias = bias.unsqueeze(2).expand(B, 1, g, T, t_keys).reshape(B, 1, g * T, t_keys)  # (B, 1, G T, Tk)

    for li, lw in enumerate(w.layers):
        x = rms_norm(h, lw.attn_norm, spec.rms_norm_eps)
        qkv = F.linear(x, lw.qkv, lw.qkv_bias)  # (N, (Hq + 2 Hkv) Dh)
        qk, v = qkv.split([(hq + hkv) * dh, hkv * dh], dim=-1)
        # Queries and keys rotate by the same angles: one rotation for both.
        qk = apply_rope(qk.view(n_tok, hq + hkv, dh), cos, sin)  # (N, Hq + Hkv, Dh)
        q, k = qk[:, :hq], qk[:, hq:]  # (N, Hq, Dh), (N, Hkv, Dh)
        pk, pv = kv.k[li], kv.v[li]  # (NB, BS, Hkv, Dh)
        pk.view(-1, hkv, dh).index_copy_(0, dest, k)
        pv.view(-1, hkv, dh).index_copy_(0, dest, v.view(n_tok, hkv, dh))
        if spans is not None:
            attn = _attend_rows(q, pk, pv, tables, spans, g > 1)  # (B, Hq Dh)
        else:
            attn = _attend_batch(q, _read_keys(pk, tables, t_keys, rows).transpose(1, 2),
                                 _read_keys(pv, tables, t_keys, rows).transpose(1, 2), bias, flat,
                                 start, B, T, spec)  # (N, Hq Dh)
        h = h + F.linear(attn, lw.o, lw.o_bias)
        x = rms_norm(h, lw.mlp_norm, spec.rms_norm_eps)
        gate, up = F.linear(x, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)  # (N, I) each
        h = h + F.linear(F.silu(gate) * up, lw.down, lw.down_bias)

    if packed:
        last = h[torch.cumsum(n_new, 0) - 1]  # (B, D): each row's last real token
    elif T == 1:
        last = h  # (B, D)
    elif single:
        n = T if n_new is None else int(n_new[0])
        last = h[n - 1 : n]  # (1, D)
    else:
        last = h.view(B, T, -1)[:, T - 1]  # (B, D)
    return F.linear(rms_norm(last, w.norm, spec.rms_norm_eps), w.lm_head).float()  # (B, V)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    uniform: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row by inverse CDF (over the row's nucleus when ``top_p < 1``).

    Each row's token is a function of its logits row and its own uniform draw only, so a request
    samples the same token whatever batch it shares.

    Parameters
    ----------
    logits
        (B, V) float32.
    temperature
        (B,) float32; 0 means greedy.
    top_p
        (B,) float64 nucleus mass in (0, 1].
    uniform
        (B,) float64 draws in [0, 1) from each request's generator (ignored for greedy rows).

    Returns
    -------
    tokens : torch.Tensor
        (B,) int64.
    logprobs : torch.Tensor
        (B,) float32 behaviour log-probs: log-softmax of ``logits / temperature`` (temperature 1 for
        greedy rows) at the token, before nucleus truncation.
    """
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / t[:, None], dim=-1)  # (B, V)
    # float64 for the cumulative sums: fewer draws land on a flipped boundary.
    probs = logp.double().exp()  # (B, V)
    # Rows without a nucleus invert the CDF in vocabulary order and skip the sort; which path a
    # row takes depends on its own top_p only, so batching never changes a row's token.
    cum = probs.cumsum(-1)  # (B, V)
    pick = torch.searchsorted(cum, (uniform * cum[:, -1])[:, None], right=True).squeeze(1)
    sampled = pick.clamp_(max=probs.shape[-1] - 1)  # (B,)
    nucleus = torch.nonzero(top_p < 1.0).squeeze(1)  # (R,)
    if len(nucleus):
        sampled[nucleus] = _sample_nucleus(probs[nucleus], top_p[nucleus], uniform[nucleus])
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _sample_nucleus(probs: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw over the smallest most-likely head of each (R, V) row with mass >= top_p."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # (R, V)
    cum = sorted_p.cumsum(-1)
    keep = (cum - sorted_p) < top_p[:, None]  # the first token is always kept
    kept_cum = (sorted_p * keep).cumsum(-1)  # (R, V)
    target = uniform * kept_cum[:, -1]  # (R,)
    pick = torch.searchsorted(kept_cum, target[:, None], right=True).squeeze(1)  # (R,)
    pick = torch.minimum(pick, keep.sum(-1) - 1)
    return order.gather(1, pick[:, None]).squeeze(1)
