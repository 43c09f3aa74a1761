"""Which drafter a job runs (`--drafter auto`): each candidate's acceptance measured on the job's own prompts, each
planned by the same search (planner/search.py), the best predicted throughput chosen.

    candidate_drafters  every registered drafter the config and target can run (none; model with a draft
                        checkpoint; ngram and suffix; self on an offloaded MoE target; ...)
    choose_drafter      measure, plan and compare them: a `DrafterChoice` (its `table` is what `specoffload plan`
                        prints)

Measuring. A drafter with a model (model, self) runs the warm-up of runtime/warmup.py (a short generation over
WARMUP_PROMPTS of the job's prompts at k = MAX_AUTO_K): its per-position acceptance curve and plausible range. The
model-free drafters need no model call: the target's warm-up outputs (the first model warm-up's, which are the
target's own, speculation being lossless; else a short no-draft generation of the same prompts) are replayed
through their matching code (runtime/drafter_replay.py): match rate, per-position acceptance, ragged feed and
proposal microseconds (planner/acceptance.py `RaggedAcceptance`). The warm-up's mean output length, its loader's
stream rate and what its passes say of the profile's compute costs (offload/replan.py `check_profile`) price every
candidate alike.

Planning. Every candidate is searched over the same batches and k (k = 0 included: a drafter that does not pay is
planned as no draft) with its own placement (a draft model's weights and KV take memory, a model-free drafter's
none) and its own draft cost (a draft model's measured step, profiler.py `drafter_steps`; a model-free drafter's
proposal microseconds). The choice is the best predicted tokens/s (ties: the earlier candidate, none first); a
winner planned at k = 0 is "none".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specoffload.planner import HardwareProfile, Workload
from specoffload.planner.acceptance import Acceptance, RaggedAcceptance, pooled_alpha, tokens_per_round
from specoffload.planner.errors import SpecOffloadError
from specoffload.planner.plan import MAX_AUTO_K, Plan

from .config import ConfigError, EngineConfig
from .drafter_replay import replay_acceptance
from .models.model import Transformer
from .offload.drafters import DRAFTERS
from .offload.profiler import drafter_steps
from .planning import ModelPair, make_plan
from .sampling import SamplingParams
from .warmup import Warmup, measure_acceptance, warmup_outputs


@dataclass(frozen=True)
class Candidate:
    """One drafter's plan for the job, with what was measured for it (None for "none")."""

    drafter: str
    plan: Plan
    acceptance: Acceptance | None
    warmup: Warmup | None = None  # the model warm-up behind `acceptance` (model, self)

    @property
    def predicted(self) -> float:
        return self.plan.policy.predicted_tokens_per_s if self.plan.policy is not None else 0.0

    def measured(self) -> str:
        """Acceptance (a draft model) or match rate and acceptance per proposed position (model-free)."""
        a = self.acceptance
        if a is None:
            return "-"
        if isinstance(a, RaggedAcceptance):
            return f"match {a.match_rate:.0%}, accept {a.alpha:.2f}, {a.proposal_s * 1e6:.0f} us/row"
        lo, hi = self.warmup.alpha_range if self.warmup is not None else (pooled_alpha(a), pooled_alpha(a))
        return f"alpha {pooled_alpha(a):.2f} ({lo:.2f}-{hi:.2f})"

    def per_pass(self) -> tuple[float, float]:
        """(tokens committed, row-tokens verified) per row per pass at the plan's k."""
        k = self.plan.k
        if self.acceptance is None or k == 0:
            return 1.0, 1.0
        fed = self.acceptance.fed(k) if isinstance(self.acceptance, RaggedAcceptance) else k + 1
        return tokens_per_round(self.acceptance, k), float(fed)


@dataclass(frozen=True)
class DrafterChoice:
    best: Candidate
    candidates: tuple[Candidate, ...]  # in registry order
    workload: Workload
    skipped: tuple[tuple[str, str], ...]  # (drafter, why) of candidates that could not run here
    seconds: float  # measuring them

    def config(self, config: EngineConfig) -> EngineConfig:
        """`config` running the chosen drafter at the chosen plan's batch and k (fixed: the measured acceptance
        chose them; the engine's own plan would start from the prior)."""
        best = self.best
        return replace(candidate_config(config, best.drafter), max_batch_size=best.plan.batch,
                       num_draft_tokens=best.plan.k, interleave=best.plan.interleave if best.plan.k else None)

    def table(self) -> str:
        """The comparison, one row per candidate (markdown)."""
        lines = ["| drafter | k | batch | measured acceptance / match rate | tokens / verified per row-pass "
                 "| predicted tok/s | x none |", "|---|---:|---:|---|---:|---:|---:|"]
        none = next((c.predicted for c in self.candidates if c.drafter == "none"), 0.0)
        for c in self.candidates:
            tokens, fed = c.per_pass()
            mark = " (chosen)" if c is self.best else ""
            ratio = f"{c.predicted / none:.3f}" if none > 0 else ""
            lines.append(f"| {c.drafter}{mark} | {c.plan.k} | {c.plan.batch} | {c.measured()} | {tokens:.2f} / "
                         f"{fed:.2f} | {c.predicted:.4g} | {ratio} |")
        lines += [f"| {name} | | | skipped: {why.replace('|', '/')} | | | |" for name, why in self.skipped]
        return "\n".join(lines)


def candidate_drafters(config: EngineConfig, target: Transformer) -> list[str]:
    """The registered drafters that can run this config and target (their traits say: a checkpoint, an MoE
    target, a budget), in registry order ("none" first)."""
    checkpoint = config.draft not in (None, "self")
    return [name for name, cls in DRAFTERS.items()
            if (checkpoint or not cls.needs_checkpoint) and (target.config.num_experts or not cls.needs_moe_target)
            and (config.offloaded or not cls.offloaded_only)]


def candidate_config(config: EngineConfig, name: str) -> EngineConfig:
    """`config` drafting with `name` (its interleave default re-chosen unless the planner chooses it)."""
    draft = config.draft if DRAFTERS[name].needs_checkpoint and config.draft != "self" else None
    return replace(config, drafter=name, draft=draft, interleave="auto" if config.interleave == "auto" else None)


def choose_drafter(config: EngineConfig, target: Transformer, prompts: Sequence[Sequence[int]],
                   params: SamplingParams, max_seq_len: int, profile: HardwareProfile, *, quick: bool = False,
                   names: Sequence[str] | None = None) -> DrafterChoice:
    """Measure, plan and compare the candidate drafters on the job's prompts (module docstring). `profile`: the
    hardware profile measured for `config` (a draft model's step is measured on top of it for its candidate);
    `target`: the target's executor (headers only). ConfigError when the config fixes both batch and k (nothing
    to predict with) or no prompt is given."""
    if not config.planned:
        raise ConfigError("--drafter auto compares the planner's predictions: leave --batch-size or -k to 'auto'")
    if not prompts:
        raise ConfigError("--drafter auto measures the drafters on the job's prompts: give --prompts")
    start = time.perf_counter()
    names = list(names) if names is not None else candidate_drafters(config, target)
    configs: dict[str, EngineConfig] = {}
    skipped: list[tuple[str, str]] = []
    for name in names:
        try:
            configs[name] = candidate_config(config, name)
        except ConfigError as exc:
            skipped.append((name, str(exc)))
    profiles: dict[str, HardwareProfile] = {}
    warmups: dict[str, Warmup] = {}
    for name, cfg in configs.items():
        cls = cfg.drafter_class
        profiles[name] = replace(profile, draft_step_s=drafter_steps(cfg, quick))  # (cached beside the profile)
        if cls.proposes and not cls.model_free:
            try:
                warmups[name] = measure_acceptance(cfg, prompts, params, profile=profiles[name])
            except SpecOffloadError as exc:  # e.g. its warm-up does not fit the budget: the others still compete
                skipped.append((name, str(exc)))
    workload = Workload.of_prompts([len(p) for p in prompts], params.max_new_tokens)
    first = next(iter(warmups.values()), None)
    if first is not None:
        rows, mean_new, rate, scale = first.outputs, first.mean_new_tokens, first.stream_rate, first.compute_scale
    else:
        outputs, rate = warmup_outputs(config, prompts, params, profile), None
        rows, mean_new, scale = outputs.rows, outputs.mean_new_tokens, outputs.compute_scale
    if mean_new is not None:
        workload = replace(workload, mean_new_tokens=min(workload.new_tokens, mean_new))
    k_replay = max(MAX_AUTO_K, config.num_draft_tokens if isinstance(config.num_draft_tokens, int) else 0)
    candidates = []
    for name, cfg in configs.items():
        cls = cfg.drafter_class
        if cls.proposes and not cls.model_free and name not in warmups:
            continue
        prof = profiles[name] if scale == 1.0 else profiles[name].scaled_compute(scale)  # (the warm-up's check)
        prof = replace(prof, stream_bytes_per_s=rate) if rate else prof
        acceptance: Acceptance | None = None
        alpha_range = None
        if cls.model_free:
            acceptance = replay_acceptance(cfg, name, rows, k_replay)
        elif name in warmups:
            acceptance, alpha_range = warmups[name].curve, warmups[name].alpha_range
        models = ModelPair.for_config(cfg, target, shares_kv=True)
        try:
            plan = make_plan(cfg, models, max_seq_len, workload=workload, alpha=acceptance, profile=prof,
                             alpha_range=alpha_range, compare_no_draft=False)  # ("none" is a candidate)
        except SpecOffloadError as exc:  # nothing of its search fits (a draft model's memory, typically)
            if name == "none":
                raise
            skipped.append((name, str(exc)))
            continue
        candidates.append(Candidate(name, plan, acceptance, warmups.get(name)))
    if not candidates:
        raise ConfigError("no drafter could be planned: " + "; ".join(f"{n}: {why}" for n, why in skipped))
    order = list(DRAFTERS)  # ties: the registry's order ("none" first, then the drafter modules by name)
    ranked = sorted(candidates, key=lambda c: (-round(c.predicted, 9), order.index(c.drafter)))
    best = ranked[0]
    if best.plan.k == 0:  # a drafter planned not to draft is no drafter
        best = next((c for c in candidates if c.drafter == "none"), best)
    return DrafterChoice(best, tuple(candidates), workload, tuple(skipped), time.perf_counter() - start)
