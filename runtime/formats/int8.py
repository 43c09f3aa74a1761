""""int8": symmetric per output channel.

scale = max|w| / 127 (float32, rounded up), q = round(w / scale) in [-127, 127] (int8), w' = q * scale. Symmetric
because weight rows are centred on zero (no zero point to store or add, one multiply to dequantize); the 256th level
is given up. The scale is rounded before the codes are computed, so |w - w'| <= scale / 2 for every element, as
stored. Stored: W.qweight I8 [..., in], W.scale F32 [..., 1]. A streamed matrix the int8 kernel takes stays packed
in its slot (runtime/models/packed.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.packed import PackedInt8, packable
from . import WeightFormat, register_format, round_up

INT8_MAX = 127
MAX_SCALE = torch.finfo(torch.float16).max / INT8_MAX  # scale * 127 within float16's range


@register_format
@dataclass(frozen=True)
class Int8(WeightFormat):
    """Symmetric int8 with one float32 scale per output channel (module docstring)."""

    name = "int8"

    def __post_init__(self) -> None:
        if self.group != 0:
            raise ValueError("int8 is per output channel: it takes no group size (int8g is int8 per group of inputs)")

    def components(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        self._check_matrix(shape)
        return {"qweight": ("I8", tuple(shape)), "scale": ("F32", (*shape[:-1], 1))}

    def quantize_rows(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = round_up(x.abs().amax(dim=-1, keepdim=True) / INT8_MAX, torch.float32)  # [..., 1]
        q = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0)
        return {"qweight": q.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), "scale": scale}

    def dequantize_rows(self, dest: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        dest.copy_(parts["qweight"])  # [..., in] int8 -> float32, exact
        return dest.mul_(parts["scale"])  # [..., 1] float32 per row

    def check_parts(self, parts: dict[str, torch.Tensor]) -> str | None:
        """The base checks, codes in [-127, 127] and scales of at most MAX_SCALE (a weight beyond float16's range,
        +-65504, is no weight a 16-bit checkpoint held: a damaged scale)."""
        problem = super().check_parts(parts)
        scale, q = parts.get("scale"), parts.get("qweight")
        if problem is None and scale is not None and bool((scale > MAX_SCALE).any()):
            problem = f"scale holds {float(scale.max()):.4g} (> {MAX_SCALE:.4g}: weights beyond float16's range)"
        if problem is None and q is not None and bool((q < -INT8_MAX).any()):
            problem = "qweight holds code -128 (int8 codes are -127 .. 127)"
        return problem

    def stays_packed(self, shape: tuple[int, ...]) -> bool:
        return packable(shape)

    codes_in_slot = True

    def packed_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, align: int = 1) -> int:
        """The codes [out, in] (1 byte each), padded to `align`, then one `dtype` scale per output channel."""
        return -(-math.prod(shape) // align) * align + shape[0] * dtype.itemsize

    def packed_view(self, region: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                    align: int = 1) -> PackedInt8:
        numel = math.prod(shape)
        at = -(-numel // align) * align
        return PackedInt8(region[:numel].view(torch.int8).view(shape), region[at : at + shape[0] * dtype.itemsize]
                          .view(dtype))

    def fill_packed(self, view: object, parts: dict[str, torch.Tensor], codes_there: bool = False) -> None:
        assert isinstance(view, PackedInt8)
        if not codes_there:
            view.qweight.copy_(parts["qweight"])
        view.scale.copy_(parts["scale"].view(-1))  # [out] float32 -> the compute dtype
