"""Which drafter a job runs (`--drafter auto`): each candidate's acceptance measured on the job's own prompts, each
planned by the same search (planner/search.py), the best predicted throughput chosen.

    candidate_drafters  every registered drafter the config and target can run (none; model with a draft
                        checkpoint; ngram and suffix; self on an offloaded MoE target; ...)
    choose_drafter      measure, plan and compare them: a `DrafterChoice` (its `table` is what `specoffload plan`
                        prints)

Measuring. One warm-up prices every candidate alike: its mean output length, its loader's stream rate and what
its passes say of the profile's compute costs (offload/replan.py `check_profile`); its outputs (the target's own,
speculation being lossless) are what the model-free drafters are replayed on, with no model call
(runtime/drafter_replay.py: match rate, per-position acceptance, ragged feed and proposal microseconds,
planner/acceptance.py `RaggedAcceptance`). It is the warm-up of the first drafter with a model (model, lowbit,
self) that may win on the profile as it is (runtime/warmup.py `measure_acceptance`: WARMUP_PROMPTS of the job's
prompts at k = MAX_AUTO_K; its per-position acceptance curve and plausible range), else a no-draft one
(`warmup_outputs`). "May win": planned as if it accepted every draft, it predicts at least no draft's tokens/s.
That plan bounds every acceptance the drafter could measure (tokens per round rise with acceptance; the pass it
prices, k + 1 rows fed per row, does not depend on it). Then none and the model-free drafters are planned, and
each other drafter with a model is warmed up only if its bound, now priced as the warm-up measured, reaches the
best candidate so far; below it, it is skipped unmeasured, both figures in its line of the table. A warm-up (an
engine of its own, 8 prompts of up to 32 tokens through the streamed target) is most of what planning costs.

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
from .warmup import Outputs, Warmup, measure_acceptance, warmup_outputs


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
    skipped: tuple[tuple[str, str], ...]  # (drafter, why) of candidates that could not run here, or could not win
    seconds: float  # measuring them
    priced_by: Warmup | Outputs | None = None  # the warm-up whose rate and compute check priced every candidate

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
                   names: Sequence[str] | None = None, measure_all: bool = False) -> DrafterChoice:
    """Measure, plan and compare the candidate drafters on the job's prompts (module docstring). `profile`: the
    hardware profile measured for `config` (a draft model's step is measured on top of it for its candidate);
    `target`: the target's executor (headers only); measure_all: warm up every drafter with a model, even one that
    cannot win (the full table, at the cost of its warm-up). ConfigError when the config fixes both batch and k (nothing
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
    profiles = {name: replace(profile, draft_step_s=drafter_steps(cfg, quick))  # (cached beside the profile)
                for name, cfg in configs.items()}
    order = list(DRAFTERS)  # ties: the registry's order ("none" first, then the drafter modules by name)

    def has_model(name: str) -> bool:
        cls = configs[name].drafter_class
        return cls.proposes and not cls.model_free

    with_model = [n for n in order if n in configs and has_model(n)]
    workload = Workload.of_prompts([len(p) for p in prompts], params.max_new_tokens)
    priced_by: Warmup | Outputs | None = None  # the warm-up whose passes price every candidate

    def priced(name: str) -> HardwareProfile:  # the pricing warm-up's compute check and its loader's rate
        prof = profiles[name]
        if priced_by is None:
            return prof
        prof = prof.scaled_compute(priced_by.compute_scale) if priced_by.compute_scale != 1.0 else prof
        return replace(prof, stream_bytes_per_s=priced_by.stream_rate) if priced_by.stream_rate else prof

    def plan_for(name: str, acceptance: Acceptance | None, alpha_range: tuple[float, float] | None = None) -> Plan:
        cfg = configs[name]
        return make_plan(cfg, ModelPair.for_config(cfg, target, shares_kv=True), max_seq_len, workload=workload,
                         alpha=acceptance, profile=priced(name), alpha_range=alpha_range,
                         compare_no_draft=False)  # ("none" is a candidate)

    def ceiling(name: str) -> float:  # its predicted tokens/s accepting every draft (0: nothing of it fits)
        try:
            policy = plan_for(name, 1.0).policy
        except SpecOffloadError:
            return 0.0
        return policy.predicted_tokens_per_s if policy is not None else 0.0

    warmups: dict[str, Warmup] = {}

    def warm_up(name: str) -> Warmup | None:
        try:
            warmups[name] = measure_acceptance(configs[name], prompts, params, profile=profiles[name])
        except SpecOffloadError as exc:  # e.g. its warm-up does not fit the budget: the others still compete
            skipped.append((name, str(exc)))
            return None
        return warmups[name]

    # the pricing warm-up: the first drafter with a model that may win on the profile as it is (its outputs are the
    # target's own, speculation being lossless), else a no-draft one
    none_now = plan_for("none", None).policy if "none" in configs else None
    hopeful = [n for n in with_model if measure_all or none_now is None
               or ceiling(n) >= none_now.predicted_tokens_per_s]
    for name in hopeful:
        if (priced_by := warm_up(name)) is not None:
            break
    if priced_by is None:
        priced_by = warmup_outputs(config, prompts, params, profile)
    rows = priced_by.outputs if isinstance(priced_by, Warmup) else priced_by.rows
    if priced_by.mean_new_tokens is not None:
        workload = replace(workload, mean_new_tokens=min(workload.new_tokens, priced_by.mean_new_tokens))
    k_replay = max(MAX_AUTO_K, config.num_draft_tokens if isinstance(config.num_draft_tokens, int) else 0)
    candidates: list[Candidate] = []
    for name in [n for n in order if n in configs and not has_model(n)] + with_model:
        cls = configs[name].drafter_class
        try:
            if has_model(name) and name not in warmups:
                if any(n == name for n, _ in skipped):  # (its warm-up failed above)
                    continue
                bar = max(candidates, key=lambda c: c.predicted, default=None)
                top = ceiling(name)
                if not measure_all and bar is not None and top < bar.predicted:
                    skipped.append((name, f"not measured: accepting every draft it would predict {top:.4g} "
                                          f"tokens/s, below {bar.drafter}'s {bar.predicted:.4g}"))
                    continue
                if warm_up(name) is None:
                    continue
            if name in warmups:
                warmup = warmups[name]
                candidates.append(Candidate(name, plan_for(name, warmup.curve, warmup.alpha_range), warmup.curve,
                                            warmup))
            else:
                acceptance = replay_acceptance(configs[name], name, rows, k_replay) if cls.model_free else None
                candidates.append(Candidate(name, plan_for(name, acceptance), acceptance))
        except SpecOffloadError as exc:  # nothing of its search fits (a draft model's memory, typically)
            if name == "none":
                raise
            skipped.append((name, str(exc)))
    if not candidates:
        raise ConfigError("no drafter could be planned: " + "; ".join(f"{n}: {why}" for n, why in skipped))
    candidates.sort(key=lambda c: order.index(c.drafter))  # (the table's order: the registry's)
    ranked = sorted(candidates, key=lambda c: (-round(c.predicted, 9), order.index(c.drafter)))
    best = ranked[0]
    if best.plan.k == 0:  # a drafter planned not to draft is no drafter
        best = next((c for c in candidates if c.drafter == "none"), best)
    return DrafterChoice(best, tuple(candidates), workload, tuple(skipped), time.perf_counter() - start,
                         priced_by)
