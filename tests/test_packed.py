"""Packed slots (runtime/models/packed.py): int8, int4 and int8g weights kept as codes in the ring slots and
multiplied by torch's weight-only kernels give the compressed target's values, row by row, and speculation on such
a target stays lossless."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.planner.shapes import PartKey
from specoffload.runtime.config import EngineConfig
from specoffload.runtime.engine import Engine
from specoffload.runtime.errors import ConfigError
from specoffload.runtime.formats import dequantize, weight_format
from specoffload.runtime.models.linear import linear, packed_kernel
from specoffload.runtime.models.model import Transformer
from specoffload.runtime.models.packed import (
    INT4_BLOCK,
    INT4_MAX_ROWS,
    INT8G_MAX_ROWS,
    KERNEL_BLOCKS,
    PACKED_MAX_ROWS,
    PackedInt4,
    PackedInt8,
    PackedInt8Split,
    halve_blocks,
    kernel_layout,
    packable,
    relayout,
    stored_layout,
)
from specoffload.runtime.offload.streamer import WeightStreamer
from specoffload.runtime.quantize import quantize_checkpoint
from specoffload.runtime.sampling import SamplingParams
from tests.conftest import OFFLOAD_PROMPTS, needs_int4_kernel


def _weight(out: int, inputs: int, dtype: torch.dtype, seed: int) -> PackedInt8:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (out, inputs), generator=g, dtype=torch.int8)  # [out, in]
    return PackedInt8(q, (torch.rand(out, generator=g) * 0.02).to(dtype))  # scale [out]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 2 * PACKED_MAX_ROWS), width=st.integers(1, 8), out=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_packed_linear_is_the_product_with_the_dequantized_weight(rows, width, out, dtype, seed):
    w = _weight(out, 16 * width, dtype, seed)
    x = torch.randn(rows, 16 * width, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)  # [N, in]
    y = linear(x, w)  # [N, out]
    assert y.dtype == dtype and y.shape == (rows, out)
    if rows > PACKED_MAX_ROWS:  # prefill-sized: dequantized on the spot, then the engine's GEMM for a dense weight
        assert torch.equal(y, linear(x, w.dequantize()))
        return
    exact = x.double() @ (w.qweight.double() * w.scale.double()[:, None]).T  # [N, out]
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-8  # one rounding of the output, one of each product sum
    bound = ulp * 4 * (x.double().abs() @ (w.qweight.double().abs() * w.scale.double()[:, None]).T) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_computed_on_its_own(dtype):
    """The kernel's result for a row does not depend on the rows beside it (a verify pass of k + 1 tokens per row
    and a decode pass of one give the same row values: lossless speculation on a packed target rests on it)."""
    w = _weight(40, 96, dtype, 0)
    x = torch.randn(PACKED_MAX_ROWS, 96).to(dtype)  # [N, in]
    together = linear(x, w)
    assert torch.equal(together, torch.cat([linear(x[i : i + 1], w) for i in range(len(x))]))
    assert torch.equal(together[:5], linear(x[:5], w))


def test_bias_leading_dims_and_the_widths_the_kernel_refuses():
    w = _weight(12, 32, torch.float32, 1)
    g = torch.Generator().manual_seed(0)  # (not the global stream: its state depends on the tests run before)
    x = torch.randn(2, 3, 32, generator=g)  # [B, T, in]
    bias = torch.randn(12, generator=g)
    want = F.linear(x, w.dequantize(), bias)
    assert torch.allclose(linear(x, w, bias), want, rtol=1e-5, atol=1e-6 * want.abs().max())
    assert not packable((12, 24)) and not packable((4, 12, 32)) and packable((12, 48))
    odd = _weight(12, 24, torch.bfloat16, 2)  # never packed by the streamer; computed through its dequantization
    x = torch.randn(3, 24).bfloat16()
    assert torch.equal(linear(x, odd), F.linear(x, odd.dequantize()))
    with pytest.raises(ValueError, match="int8 codes"):
        PackedInt8(torch.zeros(3, 4), torch.ones(3))
    gate, up = _weight(8, 32, torch.float32, 3).chunk(2)
    assert gate.shape == (4, 32) and up.scale.shape == (4,)


def _quantized(tiny_models, tmp_path_factory, fmt):  # noqa: ANN001, ANN202
    """name -> the tiny model quantized to `fmt`, made once per module."""
    root = tmp_path_factory.mktemp(f"packed-{fmt.label}")

    def get(name: str):
        out = root / name
        if not out.exists():
            quantize_checkpoint(tiny_models[name], out, fmt)
        return out

    return get


@pytest.fixture(scope="module")
def int8(tiny_models, tmp_path_factory):
    return _quantized(tiny_models, tmp_path_factory, weight_format("int8"))


@pytest.mark.parametrize("source", ["disk", "ram"])
@pytest.mark.parametrize("model", ["mixtral_fused", "qwen2_moe", "llama"])
def test_streamer_keeps_int8_weights_packed_in_the_slot(int8, source, model, single_thread):
    target = Transformer(int8(model))  # float32: the packed scale is the stored one, so values are exact
    keys = [k for k in target.loader.parts() if k.kind in ("dense_mlp", "expert", "router")][:6]
    plain = WeightStreamer(target.loader, 1, 1, "disk", "cpu")
    packed_probe = WeightStreamer(target.loader, 1, 1, "disk", "cpu", packed=True)
    slot_bytes = packed_probe.nbytes(keys)
    assert slot_bytes < plain.nbytes(keys)  # int8 codes instead of float32 weights
    with WeightStreamer(target.loader, slot_bytes, 2, source, "cpu", parts=keys, staging_bytes=8192,
                        packed=True) as s:
        for _ in range(2):  # slots and scratch reused
            got = s.load(1, keys)
            viewed = s.views(1, keys)
            packed = 0
            for key in keys:
                packed += _assert_same(got[key], target.loader.load(key))
                _assert_same(viewed[key], got[key])
            assert packed > 0


def _assert_same(a, b) -> int:
    """Field by field equal (a packed field through its dequantization); returns how many fields were packed."""
    packed = 0
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, PackedInt8):
            y = y.dequantize() if isinstance(y, PackedInt8) else y
            assert torch.equal(x.dequantize(), y), f.name
            packed += 1
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        elif dataclasses.is_dataclass(x):
            packed += _assert_same(x, y)
    return packed


@pytest.mark.parametrize("target", ["qwen2_moe", "llama"])
def test_speculation_on_a_packed_target_is_lossless(tiny_models, int8, target, single_thread):
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    base = EngineConfig(target=int8(target), max_batch_size=3, max_seq_len=48, device_memory="1GiB",
                        packed_weights="slots", num_draft_tokens=0)
    lo = Engine(base).minimum_device_memory()
    lo_off = Engine(replace(base, packed_weights="off")).minimum_device_memory()
    assert lo < lo_off  # the ring holds int8 codes
    engine = Engine(replace(base, device_memory=lo))  # the streamer's packed parts fit the planner's slots
    alone = [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, params)]
    streamer = engine.pipeline.workers.prefetch.streamer
    first = PartKey("expert", 0, 0) if target == "qwen2_moe" else PartKey("dense_mlp", 0)
    assert any(f.packed for f in streamer.layout(first).fields)
    engine.close()
    for draft in (tiny_models["qwen2_draft"], int8("qwen2_draft")):
        config = replace(base, draft=draft, num_draft_tokens=3)
        engine = Engine(replace(config, device_memory=Engine(config).minimum_device_memory()))
        assert [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, params)] == alone, draft
        engine.close()
    sampled = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    outs = []
    for packed, budget in (("on", lo), ("off", lo_off)):  # same draws; packed and dequantized targets agree here
        engine = Engine(replace(base, device_memory=budget, packed_weights=packed))
        outs.append([r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, sampled)])
        engine.close()
    assert outs[0] == outs[1]


def test_packed_weights_setting_is_checked():
    with pytest.raises(ConfigError, match="packed_weights must be"):
        EngineConfig(target="x", packed_weights="yes")
    with pytest.raises(ConfigError, match="for CPU compute"):
        EngineConfig(target="x", packed_weights="on", device="cuda")
    assert not EngineConfig(target="x", packed_weights="auto").packed_slots  # float32: dequantized slots
    bf16 = EngineConfig(target="x", dtype="bfloat16")
    assert bf16.packed_slots == hasattr(torch, "_weight_int8pack_mm")  # bfloat16 on any CPU (AVX2 too)
    assert not packed_kernel(torch.bfloat16, "cuda") and not replace(bf16, packed_weights="off").packed_slots


# --- int4 ---------------------------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(blocks=st.integers(1, 3), groups=st.integers(1, 4), group=st.sampled_from([32, 64, 128]),
       seed=st.integers(0, 2**31 - 1))
@needs_int4_kernel
def test_int4_kernel_layout_is_atens_and_inverts(blocks, groups, group, seed):
    """The byte permutation the loader applies is aten's own converter's output (this machine's block: 64 under
    AVX-512, 32 under AVX2), `stored_layout` undoes it at either block, and `relayout` takes the file layout (blocks
    of 64) to this machine's."""
    n, k = INT4_BLOCK * blocks, group * groups
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)  # [N, K]
    stored = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # [N, K / 2]: as runtime/formats/int4.py
    packed = kernel_layout(stored)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))
    assert torch.equal(stored_layout(packed), stored)
    for block in KERNEL_BLOCKS:
        assert torch.equal(stored_layout(kernel_layout(stored, block=block), block), stored)
    file_layout = kernel_layout(stored, block=INT4_BLOCK)
    assert torch.equal(relayout(file_layout), packed)
    assert torch.equal(relayout(file_layout, out=torch.empty_like(packed)), packed)


@settings(max_examples=30, deadline=None)
@given(blocks=st.integers(1, 3), half=st.sampled_from([1, 2, 8, 16, 24, 48]), offset=st.sampled_from([0, 1, 8]),
       seed=st.integers(0, 2**31 - 1))
def test_halving_the_blocks_is_going_through_the_stored_order(blocks, half, offset, seed):
    """`halve_blocks` (the file's blocks of 64 to AVX2's 32, on every load there) equals the layout at 32 of the
    stored order of the layout at 64, on any machine: on int64 lanes (contiguous, 8-byte aligned) and on bytes
    (a view at an odd offset), into a new tensor or `out`."""
    n = INT4_BLOCK * blocks
    g = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, 256, (offset + n * half,), generator=g, dtype=torch.uint8)
    codes = flat[offset:].view(n, half)  # [N, K / 2] in the file layout (any bytes are some codes)
    expected = kernel_layout(stored_layout(codes, INT4_BLOCK), block=INT4_BLOCK // 2)
    assert torch.equal(halve_blocks(codes), expected)
    out = torch.empty(offset + n * half, dtype=torch.uint8)[offset:].view(n, half)
    assert halve_blocks(codes, out) is out and torch.equal(out, expected)


def _int4(n: int, k: int, group: int, dtype: torch.dtype, seed: int) -> tuple[PackedInt4, torch.Tensor]:
    """A packed int4 weight filled by the format from a random float weight, and the format's own dequantization."""
    fmt = weight_format("int4", group)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    parts = fmt.quantize_rows(w)
    region = torch.full((fmt.packed_nbytes((n, k), dtype, 64),), 0xAB, dtype=torch.uint8)  # (stale bytes)
    view = fmt.packed_view(region, (n, k), dtype, 64)
    fmt.fill_packed(view, parts)
    return view, dequantize(parts, fmt, (n, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, INT4_MAX_ROWS, INT4_MAX_ROWS + 3])
@pytest.mark.parametrize(("n", "k", "group"), [(128, 192, 64), (96, 100, 32), (80, 96, 64)])
@needs_int4_kernel
def test_packed_int4_linear_is_the_product_with_its_weight(dtype, rows, n, k, group):
    """Both regimes (the kernel up to INT4_MAX_ROWS rows, dequantize + GEMM above) multiply by the same weight,
    (q - 8) * scale + zero, which is the format's q * scale + min up to the compute dtype's rounding of the scales;
    outputs beyond whole kernel blocks and inputs beyond whole groups are padded in the slot and cut off again."""
    w, stored = _int4(n, k, group, dtype, seed=rows)
    assert isinstance(w, PackedInt4) and w.shape == (n, k) and w.dtype == dtype and w.numel() == n * k
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(w.dequantize().float(), stored, atol=tol * stored.abs().max())
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = linear(x[None], w)[0]  # [rows, n]
    assert got.shape == (rows, n) and got.dtype == dtype
    want = x.float() @ w.dequantize().float().T
    assert torch.allclose(got.float(), want, atol=(1e-4 if dtype == torch.float32 else 2e-2) * want.abs().max())
    if n % 128 == 0:
        gate, up = w.chunk(2)
        assert torch.equal(torch.cat([gate.dequantize(), up.dequantize()]), w.dequantize())
    else:
        with pytest.raises(ValueError, match="blocks of 64"):
            w.chunk(2)


@needs_int4_kernel
def test_int4_weights_the_kernel_cannot_take_are_not_packed():
    fmt = weight_format("int4", 64)
    assert fmt.stays_packed((128, 192)) and fmt.stays_packed((64, 64))
    assert fmt.stays_packed((336, 1536)) and fmt.stays_packed((1536, 336))  # padded in the slot
    assert fmt.packed_nbytes((336, 1536), torch.bfloat16) == 384 * 1536 // 2 + 2 * 384 * 24 * 2
    assert not fmt.stays_packed((4, 128, 64))  # a fused expert tensor
    assert not weight_format("int4", 16).stays_packed((128, 64))  # the kernel takes groups of 32 .. 256


@pytest.fixture(scope="module")
def int4(tiny_models, tmp_path_factory):
    return _quantized(tiny_models, tmp_path_factory, weight_format("int4", 32))


@pytest.mark.parametrize("source", ["disk", "ram"])
@needs_int4_kernel
def test_streamer_keeps_int4_weights_packed_in_the_slot(int4, source, single_thread):
    """The tiny Llama's MLP weights ([128, 64], [64, 128]) stay packed: codes permuted into the kernel's layout, the
    scales beside them; the layers' weight is the loader's dequantized one (float32: to rounding)."""
    target = Transformer(int4("llama"))
    keys = [k for k in target.loader.parts() if k.kind == "dense_mlp"][:3]
    plain = WeightStreamer(target.loader, 1, 1, "disk", "cpu")
    packed_probe = WeightStreamer(target.loader, 1, 1, "disk", "cpu", packed=True)
    slot_bytes = packed_probe.nbytes(keys)
    assert slot_bytes < plain.nbytes(keys) / 4  # half a byte a weight instead of four
    with WeightStreamer(target.loader, slot_bytes, 2, source, "cpu", parts=keys, staging_bytes=8192,
                        packed=True) as s:
        for _ in range(2):  # slots and scratch reused
            got = s.load(0, keys)
            for key in keys:
                mlp, ref = got[key].mlp, target.loader.load(key).mlp
                for name in ("gate", "up", "down"):
                    w = getattr(mlp, name)
                    assert isinstance(w, PackedInt4), name
                    r = getattr(ref, name)
                    assert torch.allclose(w.dequantize(), r, atol=1e-6 * r.abs().max()), name


@pytest.mark.parametrize("scheme", ["int4", "int8g"])
@pytest.mark.parametrize("target", ["llama", "mixtral"])
@needs_int4_kernel
def test_speculation_on_a_packed_int4_or_int8g_target_is_lossless(tiny_models, scheme, target, single_thread,
                                                                  request):
    """An int4 (int8g) target whose streamed weights stay packed (the Mixtral's experts [96, 64] padded to a whole
    kernel block of 128 outputs in the slot): a smaller ring, the draft changes no token, and in float32 the packed
    target's tokens are those of the same checkpoint dequantized into the slots and resident."""
    ckpt = request.getfixturevalue(scheme)(target)
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    base = EngineConfig(target=ckpt, max_batch_size=3, max_seq_len=48, device_memory="1GiB",
                        packed_weights="slots", num_draft_tokens=0)
    lo = Engine(base).minimum_device_memory()
    lo_off = Engine(replace(base, packed_weights="off")).minimum_device_memory()
    assert lo < lo_off
    engine = Engine(replace(base, device_memory=lo))
    alone = [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, params)]
    streamer = engine.pipeline.workers.prefetch.streamer
    first = PartKey("expert", 0, 0) if target == "mixtral" else PartKey("dense_mlp", 0)
    assert any(f.packed for f in streamer.layout(first).fields)
    engine.close()
    config = replace(base, draft=tiny_models["qwen2_draft"], num_draft_tokens=3)
    engine = Engine(replace(config, device_memory=Engine(config).minimum_device_memory()))
    assert [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, params)] == alone
    engine.close()
    for over in ({"device_memory": lo_off}, {"device_memory": None}):  # dequantized into the slots; resident
        engine = Engine(replace(base, packed_weights="off", **over))
        assert [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, params)] == alone, over
        engine.close()


@pytest.mark.parametrize("target", ["llama", "mixtral"])
@needs_int4_kernel
def test_resident_parts_stay_packed(tiny_models, int4, target, single_thread):
    """packed_weights "on": the resident parts are held as the slots hold them (int4 codes for the kernel), the
    placement counts their packed bytes (a smaller footprint than "slots" at the same budget, everything resident),
    and in float32 the tokens are the dequantized target's."""
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    base = EngineConfig(target=int4(target), max_batch_size=3, max_seq_len=48, device_memory="1GiB",
                        num_draft_tokens=0)
    outs, used = {}, {}
    for mode in ("on", "slots"):
        engine = Engine(replace(base, packed_weights=mode))
        outs[mode] = [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, params)]
        used[mode] = engine.placement.device_bytes()
        resident = engine.pipeline.workers.verifier.model.resident
        key = PartKey("expert", 0, 0) if target == "mixtral" else PartKey("dense_mlp", 0)
        mlp = resident[key] if target == "mixtral" else resident[key].mlp
        assert isinstance(mlp.gate, PackedInt4) == (mode == "on")
        engine.close()
    assert used["on"] < used["slots"]
    assert outs["on"] == outs["slots"]


def test_resident_parts_pack_by_default_only_under_a_budget():
    from specoffload.runtime.models.linear import packed_kernel

    roomy = EngineConfig(target="x", dtype="bfloat16")
    tight = replace(roomy, device_memory="1GiB")
    assert not roomy.packed_resident and tight.packed_resident == packed_kernel(torch.bfloat16, torch.device("cpu"))
    assert replace(roomy, packed_weights="on").packed_resident and not replace(tight, packed_weights="slots") \
        .packed_resident and replace(tight, packed_weights="slots").packed_slots


@needs_int4_kernel
def test_the_profiler_times_the_streamed_ffn_as_the_slots_hold_it(int4, single_thread):
    """With packed slots the profiler's streamed FFN is the slot's (int4 codes for the kernel); without, none (the
    loader's dequantized weights are what a slot holds)."""
    from specoffload.runtime.models import layers
    from specoffload.runtime.offload.profiler import _streamed_mlp

    target = Transformer(int4("llama"))
    mlp, streamer = _streamed_mlp(EngineConfig(target=int4("llama"), packed_weights="on"), target,
                                  PartKey("dense_mlp", 0))
    assert streamer is not None and all(isinstance(getattr(mlp, n), PackedInt4) for n in ("gate", "up", "down"))
    x = torch.randn(3, 1, 64)
    ref = target.loader.load(PartKey("dense_mlp", 0)).mlp
    want = layers.gated_mlp(x, ref, target.config.hidden_act)
    assert torch.allclose(layers.gated_mlp(x, mlp, target.config.hidden_act), want, atol=1e-4 * want.abs().max())
    streamer.close()
    assert _streamed_mlp(EngineConfig(target=int4("llama"), packed_weights="off"), target,
                         PartKey("dense_mlp", 0)) == (None, None)


@pytest.fixture(scope="module")
def int4k(tiny_models, tmp_path_factory):
    return _quantized(tiny_models, tmp_path_factory, weight_format("int4k", 32))


@pytest.mark.parametrize("source", ["disk", "ram"])
@needs_int4_kernel
def test_int4k_codes_go_into_the_slot_as_stored(int4, int4k, source, single_thread, monkeypatch):
    """An int4k checkpoint's codes are read into the slot as they are where this machine's kernel reads the stored
    layout (AVX-512), re-laid by `relayout` where not (AVX2) (int4's permutation of stored codes is made to fail),
    and the packed weights are the int4 checkpoint's, byte for byte."""
    from specoffload.runtime.formats import int4 as int4_module

    plain, kernel = Transformer(int4("mixtral")), Transformer(int4k("mixtral"))
    keys = [k for k in kernel.loader.parts() if k.kind in ("dense_mlp", "expert")][:4]
    slot_bytes = WeightStreamer(kernel.loader, 1, 1, "disk", "cpu", packed=True).nbytes(keys)
    assert slot_bytes == WeightStreamer(plain.loader, 1, 1, "disk", "cpu", packed=True).nbytes(keys)
    with WeightStreamer(plain.loader, slot_bytes, 1, source, "cpu", parts=keys, packed=True) as s:
        want = s.load(0, keys)
        want = {k: {n: (getattr(w, n).codes.clone(), getattr(w, n).scales_zeros.clone()) for n in ("gate", "up",
                                                                                                   "down")}
                for k, w in want.items()}
    monkeypatch.setattr(int4_module, "kernel_layout", lambda *a, **k: pytest.fail("codes permuted on load"))
    with WeightStreamer(kernel.loader, slot_bytes, 2, source, "cpu", parts=keys, packed=True) as s:
        for slot in (0, 1, 0):
            got = s.load(slot, keys)
            for key in keys:
                for name, (codes, sz) in want[key].items():
                    w = getattr(got[key], name)
                    assert isinstance(w, PackedInt4) and torch.equal(w.codes, codes) and torch.equal(
                        w.scales_zeros, sz), (key, name)


@pytest.mark.parametrize("target", ["llama", "mixtral"])
def test_an_int4k_target_gives_the_int4_targets_tokens(int4, int4k, target, single_thread):
    """Offloaded at its minimum budget with packed slots, resident with packed parts, and resident dequantized:
    the int4k target's greedy tokens are the int4 target's (float32)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)

    def tokens(ckpt, **over):
        least = over.pop("device_memory", None) == "min"
        config = EngineConfig(target=ckpt, max_batch_size=3, max_seq_len=48, num_draft_tokens=0,
                              device_memory="1GiB" if least or over else None, **over)
        if least:
            config = replace(config, device_memory=Engine(config).minimum_device_memory())
        engine = Engine(config)
        try:
            return [r.token_ids for r in engine.generate(OFFLOAD_PROMPTS, params)]
        finally:
            engine.close()

    want = tokens(int4(target))
    for over in ({"device_memory": "min", "packed_weights": "slots"}, {"packed_weights": "on"}, {}):
        assert tokens(int4k(target), **dict(over)) == want, over


# --- int8 per group (the int4 kernel over H | L) ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, INT8G_MAX_ROWS, INT8G_MAX_ROWS + 3])
@pytest.mark.parametrize(("n", "k", "group"), [(128, 192, 64), (96, 100, 32)])
@needs_int4_kernel
def test_packed_int8g_linear_is_the_product_with_its_weight(dtype, rows, n, k, group):
    """Both regimes (the int4 kernel over [x, x] and the halves H | L up to INT8G_MAX_ROWS rows, dequantize + GEMM
    above) multiply by q * scale, the format's weight up to the compute dtype's rounding of the scales; padded
    outputs and inputs are cut off again."""
    fmt = weight_format("int8g", group)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(rows)) * 0.05
    parts = fmt.quantize_rows(w)
    stored = dequantize(parts, fmt, (n, k))  # float32
    region = torch.full((fmt.packed_nbytes((n, k), dtype, 64),), 0xAB, dtype=torch.uint8)  # (stale bytes)
    view = fmt.packed_view(region, (n, k), dtype, 64)
    fmt.fill_packed(view, parts)
    assert isinstance(view, PackedInt8Split) and view.shape == (n, k) and view.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(view.dequantize(), stored)
    else:  # the scale rounded to bfloat16, then q * scale rounded once
        assert torch.allclose(view.dequantize().float(), stored, rtol=2 ** -7, atol=0)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = linear(x[None], view)[0]  # [rows, n]
    want = x.float() @ view.dequantize().float().T
    assert got.shape == (rows, n) and got.dtype == dtype
    assert torch.allclose(got.float(), want, atol=(1e-5 if dtype == torch.float32 else 1e-2) * want.abs().max())
    if n % 128 == 0:
        gate, up = view.chunk(2)
        assert isinstance(gate, PackedInt8Split)
        assert torch.equal(torch.cat([gate.dequantize(), up.dequantize()]), view.dequantize())


@pytest.fixture(scope="module")
def int8g(tiny_models, tmp_path_factory):
    return _quantized(tiny_models, tmp_path_factory, weight_format("int8g", 32))


@pytest.mark.parametrize("source", ["disk", "ram"])
@needs_int4_kernel
def test_int8g_codes_go_into_the_slot_as_stored(int8g, source, single_thread, monkeypatch):
    """The stored codes are the slot's bytes in this machine's kernel layout (the stored bytes under AVX-512,
    `relayout`'s under AVX2; the int8g layout functions are made to fail on the load path), with H's scales
    (16 scale, 0) and L's (scale, 8 scale) beside them."""
    from specoffload.runtime.formats import int8g as int8g_module

    target = Transformer(int8g("mixtral"))
    keys = [k for k in target.loader.parts() if k.kind in ("dense_mlp", "expert")][:4]
    slot_bytes = WeightStreamer(target.loader, 1, 1, "disk", "cpu", packed=True).nbytes(keys)
    for name in ("split_layout", "split_codes"):
        monkeypatch.setattr(int8g_module, name, lambda *a, **k: pytest.fail("codes re-laid out on load"))
    ckpt = target.loader.checkpoint
    with WeightStreamer(target.loader, slot_bytes, 2, source, "cpu", parts=keys, packed=True) as s:
        for slot in (0, 1, 0):
            got = s.load(slot, keys)
            for key in keys:
                refs = target.loader.refs(key)
                for name in ("gate", "up", "down"):
                    w, ref = getattr(got[key], name), refs[name]
                    parts = ckpt.stored_parts(ref.name, ref.index)
                    assert isinstance(w, PackedInt8Split) and torch.equal(w.codes, relayout(parts["qweight"])), (
                        key, name)
                    scale = parts["scale"].float().T  # [groups, out]
                    groups, out = scale.shape
                    assert torch.equal(w.scales_zeros[:groups, :out, 0], 16 * scale)
                    assert torch.equal(w.scales_zeros[groups:, :out, 1], 8 * scale)
