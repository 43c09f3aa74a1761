"""The planner's model of model-free drafting (issue 22, item 3): ragged drafts from replayed rounds
(planner/acceptance.py `RaggedAcceptance`) and their price (planner/cost.py: no draft FLOPs, E[fed](k) row-tokens per
pass, not k + 1). Synthetic 4-layer model of tests/test_planner.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specoffload.planner import Workload, estimate_workload
from specoffload.planner.acceptance import RaggedAcceptance, expected_tokens, mean_rounds
from specoffload.planner.cost import ModelCosts, estimate_step, steady_pass
from specoffload.planner.shapes import ModelShape
from tests.test_planner import TARGET, make_profile, manual_placement

FREE = ModelCosts.from_shapes(TARGET, ModelShape("ngram", (), 0, 0), dtype_bytes=2)  # a model-free drafter
PLACEMENT = manual_placement((0, 1, 2, 3))
K = 8


@st.composite
def rounds(draw: st.DrawFn) -> list[tuple[int, int]]:
    out = []
    for _ in range(draw(st.integers(1, 30))):
        proposed = draw(st.integers(0, K))
        out.append((proposed, draw(st.integers(0, proposed))))
    return out


@given(rounds(), st.integers(0, K), st.integers(1, 64))
def test_ragged_moments_are_the_replayed_means(replayed: list[tuple[int, int]], k: int, rows: int) -> None:
    ragged = RaggedAcceptance.from_rounds(replayed, K)
    n = len(replayed)
    assert ragged.tokens(k) == pytest.approx(1 + sum(min(a, k) for _, a in replayed) / n)
    assert ragged.fed(k) == pytest.approx(1 + sum(min(p, k) for p, _ in replayed) / n)
    mean = sum(min(a, k) for _, a in replayed) / n
    assert ragged.variance(k) == pytest.approx(sum((min(a, k) - mean) ** 2 for _, a in replayed) / n, abs=1e-9)
    assert ragged.match_rate == pytest.approx(sum(p > 0 for p, _ in replayed) / n)
    assert 1.0 <= ragged.tokens(k) <= ragged.fed(k) <= k + 1
    assert ragged.fed(k) - 1e-9 <= ragged.padded(k, rows) <= k + 1
    assert ragged.padded(k, 1) == pytest.approx(ragged.fed(k))
    tried = sum(min(a + 1, p) for p, a in replayed)
    assert ragged.alpha == pytest.approx(sum(a for _, a in replayed) / tried if tried else 0.0)


@given(st.floats(0.0, 1.0), st.integers(1, K))
def test_full_proposals_at_geometric_acceptance_are_leviathans(alpha: float, k: int) -> None:
    ragged = RaggedAcceptance((1.0,) * K, tuple(alpha**i for i in range(1, K + 1)), alpha)
    assert ragged.tokens(k) == pytest.approx(expected_tokens(alpha, k))
    assert ragged.fed(k) == k + 1


def test_invalid_curves_are_refused() -> None:
    with pytest.raises(ValueError):
        RaggedAcceptance((0.5, 0.6), (0.1, 0.1), 0.2)  # proposed must not increase
    with pytest.raises(ValueError):
        RaggedAcceptance((0.5,), (0.6,), 0.2)  # accepted above proposed
    with pytest.raises(ValueError):
        RaggedAcceptance.from_rounds([(2, 3)], 4)


def profile() -> object:
    return make_profile(stream_bytes_per_s=8000.0, attention_fit=(0.0, 0.01, 0.0))


def test_a_row_without_a_match_costs_its_next_token_only() -> None:
    # half the rows propose 4 tokens (2 accepted), half nothing: E[fed](8) = 3, E[tokens](8) = 2
    ragged = RaggedAcceptance.from_rounds([(4, 2), (0, 0)], K, proposal_s=1e-5)
    assert ragged.fed(K) == 3 and ragged.tokens(K) == 2
    step = estimate_step(profile(), FREE, PLACEMENT, 2, K, ragged, 100)
    # ffn on rows x E[fed] = 6 tokens (0.1 s per token per layer x 4), not rows x 9; the draft is 2 proposals
    assert step.t_ffn == pytest.approx(0.1 * 6 * 4)
    assert step.t_draft == pytest.approx(2e-5)
    assert step.tokens_per_step == pytest.approx(4)
    fixed = estimate_step(profile(), FREE, PLACEMENT, 2, K, 0.5, 100)  # a scalar: every row verifies k + 1
    assert fixed.t_ffn == pytest.approx(0.1 * 18 * 4) and fixed.t_draft == 0.0


def test_no_match_at_all_prices_as_no_draft() -> None:
    never = RaggedAcceptance.from_rounds([(0, 0)], K)
    drafted = estimate_step(profile(), FREE, PLACEMENT, 4, K, never, 100)
    plain = estimate_step(profile(), FREE, PLACEMENT, 4, 0, 0.0, 100)
    assert drafted.t_step == pytest.approx(plain.t_step) and drafted.tokens_per_s == pytest.approx(plain.tokens_per_s)


@given(rounds(), st.integers(1, K))
def test_ragged_steady_pass_never_feeds_more_than_k_plus_one(replayed: list[tuple[int, int]], k: int) -> None:
    ragged = RaggedAcceptance.from_rounds(replayed, K)
    workload = Workload(num_prompts=64, prompt_len=20, new_tokens=16)
    steady = steady_pass(profile(), FREE, PLACEMENT, 4, k, ragged, workload)
    fixed = steady_pass(profile(), FREE, PLACEMENT, 4, k, ragged.alpha, workload)
    assert steady.decode.t_ffn <= fixed.decode.t_ffn + 1e-9
    assert steady.rounds == pytest.approx(mean_rounds(ragged, k, 15))
    assert steady.decode.t_draft == 0.0  # unmeasured proposals cost nothing
    whole = estimate_workload(profile(), FREE, PLACEMENT, 4, k, ragged, workload, refill=True)
    assert whole.steady is not None and whole.tokens_per_s > 0


def _search(ragged: RaggedAcceptance, stream_bytes_per_s: float) -> object:
    from specoffload.planner import SearchSpace, search
    from tests.test_planner import WORKLOAD, GiB

    slow = make_profile(stream_bytes_per_s=stream_bytes_per_s)
    # 3000 bytes of device memory: the target's MLPs stream (a GiB would keep them resident: no io to hide under)
    return search(slow, SearchSpace(TARGET, ModelShape("ngram", (), 0, 0), WORKLOAD, ragged, 3000, GiB,
                                    batches=(1, 2, 4), ks=range(0, 9), unified_memory=False, weights_tier="disk",
                                    interleaves=(False,), refill=True))


@given(st.floats(0.3, 1.0))
def test_search_drafts_with_a_matching_drafter_when_the_pass_has_compute_to_spare(rate: float) -> None:
    # every row proposes 8 tokens, each accepted at `rate`: on a slow disk the pass is io-bound and verifying more
    # tokens is free, so the search drafts; the row-tokens it verifies cost only compute it had to spare
    ragged = RaggedAcceptance((1.0,) * K, tuple(rate**i for i in range(1, K + 1)), rate)
    assert _search(ragged, 8.0).best.k >= 1


def test_search_does_not_draft_with_a_drafter_that_never_matches() -> None:
    never = RaggedAcceptance.from_rounds([(0, 0)], K, proposal_s=1e-5)
    assert _search(never, 8.0).best.k == 0  # ties go to k = 0, and the proposals' microseconds break none
