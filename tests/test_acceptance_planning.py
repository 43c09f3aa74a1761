"""Planning under uncertain acceptance (issue 14): the between-prompt error of the acceptance estimate, the maximin
choice over its range, online re-planning of speculation on/off with merged rows, and the pass calibration's fit."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace as dc_replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specoffload.planner import (
    AcceptanceTracker,
    HardwareProfile,
    ModelCosts,
    SearchSpace,
    Workload,
    estimate_alpha,
    estimate_alpha_by_prompt,
    replan,
    search,
)
from specoffload.planner.acceptance import (
    PRIOR_ROUNDS,
    AcceptanceCurve,
    curve_from_counts,
    expected_tokens,
    position_counts,
    t_quantile,
)
from specoffload.planner.placement import PlacementPolicy, place
from tests.conftest import dense_shape, other_cores_busy

# --- the between-prompt error --------------------------------------------------------------------------------


@pytest.mark.parametrize(("p", "df", "table"), [(0.95, None, 1.645), (0.975, None, 1.960), (0.95, 1, 6.314),
                                                (0.975, 2, 4.303), (0.95, 3, 2.353), (0.975, 4, 2.776),
                                                (0.95, 7, 1.895), (0.975, 15, 2.131), (0.9, 30, 1.310)])
def test_t_quantile_matches_tables(p: float, df: int | None, table: float) -> None:
    assert t_quantile(p, df) == pytest.approx(table, rel=0.01)


def test_estimate_by_prompt_literal() -> None:
    # two prompts, 10 positions each: 9 and 5 accepted -> alpha 0.7; residuals +2 and -2
    est = estimate_alpha_by_prompt([(10, 9), (10, 5)])
    assert (est.alpha, est.trials, est.successes, est.groups) == (0.7, 20, 14, 2)
    assert est.stderr == pytest.approx(math.sqrt(2 / 1 * (4 + 4)) / 20)  # 0.2, above the binomial 0.102
    lo, hi = est.plausible(0.9)
    assert (lo, hi) == pytest.approx((max(0.0, 0.7 - 6.314 * 0.2), 1.0), rel=0.01)
    # prompts that agree: the binomial error is the floor
    same = estimate_alpha_by_prompt([(10, 7), (10, 7)])
    assert same.stderr == pytest.approx(math.sqrt(0.7 * 0.3 / 20))
    assert estimate_alpha_by_prompt([(10, 7), (0, 0)]).groups == 0  # one prompt tried anything: binomial
    with pytest.raises(ValueError):
        estimate_alpha_by_prompt([(3, 4)])


@given(st.lists(st.tuples(st.integers(1, 60), st.floats(0, 1)), min_size=2, max_size=12))
def test_estimate_by_prompt_properties(prompts: list[tuple[int, float]]) -> None:
    counts = [(t, round(t * f)) for t, f in prompts]
    est = estimate_alpha_by_prompt(counts)
    pooled = estimate_alpha([s for _, s in counts], [t for t, _ in counts])  # not the same trials: only alpha bounds
    assert 0.0 <= est.alpha <= 1.0 and est.groups == len(counts)
    assert est.alpha == pytest.approx(sum(s for _, s in counts) / sum(t for t, _ in counts))
    assert est.stderr >= math.sqrt(est.alpha * (1 - est.alpha) / est.trials) - 1e-12
    assert 0.0 <= pooled.alpha <= 1.0


def test_by_prompt_interval_covers_heterogeneous_prompts() -> None:
    """Four prompts whose own acceptance differs (as measured: 0.6-0.98): the binomial interval from their pooled
    positions misses the population's acceptance far more often than the between-prompt one."""
    rng = random.Random(3)
    population = [0.62, 0.75, 0.85, 0.9, 0.95, 0.98]
    truth = sum(population) / len(population)
    hits = {"binomial": 0, "by prompt": 0}
    reps = 300
    for _ in range(reps):
        counts = []
        for alpha in rng.sample(population, 4):
            t = rng.randint(10, 16)
            counts.append((t, sum(rng.random() < alpha for _ in range(t))))
        by_prompt = estimate_alpha_by_prompt(counts)
        binomial = estimate_alpha([s for _, s in counts], [t for t, _ in counts])
        for name, (lo, hi) in (("binomial", binomial.interval(1.645)), ("by prompt", by_prompt.plausible(0.9))):
            hits[name] += lo <= truth <= hi
    assert hits["by prompt"] / reps >= 0.85
    assert hits["binomial"] < hits["by prompt"]


def test_tracker_keyed_by_prompt_equals_the_batch_estimate() -> None:
    tracker = AcceptanceTracker()
    tracker.record_many([2, 4, 0, 3], [4, 4, 4, 4], prompts=["a", "b", "a", "b"])
    # a: tried 3 + 1, accepted 2 + 0; b: tried 4 + 4, accepted 4 + 3
    assert tracker.estimate() == estimate_alpha_by_prompt([(4, 2), (8, 7)])
    plain = AcceptanceTracker()
    plain.record_many([2, 4, 0, 3], [4, 4, 4, 4])
    est = plain.estimate()
    assert est is not None and est.groups == 0 and est.alpha == tracker.estimate().alpha


# --- acceptance per position of a round ----------------------------------------------------------------------


def test_curve_is_exact_for_every_k_up_to_the_observed_one() -> None:
    """Rounds of k = 4: the tokens a shorter k would have committed are min(accepted, k') + 1 of the same rounds."""
    accepted = [0, 4, 2, 4, 1, 0, 3, 4]
    at_risk, hits = position_counts(accepted, [4] * len(accepted))
    assert (at_risk, hits) == ([8, 6, 5, 4], [6, 5, 4, 3])
    curve = curve_from_counts(at_risk, hits, alpha=0.5, prior_rounds=0)
    assert curve.rates == pytest.approx((6 / 8, 5 / 6, 4 / 5, 3 / 4))
    for k in range(5):
        assert curve.tokens(k) == pytest.approx(sum(min(n, k) + 1 for n in accepted) / len(accepted))
    assert curve.tokens(6) > curve.tokens(4)  # beyond position 4: the last rate carries on


def test_curve_generalises_leviathan_and_keeps_its_shape_at_other_levels() -> None:
    for alpha, k in ((0.3, 1), (0.8, 5), (0.95, 8)):
        assert AcceptanceCurve.geometric(alpha).tokens(k) == pytest.approx(expected_tokens(alpha, k))
    curve = AcceptanceCurve((0.79, 0.89, 0.92, 0.96), alpha=0.9)
    lower, higher = curve.at(0.8), curve.at(0.95)
    assert all(a < b < c for a, b, c in zip(lower.rates, curve.rates, higher.rates))
    assert list(lower.rates) == sorted(lower.rates) and lower.alpha == 0.8  # the shape: later positions easier
    assert curve.at(0.9) == curve
    assert curve.at(0.0).tokens(4) == 1.0 and curve.at(1.0).tokens(4) == 5.0
    # shrinkage toward the pooled rate: a position seen once does not swing to 0 or 1
    shrunk = curve_from_counts([10, 1], [9, 0], alpha=0.9, prior_rounds=4)
    assert shrunk.rates[1] == pytest.approx(3.6 / 5) and curve_from_counts([0, 0], [0, 0], 0.7).rates == (0.7,)


@given(st.lists(st.integers(0, 6), min_size=1, max_size=40), st.floats(0.01, 0.99))
def test_curve_properties(accepted: list[int], level: float) -> None:
    at_risk, hits = position_counts(accepted, [6] * len(accepted))
    pooled = estimate_alpha(accepted, [6] * len(accepted)).alpha
    curve = curve_from_counts(at_risk, hits, pooled)
    tokens = [curve.tokens(k) for k in range(8)]
    assert tokens[0] == 1.0 and all(b >= a for a, b in zip(tokens, tokens[1:]))
    assert all(t <= k + 1 for k, t in enumerate(tokens))
    moved = curve.at(level)
    assert moved.alpha == level and all(0.0 <= a <= 1.0 for a in moved.rates)
    assert (moved.tokens(6) >= curve.tokens(6) - 1e-9) == (level >= pooled) or abs(level - pooled) < 1e-9



def _simulate_rounds(a_reject: float, a_full: float, later: tuple[float, ...], k: int, rounds: int,
                     rng: random.Random) -> float:
    """Mean tokens per round of one row whose first-position rate depends on whether its last round was full."""
    full, total = False, 0
    for _ in range(rounds):
        accepted = 0
        for i in range(k):
            a = (a_full if full else a_reject) if i == 0 else later[min(i, len(later)) - 1]
            if rng.random() >= a:
                break
            accepted += 1
        full = accepted == k
        total += accepted + 1
    return total / rounds


def test_first_position_mixes_by_the_previous_round_at_each_k() -> None:
    """rates[0] after a rejection, after_full after a full round: the steady-state first rate at k is
    pi_k a_F + (1 - pi_k) a_R, pi_k = p_R / (1 - p_F + p_R); tokens per round match a simulation of the chain."""
    curve = AcceptanceCurve((0.6, 0.9), alpha=0.8, after_full=0.95)
    share = 0.6 * 0.9 / (1 - 0.95 * 0.9 + 0.6 * 0.9)
    assert curve.first_rate(2) == pytest.approx(share * 0.95 + (1 - share) * 0.6)
    assert curve.tokens(2) == pytest.approx(1 + curve.first_rate(2) * (1 + 0.9))
    assert curve.first_rate(1) == pytest.approx(0.6 / (1 - 0.95 + 0.6) * 0.95 + 0.05 / 0.65 * 0.6)
    # fewer drafts: more rounds end full, so the first position is easier at small k than at large k
    assert curve.first_rate(1) > curve.first_rate(2) > curve.first_rate(8) > 0.6
    rng = random.Random(7)
    for k in (1, 2, 5):
        simulated = _simulate_rounds(0.6, 0.95, (0.9, 0.85, 0.93), k, 60_000, rng)
        shaped = AcceptanceCurve((0.6, 0.9, 0.85, 0.93), alpha=0.8, after_full=0.95)
        assert shaped.tokens(k) == pytest.approx(simulated, rel=0.01)
    assert AcceptanceCurve((0.6, 0.9), alpha=0.8).first_rate(2) == 0.6  # without after_full: as before
    moved = curve.at(0.9)
    assert moved.after_full is not None and 0.95 < moved.after_full < 1 and moved.rates[0] > 0.6


def test_tracker_counts_the_first_position_by_the_rows_previous_round() -> None:
    """A prompt's round after its fully accepted round counts its first position apart (after_full)."""
    tracker = AcceptanceTracker()
    for accepted in (2, 0, 1, 2, 2):  # start, after full, after reject, after reject, after full
        tracker.record(accepted, 2, prompt="a")
    tracker.record(2, 2)  # no key: never counted as after a full round
    tracker.record(0, 2)
    alpha = tracker.estimate().alpha
    curve = tracker.curve()
    assert curve.after_full == pytest.approx((1 + PRIOR_ROUNDS * alpha) / (2 + PRIOR_ROUNDS))
    assert curve.rates[0] == pytest.approx((4 + PRIOR_ROUNDS * alpha) / (5 + PRIOR_ROUNDS))  # 5 rounds, 4 accepted
    assert AcceptanceTracker().curve() is None

# --- maximin choice over the alpha range ---------------------------------------------------------------------


TARGET = dense_shape("target", 4, attention=200, mlp=800, head=400, embedding=1000, kv=16)
DRAFT = dense_shape("draft", 2, attention=20, mlp=80, head=40, embedding=100, kv=4)
GiB = 1024**3


def _profile(**overrides: object) -> HardwareProfile:
    fields: dict[str, object] = {
        "provenance": {"machine": "test"}, "device": "cpu", "shared_compute": True, "weights_tier": "disk",
        "stream_bytes_per_s": 800.0, "ffn_flops_per_s": ((1, 8000.0),), "attention_fit": (0.1, 0.0, 0.0),
        "draft_step_s": ((1, 0.2),),
    }
    return HardwareProfile(**(fields | overrides))  # type: ignore[arg-type]


# io-bound enough that speculation pays at a high alpha (best k = 4 at alpha 0.95), not at a low one
PROFILE = _profile(stream_bytes_per_s=400.0, draft_step_s=((1, 0.05),))
WORKLOAD = Workload(num_prompts=16, prompt_len=4, new_tokens=32)


def _search(alpha: float, alpha_range: tuple[float, float] | None = None):  # noqa: ANN202
    return search(PROFILE, SearchSpace(TARGET, DRAFT, WORKLOAD, alpha=alpha, device_memory=4200, host_memory=GiB,
                                       batches=(1, 2, 4), ks=range(0, 7), unified_memory=False,
                                       alpha_range=alpha_range))


def test_search_with_a_point_range_is_the_plain_argmax() -> None:
    plain = _search(0.9)
    assert _search(0.9, (0.9, 0.9)).best == plain.best
    assert plain.best.worst_ratio == 1.0 and plain.best.predicted_low is None
    assert all(p.worst_ratio <= 1.0 for p in plain.alternatives)


def test_search_prefers_the_policy_that_stays_good_over_the_range() -> None:
    point = _search(0.95)
    assert point.best.k == 4  # at the point estimate a long k wins
    robust = _search(0.95, (0.3, 0.98))
    best = robust.best
    assert best.worst_ratio == max(p.worst_ratio for p in robust.alternatives)
    assert best.predicted_low is not None and best.predicted_low <= best.predicted_tokens_per_s
    at_point = next(p for p in robust.alternatives if (p.batch, p.k) == (point.best.batch, point.best.k))
    assert best.worst_ratio > at_point.worst_ratio  # the point argmax is worse somewhere in the range
    assert best.k < point.best.k
    with pytest.raises(ValueError, match="alpha_range"):
        _search(0.9, (0.95, 0.99))


def test_replan_turns_speculation_off_and_merges_rows() -> None:
    policy = PlacementPolicy(batch_size=2, num_batches=2, kv_capacity=48, weights_tier="disk", unified_memory=False)
    placement = place(TARGET, DRAFT, policy, 4200, GiB)
    costs = ModelCosts.from_shapes(TARGET, DRAFT)
    low = replan(PROFILE, costs, placement, 2, alpha=0.05, attended_len=40, k_max=6, merged_rows=4)
    assert (low.k, low.rows) == (0, 4)
    high = replan(PROFILE, costs, placement, 2, alpha=0.95, attended_len=40, k_max=6, merged_rows=4)
    assert high.k >= 1 and high.rows == 2 and high.tokens_per_s > low.tokens_per_s
    never = replan(PROFILE, costs, placement, 2, alpha=0.0, attended_len=40, k_max=6, merged_rows=4)
    assert (never.k, never.rows) == (0, 4)  # nothing is ever accepted
    with pytest.raises(ValueError, match="drafter"):
        replan(PROFILE, ModelCosts.from_shapes(TARGET, None), placement, 2, 0.5, 40, k_max=6, merged_rows=4)



def test_a_profile_off_by_more_than_the_margin_is_corrected_and_said(caplog, monkeypatch) -> None:
    """Passes slower (or faster) than the profile predicts by more than PROFILE_MARGIN, their loader at the profile's
    rate (so the io cannot explain them): one warning, the compute costs scaled until the prediction matches,
    `profile_off` set; passes within the margin change nothing. What is off decides (replan.py's table): drafted
    passes slower on a quiet machine are the cost model's error at their shape (the rates stand, `shape_off`);
    other processes busy correct this run but not the cached profile (`busy_cores`)."""
    from specoffload.planner import estimate_step
    from specoffload.planner.plan import fixed_plan
    from specoffload.runtime.offload import profiler
    from specoffload.runtime.offload.replan import CHECK_PASSES, PASS_WINDOW, PROFILE_MARGIN, Replanner

    policy = PlacementPolicy(batch_size=2, num_batches=2, kv_capacity=48, weights_tier="disk", unified_memory=False)
    placement = place(TARGET, DRAFT, policy, 4200, GiB)
    costs = ModelCosts.from_shapes(TARGET, DRAFT)
    space = SearchSpace(TARGET, DRAFT, WORKLOAD, alpha=0.9, device_memory=4200, host_memory=GiB, batches=(2,),
                        ks=(2,), unified_memory=False)
    compute_bound = dc_replace(PROFILE, stream_bytes_per_s=1e9)
    plan = dc_replace(fixed_plan(2, 2, 48), policy=search(compute_bound, space).best)
    model = estimate_step(compute_bound, costs, placement, 2, 2, 0.0, 24, interleave=plan.interleave)
    plain = estimate_step(compute_bound, costs, placement, 2, 0, 0.0, 24, interleave=plan.interleave)
    assert model.bound != "io" and plain.bound != "io"

    def observe(replanner: Replanner, factor: float, k: int, passes: int = CHECK_PASSES) -> list:
        step = model if k else plain
        caplog.clear()
        with caplog.at_level("INFO", logger="specoffload.offload"):
            for _ in range(passes):
                replanner.observe_pass(factor * step.t_step, k, 2, step.t_io)
        return [r for r in caplog.records if "hardware profile predicts" in r.getMessage()]

    # (factor, k of the passes, corrected): drafted passes slower on a quiet machine are the model's shape error
    for factor, k, off in ((1.1, 2, False), (1 / 1.1, 2, False), (2.0, 0, True), (0.4, 2, True), (0.4, 0, True),
                           (2.0, 2, False)):
        replanner = Replanner(plan, interval=1, profile=compute_bound, costs=costs, placement=placement)
        warned = observe(replanner, factor, k)
        assert replanner.checked and replanner.busy_cores is None
        if not off:
            assert not warned and replanner.profile_off is None and replanner.compute_scale == 1.0
            shaped = factor > PROFILE_MARGIN
            assert (replanner.shape_off == pytest.approx(factor, rel=1e-6)) if shaped else replanner.shape_off is None
            assert not shaped or any("the profile's rates stand" in r.getMessage() for r in caplog.records)
            continue
        assert len(warned) == 1 and replanner.profile_off == pytest.approx(factor, rel=1e-6)
        assert abs(math.log(replanner.profile_off)) > math.log(PROFILE_MARGIN)
        assert "measured again before the next job" in warned[0].getMessage()
        corrected = replanner.calibrated_profile()
        step = model if k else plain
        assert estimate_step(corrected, costs, placement, 2, k, 0.0, 24, interleave=plan.interleave).t_step == \
            pytest.approx(factor * step.t_step, rel=1e-3)
        assert not observe(replanner, factor, k)  # checked once per run: no second line
    # other processes busy over the passes (simulated: one extra core busy all the time): drafted passes slower are
    # corrected, for this run only
    real = other_cores_busy(monkeypatch)
    busy = Replanner(plan, interval=1, profile=compute_bound, costs=costs, placement=placement)
    warned = observe(busy, 2.0, 2)
    assert len(warned) == 1 and busy.profile_off == pytest.approx(2.0, rel=1e-6) and busy.shape_off is None
    assert busy.busy_cores is not None and busy.busy_cores > 0.5 and "the cached profile stands" in \
        warned[0].getMessage()
    monkeypatch.setattr(profiler, "_busy_seconds", real)
    monkeypatch.setattr(profiler, "OTHERS_LIMIT", float("inf"))
    # a model-free drafter's drafted passes feed fewer tokens than modelled: only its no-draft passes are judged
    ragged = Replanner(plan, interval=1, profile=compute_bound, costs=costs, placement=placement, full_feed=False)
    for _ in range(CHECK_PASSES):
        ragged.observe_pass(2.0 * model.t_step, 2, 2, model.t_io)
    assert not ragged.checked and ragged.profile_off is None
    for _ in range(PASS_WINDOW // 2):
        ragged.observe_pass(2.0 * plain.t_step, 0, 2, plain.t_io)
    assert ragged.checked and ragged.profile_off == pytest.approx(2.0, rel=1e-6)


def test_online_stream_rate_from_the_jobs_own_passes() -> None:
    """A pass that takes longer than everything but its io waited on the io: the rate it delivered is its bytes /
    its period, and the re-plan is made at that rate; a pass no slower than its compute says nothing."""
    from specoffload.planner import estimate_step
    from specoffload.planner.plan import fixed_plan
    from specoffload.runtime.offload.replan import PASS_WINDOW, Replanner

    policy = PlacementPolicy(batch_size=2, num_batches=2, kv_capacity=48, weights_tier="disk", unified_memory=False)
    placement = place(TARGET, DRAFT, policy, 4200, GiB)
    costs = ModelCosts.from_shapes(TARGET, DRAFT)
    space = SearchSpace(TARGET, DRAFT, WORKLOAD, alpha=0.9, device_memory=4200, host_memory=GiB, batches=(2,),
                        ks=(2,), unified_memory=False)
    plan = dc_replace(fixed_plan(2, 2, 48), policy=search(PROFILE, space).best)
    replanner = Replanner(plan, interval=1, profile=PROFILE, costs=costs, placement=placement)
    model = estimate_step(PROFILE, costs, placement, 2, 2, 0.0, 24)
    assert model.t_io > 0
    assert replanner.calibrated_profile() is PROFILE  # nothing observed yet
    for _ in range(PASS_WINDOW):
        replanner.observe_pass(3 * model.t_step, 2, 2)  # the disk at a third of the profile's rate
    slow = replanner.calibrated_profile()
    assert slow.stream_bytes_per_s == pytest.approx(model.t_io * PROFILE.stream_bytes_per_s / (3 * model.t_step))
    assert replanner.stream_rate == slow.stream_bytes_per_s
    assert model.bound == "io"
    fast = estimate_step(dc_replace(PROFILE, stream_bytes_per_s=1e18), costs, placement, 2, 2, 0.0, 24)
    quick = Replanner(plan, interval=1, profile=PROFILE, costs=costs, placement=placement)
    for _ in range(PASS_WINDOW):
        quick.observe_pass(fast.t_step * 0.5, 2, 2)  # faster than the model's io: the disk delivered more
    assert quick.calibrated_profile().stream_bytes_per_s == pytest.approx(model.t_io * PROFILE.stream_bytes_per_s
                                                                          / (fast.t_step * 0.5))
    quick_disk = dc_replace(PROFILE, stream_bytes_per_s=1e6)  # compute-bound: the pass never waits on the io
    assert estimate_step(quick_disk, costs, placement, 2, 2, 0.0, 24).bound != "io"
    compute = Replanner(plan, interval=1, profile=quick_disk, costs=costs, placement=placement)
    for _ in range(PASS_WINDOW):
        compute.observe_pass(fast.t_step * 0.9, 2, 2)
    assert compute.calibrated_profile() is quick_disk and compute.stream_rate is None
    few = Replanner(plan, interval=1, profile=PROFILE, costs=costs, placement=placement)
    for _ in range(PASS_WINDOW // 2 - 1):
        few.observe_pass(3 * model.t_step, 2, 2)
    assert few.calibrated_profile() is PROFILE  # too few passes to say
    mixed = Replanner(plan, interval=1, profile=PROFILE, costs=costs, placement=placement)
    for n in range(PASS_WINDOW):  # the window's most common shape (k 2, 2 rows) is the one measured
        mixed.observe_pass(3 * model.t_step if n % 4 else 100.0, 2 if n % 4 else 1, 2)
    assert mixed.calibrated_profile().stream_bytes_per_s == pytest.approx(slow.stream_bytes_per_s)
    assert len(mixed.pass_log) == PASS_WINDOW



def test_online_stream_rate_from_the_loaders_own_time() -> None:
    """With the io thread's load seconds observed (CPU), the rate is the bytes per pass / the mean load seconds per
    pass, whatever the period: a pass slowed by compute is not read as a slow disk; on CUDA (loads only queue
    copies) the period rule stands."""
    from dataclasses import replace as dc_replace

    from specoffload.planner import estimate_step
    from specoffload.runtime.offload.replan import PASS_WINDOW, observed_stream_rate

    policy = PlacementPolicy(batch_size=2, num_batches=2, kv_capacity=48, weights_tier="disk", unified_memory=False)
    placement = place(TARGET, DRAFT, policy, 4200, GiB)
    costs = ModelCosts.from_shapes(TARGET, DRAFT)
    model = estimate_step(PROFILE, costs, placement, 2, 2, 0.0, 24)
    streamed = model.t_io * PROFILE.stream_bytes_per_s
    loads = [model.t_io * f for f in (1.5, 2.5, 0.0, 4.0)] * (PASS_WINDOW // 4)  # mean 2x the model's io
    for period in (0.5 * model.t_step, 3 * model.t_step, 10 * model.t_step):
        passes = [(period, 2, 2, load) for load in loads]
        rate = observed_stream_rate(PROFILE, costs, placement, passes, 24)
        assert rate == pytest.approx(streamed / (2 * model.t_io))
        assert rate == pytest.approx(PROFILE.stream_bytes_per_s / 2)
    cuda = dc_replace(PROFILE, device="cuda", shared_compute=False)
    cuda_model = estimate_step(cuda, costs, placement, 2, 2, 0.0, 24)
    passes = [(3 * cuda_model.t_step, 2, 2, load) for load in loads]  # longer than any compute: waited on the io
    assert observed_stream_rate(cuda, costs, placement, passes, 24) == pytest.approx(
        cuda_model.t_io * cuda.stream_bytes_per_s / (3 * cuda_model.t_step))

# --- online: speculation off, rows merged (tiny models) -----------------------------------------------------


def test_online_replanning_turns_speculation_off_and_merges_the_batches(tiny_models, single_thread, monkeypatch):
    """A draft too slow to ever pay (synthetic profile): starting from k = 2 with two batches of 2 rows, the first
    re-plan turns speculation off; once a batch drains, the other admits the rows of both (4), and the output is
    the target's own greedy output."""
    from specoffload.runtime import engine as engine_module
    from specoffload.runtime import planning
    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine
    from specoffload.runtime.offload import batches as batches_module
    from specoffload.runtime.sampling import SamplingParams

    real_search = planning.search
    monkeypatch.setattr(planning, "search", lambda profile, space: real_search(profile, dc_replace(
        space, ks=(2,), batches=(2,)) if space.draft is not None else space))  # (not the no-draft comparison)
    slow_draft = _profile(stream_bytes_per_s=1e12, ffn_flops_per_s=((1, 1e9),), attention_fit=(1e-6, 0.0, 0.0),
                          draft_step_s=((1, 1.0),))
    monkeypatch.setattr(engine_module, "load_or_measure", lambda *a, **kw: slow_draft)
    waves: list[int] = []
    real_wave = batches_module.Batches._new_wave
    monkeypatch.setattr(batches_module.Batches, "_new_wave", lambda self, b: (waves.append(len(b.rows)),
                                                                           real_wave(self, b))[1])
    prompts = [[1, 5 + i, 9, 33 + 2 * i, 70 + i][: 2 + i % 4] for i in range(12)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    target = tiny_models["llama"]
    ref = Engine(EngineConfig(target, max_batch_size=4)).generate(prompts, greedy)
    waves.clear()  # (the resident reference runs the same pipeline: its one wave of 4)
    engine = Engine(EngineConfig(target, draft=tiny_models["qwen2_draft"], device_memory="1GiB", max_seq_len=48,
                                 num_draft_tokens="auto", max_batch_size="auto", replan_interval=1))
    assert (engine.plan.batch, engine.plan.k) == (2, 2) and engine.replanner.active
    out = engine.generate(prompts, greedy)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert engine.replanner.k == 0 and engine.replanner.rows == 4
    assert engine.replanner.replans[0]["k_to"] == 0 and engine.replanner.replans[0]["rows_to"] == 4
    assert waves[:2] == [2, 2] and max(waves) == 4  # two batches of 2, then merged waves of the rows of both


# --- calibration on measured passes ---------------------------------------------------------------------------


def test_calibration_fit_on_literal_points() -> None:
    from specoffload.runtime.offload.calibrate import _fit_line

    assert _fit_line([8, 16, 40], [0.1 + 0.01 * x for x in (8, 16, 40)]) == pytest.approx((0.1, 0.01))
    assert _fit_line([8, 16], [0.3, 0.1]) == (pytest.approx(0.2), 0.0)  # a negative slope: the mean, flat
    assert _fit_line([8, 16], [0.0, 0.4]) == (0.0, pytest.approx((8 * 0 + 16 * 0.4) / (64 + 256)))  # a < 0
    assert _fit_line([], []) == (0.0, 0.0)


def test_calibrated_profile_reproduces_the_measured_passes(tiny_models, single_thread, tmp_path, monkeypatch):
    """Calibration on tiny models: no-draft passes at several row counts are timed (the profile is the model's,
    whatever the drafter), the overheads are >= 0, and the profile keeps the points through JSON."""
    from specoffload.planner import HardwareProfile
    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine
    from specoffload.runtime.offload import profiler

    monkeypatch.setattr(profiler, "PROFILE_DIR", tmp_path)
    config = EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], device_memory="1GiB")
    profile = profiler.load_or_measure(config, quick=True, open_engine=Engine)
    assert profile.pass_overhead_s >= 0 and profile.position_overhead_s >= 0
    points = profile.calibration
    assert [p["rows"] for p in points] == [16, 4] and all(p["k"] == 0 for p in points)
    assert all(p["measured_s"] > 0 and p["positions"] == p["rows"] for p in points)
    assert HardwareProfile.from_json(json.loads(json.dumps(profile.to_json()))).calibration == points


def test_prose_prompts_are_paragraphs_of_the_language_reference() -> None:
    from specoffload.runtime.prompts import prose_prompts

    prompts = prose_prompts()
    assert len(prompts) > 32 and prose_prompts(4) == prompts[:4]
    assert all(len(p) >= 200 and "\n" not in p and "::=" not in p for p in prompts)
    assert prose_prompts() == prompts  # deterministic for a given Python
    with pytest.raises(ValueError):
        prose_prompts(-1)
