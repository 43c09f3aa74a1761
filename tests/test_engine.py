"""Engine.generate against transformers' own greedy decoding of the target alone."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specoffload.runtime import Engine, EngineConfig, SamplingParams

# Prompts of different lengths (token ids on the tiny models' vocabulary).
PROMPTS = [
    [5, 17, 42, 99, 3, 250, 7],
    [11],
    [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312],
    [77, 66, 55],
    [1, 2, 3, 4, 5],
]
NEW_TOKENS = 12


def hf_greedy(path, prompts, new_tokens=NEW_TOKENS) -> list[list[int]]:
    """transformers generate(do_sample=False) of the target alone, one unpadded prompt at a time."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def references(tiny_models):
    return {name: hf_greedy(tiny_models[name], PROMPTS) for name in ("mixtral", "qwen2_moe", "llama")}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "llama"])
def test_plain_decoding_matches_transformers(tiny_models, references, family):
    # max_batch_size 2 < 5 prompts: finished rows are refilled from the queue (continuous batching).
    engine = Engine(EngineConfig(target=tiny_models[family], max_batch_size=2))
    results = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == references[family]
    assert [r.index for r in results] == list(range(len(PROMPTS)))
    assert all(r.num_drafted == 0 for r in results)


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_unrelated_draft_is_lossless(tiny_models, references, family, k):
    engine = Engine(EngineConfig(target=tiny_models[family], draft=tiny_models["draft"], num_draft_tokens=k,
                                 max_batch_size=3))
    results = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == references[family]
    assert sum(r.num_drafted for r in results) > 0


@pytest.mark.parametrize("k", [1, 3, 7])
def test_target_as_its_own_draft_accepts_everything(tiny_models, references, k):
    path = tiny_models["mixtral"]
    engine = Engine(EngineConfig(target=path, draft=path, num_draft_tokens=k, max_batch_size=4))
    results = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
    assert [r.token_ids for r in results] == references["mixtral"]
    drafted = sum(r.num_drafted for r in results)
    accepted = sum(r.num_accepted for r in results)
    # A draft identical to the target agrees with it (fp32; allow a rare near-tie flip).
    assert accepted >= 0.95 * drafted > 0
    # k + 1 tokens per step: far fewer steps than tokens.
    assert engine.last_stats is not None
    assert engine.last_stats.steps < len(PROMPTS) * NEW_TOKENS / 4 * (k + 1) / k


def test_stop_ids_and_eos(tiny_models, references):
    ref = references["llama"][0]
    stop = ref[4]
    engine = Engine(EngineConfig(target=tiny_models["llama"], draft=tiny_models["draft"], num_draft_tokens=3))
    (res,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS,
                                                          stop_token_ids=(stop,)))
    cut = ref.index(stop) + 1
    assert res.token_ids == ref[:cut]
    assert res.finish_reason == "stop"
    (res,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert res.token_ids == ref[:3] and res.finish_reason == "length"


def test_sampling_is_seeded_and_self_draft_accepts(tiny_models):
    path = tiny_models["qwen2_moe"]
    engine = Engine(EngineConfig(target=path, draft=path, num_draft_tokens=3, max_batch_size=5))
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert all(len(r.token_ids) == 10 for r in a)
    # p == q (same model): rejection sampling accepts with probability min(1, q/p) = 1.
    drafted = sum(r.num_drafted for r in a)
    assert sum(r.num_accepted for r in a) >= 0.95 * drafted


def test_bfloat16_is_lossless_and_close_to_float32(tiny_models):
    """bfloat16 keeps 8 mantissa bits, so its greedy tokens may differ from float32's at near-ties, never more.
    Speculation is lossless in exact arithmetic only: in bf16 a (k + 1)-token verify pass rounds differently
    from one-token steps, so plain and speculative bf16 runs may also part at near-ties. The test: teacher-forced
    through the float32 model, every greedy token of both bf16 runs is within TOL of the float32 top logit, with
    TOL = 2% of that position's logit range."""
    from specoffload.runtime.models.model import Transformer

    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    target = tiny_models["mixtral"]
    plain = Engine(EngineConfig(target=target, dtype="bfloat16")).generate(PROMPTS, params)
    spec = Engine(EngineConfig(target=target, draft=tiny_models["draft"], dtype="bfloat16",
                               num_draft_tokens=3)).generate(PROMPTS, params)
    assert sum(r.num_drafted for r in spec) > 0

    fp32 = Transformer(target, dtype=torch.float32)
    worst = 0.0
    for prompt, result in [*zip(PROMPTS, plain), *zip(PROMPTS, spec)]:
        ids = torch.tensor([prompt + result.token_ids[:-1]])
        with torch.inference_mode():
            logits = fp32.forward(ids, fp32.new_cache(1, ids.shape[1]))[0, len(prompt) - 1:]  # [new, vocab]
        chosen = logits[torch.arange(len(result.token_ids)), torch.tensor(result.token_ids)]  # [new]
        gap = (logits.max(dim=-1).values - chosen) / (logits.max(dim=-1).values - logits.min(dim=-1).values)
        worst = max(worst, gap.max().item())
    assert worst <= 0.02, f"a bf16 greedy token is {worst:.3f} of the logit range below float32's best"
