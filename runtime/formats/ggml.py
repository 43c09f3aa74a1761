"""llama.cpp's block formats (GGML types), read as a GGUF file stores them: "q8_0", "q4_0", "q5_0", "q4_k", "q5_k",
"q6_k", "mxfp4", and "f16" (an F16 matrix, one value a "block").

A row of `in` inputs is `in / block` blocks of `block_bytes` bytes each, stored as one uint8 component
`qweight [..., in / block * block_bytes]` exactly as in the file (the streamer reads the GGUF's tensor data in place,
runtime/models/gguf.py). Dequantization is llama.cpp's (ggml-quants.c `dequantize_row_*`, which the gguf package
implements in numpy: tests/test_gguf.py checks these against it bit for bit), in float32:

    q8_0   34 B / 32:   d f16, q int8[32]                              w = d * q
    q4_0   18 B / 32:   d f16, 32 nibbles (j low, j + 16 high)          w = d * (q - 8)
    q5_0   22 B / 32:   d f16, qh u32 (5th bits), 32 nibbles           w = d * (q - 16)
    q4_k   144 B / 256: d, dmin f16, 8 x (6-bit scale, 6-bit min), 256 nibbles per 64: 32 low, 32 high
                        w = (d * sc_j) * q - (dmin * m_j) per sub-block j of 32
    q5_k   176 B / 256: as q4_k with a 5th bit per weight (qh[32], bit j for sub-block j)
    q6_k   210 B / 256: ql[128] nibbles, qh[64] 2-bit pairs, 16 int8 scales, d f16   w = (d * sc_j) * (q - 32), j per 16
    mxfp4  17 B / 32:   e8m0 exponent, 32 e2m1 nibbles                  w = 2^(e - 128) * kvalue(q) (kvalues doubled)
    f16     2 B / 1:    the float16 value                               w = the value (exact in float32)

Where the engine's own kernel for them is built (runtime/kernels: ggml.c, compiled for this CPU on first use) and
decodes a probe's blocks exactly as this module does (`block_kernel`), a streamed or resident q4_k / q6_k / f16 matrix
stays as its blocks (runtime/models/packed.py `PackedBlocks`): the disk read
puts the file's bytes straight into the ring slot and the layer multiplies by them there, with llama.cpp's float32
dequantization arithmetic inside the kernel, so a load does no work on them at all. Without it, as before:

q4_0 and q4_k are int4 with a scale and an offset per 32 inputs, so a streamed one stays packed for torch's CPU int4
kernel (runtime/models/packed.py `PackedInt4`, group 32): codes permuted into the kernel's layout, scale = d * sc_j
and zero = -(dmin * m_j) + 8 * scale rounded to the compute dtype (the kernel takes the activation dtype: a
deviation from llama.cpp's float32 products of at most half a unit in the last place of bfloat16, measured in
docs/perf `gguf`). q8_0 is int8 with a scale per 32 inputs: it stays packed as int8g's (runtime/formats/int8g.py),
its codes re-laid out per load as the int4 kernel's halves. The others are dequantized into the slot in the compute
dtype.

These formats are read, not written: `specoffload quantize` writes int8 / int4 (`writable` is False here).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..kernels import BLOCK_INPUTS, BLOCK_LAYOUT, KINDS, PROBE_INPUTS, GGMLKernel, ggml_kernel, random_blocks
from ..models.packed import Q6_K_MAX_ROWS, PackedBlocks, PackedInt4, PackedInt8Split, kernel_block, split_layout
from . import WeightFormat, dequantize, register_format
from .int4 import Int4
from .int8g import Int8Group

Tensor = torch.Tensor

QK_K = 256  # inputs per k-quant super-block
#: outputs a packed block type (q4_0, q4_k, q8_0) is repacked for the int4 kernel at a time (a multiple of its blocks
#: of 64): the temporaries of a 151936-row head stay a few MB instead of about twice its stored bytes
PACK_ROWS = 4096
#: weights decoded per step straight into a 16-bit slot: a dozen small ops per step, so fewer, larger steps than the
#: cast's cache-sized blocks (measured on a [1536, 8960] q6_k weight, 2 cores: 32 / 15 / 11 / 14 ms at 2^16 / 2^18 /
#: 2^20 / 2^22 weights a step)
DIRECT_ELEMENTS = 1 << 20


log = logging.getLogger(__name__)


@functools.cache
def block_kernel() -> GGMLKernel | None:
    """runtime/kernels' ggml kernel where it is built and decodes every kind it multiplies as this module does
    (llama.cpp's reference, bit for bit) in every compute dtype on a probe; None otherwise (the formats then repack or
    decode, as without it)."""
    kernel = ggml_kernel()
    if kernel is None:
        return None
    g = torch.Generator().manual_seed(1)
    for kind in KINDS:
        fmt = FORMATS_BY_NAME[kind]
        blocks = random_blocks(kind, 5, PROBE_INPUTS // BLOCK_INPUTS[kind], g)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            if not torch.equal(kernel.dequantize(kind, blocks, PROBE_INPUTS, dtype, threads=2),
                               dequantize({"qweight": blocks}, fmt, (5, PROBE_INPUTS), dtype)):
                log.warning("%s decodes %s blocks unlike llama.cpp's reference: GGUF weights are converted instead",
                            kernel.path, kind)
                return None
    return kernel


def reload_kernel() -> None:
    """Forget the kernel this process loaded and checked (`ggml_kernel`, `block_kernel`): the next use reads
    $SPECOFFLOAD_GGML_KERNEL and builds or loads it again."""
    ggml_kernel.cache_clear()
    block_kernel.cache_clear()


def _blocks(q: Tensor, block_bytes: int) -> Tensor:
    """uint8 [..., nb * block_bytes] -> [R, nb, block_bytes]."""
    return q.reshape(-1, q.shape[-1] // block_bytes, block_bytes)


def _f16(field: Tensor) -> Tensor:
    """A 2-byte field of every block, uint8 [R, nb, 2] -> its float16 value as float32 [R, nb, 1]."""
    return field.contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor, run: int) -> Tensor:
    """uint8 [..., n * run] -> uint8 [..., n, 2, run]: per run of `run` bytes, the low nibbles then the high ones."""
    b = qs.unflatten(-1, (qs.shape[-1] // run, 1, run))  # [..., n, 1, run]
    return torch.cat((b & 0xF, b >> 4), dim=-2)  # [..., n, 2, run]


#: nibble masks of a byte lane, as int32 words (four bytes at once; the high one is 0xF0F0F0F0 as a signed int32)
LOW_NIBBLES, HIGH_NIBBLES = 0x0F0F0F0F, -0x0F0F0F10


def _words(x: Tensor) -> Tensor:
    """uint8 [..., n] -> the same bytes as int32 [..., n / 4] (a copy where x is not contiguous or not aligned).
    Bitwise operations on words whose masks keep every result inside its byte lane act on four bytes at once: on
    two cores ~4x faster than torch's uint8 kernels on the strided views of a block layout."""
    aligned = x.storage_offset() % 4 == 0 and all(st % 4 == 0 for st in x.stride()[:-1])
    if not (aligned and x.is_contiguous()):
        x = torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)  # (fresh strides: contiguous ones)
    return x.view(torch.int32)


@dataclass(frozen=True)
class GGMLFormat(WeightFormat):
    """One GGML block type (module docstring): `group` is its block (inputs per block), stored as raw blocks."""

    block_bytes: ClassVar[int] = 0
    block: ClassVar[int] = 0
    gguf_type: ClassVar[str] = ""  # gguf.GGMLQuantizationType member name
    writable = False
    #: the engine format whose packed weight a streamed matrix of this block type is kept as (its codes and scales
    #: repacked from the blocks by `fill_packed` on each load); None: decoded into the slot in the compute dtype
    packed_as: ClassVar[WeightFormat | None] = None

    def __post_init__(self) -> None:
        if self.group != self.block:
            raise ValueError(f"{self.name} blocks are {self.block} inputs, got group {self.group}")

    def components(self, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
        self._check_matrix(shape)
        if shape[-1] % self.block:
            raise ValueError(f"a {self.name} row is whole blocks of {self.block} inputs, got {shape[-1]}")
        return {"qweight": ("U8", (*shape[:-1], shape[-1] // self.block * self.block_bytes))}

    def quantize_rows(self, x: Tensor) -> dict[str, Tensor]:
        """Through the gguf package's quantizer (llama.cpp's reference; q8_0, q4_0, q5_0 and mxfp4 only)."""
        import numpy as np
        from gguf import GGMLQuantizationType, quants

        blocks = quants.quantize(x.numpy().astype(np.float32), GGMLQuantizationType[self.gguf_type])
        return {"qweight": torch.from_numpy(np.ascontiguousarray(blocks))}

    def dequantize_rows(self, dest: Tensor, parts: dict[str, Tensor]) -> Tensor:
        """float32 in place: w = q * scale (- low), llama.cpp's arithmetic, bit for bit."""
        b = _blocks(parts["qweight"], self.block_bytes)  # [R, nb, block_bytes]
        q, scale, low = self._codes(b)  # [R, nb, G, g], [R, nb, G, 1] x 2
        out = dest.view(q.shape)
        out.copy_(q)
        out.mul_(scale)
        if low is not None:
            out.sub_(low)
        return dest

    def dequantize_direct(self, dest: Tensor, parts: dict[str, Tensor]) -> bool:
        """A 16-bit (or any) contiguous CPU `dest`, in cache-sized blocks of rows: the codes times the scale (minus
        the low) in a float32 block, rounded once into `dest`. The same values as the float32 path, rounded."""
        if not dest.is_contiguous() or dest.device.type != "cpu":
            return False
        blocks = _blocks(parts["qweight"], self.block_bytes)  # [R, nb, block_bytes]
        rows = dest.view(blocks.shape[0], -1)  # [R, in]
        step = max(1, DIRECT_ELEMENTS // rows.shape[1])
        for start in range(0, rows.shape[0], step):
            q, scale, low = self._codes(blocks[start : start + step])
            w = q.float().mul_(scale)  # [rows, nb, G, g] float32, cache-sized
            if low is not None:
                w.sub_(low)
            rows[start : start + step].view(q.shape).copy_(w)  # (a multiply writing bfloat16 itself is 5x slower)
        return True

    def _codes(self, b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Blocks b [R, nb, block_bytes] -> (q [R, nb, G, g] integer codes or values, scale [R, nb, G, 1] float32,
        low [R, nb, G, 1] float32 or None) with w = q * scale - low per group of g inputs (llama.cpp's terms)."""
        raise NotImplementedError

    def as_blocks(self, shape: tuple[int, ...]) -> bool:
        """A weight of `shape` stays as its stored blocks (`PackedBlocks`, module docstring): a matrix of a block type
        ggml.c multiplies, the kernel built for this machine."""
        return len(shape) == 2 and self.codes_in_slot

    @property
    def codes_in_slot(self) -> bool:  # type: ignore[override]
        """The disk read puts the blocks straight into the slot where they stay as stored."""
        return self.name in KINDS and block_kernel() is not None

    def stays_packed(self, shape: tuple[int, ...]) -> bool:
        return self.as_blocks(shape) or (self.packed_as is not None and self.packed_as.stays_packed(shape))

    def packed_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype, align: int = 1) -> int:
        if self.as_blocks(shape):
            return self.nbytes(shape)
        if self.packed_as is None:
            return super().packed_nbytes(shape, dtype, align)
        return self.packed_as.packed_nbytes(shape, dtype, align)

    def packed_view(self, region: Tensor, shape: tuple[int, ...], dtype: torch.dtype, align: int = 1) -> object:
        if self.as_blocks(shape):
            return PackedBlocks(region[: self.nbytes(shape)].view(shape[0], -1), self, shape[1], dtype)
        if self.packed_as is None:
            return super().packed_view(region, shape, dtype, align)
        return self.packed_as.packed_view(region, shape, dtype, align)

    def fill_packed(self, view: object, parts: dict[str, Tensor], codes_there: bool = False) -> None:
        """Blocks (`PackedBlocks`): the stored bytes copied into the slot as they are (unless the disk read put them
        there). Otherwise `packed_as`'s weight from the stored blocks, PACK_ROWS outputs at a time (`_fill_block` on
        a view of those outputs: bounded temporaries); every block holds a stored row (outputs pad to less than one
        kernel block)."""
        if isinstance(view, PackedBlocks):
            if not codes_there:
                view.blocks.copy_(parts["qweight"].reshape(view.blocks.shape))
            return
        assert isinstance(view, PackedInt4) and not codes_there
        q = parts["qweight"]  # [n, nb * block_bytes]
        n, out_p = q.shape[0], view.codes.shape[0]
        for start in range(0, out_p, PACK_ROWS):
            end = min(start + PACK_ROWS, out_p)
            part = replace(view, codes=view.codes[start:end], scales_zeros=view.scales_zeros[:, start:end],
                           out=min(end, n) - start)
            self._fill_block(part, q[start : min(end, n)])

    def _fill_block(self, view: PackedInt4, q: Tensor) -> None:
        """`fill_packed` for the outputs of `view` from their stored rows q [n <= view's outputs, row bytes]."""
        raise NotImplementedError

    #: byte offsets of each block's float16 scales (q4_k / q5_k: d and dmin; mxfp4: none, its e8m0 exponent is
    #: always a finite power of two)
    scales_at: ClassVar[tuple[int, ...]] = (0,)

    def check_parts(self, parts: dict[str, Tensor]) -> str | None:
        """Every block's float16 scales (`scales_at`) finite."""
        q = parts.get("qweight")
        if q is None or not q.numel():
            return None
        b = _blocks(q, self.block_bytes)
        for at in self.scales_at:
            if not bool(torch.isfinite(_f16(b[..., at : at + 2])).all()):
                return f"a block scale (bytes {at}..{at + 1} of each block) holds NaN or infinity"
        return None


@register_format
@dataclass(frozen=True)
class Q8_0(GGMLFormat):
    name, default_group, block, block_bytes, gguf_type = "q8_0", 32, 32, 34, "Q8_0"
    packed_as = Int8Group(32)

    def _codes(self, b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        return b[..., None, 2:].view(torch.int8), _f16(b[..., :2])[..., None], None

    def _fill_block(self, view: PackedInt4, q: Tensor) -> None:
        """int8g's packed weight (group 32: the block's d is the group's scale, q its codes, -128 included): the
        codes re-laid out as the int4 kernel's halves (`split_layout`, on every load: one pass over the codes), d in
        the compute dtype."""
        assert isinstance(view, PackedInt8Split)
        b = _blocks(q, self.block_bytes)  # [n, nb, 34]
        codes = _padded(b[..., 2:].reshape(b.shape[0], -1), view.codes.shape[0])  # [out_p, in] uint8: int8 bytes
        view.codes.copy_(split_layout(codes.view(torch.int8), block=kernel_block()))
        self.packed_as.fill_packed(view, {"scale": _f16(b[..., :2])[..., 0]}, codes_there=True)  # scale [n, nb]


@dataclass(frozen=True)
class _Int4Blocks(GGMLFormat):
    """A block type that is int4 with a scale and an offset per 32 inputs: stays packed for the int4 kernel. Its
    blocks hold, from byte `qs_at`, runs of `run` bytes whose low nibbles are `run` consecutive codes and whose
    high nibbles the next `run` (`chunks` such pairs per block)."""

    packed_as = Int4(32)
    qs_at: ClassVar[int] = 0
    run: ClassVar[int] = 0
    chunks: ClassVar[int] = 1

    def scales(self, b: Tensor) -> tuple[Tensor, Tensor]:
        """Blocks [R, nb, block_bytes] -> (scale, min) float32 [R, in / 32]: w = q * scale + min per 32 inputs."""
        raise NotImplementedError

    def int4_parts(self, parts: dict[str, Tensor]) -> dict[str, Tensor]:
        """The weight as "int4" group-32 components (codes [..., in / 2] even input low; scale and min float32): the
        reference `fill_packed`'s direct repacking is tested against (through int4's own packing)."""
        b = _blocks(parts["qweight"], self.block_bytes)  # [R, nb, block_bytes]
        codes = _nibbles(b[..., self.qs_at :], self.run).reshape(b.shape[0], -1)  # [R, in]
        scale, low = self.scales(b)
        return {"qweight": _pairs(codes), "scale": scale, "zero": low}

    def _fill_block(self, view: PackedInt4, q: Tensor) -> None:
        """The codes straight from the blocks into the kernel's layout (runtime/models/packed.py `kernel_layout`:
        per block of kb outputs, 64 or 32 by `kernel_block`, and per input e, the byte code(channel j, e) |
        code(channel kb / 2 + j, e) << 4): the two nibble planes of channel pairs (j, kb / 2 + j) combined on whole
        rows as words (`_words`), then each plane moved to its place in one strided copy; per group (scale, min + 8
        * scale) in the compute dtype (padded outputs: 0, 0)."""
        n, nb, out_p = q.shape[0], q.shape[1] // self.block_bytes, view.codes.shape[0]
        kb = kernel_block()
        half = kb // 2
        rows = _padded(q, out_p)  # [out_p, row bytes]
        if rows.shape[1] % 4 == 0:
            x, low_mask, high_mask = _words(rows), LOW_NIBBLES, HIGH_NIBBLES
        else:  # (rows of an odd number of 18-byte q4_0 blocks: byte by byte)
            x, low_mask, high_mask = rows, 0x0F, 0xF0
        pairs = x.view(out_p // kb, 2, half, -1)  # [blocks, channel half, j, row]
        first, second = pairs[:, 0], pairs[:, 1]
        low = first & low_mask  # low nibbles: code(j) | code(half + j) << 4
        part = torch.bitwise_left_shift(second, 4)
        low |= part.bitwise_and_(high_mask)
        high = torch.bitwise_right_shift(first, 4).bitwise_and_(low_mask)  # high nibbles
        high |= torch.bitwise_and(second, high_mask, out=part)
        d = view.codes.view(out_p // kb, nb, self.chunks, 2, self.run, half)  # [blocks, nb, chunks, nibble, run, j]
        for nibble, plane in enumerate((low, high)):
            src = plane.view(torch.uint8).view(out_p // kb, half, nb, self.block_bytes)[..., self.qs_at :]
            d[:, :, :, nibble].copy_(src.unflatten(-1, (self.chunks, self.run)).permute(0, 2, 3, 4, 1))
        scale, low_value = self.scales(_blocks(q, self.block_bytes))  # [n, in / 32]
        if n < out_p:
            view.scales_zeros[:, n:].zero_()
        view.scales_zeros[:, :n, 0].copy_(scale.T)
        view.scales_zeros[:, :n, 1].copy_(low_value.add_(scale, alpha=8).T)  # min + 8 * scale


def _padded(rows: Tensor, out: int) -> Tensor:
    """rows [n, w] with zero rows appended up to `out` (the outputs of whole kernel blocks); rows itself if n == out."""
    return torch.cat([rows, rows.new_zeros(out - rows.shape[0], rows.shape[1])]) if rows.shape[0] < out else rows


def _pairs(codes: Tensor) -> Tensor:
    """Codes uint8 [R, in] (0..15) -> int4's stored bytes [R, in / 2] (input 2i low, 2i + 1 high)."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


@register_format
@dataclass(frozen=True)
class Q4_0(_Int4Blocks):
    name, default_group, block, block_bytes, gguf_type = "q4_0", 32, 32, 18, "Q4_0"
    qs_at, run, chunks = 2, 16, 1

    def _codes(self, b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        q = _nibbles(b[..., 2:], 16).view(*b.shape[:2], 1, 32).view(torch.int8).sub_(8)  # [R, nb, 1, 32]
        return q, _f16(b[..., :2])[..., None], None

    def scales(self, b: Tensor) -> tuple[Tensor, Tensor]:
        d = _f16(b[..., :2])[..., 0]  # [R, nb]
        return d, -8 * d


@register_format
@dataclass(frozen=True)
class Q5_0(GGMLFormat):
    name, default_group, block, block_bytes, gguf_type = "q5_0", 32, 32, 22, "Q5_0"

    def _codes(self, b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        high = (b[..., 2:6, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [R, nb, 4, 8]: bit j of qh, LE
        low = _nibbles(b[..., 6:], 16).flatten(-3)  # [R, nb, 32]
        q = (low | (high.flatten(-2) << 4)).view(torch.int8).sub_(16)
        return q[..., None, :], _f16(b[..., :2])[..., None], None


def _k_steps(b: Tensor) -> tuple[Tensor, Tensor]:
    """q4_k / q5_k blocks [R, nb, bytes] -> (d * sc_j, dmin * m_j) float32 [R, nb, 8], per sub-block j of 32.

    The 12 scale bytes are three words D, M, MD (ggml's get_scale_min_k4): sc = (D & 63 | (MD & 15) | (D >> 2 & 48))
    and m = (M & 63 | (MD >> 4) | (M >> 2 & 48)) per byte lane, lanes 0..3 then 4..7."""
    head = b[..., :16].contiguous()  # [R, nb, 16]: d, dmin (float16), the 12 scale bytes
    w = head.view(torch.int32)  # [R, nb, 4]
    d, m, md = w[..., 1:2], w[..., 2:3], w[..., 3:4]
    sc = torch.cat((d & 0x3F3F3F3F, (md & LOW_NIBBLES) | ((d >> 2) & 0x30303030)), dim=-1)  # [R, nb, 2] words
    mn = torch.cat((m & 0x3F3F3F3F, ((md >> 4) & LOW_NIBBLES) | ((m >> 2) & 0x30303030)), dim=-1)
    dd = head.view(torch.float16)[..., :2].float()  # [R, nb, 2]: d, dmin
    return dd[..., :1] * sc.view(torch.uint8).float(), dd[..., 1:2] * mn.view(torch.uint8).float()


def _k_codes(b: Tensor, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q4_k / q5_k: w = (d * sc_j) * q - (dmin * m_j) per sub-block j of 32; q [R, nb, 8, 32]."""
    scale, low = _k_steps(b)
    return q, scale[..., None], low[..., None]


@register_format
@dataclass(frozen=True)
class Q4_K(_Int4Blocks):
    name, default_group, block, block_bytes, gguf_type = "q4_k", QK_K, QK_K, 144, "Q4_K"
    qs_at, run, chunks = 16, 32, 4

    scales_at = (0, 2)

    def _codes(self, b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        return _k_codes(b, _nibbles(b[..., 16:], 32).flatten(-3, -2))

    def scales(self, b: Tensor) -> tuple[Tensor, Tensor]:
        scale, low = _k_steps(b)  # [R, nb, 8]
        return scale.flatten(1), -low.flatten(1)


@register_format
@dataclass(frozen=True)
class Q5_K(GGMLFormat):
    name, default_group, block, block_bytes, gguf_type = "q5_k", QK_K, QK_K, 176, "Q5_K"
    scales_at = (0, 2)

    def _codes(self, b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        low = _nibbles(b[..., 48:], 32).flatten(-3, -2)  # [R, nb, 8, 32]
        high = (b[..., None, 16:48] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1  # [R, nb, 8, 32]
        return _k_codes(b, low | (high << 4))


@register_format
@dataclass(frozen=True)
class Q6_K(GGMLFormat):
    name, default_group, block, block_bytes, gguf_type = "q6_k", QK_K, QK_K, 210, "Q6_K"
    scales_at = (208,)
    #: rows up to which ggml.c multiplies (`PackedBlocks.matmul`): runtime/models/packed.py `Q6_K_MAX_ROWS`
    kernel_max_rows: ClassVar[int] = Q6_K_MAX_ROWS

    def _codes(self, b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Per half of 128 codes: 64 ql bytes (low nibbles: codes 0..63, high: 64..127) and 32 qh bytes (bits 2r,
        2r + 1: the 5th and 6th bit of run r of 32 codes), as words (`_words`)."""
        r, nb = b.shape[:2]
        ql = _words(b[..., :128]).view(r, nb, 2, 16)
        qh = _words(b[..., 128:192]).view(r, nb, 2, 8)
        q = torch.empty(r, nb, 2, 4, 8, dtype=torch.int32)  # [R, nb, half, run, 32 codes]
        nibbles = q.view(r, nb, 2, 2, 16)
        torch.bitwise_and(ql, LOW_NIBBLES, out=nibbles[:, :, :, 0])
        torch.bitwise_right_shift(ql, 4, out=nibbles[:, :, :, 1]).bitwise_and_(LOW_NIBBLES)
        bits = torch.empty_like(qh)
        for run, shift in enumerate((4, 2, 0, -2)):  # qh bits 2 run, 2 run + 1 -> bits 4, 5 of the code
            if shift >= 0:
                torch.bitwise_left_shift(qh, shift, out=bits)
            else:
                torch.bitwise_right_shift(qh, -shift, out=bits)
            q[:, :, :, run].bitwise_or_(bits.bitwise_and_(0x30303030))
        codes = q.view(torch.int8).sub_(32).view(r, nb, 16, 16)  # the 6-bit codes, 0 .. 63, minus 32
        return codes, (_f16(b[..., 208:210]) * b[..., 192:208].view(torch.int8).float())[..., None], None


#: MXFP4's e2m1 values, doubled (the exponent below halves them: ggml's kvalues_mxfp4)
_E2M1_X2 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


@register_format
@dataclass(frozen=True)
class MXFP4(GGMLFormat):
    name, default_group, block, block_bytes, gguf_type = "mxfp4", 32, 32, 17, "MXFP4"
    scales_at = ()

    def _codes(self, b: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        e = b[..., :1].to(torch.int32)  # [R, nb, 1]
        bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)  # ggml_e8m0_to_fp32_half
        values = _E2M1_X2[_nibbles(b[..., 1:], 16)[..., 0, :, :].long()].view(*b.shape[:2], 1, 32)
        return values, bits.view(torch.float32)[..., None], None


@register_format
@dataclass(frozen=True)
class F16(GGMLFormat):
    """A GGUF's F16 matrix (an MoE's 336-wide expert projections, which no block type of 32 fits, or a whole F16
    file): one value per "block" of 2 bytes, kept as stored for ggml.c (2 bytes a weight in its slot, no conversion
    at load; float32 products of the exact float16 values, rounded to the compute dtype first as a converted copy
    would be). Without the kernel it is converted at load as a plain float16 tensor is. A GGUF's F16 vectors (norms)
    stay plain tensors (runtime/models/gguf.py)."""

    name, default_group, block, block_bytes, gguf_type = "f16", 1, 1, 2, "F16"
    scales_at = ()
    #: rows of x up to which ggml.c multiplies (`PackedBlocks.matmul`; above, a converted copy and a GEMM): on the
    #: 2-core AVX2 EPYC (docs/perf kernels_f16), with the load's conversion counted (a streamed weight pays it every
    #: pass), the tile wins or ties up to 16 rows in float32 and to 32 in bfloat16; at 32 rows in float32 the copy's
    #: GEMM is 1.0-1.5x faster
    kernel_max_rows: ClassVar[int] = 16

    def dequantize_rows(self, dest: Tensor, parts: dict[str, Tensor]) -> Tensor:
        """The values themselves (float32 holds them exactly): no codes, no scales (`_codes` is not needed)."""
        return dest.copy_(parts["qweight"].view(torch.float16).view(dest.shape))

    def dequantize_direct(self, dest: Tensor, parts: dict[str, Tensor]) -> bool:
        from ..cast import copy_cast

        if dest.device.type != "cpu":
            return False
        copy_cast(dest, parts["qweight"].contiguous().view(torch.float16).view(dest.shape))
        return True

    def quantize_rows(self, x: Tensor) -> dict[str, Tensor]:
        return {"qweight": x.to(torch.float16).contiguous().view(torch.uint8)}


#: the formats ggml.c multiplies, by name (their block layouts are the kernel's, `BLOCK_LAYOUT`)
FORMATS_BY_NAME = {f.name: f(f.default_group) for f in (Q4_K, Q6_K, F16)}
assert all(BLOCK_LAYOUT[n] == (f.block_bytes, f.scales_at) and BLOCK_INPUTS[n] == f.block
           for n, f in FORMATS_BY_NAME.items())
