"""`KVCache`: per-row key/value storage for a batch of sequences, all layers in two tensors.

Index convention: `k[layer, row, kv_head, position, dim]`. Row b holds `lengths[b]` valid positions
0..lengths[b]-1. A write of T new positions goes to lengths[b] .. lengths[b]+T-1 and does *not* change
`lengths`; the caller then calls `advance` with how many of them are valid (right-padded rows advance by
less, and their padded writes are simply overwritten later). Positions >= lengths[b] are never read as
valid data: the attention mask hides them.

Capacity: a write that would pass `capacity` grows the storage by reallocation (to at least 1.5x, rounded up
to a multiple of 16) when `growable`, else raises `CacheCapacityError`. `lengths` lives on the CPU, so all
capacity checks are host-side and never synchronise with the device.
"""

from __future__ import annotations

import torch

from specoffload.planner.errors import SpecOffloadError


class CacheCapacityError(SpecOffloadError):
    """A write would go past the capacity of a non-growable cache."""


class KVCache:
    """Batched KV cache. See the module docstring for the position and capacity conventions."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        growable: bool = True,
    ) -> None:
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.growable = growable
        self.k = self._alloc(capacity)  # [layers, batch, kv_heads, capacity, head_dim]
        self.v = self._alloc(capacity)  # [layers, batch, kv_heads, capacity, head_dim]
        self._lengths = torch.zeros(batch_size, dtype=torch.long)  # [batch], CPU
        self._device_lengths: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def lengths(self) -> torch.Tensor:
        """Valid positions per row, LongTensor [batch] on the CPU. Read-only: mutate via the methods."""
        return self._lengths

    def device_lengths(self) -> torch.Tensor:
        """`lengths` on the cache's device (memoised until the lengths change)."""
        if self._device_lengths is None:
            self._device_lengths = self._lengths.to(self.device)
        return self._device_lengths

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store k_new, v_new [batch, kv_heads, T, head_dim] at positions lengths[b] + t, t in 0..T-1."""
        batch, _, steps, _ = k_new.shape
        if batch != self.batch_size or k_new.shape != v_new.shape:
            raise ValueError(f"k/v of shapes {tuple(k_new.shape)}, {tuple(v_new.shape)} for batch {self.batch_size}")
        self.ensure_capacity(int(self._lengths.max()) + steps)
        steps_range = torch.arange(steps, device=self.device)  # [T]
        positions = self.device_lengths()[:, None] + steps_range  # [batch, T]
        rows = torch.arange(batch, device=self.device)[:, None]  # [batch, 1]
        with torch.inference_mode():
            # advanced indices (rows, positions) broadcast to [batch, T]; the slices add [kv_heads, head_dim]
            self.k[layer, rows, :, positions] = k_new.permute(0, 2, 1, 3).to(self.dtype)  # [batch, T, kv, dim]
            self.v[layer, rows, :, positions] = v_new.permute(0, 2, 1, 3).to(self.dtype)

    def keys_values(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of positions 0..upto-1 of every row: ([batch, kv_heads, upto, head_dim],) * 2."""
        return self.k[layer, :, :, :upto], self.v[layer, :, :, :upto]

    def advance(self, num_new: torch.Tensor | int) -> None:
        """Mark `num_new[b]` more positions of each row valid (they must have been written)."""
        num_new = self._per_row(num_new)
        if bool((num_new < 0).any()):
            raise ValueError(f"advance by negative counts {num_new.tolist()}")
        new_lengths = self._lengths + num_new
        if int(new_lengths.max()) > self.capacity:
            raise CacheCapacityError(f"advance to lengths {new_lengths.tolist()} past capacity {self.capacity}")
        self._set_lengths(new_lengths)

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Shorten rows to `new_lengths[b]` <= lengths[b] (e.g. drop rejected speculative tokens)."""
        new_lengths = self._per_row(new_lengths)
        if bool((new_lengths > self._lengths).any()) or bool((new_lengths < 0).any()):
            raise ValueError(f"truncate to {new_lengths.tolist()} from lengths {self._lengths.tolist()}")
        self._set_lengths(new_lengths)

    def reset_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Empty the given rows (length 0), e.g. to put a new request in a finished request's slot."""
        new_lengths = self._lengths.clone()
        new_lengths[torch.as_tensor(rows, dtype=torch.long)] = 0
        self._set_lengths(new_lengths)

    def add_rows(self, n: int) -> None:
        """Append `n` empty rows (length 0) at the current capacity, e.g. to regrow a batch that lost rows."""
        if n < 0:
            raise ValueError(f"add_rows: n = {n} < 0")
        with torch.inference_mode():
            extra = torch.zeros((self.num_layers, n, *self.k.shape[2:]), dtype=self.dtype, device=self.device)
            self.k = torch.cat([self.k, extra], dim=1)  # [layers, batch + n, kv_heads, capacity, head_dim]
            self.v = torch.cat([self.v, extra], dim=1)
        self.batch_size += n
        self._set_lengths(torch.cat([self._lengths, torch.zeros(n, dtype=torch.long)]))

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order (the batch shrinks to len(rows)), e.g. when requests finish."""
        index = torch.as_tensor(rows, dtype=torch.long)
        device_index = index.to(self.device)
        with torch.inference_mode():
            self.k = self.k.index_select(1, device_index)  # [layers, len(rows), kv_heads, capacity, head_dim]
            self.v = self.v.index_select(1, device_index)
        self.batch_size = len(rows)
        self._set_lengths(self._lengths[index])

    def take_rows(self, rows: list[int]) -> KVCache:
        """A new cache holding a copy of `rows` of this one (contents and lengths), e.g. to feed some rows alone."""
        out = KVCache.__new__(KVCache)
        out.__dict__.update(self.__dict__)
        index = torch.as_tensor(rows, dtype=torch.long)
        device_index = index.to(self.device)
        used = int(self._lengths[index].max()) if len(rows) else 0
        with torch.inference_mode():
            out.k = self.k[:, :, :, :used].index_select(1, device_index)  # [layers, len(rows), kv, used, dim]
            out.v = self.v[:, :, :, :used].index_select(1, device_index)
        out.batch_size, out.growable = len(rows), True
        out._set_lengths(self._lengths[index])
        return out

    def assign_rows(self, rows: list[int], source: KVCache) -> None:
        """Copy row i of `source` (contents and length) into row rows[i] of this cache, e.g. after a prefill."""
        if (source.num_layers, source.num_kv_heads, source.head_dim) != (
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
        ):
            raise ValueError("assign_rows: caches of different layer/head geometry")
        if source.batch_size != len(rows):
            raise ValueError(f"assign_rows: {len(rows)} rows but the source cache has {source.batch_size}")
        used = int(source.lengths.max()) if len(rows) else 0
        self.ensure_capacity(used)
        index = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self.k[:, index, :, :used] = source.k[:, :, :, :used].to(self.device, self.dtype)
            self.v[:, index, :, :used] = source.v[:, :, :, :used].to(self.device, self.dtype)
        new_lengths = self._lengths.clone()
        new_lengths[torch.as_tensor(rows, dtype=torch.long)] = source.lengths
        self._set_lengths(new_lengths)

    def ensure_capacity(self, needed: int) -> None:
        """Grow the storage to hold `needed` positions per row (or raise if not growable)."""
        if needed <= self.capacity:
            return
        if not self.growable:
            raise CacheCapacityError(f"{needed} positions needed; the KV cache holds {self.capacity}")
        new_capacity = max(needed, -(-self.capacity * 3 // 2))
        new_capacity = -(-new_capacity // 16) * 16
        with torch.inference_mode():
            k, v = self._alloc(new_capacity), self._alloc(new_capacity)
            k[:, :, :, : self.capacity] = self.k
            v[:, :, :, : self.capacity] = self.v
        self.k, self.v = k, v

    def scratch_view(self) -> KVCache:
        """A cache over the same storage with its own copy of `lengths` and no growth: writes past this cache's
        valid positions land in the shared storage where the owner will write its own keys and values later
        (a drafter drafting into the target's cache, see runtime/offload/drafters.py). Allocates nothing."""
        view = KVCache.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.growable = False
        view._set_lengths(self._lengths)
        return view

    def nbytes(self) -> int:
        """Bytes of allocated storage (keys and values)."""
        return 2 * self.k.numel() * self.k.element_size()

    def used_bytes(self) -> int:
        """Bytes of valid positions (keys and values)."""
        per_position = self.num_layers * self.num_kv_heads * self.head_dim * self.k.element_size()
        return 2 * per_position * int(self._lengths.sum())

    def _alloc(self, capacity: int) -> torch.Tensor:
        shape = (self.num_layers, self.batch_size, self.num_kv_heads, capacity, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _per_row(self, value: torch.Tensor | int) -> torch.Tensor:
        out = torch.as_tensor(value, dtype=torch.long).cpu().expand(self.batch_size).clone()  # [batch]
        return out

    def _set_lengths(self, new_lengths: torch.Tensor) -> None:
        self._lengths = new_lengths.to(dtype=torch.long, device="cpu").clone()
        self._device_lengths = None
