"""Drafters: who proposes the draft tokens the target verifies. One small interface; a new drafter is a new class.

    Drafter      the interface (a Protocol): per-batch state managed by the coordinator, and `propose`
    NoDrafter    no speculation (k = 0): holds nothing, is never asked to propose
    ModelDrafter an external draft model on the target's vocabulary, resident where compute happens

`drafter_class(config)` is the class the config names (every drafter is built as cls(config, weights, slots),
like the workers, so a draft role can build it in its own process); `make_drafter(config, plan, weights)` builds
it, or NoDrafter when the plan does not speculate. A drafter proposes one token per call, for every row of
one batch: the schedule interleaves the k calls of a round with the target's layers (schedule.py). Its KV cache
holds a prefix of each row's committed tokens; the coordinator feeds it the rest at the round's first call and
truncates it to what the target accepted after verification.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from specoffload.planner.plan import Plan

from ..config import EngineConfig
from ..kv_cache import KVCache
from ..models.model import Transformer
from ..sampling import SamplingParams, warp_logits
from .batch_kv import BatchKV
from .wire import wire

if TYPE_CHECKING:
    from .workers import WeightPlan

Tensor = torch.Tensor


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for the rows of one batch b in {0, 1}; see the module docstring."""

    def reset(self, batch: int, rows: int, capacity: int) -> None: ...
    def seed(self, batch: int, seed: int | None) -> None: ...
    def drop(self, batch: int) -> None: ...
    def lengths(self, batch: int) -> list[int]: ...
    def truncate(self, batch: int, lengths: Sequence[int]) -> None: ...
    def select_rows(self, batch: int, keep: Sequence[int]) -> None: ...

    def propose(self, batch: int, ids: Tensor, num_new: Tensor,
                params: SamplingParams) -> tuple[Tensor, Tensor | None]:
        """Feed ids [rows, T] (row r: its first num_new[r] valid) and draw the next token per row: (token [rows],
        probs [rows, vocab] of the warped draft distribution, or None when greedy)."""
        ...


class BatchRNG:
    """Mixin: one seeded generator per batch (`self.generators[b]`), for workers that sample."""

    generators: dict[int, torch.Generator]

    @wire
    def seed(self, batch: int, seed: int | None) -> None:
        """Seed batch `batch`'s generator (None: draw from torch's global generator)."""
        self.generators.pop(batch, None)
        if seed is not None:
            self.generators[batch] = torch.Generator().manual_seed(seed)


class NoDrafter:
    """k = 0: no draft model, one batch, nothing to propose."""

    def reset(self, batch: int, rows: int, capacity: int) -> None:
        pass

    def seed(self, batch: int, seed: int | None) -> None:
        pass

    def drop(self, batch: int) -> None:
        pass

    def lengths(self, batch: int) -> list[int]:
        return []

    def truncate(self, batch: int, lengths: Sequence[int]) -> None:
        pass

    def select_rows(self, batch: int, keep: Sequence[int]) -> None:
        pass

    def propose(self, batch: int, ids: Tensor, num_new: Tensor,
                params: SamplingParams) -> tuple[Tensor, Tensor | None]:
        raise RuntimeError("NoDrafter was asked to propose: the plan has k = 0 (schedule bug)")


class ModelDrafter(BatchKV, BatchRNG):
    """An external draft model (same vocabulary as the target), resident, one KV cache per batch."""

    def __init__(self, config: EngineConfig, weights: WeightPlan | None = None,
                 slots: Sequence[Tensor] | None = None) -> None:
        assert config.draft is not None
        self.model = Transformer(config.draft, dtype=config.torch_dtype, device=config.device)
        self.model.preload()
        self.caches: dict[int, KVCache] = {}
        self.generators: dict[int, torch.Generator] = {}

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        return self.model.new_cache(rows, capacity)

    @wire
    def propose(self, batch: int, ids: Tensor, num_new: Tensor,
                params: SamplingParams) -> tuple[Tensor, Tensor | None]:
        """Feed ids [rows, T] (row r: its first num_new[r] valid) and draw the next token per row.

        Returns (token [rows], probs [rows, vocab] or None when greedy).
        """
        with torch.inference_mode():
            last = (num_new - 1)[:, None]  # [rows, 1]
            logits = self.model.forward(ids, self.caches[batch], num_new=num_new, output_positions=last)[:, 0]
            if params.greedy:
                return logits.argmax(dim=-1), None  # [rows]
            probs = warp_logits(logits, params.temperature, params.top_p, params.top_k)  # [rows, vocab]
            return torch.multinomial(probs, 1, generator=self.generators.get(batch)).squeeze(1), probs


def drafter_class(config: EngineConfig) -> type:
    """The drafter `config.draft` names: a checkpoint directory is an external draft model; none, NoDrafter."""
    return NoDrafter if config.draft is None else ModelDrafter


def make_drafter(config: EngineConfig, plan: Plan, weights: WeightPlan) -> Drafter:
    """The drafter the config asks for, or NoDrafter when the plan does not speculate."""
    return drafter_class(config)(config, weights) if plan.drafting else NoDrafter()
