""""int4k": int4 (int4.py: the same codes, scale and min, rounded the same way) with its codes stored in the layout
torch's CPU int4 kernel reads (runtime/models/packed.py `kernel_layout`).

A streamed int4 matrix that stays packed has its codes permuted into the kernel's layout on every load: a pass over
the codes per weight per pass (~5 ms for a [8960, 1536] weight on 2 cores, ~0.4 s of a pass of the 1.5B model
streamed at a tight budget). Stored already permuted, the codes go from the file straight into their place in the
ring slot (`codes_in_slot`, as int8's do) and a load converts only the scale and min (an eighth of the bytes at
group 64) into the kernel's (scale, min + 8 * scale) pairs.

Stored: W.qweight U8 [..., out_p, in_p / 2] (int4's codes in `kernel_layout` per matrix at blocks of 64, the
AVX-512 kernel's; out_p: the outputs padded to whole blocks of 64 with code 0; where torch runs its AVX2 kernel,
whose blocks are 32 channels, a load re-lays the codes by nibble operations, `relayout`), W.scale F16 [..., out,
groups] and W.zero F16 [..., out, groups] as int4 stores them. The group is one the kernel takes (32, 64, 128 or 256).
Dequantization inverts the permutation (`stored_layout`, plain bit operations on any device) and applies int4's
arithmetic, so the weight is the int4 weight bit for bit; where this torch has no int4 kernel whose layout is known
(`int4_kernel_ok` false) the weight is dequantized into its slot as int4's is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.packed import INT4_BLOCK, INT4_GROUPS, int4_padded, kernel_block, kernel_layout, relayout, stored_layout
from . import WeightFormat, dequantize_into, register_format
from .int4 import DEFAULT_GROUP, Int4


@register_format
@dataclass(frozen=True)
class Int4Kernel(Int4):
    """int4 with its codes in the CPU kernel's layout (module docstring)."""

    name = "int4k"
    default_group = DEFAULT_GROUP

    def __post_init__(self) -> None:
        if self.group not in INT4_GROUPS:
            raise ValueError(f"int4k's group is one the int4 kernel takes, {INT4_GROUPS}; got {self.group}")

    @property
    def codes_in_slot(self) -> bool:  # type: ignore[override]
        """The disk read puts the codes straight into the slot: where this machine's kernel reads the stored layout
        (`kernel_block` 64, AVX-512); under AVX2 (blocks of 32) a load re-lays them (`relayout`)."""
        return kernel_block() == INT4_BLOCK

    def components(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        comps = super().components(shape)
        _, codes_shape = comps["qweight"]  # [..., out, in_p / 2]
        out_p, _ = int4_padded(tuple(shape[-2:]), self.group)
        comps["qweight"] = ("U8", (*shape[:-2], out_p, codes_shape[-1]))
        return comps

    def quantize_rows(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """int4's components, the codes permuted into the kernel's layout (outputs padded with code 0)."""
        parts = super().quantize_rows(x)
        codes = parts["qweight"]  # [..., out, in_p / 2]
        out, half = codes.shape[-2:]
        pad = int4_padded((out, x.shape[-1]), self.group)[0] - out
        if pad:
            codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-2], pad, half)], dim=-2)
        parts["qweight"] = kernel_layout(codes.reshape(-1, half).contiguous(), block=INT4_BLOCK).view(codes.shape)
        return parts

    def int4_parts(self, parts: dict[str, torch.Tensor], out: int) -> dict[str, torch.Tensor]:
        """The components as int4 stores them (codes [..., out, in_p / 2], input 2i in the low nibble) for a weight
        of `out` outputs."""
        codes = parts["qweight"]  # [..., out_p, in_p / 2], whole blocks of INT4_BLOCK per matrix
        half = codes.shape[-1]
        pairs = stored_layout(codes.reshape(-1, half).contiguous(), INT4_BLOCK).view(codes.shape)
        return {**parts, "qweight": pairs[..., :out, :]}

    def components_as(self, fmt: WeightFormat, parts: dict[str, torch.Tensor],
                      shape: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
        """Also int4's of the same group: the same codes in int4's order."""
        if fmt == Int4(self.group):
            return self.int4_parts(parts, shape[-2])
        return super().components_as(fmt, parts, shape)

    def dequantize_rows(self, dest: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return super().dequantize_rows(dest, self.int4_parts(parts, dest.shape[-2]))

    def dequantize_direct(self, dest: torch.Tensor, parts: dict[str, torch.Tensor]) -> bool:
        """Always: the stored rows are not the weight's rows (blocks of 64 outputs interleaved), so the codes are
        put back in int4's order for the whole weight, then int4's `dequantize_into` (its blocks, its arithmetic)."""
        dequantize_into(dest, self.int4_parts(parts, dest.shape[-2]), Int4(self.group))
        return True

    def fill_packed(self, view: object, parts: dict[str, torch.Tensor], codes_there: bool = False) -> None:
        """The stored codes copied into the slot in this machine's kernel layout (`relayout`: as they are where it is
        the stored one; unless the disk read put them there), then int4's per-group (scale, min + 8 * scale) in the
        compute dtype."""
        if not codes_there:
            relayout(parts["qweight"], out=view.codes)  # type: ignore[attr-defined]
        self.fill_scales(view, parts)
