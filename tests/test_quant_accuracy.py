"""scripts/quant_accuracy.py on tiny models: identity scores perfectly, compression scores below it, consistently."""

from __future__ import annotations

import pytest

from scripts.quant_accuracy import compare
from specoffload.runtime.formats import weight_format
from specoffload.runtime.quantize import quantize_checkpoint

ROWS = [[1, 5 + i, 9, 33 + 2 * i, 70 + i, 11, 200 + i, 7, 99, 150 + 3 * i] for i in range(4)]
PROMPTS = [[1, 5, 9], [1, 40, 41, 42]]


def test_identity_is_perfect_and_int4_is_measurably_worse_than_int8(tiny_models, tmp_path, single_thread):
    ref = tiny_models["llama"]
    same = compare(ref, ref, ROWS, PROMPTS, greedy_tokens=8)
    assert same["top1_agreement"] == 1.0 and same["greedy_identical"] == 2
    assert same["mean_kl"] == pytest.approx(0.0, abs=1e-6)
    reports = {}
    for scheme, spec in (("int8", weight_format("int8")), ("int4", weight_format("int4", 32))):
        quantize_checkpoint(ref, tmp_path / scheme, spec)
        reports[scheme] = compare(ref, tmp_path / scheme, ROWS, PROMPTS, greedy_tokens=8)
    for r in reports.values():
        assert r["positions"] == 40 and 0.0 <= r["top1_agreement"] <= 1.0 and r["mean_kl"] >= 0.0
        first = [m for m in r["greedy_first_mismatch"] if m is not None]
        assert r["greedy_identical"] == 2 - len(first) and all(0 <= m < 8 for m in first)
    assert 0.0 < reports["int8"]["mean_kl"] < reports["int4"]["mean_kl"]
