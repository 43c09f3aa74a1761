"""Routing statistics shared by the builders and the measurement."""

from __future__ import annotations

import math

import torch


def hot_share(counts: torch.Tensor) -> float:
    """Share of routed (token, slot) pairs that go to the hottest 25% of experts (ceil(E / 4) of them).

    counts [E]: routings per expert. 0.25 is perfectly balanced; 1.0 means the cold 75% are never used.
    """
    total = float(counts.sum())
    if total == 0:
        return 0.0
    hottest = counts.float().sort(descending=True).values[: math.ceil(counts.numel() / 4)]
    return float(hottest.sum()) / total
