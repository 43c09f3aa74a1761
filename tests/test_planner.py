"""The planner's pure part: acceptance math (closed form vs Monte Carlo), the profile, the cost model on literal
numbers, the policy search on a synthetic 4-layer model, and the import boundary (no engine, no Ray)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.planner import (
    AcceptanceTracker,
    HardwareProfile,
    ModelCosts,
    NoFeasiblePolicyError,
    ProfileError,
    SearchSpace,
    Workload,
    estimate_alpha,
    estimate_step,
    estimate_workload,
    expected_tokens,
    search,
)
from specoffload.planner.cost import ChainLink, chain_period, estimate_prefill, stream_bytes
from specoffload.planner.errors import SpecOffloadError
from specoffload.planner.placement import ModelShape, Placement, PlacementPolicy
from specoffload.planner.shapes import PartKey
from tests.conftest import dense_shape

# --- acceptance ----------------------------------------------------------------------------------------------


def simulate_round(rng: random.Random, alpha: float, k: int) -> int:
    """Accepted drafts of one round: each accepted with probability alpha until the first rejection."""
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    return accepted


@pytest.mark.parametrize(("alpha", "k", "expected"), [(0.9, 1, 1.9), (0.5, 3, 1.875), (0.0, 4, 1.0), (1.0, 4, 5.0),
                                                      (0.7, 0, 1.0), (0.8, 2, 2.44)])
def test_expected_tokens_literal(alpha: float, k: int, expected: float) -> None:
    assert expected_tokens(alpha, k) == pytest.approx(expected, rel=1e-12)


def test_expected_tokens_continuous_at_alpha_one() -> None:
    assert expected_tokens(1 - 1e-12, 6) == pytest.approx(7.0, rel=1e-9)
    assert expected_tokens(1 - 1e-3, 6) < expected_tokens(1.0, 6)


@pytest.mark.parametrize(("alpha", "k"), [(-0.1, 2), (1.1, 2), (0.5, -1), (0.5, 1.5), (float("nan"), 2), (0.5, True)])
def test_expected_tokens_rejects_bad_inputs(alpha: float, k: int) -> None:
    with pytest.raises(ValueError):
        expected_tokens(alpha, k)


@pytest.mark.parametrize(("alpha", "k"), [(0.3, 1), (0.6, 4), (0.9, 8), (0.75, 2), (0.0, 3), (1.0, 5)])
def test_expected_tokens_matches_monte_carlo(alpha: float, k: int) -> None:
    rng = random.Random(1234 + k)
    n = 20_000
    tokens = [simulate_round(rng, alpha, k) + 1 for _ in range(n)]
    mean = sum(tokens) / n
    sd = math.sqrt(sum((t - mean) ** 2 for t in tokens) / (n - 1))
    assert abs(mean - expected_tokens(alpha, k)) <= 3 * sd / math.sqrt(n) + 1e-12


def test_estimate_alpha_literal() -> None:
    # rounds: 2 of 4 (tried 3), 4 of 4 (tried 4), 0 of 4 (tried 1), k = 0 round (tried 0)
    est = estimate_alpha([2, 4, 0, 0], [4, 4, 4, 0])
    assert (est.trials, est.successes) == (8, 6)
    assert est.alpha == 0.75
    assert est.stderr == pytest.approx(math.sqrt(0.75 * 0.25 / 8))
    lo, hi = est.interval()
    assert lo < 0.75 < hi <= 1.0


@pytest.mark.parametrize(("alpha", "k"), [(0.65, 5), (0.2, 2), (0.95, 8)])
def test_estimate_alpha_recovers_simulated_alpha(alpha: float, k: int) -> None:
    rng = random.Random(7)
    accepted = [simulate_round(rng, alpha, k) for _ in range(5000)]
    est = estimate_alpha(accepted, [k] * len(accepted))
    assert abs(est.alpha - alpha) <= 3 * est.stderr
    assert est.stderr < 0.02


def test_estimate_alpha_edges() -> None:
    assert estimate_alpha([0, 0], [3, 1]).alpha == 0.0
    all_in = estimate_alpha([3, 1], [3, 1])
    assert (all_in.alpha, all_in.stderr) == (1.0, 0.0)
    with pytest.raises(ValueError, match="not identifiable"):
        estimate_alpha([0], [0])
    with pytest.raises(ValueError):
        estimate_alpha([5], [4])  # more accepted than drafted
    with pytest.raises(ValueError):
        estimate_alpha([1, 2], [4])


@given(st.lists(st.integers(0, 8).flatmap(lambda k: st.tuples(st.integers(0, k), st.just(k))), min_size=1))
def test_estimate_alpha_properties(rounds: list[tuple[int, int]]) -> None:
    accepted, drafted = [n for n, _ in rounds], [k for _, k in rounds]
    if sum(drafted) == 0:
        with pytest.raises(ValueError):
            estimate_alpha(accepted, drafted)
        return
    est = estimate_alpha(accepted, drafted)
    assert 0.0 <= est.alpha <= 1.0
    assert est.successes == sum(accepted) <= est.trials <= sum(drafted)
    assert (est.alpha == 1.0) == all(n == k for n, k in rounds)


def test_tracker_without_forgetting_equals_batch_estimate() -> None:
    tracker = AcceptanceTracker()
    assert tracker.estimate() is None
    tracker.record_many([2, 4, 0], [4, 4, 4])
    tracker.record(0, 0)  # no information
    assert tracker.estimate() == estimate_alpha([2, 4, 0], [4, 4, 4])
    assert tracker.rounds == 3


def test_tracker_forgets_with_half_life() -> None:
    tracker = AcceptanceTracker(half_life=1)
    tracker.record(0, 1)  # tried 1, accepted 0
    tracker.record(1, 1)  # tried 1, accepted 1; the first round now weighs 0.5
    est = tracker.estimate()
    assert est is not None
    assert (est.trials, est.successes) == (1.5, 1.0)
    assert est.alpha == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        AcceptanceTracker(half_life=0)


# --- profile -------------------------------------------------------------------------------------------------


def make_profile(**overrides: object) -> HardwareProfile:
    fields: dict[str, object] = {
        "provenance": {"machine": "test", "cores": 2, "models": ("t", "d"), "dtype": "bfloat16"},
        "device": "cpu",
        "shared_compute": True,
        "weights_tier": "disk",
        "stream_bytes_per_s": 800.0,  # a dense_mlp part of the synthetic model (800 bytes) loads in 1 s
        "ffn_flops_per_s": ((1, 8000.0),),  # an 800-FLOP/token dense mlp: 0.1 s per token
        "attention_fit": (0.1, 0.0, 0.0),
        "draft_step_s": ((1, 0.2),),
    }
    fields.update(overrides)
    return HardwareProfile(**fields)  # type: ignore[arg-type]


def test_profile_interpolation_on_literal_points() -> None:
    profile = make_profile(ffn_flops_per_s=((1, 100.0), (4, 400.0)), draft_step_s=((1, 0.1), (3, 0.3)),
                           attention_fit=(0.5, 0.25, 0.125))
    assert profile.ffn_rate(1) == 100.0
    assert profile.ffn_rate(2) == pytest.approx(250.0)  # halfway in log(rows)
    assert profile.ffn_rate(8) == 400.0  # clamped above
    assert profile.ffn_seconds(500.0, 2) == pytest.approx(2.0)
    assert profile.ffn_seconds(0.0, 2) == 0.0
    assert profile.head_seconds(500.0, 2) == pytest.approx(2.0)  # no head rate: the ffn rate
    assert make_profile(head_flops_per_s=50.0).head_seconds(500.0, 2) == 10.0
    assert profile.draft_seconds(2) == pytest.approx(0.2)
    assert profile.draft_seconds(5) == pytest.approx(0.5)  # extrapolated along the last segment
    assert profile.attention_seconds(4, 10) == pytest.approx(0.5 + 1.0 + 5.0)
    single = make_profile(draft_step_s=((2, 0.4),))
    assert single.draft_seconds(1) == 0.4
    assert single.draft_seconds(4) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        profile.ffn_rate(0.5)


def test_profile_json_round_trip(tmp_path) -> None:  # noqa: ANN001
    profile = make_profile(head_flops_per_s=123.0, pass_overhead_s=0.01)
    path = tmp_path / "profile.json"
    profile.save(path)
    loaded = HardwareProfile.load(path)
    assert loaded == profile
    assert loaded.to_json() == json.loads(path.read_text())
    assert loaded.provenance["models"] == ["t", "d"]
    assert loaded.matches({"machine": "test", "models": ("t", "d")})
    assert not loaded.matches({"machine": "other"})
    assert not loaded.matches({"gpu": "none"})  # a key the profile lacks


@pytest.mark.parametrize(
    "overrides",
    [
        {"device": "tpu"},
        {"weights_tier": "tape"},
        {"stream_bytes_per_s": 0.0},
        {"ffn_flops_per_s": ((4, 1.0), (2, 1.0))},
        {"ffn_flops_per_s": ()},
        {"draft_step_s": ((0, 1.0),)},
        {"attention_fit": (1.0, -1.0, 0.0)},
        {"provenance": {"bad": object()}},
    ],
)
def test_profile_validation(overrides: dict[str, object]) -> None:
    with pytest.raises(ProfileError):
        make_profile(**overrides)
    assert issubclass(ProfileError, SpecOffloadError)


def test_profile_load_errors(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ProfileError, match="cannot read"):
        HardwareProfile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        HardwareProfile.load(tmp_path / "bad.json")
    data = make_profile().to_json()
    (tmp_path / "old.json").write_text(json.dumps({**data, "version": 0}))
    with pytest.raises(ProfileError, match="measure it again"):
        HardwareProfile.load(tmp_path / "old.json")
    del data["attention_fit"]
    with pytest.raises(ProfileError, match="attention_fit"):
        HardwareProfile.from_json(data)


# --- synthetic models ----------------------------------------------------------------------------------------


# 4 layers; bf16 bytes: attention 100 params, mlp 400 params (800 FLOPs/token), head 200 params (400 FLOPs/token)
TARGET = dense_shape("target", 4, attention=200, mlp=800, head=400, embedding=1000, kv=16)
DRAFT = dense_shape("draft", 2, attention=20, mlp=80, head=40, embedding=100, kv=4)
COSTS = ModelCosts.from_shapes(TARGET, DRAFT, dtype_bytes=2)


def manual_placement(streamed_mlp: tuple[int, ...], num_buffers: int = 2, weights_tier: str = "disk") -> Placement:
    """Attention, head and embedding resident; the dense mlp of `streamed_mlp` layers streamed."""
    tiers = {key: ("disk" if key.kind == "dense_mlp" and key.layer in streamed_mlp else "device")
             for key, _ in TARGET.parts}
    policy = PlacementPolicy(batch_size=1, num_buffers=num_buffers, weights_tier=weights_tier)
    return Placement(MappingProxyType(tiers), tuple(streamed_mlp), 800, num_buffers, policy, (), 0, 0)


def test_model_costs_flops() -> None:
    assert [COSTS.dense_flops(j) for j in range(4)] == [800.0] * 4
    assert COSTS.attention_flops(0) == 200.0 and COSTS.expert_flops(0) == 0.0
    assert COSTS.head_flops == 400.0
    assert COSTS.target_flops_per_token == 4 * (200 + 800) + 400  # the embedding is free
    assert COSTS.draft_flops_per_token == 2 * (20 + 80) + 40
    assert COSTS.expert_fraction == 1.0


def test_model_costs_moe_counts_top_k_experts() -> None:
    parts = [(PartKey("embedding"), 10), (PartKey("attention", 0), 20), (PartKey("router", 0), 4)]
    parts += [(PartKey("expert", 0, e), 100) for e in range(4)]
    moe = ModelShape("moe", (*parts, (PartKey("head"), 30)), 1, 8)
    costs = ModelCosts.from_shapes(moe, None, dtype_bytes=2, top_k=2)
    assert (costs.num_experts, costs.top_k) == (4, 2)
    assert costs.expert_flops(0) == 2 * 50 * 2  # 2 of 4 experts of 50 params each
    assert costs.dense_flops(0) == 4.0  # the router
    assert costs.target_flops_per_token == 20 + 4 + 200 + 30
    assert costs.expert_fraction == 0.5
    with pytest.raises(ValueError, match="top_k"):
        ModelCosts.from_shapes(moe, None, dtype_bytes=2)
    with pytest.raises(ValueError, match="num_experts"):
        ModelCosts(moe, None, 2, num_experts=8, top_k=2)


def test_stream_bytes_groups_by_layer() -> None:
    assert stream_bytes(manual_placement((1, 3)), TARGET) == {1: 800, 3: 800}


# --- the step model on literal numbers -----------------------------------------------------------------------


def test_chain_period_depends_on_ring_depth() -> None:
    # layers 0, 2 resident; 1, 3 load in 1 s; 0.5 s of compute per layer; the head is free
    links = [ChainLink(0.0, 0.5, None), ChainLink(0.0, 0.5, 1.0), ChainLink(0.0, 0.5, None), ChainLink(0.0, 0.5, 1.0),
             ChainLink(0.0, 0.0, None)]
    assert chain_period(links, 0.0, num_buffers=1) == pytest.approx(3.0)  # each load waits for the previous ffn
    assert chain_period(links, 0.0, num_buffers=2) == pytest.approx(2.0)  # loads run ahead: io-bound
    assert chain_period([ChainLink(0.25, 0.5, None)], 0.25, num_buffers=2) == pytest.approx(1.0)
    # one streamed layer, one slot: 0.5 s attention + 0.5 s ffn, 1 s load; streamed attention waits for it too
    assert chain_period([ChainLink(0.5, 0.5, 1.0)], 0.0, num_buffers=1) == pytest.approx(1.5)
    assert chain_period([ChainLink(0.5, 0.5, 1.0, pre_waits=True)], 0.0, num_buffers=1) == pytest.approx(2.0)


def test_step_io_bound_shared() -> None:
    profile = make_profile()
    placement = manual_placement((0, 1, 2, 3))
    step = estimate_step(profile, COSTS, placement, batch=1, k=0, alpha=0.5, attended_len=8)
    # io 4 x 1 s; compute 4 x (0.1 attention + 0.1 ffn) + head 0.05
    assert (step.t_io, step.t_attention, step.t_head) == pytest.approx((4.0, 0.4, 0.05))
    assert step.t_ffn == pytest.approx(0.4)
    assert step.t_chain == pytest.approx(4.0)
    assert step.t_step == pytest.approx(4.0) and step.bound == "io"
    assert step.tokens_per_s == pytest.approx(0.25)
    spec = estimate_step(profile, COSTS, placement, batch=1, k=3, alpha=0.5, attended_len=8)
    # 4 tokens fed: ffn 0.4 s per layer, head 0.2, draft 3 x 0.2: compute 2.8 s, still hidden under the io
    assert (spec.t_ffn, spec.t_head, spec.t_draft) == pytest.approx((1.6, 0.2, 0.6))
    assert spec.t_step == pytest.approx(4.0) and spec.bound == "io"
    assert spec.tokens_per_step == pytest.approx(1.875)
    assert spec.tokens_per_s == pytest.approx(1.875 / 4.0)


def test_step_compute_bound_shared_and_separate() -> None:
    shared = make_profile(stream_bytes_per_s=8000.0, ffn_flops_per_s=((1, 800.0),))
    placement = manual_placement((0, 1, 2, 3))
    step = estimate_step(shared, COSTS, placement, batch=1, k=0, alpha=0.5, attended_len=8)
    # loads 0.1 s each; 4 x (0.1 + 1.0) + head 0.5 = 4.9 s of serial compute; no stalls
    assert step.t_io == pytest.approx(0.4)
    assert step.t_chain == pytest.approx(4.9)
    assert step.t_step == pytest.approx(4.9)
    spec = estimate_step(shared, COSTS, placement, batch=1, k=3, alpha=0.5, attended_len=8)
    # 4 tokens: ffn 16, head 2, attention 0.4, draft 0.6, all on the same cores
    assert spec.t_step == pytest.approx(19.0) and spec.bound == "compute"
    assert spec.tokens_per_s < step.tokens_per_s  # speculation does not pay when compute-bound

    separate = make_profile(device="cuda", shared_compute=False, stream_bytes_per_s=8000.0,
                            ffn_flops_per_s=((1, 800.0),))
    gpu = estimate_step(separate, COSTS, placement, batch=1, k=3, alpha=0.5, attended_len=8)
    # device: ffn 16 + head 2 + draft 0.6 = 18.6 > chain 18.4 > cpu 0.4: the attention overlaps the draft
    assert gpu.t_chain == pytest.approx(18.4)
    assert gpu.t_step == pytest.approx(18.6) and gpu.bound == "device"


def test_step_draft_hidden_on_separate_compute_only() -> None:
    placement = manual_placement((0, 1, 2, 3))
    slow_draft = {"draft_step_s": ((1, 1.0),)}
    shared = estimate_step(make_profile(**slow_draft), COSTS, placement, batch=1, k=3, alpha=0.5, attended_len=8)
    # 0.4 attention + 1.6 ffn + 0.2 head + 3.0 draft = 5.2 s > 4 s of io
    assert shared.t_step == pytest.approx(5.2) and shared.bound == "compute"
    gpu = make_profile(device="cuda", shared_compute=False, **slow_draft)
    separate = estimate_step(gpu, COSTS, placement, batch=1, k=3, alpha=0.5, attended_len=8)
    assert separate.t_step == pytest.approx(4.8) and separate.bound == "device"  # 1.6 + 0.2 + 3.0


def test_step_attention_and_overhead_terms() -> None:
    profile = make_profile(attention_fit=(0.0, 0.01, 0.001), pass_overhead_s=0.5, stream_bytes_per_s=1e9)
    step = estimate_step(profile, COSTS, manual_placement(()), batch=2, k=1, alpha=0.5, attended_len=100)
    # 4 tokens fed attend to 100 keys: 0.04 + 0.4 = 0.44 s per layer
    assert step.t_attention == pytest.approx(4 * 0.44)
    assert step.t_io == 0.0
    assert step.t_chain == pytest.approx(0.5 + 4 * (0.44 + 0.4) + 0.2)
    assert step.t_step == pytest.approx(step.t_chain + 2 * 0.2)  # + the draft, on the same cores


def test_a_draft_sharing_the_target_kv_prefills_nothing() -> None:
    """A drafter built from the target (lowbit, self) drafts into the target's KV cache: its first round is k steps
    over the rows, whatever the prompt's length; a draft model prefills the prompt first."""
    profile = make_profile()
    placement = manual_placement((0, 1, 2, 3))
    stand_in = ModelShape("stand-in", tuple((key, n // 4) for key, n in TARGET.parts if key.kind != "embedding"),
                          TARGET.num_layers, 0, stands_in=True)
    shared = ModelCosts.from_shapes(TARGET, stand_in, dtype_bytes=2)
    assert shared.draft_shares_kv and not COSTS.draft_shares_kv
    for prompt_len in (2, 50):
        prefill = estimate_prefill(profile, shared, placement, batch=2, k=3, prompt_len=prompt_len)
        assert prefill.t_draft == pytest.approx(3 * profile.draft_seconds(2))
    model = estimate_prefill(profile, COSTS, placement, batch=2, k=3, prompt_len=50)
    assert model.t_draft == pytest.approx(profile.draft_seconds(100) + 2 * profile.draft_seconds(2))


def test_prefill_and_workload_literal() -> None:
    profile = make_profile()
    placement = manual_placement((0, 1, 2, 3))
    workload = Workload(num_prompts=4, prompt_len=2, new_tokens=5)
    prefill = estimate_prefill(profile, COSTS, placement, batch=1, k=3, prompt_len=2)
    # 2 tokens fed: ffn 0.8, head (1 row) 0.05, attention 0.4; draft prefill 0.4 + 2 x 0.2: 2.05 s < 4 s of io
    assert (prefill.t_ffn, prefill.t_head, prefill.t_draft) == pytest.approx((0.8, 0.05, 0.8))
    assert prefill.t_step == pytest.approx(4.0)

    plain = estimate_workload(profile, COSTS, placement, batch=1, k=0, alpha=0.5, workload=workload)
    # 4 waves of one batch: 1 prefill pass + ceil(4 / 1) decode steps, 4 s each
    assert (plain.waves, plain.num_batches, plain.rows, plain.decode_steps) == (4, 1, 1, 4)
    assert plain.total_s == pytest.approx(80.0)
    assert plain.tokens_per_s == pytest.approx(20 / 80)

    spec = estimate_workload(profile, COSTS, placement, batch=1, k=3, alpha=0.5, workload=workload)
    # 2 waves of two batches: 2 prefill passes + 2 x ceil(4 / 1.875) decode steps, 4 s each
    assert (spec.waves, spec.num_batches, spec.decode_steps) == (2, 2, 6)
    assert spec.prefill_s == pytest.approx(16.0) and spec.decode_s == pytest.approx(48.0)
    assert spec.tokens_per_s == pytest.approx(20 / 64)

    capped = estimate_workload(profile, COSTS, placement, batch=64, k=0, alpha=0.5, workload=workload)
    assert (capped.rows, capped.waves) == (4, 1)  # a batch never holds more rows than there are prompts


def test_step_rejects_mismatched_plans() -> None:
    placement = manual_placement((0,))
    with pytest.raises(ProfileError, match="measure a profile"):
        estimate_step(make_profile(weights_tier="ram"), COSTS, placement, 1, 0, 0.5, 8)
    with pytest.raises(ValueError, match="draft model"):
        estimate_step(make_profile(), ModelCosts(TARGET, None), placement, 1, 2, 0.5, 8)
    with pytest.raises(ValueError, match="not made for this target"):
        estimate_step(make_profile(), ModelCosts(DRAFT, None), placement, 1, 0, 0.5, 8)
    with pytest.raises(ValueError):
        estimate_step(make_profile(), COSTS, placement, 0, 0, 0.5, 8)


# --- search ----------------------------------------------------------------------------------------------------

WORKLOAD = Workload(num_prompts=64, prompt_len=4, new_tokens=16)
GiB = 1024**3


def test_search_picks_k0_when_compute_bound() -> None:
    fast_io = make_profile(stream_bytes_per_s=1e12, ffn_flops_per_s=((1, 800.0),))
    result = search(fast_io, SearchSpace(TARGET, DRAFT, WORKLOAD, alpha=0.8, device_memory=GiB, host_memory=GiB,
                    batches=(1, 2, 4), ks=range(0, 5), unified_memory=False))
    assert result.best.k == 0
    assert result.best.draft_batch == 0 and result.best.num_batches == 1
    assert result.alternatives[0] == result.best
    rates = [p.predicted_tokens_per_s for p in result.alternatives]
    assert rates == sorted(rates, reverse=True)
    assert len(result.alternatives) == 3 * 5 and not result.infeasible
    assert result.best_where(lambda p: p.k == 0) == result.best


def test_search_picks_speculation_when_io_bound() -> None:
    slow_io = make_profile(stream_bytes_per_s=100.0, ffn_flops_per_s=((1, 1e6),), draft_step_s=((1, 0.01),))
    # room for the draft, attention, head, the ring and one mlp: three mlp layers stream, with or without draft
    result = search(slow_io, SearchSpace(TARGET, DRAFT, WORKLOAD, alpha=0.8, device_memory=4200, host_memory=GiB,
                    batches=(1, 2, 4), ks=range(0, 5), unified_memory=False))
    best = result.best
    assert best.k > 0
    assert best.prefill_batch == best.decode_batch == best.draft_batch == best.batch
    assert best.memory["device_footprint"] <= 4200
    assert "ring buffers" in best.placement_table
    no_draft = result.best_where(lambda p: p.k == 0)
    assert no_draft is not None and no_draft.predicted_tokens_per_s < best.predicted_tokens_per_s
    assert best.estimate is not None and best.estimate.step.bound == "io"


def test_search_reports_infeasible_budgets() -> None:
    profile = make_profile()
    # enough for the target with every layer streamed, not for the draft (340 bytes) and its KV cache as well
    minimal = 2 * (200 + 800)  # a ring of two slots of one layer (attention + mlp)
    result = search(profile, SearchSpace(TARGET, DRAFT, WORKLOAD, alpha=0.8, device_memory=minimal + 300,
                                         host_memory=GiB, batches=(1, 4), ks=(0, 2), unified_memory=False))
    assert {(b, k) for b, k, _ in result.infeasible} == {(1, 2), (4, 2)}
    assert all("does not fit" in why for _, _, why in result.infeasible)
    assert result.best.k == 0
    with pytest.raises(NoFeasiblePolicyError, match="no \\(batch, k\\) fits"):
        search(profile, SearchSpace(TARGET, DRAFT, WORKLOAD, alpha=0.8, device_memory=100, host_memory=GiB,
                                    batches=(1,), ks=(0, 1), unified_memory=False))


def test_search_without_draft_only_tries_k0() -> None:
    result = search(make_profile(), SearchSpace(TARGET, None, WORKLOAD, alpha=0.8, device_memory=GiB, host_memory=GiB,
                    batches=(1, 2), ks=range(0, 4)))
    assert {p.k for p in result.alternatives} == {0}


# --- import boundary ---------------------------------------------------------------------------------------------


def test_planner_is_the_base_layer_without_torch_runtime_or_ray() -> None:
    """planner/ imports only itself: a fresh interpreter that imports it (and every module in it) has no torch, no
    specoffload.runtime and no Ray. The second line shows the check can fail: importing the runtime does pull
    torch in."""
    code = (
        "import sys, pkgutil, importlib, specoffload.planner as p\n"
        "for m in pkgutil.walk_packages(p.__path__, 'specoffload.planner.'): importlib.import_module(m.name)\n"
        "bad = ('torch', 'ray', 'safetensors', 'specoffload.runtime', 'specoffload.actors')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in bad or m.startswith(bad)))\n"
        "import specoffload.runtime.models.weights\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1] == "True"


# --- paper-scale inputs --------------------------------------------------------------------------------------------


def test_paper_scale_shapes_match_public_parameter_counts() -> None:
    from specoffload.planner.paper_scale.shapes import load_config, shape_from_config

    mixtral, top_k = shape_from_config("mixtral_8x7b", load_config("mixtral_8x7b"))
    mistral, dense_top_k = shape_from_config("mistral_7b", load_config("mistral_7b"))
    assert (top_k, dense_top_k) == (2, 0)
    assert round(mixtral.total_bytes / 2 / 1e9, 2) == 46.70  # Mixtral 8x7B: 46.7 B parameters
    assert round(mistral.total_bytes / 2 / 1e9, 2) == 7.24  # Mistral 7B: 7.24 B parameters
    assert mixtral.kv_bytes_per_token == mistral.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert sum(1 for key, _ in mixtral.parts if key.kind == "expert") == 32 * 8


def test_paper_scale_prediction_is_the_io_roofline_derived_by_hand() -> None:
    """The paper-scale prediction (Mixtral 8x7B streamed from pinned host RAM on the modelled RTX 4090) is
    io-bound; its step time is therefore the streamed target bytes over the measured stream rate, and its
    decode rate B * E(alpha, k) / T_step, with E = (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al. 2023). Both
    derived here from the published shapes and the profile, not read back from what predict.py wrote."""
    from specoffload.planner.paper_scale import predict
    from specoffload.planner.paper_scale.derive import PROFILE_PATH, derive
    from specoffload.planner.paper_scale.shapes import load_config, shape_from_config

    assert HardwareProfile.load(PROFILE_PATH) == derive()  # the shipped profile is what derive.py's inputs give
    profile = derive()
    target, _ = shape_from_config("mixtral_8x7b", load_config("mixtral_8x7b"))
    alpha, workload = predict.ALPHA, predict.WORKLOAD
    result = predict.run(alpha)
    for policy in (result.best_where(lambda p: p.k >= 1), result.best_where(lambda p: p.k == 0)):
        step = policy.estimate.step
        assert step.bound == "io"
        rows, k = policy.estimate.rows, policy.k
        batches = 2 if k else 1
        kv = target.kv_bytes_per_token * (workload.prompt_len + workload.new_tokens + k + 1) * rows * batches
        embedding = 32000 * 4096 * 2  # Mixtral's vocabulary x hidden, bf16: never streamed through the ring
        # CPU attention on a GPU (host_attention): attention weights stay in host RAM beside the KV cache
        attention = sum(n for key, n in target.parts if key.kind == "attention")
        assert attention == 32 * (4096 * (4096 + 2 * 1024 + 4096) + 4096) * 2  # q, k, v, o + norm (GQA: 8 KV heads)
        host_weights = policy.memory["host"] - kv  # the "ram" tier: every target weight not resident, + attention
        streamed = host_weights - embedding - attention
        assert step.t_io == pytest.approx(streamed / profile.stream_bytes_per_s, rel=1e-9)
        assert step.t_step == pytest.approx(step.t_io, rel=1e-9)
        e = (1 - alpha ** (k + 1)) / (1 - alpha)
        assert step.tokens_per_s == pytest.approx(rows * e / step.t_io, rel=1e-9)
        assert policy.predicted_tokens_per_s < step.tokens_per_s  # the workload adds prefill passes
    assert result.best_where(lambda p: p.k >= 1).memory["device_footprint"] <= predict.DEVICE_MEMORY


def test_paper_scale_measured_profile_takes_the_gpu_checks_link_and_gemm() -> None:
    """h200_measured.json is derive_measured(docs/perf/gpu.json): the measured link rate and GEMM points replace
    the modelled ones, CPU attention's per-key term stays modelled, and a draft step at r rows costs the draft's
    FLOPs at the GEMM rate measured at r rows (+ KV read + launches), so it grows with rows."""
    from pathlib import Path

    from specoffload.planner.paper_scale.derive import DRAFT_LAUNCH_S, MEASURED_PROFILE_PATH, derive, derive_measured

    gpu = json.loads((Path(__file__).resolve().parent.parent / "docs" / "perf" / "gpu.json").read_text())
    measured = derive_measured(gpu)
    assert HardwareProfile.load(MEASURED_PROFILE_PATH) == measured  # the shipped file is what gpu.json gives
    link = gpu["realistic"]["link"]["h2d_pinned_GBps"] * 1e9
    assert measured.stream_bytes_per_s == link != derive().stream_bytes_per_s
    assert dict(measured.ffn_flops_per_s) == {int(r): f * 1e12 for r, f in gpu["realistic"]["gemm"].items()}
    assert measured.attention_fit[2] == derive().attention_fit[2]
    assert measured.attention_fit[1] == pytest.approx(2 * (2 * 32 * 128 + 2 * 8 * 128) / link)
    steps = dict(measured.draft_step_s)
    assert list(steps) == sorted(int(r) for r in gpu["realistic"]["gemm"])
    assert all(t > DRAFT_LAUNCH_S for t in steps.values()) and steps[2048] > 10 * steps[8]


def _resident_items(policy) -> str:  # noqa: ANN001
    """The device part of a policy's placement table."""
    return "\n".join(line for line in policy.placement_table.splitlines() if "  device  " in line)


def test_resident_layers_use_the_resident_gemm_rate() -> None:
    streamed = manual_placement((0, 1))  # layers 2 and 3 resident
    plain = make_profile(stream_bytes_per_s=8000.0, ffn_flops_per_s=((1, 800.0),))
    packed = make_profile(stream_bytes_per_s=8000.0, ffn_flops_per_s=((1, 800.0),),
                          resident_ffn_flops_per_s=((1, 1600.0),))
    a = estimate_step(plain, COSTS, streamed, batch=1, k=0, alpha=0.5, attended_len=8)
    b = estimate_step(packed, COSTS, streamed, batch=1, k=0, alpha=0.5, attended_len=8)
    assert a.t_ffn == pytest.approx(4 * 1.0)  # 800 FLOPs per layer at 800 FLOP/s
    assert b.t_ffn == pytest.approx(2 * 1.0 + 2 * 0.5)  # the two resident layers at twice the rate
    assert packed.ffn_rate(1) == 800.0 and packed.ffn_rate(1, resident=True) == 1600.0
    assert plain.ffn_rate(1, resident=True) == 800.0  # not measured: the streamed rate
    assert HardwareProfile.from_json(packed.to_json()) == packed
    with pytest.raises(ProfileError, match="resident_ffn_flops_per_s"):
        make_profile(resident_ffn_flops_per_s=((1, -1.0),))


# --- routed-expert loading -------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(experts=st.integers(2, 16), data=st.data())
def test_expected_distinct_experts_matches_monte_carlo(experts: int, data: st.DataObject) -> None:
    from specoffload.planner.experts import expected_distinct_experts

    top_k = data.draw(st.integers(1, experts))
    tokens = data.draw(st.integers(1, 40))
    rng = random.Random(experts * 1000 + top_k * 100 + tokens)
    trials = 400
    mean = sum(len({e for _ in range(tokens) for e in rng.sample(range(experts), top_k)})
               for _ in range(trials)) / trials
    assert expected_distinct_experts(experts, top_k, tokens) == pytest.approx(mean, abs=0.35)
    assert expected_distinct_experts(experts, top_k, 1) == pytest.approx(top_k)


def test_selected_expert_loading_cuts_the_predicted_bytes_of_a_small_pass() -> None:
    """8 experts, top-1, 2 tokens a pass: selected loading reads E[distinct] / 8 = (8 - 8 * (7/8)^2) / 8 of the
    experts' bytes; "all" reads every one; with the routers streamed it cannot select."""
    from specoffload.planner.experts import selects_experts

    shape = ModelShape("moe", ((PartKey("embedding"), 10), (PartKey("attention", 0), 10), (PartKey("router", 0), 1),
                               *((PartKey("expert", 0, e), 100) for e in range(8)), (PartKey("head"), 10)), 1, 4)
    policy = PlacementPolicy(batch_size=2, num_batches=1, kv_capacity=8, num_buffers=1, unified_memory=False)
    resident = {PartKey("attention", 0), PartKey("router", 0), PartKey("head")}
    placement = manual_placement_for(shape, policy, resident)
    costs = ModelCosts.from_shapes(shape, None, dtype_bytes=2, top_k=1)
    profile = make_profile(stream_bytes_per_s=100.0)
    selected = estimate_step(profile, costs, placement, 2, 0, 0.5, 4, expert_loading="selected")
    everything = estimate_step(profile, costs, placement, 2, 0, 0.5, 4, expert_loading="all")
    assert everything.t_io == pytest.approx(800 / 100)
    assert selected.t_io == pytest.approx(800 * (1 - (7 / 8) ** 2) / 100)
    assert selects_experts(placement, "auto", 8, 1, 2)  # 1.9 of 8 expected: fewer than 3/4
    assert not selects_experts(placement, "auto", 8, 1, 64)
    streamed_router = manual_placement_for(shape, policy, {PartKey("attention", 0)})
    assert not selects_experts(streamed_router, "selected", 8, 1, 2)


def manual_placement_for(shape: ModelShape, policy: PlacementPolicy, resident: set[PartKey]) -> Placement:
    """Every part of `shape` on the device if in `resident`, else on disk (the embedding rows are read there)."""
    tiers = {key: ("device" if key in resident else "disk") for key, _ in shape.parts}
    streamed = tuple(sorted({shape.num_layers if k.kind == "head" else k.layer for k, t in tiers.items()
                             if t == "disk" and k.kind != "embedding"}))
    return Placement(MappingProxyType(tiers), streamed, 1000, policy.num_buffers, policy, (), 0, 0)


def test_host_attention_prices_the_hidden_state_copies_in_the_chain() -> None:
    """Attention on the host beside a GPU: each layer's hidden states [rows, T, H] cross the link twice (a + b *
    bytes per copy, `hidden_link_fit`), on the chain between layers; the io and device terms do not change, and a
    placement with attention on the device (or a profile without the fit) copies nothing."""
    shape = replace(TARGET, hidden_bytes_per_token=100)
    costs = ModelCosts.from_shapes(shape, None, dtype_bytes=2)
    tiers = {key: ("disk" if key.kind == "dense_mlp" else "device") for key, _ in shape.parts}
    on_host = PlacementPolicy(batch_size=4, num_buffers=2, weights_tier="ram", unified_memory=False,
                              host_attention=True)
    placement = Placement(MappingProxyType(tiers), (0, 1, 2, 3), 800, 2, on_host, (), 0, 0)
    on_device = replace(placement, policy=replace(on_host, host_attention=False))
    gpu = dict(device="cuda", shared_compute=False, weights_tier="ram", stream_bytes_per_s=1e9)
    linked = make_profile(**gpu, hidden_link_fit=(0.01, 1e-4))
    plain = make_profile(**gpu)
    a = estimate_step(linked, costs, placement, batch=4, k=0, alpha=0.5, attended_len=8)
    b = estimate_step(plain, costs, placement, batch=4, k=0, alpha=0.5, attended_len=8)
    c = estimate_step(linked, costs, on_device, batch=4, k=0, alpha=0.5, attended_len=8)
    per_copy = 0.01 + 1e-4 * 4 * 100  # 4 rows x 1 token x 100 bytes
    assert a.t_link == pytest.approx(4 * 2 * per_copy) and b.t_link == 0.0 and c.t_link == 0.0
    assert a.t_chain == pytest.approx(b.t_chain + a.t_link)  # serial in the chain: every link waits for it
    assert (a.t_io, a.t_ffn, a.t_attention) == (b.t_io, b.t_ffn, b.t_attention)
    assert linked.hidden_link_seconds(0) == 0.0 and plain.hidden_link_seconds(1e6) == 0.0
    assert HardwareProfile.from_json(linked.to_json()) == linked
    with pytest.raises(ProfileError, match="hidden_link_fit"):
        make_profile(hidden_link_fit=(0.1, -1.0))
