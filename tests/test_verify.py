"""Tests for speculative verification (runtime/verify.py) and the logit transforms (runtime/sampling.py).

Layout: literal hand-built cases, hypothesis property tests on random inputs, then statistical tests
that the emitted tokens follow the target distribution (with a deliberately broken sampler that the
same test must reject, to show it has power).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specoffload.runtime import verify
from specoffload.runtime.sampling import SamplingParams, greedy_tokens, sample, warp_logits
from specoffload.runtime.verify import VerifyResult, verify_greedy, verify_sampling

PASS_P = 1e-3  # a correct sampler must have a chi-square p-value above this (fixed seeds)
FAIL_P = 1e-6  # a broken sampler must have a p-value below this


def one_hot_logits(argmax_tokens: list[list[int]], vocab: int) -> torch.Tensor:
    """Logits [batch, positions, vocab] with the given argmax, 0 elsewhere and 5 at the argmax."""
    index = torch.tensor(argmax_tokens).unsqueeze(-1)
    return torch.zeros(index.shape[0], index.shape[1], vocab).scatter_(-1, index, 5.0)


def dist(*rows: list[float]) -> torch.Tensor:
    """Probability table [len(rows), vocab] from literal rows (normalised)."""
    table = torch.tensor(rows, dtype=torch.float32)
    return table / table.sum(-1, keepdim=True)


# ---------------------------------------------------------------- literal cases: greedy


def test_greedy_all_accepted_emits_bonus() -> None:
    result = verify_greedy(torch.tensor([[1, 2]]), one_hot_logits([[1, 2, 3]], vocab=4))
    assert result.num_accepted.tolist() == [2]
    assert result.tokens.tolist() == [[1, 2, 3]]


def test_greedy_first_rejected_emits_target_argmax() -> None:
    result = verify_greedy(torch.tensor([[0, 2]]), one_hot_logits([[1, 2, 3]], vocab=4))
    assert result.num_accepted.tolist() == [0]
    assert result.tokens.tolist() == [[1, -1, -1]]


def test_greedy_mixed_batch() -> None:
    draft = torch.tensor([[1, 2, 3], [1, 0, 3], [2, 2, 2], [1, 2, 0]])
    target = one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 0]], vocab=5)
    result = verify_greedy(draft, target)
    assert result.num_accepted.tolist() == [3, 1, 0, 2]
    assert result.tokens.tolist() == [[1, 2, 3, 4], [1, 2, -1, -1], [1, -1, -1, -1], [1, 2, 3, -1]]
    assert result.tokens.dtype == result.num_accepted.dtype == torch.long


def test_greedy_k0_is_plain_decoding() -> None:
    result = verify_greedy(torch.empty(2, 0, dtype=torch.long), one_hot_logits([[3], [1]], vocab=4))
    assert result.num_accepted.tolist() == [0, 0]
    assert result.tokens.tolist() == [[3], [1]]


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="does not match"):
        verify_greedy(torch.tensor([[1, 2]]), one_hot_logits([[1, 2]], vocab=4))
    with pytest.raises(ValueError, match="p shape"):
        verify_sampling(torch.tensor([[1]]), torch.ones(1, 2, 4) / 4, torch.ones(1, 2, 4) / 4)


# ---------------------------------------------------------------- literal cases: sampling


def test_sampling_p_equals_q_always_accepts() -> None:
    g = torch.Generator().manual_seed(0)
    batch, k, vocab = 500, 3, 5
    q = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g), dim=-1)
    p = q[:, :k].clone()
    draft = sample(p.reshape(-1, vocab), g).reshape(batch, k)
    result = verify_sampling(draft, p, q, g)
    assert (result.num_accepted == k).all()
    assert torch.equal(result.tokens[:, :k], draft)
    assert ((result.tokens[:, k] >= 0) & (result.tokens[:, k] < vocab)).all()


def test_sampling_zero_target_mass_always_rejects() -> None:
    g = torch.Generator().manual_seed(1)
    batch = 2000
    p = dist([0.0, 0.0, 1.0, 0.0]).expand(batch, 1, 4)  # the draft always proposes token 2
    q = dist([0.3, 0.3, 0.0, 0.4], [0.25, 0.25, 0.25, 0.25]).expand(batch, 2, 4)
    result = verify_sampling(torch.full((batch, 1), 2), p, q, g)
    assert (result.num_accepted == 0).all()
    assert (result.tokens[:, 0] != 2).all()
    assert set(result.tokens[:, 0].tolist()) == {0, 1, 3}  # the residual is q itself here
    assert (result.tokens[:, 1] == -1).all()


def test_sampling_residual_excludes_overproposed_tokens() -> None:
    # q - p = [0.4, -0.4, 0, 0]: after a rejection only token 0 may be emitted.
    g = torch.Generator().manual_seed(2)
    batch = 2000
    p = dist([0.1, 0.5, 0.2, 0.2]).expand(batch, 1, 4)
    q = dist([0.5, 0.1, 0.2, 0.2], [1, 1, 1, 1]).expand(batch, 2, 4)
    result = verify_sampling(torch.full((batch, 1), 1), p, q, g)
    rejected = result.num_accepted == 0
    assert 0 < rejected.sum() < batch  # accept probability q(1)/p(1) = 0.2
    assert (result.tokens[rejected, 0] == 0).all()


def test_sampling_k0_samples_from_q() -> None:
    g = torch.Generator().manual_seed(3)
    q = dist([0.0, 1.0, 0.0], [0.0, 0.0, 1.0]).unsqueeze(1)  # [2, 1, 3]
    result = verify_sampling(torch.empty(2, 0, dtype=torch.long), torch.empty(2, 0, 3), q, g)
    assert result.num_accepted.tolist() == [0, 0]
    assert result.tokens.tolist() == [[1], [2]]


def test_sampling_degenerate_inputs_do_not_produce_nan() -> None:
    g = torch.Generator().manual_seed(4)
    # Row 0: p(x) = 0 for the drafted token but q(x) > 0 -> accepted, bonus from q_2.
    # Row 1: p(x) = q(x) = 0 and p == q -> rejected, residual is all zero -> fall back to q.
    p = dist([0.5, 0.5, 0.0], [0.5, 0.5, 0.0]).unsqueeze(1)  # [2, 1, 3]
    q = torch.stack([dist([0.0, 0.0, 1.0], [0, 1, 0]), dist([0.5, 0.5, 0.0], [0, 0, 1])])  # [2, 2, 3]
    result = verify_sampling(torch.tensor([[2], [2]]), p, q, g)
    assert result.num_accepted.tolist() == [1, 0]
    assert result.tokens[0].tolist() == [2, 1]
    assert result.tokens[1, 0].item() in (0, 1) and result.tokens[1, 1].item() == -1


def test_residual_falls_back_to_q_when_p_equals_q() -> None:
    q = dist([0.2, 0.8], [0.5, 0.5])
    assert torch.equal(verify._residual(q, q), q)
    assert torch.allclose(verify._residual(dist([0.5, 0.5], [0.5, 0.5]), q)[0], torch.tensor([0.0, 1.0]))


# ---------------------------------------------------------------- property tests


@st.composite
def window(draw: st.DrawFn) -> dict:
    """Random batch/k/vocab, with ties, zeros (via top-k/top-p) and p == q rows among the cases."""
    batch = draw(st.integers(1, 6))
    k = draw(st.integers(0, 5))
    vocab = draw(st.integers(2, 12))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = draw(st.sampled_from([0.1, 1.0, 5.0]))
    target_logits = torch.randn(batch, k + 1, vocab, generator=g) * scale  # [batch, k + 1, vocab]
    draft_logits = torch.randn(batch, k, vocab, generator=g) * scale  # [batch, k, vocab]
    if draw(st.booleans()):  # many ties
        target_logits, draft_logits = target_logits.round(), draft_logits.round()
    if draw(st.booleans()):  # draft agrees with target on some positions
        same = torch.rand(batch, k, 1, generator=g) < 0.5
        draft_logits = torch.where(same, target_logits[:, :k], draft_logits)
    return {
        "g": g,
        "k": k,
        "vocab": vocab,
        "target_logits": target_logits,
        "draft_logits": draft_logits,
        "temperature": draw(st.sampled_from([0.5, 1.0, 2.0])),
        "top_k": draw(st.integers(0, vocab)),
        "top_p": draw(st.sampled_from([1.0, 0.9, 0.5, 1e-3])),
        "arbitrary_drafts": draw(st.booleans()),
    }


def check_structure(result: VerifyResult, draft: torch.Tensor, vocab: int) -> None:
    batch, k = draft.shape
    assert result.num_accepted.shape == (batch,) and result.tokens.shape == (batch, k + 1)
    assert result.num_accepted.dtype == result.tokens.dtype == torch.long
    for b in range(batch):
        n = int(result.num_accepted[b])
        assert 0 <= n <= k
        assert result.tokens[b, :n].tolist() == draft[b, :n].tolist()
        assert 0 <= int(result.tokens[b, n]) < vocab
        assert (result.tokens[b, n + 1 :] == -1).all()


@settings(max_examples=150, deadline=None)
@given(case=window(), corrupt=st.floats(0.0, 1.0))
def test_greedy_properties(case: dict, corrupt: float) -> None:
    target_logits, g = case["target_logits"], case["g"]
    batch, k = target_logits.shape[0], case["k"]
    target_argmax = greedy_tokens(target_logits)  # [batch, k + 1]
    noise = torch.randint(0, case["vocab"], (batch, k), generator=g)
    draft = torch.where(torch.rand(batch, k, generator=g) < corrupt, noise, target_argmax[:, :k])
    result = verify_greedy(draft, target_logits)
    check_structure(result, draft, case["vocab"])
    for b in range(batch):
        n = int(result.num_accepted[b])
        assert draft[b, :n].tolist() == target_argmax[b, :n].tolist()
        assert n == k or draft[b, n] != target_argmax[b, n]
        assert result.tokens[b, n] == target_argmax[b, n]


@settings(max_examples=150, deadline=None)
@given(case=window())
def test_sampling_properties(case: dict) -> None:
    g, k, vocab = case["g"], case["k"], case["vocab"]
    params = (case["temperature"], case["top_p"], case["top_k"])
    q = warp_logits(case["target_logits"], *params)  # [batch, k + 1, vocab]
    p = warp_logits(case["draft_logits"], *params)  # [batch, k, vocab]
    batch = q.shape[0]
    if case["arbitrary_drafts"]:  # may draft tokens with p(x) = 0
        draft = torch.randint(0, vocab, (batch, k), generator=g)
    else:
        draft = sample(p.reshape(-1, vocab), g).reshape(batch, k) if k else torch.empty(batch, 0).long()
    result = verify_sampling(draft, p, q, g)
    check_structure(result, draft, vocab)
    for b in range(batch):
        n = int(result.num_accepted[b])
        emitted = result.tokens[b, : n + 1]
        assert (q[b, torch.arange(n + 1), emitted] > 0).all()
        if n < k:
            y = int(emitted[n])
            residual_mass = (q[b, n] - p[b, n]).clamp_min(0).sum()
            if residual_mass > 0:
                assert q[b, n, y] > p[b, n, y]


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(1, 50),
    temperature=st.floats(0.05, 5.0),
    top_p=st.floats(1e-4, 1.0),
    top_k=st.integers(0, 60),
)
def test_warp_is_a_distribution(seed: int, vocab: int, temperature: float, top_p: float, top_k: int) -> None:
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * 4
    probs = warp_logits(logits, temperature, top_p, top_k)
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    assert (probs >= 0).all()
    assert (probs.argmax(-1) == logits.argmax(-1)).all()  # the argmax always survives
    if top_k:
        assert ((probs > 0).sum(-1) <= top_k).all()


# ---------------------------------------------------------------- warp_logits and SamplingParams


def test_warp_temperature_equals_scaled_softmax() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0]])
    for temperature in (0.3, 1.0, 2.5):
        expected = torch.softmax(logits / temperature, dim=-1)
        assert torch.allclose(warp_logits(logits, temperature), expected)


def test_warp_top_k_1_and_tiny_top_p_are_one_hot_argmax() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.0, 0.1, 3.0, 2.9]])
    one_hot = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    assert torch.equal(warp_logits(logits, 1.0, top_k=1), one_hot)
    assert torch.equal(warp_logits(logits, 1.0, top_p=1e-6), one_hot)
    assert torch.equal(warp_logits(logits, 0.0), one_hot)  # temperature 0 is the greedy limit


def test_warp_top_k_and_top_p_literal() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.allclose(warp_logits(logits, 1.0, top_k=2), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(warp_logits(logits, 1.0, top_p=0.7), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(warp_logits(logits, 1.0, top_p=0.85), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # top-k first, then top-p on the renormalised top-k distribution: 0.5 / 0.8 = 0.625 >= 0.6.
    assert torch.allclose(warp_logits(logits, 1.0, top_p=0.6, top_k=2), torch.tensor([1.0, 0, 0, 0]))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),  # (-1 is vLLM's "off", as 0)
    ],
)
def test_sampling_params_validation(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"{field}.*{value}"):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_and_normalisation() -> None:
    params = SamplingParams(temperature=0.0, stop_token_ids=[2, 7])  # type: ignore[arg-type]
    assert params.stop_token_ids == (2, 7) and hash(params)
    assert params.greedy and not SamplingParams(temperature=0.7).greedy
    with pytest.raises(AttributeError):
        params.top_k = 3  # type: ignore[misc]


# ---------------------------------------------------------------- statistical tests

N = 20_000  # rows per statistical test, drawn in one batched call
# Fixed tables that differ a lot: the draft over-proposes tokens the target rarely wants.
Q_TABLE = dist(
    [0.40, 0.25, 0.15, 0.10, 0.05, 0.05],
    [0.05, 0.10, 0.40, 0.25, 0.10, 0.10],
    [0.20, 0.20, 0.05, 0.05, 0.30, 0.20],
    [0.10, 0.30, 0.10, 0.30, 0.10, 0.10],
    [0.25, 0.05, 0.25, 0.05, 0.25, 0.15],
    [0.15, 0.15, 0.15, 0.15, 0.20, 0.20],
    [0.30, 0.10, 0.10, 0.10, 0.10, 0.30],
    [0.10, 0.10, 0.30, 0.30, 0.10, 0.10],
)  # [positions, vocab]
P_TABLE = dist(
    [0.05, 0.05, 0.10, 0.10, 0.30, 0.40],
    [0.40, 0.30, 0.05, 0.05, 0.10, 0.10],
    [0.05, 0.05, 0.40, 0.40, 0.05, 0.05],
    [0.30, 0.05, 0.30, 0.05, 0.25, 0.05],
    [0.05, 0.40, 0.05, 0.40, 0.05, 0.05],
    [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
    [0.10, 0.30, 0.30, 0.10, 0.10, 0.10],
    [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
)  # [positions, vocab]
VOCAB = Q_TABLE.shape[-1]


def chi_square_p(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value of integer samples [n] against probabilities [cells] (all cells > 0)."""
    observed = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.double()
    expected = expected / expected.sum() * samples.numel()
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def draft_from(p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Sample drafts x_i ~ p_i: [batch, k, vocab] -> [batch, k]."""
    batch, k, vocab = p.shape
    return sample(p.reshape(-1, vocab), g).reshape(batch, k)


@pytest.fixture(params=[False, True], ids=["correct", "wrong_residual"])
def wrong_residual(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """When True, the recovered token is resampled from q instead of norm(max(0, q - p)): biased."""
    if request.param:
        monkeypatch.setattr(verify, "_residual", lambda p, q: q)
    return request.param


def assert_fit(pvalue: float, wrong: bool) -> None:
    if wrong:
        assert pvalue < FAIL_P, f"broken sampler not detected (p-value {pvalue:.3g})"
    else:
        assert pvalue > PASS_P, f"emitted tokens do not follow q (p-value {pvalue:.3g})"


@pytest.mark.parametrize("k", [1, 3])
def test_first_token_follows_target(k: int, wrong_residual: bool) -> None:
    g = torch.Generator().manual_seed(100 + k)
    p = P_TABLE[:k].expand(N, k, VOCAB)  # a different p_i per position
    q = Q_TABLE[: k + 1].expand(N, k + 1, VOCAB)
    result = verify_sampling(draft_from(p, g), p, q, g)
    assert 0 < (result.num_accepted == 0).float().mean() < 1  # both branches are exercised
    assert_fit(chi_square_p(result.tokens[:, 0], Q_TABLE[0]), wrong_residual)


@pytest.mark.parametrize("k", [1, 3])
def test_first_two_tokens_follow_target_jointly(k: int, wrong_residual: bool) -> None:
    """Decode with repeated windows; q_t and p_t depend on the absolute position t only.

    Each row's window starts at its own absolute position, so the first two tokens come from
    accepted drafts, residual samples and bonus tokens of one or two calls. They must be distributed
    as Q_0(x) Q_1(y).
    """
    g = torch.Generator().manual_seed(200 + k)
    rows = torch.arange(N)
    emitted = torch.full((N, 2 * (k + 1)), -1)  # [N, 2 (k + 1)] tokens in decoding order
    count = torch.zeros(N, dtype=torch.long)  # [N] tokens emitted so far
    for _ in range(2):  # every call emits >= 1 token per row
        positions = count.unsqueeze(-1) + torch.arange(k + 1)  # [N, k + 1] absolute positions
        q = Q_TABLE[positions]  # [N, k + 1, vocab]
        p = P_TABLE[positions[:, :k]]  # [N, k, vocab]
        result = verify_sampling(draft_from(p, g), p, q, g)
        valid = result.tokens >= 0  # [N, k + 1]
        emitted[rows.unsqueeze(-1).expand_as(valid)[valid], positions[valid]] = result.tokens[valid]
        count += result.num_accepted + 1
    assert (count >= 2).all()
    joint = emitted[:, 0] * VOCAB + emitted[:, 1]  # [N] cell index of (x, y)
    expected = torch.outer(Q_TABLE[0], Q_TABLE[1]).flatten()  # [vocab * vocab]
    assert_fit(chi_square_p(joint, expected), wrong_residual)


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(0.7, 1.0, 3), (1.5, 0.8, 0), (1.0, 0.9, 5), (0.5, 0.95, 0)]
)
def test_emitted_tokens_follow_warped_target(temperature: float, top_p: float, top_k: int) -> None:
    g = torch.Generator().manual_seed(300)
    k, vocab = 2, 8
    target_logits = torch.randn(k + 1, vocab, generator=g) * 1.5  # [k + 1, vocab]
    draft_logits = torch.randn(k, vocab, generator=g) * 1.5  # [k, vocab]
    q = warp_logits(target_logits, temperature, top_p, top_k).expand(N, k + 1, vocab)
    p = warp_logits(draft_logits, temperature, top_p, top_k).expand(N, k, vocab)
    warped_q1 = q[0, 0]  # [vocab]
    assert not torch.allclose(warped_q1, torch.softmax(target_logits[0], -1))  # the warp matters
    result = verify_sampling(draft_from(p, g), p, q, g)
    first = result.tokens[:, 0]  # [N]
    support = (warped_q1 > 0).nonzero().squeeze(-1)  # [support]
    assert torch.isin(first, support).all()  # never a token that top-k / top-p removed
    remap = torch.full((vocab,), -1).index_put_((support,), torch.arange(support.numel()))
    assert chi_square_p(remap[first], warped_q1[support]) > PASS_P
