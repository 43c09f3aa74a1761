"""Write a tiny Hugging Face checkpoint (scripts/make_tiny_models.py) as a GGUF file, each weight in a chosen GGML
type, and the checkpoint its blocks stand for (the GGUF's weights dequantized by the gguf package, float32): the
reference a GGUF run is checked against (tests/test_gguf.py).

The gguf package quantizes Q8_0, Q4_0, Q5_0 and MXFP4; the k-quants (Q4_K, Q5_K, Q6_K) are encoded here with a
plain min / max rule (llama.cpp searches its scales harder: the bytes differ, the layout is the same), which is
enough for a reference: whatever the bytes, the reference holds the weights they decode to.

    python -m scripts.make_tiny_gguf HF_DIR OUT.gguf REF_DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

#: HF name (after model.layers.N.) -> llama.cpp name (after blk.N.); see runtime/models/gguf.py
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_expert.up_proj.weight":
    "ffn_up_shexp.weight", "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}  # fmt: skip
#: the GGUF architecture of a transformers model_type
ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen2_moe": "qwen2moe", "qwen3": "qwen3", "qwen3_moe": "qwen3moe"}
#: group-32 types only, for models whose rows are not multiples of the k-quants' 256 (the tiny llama's 64 / 128)
SMALL_ROW_TYPES = {
    "token_embd.weight": "Q8_0", "output.weight": "Q8_0", "attn_q.weight": ["Q8_0", "Q4_0"],
    "attn_k.weight": ["Q5_0", "Q8_0"], "attn_v.weight": ["Q4_0", "Q5_0"], "attn_output.weight": ["Q8_0", "MXFP4"],
    "ffn_gate.weight": ["Q4_0", "Q8_0"], "ffn_up.weight": ["Q5_0", "Q4_0"], "ffn_down.weight": ["Q8_0", "F16"],
}  # fmt: skip
#: GGML type of each weight, by the end of its llama.cpp name, cycling where a list (layer by layer): every readable
#: type appears, and each layer differs (F16: a matrix llama.cpp's quantizer leaves unquantized, as the moefied
#: model's 336-wide expert projections)
DEFAULT_TYPES = {
    "token_embd.weight": "Q4_K", "output.weight": "Q6_K", "attn_q.weight": ["Q8_0", "Q4_K"],
    "attn_k.weight": ["Q5_0", "Q6_K"], "attn_v.weight": ["Q6_K", "Q5_K"], "attn_output.weight": ["Q4_0", "MXFP4"],
    "ffn_gate.weight": ["Q4_K", "Q4_0"], "ffn_up.weight": ["Q5_K", "Q4_K"], "ffn_down.weight": ["Q6_K", "Q8_0"],
    "ffn_gate_exps.weight": ["Q4_K", "Q4_0"], "ffn_up_exps.weight": ["Q4_0", "Q4_K"],
    "ffn_down_exps.weight": ["Q6_K", "F16"], "ffn_gate_shexp.weight": ["Q4_K", "Q8_0"],
    "ffn_up_shexp.weight": ["Q5_0", "Q4_K"], "ffn_down_shexp.weight": ["Q6_K", "Q4_0"],
}  # fmt: skip


def _u8(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block [n, 8] -> ggml's 12 packed bytes [n, 12]."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def _k_minmax(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """w [n, 256] -> (d, dmin) float16 [n], (sc, m) uint8 [n, 8], q [n, 256] for w ~ d sc q - dmin m."""
    sub = w.reshape(-1, 8, 32)
    mn = np.maximum(-sub.min(-1), 0.0)  # [n, 8] (the min is -dmin * m <= 0)
    scale = (sub.max(-1) + mn) / levels
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mn.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32)[:, None], 1e-12)), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mn / np.maximum(dmin.astype(np.float32)[:, None], 1e-12)), 0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]  # [n, 8, 1]
    low = (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.round((sub + low) / np.maximum(step, 1e-12)), 0, levels).astype(np.uint8).reshape(-1, 256)
    return d, dmin, sc, m, q


def _q4_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_minmax(w, 15)
    c = q.reshape(-1, 4, 2, 32)
    qs = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_u8(d[:, None]), _u8(dmin[:, None]), _k_scales(sc, m), qs], axis=1)


def _q5_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_minmax(w, 31)
    c = q.reshape(-1, 4, 2, 32)
    qs = ((c[:, :, 0] & 0xF) | ((c[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    high = (q.reshape(-1, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[:, None]  # bit j: sub-block j
    qh = np.bitwise_or.reduce(high, axis=1).astype(np.uint8)  # [n, 32]
    return np.concatenate([_u8(d[:, None]), _u8(dmin[:, None]), _k_scales(sc, m), qh, qs], axis=1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    sub = w.reshape(-1, 16, 16)
    amax = np.abs(sub).max(-1) / 31  # [n, 16]
    d = (amax.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(amax / np.maximum(d.astype(np.float32)[:, None], 1e-12)), 1, 127).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = (np.clip(np.round(sub / np.maximum(step, 1e-12)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=-1).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6))
    return np.concatenate([ql, qh.reshape(-1, 64), _u8(sc), _u8(d[:, None])], axis=1)


def encode(w: np.ndarray, kind: str) -> np.ndarray:
    """w [..., in] float32 -> its GGML blocks, uint8 [..., in / block * block_bytes]."""
    from gguf import GGMLQuantizationType, quants

    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        flat = w.reshape(-1, 256).astype(np.float32)
        blocks = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}[kind](flat)
        return blocks.reshape(*w.shape[:-1], -1)
    return quants.quantize(w.astype(np.float32), GGMLQuantizationType[kind])


def _gguf_name(hf: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf in globals_:
        return globals_[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """q / k rows (or biases) as llama.cpp's converter stores a llama's: within each head the two halves interleaved
    (row 2i <- i, row 2i + 1 <- i + D / 2), for its interleaved RoPE."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, ref_dir: Path, types: dict | None = None) -> Path:
    """Write `hf_dir` (llama / qwen2 / qwen2_moe / qwen3 / qwen3_moe, per-expert or fused experts) as the GGUF `out`
    and its dequantized weights as the checkpoint `ref_dir` (config and generation config copied); returns `out`. A
    llama's q / k rows are permuted as llama.cpp's converter does, and its llama3 RoPE written as llama.cpp's
    `rope_freqs.weight` (frequency divisors); a qwen2_moe's shared-expert gate [1, H] is written as a vector, as
    llama.cpp's converter writes it; the reference holds them as transformers does."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    arch = ARCH[config["model_type"]]
    types = (SMALL_ROW_TYPES if config["hidden_size"] % 256 else DEFAULT_TYPES) | (types or {})
    state = {k: v.float() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    permuted: dict[str, int] = {}  # GGUF name -> heads its rows were permuted by
    tensors: dict[str, np.ndarray] = {}
    for name, w in state.items():  # experts fused into [experts, out, in] per matrix, as llama.cpp stores them
        if ".mlp.experts." in name:
            continue
        gname = _gguf_name(name)
        kind = gname.split(".")[2] if gname.startswith("blk.") else ""
        if arch == "llama" and kind in heads:
            permuted[gname] = heads[kind]
            tensors[gname] = _permute(w.numpy(), heads[kind])
        elif kind == "ffn_gate_inp_shexp":  # [1, hidden]: llama.cpp's converter writes it as a vector
            tensors[gname] = w.numpy().reshape(-1)
        else:
            tensors[gname] = w.numpy()
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        if f"{p}.0.gate_proj.weight" in state:
            for x in ("gate", "up", "down"):
                n = config.get("num_experts") or config["num_local_experts"]
                tensors[f"blk.{layer}.ffn_{x}_exps.weight"] = torch.stack(
                    [state[f"{p}.{e}.{x}_proj.weight"] for e in range(n)]).numpy()
        elif f"{p}.gate_up_proj" in state:
            gate, up = state[f"{p}.gate_up_proj"].chunk(2, dim=1)
            tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate.numpy()
            tensors[f"blk.{layer}.ffn_up_exps.weight"] = up.numpy()
            tensors[f"blk.{layer}.ffn_down_exps.weight"] = state[f"{p}.down_proj"].numpy()
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    writer.add_value_length(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    if config.get("rope_parameters", {}).get("rope_type", "default") != "default":  # llama3: its divisors
        from specoffload.runtime.models.config import ModelConfig

        scaled, _ = ModelConfig.from_dir(hf_dir).rope_inv_freq()
        base = config["rope_parameters"]["rope_theta"]
        plain = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        writer.add_tensor("rope_freqs.weight", (plain / scaled).numpy().astype(np.float32))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        if isinstance(config.get(key), int):
            add(config[key])
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    reference: dict[str, torch.Tensor] = {}
    for gname, w in tensors.items():
        key = gname.split(".", 2)[-1] if gname.startswith("blk.") else gname
        kind = types.get(key, "F32") if w.ndim >= 2 else "F32"
        if isinstance(kind, list):
            kind = kind[int(gname.split(".")[1]) % len(kind)]
        if kind == "F32":
            data = w.astype(np.float32)
            writer.add_tensor(gname, data)
            ref = data
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            data = encode(w, kind)
            writer.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
            ref = gguf.quants.dequantize(data, qtype).reshape(w.shape)
        if gname in permuted:
            ref = _unpermute(np.asarray(ref), permuted[gname])
        reference[gname] = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _write_reference(hf_dir, ref_dir, reference, state, config)
    return out


def _write_reference(hf_dir: Path, ref_dir: Path, reference: dict[str, torch.Tensor], state: dict,
                     config: dict) -> None:
    """The dequantized weights under their Hugging Face names (experts split back out), float32."""
    back = {_gguf_name(n): n for n in state if ".mlp.experts." not in n}
    out = {back[g]: t.reshape(state[back[g]].shape) for g, t in reference.items() if g in back}  # (a [1, H] gate)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        for x in ("gate", "up", "down"):
            fused = reference.get(f"blk.{layer}.ffn_{x}_exps.weight")
            if fused is not None:
                out |= {f"{p}.{e}.{x}_proj.weight": fused[e].clone() for e in range(fused.shape[0])}
    shutil.rmtree(ref_dir, ignore_errors=True)
    ref_dir.mkdir(parents=True)
    save_file(out, str(ref_dir / "model.safetensors"))
    config = dict(config, dtype="float32")
    (ref_dir / "config.json").write_text(json.dumps(config))
    if (hf_dir / "generation_config.json").is_file():
        shutil.copy(hf_dir / "generation_config.json", ref_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("ref_dir", type=Path)
    args = ap.parse_args()
    print(write_gguf(args.hf_dir, args.out, args.ref_dir))


if __name__ == "__main__":
    main()
