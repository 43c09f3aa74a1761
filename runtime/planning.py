"""From a config and a job to the `Plan` the engine runs and the `Placement` it runs it under: one place, used by
the engine and by `specoffload plan` alike, so the plan shown is the plan run.

    resolve_max_seq_len   tokens per row the KV caches hold: --max-seq-len, else the job's, else the model's
    job_max_seq_len       the same for a job's prompts (text or token ids), as both CLI commands size it
    ModelPair             the models' shapes, read from checkpoint headers (the drafter's from its class)
    search_space          what a planned config searches
    make_plan             fixed (the user chose batch and k) or planned (search over the measured profile)
    replacement           a running job's best plan on a corrected profile, and whether moving to it pays
    place_plan            the placement of a plan's parts and caches under the budgets

The search itself (planner/search.py) is pure; this module adds what needs the runtime: the measured hardware
profile (runtime/offload/profiler.py) and the models' shapes read from their checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from specoffload.planner import HardwareProfile, ModelCosts, SearchSpace, Workload, replacement_pays, search
from specoffload.planner.acceptance import Acceptance
from specoffload.planner.placement import Placement, PlacementPolicy, minimum_device_memory, place
from specoffload.planner.plan import MAX_AUTO_K, Plan, fixed_plan, planned
from specoffload.planner.search import DEFAULT_BATCHES, NoFeasiblePolicyError, Policy
from specoffload.planner.shapes import ModelShape, PartKey

from .config import ConfigError, EngineConfig
from .models.config import ModelConfig
from .models.model import Transformer
from .offload.drafters import DraftFootprint
from .offload.drafters.model import model_footprint
from .offload.drafters.resident_experts import resident_expert_footprint
from .tokenizer import load_tokenizer

logger = logging.getLogger("specoffload.planning")

#: KV length per row when neither max_seq_len nor the job nor a shorter model context says otherwise
DEFAULT_MAX_SEQ_LEN = 4096


@dataclass(frozen=True)
class ModelPair:
    """What planning needs of the models: shapes (parts and bytes in the compute dtype) and the MoE routing."""

    target: ModelShape
    draft: ModelShape | None
    model_context: int  # the target's max_position_embeddings
    dtype_bytes: int
    top_k: int = 0  # experts per token of an MoE target (0: dense)
    draft_top_k: int = 0  # the same for an MoE draft
    self_draft_experts: int = 0  # > 0: the draft is the target's resident-expert drafter keeping that many
    draft_pins: frozenset[PartKey] = frozenset()  # target parts the drafter shares (resident whenever it drafts)
    draft_dtype_bytes: int = 0  # the draft's compute dtype (0: the target's)

    @classmethod
    def of(cls, target: Transformer, draft: Transformer | None, self_draft_experts: int = 0,
           shares_kv: bool = False) -> ModelPair:
        """From executors constructed on the checkpoints (their headers are read, no weight is loaded).
        self_draft_experts > 0: the draft is the target's own resident-expert drafter with that many experts per
        layer (planner/shapes.py `self_draft_shape`), drafting into the target's KV cache when shares_kv."""
        if self_draft_experts:
            footprint = resident_expert_footprint(target, self_draft_experts, shares_kv)
        else:
            footprint = model_footprint(draft) if draft is not None else DraftFootprint(None)
        return cls.drafted_by(target, footprint)

    @classmethod
    def for_config(cls, config: EngineConfig, target: Transformer, shares_kv: bool) -> ModelPair:
        """The target and the drafter `config` names, as that drafter's class counts itself (`footprint`).
        shares_kv: the drafter is built in the target's process (the local backend)."""
        return cls.drafted_by(target, config.drafter_class.footprint(config, target, shares_kv),
                              packed=config.packed_slots)

    @classmethod
    def drafted_by(cls, target: Transformer, draft: DraftFootprint, packed: bool = False) -> ModelPair:
        """The target's shape (headers only) with a drafter's footprint; packed: int8 weights stay packed in the ring
        slots (`EngineConfig.packed_slots`)."""
        cfg = target.config
        return cls(target=target.loader.shape("target", packed=packed), draft=draft.shape,
                   model_context=cfg.max_position_embeddings,
                   dtype_bytes=target.dtype.itemsize, top_k=cfg.num_experts_per_tok if cfg.num_experts else 0,
                   draft_top_k=draft.top_k, self_draft_experts=draft.experts, draft_pins=draft.pins,
                   draft_dtype_bytes=draft.dtype_bytes)

    def costs(self, drafting: bool) -> ModelCosts:
        """FLOPs and bytes per layer for the cost model (the draft only when it is loaded)."""
        return ModelCosts.from_shapes(self.target, self.draft if drafting else None, dtype_bytes=self.dtype_bytes,
                                      top_k=self.top_k, draft_top_k=self.draft_top_k,
                                      draft_dtype_bytes=self.draft_dtype_bytes)


def resolve_max_seq_len(config_max_seq_len: int | None, model_context: int,
                        prompt_lengths: Iterable[int] | None = None, max_new_tokens: int | None = None) -> int:
    """Prompt + output tokens per row the KV caches are sized for, never above the model's context:

    the config's max_seq_len (--max-seq-len) if given; else, when the job is known, its longest prompt plus
    max_new_tokens; else min(model context, DEFAULT_MAX_SEQ_LEN).
    """
    if config_max_seq_len is not None:
        return min(model_context, config_max_seq_len)
    lengths = list(prompt_lengths) if prompt_lengths is not None else []
    if lengths and max_new_tokens is not None:
        return min(model_context, max(lengths) + max_new_tokens)
    return min(model_context, DEFAULT_MAX_SEQ_LEN)


def job_max_seq_len(config: EngineConfig, prompts: Sequence[str | Sequence[int]], max_new_tokens: int) -> int:
    """`resolve_max_seq_len` for a job: text prompts are measured with the target's tokenizer."""
    model_context = ModelConfig.from_dir(config.target).max_position_embeddings
    if config.max_seq_len is not None or not prompts:
        return resolve_max_seq_len(config.max_seq_len, model_context)
    tokenizer = load_tokenizer(config.target) if any(isinstance(p, str) for p in prompts) else None
    if tokenizer is None and any(isinstance(p, str) for p in prompts):
        return resolve_max_seq_len(None, model_context)  # the engine refuses text prompts without a tokenizer
    lengths = (len(tokenizer.encode(p, add_special_tokens=False)) if isinstance(p, str) else len(p) for p in prompts)
    return resolve_max_seq_len(None, model_context, lengths, max_new_tokens)


def search_space(config: EngineConfig, models: ModelPair, max_seq_len: int, workload: Workload | None = None,
                 alpha: Acceptance | None = None, alpha_range: tuple[float, float] | None = None,
                 extra_batches: tuple[int, ...] = ()) -> SearchSpace:
    """What a planned `config` searches (`make_plan`): the default batches (or the config's one) capped at the
    workload's prompts, plus `extra_batches`; k 1..MAX_AUTO_K with a drafter and auto k, the config's k, or 0."""
    has_draft = models.draft is not None
    if workload is None:
        workload = Workload(num_prompts=256, prompt_len=max_seq_len / 2, new_tokens=max_seq_len - max_seq_len // 2)
    batches = DEFAULT_BATCHES if config.max_batch_size == "auto" else (int(config.max_batch_size),)
    if config.max_batch_size == "auto":  # never more rows than the job has prompts: no KV placed for absent rows
        batches = tuple(sorted({min(b, max(1, int(workload.num_prompts))) for b in batches}))
    batches = tuple(sorted({*batches, *extra_batches}))
    if not has_draft:
        ks: tuple[int, ...] = (0,)
    elif config.num_draft_tokens == "auto":  # a drafter asked for runs: k >= 1 (only --drafter auto chooses none)
        ks = tuple(range(1, MAX_AUTO_K + 1))
    else:
        ks = (int(config.num_draft_tokens),)
    auto_k = config.num_draft_tokens == "auto"
    return SearchSpace(
        models.target, models.draft, workload,
        config.acceptance_prior if alpha is None else alpha,
        int(config.device_memory), config.host_budget,
        batches=batches, ks=ks, num_buffers=config.num_buffers, weights_tier=config.weights_tier,
        unified_memory=config.unified_memory, max_seq_len=max_seq_len, dtype_bytes=models.dtype_bytes,
        top_k=models.top_k, draft_top_k=models.draft_top_k, k_ceiling=MAX_AUTO_K if auto_k else 0,
        expert_loading=config.expert_loading, draft_pins=models.draft_pins, expert_group=config.expert_group or 0,
        interleaves=(True, False) if config.interleave == "auto" else (bool(config.interleave),),
        draft_dtype_bytes=models.draft_dtype_bytes,
        alpha_range=alpha_range, refill=config.refill,
        kv_block_size=_kv_block_size(config), kv_expected_use=True,
        host_attention=config.host_attention,
    )


def make_plan(
    config: EngineConfig,
    models: ModelPair,
    max_seq_len: int,
    *,
    workload: Workload | None = None,
    alpha: Acceptance | None = None,
    profile: HardwareProfile | None = None,
    alpha_range: tuple[float, float] | None = None,
    compare_no_draft: bool = True,
) -> Plan:
    """The plan for `config`: fixed when the user chose batch and k (or nothing streams), else the planner's best
    (batch, k) for `workload` (default: many prompts of max_seq_len / 2 tokens, as many new tokens) at acceptance
    `alpha` (default: config.acceptance_prior; a scalar or a per-position curve) on the measured `profile` (required
    then: the caller measures it, runtime/offload/profiler.py `load_or_measure`); with `alpha_range` (a warm-up's
    plausible acceptance, runtime/warmup.py) the maximin pick over it. The search prices the config's `refill` (the
    steady state of refilled batches, or waves) and the plan carries it, with the per-pass prompt token budget the
    planner chose (`Plan.prefill_chunk`; a fixed plan has none). compare_no_draft: with a drafter asked for, say in
    one line when the planner predicts no draft to be faster (off where the caller weighs no draft itself: --drafter
    auto's candidates, runtime/drafter_choice.py)."""
    has_draft = models.draft is not None
    if not config.planned:
        k = int(config.num_draft_tokens) if has_draft else 0
        # resident, nothing streams for a draft to hide behind: one batch drafting between its passes
        interleave = config.offloaded and config.interleave is not False
        return fixed_plan(int(config.max_batch_size), k, max_seq_len, models.self_draft_experts,
                          interleave=interleave, refill=config.refill)
    if profile is None:
        raise ValueError("a planned config (batch or k 'auto') is planned on the measured hardware profile: pass "
                         "profile= (runtime/offload/profiler.py `load_or_measure`, which the engine calls)")
    space = search_space(config, models, max_seq_len, workload, alpha, alpha_range)
    auto_k = config.num_draft_tokens == "auto"
    result = search(profile, space)
    plan = planned(result, max_seq_len, auto_k=auto_k, draft_experts=models.self_draft_experts)
    logger.info("planner: %s, predicted %.2f tok/s", plan.describe(), result.best.predicted_tokens_per_s)
    if has_draft and auto_k and compare_no_draft:  # the drafter runs as asked; say so when it is predicted to lose
        try:
            plain = search(profile, replace(space, draft=None, ks=(0,), draft_pins=frozenset())).best
        except NoFeasiblePolicyError:
            plain = None
        if plain is not None and plain.predicted_tokens_per_s > result.best.predicted_tokens_per_s:
            logger.warning("drafter %r runs as asked (k = %d, batch %d: predicted %.3g tokens/s), though the planner "
                           "predicts %.3g tokens/s without a draft (batch %d; --drafter none, or --drafter auto to let "
                           "it choose)", config.drafter_name, plan.k, plan.batch, result.best.predicted_tokens_per_s,
                           plain.predicted_tokens_per_s, plain.batch)
    return plan


@dataclass(frozen=True)
class Replacement:
    """A running job's best plan on a corrected profile (`replacement`), beside the plan it runs."""

    plan: Plan
    tokens_per_s: float  # predicted for what the job has left
    current_tokens_per_s: float  # the running plan's, predicted the same way
    switch_s: float  # predicted cost of the switch: the new resident weights read, the rows in flight fed again
    pays: bool  # planner/search.py `replacement_pays`


def replacement(config: EngineConfig, models: ModelPair, plan: Plan, k_now: int, profile: HardwareProfile,
                workload: Workload, tokens_left: float, refeed_tokens: int, alpha: Acceptance | None = None,
                max_seq_len: int | None = None) -> Replacement | None:
    """The plan `search` picks for what a job has left (`workload`: its rows left, at its mean prompt and new
    tokens), with KV for `max_seq_len` tokens a row (default: the running plan's), on `profile` (corrected by the
    job's passes, when they found it off), priced beside the running `plan` at its current k (`k_now`: online
    re-planning moves k) for the same workload. None when the best is the running plan, when the running plan's
    shape is not among the candidates (speculation turned off online: k = 0 with a drafter loaded), or when the
    config fixes the batch (a user's batch is kept). switch_s = device-tier bytes / stream rate + the prefill
    pass's time per prompt token x `refeed_tokens` (the committed tokens of the rows in flight, fed again)."""
    if config.max_batch_size != "auto" or plan.policy is None:
        return None
    max_seq_len = max_seq_len or plan.max_seq_len
    try:
        result = search(profile, search_space(config, models, max_seq_len, workload, alpha))
        same = search(profile, search_space(config, models, plan.max_seq_len, workload, alpha,
                                            extra_batches=(plan.batch,)))
    except NoFeasiblePolicyError:
        return None

    def running(p: Policy) -> bool:
        return p.batch == plan.batch and p.k == k_now and (k_now == 0 or p.interleave == plan.interleave)

    current, best = same.best_where(running), result.best
    if current is None or (running(best) and max_seq_len == plan.max_seq_len) or best.estimate is None:
        return None
    new = planned(result, max_seq_len, auto_k=config.num_draft_tokens == "auto",
                  draft_experts=models.self_draft_experts)
    prefill = best.estimate.prefill.t_step / max(1.0, best.estimate.rows * workload.prompt_len)  # s per token
    switch_s = best.memory["device"] / profile.stream_bytes_per_s + prefill * refeed_tokens
    pays = replacement_pays(current.predicted_tokens_per_s, best.predicted_tokens_per_s, tokens_left, switch_s)
    return Replacement(new, best.predicted_tokens_per_s, current.predicted_tokens_per_s, switch_s, pays)


def placement_policy(config: EngineConfig, plan: Plan, models: ModelPair) -> PlacementPolicy:
    return PlacementPolicy(
        batch_size=plan.batch,
        num_batches=plan.num_batches,
        kv_capacity=plan.kv_capacity,
        num_buffers=config.num_buffers,
        weights_tier=config.weights_tier,
        unified_memory=config.unified_memory,
        pinned=models.draft_pins if plan.drafting else frozenset(),
        expert_group=config.expert_group or 0,
        kv_block_size=_kv_block_size(config),
        kv_expected_tokens=plan.kv_expected_tokens if _kv_block_size(config) else 0,
        host_attention=config.host_attention,
    )


def _kv_block_size(config: EngineConfig) -> int:
    """Positions per block of the target's paged KV (offloaded only: the attention worker's pool), 0: contiguous.
    A planned pool holds the workload's expected use per row (prompt + mean output, `Plan.kv_expected_tokens`) and
    the pipeline preempts rows when it runs out; a fixed plan's holds every row's full context."""
    return config.kv_block_size if config.offloaded else 0


def place_plan(config: EngineConfig, plan: Plan, models: ModelPair) -> Placement:
    """Where each part and cache of `plan` lives (PlacementError, stating the minimum, when it does not fit)."""
    if config.device_memory is None:
        raise ConfigError("placement needs device_memory (the budget that makes the target stream)")
    draft = models.draft if plan.drafting else None
    policy = placement_policy(config, plan, models)
    return place(models.target, draft, policy, int(config.device_memory), config.host_budget)


def plan_minimum_device_memory(config: EngineConfig, plan: Plan, models: ModelPair) -> int:
    """The smallest device_memory that places `plan` (every streamable target part streamed, usually)."""
    draft = models.draft if plan.drafting else None
    return minimum_device_memory(models.target, draft, placement_policy(config, plan, models))
