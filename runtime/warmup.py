"""The acceptance warm-up and the plan for a known job: what `specoffload plan` prints and what a job then runs.

    measure_acceptance   a short generation over a sample of the job's prompts at k = MAX_AUTO_K, with the job's
                         sampling: the acceptance estimate with its between-prompt error (planner/acceptance.py)
    warmup_outputs       a short no-draft generation over the same sample: the target's own outputs, which a
                         model-free drafter's acceptance is replayed on (runtime/drafter_replay.py)
    plan_job             the warm-up, then the planner's search over the job's workload with the estimate's
                         plausible range (maximin over it, planner/search.py): the Plan, and why

The warm-up drafts at k = MAX_AUTO_K (so the curve holds every k the plan may pick) for WARMUP_PROMPTS prompts
spread over the whole job (every n/w-th), with the job's sampling, up to WARMUP_TOKENS tokens each. It estimates
the acceptance per position of a round (`AcceptanceCurve`, exact for every k <= MAX_AUTO_K) and its between-prompt
range (Student's t on w - 1 degrees of freedom, planner/acceptance.py); the plan must hold over that range at
CONFIDENCE (maximin, planner/search.py).

The warm-up also says how long the job's rows run: the mean new tokens a row generates before EOS (or its
max_new_tokens), which the steady-state price of refilled batches needs (planner/cost.py). A row's length is taken
as geometric (a constant chance h of stopping at each token, estimated as the rows that stopped / the tokens
generated, the rows cut at the warm-up's cap counting as censored), so under the job's cap M

    mean_new_tokens = sum_{t=1..M} (1 - h)^(t - 1) = (1 - (1 - h)^M) / h      (M when no row stopped);

when the warm-up ran the job's whole length (M <= WARMUP_TOKENS) the observed mean itself.

The warm-up's engine checks the hardware profile against its own passes (offload/replan.py `check_profile`): when
they are off by more than its margin, the job is planned with the profile's compute costs scaled to match
(`corrected`), and the cached profile is measured again before the next job.

The warm-up streams the job's weights under the job's budget, so its loader also says what the disk delivers now:
streamed bytes / its seconds in load ops (runtime/offload/replan.py `observed_stream_rate`), not the periods of
its passes, which also hold the draft steps' compute. The plan is searched at that rate when there is one, else at
the profile's. Measurements behind these choices: docs/perf/README.md, "Measurements behind the acceptance model
and the stream rate".
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from specoffload.planner import AcceptanceEstimate, HardwareProfile, Workload
from specoffload.planner.acceptance import AcceptanceCurve, RaggedAcceptance
from specoffload.planner.plan import MAX_AUTO_K, Plan

from .config import EngineConfig
from .drafter_replay import replay_acceptance
from .engine import Engine
from .offload.profiler import load_or_measure
from .offload.replan import observed_stream_rate
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
    stream_rate: float | None = None  # what its loader delivered (replan.py `observed_stream_rate`)
    mean_new_tokens: float | None = None  # tokens a job's row generates on average (module docstring)
    outputs: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()  # (prompt, output) of each warm-up row
    compute_scale: float = 1.0  # the profile's compute costs x this, as its passes measured (`checked_scale`)

    @property
    def alpha_range(self) -> tuple[float, float]:
        return self.estimate.plausible(CONFIDENCE)

    def describe(self) -> str:
        lo, hi = self.alpha_range
        return (f"{self.estimate.alpha:.3f} ({CONFIDENCE:.0%} range {lo:.2f}-{hi:.2f}, a prompt's own rate spread "
                f"+-{self.curve.spread:.2f}; warm-up on {self.prompts} of "
                f"the job's prompts, {self.new_tokens} tokens each at k = {self.k}, "
                f"{self.estimate.trials:.0f} draft positions, {self.seconds:.0f} s"
                + (f"; its loader delivered {self.stream_rate / 1e9:.2f} GB/s" if self.stream_rate else "")
                + (f"; a row runs {self.mean_new_tokens:.0f} new tokens on average" if self.mean_new_tokens else "")
                + ")")


def spread(items: Sequence, n: int) -> list:
    """n items spread evenly over the sequence (every len/n-th, starting at the first), all of them if n >= len."""
    if n >= len(items):
        return list(items)
    return [items[math.floor(i * len(items) / n)] for i in range(n)]


def measure_acceptance(config: EngineConfig, prompts: Sequence[Sequence[int]], params: SamplingParams,
                       prompts_used: int = WARMUP_PROMPTS, max_tokens: int = WARMUP_TOKENS,
                       profile: HardwareProfile | None = None) -> Warmup:
    """Generate for `prompts_used` of the job's prompts (spread over it) at k = MAX_AUTO_K with the job's
    sampling, at most `max_tokens` each, under the config's budget (module docstring). With a profile, also the
    stream rate the warm-up's own loader delivered: the disk's rate now, not when the profile was measured."""
    chosen = spread(list(prompts), prompts_used)
    new_tokens = max(2, min(max_tokens, params.max_new_tokens))
    seq = max(len(p) for p in chosen) + new_tokens
    rows = max(1, math.ceil(len(chosen) / 2))
    start = time.perf_counter()
    warm = Engine(replace(config, max_batch_size=rows, num_draft_tokens=MAX_AUTO_K, max_seq_len=seq), profile=profile)
    try:
        results = warm.generate([list(p) for p in chosen], replace(params, max_new_tokens=new_tokens))
    finally:
        warm.close()
    estimate, curve = warm.replanner.tracker.estimate(), warm.replanner.tracker.curve()
    if estimate is None or curve is None:
        raise ValueError("the warm-up drafted nothing (every prompt finished at once)")
    rate = loader_rate(warm, profile, seq)
    lengths = [(len(r.token_ids), r.finish_reason == "stop") for r in results]
    return Warmup(estimate, curve, len(chosen), new_tokens, MAX_AUTO_K, time.perf_counter() - start, rate,
                  mean_output_len(lengths, params.max_new_tokens, new_tokens),
                  tuple((tuple(p), tuple(r.token_ids)) for p, r in zip(chosen, results)), checked_scale(warm))


def loader_rate(engine: Engine, profile: HardwareProfile | None, seq: int) -> float | None:
    """The stream rate a warm-up engine's loader delivered (replan.py `observed_stream_rate`; None without a
    profile, when nothing streamed, or with too few passes)."""
    if profile is None or engine.placement is None:
        return None
    return observed_stream_rate(profile, engine.models.costs(engine.plan.drafting), engine.placement,
                                engine.replanner.pass_log, seq // 2, engine.config.expert_loading)


def checked_scale(engine: Engine) -> float:
    """The factor a warm-up engine's passes found the profile's compute costs off by (offload/replan.py
    `check_profile`: 1.0 within its margin, or when nothing was checked)."""
    return engine.replanner.compute_scale


def mean_output_len(lengths: Sequence[tuple[int, bool]], max_new_tokens: int, cap: int) -> float:
    """The mean new tokens of a job's row (module docstring) from rows of the warm-up: (tokens, stopped), each run
    to at most `cap` tokens; `max_new_tokens` is the job's cap M."""
    generated, stopped = sum(n for n, _ in lengths), sum(s for _, s in lengths)
    if not lengths or generated == 0:
        return float(max_new_tokens)
    if max_new_tokens <= cap:
        return min(float(max_new_tokens), max(1.0, generated / len(lengths)))
    if stopped == 0:
        return float(max_new_tokens)
    hazard = stopped / generated
    return max(1.0, (1.0 - (1.0 - hazard) ** max_new_tokens) / hazard)


@dataclass(frozen=True)
class Outputs:
    """What a no-draft warm-up measured (`warmup_outputs`)."""

    rows: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (prompt, output) of each warm-up row
    mean_new_tokens: float  # `mean_output_len`
    compute_scale: float = 1.0  # as `Warmup.compute_scale`
    stream_rate: float | None = None  # as `Warmup.stream_rate`
    seconds: float = 0.0


def warmup_outputs(config: EngineConfig, prompts: Sequence[Sequence[int]], params: SamplingParams,
                   profile: HardwareProfile | None = None) -> Outputs:
    """A no-draft warm-up: (prompt, output) of WARMUP_PROMPTS of the job's prompts (spread over it), at most
    WARMUP_TOKENS tokens each, the mean output length it implies (warmup.py `mean_output_len`), and with a profile
    what its passes say of the profile's compute costs (`checked_scale`) and what its loader delivered
    (`loader_rate`)."""
    start = time.perf_counter()
    chosen = spread(list(prompts), WARMUP_PROMPTS)
    new_tokens = max(2, min(WARMUP_TOKENS, params.max_new_tokens))
    rows = max(1, math.ceil(len(chosen) / 2))  # as measure_acceptance: two batches of half the prompts
    seq = max(len(p) for p in chosen) + new_tokens
    plain = replace(config, drafter="none", draft=None, max_batch_size=rows, num_draft_tokens=0, max_seq_len=seq,
                    interleave=None)
    engine = Engine(plain, profile=profile)
    try:
        results = engine.generate([list(p) for p in chosen], replace(params, max_new_tokens=new_tokens))
    finally:
        engine.close()
    lengths = [(len(r.token_ids), r.finish_reason == "stop") for r in results]
    pairs = tuple((tuple(p), tuple(r.token_ids)) for p, r in zip(chosen, results))
    return Outputs(pairs, mean_output_len(lengths, params.max_new_tokens, new_tokens), checked_scale(engine),
                   loader_rate(engine, profile, seq), time.perf_counter() - start)


def corrected(profile: HardwareProfile | None, scale: float, say: Callable[[str], None]) -> HardwareProfile | None:
    """The profile the job is planned on: its compute costs x `scale` when the warm-up's passes found it off
    (offload/replan.py `check_profile`, which said so in one line), else as it is."""
    if profile is None or scale == 1.0:
        return profile
    say(f"plan: searched with the profile's compute costs x {scale:.2f}, as the warm-up's passes measured")
    return profile.scaled_compute(scale)


@dataclass(frozen=True)
class JobPlan:
    """The plan for a known job, with the warm-up and the workload it was searched for."""

    plan: Plan
    workload: Workload
    warmup: Warmup | None  # None without a drafter (or with a fixed plan, or a model-free drafter)
    replayed: RaggedAcceptance | None = None  # a model-free drafter's acceptance, replayed (runtime/drafter_replay.py)


def plan_job(config: EngineConfig, models: ModelPair, prompts: Sequence[Sequence[int]], params: SamplingParams,
             max_seq_len: int, profile: HardwareProfile | None = None,
             log: Callable[[str], None] | None = None) -> JobPlan:
    """Warm-up (when a drafter may be used and the plan is the planner's), then the search over the job's workload
    with the warm-up's plausible acceptance range: the plan `Engine(config, plan=...)` runs. Without a drafter, a
    paged target KV (placed by expected use) gets a no-draft warm-up for the mean output length. log: a line per
    warm-up, before it runs."""
    say = log or (lambda _: None)
    workload = Workload.of_prompts([len(p) for p in prompts], params.max_new_tokens)
    warmup = None
    # a model-free drafter: its acceptance replayed on a no-draft warm-up's outputs (runtime/drafter_replay.py)
    if config.planned and config.drafter_class.model_free and config.num_draft_tokens != 0:
        say(f"warm-up: no-draft outputs of {min(len(prompts), WARMUP_PROMPTS)} prompts, to replay "
            f"{config.drafter_name!r} on")
        outputs = warmup_outputs(config, prompts, params, profile)
        profile = corrected(profile, outputs.compute_scale, say)
        workload = replace(workload, mean_new_tokens=min(workload.new_tokens, outputs.mean_new_tokens))
        k = max(MAX_AUTO_K, config.num_draft_tokens if isinstance(config.num_draft_tokens, int) else 0)
        ragged = replay_acceptance(config, config.drafter_name, outputs.rows, k)
        plan = make_plan(config, models, max_seq_len, workload=workload, alpha=ragged, profile=profile)
        return JobPlan(plan, workload, None, ragged)
    if config.planned and models.draft is not None and config.num_draft_tokens != 0:
        profile = profile or load_or_measure(config, open_engine=Engine)
        say(f"warm-up: the draft's acceptance on {min(len(prompts), WARMUP_PROMPTS)} prompts")
        warmup = measure_acceptance(config, prompts, params, profile=profile)
        profile = corrected(profile, warmup.compute_scale, say)
        if warmup.stream_rate is not None:  # the disk's rate now (it drifts: runtime/offload/replan.py)
            profile = profile.scaled_io(warmup.stream_rate / profile.stream_bytes_per_s)
        if warmup.mean_new_tokens is not None:  # rows stopping at EOS: the steady state's row length
            workload = replace(workload, mean_new_tokens=min(workload.new_tokens, warmup.mean_new_tokens))
    elif config.planned and config.offloaded and config.kv_block_size:  # a paged KV is placed by expected use
        say(f"warm-up: output lengths of {min(len(prompts), WARMUP_PROMPTS)} prompts (the paged KV's size)")
        outputs = warmup_outputs(config, prompts, params, profile)
        profile = corrected(profile, outputs.compute_scale, say)
        workload = replace(workload, mean_new_tokens=min(workload.new_tokens, outputs.mean_new_tokens))
    plan = make_plan(config, models, max_seq_len, workload=workload, profile=profile,
                     alpha=warmup.curve if warmup else None,
                     alpha_range=warmup.alpha_range if warmup else None)
    return JobPlan(plan, workload, warmup)
