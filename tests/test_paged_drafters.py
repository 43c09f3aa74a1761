"""Every drafter over block KV equals the contiguous-KV run (issue 39, case 2).

A drafter that drafts into the target's paged cache (self, lowbit) writes through a scratch view that grows as the
target's cache does; one with its own cache (model) or none (ngram, suffix) never touches the pool. Greedy tokens
with block KV equal the contiguous run's over drafters x block sizes x ragged prompt lengths x budgets.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specoffload.runtime import Engine, EngineConfig, SamplingParams


@pytest.mark.usefixtures("single_thread")
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drafter=st.sampled_from(["self", "lowbit", "model", "ngram", "suffix", "none"]),
       block=st.sampled_from([1, 3, 4, 16]),
       lengths=st.lists(st.integers(1, 44), min_size=1, max_size=10), tight=st.booleans(),
       k=st.integers(1, 4), batch=st.integers(1, 4), seed=st.integers(0, 2**16))
@example(drafter="self", block=4, lengths=[43, 2, 30, 17, 5, 44, 9, 21, 3, 38], tight=False, k=3, batch=4, seed=0)
def test_block_kv_equals_contiguous_kv_for_every_drafter(tiny_models, drafter, block, lengths, tight, k, batch,
                                                         seed) -> None:
    """tight: the budget is the smallest that places the plan (the pool has the blocks of one full batch per
    batch in flight: rows wait, or are preempted, for blocks), else 1 GiB."""
    import random

    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    extra = {"draft": tiny_models["qwen2_draft"]} if drafter == "model" else {}
    config = EngineConfig(tiny_models["qwen2_moe"], drafter=drafter, max_batch_size=batch, num_draft_tokens=k,
                          device_memory="1GiB", kv_block_size=block, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    if tight:
        roomy = Engine(config)
        config = replace(config, device_memory=roomy.minimum_device_memory())
        roomy.close()
    paged = Engine(config)
    got = [r.token_ids for r in paged.generate(prompts, params)]
    attention = paged.workers.attention
    assert attention.free_blocks() == attention.pool.num_blocks  # every block back in the pool
    paged.close()
    contiguous = Engine(replace(config, kv_block_size=0))
    assert got == [r.token_ids for r in contiguous.generate(prompts, params)]
    contiguous.close()
