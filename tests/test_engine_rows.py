"""`Engine.generate` with one SamplingParams per prompt: each row gets exactly what its own parameters (and its key,
for its random stream) give when run alone with the same rows of its warping group (resident and offloaded)."""

from __future__ import annotations

import pytest

from specoffload.runtime import Engine, EngineConfig, SamplingParams

PROMPTS = [[5, 6, 7], [9, 4], [3, 8, 11, 2], [7], [12, 13]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
HOT = SamplingParams(max_new_tokens=5, temperature=1.0, seed=11, ignore_eos=True)


@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
def test_per_row_params_equal_running_each_group_alone(tiny_models, single_thread, offloaded):
    extra = dict(device_memory="1000KiB", max_seq_len=32, max_batch_size=2) if offloaded else {}
    engine = Engine(EngineConfig(tiny_models["llama"], draft=tiny_models["qwen2_draft"], num_draft_tokens=2, **extra))
    short = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)  # greedy too: same group as GREEDY
    stop = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(999,))  # greedy, stops on EOS
    per_row = [GREEDY, HOT, short, HOT, stop]
    mixed = engine.generate(PROMPTS, per_row)
    assert engine.last_stats.num_prompts == 5 and engine.last_stats.generated_tokens == 6 + 5 + 2 + 5 + len(
        mixed[4].token_ids)  # both groups' runs, summed
    greedy_rows = [0, 2, 4]
    alone_greedy = engine.generate([PROMPTS[i] for i in greedy_rows], [per_row[i] for i in greedy_rows])
    alone_hot = engine.generate([PROMPTS[1], PROMPTS[3]], HOT, keys=[1, 3])  # the rows' own keys
    assert [r.token_ids for r in mixed] == [alone_greedy[0].token_ids, alone_hot[0].token_ids,
                                            alone_greedy[1].token_ids, alone_hot[1].token_ids,
                                            alone_greedy[2].token_ids]
    assert [len(r.token_ids) for r in mixed[:4]] == [6, 5, 2, 5]
    assert [r.index for r in mixed] == list(range(5))
    assert engine.last_stats is not None and engine.last_stats.num_prompts == 2  # of the last call: HOT alone
    # One SamplingParams for all is unchanged behaviour: the same as the list of it.
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == \
        [r.token_ids for r in engine.generate(PROMPTS, [GREEDY] * len(PROMPTS))]
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(PROMPTS, [GREEDY])
    if offloaded:  # each decode pass is observed with the io thread's seconds in load ops (replan.py's stream rate)
        log = engine.replanner.pass_log
        assert log and all(seconds > 0 and load >= 0 for seconds, _, _, load in log)
        assert sum(load for *_, load in log) > 0 and engine.pipeline.load_seconds >= sum(load for *_, load in log)
    engine.close()


def test_a_stream_prices_the_prefill_share_at_the_running_mean_prompt(tiny_models):
    """`Engine.stream` reads rows lazily, so the replanner's mean prompt length (the prefill share of refilled rows)
    is the running mean of the prompts read so far, as `generate` sets it for its whole list."""
    from specoffload.runtime.config import EngineConfig
    from specoffload.runtime.engine import Engine
    from specoffload.runtime.sampling import SamplingParams

    engine = Engine(EngineConfig(tiny_models["llama"], device_memory="1GiB", max_batch_size=2, max_seq_len=32))
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    rows = [([1, 5, 6, 7], params, 0), ([1, 9], params, 1)]
    assert engine.replanner.prompt_len is None
    list(engine.stream(iter(rows)))
    assert engine.replanner.prompt_len == 3.0  # (4 + 2) / 2
