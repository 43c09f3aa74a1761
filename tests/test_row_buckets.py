"""runtime/models/row_buckets.py: CPU 16-bit GEMMs above BUCKET_FROM rows run over a few row counts (a bucket of
at most 1/8 more rows from 256 up), computing the same x W^T on the real rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.runtime.models import linear as lin
from specoffload.runtime.models import row_buckets as rb


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(0, 1 << 20))
def test_a_bucket_holds_its_rows_with_bounded_padding(rows) -> None:
    b = rb.bucket(rows)
    assert b >= rows and rb.bucket(b) == b  # a bucket is its own bucket
    if rows <= rb.BUCKET_FROM:
        assert b == rows
    else:
        assert b - rows < rb.BUCKET_FROM or (b - rows) * 8 < rows  # below 32 rows, or below 1/8 of the rows
        assert b % rb.BUCKET_FROM == 0
    assert rb.bucket(rows + 1) >= b  # monotone


def test_buckets_are_few_per_octave() -> None:
    """Every row count from 33 to 2^16 lands in one of at most 8 buckets an octave (plus the first, 33..64)."""
    buckets = {rb.bucket(n) for n in range(rb.BUCKET_FROM + 1, 1 << 16)}
    octaves = 16 - rb.BUCKET_FROM.bit_length() + 1
    assert len(buckets) <= 8 * octaves
    assert len({rb.bucket(n) for n in range(257, 513)}) == 8


def test_bucketed_linear_is_x_w_transposed_on_the_real_rows() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).bfloat16()  # [out, in]
    for rows in (1, 32, 33, 100, 300):
        x = torch.randn(rows, 64, generator=g).bfloat16()  # [N, in]
        out = rb.bucketed_linear(x, w)  # [N, out]
        assert out.shape == (rows, 48)
        padded = F.pad(x, (0, 0, 0, rb.bucket(rows) - rows))
        assert torch.equal(out, F.linear(padded, w)[:rows])  # the GEMM over the bucket, its real rows
        assert torch.allclose(out.double(), x.double() @ w.double().T, rtol=3e-2, atol=0.25)


def test_a_prefill_of_ragged_row_counts_meets_few_gemm_shapes(monkeypatch) -> None:
    """`linear` on bfloat16 weights over 300 different row counts (an MoE prefill's experts) calls the GEMM at a
    handful of row counts; float32 weights are not padded (MKL builds no kernel per shape)."""
    if not lin.native_16bit(torch.bfloat16):
        monkeypatch.setattr(lin, "native_16bit", lambda _dtype: True)
    seen: list[int] = []
    real = F.linear

    def spy(x: torch.Tensor, w: torch.Tensor, *a) -> torch.Tensor:  # noqa: ANN002
        seen.append(x.shape[0])
        return real(x, w, *a)

    monkeypatch.setattr(rb.F, "linear", spy)
    w = torch.randn(16, 32).bfloat16()
    for rows in range(40, 340):
        assert lin.linear(torch.randn(rows, 32).bfloat16(), w).shape == (rows, 16)
    assert len(set(seen)) <= 12 and len(seen) == 300
    seen.clear()
    lin.linear(torch.randn(77, 32), torch.randn(16, 32))
    assert seen == []
