"""`copy_cast`: dest.copy_(src) across float dtypes, through a cache-sized float32 scratch where torch's direct CPU
conversion is slow.

A conversion between the two 16-bit formats (float16 <-> bfloat16) on the CPU goes through the engine's native
kernel where it is built (runtime/kernels: one pass, vectorized, on torch's thread count; ~10x the blocks below on
2 cores), else in blocks of rows through one float32 scratch of `BLOCK_ELEMENTS` elements (256 KiB: it stays in L2
between the two halves); both bit-identical to the direct conversion (float16 -> float32 is exact, float32 ->
bfloat16 rounds once to nearest even, as the direct one does) but for NaN payloads; every other conversion, and any
on CUDA, is one `copy_`. The measurements behind it: docs/perf/README.md, "kernel
choices".
"""

from __future__ import annotations

import torch

from .kernels import ggml_kernel

#: float32 elements converted per block (256 KiB: the scratch stays in the core's L2 cache)
BLOCK_ELEMENTS = 1 << 16
_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def slow_direct(src: torch.dtype, dest: torch.dtype) -> bool:
    """torch's CPU `copy_` from `src` to `dest` lacks a vectorized path (module docstring)."""
    return src != dest and src in _SIXTEEN_BIT and dest in _SIXTEEN_BIT


def copy_cast(dest: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dest.copy_(src) (same number of elements), bit-identical to it but for NaN payloads (a NaN stays a NaN);
    returns dest. Between float16 and bfloat16 on the CPU it converts contiguous tensors in float32 blocks."""
    if (dest.device.type != "cpu" or src.device.type != "cpu" or not slow_direct(src.dtype, dest.dtype)
            or not (dest.is_contiguous() and src.is_contiguous()) or dest.numel() <= BLOCK_ELEMENTS):
        return dest.copy_(src)
    flat_dest, flat_src = dest.view(-1), src.reshape(-1)  # [n], [n]
    kernel = ggml_kernel()
    if kernel is not None:
        kernel.convert(flat_dest, flat_src)
        return dest
    scratch = torch.empty(BLOCK_ELEMENTS, dtype=torch.float32)  # [block]
    n = flat_dest.numel()
    for start in range(0, n, BLOCK_ELEMENTS):
        stop = min(start + BLOCK_ELEMENTS, n)
        block = scratch[: stop - start]
        block.copy_(flat_src[start:stop])
        flat_dest[start:stop].copy_(block)
    return dest
