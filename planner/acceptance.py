"""Speculative acceptance: expected tokens per verify round, and estimating the acceptance rate alpha.

Model (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", section 3.1): each of
the k draft tokens of a round is accepted independently with probability alpha until the first rejection; the
target then emits one more token (the correction, or the bonus token when all k were accepted). The tokens
committed per round per row are therefore ``accepted + 1`` with ``accepted`` a geometric count truncated at k.

Estimating alpha: a round with n accepted out of k drafted *tried* ``n + (1 if n < k else 0)`` positions (the
first n succeeded; position n + 1 was tried and failed unless n == k, when nothing was left to try). The
likelihood over rounds is ``alpha**successes * (1 - alpha)**(trials - successes)``, so the MLE of the truncated
geometric is ``successes / trials``; its observed information ``trials / (alpha * (1 - alpha))`` gives the
binomial standard error.

Between-prompt error. Tried positions are not independent draws: a prompt the draft finds easy stays easy, so
the independent units are the prompts. With counts per prompt c (trials t_c, successes s_c; C prompts,
T = sum t_c) the ratio estimator alpha = S / T has the cluster-robust (between-prompt) variance

    se^2 = C / (C - 1) * sum_c (s_c - alpha t_c)^2 / T^2          (never below the binomial one)

and its interval uses Student's t with C - 1 degrees of freedom (`AcceptanceEstimate`).

Acceptance per position of a round. `AcceptanceCurve` keeps the rate per position i of a round (the
product-limit estimate: a_i = accepted at i / rounds that reached i with i drafted), so that

    E[tokens](k) = 1 + sum_{i=1..k} prod_{j<=i} a_j

is exact for every k up to the longest k observed (a round of k drafts holds the rounds of fewer: its first k'
drafts are what k' would have drafted), and Leviathan's eq. 1 when every a_i = alpha. Positions beyond the
observed ones take the last position's rate; each a_i is shrunk toward the pooled alpha by `PRIOR_ROUNDS` pseudo
rounds, so a position seen a few times does not swing it. The curve at another acceptance level (a scenario of the
range) keeps its shape: every a_i's odds are scaled by the same factor (`AcceptanceCurve.at`).

First position after a rejection or a full round. The first draft of a round is accepted at a_R after a rejected
round (or at the start: `rates[0]`) and at a_F after a fully accepted one (`after_full`). The rounds are then a
two-state Markov chain: from state s a round is fully accepted with p_s = a_s * c_k, c_k = prod_{i=2..k} a_i, so
the stationary share of rounds after a full one is

    pi_k = p_R / (1 - p_F + p_R)

and the round's first position is accepted at pi_k a_F + (1 - pi_k) a_R (exact for the mean tokens per round,
which is linear in a_1: `AcceptanceCurve.first_rate`).

The slowest row of a wave. Without row refill (`refill=False`, runtime/offload/batches.py) a batch is refilled only
when every row is done, so a wave of B rows takes the rounds its slowest row needs, not the rounds at the mean rate
(with refill the planner prices the steady state instead: planner/cost.py). Two things spread the
rounds R_r that row r needs for N tokens:
  - chance within a row: tokens per round X = 1 + A are i.i.d. with mean mu and variance v (A truncated at k:
    P(A >= i) = prod_{j<=i} a_j, E[A^2] = sum_i (2i - 1) P(A >= i)); by the renewal central limit theorem R_r is
    about normal with mean N / mu and variance N v / mu^3;
  - prompts differ: a row's own rate alpha_r varies between prompts with standard deviation `spread` (the part
    of the per-prompt rates that persists from the first half of a completion to the second: `between_prompt_sd`).
The slowest of B rows sits near the (B - 3/8) / (B + 1/4) quantile (Blom's plotting position, z_B standard
deviations up); the two parts add in quadrature, the between-prompt one taken at alpha - z_B * spread so that the
convexity of N / mu in alpha is kept (`rounds_for_slowest`).

Model-free drafters (prompt lookup, suffix matching) draft raggedly: a row proposes only when its text matches, and
as many tokens as its match supports. `RaggedAcceptance` keeps, from rounds replayed on the target's own outputs
(runtime/drafter_replay.py), the survival curves of the proposed length L and the accepted count A, so that
E[tokens](k) = 1 + sum_{i<=k} P(A >= i) (Leviathan's eq. 1 when every row proposes k and a_i = alpha) and the
row-tokens a pass verifies are 1 + sum_{i<=k} P(L >= i) instead of k + 1 (planner/cost.py).

The measurements behind each of these choices: docs/perf/README.md, "Measurements behind the acceptance model and
the stream rate".
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from statistics import NormalDist


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens committed per row per verify round (Leviathan et al. 2023, eq. 1).

        E[tokens] = (1 - alpha**(k + 1)) / (1 - alpha),   with the limit k + 1 at alpha = 1.

    k = 0 (no draft) gives 1; k = 1, alpha = 0.9 gives 1.9. Computed with expm1/log1p so that alpha close to 1
    stays accurate.
    """
    _check_k(k)
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be a probability in [0, 1], got {alpha!r}")
    alpha, k = float(alpha), int(k)
    if alpha == 1.0:
        return float(k + 1)
    if alpha == 0.0:
        return 1.0
    log_alpha = math.log(alpha) if alpha < 0.5 else math.log1p(-(1.0 - alpha))  # log1p(-1) for a tiny alpha
    return math.expm1((k + 1) * log_alpha) / math.expm1(log_alpha)


@dataclass(frozen=True)
class AcceptanceEstimate:
    """MLE of alpha from `trials` tried draft positions of which `successes` were accepted (module docstring)."""

    alpha: float
    trials: float  # float: the tracker's exponentially weighted counts are not integers
    successes: float
    stderr: float  # binomial sqrt(alpha * (1 - alpha) / trials), or the between-prompt one (module docstring)
    groups: int = 0  # independent prompts behind `stderr` (0: positions counted as independent draws)

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """Normal-approximation confidence interval alpha +- z * stderr, clipped to [0, 1]."""
        return max(0.0, self.alpha - z * self.stderr), min(1.0, self.alpha + z * self.stderr)

    def plausible(self, confidence: float = 0.9) -> tuple[float, float]:
        """Two-sided `confidence` interval: Student's t with groups - 1 degrees of freedom when the error is the
        between-prompt one (a handful of prompts is a handful of observations), else the normal quantile."""
        return self.interval(t_quantile(0.5 + confidence / 2, self.groups - 1 if self.groups >= 2 else None))


def t_quantile(p: float, df: int | None) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (None: the normal), p in [0.5, 1).

    Normal quantile by bisection on erf; t by the Cornish-Fisher expansion in 1/df (Abramowitz & Stegun 26.7.5),
    within 1% of tables for df >= 3; df 1 and 2 in closed form.
    """
    if not 0.5 <= p < 1.0:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    lo, hi = 0.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p else (lo, mid)
    z = (lo + hi) / 2
    if df is None:
        return z
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        q = 2 * p - 1
        return q * math.sqrt(2 / (1 - q * q))
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


#: pseudo rounds at the pooled alpha that each position's rate is shrunk toward (module docstring)
PRIOR_ROUNDS = 4.0


@dataclass(frozen=True)
class AcceptanceCurve:
    """Acceptance per position of a round: rates[i - 1] = P(draft i accepted | drafts 1..i - 1 were); `alpha` is
    the pooled per-position rate (the scalar summary, `AcceptanceEstimate.alpha`). See the module docstring."""

    rates: tuple[float, ...]
    alpha: float
    spread: float = 0.0  # between-prompt standard deviation of a row's own pooled rate (module docstring)
    # the first position's rate in a round that follows a fully accepted round of the same row; rates[0] is then
    # the rate after a rejection (or at the start); None: one first-position rate whatever came before
    after_full: float | None = None

    def __post_init__(self) -> None:
        extra = () if self.after_full is None else (self.after_full,)
        if not self.rates or not all(0.0 <= a <= 1.0 for a in (*self.rates, self.alpha, *extra)):
            raise ValueError(f"an acceptance curve needs rates in [0, 1] (at least one), got {self.rates}, "
                             f"alpha {self.alpha}, after a full round {self.after_full}")
        if not 0.0 <= self.spread <= 0.5:
            raise ValueError(f"spread must be a standard deviation in [0, 0.5], got {self.spread}")
        object.__setattr__(self, "rates", tuple(float(a) for a in self.rates))

    @classmethod
    def geometric(cls, alpha: float) -> AcceptanceCurve:
        """Every position at alpha: Leviathan et al.'s model."""
        return cls((float(alpha),), float(alpha))

    def rate(self, i: int) -> float:
        """a_i for position i >= 1 (beyond the observed positions: the last one's)."""
        return self.rates[min(i, len(self.rates)) - 1]

    def first_rate(self, k: int) -> float:
        """a_1 of a round at k drafts in the steady state: pi_k a_F + (1 - pi_k) a_R with the stationary share
        pi_k = p_R / (1 - p_F + p_R) of rounds that follow a full one, p_s = a_s prod_{i=2..k} a_i (module
        docstring); rates[0] without `after_full`."""
        if self.after_full is None or k < 1:
            return self.rates[0]
        rest = math.prod(self.rate(i) for i in range(2, k + 1))
        p_reject, p_full = self.rates[0] * rest, self.after_full * rest
        denominator = 1.0 - p_full + p_reject
        share = p_reject / denominator if denominator > 0 else 1.0
        return share * self.after_full + (1.0 - share) * self.rates[0]

    def _rates_at(self, k: int) -> list[float]:
        """a_1..a_k of a round at k drafts (the first position at k's steady-state mix)."""
        return [self.first_rate(k), *(self.rate(i) for i in range(2, k + 1))] if k else []

    def tokens(self, k: int) -> float:
        """Expected tokens committed per row per round with k drafts: 1 + sum_{i<=k} prod_{j<=i} a_j."""
        _check_k(k)
        total = survive = 1.0
        for a in self._rates_at(k):
            survive *= a
            total += survive
        return total

    def variance(self, k: int) -> float:
        """Variance of the tokens committed per row per round with k drafts: Var(A) with P(A >= i) the survival
        prod_{j<=i} a_j, E[A] = sum_i P(A >= i), E[A^2] = sum_i (2i - 1) P(A >= i), i = 1..k."""
        _check_k(k)
        mean = square = 0.0
        survive = 1.0
        for i, a in enumerate(self._rates_at(k), start=1):
            survive *= a
            mean += survive
            square += (2 * i - 1) * survive
        return max(0.0, square - mean * mean)

    def at(self, alpha: float) -> AcceptanceCurve:
        """The same shape (and spread) at pooled rate `alpha`: each a_i's odds times odds(alpha) / odds(self.alpha)."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if alpha == self.alpha:
            return self
        if alpha in (0.0, 1.0) or self.alpha in (0.0, 1.0):
            return AcceptanceCurve((alpha,), alpha, self.spread)
        factor = (alpha / (1 - alpha)) / (self.alpha / (1 - self.alpha))

        def scaled(a: float) -> float:
            return a if a in (0.0, 1.0) else a * factor / (1 - a + a * factor)

        return AcceptanceCurve(tuple(scaled(a) for a in self.rates), alpha, self.spread,
                               None if self.after_full is None else scaled(self.after_full))


@dataclass(frozen=True)
class RaggedAcceptance:
    """Acceptance of a model-free drafter (prompt lookup, suffix matching): ragged drafts, measured per round.

    A row proposes only when its text matches, and then as many tokens as its match supports (up to k), so a
    round is described by two survival curves over positions i = 1..K of a round drafted at k = K:

        proposed[i - 1] = P(L >= i)    the row proposed at least i tokens (proposed[0] is the match rate)
        accepted[i - 1] = P(A >= i)    at least i of them were accepted (A <= L)

    and, for k <= K (a round of k drafts keeps the first k of what K would have proposed),

        E[tokens](k) = 1 + sum_{i<=k} P(A >= i)       committed per row per pass (`tokens`)
        E[fed](k)    = 1 + sum_{i<=k} P(L >= i)       row-tokens the verify pass feeds per row (`fed`): a row with
                                                      no match verifies its next token only, not k + 1
        Var(tokens)  = sum_i (2i - 1) P(A >= i) - (sum_i P(A >= i))^2

    The first is Leviathan et al.'s (2023) E[tokens] with the per-position acceptance a_i = P(A >= i) / P(A >= i - 1)
    of a proposed position folded in with the chance that position i was proposed at all; `alpha` is the pooled
    per-tried-position rate (accepted / tried, a tried position being an accepted one or the first rejected one).
    The verify pass pads every row's queries to the batch's longest feed for attention (the FFN sees valid tokens
    only): of B independent rows that is 1 + sum_{i<=k} (1 - (1 - P(L >= i))^B) (`padded`).
    `proposal_s`: seconds of one row's proposal (index the new tokens, match, propose) at a round's start; it is
    the drafter's whole cost (no weights, no KV cache, no device time). `spread` is 0 and `at` keeps the measured
    curve: the replay is deterministic, its uncertainty is the sample of prompts, not a rate to scan.
    """

    proposed: tuple[float, ...]
    accepted: tuple[float, ...]
    alpha: float
    proposal_s: float = 0.0
    spread: float = 0.0

    def __post_init__(self) -> None:
        if len(self.proposed) != len(self.accepted) or not self.proposed:
            raise ValueError(f"proposed and accepted need one entry per position (at least one), got "
                             f"{self.proposed} and {self.accepted}")
        for curve in (self.proposed, self.accepted):
            if any(not 0.0 <= p <= 1.0 for p in curve) or any(b > a + 1e-12 for a, b in zip(curve, curve[1:])):
                raise ValueError(f"a survival curve must be non-increasing in [0, 1], got {curve}")
        if any(a > p + 1e-12 for p, a in zip(self.proposed, self.accepted)):
            raise ValueError("P(A >= i) cannot exceed P(L >= i): only proposed tokens are accepted")
        if not 0.0 <= self.alpha <= 1.0 or not self.proposal_s >= 0.0 or self.spread != 0.0:
            raise ValueError(f"need alpha in [0, 1], proposal_s >= 0 and spread 0, got {self}")
        object.__setattr__(self, "proposed", tuple(float(p) for p in self.proposed))
        object.__setattr__(self, "accepted", tuple(float(a) for a in self.accepted))

    @classmethod
    def from_rounds(cls, rounds: Sequence[tuple[int, int]], k: int, proposal_s: float = 0.0) -> RaggedAcceptance:
        """From replayed rounds drafted at k: (proposed L, accepted A) each, 0 <= A <= L <= k."""
        _check_k(k)
        if k < 1 or not rounds:
            raise ValueError("need k >= 1 and at least one round")
        if any(not 0 <= a <= n <= k for n, a in rounds):
            raise ValueError(f"each round needs 0 <= accepted <= proposed <= k = {k}, got {list(rounds)[:5]}")
        count = len(rounds)
        proposed = tuple(sum(n >= i for n, _ in rounds) / count for i in range(1, k + 1))
        accepted = tuple(sum(a >= i for _, a in rounds) / count for i in range(1, k + 1))
        tried = sum(min(a + 1, n) for n, a in rounds)
        hits = sum(a for _, a in rounds)
        return cls(proposed, accepted, hits / tried if tried else 0.0, proposal_s)

    @property
    def match_rate(self) -> float:
        """The share of rounds in which a row proposed anything: P(L >= 1)."""
        return self.proposed[0]

    def _survival(self, curve: tuple[float, ...], k: int) -> list[float]:
        """P(X >= i) for i = 1..k; 0 beyond the replayed positions (the replay runs at the largest k planned)."""
        return [curve[i] if i < len(curve) else 0.0 for i in range(k)]

    def tokens(self, k: int) -> float:
        """E[tokens](k) = 1 + sum_{i<=k} P(A >= i) (class docstring)."""
        _check_k(k)
        return 1.0 + sum(self._survival(self.accepted, k))

    def fed(self, k: int) -> float:
        """E[fed](k) = 1 + sum_{i<=k} P(L >= i): row-tokens verified per row per pass (class docstring)."""
        _check_k(k)
        return 1.0 + sum(self._survival(self.proposed, k))

    def padded(self, k: int, rows: int) -> float:
        """Expected longest feed of `rows` independent rows: 1 + sum_{i<=k} (1 - (1 - P(L >= i))^rows)."""
        _check_k(k)
        return 1.0 + sum(1.0 - (1.0 - p) ** max(1, rows) for p in self._survival(self.proposed, k))

    def variance(self, k: int) -> float:
        """Var of the tokens committed per row per round at k (class docstring)."""
        _check_k(k)
        survive = self._survival(self.accepted, k)
        mean = sum(survive)
        return max(0.0, sum((2 * i - 1) * p for i, p in enumerate(survive, start=1)) - mean * mean)

    def at(self, alpha: float) -> RaggedAcceptance:
        """Itself: a measured replay has no rate to scan (class docstring)."""
        return self


Acceptance = float | AcceptanceCurve | RaggedAcceptance


def tokens_per_round(acceptance: Acceptance, k: int) -> float:
    """Expected tokens per row per round: the curve's (or the ragged drafter's), or Leviathan's eq. 1 for a scalar
    alpha."""
    if isinstance(acceptance, (AcceptanceCurve, RaggedAcceptance)):
        return acceptance.tokens(k)
    return expected_tokens(acceptance, k)


def fed_per_round(acceptance: Acceptance, k: int) -> float:
    """Row-tokens the verify pass feeds per row per round: k + 1, or 1 + E[min(L, k)] for ragged drafts."""
    return acceptance.fed(k) if isinstance(acceptance, RaggedAcceptance) else float(k + 1)


def pooled_alpha(acceptance: Acceptance) -> float:
    return acceptance.alpha if isinstance(acceptance, (AcceptanceCurve, RaggedAcceptance)) else float(acceptance)


def as_curve(acceptance: Acceptance) -> AcceptanceCurve | RaggedAcceptance:
    """A scalar alpha as Leviathan's curve (every position at alpha, no spread); a curve as it is."""
    if isinstance(acceptance, (AcceptanceCurve, RaggedAcceptance)):
        return acceptance
    if isinstance(acceptance, bool) or not isinstance(acceptance, numbers.Real) or not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"alpha must be a probability in [0, 1], got {acceptance!r}")
    return AcceptanceCurve.geometric(float(acceptance))


def slowest_quantile(rows: int) -> float:
    """z_B: how many standard deviations above the mean the slowest of `rows` normal draws lies (Blom's plotting
    position (B - 3/8) / (B + 1/4); 0 for one row)."""
    if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 1:
        raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
    return 0.0 if rows == 1 else NormalDist().inv_cdf((rows - 0.375) / (rows + 0.25))


def rounds_for_slowest(acceptance: Acceptance, k: int, tokens: int, rows: int) -> float:
    """Expected verify rounds until the slowest of `rows` rows has committed `tokens` tokens (module docstring):

        R = mean_rounds + sqrt(D_between^2 + D_within^2),  D_between = N / mu(alpha - z_B spread) - N / mu,
                                                           D_within = z_B sqrt(N v / mu^3)
    with mu = E[tokens per round] and v its variance at k; at most N (a round commits at least one token)."""
    mean = mean_rounds(acceptance, k, tokens)
    z = slowest_quantile(rows)
    if k == 0 or tokens == 0 or z == 0.0:
        return mean
    curve = as_curve(acceptance)
    mu = curve.tokens(k)
    low = curve.at(max(0.0, curve.alpha - z * curve.spread)) if curve.spread > 0 else curve
    between = tokens / low.tokens(k) - tokens / mu
    within = z * math.sqrt(tokens * curve.variance(k) / mu**3)
    return min(float(tokens), mean + math.hypot(between, within))


def mean_rounds(acceptance: Acceptance, k: int, tokens: int) -> float:
    """Expected rounds one row needs to commit `tokens` tokens: the first round at which the committed count
    reaches N. By Wald's identity mu E[R] = E[committed] = N + E[overshoot], and for integer steps the overshoot
    settles at (E[X^2] - mu) / (2 mu) (renewal theory), so E[R] = N / mu + (v + mu^2 - mu) / (2 mu^2): N exactly
    at k = 0, about half a round above N / mu at large k; never above N."""
    _check_k(k)
    if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 0:
        raise ValueError(f"tokens must be an integer >= 0, got {tokens!r}")
    if tokens == 0:
        return 0.0
    curve = as_curve(acceptance)
    mu = curve.tokens(k)
    return min(float(tokens), tokens / mu + (curve.variance(k) + mu * mu - mu) / (2 * mu * mu))


def between_prompt_sd(rounds_by_prompt: Sequence[Sequence[tuple[float, float]]]) -> float:
    """The spread of the prompts' own acceptance rates that persists along a completion: split each prompt's
    rounds (trials, successes) into its first and second half, rate p1 and p2 per half; the covariance of p1 and p2
    over prompts estimates the variance they share (a prompt the draft finds easy stays easy), while the binomial
    noise and the short easy or hard stretches inside a completion, independent between the halves, drop out
    (the plain variance of whole-prompt rates keeps them). sqrt(max(0, cov)); 0 with fewer than two prompts of
    two rounds with trials."""
    halves = []
    for rounds in rounds_by_prompt:
        tried = [(float(t), float(s)) for t, s in rounds if t > 0]
        if len(tried) < 2:
            continue
        cut = (len(tried) + 1) // 2
        first, second = tried[:cut], tried[cut:]
        halves.append((sum(s for _, s in first) / sum(t for t, _ in first),
                       sum(s for _, s in second) / sum(t for t, _ in second)))
    if len(halves) < 2:
        return 0.0
    m1 = sum(a for a, _ in halves) / len(halves)
    m2 = sum(b for _, b in halves) / len(halves)
    cov = sum((a - m1) * (b - m2) for a, b in halves) / (len(halves) - 1)
    return min(0.5, math.sqrt(max(0.0, cov)))


def curve_from_counts(at_risk: Sequence[float], accepted: Sequence[float], alpha: float,
                      prior_rounds: float = PRIOR_ROUNDS, spread: float = 0.0,
                      after_full: tuple[float, float] | None = None) -> AcceptanceCurve:
    """The product-limit curve from per-position counts: at_risk[i - 1] rounds reached position i with i drafted,
    accepted[i - 1] of them accepted it; each rate shrunk toward `alpha` by `prior_rounds` pseudo rounds. Trailing
    positions nobody reached are dropped (the last observed rate carries on). `spread`: the between-prompt one.
    after_full: (rounds, accepted) of the first position in rounds that followed a fully accepted round of the same
    row, counted apart from at_risk[0] / accepted[0] (module docstring); None or no rounds: one first rate."""
    if len(at_risk) != len(accepted) or any(not 0 <= a <= r for r, a in zip(at_risk, accepted)):
        raise ValueError(f"need 0 <= accepted <= at_risk per position, got {list(accepted)} of {list(at_risk)}")
    if after_full is not None and not 0 <= after_full[1] <= after_full[0]:
        raise ValueError(f"need 0 <= accepted <= rounds after a full round, got {after_full}")
    full = None
    if after_full is not None and after_full[0] > 0:
        full = (after_full[1] + prior_rounds * alpha) / (after_full[0] + prior_rounds)
    n = len(at_risk)
    while n and at_risk[n - 1] <= 0:
        n -= 1
    if n == 0:
        return AcceptanceCurve((alpha,), alpha, spread, full)
    rates = tuple((accepted[i] + prior_rounds * alpha) / (at_risk[i] + prior_rounds) for i in range(n))
    return AcceptanceCurve(rates, alpha, spread, full)


def position_counts(accepted: Sequence[int], drafted: Sequence[int]) -> tuple[list[int], list[int]]:
    """(at_risk, accepted) per position 1..max(drafted) over rounds (round r accepted accepted[r] of drafted[r])."""
    size = max(drafted, default=0)
    at_risk, hits = [0] * size, [0] * size
    for n, k in zip(accepted, drafted):
        round_counts(n, k)  # validates
        for i in range(1, min(n + 1, k) + 1):
            at_risk[i - 1] += 1
            hits[i - 1] += n >= i
    return at_risk, hits


def round_counts(accepted: int, drafted: int) -> tuple[int, int]:
    """(trials, successes) of one verify round: n accepted of k drafted tried n + (1 if n < k else 0) positions."""
    _check_k(drafted)
    if isinstance(accepted, bool) or not isinstance(accepted, numbers.Integral) or not 0 <= accepted <= drafted:
        raise ValueError(f"accepted must be an integer in [0, drafted={drafted}], got {accepted!r}")
    return int(accepted) + (1 if accepted < drafted else 0), int(accepted)


def estimate_alpha_by_prompt(counts: Sequence[tuple[float, float]]) -> AcceptanceEstimate:
    """alpha = S / T over prompts given as (trials, successes) each, with the between-prompt standard error
    (module docstring). Prompts that tried nothing are ignored; raises ValueError when none tried anything."""
    used = [(float(t), float(s)) for t, s in counts if t > 0]
    if any(not 0 <= s <= t for t, s in used):
        raise ValueError(f"each prompt needs 0 <= successes <= trials, got {used}")
    trials, successes = sum(t for t, _ in used), sum(s for _, s in used)
    estimate = _estimate(trials, successes)
    c = len(used)
    if c < 2:
        return estimate
    between = math.sqrt(c / (c - 1) * sum((s - estimate.alpha * t) ** 2 for t, s in used)) / trials
    return AcceptanceEstimate(estimate.alpha, trials, successes, max(estimate.stderr, between), groups=c)


def estimate_alpha(accepted: Sequence[int], drafted: Sequence[int]) -> AcceptanceEstimate:
    """Truncated-geometric MLE of alpha over verify rounds: round r accepted `accepted[r]` of `drafted[r]` drafts.

    Raises ValueError if the sequences differ in length or no draft position was tried (every round had k = 0).
    """
    if len(accepted) != len(drafted):
        raise ValueError(f"accepted has {len(accepted)} rounds but drafted has {len(drafted)}")
    trials = successes = 0
    for n, k in zip(accepted, drafted):
        t, s = round_counts(n, k)
        trials += t
        successes += s
    return _estimate(trials, successes)


#: the between-prompt spread is estimated from the first SPREAD_ROUNDS rounds of the last SPREAD_PROMPTS prompts
SPREAD_ROUNDS = 64
SPREAD_PROMPTS = 256
#: rows (prompt keys) whose last round's outcome the tracker remembers (the oldest is forgotten first)
LAST_ROUND_PROMPTS = 4096


class AcceptanceTracker:
    """Running estimate of alpha for the runtime's online re-planning; optionally forgets old rounds.

    `record(accepted, drafted, prompt)` once per row per verify round. With `half_life` = h rounds, every record
    first multiplies the past counts by 0.5 ** (1 / h), so a round h records ago weighs half as much as the newest.
    Rounds recorded with a `prompt` key are also counted per prompt, and the estimate then carries the
    between-prompt standard error (module docstring); without keys it is the binomial one.
    """

    def __init__(self, half_life: float | None = None) -> None:
        if half_life is not None and not half_life > 0:
            raise ValueError(f"half_life must be a positive number of rounds or None, got {half_life!r}")
        self.decay = 1.0 if half_life is None else 0.5 ** (1.0 / half_life)
        self.trials = 0.0
        self.successes = 0.0
        self.rounds = 0
        self._prompts: dict[Hashable, tuple[float, float, int]] = {}  # key -> (trials, successes, at round)
        self._at_risk: list[float] = []  # per position i of a round (index i - 1), decayed like the totals
        self._hits: list[float] = []
        self._rounds_by_prompt: OrderedDict[Hashable, list[tuple[int, int]]] = OrderedDict()  # for the spread
        # per prompt key, whether its last round was fully accepted; the first position of the rounds that follow
        # one is counted here (rounds, accepted), apart from _at_risk[0] / _hits[0] (module docstring)
        self._last_full: OrderedDict[Hashable, bool] = OrderedDict()
        self._full_at_risk = self._full_hits = 0.0

    def record(self, accepted: int, drafted: int, prompt: Hashable | None = None) -> None:
        """Add one row's verify round. Rounds with drafted = 0 carry no information and are ignored."""
        trials, successes = round_counts(accepted, drafted)
        if trials == 0:
            return
        self.trials = self.decay * self.trials + trials
        self.successes = self.decay * self.successes + successes
        self.rounds += 1
        while len(self._at_risk) < drafted:
            self._at_risk.append(0.0)
            self._hits.append(0.0)
        after_full = prompt is not None and self._last_full.get(prompt, False)
        self._full_at_risk = self.decay * self._full_at_risk + after_full
        self._full_hits = self.decay * self._full_hits + (after_full and accepted > 0)
        for i in range(len(self._at_risk)):
            reached = i < min(accepted + 1, drafted) and not (i == 0 and after_full)
            self._at_risk[i] = self.decay * self._at_risk[i] + reached
            self._hits[i] = self.decay * self._hits[i] + (reached and accepted > i)
        if prompt is not None:
            self._last_full[prompt] = accepted == drafted
            self._last_full.move_to_end(prompt)
            if len(self._last_full) > LAST_ROUND_PROMPTS:
                self._last_full.popitem(last=False)
            t, s, at = self._prompts.get(prompt, (0.0, 0.0, self.rounds))
            fade = self.decay ** (self.rounds - at)
            self._prompts[prompt] = (t * fade + trials, s * fade + successes, self.rounds)
            rounds = self._rounds_by_prompt.setdefault(prompt, [])
            self._rounds_by_prompt.move_to_end(prompt)
            if len(rounds) < SPREAD_ROUNDS:
                rounds.append((trials, successes))
            if len(self._rounds_by_prompt) > SPREAD_PROMPTS:
                self._rounds_by_prompt.popitem(last=False)

    def record_many(self, accepted: Sequence[int], drafted: Sequence[int],
                    prompts: Sequence[Hashable] | None = None) -> None:
        """`record` for each (accepted, drafted) pair, e.g. every row of one verified batch (prompts: each row's)."""
        if len(accepted) != len(drafted) or (prompts is not None and len(prompts) != len(accepted)):
            raise ValueError(f"accepted, drafted (and prompts) differ in length: {len(accepted)}, {len(drafted)}")
        for n, (a, k) in enumerate(zip(accepted, drafted)):
            self.record(a, k, None if prompts is None else prompts[n])

    def estimate(self) -> AcceptanceEstimate | None:
        """The current (weighted) MLE, or None before any draft position was tried; with the between-prompt error
        when rounds were recorded with prompt keys."""
        if self.trials <= 0:
            return None
        if len(self._prompts) >= 2:
            by_prompt = estimate_alpha_by_prompt(self._prompt_counts())
            return AcceptanceEstimate(by_prompt.alpha, by_prompt.trials, by_prompt.successes, by_prompt.stderr,
                                      by_prompt.groups)
        return _estimate(self.trials, self.successes)

    def _prompt_counts(self) -> list[tuple[float, float]]:
        """(trials, successes) per prompt key, faded like the totals."""
        return [(t * self.decay ** (self.rounds - at), s * self.decay ** (self.rounds - at))
                for t, s, at in self._prompts.values()]

    def curve(self) -> AcceptanceCurve | None:
        """The (weighted) acceptance per position of a round with the between-prompt spread of the prompts' own
        rates (0 without prompt keys), or None before any draft position was tried."""
        estimate = self.estimate()
        if estimate is None:
            return None
        return curve_from_counts(self._at_risk, self._hits, estimate.alpha,
                                 spread=between_prompt_sd(list(self._rounds_by_prompt.values())),
                                 after_full=(self._full_at_risk, self._full_hits))


def _estimate(trials: float, successes: float) -> AcceptanceEstimate:
    if trials <= 0:
        raise ValueError("no draft position was tried (every round drafted 0 tokens): alpha is not identifiable")
    alpha = min(1.0, max(0.0, successes / trials))
    return AcceptanceEstimate(alpha, trials, successes, math.sqrt(alpha * (1.0 - alpha) / trials))


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(f"the number of draft tokens must be an integer >= 0, got {k!r}")
