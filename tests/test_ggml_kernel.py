"""runtime/kernels/ggml.c: x @ W^T over a GGUF's q4_k / q6_k blocks and F16 rows as stored (`PackedBlocks`).

Its products equal x @ W^T with W from the Python dequantization (llama.cpp's values, bit for bit: test_gguf.py) to
float32 summation, in the vector build this CPU takes (AVX-512 or AVX2) and in the portable one; a row's result does
not depend on the rows beside it nor on the thread count; a q4_k / q6_k weight stays as its blocks in a slot (read
there by the disk read, no work at load; a tiny GGUF target run so: test_gguf.py); without a compiler, or turned
off, the formats fall back to what they did before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.runtime import kernels
from specoffload.runtime.formats import dequantize, ggml, weight_format
from specoffload.runtime.models.linear import linear
from specoffload.runtime.models.packed import PackedBlocks, PackedInt4
from tests.test_gguf import random_blocks

KERNEL = ggml.block_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the ggml kernel is not built here")



@pytest.fixture(scope="module")
def generic():
    """The portable build of ggml.c (no vector path), loaded beside the default one."""
    path = kernels.build(generic=True)
    if path is None:
        pytest.skip("no C compiler")
    kernel = kernels._load(path)
    assert not kernel.vector and kernel.isa == "portable"
    return kernel


@needs_kernel
def test_the_build_takes_the_widest_vector_path_this_cpu_has():
    flags = set(kernels._cpu_signature().split())
    want = ("avx512" if {"avx512f", "avx512bw"} <= flags else "avx2" if {"avx2", "fma", "f16c"} <= flags
            else "portable")
    assert KERNEL.isa == want and KERNEL.vector == (want != "portable")


def weights(name: str, out: int, inputs: int, seed: int) -> np.ndarray:
    """Random stored rows of `out` x `inputs` weights of kind `name` (whole blocks)."""
    return random_blocks(name, out, inputs // kernels.BLOCK_INPUTS[name], seed)


def product(kernel, name: str, raw: np.ndarray, x: torch.Tensor, threads: int = 2) -> torch.Tensor:
    return kernel.matmul(name, torch.from_numpy(raw), x, threads=threads)


@needs_kernel
@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(kernels.KINDS)), out=st.integers(1, 9), blocks=st.integers(1, 3),
       rows=st.integers(1, 19), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_products_equal_the_dequantized_weights(name, out, blocks, rows, threads, seed):
    raw = weights(name, out, blocks * 256, seed)
    w = dequantize({"qweight": torch.from_numpy(raw)}, weight_format(name), (out, blocks * 256))  # [out, in] float32
    x = torch.randn(rows, blocks * 256, generator=torch.Generator().manual_seed(seed))
    want = (x.double() @ w.double().T)  # [rows, out]
    got = product(KERNEL, name, raw, x, threads)
    assert got.shape == (rows, out)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()) + 1e-30)
    alone = [product(KERNEL, name, raw, x[r : r + 1], 1) for r in (0, rows - 1)]  # one row, one thread
    assert torch.equal(alone[0][0], got[0]) and torch.equal(alone[1][0], got[-1])


@needs_kernel
def test_bfloat16_weights_take_pair_products_where_the_cpu_has_them():
    """`tile_dot` (AVX512-BF16's `vdpbf16ps`) is built exactly where the AVX-512 path runs on a CPU with
    avx512_bf16."""
    flags = set(kernels._cpu_signature().split())
    assert KERNEL.dot == (KERNEL.isa == "avx512" and "avx512_bf16" in flags)


@needs_kernel
@pytest.mark.parametrize("name", ["q4_k", "q6_k"])
def test_pair_products_equal_the_rounding_build_in_bfloat16(generic, name):
    """In bfloat16 the kernel multiplies x rounded to bfloat16 by each weight rounded to bfloat16 (a bfloat16
    GEMM's operands): the pair-product build (`tile_dot`, where built), the one that rounds each weight and
    multiply-adds in float32 (`nodot`) and the portable one give x_bf16 @ W_bf16^T to float32 summation, for tiles of
    every height (1-8 rows of x, 1 and 2 W rows); a row alone gives its bits in the batch."""
    path = kernels.build(no_dot=True)
    assert path is not None
    no_dot = kernels._load(path)
    assert not no_dot.dot
    raw = weights(name, 37, 3 * 256, 7)  # an odd number of outputs: the last one alone
    w = dequantize({"qweight": torch.from_numpy(raw)}, weight_format(name), (37, 3 * 256), torch.bfloat16)
    x = torch.randn(19, 3 * 256, generator=torch.Generator().manual_seed(8))  # tiles of 8, 8 and 3 rows
    want = x.bfloat16().double() @ w.double().T
    for kernel in (KERNEL, no_dot, generic):
        got = kernel.matmul(name, torch.from_numpy(raw), x, dtype=torch.bfloat16).double()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
        alone = kernel.matmul(name, torch.from_numpy(raw), x[-1:], threads=1, dtype=torch.bfloat16).double()
        assert torch.equal(alone[0], got[-1])


@pytest.fixture(scope="module")
def decoded():
    """The native build with float32 weights decoded one by one (ggml.c without `tile_factored`)."""
    path = kernels.build(decoded=True)
    if path is None:
        pytest.skip("no C compiler")
    return kernels._load(path)


@needs_kernel
@pytest.mark.parametrize("name", sorted(kernels.KINDS))
def test_the_portable_and_decoding_builds_agree(generic, decoded, name):
    raw = weights(name, 37, 6 * 256, 1)  # an odd number of outputs: the last one alone
    w = dequantize({"qweight": torch.from_numpy(raw)}, weight_format(name), (37, 6 * 256))
    x = torch.randn(11, 6 * 256, generator=torch.Generator().manual_seed(2))
    want = x.double() @ w.double().T
    for kernel in (KERNEL, generic, decoded):
        got = product(kernel, name, raw, x).double()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


@needs_kernel
@pytest.mark.parametrize("name", sorted(kernels.KINDS))
def test_factored_sums_hold_where_the_terms_cancel(decoded, name):
    """The AVX2 path factors float32 sums per sub-block (q4_k: scale x (codes . x) - min x sum(x)): on inputs whose
    products cancel to a small result (x orthogonal-ish to w, every x positive so sum(x) is large) it stays within
    float32 rounding of the terms it adds, as the decoding build does."""
    raw = weights(name, 16, 4 * 256, 3)
    w = dequantize({"qweight": torch.from_numpy(raw)}, weight_format(name), (16, 4 * 256)).double()
    x = torch.rand(9, 4 * 256, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 1.0
    x = x - (x @ w.T) @ torch.linalg.pinv(w.T)  # (x's component along the W rows removed: y ~ 0)
    x = x.float()
    want = x.double() @ w.T
    scale = float((x.double().abs() @ w.abs().T).max())  # the products' magnitudes, before they cancel
    for kernel in (KERNEL, decoded):
        got = product(kernel, name, raw, x).double()
        assert float((got - want).abs().max()) <= 5e-7 * scale  # (measured: 1-4e-8)


@needs_kernel
@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(sorted(kernels.KINDS)), dtype=st.sampled_from([torch.float32, torch.bfloat16,
                                                                            torch.float16]),
       out=st.integers(1, 7), blocks=st.integers(1, 2), rows=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_rounded_weights_are_the_dequantized_copys(name, dtype, out, blocks, rows, seed):
    """The kernel's 16-bit copy is the Python dequantization's in that dtype bit for bit (each float32 weight rounded
    once, as torch rounds), and its products with rounded weights are x @ W^T for that copy."""
    raw = weights(name, out, blocks * 256, seed)
    shape = (out, blocks * 256)
    w = dequantize({"qweight": torch.from_numpy(raw)}, weight_format(name), shape, dtype)
    assert torch.equal(KERNEL.dequantize(name, torch.from_numpy(raw), shape[1], dtype), w)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(seed))
    xq = x.to(dtype) if dtype == torch.bfloat16 else x  # (in bfloat16 the kernel takes x as bfloat16 too)
    want = xq.double() @ w.double().T
    got = KERNEL.matmul(name, torch.from_numpy(raw), x, dtype=dtype).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()) + 1e-30)


@needs_kernel
def test_bad_arguments_are_refused():
    raw = torch.from_numpy(random_blocks("q4_k", 4, 1, 0))
    with pytest.raises(ValueError, match="float32"):
        KERNEL.matmul("q4_k", raw, torch.randn(2, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="whole blocks"):
        KERNEL.matmul("q4_k", raw, torch.randn(2, 200))


@needs_kernel
@settings(max_examples=15, deadline=None)
@given(out=st.integers(1, 19), inputs=st.integers(1, 40), rows=st.integers(1, 19), threads=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_f16_rows_of_any_width_multiply_as_their_values(generic, out, inputs, rows, threads, dtype, seed):
    """F16 rows (`tile_f16`): any width (a tail of fewer than 8 inputs zero-padded), any tile of x rows and of W rows
    (up to 8 W rows at a time for one x row), each weight rounded to `dtype` first: x @ W^T for the converted copy,
    in both builds; a row's result is the same alone on one thread."""
    raw = weights("f16", out, inputs, seed)
    w = torch.from_numpy(raw).view(torch.float16).to(dtype)  # [out, in]: the converted copy
    assert torch.equal(KERNEL.dequantize("f16", torch.from_numpy(raw), inputs, dtype), w)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(seed)) * 100
    want = (x.to(dtype) if dtype == torch.bfloat16 else x).double() @ w.double().T
    for kernel in (KERNEL, generic):
        got = kernel.matmul("f16", torch.from_numpy(raw), x, threads=threads, dtype=dtype)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()) + 1e-30)
        alone = kernel.matmul("f16", torch.from_numpy(raw), x[-1:], threads=1, dtype=dtype)
        assert torch.equal(alone[0], got[-1])


@needs_kernel
def test_a_large_f16_product_splits_over_threads_and_gives_the_same_bits():
    """Products of 2^22 multiply-adds and more go to several threads (below, one: a thread costs more than it saves):
    each thread's outputs are the ones one thread computes."""
    raw = torch.from_numpy(weights("f16", 4099, 600, 5))  # 4 rows x 4099 x 600: ~9.8M multiply-adds
    x = torch.randn(4, 600, generator=torch.Generator().manual_seed(6))
    assert torch.equal(KERNEL.matmul("f16", raw, x, threads=3), KERNEL.matmul("f16", raw, x, threads=1))


@needs_kernel
@pytest.mark.parametrize("name", sorted(kernels.KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_weight_stays_as_stored_and_multiplies(name, dtype, monkeypatch):
    monkeypatch.setattr(PackedBlocks, "max_rows", 8)  # (the AMX machine's limit: 10 rows go through the GEMM)
    fmt = weight_format(name)
    shape = (70, 512)
    raw = torch.from_numpy(weights(name, *shape, 3))
    assert fmt.stays_packed(shape) and fmt.codes_in_slot
    assert fmt.packed_nbytes(shape, dtype) == fmt.nbytes(shape) == raw.numel()  # the stored bytes, nothing else
    w = fmt.packed_copy({"qweight": raw}, shape, dtype)
    assert isinstance(w, PackedBlocks) and torch.equal(w.blocks, raw) and w.shape == shape and w.dtype == dtype
    dense = dequantize({"qweight": raw}, fmt, shape)  # float32
    assert torch.equal(w.dequantize(), dense.to(dtype))
    x = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(0))
    y = linear(x.to(dtype), w)  # [2, 5, 70]: the kernel, whatever the row count
    assert y.dtype == dtype and y.shape == (2, 5, 70)
    want = (x.double() @ dense.double().T)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    halves = w.chunk(2)
    assert torch.equal(torch.cat([linear(x[0], h) for h in halves], -1), linear(x[0], w))
    one = torch.cat([linear(x.to(dtype)[0, r : r + 1], w) for r in range(5)])  # rows alone: the kernel's path
    assert torch.allclose(one.double(), y[0].double(), rtol=tol, atol=tol * float(want.abs().max()))
    many = linear(x.to(dtype).reshape(10, 512), w)  # 10 rows: above max_rows, the dequantized copy's GEMM
    assert torch.allclose(many.double(), y.reshape(10, 70).double(), rtol=tol, atol=tol * float(want.abs().max()))


@needs_kernel
def test_many_rows_multiply_the_same_weights_in_pieces(monkeypatch):
    """Above BLOCKS_MAX_ROWS rows the weight is dequantized (by the kernel, BLOCKS_DEQUANT weights at a time) for a
    GEMM: the product equals the one-row kernel path's to float32 summation (float32 compute), whole or in pieces."""
    from specoffload.runtime.models import packed

    monkeypatch.setattr(PackedBlocks, "max_rows", 8)  # (11 rows: above it on every machine)
    fmt = weight_format("q6_k")
    raw = torch.from_numpy(random_blocks("q6_k", 100, 2, 5))
    w = fmt.packed_copy({"qweight": raw}, (100, 512), torch.float32)
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(1))
    rows = torch.cat([w.matmul(x[r : r + 1]) for r in range(11)])
    assert x.shape[0] > w.max_rows
    whole = w.matmul(x)
    monkeypatch.setattr(packed, "BLOCKS_DEQUANT", 30 * 512)  # pieces of 30 outputs: the last one of 10
    pieces = w.matmul(x)
    for y in (whole, pieces):
        assert torch.allclose(y, rows, rtol=1e-5, atol=1e-5 * float(rows.abs().max()))


@needs_kernel
@pytest.mark.parametrize("rows", [20, 60])
def test_many_rows_go_through_the_engines_gemm(monkeypatch, rows):
    """Above max_rows the dequantized weight is multiplied by the GEMM `packed_linear` is given (`linear` gives the
    engine's: float32 from 48 rows where the CPU has no native bfloat16 GEMM), not a bare bfloat16 F.linear: the
    same result as `linear` on the dequantized weight, bit for bit."""
    from specoffload.runtime.models.packed import packed_linear

    monkeypatch.setattr(PackedBlocks, "max_rows", 8)
    fmt = weight_format("q4_k")
    raw = torch.from_numpy(random_blocks("q4_k", 96, 2, 7))
    w = fmt.packed_copy({"qweight": raw}, (96, 512), torch.bfloat16)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(linear(x, w), linear(x, w.dequantize()))
    seen = []

    def gemm(a, b):
        seen.append((a.shape, b.shape))
        return torch.zeros(a.shape[0], b.shape[0], dtype=a.dtype)

    assert torch.equal(packed_linear(x, w, dense=gemm), torch.zeros(rows, 96, dtype=torch.bfloat16))
    assert seen == [((rows, 512), (96, 512))]


def test_turned_off_or_without_a_compiler_the_formats_fall_back(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECOFFLOAD_GGML_KERNEL", "off")
    ggml.reload_kernel()
    try:
        assert kernels.ggml_kernel() is None
        fmt = weight_format("q4_k")
        assert not fmt.codes_in_slot and not fmt.as_blocks((64, 256))
        w = fmt.packed_copy({"qweight": torch.from_numpy(random_blocks("q4_k", 64, 1, 0))}, (64, 256),
                            torch.bfloat16)
        assert isinstance(w, PackedInt4)  # repacked for torch's int4 kernel, as before
        assert not weight_format("q6_k").stays_packed((64, 256))  # dequantized into the slot, as before
        monkeypatch.setenv("SPECOFFLOAD_GGML_KERNEL", "on")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        monkeypatch.setenv("SPECOFFLOAD_KERNEL_CACHE", str(tmp_path / "cache"))
        ggml.reload_kernel()
        assert kernels.ggml_kernel() is None and ggml.block_kernel() is None
    finally:
        ggml.reload_kernel()
    monkeypatch.undo()
    assert (ggml.block_kernel() is None) == (KERNEL is None)


@needs_kernel
@pytest.mark.parametrize("where", ["library", "formats"])
def test_a_probe_that_disagrees_turns_the_kernel_off(monkeypatch, where):
    """The library's own probe (products against its dequantization, conversion against torch's), or the formats'
    (its decoding against llama.cpp's reference): either failing, no weight is kept as blocks."""
    if where == "library":
        monkeypatch.setattr(kernels, "probe", lambda kernel: False)
    else:
        monkeypatch.setattr(ggml, "dequantize", lambda parts, fmt, shape, dtype: torch.zeros(shape, dtype=dtype))
    ggml.reload_kernel()
    try:
        assert ggml.block_kernel() is None
        assert not weight_format("q6_k").stays_packed((64, 256))
    finally:
        monkeypatch.undo()
        ggml.reload_kernel()
    assert ggml.block_kernel() is not None


@needs_kernel
@settings(max_examples=10, deadline=None)
@given(n=st.integers(0, 100), to_bf16=st.booleans(), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_sixteen_bit_conversion_is_torchs(generic, n, to_bf16, threads, seed):
    """float16 <-> bfloat16 of any bit pattern (subnormals, infinities, NaNs; lengths not a multiple of the vector):
    torch's rounding, a NaN a NaN; in both builds."""
    bits = torch.randint(-(1 << 15), 1 << 15, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int16)
    src_dtype, dest_dtype = (torch.float16, torch.bfloat16) if to_bf16 else (torch.bfloat16, torch.float16)
    src = bits.view(src_dtype)
    want = src.to(dest_dtype)
    for kernel in (KERNEL, generic):
        got = kernel.convert(torch.empty(n, dtype=dest_dtype), src, threads=threads)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~want.isnan()], want[~want.isnan()])


@needs_kernel
def test_calls_from_two_threads_at_once_each_get_their_product():
    """ggml.c keeps its worker threads between calls and lends them to one call at a time (`pooled`); a call made
    meanwhile (the loader's conversion beside the compute thread's products) starts threads of its own: every
    call's product is the one it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(9)
    cases = [(name, torch.from_numpy(weights(name, 33, 512, i)), torch.randn(1 + i % 5, 512, generator=g))
             for i, name in enumerate(["q4_k", "q6_k", "f16"] * 4)]
    alone = [KERNEL.matmul(name, raw, x, threads=2) for name, raw, x in cases]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            got = list(pool.map(lambda case: KERNEL.matmul(case[0], case[1], case[2], threads=2), cases))
            assert all(torch.equal(a, b) for a, b in zip(alone, got))


@needs_kernel
def test_a_forked_child_multiplies_with_workers_of_its_own():
    """A child forked after the parent's calls started workers has none of them: it starts its own and computes the
    same product (a pool that waited on the parent's threads would hang it: the waits have timeouts)."""
    import multiprocessing as mp

    raw = torch.from_numpy(weights("q4_k", 64, 512, 3))
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(3))
    want = KERNEL.matmul("q4_k", raw, x, threads=2)  # (the parent's workers exist from here)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_product, args=(raw, x, queue))
    child.start()
    try:
        got = queue.get(timeout=60)  # (before the join: a child exits once its queue is drained)
        child.join(60)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0, "the child did not finish its product"
    assert torch.equal(torch.tensor(got), want)


def _child_product(raw: torch.Tensor, x: torch.Tensor, queue) -> None:  # noqa: ANN001
    queue.put(KERNEL.matmul("q4_k", raw, x, threads=2).tolist())  # (plain values: the parent reads them after exit)
