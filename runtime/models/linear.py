"""`linear`: y = x W^T (+ b), choosing the fastest CPU GEMM orientation for the shape and dtype.

Measured on the 2-core AVX2 CI machine (torch 2.13 CPU, MKL), W [8960, 1536]:
  - float32: computing (W @ x^T)^T is 1.6-4x faster than F.linear(x, W) for 4-80 rows (F.linear takes a
    slow small-M sgemm path: 24 ms vs 6.4 ms at 4 rows) and equal at 1 row.
  - bfloat16 / float16 (no native support on AVX2): F.linear is best up to a few dozen rows; beyond that,
    upcasting W and x to float32 (exact) and doing one fp32 GEMM wins (130 ms vs 75 ms at 80 rows). oneDNN's
    bf16 GEMM accumulates in fp32 too, so this changes only the summation order, not the precision class.
    Where oneDNN has native 16-bit GEMMs (`native_16bit`: AVX512-BF16 / AMX, AVX512-FP16; measured on a 2-core
    machine with AMX, W [8960, 1536] bf16 at 48 / 80 / 256 rows: F.linear 1.6 / 2.2 / 3.3 ms, upcast 17 / 21 /
    35 ms; the 151936-row head at 48 rows: 34 ms against 329 ms) the upcast only converts W on every call, so
    F.linear is used at every row count.
  - float32 weights packed for oneDNN (`pack_weights`): 1.4-1.9x faster than either orientation above at
    1 row (the weight-bandwidth-bound decode of batch 1: 4.1 ms vs 7.7 ms), and on par at 5-80 rows.
On CUDA F.linear is used as is. An int8 weight kept packed in its ring slot (`PackedInt8`, where `packed_kernel`
holds) goes to torch's weight-only int8 kernel at decode row counts (runtime/models/packed.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TypeVar

import torch
import torch.nn.functional as F

from .packed import PackedInt8, packed_linear

W = TypeVar("W")

#: rows from which a 16-bit CPU matmul is done in float32 where the CPU has no native 16-bit GEMM (docstring)
UPCAST_MIN_ROWS = 48


@functools.cache
def native_16bit(dtype: torch.dtype) -> bool:
    """oneDNN computes `dtype` (bfloat16 / float16) GEMMs natively on this CPU (AVX512 / AMX kernels), so F.linear
    beats upcasting to float32 at every row count (module docstring)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


@functools.cache
def packed_kernel(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether streamed int8 weights stay packed in their slots: bfloat16 compute on a CPU whose oneDNN has native
    bfloat16 GEMMs (the kernel's fast path), and a torch that has the kernel."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and native_16bit(torch.bfloat16)
            and hasattr(torch, "_weight_int8pack_mm"))


def linear(x: torch.Tensor, w: torch.Tensor | PackedInt8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w[out, in]^T + bias[out] -> [..., out] in x's dtype (w: a tensor, or an int8 weight kept
    packed in its slot, runtime/models/packed.py)."""
    if isinstance(w, PackedInt8):
        rows = x.numel() // x.shape[-1]
        out = packed_linear(x.reshape(rows, x.shape[-1]), w).to(x.dtype)  # [N, out]
        return (out if bias is None else out + bias).reshape(*x.shape[:-1], w.shape[0])
    if x.device.type != "cpu":
        return F.linear(x, w, bias)
    rows = x.numel() // x.shape[-1]
    x2 = x.reshape(rows, x.shape[-1])  # [N, in]
    if w.is_mkldnn:
        out = torch._C._nn.mkldnn_linear(x2.contiguous().to_mkldnn(), w, None).to_dense()  # [N, out]
    elif w.dtype == torch.float32:
        out = (w @ x2.T).T  # [N, out] (transposed view)
    elif rows >= UPCAST_MIN_ROWS and not native_16bit(w.dtype):
        out = (w.float() @ x2.float().T).T.to(x.dtype)  # [N, out]
    else:
        out = F.linear(x2, w)  # [N, out]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], w.shape[0])


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing pays off for float32 on CPU (see module docstring)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_weights(weights: W) -> W:
    """Copy of a weights dataclass with every 2-D matrix (a `linear` weight) in oneDNN's blocked layout.

    Only for parts whose matrices are all consumed by `linear` (not the embedding table).
    """
    changes = {}
    for f in dataclasses.fields(weights):
        value = getattr(weights, f.name)
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            changes[f.name] = value.contiguous().to_mkldnn()
        elif dataclasses.is_dataclass(value):
            changes[f.name] = pack_weights(value)
    return dataclasses.replace(weights, **changes)
