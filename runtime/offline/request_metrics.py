"""Per-request metrics of a job for its summary JSON: time to first token, time, new tokens and acceptance of each
written row, kept as float arrays (8 bytes a value) and reported as count, mean and percentiles."""

from __future__ import annotations

import statistics
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .rows import RowResult

#: the percentiles a summary reports
PERCENTILES = (50, 90, 99)


def _values() -> array:
    return array("d")


@dataclass
class RequestMetricsLog:
    """One entry per written prompt row (its samples together: the first sample's time to first token, the
    slowest sample's time, the tokens and draft counts of all)."""

    time_to_first_token_s: array = field(default_factory=_values)
    time_s: array = field(default_factory=_values)
    new_tokens: array = field(default_factory=_values)
    acceptance: array = field(default_factory=_values)  # rows that drafted only

    def add(self, samples: Sequence[RowResult]) -> None:
        if samples[0].time_to_first_token_s is not None:
            self.time_to_first_token_s.append(samples[0].time_to_first_token_s)
        times = [s.time_s for s in samples if s.time_s is not None]
        if times:
            self.time_s.append(max(times))
        self.new_tokens.append(sum(len(s.token_ids) for s in samples))
        drafted = sum(s.num_drafted for s in samples)
        if drafted:
            self.acceptance.append(sum(s.num_accepted for s in samples) / drafted)

    def summary(self) -> dict[str, Any]:
        """{metric: {count, mean, p50, p90, p99, max}} for each metric with values (rows of this run only)."""
        return {name: describe(values) for name, values in (
            ("time_to_first_token_s", self.time_to_first_token_s), ("time_s", self.time_s),
            ("new_tokens", self.new_tokens), ("acceptance", self.acceptance)) if values}


def describe(values: Sequence[float]) -> dict[str, float]:
    """count, mean, the PERCENTILES (inclusive method: within the observed range) and max of `values` (non-empty)."""
    data = list(values)
    if len(data) == 1:
        cuts = {p: data[0] for p in PERCENTILES}
    else:
        q = statistics.quantiles(data, n=100, method="inclusive")  # 99 cut points: q[p - 1] is the p-th percentile
        cuts, floor, high = {}, min(data), max(data)
        for p in PERCENTILES:  # (interpolation rounds: keep them ordered and within the data)
            cuts[p] = floor = min(high, max(floor, q[p - 1]))
    return {"count": len(data), "mean": statistics.fmean(data), **{f"p{p}": cuts[p] for p in PERCENTILES},
            "max": max(data)}
