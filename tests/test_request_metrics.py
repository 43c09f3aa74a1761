"""The job summary's per-request metrics (runtime/offline/request_metrics.py)."""

from __future__ import annotations

import statistics

from hypothesis import given
from hypothesis import strategies as st

from specoffload.runtime.offline.request_metrics import RequestMetricsLog, describe
from specoffload.runtime.offline.rows import RowResult


@given(st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1, max_size=200))
def test_describe_is_ordered_and_within_the_data(values: list[float]) -> None:
    d = describe(values)
    assert d["count"] == len(values) and d["max"] == max(values)
    assert min(values) <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert abs(d["mean"] - statistics.fmean(values)) <= 1e-9 * max(1.0, max(values))
    assert d["p50"] == statistics.median(values) or abs(d["p50"] - statistics.median(values)) <= 1e-9 * d["max"]


def test_a_row_of_samples_counts_once() -> None:
    """n samples of one prompt: the first sample's time to first token, the slowest one's time, all tokens; rows
    that drafted nothing have no acceptance; results without timings (an older worker) count tokens only."""
    log = RequestMetricsLog()
    log.add([RowResult((1, 2, 3), None, "length", 4, 2, time_to_first_token_s=0.5, time_s=2.0),
             RowResult((4,), None, "stop", 4, 1, time_to_first_token_s=0.1, time_s=3.0)])
    log.add([RowResult((5, 6), None, "stop")])
    s = log.summary()
    assert s["time_to_first_token_s"]["count"] == 1 and s["time_to_first_token_s"]["max"] == 0.5
    assert s["time_s"] == {"count": 1, "mean": 3.0, "p50": 3.0, "p90": 3.0, "p99": 3.0, "max": 3.0}
    assert s["new_tokens"]["count"] == 2 and s["new_tokens"]["mean"] == 3.0
    assert s["acceptance"] == {"count": 1, "mean": 3 / 8, "p50": 3 / 8, "p90": 3 / 8, "p99": 3 / 8, "max": 3 / 8}
    assert RequestMetricsLog().summary() == {}
