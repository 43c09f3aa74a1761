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
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass


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
    log_alpha = math.log1p(-(1.0 - alpha))
    return math.expm1((k + 1) * log_alpha) / math.expm1(log_alpha)


@dataclass(frozen=True)
class AcceptanceEstimate:
    """MLE of alpha from `trials` tried draft positions of which `successes` were accepted (module docstring)."""

    alpha: float
    trials: float  # float: the tracker's exponentially weighted counts are not integers
    successes: float
    stderr: float  # sqrt(alpha * (1 - alpha) / trials): binomial approximation (0 at alpha 0 or 1)

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """Normal-approximation confidence interval alpha +- z * stderr, clipped to [0, 1]."""
        return max(0.0, self.alpha - z * self.stderr), min(1.0, self.alpha + z * self.stderr)


def round_counts(accepted: int, drafted: int) -> tuple[int, int]:
    """(trials, successes) of one verify round: n accepted of k drafted tried n + (1 if n < k else 0) positions."""
    _check_k(drafted)
    if isinstance(accepted, bool) or not isinstance(accepted, numbers.Integral) or not 0 <= accepted <= drafted:
        raise ValueError(f"accepted must be an integer in [0, drafted={drafted}], got {accepted!r}")
    return int(accepted) + (1 if accepted < drafted else 0), int(accepted)


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


class AcceptanceTracker:
    """Running estimate of alpha for the runtime's online re-planning; optionally forgets old rounds.

    `record(accepted, drafted)` once per row per verify round. With `half_life` = h rounds, every record first
    multiplies the past counts by 0.5 ** (1 / h), so a round h records ago weighs half as much as the newest.
    """

    def __init__(self, half_life: float | None = None) -> None:
        if half_life is not None and not half_life > 0:
            raise ValueError(f"half_life must be a positive number of rounds or None, got {half_life!r}")
        self.decay = 1.0 if half_life is None else 0.5 ** (1.0 / half_life)
        self.trials = 0.0
        self.successes = 0.0
        self.rounds = 0

    def record(self, accepted: int, drafted: int) -> None:
        """Add one row's verify round. Rounds with drafted = 0 carry no information and are ignored."""
        trials, successes = round_counts(accepted, drafted)
        if trials == 0:
            return
        self.trials = self.decay * self.trials + trials
        self.successes = self.decay * self.successes + successes
        self.rounds += 1

    def record_many(self, accepted: Sequence[int], drafted: Sequence[int]) -> None:
        """`record` for each (accepted, drafted) pair, e.g. every row of one verified batch."""
        if len(accepted) != len(drafted):
            raise ValueError(f"accepted has {len(accepted)} rounds but drafted has {len(drafted)}")
        for n, k in zip(accepted, drafted):
            self.record(n, k)

    def estimate(self) -> AcceptanceEstimate | None:
        """The current (weighted) MLE, or None before any draft position was tried."""
        if self.trials <= 0:
            return None
        return _estimate(self.trials, self.successes)


def _estimate(trials: float, successes: float) -> AcceptanceEstimate:
    if trials <= 0:
        raise ValueError("no draft position was tried (every round drafted 0 tokens): alpha is not identifiable")
    alpha = min(1.0, max(0.0, successes / trials))
    return AcceptanceEstimate(alpha, trials, successes, math.sqrt(alpha * (1.0 - alpha) / trials))


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(f"the number of draft tokens must be an integer >= 0, got {k!r}")
