"""Per-part weight containers and the `WeightLoader` that reads each part from a checkpoint.

A model is cut into independently loadable *parts*, named by `PartKey`, in execution order:

    embedding -> for each layer j: attention(j), then dense_mlp(j) or [router(j), expert(j, e) for selected e]
    -> head

(`PartKey` and the part kinds are defined in the base layer, planner/shapes.py.)

The post-attention RMSNorm belongs to the part that runs first in the ffn: `DenseMLPWeights.post_norm` or
`RouterWeights.post_norm`, so an expert is only its three matrices. Compute functions in `layers.py` take these
dataclasses as arguments; nothing here owns compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from specoffload.planner.shapes import PART_KINDS, ModelShape, PartKey

from .checkpoint import Checkpoint
from .config import ModelConfig
from .packed import stays_packed

Tensor = torch.Tensor

@dataclass(frozen=True)
class EmbeddingWeights:
    embed: Tensor  # [vocab, hidden]


@dataclass(frozen=True)
class AttentionWeights:
    input_norm: Tensor  # [hidden]
    q: Tensor  # [heads * head_dim, hidden]
    k: Tensor  # [kv_heads * head_dim, hidden]
    v: Tensor  # [kv_heads * head_dim, hidden]
    o: Tensor  # [hidden, heads * head_dim]
    q_bias: Tensor | None = None  # [heads * head_dim]
    k_bias: Tensor | None = None  # [kv_heads * head_dim]
    v_bias: Tensor | None = None  # [kv_heads * head_dim]
    o_bias: Tensor | None = None  # [hidden]
    q_norm: Tensor | None = None  # [head_dim] (Qwen3: per head) or [heads * head_dim] (OLMoE: whole projection)
    k_norm: Tensor | None = None  # [head_dim] or [kv_heads * head_dim]
    sinks: Tensor | None = None  # [heads]: gpt-oss's attention sink logits


@dataclass(frozen=True)
class LatentAttentionWeights:
    """Multi-head latent attention (DeepSeek-V2 / V3). h = heads, n / r / v = the query-key head's part without
    rotary embedding / its rotary part (head_dim) / the value head, L = kv_lora_rank, Lq = q_lora_rank."""

    input_norm: Tensor  # [hidden]
    kv_a: Tensor  # [L + r, hidden]: the latent c_kv and the shared rotary key
    kv_a_norm: Tensor  # [L]
    kv_b: Tensor  # [h * (n + v), L]: per head, the latent's up-projection to its key (n rows) and value (v rows)
    o: Tensor  # [hidden, h * v]
    q: Tensor | None = None  # [h * (n + r), hidden] (no q_lora_rank)
    q_a: Tensor | None = None  # [Lq, hidden]
    q_a_norm: Tensor | None = None  # [Lq]
    q_b: Tensor | None = None  # [h * (n + r), Lq]
    #: not a `linear` weight: kept as a plain tensor (linear.pack_weights), viewed per head by `key_value_up`
    raw_matrices: ClassVar[tuple[str, ...]] = ("kv_b",)

    def key_value_up(self, heads: int) -> tuple[Tensor, Tensor]:
        """kv_b per head as (W_uk [h, n, L], W_uv [h, v, L]): views, never packed (the attention multiplies queries
        by W_uk and latents by W_uv^T, `layers.mla_attention_forward`)."""
        w = self.kv_b.view(heads, -1, self.kv_b.shape[-1])  # [h, n + v, L]
        nope = w.shape[1] - self.o.shape[1] // heads
        return w[:, :nope], w[:, nope:]


@dataclass(frozen=True)
class ExpertWeights:
    """A gated MLP `down(act(gate x) * up x)`: a routed expert, the shared expert, or a dense MLP."""

    gate: Tensor  # [intermediate, hidden]
    up: Tensor  # [intermediate, hidden]
    down: Tensor  # [hidden, intermediate]
    gate_bias: Tensor | None = None  # [intermediate] (gpt-oss)
    up_bias: Tensor | None = None  # [intermediate]
    down_bias: Tensor | None = None  # [hidden]


@dataclass(frozen=True)
class DenseMLPWeights:
    post_norm: Tensor  # [hidden]
    mlp: ExpertWeights


@dataclass(frozen=True)
class RouterWeights:
    post_norm: Tensor  # [hidden]
    gate: Tensor  # [experts, hidden]
    shared_expert: ExpertWeights | None = None  # Qwen2-MoE, DeepSeek
    shared_expert_gate: Tensor | None = None  # [1, hidden], Qwen2-MoE only
    gate_bias: Tensor | None = None  # [experts], gpt-oss only
    choice_bias: Tensor | None = None  # [experts], DeepSeek-V3's e_score_correction_bias: added to choose only


@dataclass(frozen=True)
class HeadWeights:
    norm: Tensor  # [hidden]
    lm_head: Tensor  # [vocab, hidden]; the embedding matrix when tie_word_embeddings


Weights = (EmbeddingWeights | AttentionWeights | LatentAttentionWeights | DenseMLPWeights | RouterWeights
           | ExpertWeights | HeadWeights)


#: an attention part's `linear` projections (standard: q, k, v, o; MLA: q or q_a / q_b, kv_a, o; its kv_b is
#: multiplied per head, `LatentAttentionWeights.raw_matrices`): what `specoffload quantize --attention` compresses
#: and the low-bit drafter copies
ATTENTION_MATRICES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a")

#: gpt-oss stores its experts as x @ W: field -> the [out, in] matrices (views) of an expert's stored tensor; the
#: loader's `assemble` and the low-bit drafter's copies (offload/drafters/lowbit.py) read the layout from here
TRANSPOSED_EXPERT_FIELDS = {
    "gate_up_t": lambda w: {"gate": w[:, 0::2].T, "up": w[:, 1::2].T},  # [hidden, 2 * inter], interleaved
    "down_t": lambda w: {"down": w.T},  # [inter, hidden]
}


@dataclass(frozen=True)
class TensorRef:
    """A checkpoint tensor, or row `index` of its first dimension (one expert of a fused expert tensor)."""

    name: str
    index: int | None = None


class WeightLoader:
    """Reads parts of one checkpoint, cast to `dtype` on `device`. Nothing is read at construction."""

    def __init__(
        self, checkpoint: Checkpoint, config: ModelConfig, dtype: torch.dtype, device: str | torch.device
    ) -> None:
        self.checkpoint = checkpoint
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        #: a compressed weight the format keeps packed for a kernel (runtime/models/packed.py) is loaded packed, as
        #: a ring slot holds it (resident parts then take their packed bytes: `shape`), not dequantized (CPU only;
        #: the embedding, read by rows, never)
        self.packed = False

    # --- the parts -------------------------------------------------------------------------------------

    def embedding(self) -> EmbeddingWeights:
        return self.load(PartKey("embedding"))  # type: ignore[return-value]

    def attention(self, layer: int) -> AttentionWeights:
        return self.load(PartKey("attention", layer))  # type: ignore[return-value]

    def dense_mlp(self, layer: int) -> DenseMLPWeights:
        return self.load(PartKey("dense_mlp", layer))  # type: ignore[return-value]

    def router(self, layer: int) -> RouterWeights:
        return self.load(PartKey("router", layer))  # type: ignore[return-value]

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        return self.load(PartKey("expert", layer, expert))  # type: ignore[return-value]

    def head(self) -> HeadWeights:
        return self.load(PartKey("head"))  # type: ignore[return-value]

    def load(self, key: PartKey) -> Weights:
        """Load any part by key."""
        if key.kind not in PART_KINDS:
            raise ValueError(f"unknown part kind {key.kind!r}; expected one of {PART_KINDS}")
        return self.assemble(key, self._read(key))

    def assemble(self, key: PartKey, t: dict[str, Tensor]) -> Weights:
        """Build the part's dataclass from its field tensors (named as in `refs(key)`), without copying them.

        Used for tensors read from the checkpoint (`load`) and for views into a streamed buffer, so both build
        identical objects.
        """
        if key.kind == "attention" and self.config.mla:
            return LatentAttentionWeights(**t)
        if key.kind in ("embedding", "attention", "head"):
            cls = {"embedding": EmbeddingWeights, "attention": AttentionWeights, "head": HeadWeights}[key.kind]
            return cls(**t)
        if key.kind == "dense_mlp":
            return DenseMLPWeights(t["post_norm"], ExpertWeights(t["gate"], t["up"], t["down"]))
        if key.kind == "router":
            shared = None
            if "shared_gate_proj" in t:
                shared = ExpertWeights(t["shared_gate_proj"], t["shared_up_proj"], t["shared_down_proj"])
            return RouterWeights(t["post_norm"], t["gate"], shared, t.get("shared_expert_gate"), t.get("gate_bias"),
                                 t.get("choice_bias"))
        if key.kind == "expert":
            for name, matrices in TRANSPOSED_EXPERT_FIELDS.items():  # gpt-oss: views of its [in, out] tensors
                if name in t:
                    t = {**t, **matrices(t[name])}
            if "gate_up" in t:
                gate, up = t["gate_up"].chunk(2, dim=0)  # [2 * intermediate, hidden] -> 2 x [intermediate, hidden]
                return ExpertWeights(gate, up, t["down"])
            bias = t.get("gate_up_bias")  # gpt-oss: [2 * inter], gate and up interleaved as in its gate_up_t
            gate_bias, up_bias = (bias[0::2], bias[1::2]) if bias is not None else (None, None)
            return ExpertWeights(t["gate"], t["up"], t["down"], gate_bias, up_bias, t.get("down_bias"))
        raise ValueError(f"unknown part kind {key.kind!r}; expected one of {PART_KINDS}")

    # --- sizes, for placement planning -----------------------------------------------------------------

    def parts(self) -> list[PartKey]:
        """Every part of the model, in execution order (all experts of a MoE layer after its router)."""
        cfg = self.config
        keys = [PartKey("embedding")]
        for layer in range(cfg.num_layers):
            keys.append(PartKey("attention", layer))
            if cfg.is_moe_layer(layer):
                keys.append(PartKey("router", layer))
                keys += [PartKey("expert", layer, e) for e in range(cfg.num_experts)]
            else:
                keys.append(PartKey("dense_mlp", layer))
        keys.append(PartKey("head"))
        return keys

    def nbytes(self, key: PartKey) -> int:
        """Bytes the part occupies once loaded in the loader's dtype (a tied head counts the embedding)."""
        numel = sum(self.checkpoint.numel(ref.name, ref.index) for ref in self.refs(key).values())
        return numel * self.dtype.itemsize

    def total_nbytes(self) -> int:
        return sum(self.nbytes(key) for key in self.parts())

    def shape(self, name: str, packed: bool = False) -> ModelShape:
        """The base layer's view of this model (parts and bytes in the loader's dtype). Reads tensor headers only.
        packed: streamed int8 / int4 weights stay packed in the ring slots (runtime/models/packed.py), so a part with
        such weights takes fewer bytes in a slot (`ModelShape.slotted`)."""
        cfg = self.config
        kv_heads, head_dim = cfg.cache_geometry
        kv = 2 * cfg.num_layers * kv_heads * head_dim * self.dtype.itemsize
        keys = self.parts()
        stored = tuple((key, n) for key in keys if (n := self.stored_nbytes(key)) is not None)
        slotted = tuple((key, n) for key, _ in stored if (n := self.packed_nbytes(key)) < self.nbytes(key)) \
            if packed else ()
        return ModelShape(name=name, parts=tuple((key, self.nbytes(key)) for key in keys),
                          num_layers=cfg.num_layers, kv_bytes_per_token=kv, stored=stored,
                          hidden_bytes_per_token=cfg.hidden_size * self.dtype.itemsize, slotted=slotted,
                          resident_packed=packed and self.packed)

    def packed_nbytes(self, key: PartKey) -> int:
        """Bytes the part takes in a ring slot with its compressed weights packed (their format's `packed_nbytes`:
        codes plus compute-dtype scales) where they stay packed, the loader's dtype for the rest (no alignment
        padding: the streamer's slot margin covers it)."""
        ckpt, total = self.checkpoint, 0
        for ref in self.refs(key).values():
            quant, shape = ckpt.quantized(ref.name, ref.index), ckpt.shape_of(ref.name, ref.index)
            numel = ckpt.numel(ref.name, ref.index)
            total += (quant.spec.packed_nbytes(shape, self.dtype) if stays_packed(quant, shape)
                      else numel * self.dtype.itemsize)
        return total

    def stored_nbytes(self, key: PartKey) -> int | None:
        """Bytes a part with compressed weights (a `specoffload quantize` checkpoint) is stored and streamed as:
        its compressed weights' stored bytes plus its other tensors in the loader's dtype; None for a part
        without compressed weights."""
        ckpt, refs = self.checkpoint, self.refs(key).values()
        if not any(ckpt.quantized(ref.name) is not None for ref in refs):
            return None
        return sum(ckpt.nbytes(ref.name, ref.index) if ckpt.quantized(ref.name) is not None
                   else ckpt.numel(ref.name, ref.index) * self.dtype.itemsize for ref in refs)

    def refs(self, key: PartKey) -> dict[str, TensorRef]:
        """The checkpoint tensors of a part, by field name."""
        cfg = self.config
        if key.kind == "embedding":
            return {"embed": TensorRef("model.embed_tokens.weight")}
        if key.kind == "head":
            lm_head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
            return {"norm": TensorRef("model.norm.weight"), "lm_head": TensorRef(lm_head)}
        self._check_layer(key)
        p = f"model.layers.{key.layer}"
        if key.kind == "attention" and cfg.mla:
            names = {"kv_a": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
                     "kv_b": "kv_b_proj.weight", "o": "o_proj.weight"}
            if cfg.q_lora_rank:
                names |= {"q_a": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight", "q_b": "q_b_proj.weight"}
            else:
                names["q"] = "q_proj.weight"
            return {"input_norm": TensorRef(f"{p}.input_layernorm.weight")} | {
                field: TensorRef(f"{p}.self_attn.{name}") for field, name in names.items()}
        if key.kind == "attention":
            refs = {"input_norm": TensorRef(f"{p}.input_layernorm.weight")}
            refs |= {x: TensorRef(f"{p}.self_attn.{x}_proj.weight") for x in "qkvo"}
            if cfg.qkv_bias:
                refs |= {f"{x}_bias": TensorRef(f"{p}.self_attn.{x}_proj.bias") for x in "qkv"}
            if cfg.o_bias:
                refs["o_bias"] = TensorRef(f"{p}.self_attn.o_proj.bias")
            if cfg.qk_norm != "none":
                refs |= {f"{x}_norm": TensorRef(f"{p}.self_attn.{x}_norm.weight") for x in "qk"}
            if cfg.attention_sinks:
                refs["sinks"] = TensorRef(f"{p}.self_attn.sinks")
            return refs
        if key.kind == "dense_mlp":
            refs = {"post_norm": TensorRef(f"{p}.post_attention_layernorm.weight")}
            return refs | {x: TensorRef(f"{p}.mlp.{x}_proj.weight") for x in ("gate", "up", "down")}
        moe = self._moe_prefix(key.layer)
        if key.kind == "router":
            if cfg.family == "gpt_oss":
                return {"post_norm": TensorRef(f"{p}.post_attention_layernorm.weight"),
                        "gate": TensorRef(f"{moe}.router.weight"), "gate_bias": TensorRef(f"{moe}.router.bias")}
            refs = {
                "post_norm": TensorRef(f"{p}.post_attention_layernorm.weight"),
                "gate": TensorRef(f"{moe}.gate.weight"),
            }
            if cfg.has_shared_expert:
                shared = f"{moe}.shared_expert" if cfg.shared_expert_gated else f"{moe}.shared_experts"
                refs |= {f"shared_{x}_proj": TensorRef(f"{shared}.{x}_proj.weight") for x in ("gate", "up", "down")}
                if cfg.shared_expert_gated:
                    refs["shared_expert_gate"] = TensorRef(f"{moe}.shared_expert_gate.weight")
            if cfg.router == "sigmoid_group_topk":
                refs["choice_bias"] = TensorRef(f"{moe}.gate.e_score_correction_bias")
            return refs
        if key.kind == "expert":
            return self._expert_refs(moe, key.expert)
        raise ValueError(f"unknown part kind {key.kind!r}; expected one of {PART_KINDS}")

    # --- internals -------------------------------------------------------------------------------------

    def _read(self, key: PartKey) -> dict[str, Tensor]:
        ckpt, out = self.checkpoint, {}
        packs = self.packed and self.device.type == "cpu" and key.kind != "embedding"
        for field, ref in self.refs(key).items():
            quant = ckpt.quantized(ref.name, ref.index) if packs else None
            shape = ckpt.shape_of(ref.name, ref.index)
            if quant is not None and stays_packed(quant, shape):
                out[field] = quant.spec.packed_copy(ckpt.stored_parts(ref.name, ref.index), shape, self.dtype)
            else:
                out[field] = ckpt.get(ref.name, self.dtype, self.device, ref.index)
        return out

    def _check_layer(self, key: PartKey) -> None:
        cfg = self.config
        if not 0 <= key.layer < cfg.num_layers:
            raise IndexError(f"layer {key.layer} out of range for a {cfg.num_layers}-layer model")
        moe = cfg.is_moe_layer(key.layer)
        if key.kind in ("router", "expert") and not moe:
            raise ValueError(f"layer {key.layer} is dense; it has no {key.kind}")
        if key.kind == "dense_mlp" and moe:
            raise ValueError(f"layer {key.layer} is a MoE layer; it has no dense_mlp")
        if key.kind == "expert" and not 0 <= key.expert < cfg.num_experts:
            raise IndexError(f"expert {key.expert} out of range for {cfg.num_experts} experts")

    def _moe_prefix(self, layer: int) -> str:
        """Mixtral checkpoints name the block `block_sparse_moe` (HF's saved format) or `mlp` (fused format)."""
        p = f"model.layers.{layer}"
        if self.config.family == "mixtral" and self.checkpoint.has(f"{p}.block_sparse_moe.gate.weight"):
            return f"{p}.block_sparse_moe"
        return f"{p}.mlp"

    def _expert_refs(self, moe: str, e: int) -> dict[str, TensorRef]:
        if self.config.family == "gpt_oss":  # fused, transposed, with biases: [experts, hidden, 2 * inter], ...
            return {"gate_up_t": TensorRef(f"{moe}.experts.gate_up_proj", e),
                    "gate_up_bias": TensorRef(f"{moe}.experts.gate_up_proj_bias", e),
                    "down_t": TensorRef(f"{moe}.experts.down_proj", e),
                    "down_bias": TensorRef(f"{moe}.experts.down_proj_bias", e)}
        if self.checkpoint.has(f"{moe}.experts.gate_proj"):  # fused per matrix (a GGUF's): [experts, out, in]
            return {x: TensorRef(f"{moe}.experts.{x}_proj", e) for x in ("gate", "up", "down")}
        if self.checkpoint.has(f"{moe}.experts.gate_up_proj"):  # fused: [experts, 2 * inter, hidden]
            return {
                "gate_up": TensorRef(f"{moe}.experts.gate_up_proj", e),
                "down": TensorRef(f"{moe}.experts.down_proj", e),  # [experts, hidden, inter]
            }
        if self.config.family == "mixtral" and moe.endswith("block_sparse_moe"):
            names = {"gate": "w1", "up": "w3", "down": "w2"}
        else:
            names = {x: f"{x}_proj" for x in ("gate", "up", "down")}
        return {field: TensorRef(f"{moe}.experts.{e}.{n}.weight") for field, n in names.items()}
