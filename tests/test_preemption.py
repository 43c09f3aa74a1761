"""Paged target KV placed by expected use: admission by free blocks and recompute preemption (issue 21 item 3).

A pool that holds fewer positions than the rows will use (`Plan.kv_expected_tokens` below their real use, the floor
of one full-length row per batch) forces the pipeline to preempt rows: each goes back to the queue and is fed again
whole later. Outputs must not change (greedy equal to the resident engine; a sampled row equal to its run without
preemption), no row may be lost, and every block must be back in the pool at the end.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specoffload.planner.plan import fixed_plan
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.offload.batches import Batches, PromptBudget
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS

TARGET = "qwen2_moe"


def paged_engine(tiny_models, draft: str | None, expected_tokens: int, max_seq_len: int = 24) -> Engine:  # noqa: ANN001
    """An offloaded engine whose pool is placed at `expected_tokens` positions per row (3 rows a batch, k = 3)."""
    config = EngineConfig(tiny_models[TARGET], draft=tiny_models[draft] if draft == "qwen2_draft" else draft,
                          max_batch_size=3, max_seq_len=max_seq_len, num_draft_tokens=3, device_memory="1GiB",
                          kv_block_size=4)
    k = 3 if draft else 0
    plan = replace(fixed_plan(3, k, max_seq_len), kv_expected_tokens=expected_tokens)
    return Engine(config, plan=plan)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("draft", [None, "qwen2_draft", "self"])
def test_preempted_rows_finish_with_the_resident_engines_greedy_tokens(tiny_models, resident_greedy, draft) -> None:
    engine = paged_engine(tiny_models, draft, expected_tokens=4)
    policy, attention = engine.placement.policy, engine.workers.attention
    # the pool is the floor, one full row (24 + k + 1 positions) per batch, not the rows' real use
    assert attention.pool.num_blocks == policy.kv_blocks == policy.num_batches * -(-engine.plan.kv_capacity // 4)
    out = engine.generate(OFFLOAD_PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    assert [r.token_ids for r in out] == resident_greedy(TARGET)
    assert engine.pipeline.batches.preempted > 0 and engine.last_stats.preempted == engine.pipeline.batches.preempted
    assert attention.free_blocks() == attention.pool.num_blocks


@pytest.mark.usefixtures("single_thread")
def test_a_sampled_row_is_the_same_with_and_without_preemption(tiny_models) -> None:
    """Random draws are per request (runtime/rng.py): a row fed again whole after preemption draws as it would
    have, so a roomy pool (no preemption) and a tight one give the same sampled rows."""
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11)
    roomy = paged_engine(tiny_models, "qwen2_draft", expected_tokens=0)
    tight = paged_engine(tiny_models, "qwen2_draft", expected_tokens=4)
    wide = [r.token_ids for r in roomy.generate(OFFLOAD_PROMPTS, params)]
    assert roomy.pipeline.batches.preempted == 0
    narrow = [r.token_ids for r in tight.generate(OFFLOAD_PROMPTS, params)]
    assert tight.pipeline.batches.preempted > 0
    assert narrow == wide


def test_a_pass_reserves_only_its_real_positions() -> None:
    """A ragged pass (one row decoding beside another's prompt chunk) takes the blocks of its real positions: the
    padded ones go to the sink block, so the blocks a pass needs are known before it runs."""
    import torch

    from specoffload.runtime.kv_blocks import BlockPool, OutOfBlocksError, PagedKVCache

    pool = BlockPool(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2)
    cache = PagedKVCache(pool, batch_size=2, capacity=16)
    assert cache.blocks_needed([1, 5]) == 1 + 3
    cache.reserve([1, 5])
    assert cache.blocks_held() == [1, 3] and pool.free_blocks == 0
    k = torch.arange(2 * 5 * 2, dtype=torch.float32).view(2, 1, 5, 2)  # [batch, kv_heads, T, dim]
    cache.write(0, k, k)  # row 0's 4 padded positions land in the sink, not in blocks it does not hold
    cache.advance(torch.tensor([1, 5]))
    keys, _ = cache.keys_values(0, 5)  # [batch, kv_heads, 5, dim]
    assert torch.equal(keys[0, 0, :1], k[0, 0, :1]) and torch.equal(keys[1, 0], k[1, 0])
    with pytest.raises(OutOfBlocksError):
        cache.reserve([2, 1])  # row 0 needs a second block: none is free, and nothing changed
    assert cache.blocks_held() == [1, 3]


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("draft", [None, "qwen2_draft"])
def test_a_batch_that_lost_rows_regrows(tiny_models, resident_greedy, draft) -> None:
    """After a preemption the batch runs with fewer rows; once rows finish and blocks are free it takes waiting
    requests into new rows again (no other row moves), so a long job does not run short for the rest of its life."""
    engine = paged_engine(tiny_models, draft, expected_tokens=4, max_seq_len=32)
    pipeline = engine.pipeline
    marks: list[int] = []
    original = Batches.preempt

    def spy(self, b):  # noqa: ANN001, ANN202
        marks.append(len(pipeline.verify_log))
        return original(self, b)

    prompts = OFFLOAD_PROMPTS * 3  # 21 requests: many wait while the first ones run
    try:
        Batches.preempt = spy
        out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
    finally:
        Batches.preempt = original
    assert [r.token_ids for r in out] == resident_greedy(TARGET) * 3
    assert marks, "no row was preempted: the pool is too roomy for this test"
    rows_after = [rows for _, b, _, rows in list(pipeline.verify_log)[marks[0]:] if b == 0]  # batch 0 from then
    first_short = next(i for i, rows in enumerate(rows_after) if rows < 3)
    assert 3 in rows_after[first_short:], rows_after  # ... and full again later


@pytest.mark.usefixtures("single_thread")
def test_preemption_over_the_wire_matches_the_local_backend(tiny_models, resident_greedy) -> None:
    """The Ray backend's wiring (roles over their sockets and arenas, served by threads here): reserve, preempt
    and regrow are worker calls like any other, and the draft role's own KV cache follows the batch."""
    from specoffload.actors.coordinator import RoleWorkers
    from tests.test_actors import InProcessGroup

    local = paged_engine(tiny_models, "qwen2_draft", expected_tokens=4)
    config, plan = local.config, local.plan
    local.close()
    roles = RoleWorkers(InProcessGroup(config, ["prefetch", "attention", "verifier", "draft"]))
    engine = Engine(config, plan=plan, workers=roles, recovery=roles)
    try:
        out = engine.generate(OFFLOAD_PROMPTS * 2, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True))
        assert [r.token_ids for r in out] == resident_greedy(TARGET) * 2
        assert engine.pipeline.batches.preempted > 0
        assert roles.proxies["attention"].free_blocks() == engine.placement.policy.kv_blocks
    finally:
        engine.close()
        roles.close()


class _Pool:
    """A paged attention worker's admission view: 4 positions a block, `free` blocks free."""

    def __init__(self, free: int) -> None:
        self.free = free

    def block_size(self) -> int:
        return 4

    def free_blocks(self) -> int:
        return self.free


@pytest.mark.parametrize(("prompts", "whole", "admitted"), [
    (PromptBudget(pace=1), False, 3),  # beside decoding rows: a first feed of 1 token + 1 position, 1 block each
    (PromptBudget(pace=1), True, 2),  # a batch's every row new: fed whole (8 + 1 positions, 3 blocks each)
    (PromptBudget(cap=1), True, 3),  # the user's cap holds on the first fill too
    (PromptBudget(), False, 2),  # no budget: whole prompts
])
def test_admission_counts_the_first_feed_the_pass_will_make(prompts, whole, admitted) -> None:
    from types import SimpleNamespace

    from specoffload.runtime.request import Request

    workers = SimpleNamespace(attention=_Pool(free=6))
    rows = [Request(i, list(range(1, 9)), 4, frozenset()) for i in range(3)]
    batches = Batches(workers, fixed_plan(3, 0, 24), rows, prompts=prompts)  # type: ignore[arg-type]
    assert batches._fit(3, whole=whole) == admitted


@given(st.one_of(st.none(), st.integers(1, 10**6)), st.one_of(st.none(), st.integers(1, 10**6)), st.booleans())
def test_a_prompt_budget_is_the_cap_where_set_else_the_pace_beside_decoding_rows(pace, cap, decoding) -> None:
    budget = PromptBudget(pace=pace, cap=cap).tokens(decoding)
    assert budget == (cap if cap is not None else pace if decoding else None)
    if cap is not None:  # the user's bound holds on every pass
        assert budget == PromptBudget(pace=pace, cap=cap).tokens(not decoding) == cap


def test_a_prompt_budget_below_one_token_is_refused() -> None:
    for bad in ({"pace": 0}, {"cap": -3}):
        with pytest.raises(ValueError, match="must be >= 1"):
            PromptBudget(**bad)
