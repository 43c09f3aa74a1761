"""Weight formats: how a compressed weight is stored, rebuilt and multiplied. A format is one module of this package.

    WeightFormat   the interface (a frozen dataclass: its `group`, 0 where it has none): the components a weight of a
                   shape is stored as (`components`, `nbytes`), `quantize` (a float weight -> its components),
                   `dequantize_rows` (components -> float32 weight, in place), and `stays_packed` (a streamed weight
                   kept as its codes in a ring slot, the layer multiplying by a kernel: runtime/models/packed.py)
                   with the slot bytes, the view and the fill of such a weight
    int8.py        "int8": symmetric per output channel
    int8g.py       "int8g": symmetric int8 per group of inputs (Q8_0's scheme at 32), its codes stored as the CPU int4
                   kernel's two halves (one kernel call multiplies them)
    int4.py        "int4": asymmetric per group of inputs
    int4k.py       "int4k": int4 with its codes stored in the CPU int4 kernel's layout (read into a slot as stored)
    ggml.py        llama.cpp's block types as a GGUF file stores them (q8_0, q4_0, q5_0, q4_k, q5_k, q6_k, mxfp4): read
                   in place, not written

Every format applies along a weight's last (input) dimension, every leading dimension being a "row" (an output
channel; a fused expert tensor `[experts, out, in]` is `experts x out` rows). Weights stored uncompressed (float16,
bfloat16, float32) are not formats here: the streamer converts them (runtime/cast.py).

The registry: every module of this package is imported when the package is and registers its class under its
`name` (`register_format`); `weight_format(name, group)` builds one ("specoffload quantize --to NAME", the
checkpoint manifest of runtime/models/quantized.py). A new format is one new file here (+ its tests).

`dequantize_into` writes the dequantized weight straight into a caller's tensor in the compute dtype (the streamer's
ring slot), with the arithmetic in float32: a float32, contiguous destination whose rows are whole groups is written
in place (the codes converted into it, then scaled and shifted in place: one pass over the destination), any other
in blocks of rows through one float32 scratch of about `BLOCK_ELEMENTS` (cache-sized: the destination is touched
once, in the compute dtype).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cast import BLOCK_ELEMENTS

#: component suffixes, in the order they are stored (adjacent in the file, so one read fetches a weight)
COMPONENTS = ("qweight", "scale", "zero")
#: safetensors dtype string -> torch dtype of each component
_STORAGE = {"I8": torch.int8, "U8": torch.uint8, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class WeightFormat:
    """A compressed storage format (module docstring); subclasses set `name` and implement the methods."""

    group: int = 0  # inputs per scale (0: the format has no groups)

    name: ClassVar[str] = ""
    default_group: ClassVar[int] = 0  # the group `weight_format` picks when none is given (0: none)
    #: `specoffload quantize` writes it (False: a format read from other files only, e.g. GGUF's blocks)
    writable: ClassVar[bool] = True

    @property
    def label(self) -> str:
        """A short name for files and tables: the format's name, with its group where it has one (int4g64)."""
        return f"{self.name}g{self.group}" if self.group else self.name

    def groups(self, inputs: int) -> int:
        """Scales per row of `inputs` inputs."""
        return math.ceil(inputs / self.group) if self.group else 1

    def components(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Suffix -> (safetensors dtype, shape) of what a weight of `shape` is stored as."""
        raise NotImplementedError

    def quantize_rows(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [..., in] float32, finite -> its components."""
        raise NotImplementedError

    def dequantize_rows(self, dest: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Write the weight into `dest` [..., padded in] (float32, contiguous, rows of whole groups) in place."""
        raise NotImplementedError

    def dequantize_direct(self, dest: torch.Tensor, parts: dict[str, torch.Tensor]) -> bool:
        """Write the weight into `dest` (any float dtype: the compute dtype) without a float32 destination, the
        arithmetic in float32 and one rounding, where the format can; False: it cannot (the caller goes through
        float32, `dequantize_into`)."""
        return False

    def check_parts(self, parts: dict[str, torch.Tensor]) -> str | None:
        """What is wrong with a weight's stored components (a damaged file), or None: the base checks that every
        floating component (scale, zero point) is finite and that scales are >= 0; a format adds its own rules.
        `parts` may hold a subset of the components (the small ones are checked at open time)."""
        for suffix, t in parts.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"{suffix} holds NaN or infinite values"
        scale = parts.get("scale")
        if scale is not None and bool((scale < 0).any()):
            return f"scale holds negative values (min {float(scale.min()):.4g})"
        return None

    def stays_packed(self, shape: tuple[int, ...]) -> bool:
        """A streamed weight of `shape` is kept as its codes in its ring slot (packed slots on) and multiplied by a
        kernel (runtime/models/packed.py); default: never. The four methods below are for such weights."""
        return False

    #: the disk read may put a packed weight's stored codes straight into their place in the slot (int8); False:
    #: `fill_packed` writes them from the components (int4: permuted into the kernel's layout)
    codes_in_slot: ClassVar[bool] = False

    def packed_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, align: int = 1) -> int:
        """Slot bytes of a packed weight of `shape` with `dtype` scales, its sections aligned to `align`."""
        raise NotImplementedError(f"{self.name} keeps no weight packed")

    def packed_view(self, region: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, align: int = 1) -> object:
        """The packed weight (runtime/models/packed.py) over a slot's `region` (uint8, `packed_nbytes` bytes)."""
        raise NotImplementedError(f"{self.name} keeps no weight packed")

    def fill_packed(self, view: object, parts: dict[str, torch.Tensor], codes_there: bool = False) -> None:
        """Write a packed weight into its slot `view` from its stored components (`codes_there`: the disk read
        already put the codes in place)."""
        raise NotImplementedError(f"{self.name} keeps no weight packed")

    def packed_copy(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> object:
        """A packed weight of its own (not in a ring slot: a resident low-bit copy) from its stored components, on
        the CPU (`stays_packed` holds for `shape`)."""
        view = self.packed_view(torch.empty(self.packed_nbytes(shape, dtype), dtype=torch.uint8), shape, dtype)
        self.fill_packed(view, parts)
        return view

    def components_as(self, fmt: WeightFormat, parts: dict[str, torch.Tensor],
                      shape: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
        """A weight of `shape` stored in this format as `fmt`'s components holding the same weight (no rounding),
        or None where that takes requantizing; default: the parts themselves when `fmt` is this format."""
        return parts if fmt == self else None

    def padded_width(self, inputs: int) -> int:
        """The row width the stored codes cover (inputs padded to whole groups)."""
        return self.groups(inputs) * self.group if self.group else inputs

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Stored bytes of a weight of `shape` (codes, scales and zero points)."""
        return sum(math.prod(s) * _STORAGE[d].itemsize for d, s in self.components(shape).values())

    def bits_per_weight(self, shape: tuple[int, ...]) -> float:
        return 8.0 * self.nbytes(shape) / math.prod(shape)

    def _check_matrix(self, shape: tuple[int, ...]) -> None:
        if len(shape) < 2:
            raise ValueError(f"only matrices (or stacks of them) are quantized, got shape {shape}")


#: format name -> class; add one with `register_format` (a module of this package)
FORMATS: dict[str, type[WeightFormat]] = {}


def register_format(cls: type[WeightFormat]) -> type[WeightFormat]:
    """Make `cls` the format named `cls.name`; returns cls (a class decorator)."""
    if not cls.name or FORMATS.get(cls.name, cls) is not cls:
        raise ValueError(f"format name {cls.name!r} is empty or taken by {FORMATS.get(cls.name)}")
    FORMATS[cls.name] = cls
    return cls


def weight_format(name: str, group: int | None = None) -> WeightFormat:
    """The format `name` with `group` inputs per scale (None: the format's default); ValueError for an unknown name
    or a group the format refuses."""
    cls = FORMATS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown quantization scheme {name!r}; expected one of {tuple(sorted(FORMATS))}")
    return cls(cls.default_group if group is None else group)


def storage_dtype(name: str) -> torch.dtype:
    return _STORAGE[name]


def quantize(w: torch.Tensor, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    """Compress a weight [..., in] (any float dtype) into its components (suffix -> tensor)."""
    x = w.detach().to(torch.float32)  # [..., in]
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize a weight with non-finite values")
    fmt._check_matrix(tuple(x.shape))
    return fmt.quantize_rows(x)


def dequantize_into(dest: torch.Tensor, parts: dict[str, torch.Tensor], fmt: WeightFormat) -> torch.Tensor:
    """Write the dequantized weight into `dest` [..., in] (its dtype: the compute dtype), arithmetic in float32
    (module docstring). `parts` are the stored components (their leading dims equal dest's). Returns `dest`."""
    width = fmt.padded_width(dest.shape[-1])  # a row with its group padding
    if dest.dtype == torch.float32 and dest.is_contiguous() and width == dest.shape[-1]:
        return fmt.dequantize_rows(dest, parts)
    if fmt.dequantize_direct(dest, parts):
        return dest
    rows = dest.reshape(-1, dest.shape[-1]) if dest.is_contiguous() else None  # [R, in] view
    if rows is None or dest.device.type != "cpu":  # one temporary (CUDA: the block loop would launch per block)
        full = torch.empty(*dest.shape[:-1], width, dtype=torch.float32, device=dest.device)
        dest.copy_(fmt.dequantize_rows(full, parts)[..., : dest.shape[-1]])
        return dest
    flat = {k: v.reshape(-1, v.shape[-1]) for k, v in parts.items()}  # [R, ...] each
    step = max(1, BLOCK_ELEMENTS // width)
    scratch = torch.empty(step, width, dtype=torch.float32)  # [step, width]
    for start in range(0, rows.shape[0], step):
        stop = min(start + step, rows.shape[0])
        block = fmt.dequantize_rows(scratch[: stop - start], {k: v[start:stop] for k, v in flat.items()})
        rows[start:stop].copy_(block[:, : rows.shape[1]])
    return dest


def dequantize(parts: dict[str, torch.Tensor], fmt: WeightFormat, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> torch.Tensor:
    """The dequantized weight of `shape` in `dtype` (a new tensor; `dequantize_into` fills an existing one)."""
    dest = torch.empty(shape, dtype=dtype, device=device)
    return dequantize_into(dest, {k: v.to(device) for k, v in parts.items()}, fmt)


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32) rounded to `dtype`, upwards where rounding went down (so a scale never shrinks)."""
    y = x.to(dtype)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float32) rounded to `dtype`, downwards where rounding went up (so a group's min never rises)."""
    y = x.to(dtype)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, -math.inf)), y)


for _module in pkgutil.iter_modules(__path__):  # every format module of this package registers itself
    importlib.import_module(f"{__name__}.{_module.name}")
