"""The "self" drafter: the MoE target drafts for itself with only its resident routed experts (SpecMoE)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specoffload.planner.shapes import PartKey, self_draft_shape

from ...errors import ConfigError
from ...kv_cache import KVCache
from ...models.config import ModelConfig
from ...models.model import Transformer
from ..wire import wire
from . import DrafterTraits, DraftFootprint, TargetShare, option, register_drafter
from .shared_kv import SharedKV

if TYPE_CHECKING:
    from ...config import EngineConfig
    from ..workers import WeightPlan

Tensor = torch.Tensor


@dataclass(frozen=True)
class ResidentExpertOptions:
    """The "self" drafter's settings."""

    resident_experts: int | None = option(None, "routed experts per MoE layer the drafter keeps resident (>= 1, at "
                                                "most the layer's experts; default: a quarter of them, at least 1)")
    migrate_interval: int = option(8, "re-choose the resident experts every this many verify rounds, from the "
                                      "target's routing meanwhile, when the gain in hit rate is worth the bytes "
                                      "(0: never)")

    def __post_init__(self) -> None:
        n = self.resident_experts
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"resident_experts must be an integer >= 1, got {n!r}")
        m = self.migrate_interval
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ConfigError(f"migrate_interval must be an integer >= 0, got {m!r}")


class ResidentExpertDrafter(SharedKV, DrafterTraits):
    """The MoE target drafts for itself: its embedding, attention, routers (and shared expert), head, and only
    `n` resident routed experts per layer, chosen by hotness (self-assisted speculative decoding, SpecMoE).

    Routing: the router's logits of non-resident experts are masked before the architecture's own softmax /
    top-k / renormalisation (`layers.route`), so a token whose favourite expert is not resident goes to the
    best-scoring resident one (affinity-based substitution). Verification by the full target keeps the output
    lossless whatever the drafter proposes.

    Sharing (`share`, the local backend: the target's workers in this process): it uses the target's resident
    embedding, attention, routers and head (the same tensors; placement counts only its experts) and drafts into
    the target's own KV cache (shared_kv.py `SharedKV`). Without `share` (a drafter role in its own process) it loads
    its own copies of those parts and keeps its own cache per batch, which placement then counts (planner/shapes.py
    `self_draft_shape`).

    Resident set: experts 0..n-1 per layer until the first `adapt`; then, from the target's routing counts
    (decayed by `decay` per call), a layer's set moves to its n hottest experts when that raises the layer's hit
    rate by at least `min_gain` (moving an expert costs its bytes; a small gain is not worth them).
    """

    needs_moe_target = True
    shares_target = True
    options = ResidentExpertOptions

    @classmethod
    def adapt_interval(cls, config: EngineConfig) -> int:
        return cls.settings(config).migrate_interval

    @classmethod
    def footprint(cls, config: EngineConfig, target: Transformer, shares_kv: bool) -> DraftFootprint:
        return resident_expert_footprint(target, resident_expert_count(config, target.config), shares_kv)

    @classmethod
    def profile_key(cls, config: EngineConfig) -> str:
        return f"{config.drafter_name}:{cls.settings(config).resident_experts or 'default'}"

    @classmethod
    def step_model(cls, config: EngineConfig) -> tuple[Transformer, dict[int, Tensor] | None] | None:
        drafter = cls(config)
        return drafter.model, drafter.allowed

    def __init__(self, config: EngineConfig, weights: WeightPlan | None = None, slots: Sequence[Tensor] | None = None,
                 *, share: TargetShare | None = None, decay: float = 0.5, min_gain: float = 0.02) -> None:
        self.target_kv = share.kv if share is not None else None
        self.model = Transformer(config.target, dtype=config.torch_dtype, device=config.device,
                                 packed=config.packed_resident)
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
    n = ResidentExpertDrafter.settings(config).resident_experts or max(1, model.num_experts // 4)
    if n > model.num_experts:
        raise ConfigError(f"resident_experts = {n} but {config.target} has {model.num_experts} experts per layer")
    return n


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


register_drafter("self", ResidentExpertDrafter)
