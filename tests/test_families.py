"""The families added for issue 41 (Qwen3, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V2 / V3) through the whole engine: the
correctness table.

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
from tests.conftest import has_int4_kernel, offload_greedy, tight_config
from tests.test_engine import PROMPTS, hf_greedy

FAMILIES = ["qwen3", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3"]
MOES = ["qwen3_moe", "qwen3_moe_fused", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3"]

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
    assert engine.workers.drafter.copies > 0 or not has_int4_kernel()  # (int4 held dequantized: all resident)
    assert 0 < stats.num_accepted <= stats.num_drafted
    engine.close()


@pytest.mark.parametrize("target", ["qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"])
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
    (path / "config.json").write_text(json.dumps(raw | {"architectures": ["Glm4MoeForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="Glm4MoeForCausalLM.*supported: .*DeepseekV3ForCausalLM"):
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


def test_mla_caches_the_latent_and_rotary_key_as_transformers_does(tiny_models):
    """DeepSeek's KV cache holds one row per token and layer, the normalised latent c_kv and the rotated shared key
    (kv_lora_rank + qk_rope_head_dim values for all heads), equal to what transformers' own cache holds."""
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_models["deepseek_v3"]
    model = Transformer(path)
    cfg = model.config
    rank, rot = cfg.kv_lora_rank, cfg.head_dim
    ids = torch.tensor([[5, 9, 33, 70, 11, 4]])
    cache = model.new_cache(1, 8)
    model.forward(ids, cache)
    assert cache.k.shape[2:] == (1, 8, (rank + rot) // 2) == cache.v.shape[2:]
    shape = model.loader.shape("x")
    assert shape.kv_bytes_per_token == cfg.num_layers * (rank + rot) * 4  # float32: one row, nothing twice
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids, use_cache=True).past_key_values
    for layer in range(cfg.num_layers):
        keys, values = cache.keys_values(layer, ids.shape[1])  # [1, 1, T, half] each
        row = torch.cat([keys, values], dim=-1)[0, 0]  # [T, L + r]
        theirs = ref.layers[layer]
        for got, want in ((row[:, :rank], theirs.keys[0, 0]), (row[:, rank:], theirs.values[0, 0])):
            # float32 to 1e-4 of the tensor's scale (another CPU sums the projections in another order)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_deepseek_v3_next_token_layers_are_ignored_and_others_refused(tiny_models, tmp_path):
    """DeepSeek-V3 checkpoints carry multi-token-prediction layers after the last decoder layer: not part of the
    model (transformers skips them too); the same extra layer on DeepSeek-V2 is a config / weights mismatch."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from specoffload.runtime.models.errors import CheckpointError

    for family, accepted in (("deepseek_v3", True), ("deepseek_v2", False)):
        path = tmp_path / family
        shutil.copytree(tiny_models[family], path)
        tensors = load_file(path / "model.safetensors")
        tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        if accepted:
            Transformer(path)
        else:
            with pytest.raises(CheckpointError, match="model.layers.3.eh_proj.weight"):
                Transformer(path)


def test_deepseek_attention_quantized_keeps_kv_b_and_streams_losslessly(tiny_models, tmp_path):
    """`quantize --attention` compresses MLA's projections (q_a, q_b, kv_a, o) but not kv_b, which the attention
    multiplies per head; the compressed checkpoint runs offloaded exactly as it runs resident."""
    import torch

    from specoffload.runtime.formats import weight_format
    from specoffload.runtime.models.checkpoint import Checkpoint
    from specoffload.runtime.quantize import quantize_checkpoint

    out = tmp_path / "q"
    quantize_checkpoint(tiny_models["deepseek_v3"], out, weight_format("int8"), attention=True)
    ckpt = Checkpoint(out)
    attn = "model.layers.1.self_attn"
    assert all(ckpt.quantized(f"{attn}.{x}_proj.weight") is not None for x in ("q_a", "q_b", "o"))
    assert ckpt.quantized(f"{attn}.kv_a_proj_with_mqa.weight") is not None
    assert ckpt.quantized(f"{attn}.kv_b_proj.weight") is None
    ids = torch.tensor([[5, 9, 33, 70]])
    ours = Transformer(out).forward(ids, Transformer(out).new_cache(1, 8))
    base = Transformer(tiny_models["deepseek_v3"])
    ref = base.forward(ids, base.new_cache(1, 8))
    assert 0 < float((ours - ref).abs().max() / ref.abs().max()) < 0.05
    resident = Engine(EngineConfig(target=out, max_batch_size=3))
    want = [r.token_ids for r in resident.generate([[1, 5, 9], [1, 6, 9, 35]],
                                                   SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))]
    offloaded = Engine(tight_config(out))
    got = [r.token_ids for r in offloaded.generate([[1, 5, 9], [1, 6, 9, 35]],
                                                   SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))]
    assert offloaded.placement.streamed_layers and got == want
    offloaded.close()
