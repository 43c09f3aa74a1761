"""`SharedKV`: the KV handling of a drafter built from the target itself ("self", "lowbit"), written once.

Such a drafter runs the target's architecture, so in the target's process (`TargetShare`, the local backend) it can
draft into the target's own KV cache: its committed context is the target's exact keys and values, and it costs no
second cache. At each round's start (`lengths`) it takes a scratch view of the batch's target cache (same storage,
own lengths): its drafted positions are written past the committed ones, where the target's verify pass of that
batch writes its own keys and values next (the schedule never runs both on one batch at once; the cache capacity
has room for k + 1 positions), so verification never reads a key or value the drafter wrote. The coordinator's cache
calls (reset, drop, truncate, select_rows, reset_rows, add_rows) are then the target's attention worker's business:
here they only drop the view. Without a share (a drafter role in its own process) it keeps its own cache per batch
(`BatchKV`), which placement then counts.

This module registers no drafter; the drafters that share the target subclass `SharedKV`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...kv_cache import CacheCapacityError, KVCache
from ...models.model import Transformer
from ...sampling import SamplingParams
from ..batch_kv import BatchKV
from ..wire import wire
from .model import draft_next

Tensor = torch.Tensor


class SharedKV(BatchKV):
    """Mixin (module docstring): `self.model` (the target's architecture), `self.target_kv` (the target's caches
    per batch in this process, or None: a cache of its own) and `self.allowed` (experts each MoE layer may route
    to, or None: all)."""

    model: Transformer
    target_kv: dict[int, KVCache] | None
    allowed: dict[int, Tensor] | None

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
        """Feed ids [rows, T] and draw the next token per row (routing among `allowed` experts). Drafting into the
        target's KV where it cannot hold the draft positions (a paged pool with no free block, or a cache at its
        fixed capacity; nothing is written then) proposes nothing (tokens -1: the round ends, its rows verify what
        they have; runtime/speculative.py `cut_drafts`)."""
        try:
            return draft_next(self.model, self.caches[batch], ids, num_new, params, seeds, self.allowed, warps)
        except CacheCapacityError:  # (OutOfBlocksError included)
            return torch.full((ids.shape[0],), -1, dtype=torch.long), None
