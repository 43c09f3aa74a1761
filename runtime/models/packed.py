"""Packed weights: a streamed compressed weight kept as its codes in its ring slot, the layer multiplying by it with
one of torch's weight-only kernels. Which weights a format keeps packed, how many slot bytes they take and how the
loader fills them is the format's (runtime/formats/: `stays_packed`, `packed_nbytes`, `packed_view`, `fill_packed`).

`PackedInt8`: int8 codes (1 byte a weight instead of 2): no dequantization on the loader's thread, and torch's
weight-only int8 kernel reads the codes as they are:

  `torch._weight_int8pack_mm(x, q, s)` = (x @ q^T) * s, x [N, in] bfloat16, q [out, in] int8, s [out] bfloat16.

`PackedInt4`: int4 codes (half a byte a weight) in the layout torch's CPU int4 kernel reads (`kernel_layout`: a
byte permutation of the stored codes in blocks of 64 output channels under AVX-512 and 32 under AVX2, probed by
`kernel_block`; 1.8-2.4 ms for a [8960, 1536] weight against 16.5 ms to dequantize it, docs/perf int4_kernel), and
per group of inputs a scale and a zero point in the compute dtype (a low-bit draft copy's: KERNEL_DTYPE):

  `torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes, group, scales_zeros)` = x @ W'^T,
  W'[n, i] = (q[n, i] - 8) * scale[i / group, n] + zero[i / group, n],

so the stored int4 (W' = q * scale + min, runtime/formats/int4.py) gives zero = min + 8 * scale. The kernel runs a
row at 0.16 ms for [8960, 1536] against 16.5 ms to dequantize plus 0.06 ms a row of bf16 GEMM, so up to
INT4_MAX_ROWS rows it multiplies and above (a prefill) the weight is dequantized on the spot.

`PackedInt8Split`: int8 codes with a scale per group of inputs (runtime/formats/int8g.py), which no torch kernel
takes as they are, held as the int4 weight [H | L] of twice the inputs (q + 128 = 16 h + l): one call of the int4
kernel over [x, x] is x @ W'^T, at twice an int4 weight's compute (docs/perf `kernels`: 0.6-0.8x the per-channel
int8 kernel's rate on the Xeon with AMX, 8-128 rows), reading one byte a weight. It
multiplies up to INT8G_MAX_ROWS rows (a layer's three FFN GEMMs with native bfloat16 GEMMs: the kernel wins at 32
rows, loses at 48; without, at 64 rows), and
above that the weight is dequantized on the spot.

The kernel is a row loop, so above `PACKED_MAX_ROWS` rows (prefill) the weight is dequantized on the spot and
multiplied by the engine's dense GEMM (runtime/models/linear.py `linear`). Only weights whose input width is a
multiple of `PACKED_ALIGN` are packed (the kernel's limit).
Numerics: the scale is the stored float32 scale rounded to the compute dtype (the kernel takes the activation
dtype); both row regimes compute with it (`dequantize` rounds q * s once), so a packed target is one fixed model up
to the summation order of its GEMMs, as any bfloat16 target is across batch shapes (the kernel computes each row on
its own, so a row's result does not depend on the rows beside it). Used by default (`EngineConfig.packed_weights`
"auto") only where `linear.packed_kernel` holds: bfloat16 compute on the CPU. Which weights a format
keeps packed is the format's (runtime/formats/ `stays_packed`). The measurements behind the row limit and the
default: docs/perf/README.md, "kernel choices".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from .row_buckets import bucketed_linear, native_16bit

if TYPE_CHECKING:
    from .checkpoint import QuantRef

#: rows up to which the int8 kernel beats dequantize + the dense GEMM: equal near 24-32 rows with native bfloat16
#: GEMMs (module docstring); without, it won at every measured count to 128 (docs/perf kernels_avx2)
PACKED_MAX_ROWS = 16 if native_16bit(torch.bfloat16) else 128
#: the kernel's input width must be a multiple of this: torch 2.13's bfloat16 kernel returns garbage for 8 or 24
#: inputs and crashes for 17 (measured); such weights are never packed (`packable`)
PACKED_ALIGN = 16
#: rows up to which the int4 kernel beats dequantize + GEMM (module docstring: equal near 200 rows)
INT4_MAX_ROWS = 128
#: output channels per block of the int4 kernel's layout as the file formats store it (int4k, int8g: the AVX-512
#: kernel's), the unit int4 weights' outputs are padded to, and the groups the kernel takes
INT4_BLOCK = 64
#: the blocks of the layouts torch's CPU int4 kernel reads (AVX-512, AVX2: `kernel_block`)
KERNEL_BLOCKS = (64, 32)
#: the activation dtype of the weight-only kernels' vector code (torch 2.13's CPU int4 and int8 kernels vectorize
#: bfloat16 only; in float32 they run a scalar loop: a [8960, 1536] weight took 16.3 ms a row (int4) and 12.6 ms
#: (int8) in float32 against 1.17 and 1.21 ms in bfloat16 on a 2-core AVX2 EPYC, where a float32 GEMM took 3.8 ms);
#: what a low-bit draft copy multiplies in whatever the target's dtype (runtime/offload/drafters/lowbit.py)
KERNEL_DTYPE = torch.bfloat16
INT4_GROUPS = (32, 64, 128, 256)
#: rows up to which the split int8 kernel (`PackedInt8Split`: twice the int4 kernel's work) beats dequantize + GEMM
#: (native bfloat16 GEMMs: 32; without: 64, docs/perf kernels_avx2 `int8g32_kernel_faster_up_to_rows`)
INT8G_MAX_ROWS = 32 if native_16bit(torch.bfloat16) else 64


def amx() -> bool:
    """The CPU runs AMX tiles for oneDNN's bfloat16 GEMMs (several times AVX-512's rate)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


#: rows up to which the ggml kernel over a q4_k / f16 weight's blocks beats the kernel's dequantization + a GEMM:
#: with AMX 8 (the Xeon, 2 cores, one run: [8960, 1536] 3.5 / 5.4 ms against 5.6 / 5.9 at 4 / 8 rows, 7.8 against
#: 5.5 at 12; [3584, 1536] 0.8 / 1.2 against 2.2 / 2.7, 4.0 against 2.1 at 12; a [336, 1536] expert 0.18 against 0.26
#: at 8, 0.32 against 0.25 at 12); with native bfloat16 GEMMs but no AMX (AVX512-BF16) 16 (the 2-core AVX-512 EPYC,
#: bfloat16, six copies of each weight in turn, one run: q4_k [8960, 1536] 2.4 / 3.9 / 4.4 ms against 4.1 / 4.5 / 4.7
#: at 8 / 12 / 16 rows, 6.7 against 5.4 at 24; [3584, 1536] 1.0 / 1.5 / 1.7 against 1.5 / 1.6 / 1.7; a [336, 1536]
#: expert 0.09 / 0.14 / 0.18 against 0.21 / 0.22 / 0.24, 0.25 against 0.26 at 24; the moefied GGUF streamed at 0.34
#: GiB, 16 rows: 0.91-0.95 s a decode pass against 1.16-1.25 s at 8, two runs each, alternating); without native
#: bfloat16 GEMMs 96, the most measured there (the kernel's AVX2 path against dequantize + the engine's GEMM on the
#: 2-core AVX2 EPYC, one FFN layer of the 1.5B: 15 / 50 / 136 ms against 77 / 153 / 172 at 8 / 32 / 96 rows;
#: docs/perf kernels_blocks_avx2 `q4_k_kernel_faster_up_to_rows`)
BLOCKS_MAX_ROWS = (8 if amx() else 16) if native_16bit(torch.bfloat16) else 96
#: the same for q6_k, whose decode costs more a weight: 8 with native bfloat16 GEMMs (the AVX-512 EPYC: [1536, 8960]
#: 3.9 ms against 4.5 at 8 rows, 6.7 against 5.1 at 12, 8.0 against 5.0 at 16), else BLOCKS_MAX_ROWS
Q6_K_MAX_ROWS = 8 if native_16bit(torch.bfloat16) else BLOCKS_MAX_ROWS
#: weights of a block weight dequantized at a time for a GEMM over more rows (16 MiB in bfloat16: a 151936-row head
#: does not need a 16-bit copy of itself)
BLOCKS_DEQUANT = 1 << 23
#: float32 elements of the scratch a packed weight is dequantized through (4 MiB: measured fastest of 256 KiB .. 16 MiB
#: on a [8960, 1536] weight, 2 cores)
DEQUANT_BLOCK = 1 << 20


def packable(shape: tuple[int, ...]) -> bool:
    """A weight of this shape can stay packed: a matrix whose input width the kernel takes."""
    return len(shape) == 2 and shape[-1] % PACKED_ALIGN == 0


def stays_packed(quant: QuantRef | None, shape: tuple[int, ...]) -> bool:
    """A streamed weight (`quant`: its compression, None if stored uncompressed) is kept packed in its slot when
    packed slots are on: where its format says so (runtime/formats/: an int8 matrix the kernel takes)."""
    return quant is not None and quant.spec.stays_packed(shape)


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
        """The weight [out, in] in the compute dtype: q * scale in float32, rounded once (`_by_blocks`)."""
        out, inputs = self.qweight.shape
        scale = self.scale.float()  # [out]

        def fill(block: torch.Tensor, rows: slice) -> None:  # block [n, 1, in] float32
            block.view(block.shape[0], -1).copy_(self.qweight[rows]).mul_(scale[rows, None])

        return _by_blocks(fill, out, inputs, 1, inputs, self.dtype, align=1)


def kernel_layout(qweight: torch.Tensor, out: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """Stored int4 codes (uint8 [N, K / 2], input 2i in the low nibble and 2i + 1 in the high one:
    runtime/formats/int4.py) in the layout the CPU int4 kernel reads (torch 2.13, probed with single codes; checked
    against aten's converter by `kernel_block`): per block of `block` output channels, for each pair of inputs
    (2i, 2i + 1), `block` bytes: byte p * block / 2 + j holds input 2i + p of channel j in its low nibble and of
    channel block / 2 + j in its high one. The kernel's block is 64 channels where torch runs its AVX-512 code and
    32 under AVX2; `block` defaults to this machine's (`kernel_block`). N a multiple of INT4_BLOCK (so of either
    block); written into `out` (uint8 [N, K / 2]) when given."""
    b = block or layout_block()
    n, half = qweight.shape
    a = qweight.view(n // b, 2, b // 2, half)  # [blocks, channel half h, j, input pair i]
    even = (a[:, 0] & 0xF) | (a[:, 1] << 4)  # [blocks, j, i]: input 2i of channels j (low nibble), b / 2 + j (high)
    odd = (a[:, 0] >> 4) | (a[:, 1] & 0xF0)  # [blocks, j, i]: input 2i + 1
    dest = torch.empty_like(qweight) if out is None else out
    d = dest.view(n // b, half, 2, b // 2)  # [blocks, i, p, j]
    d[:, :, 0].copy_(even.transpose(1, 2))
    d[:, :, 1].copy_(odd.transpose(1, 2))
    return dest


def stored_layout(codes: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The inverse of `kernel_layout` (the same `block`): the kernel's codes [N, K / 2] back in the stored nibble
    order."""
    b = block or layout_block()
    n, half = codes.shape
    d = codes.view(n // b, half, 2, b // 2).transpose(1, 3)  # [blocks, j, p, i]
    even, odd = d[:, :, 0], d[:, :, 1]  # [blocks, j, i]
    low = (even & 0xF) | (odd << 4)  # channels j: inputs 2i (low), 2i + 1 (high)
    high = (even >> 4) | (odd & 0xF0)  # channels b / 2 + j
    return torch.stack((low, high), dim=1).reshape(n, half)  # [blocks, h, j, i]


def layout_block() -> int:
    """The block packed int4 codes are laid out in on this machine: the kernel's (`kernel_block`), INT4_BLOCK where
    this torch has none whose layout is known (nothing is then multiplied by it)."""
    return kernel_block() or INT4_BLOCK


def relayout(codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Codes [N, K / 2] in the file layout (`kernel_layout` at INT4_BLOCK: what int4k and int8g store) in this
    machine's kernel layout (`kernel_block`, one of KERNEL_BLOCKS): a copy where the blocks agree, else
    `halve_blocks` (AVX2's 32)."""
    if layout_block() == INT4_BLOCK:
        return codes.clone() if out is None else out.copy_(codes)
    return halve_blocks(codes, out)


#: the low and the high nibble of every byte of an int64 lane (the high: 0xF0...F0's bits as a signed int64)
_LOW_NIBBLES, _HIGH_NIBBLES = 0x0F0F0F0F0F0F0F0F, 0xF0F0F0F0F0F0F0F0 - (1 << 64)


def halve_blocks(codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`kernel_layout` codes [N, K / 2] at blocks of 2b output channels (INT4_BLOCK) in the layout at blocks of b,
    without going through the stored order. At 2b, byte (i, p, j) of a block holds input 2i + p of channel j in its
    low nibble and of channel b + j in its high one (j < b); at b, of channels j and b / 2 + j (j < b / 2). So the
    first b-block's byte (i, p, j) is (lo of 2b-byte (i, p, j)) | (lo of (i, p, b / 2 + j)) << 4, and the second's
    (hi of (i, p, j)) | (hi of (i, p, b / 2 + j)) << 4: nibble operations on runs of b / 2 bytes, no transpose (on
    int64 lanes where the bytes allow it). Written into `out` (uint8 [N, K / 2]) when given."""
    n, half = codes.shape
    b = INT4_BLOCK // 2
    dest = torch.empty_like(codes) if out is None else out
    lanes = all(t.is_contiguous() and t.storage_offset() % 8 == 0 for t in (codes, dest))  # (runs: 2 lanes)
    src = codes.view(-1).view(torch.int64) if lanes else codes  # (N is a multiple of 64: whole lanes)
    dst = dest.view(-1).view(torch.int64) if lanes else dest
    run = b // 2 // (8 if lanes else 1)  # a run of b / 2 bytes, in elements
    low, high = (_LOW_NIBBLES, _HIGH_NIBBLES) if lanes else (0x0F, 0xF0)
    s = src.view(n // INT4_BLOCK, half, 2, 2, run)  # [2b-blocks, i, p, first / second half of j, run]
    first, second = s[:, :, :, 0], s[:, :, :, 1]
    d = dst.view(n // INT4_BLOCK, 2, half, 2, run)  # [2b-blocks, b-block, i, p, run]
    torch.bitwise_or(first & low, (second & low) << 4, out=d[:, 0])
    torch.bitwise_or((first >> 4) & low, second & high, out=d[:, 1])  # (int64 >> is arithmetic: masked after)
    return dest


@functools.cache
def kernel_block() -> int:
    """Output channels per block of the layout this torch's CPU int4 kernel reads (64 under AVX-512, 32 under
    AVX2): the one of `kernel_layout`'s blocks that aten's own converter agrees with on a probe; 0 where this torch
    has no CPU int4 kernel or its layout is neither."""
    convert = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if convert is None or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return 0
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (2 * INT4_BLOCK, 64), generator=g, dtype=torch.int32)  # [N, K]
    stored = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # [N, K / 2]
    try:
        packed = convert(codes, 2)
    except RuntimeError:
        return 0
    for block in KERNEL_BLOCKS:
        if torch.equal(packed, kernel_layout(stored, block=block)):
            return block
    return 0


def int4_kernel_ok() -> bool:
    """This torch has the CPU int4 kernel and `kernel_layout` writes the layout it reads (`kernel_block`)."""
    return kernel_block() != 0


def int4_packable(shape: tuple[int, ...], group: int) -> bool:
    """An int4 weight of this shape and group can stay packed: a matrix, a group the kernel takes, this torch's kernel
    reading `kernel_layout` (any width: outputs are padded to whole kernel blocks, inputs to whole groups)."""
    return len(shape) == 2 and group in INT4_GROUPS and int4_kernel_ok()


def int4_padded(shape: tuple[int, ...], group: int) -> tuple[int, int]:
    """(outputs, inputs) of an int4 weight in its slot: outputs to whole kernel blocks, inputs to whole groups."""
    out, inputs = shape
    return -(-out // INT4_BLOCK) * INT4_BLOCK, -(-inputs // group) * group


@dataclass(frozen=True, eq=False)
class PackedInt4:
    """An int4 weight W' = (q - 8) * scale + zero per group of inputs (module docstring), in place of a [out, in]
    compute-dtype tensor. Its slot holds whole kernel blocks and whole groups (`int4_padded`): the padded outputs have
    scale and zero 0 and are cut from the product, the padded inputs meet zeros in x."""

    codes: torch.Tensor  # [out_p, in_p / 2] uint8, in the kernel's layout (`kernel_layout`)
    scales_zeros: torch.Tensor  # [in_p / group, out_p, 2] compute dtype: (scale, zero)
    group: int
    out: int  # the weight's outputs (<= out_p)
    inputs: int  # its inputs (<= in_p)

    max_rows: ClassVar[int] = INT4_MAX_ROWS  # rows up to which `packed_linear` calls the kernel

    def __post_init__(self) -> None:
        out_p, half = self.codes.shape
        if not (self.codes.dtype == torch.uint8 and self.scales_zeros.shape == (2 * half // self.group, out_p, 2)
                and out_p % INT4_BLOCK == 0 and 0 < self.out <= out_p and 0 < self.inputs <= 2 * half):
            raise ValueError(f"a packed int4 weight is uint8 codes [out, in / 2] (out whole blocks of {INT4_BLOCK}) "
                             f"and scales_zeros [in / group, out, 2], got {self.codes.dtype} "
                             f"{list(self.codes.shape)} and {list(self.scales_zeros.shape)} for a [{self.out}, "
                             f"{self.inputs}] weight")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out, self.inputs))

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_zeros.dtype

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def numel(self) -> int:
        return self.out * self.inputs

    @property
    def qweight(self) -> torch.Tensor:
        """The codes as a checkpoint in the kernel's layout stores them (format int4k): where a disk read puts them
        (where this machine's kernel block is the file's, `relayout`)."""
        return self.codes

    def chunk(self, chunks: int, dim: int = 0) -> list[PackedInt4]:
        """Split along the output channels (a fused gate_up weight) in whole kernel blocks, unpadded."""
        out_p = self.codes.shape[0]
        if dim != 0 or out_p != self.out or out_p % (chunks * INT4_BLOCK):
            raise ValueError(f"a packed int4 weight splits along its output channels in blocks of {INT4_BLOCK}")
        return [type(self)(c, sz.contiguous(), self.group, self.out // chunks, self.inputs)
                for c, sz in zip(self.codes.chunk(chunks), self.scales_zeros.chunk(chunks, dim=1))]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] @ W'^T -> [N, out] by the kernel (x padded with zeros to the slot's inputs)."""
        pad = 2 * self.codes.shape[1] - self.inputs
        x = x.to(self.dtype)
        x = F.pad(x, (0, pad)) if pad else x.contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.codes, self.group, self.scales_zeros)  # [N, out_p]
        return y[:, : self.out] if self.out < y.shape[1] else y

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the compute dtype: (q - 8) * scale + zero in float32, rounded once
        (`_by_blocks`)."""
        scale = self.scales_zeros[..., 0].float().T  # [out_p, groups]
        zero = self.scales_zeros[..., 1].float().T

        def fill(block: torch.Tensor, rows: slice) -> None:  # block [n, groups, group] float32
            stored = stored_layout(self.codes[rows])  # [n, in_p / 2]
            pairs = block.view(block.shape[0], -1, 2)  # [n, in_p / 2, 2]
            pairs[..., 0].copy_(stored & 0xF)
            pairs[..., 1].copy_(stored >> 4)
            block.sub_(8).mul_(scale[rows, :, None]).add_(zero[rows, :, None])

        return _by_blocks(fill, self.out, self.inputs, scale.shape[1], self.group, self.dtype)


@dataclass(frozen=True, eq=False)
class PackedInt8Split(PackedInt4):
    """An int8 weight W' = q * scale per group of inputs (runtime/formats/int8g.py), q in [-128, 127], held as the
    int4 weight [H | L] over the inputs taken twice: q + 128 = 16 h + l with h, l in 0 .. 15, so

        x @ W'^T = [x, x] @ [H | L]^T,  H[n, i] = (h - 8) * 16 scale + 0,  L[n, i] = (l - 8) * scale + 8 scale,

    one call of the int4 kernel over 2 * in_p inputs: H's groups first (scales_zeros[:groups] = (16 scale, 0)), then
    L's (scales_zeros[groups:] = (scale, 8 scale)). Each half's weight is exact in float32 (h - 8 and l - 8 have 4
    bits, the scale is one value of the compute dtype), so in float32 the product is x @ W'^T up to its summation
    order (tests/test_packed.py); it costs an int4 weight of twice the inputs (docs/perf `kernels`), reading one byte
    a weight. `codes` [out_p, in_p]: the nibbles of [H | L] in `kernel_layout`."""

    max_rows: ClassVar[int] = INT8G_MAX_ROWS

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] @ W'^T -> [N, out] by the kernel on [x, x] (x padded with zeros to the slot's inputs)."""
        half = self.codes.shape[1]  # in_p: the inputs of each of H and L
        x = x.to(self.dtype)
        x = F.pad(x, (0, half - self.inputs)) if half > self.inputs else x
        xx = torch.cat((x, x), dim=1)  # [N, 2 in_p]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xx, self.codes, self.group, self.scales_zeros)  # [N, out_p]
        return y[:, : self.out] if self.out < y.shape[1] else y

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the compute dtype: q * scale in float32, rounded once (`_by_blocks`)."""
        groups = self.scales_zeros.shape[0] // 2
        scale = self.scales_zeros[groups:, :, 0].float().T  # [out_p, groups]

        kb = layout_block()  # the codes' layout block

        def fill(block: torch.Tensor, rows: slice) -> None:  # block [n, groups, group] float32, n whole blocks
            n, half = block.shape[0], self.codes.shape[1] // 2
            b = self.codes[rows].view(n // kb, 2 * half, 2, kb // 2)  # [blocks, pair i, p, j]
            high, low = b[:, :half], b[:, half:]  # H's and L's bytes: inputs 2i + p of channels j and kb / 2 + j
            d = block.view(n // kb, 2, kb // 2, half, 2)  # [blocks, channel half, j, i, p]
            d[:, 0].copy_((((high & 0xF) << 4) | (low & 0xF)).permute(0, 3, 1, 2))  # q + 128 of channels j
            d[:, 1].copy_(((high & 0xF0) | (low >> 4)).permute(0, 3, 1, 2))  # of channels kb / 2 + j
            block.sub_(128).mul_(scale[rows, :, None])

        return _by_blocks(fill, self.out, self.inputs, groups, self.group, self.dtype)


def _by_blocks(fill, out: int, inputs: int, groups: int, group: int, dtype: torch.dtype,  # noqa: ANN001
               align: int = INT4_BLOCK) -> torch.Tensor:
    """A [out, inputs] `dtype` weight written in blocks of whole `align`s of rows (the int4 kernel's blocks):
    `fill(block, rows)` writes rows `rows` of the padded weight in float32 into `block` [n, groups, group] (a scratch
    of about DEQUANT_BLOCK elements), which is then rounded into place."""
    dest = torch.empty(out, inputs, dtype=dtype)
    step = max(1, DEQUANT_BLOCK // (groups * group * align)) * align
    scratch = torch.empty(step, groups, group, dtype=torch.float32)
    for start in range(0, out, step):
        block = scratch[: min(step, -(-(out - start) // align) * align)]  # whole aligns of rows
        fill(block, slice(start, start + block.shape[0]))
        stop = min(start + step, out)
        dest[start:stop].copy_(block.view(block.shape[0], -1)[: stop - start, :inputs])
    return dest


def split_layout(q: torch.Tensor, block: int = INT4_BLOCK) -> torch.Tensor:
    """int8 codes [N, K] (N a multiple of INT4_BLOCK, K even) -> uint8 [N, K]: the nibbles h, l of q + 128 = 16 h + l
    as the int4 codes [H | L] of 2K inputs in `kernel_layout` at `block`: by default the file layout (INT4_BLOCK;
    `relayout` puts it in this machine's for `PackedInt8Split`)."""
    u = q.view(torch.uint8) ^ 0x80  # q + 128, as a byte
    n, k = u.shape
    pairs = torch.empty(n, k, dtype=torch.uint8)  # [N, 2K / 2]: H's pairs, then L's; input 2i in the low nibble
    even, odd = u[:, 0::2], u[:, 1::2]  # [N, K / 2]
    torch.bitwise_or(even >> 4, odd & 0xF0, out=pairs[:, : k // 2])  # h(2i) | h(2i + 1) << 4
    torch.bitwise_or(even & 0x0F, odd << 4, out=pairs[:, k // 2 :])  # l(2i) | l(2i + 1) << 4
    return kernel_layout(pairs, block=block)


def split_codes(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of `split_layout`: uint8 [N, K] in the file layout -> the int8 codes [N, K]."""
    pairs = stored_layout(codes, INT4_BLOCK)  # [N, K]: H's pairs, then L's
    n, k = pairs.shape
    high, low = pairs[:, : k // 2], pairs[:, k // 2 :]  # [N, K / 2]
    u = torch.empty(n, k, dtype=torch.uint8)
    torch.bitwise_or(high << 4, low & 0x0F, out=u[:, 0::2])  # q(2i) + 128 = h << 4 | l
    torch.bitwise_or(high & 0xF0, low >> 4, out=u[:, 1::2])
    return (u ^ 0x80).view(torch.int8)


@dataclass(frozen=True, eq=False)
class PackedBlocks:
    """A weight kept as llama.cpp's blocks exactly as its GGUF stores them (q4_k, q6_k, f16: runtime/formats/ggml.py):
    a quarter to a third of a 16-bit copy's bytes in its slot (f16: half a float32 copy's), read there by the disk
    read with no work at load.
    runtime/kernels/ggml.c decodes every block with llama.cpp's float32 arithmetic and rounds each weight to the
    compute dtype; up to BLOCKS_MAX_ROWS rows it multiplies by x where the blocks lie (float32 products, each row
    on its own; in float32 on AVX2 the sums factored per sub-block, the same products in another order), above
    that it writes those rounded weights into a 16-bit copy (BLOCKS_DEQUANT weights at a time, ~15 GB/s of output
    on 2 cores) for a GEMM. Both regimes multiply the same weights: one fixed model, as `PackedInt4` is."""

    blocks: torch.Tensor  # [out, in / block inputs * block bytes] uint8, the stored rows
    fmt: object  # the GGML format (runtime/formats/ggml.py) the blocks are in
    inputs: int
    compute: torch.dtype  # the dtype products are returned in

    max_rows: ClassVar[int] = BLOCKS_MAX_ROWS

    def __post_init__(self) -> None:
        nbytes = self.inputs // self.fmt.block * self.fmt.block_bytes  # type: ignore[attr-defined]
        if not (self.blocks.dtype == torch.uint8 and self.blocks.dim() == 2 and self.blocks.shape[1] == nbytes):
            raise ValueError(f"a {self.fmt.name} weight of {self.inputs} inputs is uint8 blocks [out, {nbytes}], "  # type: ignore[attr-defined]
                             f"got {self.blocks.dtype} {list(self.blocks.shape)}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.inputs))

    @property
    def dtype(self) -> torch.dtype:
        return self.compute

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def numel(self) -> int:
        return self.blocks.shape[0] * self.inputs

    @property
    def qweight(self) -> torch.Tensor:
        """The blocks as the GGUF stores them: where a disk read puts them."""
        return self.blocks

    def chunk(self, chunks: int, dim: int = 0) -> list[PackedBlocks]:
        """Split along the output channels (a fused gate_up weight), as `Tensor.chunk(chunks, 0)` does."""
        if dim != 0 or self.blocks.shape[0] % chunks:
            raise ValueError(f"a block weight splits along its output channels into equal parts, not {chunks}")
        return [type(self)(b, self.fmt, self.inputs, self.compute) for b in self.blocks.chunk(chunks)]

    def matmul(self, x: torch.Tensor,
               dense: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = bucketed_linear) -> torch.Tensor:
        """x [N, in] @ W^T -> [N, out] in the compute dtype: up to `max_rows` rows (fewer where the format says,
        `kernel_max_rows`) the kernel over the blocks, above
        that (a prefill) the weight dequantized by the kernel and `dense(x, W')` (`packed_linear`'s: the engine's
        GEMM, float32 from 48 rows where the CPU has no native bfloat16 GEMM), BLOCKS_DEQUANT weights at a time. Both
        multiply the same weights, each rounded once to the compute dtype."""
        from ..kernels import ggml_kernel

        kernel = ggml_kernel()
        assert kernel is not None, "a block weight exists only where the ggml kernel loaded"
        name = self.fmt.name  # type: ignore[attr-defined]
        if x.shape[0] <= min(self.max_rows, getattr(self.fmt, "kernel_max_rows", self.max_rows)):
            return kernel.matmul(name, self.blocks, x.float(), dtype=self.compute).to(self.compute)
        out = self.blocks.shape[0]
        x = x.to(self.compute)  # [N, in]
        step = max(1, BLOCKS_DEQUANT // self.inputs)  # outputs per dequantized piece
        if step >= out:
            return dense(x, kernel.dequantize(name, self.blocks, self.inputs, self.compute))
        y = torch.empty(x.shape[0], out, dtype=self.compute)  # [N, out]
        for start in range(0, out, step):
            w = kernel.dequantize(name, self.blocks[start : start + step], self.inputs, self.compute)  # [step, in]
            y[:, start : start + w.shape[0]] = dense(x, w)
        return y

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in the compute dtype (llama.cpp's float32 values, rounded once)."""
        from ..kernels import ggml_kernel

        return ggml_kernel().dequantize(self.fmt.name, self.blocks, self.inputs, self.compute)  # type: ignore


PackedWeight = PackedInt8 | PackedInt4 | PackedBlocks


def packed_linear(x: torch.Tensor, w: PackedWeight,
                  dense: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = bucketed_linear) -> torch.Tensor:
    """x [N, in] @ W'^T -> [N, out] in the weight's dtype: its kernel up to its row limit; above it (a prefill)
    `dense(x, W')` on the weight dequantized (runtime/models/linear.py passes its own dense GEMM: in float32 from 48
    rows where the CPU has no native bfloat16 GEMM, which on AVX2 is several times a bfloat16 F.linear there)."""
    if isinstance(w, PackedBlocks):
        return w.matmul(x, dense)
    if isinstance(w, PackedInt4):  # (and PackedInt8Split)
        if x.shape[0] <= w.max_rows:
            return w.matmul(x)
    elif x.shape[0] <= PACKED_MAX_ROWS and packable(tuple(w.shape)):
        return torch._weight_int8pack_mm(x.to(w.dtype).contiguous(), w.qweight, w.scale)
    return dense(x.to(w.dtype), w.dequantize())
