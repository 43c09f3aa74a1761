"""scripts/bench_compressed.py's bound: what a format can gain over the baseline when its pass overlaps load and
compute perfectly."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scripts.bench_compressed import overlap_bound

seconds = st.floats(min_value=0.01, max_value=10.0)


def _result(walls: list[float], passes: int, load: float, compute: float) -> dict:
    return {"runs": [{"wall_s": w, "passes": passes} for w in walls], "load_s_per_pass": load,
            "compute_s_per_pass": compute}


def test_the_bound_is_the_baselines_period_over_the_variants_slower_side():
    baseline = _result([20.0, 18.0, 22.0], 10, 1.6, 0.7)  # median period 2.0 s
    assert overlap_bound(_result([9.0], 10, 0.5, 0.8), baseline) == 2.5  # compute-bound: 2.0 / 0.8
    assert overlap_bound(_result([9.0], 10, 1.0, 0.4), baseline) == 2.0  # load-bound: 2.0 / 1.0
    assert overlap_bound(_result([9.0], 10, 0.0, 0.0), baseline) is None  # no trace: no bound


@given(seconds, seconds, seconds, seconds)
def test_a_variant_no_faster_on_either_side_is_bounded_by_the_baseline_itself(period, load, compute, slack):
    """A variant whose load and compute are each at least the baseline's pass period cannot gain: bound <= 1."""
    baseline = _result([period * 4], 4, load, compute)
    slower = _result([1.0], 4, period + slack, period)
    assert overlap_bound(slower, baseline) <= 1.0
