"""A checkpoint checked against its config.json before anything is allocated (the model's executor calls it first).

1. Size: the weights the config implies (every part's tensors, at the smallest float item size, 2 bytes; a
   compressed weight at its smallest, 4-bit codes) must fit
   in the tensor data of the safetensors files: a config that implies 4 GB in a 200 KB file is refused in one line
   before a byte is allocated (this catches, e.g., hidden_size 10**9).
2. Every tensor the config implies is present, has exactly the shape the config implies (one line naming the
   tensor, its file, the expected and the found shape) and a float dtype (F64, F32, F16, BF16): a float model with
   an int32 tensor, or intermediate_size off by one, is refused instead of running.
3. No tensor the config does not imply (one line naming it and its file): a config with fewer num_hidden_layers
   than the checkpoint, or of another architecture, would otherwise run part of the weights. Buffers that some
   checkpoints carry and the model recomputes (`rotary_emb.inv_freq`), a stored head beside tied embeddings and
   empty tensors (a part of size 0 that transformers saves anyway, such as a shared expert of width 0, with its
   gate) are allowed.

Only headers are read (Checkpoint reads nothing else at open).
"""

from __future__ import annotations

import math

from specoffload.planner.shapes import PartKey

from .checkpoint import Checkpoint
from .config import ModelConfig
from .errors import CheckpointError
from .weights import WeightLoader

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # recomputed from the config


def expected_shape(config: ModelConfig, key: PartKey, field: str) -> tuple[int, ...]:
    """The shape config.json implies for field `field` of part `key` (of one expert's row for a fused tensor)."""
    c = config
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    inter = c.moe_intermediate_size if key.kind == "expert" else c.intermediate_size
    shared = c.shared_expert_intermediate_size
    shapes = {
        "embed": (c.vocab_size, h), "lm_head": (c.vocab_size, h), "norm": (h,), "input_norm": (h,),
        "post_norm": (h,), "q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "q_bias": (q,), "k_bias": (kv,),
        "v_bias": (kv,), "o_bias": (h,), "up": (inter, h), "down": (h, inter), "gate_up": (2 * inter, h),
        "shared_gate_proj": (shared, h), "shared_up_proj": (shared, h), "shared_down_proj": (h, shared),
        "shared_expert_gate": (1, h),
        "q_norm": (c.head_dim,) if c.qk_norm == "head" else (q,),
        "k_norm": (c.head_dim,) if c.qk_norm == "head" else (kv,),
        "sinks": (c.num_heads,), "gate_bias": (c.num_experts,), "gate_up_t": (h, 2 * inter),
        "gate_up_bias": (2 * inter,), "down_t": (inter, h), "down_bias": (h,),
    }  # fmt: skip
    if c.mla:  # h heads of n + r query / key dims (r = head_dim, the rotary part) and v value dims; latent L (+ r)
        heads, qk = c.num_heads, c.qk_nope_head_dim + c.head_dim
        shapes |= {"q": (heads * qk, h), "q_a": (c.q_lora_rank, h), "q_a_norm": (c.q_lora_rank,),
                   "q_b": (heads * qk, c.q_lora_rank), "kv_a": (c.kv_lora_rank + c.head_dim, h),
                   "kv_a_norm": (c.kv_lora_rank,), "o": (h, heads * c.v_head_dim),
                   "kv_b": (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)}
    if field == "gate":  # the router's gate is [experts, hidden]; an MLP's gate projection [inter, hidden]
        return (c.num_experts, h) if key.kind == "router" else (inter, h)
    if field == "choice_bias":
        return (c.num_experts,)
    return shapes[field]


def _next_token_layer(name: str, config: ModelConfig) -> bool:
    """A tensor of DeepSeek-V3's multi-token-prediction layers, stored after the last decoder layer (transformers
    does not load them either)."""
    parts = name.split(".")
    return (config.family == "deepseek_v3" and name.startswith("model.layers.") and parts[2].isdigit()
            and int(parts[2]) >= config.num_layers)


def validate_checkpoint(checkpoint: Checkpoint, config: ModelConfig) -> None:
    """Raise CheckpointError (one line) unless every tensor the config implies is there, shaped and typed as it
    implies, and their total fits in the files (see the module docstring)."""
    loader = WeightLoader(checkpoint, config, dtype=None, device="cpu")  # type: ignore[arg-type]
    where = f"{config.path}/config.json"
    expected: dict[str, tuple[int, ...]] = {}  # tensor -> its full expected shape
    for key in loader.parts():
        for field, ref in loader.refs(key).items():
            shape = expected_shape(config, key, field)
            if ref.index is not None:
                shape = (config.num_experts, *shape)  # a fused [experts, ...] tensor
            expected.setdefault(ref.name, shape)
    # a compressed weight (`specoffload quantize`) holds at least its 4-bit codes: half a byte per element
    implied = int(sum(math.prod(s) * (0.5 if checkpoint.quantized(name) is not None else 2)
                      for name, s in expected.items()))
    held = checkpoint.data_bytes()
    if implied > held:
        raise CheckpointError(
            f"{where} implies at least {implied} bytes of weights (hidden_size {config.hidden_size}, "
            f"{config.num_layers} layers, vocab {config.vocab_size}, intermediate {config.intermediate_size}), but "
            f"the safetensors files of {checkpoint.path} hold {held} bytes of tensors: config and weights disagree"
        )
    for name, shape in expected.items():
        if not checkpoint.has(name):
            raise CheckpointError(f"tensor {name!r} that {where} implies is missing from {checkpoint.path}")
        entry = checkpoint.entry(name)
        if entry.shape != shape:
            raise CheckpointError(f"tensor {name!r} in {entry.file}: expected shape {list(shape)} (from {where}), "
                                  f"found {list(entry.shape)}")
        if entry.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {entry.file}: expected a float dtype ({', '.join(FLOAT_DTYPES)})"
                                  f", found {entry.dtype}")
    extra = [n for n in checkpoint.names() if n not in expected and not n.endswith(IGNORED_SUFFIXES)
             and not (n == "lm_head.weight" and config.tie_word_embeddings)
             and math.prod(checkpoint.entry(n).shape) > 0  # (empty: a part of size 0, e.g. no shared expert)
             and not (n.endswith(".shared_expert_gate.weight") and not config.has_shared_expert)
             and not _next_token_layer(n, config)]
    if extra:
        entry = checkpoint.entry(extra[0])
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"tensor {extra[0]!r} in {entry.file}{more} is not part of the model {where} describes "
                              f"({config.num_layers} layers, {config.num_experts or 'no'} experts): config and weights "
                              "disagree")
