"""Functional compute of one decoder layer's parts. Weights come in as arguments; nothing here owns state.

Numerics follow transformers' modeling code (Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen2-MoE/Qwen3-MoE/OLMoE/gpt-oss/
DeepSeek-V2/V3, v5) step by step, so fp32 results agree to rounding (DeepSeek's latent attention is computed in its
absorbed form, `mla_attention_forward`): RMSNorm in float32 then cast back before the weight multiply
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
from .linear import exact_mode, linear, rows_bmm
from .weights import (
    AttentionWeights,
    DenseMLPWeights,
    EmbeddingWeights,
    ExpertWeights,
    HeadWeights,
    LatentAttentionWeights,
    RouterWeights,
)

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

    token_mask [B, T] bool (right padding: row b's first n_b positions are valid): the norm, projections and RoPE
    run on the valid tokens only (one row of n tokens) and the scores in two row groups (`_split_rows`), so a pass
    that prefills one prompt beside decode rows (row refill), or a chunked prefill in a wide batch whose other rows
    feed nothing, costs its tokens, not rows x its length; padded positions keep their input and write zero K/V
    past the row's length that no valid query reads (and a later call overwrites).
    """
    batch, steps, _ = hidden.shape
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mask = padding_mask(token_mask, hidden.device) if steps > 1 else None  # [B, T] or None
    positions = cache.device_lengths()[:, None] + torch.arange(steps, device=hidden.device)  # [B, T]
    x = hidden if mask is None else hidden[mask][None]  # [B, T, H], or the valid tokens as one row [1, n, H]
    rows, cols = x.shape[:2]
    x = norm(cfg, x, w.input_norm)
    q = linear(x, w.q, w.q_bias)  # [rows, cols, heads * D]
    k = linear(x, w.k, w.k_bias)  # [rows, cols, kv * D]
    v = linear(x, w.v, w.v_bias)  # [rows, cols, kv * D]
    if cfg.qk_norm == "all":  # OLMoE: over the whole projection
        q, k = norm(cfg, q, w.q_norm), norm(cfg, k, w.k_norm)
    if cfg.clip_qkv is not None:
        q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
    q = q.reshape(rows, cols, heads, dim)  # [rows, cols, heads, D]
    k = k.reshape(rows, cols, kv_heads, dim)  # [rows, cols, kv, D]
    if cfg.qk_norm == "head":  # Qwen3: each head over head_dim
        q, k = norm(cfg, q, w.q_norm), norm(cfg, k, w.k_norm)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [rows, heads, cols, D], [rows, kv, cols, D]
    v = v.reshape(rows, cols, kv_heads, dim).transpose(1, 2)  # [rows, kv, cols, D]

    cos, sin = rope_cos_sin(rope, positions if mask is None else positions[mask][None], x.dtype)  # [rows, cols, D]
    rotate = _rope_pairs if cfg.rope_interleaved else apply_rope  # (pairs: a llama GGUF's q / k rows as stored)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if mask is not None:
        q, k, v = (_unpack(t, mask) for t in (q, k, v))  # [B, heads or kv, T, D]

    cache.write(layer, k, v)
    out = _attend_cached(q, cache, layer, positions, cfg.window_of(layer), mask,
                         lambda q, keys, values, m: _attend(q, keys, values, m, cfg.scale, w.sinks))  # [B, heads, T, D]
    return _output(hidden, out.transpose(1, 2).reshape(batch, steps, heads * dim), w.o, w.o_bias, mask)


def _unpack(t: Tensor, mask: Tensor) -> Tensor:
    """The valid tokens' t [1, heads, n, D] at their places in [B, heads, T, D] (mask [B, T], n valid; zeros
    elsewhere)."""
    full = t.new_zeros((*mask.shape, t.shape[1], t.shape[3]))  # [B, T, heads, D]
    full[mask] = t[0].transpose(0, 1)
    return full.transpose(1, 2)


def _attend_cached(q: Tensor, cache: KVCache, layer: int, positions: Tensor, window: int | None, mask: Tensor | None,
                   attend: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """attend(q, keys, values, mask) over the layer's cached positions, this call's included: q [B, heads, T, Dq],
    positions [B, T] -> [B, heads, T, Dv]. A ragged pass (mask [B, T] with padding) attends in two row groups
    (`_split_rows`): the short rows' queries cut to their longest feed, and their keys to what those queries see."""
    steps = q.shape[2]
    num_keys = int(cache.lengths.max()) + steps
    keys, values = cache.keys_values(layer, num_keys)  # [B, kv_heads, S, D]
    if exact_mode():
        return _attend_each(q, keys, values, positions, window, mask, attend)
    attn_mask = attention_mask(positions, num_keys, window)  # [B, 1, T, S]
    groups = _split_rows(mask.sum(dim=1), steps) if mask is not None else None
    if groups is None:
        return attend(q, keys, values, attn_mask)
    out = None
    lengths = cache.device_lengths()
    for rows, width in groups:
        seen = int(lengths[rows].max()) + width
        part = attend(q[rows, :, :width], keys[rows, :, :seen], values[rows, :, :seen],
                      attn_mask[rows, :, :width, :seen])  # [rows, heads, width, Dv]
        if out is None:
            out = part.new_zeros((*q.shape[:3], part.shape[-1]))  # [B, heads, T, Dv]
        out[rows, :, :width] = part
    return out


#: key columns per span in exact mode (`_attend_each`): a query attends over whole spans of this many positions
EXACT_KEYS = 64


def _attend_each(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, window: int | None, mask: Tensor | None,
                 attend: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """`_attend_cached` in exact mode (runtime/models/linear.py): q [B, heads, T, Dq], positions [B, T] ->
    [B, heads, T, Dv] (padded queries 0), each query's result depending on its own row's keys only.

    The core's kernel sums in an order that changes with the number of queries in a call and the number of key
    columns, masked or not (measured, bfloat16: one padded column changes a result), not with the batch. So each
    valid query at position p, seeing positions lo..p (lo > 0 in a window), is one batch entry of one query over
    the key columns start..stop (lo and p + 1 rounded out to EXACT_KEYS, zero-filled past the cache), masked to
    lo..p: spans and masks depend on (lo, p) only. The queries of a row that share a span go in one call."""
    out = None
    valid = mask.sum(dim=1).tolist() if mask is not None else [q.shape[2]] * q.shape[0]
    for b, (row, n) in enumerate(zip(positions.tolist(), valid, strict=True)):
        spans: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # span -> (step, lo, p) of its queries
        for t in range(n):
            p = row[t]
            lo = max(0, p - window + 1) if window is not None else 0
            spans.setdefault((lo // EXACT_KEYS * EXACT_KEYS, -(-(p + 1) // EXACT_KEYS) * EXACT_KEYS), []).append(
                (t, lo, p))
        for (start, stop), queries in spans.items():
            k, v = keys[b:b + 1, :, start:stop], values[b:b + 1, :, start:stop]  # [1, kv, <= stop - start, D]
            if k.shape[2] < stop - start:  # past the positions the cache holds: zero keys, masked below
                k, v = (F.pad(x, (0, 0, 0, stop - start - x.shape[2])) for x in (k, v))
            at, lows, seen = torch.tensor(queries, device=q.device).T  # [G] each: steps, first and last seen
            columns = torch.arange(start, stop, device=q.device)  # [S]
            sees = (columns >= lows[:, None]) & (columns <= seen[:, None])  # [G, S]
            g = len(queries)
            part = attend(q[b, :, at].transpose(0, 1)[:, :, None], k.expand(g, -1, -1, -1), v.expand(g, -1, -1, -1),
                          sees[:, None, None])  # [G, heads, 1, Dv]
            if out is None:
                out = part.new_zeros((*q.shape[:3], part.shape[-1]))  # [B, heads, T, Dv]
            out[b, :, at] = part[:, :, 0].transpose(0, 1)
    if out is None:
        raise ValueError("an attention call without a valid query")
    return out


def _output(hidden: Tensor, out: Tensor, o: Tensor, o_bias: Tensor | None, mask: Tensor | None) -> Tensor:
    """hidden + o(out) (+ o_bias), on the valid tokens only when mask [B, T] is given: out [B, T, heads * Dv]."""
    if mask is None:
        return hidden + linear(out, o, o_bias)
    result = hidden.clone()
    result[mask] = hidden[mask] + linear(out[mask], o, o_bias)  # [n valid, H]
    return result


def mla_attention_forward(
    cfg: ModelConfig, w: LatentAttentionWeights, hidden: Tensor, cache: KVCache, layer: int, rope: Rope,
    token_mask: Tensor | None = None,
) -> Tensor:
    """Multi-head latent attention (DeepSeek-V2 / V3) with residual: hidden [B, T, H] -> [B, T, H]; the contract of
    `attention_forward` (cache writes, token_mask).

    It caches per token the latent c_kv = RMSNorm(kv_a x)[:L] and the rotary key k_r = RoPE((kv_a x)[L:]), one row
    [c_kv | k_r] of L + r values for all heads (`ModelConfig.cache_geometry`: first half in K, second in V), and
    attends in the latent form (W_uk absorbed into the query, W_uv applied after the weighted sum), which equals
    transformers' expanded form, softmax((q_n k_n + q_r k_r) scale) v with k_n = W_uk c_kv and v = W_uv c_kv per
    head, up to the order of the sums:

        q_n W_uk c_kv = (W_uk^T q_n) . c_kv,    sum_s p_s W_uv c_kv,s = W_uv (sum_s p_s c_kv,s).

    So a decode step reads L + r values per cached token (not heads x (n + r + v)), and no key or value is expanded.
    The q / kv latents' norms use eps 1e-6 as transformers' do; RoPE pairs interleaved dims for DeepSeek (rotated as
    even / odd halves, as transformers' interleaved form does).
    """
    batch, steps, _ = hidden.shape
    heads, nope, rot, rank = cfg.num_heads, cfg.qk_nope_head_dim, cfg.head_dim, cfg.kv_lora_rank
    x = norm(cfg, hidden, w.input_norm)  # [B, T, H]
    mask = padding_mask(token_mask, hidden.device) if steps > 1 else None  # [B, T] or None
    if w.q is not None:
        q = _project(x, w.q, None, mask)  # [B, T, h * (n + r)]
    else:
        q = linear(rms_norm(_project(x, w.q_a, None, mask), w.q_a_norm, 1e-6), w.q_b)  # [B, T, h * (n + r)]
    q = q.reshape(batch, steps, heads, nope + rot).transpose(1, 2)  # [B, h, T, n + r]
    latent = _project(x, w.kv_a, None, mask)  # [B, T, L + r]
    c_kv = rms_norm(latent[..., :rank], w.kv_a_norm, 1e-6)  # [B, T, L]
    positions = cache.device_lengths()[:, None] + torch.arange(steps, device=hidden.device)  # [B, T]
    cos, sin = rope_cos_sin(rope, positions, x.dtype)  # [B, T, r]
    rotate = _rope_pairs if cfg.rope_interleaved else apply_rope
    q_rot = rotate(q[..., nope:], cos, sin)  # [B, h, T, r]
    k_rot = rotate(latent[:, None, :, rank:], cos, sin)[:, 0]  # [B, T, r]
    row = torch.cat([c_kv, k_rot], dim=-1)[:, None]  # [B, 1, T, L + r]
    half = row.shape[-1] // 2
    cache.write(layer, row[..., :half], row[..., half:])

    w_uk, w_uv = w.key_value_up(heads)  # [h, n, L], [h, v, L]
    q_nope = q[..., :nope].transpose(0, 1).reshape(heads, batch * steps, nope)  # [h, B * T, n]
    q_latent = rows_bmm(q_nope, w_uk).view(heads, batch, steps, rank).transpose(0, 1)  # [B, h, T, L]
    query = torch.cat([q_latent, q_rot], dim=-1)  # [B, h, T, L + r]: against the cached rows
    out = _attend_cached(query, cache, layer, positions, cfg.window_of(layer), mask,
                         lambda q, k, v, m: _attend_latent(q, k, v, m, cfg.scale, rank))  # [B, h, T, L]
    out = rows_bmm(out.transpose(0, 1).reshape(heads, batch * steps, rank), w_uv.transpose(1, 2))  # [h, B*T, v]
    out = out.view(heads, batch, steps, -1).permute(1, 2, 0, 3).reshape(batch, steps, -1)  # [B, T, h * v]
    return _output(hidden, out, w.o, None, mask)


def _rope_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on dims paired as (x0, x1), (x2, x3), ... (DeepSeek): x [B, heads, T, r], cos / sin [B, T, r] (halves
    repeated, `rope_cos_sin`) -> [B, heads, T, r], laid out as the rotated evens then the rotated odds (transformers'
    interleaved form; queries and keys alike, so their products are those of the pairs)."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :, :half], sin[:, None, :, :half]  # [B, 1, T, r / 2]
    even, odd = x[..., 0::2], x[..., 1::2]  # [B, heads, T, r / 2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def _attend_latent(query: Tensor, first: Tensor, second: Tensor, mask: Tensor, scale: float, rank: int) -> Tensor:
    """softmax(query . row scale, masked) c_kv over cached rows [c_kv | k_r] kept as two halves (first, second
    [B, 1, S, (L + r) / 2]): query [B, h, T, L + r], mask [B, 1, T, S] bool -> [B, h, T, L]. Heads and steps are
    folded into one batched matrix product per half, so the rows are read once for all heads."""
    batch, heads, steps, width = query.shape
    half = first.shape[-1]
    q = query.reshape(batch, heads * steps, width)  # [B, h * T, L + r]
    k1, k2 = first[:, 0], second[:, 0]  # [B, S, half]
    scores = torch.baddbmm(torch.bmm(q[..., :half], k1.transpose(1, 2)), q[..., half:], k2.transpose(1, 2))
    scores = scores.view(batch, heads, steps, -1) * scale  # [B, h, T, S]
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype).view(batch, heads * steps, -1)
    out = torch.cat([torch.bmm(probs, k1), torch.bmm(probs, k2[..., : rank - half])], dim=-1)  # [B, h * T, L]
    return out.view(batch, heads, steps, rank)


#: queries per row up to which CPU attention is two float32 matmuls around a softmax (`_attend_few`) rather than
#: torch's fused kernel, which for one query per row in bfloat16 takes 4-10x as long on the CPU (2-core EPYC, torch
#: 2.13, 12 / 2 heads of 128: 8 rows over 101 keys 0.98 ms against 0.25, over 1000 keys 10.5 against 1.5; 5
#: queries over 1000 keys 4.2 against 2.9; 16 queries about even, 64 slower): decode and verify passes
FEW_QUERIES = 8
#: float32 elements of `_attend_few`'s copies of keys and values and its scores per call: rows go in groups under it
FEW_ELEMENTS = 1 << 23


def _attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, sinks: Tensor | None) -> Tensor:
    """softmax(q k^T scale, masked) v: q [B, heads, T, D], keys / values [B, kv_heads, S, D], mask [B, 1, T, S] bool
    -> [B, heads, T, D]. With sinks [heads] (gpt-oss) as transformers' eager attention computes it: each head's sink
    logit joins every query's softmax (after the max is subtracted) and its probability is dropped, taking no value.
    On the CPU with at most FEW_QUERIES queries per row: `_attend_few`."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    if sinks is None:
        if q.shape[2] <= FEW_QUERIES and q.device.type == "cpu":
            return _attend_few(q, keys, values, mask, scale)
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


def _attend_few(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """`_attend` without sinks in float32: scores = (q k^T) scale for each query head against its KV head (head h
    reads KV head h // (heads / kv_heads), as enable_gqa does), -inf where mask is False, softmax over the keys, times
    v; q [B, heads, T, Dq], keys [B, kv_heads, S, Dq], values [B, kv_heads, S, Dv] -> [B, heads, T, Dv] in q's dtype.
    Masked scores are float32's lowest value, not -inf, so a query that sees no key (none does in a pass: it sees its
    own position) averages the values instead of giving NaN. Rows go in groups whose float32 copies and scores stay
    under FEW_ELEMENTS; a row's result is the same in any group (tests/test_models.py)."""
    batch, heads, steps, dq = q.shape
    kv_heads, seen, dv = keys.shape[1], keys.shape[2], values.shape[3]
    group = heads // kv_heads
    per_row = kv_heads * seen * (dq + dv) + heads * steps * seen
    rows = max(1, FEW_ELEMENTS // max(1, per_row))
    out = q.new_empty(batch, heads, steps, dv)
    for lo in range(0, batch, rows):
        hi = min(batch, lo + rows)
        qg = q[lo:hi].float().reshape(hi - lo, kv_heads, group * steps, dq)  # [b, kv, group T, Dq]
        scores = torch.matmul(qg, keys[lo:hi].float().transpose(2, 3)) * scale  # [b, kv, group T, S]
        scores = scores.view(hi - lo, kv_heads, group, steps, seen)
        scores = scores.masked_fill(~mask[lo:hi, :, None], torch.finfo(torch.float32).min)  # (mask [b, 1, 1, T, S])
        probs = torch.softmax(scores, dim=-1).view(hi - lo, kv_heads, group * steps, seen)
        out[lo:hi] = torch.matmul(probs, values[lo:hi].float()).view(hi - lo, heads, steps, dv)
    return out


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
    # [N, E]; DeepSeek: float32 hidden times a float32 gate
    logits = linear(normed.float(), w.gate.float()) if cfg.router_in_float32 else linear(normed, w.gate, w.gate_bias)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    k = cfg.num_experts_per_tok
    if cfg.router == "topk_softmax":  # gpt-oss: the top k logits, then a softmax over them (in the logits' dtype)
        top_logits, topk_ids = torch.topk(logits, k, dim=-1)  # [N, k]
        topk_weights = torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)
    elif cfg.router == "sigmoid_group_topk":  # DeepSeek-V3: chosen by score + bias, weighted by the score
        scores = logits.float().sigmoid()  # [N, E]
        choice = scores + w.choice_bias.float() if w.choice_bias is not None else scores
        if allowed is not None:
            choice = choice.masked_fill(~allowed.to(logits.device), float("-inf"))
        group_score = _grouped(choice, cfg.expert_groups[0]).topk(2, dim=-1).values.sum(dim=-1)  # [N, groups]
        choice = _keep_groups(choice, group_score, cfg.expert_groups[1], float("-inf"))
        topk_ids = torch.topk(choice, k, dim=-1).indices  # [N, k]
        topk_weights = scores.gather(1, topk_ids)  # [N, k]
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E]
        if cfg.router == "softmax_group_topk":  # DeepSeek-V2: the groups of the best maximum
            group_score = _grouped(probs, cfg.expert_groups[0]).max(dim=-1).values  # [N, groups]
            probs = _keep_groups(probs, group_score, cfg.expert_groups[1], 0.0)
        topk_weights, topk_ids = torch.topk(probs, k, dim=-1)  # [N, k]
    if allowed is not None:  # fewer allowed experts than k: point the zero-weight picks at an allowed one
        topk_ids = torch.where(topk_weights > 0, topk_ids, topk_ids[:, :1])
    if cfg.norm_topk_prob:
        extra = 1e-20 if cfg.router == "sigmoid_group_topk" else 0.0  # (as transformers adds it)
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + extra)
    if cfg.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * cfg.routed_scaling_factor
    if cfg.route_weights_in_compute_dtype:
        topk_weights = topk_weights.to(normed.dtype)
    return normed, topk_ids, topk_weights


def _grouped(scores: Tensor, groups: int) -> Tensor:
    """scores [N, E] -> [N, groups, E / groups] (experts in consecutive groups)."""
    return scores.view(scores.shape[0], groups, -1)


def _keep_groups(scores: Tensor, group_score: Tensor, keep: int, fill: float) -> Tensor:
    """scores [N, E] with every expert outside the `keep` best groups (by group_score [N, groups]) set to fill."""
    best = torch.topk(group_score, keep, dim=-1).indices  # [N, keep]
    kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)  # [N, groups]
    return _grouped(scores, kept.shape[1]).masked_fill(~kept[:, :, None], fill).view_as(scores)


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
    """The shared expert: normed [N, H] -> [N, H], times sigmoid(its gate) where it has one (Qwen2-MoE)."""
    if w.shared_expert is None:
        raise ValueError("router weights carry no shared expert")
    out = expert_mlp(cfg, normed, w.shared_expert)
    if w.shared_expert_gate is None:
        return out
    return torch.sigmoid(linear(normed, w.shared_expert_gate)) * out  # [N, 1] * [N, H]

