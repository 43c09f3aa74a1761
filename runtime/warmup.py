"""The acceptance warm-up and the plan for a known job: what `specoffload plan` prints and what a job then runs.

    measure_acceptance   a short generation over a sample of the job's prompts at k = MAX_AUTO_K, with the job's
                         sampling: the acceptance estimate with its between-prompt error (planner/acceptance.py)
    plan_job             the warm-up, then the planner's search over the job's workload with the estimate's
                         plausible range (maximin over it, planner/search.py): the Plan, and why

Why the warm-up looks like this (issue 14; measured, docs/perf/README.md "acceptance"): the previous warm-up drafted
for the job's *first four* prompts, 16 tokens each, at k = 4, greedy, and treated its 49 tried positions as 49
independent draws. On 16 full HumanEval prompts that gave alpha 0.93 with a binomial interval of +- 0.07, while
the prompts' own acceptance spreads widely (per prompt 0.6 to 0.98): four prompts are four observations, and the
first four of HumanEval happen to be easy ones. So: the prompts are spread over the whole job (every n/w-th),
the error is the between-prompt one (Student's t on w - 1 degrees of freedom), the sampling is the job's (a
sampled job accepts by min(1, p/q), not by argmax equality), and k is the largest the planner may choose, so that
the rounds it observes are the ones a long k would run rather than an extrapolation from k = 4.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specoffload.planner import AcceptanceEstimate, HardwareProfile, Workload
from specoffload.planner.acceptance import AcceptanceCurve
from specoffload.planner.plan import MAX_AUTO_K, Plan

from .config import EngineConfig
from .engine import Engine
from .planning import ModelPair, make_plan
from .sampling import SamplingParams

#: prompts the warm-up drafts for (two batches of half as many rows: rows cost little next to a streamed pass)
WARMUP_PROMPTS = 8
#: tokens per warm-up prompt, at most (and at most the job's)
WARMUP_TOKENS = 32
#: two-sided confidence of the acceptance range the plan must hold over
CONFIDENCE = 0.8


@dataclass(frozen=True)
class Warmup:
    """What the warm-up measured: the estimate (per-prompt error), on how many prompts and tokens, at which k."""

    estimate: AcceptanceEstimate
    curve: AcceptanceCurve  # acceptance per position of a round (planner/acceptance.py)
    prompts: int
    new_tokens: int
    k: int
    seconds: float

    @property
    def alpha_range(self) -> tuple[float, float]:
        return self.estimate.plausible(CONFIDENCE)

    def describe(self) -> str:
        lo, hi = self.alpha_range
        return (f"{self.estimate.alpha:.3f} ({CONFIDENCE:.0%} range {lo:.2f}-{hi:.2f}; warm-up on {self.prompts} of "
                f"the job's prompts, {self.new_tokens} tokens each at k = {self.k}, "
                f"{self.estimate.trials:.0f} draft positions, {self.seconds:.0f} s)")


def spread(items: Sequence, n: int) -> list:
    """n items spread evenly over the sequence (every len/n-th, starting at the first), all of them if n >= len."""
    if n >= len(items):
        return list(items)
    return [items[math.floor(i * len(items) / n)] for i in range(n)]


def measure_acceptance(config: EngineConfig, prompts: Sequence[Sequence[int]], params: SamplingParams,
                       prompts_used: int = WARMUP_PROMPTS, max_tokens: int = WARMUP_TOKENS) -> Warmup:
    """Generate for `prompts_used` of the job's prompts (spread over it) at k = MAX_AUTO_K with the job's
    sampling, at most `max_tokens` each, under the config's budget (module docstring)."""
    chosen = spread(list(prompts), prompts_used)
    new_tokens = max(2, min(max_tokens, params.max_new_tokens))
    seq = max(len(p) for p in chosen) + new_tokens
    rows = max(1, math.ceil(len(chosen) / 2))
    start = time.perf_counter()
    warm = Engine(replace(config, max_batch_size=rows, num_draft_tokens=MAX_AUTO_K, max_seq_len=seq))
    try:
        warm.generate([list(p) for p in chosen], replace(params, max_new_tokens=new_tokens))
    finally:
        warm.close()
    estimate, curve = warm.replanner.tracker.estimate(), warm.replanner.tracker.curve()
    if estimate is None or curve is None:
        raise ValueError("the warm-up drafted nothing (every prompt finished at once)")
    return Warmup(estimate, curve, len(chosen), new_tokens, MAX_AUTO_K, time.perf_counter() - start)


@dataclass(frozen=True)
class JobPlan:
    """The plan for a known job, with the warm-up and the workload it was searched for."""

    plan: Plan
    workload: Workload
    warmup: Warmup | None  # None without a drafter (or with a fixed plan)


def plan_job(config: EngineConfig, models: ModelPair, prompts: Sequence[Sequence[int]], params: SamplingParams,
             max_seq_len: int, profile: HardwareProfile | None = None) -> JobPlan:
    """Warm-up (when a drafter may be used and the plan is the planner's), then the search over the job's workload
    with the warm-up's plausible acceptance range: the plan `Engine(config, plan=...)` runs."""
    workload = Workload(num_prompts=len(prompts), prompt_len=sum(map(len, prompts)) / len(prompts),
                        new_tokens=params.max_new_tokens)
    warmup = None
    if config.planned and models.draft is not None and config.num_draft_tokens != 0:
        warmup = measure_acceptance(config, prompts, params)
    plan = make_plan(config, models, max_seq_len, workload=workload, profile=profile,
                     alpha=warmup.curve if warmup else None,
                     alpha_range=warmup.alpha_range if warmup else None)
    return JobPlan(plan, workload, warmup)
