"""The families added for issue 41 (Qwen3, Qwen3-MoE, OLMoE, gpt-oss) through the whole engine: the correctness table.

Layer-level agreement with transformers (fp32 logits within 1e-4) is in test_models.py. Here each family runs
through the Engine: resident greedy equals transformers' greedy; offloaded at the smallest budget (contiguous and
block KV) equals the resident engine; self-drafting and the low-bit self-draft on the MoEs, and a dense Qwen3 as a
separate draft, are lossless.
"""

from __future__ import annotations

import pytest

from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.models.errors import UnsupportedModelError
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import offload_greedy, tight_config
from tests.test_engine import PROMPTS, hf_greedy

FAMILIES = ["qwen3", "qwen3_moe", "olmoe", "gpt_oss"]
MOES = ["qwen3_moe", "qwen3_moe_fused", "olmoe", "gpt_oss"]

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("family", FAMILIES)
def test_resident_greedy_matches_transformers(tiny_models, family):
    engine = Engine(EngineConfig(target=tiny_models[family], max_batch_size=2))
    results = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12))
    assert [r.token_ids for r in results] == hf_greedy(tiny_models[family], PROMPTS)


@pytest.mark.parametrize("kv", [{}, {"kv_block_size": 4}], ids=["contiguous", "block-kv"])
@pytest.mark.parametrize("family", [*FAMILIES, "qwen3_moe_fused"])
def test_offloaded_at_the_minimum_budget_matches_resident(tiny_models, resident_greedy, family, kv):
    out, engine = offload_greedy(tight_config(tiny_models[family], **kv))
    assert engine.placement.streamed_layers, "the smallest budget must stream something"
    assert engine.last_stats.bytes_read > 0
    assert out == resident_greedy(family)
    engine.close()


@pytest.mark.parametrize("target", MOES)
def test_self_draft_is_lossless(tiny_models, resident_greedy, target):
    config = tight_config(tiny_models[target], draft="self",
                          drafter_options={"resident_experts": 4, "migrate_interval": 2})
    out, engine = offload_greedy(config)
    assert out == resident_greedy(target)
    assert engine.last_stats.num_drafted > 0 and engine.last_stats.expert_picks > 0
    engine.close()


@pytest.mark.parametrize("target", [*FAMILIES, "qwen3_moe_fused"])
def test_lowbit_self_draft_is_lossless(tiny_models, resident_greedy, target):
    out, engine = offload_greedy(tight_config(tiny_models[target], drafter="lowbit"))
    assert out == resident_greedy(target)
    stats = engine.last_stats
    assert engine.workers.drafter.copies > 0 and 0 < stats.num_accepted <= stats.num_drafted
    engine.close()


@pytest.mark.parametrize("target", ["qwen3_moe", "olmoe", "gpt_oss"])
def test_dense_qwen3_drafts_for_the_moes(tiny_models, resident_greedy, target):
    config = EngineConfig(target=tiny_models[target], draft=tiny_models["qwen3"], max_batch_size=3, max_seq_len=48,
                          num_draft_tokens=3)
    out, engine = offload_greedy(config)
    assert out == resident_greedy(target) and engine.last_stats.num_drafted > 0
    engine.close()


def test_an_unsupported_family_is_refused_naming_the_supported_ones(tiny_models, tmp_path):
    import json
    import shutil

    path = tmp_path / "other"
    shutil.copytree(tiny_models["qwen3"], path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"architectures": ["DeepseekV2ForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="DeepseekV2ForCausalLM.*supported: .*GptOssForCausalLM"):
        Transformer(path)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_gpt_oss_lowbit_copies_its_transposed_experts(tiny_models, fmt):
    """gpt-oss stores its experts as x @ W ([in, out], gate and up interleaved): the low-bit copy holds the [out, in]
    matrices, keeps the biases as stored, and computes the expert within the format's rounding."""
    import torch

    from specoffload.planner.shapes import PartKey
    from specoffload.runtime.formats import weight_format
    from specoffload.runtime.models import layers
    from specoffload.runtime.offload.drafters.lowbit import lowbit_part

    model = Transformer(tiny_models["gpt_oss"])
    key = PartKey("expert", 1, 5)
    stored = model.loader.load(key)
    copy = lowbit_part(model.loader, key, weight_format(fmt, 32 if fmt == "int4" else None))
    for bias in ("gate_bias", "up_bias", "down_bias"):
        assert torch.equal(getattr(copy, bias), getattr(stored, bias))
    x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want, got = layers.expert_mlp(model.config, x, stored), layers.expert_mlp(model.config, x, copy)
    assert float((got - want).abs().max() / want.abs().max()) < (0.02 if fmt == "int8" else 0.2)
    assert not torch.equal(got, want)  # a copy, not the stored weights
