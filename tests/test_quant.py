"""runtime/formats/: the error bound of each format, the stored layout, and dequantization into a slot."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.runtime import formats
from specoffload.runtime.formats import (
    WeightFormat,
    dequantize,
    dequantize_into,
    quantize,
    storage_dtype,
    weight_format,
)
from specoffload.runtime.formats.int4 import INT4_LEVELS
from tests.conftest import needs_int4_kernel

SPECS = st.one_of(st.just(weight_format("int8")),
                  st.sampled_from([2, 4, 8, 32, 64]).map(lambda g: weight_format("int4", g)),
                  st.sampled_from([32, 64]).map(lambda g: weight_format("int8g", g)))


@st.composite
def weights(draw: st.DrawFn) -> torch.Tensor:
    """A [lead..., in] float weight of random size, scale and offset (some rows constant, some zero)."""
    lead = draw(st.lists(st.integers(1, 5), min_size=1, max_size=2))
    inputs = draw(st.integers(1, 150))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-4, 0.02, 1.0, 300.0]))
    offset = draw(st.sampled_from([0.0, 0.5, -3.0]))
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*lead, inputs, generator=g) * scale + offset * scale
    if draw(st.booleans()):
        w[..., 0, :] = w[..., 0, :1]  # a constant row: zero range
    if draw(st.booleans()):
        w[..., -1, :] = 0.0
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return w.to(dtype)


def _step(parts: dict[str, torch.Tensor], spec: WeightFormat, inputs: int) -> torch.Tensor:
    """Each element's quantization step (int8: its row's scale; int4, int8g: its group's), [..., in]."""
    scale = parts["scale"].float()
    if spec.name == "int8":
        return scale.expand(*scale.shape[:-1], inputs)
    return scale.repeat_interleave(spec.group, dim=-1)[..., :inputs]


@settings(max_examples=150, deadline=None)
@given(w=weights(), spec=SPECS)
def test_round_trip_error_is_at_most_half_a_step(w: torch.Tensor, spec: WeightFormat) -> None:
    parts = quantize(w, spec)
    back = dequantize(parts, spec, tuple(w.shape))  # float32
    x = w.float()
    step = _step(parts, spec, w.shape[-1])
    err = (back - x).abs()
    tol = step / 2 * (1 + 1e-5) + 1e-6 * x.abs() + 1e-30  # float32 arithmetic of the dequantization itself
    assert (err <= tol).all(), f"max excess {(err - step / 2).max().item()}"
    if spec.name == "int4":  # the step is the smallest float16 >= the group's range / 15
        g = math.ceil(w.shape[-1] / spec.group)
        assert parts["scale"].shape[-1] == g and parts["zero"].shape[-1] == g
        assert (parts["scale"].float() >= 0).all()


@settings(max_examples=100, deadline=None)
@given(w=weights(), spec=SPECS)
def test_stored_layout_matches_the_spec_and_round_trips_exactly(w: torch.Tensor, spec: WeightFormat) -> None:
    parts = quantize(w, spec)
    expected = spec.components(tuple(w.shape))
    assert {k: (v.dtype, tuple(v.shape)) for k, v in parts.items()} == {
        k: (storage_dtype(d), s) for k, (d, s) in expected.items()
    }
    assert sum(v.numel() * v.element_size() for v in parts.values()) == spec.nbytes(tuple(w.shape))
    if spec.name == "int8":
        q = parts["qweight"]
        assert q.abs().max() <= 127
        return
    if spec.name == "int8g":  # the nearest codes for the stored scales, |q| <= 127
        q = spec.codes(parts, w.shape[-2])[..., : w.shape[-1]].float()  # [..., in]
        step = _step(parts, spec, w.shape[-1])
        x = w.float()
        assert torch.equal(q, torch.where(step > 0, (x / torch.where(step > 0, step, 1.0)).round().clamp(-127, 127),
                                          0.0))
        return
    # the packing is exact: unpacking the nibbles (even input in the low nibble) gives codes that re-pack to it
    packed = parts["qweight"]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # [..., groups * group]
    assert codes.max() <= INT4_LEVELS
    assert torch.equal(codes[..., 0::2] | (codes[..., 1::2] << 4), packed)
    # the codes are the nearest ones for the stored min and scale
    x = w.float()
    inputs = x.shape[-1]
    step = _step(parts, spec, inputs)
    zero = parts["zero"].float().repeat_interleave(spec.group, dim=-1)[..., :inputs]
    expect = torch.where(step > 0, ((x - zero) / torch.where(step > 0, step, 1.0)).round().clamp(0, 15), 0.0)
    assert torch.equal(codes[..., :inputs].float(), expect)


@settings(max_examples=60, deadline=None)
@given(w=weights(), spec=SPECS, dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_dequantize_into_a_slot_view_equals_dequantize(w: torch.Tensor, spec: WeightFormat, dtype: torch.dtype) -> None:
    """The streamer writes into a view of a uint8 slot; the resident path allocates: the same values."""
    parts = quantize(w, spec)
    ref = dequantize(parts, spec, tuple(w.shape), dtype)
    slot = torch.full((ref.numel() * ref.element_size() + 64,), 0xAB, dtype=torch.uint8)
    dest = slot[64:].view(dtype).view(w.shape)
    dequantize_into(dest, parts, spec)
    assert torch.equal(dest, ref)
    assert (slot[:64] == 0xAB).all()  # nothing written outside the view
    assert torch.equal(ref, dequantize(parts, spec, tuple(w.shape)).to(dtype))  # float32 arithmetic, then cast


@settings(max_examples=60, deadline=None)
@given(w=weights(), spec=SPECS, dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       block=st.integers(1, 700))
def test_dequantize_into_16_bit_in_row_blocks_equals_one_float32_pass(w: torch.Tensor, spec: WeightFormat,
                                                                      dtype: torch.dtype, block: int) -> None:
    """A 16-bit dest is filled in blocks of rows through a small float32 scratch (several blocks here: the block
    is shrunk): exactly the float32 dequantization, cast once."""
    parts = quantize(w, spec)
    dest = torch.full(tuple(w.shape), float("nan"), dtype=dtype)
    with mock.patch.object(formats, "BLOCK_ELEMENTS", block):
        dequantize_into(dest, parts, spec)
    assert torch.equal(dest, dequantize(parts, spec, tuple(w.shape)).to(dtype))


def test_int4_is_4_5_bits_at_group_64_and_int8_about_8() -> None:
    assert weight_format("int4", 64).bits_per_weight((8960, 1536)) == pytest.approx(4.5)
    assert weight_format("int8").bits_per_weight((8960, 1536)) == pytest.approx(8 + 32 / 1536)


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="scheme"):
        weight_format("int3")
    with pytest.raises(ValueError, match="even group"):
        weight_format("int4", 63)
    with pytest.raises(ValueError, match="int8g is int8 per group"):
        weight_format("int8", 64)
    assert weight_format("int4") == weight_format("int4", 64)
    with pytest.raises(ValueError, match="non-finite"):
        quantize(torch.tensor([[1.0, math.inf]]), weight_format("int8"))


@settings(max_examples=80, deadline=None)
@given(w=weights(), group=st.sampled_from([32, 64, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_int4k_is_int4_with_its_codes_in_the_kernels_layout(w: torch.Tensor, group: int, dtype: torch.dtype) -> None:
    """int4k stores int4's scale and min as they are and its codes permuted per matrix into the CPU kernel's layout
    (outputs padded to whole blocks of 64 with code 0): its weight is int4's bit for bit, in any compute dtype."""
    from specoffload.runtime.models.packed import INT4_BLOCK, kernel_layout

    plain, kernel = weight_format("int4", group), weight_format("int4k", group)
    a, b = quantize(w, plain), quantize(w, kernel)
    assert torch.equal(a["scale"], b["scale"]) and torch.equal(a["zero"], b["zero"])
    *lead, out, half = a["qweight"].shape
    out_p = -(-out // INT4_BLOCK) * INT4_BLOCK
    assert {s: (storage_dtype(d), shape) for s, (d, shape) in kernel.components(tuple(w.shape)).items()} == {
        s: (t.dtype, tuple(t.shape)) for s, t in b.items()}
    assert b["qweight"].shape == (*lead, out_p, half)
    first = torch.cat([a["qweight"].reshape(-1, out, half)[0], a["qweight"].new_zeros(out_p - out, half)])
    assert torch.equal(b["qweight"].reshape(-1, out_p, half)[0], kernel_layout(first, block=INT4_BLOCK))
    shape = tuple(w.shape)
    assert torch.equal(dequantize(b, kernel, shape, dtype), dequantize(a, plain, shape, dtype))


def test_int4k_takes_only_the_kernels_groups():
    with pytest.raises(ValueError, match="int4k's group"):
        weight_format("int4k", 16)
    assert weight_format("int4k") == weight_format("int4k", 64) and weight_format("int4k").label == "int4kg64"


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 3), pairs=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
@needs_int4_kernel
def test_int8g_split_layout_is_the_int4_kernels_h_then_l_and_inverts(blocks: int, pairs: int, seed: int) -> None:
    """`split_layout` writes q + 128 = 16 h + l as aten's own int4 packing of the codes [H | L] (every int8 code,
    -128 included) at this machine's kernel block, and `split_codes` undoes the file layout's (blocks of 64)."""
    from specoffload.runtime.models.packed import INT4_BLOCK, kernel_block, relayout, split_codes, split_layout

    n, k = INT4_BLOCK * blocks, 2 * pairs
    q = torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    u = q + 128
    codes = torch.cat([u >> 4, u & 15], dim=1)  # [N, 2K]: H, then L
    stored = split_layout(q.to(torch.int8))
    packed = split_layout(q.to(torch.int8), block=kernel_block())
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2))
    assert torch.equal(relayout(stored), packed)
    assert torch.equal(split_codes(stored), q.to(torch.int8))


def test_int8g_takes_only_the_kernels_groups_and_is_8_5_bits_at_32():
    with pytest.raises(ValueError, match="int8g's group"):
        weight_format("int8g", 16)
    assert weight_format("int8g") == weight_format("int8g", 32) and weight_format("int8g").label == "int8g32"
    assert weight_format("int8g", 32).bits_per_weight((8960, 1536)) == pytest.approx(8.5)
    assert weight_format("int8g", 64).bits_per_weight((8960, 1536)) == pytest.approx(8.25)
