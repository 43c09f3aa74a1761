"""`ModelConfig`: the architecture facts the runtime needs, parsed once from a checkpoint's config.json.

Layer convention used everywhere in `runtime.models`: layers are numbered 0..num_layers-1; each layer has an
`attention` part and an `ffn` part; the ffn part of layer i is a mixture of experts iff `is_moe_layer(i)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..json_bounds import JsonBounds, loads_bounded
from .errors import CheckpointError, UnsupportedModelError

#: architecture name in config.json -> family name used in this package
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

#: families with multi-head latent attention (DeepSeek-V2 / V3): `ModelConfig.mla`
_MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")

#: MoE families whose router casts the top-k weights back to the compute dtype (Mixtral keeps them in float32)
_ROUTE_WEIGHTS_IN_COMPUTE_DTYPE = ("qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
#: families whose attention_bias also gives the output projection a bias (the others: q, k, v only)
_O_BIAS_FAMILIES = ("llama", "qwen3", "qwen3_moe", "olmoe", "gpt_oss")
#: how a family normalises queries and keys after their projections: per head over head_dim (Qwen3, Qwen3-MoE)
#: or over the whole projection (OLMoE)
_QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "all"}

# RoPE types whose frequencies depend on the current sequence length: HF recomputes them per forward, which a
# KV cache written at earlier lengths cannot follow exactly.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder-only checkpoint. Build it with `ModelConfig.from_dir`."""

    path: str
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (Mixtral: also the expert width)
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool  # the attention's output projection has a bias (Llama, Qwen3(-MoE), OLMoE with attention_bias)
    qk_norm: str  # RMSNorm of q and k after projection: "none", "head" (over head_dim) or "all" (whole projection)
    clip_qkv: float | None  # q, k, v clamped to [-clip, clip] after projection (OLMoE), None = not
    attention_sinks: bool  # a learned logit per head joins each query's softmax and takes no value (gpt-oss)
    norm_scale_in_float32: bool  # RMSNorm scales by its weight in float32, then casts (gpt-oss); else casts first
    rope_type: str
    layer_windows: tuple[int | None, ...]  # per layer: sliding window size, None = full causal attention
    num_experts: int  # 0 for dense models
    num_experts_per_tok: int
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    route_weights_in_compute_dtype: bool  # the top-k weights are cast back to the compute dtype (not Mixtral)
    router: str  # "softmax_topk": softmax over all experts, then top k; "topk_softmax": top k logits, softmax of those;
    # "softmax_group_topk" (DeepSeek-V2's group-limited greedy): softmax, keep the `expert_groups[1]` groups of best
    # maximum, top k within them; "sigmoid_group_topk" (DeepSeek-V3): sigmoid scores, choice by score + correction
    # bias within the groups of best top-2 sum, weights the chosen scores (layers.route)
    swiglu_limit: float | None  # gpt-oss's clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate): clamp, and alpha
    swiglu_alpha: float
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0 = no shared expert
    moe_layers: frozenset[int]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    _hf_config: Any = field(default=None, repr=False, compare=False)
    # --- DeepSeek-V2 / V3 (defaults: every other family) ---
    softmax_scale: float = 0.0  # attention's score scale; 0 = head_dim ** -0.5 (MLA: qk head dim, times YaRN mscale^2)
    expert_groups: tuple[int, int] = (1, 1)  # (groups the experts are cut into, groups a token may route to)
    routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by it (after renormalisation)
    router_in_float32: bool = False  # router logits from float32 hidden and gate, as DeepSeek's router computes them
    shared_expert_gated: bool = True  # the shared expert's output is scaled by sigmoid(its gate) (Qwen2-MoE)
    # multi-head latent attention (MLA, DeepSeek-V2 / V3); kv_lora_rank 0 = standard attention. head_dim is then the
    # rotary part of the query / key heads (qk_rope_head_dim)
    q_lora_rank: int = 0  # 0 = q projected in one matrix; else q_a (to this rank), its RMSNorm, q_b
    kv_lora_rank: int = 0  # width of the cached latent c_kv
    qk_nope_head_dim: int = 0  # the query / key head's part without rotary embedding
    v_head_dim: int = 0
    rope_interleaved: bool = False  # the rotary dims pair as (x0, x1), (x2, x3), ... (DeepSeek) instead of halves

    @property
    def sliding_window(self) -> int | None:
        """Sliding window size if any layer uses one, else None."""
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    @property
    def mla(self) -> bool:
        """Multi-head latent attention: one cached latent row per token and layer (`cache_geometry`)."""
        return self.kv_lora_rank > 0

    @property
    def scale(self) -> float:
        """The attention's score scale (softmax(q k^T scale))."""
        return self.softmax_scale or self.head_dim**-0.5

    @property
    def cache_geometry(self) -> tuple[int, int]:
        """(kv heads, head dim) of the KV cache's K and V tensors. MLA caches per token one latent row
        [c_kv | k_rope] (kv_lora_rank + qk_rope_head_dim values, shared by every head): it is stored as the K and V
        of a single head of half that width, its first half in K and its second in V (layers.mla_attention_forward),
        so every cache, block pool and copy works on it unchanged and nothing is stored twice."""
        if self.mla:
            return 1, (self.kv_lora_rank + self.head_dim) // 2
        return self.num_kv_heads, self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def window_of(self, layer: int) -> int | None:
        """Sliding window of `layer`: a query at position q sees keys k with q - k < window; None = all k <= q."""
        return self.layer_windows[layer]

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """(inv_freq [head_dim // 2] float32, attention_scaling) exactly as transformers computes them."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if self.rope_type == "default":
            base = self._hf_config.rope_parameters["rope_theta"]
            dim = self.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [head_dim // 2]
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self._hf_config, None)
        factors = getattr(self._hf_config, "rope_freq_factors", None)  # a GGUF's rope_freqs (runtime/models/gguf.py)
        if factors is not None:
            if len(factors) != inv_freq.shape[0]:
                raise CheckpointError(f"{self.path}: {len(factors)} rope_freq_factors for {inv_freq.shape[0]} RoPE "
                                      "frequencies")
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)  # llama.cpp: theta / freq_factor
        return inv_freq.float(), float(scaling)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Parse `path/config.json` (+ `generation_config.json` for extra EOS ids)."""
        path = Path(path)
        raw = _read_json(path / "config.json", required=True)
        architecture = _architecture(raw, path)
        if raw.get("quantization_config"):
            raise UnsupportedModelError(f"quantized checkpoints are not supported ({path}/config.json)")
        try:
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(str(path))
        except Exception as exc:  # transformers raises many types for bad values
            raise CheckpointError(f"cannot parse {path / 'config.json'}: {exc}") from exc
        generation = _read_json(path / "generation_config.json", required=False)
        return _build(str(path), architecture, hf, generation)


def _read_json(file: Path, required: bool) -> dict[str, Any]:
    if not file.parent.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {file.parent}")
    if not file.is_file():
        if required:
            raise CheckpointError(f"missing {file.name} in checkpoint directory {file.parent}")
        return {}
    try:
        data = loads_bounded(file.read_bytes(), JsonBounds(max_depth=32, max_digits=64))  # no recursion on it
    except (OSError, ValueError) as exc:  # BoundsError, JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"corrupt {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"corrupt {file}: expected a JSON object")
    return data


def _architecture(raw: dict[str, Any], path: Path) -> str:
    names = list(raw.get("architectures") or [])
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    shown = ", ".join(names) or f"model_type={raw.get('model_type')!r}"
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    raise UnsupportedModelError(f"unsupported architecture {shown} in {path}; supported: {supported}")


def _build(path: str, architecture: str, hf: Any, generation: dict[str, Any]) -> ModelConfig:
    family = SUPPORTED_ARCHITECTURES[architecture]
    num_layers = hf.num_hidden_layers
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope_type = (hf.rope_parameters or {}).get("rope_type", "default")
    if rope_type in _DYNAMIC_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {rope_type!r} (length-dependent RoPE) is not supported ({path})")
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedModelError(f"mlp_bias=True is not supported ({path})")

    if family == "mixtral":
        num_experts, moe_width, shared_width = hf.num_local_experts, hf.intermediate_size, 0
        moe_layers = frozenset(range(num_layers))
        norm_topk = True
    elif family in ("qwen2_moe", "qwen3_moe"):
        num_experts, moe_width = hf.num_experts, hf.moe_intermediate_size
        shared_width = hf.shared_expert_intermediate_size if family == "qwen2_moe" else 0
        mlp_only = set(hf.mlp_only_layers or [])
        moe_layers = frozenset(
            i
            for i in range(num_layers)
            if i not in mlp_only and num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
        )
        norm_topk = bool(hf.norm_topk_prob)
    elif family == "gpt_oss":  # every layer sparse; the experts are intermediate_size wide
        num_experts, moe_width, shared_width = hf.num_local_experts, hf.intermediate_size, 0
        moe_layers = frozenset(range(num_layers))
        norm_topk = False  # (its softmax over the top k sums to 1 by construction)
    elif family == "olmoe":  # every layer sparse; the experts are intermediate_size wide
        num_experts, moe_width, shared_width = hf.num_experts, hf.intermediate_size, 0
        moe_layers = frozenset(range(num_layers))
        norm_topk = bool(hf.norm_topk_prob)
    elif family in _MLA_FAMILIES:  # layers from first_k_dense_replace on are sparse (transformers ignores freq)
        num_experts, moe_width = hf.n_routed_experts or 0, hf.moe_intermediate_size
        shared_width = moe_width * (hf.n_shared_experts or 0)
        moe_layers = frozenset(range(hf.first_k_dense_replace or 0, num_layers)) if num_experts else frozenset()
        # (transformers' DeepSeek-V2 router never renormalises, whatever norm_topk_prob says; V3's does if it says so)
        norm_topk = family == "deepseek_v3" and bool(hf.norm_topk_prob)
    else:
        num_experts, moe_width, shared_width, moe_layers, norm_topk = 0, 0, 0, frozenset(), False

    deepseek = _deepseek(family, hf, path) if family in _MLA_FAMILIES else {}
    return ModelConfig(
        path=path,
        architecture=architecture,
        family=family,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=num_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=hf.intermediate_size,
        hidden_act=hf.hidden_act,
        rms_norm_eps=float(hf.rms_norm_eps),
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=_qkv_bias(family, hf),
        o_bias=family in _O_BIAS_FAMILIES and bool(getattr(hf, "attention_bias", False)),
        qk_norm=_QK_NORM.get(family, "none"),
        clip_qkv=float(hf.clip_qkv) if family == "olmoe" and getattr(hf, "clip_qkv", None) is not None else None,
        attention_sinks=family == "gpt_oss",
        norm_scale_in_float32=family == "gpt_oss",
        rope_type=rope_type,
        # a llama GGUF's q / k rows (runtime/models/gguf.py); DeepSeek's (`_deepseek`)
        rope_interleaved=deepseek.pop("rope_interleaved", bool(getattr(hf, "rope_interleave", False))),
        layer_windows=_layer_windows(family, hf, num_layers),
        num_experts=num_experts,
        num_experts_per_tok=getattr(hf, "num_experts_per_tok", 0) if num_experts else 0,
        norm_topk_prob=norm_topk,
        route_weights_in_compute_dtype=family in _ROUTE_WEIGHTS_IN_COMPUTE_DTYPE,
        router=deepseek.pop("router", "topk_softmax" if family == "gpt_oss" else "softmax_topk"),
        swiglu_limit=float(hf.swiglu_limit) if family == "gpt_oss" else None,
        swiglu_alpha=float(getattr(hf, "swiglu_alpha", 1.702)) if family == "gpt_oss" else 1.0,
        moe_intermediate_size=moe_width,
        shared_expert_intermediate_size=shared_width,
        moe_layers=moe_layers,
        eos_token_ids=_eos_ids(hf.eos_token_id, generation.get("eos_token_id")),
        bos_token_id=getattr(hf, "bos_token_id", None),
        _hf_config=hf,
        **deepseek,
    )


def _deepseek(family: str, hf: Any, path: str) -> dict[str, Any]:
    """The DeepSeek-V2 / V3 fields of `ModelConfig`, as transformers' modeling code reads the config."""
    if getattr(hf, "attention_bias", False):
        raise UnsupportedModelError(f"attention_bias=True is not supported for {family} ({path})")
    rank, rope, nope = hf.kv_lora_rank, hf.qk_rope_head_dim, hf.qk_nope_head_dim
    if (rank + rope) % 2 or not 0 < rope < rank:
        raise UnsupportedModelError(f"kv_lora_rank {rank} + qk_rope_head_dim {rope} must be even, with the rope part "
                                    f"narrower than the latent ({path})")
    scale = (nope + rope) ** -0.5
    params = hf.rope_parameters or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):  # YaRN's mscale, squared
        factor = params["factor"]
        mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    groups = (1, 1)
    if family == "deepseek_v3":
        router, groups = "sigmoid_group_topk", (hf.n_group or 1, hf.topk_group or 1)
    elif hf.topk_method == "group_limited_greedy":
        router, groups = "softmax_group_topk", (hf.n_group or 1, hf.topk_group or 1)
    elif hf.topk_method == "greedy":
        router = "softmax_topk"
    else:
        raise UnsupportedModelError(f"topk_method {hf.topk_method!r} is not supported ({path})")
    if hf.n_routed_experts and hf.n_routed_experts % groups[0]:
        raise UnsupportedModelError(f"{hf.n_routed_experts} experts do not split into n_group {groups[0]} ({path})")
    return dict(
        router=router, softmax_scale=scale, expert_groups=groups, routed_scaling_factor=float(hf.routed_scaling_factor),
        router_in_float32=True, shared_expert_gated=False, q_lora_rank=hf.q_lora_rank or 0, kv_lora_rank=rank,
        qk_nope_head_dim=nope, v_head_dim=hf.v_head_dim,
        rope_interleaved=family == "deepseek_v2" or bool(getattr(hf, "rope_interleave", True)),
    )


def _qkv_bias(family: str, hf: Any) -> bool:
    if family == "qwen2":
        return True  # Qwen2Attention always has q/k/v biases
    if family == "qwen2_moe":
        return bool(hf.qkv_bias)
    return bool(getattr(hf, "attention_bias", False))


def _layer_windows(family: str, hf: Any, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window, following each family's HF modeling code."""
    window = getattr(hf, "sliding_window", None) or None  # Qwen2-MoE stores 0 when disabled
    if family in ("mistral", "mixtral", "qwen3_moe"):
        return (window,) * num_layers  # these apply config.sliding_window to every layer
    if family in ("qwen2", "qwen2_moe", "qwen3", "gpt_oss") and window is not None:
        types = getattr(hf, "layer_types", None) or ["full_attention"] * num_layers
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (None,) * num_layers


def _eos_ids(*values: int | list[int] | None) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        for token in [value] if isinstance(value, int) else value or []:
            if token not in ids:
                ids.append(int(token))
    return tuple(ids)
