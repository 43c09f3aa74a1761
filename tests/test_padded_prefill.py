"""A prefill pads every row to the batch's longest prompt (issue 14: prose prompts of mean 122 and longest 329
tokens made one prefill pass 2.4-2.7x the modelled one): the dense FFN now runs on the valid tokens only, and the
cost model prices the padded attention from the workload's prompt lengths."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specoffload.planner import Workload
from specoffload.planner.cost import PROMPT_LEN_SAMPLE, estimate_prefill
from specoffload.runtime.models.model import Transformer


def test_dense_ffn_runs_on_valid_tokens_only(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from specoffload.runtime.models import layers

    model = Transformer(tiny_models["llama"])
    hidden = torch.randn(2, 5, model.config.hidden_size)  # [B, T, H]
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])  # [B, T]: row 1 padded after 2 tokens
    full = model.ffn(0, hidden)  # every position
    seen: list[int] = []
    real = layers.dense_mlp_forward
    monkeypatch.setattr(layers, "dense_mlp_forward", lambda cfg, w, h: (seen.append(h.shape[0] if h.dim() == 2
                                                                                    else h.shape[0] * h.shape[1]),
                                                                       real(cfg, w, h))[1])
    masked = model.ffn(0, hidden, mask)  # [B, T, H]
    assert seen == [7]  # the 7 valid tokens, not the 10 padded ones
    torch.testing.assert_close(masked[mask], full[mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(masked[~mask], hidden[~mask])  # padded positions keep their input
    assert torch.equal(model.ffn(0, hidden, torch.ones(2, 5, dtype=torch.bool)), full)


@given(st.lists(st.integers(1, 500), min_size=1, max_size=50), st.integers(1, 64))
def test_padded_len_properties(lengths: list[int], rows: int) -> None:
    w = Workload.of_prompts(lengths, new_tokens=8)
    assert w.padded_len(1) == pytest.approx(sum(lengths) / len(lengths))
    assert w.padded_len(rows) <= max(lengths) + 1e-9
    assert w.padded_len(rows + 1) >= w.padded_len(rows) - 1e-9
    assert Workload(num_prompts=3, prompt_len=7.5, new_tokens=2).padded_len(rows) == 7.5  # no lengths: the mean


def test_padded_len_literal_and_sample() -> None:
    w = Workload.of_prompts([10, 30], new_tokens=4)
    assert w.padded_len(2) == pytest.approx(10 * 0.25 + 30 * 0.75)  # max of two draws: 30 unless both are 10
    big = Workload.of_prompts(list(range(1, 10_001)), new_tokens=4)
    assert len(big.prompt_lens) == PROMPT_LEN_SAMPLE and big.num_prompts == 10_000
    assert big.prompt_len == pytest.approx(5000.5) and big.prompt_lens[-1] == 10_000


def test_prefill_prices_the_padded_attention() -> None:
    from tests.test_planner import COSTS, make_profile, manual_placement

    profile, placement = make_profile(), manual_placement((0, 1, 2, 3))
    mean = estimate_prefill(profile, COSTS, placement, batch=4, k=0, prompt_len=10)
    padded = estimate_prefill(profile, COSTS, placement, batch=4, k=0, prompt_len=10, padded_len=27)
    assert padded.t_ffn == pytest.approx(mean.t_ffn)  # the FFN sees the valid tokens only
    c0, c1, c2 = profile.attention_fit
    layers = COSTS.target.num_layers
    causal = math.ceil(28 / 2)  # a query attends to the keys before it: (T + 1) / 2 on average
    assert padded.t_attention == pytest.approx(layers * (c0 + c1 * 4 * 27 + c2 * 4 * 27 * causal))
    assert padded.t_attention >= mean.t_attention
