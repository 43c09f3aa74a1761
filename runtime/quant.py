"""Weight compression for streaming: int8 per output channel and int4 per group, with their exact dequantization.

Two schemes, both applied along a weight's last (input) dimension, every leading dimension being a "row" (an
output channel; a fused expert tensor `[experts, out, in]` is `experts x out` rows):

  int8  symmetric per row: scale = max|w| / 127 (float32), q = round(w / scale) in [-127, 127] (int8),
        w' = q * scale. Symmetric because weight rows are centred on zero (no zero point to store or add, one
        multiply to dequantize); the 256th level is given up.
  int4  asymmetric per group of `group` inputs (FlexGen, Sheng et al. 2023, section 5: group-wise min/scale):
        min = min(w), scale = (max(w) - min) / 15, q = round((w - min) / scale) in [0, 15], w' = q * scale + min.
        Two codes per byte (the even input in the low nibble), scale and min in float16: 4 + 32 / group bits per
        weight (4.5 at group 64). A row whose length is not a multiple of the group is padded to one (the
        padding quantizes to the group's min and is dropped on dequantization).

Scale (and min) are rounded to their stored dtype *before* the codes are computed (min rounded down, scale up), so
the stored codes are the nearest ones for the stored scale: |w - w'| <= scale / 2 for every element, exactly as
stored (up to the float32 rounding of the dequantization itself). `dequantize_into` writes the dequantized weight
straight into a caller's tensor in the compute dtype (the streamer's ring slot), with the arithmetic in float32.

Stored components of a weight named W of shape [..., in] (`QuantSpec.components`):
  int8: W.qweight I8 [..., in],            W.scale F32 [..., 1]
  int4: W.qweight U8 [..., groups*group/2], W.scale F16 [..., groups], W.zero F16 [..., groups] (the group's min)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .cast import BLOCK_ELEMENTS

SCHEMES = ("int8", "int4")
DEFAULT_GROUP = 64
INT8_MAX = 127
INT4_LEVELS = 15
#: component suffixes, in the order they are stored (adjacent in the file, so one read fetches a weight)
COMPONENTS = ("qweight", "scale", "zero")
#: safetensors dtype string -> torch dtype of each component
_STORAGE = {"I8": torch.int8, "U8": torch.uint8, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class QuantSpec:
    """A compression scheme: "int8" (per output channel) or "int4" with `group` inputs per scale (module doc)."""

    scheme: str
    group: int = 0  # int4 only: inputs per group (even); 0 for int8

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {self.scheme!r}; expected one of {SCHEMES}")
        if self.scheme == "int4" and (self.group < 2 or self.group % 2):
            raise ValueError(f"int4 needs an even group size of at least 2, got {self.group}")
        if self.scheme == "int8" and self.group != 0:
            raise ValueError("int8 is per output channel: it takes no group size")

    @classmethod
    def of(cls, scheme: str, group: int | None = None) -> QuantSpec:
        """The spec for a CLI choice: int4's group defaults to DEFAULT_GROUP; int8 ignores none given."""
        if scheme == "int8":
            if group not in (None, 0):
                raise ValueError("--group applies to int4 only (int8 has one scale per output channel)")
            return cls("int8")
        return cls(scheme, DEFAULT_GROUP if group is None else group)

    def groups(self, inputs: int) -> int:
        return math.ceil(inputs / self.group) if self.scheme == "int4" else 1

    def components(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Suffix -> (safetensors dtype, shape) of what a weight of `shape` is stored as."""
        if len(shape) < 2:
            raise ValueError(f"only matrices (or stacks of them) are quantized, got shape {shape}")
        lead, inputs = tuple(shape[:-1]), shape[-1]
        if self.scheme == "int8":
            return {"qweight": ("I8", shape), "scale": ("F32", (*lead, 1))}
        groups = self.groups(inputs)
        return {"qweight": ("U8", (*lead, groups * self.group // 2)), "scale": ("F16", (*lead, groups)),
                "zero": ("F16", (*lead, groups))}

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Stored bytes of a weight of `shape` (codes, scales and zero points)."""
        return sum(math.prod(s) * _STORAGE[d].itemsize for d, s in self.components(shape).values())

    def bits_per_weight(self, shape: tuple[int, ...]) -> float:
        return 8.0 * self.nbytes(shape) / math.prod(shape)


def storage_dtype(name: str) -> torch.dtype:
    return _STORAGE[name]


def quantize(w: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """Compress a weight [..., in] (any float dtype) into its components (suffix -> tensor, see module doc)."""
    x = w.detach().to(torch.float32)  # [..., in]
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize a weight with non-finite values")
    if spec.scheme == "int8":
        scale = _round_up(x.abs().amax(dim=-1, keepdim=True) / INT8_MAX, torch.float32)  # [..., 1]
        q = torch.where(scale > 0, x / torch.where(scale > 0, scale, 1.0), 0.0)
        return {"qweight": q.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), "scale": scale}
    inputs, groups = x.shape[-1], spec.groups(x.shape[-1])
    pad = groups * spec.group - inputs
    if pad:  # pad with the row's first element: it lies inside its group's range, so min and max are unchanged
        x = torch.cat([x, x[..., :1].expand(*x.shape[:-1], pad)], dim=-1)
    g = x.unflatten(-1, (groups, spec.group))  # [..., groups, group]
    lo = _round_down(g.amin(dim=-1), torch.float16)  # [..., groups]
    hi = g.amax(dim=-1)  # [..., groups]
    if not (torch.isfinite(lo).all() and (hi - lo.float()).abs().max() <= torch.finfo(torch.float16).max):
        raise ValueError("weights outside float16's range cannot take int4's float16 min and scale")
    scale = _round_up((hi - lo.float()) / INT4_LEVELS, torch.float16)  # [..., groups]
    s = scale.float()[..., None]
    q = torch.where(s > 0, (g - lo.float()[..., None]) / torch.where(s > 0, s, 1.0), 0.0)
    q = q.round_().clamp_(0, INT4_LEVELS).to(torch.uint8).flatten(-2)  # [..., groups * group]
    return {"qweight": q[..., 0::2] | (q[..., 1::2] << 4), "scale": scale, "zero": lo}


def dequantize_into(dest: torch.Tensor, parts: dict[str, torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """Write the dequantized weight into `dest` [..., in] (its dtype: the compute dtype), arithmetic in float32.

    `parts` are the stored components (their leading dims equal dest's). Returns `dest`. A float32, contiguous
    `dest` (whose rows are whole groups) is written in place: the codes converted into it, then scaled (and
    shifted) in place, 4x faster on the CPU than one mixed-dtype `mul` / `addcmul` (35 -> 9 ms for int8, 42 ->
    18 ms for int4 on an [8960, 1536] weight, one thread, AVX2); any other `dest` in blocks of rows through one
    float32 scratch of about `BLOCK_ELEMENTS` (bfloat16 out on an AVX512-BF16 CPU: int8 4.6 ms, int4 13 ms; through
    one whole-size temporary 20 / 28 ms, its first touch dominating).
    """
    q, scale = parts["qweight"], parts["scale"]
    groups = scale.shape[-1]
    width = groups * spec.group if spec.scheme == "int4" else dest.shape[-1]  # a row with int4's group padding
    if dest.dtype != torch.float32 or not dest.is_contiguous() or width != dest.shape[-1]:
        rows = dest.reshape(-1, dest.shape[-1]) if dest.is_contiguous() else None  # [R, in] view
        if rows is None or dest.device.type != "cpu":  # one temporary (CUDA: the block loop would launch per block)
            full = torch.empty(*dest.shape[:-1], width, dtype=torch.float32, device=dest.device)
            dest.copy_(dequantize_into(full, parts, spec)[..., : dest.shape[-1]])
            return dest
        flat = {k: v.reshape(-1, v.shape[-1]) for k, v in parts.items()}  # [R, ...] each
        step = max(1, BLOCK_ELEMENTS // width)
        scratch = torch.empty(step, width, dtype=torch.float32)  # [step, width]
        for start in range(0, rows.shape[0], step):
            stop = min(start + step, rows.shape[0])
            block = dequantize_into(scratch[: stop - start], {k: v[start:stop] for k, v in flat.items()}, spec)
            rows[start:stop].copy_(block[:, : rows.shape[1]])
        return dest
    if spec.scheme == "int8":
        dest.copy_(q)  # [..., in] int8 -> float32, exact
        dest.mul_(scale)  # [..., 1] float32 per row
        return dest
    pairs = dest.view(*dest.shape[:-1], groups, spec.group // 2, 2)  # [..., groups, group / 2, 2]
    codes = q.view(*q.shape[:-1], groups, spec.group // 2)  # [..., groups, group / 2] uint8
    pairs[..., 0].copy_(codes & 0xF)  # even inputs: low nibble
    pairs[..., 1].copy_(codes >> 4)  # odd inputs: high nibble
    grouped = dest.view(*dest.shape[:-1], groups, spec.group)  # [..., groups, group]
    grouped.mul_(scale.float()[..., None]).add_(parts["zero"].float()[..., None])
    return dest


def dequantize(parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
    """The dequantized weight of `shape` in `dtype` (a new tensor; `dequantize_into` fills an existing one)."""
    dest = torch.empty(shape, dtype=dtype, device=device)
    return dequantize_into(dest, {k: v.to(device) for k, v in parts.items()}, spec)


def _round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32) rounded to `dtype`, upwards where rounding went down (so a scale never shrinks)."""
    y = x.to(dtype)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def _round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32) rounded to `dtype`, downwards where rounding went up (so a group's min never rises)."""
    y = x.to(dtype)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, -math.inf)), y)
