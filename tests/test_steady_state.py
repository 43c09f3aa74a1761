"""The planner prices the steady state of refilled batches (issue 21, item 6): tokens per row per pass from the
acceptance curve (one at a row's prefill pass), rows finishing and replaced per pass, the prefill share of a pass;
the per-pass prompt token budget it sets (`Plan.prefill_chunk`); the runtime carrying both. Literal numbers on the
synthetic 4-layer model of tests/test_planner.py."""

from __future__ import annotations

import math

import pytest

from specoffload.planner import SearchSpace, Workload, estimate_workload, replan, search
from specoffload.planner.acceptance import AcceptanceCurve, mean_rounds, rounds_for_slowest
from specoffload.planner.cost import steady_pass
from specoffload.planner.plan import fixed_plan, planned
from tests.test_planner import COSTS, DRAFT, TARGET, GiB, make_profile, manual_placement

#: every mlp streamed; attention costs 0.01 s per query per layer (so the padding of a prefill pass shows)
PLACEMENT = manual_placement((0, 1, 2, 3))
#: 16 prompts of 4 tokens, 9 new tokens each: with 2 rows per batch and k = 1, prompts wait for slots
WORKLOAD = Workload(num_prompts=16, prompt_len=4, new_tokens=9)


def profile(stream_bytes_per_s: float) -> object:
    return make_profile(stream_bytes_per_s=stream_bytes_per_s, attention_fit=(0.0, 0.01, 0.0))


def test_steady_pass_by_hand() -> None:
    # alpha 0.5, k = 1: a decode round commits 1.5 tokens (variance 0.25); a row's 8 tokens after its prefill pass
    # take R = 8 / 1.5 + (0.25 + 2.25 - 1.5) / (2 x 2.25) = 50 / 9 rounds (acceptance.py `mean_rounds`)
    steady = steady_pass(profile(8000.0), COSTS, PLACEMENT, 2, 1, 0.5, WORKLOAD)
    assert steady.rounds == pytest.approx(50 / 9)
    assert steady.tokens_per_row == pytest.approx(9 / (1 + 50 / 9))  # = 81 / 59: N / (1 + R)
    assert steady.starts == pytest.approx(18 / 59)  # rows / (1 + R) finish, and prompts start, per pass
    assert steady.prefill_tokens == pytest.approx(72 / 59)  # x 4 prompt tokens
    # decode pass (4 tokens fed): attention 4 x 0.04, ffn 4 x 0.4, head 0.2, draft 1 x draft_seconds(2) = 0.4,
    # on shared cores: 2.36 s, over the io (4 x 0.1 s)
    assert steady.decode.t_step == pytest.approx(2.36) and steady.decode.bound == "compute"
    # + the prefill share: ffn on 72/59 more tokens (0.4 s per token over 4 layers), 18/59 of the passes add the
    # 4-token prompt's own attention (4 queries: + 0.04 s per layer; the decode rows are not padded to it), the
    # draft prefills the prompt then (draft_seconds(4) = 0.8 s)
    t_pass = 2.36 + 0.4 * 72 / 59 + 4 * 0.04 * 18 / 59 + 0.8 * 18 / 59
    assert t_pass == pytest.approx(2.36 + 46.08 / 59)
    assert steady.step.t_step == pytest.approx(t_pass) and steady.step.bound == "compute"
    assert steady.step.tokens_per_s == pytest.approx(2 * 81 / 59 / t_pass)
    assert steady.step.t_io == steady.decode.t_io == pytest.approx(0.4)  # the io is a decode pass's

    whole = estimate_workload(profile(8000.0), COSTS, PLACEMENT, 2, 1, 0.5, WORKLOAD, refill=True)
    assert whole.steady == steady and whole.step == steady.step
    # num_prompts (1 + R) / rows steady passes, and each of the 2 batches' drain: half the rounds of the slowest
    # of its 2 rows run to the 9-token cap
    drain = 2 * rounds_for_slowest(0.5, 1, 8, 2) / 2
    assert 8 / 1.5 < rounds_for_slowest(0.5, 1, 8, 2) <= 8  # slower than a mean row, at most one token a round
    passes = 16 * (59 / 9) / 2 + drain
    assert whole.total_s == pytest.approx(passes * t_pass)
    assert whole.tokens_per_s == pytest.approx(16 * 9 / (passes * t_pass))  # below the steady 2 x 81/59 / t_pass
    assert whole.tokens_per_s < 2 * 81 / 59 / t_pass
    assert whole.decode_s == pytest.approx(passes * 2.36)
    assert whole.prefill_s == pytest.approx(passes * 46.08 / 59)
    assert whole.decode_steps == round(passes)


def test_steady_pass_takes_the_curve_and_no_drafts_at_a_rows_first_verify() -> None:
    curve = AcceptanceCurve((0.6, 0.4), 0.5)  # E(2) = 1 + 0.6 + 0.24 = 1.84
    steady = steady_pass(profile(8000.0), COSTS, PLACEMENT, 2, 2, curve, WORKLOAD)
    assert steady.rounds == pytest.approx(mean_rounds(curve, 2, 8))
    assert 8 / 1.84 < steady.rounds < 8 / 1.84 + 1
    assert steady.tokens_per_row == pytest.approx(9 / (1 + steady.rounds))
    plain = steady_pass(profile(8000.0), COSTS, PLACEMENT, 2, 0, 0.5, WORKLOAD)
    assert plain.rounds == 8 and plain.tokens_per_row == 1.0  # k = 0: one token per pass, the prefill's too
    # the mean output length (rows stopping at EOS) sets the rate of finishing rows
    short = steady_pass(profile(8000.0), COSTS, PLACEMENT, 2, 0, 0.5,
                        Workload(num_prompts=16, prompt_len=4, new_tokens=9, mean_new_tokens=3))
    assert short.starts == pytest.approx(2 / 3) and short.prefill_tokens == pytest.approx(8 / 3)


def test_waves_unchanged_and_no_refill_without_waiting_prompts() -> None:
    waves = estimate_workload(profile(8000.0), COSTS, PLACEMENT, 2, 1, 0.5, WORKLOAD)
    assert waves == estimate_workload(profile(8000.0), COSTS, PLACEMENT, 2, 1, 0.5, WORKLOAD, refill=False)
    assert waves.steady is None
    few = Workload(num_prompts=4, prompt_len=4, new_tokens=9)  # two batches of two rows hold every prompt
    assert (estimate_workload(profile(8000.0), COSTS, PLACEMENT, 2, 1, 0.5, few, refill=True)
            == estimate_workload(profile(8000.0), COSTS, PLACEMENT, 2, 1, 0.5, few))
    # waves count the tokens rows actually generate
    stopping = Workload(num_prompts=16, prompt_len=4, new_tokens=9, mean_new_tokens=4.5)
    assert (estimate_workload(profile(8000.0), COSTS, PLACEMENT, 2, 1, 0.5, stopping).tokens_per_s
            == pytest.approx(waves.tokens_per_s / 2))


def test_workload_mean_new_tokens() -> None:
    assert WORKLOAD.mean_new_tokens == 9.0
    assert Workload.of_prompts([3, 5], 10, mean_new_tokens=6).mean_new_tokens == 6.0
    with pytest.raises(ValueError, match="mean_new_tokens"):
        Workload(num_prompts=1, prompt_len=4, new_tokens=9, mean_new_tokens=10)


def test_prefill_chunk_follows_its_rule() -> None:
    # io 8 s per pass (4 x 800 B at 400 B/s) over 2.36 s of decode compute: 5.64 s of headroom; a prompt token
    # adds (46.08 / 59) / (72 / 59) = 0.64 s of compute: floor(5.64 / 0.64) = 8 tokens
    slow = steady_pass(profile(400.0), COSTS, PLACEMENT, 2, 1, 0.5, WORKLOAD)
    assert slow.decode.t_io == pytest.approx(8.0) and slow.decode.t_compute == pytest.approx(2.36)
    assert slow.step.t_step == pytest.approx(8.0) and slow.step.bound == "io"
    assert slow.prefill_chunk == 8 == math.floor((8.0 - 2.36) / 0.64)
    # no headroom (compute-bound): the prompt tokens a pass must take, ceil(72 / 59)
    assert steady_pass(profile(8000.0), COSTS, PLACEMENT, 2, 1, 0.5, WORKLOAD).prefill_chunk == 2
    # nothing streams: no io to hide a prefill under, no budget
    assert steady_pass(profile(400.0), COSTS, manual_placement(()), 2, 1, 0.5, WORKLOAD).prefill_chunk is None


#: an io-bound machine whose draft costs little; 256 prompts of 8 tokens, 16 new tokens each
IO_BOUND = make_profile(stream_bytes_per_s=100.0, ffn_flops_per_s=((1, 1e6),), draft_step_s=((1, 0.01),))
MANY = Workload.of_prompts([8] * 256, 16)


def _search(alpha: AcceptanceCurve, refill: bool):  # noqa: ANN202
    return search(IO_BOUND, SearchSpace(TARGET, DRAFT, MANY, alpha=alpha, device_memory=4200, host_memory=GiB,
                                        batches=(1, 2, 4, 8), ks=range(0, 7), unified_memory=False, refill=refill))


def test_refill_speculates_where_the_slowest_row_made_waves_expensive() -> None:
    spread = AcceptanceCurve((0.8,), 0.8, spread=0.3)  # prompts' own acceptance rates differ widely
    waves, steady = _search(spread, refill=False).best, _search(spread, refill=True).best
    # in waves the slowest of 8 rows (a prompt at 0.8 - 1.4 x 0.3) sets every wave's rounds: speculation loses
    assert (waves.batch, waves.k, waves.refill, waves.prefill_chunk) == (8, 0, False, None)
    assert waves.predicted_tokens_per_s == pytest.approx(1 / 3, rel=1e-3)
    # refilled, no row waits for the slowest: 4 drafts a round pay
    assert (steady.batch, steady.k, steady.refill) == (8, 4, True)
    assert steady.predicted_tokens_per_s == pytest.approx(0.466, abs=1e-3)  # (0.491 steady, less the drain)
    assert steady.estimate is not None and steady.estimate.steady is not None
    assert steady.prefill_chunk == steady.estimate.steady.prefill_chunk == 3267
    # without the spread, waves speculate as well: it was the slowest row that made them expensive
    assert _search(AcceptanceCurve((0.8,), 0.8), refill=False).best.k == 4

    plan = planned(_search(spread, refill=True), max_seq_len=32, auto_k=False)
    assert (plan.batch, plan.k, plan.refill, plan.prefill_chunk) == (8, 4, True, 3267)
    assert planned(_search(spread, refill=False), max_seq_len=32, auto_k=False).prefill_chunk is None


def test_replan_with_refill_drops_the_slowest_row() -> None:
    from specoffload.planner import ModelCosts
    from specoffload.planner.placement import PlacementPolicy, place
    from tests.test_acceptance_planning import DRAFT as DRAFT_A
    from tests.test_acceptance_planning import PROFILE
    from tests.test_acceptance_planning import TARGET as TARGET_A

    policy = PlacementPolicy(batch_size=2, num_batches=2, kv_capacity=48, weights_tier="disk", unified_memory=False)
    placement = place(TARGET_A, DRAFT_A, policy, 4200, GiB)
    costs = ModelCosts.from_shapes(TARGET_A, DRAFT_A)
    curve = AcceptanceCurve((0.95,), 0.95, 0.1)
    tail = replan(PROFILE, costs, placement, 2, curve, 40, k_max=6, merged_rows=4, tokens=32)
    steady = replan(PROFILE, costs, placement, 2, curve, 40, k_max=6, merged_rows=4, tokens=32, refill=True)
    assert steady.tokens_per_s > tail.tokens_per_s and steady.k >= tail.k
    decode = steady_pass(PROFILE, costs, placement, 2, steady.k, curve,
                         Workload(num_prompts=1, prompt_len=1, new_tokens=32), attended_len=40).decode
    assert steady.tokens_per_s == pytest.approx(decode.tokens_per_s)
    prefilled = replan(PROFILE, costs, placement, 2, curve, 40, k_max=6, merged_rows=4, tokens=32, refill=True,
                       prompt_len=30)
    assert prefilled.tokens_per_s < steady.tokens_per_s  # the prompts of replacement rows cost compute


def test_warmup_mean_output_len() -> None:
    from specoffload.runtime.warmup import mean_output_len

    rows = [(10, True), (32, False), (5, True), (32, False)]  # two stopped, two cut at the warm-up's 32 tokens
    hazard = 2 / 79  # stops / tokens generated
    assert mean_output_len(rows, 256, 32) == pytest.approx((1 - (1 - hazard) ** 256) / hazard)
    assert mean_output_len(rows, 20, 32) == pytest.approx(79 / 4)  # the warm-up ran the job's whole length
    assert mean_output_len([(32, False), (32, False)], 256, 32) == 256.0  # nobody stopped


def test_plans_carry_refill_and_the_prefill_chunk(tiny_models) -> None:
    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine
    from specoffload.runtime.offload.batches import PromptBudget
    from specoffload.runtime.planning import ModelPair, make_plan

    path = tiny_models["llama"]
    pair = ModelPair(TARGET, DRAFT, model_context=64, dtype_bytes=2)
    config = EngineConfig(path, draft=path, device_memory=4200, max_seq_len=32, max_batch_size="auto",
                          num_draft_tokens="auto")
    plan = make_plan(config, pair, 32, workload=MANY, alpha=AcceptanceCurve((0.8,), 0.8, 0.3), profile=IO_BOUND)
    assert plan.refill and plan.policy is not None and plan.policy.refill
    assert plan.prefill_chunk is not None and plan.prefill_chunk == plan.policy.prefill_chunk
    waves = make_plan(EngineConfig(path, draft=path, device_memory=4200, max_seq_len=32, max_batch_size="auto",
                                   num_draft_tokens="auto", refill=False),
                      pair, 32, workload=MANY, alpha=AcceptanceCurve((0.8,), 0.8, 0.3), profile=IO_BOUND)
    assert not waves.refill and waves.prefill_chunk is None
    fixed = make_plan(EngineConfig(path, max_batch_size=2, refill=False), pair, 32)
    assert (fixed.refill, fixed.prefill_chunk) == (False, None)

    base = dict(max_batch_size=2, max_seq_len=48, num_draft_tokens=0, device_memory="1GiB", replan_interval=0)
    chunked = fixed_plan(2, 0, 48, prefill_chunk=3)
    engine = Engine(EngineConfig(path, **base), plan=chunked)
    try:
        assert engine.pipeline.prompts == PromptBudget(pace=3)  # the plan's: paces prompts beside decoding rows
    finally:
        engine.close()
    engine = Engine(EngineConfig(path, prefill_chunk=5, **base), plan=chunked)
    try:
        assert engine.pipeline.prompts == PromptBudget(pace=3, cap=5)  # the config's caps every pass
        assert engine.pipeline.prompts.tokens(decoding=True) == engine.pipeline.prompts.tokens(decoding=False) == 5
    finally:
        engine.close()


def test_a_pass_carrying_a_prompt_is_priced_on_its_own() -> None:
    # io-bound decode passes (8 s of io over 2.36 s of compute): a 4-token prompt fits under a pass's io, so the
    # mean pass is the io; a 16-token prompt does not (its pass computes ~12 s): the 18/59 passes carrying one
    # cost their compute, the rest their io. Priced at the average pass (4.9 prompt tokens each, under the io)
    # the job would look io-bound, 8 s a pass.
    small = steady_pass(profile(400.0), COSTS, PLACEMENT, 2, 1, 0.5, WORKLOAD)
    assert small.step.t_step == pytest.approx(8.0)
    long = Workload(num_prompts=16, prompt_len=16, new_tokens=9)
    big = steady_pass(profile(400.0), COSTS, PLACEMENT, 2, 1, 0.5, long)
    assert big.decode.t_step == pytest.approx(8.0) and big.starts == pytest.approx(18 / 59)
    carrying = (big.step.t_step - (1 - big.starts) * 8.0) / big.starts  # the carrying pass's own seconds
    assert carrying > 8.0 + 0.4 * 16 * 0.5  # its compute: 2.36 + 6.4 (ffn) + its attention and draft, over the io
    assert big.step.t_step > 8.0 + 1.0
    assert big.step.tokens_per_s == pytest.approx(2 * big.tokens_per_row / big.step.t_step)
