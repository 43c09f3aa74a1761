"""A ragged pass (row refill: one row prefills its prompt beside rows that decode a token or k + 1) computes the
valid tokens only: attention projections, routing, the shared expert and the experts on the packed tokens, the
scores in two row groups. Each row's outputs equal that row run alone, unpadded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specoffload.runtime.models import layers
from specoffload.runtime.models.model import Transformer


def _alone(model: Transformer, history: list[int], new: list[int]) -> torch.Tensor:
    """Logits [len(new), V] of row `new` after `history`, run as a batch of one without padding."""
    cache = model.new_cache(1, 64)
    if history:
        model.forward(torch.tensor([history]), cache, compute_logits=False)
    return model.forward(torch.tensor([new]), cache)[0]  # [T, V]


@pytest.mark.parametrize("name", ["llama", "qwen2_moe", "mixtral", "qwen2_moe_windowed"])
def test_ragged_pass_equals_each_row_alone(tiny_models: dict[str, Path], name: str) -> None:
    model = Transformer(tiny_models[name])
    # row 0 prefills a 9-token prompt, rows 1-3 decode 1 or 3 tokens after a history of different lengths
    histories = [[], [1, 7, 9, 11, 13], [1, 4], [1, 8, 8, 8, 8, 8, 8, 8]]
    feeds = [[1, 20, 21, 22, 23, 24, 25, 26, 27], [40], [41, 42, 43], [44]]
    cache = model.new_cache(len(feeds), 64)
    width = max(map(len, histories))
    prime = torch.zeros(len(histories), width, dtype=torch.long)  # [B, width]
    for n, h in enumerate(histories):
        prime[n, : len(h)] = torch.tensor(h, dtype=torch.long) if h else prime[n, :0]
    model.forward(prime, cache, num_new=torch.tensor([len(h) for h in histories]), compute_logits=False)
    steps = max(map(len, feeds))
    ids = torch.zeros(len(feeds), steps, dtype=torch.long)  # [B, T]
    for n, f in enumerate(feeds):
        ids[n, : len(f)] = torch.tensor(f)
    num_new = torch.tensor([len(f) for f in feeds])
    logits = model.forward(ids, cache, num_new=num_new)  # [B, T, V]
    for n, (h, f) in enumerate(zip(histories, feeds)):
        torch.testing.assert_close(logits[n, : len(f)], _alone(model, h, f), rtol=1e-4, atol=1e-4)


def test_ragged_attention_projects_valid_tokens_only(tiny_models: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = Transformer(tiny_models["qwen2_moe"])
    rows: list[int] = []
    real = layers.linear
    monkeypatch.setattr(layers, "linear", lambda x, w, b=None: (rows.append(x.reshape(-1, x.shape[-1]).shape[0]),
                                                                real(x, w, b))[1])
    hidden = torch.randn(4, 8, model.config.hidden_size)  # [B, T, H]
    mask = torch.arange(8)[None, :] < torch.tensor([8, 1, 1, 2])[:, None]  # [B, T]: 12 valid of 32
    model.attention(0, hidden, model.new_cache(4, 16), mask)
    model.ffn(0, hidden, mask)
    # q, k, v, o, the router gate, the shared expert and its gate see the 12 valid tokens; each expert fewer
    assert rows.count(12) >= 7 and max(rows) == 12


def test_ragged_attention_norms_and_rotates_valid_tokens_only(tiny_models: dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunked prefill in a wide batch (one row feeds its chunk, the others nothing): the input norm and RoPE
    cost the valid tokens, not rows x the chunk."""
    model = Transformer(tiny_models["qwen2_moe"])
    normed: list[int] = []
    rotated: list[int] = []
    real_norm, real_rope = layers.norm, layers.apply_rope
    monkeypatch.setattr(layers, "norm", lambda cfg, x, w: (normed.append(x.numel() // x.shape[-1]),
                                                           real_norm(cfg, x, w))[1])
    monkeypatch.setattr(layers, "apply_rope", lambda x, cos, sin: (rotated.append(x.shape[0] * x.shape[2]),
                                                                   real_rope(x, cos, sin))[1])
    hidden = torch.randn(8, 6, model.config.hidden_size)  # [B, T, H]
    mask = torch.arange(6)[None, :] < torch.tensor([6, 0, 0, 0, 0, 0, 0, 0])[:, None]  # [B, T]: 6 valid of 48
    out = model.attention(0, hidden, model.new_cache(8, 16), mask)  # [B, T, H]
    assert normed == [6] and rotated == [6, 6]  # q and k of the 6 valid tokens
    assert torch.equal(out[~mask], hidden[~mask])  # padded positions keep their input
    alone = model.attention(0, hidden[:1], model.new_cache(1, 16))  # the prefilling row by itself
    torch.testing.assert_close(out[0], alone[0], rtol=1e-5, atol=1e-5)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=24))
def test_split_rows_covers_every_row_once_at_its_length(lengths: list[int]) -> None:
    steps = max(lengths)
    groups = layers._split_rows(torch.tensor(lengths), steps)
    if groups is None:  # not worth it: one padded call computes at most 4/3 of the best split
        return
    rows = sorted(i for g, _ in groups for i in g.tolist())
    assert rows == list(range(len(lengths)))
    for g, width in groups:
        assert all(lengths[i] <= width <= steps for i in g.tolist())
    assert sum(len(g) * w for g, w in groups) <= 0.75 * len(lengths) * steps
