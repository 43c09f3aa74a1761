"""The MoE formats a dense checkpoint becomes, and their tensor names.

Qwen2-MoE (`Qwen2MoeForCausalLM`): q/k/v biases allowed, an optional shared expert with a sigmoid gate,
`norm_topk_prob` to renormalise the top-k weights. Mixtral (`MixtralForCausalLM`): no attention biases,
top-k weights always renormalised, no shared expert. Both are read by transformers and by our executor
(`runtime/models/weights.py`), from the per-expert tensor names written here (HF's original format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specoffload.runtime.models.config import ModelConfig

from .errors import MoEBuildError

DENSE_FAMILIES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class MoEFormat:
    """Names the tensors of one MoE layer in `family` ("qwen2_moe" or "mixtral")."""

    family: str

    def block(self, layer: int) -> str:
        return f"model.layers.{layer}." + ("block_sparse_moe" if self.family == "mixtral" else "mlp")

    def router(self, layer: int) -> str:
        return f"{self.block(layer)}.gate.weight"

    def expert(self, layer: int, expert: int) -> dict[str, str]:
        """Field ("gate", "up", "down") -> tensor name of one routed expert."""
        names = {"gate": "w1", "up": "w3", "down": "w2"} if self.family == "mixtral" else None
        prefix = f"{self.block(layer)}.experts.{expert}"
        if names:
            return {field: f"{prefix}.{n}.weight" for field, n in names.items()}
        return {field: f"{prefix}.{field}_proj.weight" for field in ("gate", "up", "down")}

    def shared(self, layer: int) -> dict[str, str]:
        """Field -> tensor name of the shared expert and its gate (Qwen2-MoE only)."""
        if self.family != "qwen2_moe":
            raise ValueError("only Qwen2-MoE has a shared expert")
        prefix = f"{self.block(layer)}.shared_expert"
        return {field: f"{prefix}.{field}_proj.weight" for field in ("gate", "up", "down")} | {
            "gate_logit": f"{prefix}_gate.weight"
        }


def check_dense(cfg: ModelConfig) -> None:
    if cfg.family not in DENSE_FAMILIES:
        raise MoEBuildError(
            f"--dense must be a dense {'/'.join(DENSE_FAMILIES)} checkpoint; {cfg.path} is {cfg.architecture}"
        )
    if cfg.family == "llama" and cfg.qkv_bias:
        raise MoEBuildError(f"{cfg.path}: attention_bias adds an o_proj bias, which no supported MoE format has")


def upcycle_format(cfg: ModelConfig) -> MoEFormat:
    """Mixtral where the dense model fits it (no attention biases), else Qwen2-MoE (e.g. Qwen2's q/k/v biases)."""
    check_dense(cfg)
    return MoEFormat("qwen2_moe" if cfg.qkv_bias else "mixtral")


def moe_config(
    cfg: ModelConfig, fmt: MoEFormat, experts: int, top_k: int, expert_width: int, shared_width: int, dtype: str
) -> Any:
    """A transformers config for the MoE model with the dense model's attention, norms, RoPE and vocabulary."""
    from transformers import MixtralConfig, Qwen2MoeConfig

    hf = cfg._hf_config
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters=dict(hf.rope_parameters),
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        pad_token_id=getattr(hf, "pad_token_id", None),
        num_experts_per_tok=top_k,
        architectures=[_ARCHITECTURE[fmt.family]],
        dtype=dtype,
    )
    if fmt.family == "mixtral":
        if shared_width:
            raise ValueError("Mixtral has no shared expert")
        return MixtralConfig(
            **common,
            intermediate_size=expert_width,
            head_dim=cfg.head_dim,
            sliding_window=cfg.sliding_window,
            num_local_experts=experts,
        )
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise MoEBuildError(
            f"{cfg.path}: head_dim {cfg.head_dim} x {cfg.num_heads} heads != hidden size; Qwen2-MoE cannot express it"
        )
    windows = cfg.layer_windows
    return Qwen2MoeConfig(
        **common,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=expert_width,
        shared_expert_intermediate_size=shared_width,
        num_experts=experts,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        qkv_bias=cfg.qkv_bias,
        use_sliding_window=cfg.sliding_window is not None,
        sliding_window=cfg.sliding_window,
        max_window_layers=cfg.num_layers,
        layer_types=["full_attention" if w is None else "sliding_attention" for w in windows],
    )


_ARCHITECTURE = {"qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def global_names(names: list[str]) -> list[str]:
    """Tensors outside the decoder layers (embedding, final norm, LM head): copied as they are."""
    return [n for n in names if not n.startswith("model.layers.")]


def attention_names(names: list[str], layer: int) -> list[str]:
    """Layer `layer`'s tensors other than its FFN (attention, both norms): copied as they are."""
    prefix = f"model.layers.{layer}."
    return [n for n in names if n.startswith(prefix) and not n.startswith(prefix + "mlp.")]
