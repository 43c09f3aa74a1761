"""A wave lasts until its slowest row (issue 14): the variance of tokens per round, the rounds the slowest of B
rows needs (checked against a simulation of the engine's rounds), the persistent between-prompt spread, and the
workload estimate that counts them."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.planner import AcceptanceTracker, Workload, estimate_workload
from specoffload.planner.acceptance import (
    AcceptanceCurve,
    between_prompt_sd,
    mean_rounds,
    rounds_for_slowest,
    slowest_quantile,
)

rates = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8)


def exact_moments(curve: AcceptanceCurve, k: int) -> tuple[float, float]:
    """Mean and variance of 1 + A from the pmf: P(A = n) = S(n) - S(n + 1) (S(k + 1) = 0), S the survival."""
    survival = [1.0]
    for i in range(1, k + 1):
        survival.append(survival[-1] * curve.rate(i))
    survival.append(0.0)
    pmf = [survival[n] - survival[n + 1] for n in range(k + 1)]
    mean = sum((n + 1) * p for n, p in enumerate(pmf))
    return mean, sum((n + 1 - mean) ** 2 * p for n, p in enumerate(pmf))


@given(rates, st.floats(0.0, 1.0), st.integers(0, 10))
def test_variance_is_the_pmf_variance(rs: list[float], alpha: float, k: int) -> None:
    curve = AcceptanceCurve(tuple(rs), alpha)
    mean, variance = exact_moments(curve, k)
    assert curve.tokens(k) == pytest.approx(mean, abs=1e-9)
    assert curve.variance(k) == pytest.approx(variance, abs=1e-9)


@pytest.mark.parametrize(("alpha", "k"), [(0.5, 3), (0.9, 8), (0.7, 1)])
def test_mean_rounds_of_one_row_matches_a_simulation(alpha: float, k: int) -> None:
    simulated = simulate_slowest(alpha, 0.0, k, 63, 1, trials=3000, seed=2)
    assert mean_rounds(alpha, k, 63) == pytest.approx(simulated, rel=0.02)
    assert mean_rounds(alpha, 0, 63) == 63.0


def test_quantile_of_the_slowest_row() -> None:
    assert slowest_quantile(1) == 0.0
    assert slowest_quantile(8) == pytest.approx(1.4236, abs=0.02)  # E[max of 8 standard normals] = 1.4236
    assert slowest_quantile(2) == pytest.approx(1 / math.sqrt(math.pi), abs=0.03)
    with pytest.raises(ValueError):
        slowest_quantile(0)


@settings(max_examples=60)
@given(st.floats(0.05, 0.99), st.floats(0.0, 0.3), st.integers(0, 8), st.integers(0, 200), st.integers(1, 64))
def test_rounds_for_slowest_properties(alpha: float, spread: float, k: int, tokens: int, rows: int) -> None:
    curve = AcceptanceCurve((alpha,), alpha, spread)
    r = rounds_for_slowest(curve, k, tokens, rows)
    mean = mean_rounds(curve, k, tokens)
    assert min(tokens / curve.tokens(k), tokens) - 1e-9 <= mean <= r <= tokens + 1e-9
    if rows == 1 or k == 0:
        assert r == pytest.approx(mean)
    assert rounds_for_slowest(curve, k, tokens, rows + 1) >= r - 1e-9  # more rows: a slower slowest one
    wider = AcceptanceCurve((alpha,), alpha, min(0.5, spread + 0.1))
    assert rounds_for_slowest(wider, k, tokens, rows) >= r - 1e-9
    assert rounds_for_slowest(alpha, k, tokens, rows) <= r + 1e-9  # a scalar alpha: no spread


def simulate_slowest(alpha: float, spread: float, k: int, tokens: int, rows: int, trials: int, seed: int) -> float:
    """Mean over trials of the rounds the slowest of `rows` rows needs: each row draws its own rate
    N(alpha, spread) (clipped), then rounds commit 1 + A tokens, A truncated-geometric at its rate."""
    rng = random.Random(seed)
    worst = []
    for _ in range(trials):
        slowest = 0
        for _ in range(rows):
            a = min(0.999, max(0.0, rng.gauss(alpha, spread)))
            done = rounds = 0
            while done < tokens:
                n = 0
                while n < k and rng.random() < a:
                    n += 1
                done += n + 1
                rounds += 1
            slowest = max(slowest, rounds)
        worst.append(slowest)
    return statistics.fmean(worst)


@pytest.mark.parametrize(("alpha", "spread", "k", "rows"), [(0.9, 0.0, 2, 8), (0.9, 0.0, 8, 8), (0.9, 0.06, 8, 8),
                                                            (0.75, 0.08, 4, 16), (0.9, 0.06, 2, 4)])
def test_rounds_for_slowest_matches_a_simulation(alpha: float, spread: float, k: int, rows: int) -> None:
    tokens = 63
    simulated = simulate_slowest(alpha, spread, k, tokens, rows, trials=300, seed=1)
    model = rounds_for_slowest(AcceptanceCurve((alpha,), alpha, spread), k, tokens, rows)
    at_mean = tokens / AcceptanceCurve.geometric(alpha).tokens(k)
    assert model == pytest.approx(simulated, rel=0.05), (model, simulated)
    assert abs(model - simulated) < abs(at_mean - simulated)  # and much closer than the mean rate's count


def test_between_prompt_sd_keeps_what_persists_and_drops_noise() -> None:
    rng = random.Random(3)

    def prompts(sd: float, n: int = 400, rounds: int = 16, k: int = 4) -> list[list[tuple[int, int]]]:
        out = []
        for _ in range(n):
            a = min(0.99, max(0.01, rng.gauss(0.8, sd)))
            out.append([])
            for _ in range(rounds):
                accepted = 0
                while accepted < k and rng.random() < a:
                    accepted += 1
                out[-1].append((accepted + (accepted < k), accepted))
        return out

    assert between_prompt_sd(prompts(0.0)) < 0.03  # the binomial noise alone: (close to) no spread
    assert between_prompt_sd(prompts(0.08)) == pytest.approx(0.08, abs=0.02)
    assert between_prompt_sd([[(3, 2)], [(2, 1), (1, 1)]]) == 0.0  # fewer than two usable prompts
    # a literal: two prompts, halves (1.0, 1.0) and (0.5, 0.5): cov = 2 * 0.25^2 / 1 = 0.125
    assert between_prompt_sd([[(2, 2), (2, 2)], [(2, 1), (2, 1)]]) == pytest.approx(math.sqrt(0.125))


def test_tracker_curve_carries_the_spread() -> None:
    tracker = AcceptanceTracker()
    for _ in range(10):
        tracker.record(4, 4, prompt="easy")
        tracker.record(0, 4, prompt="hard")
    curve = tracker.curve()
    assert curve is not None and curve.spread > 0.3  # 1.0 vs 0.0 in both halves
    assert curve.at(0.6).spread == curve.spread
    plain = AcceptanceTracker()
    plain.record_many([4, 0], [4, 4])
    assert plain.curve().spread == 0.0  # no prompt keys: nothing to tell rows apart


def test_workload_counts_the_slowest_row() -> None:
    from tests.test_planner import COSTS, make_profile, manual_placement

    profile, placement = make_profile(), manual_placement((0, 1, 2, 3))
    workload = Workload(num_prompts=16, prompt_len=8, new_tokens=64)
    spread = AcceptanceCurve((0.9,), 0.9, 0.1)
    one = estimate_workload(profile, COSTS, placement, batch=1, k=4, alpha=spread, workload=workload)
    eight = estimate_workload(profile, COSTS, placement, batch=8, k=4, alpha=spread, workload=workload)
    assert one.decode_steps == 2 * round(mean_rounds(spread, 4, 63))
    assert eight.decode_steps == 2 * round(rounds_for_slowest(spread, 4, 63, 8))
    assert eight.decode_steps > 2 * math.ceil(63 / spread.tokens(4))


def test_online_replan_prices_the_slowest_row() -> None:
    from specoffload.planner import ModelCosts, replan
    from specoffload.planner.placement import PlacementPolicy, place
    from tests.test_acceptance_planning import DRAFT, PROFILE, TARGET, GiB

    policy = PlacementPolicy(batch_size=2, num_batches=2, kv_capacity=48, weights_tier="disk", unified_memory=False)
    placement = place(TARGET, DRAFT, policy, 4200, GiB)
    costs = ModelCosts.from_shapes(TARGET, DRAFT)
    curve = AcceptanceCurve((0.95,), 0.95, 0.1)
    mean = replan(PROFILE, costs, placement, 2, curve, 40, k_max=6, merged_rows=4)
    tail = replan(PROFILE, costs, placement, 2, curve, 40, k_max=6, merged_rows=4, tokens=32)
    assert mean.k >= 1
    assert tail.tokens_per_s < mean.tokens_per_s  # the wave's slowest row costs speculation rounds
    assert tail.k <= mean.k
