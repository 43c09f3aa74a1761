""""int4": asymmetric per group of `group` inputs (FlexGen, Sheng et al. 2023, section 5: group-wise min/scale).

min = min(w) (float16, rounded down), scale = (max(w) - min) / 15 (float16, rounded up), q = round((w - min) / scale)
in [0, 15], w' = q * scale + min. Two codes per byte (the even input in the low nibble): 4 + 32 / group bits per
weight (4.5 at group 64). A row whose length is not a multiple of the group is padded to one with its first element
(inside the group's range, so min and max are unchanged; dropped on dequantization). The scale and min are rounded
before the codes are computed, so |w - w'| <= scale / 2 for every element, as stored. Stored: W.qweight U8
[..., groups * group / 2], W.scale F16 [..., groups], W.zero F16 [..., groups] (the group's min). A streamed matrix of
a group the CPU int4 kernel takes (32 .. 256) stays packed in its slot: its codes permuted into the kernel's layout
(outputs padded to whole blocks of 64), its scale and zero (min + 8 * scale) in the compute dtype
(runtime/models/packed.py `PackedInt4`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.packed import PackedInt4, int4_packable, int4_padded, kernel_layout
from . import WeightFormat, register_format, round_down, round_up

INT4_LEVELS = 15
DEFAULT_GROUP = 64


@register_format
@dataclass(frozen=True)
class Int4(WeightFormat):
    """Asymmetric int4 per group of inputs, float16 scale and min (module docstring)."""

    name = "int4"
    default_group = DEFAULT_GROUP

    def __post_init__(self) -> None:
        if self.group < 2 or self.group % 2:
            raise ValueError(f"int4 needs an even group size of at least 2, got {self.group}")

    def components(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        self._check_matrix(shape)
        lead, groups = tuple(shape[:-1]), self.groups(shape[-1])
        return {"qweight": ("U8", (*lead, groups * self.group // 2)), "scale": ("F16", (*lead, groups)),
                "zero": ("F16", (*lead, groups))}

    def quantize_rows(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs, groups = x.shape[-1], self.groups(x.shape[-1])
        pad = groups * self.group - inputs
        if pad:  # the row's first element: inside its group's range, so min and max are unchanged
            x = torch.cat([x, x[..., :1].expand(*x.shape[:-1], pad)], dim=-1)
        g = x.unflatten(-1, (groups, self.group))  # [..., groups, group]
        lo = round_down(g.amin(dim=-1), torch.float16)  # [..., groups]
        hi = g.amax(dim=-1)  # [..., groups]
        if not (torch.isfinite(lo).all() and (hi - lo.float()).abs().max() <= torch.finfo(torch.float16).max):
            raise ValueError("weights outside float16's range cannot take int4's float16 min and scale")
        scale = round_up((hi - lo.float()) / INT4_LEVELS, torch.float16)  # [..., groups]
        s = scale.float()[..., None]
        q = torch.where(s > 0, (g - lo.float()[..., None]) / torch.where(s > 0, s, 1.0), 0.0)
        q = q.round_().clamp_(0, INT4_LEVELS).to(torch.uint8).flatten(-2)  # [..., groups * group]
        return {"qweight": q[..., 0::2] | (q[..., 1::2] << 4), "scale": scale, "zero": lo}

    def check_parts(self, parts: dict[str, torch.Tensor]) -> str | None:
        """The base checks, and every group's range, zero .. zero + 15 * scale, within float16's (+-65504)."""
        problem = super().check_parts(parts)
        scale, zero = parts.get("scale"), parts.get("zero")
        if problem is None and scale is not None and zero is not None:
            top = (zero.float() + INT4_LEVELS * scale.float()).abs().max() if scale.numel() else 0.0
            if float(top) > torch.finfo(torch.float16).max:
                problem = f"zero + 15 * scale reaches {float(top):.4g} (weights beyond float16's range)"
        return problem

    def stays_packed(self, shape: tuple[int, ...]) -> bool:
        return int4_packable(shape, self.group)

    def packed_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, align: int = 1) -> int:
        """The codes [out_p, in_p / 2] in the kernel's layout, padded to `align`, then scales_zeros [in_p / group,
        out_p, 2] (out_p, in_p: `int4_padded`)."""
        out, inputs = int4_padded(shape, self.group)
        return -(-out * inputs // 2 // align) * align + 2 * out * (inputs // self.group) * dtype.itemsize

    def packed_view(self, region: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                    align: int = 1) -> PackedInt4:
        out, inputs = int4_padded(shape, self.group)
        at = -(-out * inputs // 2 // align) * align
        sz = region[at : at + 2 * out * (inputs // self.group) * dtype.itemsize].view(dtype)
        return PackedInt4(region[: out * inputs // 2].view(out, inputs // 2), sz.view(inputs // self.group, out, 2),
                          self.group, shape[0], shape[1])

    def fill_packed(self, view: object, parts: dict[str, torch.Tensor], codes_there: bool = False) -> None:
        """The stored codes permuted into the kernel's layout (padded outputs: code 0), per group (scale, min + 8 *
        scale) in the compute dtype (the kernel's W' = (q - 8) * scale + zero; padded outputs: 0, 0)."""
        assert isinstance(view, PackedInt4) and not codes_there
        codes = parts["qweight"]  # [out, in_p / 2]
        out_p = view.codes.shape[0]
        if codes.shape[0] < out_p:
            codes = torch.cat([codes, codes.new_zeros(out_p - codes.shape[0], codes.shape[1])])
        kernel_layout(codes, out=view.codes)
        self.fill_scales(view, parts)

    def fill_scales(self, view: PackedInt4, parts: dict[str, torch.Tensor]) -> None:
        """Per group (scale, min + 8 * scale) in the compute dtype into the packed weight (padded outputs: 0, 0)."""
        scale, low = parts["scale"].float(), parts["zero"].float()  # [out, groups]
        n, out_p = scale.shape[0], view.codes.shape[0]
        if n < out_p:
            view.scales_zeros[:, n:].zero_()
        view.scales_zeros[:, :n, 0].copy_(scale.T)
        view.scales_zeros[:, :n, 1].copy_((low + 8 * scale).T)

    def dequantize_rows(self, dest: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        q, scale = parts["qweight"], parts["scale"]
        groups = scale.shape[-1]
        pairs = dest.view(*dest.shape[:-1], groups, self.group // 2, 2)  # [..., groups, group / 2, 2]
        codes = q.view(*q.shape[:-1], groups, self.group // 2)  # [..., groups, group / 2] uint8
        pairs[..., 0].copy_(codes & 0xF)  # even inputs: low nibble
        pairs[..., 1].copy_(codes >> 4)  # odd inputs: high nibble
        grouped = dest.view(*dest.shape[:-1], groups, self.group)  # [..., groups, group]
        return grouped.mul_(scale.float()[..., None]).add_(parts["zero"].float()[..., None]).view_as(dest)
