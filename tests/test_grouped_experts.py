"""The grouped MoE expert pass (layers.experts_forward) against the per-expert loop it replaced, bit for bit.

The reference (scripts/bench_fine_moe.py `per_expert_loop`, also the benchmark's baseline) is that loop as it
was: for each selected expert in ascending id, its tokens by a mask, its gated MLP, the routing weight, one
index_add. The grouped pass must give the same bits (same GEMMs on the same
rows, the same additions in the same order) for any routing: padded tokens, consecutive expert ranges (`only`, the
streamed expert groups), duplicate ids with weight 0 (route's fallback when fewer than k experts are allowed),
float32 weights with bfloat16 activations (Mixtral) and many experts with top 8 (the fine-grained families).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scripts.bench_fine_moe import _Cfg
from scripts.bench_fine_moe import per_expert_loop as _reference
from specoffload.runtime.models import layers
from specoffload.runtime.models.weights import ExpertWeights


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(1, 24),
    num_experts=st.sampled_from([4, 16, 64]),
    top_k=st.integers(1, 8),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    float32_weights=st.booleans(),
    masked=st.booleans(),
    groups=st.integers(1, 4),
    duplicates=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_pass_equals_the_per_expert_loop(num_tokens, num_experts, top_k, dtype, float32_weights, masked,
                                                 groups, duplicates, seed):
    top_k = min(top_k, num_experts)
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = 16, 8
    experts = {e: ExpertWeights(*(torch.randn(shape, generator=gen).to(dtype)
                                  for shape in ((inter, hidden), (inter, hidden), (hidden, inter))))
               for e in range(num_experts)}
    normed = torch.randn(num_tokens, hidden, generator=gen).to(dtype)  # [N, H]
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k)  # [N, k]
    if duplicates and top_k > 1:  # route's fallback: zero-weight picks point at the token's first expert
        weights[:, -1] = 0.0
        ids = torch.where(weights > 0, ids, ids[:, :1])
    weights = weights if float32_weights else weights.to(dtype)
    mask = torch.rand(num_tokens, generator=gen) < 0.7 if masked else None
    bounds = torch.linspace(0, num_experts, groups + 1).long().tolist()
    ranges = [range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)] if groups > 1 else [None]
    cfg = _Cfg(num_experts)
    ours, ref = torch.zeros_like(normed), torch.zeros_like(normed)
    for only in ranges:
        layers.experts_forward(cfg, normed, ids, weights, experts, mask, out=ours, only=only)
        _reference(cfg, normed, ids, weights, experts, mask, out=ref, only=only)
    assert torch.equal(ours, ref)
