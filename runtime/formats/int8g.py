""""int8g": symmetric int8 per group of `group` inputs (llama.cpp's Q8_0 at group 32), its codes stored as torch's CPU
int4 kernel multiplies them.

scale = max|w| / 127 over the group (float16, rounded up), q = round(w / scale) in [-127, 127], w' = q * scale. The
scale is rounded before the codes are computed, so |w - w'| <= scale / 2 for every element, as stored; a group's
scale follows its own largest weight, so the error shrinks where a row's weights are small (int8.py's one scale per
row takes its largest weight's: top-1 agreement 0.984 on the dense 1.5B). A row whose length is not a multiple of
the group is padded with zeros (code 0). 8 + 16 / group bits per weight (8.5 at group 32).

No torch kernel multiplies int8 codes with a scale per group, so the codes are stored as the int4 kernel's: q + 128 =
16 h + l, and the weight is the int4 weight [H | L] over the inputs taken twice (runtime/models/packed.py
`PackedInt8Split`: one kernel call, twice an int4 weight's work, docs/perf int8g_kernel). Stored: W.qweight U8 [...,
out_p, in_p] (`split_layout` per matrix: out_p the outputs padded to whole kernel blocks of 64 with code 0, in_p the
inputs to whole groups), W.scale F16 [..., out, groups]. A streamed matrix's codes go from the file straight into
its ring slot (`codes_in_slot`; where torch runs its AVX2 kernel, whose layout blocks are 32 channels, a load
re-lays them); a load writes only the scales, (16 scale, 0) for H and (scale, 8 scale) for L, in
the compute dtype. Where this torch's kernel does not read the layout the weight is dequantized into its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.packed import (
    INT4_BLOCK,
    INT4_GROUPS,
    PackedInt8Split,
    int4_packable,
    int4_padded,
    kernel_block,
    relayout,
    split_codes,
    split_layout,
)
from . import WeightFormat, dequantize_into, register_format, round_up
from .int8 import INT8_MAX

DEFAULT_GROUP = 32


@register_format
@dataclass(frozen=True)
class Int8Group(WeightFormat):
    """Symmetric int8 with one float16 scale per group of inputs, codes in the split int4 kernel layout (module
    docstring)."""

    name = "int8g"
    default_group = DEFAULT_GROUP

    def __post_init__(self) -> None:
        if self.group not in INT4_GROUPS:
            raise ValueError(f"int8g's group is one the int4 kernel takes, {INT4_GROUPS}; got {self.group}")

    @property
    def codes_in_slot(self) -> bool:  # type: ignore[override]
        """The disk read puts the codes straight into the slot where this machine's kernel reads the stored layout
        (AVX-512); under AVX2 a load re-lays them (`relayout`)."""
        return kernel_block() == INT4_BLOCK

    @property
    def label(self) -> str:
        return f"{self.name}{self.group}"  # int8g32

    def components(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        self._check_matrix(shape)
        out_p, in_p = int4_padded(tuple(shape[-2:]), self.group)
        return {"qweight": ("U8", (*shape[:-2], out_p, in_p)),
                "scale": ("F16", (*shape[:-1], self.groups(shape[-1])))}

    def quantize_rows(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        *lead, out, inputs = x.shape
        out_p, in_p = int4_padded((out, inputs), self.group)
        g = F.pad(x, (0, in_p - inputs)).unflatten(-1, (in_p // self.group, self.group))  # [..., out, groups, group]
        scale = round_up(g.abs().amax(dim=-1) / INT8_MAX, torch.float16)  # [..., out, groups]
        if not torch.isfinite(scale).all():
            raise ValueError("weights beyond float16's range cannot take int8g's float16 scale")
        s = scale.float()[..., None]
        q = torch.where(s > 0, g / torch.where(s > 0, s, 1.0), 0.0).round_().clamp_(-INT8_MAX, INT8_MAX)
        q = F.pad(q.to(torch.int8).flatten(-2), (0, 0, 0, out_p - out))  # [..., out_p, in_p]
        codes = split_layout(q.reshape(-1, in_p).contiguous()).view(q.shape)
        return {"qweight": codes, "scale": scale}

    def codes(self, parts: dict[str, torch.Tensor], out: int) -> torch.Tensor:
        """The int8 codes [..., out, in_p] of a weight of `out` outputs."""
        stored = parts["qweight"]  # [..., out_p, in_p]
        q = split_codes(stored.reshape(-1, stored.shape[-1]).contiguous()).view(stored.shape)
        return q[..., :out, :]

    def dequantize_rows(self, dest: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """`parts` as stored (uint8 codes in the split layout) or with the codes already in row order (int8, from
        `dequantize_direct`)."""
        scale, q = parts["scale"], parts["qweight"]  # [..., out, groups]
        if q.dtype == torch.uint8:
            q = self.codes(parts, dest.shape[-2])
        grouped = dest.view(*dest.shape[:-1], scale.shape[-1], self.group)  # [..., out, groups, group]
        grouped.copy_(q.view(grouped.shape))
        return grouped.mul_(scale.float()[..., None]).view_as(dest)

    def dequantize_direct(self, dest: torch.Tensor, parts: dict[str, torch.Tensor]) -> bool:
        """Stored codes: the stored rows are not the weight's rows (blocks of 64 outputs interleaved), so the codes
        are put back in row order for the whole weight (a byte each), then `dequantize_into`'s blocks of rows scale
        them (as int4k does through int4). Codes in row order already: False (those blocks)."""
        if parts["qweight"].dtype != torch.uint8:
            return False
        dequantize_into(dest, {**parts, "qweight": self.codes(parts, dest.shape[-2])}, self)
        return True

    def stays_packed(self, shape: tuple[int, ...]) -> bool:
        return int4_packable(shape, self.group)

    def packed_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, align: int = 1) -> int:
        """The codes [out_p, in_p] (one byte a weight), padded to `align`, then scales_zeros [2 in_p / group, out_p,
        2] (H's groups, then L's)."""
        out, inputs = int4_padded(shape, self.group)
        return -(-out * inputs // align) * align + 4 * out * (inputs // self.group) * dtype.itemsize

    def packed_view(self, region: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                    align: int = 1) -> PackedInt8Split:
        out, inputs = int4_padded(shape, self.group)
        at = -(-out * inputs // align) * align
        groups = 2 * inputs // self.group
        sz = region[at : at + 2 * out * groups * dtype.itemsize].view(dtype).view(groups, out, 2)
        return PackedInt8Split(region[: out * inputs].view(out, inputs), sz, self.group, shape[0], shape[1])

    def fill_packed(self, view: object, parts: dict[str, torch.Tensor], codes_there: bool = False) -> None:
        """The stored codes copied into the slot in this machine's kernel layout (`relayout`; unless the disk read put
        them there); per group H's
        (16 scale, 0) and L's (scale, 8 scale) in the compute dtype (padded outputs: 0, 0)."""
        assert isinstance(view, PackedInt8Split)
        if not codes_there:
            relayout(parts["qweight"], out=view.codes)
        scale = parts["scale"].float().T  # [groups, out]
        groups, n = scale.shape
        sz = view.scales_zeros  # [2 groups, out_p, 2]
        sz[:, n:].zero_()
        sz[:groups, :n, 0].copy_(scale * 16)
        sz[:groups, :n, 1].zero_()
        sz[groups:, :n, 0].copy_(scale)
        sz[groups:, :n, 1].copy_(scale * 8)
