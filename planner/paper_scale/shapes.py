"""`ModelShape` from a Hugging Face config.json dict: part sizes from the config fields alone (no weights).

Parts per layer, in the runtime's cut (runtime/models/weights.py), P = parameters, H = hidden, I = intermediate:
    embedding   V * H
    attention   H (input norm) + 2 * (heads * head_dim) * H (q, o) + 2 * (kv_heads * head_dim) * H (k, v)
    dense_mlp   H (post norm) + 3 * I * H (gate, up, down)                      dense models
    router      H (post norm) + E * H (gate)                                    MoE models (num_local_experts = E)
    expert      3 * I * H, for each of the E experts
    head        H (final norm) + V * H
Bytes = P * dtype_bytes; KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * dtype_bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..shapes import ModelShape, PartKey

HERE = Path(__file__).resolve().parent


def load_config(name: str) -> dict[str, Any]:
    """A config JSON of this folder by file stem, e.g. "mixtral_8x7b"."""
    return json.loads((HERE / f"{name}.json").read_text())


def shape_from_config(name: str, config: Mapping[str, Any], dtype_bytes: int = 2) -> tuple[ModelShape, int]:
    """(shape, top_k) of a Llama / Mistral / Mixtral style config; top_k = 0 for a dense model (module docstring)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    vocab = config["vocab_size"]
    experts = config.get("num_local_experts", 0)
    top_k = config["num_experts_per_tok"] if experts else 0
    attention = hidden + 2 * heads * head_dim * hidden + 2 * kv_heads * head_dim * hidden
    parts: list[tuple[PartKey, int]] = [(PartKey("embedding"), vocab * hidden)]
    for j in range(layers):
        parts.append((PartKey("attention", j), attention))
        if experts:
            parts.append((PartKey("router", j), hidden + experts * hidden))
            parts += [(PartKey("expert", j, e), 3 * inter * hidden) for e in range(experts)]
        else:
            parts.append((PartKey("dense_mlp", j), hidden + 3 * inter * hidden))
    parts.append((PartKey("head"), hidden + vocab * hidden))
    sized = tuple((key, params * dtype_bytes) for key, params in parts)
    kv = 2 * layers * kv_heads * head_dim * dtype_bytes
    return ModelShape(name, sized, layers, kv, hidden_bytes_per_token=hidden * dtype_bytes), top_k
