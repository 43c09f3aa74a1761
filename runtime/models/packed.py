"""`PackedInt8`: a streamed int8 weight kept compressed in its ring slot, the layer multiplying by it directly.

A slot that keeps the codes (1 byte a weight instead of 2) needs no dequantization on the loader's thread, and
torch's weight-only int8 kernel reads them as they are:

  `torch._weight_int8pack_mm(x, q, s)` = (x @ q^T) * s, x [N, in] bfloat16, q [out, in] int8, s [out] bfloat16.

The kernel is a row loop, so above `PACKED_MAX_ROWS` rows (prefill) the weight is dequantized on the spot and
F.linear used. Only weights whose input width is a multiple of `PACKED_ALIGN` are packed (the kernel's limit).
Numerics: the scale is the stored float32 scale rounded to the compute dtype (the kernel takes the activation
dtype); both row regimes compute with it (`dequantize` rounds q * s once), so a packed target is one fixed model up
to the summation order of its GEMMs, as any bfloat16 target is across batch shapes (the kernel computes each row on
its own, so a row's result does not depend on the rows beside it). Used by default (`EngineConfig.packed_weights`
"auto") only where `linear.packed_kernel` holds: bfloat16 on a CPU with native 16-bit GEMMs. Which weights a format
keeps packed is the format's (runtime/formats/ `stays_packed`). The measurements behind the row limit and the
default: docs/perf/README.md, "kernel choices".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .checkpoint import QuantRef

#: rows up to which the int8 kernel beats dequantize + F.linear (module docstring: equal near 24-32 rows)
PACKED_MAX_ROWS = 16
#: the kernel's input width must be a multiple of this: torch 2.13's bfloat16 kernel returns garbage for 8 or 24
#: inputs and crashes for 17 (measured); such weights are never packed (`packable`)
PACKED_ALIGN = 16


def packable(shape: tuple[int, ...]) -> bool:
    """A weight of this shape can stay packed: a matrix whose input width the kernel takes."""
    return len(shape) == 2 and shape[-1] % PACKED_ALIGN == 0


def stays_packed(quant: QuantRef | None, shape: tuple[int, ...]) -> bool:
    """A streamed weight (`quant`: its compression, None if stored uncompressed) is kept packed in its slot when
    packed slots are on: where its format says so (runtime/formats/: an int8 matrix the kernel takes)."""
    return quant is not None and quant.spec.stays_packed(shape)


def slot_nbytes(shape: tuple[int, ...], dtype: torch.dtype, align: int = 1) -> int:
    """Bytes a packed [out, in] weight takes in a slot: its codes, padded to `align`, then one `dtype` scale per
    output channel (the streamer's layout, `align` its tensor alignment)."""
    return -(-math.prod(shape) // align) * align + shape[0] * dtype.itemsize


@dataclass(frozen=True, eq=False)
class PackedInt8:
    """An int8 weight W' = q * scale (per output channel), in place of a [out, in] compute-dtype tensor."""

    def __post_init__(self) -> None:
        if not (self.qweight.dtype == torch.int8 and self.qweight.dim() == 2 and self.scale.dim() == 1
                and self.scale.shape[0] == self.qweight.shape[0]):
            raise ValueError(f"a packed weight is int8 codes [out, in] and a scale [out], got "
                             f"{self.qweight.dtype} {list(self.qweight.shape)} and {list(self.scale.shape)}")

    qweight: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out], compute dtype

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def numel(self) -> int:
        return self.qweight.numel()

    def chunk(self, chunks: int, dim: int = 0) -> list[PackedInt8]:
        """Split along the output channels (a fused gate_up weight), as `Tensor.chunk(chunks, 0)` does."""
        if dim != 0:
            raise ValueError("a packed weight splits along its output channels (dim 0) only")
        return [PackedInt8(q, s) for q, s in zip(self.qweight.chunk(chunks), self.scale.chunk(chunks))]

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the compute dtype: q * scale in float32, rounded once."""
        return (self.qweight.float() * self.scale.float()[:, None]).to(self.dtype)


def packed_linear(x: torch.Tensor, w: PackedInt8) -> torch.Tensor:
    """x [N, in] @ W'^T -> [N, out] in the compute dtype."""
    if x.shape[0] <= PACKED_MAX_ROWS and packable(tuple(w.shape)):
        return torch._weight_int8pack_mm(x.to(w.dtype).contiguous(), w.qweight, w.scale)
    return F.linear(x.to(w.dtype), w.dequantize())
