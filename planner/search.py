"""Policy search: the (batch, k) that maximises predicted workload throughput within the memory budgets.

The paper's policy is (prefill_batch, decode_batch, draft_batch, k). In our runtime prefill is merged into the
first pass of each batch and the draft proposes for the *other* batch of the same size, so
prefill_batch = decode_batch = draft_batch = batch (draft_batch = 0 without a draft); the four fields are kept
for the paper's vocabulary and the search runs over (batch, k):

    k = 0   no draft, one batch (num_batches = 1): layer streaming only, FlexGen style;
    k >= 1  the draft resident on the device, two batches of `batch` rows alternate (num_batches = 2).

For each pair: `place` (a `PlacementError` makes the pair infeasible, with its reason), then
`estimate_workload` (cost.py); the best policy is the argmax, ties going to the smaller batch, then smaller k.
With `refill` (the engine's continuous batching, its default) a workload is priced in the steady state of refilled
batches (cost.py, "Refilled batches"); without, in waves that last until their slowest row.

Uncertain acceptance (`alpha_range`, e.g. a warm-up's confidence interval from a few prompts): each policy is
predicted at every alpha of a grid over the range, and the pick is the maximin of its ratio to the best policy at
that alpha:

    worst_ratio(p) = min over a in range of  rate(p, a) / max_q rate(q, a)

so a policy that is near-best over the whole range beats one that is best only at the point estimate and poor at
the low end (a long k at a high alpha, typically). With a narrow range this is the plain argmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from .acceptance import (
    Acceptance,
    AcceptanceCurve,
    RaggedAcceptance,
    pooled_alpha,
    rounds_for_slowest,
    tokens_per_round,
)
from .cost import ModelCosts, Workload, WorkloadEstimate, estimate_step, estimate_workload, steady_pass
from .errors import SpecOffloadError
from .kv_budget import expected_kv_tokens
from .placement import Placement, PlacementError, PlacementPolicy, place
from .profile import HardwareProfile
from .shapes import ModelShape, PartKey

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


class NoFeasiblePolicyError(SpecOffloadError, ValueError):
    """No (batch, k) of the search space fits the memory budgets."""


@dataclass(frozen=True)
class Policy:
    """A chosen plan: batch sizes in the paper's vocabulary (tied in our runtime, module docstring) and k."""

    prefill_batch: int
    decode_batch: int
    draft_batch: int  # rows the draft proposes for per step: decode_batch with a draft, 0 without
    k: int
    predicted_tokens_per_s: float
    alpha: float
    memory: Mapping[str, int] = field(hash=False)  # bytes per tier, and "device_footprint" (the device budget used)
    placement_table: str = field(repr=False)
    estimate: WorkloadEstimate | None = field(default=None, compare=False, repr=False)
    # min over the alpha range of rate / the best policy's rate (module docstring); 1 for the best without a range
    worst_ratio: float = field(default=1.0, compare=False)
    predicted_low: float | None = field(default=None, compare=False)  # tokens/s at the low end of the alpha range
    interleave: bool = True  # with a draft: two batches alternate; False: one batch drafts between its passes
    refill: bool = True  # priced with finished rows refilled at once (the steady state); False: in waves
    prefill_chunk: int | None = None  # prompt tokens per pass the steady price allows (cost.py `prefill_budget`)
    kv_expected_tokens: int = 0  # paged target KV placed by expected use: positions per row (0: by the context)

    def __post_init__(self) -> None:
        if self.prefill_batch != self.decode_batch or self.draft_batch != (self.decode_batch if self.k else 0):
            raise ValueError(
                "in this runtime prefill_batch = decode_batch and draft_batch = decode_batch (0 when k = 0), got "
                f"{self.prefill_batch}, {self.decode_batch}, {self.draft_batch} with k = {self.k}"
            )
        object.__setattr__(self, "memory", MappingProxyType(dict(self.memory)))

    @property
    def batch(self) -> int:
        return self.decode_batch

    @property
    def num_batches(self) -> int:
        return 2 if self.k >= 1 and self.interleave else 1

    def describe(self) -> str:
        draft = (f"k={self.k}, {'two batches' if self.interleave else 'one batch drafting between its passes'}"
                 if self.k else "no draft, one batch")
        low = "" if self.predicted_low is None else f" ({self.predicted_low:.2f} at the low end of alpha)"
        return f"batch={self.batch} ({draft}): {self.predicted_tokens_per_s:.2f} tokens/s predicted{low}"


@dataclass(frozen=True)
class SearchResult:
    """`alternatives`: every feasible policy, best first (so alternatives[0] is `best`)."""

    best: Policy
    alternatives: tuple[Policy, ...]
    infeasible: tuple[tuple[int, int, str], ...]  # (batch, k, why)

    def best_where(self, predicate: Callable[[Policy], bool]) -> Policy | None:
        """The best feasible policy satisfying `predicate`, e.g. `lambda p: p.k == 0` (no speculation)."""
        return next((p for p in self.alternatives if predicate(p)), None)


@dataclass(frozen=True)
class SearchSpace:
    """What `search` chooses among, and under what: the models, the workload and its acceptance `alpha`, the
    memory budgets, and the candidate batches, k and interleaving (module docstring).

    alpha_range: (low, high) plausible acceptance around `alpha`; the pick is then the maximin of the ratio to the
    best policy over the range (module docstring); `alternatives` are ranked by that ratio, then by the rate at
    `alpha`.
    max_seq_len: tokens per row (prompt + new tokens; the engine's max_seq_len), default ceil(prompt_len) +
    new_tokens; the KV capacity placed is max_seq_len + k_max + 1, as the engine sizes it, where k_max = k, or
    max(k, k_ceiling) for k >= 1 when online re-planning may raise k up to k_ceiling (`Plan.kv_capacity`).
    draft_pins: target parts resident whenever there is a draft (a resident-expert drafter shares them).
    expert_group: experts per ring slot of a streamed MoE layer (0: whole layers; placement.py).
    interleaves: with a draft, whether two batches alternate (True) or one drafts between its passes (False);
    both are candidates when both are given.
    refill: price the steady state of refilled batches (the engine's default: runtime/planning.py passes its
    config's), else waves (module docstring).
    kv_block_size: the target KV is paged in blocks of this many positions (placement rounds a row up to whole
    blocks; 0: contiguous); kv_expected_use: with blocks, place the target KV by the workload's expected use,
    ceil(prompt_len + mean_new_tokens) + k_max + 1 per row (kv_budget.py), instead of the context (the runtime
    preempts rows when the pool runs out: runtime/offload/batches.py).
    host_attention: the target's attention and embedding stay in host RAM (CPU attention beside a GPU; default: on
    a CUDA profile). weights_tier defaults to
    the profile's; unified_memory to True on a CPU profile (device memory is host memory). dtype_bytes and
    top_k (experts per token of an MoE target) feed `ModelCosts`. k >= 1 is skipped without a draft.
    """

    target: ModelShape
    draft: ModelShape | None
    workload: Workload
    alpha: Acceptance
    device_memory: int
    host_memory: int
    batches: tuple[int, ...] = DEFAULT_BATCHES
    ks: tuple[int, ...] = tuple(range(0, 9))
    num_buffers: int = 2
    weights_tier: str | None = None
    unified_memory: bool | None = None
    max_seq_len: int | None = None
    dtype_bytes: int = 2
    top_k: int = 0
    draft_top_k: int = 0
    k_ceiling: int = 0
    expert_loading: str = "auto"
    draft_pins: frozenset[PartKey] = frozenset()
    alpha_range: tuple[float, float] | None = None
    expert_group: int = 0
    interleaves: tuple[bool, ...] = (True,)
    draft_dtype_bytes: int = 0
    refill: bool = False
    kv_block_size: int = 0
    kv_expected_use: bool = False
    host_attention: bool | None = None

    def __post_init__(self) -> None:
        for name in ("batches", "ks", "interleaves"):  # any iterable given: a tuple kept
            object.__setattr__(self, name, tuple(getattr(self, name)))


def search(profile: HardwareProfile, space: SearchSpace) -> SearchResult:
    """The best (batch, k) of `space` on `profile` (module docstring; `SearchSpace` says what each field does).
    Raises `NoFeasiblePolicyError` (with the reasons) when no pair fits."""
    costs = ModelCosts.from_shapes(space.target, space.draft, space.dtype_bytes, space.top_k, space.draft_top_k,
                                   space.draft_dtype_bytes)
    tier = space.weights_tier if space.weights_tier is not None else profile.weights_tier
    unified = space.unified_memory if space.unified_memory is not None else profile.device == "cpu"
    on_host = space.host_attention if space.host_attention is not None else profile.device == "cuda"
    workload = space.workload
    tokens = (space.max_seq_len if space.max_seq_len is not None
              else math.ceil(workload.prompt_len) + workload.new_tokens)
    scenarios = _alpha_grid(space.alpha, space.alpha_range)
    rates: dict[tuple[int, int, bool], list[float]] = {}  # (batch, k, interleave) -> tokens/s at each alpha
    feasible: list[Policy] = []
    infeasible: list[tuple[int, int, str]] = []
    candidates = [(b, kk, i) for b in space.batches for kk in space.ks for i in (space.interleaves if kk else (True,))]
    for batch, k, interleave in candidates:
        if k >= 1 and space.draft is None:
            continue
        k_max = max(k, space.k_ceiling) if k >= 1 else 0
        policy = PlacementPolicy(
            batch_size=batch,
            num_batches=2 if k >= 1 and interleave else 1,
            kv_capacity=tokens + k_max + 1,
            num_buffers=space.num_buffers,
            weights_tier=tier,
            unified_memory=unified,
            pinned=space.draft_pins if k >= 1 else frozenset(),
            expert_group=space.expert_group,
            kv_block_size=space.kv_block_size,
            kv_expected_tokens=(expected_kv_tokens(space.workload, k_max, space.workload.mean_new_tokens)
                                if space.kv_block_size and space.kv_expected_use else 0),
            host_attention=on_host,
        )
        try:
            placement = place(space.target, space.draft if k >= 1 else None, policy, space.device_memory,
                              space.host_memory)
        except PlacementError as exc:
            infeasible.append((batch, k, str(exc)))
            continue
        estimate = estimate_workload(profile, costs, placement, batch, k, space.alpha, workload, space.expert_loading,
                                     interleave, space.refill)
        rates[(batch, k, interleave)] = [estimate.tokens_per_s if a is space.alpha or k == 0 else
                                         estimate_workload(profile, costs, placement, batch, k, a, space.workload,
                                                           space.expert_loading, interleave, space.refill).tokens_per_s
                                         for a in scenarios]
        feasible.append(replace(_policy(batch, k, pooled_alpha(space.alpha), placement, estimate),
                                interleave=interleave, refill=space.refill,
                                kv_expected_tokens=policy.kv_expected_tokens,
                                prefill_chunk=estimate.steady.prefill_chunk if estimate.steady else None))
    if not feasible:
        if not infeasible:
            raise NoFeasiblePolicyError(f"no (batch, k) to search: batches {space.batches}, k {space.ks}"
                                        + ("" if space.draft is not None else " (k >= 1 needs a draft)"))
        b, k, why = infeasible[0]  # the smallest: what it needs (and the floor under every batch) says it all
        raise NoFeasiblePolicyError(f"no (batch, k) fits the memory budgets; the smallest, batch={b}, k={k}: {why}")
    best_at = [max(r[n] for r in rates.values()) for n in range(len(scenarios))]
    feasible = [replace(p, worst_ratio=min(r / b for r, b in zip(rates[(p.batch, p.k, p.interleave)], best_at)),
                        predicted_low=rates[(p.batch, p.k, p.interleave)][0] if space.alpha_range is not None
                        else None)
                for p in feasible]
    ranked = tuple(sorted(feasible, key=lambda p: (-_rounded(p.worst_ratio), -_rounded(p.predicted_tokens_per_s),
                                                   p.batch, p.k, not p.interleave)))
    return SearchResult(best=ranked[0], alternatives=ranked, infeasible=tuple(infeasible))


def _alpha_grid(alpha: Acceptance, alpha_range: tuple[float, float] | None, points: int = 5) -> list[Acceptance]:
    """The acceptances a policy is judged at: [alpha] without a range, else `points` pooled rates spread over
    [low, high] (a curve keeps its shape: `AcceptanceCurve.at`) with `alpha` itself among them (low first)."""
    if alpha_range is None:
        return [alpha]
    low, high = alpha_range
    point = pooled_alpha(alpha)
    if not 0.0 <= low <= point <= high <= 1.0:
        raise ValueError(f"alpha_range must satisfy 0 <= low <= alpha <= high <= 1, got {alpha_range} for {point}")
    levels = sorted({low + (high - low) * n / (points - 1) for n in range(points)} - {point})
    below = [a for a in levels if a < point]
    at = (lambda a: alpha.at(a)) if isinstance(alpha, (AcceptanceCurve, RaggedAcceptance)) else (lambda a: a)  # noqa: E731
    return [at(a) for a in below] + [alpha] + [at(a) for a in levels if a > point]


@dataclass(frozen=True)
class Replan:
    """An online decision (`replan`): k draft tokens per round (0: speculation off) and the rows a batch admits."""

    k: int
    rows: int
    tokens_per_s: float  # predicted decode rate at the point estimate
    worst_ratio: float  # min over the alpha range of its rate / the best candidate's (module docstring)


def replan(
    profile: HardwareProfile,
    costs: ModelCosts,
    placement: Placement,
    batch: int,
    alpha: Acceptance,
    attended_len: int,
    k_max: int,
    merged_rows: int,
    alpha_range: tuple[float, float] | None = None,
    expert_loading: str = "auto",
    tokens: int | None = None,
    refill: bool = False,
    prompt_len: float | None = None,
) -> Replan:
    """Online re-planning with a drafter loaded and placed for two batches of `batch` rows: the decode step with
    the best worst-case ratio over `alpha_range` (module docstring) among

        k in 1..k_max, two batches of `batch` rows (speculation on), and
        k = 0 with one batch of `merged_rows` rows (speculation off: the rows of both batches in one, the KV memory
        they were placed with; the other batch stays empty, as a no-draft plan runs).

    attended_len: keys each token attends to (cost.py `estimate_step`).
    tokens: new tokens per row; given, a speculating batch's rate counts its slowest row (a batch is refilled only
    when all its rows are done: rate x (N / R_slowest(N)) / E(k), acceptance.py `rounds_for_slowest`).
    refill: finished rows are refilled at once, so no row waits for the slowest; with `tokens` a candidate's rate
    is then the steady pass's (cost.py `steady_pass`: rows x E_row / T_pass), its prefill share priced when
    `prompt_len` (mean prompt tokens) is given; without `tokens` the decode step's.
    Ties go to the smaller k. Decode steps only, in waves: the rows' prefill is the same whichever is chosen.
    """
    if costs.draft is None or k_max < 1:
        raise ValueError("replan needs a drafter (costs.draft) and k_max >= 1; without one there is nothing to choose")
    candidates = [(k, batch) for k in range(1, k_max + 1)] + [(0, merged_rows)]
    scenarios = _alpha_grid(alpha, alpha_range)

    def wave(a: Acceptance, k: int, rows: int) -> float:
        if not tokens or k == 0:
            return 1.0
        return tokens / rounds_for_slowest(a, k, tokens, rows) / tokens_per_round(a, k)

    def rate(a: Acceptance, k: int, rows: int) -> float:
        if refill and tokens:
            steady = Workload(num_prompts=1, prompt_len=max(1.0, prompt_len or 1.0), new_tokens=tokens)
            priced = steady_pass(profile, costs, placement, rows, k, a, steady, expert_loading,
                                 attended_len=attended_len)
            return (priced.step if prompt_len else priced.decode).tokens_per_s
        step = estimate_step(profile, costs, placement, rows, k, a, attended_len, expert_loading).tokens_per_s
        return step if refill else step * wave(a, k, rows)

    rates = {c: [rate(a, c[0], c[1]) for a in scenarios] for c in candidates}
    best_at = [max(r[n] for r in rates.values()) for n in range(len(scenarios))]
    worst = {c: min(r / b for r, b in zip(rates[c], best_at)) for c in candidates}
    point = next(n for n, a in enumerate(scenarios) if a is alpha)
    k, rows = min(candidates, key=lambda c: (-_rounded(worst[c]), -_rounded(rates[c][point]), c[0]))
    return Replan(k=k, rows=rows, tokens_per_s=rates[(k, rows)][point], worst_ratio=worst[(k, rows)])


#: the least predicted speed-up over the current plan for which a running job is re-placed (`replacement_pays`)
REPLACE_GAIN = 1.15


def replacement_pays(current_tokens_per_s: float, new_tokens_per_s: float, tokens_left: float, switch_s: float,
                     min_gain: float = REPLACE_GAIN) -> bool:
    """Whether a running job should move from its plan to a new one (batch, k and placement; the runtime's
    re-placement, runtime/offload/pipeline.py): the new plan is predicted at least `min_gain` times as fast, and over
    the `tokens_left` the job still generates it saves at least twice what switching costs (`switch_s`: the new
    resident weights read and the rows in flight fed again):

        r_new >= min_gain x r_cur   and   T / r_cur - T / r_new >= 2 x switch_s

    Twice, not once: the rates are predictions from a profile that was just found off."""
    if min(current_tokens_per_s, new_tokens_per_s) <= 0 or tokens_left <= 0:
        return False
    if new_tokens_per_s < min_gain * current_tokens_per_s:
        return False
    saved = tokens_left / current_tokens_per_s - tokens_left / new_tokens_per_s
    return saved >= 2 * max(0.0, switch_s)


def _rounded(rate: float) -> float:
    """`rate` to 12 significant digits: predictions equal up to float rounding tie (then smaller batch, k win)."""
    return float(f"{rate:.12g}")


def _policy(batch: int, k: int, alpha: float, placement: Placement, estimate: WorkloadEstimate) -> Policy:
    memory = {**placement.bytes_by_tier(), "device_footprint": placement.device_bytes()}
    return Policy(
        prefill_batch=batch,
        decode_batch=batch,
        draft_batch=batch if k else 0,
        k=k,
        predicted_tokens_per_s=estimate.tokens_per_s,
        alpha=alpha,
        memory=memory,
        placement_table=placement.table(),
        estimate=estimate,
    )
