"""Row buckets for CPU 16-bit GEMMs: F.linear over x's rows padded with zero rows up to `bucket(rows)`.

oneDNN builds (JIT-compiles) a kernel for each GEMM shape it meets and caches it (runtime/models/linear.py
`bound_kernel_caches`); a build costs 1-2.5 ms on the 2-core Xeon with AMX (measured with
ONEDNN_VERBOSE=profile_create), several times the GEMM itself. A prefill pass gives every expert of an MoE layer a
different row count, in every layer and pass (the moefied Qwen2.5-1.5B, 8 prompts, chunks of 256 tokens: 3549
builds, 7.1 s of a ~14 s prefill). Padding the rows to a bucket makes those GEMMs a few shapes:

    bucket(n) = n                                   for n <= BUCKET_FROM
              = ceil(n / g) * g,  g = max(BUCKET_FROM, 2^floor(log2 n) / 8)   above,

so the padding is below 1/8 of the rows from 256 rows up (below 32 rows under that) and the number of shapes grows
with log(n) (8 buckets an octave). Up to BUCKET_FROM rows (decode, verify) nothing is padded: oneDNN's small-row
kernels serve those, and a decode pass meets the same few counts every pass.

Numerics: the real rows' products are the same products; which kernel (and so which summation order) a row meets
depends on the GEMM's row count, which is now the bucket's, as a row's result already depended on the rows beside
it (runtime/models/linear.py, "exact arithmetic"; exact mode does not pad: its blocks are one shape already).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

#: row counts up to which a GEMM is run as it is (oneDNN's small-row kernel range, linear.py EXACT_ROWS)
BUCKET_FROM = 32


def bucket(rows: int) -> int:
    """The row count a GEMM over `rows` rows is run at (module docstring): >= rows, < rows * 9/8 above 256."""
    if rows <= BUCKET_FROM:
        return rows
    step = max(BUCKET_FROM, (1 << (rows.bit_length() - 1)) // 8)
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, in] with zero rows appended up to bucket(N) (x itself where N is its own bucket)."""
    extra = bucket(x.shape[0]) - x.shape[0]
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def bucketed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x [N, in], w [out, in]) -> [N, out], computed over bucket(N) rows on the CPU (module docstring)."""
    if x.device.type != "cpu":
        return F.linear(x, w)
    return F.linear(pad_rows(x), w)[: x.shape[0]]


@functools.cache
def native_16bit(dtype: torch.dtype) -> bool:
    """oneDNN computes `dtype` (bfloat16 / float16) GEMMs natively on this CPU (AVX512 / AMX kernels), so F.linear
    beats upcasting to float32 at every row count (runtime/models/linear.py's module docstring; the packed kernels'
    row limits depend on it too, runtime/models/packed.py)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False
