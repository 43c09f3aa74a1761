"""Build tiny random HF checkpoints (seconds, no hub) for tests and local runs.

All models share one 512-token vocabulary (bos 1, eos 2) so any of them can draft for any other. Weights are
N(0, 0.2) so greedy decoding does not collapse onto one token. Seeds are fixed: same output every run.

    python -m scripts.make_tiny_models OUT_DIR [NAME ...]
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB_SIZE = 512
BOS_ID, EOS_ID = 1, 2
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)


def _mixtral() -> PretrainedConfig:
    return MixtralConfig(
        **_COMMON, intermediate_size=96, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2
    )


_QWEN2_MOE = dict(
    _COMMON,
    intermediate_size=128,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_hidden_layers=3,
    num_experts=4,
    num_experts_per_tok=2,
)


def _qwen2_moe(norm_topk_prob: bool = False) -> PretrainedConfig:
    """Shared expert; layer 1 dense (mlp_only_layers); YaRN RoPE (attention scaling != 1)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 256}
    return Qwen2MoeConfig(
        **_QWEN2_MOE,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=[1],
        rope_parameters=rope,
    )


def _qwen2_moe_windowed() -> PretrainedConfig:
    """norm_topk_prob, decoder_sparse_step 2 (only layer 1 sparse), sliding window 4 on layers 0 and 2."""
    return Qwen2MoeConfig(
        **_QWEN2_MOE,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=3,
    )


def _llama() -> PretrainedConfig:
    """Untied head, q/k/v/o biases, llama3 RoPE."""
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return LlamaConfig(**_COMMON, intermediate_size=128, num_hidden_layers=2, attention_bias=True, rope_parameters=rope)


def _llama_tied() -> PretrainedConfig:
    """Tied head, multi-query attention, head_dim (32) decoupled from hidden / heads (16)."""
    cfg = dict(_COMMON, num_key_value_heads=1)
    return LlamaConfig(**cfg, intermediate_size=128, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True)


def _qwen2_draft() -> PretrainedConfig:
    return Qwen2Config(**_COMMON, intermediate_size=96, num_hidden_layers=2, tie_word_embeddings=True)


def _draft_other_vocab() -> PretrainedConfig:
    """A draft on a different (smaller) vocabulary: must be refused as a draft for the others."""
    cfg = dict(_COMMON, vocab_size=300)
    return Qwen2Config(**cfg, intermediate_size=96, num_hidden_layers=1, tie_word_embeddings=True)


def _mistral() -> PretrainedConfig:
    """Sliding window 4 on every layer, linear RoPE scaling."""
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    return MistralConfig(**_COMMON, intermediate_size=96, num_hidden_layers=2, sliding_window=4, rope_parameters=rope)


def _qwen3() -> PretrainedConfig:
    """q/k norms per head, head_dim (32) decoupled from hidden / heads, q/k/v/o biases, tied head, sliding window 4
    on layer 1 (max_window_layers 1)."""
    return Qwen3Config(**_COMMON, intermediate_size=96, num_hidden_layers=2, head_dim=32, attention_bias=True,
                       tie_word_embeddings=True, use_sliding_window=True, sliding_window=4, max_window_layers=1)


def _qwen3_moe() -> PretrainedConfig:
    """Fine-grained MoE: 16 experts of width 16, top 4, renormalised; q/k norms per head; layer 1 dense."""
    return Qwen3MoeConfig(**_COMMON, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
                          num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1])


def _qwen2_256() -> PretrainedConfig:
    """Rows of whole 256-input blocks (GGUF's k-quants: tests/test_gguf.py), untied head, q/k/v biases."""
    cfg = dict(_COMMON, hidden_size=256)
    return Qwen2Config(**cfg, intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=False)


def _qwen3_moe_256() -> PretrainedConfig:
    """A Qwen3-MoE of 256-wide rows (GGUF's k-quants), 8 experts of width 256, top 2, tied head."""
    cfg = dict(_COMMON, hidden_size=256)
    return Qwen3MoeConfig(**cfg, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=2, head_dim=64,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True)


def _qwen2_moe_256() -> PretrainedConfig:
    """A Qwen2-MoE of 256-wide rows (GGUF's k-quants): 4 experts of width 256, top 2, not renormalised (llama.cpp's
    qwen2moe graph), a shared expert with its sigmoid gate, untied head."""
    cfg = dict(_COMMON, hidden_size=256)
    return Qwen2MoeConfig(**cfg, intermediate_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                          num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                          tie_word_embeddings=False)


def _olmoe() -> PretrainedConfig:
    """16 experts of width 24, top 4, not renormalised; q/k norms over the whole projection; q, k, v clipped."""
    return OlmoeConfig(**_COMMON, intermediate_size=24, num_hidden_layers=2, num_experts=16, num_experts_per_tok=4,
                       clip_qkv=1.5)


def _gpt_oss() -> PretrainedConfig:
    """8 experts of width 32, top 2 (top-k logits, then their softmax); attention sinks; sliding window 4 on the even
    layers; q/k/v/o, router and expert biases; clamped SwiGLU; YaRN RoPE."""
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 256}
    return GptOssConfig(**_COMMON, head_dim=16, intermediate_size=32, num_hidden_layers=2, num_local_experts=8,
                        num_experts_per_tok=2, sliding_window=4, rope_parameters=rope, swiglu_limit=1.0)


#: multi-head latent attention at tiny size: latent 32, rotary 8, 16 + 16 query-key / value dims per head
_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def _deepseek_v2() -> PretrainedConfig:
    """DeepSeek-V2(-Lite)-like: q in one projection, layer 0 dense, 8 experts of width 24 in 2 groups (top 2 within
    the group of the best expert), a shared expert, routed weights scaled 1.5, YaRN RoPE with mscale (so a scaled
    softmax)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 256}
    return DeepseekV2Config(**_COMMON | {"num_key_value_heads": 4}, **_MLA, q_lora_rank=None, intermediate_size=96,
                            moe_intermediate_size=24, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                            n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2,
                            topk_group=1, routed_scaling_factor=1.5, rope_parameters=rope)


def _deepseek_v3() -> PretrainedConfig:
    """DeepSeek-V3-like: q through a rank-24 latent, layer 0 dense, 8 experts of width 24 in 4 groups, sigmoid scores
    with a correction bias, renormalised, scaled 2.5, a shared expert, interleaved RoPE."""
    return DeepseekV3Config(**_COMMON | {"num_key_value_heads": 4}, **_MLA, q_lora_rank=24, intermediate_size=96,
                            moe_intermediate_size=24, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                            n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, norm_topk_prob=True)


_MODEL_CLASS: dict[str, type[PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
}

# name -> (config factory, seed, save options)
TINY_MODELS: dict[str, tuple[Callable[[], PretrainedConfig], int, dict]] = {
    "mixtral": (_mixtral, 1, {}),
    "mixtral_fused": (_mixtral, 1, {"save_original_format": False}),  # same weights, fused expert tensors
    "qwen2_moe": (_qwen2_moe, 2, {}),
    "qwen2_moe_fused": (_qwen2_moe, 2, {"save_original_format": False}),
    "qwen2_moe_windowed": (_qwen2_moe_windowed, 3, {}),
    "llama": (_llama, 4, {}),
    "llama_sharded": (_llama, 4, {"max_shard_size": "40KB"}),  # same weights, several shards + index
    "llama_tied": (_llama_tied, 5, {}),
    "qwen2_draft": (_qwen2_draft, 6, {}),
    "mistral": (_mistral, 7, {}),
    "draft_other_vocab": (_draft_other_vocab, 8, {}),
    "qwen3": (_qwen3, 9, {}),
    "qwen3_moe": (_qwen3_moe, 10, {}),
    "qwen3_moe_fused": (_qwen3_moe, 10, {"save_original_format": False}),
    "olmoe": (_olmoe, 11, {}),
    "gpt_oss": (_gpt_oss, 12, {}),
    "qwen2_256": (_qwen2_256, 13, {}),  # the GGUF tests' models (tests/test_gguf.py)
    "qwen3_moe_256": (_qwen3_moe_256, 14, {}),
    "qwen2_moe_256": (_qwen2_moe_256, 17, {}),
    "deepseek_v2": (_deepseek_v2, 15, {}),
    "deepseek_v3": (_deepseek_v3, 16, {}),
}

#: extra names for the same checkpoint (tests elsewhere ask for "draft")
ALIASES = {"draft": "qwen2_draft"}


def build(name: str, out_dir: Path) -> Path:
    """Build one tiny model into out_dir/name (replacing what is there) and return its path."""
    make_config, seed, save_options = TINY_MODELS[name]
    config = make_config()
    torch.manual_seed(seed)
    model = _MODEL_CLASS[config.model_type](config).eval()
    with torch.no_grad():  # transformers initialises biases to zero: random ones, so a bias left out shows
        for pname, param in model.named_parameters():
            if pname.endswith((".bias", "_bias")):
                param.normal_(0.0, 0.02)
            elif pname.endswith(".sinks"):  # gpt-oss's sink logits: large enough to take a visible share
                param.normal_(0.0, 1.0)
        for bname, buffer in model.named_buffers():  # DeepSeek-V3's routing bias: nonzero, so that it counts
            if bname.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
    path = Path(out_dir) / name
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path, **save_options)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=0).save_pretrained(path)
    return path


#: a chat template of the usual shape (roles in tags, the assistant's turn opened at the end)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_char_tokenizer(path: str | Path) -> Path:
    """Give a tiny checkpoint a tokenizer: one character per token (<pad> 0, <s> 1, </s> 2, then printable ASCII, a
    newline and Latin-1 / Latin Extended letters up to id 511) and CHAT_TEMPLATE. The tiny models ship none by
    default (tests of prompts without a tokenizer rely on that)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"] + [chr(c) for c in range(0xC0, 0xC0 + VOCAB_SIZE)]
    vocab = {"<pad>": 0, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab |= {c: 3 + i for i, c in enumerate(chars[: VOCAB_SIZE - 3])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return Path(path)


def make_tiny_models(out_dir: str | Path, names: list[str] | None = None) -> dict[str, Path]:
    """Build the tiny models (all by default) under out_dir; returns name -> checkpoint directory.

    Aliases (ALIASES, e.g. "draft") map to their model's directory; naming an alias builds that model.
    """
    wanted = [ALIASES.get(name, name) for name in names or TINY_MODELS]
    built = {name: build(name, Path(out_dir)) for name in dict.fromkeys(wanted)}
    return built | {alias: built[name] for alias, name in ALIASES.items() if name in built}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("names", nargs="*", help=f"models to build (default: all of {', '.join(TINY_MODELS)})")
    args = parser.parse_args()
    unknown = set(args.names) - set(TINY_MODELS) - set(ALIASES)
    if unknown:
        parser.error(f"unknown model names {sorted(unknown)}; choose from {', '.join(TINY_MODELS)}")
    for name, path in make_tiny_models(args.out_dir, args.names or None).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
