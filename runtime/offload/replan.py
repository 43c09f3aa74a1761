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

With row refill (the pipeline's default) a candidate is priced in the steady state of refilled batches (rows x
tokens per row per pass / the pass's seconds, its prefill share at the run's mean prompt length: planner/cost.py
`steady_pass`); with `refill=False`, by the rounds the slowest row of a wave needs.

The cost model's stream rate is the job's own too (the disk's rate drifts between the profile and the job).
Each decode pass is observed (`observe_pass`): its period and the seconds the io thread spent in load ops since
the previous pass (reading and converting the weights into slots). On a CPU the rate is the bytes the model
streams per pass / the mean load seconds per pass over the last PASS_WINDOW passes: what the loader itself
delivered, whatever the compute beside it did (a pass's period also holds compute the model undercounts, e.g. the
draft steps, and would read as a slow disk). On CUDA a load op only queues its copies, so there the period rule is
used: when the median period is longer than everything but the io the model counts for that pass (its step with
an unbounded stream rate), the pass waited on the io and the rate is its streamed bytes / that period.
`stream_rate` holds the rate used last (None until observed). Measurements: docs/perf/README.md, "Measurements
behind the acceptance model and the stream rate".

The profile itself is checked once per engine (`check_profile`), after CHECK_PASSES decode passes: their median
period (the most common k and rows; with a model-free drafter, whose rows feed fewer than k + 1 tokens, the no-draft
passes only) against the step the profile, at the job's own stream rate, predicts for them, and the cores other
processes kept busy over those passes (/proc/stat less this process, steal included: profiler.py `_busy_seconds`).
Off by more than PROFILE_MARGIN, the cause decides:

    faster than predicted            the profile was measured slow (a busy machine): corrected, and stale
    slower, other processes busy     the machine is busy now: corrected for this run; the profile (measured
                                     quiet) stands for the next job (`busy_cores` says why)
    slower, quiet, no-draft passes   the profile is off for this machine: corrected, and stale
    slower, quiet, drafted passes    the cost model's error at this shape (a draft model's steps beside the
                                     target's pass on shared cores: e.g. the warm-up's k = 8 on 4 rows took 1.39x
                                     a fresh profile's prediction on a quiet 2-core EPYC, while its k = 2 and
                                     k = 4 jobs measured within 10% of it; docs/perf planner_validation_v3): the
                                     rates stand, one info line (`shape_off` keeps the ratio); scaling every
                                     compute cost by it priced all plans 33% slow

A correction, or a stream rate off the profile's by more than the margin, also sets `replace_due`: the pipeline
then asks the engine once whether a new plan (batch, k, placement) pays for what the job has left (pipeline.py,
step 6). A correction is one warning line, and the run goes on with the profile's compute costs scaled by the
factor that makes the prediction match (`HardwareProfile.scaled_compute`, found by bisection: the step is
non-decreasing in it); `profile_off` keeps the ratio for the engine, which marks the cached profile stale
(profiler.py `mark_stale`) unless other processes were busy.

A new k takes effect at each batch's next draft round. Only when the planner chose k ("auto") and a drafter is
loaded. While speculation is off nothing is drafted, so nothing new is observed: the decision stands for the rest
of the run (k_max = 0 plans have no drafter to turn on).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Hashable, Sequence

from specoffload.planner import AcceptanceTracker, HardwareProfile, ModelCosts, estimate_step, replan
from specoffload.planner.placement import Placement
from specoffload.planner.plan import Plan

from . import profiler
from .calibrate import solve_nondecreasing

logger = logging.getLogger("specoffload.offload")

#: two-sided confidence of the alpha range the online decision must hold over
CONFIDENCE = 0.8
#: decode passes whose median period calibrates the stream rate (fewer observed: the profile's rate)
PASS_WINDOW = 8
PASS_LOG = 1 << 12  # passes `pass_log` keeps
#: a stream rate no disk reaches: the model's step without io stalls
UNBOUNDED = 1e18
#: decode passes observed before the profile is checked against them; the ratio either way that says it is off
CHECK_PASSES = 2 * PASS_WINDOW
PROFILE_MARGIN = 1.25


class Replanner:
    """Holds the current k and rows per batch; `record` each verified batch's acceptance; see the module docstring."""

    def __init__(self, plan: Plan, interval: int, profile: HardwareProfile | None = None,
                 costs: ModelCosts | None = None, placement: Placement | None = None,
                 expert_loading: str = "auto", refill: bool | None = None, full_feed: bool = True) -> None:
        """refill: the pipeline refills finished rows at once (default: the plan's), so candidates are priced in
        the steady state (planner/cost.py `steady_pass`), not by the slowest row of a wave. full_feed: a drafted
        pass feeds rows x (k + 1) tokens (a drafter with a model); False (a model-free drafter, whose rows propose
        fewer): `check_profile` judges the no-draft passes only."""
        self.plan, self.interval, self.expert_loading = plan, interval, expert_loading
        self.refill = plan.refill if refill is None else refill
        self.profile, self.costs, self.placement = profile, costs, placement
        self.k = plan.k
        self.rows = plan.batch
        self.tracker = AcceptanceTracker(half_life=64)
        self.replans: list[dict[str, float]] = []
        self.rounds = 0
        # (seconds, k, rows, load seconds) of every decode pass observed
        #: (seconds, k, rows, load seconds) of the last PASS_LOG passes (a long job's memory stays flat)
        self.pass_log: deque[tuple[float, int, int, float]] = deque(maxlen=PASS_LOG)
        self.tokens_per_row: int | None = None  # the run's max_new_tokens: the slowest row of a wave is priced
        self.prompt_len: float | None = None  # the run's mean prompt tokens (the engine's): the prefill share
        self.stream_rate: float | None = None
        self.full_feed = full_feed
        self.compute_scale = 1.0  # the profile's compute costs times this (`check_profile`)
        self.profile_off: float | None = None  # measured / predicted pass period, when off by > PROFILE_MARGIN
        self.shape_off: float | None = None  # the same, for drafted passes the profile's rates stand for
        self.busy_cores: float | None = None  # other processes' cores over the checked passes, when above the limit
        self.checked = False
        #: the check found the profile the plan was made on off (compute corrected, or the stream rate beyond the
        #: margin): the pipeline asks its replacer for a better plan (pipeline.py, step 6) and clears it
        self.replace_due = False
        #: profiler.py `busy_mark` at each of the last passes observed before the check
        self._busy_log: deque[profiler.BusyMark] = deque(maxlen=CHECK_PASSES + 1)

    def carry(self, previous: Replanner) -> None:
        """After a re-placement (pipeline.py, step 6): take over what `previous` learnt of the job (its acceptance,
        rounds and decisions, the job's shape, the profile's correction and check); the passes observed are not
        carried (they were another placement's)."""
        self.tracker, self.replans, self.rounds = previous.tracker, previous.replans, previous.rounds
        self.tokens_per_row, self.prompt_len = previous.tokens_per_row, previous.prompt_len
        self.compute_scale, self.profile_off = previous.compute_scale, previous.profile_off
        self.shape_off, self.busy_cores, self.checked = previous.shape_off, previous.busy_cores, previous.checked

    @property
    def active(self) -> bool:
        return (self.plan.policy is not None and self.plan.k_max > 0 and self.interval > 0
                and None not in (self.profile, self.costs, self.placement))

    def observe_pass(self, seconds: float, k: int, rows: int, load_s: float = 0.0) -> None:
        """One decode pass of `rows` rows at k drafts took `seconds` (end of the previous pass to the end of this),
        while the io thread spent `load_s` seconds in load ops (0: not measured)."""
        if seconds > 0 and rows > 0:
            self.pass_log.append((seconds, k, rows, max(0.0, load_s)))
            if not self.checked:
                mark = profiler.busy_mark()
                if mark is not None:
                    self._busy_log.append(mark)
                if len(self.pass_log) >= CHECK_PASSES:
                    self.check_profile()

    def attended_len(self) -> int:
        """Keys a decode token attends to on average: the run's mean prompt plus half a row's new tokens (half the
        KV length per row before the run says)."""
        if self.prompt_len is None:
            return self.plan.max_seq_len // 2
        return max(1, min(self.plan.max_seq_len, round(self.prompt_len + (self.tokens_per_row or 0) / 2)))

    def check_profile(self) -> float | None:
        """The profile against the decode passes observed (module docstring): measured / predicted period of the
        most common (k, rows) over the last CHECK_PASSES passes, or None when there is nothing to check."""
        self.checked = True
        if self.profile is None or self.costs is None or self.placement is None:
            return None
        passes = [p for p in list(self.pass_log)[-CHECK_PASSES:] if self.full_feed or p[1] == 0]
        if not passes:
            self.checked = False  # (no no-draft pass yet: checked once there are enough)
            return None
        shapes = [(k, rows) for _, k, rows, _ in passes]
        k, rows = max(set(shapes), key=shapes.count)
        periods = [s for s, kk, r, _ in passes if (kk, r) == (k, rows)]
        if len(periods) < PASS_WINDOW // 2:
            self.checked = len(self.pass_log) >= PASS_LOG  # (too few of one shape yet: again at the next pass)
            return None
        profile = self.calibrated_profile()
        assert profile is not None
        measured, attended = statistics.median(periods), self.attended_len()

        def step(scale: float) -> float:
            scaled = profile.scaled_compute(scale) if scale != 1.0 else profile
            return estimate_step(scaled, self.costs, self.placement, rows, k, 0.0, attended, self.expert_loading,
                                 self.plan.interleave).t_step

        predicted = step(1.0)
        ratio = measured / predicted
        if self.stream_rate is not None and not 1 / PROFILE_MARGIN <= (
                self.stream_rate / self.profile.stream_bytes_per_s) <= PROFILE_MARGIN:
            self.replace_due = True  # the disk runs off the profile's rate: the plan's placement may be wrong
        if 1 / PROFILE_MARGIN <= ratio <= PROFILE_MARGIN:
            return ratio
        others = self.others_cores()
        busy = others is not None and others > profiler.OTHERS_LIMIT
        if ratio > PROFILE_MARGIN and k > 0 and self.full_feed and not busy:  # (module docstring's table)
            self.shape_off = ratio
            logger.info("drafted passes (%d rows, k %d) take %.3g s, %.2fx the %.3g s the profile predicts, on a "
                        "quiet machine: the cost model's error at this shape; the profile's rates stand", rows, k,
                        measured, ratio, predicted)
            return ratio
        lo, hi = 1.0, 1.0
        while step(hi) < measured and hi < 64:
            hi *= 2
        while step(lo) > measured and lo > 1 / 64:
            lo /= 2
        self.compute_scale = solve_nondecreasing(step, measured, lo, hi, 30)  # (the step grows with the scale)
        self.profile_off = ratio
        self.replace_due = True
        self.busy_cores = others if busy and ratio > 1 else None
        after = (f"other processes keep {others:.2f} cores busy: the cached profile stands" if self.busy_cores
                 else "the cached profile is measured again before the next job")
        logger.warning("the hardware profile predicts %.3g s per pass (%d rows, k %d) and this job's passes take "
                       "%.3g s (%.2fx, beyond the %.0f%% margin): this run goes on with its compute costs x %.2f; %s",
                       predicted, rows, k, measured, ratio, (PROFILE_MARGIN - 1) * 100, self.compute_scale, after)
        return ratio

    def others_cores(self) -> float | None:
        """Cores other processes kept busy over the passes observed before the check (None: not measurable)."""
        if len(self._busy_log) < 2:
            return None
        return profiler.others_cores(self._busy_log[0], self._busy_log[-1])

    def calibrated_profile(self) -> HardwareProfile | None:
        """The profile at the stream rate the job's last decode passes show (module docstring); the profile itself
        when too few passes were observed or they say nothing about the rate."""
        if self.profile is None or self.costs is None or self.placement is None:
            return self.profile
        base = self.profile if self.compute_scale == 1.0 else self.profile.scaled_compute(self.compute_scale)
        rate = observed_stream_rate(base, self.costs, self.placement, list(self.pass_log)[-PASS_WINDOW:],
                                    self.plan.max_seq_len // 2, self.expert_loading)
        if rate is None:
            return base
        self.stream_rate = rate
        return base.scaled_io(rate / base.stream_bytes_per_s)  # (compressed parts' rates too)

    def record(self, accepted: Sequence[int], k: int | Sequence[int],
               prompts: Sequence[Hashable] | None = None) -> None:
        """One verified batch: row r (of request prompts[r]) accepted accepted[r] of k (or k[r]) drafts (>= 1)."""
        ks = [k] * len(accepted) if isinstance(k, int) else list(k)
        self.tracker.record_many(accepted, ks, prompts)
        self.rounds += 1
        if not self.active or self.rounds % self.interval:
            return
        estimate, curve = self.tracker.estimate(), self.tracker.curve()
        if estimate is None or curve is None:
            return
        assert self.costs is not None and self.placement is not None
        profile = self.calibrated_profile()
        assert profile is not None
        choice = replan(profile, self.costs, self.placement, self.plan.batch, curve,
                        self.plan.max_seq_len, self.plan.k_max, self.plan.batch * self.plan.num_batches,
                        alpha_range=estimate.plausible(CONFIDENCE), expert_loading=self.expert_loading,
                        tokens=self.tokens_per_row, refill=self.refill, prompt_len=self.prompt_len)
        if (choice.k, choice.rows) != (self.k, self.rows):
            self.replans.append({"round": self.rounds, "alpha": estimate.alpha, "k_from": self.k, "k_to": choice.k,
                                 "rows_from": self.rows, "rows_to": choice.rows,
                                 "stream_rate": profile.stream_bytes_per_s})
            logger.info("re-plan after %d rounds: alpha %.3f -> k %d, %d rows per batch (was k %d, %d rows)",
                        self.rounds, estimate.alpha, choice.k, choice.rows, self.k, self.rows)
            self.k, self.rows = choice.k, choice.rows


def observed_stream_rate(profile: HardwareProfile, costs: ModelCosts, placement: Placement,
                         passes: Sequence[tuple[float, int, int, float]], attended_len: int,
                         expert_loading: str = "auto", min_passes: int = PASS_WINDOW // 2) -> float | None:
    """The stream rate decode passes (seconds, k, rows, load seconds) show, by the rule of the module docstring,
    over the passes of their most common (k, rows); None with fewer than `min_passes` of them, when nothing
    streams, or (period rule) when the passes were no slower than everything but their io."""
    if not passes:
        return None
    shapes = [(k, rows) for _, k, rows, _ in passes]
    k, rows = max(set(shapes), key=shapes.count)
    chosen = [(s, load) for s, kk, r, load in passes if (kk, r) == (k, rows)]
    if len(chosen) < min_passes:
        return None
    model = estimate_step(profile, costs, placement, rows, k, 0.0, attended_len, expert_loading)
    if model.t_io <= 0:
        return None
    streamed = model.t_io * profile.stream_bytes_per_s  # bytes per pass
    loads = [load for _, load in chosen]
    if profile.device == "cpu" and sum(loads) > 0:  # (a pass may see 0 loads, the next two passes' worth)
        return streamed / statistics.fmean(loads)  # what the loader delivered per second of its own work
    period = statistics.median(s for s, _ in chosen)
    unbounded = profile.scaled_io(UNBOUNDED / profile.stream_bytes_per_s)  # every loader rate
    fast = estimate_step(unbounded, costs, placement, rows, k, 0.0, attended_len, expert_loading)
    if period <= fast.t_step and model.bound != "io":
        return None  # the pass did not wait on the io: its period says nothing about the rate
    return streamed / period
