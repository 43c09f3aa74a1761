"""Online re-planning of k from the acceptance rate observed so far (the planner's choice was made on a prior).

Every `interval` verify rounds with drafts, the tracker's estimate of alpha (recent rounds weigh more) re-runs
`planner.replan_k` at the engine's fixed batch and placement; a new k takes effect at each batch's next draft
round. Only when the planner chose k ("auto") and a drafter is loaded: k moves within 1..plan.k_max.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from specoffload.planner import AcceptanceTracker, HardwareProfile, ModelCosts, replan_k
from specoffload.planner.placement import Placement
from specoffload.planner.plan import Plan

logger = logging.getLogger("specoffload.offload")


class KReplanner:
    """Holds the current k; `record` each verified batch's acceptance; see the module docstring."""

    def __init__(self, plan: Plan, interval: int, profile: HardwareProfile | None = None,
                 costs: ModelCosts | None = None, placement: Placement | None = None,
                 expert_loading: str = "auto") -> None:
        self.plan, self.interval, self.expert_loading = plan, interval, expert_loading
        self.profile, self.costs, self.placement = profile, costs, placement
        self.k = plan.k
        self.tracker = AcceptanceTracker(half_life=64)
        self.replans: list[dict[str, float]] = []
        self.rounds = 0

    @property
    def active(self) -> bool:
        return (self.plan.policy is not None and self.plan.k_max > 0 and self.interval > 0
                and None not in (self.profile, self.costs, self.placement))

    def record(self, accepted: Sequence[int], k: int) -> None:
        """One verified batch: row r accepted accepted[r] of k drafts (k >= 1)."""
        self.tracker.record_many(accepted, [k] * len(accepted))
        self.rounds += 1
        if not self.active or self.rounds % self.interval:
            return
        estimate = self.tracker.estimate()
        if estimate is None:
            return
        new_k = replan_k(self.profile, self.costs, self.placement, self.plan.batch, estimate.alpha,
                         self.plan.max_seq_len, ks=range(1, self.plan.k_max + 1), expert_loading=self.expert_loading)
        if new_k != self.k:
            self.replans.append({"round": self.rounds, "alpha": estimate.alpha, "k_from": self.k, "k_to": new_k})
            logger.info("re-plan after %d rounds: alpha %.3f -> k %d (was %d)", self.rounds, estimate.alpha, new_k,
                        self.k)
            self.k = new_k
