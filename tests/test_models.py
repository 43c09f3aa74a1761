"""Our functional forward (runtime.models) against transformers' reference on tiny random checkpoints."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specoffload.runtime.models import layers
from specoffload.runtime.models.checkpoint import Checkpoint
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.models.weights import ExpertWeights, PartKey, RouterWeights

pytestmark = pytest.mark.usefixtures("single_thread")

ALL_MODELS = [
    "mixtral",
    "mixtral_fused",
    "qwen2_moe",
    "qwen2_moe_fused",
    "qwen2_moe_windowed",
    "llama",
    "llama_sharded",
    "llama_tied",
    "qwen2_draft",
    "mistral",
    "qwen3",
    "qwen3_moe",
    "qwen3_moe_fused",
    "olmoe",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
]
TOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


@functools.cache
def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_logits(path: Path, tokens: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference logits [len(tokens), V] of one unpadded sequence."""
    with torch.no_grad():
        return hf_model(path, dtype)(torch.tensor([tokens])).logits[0].float()


def ragged_batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Right-padded input_ids [B, max(lengths)] with random junk in the padding, and the unpadded rows."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (len(lengths), max(lengths)), generator=gen)
    return ids, [ids[b, :n].tolist() for b, n in enumerate(lengths)]


@pytest.mark.parametrize("name", ALL_MODELS)
def test_ragged_prefill_matches_reference(tiny_models: dict[str, Path], name: str) -> None:
    path = tiny_models[name]
    model = Transformer(path)
    lengths = [7, 3, 12]
    ids, rows = ragged_batch(lengths, seed=0)
    cache = model.new_cache(len(lengths), capacity=16)
    logits = model.forward(ids, cache, num_new=torch.tensor(lengths))  # [B, T, V]
    assert logits.dtype == torch.float32 and logits.shape == (3, 12, 512)
    assert cache.lengths.tolist() == lengths
    for b, row in enumerate(rows):
        assert rel_err(logits[b, : len(row)], hf_logits(path, row)) <= TOL, f"row {b}"


@pytest.mark.parametrize("name", ALL_MODELS)
def test_cached_decoding_matches_full_forward(tiny_models: dict[str, Path], name: str) -> None:
    """Ragged prefill, then greedy token-by-token steps; a tiny initial capacity forces cache growth.

    Step i's logits must equal the reference's full forward on the sequence so far; by causality that is
    position len - 1 of one reference forward over the final sequence, which keeps the test fast.
    """
    path = tiny_models[name]
    model = Transformer(path)
    lengths, steps = [5, 2], 6
    ids, rows = ragged_batch(lengths, seed=1)
    cache = model.new_cache(len(lengths), capacity=4)
    logits = model.forward(ids, cache, num_new=torch.tensor(lengths))
    last = logits[torch.arange(2), torch.tensor(lengths) - 1]  # [B, V]
    step_logits = []  # per step: [B, V], for the token at position len(row) - 1
    for _ in range(steps):
        next_ids = last.argmax(-1)  # [B]
        for b, row in enumerate(rows):
            row.append(int(next_ids[b]))
        last = model.forward(next_ids[:, None], cache)[:, 0]  # [B, V]
        step_logits.append(last)
    assert cache.lengths.tolist() == [len(r) for r in rows]
    assert cache.capacity >= 11
    for b, row in enumerate(rows):
        ref = hf_logits(path, row)[-steps:]  # [steps, V]
        for i in range(steps):
            assert rel_err(step_logits[i][b], ref[i]) <= TOL, f"row {b}, step {i}"


def test_output_positions_and_no_logits(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["qwen2_moe"]
    model = Transformer(path)
    lengths = [4, 7]
    ids, rows = ragged_batch(lengths, seed=6)
    full = model.forward(ids, model.new_cache(2, 8), num_new=torch.tensor(lengths))  # [B, T, V]
    cache = model.new_cache(2, 8)
    last = torch.tensor([[3], [6]])  # [B, 1]: each row's last valid position
    picked = model.forward(ids, cache, num_new=torch.tensor(lengths), output_positions=last)  # [B, 1, V]
    assert picked.shape == (2, 1, 512)
    torch.testing.assert_close(picked[:, 0], full[torch.arange(2), last[:, 0]])
    assert model.forward(torch.tensor([[9], [9]]), cache, compute_logits=False) is None
    assert cache.lengths.tolist() == [5, 8]


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "mistral"])
def test_verify_step_truncate_and_continue(tiny_models: dict[str, Path], name: str) -> None:
    """A speculative-style step: score 4 tokens per row, keep a different number per row, truncate, go on."""
    path = tiny_models[name]
    model = Transformer(path)
    ids, rows = ragged_batch([6, 6], seed=2)
    cache = model.new_cache(2, capacity=32)
    model.forward(ids, cache)
    proposal = torch.randint(3, 512, (2, 4), generator=torch.Generator().manual_seed(3))  # [B, 4]
    logits = model.forward(proposal, cache)  # [B, 4, V]
    for b in range(2):
        ref = hf_logits(path, rows[b] + proposal[b].tolist())[-4:]
        assert rel_err(logits[b], ref) <= TOL
    keep = [1, 3]  # accepted tokens per row
    cache.truncate(torch.tensor([6 + k for k in keep]))
    rows = [rows[b] + proposal[b, : keep[b]].tolist() for b in range(2)]
    more = torch.randint(3, 512, (2, 2), generator=torch.Generator().manual_seed(4))  # [B, 2]
    logits = model.forward(more, cache, num_new=torch.tensor([2, 1]))
    for b, n in enumerate([2, 1]):
        ref = hf_logits(path, rows[b] + more[b, :n].tolist())[-n:]
        assert rel_err(logits[b, :n], ref) <= TOL


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_bfloat16_is_close_to_reference(tiny_models: dict[str, Path], name: str) -> None:
    path = tiny_models[name]
    ids, rows = ragged_batch([9], seed=5)
    model = Transformer(path, dtype=torch.bfloat16)
    logits = model.forward(ids, model.new_cache(1, 16))
    assert logits.dtype == torch.float32
    assert rel_err(logits[0], hf_logits(path, rows[0], torch.bfloat16)) <= 3e-2
    assert rel_err(logits[0], hf_logits(path, rows[0])) <= 5e-2


def test_config_variants(tiny_models: dict[str, Path]) -> None:
    cfg = {name: Transformer(tiny_models[name]).config for name in ALL_MODELS}
    assert cfg["llama_tied"].tie_word_embeddings and not cfg["llama"].tie_word_embeddings
    assert cfg["qwen2_draft"].tie_word_embeddings and cfg["qwen2_draft"].qkv_bias
    assert cfg["llama"].qkv_bias and not cfg["mistral"].qkv_bias
    assert cfg["llama_tied"].head_dim == 32 and cfg["llama_tied"].num_kv_heads == 1
    assert cfg["llama"].rope_type == "llama3" and cfg["qwen2_moe"].rope_type == "yarn"
    assert cfg["mistral"].layer_windows == (4, 4) and cfg["mistral"].sliding_window == 4
    assert cfg["qwen2_moe_windowed"].layer_windows == (4, None, 4)
    assert cfg["llama"].sliding_window is None and cfg["qwen2_moe"].sliding_window is None
    assert cfg["mixtral"].moe_layers == {0, 1} and cfg["mixtral"].norm_topk_prob
    assert cfg["qwen2_moe"].moe_layers == {0, 2} and cfg["qwen2_moe"].has_shared_expert
    assert not cfg["qwen2_moe"].norm_topk_prob
    assert cfg["qwen2_moe_windowed"].moe_layers == {1} and cfg["qwen2_moe_windowed"].norm_topk_prob
    assert not cfg["llama"].is_moe and cfg["llama"].moe_layers == frozenset()
    assert cfg["qwen3"].qk_norm == "head" and cfg["qwen3"].o_bias and cfg["qwen3"].layer_windows == (None, 4)
    assert cfg["qwen3_moe"].moe_layers == {0, 2} and cfg["qwen3_moe"].num_experts == 16
    assert cfg["qwen3_moe"].norm_topk_prob and not cfg["qwen3_moe"].has_shared_expert
    assert cfg["olmoe"].qk_norm == "all" and cfg["olmoe"].clip_qkv == 1.5 and not cfg["olmoe"].norm_topk_prob
    assert cfg["olmoe"].moe_layers == {0, 1} and cfg["olmoe"].moe_intermediate_size == 24
    assert not cfg["mixtral"].route_weights_in_compute_dtype and cfg["olmoe"].route_weights_in_compute_dtype
    assert all(c.eos_token_ids == (2,) and c.vocab_size == 512 for c in cfg.values())


def test_tied_head_reads_the_embedding(tiny_models: dict[str, Path]) -> None:
    loader = Transformer(tiny_models["llama_tied"]).loader
    assert not loader.checkpoint.has("lm_head.weight")
    assert torch.equal(loader.head().lm_head, loader.embedding().embed)
    untied = Transformer(tiny_models["llama"]).loader
    assert not torch.equal(untied.head().lm_head, untied.embedding().embed)


def test_fused_and_per_expert_formats_read_the_same_experts(tiny_models: dict[str, Path]) -> None:
    for name in ("mixtral", "qwen2_moe"):
        per_expert = Transformer(tiny_models[name]).loader
        fused = Transformer(tiny_models[f"{name}_fused"]).loader
        key = PartKey("expert", 0, 3)
        assert all(ref.index is None for ref in per_expert.refs(key).values())
        assert all(ref.index == 3 for ref in fused.refs(key).values())
        a, b = per_expert.expert(0, 3), fused.expert(0, 3)
        for field in ("gate", "up", "down"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (name, field)
        assert per_expert.nbytes(key) == fused.nbytes(key)


def test_sharded_checkpoint_reads_the_same_tensors(tiny_models: dict[str, Path]) -> None:
    single, sharded = Checkpoint(tiny_models["llama"]), Checkpoint(tiny_models["llama_sharded"])
    assert single.names() == sharded.names()
    assert len({sharded.file_of(n).path for n in sharded.names()}) > 1
    for name in single.names():
        assert torch.equal(single.get(name), sharded.get(name))


def test_file_of_points_at_the_raw_bytes(tiny_models: dict[str, Path]) -> None:
    for name, tensor, index in [
        ("llama_sharded", "model.layers.1.self_attn.q_proj.weight", None),
        ("mixtral_fused", "model.layers.1.mlp.experts.down_proj", 2),
    ]:
        ckpt = Checkpoint(tiny_models[name])
        loc = ckpt.file_of(tensor, index)
        with open(loc.path, "rb") as f:
            f.seek(loc.offset)
            raw = np.frombuffer(f.read(loc.length), dtype="<f4")
        expected = ckpt.get(tensor, index=index)
        assert loc.length == ckpt.nbytes(tensor, index) == expected.numel() * 4
        assert np.array_equal(raw, expected.flatten().numpy())


def test_parts_and_nbytes(tiny_models: dict[str, Path]) -> None:
    model = Transformer(tiny_models["qwen2_moe"], dtype=torch.bfloat16)
    kinds = [(k.kind, k.layer) for k in model.loader.parts() if k.kind != "expert"]
    assert kinds == [
        ("embedding", -1),
        ("attention", 0), ("router", 0),
        ("attention", 1), ("dense_mlp", 1),
        ("attention", 2), ("router", 2),
        ("head", -1),
    ]  # fmt: skip
    ckpt = model.loader.checkpoint
    every_tensor = sum(ckpt.numel(n) for n in ckpt.names())
    assert model.loader.total_nbytes() == every_tensor * 2  # bf16, untied: each tensor in exactly one part
    assert model.loader.nbytes(PartKey("expert", 0, 1)) == 3 * 32 * 64 * 2
    tied = Transformer(tiny_models["llama_tied"]).loader
    embed_bytes = 512 * 64 * 4
    assert tied.nbytes(PartKey("head")) == embed_bytes + 64 * 4


def test_ffn_loads_only_selected_experts(tiny_models: dict[str, Path]) -> None:
    model = Transformer(tiny_models["mixtral"])
    cache = model.new_cache(1, 8)
    model.forward(torch.tensor([[5]]), cache)
    experts = [k for k in model.resident if k.kind == "expert"]
    assert sorted(k.layer for k in experts) == [0, 0, 1, 1]  # one token, top-2, in each of the 2 layers
    # padded tokens (token_mask False) pull in no expert
    fresh = Transformer(tiny_models["mixtral"])
    hidden = torch.randn(2, 3, 64)
    out = fresh.ffn(0, hidden, token_mask=torch.zeros(2, 3, dtype=torch.bool))
    assert not [k for k in fresh.resident if k.kind == "expert"]
    assert torch.equal(out, hidden)


@pytest.mark.parametrize(
    ("name", "normalised"), [("mixtral", True), ("qwen2_moe", False), ("qwen2_moe_windowed", True)]
)
def test_routing_normalisation(tiny_models: dict[str, Path], name: str, normalised: bool) -> None:
    cfg = Transformer(tiny_models[name]).config
    gate = torch.zeros(4, 64)
    gate[:, 0] = torch.tensor([3.0, 1.0, 2.0, 0.0])  # expert logits = x0 * [3, 1, 2, 0]
    w = RouterWeights(post_norm=torch.ones(64), gate=gate)
    hidden = torch.zeros(1, 1, 64)
    hidden[0, 0, 0] = 8.0  # rms-normalised to x0 = 8.0 (all other features 0)
    _, ids, weights = layers.route(cfg, w, hidden)
    probs = torch.softmax(torch.tensor([24.0, 8.0, 16.0, 0.0]), -1)
    assert ids.tolist() == [[0, 2]]
    expected = probs[[0, 2]] / (probs[[0, 2]].sum() if normalised else 1.0)
    torch.testing.assert_close(weights[0].float(), expected, rtol=1e-5, atol=1e-6)


def test_experts_forward_needs_every_selected_expert(tiny_models: dict[str, Path]) -> None:
    cfg = Transformer(tiny_models["mixtral"]).config
    one = ExpertWeights(torch.eye(96, 64), torch.eye(96, 64), torch.eye(64, 96))
    normed = torch.randn(3, 64)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    weights = torch.full((3, 2), 0.5)
    with pytest.raises(KeyError, match="expert 1"):
        layers.experts_forward(cfg, normed, ids, weights, {0: one})
    out = layers.experts_forward(cfg, normed, ids, weights, {0: one, 1: one})
    torch.testing.assert_close(out, torch.nn.functional.silu(normed) * normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_query_attention_is_the_fused_kernels_and_each_rows_own(dtype: torch.dtype, monkeypatch) -> None:
    """`layers._attend_few` (decode / verify on the CPU: at most FEW_QUERIES queries per row) gives what torch's fused
    attention gives, grouped-query heads and masks included, to the dtype's rounding; a row's result is the same alone,
    in the whole batch and in groups of 2 rows (FEW_ELEMENTS lowered); a query that sees no key averages the values
    (no NaN)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 6, 3, 32, generator=g).to(dtype)  # [B, heads, T, D]
    keys, values = (torch.randn(7, 2, 41, 32, generator=g).to(dtype) for _ in range(2))  # [B, kv, S, D]
    mask = torch.rand(7, 1, 3, 41, generator=g) > 0.4
    mask[..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), keys.double(), values.double(),
                                                            attn_mask=mask, scale=0.2, enable_gqa=True)
    got = layers._attend(q, keys, values, mask, 0.2, None)
    assert got.dtype == dtype and got.shape == (7, 6, 3, 32)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol)
    alone = torch.cat([layers._attend_few(q[i : i + 1], keys[i : i + 1], values[i : i + 1], mask[i : i + 1], 0.2)
                       for i in range(7)])
    assert torch.equal(alone, got)
    per_row = 2 * 41 * 64 + 6 * 3 * 41
    monkeypatch.setattr(layers, "FEW_ELEMENTS", 2 * per_row)  # groups of 2 rows
    assert torch.equal(layers._attend_few(q, keys, values, mask, 0.2), got)
    blind = torch.zeros_like(mask)
    mean = layers._attend_few(q, keys, values, blind, 0.2)
    assert torch.allclose(mean.double(), values.double().mean(2, keepdim=True).repeat_interleave(3, 1)
                          .expand(-1, -1, 3, -1).reshape(7, 6, 3, 32), rtol=tol, atol=tol)
