"""runtime/models/linear.py: every CPU GEMM path computes x W^T (+ b); 16-bit inputs upcast only without native
16-bit GEMMs."""

from __future__ import annotations

import pytest
import torch

from specoffload.runtime.models import linear as lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, lin.UPCAST_MIN_ROWS, 80])
@pytest.mark.parametrize("native", [True, False])
def test_linear_is_x_w_transposed_on_every_path(monkeypatch, dtype, rows, native) -> None:
    monkeypatch.setattr(lin, "native_16bit", lambda _dtype: native)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 64, generator=g).to(dtype)  # [2, rows, in]
    w = torch.randn(96, 64, generator=g).to(dtype)  # [out, in]
    b = torch.randn(96, generator=g).to(dtype)
    out = lin.linear(x, w, b)  # [2, rows, out]
    assert out.shape == (2, rows, 96) and out.dtype == dtype
    expected = x.double() @ w.double().T + b.double()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.double(), expected, rtol=tol, atol=tol * 8)


def test_native_16bit_is_onednns_capability_asked_once() -> None:
    """float32 is never "native 16-bit"; bf16 / fp16 follow oneDNN's own capability checks, asked once per dtype."""
    lin.native_16bit.cache_clear()
    assert lin.native_16bit(torch.float32) is False
    assert lin.native_16bit(torch.bfloat16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert lin.native_16bit(torch.float16) == bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    lin.native_16bit(torch.bfloat16)
    assert lin.native_16bit.cache_info().hits == 1 and lin.native_16bit.cache_info().misses == 3


def test_sixteen_bit_rows_upcast_only_without_native_kernels(monkeypatch) -> None:
    """At UPCAST_MIN_ROWS rows a bfloat16 GEMM converts W to float32 (the AVX2 rule) only where oneDNN has no
    native bfloat16 GEMM: the conversion of W is what the native path avoids (the 151936-row head: 10x)."""
    calls: list[torch.dtype] = []
    real = torch.Tensor.float

    def spy(t: torch.Tensor, *a, **k) -> torch.Tensor:  # noqa: ANN002, ANN003
        calls.append(t.dtype)
        return real(t, *a, **k)

    monkeypatch.setattr(torch.Tensor, "float", spy)
    x, w = torch.randn(lin.UPCAST_MIN_ROWS, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    for native, upcasts in ((True, False), (False, True)):
        monkeypatch.setattr(lin, "native_16bit", lambda _dtype, n=native: n)
        calls.clear()
        lin.linear(x, w)
        assert bool(calls) == upcasts
