"""Drafters: who proposes the draft tokens the target verifies. One small interface; a new drafter is a new class.

    Drafter               the interface (a Protocol): per-batch state managed by the coordinator, `propose`,
                          and `adapt` (what the target routed since the last call; a no-op but for the next one)
    NoDrafter             no speculation (k = 0): holds nothing, is never asked to propose
    ModelDrafter          an external draft model on the target's vocabulary, resident where compute happens
    ResidentExpertDrafter the MoE target drafts for itself with only its resident ("hot") routed experts
    NgramDrafter, SuffixDrafter  model-free: prompt lookup and suffix matching (modelfree.py, registered as "ngram"
                          and "suffix" when it is imported: runtime/config.py imports it)

The registry: `DRAFTERS` maps a name (EngineConfig.drafter: "none", "model", "self", ...) to a class, and
`register_drafter(name, cls)` adds one: a new drafter is one class and one registry line. Each class declares on
itself what the rest of the engine must know of it (`DrafterTraits`: a checkpoint? an MoE target? its footprint
for placement, its step for the profiler); config, planning, profiler and engine ask the class, never the name.

`drafter_class(config)` is the class the config names (every drafter is built as cls(config, weights, slots),
like the workers, so a draft role can build it in its own process); `make_drafter(config, plan, weights)` builds
it, or NoDrafter when the plan does not speculate. A drafter proposes one token per call, for every row of
one batch: the schedule interleaves the k calls of a round with the target's layers (schedule.py); a negative
token means the row proposes nothing more this round (runtime/speculative.py `cut_drafts`: its draft stops there,
and a round stops early once no row has a draft left). Its KV cache
holds a prefix of each row's committed tokens; the coordinator feeds it the rest at the round's first call and
truncates it to what the target accepted after verification.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import torch

from specoffload.planner.plan import Plan
from specoffload.planner.shapes import ModelShape, PartKey, self_draft_shape

from ..errors import ConfigError
from ..kv_blocks import OutOfBlocksError
from ..kv_cache import KVCache
from ..models.config import ModelConfig
from ..models.model import Transformer
from ..rng import generators
from ..sampling import SamplingParams, sample_rows, warp_logits, warp_rows
from .batch_kv import BatchKV
from .wire import wire

if TYPE_CHECKING:
    from ..config import EngineConfig
    from .workers import WeightPlan

Tensor = torch.Tensor


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for the rows of one batch b in {0, 1}; see the module docstring."""

    def reset(self, batch: int, rows: int, capacity: int) -> None: ...
    def drop(self, batch: int) -> None: ...
    def lengths(self, batch: int) -> list[int]: ...
    def truncate(self, batch: int, lengths: Sequence[int]) -> None:
        """Keep at most lengths[r] positions of row r."""
        ...
    def select_rows(self, batch: int, keep: Sequence[int]) -> None: ...
    def reset_rows(self, batch: int, rows: Sequence[int], capacity: int) -> None:
        """Empty these rows for new requests (refill: the other rows keep their state)."""
        ...
    def add_rows(self, batch: int, n: int, capacity: int) -> None:
        """Append n empty rows for new requests (a batch that lost rows to preemption regrows)."""
        ...

    def propose(self, batch: int, ids: Tensor, num_new: Tensor, params: SamplingParams,
                seeds: Sequence[int] | None = None,
                warps: Sequence[Sequence[float]] | None = None) -> tuple[Tensor, Tensor | None]:
        """Feed ids [rows, T] (row r: its first num_new[r] valid) and draw the next token per row: (token [rows],
        probs [rows, vocab] of the warped draft distribution, or None when greedy). seeds: one per row, the
        row's own draw (runtime/rng.py); None: torch's global generator. warps: each row's own (temperature,
        top_p, top_k) instead of params' (runtime/sampling.py `warp_rows`). A token < 0: the row proposes nothing
        more this round. probs None with sampled rows: the drafts are deterministic (a point mass on each token).
        `lengths` is called at the start of every round, before its first `propose`."""
        ...

    def adapt(self, routing_counts: list[list[int]]) -> list[int]:
        """The target's routing since the last call (per layer, tokens per expert; [] for a dense layer): the
        drafter may re-choose what it keeps. Returns [hits, picks, bytes moved, experts moved]."""
        ...


@dataclass(frozen=True)
class DraftFootprint:
    """What planning and placement count of a drafter (runtime/planning.py `ModelPair`)."""

    shape: ModelShape | None  # its parts and KV bytes per token, as placement counts them; None: it never drafts
    top_k: int = 0  # routed experts per token of an MoE drafter (0: dense)
    dtype_bytes: int = 0  # bytes per element of its compute dtype (0: the target's)
    experts: int = 0  # a resident-expert drafter's routed experts per layer (the plan's draft_experts; 0: another)
    pins: frozenset[PartKey] = field(default=frozenset())  # target parts it shares: resident whenever it drafts


class DrafterTraits:
    """What the engine must know of a drafter class before it builds one, declared on the class (the defaults: a
    drafter that proposes, runs offloaded, and holds nothing placement must count). A drafter subclasses it (or
    declares every attribute and class method itself); config, planning, profiler and engine ask these, never the
    drafter's name.

    proposes          False only for NoDrafter: nothing to speculate with (the plan's k is 0)
    needs_checkpoint  config.draft is the checkpoint directory of its model (on the target's vocabulary)
    needs_moe_target  it drafts with the target's routed experts: a dense target is a ConfigError
    offloaded_only    it runs with device_memory set only; False: a resident engine (the same pipeline, nothing
                      streamed) runs it too
    shares_target     in the target's process it drafts with the target's own parts and KV cache (`TargetShare`)
    adapts            its `adapt` re-chooses what it keeps: the pipeline calls it every config.migrate_interval rounds
    model_free        it holds no model and proposes in microseconds (modelfree.py): a backend builds it in the
                      coordinator's process (no draft actor), and one batch drafts between its passes by default
    footprint         (class method) its weights and KV cache as placement counts them
    profile_key       (class method) what the profiled draft step depends on (profiler.py `fingerprint`)
    step_model        (class method) the model one draft step runs, for the profiler to time
    """

    proposes: ClassVar[bool] = True
    needs_checkpoint: ClassVar[bool] = False
    needs_moe_target: ClassVar[bool] = False
    offloaded_only: ClassVar[bool] = True
    shares_target: ClassVar[bool] = False
    adapts: ClassVar[bool] = False
    model_free: ClassVar[bool] = False

    @classmethod
    def footprint(cls, config: EngineConfig, target: Transformer, shares_kv: bool) -> DraftFootprint:
        """Its parts and KV cache as placement counts them. target: the target's executor (headers only, nothing
        loaded); shares_kv: it is built in the target's process (`TargetShare`). Default: no weights, no cache."""
        return DraftFootprint(ModelShape(cls.__name__, (), 0, 0))

    @classmethod
    def profile_key(cls, config: EngineConfig) -> str:
        """What the profiled draft step depends on (a new value re-measures the profile); default: its name."""
        return config.drafter_name

    @classmethod
    def step_model(cls, config: EngineConfig) -> tuple[Transformer, dict[int, Tensor] | None] | None:
        """(model, allowed experts per layer or None) one draft step runs, loaded, for the profiler to time; None:
        nothing to time (the profile assumes a nominal step)."""
        return None


class NoDrafter(DrafterTraits):
    """k = 0: no draft model, one batch, nothing to propose."""

    proposes = False
    offloaded_only = False

    @classmethod
    def footprint(cls, config: EngineConfig, target: Transformer, shares_kv: bool) -> DraftFootprint:
        return DraftFootprint(None)

    @classmethod
    def profile_key(cls, config: EngineConfig) -> str:
        return ""

    def reset(self, batch: int, rows: int, capacity: int) -> None:
        pass

    def drop(self, batch: int) -> None:
        pass

    def lengths(self, batch: int) -> list[int]:
        return []

    def truncate(self, batch: int, lengths: Sequence[int]) -> None:
        pass

    def select_rows(self, batch: int, keep: Sequence[int]) -> None:
        pass

    def reset_rows(self, batch: int, rows: Sequence[int], capacity: int) -> None:
        pass

    def add_rows(self, batch: int, n: int, capacity: int) -> None:
        pass

    def propose(self, batch: int, ids: Tensor, num_new: Tensor, params: SamplingParams,
                seeds: Sequence[int] | None = None,
                warps: Sequence[Sequence[float]] | None = None) -> tuple[Tensor, Tensor | None]:
        raise RuntimeError("NoDrafter was asked to propose: the plan has k = 0 (schedule bug)")

    def adapt(self, routing_counts: list[list[int]]) -> list[int]:
        return [0, 0, 0, 0]


class ModelDrafter(BatchKV, DrafterTraits):
    """An external draft model (same vocabulary as the target), resident, one KV cache per batch."""

    needs_checkpoint = True
    offloaded_only = False

    @classmethod
    def footprint(cls, config: EngineConfig, target: Transformer, shares_kv: bool) -> DraftFootprint:
        return model_footprint(Transformer(config.draft, dtype=config.draft_torch_dtype, device=config.device))

    @classmethod
    def profile_key(cls, config: EngineConfig) -> str:
        return Path(config.draft).name

    @classmethod
    def step_model(cls, config: EngineConfig) -> tuple[Transformer, dict[int, Tensor] | None] | None:
        draft = Transformer(config.draft, dtype=config.draft_torch_dtype, device=config.device)
        draft.preload()
        return draft, None

    def __init__(self, config: EngineConfig | None, weights: WeightPlan | None = None,
                 slots: Sequence[Tensor] | None = None, *, model: Transformer | None = None) -> None:
        """model: an already built draft model (the resident runner's); default: config.draft's."""
        if model is None:
            assert config is not None and config.draft is not None
            model = Transformer(config.draft, dtype=config.draft_torch_dtype, device=config.device)
        self.model = model
        self.model.preload()
        self.caches: dict[int, KVCache] = {}

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        return self.model.new_cache(rows, capacity)

    @wire
    def propose(self, batch: int, ids: Tensor, num_new: Tensor, params: SamplingParams,
                seeds: Sequence[int] | None = None,
                warps: Sequence[Sequence[float]] | None = None) -> tuple[Tensor, Tensor | None]:
        """Feed ids [rows, T] (row r: its first num_new[r] valid) and draw the next token per row.

        Returns (token [rows], probs [rows, vocab] or None when greedy).
        """
        return draft_next(self.model, self.caches[batch], ids, num_new, params, seeds, warps=warps)

    @wire
    def adapt(self, routing_counts: list[list[int]]) -> list[int]:
        """An external draft model keeps nothing of the target's: nothing to re-choose."""
        return [0, 0, 0, 0]


def draft_next(model: Transformer, cache: KVCache, ids: Tensor, num_new: Tensor, params: SamplingParams,
               seeds: Sequence[int] | None = None, allowed_experts: dict[int, Tensor] | None = None,
               warps: Sequence[Sequence[float]] | None = None) -> tuple[Tensor, Tensor | None]:
    """One draft token per row: feed ids [rows, T] (row r: its first num_new[r] valid) through `model` and draw
    from its (warped) distribution at each row's last fed position: (token [rows], probs [rows, vocab] or None
    when greedy). seeds: each row's own draw (runtime/rng.py). allowed_experts: MoE routing restricted to these
    experts per layer.

    Rows that join a batch bring their whole prompt: when padding every row to the longest would waste most of the
    call, those rows' prefixes are fed first on their own (`feed_prefixes`), then every row its last token."""
    with torch.inference_mode():
        num_new = torch.as_tensor(num_new, dtype=torch.long)
        ids, num_new = feed_prefixes(model, cache, ids, num_new, allowed_experts)
        last = (num_new - 1)[:, None]  # [rows, 1]
        logits = model.forward(ids, cache, num_new=num_new, output_positions=last,
                               allowed_experts=allowed_experts)[:, 0]  # [rows, vocab]
        if warps is None and params.greedy:
            return logits.argmax(dim=-1), None  # [rows]
        probs = (warp_rows(logits, warps) if warps is not None  # [rows, vocab]
                 else warp_logits(logits, params.temperature, params.top_p, params.top_k))
        return sample_rows(probs, generators(seeds) if seeds is not None else None), probs


def feed_prefixes(model: Transformer, cache: KVCache, ids: Tensor, num_new: Tensor,
                  allowed_experts: dict[int, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """If right-padding ids [rows, T] would compute more than twice the valid tokens, feed the long rows' tokens
    but their last through `model` alone (a copy of their cache rows, written back), and return what is left:
    (ids [rows, T'], num_new [rows]) with at most the last token of each long row. Same keys and values as one
    padded call (causal attention: padding never reaches a valid position)."""
    rows, width = ids.shape
    valid = int(num_new.sum())
    if rows < 2 or width <= 2 or 2 * valid >= rows * width or not hasattr(cache, "take_rows"):  # (paged: as is)
        return ids, num_new
    long = [n for n in range(rows) if int(num_new[n]) > 1]
    sub = cache.take_rows(long)
    prefix_new = num_new[long] - 1  # [len(long)]
    model.forward(ids[long, : int(prefix_new.max())], sub, num_new=prefix_new, compute_logits=False,
                  allowed_experts=allowed_experts)
    cache.assign_rows(long, sub)
    rest = [[int(t) for t in ids[n, int(num_new[n]) - (1 if n in long else int(num_new[n])): int(num_new[n])]]
            for n in range(rows)]
    ids_out = torch.zeros((rows, max(len(r) for r in rest)), dtype=torch.long)  # [rows, T']
    for n, r in enumerate(rest):
        ids_out[n, : len(r)] = torch.tensor(r, dtype=torch.long)
    return ids_out, torch.tensor([len(r) for r in rest], dtype=torch.long)


class ResidentExpertDrafter(BatchKV, DrafterTraits):
    """The MoE target drafts for itself: its embedding, attention, routers (and shared expert), head, and only
    `n` resident routed experts per layer, chosen by hotness (self-assisted speculative decoding, SpecMoE).

    Routing: the router's logits of non-resident experts are masked before the architecture's own softmax /
    top-k / renormalisation (`layers.route`), so a token whose favourite expert is not resident goes to the
    best-scoring resident one (affinity-based substitution). Verification by the full target keeps the output
    lossless whatever the drafter proposes.

    Sharing (`share`, the local backend: the target's workers in this process): it uses the target's resident
    embedding, attention, routers and head (the same tensors; placement counts only its experts) and drafts into
    the target's own KV cache, so its committed context is the target's exact keys and values and it costs no
    second cache. At each round's start (`lengths`) it takes a scratch view of the batch's target cache (same storage,
    own lengths): its drafted positions are written past the committed ones, where the target's verify pass of
    that batch writes its own keys and values next (the schedule never runs both on one batch at once; the cache
    capacity has room for k + 1 positions). The coordinator's cache calls (reset, drop, truncate, select_rows)
    are then the target's business: here they only drop the view. Without `share` (a drafter role in its own
    process) it loads its own copies of those parts and keeps its own cache per batch, which placement then
    counts (planner/shapes.py `self_draft_shape`).

    Resident set: experts 0..n-1 per layer until the first `adapt`; then, from the target's routing counts
    (decayed by `decay` per call), a layer's set moves to its n hottest experts when that raises the layer's hit
    rate by at least `min_gain` (moving an expert costs its bytes; a small gain is not worth them).
    """

    needs_moe_target = True
    shares_target = True
    adapts = True

    @classmethod
    def footprint(cls, config: EngineConfig, target: Transformer, shares_kv: bool) -> DraftFootprint:
        return resident_expert_footprint(target, resident_expert_count(config, target.config), shares_kv)

    @classmethod
    def profile_key(cls, config: EngineConfig) -> str:
        return f"{config.drafter_name}:{config.resident_experts or 'default'}"

    @classmethod
    def step_model(cls, config: EngineConfig) -> tuple[Transformer, dict[int, Tensor] | None] | None:
        drafter = cls(config)
        return drafter.model, drafter.allowed

    def __init__(self, config: EngineConfig, weights: WeightPlan | None = None, slots: Sequence[Tensor] | None = None,
                 *, share: TargetShare | None = None, decay: float = 0.5, min_gain: float = 0.02) -> None:
        self.target_kv = share.kv if share is not None else None
        self.model = Transformer(config.target, dtype=config.torch_dtype, device=config.device)
        cfg = self.model.config
        self.n = weights.draft_experts if weights is not None and weights.draft_experts else resident_expert_count(
            config, cfg)
        self.decay, self.min_gain = decay, min_gain
        self.moe_layers = [j for j in range(cfg.num_layers) if cfg.is_moe_layer(j)]
        self.resident: dict[int, list[int]] = {j: list(range(self.n)) for j in self.moe_layers}
        keep = [key for key in self.model.loader.parts() if key.kind != "expert" or key.expert < self.n]
        if share is not None:  # the target's own tensors, not copies; the embedding is the attention worker's
            self.model.embedder = share.embed
            missing = [key for key in keep if key.kind not in ("expert", "embedding") and key not in share.parts]
            if missing:
                raise RuntimeError(f"the target streams {missing[:3]}...: a sharing drafter needs them resident")
            self.model.resident.update({key: share.parts[key] for key in keep if key in share.parts
                                        and key.kind != "expert"})
            keep = [key for key in keep if key.kind == "expert"]
        self.model.preload(keep)
        self.model.fetch = self._missing
        self.allowed = {j: self._mask(experts) for j, experts in self.resident.items()}
        self.heat = torch.zeros(cfg.num_layers, max(cfg.num_experts, 1), dtype=torch.float64)  # [L, E]
        self.caches: dict[int, KVCache] = {}

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        return self.model.new_cache(rows, capacity)

    @wire
    def reset_rows(self, batch: int, rows: Sequence[int], capacity: int) -> None:
        """New requests in these rows: empty them in its own cache; drafting into the target's, nothing to do (the
        target's attention worker resets them)."""
        if self.target_kv is None:
            super().reset_rows(batch, rows, capacity)
        else:
            self.caches.pop(batch, None)

    @wire
    def add_rows(self, batch: int, n: int, capacity: int) -> None:
        if self.target_kv is None:
            super().add_rows(batch, n, capacity)
        else:  # the target's attention worker adds them to its cache
            self.caches.pop(batch, None)

    @wire
    def truncate(self, batch: int, lengths: Sequence[int]) -> None:
        if self.target_kv is None:
            super().truncate(batch, lengths)
        else:  # the target's cache is the attention worker's to truncate: only the view goes
            self.caches.pop(batch, None)

    @wire
    def select_rows(self, batch: int, keep: Sequence[int]) -> None:
        if self.target_kv is None:
            super().select_rows(batch, keep)
        else:
            self.caches.pop(batch, None)

    @wire
    def reset(self, batch: int, rows: int, capacity: int) -> None:
        """A new wave of batch `batch`: an empty cache of its own, or (drafting into the target's) nothing yet."""
        if self.target_kv is None:
            self.caches[batch] = self.new_cache(rows, capacity)
        else:
            self.caches.pop(batch, None)

    @wire
    def lengths(self, batch: int) -> list[int]:
        """Committed tokens per row its cache holds; drafting into the target's cache, a fresh scratch view of it
        (called at the start of every draft round)."""
        if self.target_kv is not None:
            self.caches[batch] = self.target_kv[batch].scratch_view()
        return self.caches[batch].lengths.tolist()

    @wire
    def propose(self, batch: int, ids: Tensor, num_new: Tensor, params: SamplingParams,
                seeds: Sequence[int] | None = None,
                warps: Sequence[Sequence[float]] | None = None) -> tuple[Tensor, Tensor | None]:
        """Feed ids [rows, T] and draw the next token per row, routing among the resident experts only. Drafting
        into a paged target KV whose pool has no free block for the draft positions proposes nothing (tokens -1:
        the round ends, its rows verify what they have; runtime/speculative.py `cut_drafts`)."""
        try:
            return draft_next(self.model, self.caches[batch], ids, num_new, params, seeds, self.allowed, warps)
        except OutOfBlocksError:
            return torch.full((ids.shape[0],), -1, dtype=torch.long), None

    @wire
    def adapt(self, routing_counts: list[list[int]]) -> list[int]:
        """Count the target's picks that hit the resident set, then migrate layers whose hottest n experts would
        raise their hit rate by min_gain. Returns [hits, picks, bytes moved, experts moved]."""
        hits = picks = moved_bytes = moved = 0
        for j in self.moe_layers:
            counts = torch.tensor(routing_counts[j], dtype=torch.float64)  # [E]
            hits += int(counts[self.resident[j]].sum())
            picks += int(counts.sum())
            self.heat[j] = self.decay * self.heat[j] + counts
            total = float(self.heat[j].sum())
            if total <= 0:
                continue
            hottest = sorted(torch.topk(self.heat[j], self.n).indices.tolist())
            gain = (float(self.heat[j][hottest].sum()) - float(self.heat[j][self.resident[j]].sum())) / total
            if gain < self.min_gain:
                continue
            added = [e for e in hottest if e not in self.resident[j]]
            for e in self.resident[j]:
                if e not in hottest:
                    del self.model.resident[PartKey("expert", j, e)]
            for e in added:
                key = PartKey("expert", j, e)
                self.model.preload([key])
                moved_bytes += self.model.loader.nbytes(key)
            moved += len(added)
            self.resident[j] = hottest
            self.allowed[j] = self._mask(hottest)
        return [hits, picks, moved_bytes, moved]

    def _mask(self, experts: list[int]) -> Tensor:
        mask = torch.zeros(self.model.config.num_experts, dtype=torch.bool)  # [E]
        mask[experts] = True
        return mask.to(self.model.device)

    def _missing(self, keys: list[PartKey]) -> dict:
        raise RuntimeError(f"the resident-expert drafter was asked for non-resident parts {keys} (routing bug)")


def resident_expert_count(config: EngineConfig, model: ModelConfig) -> int:
    """Routed experts per layer a resident-expert drafter keeps: config.resident_experts, default a quarter."""
    if not model.num_experts:
        raise ConfigError(f"drafter {config.drafter_name!r} needs an MoE target; {config.target} is dense (no routed "
                          "experts)")
    n = config.resident_experts if config.resident_experts is not None else max(1, model.num_experts // 4)
    if n > model.num_experts:
        raise ConfigError(f"resident_experts = {n} but {config.target} has {model.num_experts} experts per layer")
    return n


def model_footprint(draft: Transformer) -> DraftFootprint:
    """An external draft model's footprint, from its executor (headers only): its own parts and KV cache."""
    return DraftFootprint(draft.loader.shape("draft"),
                          top_k=draft.config.num_experts_per_tok if draft.config.num_experts else 0,
                          dtype_bytes=draft.dtype.itemsize)


def resident_expert_footprint(target: Transformer, experts: int, shares_kv: bool) -> DraftFootprint:
    """The target's own resident-expert drafter keeping `experts` routed experts per layer (planner/shapes.py
    `self_draft_shape`); shares_kv (in the target's process): it drafts into the target's KV cache and with the
    target's resident parts, which are then pinned resident."""
    shape = target.loader.shape("target")
    cfg = target.config
    top_k = cfg.num_experts_per_tok if cfg.num_experts else 0
    pins = frozenset(key for key, _ in shape.parts if key.kind in ("attention", "router", "dense_mlp", "head"))
    return DraftFootprint(self_draft_shape(shape, experts, shares_kv=shares_kv), top_k=min(top_k, experts),
                          experts=experts, pins=pins if shares_kv else frozenset())


#: the Drafter methods every registered class implements (the coordinator calls them, locally or over the wire)
DRAFTER_METHODS = ("reset", "drop", "lengths", "truncate", "select_rows", "reset_rows", "propose", "adapt")
#: the class attributes every registered class declares (`DrafterTraits`)
DRAFTER_TRAITS = ("proposes", "needs_checkpoint", "needs_moe_target", "offloaded_only", "shares_target", "adapts",
                  "model_free", "footprint", "profile_key", "step_model")

#: drafter name (EngineConfig.drafter) -> class; add one with `register_drafter`
DRAFTERS: dict[str, type] = {}


def register_drafter(name: str, cls: type) -> type:
    """Make `cls` the drafter EngineConfig(drafter=name) runs; returns cls. It implements `Drafter` and declares
    `DrafterTraits` (subclass it for the defaults). A name already taken by another class is an error."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a drafter's name is a non-empty string, got {name!r}")
    missing = [m for m in DRAFTER_METHODS if not callable(getattr(cls, m, None))]
    missing += [t for t in DRAFTER_TRAITS if not hasattr(cls, t)]
    if missing:
        raise TypeError(f"drafter class {cls.__name__} lacks {', '.join(missing)}: it implements Drafter and "
                        f"subclasses DrafterTraits (runtime/offload/drafters.py)")
    if DRAFTERS.get(name, cls) is not cls:
        raise ValueError(f"drafter name {name!r} is taken by {DRAFTERS[name].__name__}")
    DRAFTERS[name] = cls
    return cls


def drafter_named(name: str) -> type:
    """The registered drafter class `name`; ConfigError naming the registered drafters when there is none."""
    cls = DRAFTERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigError(f"unknown drafter {name!r}: registered drafters are {', '.join(sorted(DRAFTERS))} "
                          f"(add one with register_drafter, runtime/offload/drafters.py)")
    return cls


def drafter_class(config: EngineConfig) -> type:
    """The drafter class the config names (`EngineConfig.drafter_name`)."""
    return drafter_named(config.drafter_name)


@dataclass(frozen=True)
class TargetShare:
    """What the target's workers in this process lend a drafter built from the target itself: the per-batch KV
    caches (the attention worker's), the resident parts (attention's and verifier's), and the embedding."""

    kv: dict[int, KVCache]
    parts: Mapping[PartKey, object]
    embed: Callable[[Tensor], Tensor]


def make_drafter(config: EngineConfig, plan: Plan, weights: WeightPlan, share: TargetShare | None = None) -> Drafter:
    """The drafter the config asks for, or NoDrafter when the plan does not speculate. share: the target's state
    in this process, for a drafter that drafts with it (`shares_target`)."""
    if not plan.drafting:
        return NoDrafter()
    cls = drafter_class(config)
    if cls.shares_target and share is not None:
        return cls(config, weights, share=share)
    return cls(config, weights)


register_drafter("none", NoDrafter)
register_drafter("model", ModelDrafter)
register_drafter("self", ResidentExpertDrafter)
