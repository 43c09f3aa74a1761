"""Online re-planning from the acceptance observed so far (the planner's choice was made on an estimate).

Every `interval` verify rounds with drafts, the tracker's acceptance per position of a round (recent rounds weigh
more; planner/acceptance.py `AcceptanceCurve`) and the plausible range of its pooled rate (the between-prompt error,
rows being keyed by their request) are judged as the planner judges them (`planner.replan`: the maximin of the
ratio to the best candidate over the range). The decision is

    k       draft tokens per round, 1..plan.k_max, or 0: speculation off (the drafter stays loaded and idle);
    rows    the rows a batch admits at its next wave (`Batches.admit`): plan.batch while speculating; with
            speculation off, the rows of both batches in one (num_batches x plan.batch: the KV memory they were
            placed with), which a batch takes once the other has drained, as a no-draft plan runs. Turning
            speculation back on splits the rows again at the next wave.

A new k takes effect at each batch's next draft round. Only when the planner chose k ("auto") and a drafter is
loaded. While speculation is off nothing is drafted, so nothing new is observed: the decision stands for the rest
of the run (k_max = 0 plans have no drafter to turn on).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

from specoffload.planner import AcceptanceTracker, HardwareProfile, ModelCosts, replan
from specoffload.planner.placement import Placement
from specoffload.planner.plan import Plan

logger = logging.getLogger("specoffload.offload")

#: two-sided confidence of the alpha range the online decision must hold over
CONFIDENCE = 0.8


class KReplanner:
    """Holds the current k and rows per batch; `record` each verified batch's acceptance; see the module docstring."""

    def __init__(self, plan: Plan, interval: int, profile: HardwareProfile | None = None,
                 costs: ModelCosts | None = None, placement: Placement | None = None,
                 expert_loading: str = "auto") -> None:
        self.plan, self.interval, self.expert_loading = plan, interval, expert_loading
        self.profile, self.costs, self.placement = profile, costs, placement
        self.k = plan.k
        self.rows = plan.batch
        self.tracker = AcceptanceTracker(half_life=64)
        self.replans: list[dict[str, float]] = []
        self.rounds = 0

    @property
    def active(self) -> bool:
        return (self.plan.policy is not None and self.plan.k_max > 0 and self.interval > 0
                and None not in (self.profile, self.costs, self.placement))

    def record(self, accepted: Sequence[int], k: int, prompts: Sequence[Hashable] | None = None) -> None:
        """One verified batch: row r (of request prompts[r]) accepted accepted[r] of k drafts (k >= 1)."""
        self.tracker.record_many(accepted, [k] * len(accepted), prompts)
        self.rounds += 1
        if not self.active or self.rounds % self.interval:
            return
        estimate, curve = self.tracker.estimate(), self.tracker.curve()
        if estimate is None or curve is None:
            return
        assert self.profile is not None and self.costs is not None and self.placement is not None
        choice = replan(self.profile, self.costs, self.placement, self.plan.batch, curve,
                        self.plan.max_seq_len, self.plan.k_max, self.plan.batch * self.plan.num_batches,
                        alpha_range=estimate.plausible(CONFIDENCE), expert_loading=self.expert_loading)
        if (choice.k, choice.rows) != (self.k, self.rows):
            self.replans.append({"round": self.rounds, "alpha": estimate.alpha, "k_from": self.k, "k_to": choice.k,
                                 "rows_from": self.rows, "rows_to": choice.rows})
            logger.info("re-plan after %d rounds: alpha %.3f -> k %d, %d rows per batch (was k %d, %d rows)",
                        self.rounds, estimate.alpha, choice.k, choice.rows, self.k, self.rows)
            self.k, self.rows = choice.k, choice.rows
