"""runtime/cast.py: `copy_cast` gives `copy_`'s bits for every float pair, in blocks or not (NaN payloads aside)."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specoffload.runtime import cast
from specoffload.runtime.cast import copy_cast, slow_direct

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 3000), src=st.sampled_from(FLOATS), dest=st.sampled_from(FLOATS),
       block=st.integers(1, 1024), seed=st.integers(0, 2**31 - 1), special=st.booleans())
def test_copy_cast_equals_copy(n: int, src: torch.dtype, dest: torch.dtype, block: int, seed: int,
                               special: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * torch.logspace(-8, 4, n)).to(src)  # [n]: tiny to large magnitudes
    if special:  # non-finite values and float16 subnormals cross the float32 scratch unchanged
        x[:: max(1, n // 4)] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3e-6]).to(src)[
            torch.arange(len(x[:: max(1, n // 4)])) % 4]
    want = torch.empty(n, dtype=dest).copy_(x)
    got = torch.full((n,), 7.0, dtype=dest)
    with mock.patch.object(cast, "BLOCK_ELEMENTS", block):
        out = copy_cast(got, x)
    assert out is got
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)  # a NaN stays a NaN (its payload bits may differ)
    assert torch.equal(got.view(_int(dest))[~nan], want.view(_int(dest))[~nan])  # every other value bit for bit


def test_a_shaped_destination_and_a_strided_source_are_copied_too() -> None:
    x = torch.randn(40, 30).half()
    dest = torch.empty(40, 30, dtype=torch.bfloat16)
    with mock.patch.object(cast, "BLOCK_ELEMENTS", 7):
        copy_cast(dest, x)
        assert torch.equal(dest, x.to(torch.bfloat16))
        copy_cast(dest, x.T.contiguous().T)  # strided: the plain copy_
    assert torch.equal(dest, x.to(torch.bfloat16))


def test_only_the_16_bit_pairs_take_the_blocked_path() -> None:
    assert slow_direct(torch.float16, torch.bfloat16) and slow_direct(torch.bfloat16, torch.float16)
    assert not any(slow_direct(a, b) for a in FLOATS for b in FLOATS if torch.float32 in (a, b) or a == b)


def _int(dtype: torch.dtype) -> torch.dtype:
    return {4: torch.int32, 2: torch.int16}[dtype.itemsize]
