"""The "model" drafter: an external draft model on the target's vocabulary, resident where compute runs, with one
KV cache per batch (`ModelDrafter`); `draft_next`, one draft token per row, is the step every model-based
drafter takes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...kv_cache import KVCache
from ...models.model import Transformer
from ...rng import generators
from ...sampling import SamplingParams, sample_rows, warp_logits, warp_rows
from ..batch_kv import BatchKV
from ..wire import wire
from . import DrafterTraits, DraftFootprint, register_drafter

if TYPE_CHECKING:
    from ...config import EngineConfig
    from ..workers import WeightPlan

Tensor = torch.Tensor


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

    def __init__(self, config: EngineConfig, weights: WeightPlan | None = None,
                 slots: Sequence[Tensor] | None = None) -> None:
        assert config.draft is not None
        self.model = Transformer(config.draft, dtype=config.draft_torch_dtype, device=config.device)
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


def model_footprint(draft: Transformer) -> DraftFootprint:
    """An external draft model's footprint, from its executor (headers only): its own parts and KV cache."""
    return DraftFootprint(draft.loader.shape("draft"),
                          top_k=draft.config.num_experts_per_tok if draft.config.num_experts else 0,
                          dtype_bytes=draft.dtype.itemsize)


register_drafter("model", ModelDrafter)
