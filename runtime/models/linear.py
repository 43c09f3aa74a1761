"""`linear`: y = x W^T (+ b), choosing the CPU GEMM orientation for the shape and dtype.

  - float32: (W @ x^T)^T for more than one row (MKL's small-M sgemm path behind F.linear is the slower one),
    F.linear at one row; a weight packed for oneDNN (`pack_weights`) goes through its packed GEMM.
  - bfloat16 / float16: F.linear where oneDNN has native 16-bit GEMMs (`native_16bit`: AVX512-BF16 / AMX,
    AVX512-FP16), above 32 rows over the rows padded to a bucket (runtime/models/row_buckets.py: a new row count
    costs a kernel build); elsewhere F.linear below `UPCAST_MIN_ROWS` rows, from there W and x upcast to float32
    (exact) and one float32 GEMM (the summation order changes, not the precision class: oneDNN accumulates 16-bit
    GEMMs in float32 too).
  - an int8 or int4 weight kept packed in its ring slot (`PackedInt8`, `PackedInt4`, where `packed_kernel` holds):
    torch's weight-only int8 / int4 kernel at decode row counts (runtime/models/packed.py); a GGUF's q4_k / q6_k
    weight kept as its blocks (`PackedBlocks`): runtime/kernels/ggml.c at every row count.
On CUDA F.linear is used as is. The measurements behind each rule: docs/perf/README.md, "kernel choices".

Exact arithmetic (`exact_rows`, EngineConfig.exact). A GEMM's kernel, and with it the order in which each output
sums its products, depends on the number of rows (measured here, bfloat16 on AMX: a row's output is the same for 1
to 32 rows and different from 33 on), so the same row computes differently in a decode pass, a verify pass over
k + 1 tokens or a batch of another size, and a near-tie of two logits can then flip. Inside `exact_rows()`,
`linear` (and `rows_bmm`) multiply every block of EXACT_ROWS rows as one GEMM of exactly EXACT_ROWS rows (the last
block padded with zero rows), so each row meets one kernel of one shape whatever its company: its result depends on
its own values only. The attention core does the same per query (runtime/models/layers.py `_attend_cached`).
A block's row may still compute differently by its place in the block: on an AVX2 EPYC (MKL), a float32 bmm with
few output columns (e.g. 7) gives rows 2 and 3 of every 4 other last bits than rows 0 and 1 (184 of 2560 row
places over 80 shapes; none in bfloat16). `rows_bmm` therefore multiplies a block transposed, b^T a^T, which puts
the block's rows on the kernel's vector lanes: the same products in the same order for every lane (0 of 2560 there).

oneDNN compiles a kernel per GEMM shape and keeps it in two caches (its own and ideep's, 1024 entries each by
default, ~0.3-0.5 MB an entry); ragged batches (refill, chunked prefill) bring new row counts all job long, so those
caches alone grew a long job's memory by ~500 MB. `bound_kernel_caches` caps both at KERNEL_CACHE entries (the
passes of one job use a few dozen shapes), unless the environment already sets them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.nn.functional as F

from .packed import PackedBlocks, PackedInt4, PackedInt8, PackedWeight, packed_linear
from .row_buckets import bucketed_linear, native_16bit

W = TypeVar("W")

#: rows from which a 16-bit CPU matmul is done in float32 where the CPU has no native 16-bit GEMM (docstring)
UPCAST_MIN_ROWS = 48


@functools.cache
def packed_kernel(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether streamed int8 / int4 weights stay packed in their slots by default: bfloat16 compute on the CPU (the
    kernels vectorize bfloat16 only: runtime/models/packed.py KERNEL_DTYPE) and a torch that has the int8 kernel
    (int4 weights also need the int4 kernel, runtime/models/packed.py `int4_kernel_ok`). With native bfloat16 GEMMs
    (AMX) the kernels win at decode row counts once the loader's dequantization is counted; without (AVX2) they beat
    the bfloat16 GEMM itself at every row count to 128 (docs/perf kernels_avx2: int4 1.2-4.1x, int8 1.1-3.4x)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and hasattr(torch, "_weight_int8pack_mm"))


#: rows of every GEMM in exact mode (module docstring): the largest count of oneDNN's small-row bfloat16 kernel,
#: so a decode pass of up to 32 rows costs what it costs without exact mode
EXACT_ROWS = 32

_exact = threading.local()  # per thread: an offloaded pass runs the target's blocks on worker threads


@contextlib.contextmanager
def exact_rows(on: bool = True) -> Iterator[None]:
    """Within this block (this thread), `linear`, `rows_bmm` and the attention core compute each row independently
    of the others in its call (module docstring); nested blocks restore the outer setting."""
    outer = getattr(_exact, "on", False)
    _exact.on = on
    try:
        yield
    finally:
        _exact.on = outer


def exact_mode() -> bool:
    """Whether this thread is inside `exact_rows()`."""
    return getattr(_exact, "on", False)


def in_row_blocks(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], dim: int = 0) -> torch.Tensor:
    """fn over x in blocks of exactly EXACT_ROWS along `dim` (the last block zero-padded, its padding cut from the
    result) concatenated: fn must map each index of `dim` to the same index of its output."""
    rows = x.shape[dim]
    if rows == 0:
        return fn(x)
    pieces = []
    for start in range(0, rows, EXACT_ROWS):
        block = x.narrow(dim, start, min(EXACT_ROWS, rows - start))
        n = block.shape[dim]
        if n < EXACT_ROWS:
            pad = list(block.shape)
            pad[dim] = EXACT_ROWS - n
            block = torch.cat([block, block.new_zeros(pad)], dim=dim)
        pieces.append(fn(block).narrow(dim, 0, n))
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def rows_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a [G, N, K], b [G, K, M]) -> [G, N, M]; in exact mode N in blocks (`in_row_blocks`), each block
    multiplied transposed, (b^T [G, M, K] @ block^T [G, K, EXACT_ROWS])^T, its rows on the vector lanes (module
    docstring)."""
    if not exact_mode():
        return torch.bmm(a, b)
    bt = b.transpose(1, 2)  # [G, M, K]
    return in_row_blocks(a, lambda block: torch.bmm(bt, block.transpose(1, 2)).transpose(1, 2), dim=1)


KERNEL_CACHE = 128  # oneDNN primitives kept per cache (module docstring)


def bound_kernel_caches() -> None:
    """Cap oneDNN's primitive caches at KERNEL_CACHE entries, unless the environment sets them: oneDNN and ideep
    read these variables when they first create a kernel, so this holds if no GEMM has run in this process yet."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(KERNEL_CACHE))


def linear(x: torch.Tensor, w: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w[out, in]^T + bias[out] -> [..., out] in x's dtype (w: a tensor, or an int8 / int4 weight kept
    packed in its slot, runtime/models/packed.py); in exact mode in blocks of EXACT_ROWS rows (module docstring)."""
    if exact_mode():
        rows = x.numel() // x.shape[-1]
        out = in_row_blocks(x.reshape(rows, x.shape[-1]), lambda block: _linear(block, w))  # [N, out]
        return (out if bias is None else out + bias).reshape(*x.shape[:-1], out.shape[-1])
    return _linear(x, w, bias)


def _linear(x: torch.Tensor, w: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` in one call, the kernel chosen by the shape (module docstring)."""
    if isinstance(w, (PackedInt8, PackedInt4, PackedBlocks)):
        rows = x.numel() // x.shape[-1]
        out = packed_linear(x.reshape(rows, x.shape[-1]), w, dense=_linear).to(x.dtype)  # [N, out]
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
        out = bucketed_linear(x2, w)  # [N, out], over a bucket of rows (runtime/models/row_buckets.py)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], w.shape[0])


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing pays off for float32 on CPU (see module docstring)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_weights(weights: W) -> W:
    """Copy of a weights dataclass with every 2-D matrix (a `linear` weight) in oneDNN's blocked layout.

    Only for parts whose matrices are all consumed by `linear` (not the embedding table), but for those the
    dataclass names in `raw_matrices` (multiplied otherwise: MLA's kv_b).
    """
    changes = {}
    raw = getattr(weights, "raw_matrices", ())
    for f in dataclasses.fields(weights):
        value = getattr(weights, f.name)
        if isinstance(value, torch.Tensor) and value.dim() == 2 and f.name not in raw:
            changes[f.name] = value.contiguous().to_mkldnn()
        elif dataclasses.is_dataclass(value) and not isinstance(value, PackedWeight):  # (a kernel's own layout)
            changes[f.name] = pack_weights(value)
    return dataclasses.replace(weights, **changes)
