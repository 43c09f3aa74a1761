"""The low-bit drafter (drafter="lowbit"): the target drafts for itself with int4 / int8 copies of the FFN parts it
streams (issue 40).

Lossless whatever it proposes (greedy equals the target's own decoding token for token, on dense and MoE targets,
fused experts included, with block KV and chunked prefill; seeded sampling reproducible); verification never reads
a key or value the drafter wrote; its copies are its format's codes multiplied by the format's kernel, taken as
stored from a checkpoint compressed in that format; placement counts its copies and pins what it shares.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specoffload.planner.shapes import PartKey
from specoffload.runtime.config import ConfigError, EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.formats import dequantize, quantize, weight_format
from specoffload.runtime.models.linear import linear
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.models.packed import KERNEL_DTYPE, PackedInt4, PackedInt8, stored_layout
from specoffload.runtime.offload.drafters import DRAFTERS
from specoffload.runtime.offload.drafters.lowbit import LowbitDrafter, lowbit_footprint, lowbit_part
from specoffload.runtime.quantize import quantize_checkpoint
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS, has_int4_kernel, needs_int4_kernel

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)  # as conftest's resident_greedy


def _config(tiny_models, target: str, fmt: str = "int4", **kw) -> EngineConfig:
    base = dict(target=tiny_models[target], drafter="lowbit", max_batch_size=3, max_seq_len=48, num_draft_tokens=3,
                device_memory="1GiB", num_buffers=1, drafter_options={"lowbit_format": fmt})
    return EngineConfig(**(base | kw))


def _tight(tiny_models, target: str, fmt: str = "int4", **kw) -> EngineConfig:
    """The smallest budget that places the plan, with one ring slot: the FFN parts stream, so the drafter copies
    them (with two slots keeping everything resident is cheaper once the shared parts are pinned)."""
    config = _config(tiny_models, target, fmt, **kw)
    roomy = Engine(config)
    budget = roomy.minimum_device_memory()
    roomy.close()
    return replace(config, device_memory=budget)


@pytest.mark.parametrize("target", ["llama", "mixtral", "qwen2_moe_fused"])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_lowbit_draft_is_lossless_at_the_minimum_budget(tiny_models, resident_greedy, single_thread, target, fmt):
    engine = Engine(_tight(tiny_models, target, fmt))
    streamed = [key for key in engine.placement.tiers if key.kind != "embedding" and engine.placement.is_streamed(key)]
    drafter = engine.workers.drafter
    assert isinstance(drafter, LowbitDrafter) and drafter.copies == len(streamed)  # a copy of each, no more
    if fmt == "int8" or has_int4_kernel():  # (int4 copies held dequantized cost the part's bytes: all resident)
        assert drafter.copies > 0 and {key.kind for key in streamed} >= {"dense_mlp" if target == "llama" else "expert"}
    items = {item.name: item.nbytes for item in engine.placement.items}
    assert items["draft weights"] == drafter.copy_bytes  # placement counts the copies it makes
    assert engine.placement.device_bytes() <= engine.config.device_memory
    out = engine.generate(OFFLOAD_PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == resident_greedy(target)
    stats = engine.last_stats
    assert stats.num_drafted > 0 and 0 < stats.num_accepted <= stats.num_drafted
    engine.close()


@pytest.mark.parametrize("extra", [dict(kv_block_size=4), dict(prefill_chunk=2), dict(refill=False)],
                         ids=["block-kv", "chunked", "waves"])
def test_lowbit_draft_is_lossless_with_block_kv_chunked_prefill_and_waves(tiny_models, resident_greedy,
                                                                          single_thread, extra):
    engine = Engine(_tight(tiny_models, "qwen2_moe", **extra))
    assert engine.workers.drafter.copies > 0 or not has_int4_kernel()  # (held dequantized: nothing to copy)
    assert [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, GREEDY)] == resident_greedy("qwen2_moe")
    assert engine.last_stats.num_drafted > 0
    engine.close()


class _Poisoning(LowbitDrafter):
    """After every draft call, overwrites every position past the target's committed ones (what it drafted, and the
    free space beyond) with large random values: verification must never read them before writing its own."""

    poisoned = 0

    def propose(self, batch, ids, num_new, params, seeds=None, warps=None):  # noqa: ANN001, ANN201
        out = super().propose(batch, ids, num_new, params, seeds, warps)
        target = self.target_kv[batch]
        for row, length in enumerate(target.lengths.tolist()):
            for store in (target.k, target.v):  # [layers, rows, kv_heads, capacity, head_dim]
                garbage = 1e3 * torch.randn_like(store[:, row, :, length:])
                store[:, row, :, length:] = garbage
        type(self).poisoned += 1
        return out


def test_verification_never_reads_what_the_drafter_wrote(tiny_models, resident_greedy, single_thread, monkeypatch):
    monkeypatch.setitem(DRAFTERS, "lowbit-poisoning", _Poisoning)  # (registered for this test only)
    config = replace(_tight(tiny_models, "mixtral"), drafter="lowbit-poisoning")
    engine = Engine(config)
    assert engine.workers.drafter.target_kv is engine.workers.attention.caches  # it drafts into the target's cache
    assert [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, GREEDY)] == resident_greedy("mixtral")
    assert _Poisoning.poisoned > 0 and engine.last_stats.num_drafted > 0
    engine.close()


def test_seeded_sampling_with_the_lowbit_draft_is_reproducible(tiny_models, single_thread):
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    config = _tight(tiny_models, "qwen2_moe")
    runs = []
    for _ in range(2):
        engine = Engine(config)
        runs.append([r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, params)])
        assert engine.last_stats.num_drafted > 0
        engine.close()
    assert runs[0] == runs[1] and all(len(t) == 8 for t in runs[0])


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@needs_int4_kernel
def test_a_copy_multiplies_as_its_dequantized_weights(tiny_models, fmt):
    """Each matrix of a copied part is its format's packed weight, multiplied in bfloat16 (the kernels' vector code,
    `KERNEL_DTYPE`) for a float32 model and equal in use to x @ dequantize(quantize(W))^T with x and the weight in
    bfloat16 (up to the bfloat16 rounding of the product), its result in the model's dtype."""
    model = Transformer(tiny_models["mixtral"])
    assert model.dtype == torch.float32
    spec = weight_format(fmt, 64 if fmt == "int4" else None)
    key = PartKey("expert", 1, 2)
    copy, exact = lowbit_part(model.loader, key, spec), model.loader.load(key)
    x = torch.randn(5, model.config.hidden_size)
    for name in ("gate", "up", "down"):
        w, packed = getattr(exact, name), getattr(copy, name)
        assert isinstance(packed, PackedInt4 if fmt == "int4" else PackedInt8) and packed.dtype == KERNEL_DTYPE
        x_in = x if name != "down" else torch.randn(5, w.shape[1])
        held = dequantize(quantize(w, spec), spec, tuple(w.shape), KERNEL_DTYPE).float()  # [out, in]
        reference = x_in.to(KERNEL_DTYPE).float() @ held.T
        got = linear(x_in, packed)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, reference, rtol=1e-2, atol=1e-2 * reference.abs().max().item())
        assert not torch.equal(held, w.to(KERNEL_DTYPE).float())  # a copy, not the weight


@pytest.mark.parametrize("stored_as", ["int4", "int4k"])
def test_a_checkpoint_stored_in_the_copy_format_is_taken_as_stored(tiny_models, tmp_path, stored_as):
    """No second rounding: from an int4 g64 checkpoint (or int4k g64: the same codes in the kernel's layout) the
    copy holds the stored codes and scales (the scales in KERNEL_DTYPE), so its weights are the checkpoint's
    dequantized ones up to that rounding of the scale and min (well under a code step)."""
    out = tmp_path / stored_as
    quantize_checkpoint(tiny_models["mixtral_fused"], out, weight_format(stored_as, 64))
    stored, fmt, key = Transformer(out), weight_format("int4", 64), PartKey("expert", 0, 1)
    copy = lowbit_part(stored.loader, key, fmt)
    exact = stored.loader.load(key)  # the checkpoint's own dequantization
    ckpt = stored.loader.checkpoint
    ref = stored.loader.refs(key)["gate_up"]
    int4 = weight_format(stored_as, 64).components_as(fmt, ckpt.stored_parts(ref.name, ref.index),
                                                       ckpt.shape_of(ref.name, ref.index))
    held = torch.cat([stored_layout(copy.gate.codes)[: copy.gate.out], stored_layout(copy.up.codes)[: copy.up.out]])
    assert torch.equal(held, int4["qweight"])  # [2 * inter, hidden / 2]: gate's rows, then up's
    scales = torch.cat([copy.gate.scales_zeros[:, : copy.gate.out, 0], copy.up.scales_zeros[:, : copy.up.out, 0]], 1)
    assert torch.equal(scales, int4["scale"].to(KERNEL_DTYPE).T)
    for name in ("gate", "up", "down"):
        w, m = getattr(exact, name), getattr(copy, name)  # [out, in]
        step = m.scales_zeros[:, : m.out, 0].float().T  # [out, groups]: a code step (int4's scale)
        err = (m.dequantize().float() - w).abs()
        err = torch.nn.functional.pad(err, (0, step.shape[1] * 64 - err.shape[1])).unflatten(1, (-1, 64)).amax(-1)
        assert (err <= step / 8).all(), name


@needs_int4_kernel
def test_placement_counts_a_copy_only_while_its_target_part_streams(tiny_models):
    """Every part but the embedding has a stand-in copy in the footprint; the budget pays for those of streamed
    target parts only, so a roomy budget that keeps the whole target resident holds no copy at all."""
    engine = Engine(_config(tiny_models, "mixtral", num_buffers=2))
    spec = weight_format("int4", 64)
    footprint = lowbit_footprint(engine.target, spec, shares_kv=True)
    shape = footprint.shape
    assert engine.models.draft == shape and shape.kv_bytes_per_token == 0 and shape.stands_in
    full = dict(engine.models.target.parts)
    copies = dict(shape.parts)
    assert set(copies) == {key for key in full if key.kind != "embedding"} and footprint.pins == frozenset()
    for key, n in copies.items():  # a copy is smaller than its part wherever the part has a matrix the kernel takes
        assert 0 < n <= full[key] and (n < full[key] or key.kind == "router")
    assert not engine.placement.streamed_layers  # 1 GiB: all resident, so no copy is held or counted
    items = {item.name: item.nbytes for item in engine.placement.items}
    assert items["draft weights"] == 0 and engine.workers.drafter.copies == 0
    streamed = {PartKey("expert", 1, e) for e in range(4)} | {PartKey("head")}
    assert shape.held_bytes(set(full) - streamed) == sum(copies[key] for key in streamed)
    own = lowbit_footprint(engine.target, spec, shares_kv=False)  # in a process of its own: all of it, and a cache
    assert own.shape.kv_bytes_per_token == engine.models.target.kv_bytes_per_token and not own.shape.stands_in
    assert {key for key, _ in own.shape.parts} == set(full)
    assert own.shape.held_bytes(set(full)) == own.shape.total_bytes
    engine.close()


@pytest.mark.parametrize(("options", "match"), [
    ({"lowbit_format": "int3"}, "lowbit_format must be one of"),
    ({"lowbit_group": 48}, "lowbit_group must be 32, 64, 128 or 256"),
])
def test_bad_lowbit_options_are_one_line(tiny_models, options, match):
    with pytest.raises(ConfigError, match=match):
        Engine(_config(tiny_models, "llama", drafter_options=options))


def test_the_lowbit_draft_needs_a_budget(tiny_models):
    with pytest.raises(ConfigError, match="needs device_memory"):
        EngineConfig(tiny_models["llama"], drafter="lowbit")


@needs_int4_kernel
def test_the_profiled_step_copies_the_ffn_and_keeps_attention_and_head_as_stored(tiny_models):
    """The profiler times the step of the typical placement: FFN parts as copies, attention and head as stored."""
    model, allowed = LowbitDrafter.step_model(_config(tiny_models, "qwen2_moe"))
    assert allowed is None and set(model.resident) == set(model.loader.parts())  # nothing left to fetch
    for key, part in model.resident.items():
        if key.kind == "expert":
            assert isinstance(part.gate, PackedInt4) and isinstance(part.down, PackedInt4)
        elif key.kind == "router" and part.shared_expert is not None:
            assert isinstance(part.shared_expert.up, PackedInt4) and isinstance(part.gate, torch.Tensor)
        elif key.kind == "attention":
            assert isinstance(part.q, torch.Tensor)
        elif key.kind == "head":
            assert isinstance(part.lm_head, torch.Tensor)
