"""Functional compute of one decoder layer's parts. Weights come in as arguments; nothing here owns state.

Numerics follow transformers' modeling code (Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen2-MoE/Qwen3-MoE/OLMoE/gpt-oss,
v5) step by step, so fp32 results agree to rounding: RMSNorm in float32 then cast back before the weight multiply
(gpt-oss: after it; also the q/k norms: Qwen3 per head, OLMoE over the whole projection, before RoPE); RoPE cos/sin
in float32 times the rope type's attention scaling; router softmax in float32 (gpt-oss: the top-k logits, then
their softmax in the compute dtype); Mixtral keeps the top-k weights in float32, the others cast them back to the
compute dtype; gpt-oss's attention with its sink logits as transformers' eager attention computes it.

Shapes: B = batch rows, T = new tokens per row in this call, N = B * T, S = key positions attended to,
H = hidden size, D = head dim, E = experts, k = experts per token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from ..kv_cache import KVCache
from .config import ModelConfig
from .linear import linear
from .weights import AttentionWeights, DenseMLPWeights, EmbeddingWeights, ExpertWeights, HeadWeights, RouterWeights

Tensor = torch.Tensor


# --- norms, activations, embedding, head ------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor, eps: float, scale_in_float32: bool = False) -> Tensor:
    """RMSNorm as transformers computes it: normalise in float32, cast back, then scale (scale_in_float32, gpt-oss:
    scale in float32, then cast back)."""
    dtype = x.dtype
    h = x.to(torch.float32)  # [..., H]
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_float32:
        return (weight * h).to(dtype)
    return weight * h.to(dtype)


def norm(cfg: ModelConfig, x: Tensor, weight: Tensor) -> Tensor:
    """The model's RMSNorm of x [..., H'] with `weight` [H']."""
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_scale_in_float32)


@lru_cache(maxsize=8)
def activation(name: str) -> Callable[[Tensor], Tensor]:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def gated_mlp(x: Tensor, w: ExpertWeights, act: str) -> Tensor:
    """down(act(gate x) * up x) (each with its bias, where it has one): x [..., H] -> [..., H]."""
    return linear(activation(act)(linear(x, w.gate, w.gate_bias)) * linear(x, w.up, w.up_bias), w.down, w.down_bias)


def expert_mlp(cfg: ModelConfig, x: Tensor, w: ExpertWeights) -> Tensor:
    """An expert (or dense MLP) of this model: `gated_mlp`, or gpt-oss's clamped SwiGLU (transformers' GptOssExperts):
    gate clamped above at `swiglu_limit`, up to +-limit, down((up + 1) * gate * sigmoid(alpha * gate)). x [..., H]."""
    if cfg.swiglu_limit is None:
        return gated_mlp(x, w, cfg.hidden_act)
    gate = linear(x, w.gate, w.gate_bias).clamp(max=cfg.swiglu_limit)  # [..., I]
    up = linear(x, w.up, w.up_bias).clamp(-cfg.swiglu_limit, cfg.swiglu_limit)  # [..., I]
    return linear((up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha)), w.down, w.down_bias)


def embed(w: EmbeddingWeights, input_ids: Tensor) -> Tensor:
    """input_ids [B, T] -> [B, T, H]."""
    return F.embedding(input_ids, w.embed)


def head_logits(cfg: ModelConfig, w: HeadWeights, hidden: Tensor) -> Tensor:
    """Final norm and LM head: hidden [B, T, H] -> logits [B, T, V] in float32."""
    return linear(norm(cfg, hidden, w.norm), w.lm_head).float()


# --- rotary position embedding -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rope:
    """RoPE tables of one model: inverse frequencies and the cos/sin scaling of its rope type."""

    inv_freq: Tensor  # [D // 2] float32
    attention_scaling: float

    @classmethod
    def from_config(cls, cfg: ModelConfig, device: str | torch.device = "cpu") -> Rope:
        inv_freq, scaling = cfg.rope_inv_freq()
        if inv_freq.shape != (cfg.head_dim // 2,):
            raise ValueError(f"rope gives {inv_freq.shape[0]} frequencies for head_dim {cfg.head_dim}")
        return cls(inv_freq.to(device), scaling)


def rope_cos_sin(rope: Rope, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [B, T] -> (cos, sin) [B, T, D] in `dtype`."""
    freqs = positions[..., None].float() * rope.inv_freq.float()  # [B, T, D // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    cos = emb.cos() * rope.attention_scaling
    sin = emb.sin() * rope.attention_scaling
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, D], cos/sin [B, T, D] -> rotated x [B, heads, T, D] (rotate-half convention)."""
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [B, heads, T, D]
    return x * cos + rotated * sin


# --- attention ---------------------------------------------------------------------------------------------


def attention_mask(positions: Tensor, num_keys: int, window: int | None) -> Tensor:
    """True where query position q may see key position k: k <= q and (q - k < window if windowed).

    positions [B, T] -> mask [B, 1, T, num_keys] bool.
    """
    keys = torch.arange(num_keys, device=positions.device)  # [S]
    queries = positions[:, :, None]  # [B, T, 1]
    mask = keys <= queries  # [B, T, S]
    if window is not None:
        mask &= queries - keys < window
    return mask[:, None]


def padding_mask(token_mask: Tensor | None, device: torch.device) -> Tensor | None:
    """token_mask [B, T] bool on `device` when it marks some position as padding; None when every token is valid
    (the blocks then run on the whole [B, T] as one GEMM)."""
    if token_mask is None or bool(token_mask.all()):
        return None
    return token_mask.to(device)


def attention_forward(
    cfg: ModelConfig, w: AttentionWeights, hidden: Tensor, cache: KVCache, layer: int, rope: Rope,
    token_mask: Tensor | None = None,
) -> Tensor:
    """Pre-norm self-attention block with residual: hidden [B, T, H] -> [B, T, H].

    Writes this call's keys/values at positions cache.lengths[b] + t and attends causally over positions
    0..lengths[b] + t. Does not advance the cache.

    token_mask [B, T] bool (right padding: row b's first n_b positions are valid): the projections run on the
    valid tokens only and the scores in two row groups (`_split_rows`), so a pass that prefills one prompt beside
    decode rows (row refill) costs its tokens, not rows x its length; padded positions keep their input and write
    junk K/V past the row's length that no valid query reads (and a later call overwrites).
    """
    batch, steps, _ = hidden.shape
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = norm(cfg, hidden, w.input_norm)  # [B, T, H]
    mask = padding_mask(token_mask, hidden.device) if steps > 1 else None  # [B, T] or None
    q = _project(x, w.q, w.q_bias, mask)  # [B, T, heads * D]
    k = _project(x, w.k, w.k_bias, mask)  # [B, T, kv * D]
    v = _project(x, w.v, w.v_bias, mask)  # [B, T, kv * D]
    if cfg.qk_norm == "all":  # OLMoE: over the whole projection
        q, k = norm(cfg, q, w.q_norm), norm(cfg, k, w.k_norm)
    if cfg.clip_qkv is not None:
        q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
    q = q.reshape(batch, steps, heads, dim)  # [B, T, heads, D]
    k = k.reshape(batch, steps, kv_heads, dim)  # [B, T, kv, D]
    if cfg.qk_norm == "head":  # Qwen3: each head over head_dim
        q, k = norm(cfg, q, w.q_norm), norm(cfg, k, w.k_norm)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, T, D], [B, kv, T, D]
    v = v.reshape(batch, steps, kv_heads, dim).transpose(1, 2)  # [B, kv, T, D]

    positions = cache.device_lengths()[:, None] + torch.arange(steps, device=hidden.device)  # [B, T]
    cos, sin = rope_cos_sin(rope, positions, x.dtype)  # [B, T, D]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    cache.write(layer, k, v)
    num_keys = int(cache.lengths.max()) + steps
    keys, values = cache.keys_values(layer, num_keys)  # [B, kv_heads, S, D]
    attn_mask = attention_mask(positions, num_keys, cfg.window_of(layer))  # [B, 1, T, S]
    groups = _split_rows(mask.sum(dim=1), steps) if mask is not None else None
    if groups is None:
        out = _attend(q, keys, values, attn_mask, dim**-0.5, w.sinks)  # [B, heads, T, D]
    else:  # the short rows' queries cut to their longest feed, and their keys to what those queries see
        out = q.new_zeros(q.shape)  # [B, heads, T, D]
        lengths = cache.device_lengths()
        for rows, width in groups:
            seen = int(lengths[rows].max()) + width
            out[rows, :, :width] = _attend(
                q[rows, :, :width], keys[rows, :, :seen], values[rows, :, :seen], attn_mask[rows, :, :width, :seen],
                dim**-0.5, w.sinks,
            )  # [rows, heads, width, D]
    out = out.transpose(1, 2).reshape(batch, steps, heads * dim)  # [B, T, heads * D]
    if mask is None:
        return hidden + linear(out, w.o, w.o_bias)
    result = hidden.clone()
    result[mask] = hidden[mask] + linear(out[mask], w.o, w.o_bias)  # [n valid, H]
    return result


def _attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, sinks: Tensor | None) -> Tensor:
    """softmax(q k^T scale, masked) v: q [B, heads, T, D], keys / values [B, kv_heads, S, D], mask [B, 1, T, S] bool
    -> [B, heads, T, D]. With sinks [heads] (gpt-oss) as transformers' eager attention computes it: each head's sink
    logit joins every query's softmax (after the max is subtracted) and its probability is dropped, taking no value."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=heads != kv_heads)
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [B, heads, S, D]
    values = values.repeat_interleave(heads // kv_heads, dim=1)  # [B, heads, S, D]
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [B, heads, T, S]
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)  # [B, heads, T, 1]
    logits = torch.cat([scores, sink], dim=-1)  # [B, heads, T, S + 1]
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # [B, heads, T, S]
    return torch.matmul(probs.to(values.dtype), values)


def _project(x: Tensor, weight: Tensor, bias: Tensor | None, mask: Tensor | None) -> Tensor:
    """linear(x) [B, T, out], computed on the valid tokens only when mask [B, T] is given (zeros elsewhere)."""
    if mask is None:
        return linear(x, weight, bias)
    y = linear(x[mask], weight, bias)  # [n valid, out]
    full = y.new_zeros((*x.shape[:2], y.shape[-1]))  # [B, T, out]
    full[mask] = y
    return full


def _split_rows(lengths: Tensor, steps: int) -> list[tuple[Tensor, int]] | None:
    """Two row groups for the scores of a ragged pass, lengths [B] the valid tokens per row: rows of at most w
    tokens computed at width w, the others at the full `steps`, w chosen to minimise the query rows computed
    (count(len <= w) w + count(len > w) steps). None when that saves less than a quarter (one padded call)."""
    values = lengths.tolist()
    best_w, best = steps, len(values) * steps
    for w in sorted(set(values)):
        cost = sum(w if n <= w else steps for n in values)
        if cost < best:
            best_w, best = w, cost
    if best_w >= steps or best > 0.75 * len(values) * steps:
        return None
    short = torch.tensor([i for i, n in enumerate(values) if n <= best_w], dtype=torch.long)
    long = torch.tensor([i for i, n in enumerate(values) if n > best_w], dtype=torch.long)
    return [(rows, width) for rows, width in ((short, best_w), (long, steps)) if len(rows)]


# --- feed-forward ------------------------------------------------------------------------------------------


def dense_mlp_forward(cfg: ModelConfig, w: DenseMLPWeights, hidden: Tensor) -> Tensor:
    """Pre-norm dense MLP block with residual: hidden [B, T, H] -> [B, T, H]."""
    return hidden + expert_mlp(cfg, norm(cfg, hidden, w.post_norm), w.mlp)


def route(cfg: ModelConfig, w: RouterWeights, hidden: Tensor,
          allowed: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Post-attention norm and top-k routing.

    hidden [B, T, H] -> (normed [N, H], topk_ids [N, k] long, topk_weights [N, k]). Softmax over all experts in
    float32, top-k, renormalise if cfg.norm_topk_prob (always for Mixtral). allowed [E] bool: route among these
    experts only (the others' logits are -inf before the softmax, so the architecture's own normalisation
    applies to the allowed set; with fewer than k allowed, the rest get weight 0 on an allowed expert's id).
    """
    normed = norm(cfg, hidden, w.post_norm).reshape(-1, hidden.shape[-1])  # [N, H]
    logits = linear(normed, w.gate, w.gate_bias)  # [N, E]
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    if cfg.router == "topk_softmax":  # gpt-oss: the top k logits, then a softmax over them (in the logits' dtype)
        top_logits, topk_ids = torch.topk(logits, cfg.num_experts_per_tok, dim=-1)  # [N, k]
        topk_weights = torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E]
        topk_weights, topk_ids = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)  # [N, k]
    if allowed is not None:  # fewer allowed experts than k: point the zero-weight picks at an allowed one
        topk_ids = torch.where(topk_weights > 0, topk_ids, topk_ids[:, :1])
    if cfg.norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if cfg.route_weights_in_compute_dtype:
        topk_weights = topk_weights.to(logits.dtype)
    return normed, topk_ids, topk_weights


def selected_experts(topk_ids: Tensor, token_mask: Tensor | None = None) -> list[int]:
    """Sorted expert ids chosen by any (valid) token. topk_ids [N, k]; token_mask [N] bool or None."""
    ids = topk_ids if token_mask is None else topk_ids[token_mask.reshape(-1)]
    return ids.unique().tolist()


def experts_forward(
    cfg: ModelConfig,
    normed: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    experts: Mapping[int, ExpertWeights],
    token_mask: Tensor | None = None,
    out: Tensor | None = None,
    only: range | None = None,
) -> Tensor:
    """Weighted sum of the selected experts' outputs: normed [N, H] -> [N, H].

    Touches only experts some valid token selected; raises KeyError if one of them is not in `experts`.
    Tokens with token_mask False get 0 (their routing is ignored, so they pull in no expert).
    out: accumulate into it (and return it); only: consider just these expert ids. Calling it for consecutive
    ranges of experts in order adds exactly what one call over all adds, in the same order.

    Grouped, for fine-grained MoEs (64-128 experts, top 8): the (token, slot) pairs are sorted by expert once, so
    each active expert's tokens are one contiguous slice of the gathered inputs, and the Python loop does only that
    expert's three GEMMs; the routing weights multiply all pairs in one op. The sum is deterministic on every device
    and adds each token's experts in ascending expert id (the order of one index_add per expert): with each pair's
    rank among its token's expert ids, the weighted outputs are added rank by rank, k index_adds of which none has
    two rows for one token (no [N, k, H] buffer: a long prefill's pass holds the gathered inputs and outputs only).
    """
    out = torch.zeros_like(normed) if out is None else out  # [N, H]
    num_tokens, k = topk_ids.shape
    pairs = torch.arange(num_tokens * k, device=topk_ids.device)  # [N * k]: token * k + slot
    chosen = topk_ids.reshape(-1)  # [N * k] the expert of each pair
    keep = None
    if token_mask is not None:
        keep = token_mask.to(topk_ids.device).reshape(-1, 1).expand(-1, k).reshape(-1)  # [N * k]
    if only is not None:
        inside = (chosen >= only.start) & (chosen < only.stop) if only.step == 1 else \
            torch.isin(chosen, torch.tensor(list(only), device=chosen.device))
        keep = inside if keep is None else keep & inside
    if keep is not None:
        pairs, chosen = pairs[keep], chosen[keep]  # [P]
    if pairs.numel() == 0:
        return out
    chosen, order = torch.sort(chosen, stable=True)  # [P]: expert-major, then token, then slot
    pairs = pairs[order]
    tokens, slots = pairs // k, pairs % k  # [P], [P]
    counts = torch.bincount(chosen, minlength=cfg.num_experts).tolist()  # the one host sync
    x = normed[tokens]  # [P, H]
    pieces, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        if e not in experts:
            raise KeyError(f"expert {e} was selected but not provided (have {sorted(experts)})")
        pieces.append(expert_mlp(cfg, x[start:start + n], experts[e]))  # [n_e, H]
        start += n
    y = torch.cat(pieces) if len(pieces) > 1 else pieces[0]  # [P, H]
    y = (y * topk_weights[tokens, slots, None]).to(out.dtype)  # float32 weights for Mixtral, as in transformers
    rank = torch.sort(topk_ids, dim=1, stable=True).indices.argsort(dim=1)  # [N, k]: slot -> rank by expert id
    ranks = rank[tokens, slots]  # [P]
    for j in range(k):  # each token at most once per rank: index_add without colliding targets, deterministic
        at = ranks == j  # [P]
        out.index_add_(0, tokens[at], y[at])
    return out


def shared_expert_forward(cfg: ModelConfig, w: RouterWeights, normed: Tensor) -> Tensor:
    """Qwen2-MoE shared expert with its sigmoid gate: normed [N, H] -> [N, H]."""
    if w.shared_expert is None or w.shared_expert_gate is None:
        raise ValueError("router weights carry no shared expert")
    gate = torch.sigmoid(linear(normed, w.shared_expert_gate))  # [N, 1]
    return gate * expert_mlp(cfg, normed, w.shared_expert)

