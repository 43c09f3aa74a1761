"""Routed-expert loading: how many distinct experts a pass touches, and when loading only those pays.

A streamed MoE layer either loads all its experts into the ring slot ahead of use, or (selected loading) only the
experts the router picked for the pass's tokens, read right after routing. Selected loading needs the routers
and attention resident (they run before the experts are known) and the disk tier (the ffn op reads the experts
itself); it pays when a pass touches clearly fewer than all experts. One rule, used by the engine to decide and
by the cost model to predict the bytes a pass reads.
"""

from __future__ import annotations

from .placement import Placement


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """E[# distinct experts] hit by `tokens` independent top-k routings, uniform over `num_experts`:
    E * (1 - (1 - k/E)^tokens) (each expert is missed by one token with probability 1 - k/E)."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def selects_experts(placement: Placement, mode: str, num_experts: int, top_k: int, tokens: int) -> bool:
    """Load only the routed experts of a streamed MoE layer? mode "selected" / "all" decide; "auto" selects when
    fewer than 3/4 of the experts are expected to be hit by the pass's `tokens`."""
    if not num_experts or mode == "all" or placement.policy.weights_tier != "disk" or placement.policy.expert_group:
        return False  # (expert groups load whole units: they replace selected loading)
    if any(placement.is_streamed(key) for key in placement.tiers if key.kind in ("attention", "router")):
        return False
    return mode == "selected" or expected_distinct_experts(num_experts, top_k, tokens) < 0.75 * num_experts
