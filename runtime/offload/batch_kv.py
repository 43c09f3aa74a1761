"""`BatchKV`: the per-batch KV caches of a worker, and the wire methods that manage them, written once.

The coordinator decides (admit, drop, truncate after verification, drop finished rows) and the worker that
computes with a cache owns its memory: the target's attention worker and every drafter with a KV cache of its
own. Batches are named by their index b in {0, 1} (the two interleaved batches; schedule.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kv_blocks import PagedKVCache
from ..kv_cache import KVCache
from .wire import wire


class BatchKV:
    """Mixin: `self.caches[b]` per batch, built by `self.new_cache(rows, capacity)` (the worker's model)."""

    caches: dict[int, KVCache | PagedKVCache]

    def new_cache(self, rows: int, capacity: int) -> KVCache | PagedKVCache:
        raise NotImplementedError

    @wire
    def reset(self, batch: int, rows: int, capacity: int) -> None:
        """An empty cache of `rows` rows and `capacity` positions for batch `batch`."""
        self._release(batch)
        self.caches[batch] = self.new_cache(rows, capacity)

    @wire
    def drop(self, batch: int) -> None:
        self._release(batch)

    def _release(self, batch: int) -> None:
        """Forget batch `batch`'s cache; a paged one first returns its blocks to the pool (a view returns none)."""
        cache = self.caches.pop(batch, None)
        if isinstance(cache, PagedKVCache):
            cache.release()

    @wire
    def lengths(self, batch: int) -> list[int]:
        return self.caches[batch].lengths.tolist()

    @wire
    def advance(self, batch: int, num_new: Sequence[int]) -> None:
        self.caches[batch].advance(torch.tensor(list(num_new), dtype=torch.long))

    @wire
    def truncate(self, batch: int, lengths: Sequence[int]) -> None:
        """Keep at most lengths[r] positions of row r (a row already shorter keeps what it has)."""
        cache = self.caches[batch]
        cache.truncate(torch.minimum(torch.tensor(list(lengths), dtype=torch.long), cache.lengths))

    @wire
    def select_rows(self, batch: int, keep: Sequence[int]) -> None:
        self.caches[batch].select_rows(list(keep))

    @wire
    def add_rows(self, batch: int, n: int, capacity: int) -> None:
        """Append n empty rows to batch `batch` (new requests in a batch that lost rows), with room for `capacity`
        positions per row."""
        cache = self.caches[batch]
        cache.add_rows(n)
        cache.ensure_capacity(capacity)

    @wire
    def reset_rows(self, batch: int, rows: Sequence[int], capacity: int) -> None:
        """Empty rows `rows` of batch `batch` for new requests (their slots are reused: no other row moves), with
        room for `capacity` positions per row."""
        cache = self.caches[batch]
        cache.ensure_capacity(capacity)
        cache.reset_rows(list(rows))
